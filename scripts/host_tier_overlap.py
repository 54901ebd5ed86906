"""Decode steps of other requests during a suspend and a resume, with the host tier's copies made three
ways side by side in one process: the CUDA backend's copy_runs as it is (cupykv_copy_runs both ways, its
grid per direction from cupykv.kernels), cupykv_copy_runs both ways at every --grids size, and one
memcpyAsync per run both ways.
The host-tier benchmark's rig (GPT-OSS-120B shape, a 128k request, 32 requests of 4k decoding); each step:
prepare_batch, a token per request up, the stand-in attention, a token per request back (an engine's
copies), finish, the host's wait, settle. Then a fragmented request (its full-attention slots one run per
slot: prefilled in lockstep with another) suspended and resumed alone, each way of copying.

    PYTHONPATH=. python scripts/host_tier_overlap.py [--prompt N] [--steps N] [--rounds N] [--grids 8x512,...]

(--grids: the copy kernel's blocks x threads per block, at most kernels.TIER_COPY_THREADS threads.)
Prints per case the step walls (the first, the median, the mean while the copy ran), the tier copy's
device time, the step after which it had completed, and the host time of the suspend / resume call (each
case --rounds times, default 2; 0 skips the decode steps); for the fragmented request, the medians of the
calls' host times and device times, and a cProfile of each call with the library's copies.
"""
import cProfile
import pstats
import sys
import time

import cupy
import numpy as np

from cupykv.backends import cuda as cuda_backend
from cupykv.backends.runs import run_table
from cupykv.bench.host_tier_bench import HostTierSettings, _Clock, _Decoder, _Rig, _round_trips
from cupykv.bench.prefix_trace import _prefill
from cupykv.bench.workload import SHAPES
from cupykv.layout import cdiv


Backend = cuda_backend.CudaBackend
LIBRARY_THREADS = cuda_backend.TIER_COPY_THREADS
GRID = [0, 0]           # kernel_runs' grid


def memcpy_runs(self, dst, src, runs, unit_bytes, stream):
    """copy_runs as one memcpyAsync per run both ways (copy engines)."""
    self._copy_runs_by_memcpy(dst, src, run_table(runs, unit_bytes, dst.nbytes, src.nbytes), unit_bytes, stream)


def kernel_runs(self, dst, src, runs, unit_bytes, stream):
    """copy_runs as one cupykv_copy_runs launch of GRID[0] blocks of GRID[1] threads both ways."""
    cuda_backend.TIER_COPY_THREADS = GRID[1]
    self._copy_runs_by_kernel(dst, src, run_table(runs, unit_bytes, dst.nbytes, src.nbytes), unit_bytes, stream,
                              GRID[0])


def use(impl, blocks, threads):
    """copy_runs from now on: impl (kernel_runs at blocks x threads)."""
    Backend.copy_runs = impl
    GRID[:] = blocks, threads
    cuda_backend.TIER_COPY_THREADS = LIBRARY_THREADS


def option(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main():
    prompt, n, rounds = option("--prompt", 131072), option("--steps", 60), option("--rounds", 2)
    s = HostTierSettings(prompt=prompt, backend="cuda", frag_run=0, whole=False)
    tpb, blocks = s.tpb, cdiv(prompt, s.tpb)
    swa_keep = cdiv(128, tpb) + 2
    grids = [tuple(map(int, g.split("x"))) for g in option("--grids", "8x512").split(",")]
    library = Backend.copy_runs
    cases = ([("library", library, 0, 0)] + [(f"kernel {b}x{t}", kernel_runs, b, t) for b, t in grids]
             + [("memcpy", memcpy_runs, 0, 0)])
    bg_len = s.bg_ctx + rounds * 3 * len(cases) * n + 64        # the other requests grow a token a step
    max_batch = s.bg_requests + 4
    rig = _Rig(SHAPES["gpt-oss-120b"].windows, SHAPES["gpt-oss-120b"], s,
               cdiv(max(prompt, bg_len) + 2 * tpb, tpb) * tpb, max_batch,
               3 * blocks + s.bg_requests * cdiv(bg_len, tpb) + 256,
               swa_keep * (max_batch + 2) + 2 * cdiv(s.chunk + max_batch, tpb) + 256, blocks + 8, swa_keep + 8, [])
    mgr, st, tier = rig.mgr, rig.storage, rig.tier
    mgr.add("A", prompt)
    _prefill(mgr, {"A": prompt}, s.chunk)
    bg = [f"bg{i}" for i in range(s.bg_requests)]
    for rid in bg:
        mgr.add(rid, s.bg_ctx)
    _prefill(mgr, {rid: s.bg_ctx for rid in bg}, s.chunk)
    dec = _Decoder(rig, bg)
    for copies, impl, grid_blocks, threads in cases * rounds:
        use(impl, grid_blocks, threads)
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
            print(f"copies by {copies:16s} {label:8s}: step wall first {walls[0]:7.2f} ms, median "
                  f"{np.median(walls):5.2f} ms, mean while copying {np.mean(during):5.2f} ms, all {sum(walls):7.1f} ms | "
                  f"tier copy {cupy.cuda.get_elapsed_time(c0, c1):6.2f} ms, done after step {done_at} | the call {t_call:7.1f} us")
    for rid in ["A"] + bg:
        mgr.free(rid)
    mgr.add("B", prompt)
    mgr.add("C", prompt)
    for _ in range(blocks):                    # a slot each in turn: B's slots are one run per slot
        step = mgr.prepare_batch(contexts={"B": tpb, "C": tpb})
        step.finish()
        mgr.settle(step)
    mgr.synchronize()
    clock = _Clock(mgr.backend)
    for copies, impl, grid_blocks, threads in cases:
        use(impl, grid_blocks, threads)
        out = _round_trips(rig, "B", 3, clock)
        print(f"fragmented, copies by {copies:16s}: " + " | ".join(
            f"{d} of {int(np.median(out[d]['copies']))} runs: call {np.median(out[d]['host_us']):8.1f} us, device {np.median(out[d]['device_ms']):6.2f} ms "
            f"({np.median(out[d]['bytes']) / np.median(out[d]['device_ms']) / 1e6:4.1f} GB/s)" for d in out))
    use(library, 0, 0)
    for label in ("suspend", "resume"):        # where the library's call spends its host time
        mgr.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        getattr(st, label)("B")
        profile.disable()
        print(f"fragmented {label}, the library's copies, cProfile (us; the functions of most cumulative time):")
        rows = pstats.Stats(profile).stats.items()       # (file, line, name) -> (calls, _, tottime, cumtime, _)
        for (file, line, name), (calls, _, tottime, cumtime, _) in sorted(rows, key=lambda r: -r[1][3])[:16]:
            print(f"  {cumtime * 1e6:9.1f} cum {tottime * 1e6:9.1f} own {calls:6d} calls  {file.split('/')[-1]}:{line} {name}")


if __name__ == "__main__":
    main()
