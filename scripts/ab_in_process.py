"""Two trees' decode steps side by side in one process, step by step in turn.

    PYTHONPATH=. python scripts/ab_in_process.py OTHER_TREE [batch ...] [--backend cuda|host] [--steps N]

The host's speed differs from process to process by up to 1.6x (the same tree in two processes of one
device call: docs/host_profile.md), more than most changes to a step move it, so comparing trees in
separate processes needs many of them. Here this tree's cupykv and OTHER_TREE's (a directory holding a
cupykv/ package, e.g. an untracked copy of an older commit) are loaded under two package names in one
process; each gets a manager prefilled as profile_manager.prefilled_manager does, and their decode steps
(the previous step's batch, one token each) alternate, each step waited for. Prints the medians of
prepare_batch and settle per tree; on the host backend the queued device work is a no-op
(profile_manager.stub_device_work).
"""
import importlib.util
import pathlib
import sys
import time

import numpy as np

from profile_manager import prefilled_manager, stub_device_work

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(tree: pathlib.Path, name: str):
    """The cupykv package of `tree` as module `name` (its relative imports resolve inside it)."""
    spec = importlib.util.spec_from_file_location(name, tree / "cupykv" / "__init__.py",
                                                  submodule_search_locations=[str(tree / "cupykv")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def prefilled(kv, batch: int, backend: str):
    mgr = prefilled_manager(batch, backend, kv)
    if backend == "host":
        stub_device_work(mgr.backend)
    return mgr


def step(mgr, rids, wait: bool):
    t0 = time.perf_counter()
    s = mgr.prepare_batch((), rids)
    t1 = time.perf_counter()
    if wait:
        s.ready.synchronize()
    s.finish()
    t2 = time.perf_counter()
    mgr.settle(s)
    return t1 - t0, time.perf_counter() - t2


def main():
    args = [a for a in sys.argv[1:]]
    backend = args[args.index("--backend") + 1] if "--backend" in args else "cuda"
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 400
    positional = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or not args[i - 1].startswith("--"))]
    other, batches = pathlib.Path(positional[0]).resolve(), [int(b) for b in positional[1:]] or [1, 256]
    trees = {"this tree": load(ROOT, "kv_this"), other.name: load(other, "kv_other")}
    for batch in batches:
        managers = {label: prefilled(kv, batch, backend) for label, kv in trees.items()}
        rids = list(range(batch))
        times = {label: ([], []) for label in managers}
        for i in range(steps + 50):
            for label, mgr in (managers.items() if i % 2 else reversed(managers.items())):
                prepare, settle = step(mgr, rids, backend == "cuda")
                if i >= 50:
                    times[label][0].append(prepare)
                    times[label][1].append(settle)
        print(f"batch {batch}, {backend} backend, steps in turn, each waited for: medians of {steps}")
        for label, (prepare, settle) in times.items():
            print(f"  {label:18s} prepare_batch {np.median(prepare) * 1e6:6.1f} us   settle {np.median(settle) * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
