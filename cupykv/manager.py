"""KVCacheManager: requests, slots, the host page table, and the per-step pipeline.

The host page table is the only source of truth. Each prepare_batch snapshots what the device needs
(the table cells changed since the last step, the batch's rows, the scratch metadata) into a pinned ring
slot that nobody writes until its copy has completed, then enqueues one copy, one delta-apply kernel,
one conversion kernel and one write-position kernel on the manager's stream. The scheduler may change
the host state right after; the step's tables still describe the state at its prepare.

Per-request numbers live in arrays indexed by table row, so that a decode step of hundreds of requests
is a handful of numpy operations rather than a Python loop.
"""
from __future__ import annotations

import heapq
from operator import itemgetter
from typing import Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .allocator import SlotPool
from .backends import make_backend
from .errors import (CapacityExceededError, DuplicateRequestError, InvalidRequestError, InvalidSpecError,
                     OutOfSlotsError, StepOrderError, UnknownRequestError)
from .layout import BAD, Layout
from .spec import CacheSpec
from .staging import MODE_DELTA, MODE_FULL, SnapshotRing, pack_snapshot, snapshot_words
from .step import Step, StepOutputs

RequestId = Hashable
STAGING_MODES = ("snapshot", "unsafe")


def _cdiv(a, b):
    return -(-a // b)


def _expand_ranges(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """(row, block) pairs of the non-empty block ranges [lo, hi) of each row (hi > lo), rows in order."""
    count = hi - lo
    if count.max(initial=0) == 1:                     # the decode case: one block per row
        return rows, lo
    first = np.repeat(np.cumsum(count) - count, count)
    return np.repeat(rows, count), np.repeat(lo, count) + (np.arange(int(count.sum())) - first)


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _is_count(n) -> bool:
    return isinstance(n, (int, np.integer)) and not isinstance(n, bool)


class Request:
    """A request's identity and its table row; its numbers live in the manager's per-row arrays."""

    __slots__ = ("rid", "row", "incarnation", "scratch", "_mgr")

    def __init__(self, mgr: "KVCacheManager", rid: RequestId, row: int, incarnation: int):
        self._mgr = mgr
        self.rid = rid
        self.row = row
        self.incarnation = incarnation
        self.scratch: Dict[int, List[np.ndarray]] = {}   # step id -> scratch slots per group (unsettled)

    def _live_row(self) -> int:
        if self._mgr._incarnation[self.row] != self.incarnation:
            raise UnknownRequestError(f"request {self.rid!r} was freed; this Request no longer describes it")
        return self.row

    @property
    def prompt_len(self) -> int:
        return int(self._mgr._prompt[self._live_row()])

    @property
    def history(self) -> int:
        """Tokens whose KV is final (settled)."""
        return int(self._mgr._hist[self._live_row()])

    @property
    def capacity(self) -> int:
        """Tokens with KV space reserved: history plus the tokens of unsettled steps."""
        return int(self._mgr._cap[self._live_row()])

    @property
    def pending(self) -> List[Step]:
        """Prepared steps of this request that are not settled yet, oldest first."""
        return [s for s in self._mgr._unsettled
                if np.any((s.rows == self.row) & (s.incarnations == self.incarnation))]


class _GenBatch:
    """A generation list that passed the lookup, duplicate and readiness checks.

    Decode steps usually schedule the same requests as the step before, so prepare_batch keeps the last
    validated list and skips those checks when the next list is equal to it. It stays valid until the
    next free: only a free changes the row of a listed id (an added id is not in the list), and a request
    that could decode stays able to (its capacity never drops below its prompt: rewinds undo only
    generated tokens). The arrays are shared by the steps that schedule this list, so they are read-only.
    """

    __slots__ = ("ids", "rows", "rows32", "incarnations", "k", "tokens")

    def __init__(self, ids: List[RequestId], rows: np.ndarray, incarnations: np.ndarray):
        self.ids = ids
        self.rows = _frozen(rows)                            # int64, for indexing the per-row arrays
        self.rows32 = _frozen(rows.astype(np.int32))         # Step.rows
        self.incarnations = _frozen(incarnations)
        self.k, self.tokens = 0, rows[:0]                    # num_tokens of the last k asked for

    def matches(self, ids: List[RequestId]) -> bool:
        """Equal ids hash equal (Python's rule for dict keys), so an equal list maps to the same rows."""
        try:
            return ids == self.ids
        except Exception:        # an id whose == misbehaves (an array): let the full checks report it
            return False

    def tokens_for(self, k: int) -> np.ndarray:
        if k != self.k:
            self.k, self.tokens = k, _frozen(np.full(len(self.rows), k, np.int64))
        return self.tokens


class _GenPlan:
    """What the generation entries of a step need: their rows, capacities, and new (row, block) pairs."""

    __slots__ = ("batch", "rows", "cap", "new_rows", "new_blocks")

    def __init__(self, batch: Optional[_GenBatch], rows: np.ndarray, cap: np.ndarray, new_rows: np.ndarray,
                 new_blocks: np.ndarray):
        self.batch = batch           # the validated list, or None when there are no generation entries
        self.rows, self.cap = rows, cap
        self.new_rows, self.new_blocks = new_rows, new_blocks


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class _Consts:
    """Per-manager constants the kernels need (host copies, and device copies for the CUDA backend)."""

    def __init__(self, layout: Layout, max_batch: int, backend):
        self.num_groups, self.num_layers = layout.num_groups, layout.num_layers
        self.rows = self.max_batch = max_batch
        self.max_blocks, self.tokens_per_block = layout.max_blocks, layout.tpb
        self.layer_group, self.layer_koff, self.group_scale = layout.layer_group, layout.layer_koff, layout.group_scale
        self.d_layer_group = backend.upload(layout.layer_group)
        self.d_layer_koff = backend.upload(layout.layer_koff)
        self.d_group_scale = backend.upload(layout.group_scale)


class KVCacheManager:
    """Paged KV cache bookkeeping and per-step page tables for models with mixed attention windows.

    backend: "auto" (GPU when usable, else the host backend), "cuda" or "host".
    staging: "snapshot" (the default, race-free) or "unsafe" (copies straight from the live host table
        and from pinned pool arrays dropped after enqueue; it exists only to prove that the race tests
        catch the race; never use it).
    ring_slots / max_ring_slots / staging_timeout_s: the pinned snapshot ring's initial size, bound, and
        how long prepare waits for a slot once the bound is reached.
    max_steps_in_flight: prepared steps whose finish event has not completed; more is an error.
    debug_verify_mirror: after each prepare, wait and check the device mirror against the host table.
    use_graphs: run each step's device work (snapshot copy, delta apply, conversions, write positions) as
        one CUDA graph replay per ring slot and batch-size bucket instead of separate launches.
    steady_batch_delta: when a decode step has the previous step's batch, row for row, rewrite only the
        output cells whose table entry changed instead of the batch's whole rows.
    """

    def __init__(self, spec: CacheSpec, backend: Union[str, object] = "auto", *, staging: str = "snapshot",
                 ring_slots: int = 4, max_ring_slots: int = 64, staging_timeout_s: float = 10.0,
                 max_steps_in_flight: int = 64, debug_verify_mirror: bool = False, use_graphs: bool = False,
                 steady_batch_delta: bool = True):
        if staging not in STAGING_MODES:
            raise InvalidSpecError(f"staging={staging!r}: must be one of {STAGING_MODES}")
        if not _is_count(ring_slots) or ring_slots < 1 or not _is_count(max_ring_slots) or max_ring_slots < ring_slots:
            raise InvalidSpecError(f"ring_slots={ring_slots!r}, max_ring_slots={max_ring_slots!r}: need "
                                   f"1 <= ring_slots <= max_ring_slots")
        self.spec = spec
        self.layout = lay = Layout(spec)
        self.backend = be = make_backend(backend) if isinstance(backend, str) else backend
        self.staging = staging
        self.max_steps_in_flight = max_steps_in_flight
        self.debug_verify_mirror = debug_verify_mirror
        self.use_graphs = use_graphs
        self.steady_batch_delta = steady_batch_delta
        P, rows, B = lay.num_groups, spec.max_batch, lay.max_blocks
        if P * rows * B >= 2 ** 31:     # the snapshot ships flat table indices as int32
            raise InvalidSpecError(f"CacheSpec: groups x max_batch x max_blocks = {P * rows * B} table cells; "
                                   f"at most 2^31 - 1 (lower max_batch or max_seq_len)")
        self.pools = [SlotPool(n) for n in lay.slots_per_group]
        # Pinned so that the unsafe mode can DMA from it directly; the snapshot mode never does.
        self.table = be.pinned_empty(P * rows * B).reshape(P, rows, B)
        self.table.fill(BAD)
        self._table_flat = self.table.reshape(-1)     # a view: cells are addressed by flat index
        self._dirty: List[np.ndarray] = []            # flat table indices changed since the last step
        self._group_base = np.arange(P, dtype=np.int64)[:, None] * (rows * B)   # flat index of table[p, 0, 0]
        self._group_off = [int(b) for b in self._group_base[:, 0]]             # the same as Python ints
        self._tpb_shift = lay.tpb.bit_length() - 1    # tokens_per_block is a power of two
        # Per-row request state. A row's incarnation counts its tenants, so a step can tell whether the
        # request it scheduled in a row is still the one there.
        self._hist = np.zeros(rows, np.int64)
        self._cap = np.zeros(rows, np.int64)
        self._prompt = np.zeros(rows, np.int64)
        self._incarnation = np.zeros(rows, np.int64)
        self._last_scheduled = np.full(rows, -1, np.int64)      # id of the last step that scheduled the row
        self._stale_done = np.zeros((P, rows), np.int64)        # blocks below this were released (SWA)
        self._sink_blocks = np.array([lay.sink_blocks(g) for g in lay.groups], np.int64)
        self._swa_groups = [g for g in lay.groups if g.window is not None]
        self._requests: Dict[RequestId, Request] = {}
        self._row_of: Dict[RequestId, int] = {}
        self._free_rows = list(range(rows))
        self._gen_batch: Optional[_GenBatch] = None   # the last validated generation list (see _GenBatch)
        self._free_epoch = 0                          # frees so far: a step prepared at the same count is all live
        self._consts = _Consts(lay, spec.max_batch, be)
        # Scratch metadata of a step without contexts (shared by those steps, so read-only).
        self._no_scratch = (_frozen(np.zeros((P, 0), np.int32)), _frozen(np.zeros((P, 0), np.int32)),
                            _frozen(np.zeros((P, 0, 0), np.int32)))
        self.mirror = be.device_full((P, rows, B), BAD, np.int32)
        # (epoch, batch entry) of each row in the last FULL step's batch; DELTA steps look their cells up here
        self.row_entry = be.device_full((rows, 2), -1, np.int32)
        self._epoch = 0
        self._force_full = False     # set when a step's launch failed: the output may hold anything
        out_planes = P if spec.table_mode == "shared" else lay.num_layers
        self.out = be.device_full((out_planes, spec.max_batch, 2, B), BAD, np.int32)
        # Where each new token's K/V goes: K page index per layer (V is K + 1) and position in the page.
        self.write_pages = be.device_full((lay.num_layers, spec.step_token_capacity), BAD, np.int32)
        self.write_offsets = be.device_full((spec.step_token_capacity,), 0, np.int32)
        self.outputs = StepOutputs(self.out, self.write_pages, self.write_offsets)
        self.ring = SnapshotRing(be, snapshot_words(rows, 0, P, 0, 64, 1024), ring_slots, max_ring_slots,
                                 staging_timeout_s)
        self._unsafe_dev = None
        self._next_step_id = 0
        self._finished_through = -1
        self._in_flight: List[Step] = []       # prepared, finish event not yet complete, in id order
        self._unsettled: List[Step] = []
        self._last_step: Optional[Step] = None
        self._scratch_held = [0] * P
        self.h2d_bytes_last_step = 0
        be.synchronize()                       # buffers initialised before any step uses them

    # -- requests --------------------------------------------------------------------------------
    def add(self, rid: RequestId, prompt_len: int) -> None:
        """Register a request with a prompt of prompt_len tokens; it takes the lowest free table row."""
        try:
            known = rid in self._requests
        except TypeError:
            raise InvalidRequestError(f"request id {rid!r} is not hashable") from None
        if known:
            raise DuplicateRequestError(f"request {rid!r} is already added")
        if not _is_count(prompt_len) or prompt_len <= 0:
            raise InvalidRequestError(f"request {rid!r}: prompt_len={prompt_len!r} must be a positive int")
        if prompt_len > self.spec.max_seq_len:
            raise CapacityExceededError(
                f"request {rid!r}: prompt_len={prompt_len} exceeds max_seq_len={self.spec.max_seq_len}")
        if not self._free_rows:
            raise CapacityExceededError(f"request {rid!r}: all max_batch={self.spec.max_batch} rows are in use")
        row = heapq.heappop(self._free_rows)
        self._hist[row] = self._cap[row] = 0
        self._prompt[row] = prompt_len
        self._last_scheduled[row] = -1
        self._stale_done[:, row] = self._sink_blocks
        self._requests[rid] = Request(self, rid, row, int(self._incarnation[row]))
        self._row_of[rid] = row     # the cached generation list stays valid: no listed id maps here

    def free(self, rid: RequestId) -> None:
        """Release every slot of the request (quarantined until the steps that may read them finish)."""
        req = self._request(rid)
        tag = self._last_prepared
        row_start = req.row * self.layout.max_blocks
        for p in range(len(self.pools)):
            held = np.flatnonzero(self.table[p, req.row] != BAD)
            self._release_flat(p, held + (self._group_off[p] + row_start), tag)
        for slots in req.scratch.values():
            self._release_scratch(slots, tag)
        req.scratch.clear()
        del self._requests[rid], self._row_of[rid]
        self._incarnation[req.row] += 1      # steps still holding the row now see it as someone else's
        self._free_epoch += 1
        self._gen_batch = None
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

    @property
    def latest_step(self) -> Optional[Step]:
        """The most recently prepared step: the one whose tables the output buffers hold."""
        return self._last_step

    @property
    def _last_prepared(self) -> int:
        return self._next_step_id - 1

    # -- steps -----------------------------------------------------------------------------------
    def prepare_batch(self, contexts: Union[Mapping[RequestId, int], Sequence[Tuple[RequestId, int]]] = (),
                      generation: Iterable[RequestId] = (), num_gen_tokens: int = 1,
                      pad_to: Optional[int] = None) -> Step:
        """Schedule one step and enqueue its tables.

        contexts: request id -> tokens of its next prefill chunk. generation: request ids that decode
        num_gen_tokens tokens each (more than one for speculative decoding). Contexts come first in the
        batch. Slots are reserved for every new token (all or nothing), the step's inputs are
        snapshotted, and the copy and kernels are enqueued on the manager stream. Returns the Step.
        pad_to: for a consumer captured with a fixed batch size: output rows [num_seqs, pad_to) are
        written BAD.
        """
        if type(contexts) is tuple and not contexts:     # the default, in every decode step: no ABC check
            ctx_items = []
        else:
            ctx_items = list(contexts.items()) if isinstance(contexts, Mapping) else [tuple(c) for c in contexts]
        if isinstance(generation, (str, bytes)):
            raise InvalidRequestError(f"generation={generation!r}: pass a list of request ids, not one id")
        gen_ids = generation.tolist() if isinstance(generation, np.ndarray) else list(generation)
        num_seqs = len(ctx_items) + len(gen_ids)
        if pad_to is not None and (not _is_count(pad_to) or not num_seqs <= pad_to <= self.spec.max_batch):
            raise InvalidRequestError(f"pad_to={pad_to!r} must be an int in [{num_seqs}, max_batch="
                                      f"{self.spec.max_batch}]")
        plan = self._plan(ctx_items, gen_ids, num_gen_tokens)
        plan["pad_to"] = int(pad_to or 0)
        return self._commit(plan)

    def _plan(self, ctx_items, gen_ids, k) -> dict:
        """Validate a step and work out what it needs; changes no state."""
        spec, lay, tpb = self.spec, self.layout, self.layout.tpb
        if self._last_step is not None and self._last_step.finished is None:
            raise StepOrderError(f"step {self._last_step.id} is not finished: call step.finish(stream) "
                                 "after its consumer's last read, before preparing the next step "
                                 "(the next step overwrites its tables)")
        if not _is_count(k) or k <= 0:
            raise InvalidRequestError(f"num_gen_tokens={k!r} must be a positive int")
        # Contexts: few per step, checked one by one.
        ctx_rows, ctx_tokens = [], []
        for item in ctx_items:
            if len(item) != 2:
                raise InvalidRequestError(f"context entry {item!r} must be (request id, tokens)")
            rid, n = item
            row = self._request(rid).row
            if row in ctx_rows:
                raise DuplicateRequestError(f"request {rid!r} appears twice in one step")
            if not _is_count(n) or n <= 0:
                raise InvalidRequestError(f"request {rid!r}: context chunk of {n!r} tokens; must be a positive int")
            if self._cap[row] + n > self._prompt[row]:
                raise InvalidRequestError(f"request {rid!r}: chunk of {n} tokens goes past its prompt "
                                          f"({self._cap[row]} of {self._prompt[row]} already scheduled)")
            ctx_rows.append(row)
            ctx_tokens.append(int(n))
        gen = self._plan_generation(gen_ids, ctx_rows, k)
        total_tokens = sum(ctx_tokens) + k * len(gen.rows)
        if total_tokens > spec.step_token_capacity:
            raise CapacityExceededError(f"the step schedules {total_tokens} tokens; max_step_tokens="
                                        f"{spec.step_token_capacity}")
        # Slots per group: own blocks of every new block, scratch slots for contexts' scratch ranges.
        gen_blocks = len(gen.new_rows)
        need = [gen_blocks] * lay.num_groups
        ctx_blocks = []          # per context, per group: (lo, hi, scratch_lo, scratch_hi)
        for row, n in zip(ctx_rows, ctx_tokens):
            old = int(self._cap[row])
            per_group = []
            for g in lay.groups:
                lo, hi = _cdiv(old, tpb), _cdiv(old + n, tpb)
                s_lo, s_hi = lay.scratch_range(g, old, old + n)
                need[g.index] += (hi - lo) - (s_hi - s_lo) + lay.scratch_slots_needed(g, s_hi - s_lo)
                per_group.append((lo, hi, s_lo, s_hi))
            ctx_blocks.append(per_group)
        for p, pool in enumerate(self.pools):
            # the free list alone answers the common case; _available also counts lifted quarantine
            if need[p] > pool.num_free and need[p] > self._available(p):
                self._wait_for_slots(p, need[p])
                if need[p] > self._available(p):
                    raise OutOfSlotsError(
                        f"group {p} (window={lay.groups[p].window}) needs {need[p]} slots for this step; "
                        f"{self._available(p)} free, {pool.num_quarantined} quarantined by unfinished steps")
        if (len(self._in_flight) >= self.max_steps_in_flight
                and len(self._in_flight) - self._completed_count() >= self.max_steps_in_flight):
            raise StepOrderError(f"{len(self._in_flight)} steps are in flight (max_steps_in_flight="
                                 f"{self.max_steps_in_flight}); their finish events have not completed")
        M = max([lay.scratch_slots_needed(g, s_hi - s_lo)
                 for per in ctx_blocks for g, (_, _, s_lo, s_hi) in zip(lay.groups, per)] or [0])
        cells = sum(map(len, self._dirty)) + lay.num_groups * gen_blocks + sum(
            hi - lo for per in ctx_blocks for (lo, hi, _, _) in per)
        words = snapshot_words(len(ctx_rows) + len(gen.rows), len(ctx_rows), lay.num_groups, M, cells, cells)
        slot = self.ring.acquire(words) if self.staging == "snapshot" else None
        return dict(ctx_ids=[item[0] for item in ctx_items], ctx_rows=ctx_rows, ctx_tokens=ctx_tokens,
                    ctx_blocks=ctx_blocks, gen_ids=gen_ids, gen=gen, k=k, scratch_width=M, ring_slot=slot)

    def _plan_generation(self, gen_ids: List[RequestId], ctx_rows: List[int], k: int) -> _GenPlan:
        """Check the generation entries (possibly hundreds, with array operations) and find the blocks
        their k new tokens open; changes no state but the cache of the validated list."""
        batch = self._gen_batch
        if batch is None or not batch.matches(gen_ids):
            batch = self._check_gen_ids(gen_ids, ctx_rows)
        elif ctx_rows:           # the cached list has no duplicates; a context may still repeat an entry
            self._check_no_duplicates(gen_ids, batch.rows, ctx_rows)
        if batch is None:
            empty = np.zeros(0, np.int64)
            return _GenPlan(None, empty, empty, empty, empty)
        rows = batch.rows
        cap = self._cap[rows]
        if cap.max() > self.spec.max_seq_len - k:
            i = int(np.argmax(cap > self.spec.max_seq_len - k))
            raise CapacityExceededError(f"request {gen_ids[i]!r}: {cap[i]} + {k} tokens exceeds "
                                        f"max_seq_len={self.spec.max_seq_len}")
        tpb, shift = self.layout.tpb, self._tpb_shift
        if k <= tpb:
            # At most one new block per entry: block ceil(cap / tpb), opened when the k tokens do not
            # fit in the room left in the last block. Decode steps take this path.
            room = -cap & (tpb - 1)
            new = np.flatnonzero(room < k)
            return _GenPlan(batch, rows, cap, rows[new], (cap[new] + (tpb - 1)) >> shift)
        lo, hi = (cap + (tpb - 1)) >> shift, (cap + (k + tpb - 1)) >> shift
        new_rows, new_blocks = _expand_ranges(rows, lo, hi)
        return _GenPlan(batch, rows, cap, new_rows, new_blocks)

    def _check_gen_ids(self, gen_ids: List[RequestId], ctx_rows: List[int]) -> Optional[_GenBatch]:
        """The full checks of a generation list (known, no duplicates, prompt scheduled); caches it."""
        if not gen_ids:
            return None
        try:
            rows = np.array(itemgetter(*gen_ids)(self._row_of), np.int64).reshape(-1)
        except (KeyError, TypeError):
            bad = next(r for r in gen_ids if not self._known(r))
            raise UnknownRequestError(f"unknown request id {bad!r}") from None
        self._check_no_duplicates(gen_ids, rows, ctx_rows)
        cap = self._cap[rows]
        unready = cap < self._prompt[rows]
        if unready.any():
            i = int(np.argmax(unready))
            raise InvalidRequestError(f"request {gen_ids[i]!r}: cannot decode before its whole prompt "
                                      f"is scheduled ({cap[i]} of {self._prompt[rows[i]]} tokens)")
        self._gen_batch = batch = _GenBatch(gen_ids, rows, self._incarnation[rows])
        return batch

    def _check_no_duplicates(self, gen_ids: List[RequestId], rows: np.ndarray, ctx_rows: List[int]) -> None:
        seen = np.bincount(rows, minlength=self.spec.max_batch)
        seen[ctx_rows] += 1
        if seen.max() > 1:
            dup = next(r for r in gen_ids if seen[self._row_of[r]] > 1)
            raise DuplicateRequestError(f"request {dup!r} appears twice in one step")

    def _known(self, rid) -> bool:
        try:
            return rid in self._row_of
        except TypeError:
            return False

    def _commit(self, plan: dict) -> Step:
        """Allocate, write the host table, pack the snapshot and enqueue; cannot fail after _plan."""
        self._poll()
        step_id = self._next_step_id
        begs, ends, scratch = self._commit_contexts(plan, step_id)
        gen: _GenPlan = plan["gen"]
        self._allocate_blocks(gen.new_rows, gen.new_blocks)
        k, C = plan["k"], len(plan["ctx_rows"])
        if C == 0 and gen.batch is not None:
            # A pure decode step: the batch arrays are the validated list's (shared, read-only).
            rows, rows32, incarnations = gen.rows, gen.batch.rows32, gen.batch.incarnations
            tokens, starts = gen.batch.tokens_for(k), gen.cap
            self._cap[rows] = starts + k
        else:
            rows = np.concatenate((np.array(plan["ctx_rows"], np.int64), gen.rows))
            rows32, incarnations = rows.astype(np.int32), self._incarnation[rows]
            tokens = np.concatenate((np.array(plan["ctx_tokens"], np.int64), np.full(len(gen.rows), k)))
            starts = self._cap[rows]
            self._cap[rows] = starts + tokens
        self._last_scheduled[rows] = step_id
        step = Step(step_id, plan["ctx_ids"] + plan["gen_ids"], rows32, incarnations, tokens, starts, C,
                    layout=self.layout, backend=self.backend, outputs=self.outputs, owner=self,
                    pad_to=plan["pad_to"], moves=self._free_epoch)
        step.scratch_begs, step.scratch_ends, step.scratch_slots = begs, ends, scratch
        self._enqueue(step, plan["ring_slot"])
        self._next_step_id += 1
        self._last_step = step
        self.outputs.holder = step.id
        self._in_flight.append(step)
        self._unsettled.append(step)
        if self.debug_verify_mirror:        # after the step is registered: a failed check leaves it usable
            self.verify_mirror()
        return step

    def _commit_contexts(self, plan: dict, step_id: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Own slots and scratch slots of the step's context chunks; returns the scratch metadata."""
        lay = self.layout
        P, M, C = lay.num_groups, plan["scratch_width"], len(plan["ctx_rows"])
        if C == 0:
            return self._no_scratch
        begs = np.zeros((P, C), np.int32)
        ends = np.zeros((P, C), np.int32)
        scratch = np.zeros((P, C, M), np.int32)
        for c, (rid, row, per_group) in enumerate(zip(plan["ctx_ids"], plan["ctx_rows"], plan["ctx_blocks"])):
            held = []
            for g, (lo, hi, s_lo, s_hi) in zip(lay.groups, per_group):
                pool = self.pools[g.index]
                own = np.array([b for b in range(lo, hi) if not s_lo <= b < s_hi], np.int64)
                self._set_cells(g.index, np.full(len(own), row), own, pool.allocate(len(own)))
                s = pool.allocate(lay.scratch_slots_needed(g, s_hi - s_lo))
                if len(s):
                    begs[g.index, c], ends[g.index, c] = s_lo, s_hi
                    scratch[g.index, c, :len(s)] = s
                    self._scratch_held[g.index] += len(s)
                held.append(s)
            if any(len(h) for h in held):
                self._requests[rid].scratch[step_id] = held
        return begs, ends, scratch

    def _allocate_blocks(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """A slot of every group for each (row, block): one table store and one log entry for all groups."""
        n = len(rows)
        if n == 0:
            return
        cells = self._group_base + (rows * self.layout.max_blocks + blocks)     # [groups, n]
        for p, pool in enumerate(self.pools):
            self._table_flat[cells[p]] = pool.allocate(n)
        self._dirty.append(cells.reshape(-1))

    def _enqueue(self, step: Step, slot) -> None:
        # Logged in order, neither sorted nor deduplicated: every copy of a cell carries the table's current
        # value, and runs only need adjacent cells (sorting the log of a step with frees cost ~100 us).
        cells = np.concatenate(self._dirty) if self._dirty else np.empty(0, np.int64)
        try:
            self._launch(step, slot, cells)
        except BaseException:
            # The device work may be partly enqueued: keep the log for the next step, which must be FULL.
            self._force_full = True
            raise
        self._dirty.clear()
        self._force_full = False
        if step.mode == MODE_FULL:
            self._epoch = step.id       # DELTA steps find their batch entries through this step's row map

    def _launch(self, step: Step, slot, cells: np.ndarray) -> None:
        """Pack the step's snapshot and enqueue its copy and kernels (or its graph) on the manager stream."""
        be, st = self.backend, self.backend.stream
        cu_tokens = np.zeros(step.num_seqs + 1, np.int64)
        np.cumsum(step.num_tokens, out=cu_tokens[1:])
        prev = self._in_flight[-1] if self._in_flight else None
        if prev is not None:
            be.wait(st, prev.finished)     # the previous consumer's reads come before our writes
        shared = self.spec.table_mode == "shared"
        tokens = int(cu_tokens[-1])
        if self.staging == "unsafe":
            snap = self._enqueue_unsafe(step, cu_tokens)     # carries no deltas: the mirror is copied whole
            be.build_step(st, snap, self.mirror, self.out, self.row_entry, self.write_pages, self.write_offsets,
                          self._consts, shared, MODE_FULL, num_entries=step.num_seqs, num_tokens=tokens)
            step.ready = be.record(st)
            return
        step.mode = MODE_DELTA if self._steady(step) else MODE_FULL
        values = self._table_flat[cells]
        words = pack_snapshot(slot.host, step.id, step.rows, step.scratch_begs, step.scratch_ends,
                              step.scratch_slots, cells, values, cu_tokens, step.start_positions, mode=step.mode,
                              pad_to=step.pad_to, epoch=step.id if step.mode == MODE_FULL else self._epoch)
        entries = max(step.num_seqs, step.pad_to)
        if self.use_graphs:
            # Buckets keep the number of graphs small: batch size, tokens and copy size round up to powers
            # of two; the kernels read the true counts from the snapshot.
            copy_words = min(_pow2_at_least(max(words, 1024)), slot.capacity)
            be.launch_step_graph(st, slot, self.mirror, self.out, self.row_entry, self.write_pages,
                                 self.write_offsets, self._consts, shared, step.mode,
                                 min(_pow2_at_least(entries), self.spec.max_batch),
                                 min(_pow2_at_least(max(tokens, 256)), self.write_offsets.size), copy_words)
            self.h2d_bytes_last_step = copy_words * 4
        else:
            be.copy_h2d(slot.dev, slot.host, words, st)
            self.h2d_bytes_last_step = words * 4
            if len(cells):      # a steady decode step often changes no cell: one launch fewer
                be.apply_deltas(st, slot.dev, self.mirror, self._consts, num_values=len(cells))
            be.build_step(st, slot.dev, self.mirror, self.out, self.row_entry, self.write_pages,
                          self.write_offsets, self._consts, shared, step.mode, num_entries=entries,
                          num_values=len(cells), num_tokens=tokens)
        # One event for both: the slot's copy is done when the step is (an event between the copy and the
        # kernels would cost the GPU about a microsecond per step, and the slot is reused only later).
        step.ready = slot.copied = be.record(st)

    def _steady(self, step: Step) -> bool:
        """True when the output already holds this batch's rows (the previous step's, row for row, no
        contexts in either, same padding): only changed cells need rewriting."""
        prev = self._last_step
        return (self.steady_batch_delta and not self._force_full and prev is not None and getattr(prev, "mode", None) is not None
                and step.num_contexts == 0 and prev.num_contexts == 0 and prev.pad_to == step.pad_to
                and (prev.rows is step.rows or np.array_equal(prev.rows, step.rows)))

    def _enqueue_unsafe(self, step: Step, cu_tokens):
        """UNSAFE, for the race tests only: metadata from a pinned pool array dropped right after enqueue,
        and the table copied from the live host table. Both are read when the copies run, not now."""
        be, st, P = self.backend, self.backend.stream, self.layout.num_groups
        # Sized for the largest batch, as a persistent metadata buffer would be: every step (and any other
        # pinned allocation of that size class) gets the block the previous one dropped.
        words = snapshot_words(self.spec.max_batch, self.spec.max_batch, P, max(16, step.scratch_slots.shape[2]), 0, 0)
        tmp = be.pinned_temp(words)
        empty = np.empty(0, np.int64)
        words = pack_snapshot(tmp, step.id, step.rows, step.scratch_begs, step.scratch_ends, step.scratch_slots,
                              empty, empty, cu_tokens, step.start_positions, epoch=step.id)
        if self._unsafe_dev is None or len(self._unsafe_dev) < words:
            self._unsafe_dev = be.device_empty(max(words, 4096))
        be.copy_h2d(self._unsafe_dev, tmp, words, st)
        be.copy_h2d(self.mirror, self.table, self.table.size, st)
        self.h2d_bytes_last_step = (words + self.table.size) * 4
        return self._unsafe_dev

    def settle(self, step: Step, accepted: Union[None, Mapping[RequestId, int], Sequence[int]] = None) -> None:
        """The step's tokens are final: history advances by the accepted tokens.

        accepted: None (all scheduled tokens), a mapping request id -> accepted tokens, or a sequence in
        batch order. Context chunks are always accepted whole. Rejected speculative tokens are rewound
        (at most max_rewind per request, and only from the request's latest step). SWA blocks that fell
        out of the window are released, scratch slots of the step's contexts too; released slots stay
        quarantined until the steps that may read them have finished. Requests freed since the step was
        prepared are skipped.
        """
        if getattr(step, "owner", None) is not self:
            raise StepOrderError("this step belongs to another manager (or is not a Step)")
        if step.settled:
            raise StepOrderError(f"step {step.id} is already settled")
        if self._unsettled[0] is not step:
            raise StepOrderError(f"settle steps in the order they were prepared: step "
                                 f"{self._unsettled[0].id} comes before {step.id}")
        acc = self._accepted(step, accepted)
        rows = step.rows.astype(np.int64)
        # Only free() changes a row's tenant: when nothing was freed since the prepare, every entry is live.
        all_live = step.moves == self._free_epoch
        if all_live and (accepted is None or np.array_equal(acc, step.num_tokens)):
            self._settle_accepted(step, rows, acc)
        else:
            self._settle_general(step, rows, acc)
        step.settled = True
        self._unsettled.pop(0)

    def _settle_accepted(self, step: Step, rows: np.ndarray, acc: np.ndarray) -> None:
        """settle when every entry is live and every token accepted: no rewinds, nothing to check."""
        tag = self._last_prepared
        hist = self._hist[rows] + acc
        self._hist[rows] = hist
        for rid in step.request_ids[:step.num_contexts]:
            self._release_scratch(self._requests[rid].scratch.pop(step.id, ()), tag)
        self._release_stale(rows, hist, tag)

    def _settle_general(self, step: Step, rows: np.ndarray, acc: np.ndarray) -> None:
        """settle with freed entries or rejected tokens: validate the rewinds first, then apply."""
        live = self._incarnation[rows] == step.incarnations
        rejected = np.where(live, step.num_tokens - acc, 0)
        for i in np.flatnonzero(rejected):
            rid = step.request_ids[i]
            if rejected[i] > self.spec.max_rewind:
                raise CapacityExceededError(f"request {rid!r}: rejecting {rejected[i]} tokens exceeds "
                                            f"max_rewind={self.spec.max_rewind}")
            if self._last_scheduled[rows[i]] != step.id:
                raise StepOrderError(f"request {rid!r}: cannot reject tokens of step {step.id}: a later step "
                                     f"{self._last_scheduled[rows[i]]} already scheduled it")
        tag, tpb = self._last_prepared, self.layout.tpb
        self._hist[rows[live]] += acc[live]
        for i in np.flatnonzero(rejected):
            old = int(self._cap[rows[i]])
            self._cap[rows[i]] = old - rejected[i]
            blocks = np.arange(_cdiv(old - rejected[i], tpb), _cdiv(old, tpb))
            for p in range(self.layout.num_groups):
                self._release_cells(p, np.full(len(blocks), rows[i]), blocks, tag)
        for i in np.flatnonzero(live[:step.num_contexts]):
            self._release_scratch(self._requests[step.request_ids[i]].scratch.pop(step.id, ()), tag)
        live_rows = rows[live]
        self._release_stale(live_rows, self._hist[live_rows], tag)

    def _release_stale(self, rows: np.ndarray, hist: np.ndarray, tag: int) -> None:
        """Release the SWA blocks that fell out of the window now that `rows` have `hist` tokens settled.

        Per row and SWA group that is [stale_done, edge) with edge = (hist + 1 - window) // tpb; only the
        few rows whose edge crossed a block boundary this step release anything. stale_done starts at the
        sink blocks, so an edge past it is past the sinks too.
        """
        shift = self._tpb_shift
        for g in self._swa_groups:
            edge = (hist + (1 - g.window)) >> shift          # floor division by tpb (edge may be negative)
            done = self._stale_done[g.index, rows]
            moved = np.flatnonzero(edge > done)
            if len(moved) == 0:
                continue
            r, lo, hi = rows[moved], done[moved], edge[moved]
            self._release_cells(g.index, *_expand_ranges(r, lo, hi), tag)
            self._stale_done[g.index, r] = hi

    def _accepted(self, step: Step, accepted) -> np.ndarray:
        n = step.num_tokens
        if accepted is None:
            return n
        if isinstance(accepted, Mapping):
            index = {rid: i for i, rid in enumerate(step.request_ids)}
            acc = n.copy()
            for rid, a in accepted.items():
                if rid not in index:
                    raise UnknownRequestError(f"request {rid!r} is not in step {step.id}")
                if not _is_count(a):
                    raise InvalidRequestError(f"request {rid!r}: accepted={a!r} must be an int")
                acc[index[rid]] = a
        else:
            acc = np.asarray(list(accepted))
            if acc.shape != n.shape or (len(acc) and acc.dtype.kind not in "iu"):
                raise InvalidRequestError(f"accepted has {len(acc)} entries of dtype {acc.dtype}; step {step.id} "
                                          f"needs {len(n)} ints, one per entry")
            acc = acc.astype(np.int64)
        bad = np.flatnonzero((acc < 0) | (acc > n))
        if len(bad):
            i = bad[0]
            raise InvalidRequestError(f"request {step.request_ids[i]!r}: accepted={acc[i]} must be in "
                                      f"[0, {n[i]}]")
        partial = np.flatnonzero(acc[:step.num_contexts] != n[:step.num_contexts])
        if len(partial):
            i = partial[0]
            raise InvalidRequestError(f"request {step.request_ids[i]!r}: a context chunk is accepted whole "
                                      f"({n[i]} tokens)")
        return acc

    # -- slots and cells -------------------------------------------------------------------------
    def _release_cells(self, p: int, rows: np.ndarray, blocks: np.ndarray, tag: int) -> None:
        """Quarantine the slots held at table[p, rows, blocks] and clear those cells."""
        self._release_flat(p, rows * self.layout.max_blocks + (blocks + self._group_off[p]), tag)

    def _release_flat(self, p: int, cells: np.ndarray, tag: int) -> None:
        """Quarantine the slots held at these flat cells of group p's table and clear the cells."""
        if len(cells) == 0:
            return
        vals = self._table_flat[cells]
        if vals.min() == BAD:       # scratch blocks of a chunk never got a slot of their own (slots are >= 0)
            held = vals != BAD
            cells, vals = cells[held], vals[held]
            if len(cells) == 0:
                return
        self.pools[p].release(vals, tag)
        self._set_flat(cells, BAD)

    def _release_scratch(self, per_group: Sequence[np.ndarray], tag: int) -> None:
        for p, slots in enumerate(per_group):
            self.pools[p].release(slots, tag)
            self._scratch_held[p] -= len(slots)

    def _set_cells(self, p: int, rows: np.ndarray, blocks: np.ndarray, values) -> None:
        if len(blocks) == 0:
            return
        self._set_flat(np.asarray(rows, np.int64) * self.layout.max_blocks + (blocks + self._group_off[p]), values)

    def _set_flat(self, cells: np.ndarray, values) -> None:
        """Write table cells by flat index and log them for the next step's snapshot."""
        self._table_flat[cells] = values
        self._dirty.append(cells)

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
        """Wait for all work on the backend's streams, then lift the quarantine of finished steps."""
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
        bad = np.flatnonzero(ok & (mirror != self._table_flat))
        if len(bad):
            raise AssertionError(f"device mirror differs from the host table at {len(bad)} cells, "
                                 f"first flat index {int(bad[0])}")

    def state(self) -> tuple:
        """A comparable snapshot of every piece of host state (tests compare it around failing calls)."""
        reqs = tuple((repr(r.rid), r.row, r.incarnation,
                      tuple((k, tuple(a.tobytes() for a in v)) for k, v in sorted(r.scratch.items())))
                     for r in self._requests.values())
        arrays = tuple(a.tobytes() for a in (self._hist, self._cap, self._prompt, self._incarnation,
                                             self._last_scheduled, self._stale_done))
        return (self.table.tobytes(), np.concatenate(self._dirty).tobytes() if self._dirty else b"",
                reqs, arrays, tuple(sorted(self._free_rows)), tuple(p.state() for p in self.pools),
                self._next_step_id, tuple(s.id for s in self._unsettled), tuple(self._scratch_held))
