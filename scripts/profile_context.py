"""The manager's host cost in the benchmark's "ctx" steps (GPT-OSS-120B, batch 256 decoding plus 8
requests prefilling in chunks of 8192 tokens, one chunk each per step; a prefill that completes joins the
decode batch, a random decode request is freed for it and a new request arrives), with the host backend's
device work replaced by no-ops (before setup too: the manager's decisions never read device outputs).
Prints medians of prepare_batch, settle and the schedule (the frees and adds).

    python scripts/profile_context.py [--seq N] [--lines] [--cprofile]
"""
import sys
import time

import numpy as np

from profile_manager import host_workload  # noqa: E402  (scripts/ is on sys.path when run from it)

seq = int(sys.argv[sys.argv.index("--seq") + 1]) if "--seq" in sys.argv else 131072
wl = host_workload(seq, contexts=8)
mgr = wl.mgr
LP = None
times = {"prepare": [], "settle": [], "sched": []}


def step(record=True):
    plan = wl.plan_ctx()
    t0 = time.perf_counter()
    wl.apply(mgr, plan)
    t1 = time.perf_counter()
    if LP is not None:
        LP.enable_by_count()
    s = mgr.prepare_batch(contexts=plan.contexts, generation=plan.generation)
    t2 = time.perf_counter()
    s.finish()
    mgr.settle(s)
    t3 = time.perf_counter()
    if LP is not None:
        LP.disable_by_count()
    if record:
        times["sched"].append(t1 - t0)
        times["prepare"].append(t2 - t1)
        times["settle"].append(t3 - t2)


for _ in range(10):
    step(False)
if "--lines" in sys.argv:
    from line_profiler import LineProfiler
    import cupykv.manager as m
    import cupykv.pipeline as pl
    import cupykv.staging as sg
    lp = LP = LineProfiler()
    for f in (m.KVCacheManager._plan, m.KVCacheManager._commit, m.KVCacheManager._commit_contexts,
              m.KVCacheManager.settle, m.KVCacheManager._release_stale, pl.StepPipeline._enqueue, sg.pack_snapshot,
              m.RequestTable.generation_batch, m.RequestTable._check_no_duplicates, m.KVCacheManager._release):
        lp.add_function(f)
    for _ in range(40):
        step()
    lp.print_stats(output_unit=1e-6, stripzeros=True)
elif "--cprofile" in sys.argv:
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(60):
        step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
else:
    for _ in range(60):
        step()
    print(f"ctx (8 chunks + {len(wl.decode)} decodes, {seq}): "
          + ", ".join(f"{k} {np.median(v) * 1e6:.1f} us" for k, v in times.items()))
