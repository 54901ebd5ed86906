"""Settling a step: its tokens are final. History advances by the accepted tokens, rejected speculative
tokens are rewound, the chunks' scratch slots and the blocks that left a window are released (quarantined
until the steps that may read them have finished), and prefix caching publishes the blocks whose tokens
are now final. KVCacheManager.settle checks the arguments and the order; StepSettler does the rest.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import CapacityExceededError, StepOrderError
from .step import Step


class StepSettler:
    """The settle half of a step's life (after prepare_batch's plan and commit)."""

    def __init__(self, spec, layout, requests, page_table, pools, ledger, prefix):
        self.spec, self.layout, self.requests, self.page_table = spec, layout, requests, page_table
        self.pools, self.ledger, self.prefix = pools, ledger, prefix
        self._windowed = [g for g in layout.groups if not g.keeps_every_block]

    def settle(self, step: Step, acc: np.ndarray, reported, explicit: bool) -> None:
        """acc: accepted tokens per entry (int64 [num_seqs]); reported: the generation entries' input tokens
        (args.generation_tokens) or None; explicit: the caller gave accepted counts (rejections rewind)."""
        reqs, ledger = self.requests, self.ledger
        rows, tokens, entries = step.index_rows, step.num_tokens, None
        live = range(step.num_contexts)     # the live contexts
        if step.moves != reqs.moves:        # a request moved since the prepare: skip entries no longer live
            entries = np.flatnonzero(reqs.incarnation[rows] == step.incarnations)
            rows, acc, tokens = rows[entries], acc[entries], tokens[entries]
            live = entries[entries < step.num_contexts]
        rejected = tokens - acc if explicit else None
        rewinds = np.flatnonzero(rejected) if rejected is not None else ()
        for i in rewinds:
            rid = step.request_ids[i if entries is None else entries[i]]
            if rejected[i] > self.spec.max_rewind:
                raise CapacityExceededError(f"request {rid!r}: rejecting {rejected[i]} tokens exceeds "
                                            f"max_rewind={self.spec.max_rewind}")
            if reqs.last_scheduled[rows[i]] != step.id:
                raise StepOrderError(f"request {rid!r}: cannot reject tokens of step {step.id}: a later step "
                                     f"{reqs.last_scheduled[rows[i]]} already scheduled it")
        tag = ledger.last_prepared
        hist = reqs.hist[rows] + acc
        reqs.hist[rows] = hist
        for i in rewinds:
            cap, row = int(reqs.cap[rows[i]]), int(rows[i])
            reqs.set_capacity(row, cap - rejected[i])
            for g in self.layout.groups:
                lo, hi = g.rewind_blocks(cap, int(rejected[i]))
                self._release(g.index, self.page_table.cells(g.index, row, np.arange(lo, hi)), tag)
        # the chunks' scratch slots, one release per group (in chunk order, as releases one by one would)
        if len(live):
            per_chunk = [reqs.get(step.request_ids[i]).scratch.pop(step.id, ()) for i in live]
            per_chunk = [held for held in per_chunk if len(held)]
            if per_chunk:
                self.release_scratch([np.concatenate(held) for held in zip(*per_chunk)], tag)
        self.prefix.settle(step, entries, rows, hist, acc, reported)
        self._release_stale(rows, hist, tag)

    def _release_stale(self, rows: np.ndarray, hist: np.ndarray, tag: int) -> None:
        """Release the SWA blocks that fell out of the window now that `rows` have `hist` tokens settled:
        per row and group [stale_done, stale_end). Only rows whose stale end crossed a block boundary this
        step release anything; stale_done starts at the sink blocks."""
        for g in self._windowed:
            end = g.stale_end(hist)
            stale_done = self.requests.stale_done[g.index]      # (a row view, then a gather: cheaper than a 2-D one)
            done = stale_done[rows]
            moved = (end > done).nonzero()[0]
            if len(moved):
                r, hi = rows[moved], end[moved]
                self.prefix.release_window(g, r, done[moved], hi, tag)
                stale_done[r] = hi

    def _release(self, p: int, cells: np.ndarray, tag: int) -> None:
        """Let go of the slots held at these flat cells of group p and clear the cells; slots left with no
        holder are quarantined."""
        _, slots = self.page_table.take(cells)
        self.pools[p].release(slots, tag)

    def release_scratch(self, per_group: Sequence[np.ndarray], tag: int) -> None:
        """Let go of scratch slots (per group), quarantined until the steps that may read them finish."""
        for p, slots in enumerate(per_group):
            self.pools[p].release(slots, tag)
