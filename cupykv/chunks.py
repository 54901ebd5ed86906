"""A step's context chunks and their slots: the layout of each group's slots (ChunkSlots, made by the
planner), and their allocation and table writes at commit (commit_chunks)."""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from .requests import frozen

_NO_SLOTS = frozen(np.zeros(0, np.int32))


class ChunkSlots:
    """One group's slots for a step's context chunks, laid out as chunk-by-chunk allocation would take
    them: each chunk's own blocks, then its scratch slots. The own blocks are runs of table cells (the
    scratch range lies inside the chunk's blocks and splits them)."""

    __slots__ = ("count", "sizes", "starts", "lens", "offs", "scratch")

    def __init__(self):
        self.count = 0          # slots taken so far
        self.sizes: List[int] = []      # per chunk: its slots
        self.starts: List[int] = []     # per run: flat table index of its first cell,
        self.lens: List[int] = []       # its length,
        self.offs: List[int] = []       # and the position of its first slot among the group's
        self.scratch: list = []         # (chunk, scratch lo, scratch hi, position of its first slot, slots)

    def add(self, chunk: int, row_start: int, lo: int, hi: int, s_lo: int, s_hi: int, scratch_slots: int) -> None:
        first = self.count
        for a, b in (((lo, s_lo), (s_hi, hi)) if s_lo < s_hi else ((lo, hi),)):
            if b > a:
                self.starts.append(row_start + a)
                self.lens.append(b - a)
                self.offs.append(self.count)
                self.count += b - a
        if scratch_slots:
            self.scratch.append((chunk, s_lo, s_hi, self.count, scratch_slots))
            self.count += scratch_slots
        self.sizes.append(self.count - first)


def commit_chunks(plan, step_id: int, table, pools, requests) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Allocate the own slots and scratch slots of a plan's context chunks (at least one) and write the own
    ones into the table; each chunk's request holds its scratch until the step is settled. Returns the
    scratch metadata: (begs, ends) int32 [P, chunks], slots int32 [P, chunks, plan.scratch_width]."""
    P, C = len(pools), len(plan.ctx_rows)
    begs = np.zeros((P, C), np.int32)
    ends = np.zeros((P, C), np.int32)
    scratch = np.zeros((P, C, plan.scratch_width), np.int32)
    held = {}       # chunk -> its scratch slots per group (chunks that borrow any)
    for p, (chunks, slots) in enumerate(zip(plan.ctx_slots, allocate_chunks(plan.ctx_slots, pools))):
        table.write_runs(chunks.starts, chunks.lens, slots, chunks.offs)
        for c, s_lo, s_hi, o, n in chunks.scratch:
            if c not in held:
                held[c] = [_NO_SLOTS] * P
            held[c][p] = slots[o:o + n]
            begs[p, c], ends[p, c] = s_lo, s_hi
            scratch[p, c, :n] = held[c][p]
    for c, per_group in held.items():
        requests.get(plan.ctx_ids[c]).scratch[step_id] = per_group
    return begs, ends, scratch


def allocate_chunks(per_group: List[ChunkSlots], pools) -> List[np.ndarray]:
    """Each group's slots for the chunks, as allocating them chunk by chunk (each chunk group by group)
    gives: one allocation per group unless some group would evict cached blocks, whose evictions are
    reported (cache events, copies out) in that order."""
    if all(chunks.count <= pool.num_free for chunks, pool in zip(per_group, pools)):
        return [pool.allocate(chunks.count) for chunks, pool in zip(per_group, pools)]
    parts = [[] for _ in per_group]
    for c in range(len(per_group[0].sizes)):
        for p, chunks in enumerate(per_group):
            parts[p].append(pools[p].allocate(chunks.sizes[c]))
    return [np.concatenate(slots) for slots in parts]
