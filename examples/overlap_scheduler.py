"""An overlap scheduler: the CPU runs one step ahead of the GPU, and a gate makes the race window wide.

The loop prepares step N+1 (allocations, table writes, its snapshot) while step N has not run yet: a gate
kernel holds the manager stream in front of each step until the CPU has prepared the next one. Each
step is finished right after its work is enqueued, and settled one step late (after the next prepare).
Layers run in order on a compute stream: write the layer's K/V at the step's write positions, then paged
attention through the layer's table (the kernel of examples/cupy_decode.py).

The same workload runs twice: with cupykv's snapshot staging, and with staging="unsafe" (copies straight
from live host buffers and from pinned buffers dropped after enqueue: what an engine without cupykv's
discipline does). Every attention output is compared with the dense reference. cupykv must produce no
wrong step; the unsafe mode should produce many (that shows the gate really opened the window).

Runs on the GPU (CuPy) and, with the host backend's simulated streams, on the CPU.

    python examples/overlap_scheduler.py [--backend auto|cuda|host]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupykv                                                     # noqa: E402
from cupykv.storage import KVStorage                              # noqa: E402
from cupy_decode import ATOL, COMMON, Runner, Workload, dense_reference, parse_backend   # noqa: E402

WINDOWS = [16] * 5 + [None]      # Gemma-like 5:1


def run(staging: str, backend: str, gated: bool = True):
    """Returns (steps, wrong steps, in-window keys without a page, gates that timed out).

    gated=False runs the same loop without gates (also the warm-up: while a gate spins, the first launch of
    a kernel, whose module load synchronizes the device, would block the host until the gate times out)."""
    spec = cupykv.CacheSpec(windows=WINDOWS, **COMMON)
    mgr = cupykv.KVCacheManager(spec, backend=backend, staging=staging)
    be = mgr.backend
    storage = KVStorage(mgr)
    compute = be.new_stream("compute")
    runner = Runner(mgr, storage, compute)
    wl = Workload(mgr)
    checks = []                       # (step id, results, seeds, positions)
    prev = None                       # (step, gate) prepared, not yet released to the device
    gates = []
    it = 0
    while not wl.done() or prev is not None:
        ctx, gen = wl.plan(it) if not wl.done() else ({}, [])
        it += 1
        step = gate = None
        if ctx or gen:
            if gated:
                gate = be.gate(be.stream)        # holds this step (and everything after it) on the device
                gates.append(gate)
            step = mgr.prepare_batch(ctx, gen)   # the CPU prepares step N+1 while step N is still held
            ent, seeds, pos = wl.scheduled(step)
            checks.append((step.id, runner.run_step(step, ent, seeds, pos), seeds, pos))
            step.finish(compute)
        if prev is not None:
            if prev[1] is not None:
                prev[1].open()                   # step N may run now
            mgr.settle(prev[0])                  # and is settled one step late
            wl.settled(prev[0])
        prev = (step, gate) if step is not None else None
        if it > 500:
            raise RuntimeError("the workload did not finish")
    be.synchronize()
    compute.synchronize()
    timeouts = sum(g.close_timeout_hit() for g in gates)
    wrong = 0
    for _, results, seeds, pos in checks:
        worst = 0.0
        for layer, holder in results:
            out = holder["out"]
            out = out if isinstance(out, np.ndarray) else out.get()
            for t in range(len(pos)):
                ref = dense_reference(layer, int(seeds[t]), int(pos[t]), WINDOWS[layer], spec.num_kv_heads,
                                      spec.head_dim)
                err = np.nan_to_num(np.abs(out[t] - ref), nan=np.inf)      # a NaN is a failure
                worst = max(worst, float(err.max()))
        wrong += worst > ATOL or not np.isfinite(worst)
    return len(checks), wrong, runner.bad_keys(), timeouts


def main(argv=None) -> int:
    backend = parse_backend(argv, __doc__)
    print(f"overlap_scheduler: backend={backend}; the CPU prepares step N+1 while a gate holds step N; "
          f"finish right after enqueue, settle one step late")
    t0 = time.perf_counter()
    w_steps, w_wrong, w_bad, _ = run("snapshot", backend, gated=False)    # also warms up every kernel
    print(f"  cupykv staging, no gate:  {w_wrong} of {w_steps} steps produced wrong attention output "
          f"(in-window keys without a page: {w_bad})")
    steps, wrong, bad, timeouts = run("snapshot", backend)
    print(f"  cupykv staging, gated:    {wrong} of {steps} steps produced wrong attention output "
          f"(in-window keys without a page: {bad})")
    u_steps, u_wrong, u_bad, u_timeouts = run("unsafe", backend)
    print(f"  unsafe staging, gated:    {u_wrong} of {u_steps} steps produced wrong attention output "
          f"(in-window keys without a page: {u_bad})")
    ok = wrong == 0 and bad == 0 and timeouts == 0 and w_wrong == 0 and w_bad == 0
    shown = u_wrong > 0
    if not shown:
        print("  the unsafe mode produced no wrong step: the gate did not open the race window")
    if timeouts or u_timeouts:
        print(f"  gates that timed out: {timeouts} + {u_timeouts}")
    print(f"checked: every step's paged attention == dense reference under a one-step-ahead scheduler "
          f"with cupykv's staging, and the same workload breaks without it; {time.perf_counter() - t0:.1f} s "
          f"-> {'PASS' if ok and shown else 'FAIL'}")
    return 0 if ok and shown else 1


if __name__ == "__main__":
    sys.exit(main())
