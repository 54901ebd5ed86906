"""Host-side profile of a decode step on the CUDA backend (what the benchmark's host column measures).

    python scripts/profile_host.py [batch]
"""
import cProfile
import pstats
import sys
import time

import cupy
import numpy as np

from profile_manager import prefilled_manager

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

mgr = prefilled_manager(batch, backend="cuda")
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
