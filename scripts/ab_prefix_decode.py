"""Two trees' decode steps with prefix caching, side by side in one process, step by step in turn.

    PYTHONPATH=. python scripts/ab_prefix_decode.py OTHER_TREE [array|mapping|none|off] [--steps N]

The benchmark's prefix decode part (`python -m cupykv.bench prefix --parts decode`: GPT-OSS-120B, tpb 32,
batch 256, 32k, host backend, prompts with tokens, prefilled) on a manager of this tree and one of
OTHER_TREE (a directory holding a cupykv/ package), loaded under two names as ab_in_process.py does.
Their steps alternate (which goes first alternates too); the variant says what settle is told:
new_tokens as one int64 array in batch order, as a mapping of one-token lists, nothing, or prefix
caching off. Prints each tree's medians of prepare_batch and settle; checks the two tables agree.
"""
import argparse
import importlib
import pathlib
import sys
import time

import numpy as np

from ab_in_process import load

ap = argparse.ArgumentParser()
ap.add_argument("other", type=pathlib.Path)
ap.add_argument("variant", nargs="?", default="array", choices=["array", "mapping", "none", "off"])
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--warmup", type=int, default=30)
args = ap.parse_args()
tpb, batch, ctx = 32, 256, 32768
rng = np.random.default_rng(0)
lens = rng.integers(ctx * 3 // 4, ctx - args.steps - 2 * tpb - 20, batch)
chunk = max(min(65536, int(lens.sum())), int(lens.max()))
prompts = [rng.integers(0, 50000, int(n)) for n in lens]


def manager(package: str):
    ck = sys.modules[package]
    trace = importlib.import_module(f"{package}.bench.prefix_trace")
    shape = importlib.import_module(f"{package}.bench.workload").SHAPES["gpt-oss-120b"]
    cdiv = importlib.import_module(f"{package}.layout").cdiv
    kw = dict(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
              tokens_per_block=tpb, max_seq_len=ctx, max_batch=batch, max_step_tokens=chunk)
    slots = trace._slot_counts(kw, full=batch * cdiv(ctx, tpb) + 256,
                               swa=batch * 12 + 2 * cdiv(chunk, tpb) + 2 * batch + 256)
    mgr = ck.KVCacheManager(ck.CacheSpec(**kw, slots_per_group=slots, prefix_caching=args.variant != "off"),
                            backend=trace.make_trace_backend("host"))
    for rid, p in enumerate(prompts):
        mgr.add(rid, len(p), tokens=p)
    trace._prefill(mgr, {rid: len(p) for rid, p in enumerate(prompts)}, chunk)
    return mgr


load(args.other, "cupykv_other")
load(pathlib.Path(__file__).resolve().parent.parent, "cupykv_this")
mgrs = {"other": manager("cupykv_other"), "this": manager("cupykv_this")}
times = {name: ([], []) for name in mgrs}
rids = list(range(batch))
for i in range(args.warmup + args.steps):
    toks = rng.integers(0, 50000, batch)
    for name, mgr in (list(mgrs.items()) if i % 2 else list(mgrs.items())[::-1]):
        reported = {"array": toks, "mapping": {r: [t] for r, t in zip(rids, toks.tolist())}}.get(args.variant)
        a = time.perf_counter()
        step = mgr.prepare_batch(generation=rids)
        b = time.perf_counter()
        step.finish()
        c = time.perf_counter()
        mgr.settle(step, new_tokens=reported)
        d = time.perf_counter()
        if i >= args.warmup:
            times[name][0].append(b - a)
            times[name][1].append(d - c)
assert np.array_equal(mgrs["other"].table, mgrs["this"].table), "the two trees' tables differ"
for name, (prep, settle) in times.items():
    print(f"{args.variant:8s} {name}: prepare {np.median(prep) * 1e6:6.1f}  settle {np.median(settle) * 1e6:6.1f}  "
          f"total {np.median(np.add(prep, settle)) * 1e6:6.1f} us (medians of {args.steps})")
