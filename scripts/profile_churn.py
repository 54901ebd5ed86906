"""The manager's host cost in the benchmark's churn decode steps (GPT-OSS-120B, 128k, batch 256: before each
"decode" step two requests finish and two new ones are prefilled untimed), with the host backend's device
work replaced by no-ops. Prints medians of prepare_batch per case and of the schedule (the frees).

    python scripts/profile_churn.py [--lines]      (--lines: line_profiler over the decode steps' prepare)
"""
import sys
import time

import numpy as np

from profile_manager import host_workload  # noqa: E402  (scripts/ is on sys.path when run from it)

wl = host_workload()
mgr = wl.mgr
LP = None
times = {"decode": [], "steady": [], "sched": [], "settle": []}
def step(i, record=True):
    pos = wl.pre_churn_decode_only(i)
    t0 = time.perf_counter()
    ctx, gen, case = wl.schedule_decode_only(pos)
    t1 = time.perf_counter()
    if LP is not None and case == "decode": LP.enable_by_count()
    s = mgr.prepare_batch(contexts=ctx, generation=gen)
    if LP is not None and case == "decode": LP.disable_by_count()
    t2 = time.perf_counter()
    s.finish()
    mgr.settle(s)
    t3 = time.perf_counter()
    if record:
        times[case].append(t2 - t1)
        if case == "decode":
            times["sched"].append(t1 - t0)
            times["settle"].append(t3 - t2)
for i in range(10): step(i, False)
if "--lines" in sys.argv:
    from line_profiler import LineProfiler
    import cupykv.manager as m
    lp = LP = LineProfiler()
    import cupykv.allocator as al
    import cupykv.ledger as ld
    import cupykv.pipeline as pl
    import cupykv.requests as rq
    import cupykv.staging as sg
    for f in (m.KVCacheManager.prepare_batch, m.KVCacheManager._plan, m.KVCacheManager._commit,
              pl.StepPipeline.launch, pl.StepPipeline._enqueue, ld.StepLedger.poll,
              rq.RequestTable.generation_batch, al.SlotPool.reclaim, sg.pack_snapshot, sg.runs_from_cells):
        lp.add_function(f)
    for i in range(10, 50): step(i)
    lp.print_stats(output_unit=1e-6, stripzeros=True)
else:
    for i in range(10, 70): step(i)
    for k, v in times.items(): print(k, f"{np.median(v)*1e6:.1f} us")
