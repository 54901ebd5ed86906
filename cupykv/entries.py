"""Which output entry holds which table row: the host's model of what the step kernels keep.

The output tables have an entry (a batch position) per row of the largest batch. A step writes some
entries whole (FULL: all of its batch; DELTA: the ones this map says are not current) and, at every other
entry that holds a row's generation tables, that row's changed cells, so such an entry stays current from
step to step, inside the batch or past it. The kernels find a cell's entry through row_entry (device,
[rows]: where each row was last written whole) and check it against the step's batch and the snapshot's
held section (staging.py); this map is the same information on the host, and it decides which entries a
DELTA step rebuilds.

It is owned by the pipeline, updated once per launched step (advance), and forgotten (its one
invalidation point) when a launch fails part-way and the outputs may hold anything.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

NONE = -1        # the entry holds nothing the next step can use (a context's tables, or unknown)
PADDING = -2     # a padding row of a fixed-size batch, written BAD


def most_rebuilt(live: int) -> int:
    """The most entries a DELTA step of `live` entries rebuilds: advance() makes a step that would rebuild
    more FULL (rebuilding more than half of the entries costs as much as writing them all)."""
    return live // 2


class EntryMap:
    """holder[e]: the row whose generation tables the output holds at entry e, current as of the last
    launched step, or NONE / PADDING; entry_of[row]: the entry the row was last written whole at (the
    device's row_entry). Entries from held_end on hold nothing."""

    def __init__(self, max_batch: int, rows: int):
        self.holder = np.full(max_batch, NONE, np.int64)
        self.entry_of = np.full(rows, -1, np.int64)
        self.held_end = 0
        self._order = np.arange(max_batch, dtype=np.int64)       # entry numbers, read only

    def forget(self) -> None:
        """Nothing the outputs hold is known any more (a launch failed part-way)."""
        self.holder[:] = NONE
        self.entry_of[:] = -1
        self.held_end = 0

    def advance(self, rows: np.ndarray, num_contexts: int, pad_to: int, delta: bool
                ) -> Tuple[Optional[np.ndarray], np.ndarray]:
        """Record a step of batch `rows` (int32 [num_seqs], contexts first) and padding rows up to pad_to.

        delta: the step may be DELTA. Returns (rebuilt, held): the entries a DELTA step writes whole (its
        contexts always), or None for a FULL step (rebuilding more than half of the entries costs as much
        as FULL); and the rows held past the batch after the step (the snapshot's held section, a view of
        holder).
        Invariant relied on: holder[e] == row only if entry_of[row] == e (a row written whole elsewhere
        leaves its old entry, below)."""
        n = len(rows)
        live = max(n, pad_to)
        holder, entry_of = self.holder, self.entry_of
        want = rows                               # what holder[:live] becomes
        if live > n or num_contexts:
            want = np.full(live, PADDING, np.int64)
            want[:n] = rows
            want[:num_contexts] = NONE
        rebuilt = None
        if delta:
            rebuilt = (holder[:live] != want).nonzero()[0]
            if num_contexts:        # a context's tables change with every chunk (its blocks, its scratch)
                rebuilt = np.concatenate((self._order[:num_contexts], rebuilt[rebuilt >= num_contexts]))
            if len(rebuilt) > most_rebuilt(live):
                rebuilt = None
        # Rows of this batch held past it (an entry they were written at before) leave those entries: the
        # kernels write a row whole here and move its row_entry, so its cells stop going there.
        old = entry_of[rows]
        past = (old >= live).nonzero()[0]
        if len(past):
            moved = old[past]
            holder[moved[holder[moved] == rows[past]]] = NONE
        holder[:live] = want
        entry_of[rows] = self._order[:n]
        self.held_end = max(self.held_end, live)
        return rebuilt, holder[live:self.held_end]
