"""KVCacheManager: the public API (add, prepare_batch, settle, free) over the manager's parts.

    requests.RequestTable   request ids <-> table rows, per-row numbers (history, capacity, prompt, ...)
    groups.LayerGroup       each group's block rules (stale, scratch, new blocks, rewind)
    allocator.SlotPool      slots per group, released into quarantine
    table.PageTable         the host page table (the only source of truth) and its dirty log
    ledger.StepLedger       step ids, in flight, unsettled, the finish watermark that lifts quarantine
    pipeline.StepPipeline   the per-step device work: snapshot, copy, deltas, tables, ready event

Every public operation checks first and mutates after: when it raises a CupykvError, nothing changed.
prepare_batch is plan (validate, count slots, take a ring slot; no state changes) then commit
(allocate, write the table, launch; cannot fail on bad input after the plan).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .allocator import CachingSlotPool, SlotPool
from .args import accepted_counts, as_count, as_flag, context_items, generation_tokens, request_ids, salt_bytes, token_ids
from .backends import make_backends
from .errors import (CapacityExceededError, DuplicateRequestError, InvalidRequestError, InvalidSpecError,
                     OutOfSlotsError, SpecTooLargeError, StepOrderError)
from .entries import most_rebuilt
from .layout import NO_INDEX, Layout
from .ledger import StepLedger
from .pipeline import StepPipeline, UnsafeStaging
from .prefix_cache import PrefixCache
from .residence import Residence
from .requests import GenBatch, Request, RequestId, RequestTable, frozen
from .spec import INT32_MAX, CacheSpec
from .staging import snapshot_words
from .step import DeviceStep, Step
from .table import PageTable

STAGING_MODES = ("snapshot", "unsafe")
# A settle clears a row's window release by slices (PageTable.take_blocks: a Python call for each such row,
# logged as a range) from this many blocks on; shorter ones go as the cells of all rows in one vectorised
# pass (slicing releases of 16-63 blocks row by row doubled a SHARED chunk's settle: docs/host_profile.md in git history).
SLICE_MIN_BLOCKS = 64
_NO_SLOTS = frozen(np.zeros(0, np.int32))


def _expand_ranges(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """(row, block) pairs of the non-empty block ranges [lo, hi) of each row (hi > lo), rows in order."""
    if len(rows) == 0:
        return rows, lo
    count = hi - lo
    return _range_pairs(rows, lo, count, np.maximum.reduce(count))


def _range_pairs(rows: np.ndarray, lo: np.ndarray, count: np.ndarray, longest):
    """_expand_ranges of the ranges [lo, lo + count) (count >= 1; longest = count.max())."""
    if longest == 1:                     # the decode case: one block per row
        return rows, lo
    # (methods rather than np.* functions: at these sizes the dispatch costs more than the work)
    ends = count.cumsum()
    return rows.repeat(count), lo.repeat(count) + (np.arange(int(ends[-1])) - (ends - count).repeat(count))


class _ChunkSlots:
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


@dataclass
class _Plan:
    """What a validated step needs; made by _plan without changing any state."""
    ctx_ids: list
    ctx_rows: List[int]
    ctx_tokens: List[int]
    ctx_slots: List[_ChunkSlots]       # per group
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


class KVCacheManager:
    """Paged KV cache bookkeeping and per-step page tables for models with mixed attention windows.

    backend: "auto" (GPU when usable, else the host backend), "cuda", "host", or a backend object.
    staging: "snapshot" (the default, race-free) or "unsafe" (pipeline.UnsafeStaging: copies straight from
        the live host table; it exists only to prove that the race tests catch the race; never use it).
    ring_slots / max_ring_slots / staging_timeout_s: the pinned snapshot ring's initial size, bound, and
        how long a host wait (a ring slot, a finish event) may take before it is an error.
    max_steps_in_flight: prepared steps whose finish event has not completed; a prepare_batch beyond it
        waits for the oldest ones (up to staging_timeout_s each), and is an error if they do not complete.
    debug_verify_mirror: after each prepare, wait and check the device mirror against the host table.
    use_graphs: run each step's device work (snapshot copy, delta apply, tables and write positions; one
        kernel launch on CUDA) as a CUDA graph replay per ring slot, mode and bucket instead; a small step
        (a small batch's decode step: its snapshot fits cupykv_step_inline_small) is still launched with
        its snapshot in the launch's parameters: the device takes a few microseconds less than for its
        replay, the host about as long (docs/design.md, "CUDA graphs").
    steady_batch_delta: rewrite whole only the output entries whose request is not the one they hold, and
        the context chunks, and only the changed cells of the others, while that is at most half of the
        step's entries (cupykv/entries.py), instead of every entry of the batch.
    devices: the devices that need the tables (tensor parallelism: every rank reads the same tables),
        e.g. [0, 1]; default: one, the current CUDA device (or the backend object given). One host
        manager makes every decision and packs one snapshot per step; each device copies it into its own
        mirror and builds its own tables, write positions and ready event (step.on(rank), rank = position
        in this list). CUDA device ids may repeat ([0, 0]: two mirrors on one GPU, how the multi-device
        path is tested on one GPU); on the host backend they are labels of simulated devices.
    """

    def __init__(self, spec: CacheSpec, backend: Union[str, object] = "auto", *, staging: str = "snapshot",
                 ring_slots: int = 4, max_ring_slots: int = 64, staging_timeout_s: float = 10.0,
                 max_steps_in_flight: int = 64, debug_verify_mirror: bool = False, use_graphs: bool = False,
                 steady_batch_delta: bool = True, devices: Optional[Sequence[int]] = None):
        if not isinstance(spec, CacheSpec):
            raise InvalidSpecError(f"spec={spec!r}: needs a cupykv.CacheSpec")
        if not isinstance(staging, str) or staging not in STAGING_MODES:
            raise InvalidSpecError(f"staging={staging!r}: must be one of {STAGING_MODES}")
        ring_slots = as_count(ring_slots, "ring_slots", minimum=1, error=InvalidSpecError)
        max_ring_slots = as_count(max_ring_slots, "max_ring_slots", minimum=ring_slots, error=InvalidSpecError)
        self.max_steps_in_flight = as_count(max_steps_in_flight, "max_steps_in_flight", minimum=1,
                                            error=InvalidSpecError)
        if (not isinstance(staging_timeout_s, (int, float, np.integer, np.floating)) or isinstance(staging_timeout_s, bool)
                or not staging_timeout_s > 0):
            raise InvalidSpecError(f"staging_timeout_s={staging_timeout_s!r}: must be a positive number of seconds")
        debug_verify_mirror = as_flag(debug_verify_mirror, "debug_verify_mirror", InvalidSpecError)
        use_graphs = as_flag(use_graphs, "use_graphs", InvalidSpecError)
        steady_batch_delta = as_flag(steady_batch_delta, "steady_batch_delta", InvalidSpecError)
        self.spec = spec
        self.layout = lay = Layout(spec)
        self.backends = make_backends(backend, devices)
        self.backend = be = self.backends[0]
        self.devices = [getattr(b, "device_id", 0) for b in self.backends]
        self.staging = staging
        self.debug_verify_mirror = debug_verify_mirror
        P, rows, B = lay.num_groups, spec.max_batch, lay.max_blocks
        if P * rows * B > INT32_MAX:     # the snapshot ships flat table indices as int32
            raise InvalidSpecError(f"CacheSpec: groups x max_batch x max_blocks = {P * rows * B} table cells; "
                                   f"at most 2^31 - 1 (lower max_batch or max_seq_len)")
        try:
            self.pools = [(CachingSlotPool if spec.prefix_caching else SlotPool)(n)
                          for n in lay.allocatable_slots]
            self.cache = (PrefixCache(lay, self.pools, spec.prefix_retention, spec.prefix_events)
                          if spec.prefix_caching else None)
            self.page_table = PageTable(be, P, rows, B)
            self.ledger = StepLedger(self.pools, float(staging_timeout_s))
            self.requests = RequestTable(rows, P, np.array([g.sink_blocks for g in lay.groups], np.int64),
                                         lambda: self.ledger.unsettled)
            options = dict(ring_slots=ring_slots, max_ring_slots=max_ring_slots,
                           timeout_s=float(staging_timeout_s), use_graphs=use_graphs,
                           steady_batch_delta=steady_batch_delta)
            self.pipeline = (UnsafeStaging(lay, self.backends, self.page_table, **options) if staging == "unsafe"
                             else StepPipeline(lay, self.backends, **options))
        except MemoryError as e:
            raise SpecTooLargeError(
                f"the buffers this CacheSpec sizes do not fit ({e}): the page table and the outputs grow with "
                f"max_batch={spec.max_batch} x (max_seq_len={spec.max_seq_len} + max_rewind={spec.max_rewind}) / "
                f"tokens_per_block, the write positions with num_layers={spec.num_layers} x max_step_tokens="
                f"{spec.step_token_capacity}" + ("" if spec.max_step_tokens is not None else
                                                 " (by default 8192 + max_batch x (1 + max_rewind))")) from e
        self._windowed = [g for g in lay.groups if not g.keeps_every_block]
        self.host_tier = None           # a KVStorage's HostTier registers itself here (free, stats)
        self.residence = Residence(self)
        self._scratch_held = [0] * P
        self._no_chunks = [_ChunkSlots() for _ in range(P)]     # a step without contexts (never added to)
        # Scratch metadata of a step without contexts (shared by those steps, so read-only).
        self._no_scratch = (frozen(np.zeros((P, 0), np.int32)), frozen(np.zeros((P, 0), np.int32)),
                            frozen(np.zeros((P, 0, 0), np.int32)))
        for b in self.backends:
            b.synchronize()                    # buffers initialised before any step uses them

    # -- the buffers consumers and tests read (fixed addresses for the life of the manager) ------------
    table = property(lambda self: self.page_table.array, doc="The host page table, int32 [P, rows, B].")
    outputs = property(lambda self: self.pipeline.outputs, doc="Device 0's output buffers (tables, write positions).")
    out = property(lambda self: self.pipeline.outputs.tables, doc="= step.tables of every step.")
    write_pages = property(lambda self: self.pipeline.outputs.write_pages,
                           doc="= step.write_pages: int32 [L, max_step_tokens], each new token's K page per layer.")
    write_offsets = property(lambda self: self.pipeline.outputs.write_offsets,
                             doc="= step.write_offsets: int32 [max_step_tokens], each new token's place in its page.")
    mirror = property(lambda self: self.pipeline.mirror, doc="The device mirror of the host table.")
    ring = property(lambda self: self.pipeline.ring, doc="The pinned snapshot ring.")
    h2d_bytes_last_step = property(lambda self: self.pipeline.h2d_bytes_last_step,
                                   doc="Bytes the last step copied host to device (its snapshot), per device.")
    use_graphs = property(lambda self: self.pipeline.use_graphs,
                          lambda self, on: setattr(self.pipeline, "use_graphs", as_flag(on, "use_graphs")),
                          doc="Replay each step's device work as a CUDA graph (may be switched between steps).")

    def capture_graphs(self) -> int:
        """With use_graphs on the CUDA backend: capture now every step graph the snapshot ring can need, so
        that no prepare_batch captures one later (a ring slot added or grown later still captures on first
        use: ring_slots sets how many exist now). Call while nothing holds the device, before serving: a
        capture can make the host wait for the device's busy streams (docs/design.md, "CUDA graphs"). Returns how
        many graphs were captured."""
        return self.pipeline.capture_graphs()

    # -- requests --------------------------------------------------------------------------------
    def add(self, rid: RequestId, prompt_len: int, *, tokens=None, cache_salt=None, checkpoints=()) -> int:
        """Register a request with a prompt of prompt_len tokens; it takes the lowest free table row.

        With prefix caching on, tokens (the prompt's prompt_len token ids) is required; cache_salt (bytes
        or str) keeps requests that must not share KV apart; checkpoints are prompt positions to keep
        hit-able later (their windows stay cached). Returns the prompt tokens already cached (a multiple
        of tokens_per_block, less than prompt_len): the request starts with that history, its cached
        blocks already in its table rows, and its first context chunk starts there. 0 without caching.
        """
        reqs, cache = self.requests, self.cache
        reqs.check_new(rid)
        n = as_count(prompt_len, f"request {rid!r}: prompt_len", minimum=1)
        if n > self.spec.max_seq_len:
            raise CapacityExceededError(f"request {rid!r}: prompt_len={n} exceeds max_seq_len={self.spec.max_seq_len}")
        if not reqs.free_rows:
            raise CapacityExceededError(f"request {rid!r}: all max_batch={self.spec.max_batch} rows are in use")
        if cache is not None and tokens is None:
            raise InvalidRequestError(f"request {rid!r}: prefix caching is on, so add() needs tokens= "
                                      f"(the prompt's {n} token ids)")
        toks = None if tokens is None else token_ids(tokens, f"request {rid!r}: tokens", n)
        salt = salt_bytes(cache_salt)
        if (isinstance(checkpoints, (str, bytes, Mapping)) or not isinstance(checkpoints, Iterable)
                or getattr(checkpoints, "ndim", 1) != 1):
            raise InvalidRequestError(f"request {rid!r}: checkpoints={checkpoints!r} must be prompt positions")
        marks = sorted({as_count(c, f"request {rid!r}: checkpoint", minimum=1, maximum=n) for c in checkpoints})
        if cache is None:
            reqs.add(rid, n)
            return 0
        seq = cache.new_seq(toks, salt, [n, *marks])
        hit, hits = cache.lookup(seq.hashes, n)
        if cache.host is not None and any(on_host.any() for _, _, on_host in hits):
            self.ledger.poll()          # finished steps' slots count as room for the host blocks
            # the longest hit whose host blocks fit (a shorter lookup prefers device copies; one with no
            # host block always fits)
            while hit and not self._room_for_host_hits(hits):
                hit, hits = cache.lookup(seq.hashes, hit * self.layout.tpb)
        # -- nothing has changed so far --
        row = reqs.add(rid, n).row
        reqs.hist[row] = cached = hit * self.layout.tpb
        reqs.set_capacity(row, cached)
        for g, (hit_blocks, hit_slots, on_host) in zip(self.layout.groups, hits):
            some_on_host = on_host.any()
            blocks, slots = (hit_blocks[~on_host], hit_slots[~on_host]) if some_on_host else (hit_blocks, hit_slots)
            if len(blocks):
                self.pools[g.index].acquire(slots)
                self.page_table.write(self.page_table.cells(g.index, row, blocks), slots)
                if cache.still_arriving(g.index, slots):     # an earlier hit's copy back: wait for it too
                    reqs.loading[row] = cache.last_copy_in
            # (one event per row: the tier copies on one stream, so a group's later event covers an earlier one)
            if some_on_host:        # copied back into fresh slots; the request's first step waits for the copy
                blocks, host_slots = hit_blocks[on_host], hit_slots[on_host]
                slots, reqs.loading[row] = cache.bring_back(g.index, [seq.hashes[b] for b in blocks.tolist()],
                                                            host_slots.tolist(), self.pools[g.index].allocate)
                self.page_table.write(self.page_table.cells(g.index, row, blocks), slots)
            reqs.stale_done[g.index, row] = max(g.sink_blocks, min(int(g.stale_end(cached)), hit))
        seq.hit_blocks = hit
        cache.begin(row, seq)
        cache.queries, cache.query_tokens, cache.hit_tokens = cache.queries + 1, cache.query_tokens + n, cache.hit_tokens + cached
        return cached

    def _room_for_host_hits(self, hits) -> bool:
        """Every group can allocate a slot for each hit host block, after the hit device blocks were taken
        back from the evictable list. hits: per group (blocks, slots, on_host), as PrefixCache.lookup."""
        for pool, (_, slots, on_host) in zip(self.pools, hits):
            n = int(np.count_nonzero(on_host))
            if n and n > pool.num_available - pool.count_evictable(slots[~on_host]):
                return False
        return True

    def free(self, rid: RequestId) -> None:
        """Release every slot of the request (quarantined until the steps that may read them finish)."""
        req = self.requests.get(rid)
        loading = self.requests.loading.get(req.row)
        # A copy back (resume, host-tier hits) that no step has waited for yet may still write its slots.
        tag = self.ledger.record_fence(loading) if loading is not None else self.ledger.last_prepared
        if self.cache is not None:      # every cached block it holds keeps its hash: its last window
            self.cache.end(req.row, self.page_table.array)
        self.residence.release_row(req.row, tag)
        for slots in req.scratch.values():
            self._release_scratch(slots, tag)
        req.scratch.clear()
        if self.host_tier is not None:
            self.host_tier.forget(rid)
        self.requests.remove(rid)

    def can_add(self) -> bool:
        """Whether add() has a free table row for one more request now (max_batch rows; freeing a request
        frees its row at once)."""
        return bool(self.requests.free_rows)

    def resident_blocks(self, rid: RequestId):
        """Per group (blocks, slots) of the request that hold a device slot (see Residence)."""
        return self.residence.resident_blocks(rid)

    def __contains__(self, rid: RequestId) -> bool:
        try:
            return rid in self.requests.requests
        except TypeError:           # unhashable: never a request id
            return False

    def request(self, rid: RequestId) -> Request:
        """The live request's record (row, prompt_len, history, capacity, suspended); UnknownRequestError
        for an id that is not live."""
        return self.requests.get(rid)

    @property
    def request_ids(self) -> List[RequestId]:
        """The live requests' ids, in the order they were added."""
        return list(self.requests.requests)

    @property
    def latest_step(self) -> Optional[Step]:
        """The most recently prepared step: the one whose tables the output buffers hold."""
        return self.ledger.latest

    # -- steps -----------------------------------------------------------------------------------
    def prepare_batch(self, contexts: Union[Mapping[RequestId, int], Sequence[Tuple[RequestId, int]]] = (),
                      generation: Iterable[RequestId] = (), num_gen_tokens: int = 1,
                      pad_to: Optional[int] = None) -> Step:
        """Schedule one step and enqueue its tables.

        contexts: request id -> tokens of its next prefill chunk (a mapping or (id, tokens) pairs).
        generation: request ids that decode num_gen_tokens tokens each (more than one for speculative
        decoding). Contexts come first in the batch. Slots are reserved for every new token (all or
        nothing), the step's inputs are snapshotted, and the copy and kernels are enqueued on the manager
        stream. Returns the Step. pad_to: for a consumer captured with a fixed batch size: output rows
        [num_seqs, pad_to) are written BAD (the null page with CacheSpec(null_slot=True)).
        """
        ctx_items = context_items(contexts)
        gen_ids = request_ids(generation)
        k = as_count(num_gen_tokens, "num_gen_tokens", minimum=1, maximum=self.spec.max_seq_len)
        pad = None if pad_to is None else as_count(pad_to, "pad_to")   # its range once the entries are known
        reqs = self.requests
        gen = reqs.last_generation
        in_room = not ctx_items and gen is not None and gen.has_room(k, reqs.cap_writes)   # (never at b256)
        plan = self._plan_in_room(gen, gen_ids, k, pad) if in_room else None
        return self._commit(plan if plan is not None else self._plan(ctx_items, gen_ids, k, pad))

    def _plan_in_room(self, gen: GenBatch, gen_ids: list, k: int, pad_to: Optional[int]) -> Optional[_Plan]:
        """The plan of a decode step of the last validated list `gen`, whose room holds k tokens an entry
        (GenBatch.has_room: no entry opens a block or passes max_seq_len): most steps of a small batch. Such
        a step takes no slot, so it needs none of _plan's counting. None when gen_ids are not that list, and
        for a step that _plan would refuse (it raises the error) or whose in-flight steps it would wait for.
        pad_to: None (no padding) or a count."""
        reqs, ledger, spec = self.requests, self.ledger, self.spec
        latest = ledger.latest
        if (not gen.matches(gen_ids, reqs.moves) or (latest is not None and not latest.is_finished())
                or ledger.num_steps_in_flight() >= self.max_steps_in_flight):
            return None
        n = len(gen.rows)
        live = n if pad_to is None else pad_to      # (an explicit pad_to of 0 is out of range: _plan says so)
        if not n <= live <= spec.max_batch or k * n > spec.step_token_capacity:
            return None
        cap = reqs.cap[gen.rows]
        words = self._snapshot_bound(n, 0, 0, self.page_table.num_logged(), live)
        return _Plan([], [], [], self._no_chunks, gen_ids, gen, cap, cap + gen.tokens_for(k), gen.longest + k,
                     NO_INDEX, NO_INDEX, gen.room - k, True, False, k, 0, 0 if pad_to is None else pad_to,
                     self.pipeline.acquire(words))

    def _snapshot_bound(self, num_seqs: int, num_contexts: int, scratch_width: int, cells: int, live: int) -> int:
        """The most words a step's snapshot can take: every changed cell a run of its own, the most entries
        a DELTA step rebuilds, every entry past the `live` ones (the batch and its padding) held."""
        return snapshot_words(num_seqs, num_contexts, self.layout.num_groups, scratch_width, cells, cells,
                              most_rebuilt(live), self.spec.max_batch - live)

    def _plan(self, ctx_items: list, gen_ids: list, k: int, pad_to: Optional[int]) -> _Plan:
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
        ctx_slots = [_ChunkSlots() for _ in lay.groups] if ctx_items else self._no_chunks
        ctx_cells = M = 0
        row_start = self.page_table.row_start
        for rid, n in ctx_items:          # few per step, checked one by one
            row = reqs.get(rid).row
            if reqs.suspended[row]:
                raise InvalidRequestError(f"request {rid!r} is suspended: resume it before scheduling it")
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
                s_lo, s_hi = (g.scratch_range(old, old + n) if self.cache is None
                              else self.cache.scratch_range(g, row, old, old + n))
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
        # (A step within the list's room opens none: _plan_in_room planned it.)
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
                new_rows, new_blocks = _expand_ranges(gen_rows[opened], lo[opened], hi[opened])
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
        words = self._snapshot_bound(len(ctx_rows) + len(gen_rows), len(ctx_rows), M, cells,
                                     max(len(ctx_rows) + len(gen_rows), pad_to))
        return _Plan([rid for rid, _ in ctx_items] if ctx_items else [], ctx_rows, ctx_tokens, ctx_slots, gen_ids,
                     gen, cap, end, longest, new_rows, new_blocks, room, known, phased is not None, k, M, pad_to,
                     self.pipeline.acquire(words))

    def _commit(self, plan: _Plan) -> Step:
        """Allocate, write the host table, pack the snapshot and enqueue; cannot fail on bad input."""
        reqs, ledger, table = self.requests, self.ledger, self.page_table
        ledger.poll()
        step_id = ledger.next_id
        gen, k = plan.gen, plan.k
        if plan.ctx_rows:
            begs, ends, scratch = self._commit_contexts(plan, step_id)
        else:
            begs, ends, scratch = self._no_scratch
        if len(plan.new_rows):
            self._allocate_blocks(plan.new_rows, plan.new_blocks)
        if not plan.ctx_rows and gen is not None:
            # A pure decode step: the batch arrays are the validated list's (shared, read-only).
            rows, rows32, incarnations, tokens, starts = gen.rows, gen.rows32, gen.incarnations, gen.tokens_for(k), plan.gen_cap
            reqs.set_capacity(rows, plan.gen_end)          # = starts + tokens, already computed by the plan
            gen.keep(plan.gen_room, plan.gen_longest, reqs.cap_writes, plan.gen_known, plan.gen_phased)
        else:
            gen_rows = gen.rows if gen is not None else NO_INDEX
            rows = np.concatenate((np.array(plan.ctx_rows, np.int64), gen_rows))
            rows32, incarnations = rows.astype(np.int32), reqs.incarnation[rows]
            gen_tokens = gen.tokens_for(k) if gen is not None else gen_rows
            tokens = np.concatenate((np.array(plan.ctx_tokens, np.int64), gen_tokens))
            starts = reqs.cap[rows]
            reqs.set_capacity(rows, starts + tokens)
        reqs.last_scheduled[rows] = step_id
        ids = plan.ctx_ids + plan.gen_ids if plan.ctx_ids else plan.gen_ids
        step = Step(step_id, ids, rows32, incarnations, tokens, starts, len(plan.ctx_rows), layout=self.layout,
                    owner=self, pad_to=plan.pad_to, moves=reqs.moves, index_rows=rows)
        step.scratch_begs, step.scratch_ends, step.scratch_slots = begs, ends, scratch
        cells, cleared, written = table.logged()
        # Our writes come after the previous consumer's reads (the pipeline waits for those per device),
        # and after the copy back of any resumed KV.
        after = self.cache.spill_events() if self.cache is not None else []   # evicted blocks copied out first
        loading = set(rows.tolist()) & reqs.loading.keys() if reqs.loading else ()
        if loading:
            after += [reqs.loading[r] for r in loading]
        # A launch that fails keeps the log (the next step ships it) and forces the next step FULL.
        self.pipeline.launch(step, plan.ring_slot, cells, table.flat[cells] if len(cells) else _NO_SLOTS, cleared,
                             written, after)
        table.clear_log()
        for r in loading:          # waited for by this step, so by every later one (stream order)
            del reqs.loading[r]
        if self.cache is not None:
            self.cache.pending.clear()
        ledger.record(step)
        if self.debug_verify_mirror:        # after the step is registered: a failed check leaves it usable
            self.pipeline.verify_mirror(table)
        return step

    def _commit_contexts(self, plan: _Plan, step_id: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Own slots and scratch slots of the step's context chunks (at least one); returns the scratch
        metadata."""
        lay, table, C = self.layout, self.page_table, len(plan.ctx_rows)
        if self.cache is not None:        # a chunk's end is a boundary whose window stays cached
            for row, n in zip(plan.ctx_rows, plan.ctx_tokens):
                self.cache.add_boundary(row, int(self.requests.cap[row]) + n)
        begs = np.zeros((lay.num_groups, C), np.int32)
        ends = np.zeros((lay.num_groups, C), np.int32)
        scratch = np.zeros((lay.num_groups, C, plan.scratch_width), np.int32)
        held = {}       # chunk -> its scratch slots per group (chunks that borrow any)
        for p, (chunks, slots) in enumerate(zip(plan.ctx_slots, self._allocate_chunks(plan.ctx_slots))):
            table.write_runs(chunks.starts, chunks.lens, slots, chunks.offs)
            for c, s_lo, s_hi, o, n in chunks.scratch:
                if c not in held:
                    held[c] = [_NO_SLOTS] * lay.num_groups
                held[c][p] = slots[o:o + n]
                begs[p, c], ends[p, c] = s_lo, s_hi
                scratch[p, c, :n] = held[c][p]
                self._scratch_held[p] += n
        for c, per_group in held.items():
            self.requests.get(plan.ctx_ids[c]).scratch[step_id] = per_group
        return begs, ends, scratch

    def _allocate_chunks(self, per_group: List[_ChunkSlots]) -> List[np.ndarray]:
        """Each group's slots for the chunks, as allocating them chunk by chunk (each chunk group by group)
        gives: one allocation per group unless some group would evict cached blocks, whose evictions are
        reported (cache events, copies out) in that order."""
        if all(chunks.count <= pool.num_free for chunks, pool in zip(per_group, self.pools)):
            return [pool.allocate(chunks.count) for chunks, pool in zip(per_group, self.pools)]
        parts = [[] for _ in per_group]
        for c in range(len(per_group[0].sizes)):
            for p, chunks in enumerate(per_group):
                parts[p].append(self.pools[p].allocate(chunks.sizes[c]))
        return [np.concatenate(slots) for slots in parts]

    def _allocate_blocks(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """A slot of every group for each (row, block) (at least one): one table write for all groups."""
        table = self.page_table
        table.write(table.cells_in_every_group(rows, blocks).reshape(-1),
                    np.concatenate([pool.allocate(len(rows)) for pool in self.pools]))

    def settle(self, step: Step, accepted: Union[None, Mapping[RequestId, int], Sequence[int]] = None, *,
               input_tokens: Union[None, Mapping[RequestId, Sequence[int]], Sequence[int], np.ndarray] = None,
               new_tokens: Union[None, Mapping[RequestId, Sequence[int]], Sequence[int], np.ndarray] = None
               ) -> None:
        """The step's tokens are final: history advances by the accepted tokens.

        accepted: None (all scheduled tokens), a mapping request id -> accepted tokens, or a sequence in
        batch order. Context chunks are always accepted whole. Rejected speculative tokens are rewound
        (at most max_rewind per request, and only from the request's latest step). SWA blocks that fell
        out of the window are released, scratch slots of the step's contexts too; released slots stay
        quarantined until the steps that may read them have finished. Requests freed since the step was
        prepared are skipped.

        input_tokens: the token ids each generation entry was fed in this step, its inputs, whose K/V the
        step wrote (as many as accepted): never the tokens it sampled from them, which are the next step's
        inputs. A mapping request id -> ids, or all at once: every generation entry's accepted input ids
        in batch order, int [sum of accepted over the generation entries] (entries of freed requests
        included; their ids are ignored). With prefix caching, the blocks they fill are cached too
        (without them only prompt blocks are): reporting sampled tokens would publish KV under the wrong
        tokens. new_tokens: the same argument under its former name.
        """
        if new_tokens is not None:
            if input_tokens is not None:
                raise InvalidRequestError("settle: give input_tokens= (new_tokens= is its former name), not both")
            input_tokens = new_tokens
        reqs, ledger = self.requests, self.ledger
        if isinstance(step, DeviceStep):
            raise StepOrderError(f"settle takes the Step (step {step.id} as prepare_batch returned it), not "
                                 f"step.on({step.rank}): the tokens are settled once for every device")
        if getattr(step, "owner", None) is not self:
            raise StepOrderError("this step belongs to another manager (or is not a Step)")
        if step.settled:
            raise StepOrderError(f"step {step.id} is already settled")
        if ledger.unsettled[0] is not step:
            raise StepOrderError(f"settle steps in the order they were prepared: step "
                                 f"{ledger.unsettled[0].id} comes before {step.id}")
        acc = accepted_counts(accepted, step.request_ids, step.num_tokens, step.num_contexts, step.id)
        reported = generation_tokens(input_tokens, step.request_ids, acc, step.num_contexts, step.id)
        rows, tokens, entries = step.index_rows, step.num_tokens, None
        live = range(step.num_contexts)     # the live contexts
        if step.moves != reqs.moves:        # a request moved since the prepare: skip entries no longer live
            entries = np.flatnonzero(reqs.incarnation[rows] == step.incarnations)
            rows, acc, tokens = rows[entries], acc[entries], tokens[entries]
            live = entries[entries < step.num_contexts]
        rejected = tokens - acc if accepted is not None else None
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
                self._release_scratch([np.concatenate(held) for held in zip(*per_chunk)], tag)
        if self.cache is not None:
            index = np.arange(step.num_seqs) if entries is None else entries
            self.cache.settle(step.rows, index, step.num_contexts, rows, hist, acc, reported, self.page_table.array)
        self._release_stale(rows, hist, tag)
        step.settled = True
        ledger.unsettled.pop(0)

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
                r, lo, hi = rows[moved], done[moved], end[moved]
                count = hi - lo
                longest = np.maximum.reduce(count)      # (the ufunc: .max() wraps it in Python)
                if self.cache is None:
                    # A long chunk's settle clears each long range as one (a decode step's rows release a block
                    # or two), unless the group reuses scratch: then most of such a range is scratch blocks that
                    # never held a slot, and cells cost less.
                    if longest >= SLICE_MIN_BLOCKS and not g.scratch_reuse:
                        whole = count >= SLICE_MIN_BLOCKS
                        for row, a, b in zip(r[whole].tolist(), lo[whole].tolist(), hi[whole].tolist()):
                            self.pools[g.index].release(self.page_table.take_blocks(g.index, row, a, b), tag)
                        part = ~whole
                        pair_rows, blocks = _expand_ranges(r[part], lo[part], hi[part])
                    else:
                        pair_rows, blocks = _range_pairs(r, lo, count, longest)
                    self._release(g.index, self.page_table.cells(g.index, pair_rows, blocks), tag)
                else:       # blocks outside every retained window leave the cache once nobody holds them
                    pair_rows, blocks = _range_pairs(r, lo, count, longest)
                    cells = self.page_table.cells(g.index, pair_rows, blocks)
                    drop = self.cache.leaving(g, r.tolist(), count.cumsum().tolist(), blocks.tolist(),
                                              self.page_table.flat[cells].tolist())   # each row's blocks in order
                    self._release(g.index, cells, tag)
                    if drop:
                        drop = np.array(drop, np.int32)
                        self.cache.unhash(g.index, drop[self.pools[g.index].refs[drop] == 0])
                stale_done[r] = hi

    # -- slots -------------------------------------------------------------------------------------
    def _release(self, p: int, cells: np.ndarray, tag: int) -> None:
        """Let go of the slots held at these flat cells of group p and clear the cells; slots left with no
        holder are quarantined."""
        _, slots = self.page_table.take(cells)
        self.pools[p].release(slots, tag)

    def _release_scratch(self, per_group: Sequence[np.ndarray], tag: int) -> None:
        for p, slots in enumerate(per_group):
            self.pools[p].release(slots, tag)
            self._scratch_held[p] -= len(slots)

    # -- completion --------------------------------------------------------------------------------
    def reclaim(self, wait: bool = False) -> None:
        """Lift the quarantine of steps that have finished; with wait=True, wait for all finish events."""
        if as_flag(wait, "reclaim: wait"):
            self.ledger.wait_all()
        self.ledger.poll()

    @property
    def steps_in_flight(self) -> List[Step]:
        """Prepared steps whose finish event has not completed (or that were not finished yet)."""
        self.ledger.poll()
        return self.ledger.steps_in_flight()

    def synchronize(self) -> None:
        """Wait for all work on every device's streams, then lift the quarantine of finished steps."""
        for b in self.backends:
            b.synchronize()
        self.ledger.poll()

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """A dict: groups (per group: window, layers, and slots total / free / owned / scratch / quarantined /
        evictable), requests, steps_in_flight, steps_unsettled, ring_slots, and prefix_cache and host_tier
        (their own stats, or None when off)."""
        self.ledger.poll()
        groups = []
        for g, pool in zip(self.layout.groups, self.pools):
            scratch = self._scratch_held[g.index]
            owned = pool.total - pool.num_free - pool.num_quarantined - pool.num_evictable - scratch
            groups.append(dict(window=g.window, layers=g.num_layers, total=pool.total, free=pool.num_free,
                               owned=owned, scratch=scratch, quarantined=pool.num_quarantined,
                               evictable=pool.num_evictable))
        return dict(groups=groups, requests=len(self.requests), steps_in_flight=len(self.ledger.steps_in_flight()),
                    steps_unsettled=len(self.ledger.unsettled), ring_slots=len(self.ring.slots),
                    prefix_cache=self.cache.stats() if self.cache is not None else None,
                    host_tier=self.host_tier.stats() if self.host_tier is not None else None)

    def drain_cache_events(self) -> List[Tuple[str, int, bytes]]:
        """The blocks stored in and removed from the prefix cache since the last call, in order:
        ("stored" | "removed", group, block hash (16 bytes)). Needs CacheSpec(prefix_caching=True,
        prefix_events=True): the manager keeps the events until they are drained."""
        if not self.spec.prefix_events:
            raise InvalidRequestError("drain_cache_events: the prefix cache records no events; make the manager with "
                                      "CacheSpec(..., prefix_caching=True, prefix_events=True) and drain them regularly")
        return self.cache.drain_events()

    def verify_mirror(self) -> None:
        """Debug: wait for the manager stream and check the device mirror against the host table."""
        self.pipeline.verify_mirror(self.page_table)

    def state(self) -> tuple:
        """A comparable snapshot of every piece of host state (tests compare it around failing calls)."""
        return (self.page_table.state(), self.requests.state(), tuple(p.state() for p in self.pools),
                self.ledger.state(), tuple(self._scratch_held), self.cache.state() if self.cache else None,
                self.host_tier.state() if self.host_tier else None, tuple(sorted(self.requests.loading)))
