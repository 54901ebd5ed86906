"""Two trees' decode steps side by side in one process, step by step in turn.

    PYTHONPATH=. python scripts/ab_in_process.py OTHER_TREE [batch ...] [--backend cuda|host] [--steps N]
    PYTHONPATH=. python scripts/ab_in_process.py OTHER_TREE --workload [--contexts 8] [--seq 131072] [...]
    PYTHONPATH=. python scripts/ab_in_process.py --shared --workload [--contexts 8] [...]
    PYTHONPATH=. python scripts/ab_in_process.py OTHER_TREE [batch ...] --prefix [--backend host]

The host's speed differs from process to process by up to 1.6x (the same tree in two processes of one
device call: docs/host_profile.md in git history), more than most changes to a step move it, so comparing trees in
separate processes needs many of them. Here this tree's cupykv and OTHER_TREE's (a directory holding a
cupykv/ package, e.g. an untracked copy of an older commit) are loaded under two package names in one
process; each gets a manager prefilled as profile_manager.prefilled_manager does, and their decode steps
(the previous step's batch, one token each) alternate, each step waited for. Prints the medians of
prepare_batch and settle per tree; on the host backend the queued device work is a no-op
(profile_manager.stub_device_work). --workload: the benchmark's steps instead (bench.workload.Workload:
GPT-OSS-120B at --seq tokens, batch 256, requests finishing and arriving; with --contexts N its "ctx"
steps, N requests prefilling in chunks of 8192; one plan per step applied to both managers), with the
frees and adds (the schedule) timed too. --shared: this tree's PER_LAYER and SHARED managers instead of
two trees. --prefix: the decode steps with prefix caching on (the prompts added with their tokens), each
settled with every entry's new token as one array in batch order (new_tokens=, the form a large batch
uses), the same tokens for both trees.
"""
import dataclasses
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


def prefilled(kv, batch: int, backend: str, prefix: bool = False):
    mgr = prefilled_manager(batch, backend, kv, prefix_caching=prefix)
    if backend == "host":
        stub_device_work(mgr.backend)
    return mgr


def step(mgr, rids, wait: bool, contexts=(), new_tokens=None):
    t0 = time.perf_counter()
    s = mgr.prepare_batch(contexts, rids)
    t1 = time.perf_counter()
    if wait:
        s.ready.synchronize()
    s.finish()
    t2 = time.perf_counter()
    mgr.settle(s, new_tokens=new_tokens)
    return t1 - t0, time.perf_counter() - t2


def workload_steps(trees: dict, seq: int, contexts: int, steps: int, backend: str, shared: bool) -> None:
    """The benchmark's workload (bench.workload.Workload) on two managers, step by step in turn: its "ctx"
    steps with `contexts` > 0, else its decode steps (churn and steady in turn). shared: this tree's
    PER_LAYER and SHARED managers (the Workload's own pair); else both trees' PER_LAYER ones."""
    kvs = list(trees.values())
    if backend == "host":        # before any manager exists: the setup's prefills would build 128k tables
        for kv in kvs:
            stub_device_work(importlib.import_module(kv.__name__ + ".backends.host").HostBackend)
    wl_mod = importlib.import_module(kvs[0].__name__ + ".bench.workload")
    st = wl_mod.Settings(shapes=["gpt-oss-120b"], seqs=[seq], batches=[256], contexts=[contexts], steps=steps,
                         warmup=20, backend=backend)
    wl = wl_mod.Workload(wl_mod.SHAPES["gpt-oss-120b"], seq, 256, contexts, st, np.random.default_rng(0),
                         shared=shared)
    if shared:
        labels = ["per_layer", "shared"]
    else:
        fields = {f.name: getattr(wl.spec, f.name) for f in dataclasses.fields(wl.spec) if f.init}
        wl.managers.append(kvs[1].KVCacheManager(kvs[1].CacheSpec(**fields), backend=backend))
        labels = list(trees)
    wl.setup_decode()
    if contexts:
        wl.setup_contexts(contexts)
    by_id = {id(mgr): label for mgr, label in zip(wl.managers, labels)}
    times = {}          # (case, label) -> (schedule, prepare, settle) seconds
    for i in range(steps + 20):
        plan = wl.plan_ctx() if contexts else wl.plan_decode_only(wl.pre_churn_decode_only(i))
        # (the decode workload alternates churn and steady steps: the order flips every two steps)
        for mgr in (wl.managers if (i // 2) % 2 else wl.managers[::-1]):
            t0 = time.perf_counter()
            wl.apply(mgr, plan)
            t1 = time.perf_counter()
            prepare, settle = step(mgr, plan.generation, backend == "cuda", plan.contexts)
            if i >= 20:
                for series, value in zip(times.setdefault((plan.case, by_id[id(mgr)]), ([], [], [])),
                                         (t1 - t0, prepare, settle)):
                    series.append(value)
    print(f"the benchmark's workload (GPT-OSS-120B, {seq}, b256, {contexts} context chunks), {backend} backend, "
          f"the two managers in turn, each step waited for: medians")
    for (case, label), (sched, prepare, settle) in sorted(times.items()):
        print(f"  {case:7s} {label:18s} schedule {np.median(sched) * 1e6:6.1f} us   prepare_batch "
              f"{np.median(prepare) * 1e6:6.1f} us   settle {np.median(settle) * 1e6:6.1f} us   ({len(prepare)} steps)")


def main():
    args = [a for a in sys.argv[1:]]
    option = lambda name, default: type(default)(args[args.index(name) + 1]) if name in args else default  # noqa: E731
    backend, steps = option("--backend", "cuda"), option("--steps", 400)
    positional = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or not args[i - 1].startswith("--"))]
    trees = {"this tree": load(ROOT, "kv_this")}
    if "--shared" not in args:
        other = pathlib.Path(positional.pop(0)).resolve()
        trees[other.name] = load(other, "kv_other")
    if "--workload" in args:
        workload_steps(trees, option("--seq", 131072), option("--contexts", 0), steps, backend, "--shared" in args)
        return
    batches = [int(b) for b in positional] or [1, 256]
    prefix = "--prefix" in args
    for batch in batches:
        managers = {label: prefilled(kv, batch, backend, prefix) for label, kv in trees.items()}
        rids = list(range(batch))
        times = {label: ([], []) for label in managers}
        rng = np.random.default_rng(1)
        for i in range(steps + 50):
            new_tokens = rng.integers(0, 50000, batch) if prefix else None
            for label, mgr in (managers.items() if i % 2 else reversed(managers.items())):
                prepare, settle = step(mgr, rids, backend == "cuda", new_tokens=new_tokens)
                if i >= 50:
                    times[label][0].append(prepare)
                    times[label][1].append(settle)
        print(f"batch {batch}, {backend} backend{', prefix caching, new_tokens' if prefix else ''}, steps in turn, "
              f"each waited for: medians of {steps}")
        for label, (prepare, settle) in times.items():
            print(f"  {label:18s} prepare_batch {np.median(prepare) * 1e6:6.1f} us   settle {np.median(settle) * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
