"""Slot pools: one per layer group, with a quarantine for released slots.

A released slot may still be read (or written) by steps that were prepared while it was mapped, so it
waits in quarantine, tagged with the id of the last step prepared before its release, until every step
up to that id has finished. Only then does it return to the free list.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Tuple

import numpy as np


class SlotPool:
    """Free slots of one group as a stack, plus the quarantine.

    The order is deterministic (a fresh pool hands out 0, 1, 2, ...; reclaimed slots come out next, in
    ascending order per reclaim), so managers that see the same calls make the same decisions.
    """

    def __init__(self, num_slots: int):
        self.total = num_slots
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.int32)  # top of the stack at the end
        self._top = num_slots
        self._quarantine: Deque[Tuple[int, np.ndarray]] = deque()     # (tag, slots), tags ascending
        self.num_quarantined = 0

    @property
    def num_free(self) -> int:
        return self._top

    def allocate(self, k: int) -> np.ndarray:
        """Pop k slots. The caller has checked num_free first (all-or-nothing steps)."""
        assert 0 <= k <= self._top, (k, self._top)
        self._top -= k
        return self._stack[self._top:self._top + k][::-1].copy()

    def release(self, slots: np.ndarray, tag: int) -> None:
        """Quarantine slots until every step with id <= tag has finished."""
        if len(slots) == 0:
            return
        slots = np.array(slots, np.int32)      # a copy: the caller's array may change later
        if self._quarantine and self._quarantine[-1][0] == tag:
            self._quarantine[-1] = (tag, np.concatenate((self._quarantine[-1][1], slots)))
        else:
            self._quarantine.append((tag, slots))
        self.num_quarantined += len(slots)

    def reclaim(self, finished_through: int) -> int:
        """Return quarantined slots whose tag <= finished_through to the free list; returns how many."""
        moved = 0
        while self._quarantine and self._quarantine[0][0] <= finished_through:
            _, slots = self._quarantine.popleft()
            # released lowest-first ends up on top in ascending order, so reuse stays deterministic
            # The quarantine owns these arrays (see release). A freed request's slots come in long ascending
            # runs (allocated from the stack in order): timsort takes 2 us for 4k of them, quicksort 40.
            slots.sort(kind="stable")
            self._stack[self._top:self._top + len(slots)] = slots[::-1]
            self._top += len(slots)
            moved += len(slots)
        self.num_quarantined -= moved
        return moved

    def quarantined_through(self, tag: int) -> int:
        """Slots that reclaim(tag) would return."""
        return sum(len(s) for t, s in self._quarantine if t <= tag)

    def quarantined_slots(self) -> np.ndarray:
        return np.concatenate([s for _, s in self._quarantine]) if self._quarantine else np.empty(0, np.int32)

    def free_slots(self) -> np.ndarray:
        return self._stack[:self._top].copy()

    def state(self) -> tuple:
        return (self._stack[:self._top].tobytes(), tuple((t, s.tobytes()) for t, s in self._quarantine))
