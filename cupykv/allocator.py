"""Slot pools: one per layer group: free slots and quarantine; with prefix caching also reference counts
and evictable (cached) slots.

A released slot may still be read (or written) by steps that were prepared while it was mapped, so it
waits in quarantine, tagged with the id of the last step prepared before its release, until every step
up to that id has finished. Only then can it be handed out again.

SlotPool is the pool without prefix caching: every slot has at most one holder, and a slot whose
quarantine lifts is free. CachingSlotPool overrides what changes when slots can be shared and cached.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Callable, Deque, List, Optional, Tuple

import numpy as np

NO_TAG = -1


def _no_repeats(a: np.ndarray) -> bool:
    """Whether a short array (a step's few slots) has no value twice; False for a long one (not checked)."""
    return len(a) < 2 or (len(a) <= 64 and len(set(a.tolist())) == len(a))


def _distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of a (1-D), ascending, as np.unique gives them (a new array of a's dtype); a
    sort and a compare cost a fraction of np.unique here."""
    s = np.sort(a)
    return s if _no_repeats(s) else s[np.concatenate(([True], s[1:] != s[:-1]))]


def _joined(parts: List[np.ndarray]) -> np.ndarray:
    """The parts of a quarantine entry as one array, in release order (the one part itself if alone)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _first_occurrences(a: np.ndarray) -> np.ndarray:
    """Indices of the first occurrence of each distinct value of a (1-D), ascending."""
    if len(a) < 2:
        return np.arange(len(a))
    order = np.argsort(a, kind="stable")
    s = a[order]
    return np.sort(order[np.concatenate(([True], s[1:] != s[:-1]))])


class SlotPool:
    """Free slots of one group as a stack, plus the quarantine.

    The order is deterministic (a fresh pool hands out 0, 1, 2, ...; reclaimed slots come out next, in
    ascending order per reclaim), so managers that see the same calls make the same decisions.
    """

    num_evictable = 0
    evictions = 0

    def __init__(self, num_slots: int):
        self.total = num_slots
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.int32)  # top of the stack at the end
        self._top = num_slots
        # (tag, the slots of each release under it, in release order), tags ascending: kept as parts and joined
        # when they are lifted, so that n releases between two steps (a burst of frees) copy each slot once,
        # not once for every release after it
        self._quarantine: Deque[Tuple[int, List[np.ndarray]]] = deque()
        self.num_quarantined = 0

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_available(self) -> int:
        """Slots allocate() can hand out now."""
        return self._top + self.num_evictable

    def allocate(self, k: int) -> np.ndarray:
        """Pop k slots. The caller has checked num_available first (all-or-nothing steps)."""
        assert 0 <= k <= self._top, (k, self._top)
        self._top -= k
        return self._stack[self._top:self._top + k][::-1].copy()

    def release(self, slots: np.ndarray, tag: int) -> np.ndarray:
        """Quarantine slots until every step with id <= tag has finished; returns the quarantined slots."""
        if len(slots) == 0:
            return slots
        slots = np.array(slots, np.int32)      # a copy: the caller's array may change later
        self._enter_quarantine(slots, tag)
        return slots

    def _enter_quarantine(self, slots: np.ndarray, tag: int) -> None:
        if self._quarantine and self._quarantine[-1][0] == tag:
            self._quarantine[-1][1].append(slots)
        else:
            self._quarantine.append((tag, [slots]))
        self.num_quarantined += len(slots)

    def reclaim(self, finished_through: int) -> int:
        """Lift the quarantine of entries with tag <= finished_through; returns how many slots."""
        moved = 0
        while self._quarantine and self._quarantine[0][0] <= finished_through:
            tag, parts = self._quarantine.popleft()
            moved += self._lift(tag, _joined(parts))
        self.num_quarantined -= moved
        return moved

    def give_back(self, slots: np.ndarray) -> None:
        """Slots straight onto the free stack, no quarantine: for an owner that tracks by itself when nobody
        uses them any more (the host tier's pools, after their copy's event)."""
        self._push_free(np.array(slots, np.int32))      # a copy, which _push_free sorts

    def _lift(self, tag: int, slots: np.ndarray) -> int:
        self._push_free(slots)
        return len(slots)

    def _push_free(self, slots: np.ndarray) -> None:
        # released lowest-first ends up on top in ascending order, so reuse stays deterministic. The
        # quarantine owns these arrays (see release). A freed request's slots come in long ascending runs
        # (allocated from the stack in order), which a stable sort (timsort) merges instead of re-sorting.
        slots.sort(kind="stable")
        self._stack[self._top:self._top + len(slots)] = slots[::-1]
        self._top += len(slots)

    def quarantined_through(self, tag: int) -> int:
        """Slots that reclaim(tag) would lift."""
        return sum(len(s) for t, parts in self._quarantine if t <= tag for s in parts)

    def quarantined_slots(self) -> np.ndarray:
        return (np.concatenate([s for _, parts in self._quarantine for s in parts]) if self._quarantine
                else np.empty(0, np.int32))

    def free_slots(self) -> np.ndarray:
        return self._stack[:self._top].copy()

    def state(self) -> tuple:
        return (self._stack[:self._top].tobytes(),
                tuple((t, b"".join(s.tobytes() for s in parts)) for t, parts in self._quarantine))


class CachingSlotPool(SlotPool):
    """A pool whose slots can be shared (a cache hit maps one slot into several rows) and cached.

    `refs` counts the holders of each slot (table cells and scratch borrowings); a slot enters quarantine
    when its last holder lets go. When its quarantine lifts, a slot the prefix cache still names
    (`hashed`, set by the cache) becomes evictable instead of free: still a hit, handed out only after
    every free slot, least recently released first (the cache forgets it then, through on_evict).

    A hit takes a slot back from the evictable list or out of quarantine (it only reads the KV). A
    quarantine entry is valid only for the slots whose `qtag` still equals its tag: a hit clears it, a
    later release gives the slot a newer one.
    """

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.refs = np.zeros(num_slots, np.int32)
        self.qtag = np.full(num_slots, NO_TAG, np.int64)
        self.hashed = np.zeros(num_slots, bool)
        self._evictable: "OrderedDict[int, None]" = OrderedDict()
        self.on_evict: Optional[Callable[[np.ndarray], None]] = None
        self.evictions = 0

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def allocate(self, k: int) -> np.ndarray:
        """k slots with one holder each: free slots first, then the least recently released evictable
        ones (the cache forgets them). The caller has checked num_available."""
        assert 0 <= k <= self.num_available, (k, self.num_available)
        take = min(k, self._top)
        slots = super().allocate(take)
        if take < k:
            evicted = np.array([self._evictable.popitem(last=False)[0] for _ in range(k - take)], np.int32)
            self.hashed[evicted] = False
            self.evictions += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)
            slots = np.concatenate((slots, evicted))
        self.refs[slots] = 1
        return slots

    def acquire(self, slots: np.ndarray) -> None:
        """One more holder for each of these cached slots (a hit): back from evictable or quarantine."""
        idle = slots[self.refs[slots] == 0].tolist()
        pop = self._evictable.pop           # (a long prompt's hit: thousands of slots, most of them evictable)
        waiting = [s for s, was in zip(idle, map(pop, idle, repeat(False))) if was is False]
        if waiting:                         # not evictable and unheld: in quarantine, or taken out by a repeat
            waiting = _distinct(np.array(waiting, np.int64))
            waiting = waiting[self.qtag[waiting] != NO_TAG]
            self.qtag[waiting] = NO_TAG
            self.num_quarantined -= len(waiting)
        if len(_distinct(slots)) == len(slots):        # (ufunc.at is much slower than a plain scatter)
            self.refs[slots] += 1
        else:
            np.add.at(self.refs, slots, 1)

    def unname(self, slots: np.ndarray) -> None:
        """The cache no longer names these slots: an evictable one becomes free (reused first)."""
        self.hashed[slots] = False
        gone = [s for s in slots.tolist() if self._evictable.pop(s, False) is None]
        if gone:
            self._push_free(np.array(gone, np.int32))

    def release(self, slots: np.ndarray, tag: int) -> np.ndarray:
        """Drop one holder of each slot; slots left with none are quarantined (returned)."""
        if len(slots) == 0:
            return slots
        once = _no_repeats(slots)
        if once:                            # (a plain scatter: ufunc.at is slower even at a few slots)
            self.refs[slots] -= 1
        else:
            np.subtract.at(self.refs, slots, 1)
        last = slots[self.refs[slots] == 0]
        last = np.sort(last) if once else _distinct(last)      # two holders may let go at once
        if len(last):
            self.qtag[last] = tag
            self._enter_quarantine(last.astype(np.int32, copy=False), tag)
        return last

    def give_back(self, slots: np.ndarray) -> None:
        """Slots straight onto the free stack, no quarantine: for an owner that tracks by itself when nobody
        uses them any more (the host tier's pools, after their copy's event)."""
        self._push_free(np.array(slots, np.int32))      # a copy, which _push_free sorts

    def _lift(self, tag: int, slots: np.ndarray) -> int:
        # Not taken by a hit, not released again since; once each, in the order of its last release (hit
        # and released again under the same tag, a slot is in its entry twice).
        slots = slots[self.qtag[slots] == tag]
        if not _no_repeats(slots):
            newest_first = slots[::-1]
            slots = newest_first[_first_occurrences(newest_first)][::-1]
        self.qtag[slots] = NO_TAG
        cached = self.hashed[slots]
        self._evictable.update((s, None) for s in slots[cached].tolist())
        self._push_free(slots[~cached])
        return len(slots)

    def quarantined_through(self, tag: int) -> int:
        # each slot once: hit and released again under the same tag, it is in its entry twice
        n = 0
        for t, parts in self._quarantine:
            if t <= tag:
                s = _joined(parts)
                n += len(_distinct(s[self.qtag[s] == t]))
        return n

    def quarantined_slots(self) -> np.ndarray:
        return np.flatnonzero(self.qtag != NO_TAG).astype(np.int32)

    def count_evictable(self, slots) -> int:
        """How many of these slots are evictable now."""
        return sum(map(self._evictable.__contains__, np.asarray(slots).tolist()))

    def evictable_slots(self) -> np.ndarray:
        """Evictable slots, least recently released first."""
        return np.fromiter(self._evictable, np.int32, len(self._evictable))

    def state(self) -> tuple:
        return super().state() + (self.refs.tobytes(), self.qtag.tobytes(), self.hashed.tobytes(),
                                  tuple(self._evictable))


def run_starts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Indices (int64) where the maximal runs of a and b both stepping by one start."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    if not len(a):
        return np.empty(0, np.int64)
    return np.flatnonzero(np.concatenate(([True], (np.diff(a) != 1) | (np.diff(b) != 1))))


def slot_runs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int64 [num_runs, 3] rows (a0, b0, n): the maximal runs where a and b both step by one, each moved as
    one piece (of a copy_runs, or one transfer descriptor). One numpy pass: a fragmented 128k request has
    4096 runs a group."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    starts = run_starts(a, b)
    return np.stack((a[starts], b[starts], np.diff(np.append(starts, len(a)))), axis=1)
