"""Host-side profile of a decode step on the CUDA backend (what the benchmark's host column measures).

    python scripts/profile_host.py [batch]
"""
import cProfile
import pstats
import sys
import time

import cupy
import numpy as np

import cupykv

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
for block in (True, False):
    t0 = time.perf_counter()
    evs = [cupy.cuda.Event(block=block, disable_timing=True) for _ in range(200)]
    t1 = time.perf_counter()
    print(f"Event(block={block}) create: {(t1 - t0) / 200 * 1e6:.1f} us each")
s = cupy.cuda.Stream(non_blocking=True)
t0 = time.perf_counter()
for e in evs:
    e.record(s)
print(f"record: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us each")

spec = cupykv.CacheSpec(windows=[128, None] * 18, num_kv_heads=8, head_dim=64, tokens_per_block=32,
                        max_seq_len=32768, max_batch=batch, slots_per_group=[batch * 8, batch * 1100],
                        max_step_tokens=1 << 22)
mgr = cupykv.KVCacheManager(spec, backend="cuda")
rng = np.random.default_rng(0)
for r in range(batch):
    mgr.add(r, int(rng.integers(8192, 30000)))
    s = mgr.prepare_batch({r: mgr.request(r).prompt_len})
    s.finish()
    mgr.settle(s)
mgr.synchronize()
rids = list(range(batch))


def one():
    s = mgr.prepare_batch((), rids)
    s.finish()
    mgr.settle(s)
    s.ready.synchronize()


for _ in range(50):
    one()
tp = []
for _ in range(300):
    t0 = time.perf_counter()
    s = mgr.prepare_batch((), rids)
    tp.append(time.perf_counter() - t0)
    s.finish()
    mgr.settle(s)
    s.ready.synchronize()
print(f"batch {batch}: prepare_batch median {np.median(tp) * 1e6:.1f} us")
cProfile.run("for _ in range(200): one()", "/tmp/prof")
pstats.Stats("/tmp/prof").sort_stats("tottime").print_stats(25)
