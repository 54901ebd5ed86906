"""How a kernel's first reads of a step's snapshot cost: from pinned host memory over the bus, from
device memory, or from the launch's own parameters (a by-value __grid_constant__ struct the driver copies
when the launch is enqueued). Prints medians of the GPU time between events around one launch (the stream
held by the CUDA backend's gate while the host enqueues, so the host's launch call is not in it), and of
the host time of the launch call.

    python scripts/snapshot_probe.py [reps]
"""
import ctypes
import sys
import time

import cupy
import numpy as np
from cupy.cuda import driver

# the step's pattern: the header, then words at offsets the header gives, then a write
USE = r"""
__device__ __forceinline__ void use(const int* s, int* out)
{
    const int n = s[0];
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = s[s[1] + i];
}
"""

SRC = USE + r"""
template <int W> struct Snap { int w[W]; };

extern "C" __global__ void k_empty(const int* s, int* out) { if (threadIdx.x == 0) out[0] = 1; }
extern "C" __global__ void k_ptr(const int* s, int* out) { use(s, out); }
extern "C" __global__ void k_copy(const int* s, int* twin, int words, int* out)
{
    for (int i = threadIdx.x; i < words; i += blockDim.x)
        twin[i] = s[i];
    __syncthreads();
    use(twin, out);
}
extern "C" __global__ void k_param1k(const __grid_constant__ Snap<960> s, int* out) { use(s.w, out); }
extern "C" __global__ void k_param8k(const __grid_constant__ Snap<8000> s, int* out) { use(s.w, out); }
"""


def pinned_snapshot(words: int):
    """(pinned memory, its int32 view) of `words` words holding 0, 1, ...; the header says: the 64 words at
    offset 16 (what `use` reads)."""
    host = cupy.cuda.alloc_pinned_memory(words * 4)
    snap = np.frombuffer(host, np.int32, words)
    snap[:] = np.arange(words)
    snap[0], snap[1] = 64, 16
    return host, snap


def main(reps: int = 400) -> None:
    from cupykv.backends.cuda import CudaBackend
    be = CudaBackend()
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",))
    stream = be.stream
    words = 8000
    host, snap = pinned_snapshot(words)
    dev = cupy.asarray(snap)
    twin = cupy.empty(words, np.int32)
    out = cupy.zeros(words, np.int32)
    hp = ctypes.c_uint64(host.ptr)
    cases = {
        "empty kernel": ("k_empty", [ctypes.c_uint64(dev.data.ptr), ctypes.c_uint64(out.data.ptr)]),
        "header + 64 words, device memory": ("k_ptr", [ctypes.c_uint64(dev.data.ptr), ctypes.c_uint64(out.data.ptr)]),
        "header + 64 words, pinned host": ("k_ptr", [hp, ctypes.c_uint64(out.data.ptr)]),
        "copy 256 words from pinned, then use": ("k_copy", [hp, ctypes.c_uint64(twin.data.ptr), ctypes.c_int32(256),
                                                             ctypes.c_uint64(out.data.ptr)]),
        "copy 2048 words from pinned, then use": ("k_copy", [hp, ctypes.c_uint64(twin.data.ptr), ctypes.c_int32(2048),
                                                              ctypes.c_uint64(out.data.ptr)]),
        "parameters, 3.8 KB": ("k_param1k", [None, ctypes.c_uint64(out.data.ptr)]),
        "parameters, 32 KB": ("k_param8k", [None, ctypes.c_uint64(out.data.ptr)]),
    }
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    print(f"{'case':40s} {'device us':>10s} {'launch call us':>15s}")
    for name, (kname, cells) in cases.items():
        fn = mod.get_function(kname).kernel.ptr
        ptrs = [host.ptr if c is None else ctypes.addressof(c) for c in cells]    # params read from the slot
        params = (ctypes.c_void_p * len(ptrs))(*ptrs)
        dt, ht = [], []
        # loaded and run once before any gate: loading a kernel waits for the held stream
        driver.launchKernel(fn, 1, 1, 1, 256, 1, 1, 0, stream.ptr, ctypes.addressof(params), 0)
        stream.synchronize()
        for _ in range(reps):
            gate = be.gate(stream)
            e0.record(stream)
            t = time.perf_counter()
            driver.launchKernel(fn, 1, 1, 1, 256, 1, 1, 0, stream.ptr, ctypes.addressof(params), 0)
            ht.append(time.perf_counter() - t)
            e1.record(stream)
            gate.open()
            e1.synchronize()
            dt.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
        assert int(out[5]) == 16 + 5 or kname == "k_empty", (name, int(out[5]))
        out.fill(0)
        skip = min(20, reps // 2)        # the first launches warm the caches
        print(f"{name:40s} {np.median(dt[skip:]):10.2f} {np.median(ht[skip:]) * 1e6:15.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
