"""Host time of each backend call inside prepare_batch on the CUDA backend (decode steps, batch 256).

    python scripts/host_calls.py [batch]

Wraps the backend's methods with perf_counter timers; prints the median per call and per step, next to
the median of prepare_batch itself and of a bare cupy launch and memcpyAsync for scale.
"""
import sys
import time
from collections import defaultdict

import cupy
import numpy as np

from profile_manager import prefilled_manager

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
mgr = prefilled_manager(batch, backend="cuda")
be = mgr.backend
spent = defaultdict(float)


def timed(name, fn):
    def call(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        spent[name] += time.perf_counter() - t0
        return out
    return call


for name in ("wait", "copy_h2d", "apply_deltas", "build_step", "record", "launch_step_graph"):
    setattr(be, name, timed(name, getattr(be, name)))
rids = list(range(batch))
for graphs in (False, True):
    mgr.use_graphs = graphs
    per = defaultdict(list)
    for i in range(250):
        spent.clear()
        t0 = time.perf_counter()
        s = mgr.prepare_batch((), rids)
        t1 = time.perf_counter()
        s.finish()
        mgr.settle(s)
        s.ready.synchronize()
        if i >= 50:
            per["prepare_batch (total)"].append(t1 - t0)
            for k, v in spent.items():
                per[k].append(v)
    print(f"graphs={graphs}: medians per step over 200 decode steps, batch {batch}")
    for k, v in per.items():
        print(f"  {k:24s} {np.median(v) * 1e6:7.1f} us")

# scale: a bare RawKernel launch and a small pinned memcpyAsync on this host
k = cupy.RawKernel('extern "C" __global__ void noop(int* p) {}', "noop")
dev = cupy.zeros(1024, np.int32)
host = cupy.cuda.alloc_pinned_memory(4096)
st = cupy.cuda.Stream(non_blocking=True)
k((1,), (32,), (dev,), stream=st)
for label, fn in (("RawKernel launch, 1 arg", lambda: k((1,), (32,), (dev,), stream=st)),
                  ("memcpyAsync 4 KB pinned", lambda: cupy.cuda.runtime.memcpyAsync(
                      dev.data.ptr, host.ptr, 4096, cupy.cuda.runtime.memcpyHostToDevice, st.ptr)),
                  ("Event() + record", lambda: cupy.cuda.Event(block=True, disable_timing=True).record(st))):
    ts = []
    for _ in range(300):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    st.synchronize()
    print(f"  {label:24s} {np.median(ts) * 1e6:7.1f} us")
