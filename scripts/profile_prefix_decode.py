"""The host cost of a decode step with prefix caching on, part by part: the benchmark's decode part
(`python -m cupykv.bench prefix --parts decode`: GPT-OSS-120B, tpb 32, batch 256, 32k) on the host backend,
the step's device work skipped, under cProfile. Prints, per variant, the functions with the most own time
per step. --parts: perf_counter timers around the caching parts of a step instead (medians per step; each
timer adds a few tenths of a microsecond).

    python scripts/profile_prefix_decode.py [--steps N] [--top K] [--parts]
"""
import argparse
import collections
import cProfile
import pstats

import numpy as np

from cupykv import CacheSpec, KVCacheManager
from cupykv.bench.prefix_trace import _prefill, _slot_counts, make_trace_backend
from cupykv.bench.workload import SHAPES
from cupykv.layout import cdiv

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--top", type=int, default=22)
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--parts", action="store_true")
args = ap.parse_args()


def time_parts(spent: dict) -> None:
    """perf_counter timers around the parts of a caching step (adds each call's seconds to spent[name])."""
    from cupykv import allocator, ledger, manager, pipeline, prefix_cache
    from profile_manager import timer

    timed = timer(spent)
    for owner, name in [(manager.KVCacheManager, "prepare_batch"), (manager.KVCacheManager, "_plan"),
                        (manager.KVCacheManager, "_commit"), (manager.KVCacheManager, "_allocate_blocks"),
                        (pipeline.StepPipeline, "launch"), (manager.KVCacheManager, "settle"),
                        (manager.KVCacheManager, "_release_stale"), (manager.KVCacheManager, "_release"),
                        (prefix_cache.PrefixCache, "settle"), (prefix_cache.PrefixCache, "_extend"),
                        (prefix_cache.PrefixCache, "publish"), (prefix_cache.PrefixCache, "leaving"),
                        (prefix_cache.PrefixCache, "unhash"), (allocator.CachingSlotPool, "release"),
                        (allocator.CachingSlotPool, "allocate"), (allocator.CachingSlotPool, "_lift"),
                        (ledger.StepLedger, "poll")]:
        setattr(owner, name, timed(f"{owner.__name__}.{name}", getattr(owner, name)))


spent = collections.defaultdict(float)
if args.parts:
    time_parts(spent)
shape, tpb, batch, ctx = SHAPES["gpt-oss-120b"], 32, args.batch, 32768
rng = np.random.default_rng(0)
lens = rng.integers(ctx * 3 // 4, ctx - args.steps - 2 * tpb - 20, batch)
chunk = max(min(65536, int(lens.sum())), int(lens.max()))
kw = dict(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
          tokens_per_block=tpb, max_seq_len=ctx, max_batch=batch, max_step_tokens=chunk)
slots = _slot_counts(kw, full=batch * cdiv(ctx, tpb) + 256, swa=batch * 12 + 2 * cdiv(chunk, tpb) + 2 * batch + 256)
for variant in ("caching-off", "caching-on", "caching-on+new_tokens", "caching-on+new_tokens[array]"):
    mgr = KVCacheManager(CacheSpec(**kw, slots_per_group=slots, prefix_caching=variant != "caching-off"),
                         backend=make_trace_backend("host"))
    rids = list(range(batch))
    for rid, n in zip(rids, lens):
        mgr.add(rid, int(n), tokens=rng.integers(0, 50000, int(n)))
    _prefill(mgr, {rid: int(n) for rid, n in zip(rids, lens)}, chunk)
    prof = cProfile.Profile()
    per_step = collections.defaultdict(list)
    for i in range(args.steps + 10):
        toks = rng.integers(0, 50000, batch)
        reported = {"caching-on+new_tokens": {rid: [t] for rid, t in zip(rids, toks.tolist())},
                    "caching-on+new_tokens[array]": toks}.get(variant)
        if i >= 10 and not args.parts:
            prof.enable()
        spent.clear()
        step = mgr.prepare_batch(generation=rids)
        step.finish()
        mgr.settle(step, new_tokens=reported)
        if i >= 10:
            prof.disable()
            for name, t in spent.items():
                per_step[name].append(t)
    if args.parts:
        print(f"== {variant}: medians per step over {args.steps} steps (us; a part's time includes its callees)")
        for name, ts in per_step.items():
            print(f"  {name:34s} {np.median(ts) * 1e6:8.1f}")
        continue
    st = pstats.Stats(prof)
    print(f"== {variant}: per step (us), own / cumulative / calls, over {args.steps} steps (cProfile inflates)")
    for (f, l, name), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"{tt / args.steps * 1e6:8.1f} {ct / args.steps * 1e6:8.1f} {nc / args.steps:7.1f}  {f.split('/')[-1]}:{l} {name}")
