"""The benchmark's decode workload (GPT-OSS-120B, 128k, batch 256: churn and steady steps, bench.workload)
on one PER_LAYER manager, each step waited for, with perf_counter timers around the manager's parts of a
step (profile_manager.time_parts) and the backend's calls; then a cProfile of the churn steps' prepare_batch.

    PYTHONPATH=. python scripts/workload_parts.py [--backend cuda|host] [--steps N] [--profile]

Prints the median per step of each part, per case (churn "decode", "steady"). With --backend host the
host backend's device work is a no-op from the start (profile_manager.stub_device_work).
"""
import cProfile
import pstats
import sys
import time
from collections import defaultdict

import numpy as np

from profile_manager import stub_device_work, time_parts, timer


def option(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main():
    backend = option("--backend", "cuda")
    steps = option("--steps", 200)
    if backend == "host":
        from cupykv.backends.host import HostBackend
        stub_device_work(HostBackend)
    from cupykv.bench import workload as wl_mod
    st = wl_mod.Settings(shapes=["gpt-oss-120b"], seqs=[131072], batches=[256], contexts=[0], steps=steps,
                         warmup=20, backend=backend)
    wl = wl_mod.Workload(wl_mod.SHAPES["gpt-oss-120b"], 131072, 256, 0, st, np.random.default_rng(0))
    wl.setup_decode()
    mgr = wl.managers[0]
    spent = defaultdict(float)
    timed = timer(spent)
    restore = time_parts(timed)
    if backend == "cuda":
        from cupykv.backends import cuda as cb
        restore.append((cb.CudaStepPlan, "run", cb.CudaStepPlan.run))
        cb.CudaStepPlan.run = timed("plan.run", cb.CudaStepPlan.run)
        for name in ("record", "wait"):
            restore.append((type(mgr.backend), name, getattr(type(mgr.backend), name)))
            setattr(type(mgr.backend), name, timed(f"backend.{name}", getattr(type(mgr.backend), name)))
    prof = cProfile.Profile() if "--profile" in sys.argv else None
    per = defaultdict(lambda: defaultdict(list))
    for i in range(steps + 20):
        plan = wl.plan_decode_only(wl.pre_churn_decode_only(i))
        t0 = time.perf_counter()
        wl.apply(mgr, plan)
        t1 = time.perf_counter()
        spent.clear()
        if prof is not None and plan.case == "decode" and i >= 20:
            prof.enable()
        s = mgr.prepare_batch(contexts=plan.contexts, generation=plan.generation)
        if prof is not None:
            prof.disable()
        t2 = time.perf_counter()
        s.ready.synchronize()
        parts = dict(spent)
        spent.clear()
        t3 = time.perf_counter()
        s.finish()
        mgr.settle(s)
        t4 = time.perf_counter()
        if i >= 20:
            row = per[plan.case]
            row["schedule"].append(t1 - t0)
            row["prepare_batch"].append(t2 - t1)
            row["finish+settle"].append(t4 - t3)
            for k, v in parts.items():
                row["  " + k].append(v)
            for k, v in spent.items():
                row["  (settle) " + k].append(v)
    for owner, name, fn in restore:
        setattr(owner, name, fn)
    print(f"workload decode steps, {backend} backend, PER_LAYER, 128k b256, medians (us)")
    for case, row in sorted(per.items()):
        print(f" {case} ({len(row['prepare_batch'])} steps)")
        for k, v in row.items():
            print(f"   {k:40s} {np.median(v) * 1e6:8.1f}  (n={len(v)})")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
