"""KVCacheManager: the public API (add, prepare_batch, settle, free) over the manager's parts.

    requests.RequestTable   request ids <-> table rows, per-row numbers (history, capacity, prompt, ...)
    groups.LayerGroup       each group's block rules (stale, scratch, new blocks, rewind)
    allocator.SlotPool      slots per group, released into quarantine
    table.PageTable         the host page table (the only source of truth) and its dirty log
    ledger.StepLedger       step ids, in flight, unsettled, the finish watermark that lifts quarantine
    pipeline.StepPipeline   the per-step device work: snapshot, copy, deltas, tables, ready event

    planner.StepPlanner     a step's plan: validation and what it needs, no state changed
    prefix_hook             prefix caching (or its do-nothing hook), called at the same points either way

Every public operation checks first and mutates after: when it raises a CupykvError, nothing changed.
One step, in order:

    prepare_batch   plan    StepPlanner.plan_in_room / plan: validate, count slots, take a ring slot
                    commit  allocate (chunks, scratch, opened blocks), write the host table, pack the
                            snapshot and launch the step's device work after the copies it needs
                            (evicted blocks out, resumed KV in); cannot fail on bad input after the plan
    (the consumer reads step.tables after step.ready, then step.finish(stream))
    settle          history advances by the accepted tokens; rejected tokens rewound; the chunks' scratch
                    and the blocks that left a window released (quarantined until the steps that may read
                    them have finished); prefix caching publishes the blocks whose tokens are final
"""
from __future__ import annotations

from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .allocator import CachingSlotPool, SlotPool
from .args import manager_options, accepted_counts, as_count, as_flag, context_items, generation_tokens, request_ids, salt_bytes, token_ids
from .backends import make_backends
from .errors import (CapacityExceededError, InvalidRequestError, InvalidSpecError, SpecTooLargeError,
                     StepOrderError)
from .layout import NO_INDEX, Layout
from .ledger import StepLedger
from .pipeline import StepPipeline, UnsafeStaging
from .chunks import commit_chunks
from .planner import Plan, StepPlanner
from .prefix_cache import PrefixCache
from .prefix_hook import NoPrefixCaching, PrefixCaching
from .residence import Residence
from .settler import StepSettler
from .requests import Request, RequestId, RequestTable, frozen
from .spec import INT32_MAX, CacheSpec
from .step import DeviceStep, Step
from .table import PageTable

