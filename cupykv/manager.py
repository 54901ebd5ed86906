"""KVCacheManager: requests, slots, the host page table, and the per-step pipeline.

The host page table is the only source of truth. Each prepare_batch snapshots what the device needs
(the table cells changed since the last step, the batch's rows, the scratch metadata) into a pinned ring
slot that nobody writes until its copy has completed, then enqueues one copy, one delta-apply kernel
and one conversion kernel on the manager's stream. The scheduler may change the host state right after;
the step's tables still describe the state at its prepare.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .allocator import SlotPool
from .backends import make_backend
from .errors import (CapacityExceededError, DuplicateRequestError, InvalidRequestError, InvalidSpecError,
                     OutOfSlotsError, StepOrderError, UnknownRequestError)
from .layout import BAD, Layout, cdiv
from .spec import CacheSpec
from .staging import HEADER_WORDS, SnapshotRing, pack_snapshot, snapshot_words

RequestId = Hashable
STAGING_MODES = ("snapshot", "unsafe")


@dataclass
class Request:
    """Host-side state of one request. The table row itself lists the request's slots."""

    rid: RequestId
    row: int
    prompt_len: int
    history: int = 0            # tokens whose KV is final (settled)
    capacity: int = 0           # tokens with KV space reserved (history + tokens in flight)
    stale_done: List[int] = field(default_factory=list)   # per group: blocks below this were released
    pending: List["Step"] = field(default_factory=list)   # prepared, not yet settled, in order
    scratch: Dict[int, List[np.ndarray]] = field(default_factory=dict)  # step id -> scratch slots per group


@dataclass
class _Consts:
    """Per-manager constants the kernels need (host copies and device copies)."""

    num_groups: int
    num_layers: int
    rows: int
    max_batch: int
    max_blocks: int
    layer_group: np.ndarray
    layer_koff: np.ndarray
    group_scale: np.ndarray
    tokens_per_block: int
    d_layer_group: object = None
    d_layer_koff: object = None
    d_group_scale: object = None


class Step:
    """One prepared step: its batch, its tables on the device, and the events that order it.

    Consumers wait on `ready` before reading `tables`, and call finish(stream) after their last read.
    """

    def __init__(self, manager: "KVCacheManager", step_id: int, entries: List[Request], tokens: np.ndarray,
                 starts: np.ndarray, num_contexts: int):
        self.manager = manager
        self.id = step_id
        self.entries = entries                      # batch order, contexts first
        self.request_ids = [r.rid for r in entries]
        self.rows = np.array([r.row for r in entries], np.int32)   # = copy_idx
        self.num_tokens = tokens                    # tokens scheduled per entry
        self.start_positions = starts               # sequence position of each entry's first new token
        self.num_contexts = num_contexts
        self.ready = None                           # event: tables are written
        self.finished = None                        # event: the consumer's last read
        self.settled = False
        # Scratch metadata of the contexts, per group: block range [begs, ends) and the shared slots.
        self.scratch_begs: Optional[np.ndarray] = None     # [P, num_contexts]
        self.scratch_ends: Optional[np.ndarray] = None     # [P, num_contexts]
        self.scratch_slots: Optional[np.ndarray] = None    # [P, num_contexts, M]

    @property
    def num_seqs(self) -> int:
        return len(self.entries)

    @property
    def tables(self):
        """The output buffer (fixed address): [L, max_batch, 2, B] PER_LAYER or [P, max_batch, 2, B]
        SHARED. Rows < num_seqs belong to this step until the next step is prepared."""
        return self.manager.out

    def finish(self, stream=None) -> None:
        """Record that the consumer (on `stream`, default: the manager stream) is done reading."""
        if self.finished is not None:
            raise StepOrderError(f"step {self.id} was already finished")
        be = self.manager.backend
        self.finished = be.record(stream if stream is not None else be.stream)

    def is_complete(self) -> bool:
        return self.finished is not None and self.finished.done()

    def __repr__(self) -> str:
        return f"Step(id={self.id}, num_seqs={self.num_seqs}, num_contexts={self.num_contexts})"


