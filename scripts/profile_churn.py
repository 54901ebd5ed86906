"""The manager's host cost in the benchmark's churn decode steps (GPT-OSS-120B, 128k, batch 256: before each
"decode" step two requests finish and two new ones are prefilled untimed), with the host backend's device
work replaced by no-ops. Prints medians of prepare_batch per case and of the schedule (the frees).

    python scripts/profile_churn.py [--lines | --parts] [--cuda]

--lines: line_profiler over the churn steps' prepare. --parts: timers around the manager's parts of a step
(profile_manager.time_parts, and the frees), medians over the churn steps. --cuda: the workload on the GPU,
device work and all (on the host backend by default, its device work no-ops).

scripts/host_floor.py --churn prints these medians beside the floor of the same step.
"""
import sys
import time

import numpy as np

from profile_manager import host_workload  # noqa: E402  (scripts/ is on sys.path when run from it)


def churn_times(wl, steps: int = 60, warm: int = 10, lp=None, caches=None, before=None, after=None,
                start: int = 0) -> dict:
    """Seconds per step of the workload's decode-only steps number start.. start + steps - 1, those below
    `warm` not counted (the workload's untimed arrivals come before the even ones): prepare_batch per
    case ("decode": a churn step; "steady"), and the churn steps' schedule, settle and the three's "total".
    lp: a line profiler enabled around the counted churn steps' prepare_batch. caches: a host_floor.Caches,
    whose conditions the steps take in turn: then the times are keyed (condition, part) and only its counted
    steps kept. before, after: called before each step's schedule (after the untimed arrivals) and with
    (counted, case) after its settle (counted: past the warm ones)."""
    mgr = wl.mgr
    times = {}
    for i in range(start, start + steps):
        pos = wl.pre_churn_decode_only(i)
        cond = caches.condition(i) if caches is not None else None
        if cond is not None:
            caches.chill(cond)
        if before is not None:
            before()
        t0 = time.perf_counter()
        ctx, gen, case = wl.schedule_decode_only(pos)
        t1 = time.perf_counter()
        profiled = lp is not None and case == "decode" and i >= warm
        if profiled:
            lp.enable_by_count()
        s = mgr.prepare_batch(contexts=ctx, generation=gen)
        if profiled:
            lp.disable_by_count()
        t2 = time.perf_counter()
        if cond is not None:
            caches.chill(cond)
        t3 = time.perf_counter()
        s.finish()
        mgr.settle(s)
        t4 = time.perf_counter()
        s.ready.synchronize()           # as the benchmark's steps: each done before the next (not timed)
        if i >= warm and (cond is None or caches.counted(i)):
            parts = [(case, t2 - t1)] + ([("sched", t1 - t0), ("settle", t4 - t3), ("total", t2 - t0 + t4 - t3)]
                                         if case == "decode" else [])
            for part, t in parts:
                times.setdefault(part if cond is None else (cond, part), []).append(t)
        if after is not None:
            after(i >= warm, case)
    return times


def churn_parts(wl, steps: int = 120) -> None:
    """Print the medians of the manager's parts over the churn steps."""
    from collections import defaultdict

    import cupykv.manager as m
    from profile_manager import time_parts, timer
    spent, per = defaultdict(float), defaultdict(list)
    timed = timer(spent)
    restore = time_parts(timed) + [(m.KVCacheManager, "free", m.KVCacheManager.free)]
    m.KVCacheManager.free = timed("KVCacheManager.free", m.KVCacheManager.free)

    def after(counted, case):
        if counted and case == "decode":
            for k, v in spent.items():
                per[k].append(v)
    times = churn_times(wl, steps + 10, before=spent.clear, after=after)
    for owner, name, fn in restore:
        setattr(owner, name, fn)
    print(f"churn steps ({len(times['decode'])}), {wl.mgr.backend.name} backend: medians per step")
    for k in ("sched", "decode", "settle"):
        print(f"  {k:32s} {np.median(times[k]) * 1e6:7.1f} us")
    for k, v in per.items():
        print(f"  {k:32s} {np.median(v) * 1e6:7.1f} us")


if __name__ == "__main__":
    wl = host_workload(backend="cuda" if "--cuda" in sys.argv else "host", steps=120)
    if "--parts" in sys.argv:
        churn_parts(wl)
    elif "--lines" in sys.argv:
        from line_profiler import LineProfiler
        import cupykv.manager as m
        import cupykv.allocator as al
        import cupykv.ledger as ld
        import cupykv.pipeline as pl
        import cupykv.requests as rq
        import cupykv.staging as sg
        lp = LineProfiler()
        for f in (m.KVCacheManager.prepare_batch, m.KVCacheManager._plan, m.KVCacheManager._commit,
                  pl.StepPipeline.launch, pl.StepPipeline._enqueue, ld.StepLedger.poll,
                  rq.RequestTable.generation_batch, al.SlotPool.reclaim, sg.pack_snapshot, sg.runs_from_cells):
            lp.add_function(f)
        churn_times(wl, 50, lp=lp)
        lp.print_stats(output_unit=1e-6, stripzeros=True)
    else:
        for k, v in churn_times(wl, 70).items():
            print(k, f"{np.median(v)*1e6:.1f} us")
