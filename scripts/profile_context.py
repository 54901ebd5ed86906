"""The manager's host cost in the benchmark's "ctx" steps (GPT-OSS-120B, batch 256 decoding plus 8
requests prefilling in chunks of 8192 tokens, one chunk each per step; a prefill that completes joins the
decode batch, a random decode request is freed for it and a new request arrives), with the host backend's
device work replaced by no-ops (before setup too: the manager's decisions never read device outputs).
Prints medians of prepare_batch, settle and the schedule (the frees and adds).

    python scripts/profile_context.py [--seq N] [--lines] [--cprofile]

scripts/host_floor.py --context prints the prepare's medians beside the floor of the same step.
"""
import sys
import time

import numpy as np

from profile_manager import host_workload  # noqa: E402  (scripts/ is on sys.path when run from it)


def context_times(wl, steps: int, start: int = 0, warm: int = 0, caches=None, lp=None) -> dict:
    """Seconds per part ("sched", "prepare", "settle") of the workload's context steps number start..
    start + steps - 1, those below `warm` not counted. caches: a host_floor.Caches, whose conditions the steps
    take in turn (its pass after the schedule, just before the prepare, not timed): then the times are keyed
    (condition, part) and only its counted steps kept. lp: a line profiler enabled around the counted steps'
    prepare and settle."""
    mgr = wl.mgr
    times = {}
    for i in range(start, start + steps):
        plan = wl.plan_ctx()
        t0 = time.perf_counter()
        wl.apply(mgr, plan)
        t1 = time.perf_counter()
        cond = caches.condition(i) if caches is not None else None
        if cond is not None:
            caches.chill(cond)
        profiled = lp is not None and i >= warm
        if profiled:
            lp.enable_by_count()
        t2 = time.perf_counter()
        s = mgr.prepare_batch(contexts=plan.contexts, generation=plan.generation)
        t3 = time.perf_counter()
        s.finish()
        mgr.settle(s)
        t4 = time.perf_counter()
        if profiled:
            lp.disable_by_count()
        s.ready.synchronize()           # as the benchmark's steps: each done before the next (not timed)
        if i >= warm and (cond is None or caches.counted(i)):
            for part, t in (("sched", t1 - t0), ("prepare", t3 - t2), ("settle", t4 - t3)):
                times.setdefault(part if cond is None else (cond, part), []).append(t)
    return times


if __name__ == "__main__":
    seq = int(sys.argv[sys.argv.index("--seq") + 1]) if "--seq" in sys.argv else 131072
    wl = host_workload(seq, contexts=8)
    if "--lines" in sys.argv:
        from line_profiler import LineProfiler
        import cupykv.manager as m
        import cupykv.planner as pn
        import cupykv.pipeline as pl
        import cupykv.staging as sg
        lp = LineProfiler()
        for f in (pn.StepPlanner.plan, m.KVCacheManager._commit, m.KVCacheManager._commit_contexts,
                  m.KVCacheManager.settle, m.KVCacheManager._release_stale, pl.StepPipeline._enqueue,
                  sg.pack_snapshot, m.RequestTable.generation_batch, m.RequestTable._check_no_duplicates,
                  m.KVCacheManager._release):
            lp.add_function(f)
        context_times(wl, 50, warm=10, lp=lp)
        lp.print_stats(output_unit=1e-6, stripzeros=True)
    elif "--cprofile" in sys.argv:
        import cProfile
        import pstats
        context_times(wl, 10)
        pr = cProfile.Profile()
        pr.enable()
        context_times(wl, 60)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    else:
        times = context_times(wl, 70, warm=10)
        print(f"ctx (8 chunks + {len(wl.decode)} decodes, {seq}): "
              + ", ".join(f"{k} {np.median(v) * 1e6:.1f} us" for k, v in times.items()))
