"""Decode steps of other requests during a suspend and a resume, with the host tier's copies made by the
CUDA backend's copy_runs (to the host by cupykv_copy_runs, at each --grids size; back by memcpys) and,
side by side in the same process, by one memcpyAsync per run both ways. The host-tier benchmark's rig
(GPT-OSS-120B shape, a 128k request, 32 requests of 4k decoding); each step: prepare_batch, a token per
request up, the stand-in attention, a token per request back (an engine's copies), finish, the host's
wait, settle.

    PYTHONPATH=. python scripts/host_tier_overlap.py [--prompt N] [--steps N] [--grids 8x512,4x256,...]

(--grids: the copy kernel's blocks x threads per block, at most kernels.TIER_COPY_THREADS threads.)
Prints per case the step walls (the first, the median, the mean while the copy ran), the tier copy's
device time, the step after which it had completed, and the host time of the suspend / resume call.
"""
import sys
import time

import cupy
import numpy as np
from cupy.cuda import runtime

from cupykv.backends import cuda as cuda_backend
from cupykv.bench.host_tier_bench import HostTierSettings, _Decoder, _Rig
from cupykv.bench.prefix_trace import _prefill
from cupykv.bench.workload import SHAPES
from cupykv.layout import cdiv


def memcpy_runs(self, dst, src, runs, unit_bytes, stream):
    """copy_runs as one memcpyAsync per run (a copy engine)."""
    dst_ptr, src_ptr = cuda_backend._address(dst), cuda_backend._address(src)
    for d0, s0, n in runs:
        runtime.memcpyAsync(dst_ptr + d0 * unit_bytes, src_ptr + s0 * unit_bytes, n * unit_bytes,
                            cuda_backend.MEMCPY_DEFAULT, stream.ptr)


def option(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main():
    prompt, n = option("--prompt", 131072), option("--steps", 60)
    s = HostTierSettings(prompt=prompt, backend="cuda", frag_run=0, whole=False)
    tpb, blocks = s.tpb, cdiv(prompt, s.tpb)
    swa_keep = cdiv(128, tpb) + 2
    bg_len = s.bg_ctx + 8 * n + 64
    max_batch = s.bg_requests + 4
    rig = _Rig(SHAPES["gpt-oss-120b"].windows, SHAPES["gpt-oss-120b"], s,
               cdiv(max(prompt, bg_len) + 2 * tpb, tpb) * tpb, max_batch,
               blocks + s.bg_requests * cdiv(bg_len, tpb) + 256,
               swa_keep * (max_batch + 2) + 2 * cdiv(s.chunk + max_batch, tpb) + 256, blocks + 8, swa_keep + 8, [])
    mgr, st, tier = rig.mgr, rig.storage, rig.tier
    mgr.add("A", prompt)
    _prefill(mgr, {"A": prompt}, s.chunk)
    bg = [f"bg{i}" for i in range(s.bg_requests)]
    for rid in bg:
        mgr.add(rid, s.bg_ctx)
    _prefill(mgr, {rid: s.bg_ctx for rid in bg}, s.chunk)
    dec = _Decoder(rig, bg)
    kernel_runs = cuda_backend.CudaBackend.copy_runs
    grids = [tuple(map(int, g.split("x"))) for g in option("--grids", "8x512").split(",")]
    cases = [(f"kernel {b}x{t}", kernel_runs, b, t) for b, t in grids] + [("memcpy", memcpy_runs, 0, 0)]
    for copies, impl, blocks, threads in cases * 2:
        cuda_backend.CudaBackend.copy_runs = impl
        cuda_backend.TIER_COPY_BLOCKS, cuda_backend.TIER_COPY_THREADS = blocks, threads
        for label in ("alone", "suspend", "resume"):
            want_suspended = label == "resume"
            if mgr.request("A").suspended != want_suspended:
                (st.resume if mgr.request("A").suspended else st.suspend)("A")
            mgr.synchronize()
            c0 = cupy.cuda.Event()
            c0.record(tier.stream)
            t_call = time.perf_counter()
            if label != "alone":
                getattr(st, label)("A")
            t_call = (time.perf_counter() - t_call) * 1e6
            c1 = cupy.cuda.Event()
            c1.record(tier.stream)
            walls, done_at = [], None
            for _ in range(n):
                t0 = time.perf_counter()
                dec.steps(1)
                walls.append((time.perf_counter() - t0) * 1e3)
                if done_at is None and c1.done:
                    done_at = len(walls)
            tier.stream.synchronize()
            during = walls[:done_at]
            print(f"copies by {copies:14s} {label:8s}: step wall first {walls[0]:7.2f} ms, median "
                  f"{np.median(walls):5.2f} ms, mean while copying {np.mean(during):5.2f} ms, all {sum(walls):7.1f} ms | "
                  f"tier copy {cupy.cuda.get_elapsed_time(c0, c1):6.2f} ms, done after step {done_at} | the call {t_call:7.1f} us")
    cuda_backend.CudaBackend.copy_runs = kernel_runs
    cuda_backend.TIER_COPY_BLOCKS, cuda_backend.TIER_COPY_THREADS = grids[0]


if __name__ == "__main__":
    main()