_NO_SLOTS = frozen(np.zeros(0, np.int32))


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
        o = manager_options(staging=staging, ring_slots=ring_slots, max_ring_slots=max_ring_slots,
                            staging_timeout_s=staging_timeout_s, max_steps_in_flight=max_steps_in_flight,
                            debug_verify_mirror=debug_verify_mirror, use_graphs=use_graphs,
                            steady_batch_delta=steady_batch_delta)
        self.spec = spec
        self.layout = lay = Layout(spec)
        self.backends = make_backends(backend, devices)
        self.backend = be = self.backends[0]
        self.devices = [getattr(b, "device_id", 0) for b in self.backends]
        self.staging, self.debug_verify_mirror = o["staging"], o["debug_verify_mirror"]
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
            self.ledger = StepLedger(self.pools, o["staging_timeout_s"])
            self.requests = RequestTable(rows, P, np.array([g.sink_blocks for g in lay.groups], np.int64),
                                         self.ledger)
            options = dict(ring_slots=o["ring_slots"], max_ring_slots=o["max_ring_slots"],
                           timeout_s=o["staging_timeout_s"], use_graphs=o["use_graphs"],
                           steady_batch_delta=o["steady_batch_delta"])
            self.pipeline = (UnsafeStaging(lay, self.backends, self.page_table, **options) if self.staging == "unsafe"
                             else StepPipeline(lay, self.backends, **options))
        except MemoryError as e:
            raise SpecTooLargeError(f"the buffers this CacheSpec sizes do not fit ({e}): {spec.buffer_sizes()}") from e
        self.prefix = (NoPrefixCaching(lay, self.requests, self.page_table, self.pools) if self.cache is None else
                       PrefixCaching(lay, self.requests, self.page_table, self.pools, self.ledger, self.cache))
        self.planner = StepPlanner(spec, lay, self.requests, self.ledger, self.page_table, self.pools,
                                   self.pipeline, self.prefix, o["max_steps_in_flight"])
        self.settler = StepSettler(spec, lay, self.requests, self.page_table, self.pools, self.ledger, self.prefix)
        self.host_tier = None           # a KVStorage's host tier, once attach_host_tier registered it
        self.residence = Residence(self)
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
        reqs = self.requests
        reqs.check_new(rid)
        n = as_count(prompt_len, f"request {rid!r}: prompt_len", minimum=1)
        if n > self.spec.max_seq_len:
            raise CapacityExceededError(f"request {rid!r}: prompt_len={n} exceeds max_seq_len={self.spec.max_seq_len}")
        if not reqs.free_rows:
            raise CapacityExceededError(f"request {rid!r}: all max_batch={self.spec.max_batch} rows are in use")
        if self.cache is not None and tokens is None:
            raise InvalidRequestError(f"request {rid!r}: prefix caching is on, so add() needs tokens= "
                                      f"(the prompt's {n} token ids)")
        toks = None if tokens is None else token_ids(tokens, f"request {rid!r}: tokens", n)
        salt = salt_bytes(cache_salt)
        if (isinstance(checkpoints, (str, bytes, Mapping)) or not isinstance(checkpoints, Iterable)
                or getattr(checkpoints, "ndim", 1) != 1):
            raise InvalidRequestError(f"request {rid!r}: checkpoints={checkpoints!r} must be prompt positions")
        marks = sorted({as_count(c, f"request {rid!r}: checkpoint", minimum=1, maximum=n) for c in checkpoints})
        return self.prefix.admit(rid, n, toks, salt, marks)

    def free(self, rid: RequestId) -> None:
        """Release every slot of the request (quarantined until the steps that may read them finish)."""
        req = self.requests.get(rid)
        if req.parked in ("sending", "receiving"):
            raise StepOrderError(f"request {rid!r} is {req.parked}: a transport may still touch its slots; "
                                 f"call KVTransfers.{'sent or unsend' if req.parked == 'sending' else 'unreceive'} "
                                 "first")
        loading = self.requests.loading.get(req.row)
        # A copy back (resume, host-tier hits) that no step has waited for yet may still write its slots.
        tag = self.ledger.record_fence(loading) if loading is not None else self.ledger.last_prepared
        self.prefix.end(req.row)        # with caching, every cached block it holds keeps its hash
        self.residence.release_row(req.row, tag)
        for slots in req.scratch.values():
            self.settler.release_scratch(slots, tag)
        req.scratch.clear()
        if self.host_tier is not None:
            self.host_tier.forget(rid)
        self.requests.remove(rid)

    def attach_host_tier(self, tier) -> None:
        """Register a KVStorage's host tier (one per manager): free() lets go of a request's host copy, and
        stats() and state() include the tier's."""
        if self.host_tier is not None:
            raise InvalidRequestError("this manager already has a host tier (one KVStorage with host_tier_bytes)")
        self.host_tier = tier

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
        reqs, planner = self.requests, self.planner
        gen = reqs.last_generation
        in_room = not ctx_items and gen is not None and gen.has_room(k, reqs.cap_writes)   # (never at b256)
        plan = planner.plan_in_room(gen, gen_ids, k, pad) if in_room else None
        return self._commit(plan if plan is not None else planner.plan(ctx_items, gen_ids, k, pad))

    @property
    def max_steps_in_flight(self) -> int:
        """Prepared steps whose finish event has not completed, at most (see the class docstring)."""
        return self.planner.max_steps_in_flight

    @max_steps_in_flight.setter
    def max_steps_in_flight(self, n: int) -> None:
        self.planner.max_steps_in_flight = as_count(n, "max_steps_in_flight", minimum=1, error=InvalidSpecError)

    def _commit(self, plan: Plan) -> Step:
        """Allocate, write the host table, pack the snapshot and enqueue; cannot fail on bad input."""
        reqs, ledger, table = self.requests, self.ledger, self.page_table
        ledger.poll()
        step_id = ledger.next_id
        gen, k = plan.gen, plan.k
        if plan.ctx_rows:
            for row, n in zip(plan.ctx_rows, plan.ctx_tokens):
                self.prefix.chunk_end(row, int(reqs.cap[row]) + n)
            begs, ends, scratch = commit_chunks(plan, step_id, table, self.pools, reqs)
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
                    owner=self, pad_to=plan.pad_to, moves=reqs.moves, index_rows=rows,
                    list_key=(gen.serial, k, plan.pad_to) if gen is not None and not plan.ctx_rows else None)
        step.scratch_begs, step.scratch_ends, step.scratch_slots = begs, ends, scratch
        cells, cleared, written = table.logged()
        # Our writes come after the previous consumer's reads (the pipeline waits for those per device),
        # and after the copy back of any resumed KV.
        after = self.prefix.copies_before()
        loading = set(rows.tolist()) & reqs.loading.keys() if reqs.loading else ()
        if loading:
            after += [reqs.loading[r] for r in loading]
        # A launch that fails keeps the log (the next step ships it) and forces the next step FULL.
        self.pipeline.launch(step, plan.ring_slot, cells, table.flat[cells] if len(cells) else _NO_SLOTS, cleared,
                             written, after)
        table.clear_log()
        for r in loading:          # waited for by this step, so by every later one (stream order)
            del reqs.loading[r]
        self.prefix.committed()
        ledger.record(step)
        if self.debug_verify_mirror:        # after the step is registered: a failed check leaves it usable
            self.pipeline.verify_mirror(table)
        return step

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
        ledger = self.ledger
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
        self.settler.settle(step, acc, reported, accepted is not None)
        step.settled = True
        ledger.unsettled.pop(0)

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
        held = self.requests.scratch_held(self.layout.num_groups)
        for g, pool in zip(self.layout.groups, self.pools):
            scratch = held[g.index]
            owned = pool.total - pool.num_free - pool.num_quarantined - pool.num_evictable - scratch
            groups.append(dict(window=g.window, layers=g.num_layers, total=pool.total, free=pool.num_free,
                               owned=owned, scratch=scratch, quarantined=pool.num_quarantined,
                               evictable=pool.num_evictable))
        return dict(groups=groups, requests=len(self.requests), steps_in_flight=len(self.ledger.steps_in_flight()),
                    steps_unsettled=len(self.ledger.unsettled), ring_slots=len(self.ring.slots),
                    prefix_cache=self.prefix.stats(),
                    host_tier=self.host_tier.stats() if self.host_tier is not None else None)

    def drain_cache_events(self, detail: bool = False) -> List[tuple]:
        """The blocks stored in and removed from the prefix cache since the last call, in order:
        ("stored" | "removed", group, block hash (16 bytes)). detail: stored events also carry the parent
        block's hash (None for a sequence's first block) and the block's tokens (int64 little-endian bytes),
        (kind, group, hash, parent, tokens), what cupykv.kv_events turns into vLLM's wire format. Needs
        CacheSpec(prefix_caching=True, prefix_events=True): the manager keeps the events until they are
        drained. A block evicted to the host tier stays stored (a hit brings it back)."""
        if not self.spec.prefix_events:
            raise InvalidRequestError("drain_cache_events: the prefix cache records no events; make the manager with "
                                      "CacheSpec(..., prefix_caching=True, prefix_events=True) and drain them regularly")
        events = self.cache.drain_events()
        return events if detail else [e[:3] for e in events]

    def verify_mirror(self) -> None:
        """Debug: wait for the manager stream and check the device mirror against the host table."""
        self.pipeline.verify_mirror(self.page_table)

    def state(self) -> tuple:
        """A comparable snapshot of every piece of host state (tests compare it around failing calls)."""
        return (self.page_table.state(), self.requests.state(), tuple(p.state() for p in self.pools),
                self.ledger.state(), self.requests.scratch_held(self.layout.num_groups), self.prefix.state(),
                self.host_tier.state() if self.host_tier else None, tuple(sorted(self.requests.loading)))
