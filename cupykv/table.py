"""The host page table (the only source of truth) and its dirty log.

table[p, row, b] is the slot that holds block b of the request in `row` for layer group p, or BAD.
Cells are addressed by flat index into the table; every write is logged, and the next step's snapshot
ships the logged cells with their current values (the device mirror applies them in stream order). A long
run of cells cleared at once (a freed or suspended request's row, a long chunk's window release) is logged
as one range, not cell by cell: a 128k-token request's row is thousands of cells, and the snapshot ships
such a range as one fill run anyway. So is a run written at once (a context chunk's new blocks), which the
snapshot ships as one run with its values.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .layout import BAD, FILL_MIN_RUN, NO_INDEX



def range_pairs(rows: np.ndarray, lo: np.ndarray, count: np.ndarray, longest):
    """(row, block) pairs of the block ranges [lo, lo + count) of each row (count >= 1; longest =
    count.max()), rows in order."""
    if longest == 1:                     # the decode case: one block per row
        return rows, lo
    # (methods rather than np.* functions: at these sizes the dispatch costs more than the work)
    ends = count.cumsum()
    return rows.repeat(count), lo.repeat(count) + (np.arange(int(ends[-1])) - (ends - count).repeat(count))


def expand_ranges(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """(row, block) pairs of the non-empty block ranges [lo, hi) of each row (hi > lo), rows in order."""
    if len(rows) == 0:
        return rows, lo
    count = hi - lo
    return range_pairs(rows, lo, count, np.maximum.reduce(count))


class PageTable:
    """int32 [P, rows, B] in pinned memory (the unsafe staging mode copies from it directly; the snapshot
    mode never lets the copy engine read it), and the flat cells written since the last step."""

    def __init__(self, backend, num_groups: int, rows: int, max_blocks: int):
        self.shape = (num_groups, rows, max_blocks)
        self.array = backend.pinned_empty(num_groups * rows * max_blocks).reshape(self.shape)
        self.array.fill(BAD)
        self.flat = self.array.reshape(-1)                # a view: cells by flat index
        self.max_blocks = max_blocks
        # int64 [P, rows]: flat index of table[p, row, 0] (a gather and an add find any cell)
        self.row_starts = np.arange(num_groups * rows, dtype=np.int64).reshape(num_groups, rows) * max_blocks
        self._group_base = self.row_starts[:, :1].copy()         # int64 [P, 1]: of table[p, 0, 0]
        self._base = [int(b) for b in self._group_base[:, 0]]    # the same, as Python ints
        self._log: List[np.ndarray] = []
        self._cleared: List[Tuple[int, int]] = []     # flat ranges [lo, hi) written BAD, logged as ranges
        self._written: List[Tuple[int, int]] = []     # flat ranges [lo, hi) written whole (write_runs)

    def cells(self, p: int, rows, blocks) -> np.ndarray:
        """Flat indices of table[p, rows, blocks] (rows: an int or an int64 array; blocks: an int or an integer
        array; broadcast), int64."""
        return self.row_starts[p][rows] + blocks

    def cells_in_every_group(self, rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Flat indices of table[:, rows, blocks] (rows: int64 [n]; blocks: integer [n]), int64 [P, n]: group
        0's cells (its base is 0) moved by each group's base, a broadcast add, which costs less than the
        2-D gather row_starts[:, rows]."""
        return self._group_base + self.cells(0, rows, blocks)

    def row_start(self, p: int, row: int) -> int:
        """Flat index of table[p, row, 0] (a Python int)."""
        return self._base[p] + row * self.max_blocks

    def row_cells(self, p: int, row: int, hi: Optional[int] = None) -> np.ndarray:
        """Flat indices of the held (non-BAD) cells of one row of group p, among its blocks [0, hi) (default:
        the whole row)."""
        start = self.row_start(p, row)
        return (self.flat[start:start + (self.max_blocks if hi is None else hi)] != BAD).nonzero()[0] + start

    def take_blocks(self, p: int, row: int, lo: int = 0, hi: Optional[int] = None) -> np.ndarray:
        """Clear blocks [lo, hi) of one row of group p (default: the whole row) in one pass; returns the
        slots its held cells had, in block order (the caller's copy). Held cells that form one run of at
        least FILL_MIN_RUN (a row of a group that keeps every block, a long chunk's window) are cleared with
        a slice and logged as a range, which ships as one fill run (a range costs the snapshot a few numpy
        calls, a cell next to nothing)."""
        start = self.row_start(p, row) + lo
        seg = self.flat[start:start + ((self.max_blocks if hi is None else hi) - lo)]
        held = (seg != BAD).nonzero()[0]
        n = len(held)
        if n >= FILL_MIN_RUN and held[-1] - held[0] == n - 1:
            a = start + int(held[0])
            vals = self.flat[a:a + n].copy()
            self.flat[a:a + n] = BAD
            self._cleared.append((a, a + n))
            return vals
        vals = seg[held]
        if n:
            self.write(held + start, BAD)
        return vals

    def write(self, cells: np.ndarray, values) -> None:
        """Write cells by flat index and log them for the next step's snapshot."""
        self.flat[cells] = values
        self._log.append(cells)

    def write_runs(self, starts: Sequence[int], lens: Sequence[int], values: np.ndarray, offs: Sequence[int]) -> None:
        """Write runs of cells by slices, each logged as a range: flat[starts[i]:starts[i] + lens[i]] =
        values[offs[i]:offs[i] + lens[i]] (a context chunk's new blocks are a run of a row's cells, and their
        slots a run of the group's allocation: a few slices cost less than the cells one by one, and the
        snapshot ships each range as a run without looking for it)."""
        flat, written = self.flat, self._written
        for start, n, off in zip(starts, lens, offs):
            flat[start:start + n] = values[off:off + n]
            written.append((start, start + n))

    def take(self, cells: np.ndarray):
        """Clear these cells; returns (cells that held a slot, their slots). Cells that hold BAD (scratch
        blocks never got a slot of their own) are skipped."""
        vals = self.flat[cells]
        if len(vals) and np.minimum.reduce(vals) == BAD:     # slots are >= 0 (the ufunc: .min() wraps it in Python)
            held = vals != BAD
            cells, vals = cells[held], vals[held]
        if len(cells):
            self.write(cells, BAD)
        return cells, vals

    # -- the dirty log ---------------------------------------------------------------------------
    def logged(self) -> Tuple[np.ndarray, Optional[np.ndarray], Optional[Tuple[np.ndarray, np.ndarray]]]:
        """What the next snapshot ships: (cells, cleared, written). cells: int64, the cells written since the
        last clear_log, in the order logged, with repeats (every copy of a cell carries the table's current
        value, and runs only need adjacent cells: sorting cost more than it saved). cleared: None, or int64
        [n, 2], the ranges [lo, hi) cleared whole that still hold BAD in every cell. written: None, or (int64
        [n, 2] ranges [lo, hi), int32 [sum of their lengths] their cells' current values, range after
        range): the ranges written by write_runs, and the cleared ranges written again since (a row freed,
        then given to a new request in the same interval)."""
        cleared = self._still_cleared() if self._cleared else None
        written = None
        if self._written:
            flat = self.flat
            written = (np.array(self._written, np.int64),
                       np.concatenate([flat[lo:hi] for lo, hi in self._written]))
        log = self._log
        if not log:
            return NO_INDEX, cleared, written
        if len(log) > 1:
            log[:] = [np.concatenate(log)]
        return log[0], cleared, written

    def _still_cleared(self) -> Optional[np.ndarray]:
        """logged()'s cleared ranges; those written again since ship their values as written ranges."""
        still = []
        for lo, hi in self._cleared:
            if np.maximum.reduce(self.flat[lo:hi]) == BAD:       # (slots are >= 0)
                still.append((lo, hi))
            else:
                self._written.append((lo, hi))
        self._cleared[:] = still
        return np.array(still, np.int64).reshape(-1, 2) if still else None

    def logged_cells(self) -> np.ndarray:
        """Every cell logged since the last clear_log, the cleared ranges' cells included (in no set order)."""
        ranges = [np.arange(lo, hi, dtype=np.int64) for lo, hi in self._cleared + self._written]
        return np.concatenate(self._log + ranges) if self._log or ranges else NO_INDEX

    def num_logged(self) -> int:
        """An upper bound of the cells the next snapshot ships (a cleared range counts its every cell)."""
        n = sum(map(len, self._log)) if self._log else 0
        if self._written:
            n += sum(hi - lo for lo, hi in self._written)
        return n + sum(hi - lo for lo, hi in self._cleared) if self._cleared else n

    def clear_log(self) -> None:
        self._log.clear()
        self._cleared.clear()
        self._written.clear()

    def state(self) -> tuple:
        return self.array.tobytes(), np.sort(self.logged_cells()).tobytes()

