"""What the CUDA calls of a step do to the host code around them: the same piece of the manager's Python
timed alone, and right after the calls a step makes.

    python scripts/driver_footprint.py

The piece is a decode step's settle at batch 1 and at batch 256 (host backend, its device work no-ops:
numpy on small arrays and Python, no CUDA call), on a manager of its own for each condition; before each
timed settle, on a separate CUDA stream (host_floor.py's), one of:

    nothing                     (the settle alone, as profile_manager.py times it)
    eventRecord                 one raw event record
    launch, 1 argument          cuLaunchKernel of an empty kernel with one pointer argument
    launch, 3.8 KB parameters   cuLaunchKernel with the snapshot struct by value (cupykv_step_inline's size)
    a step's calls              two eventQuery, streamWaitEvent, the 3.8 KB launch, eventRecord
                                (host_floor.Floor.cuda_calls)

and either the stream is synchronized after each settle (the GPU idle at the next calls) or not. Only the
settle is timed (perf_counter around it), so what moves is the settle's own cost: the host's caches and
whatever else the driver's calls leave behind. Medians of 400 after 100 not counted.
"""
import sys
import time

import cupy
import numpy as np

sys.path.insert(0, "scripts")
from host_floor import Floor  # noqa: E402
from profile_manager import make_manager  # noqa: E402
from cupykv.backends.cuda import PackedLaunch  # noqa: E402


def main():
    floor = Floor(1, cuda=True)                 # its CUDA calls and their kernel, stream and events
    rt, big_launch, stream, events = floor.cuda
    empty = cupy.RawKernel('extern "C" __global__ void empty(int* p) {}', "empty")
    small_launch = PackedLaunch(empty, (cupy.zeros(4, np.int32),))
    small_launch(1, stream.ptr)
    stream.synchronize()
    before = {"nothing": lambda: None,
              "eventRecord": lambda: rt.eventRecord(events[3].ptr, stream.ptr),
              "launch, 1 argument": lambda: small_launch(1, stream.ptr),
              "launch, 3.8 KB parameters": lambda: big_launch(1, stream.ptr),
              "a step's calls": floor.cuda_calls}
    for batch in (1, 256):
        rids = list(range(batch))
        print(f"settle of a batch-{batch} decode step (host backend), medians of 400 (us): "
              "synchronized after each / not")
        for label, calls in before.items():
            mgr = make_manager(batch)       # a fresh one per row: 1000 steps are as many as its requests have room for
            medians = []
            for sync in (True, False):
                times = []
                for i in range(500):
                    s = mgr.prepare_batch((), rids)
                    s.finish()
                    calls()
                    t0 = time.perf_counter()
                    mgr.settle(s)
                    t1 = time.perf_counter()
                    if sync:
                        stream.synchronize()
                    if i >= 100:
                        times.append(t1 - t0)
                stream.synchronize()
                medians.append(np.median(times) * 1e6)
            print(f"  {label:28s} {medians[0]:6.1f} / {medians[1]:6.1f}")


if __name__ == "__main__":
    main()
