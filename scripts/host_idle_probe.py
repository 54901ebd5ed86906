"""A decode step's host time against how the host waited for the GPU before it.

    PYTHONPATH=. python scripts/host_idle_probe.py [batch ...]      (default 1 256; CUDA)

The manager's CUDA events are blocking-sync ones (backends/cuda.py): a thread that waits for one sleeps
until the GPU is done, and its core may go idle. This times the same decode steps (the previous step's
batch, one token each; profile_manager.prefilled_manager) after three kinds of wait, in rounds that take
them in turn: "sleep" (step.ready.synchronize(), as an engine that waits for its GPU), "spin" (poll
step.ready.done() until it is), "none" (no wait: the GPU keeps up with these steps). Then host_floor.py's
flat step in the same three ways. Prints the median prepare_batch and settle of each; nothing is asserted.
"""
import sys
from collections import defaultdict

import numpy as np

from host_floor import Floor, timed_floor_step
from profile_manager import prefilled_manager, timed_decode_step

MODES = ("sleep", "spin", "none")


def wait(event, mode: str) -> None:
    if mode == "sleep":
        event.synchronize()
    elif mode == "spin":
        while not event.done():
            pass


class _Blocking:
    """A blocking-sync cupy event recorded on `stream`, with CudaEvent's done() and synchronize()."""

    def __init__(self, event, stream):
        self.event, self.stream = event, stream

    def record(self) -> "_Blocking":
        self.event.record(self.stream)
        return self

    def done(self) -> bool:
        return self.event.done

    def synchronize(self) -> None:
        self.event.synchronize()


def manager_rounds(batch: int, rounds: int = 6, steps: int = 120, skip: int = 20) -> dict:
    mgr = prefilled_manager(batch, backend="cuda")
    rids = list(range(batch))
    per = defaultdict(lambda: ([], []))
    for r in range(rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:      # each mode first in some round
            for i in range(steps):
                prepare, settle, s = timed_decode_step(mgr, rids)
                wait(s.ready, mode)
                if i >= skip:
                    per[mode][0].append(prepare)
                    per[mode][1].append(settle)
            mgr.synchronize()
    return per


def floor_rounds(batch: int, rounds: int = 3, steps: int = 200, skip: int = 20) -> dict:
    """(The floor's requests start at 8k-30k tokens of 32k: 1800 steps fit.)"""
    import cupy
    floor = Floor(batch, cuda=True)
    stream = floor.cuda[2]
    ready = _Blocking(cupy.cuda.Event(block=True, disable_timing=True), stream)   # as the manager's events
    per = defaultdict(lambda: ([], []))
    for r in range(rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            for i in range(steps):
                prepare, settle = timed_floor_step(floor)
                wait(ready.record(), mode)
                if i >= skip:
                    per[mode][0].append(prepare)
                    per[mode][1].append(settle)
            stream.synchronize()
    return per


def main():
    for batch in [int(a) for a in sys.argv[1:]] or [1, 256]:
        for name, per in (("manager", manager_rounds(batch)), ("floor", floor_rounds(batch))):
            line = ", ".join(f"{mode} {np.median(p) * 1e6:.1f} / {np.median(s) * 1e6:.1f}"
                             for mode, (p, s) in per.items())
            print(f"batch {batch} {name}: prepare / settle us after a wait by  {line}")


if __name__ == "__main__":
    main()
