"""The step ledger: step ids, steps in flight and unsettled, the finish watermark, quarantine lifting.

A slot released while steps may still read it is tagged with the id of the last step prepared so far
(`last_prepared`) and returns to its pool once every step up to that id has finished. Steps finish in
id order as far as the ledger is concerned: the watermark `finished_through` advances over the oldest
in-flight steps whose finish events have completed, and never past one that has not.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

from .allocator import SlotPool
from .step import Step


class Fence:
    """A point that quarantine waits for which is not a step: the event after copies that read slots
    released now (the host tier's suspend). It takes a step id, so tags and the watermark work as for
    steps."""

    def __init__(self, fence_id: int, event):
        self.id = fence_id
        self.finished = event

    def is_complete(self) -> bool:
        return self.finished.done()

    def is_finished(self) -> bool:
        return True

    def wait_finished(self, timeout=None) -> bool:
        return self.finished.wait(timeout)


class StepLedger:
    def __init__(self, pools: Sequence[SlotPool], timeout_s: float):
        self.pools = pools
        self.timeout_s = timeout_s
        self.next_id = 0
        self.finished_through = -1
        self.in_flight: List[Union[Step, Fence]] = []    # finish event not yet complete, in id order
        self.num_fences = 0                 # the Fences among them (copies of the host tier, not steps)
        self.unsettled: List[Step] = []
        self.latest: Optional[Step] = None     # the step whose outputs the buffers hold

    @property
    def last_prepared(self) -> int:
        """The tag of a slot released now: steps up to this id may still read it."""
        return self.next_id - 1

    def record(self, step: Step) -> None:
        """A step was prepared (its id is next_id)."""
        self.next_id += 1
        self.latest = step
        self.in_flight.append(step)
        self.unsettled.append(step)

    def record_fence(self, event) -> int:
        """A fence after every step prepared so far; returns the tag that waits for it."""
        fence = Fence(self.next_id, event)
        self.next_id += 1
        self.in_flight.append(fence)
        self.num_fences += 1
        return fence.id

    def steps_in_flight(self) -> List[Step]:
        return [s for s in self.in_flight if isinstance(s, Step)]

    def completed_count(self) -> int:
        """How many in-flight steps, from the oldest on, have completed (observes; changes nothing)."""
        k = 0
        for step in self.in_flight:
            if not step.is_complete():
                break
            k += 1
        return k

    def lifted(self, p: int) -> int:
        """Quarantined slots of group p that the next poll() lifts: their steps have completed."""
        k = self.completed_count()
        through = self.in_flight[k - 1].id if k else self.finished_through
        return self.pools[p].quarantined_through(through)

    def available(self, p: int) -> int:
        """Slots of group p that allocation could use now: free, plus quarantine already lifted."""
        return self.pools[p].num_available + self.lifted(p)

    def poll(self) -> None:
        """Advance the watermark over completed steps and lift their quarantine."""
        k = self.completed_count()
        if k:
            self.finished_through = self.in_flight[k - 1].id
            if self.num_fences:
                self.num_fences -= sum(1 for s in self.in_flight[:k] if isinstance(s, Fence))
            del self.in_flight[:k]
        for pool in self.pools:
            pool.reclaim(self.finished_through)

    def wait_for_slots(self, p: int, need: int) -> None:
        """Wait for finish events (oldest first) while the quarantine of group p can cover the shortfall."""
        pool = self.pools[p]
        if pool.num_available + pool.num_quarantined < need:
            return
        for step in self.in_flight:
            if self.available(p) >= need or not step.is_finished():
                return
            step.wait_finished(self.timeout_s)

    def num_steps_in_flight(self) -> int:
        """Prepared steps in in_flight (some may have completed since the last poll; fences not counted)."""
        return len(self.in_flight) - self.num_fences

    def wait_for_in_flight(self, limit: int) -> bool:
        """Wait for finish events (oldest first, each up to timeout_s) until fewer than `limit` prepared
        steps are incomplete (fences, the host tier's copies, do not count); returns whether they are.
        Changes nothing (poll lifts what completed)."""
        pending = [s for s in self.in_flight if isinstance(s, Step) and not s.is_complete()]
        while len(pending) >= limit and pending[0].wait_finished(self.timeout_s):
            pending.pop(0)
        return len(pending) < limit

    def wait_all(self) -> None:
        for step in list(self.in_flight):
            step.wait_finished(self.timeout_s)

    def state(self) -> tuple:
        return self.next_id, tuple(s.id for s in self.unsettled)