class KVCacheManager:
    """Paged KV cache bookkeeping and per-step page tables for models with mixed attention windows.

    backend: "auto" (GPU when usable, else the host backend), "cuda" or "host".
    staging: "snapshot" (the default, race-free) or "unsafe" (copies straight from live host buffers
        and from pinned arrays dropped after enqueue; it exists only to prove that the race tests
        catch the race; never use it).
    max_steps_in_flight: prepared steps whose finish event has not completed; more is an error.
    """

    def __init__(self, spec: CacheSpec, backend: Union[str, object] = "auto", *, staging: str = "snapshot",
                 ring_slots: int = 4, max_ring_slots: int = 64, staging_timeout_s: float = 10.0,
                 max_steps_in_flight: int = 64, debug_verify_mirror: bool = False):
        if staging not in STAGING_MODES:
            raise InvalidSpecError(f"staging={staging!r}: must be one of {STAGING_MODES}")
        self.spec = spec
        self.layout = Layout(spec)
        self.backend = make_backend(backend) if isinstance(backend, str) else backend
        self.staging = staging
        self.max_steps_in_flight = max_steps_in_flight
        self.debug_verify_mirror = debug_verify_mirror
        lay, be = self.layout, self.backend
        P, rows, B = lay.num_groups, spec.max_batch, lay.max_blocks
        self.pools = [SlotPool(n) for n in lay.slots_per_group]
        # The host table lives in pinned memory so that the unsafe mode can DMA from it directly; the
        # snapshot mode never does.
        self.table = be.pinned_empty(P * rows * B).reshape(P, rows, B)
        self.table.fill(BAD)
        self._dirty: List[np.ndarray] = []
        self._requests: Dict[RequestId, Request] = {}
        self._free_rows = list(range(rows))
        heapq.heapify(self._free_rows)
        self._consts = _Consts(P, lay.num_layers, rows, spec.max_batch, B, lay.layer_group, lay.layer_koff,
                               lay.group_scale, lay.tpb)
        self._consts.d_layer_group = be.upload(lay.layer_group)
        self._consts.d_layer_koff = be.upload(lay.layer_koff)
        self._consts.d_group_scale = be.upload(lay.group_scale)
        self.mirror = be.device_full((P, rows, B), BAD, np.int32)
        out_planes = P if spec.table_mode == "shared" else lay.num_layers
        self.out = be.device_full((out_planes, spec.max_batch, 2, B), BAD, np.int32)
        # Where each new token's K/V goes: page index of its K page per layer (V is K + 1) and the
        # position inside the page, in batch order.
        self.write_pages = be.device_full((lay.num_layers, spec.step_token_capacity), BAD, np.int32)
        self.write_offsets = be.device_full((spec.step_token_capacity,), 0, np.int32)
        base_words = snapshot_words(spec.max_batch, 0, P, 0, 64, 1024)
        self.ring = SnapshotRing(be, base_words, ring_slots, max_ring_slots, staging_timeout_s)
        self._next_step_id = 0
        self._last_prepared = -1
        self._finished_through = -1
        self._in_flight: List[Step] = []       # prepared, finish event not yet complete, in id order
        self._unsettled: List[Step] = []
        self._last_step: Optional[Step] = None
        self._scratch_held = [0] * P
        self.h2d_bytes_last_step = 0
        self._unsafe_dev = None
        be.synchronize()                       # buffers initialised before any step uses them

    # -- requests --------------------------------------------------------------------------------
    def add(self, rid: RequestId, prompt_len: int) -> None:
        """Register a request with a prompt of prompt_len tokens; it takes the lowest free table row."""
        if rid in self._requests:
            raise DuplicateRequestError(f"request {rid!r} is already added")
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or prompt_len <= 0:
            raise InvalidRequestError(f"request {rid!r}: prompt_len={prompt_len!r} must be a positive int")
        if prompt_len > self.spec.max_seq_len:
            raise CapacityExceededError(
                f"request {rid!r}: prompt_len={prompt_len} exceeds max_seq_len={self.spec.max_seq_len}")
        if not self._free_rows:
            raise CapacityExceededError(f"request {rid!r}: all max_batch={self.spec.max_batch} rows are in use")
        row = heapq.heappop(self._free_rows)
        self._requests[rid] = Request(rid, row, int(prompt_len),
                                      stale_done=[self.layout.sink_blocks(g) for g in self.layout.groups])

    def free(self, rid: RequestId) -> None:
        """Release every slot of the request (quarantined until the steps that may read them finish)."""
        req = self._request(rid)
        tag = self._last_prepared
        for g in self.layout.groups:
            row = self.table[g.index, req.row]
            held = np.flatnonzero(row != BAD)
            self.pools[g.index].release(row[held], tag)
            self._set_cells(g.index, req.row, held, BAD)
        for slots in req.scratch.values():
            for p, s in enumerate(slots):
                self.pools[p].release(s, tag)
                self._scratch_held[p] -= len(s)
        req.scratch.clear()
        del self._requests[rid]
        heapq.heappush(self._free_rows, req.row)

    def __contains__(self, rid: RequestId) -> bool:
        return rid in self._requests

    def request(self, rid: RequestId) -> Request:
        return self._request(rid)

    @property
    def request_ids(self) -> List[RequestId]:
        return list(self._requests)

    def _request(self, rid: RequestId) -> Request:
        try:
            return self._requests[rid]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {rid!r}") from None

    # -- steps -----------------------------------------------------------------------------------
    def prepare_batch(self, contexts: Union[Mapping[RequestId, int], Sequence[Tuple[RequestId, int]]] = (),
                      generation: Iterable[RequestId] = (), num_gen_tokens: int = 1) -> Step:
        """Schedule one step and enqueue its tables.

        contexts: request id -> tokens of its next prefill chunk. generation: request ids that decode
        num_gen_tokens tokens each (more than one for speculative decoding). Contexts come first in the
        batch. Slots are reserved for every new token (all or nothing), the step's inputs are
        snapshotted, and the copy and kernels are enqueued on the manager stream. Returns the Step.
        """
        ctx_items = list(contexts.items()) if isinstance(contexts, Mapping) else [tuple(c) for c in contexts]
        gen_ids = list(generation)
        plan = self._plan(ctx_items, gen_ids, num_gen_tokens)
        return self._commit(plan)

    def _plan(self, ctx_items, gen_ids, num_gen_tokens) -> dict:
        """Validate a step and work out what it needs; touches no state."""
        spec, lay = self.spec, self.layout
        if self._last_step is not None and self._last_step.finished is None:
            raise StepOrderError(f"step {self._last_step.id} is not finished: call step.finish(stream) "
                                 "after its consumer's last read, before preparing the next step "
                                 "(the next step overwrites its tables)")
        if isinstance(num_gen_tokens, bool) or not isinstance(num_gen_tokens, (int, np.integer)) \
                or num_gen_tokens <= 0:
            raise InvalidRequestError(f"num_gen_tokens={num_gen_tokens!r} must be a positive int")
        seen = set()
        entries, tokens, scratch = [], [], []
        for rid, n in ctx_items:
            req = self._request(rid)
            if rid in seen:
                raise DuplicateRequestError(f"request {rid!r} appears twice in one step")
            seen.add(rid)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
                raise InvalidRequestError(f"request {rid!r}: context chunk of {n!r} tokens; must be a positive int")
            if req.capacity + n > req.prompt_len:
                raise InvalidRequestError(f"request {rid!r}: chunk of {n} tokens goes past its prompt "
                                          f"({req.capacity} of {req.prompt_len} already scheduled)")
            entries.append(req)
            tokens.append(int(n))
        for rid in gen_ids:
            req = self._request(rid)
            if rid in seen:
                raise DuplicateRequestError(f"request {rid!r} appears twice in one step")
            seen.add(rid)
            if req.capacity < req.prompt_len:
                raise InvalidRequestError(f"request {rid!r}: cannot decode before its whole prompt is scheduled "
                                          f"({req.capacity} of {req.prompt_len} tokens)")
            if req.capacity + num_gen_tokens > spec.max_seq_len:
                raise CapacityExceededError(
                    f"request {rid!r}: {req.capacity} + {num_gen_tokens} tokens exceeds max_seq_len="
                    f"{spec.max_seq_len}")
            entries.append(req)
            tokens.append(int(num_gen_tokens))
        num_contexts = len(ctx_items)
        if sum(tokens) > spec.step_token_capacity:
            raise CapacityExceededError(f"the step schedules {sum(tokens)} tokens; max_step_tokens="
                                        f"{spec.step_token_capacity}")
        # Blocks that need a slot of their own, and scratch, per group.
        need = [0] * lay.num_groups
        new_blocks = []          # per entry, per group: (lo, hi, scratch_lo, scratch_hi)
        for k, (req, n) in enumerate(zip(entries, tokens)):
            old, new = req.capacity, req.capacity + n
            per_group = []
            for g in lay.groups:
                lo, hi = cdiv(old, lay.tpb), cdiv(new, lay.tpb)
                s_lo, s_hi = lay.scratch_range(g, old, new) if k < num_contexts else (0, 0)
                n_scratch = s_hi - s_lo
                need[g.index] += (hi - lo) - n_scratch + lay.scratch_slots_needed(g, n_scratch)
                per_group.append((lo, hi, s_lo, s_hi))
            new_blocks.append(per_group)
        for p, pool in enumerate(self.pools):
            if need[p] > self._available(p):
                self._wait_for_slots(p, need[p])
                if need[p] > self._available(p):
                    raise OutOfSlotsError(
                        f"group {p} (window={lay.groups[p].window}) needs {need[p]} slots for this step; "
                        f"{self._available(p)} free, "
                        f"{pool.num_quarantined} quarantined by unfinished steps")
        if len(self._in_flight) - self._completed_count() >= self.max_steps_in_flight:
            raise StepOrderError(f"{len(self._in_flight)} steps are in flight (max_steps_in_flight="
                                 f"{self.max_steps_in_flight}); their finish events have not completed")
        new_cells = sum(hi - lo for per in new_blocks for (lo, hi, _, _) in per)
        pending_cells = sum(len(d) for d in self._dirty)
        M = max([lay.scratch_slots_needed(g, s_hi - s_lo)
                 for per in new_blocks[:num_contexts] for g, (_, _, s_lo, s_hi) in zip(lay.groups, per)] or [0])
        words = snapshot_words(len(entries), num_contexts, lay.num_groups, M,
                               new_cells + pending_cells, new_cells + pending_cells)
        slot = self.ring.acquire(words) if self.staging == "snapshot" else None
        return dict(entries=entries, tokens=tokens, num_contexts=num_contexts, new_blocks=new_blocks,
                    scratch_width=M, ring_slot=slot)

    def _commit(self, plan: dict) -> Step:
        """Allocate, write the host table, pack the snapshot and enqueue; cannot fail after _plan."""
        self._poll()
        lay, be = self.layout, self.backend
        entries, tokens, C = plan["entries"], plan["tokens"], plan["num_contexts"]
        P, M = lay.num_groups, plan["scratch_width"]
        step_id = self._next_step_id
        begs = np.zeros((P, C), np.int32)
        ends = np.zeros((P, C), np.int32)
        scratch = np.zeros((P, C, M), np.int32)
        starts = np.array([r.capacity for r in entries], np.int64)
        for k, (req, n, per_group) in enumerate(zip(entries, tokens, plan["new_blocks"])):
            held = []
            for g, (lo, hi, s_lo, s_hi) in zip(lay.groups, per_group):
                pool = self.pools[g.index]
                own = np.array([b for b in range(lo, hi) if not s_lo <= b < s_hi], np.int64)
                if len(own):
                    self._set_cells(g.index, req.row, own, pool.allocate(len(own)))
                if s_hi > s_lo:
                    s = pool.allocate(lay.scratch_slots_needed(g, s_hi - s_lo))
                    begs[g.index, k], ends[g.index, k] = s_lo, s_hi
                    scratch[g.index, k, :len(s)] = s
                    self._scratch_held[g.index] += len(s)
                    held.append(s)
                else:
                    held.append(np.empty(0, np.int32))
            if any(len(h) for h in held):
                req.scratch[step_id] = held
            req.capacity += n
        step = Step(self, step_id, entries, np.array(tokens, np.int64), starts, C)
        for req in entries:
            req.pending.append(step)
        cu_tokens = np.concatenate(([0], np.cumsum(tokens))).astype(np.int32)
        self._enqueue(step, plan["ring_slot"], begs, ends, scratch, cu_tokens)
        self._next_step_id += 1
        self._last_prepared = step_id
        self._last_step = step
        self._in_flight.append(step)
        self._unsettled.append(step)
        return step

    def _enqueue(self, step: Step, slot, begs, ends, scratch, cu_tokens) -> None:
        be, st = self.backend, self.backend.stream
        cells = np.unique(np.concatenate(self._dirty)) if self._dirty else np.empty(0, np.int64)
        self._dirty.clear()
        step.scratch_begs, step.scratch_ends, step.scratch_slots = begs, ends, scratch
        start_pos = step.start_positions.astype(np.int32)
        prev = self._in_flight[-1] if self._in_flight else None
        if prev is not None:
            be.wait(st, prev.finished)     # the previous consumer's reads come before our writes
        if self.staging == "snapshot":
            values = self.table.reshape(-1)[cells]
            words = pack_snapshot(slot.host, step.id, step.rows, begs, ends, scratch, cells, values,
                                  cu_tokens, start_pos)
            be.copy_h2d(slot.dev, slot.host, words, st)
            slot.copied = be.record(st)
            snap = slot.dev
            num_runs = int(slot.host[1])
            self.h2d_bytes_last_step = words * 4
        else:
            # UNSAFE: a pinned array from the pool, dropped right after enqueue, and a copy of the live
            # table. Both are read when the copy runs, not now.
            # Sized for the largest batch, as a persistent metadata buffer would be: every step (and any
            # other pinned allocation of that size class) gets the block the previous one dropped.
            words = snapshot_words(self.spec.max_batch, self.spec.max_batch, self.layout.num_groups,
                                   max(16, scratch.shape[2]), 0, 0)
            tmp = be.pinned_temp(words)
            empty = np.empty(0, np.int64)
            words = pack_snapshot(tmp, step.id, step.rows, begs, ends, scratch, empty, empty, cu_tokens, start_pos)
            if self._unsafe_dev is None or len(self._unsafe_dev) < words:
                self._unsafe_dev = be.device_empty(max(words, 4096))
            snap = self._unsafe_dev
            be.copy_h2d(snap, tmp, words, st)
            be.copy_h2d(self.mirror, self.table, self.table.size, st)
            num_runs = 0
            self.h2d_bytes_last_step = (words + self.table.size) * 4
            del tmp
        be.apply_deltas(st, snap, self.mirror, self._consts, num_runs=num_runs)
        shared = self.spec.table_mode == "shared"
        be.convert(st, snap, self.mirror, self.out, self._consts, shared, num_seqs=step.num_seqs)
        be.write_positions(st, snap, self.out, self.write_pages, self.write_offsets, self._consts, shared,
                           num_tokens=int(cu_tokens[-1]))
        step.ready = be.record(st)
        if self.debug_verify_mirror:
            self.verify_mirror()

    def settle(self, step: Step, accepted: Union[None, Mapping[RequestId, int], Sequence[int]] = None) -> None:
        """The step's tokens are final: history advances by the accepted tokens.

        accepted: None (all scheduled tokens), a mapping request id -> accepted tokens, or a sequence in
        batch order. Context chunks are always accepted whole. Rejected speculative tokens are rewound
        (at most max_rewind per request). SWA blocks that fell out of the window are released, scratch
        slots of the step's contexts too; released slots stay quarantined until the steps that may read
        them have finished.
        """
        if step.manager is not self:
            raise StepOrderError("this step belongs to another manager")
        if step.settled:
            raise StepOrderError(f"step {step.id} is already settled")
        if not self._unsettled or self._unsettled[0] is not step:
            raise StepOrderError(f"settle steps in the order they were prepared: step "
                                 f"{self._unsettled[0].id if self._unsettled else None} comes before {step.id}")
        acc = self._accepted(step, accepted)
        live = [(k, req) for k, req in enumerate(step.entries) if self._requests.get(req.rid) is req]
        for k, req in live:
            rejected = int(step.num_tokens[k]) - acc[k]
            if rejected:
                if rejected > self.spec.max_rewind:
                    raise CapacityExceededError(f"request {req.rid!r}: rejecting {rejected} tokens exceeds "
                                                f"max_rewind={self.spec.max_rewind}")
                if req.pending[-1] is not step:
                    raise StepOrderError(f"request {req.rid!r}: cannot reject tokens of step {step.id} while a "
                                         f"later step {req.pending[-1].id} already scheduled it")
        tag = self._last_prepared
        for k, req in live:
            req.pending.remove(step)
            req.history += acc[k]
            rejected = int(step.num_tokens[k]) - acc[k]
            if rejected:
                old = req.capacity
                req.capacity -= rejected
                self._release_blocks(req, cdiv(req.capacity, self.layout.tpb), cdiv(old, self.layout.tpb), tag)
            for p, s in enumerate(req.scratch.pop(step.id, ())):
                self.pools[p].release(s, tag)
                self._scratch_held[p] -= len(s)
            for g in self.layout.groups:
                lo, hi = self.layout.stale_range(g, req.history)
                if hi > req.stale_done[g.index]:
                    self._release_blocks(req, req.stale_done[g.index], hi, tag, only=g.index)
                    req.stale_done[g.index] = hi
        step.settled = True
        self._unsettled.pop(0)

    def _accepted(self, step: Step, accepted) -> List[int]:
        n = [int(t) for t in step.num_tokens]
        if accepted is None:
            return n
        if isinstance(accepted, Mapping):
            index = {rid: k for k, rid in enumerate(step.request_ids)}
            out = list(n)
            for rid, a in accepted.items():
                if rid not in index:
                    raise UnknownRequestError(f"request {rid!r} is not in step {step.id}")
                out[index[rid]] = a
        else:
            out = list(accepted)
            if len(out) != len(n):
                raise InvalidRequestError(f"accepted has {len(out)} entries; step {step.id} has {len(n)}")
        for k, a in enumerate(out):
            rid = step.request_ids[k]
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or not 0 <= a <= n[k]:
                raise InvalidRequestError(f"request {rid!r}: accepted={a!r} must be an int in [0, {n[k]}]")
            if k < step.num_contexts and a != n[k]:
                raise InvalidRequestError(f"request {rid!r}: a context chunk is accepted whole ({n[k]} tokens)")
        return [int(a) for a in out]

    def _release_blocks(self, req: Request, lo: int, hi: int, tag: int, only: Optional[int] = None) -> None:
        for g in self.layout.groups:
            if only is not None and g.index != only:
                continue
            cells = self.table[g.index, req.row, lo:hi]
            held = np.flatnonzero(cells != BAD)
            if len(held):
                self.pools[g.index].release(cells[held], tag)
                self._set_cells(g.index, req.row, held + lo, BAD)

    def _set_cells(self, p: int, row: int, blocks: np.ndarray, values) -> None:
        self.table[p, row, blocks] = values
        B = self.layout.max_blocks
        self._dirty.append((p * self.spec.max_batch + row) * B + np.asarray(blocks, np.int64))

    # -- completion ------------------------------------------------------------------------------
    def _completed_count(self) -> int:
        """How many in-flight steps, from the oldest on, have completed (observes; changes nothing)."""
        k = 0
        while k < len(self._in_flight) and self._in_flight[k].is_complete():
            k += 1
        return k

    def _available(self, p: int) -> int:
        """Slots of group p that allocation could use now: free, plus quarantine already lifted."""
        k = self._completed_count()
        through = self._in_flight[k - 1].id if k else self._finished_through
        return self.pools[p].num_free + self.pools[p].quarantined_through(through)

    def _poll(self) -> None:
        """Advance the finished watermark over completed steps and lift their quarantine."""
        k = self._completed_count()
        if k:
            self._finished_through = self._in_flight[k - 1].id
            del self._in_flight[:k]
        for pool in self.pools:
            pool.reclaim(self._finished_through)

    def _wait_for_slots(self, p: int, need: int) -> None:
        """Wait for finish events (oldest first) when the quarantine of group p can cover the shortfall."""
        if self.pools[p].num_free + self.pools[p].num_quarantined < need:
            return
        for step in self._in_flight:
            if self._available(p) >= need or step.finished is None:
                return
            step.finished.wait(self.ring.timeout_s)

    def reclaim(self, wait: bool = False) -> None:
        """Lift the quarantine of steps that have finished; with wait=True, wait for all finish events."""
        if wait:
            for step in list(self._in_flight):
                if step.finished is not None:
                    step.finished.wait(self.ring.timeout_s)
        self._poll()

    @property
    def steps_in_flight(self) -> List[Step]:
        """Prepared steps whose finish event has not completed (or that were not finished yet)."""
        self._poll()
        return list(self._in_flight)

    def synchronize(self) -> None:
        self.backend.synchronize()
        self._poll()

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Slots per group (free / owned / scratch / quarantined / total), requests and steps."""
        self._poll()
        groups = []
        for g, pool in zip(self.layout.groups, self.pools):
            scratch = self._scratch_held[g.index]
            owned = pool.total - pool.num_free - pool.num_quarantined - scratch
            groups.append(dict(window=g.window, layers=g.num_layers, total=pool.total, free=pool.num_free,
                               owned=owned, scratch=scratch, quarantined=pool.num_quarantined))
        return dict(groups=groups, requests=len(self._requests), steps_in_flight=len(self._in_flight),
                    steps_unsettled=len(self._unsettled), ring_slots=len(self.ring.slots))

    def verify_mirror(self) -> None:
        """Debug: wait for the manager stream and check the device mirror against the host table.

        Cells changed since the last prepare are skipped: the mirror holds their value at that prepare.
        """
        self.backend.stream.synchronize()
        mirror = self.backend.to_numpy(self.mirror).reshape(-1)
        ok = np.ones(mirror.size, bool)
        if self._dirty:
            ok[np.concatenate(self._dirty)] = False
        bad = np.flatnonzero(ok & (mirror != self.table.reshape(-1)))
        if len(bad):
            raise AssertionError(f"device mirror differs from the host table at {len(bad)} cells, "
                                 f"first flat index {int(bad[0])}")

    def state(self) -> tuple:
        """A comparable snapshot of every piece of host state (tests compare it around failing calls)."""
        reqs = tuple((repr(r.rid), r.row, r.prompt_len, r.history, r.capacity, tuple(r.stale_done),
                      tuple(s.id for s in r.pending),
                      tuple((k, tuple(a.tobytes() for a in v)) for k, v in sorted(r.scratch.items())))
                     for r in self._requests.values())
        return (self.table.tobytes(), tuple(np.concatenate(self._dirty).tolist()) if self._dirty else (),
                reqs, tuple(sorted(self._free_rows)), tuple(p.state() for p in self.pools),
                self._next_step_id, tuple(s.id for s in self._unsettled), tuple(self._scratch_held))
