"""The host cost of free() by request length in a long-context manager, for this tree and another side by
side in one process (host backend, device work no-ops: free touches no device).

    PYTHONPATH=. python scripts/free_cost.py OTHER_TREE [--lengths 2048,32768,131000]

GPT-OSS-120B's two groups (a 128-token window and full attention), 32 tokens a block, max_seq_len 128k,
batch 64: for each length, requests of that many tokens are added and prefilled in one step each, then
freed one by one, alternately through both trees' managers; prints the median of free() per tree.
"""
import sys
import time

import numpy as np

from ab_in_process import load
from profile_manager import stub_device_work


def manager(kv, batch: int = 64):
    spec = kv.CacheSpec(windows=[128, None] * 18, num_kv_heads=8, head_dim=64, tokens_per_block=32,
                        max_seq_len=131072, max_batch=batch, slots_per_group=[4200 + batch * 8, batch * 4200],
                        max_step_tokens=1 << 18)
    mgr = kv.KVCacheManager(spec, backend="host")
    stub_device_work(mgr.backend)
    return mgr


def free_times(mgrs, length: int, rounds: int = 6, batch: int = 64) -> list:
    """Seconds of each free() per manager, over rounds of `batch` requests of `length` tokens."""
    times = [[] for _ in mgrs]
    for r in range(rounds):
        ids = [f"r{r}-{i}" for i in range(batch)]
        for mgr in mgrs:
            for rid in ids:
                mgr.add(rid, length)
                s = mgr.prepare_batch(contexts={rid: length})
                s.finish()
                mgr.settle(s)
        for i, rid in enumerate(ids):
            for k in (range(len(mgrs)) if i % 2 else reversed(range(len(mgrs)))):     # each first in turn
                mgr = mgrs[k]
                t0 = time.perf_counter()
                mgr.free(rid)
                times[k].append(time.perf_counter() - t0)
        for mgr in mgrs:
            mgr.synchronize()
    return times


if __name__ == "__main__":
    other = sys.argv[1]
    lengths = [2048, 32768, 131000]
    if "--lengths" in sys.argv:
        lengths = [int(x) for x in sys.argv[sys.argv.index("--lengths") + 1].split(",")]
    import pathlib
    import cupykv
    trees = [("this tree", cupykv), ("other", load(pathlib.Path(other), "cupykv_other"))]
    mgrs = [manager(kv) for _, kv in trees]
    for length in lengths:
        times = free_times(mgrs, length)
        print(f"free() of a {length}-token request, medians of {len(times[0])}: " +
              ", ".join(f"{name} {np.median(t) * 1e6:.1f} us" for (name, _), t in zip(trees, times)))
