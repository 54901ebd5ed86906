"""Does the way the benchmark measures change the host time it reports?

prepare_batch on the CUDA backend (decode steps whose batch is the previous one's, as scripts/host_calls.py
times them), and the benchmark floor's host calls (a 4 KB memcpyAsync and one RawKernel launch), under
conditions taken in turn, in blocks of BLOCK consecutive steps whose first WARM are not counted (so that
a condition does not inherit the caches the one before left), many blocks each, so that a change of the
machine's speed hits all of them alike:

    plain         nothing holds the stream (what host_calls.py measures)
    gate-spin     the stream held by CudaBackend.gate while the host enqueues (what the benchmark does):
                  one GPU thread reads a word of mapped pinned host memory in a tight loop
    gate-sleep    the same hold, the GPU thread sleeping 2 us between its reads of the word
    cold-caches   nothing held, but a 64 MB NumPy pass just before the call (the torch contenders that run
                  between cupykv's steps in the benchmark leave the CPU caches as cold as this)

    python scripts/host_conditions.py [batch ...]     (default 256 1)

Prints the median per condition. Nothing here is a test: it measures.
"""
import sys
import time
from collections import defaultdict

import cupy
import numpy as np

from host_calls import floor_calls
from profile_manager import prefilled_manager
from cupykv.backends import cuda as cuda_backend

_SLEEPY_GATE = r"""
extern "C" __global__ void sleepy_gate(volatile int* flag, long long max_cycles)
{
    const long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles)
        __nanosleep(2000);
}
"""
CONDITIONS = ("plain", "gate-spin", "gate-sleep", "cold-caches")
BLOCK, WARM = 10, 3


class Conditions:
    def __init__(self, backend):
        self.backend = backend
        self.sleepy = cupy.RawKernel(_SLEEPY_GATE, "sleepy_gate")
        self.big = np.zeros(64 << 18, np.int32)        # 64 MB
        self.max_cycles = np.int64(5 * backend._clock_rate_khz() * 1000)   # 5 s

    def arm(self, name: str, stream):
        """Set up condition `name` on `stream`; returns what open() needs afterwards."""
        if name == "gate-spin":
            return self.backend.gate(stream)
        if name == "gate-sleep":
            ptr = cuda_backend._new_gate_words()
            gate = cuda_backend.CudaGate(ptr)
            self.sleepy((1,), (1,), (np.uint64(ptr), self.max_cycles), stream=stream)
            return gate
        if name == "cold-caches":
            np.add(self.big, 1, out=self.big)
        return None

    @staticmethod
    def open(gate) -> None:
        if gate is not None:
            gate.open()


def under_conditions(cond: Conditions, stream, blocks: int, enqueue, complete, label: str) -> None:
    """Time enqueue() under each condition (blocks of BLOCK steps, the first WARM of a block not counted);
    complete(result) runs after the gate is open. Prints the medians."""
    per = defaultdict(list)
    for i in range(blocks):
        for name in CONDITIONS:
            for j in range(BLOCK):
                gate = cond.arm(name, stream)
                t0 = time.perf_counter()
                res = enqueue()
                t1 = time.perf_counter()
                Conditions.open(gate)
                complete(res)
                if i and j >= WARM:
                    per[name].append(t1 - t0)
    print(f"{label}: medians over {len(per['plain'])} per condition")
    for name in CONDITIONS:
        print(f"  {name:12s} {np.median(per[name]) * 1e6:7.1f} us")


def prepare_under_conditions(cond: Conditions, batch: int, blocks: int = 25) -> None:
    mgr = prefilled_manager(batch, backend="cuda")
    be, rids = mgr.backend, list(range(batch))

    def complete(step):
        step.finish()
        mgr.settle(step)
        step.ready.synchronize()
    for graphs in (False, True):
        mgr.use_graphs = graphs
        under_conditions(cond, be.stream, blocks, lambda: mgr.prepare_batch((), rids), complete,
                         f"batch {batch}, graphs={graphs}: prepare_batch")
        be.synchronize()


def floor_under_conditions(cond: Conditions, blocks: int = 30) -> None:
    enqueue, st, *_ = floor_calls()
    under_conditions(cond, st, blocks, enqueue, lambda _: st.synchronize(),
                     "floor host calls (memcpyAsync 4 KB + one launch)")


if __name__ == "__main__":
    conditions = Conditions(cuda_backend.CudaBackend())
    for b in [int(a) for a in sys.argv[1:]] or [256, 1]:
        prepare_under_conditions(conditions, b)
    floor_under_conditions(conditions)
