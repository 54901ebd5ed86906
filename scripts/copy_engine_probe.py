"""How long a small copy on one stream waits behind a large copy in the same direction on another stream,
whether issuing the large one in chunks bounds that wait, whether the other stream matters, and what a
copy kernel reaches instead (the host tier's suspend and resume are such large copies; an engine's
per-step copies are such small ones).

    PYTHONPATH=. python scripts/copy_engine_probe.py [MiB]       (default 4608: a 128k GPT-OSS-120B request)

For each direction and chunk size: the large copy (one memcpyAsync per chunk) on stream A, then eight
4 KB memcpyAsync in the same direction on stream B, each waited for; prints the wall time of each small
copy and the large copy's bandwidth (events around it on A).
"""
import sys
import time

import cupy
import numpy as np
from cupy.cuda import runtime

MEMCPY_DEFAULT = 4          # cudaMemcpyDefault: the direction inferred from the pointers (as the backend copies)


def buffers(nbytes: int):
    """A pinned and a device buffer of nbytes, a 4 KB pair, and per direction (memcpy kind, large copy's
    destination and source, small copy's destination and source): the buffers come first, to keep alive."""
    host, dev = cupy.cuda.alloc_pinned_memory(nbytes), cupy.empty(nbytes, np.uint8)
    small_host, small_dev = cupy.cuda.alloc_pinned_memory(4096), cupy.empty(4096, np.uint8)
    hp, dp, shp, sdp = host.ptr, dev.data.ptr, small_host.ptr, small_dev.data.ptr
    kinds = {"H2D": (runtime.memcpyHostToDevice, dp, hp, sdp, shp),
             "D2H": (runtime.memcpyDeviceToHost, hp, dp, shp, sdp)}
    return (host, dev, small_host, small_dev), kinds


def main():
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 4608
    nbytes = mib << 20
    keep, kinds = buffers(nbytes)
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    for direction, (kind, dst, src, sdst, ssrc) in kinds.items():
        for chunk_mib, big_kind, into_big in ((0, kind, False), (0, MEMCPY_DEFAULT, False), (0, MEMCPY_DEFAULT, True),
                                              (256, kind, False), (64, kind, False), (16, kind, False), (4, kind, False)):
            chunk = nbytes if chunk_mib == 0 else chunk_mib << 20
            a.synchronize()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(a)
            t0 = time.perf_counter()
            for off in range(0, nbytes, chunk):
                runtime.memcpyAsync(dst + off, src + off, min(chunk, nbytes - off), big_kind, a.ptr)
            enqueue_us = (time.perf_counter() - t0) * 1e6
            e1.record(a)
            waits = []
            for _ in range(8):
                t = time.perf_counter()
                # into_big: the small copy's device side inside the large copy's device buffer
                runtime.memcpyAsync(dst if into_big and direction == "H2D" else sdst,
                                    src if into_big and direction == "D2H" else ssrc, 4096, kind, b.ptr)
                b.synchronize()
                waits.append((time.perf_counter() - t) * 1e3)
            e1.synchronize()
            ms = cupy.cuda.get_elapsed_time(e0, e1)
            label = ("one copy" if chunk_mib == 0 else f"chunks of {chunk_mib} MiB") + (
                ", kind default" if big_kind == MEMCPY_DEFAULT else "") + (", small in big" if into_big else "")
            print(f"{direction} {mib} MiB, {label:38s}: enqueue {enqueue_us:8.1f} us, {nbytes / ms / 1e6:5.1f} GB/s | "
                  f"4 KB {direction} on another stream, wall ms: {' '.join(f'{w:.3f}' for w in waits)}")


def streams_and_kernel():
    """A 2 GiB copy: a 4 KB copy on each of several other streams (six fresh ones, a high-priority one,
    the null stream), each direction; then a copy kernel (SMs reading or writing mapped pinned memory, no
    copy engine) of the same bytes at several grid sizes, with a 4 KB memcpy on another stream meanwhile."""
    MIB = 2048
    nbytes = MIB << 20
    (host, dev, sh, sd), kinds = buffers(nbytes)
    hp, dp = host.ptr, dev.data.ptr
    big = cupy.cuda.Stream(non_blocking=True)
    hi = -5          # CUDA clamps a priority to its range; lower is higher (greatest -5 on current GPUs)
    others = [("stream %d" % i, cupy.cuda.Stream(non_blocking=True)) for i in range(6)]
    others.append(("high priority", cupy.cuda.Stream(non_blocking=True, priority=hi)))
    others.append(("null stream", cupy.cuda.Stream.null))
    for direction, (kind, dst, src, sdst, ssrc) in kinds.items():
        for name, s in others:
            big.synchronize()
            runtime.memcpyAsync(dst, src, nbytes, kind, big.ptr)
            t = time.perf_counter()
            runtime.memcpyAsync(sdst, ssrc, 4096, kind, s.ptr)
            call = (time.perf_counter() - t) * 1e3
            s.synchronize()
            wall = (time.perf_counter() - t) * 1e3
            busy = not big.done
            big.synchronize()
            print(f"{direction}: big {MIB} MiB on one stream; 4 KB on {name:14s}: call {call:.3f} ms, done after "
                  f"{wall:8.3f} ms (big copy still running then: {busy})")
    
    src_code = r'''
    extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
            dst[i] = src[i];
    }'''
    k = cupy.RawKernel(src_code, "copy16")
    n16 = np.int64(nbytes // 16)
    ks = cupy.cuda.Stream(non_blocking=True)
    other = cupy.cuda.Stream(non_blocking=True)
    for direction, (s_ptr, d_ptr) in (("H2D", (hp, dp)), ("D2H", (dp, hp))):
        for blocks in (8, 16, 32, 64, 132):
            with ks:
                k((blocks,), (512,), (np.uint64(s_ptr), np.uint64(d_ptr), n16))
            ks.synchronize()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(ks)
            with ks:
                k((blocks,), (512,), (np.uint64(s_ptr), np.uint64(d_ptr), n16))
            e1.record(ks)
            kind, _, _, sdst, ssrc = kinds[direction]
            t = time.perf_counter()
            runtime.memcpyAsync(sdst, ssrc, 4096, kind, other.ptr)
            other.synchronize()
            wait = (time.perf_counter() - t) * 1e3
            e1.synchronize()
            ms = cupy.cuda.get_elapsed_time(e0, e1)
            print(f"copy kernel {direction}, {blocks:3d} blocks x 512: {nbytes / ms / 1e6:5.1f} GB/s ({ms:.1f} ms); "
                  f"a 4 KB {direction} memcpy on another stream meanwhile: {wait:.3f} ms")
    assert (cupy.asnumpy(dev[:1 << 20]) == np.frombuffer(host, np.uint8, 1 << 20)).all()
    print("copy kernel: bytes match")


if __name__ == "__main__":
    main()
    streams_and_kernel()
