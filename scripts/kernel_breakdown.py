"""Per-kernel device time of decode steps, for Nsight Compute (ncu) on a GPU machine.

    ncu --profile-from-start off --clock-control none -k regex:cupykv --csv \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python scripts/kernel_breakdown.py gpt-oss-120b 131072 256 [steps]

Builds the benchmark's workload for one (shape, max_seq_len, batch), prefills it (not profiled), then
profiles `steps` decode steps (churn and steady alternate, as in the benchmark). Without ncu it prints the
median device time per step from CUDA events instead. --shared: a SHARED-table manager of the same
workload; --graphs: use_graphs=True; --segments: the GPU time of each part of a step, from events between
the backend calls (the stream held by a gate while the host enqueues); --phases (with --segments, without
--graphs): the step as the three operations cupykv_step fuses (the snapshot copy, cupykv_apply_deltas,
cupykv_build_step: the plan the host backend runs, on the CUDA backend), so each gets its own segment.
"""
import csv
import sys
from collections import defaultdict

import numpy as np


def summarize(path: str) -> None:
    """Median of each metric per kernel from ncu's --csv output (lines that are not CSV rows are echoed)."""
    vals = defaultdict(list)
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for row in csv.DictReader(lines):
        try:
            vals[(row["Kernel Name"].split("(")[0], row["Metric Name"], row["Metric Unit"])].append(
                float(row["Metric Value"].replace(",", "")))
        except (KeyError, ValueError):
            continue
    for (kernel, metric, unit), v in sorted(vals.items()):
        spread = f" min {min(v):.4g} max {max(v):.4g}" if len(v) > 1 else ""
        print(f"  {kernel:32s} {metric:55s} median {np.median(v):10.2f} {unit:8s} (n={len(v)}{spread})")


if sys.argv[1] == "--summarize":
    summarize(sys.argv[2])
    sys.exit(0)

import cupy  # noqa: E402

from cupykv.bench.harness import SHAPES, Settings, Workload  # noqa: E402

shape, seq, batch = SHAPES[sys.argv[1]], int(sys.argv[2]), int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4].isdigit() else 12
graphs = "--graphs" in sys.argv
segments = "--segments" in sys.argv
shared = "--shared" in sys.argv        # a SHARED-table manager instead of the PER_LAYER one
settings = Settings(shapes=[shape.name], seqs=[seq], batches=[batch], contexts=[0], steps=steps, warmup=4,
                    torch=False, backend="cuda")
wl = Workload(shape, seq, batch, 0, settings, np.random.default_rng(0), shared=shared)
wl.setup_decode()
mgr = wl.shared if shared else wl.mgr
mgr.use_graphs = graphs
be = mgr.backend
st = be.stream
e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
times = []
# --segments: a timing event after each backend call of the step (the stream held by a gate while the host
# enqueues, so the gaps are the GPU's own), medians per case and segment.
marks = []
if segments:
    from cupykv.backends import cuda as cuda_backend

    def timed(fn, name):
        def call(*a, **k):
            fn(*a, **k)
            ev = cupy.cuda.Event()
            ev.record(st)
            marks.append((name if isinstance(name, str) else name(*a), ev))
        return call
    # The step plan's raw calls: its kernel launch (named by its function) or its graph replay.
    from cupykv.kernels import MODULES
    kernel_names = {be._kernel(n).kernel.ptr: n[len("cupykv_"):] for n in MODULES["step"].kernels}
    cuda_backend.PackedLaunch.__call__ = timed(cuda_backend.PackedLaunch.__call__,
                                               lambda launch, *a: kernel_names[launch.function])
    rt = cuda_backend.runtime
    rt.graphLaunch = timed(rt.graphLaunch, "graph replay")
    be.wait = timed(be.wait, "wait")
    if "--phases" in sys.argv:
        from cupykv.backends.plan import StepPlan
        be.step_plan = lambda twin, buffers, shared: StepPlan(be, twin, buffers, shared)
        for m in mgr.pipeline.mirrors:
            m._plans.clear()        # made again, as StepPlans, at the next step
        for name in ("copy_h2d", "apply_deltas", "build_step"):
            setattr(be, name, timed(getattr(be, name), name))
seg = {}
for i in range(steps + 4):
    if i == 4:
        cupy.cuda.runtime.profilerStart()
    pos = wl.pre_churn_decode_only(i)
    ctx, gen, case = wl.schedule_decode_only(pos)
    gate = be.gate(st) if segments else None
    e0.record(st)
    marks.clear()
    step = mgr.prepare_batch(contexts=ctx, generation=gen)
    e1.record(st)
    if gate is not None:
        gate.open()
    e1.synchronize()
    if i >= 4:
        times.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
        prev = e0
        for name, ev in marks + [("end", e1)]:
            seg.setdefault((case, name), []).append(cupy.cuda.get_elapsed_time(prev, ev) * 1e3)
            prev = ev
    step.finish()
    mgr.settle(step)
cupy.cuda.runtime.profilerStop()
print(f"{shape.name} {seq} b{batch} {mgr.spec.table_mode} graphs={graphs}: event time per step median "
      f"{np.median(times):.1f} us over {len(times)} steps ({'gated' if segments else 'ungated'})")
for (case, name), v in sorted(seg.items()):
    if segments:
        print(f"  {case:7s} up to the end of {name:18s} median {np.median(v):8.1f} us (n={len(v)})")
