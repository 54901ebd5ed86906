"""A small decode step under use_graphs, launched inline (what CudaStepPlan._inline chooses for a step that
fits cupykv_step_inline_small) and replayed (CudaStepPlan.small_steps_inline_under_graphs off),
alternating step by step on one manager in one process: prepare_batch's host time, and the step's device
time between events around it while a gate holds the stream (as the benchmark measures it). Medians.

    PYTHONPATH=. python scripts/graph_inline_ab.py [batch] [--steps N]      (batch 1, 400 steps by default)
"""
import sys
import time

import cupy
import numpy as np

from profile_manager import prefilled_manager  # noqa: E402  (scripts/ is on sys.path when run from it)
from cupykv.backends.cuda import CudaStepPlan

args = sys.argv[1:]
steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 400
batch = int(args[0]) if args and not args[0].startswith("--") else 1
mgr = prefilled_manager(batch, "cuda")
mgr.use_graphs = True
mgr.capture_graphs()
be, rids = mgr.backend, list(range(batch))
times = {"inline": ([], []), "replay": ([], [])}
start, end = cupy.cuda.Event(), cupy.cuda.Event()
for i in range(steps + 20):
    variant = "replay" if i % 4 in (1, 2) else "inline"       # ABBA: neither goes first more often
    CudaStepPlan.small_steps_inline_under_graphs = variant == "inline"
    gate = be.gate(be.stream)
    start.record(be.stream)
    t0 = time.perf_counter()
    s = mgr.prepare_batch((), rids)
    t1 = time.perf_counter()
    end.record(be.stream)
    gate.open()
    end.synchronize()
    s.finish()
    mgr.settle(s)
    if i >= 20:
        times[variant][0].append(t1 - t0)
        times[variant][1].append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
CudaStepPlan.small_steps_inline_under_graphs = True
print(f"batch {batch}, use_graphs, decode steps alternating (ABBA), medians of {steps // 2} each:")
for variant, (host, device) in times.items():
    print(f"  {variant:7s} prepare_batch {np.median(host) * 1e6:6.1f} us   device {np.median(device):5.1f} us")
