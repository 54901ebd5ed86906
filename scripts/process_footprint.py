"""The manager's host-backend decode step (profile_manager.py's timing) in a process that has: imported
nothing of CUDA, imported cupy, created a CUDA context, a prefilled manager on the CUDA backend; or (pinned)
the host-backend manager with its host arrays (page table, ring slots) in pinned memory, as on CUDA.

    python scripts/process_footprint.py {plain|import|context|cuda-manager|pinned} [batch]

One condition per process (run each in turn); prints the medians of prepare_batch and settle.
"""
import sys

import numpy as np

sys.path.insert(0, "scripts")
from profile_manager import make_manager, prefilled_manager, timed_decode_step  # noqa: E402

cond = sys.argv[1]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
keep = None
if cond != "plain":
    import cupy
    if cond in ("context", "cuda-manager"):
        keep = cupy.zeros(1)
    if cond == "cuda-manager":
        keep = prefilled_manager(batch, backend="cuda")
    if cond == "pinned":
        import cupyx
        from cupykv.backends.host import HostBackend
        HostBackend.pinned_empty = lambda self, words: cupyx.zeros_pinned(words, np.int32)
mgr, rids = make_manager(batch), list(range(batch))
for round_ in range(3):
    times = [timed_decode_step(mgr, rids)[:2] for _ in range(500)][100:]
    p, s = (float(np.median(t)) * 1e6 for t in zip(*times))
    print(f"{cond:13s} b{batch} round {round_}: prepare {p:.1f} us, settle {s:.1f} us")
