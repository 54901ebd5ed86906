"""The host page table (the only source of truth) and its dirty log.

table[p, row, b] is the slot that holds block b of the request in `row` for layer group p, or BAD.
Cells are addressed by flat index into the table; every write is logged, and the next step's snapshot
ships the logged cells with their current values (the device mirror applies them in stream order).
"""
from __future__ import annotations

from typing import List

import numpy as np

from .layout import BAD, NO_INDEX


class PageTable:
    """int32 [P, rows, B] in pinned memory (the unsafe staging mode copies from it directly; the snapshot
    mode never lets the copy engine read it), and the flat cells written since the last step."""

    def __init__(self, backend, num_groups: int, rows: int, max_blocks: int):
        self.shape = (num_groups, rows, max_blocks)
        self.array = backend.pinned_empty(num_groups * rows * max_blocks).reshape(self.shape)
        self.array.fill(BAD)
        self.flat = self.array.reshape(-1)                # a view: cells by flat index
        self.max_blocks = max_blocks
        self.group_base = np.arange(num_groups, dtype=np.int64)[:, None] * (rows * max_blocks)  # [P, 1]
        self._base = [int(b) for b in self.group_base[:, 0]]     # the same, as Python ints
        self._log: List[np.ndarray] = []

    def cells(self, p: int, rows, blocks) -> np.ndarray:
        """Flat indices of table[p, rows, blocks] (ints or int64 arrays, broadcast)."""
        return np.add(rows * self.max_blocks, blocks + self._base[p], dtype=np.int64)

    def row_start(self, p: int, row: int) -> int:
        """Flat index of table[p, row, 0] (a Python int)."""
        return self._base[p] + row * self.max_blocks

    def row_cells(self, p: int, row: int) -> np.ndarray:
        """Flat indices of the held (non-BAD) cells of one row of group p."""
        start = self.row_start(p, row)
        return (self.flat[start:start + self.max_blocks] != BAD).nonzero()[0] + start

    def take_row(self, p: int, row: int):
        """take(row_cells(p, row)) in one pass over the row: clear it; returns (the cells that held a slot,
        their slots)."""
        start = self.row_start(p, row)
        seg = self.flat[start:start + self.max_blocks]
        held = (seg != BAD).nonzero()[0]
        n = len(held)
        if n and held[-1] - held[0] == n - 1:      # one run (most rows: every block, or a window): slices, not gathers
            lo = start + int(held[0])
            vals = self.flat[lo:lo + n].copy()
            return self.write_run(lo, lo + n, BAD), vals
        vals = seg[held]
        cells = held + start
        if n:
            self.write(cells, BAD)
        return cells, vals

    def write(self, cells: np.ndarray, values) -> None:
        """Write cells by flat index and log them for the next step's snapshot."""
        self.flat[cells] = values
        self._log.append(cells)

    def write_run(self, lo: int, hi: int, value) -> np.ndarray:
        """write(np.arange(lo, hi), value) with a slice: the flat cells [lo, hi), logged; returns those cells."""
        self.flat[lo:hi] = value
        cells = np.arange(lo, hi, dtype=np.int64)
        self._log.append(cells)
        return cells

    def take(self, cells: np.ndarray):
        """Clear these cells; returns (cells that held a slot, their slots). Cells that hold BAD (scratch
        blocks never got a slot of their own) are skipped."""
        vals = self.flat[cells]
        if len(vals) and vals.min() == BAD:     # slots are >= 0
            held = vals != BAD
            cells, vals = cells[held], vals[held]
        if len(cells):
            self.write(cells, BAD)
        return cells, vals

    # -- the dirty log ---------------------------------------------------------------------------
    def logged(self) -> np.ndarray:
        """Cells written since the last clear_log, in order, with repeats (every copy of a cell carries
        the table's current value, and runs only need adjacent cells: sorting cost more than it saved)."""
        if not self._log:
            return NO_INDEX
        if len(self._log) > 1:
            self._log[:] = [np.concatenate(self._log)]
        return self._log[0]

    def num_logged(self) -> int:
        return sum(map(len, self._log)) if self._log else 0

    def clear_log(self) -> None:
        self._log.clear()

    def state(self) -> tuple:
        return self.array.tobytes(), self.logged().tobytes()
