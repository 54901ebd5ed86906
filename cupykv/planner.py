"""Planning a step: validate prepare_batch's arguments against the live state and work out everything the
step needs (its chunks' slots and scratch, the blocks its decode tokens open, the slots to count, a ring
slot for its snapshot), without changing any state but the validated-list cache. The manager commits the
plan (KVCacheManager._commit); a plan that raises leaves everything as it was.

    StepPlanner.plan_in_room   a decode step of the last validated list whose room holds its tokens
                               (GenBatch.has_room): no slot to take, none of plan's counting
    StepPlanner.plan           every other step
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from .errors import CapacityExceededError, DuplicateRequestError, InvalidRequestError, OutOfSlotsError, StepOrderError
from .entries import most_rebuilt
from .layout import NO_INDEX
from .requests import GenBatch
from .args import as_count
from .chunks import ChunkSlots
from .staging import snapshot_words
from .table import expand_ranges


@dataclass
class Plan:
    """What a validated step needs; made by StepPlanner without changing any state."""
    ctx_ids: list
    ctx_rows: List[int]
    ctx_tokens: List[int]
    ctx_slots: List[ChunkSlots]       # per group
    gen_ids: list
    gen: Optional[GenBatch]
    gen_cap: np.ndarray                # capacity of each generation entry before this step
    gen_end: np.ndarray                # and after it (gen_cap + k)
    gen_longest: int                   # gen_end's largest (0 without generation entries)
    new_rows: np.ndarray               # (row, block) pairs the generation tokens open
    new_blocks: np.ndarray
    gen_room: int                      # a pure decode step: the list's room after it (GenBatch.room), or -1
    gen_known: bool                    # a pure decode step knew the list's capacities (GenBatch.knows)
    gen_phased: bool                   # and took its openings from the list's phase order
    k: int
    scratch_width: int
    pad_to: int
    ring_slot: object


class StepPlanner:
    """The plan half of prepare_batch (plan -> commit): reads the manager's parts, changes none of them."""

    def __init__(self, spec, layout, requests, ledger, page_table, pools, pipeline, prefix,
                 max_steps_in_flight: int):
        self.spec, self.layout, self.requests, self.ledger = spec, layout, requests, ledger
        self.page_table, self.pools, self.pipeline, self.prefix = page_table, pools, pipeline, prefix
        self.max_steps_in_flight = max_steps_in_flight
        self.no_chunks = [ChunkSlots() for _ in layout.groups]     # a step without contexts (never added to)

    def plan_in_room(self, gen: GenBatch, gen_ids: list, k: int, pad_to: Optional[int]) -> Optional[Plan]:
        """The plan of a decode step of the last validated list `gen`, whose room holds k tokens an entry
        (GenBatch.has_room: no entry opens a block or passes max_seq_len): most steps of a small batch. Such
        a step takes no slot, so it needs none of plan's counting. None when gen_ids are not that list, and
        for a step that plan would refuse (it raises the error) or whose in-flight steps it would wait for.
        pad_to: None (no padding) or a count."""
        reqs, ledger, spec = self.requests, self.ledger, self.spec
        latest = ledger.latest
        if (not gen.matches(gen_ids, reqs.moves) or (latest is not None and not latest.is_finished())
                or ledger.num_steps_in_flight() >= self.max_steps_in_flight):
            return None
        n = len(gen.rows)
        live = n if pad_to is None else pad_to      # (an explicit pad_to of 0 is out of range: plan says so)
        if not n <= live <= spec.max_batch or k * n > spec.step_token_capacity:
            return None
        cap = reqs.cap[gen.rows]
        words = self.snapshot_bound(n, 0, 0, self.page_table.num_logged(), live)
        return Plan([], [], [], self.no_chunks, gen_ids, gen, cap, cap + gen.tokens_for(k), gen.longest + k,
                     NO_INDEX, NO_INDEX, gen.room - k, True, False, k, 0, 0 if pad_to is None else pad_to,
                     self.pipeline.acquire(words))

    def snapshot_bound(self, num_seqs: int, num_contexts: int, scratch_width: int, cells: int, live: int) -> int:
        """The most words a step's snapshot can take: every changed cell a run of its own, the most entries
        a DELTA step rebuilds, every entry past the `live` ones (the batch and its padding) held."""
        return snapshot_words(num_seqs, num_contexts, self.layout.num_groups, scratch_width, cells, cells,
                              most_rebuilt(live), self.spec.max_batch - live)

    def plan(self, ctx_items: list, gen_ids: list, k: int, pad_to: Optional[int]) -> Plan:
        """Validate a step and work out what it needs; changes no state but the validated-list cache.
        pad_to: None (no padding) or a count, checked against the batch after its ids are."""
        spec, lay, reqs, ledger = self.spec, self.layout, self.requests, self.ledger
        if ledger.latest is not None and not ledger.latest.is_finished():
            latest = ledger.latest
            where = f" on device(s) {latest.unfinished_ranks()}" if len(latest.parts) > 1 else ""
            raise StepOrderError(f"step {latest.id} is not finished{where}: call step.finish(stream) "
                                 "(step.on(rank).finish(stream) per device) after its consumer's last read, "
                                 "before preparing the next step (the next step overwrites its tables)")
        ctx_rows, ctx_tokens = [], []
        ctx_slots = [ChunkSlots() for _ in lay.groups] if ctx_items else self.no_chunks
        ctx_cells = M = 0
        row_start = self.page_table.row_start
        for rid, n in ctx_items:          # few per step, checked one by one
            row = reqs.get(rid).row
            if reqs.parked[row]:
                reqs.check_schedulable(rid, row)
            if row in ctx_rows:
                raise DuplicateRequestError(f"request {rid!r} appears twice in one step")
            n = as_count(n, f"request {rid!r}: context chunk", minimum=1, maximum=spec.max_seq_len)
            old, prompt = int(reqs.cap[row]), int(reqs.prompt[row])
            if old + n > prompt:
                raise InvalidRequestError(f"request {rid!r}: chunk of {n} tokens goes past its prompt "
                                          f"({old} of {prompt} already scheduled)")
            for g, chunks in zip(lay.groups, ctx_slots):
                lo, hi = g.new_blocks(old, old + n)
                # with prefix caching, retained windows are kept out of the scratch range
                s_lo, s_hi = self.prefix.scratch_range(g, row, old, old + n)
                sc = g.scratch_slots_needed(s_hi - s_lo)
                chunks.add(len(ctx_rows), row_start(g.index, row), lo, hi, s_lo, s_hi, sc)
                ctx_cells += hi - lo
                M = max(M, sc)
            ctx_rows.append(row)
            ctx_tokens.append(n)
        gen = reqs.generation_batch(gen_ids, ctx_rows)
        gen_rows = gen.rows if gen is not None else NO_INDEX
        if pad_to is None:
            pad_to = 0
        elif not len(ctx_rows) + len(gen_rows) <= pad_to <= spec.max_batch:
            raise InvalidRequestError(f"pad_to={pad_to} must be in [{len(ctx_rows) + len(gen_rows)}, "
                                      f"{spec.max_batch}] (the step's entries, max_batch)")
        cap = reqs.cap[gen_rows]
        end = cap + k
        # Within the list's room no entry opens a block or passes max_seq_len (GenBatch.room). A batch whose
        # entries take a block's worth of tokens a step or more nearly always has one at a block's end, and so
        # no room: only smaller ones keep it (working it out costs a few numpy operations).
        decode = gen is not None and not ctx_rows
        known = decode and gen.knows(reqs.cap_writes)
        keeps_room = decode and len(gen_rows) * k < lay.tpb
        longest = gen.longest + k if known else (int(np.maximum.reduce(end)) if len(end) else 0)
        if longest > spec.max_seq_len:
            i = int(np.argmax(end > spec.max_seq_len))
            raise CapacityExceededError(f"request {gen_ids[i]!r}: {cap[i]} + {k} tokens exceeds "
                                        f"max_seq_len={spec.max_seq_len}")
        total_tokens = sum(ctx_tokens) + k * len(gen_rows)
        if total_tokens > spec.step_token_capacity:
            raise CapacityExceededError(f"the step schedules {total_tokens} tokens; max_step_tokens="
                                        f"{spec.step_token_capacity}")
        # The blocks the generation tokens open: the same in every group (generation is never scratch).
        # (A step within the list's room opens none: plan_in_room planned it.)
        g = lay.groups[0]
        phased = gen.openings(k, cap, g) if known and not keeps_room else None
        if phased is not None:      # k divides tpb: at most one block an entry, every tpb / k steps
            opened, new_rows = phased
            new_blocks = g.new_blocks(cap[opened], 0)[0] if len(opened) else NO_INDEX
        else:
            lo, hi = g.new_blocks(cap, end)
            opened = (hi > lo).nonzero()[0]
            if not len(opened):         # most decode steps open no block: skip the gathers
                new_rows = new_blocks = NO_INDEX
            elif k <= lay.tpb:          # k tokens open at most ceil(k / tpb) blocks an entry: one each here
                new_rows, new_blocks = gen_rows[opened], lo[opened]
            else:
                new_rows, new_blocks = expand_ranges(gen_rows[opened], lo[opened], hi[opened])
        room = min(int(g.block_room(end).min()), spec.max_seq_len - longest) if keeps_room else -1
        if len(new_rows) or ctx_rows:       # a step that takes no slot needs no count
            need = [len(new_rows) + chunks.count for chunks in ctx_slots]
            for p, pool in enumerate(self.pools):
                # the free list alone answers the common case; available() also counts lifted quarantine
                if need[p] > pool.num_available and need[p] > ledger.available(p):
                    ledger.wait_for_slots(p, need[p])
                    if need[p] > ledger.available(p):
                        raise OutOfSlotsError(
                            f"group {p} (window={lay.groups[p].window}) needs {need[p]} slots for this step; "
                            f"{ledger.available(p)} free, {pool.num_quarantined - ledger.lifted(p)} quarantined "
                            "by unfinished steps")
        if ledger.num_steps_in_flight() >= self.max_steps_in_flight:
            # the oldest finish events complete by themselves on a GPU (a host backend runs its queued work
            # when waited on): wait for them as for slots, and fail only if they do not complete in time
            if not ledger.wait_for_in_flight(self.max_steps_in_flight):
                raise StepOrderError(f"{ledger.num_steps_in_flight()} steps are in flight (max_steps_in_flight="
                                     f"{self.max_steps_in_flight}); the oldest finish events did not complete "
                                     f"within staging_timeout_s={ledger.timeout_s}")
        cells = self.page_table.num_logged() + lay.num_groups * len(new_rows) + ctx_cells
        # the entries a DELTA step rebuilds, and those held past the batch (at most all the others)
        words = self.snapshot_bound(len(ctx_rows) + len(gen_rows), len(ctx_rows), M, cells,
                                     max(len(ctx_rows) + len(gen_rows), pad_to))
        return Plan([rid for rid, _ in ctx_items] if ctx_items else [], ctx_rows, ctx_tokens, ctx_slots, gen_ids,
                     gen, cap, end, longest, new_rows, new_blocks, room, known, phased is not None, k, M, pad_to,
                     self.pipeline.acquire(words))
