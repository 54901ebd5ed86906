"""The tests' oracle: what the manager must produce, worked out from the contract alone.

Written from ../shared/DESIGN.md sections 2 (concepts) and 3 (the conversion contract), independent of
the implementation: the layer groups, block counts and ranges are derived here from the spec's own
fields (never from cupykv.layout), and only the conversion itself is delegated to cupykv.reference, the
NumPy statement of section 3.

- Geometry(spec): layer groups, scale and offsets, B, stale and scratch ranges, and which blocks of a
  sequence hold a slot of their own.
- reference_tables / expected_tables / expected_write_positions: the step outputs.
- Model: history, capacity, row and unsettled scratch ranges per request, from the calls alone;
  Modelled drives a manager and its Model together and checks the manager after each call.
- check_slots / check_stats / held_slots: slot conservation and reading a request's slots.
- Capture: a consumer on its own stream that copies each step's tables out for a later comparison.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Tuple

import numpy as np

from cupykv import reference

BAD = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------------
# Geometry: DESIGN.md section 2
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """One layer group: the layers with the same window and sink count (full attention: no sinks)."""

    index: int
    window: Optional[int]
    sink_tokens: int
    layers: Tuple[int, ...]
    tpb: int

    @property
    def scale(self) -> int:
        return 2 * len(self.layers)

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.tpb) if self.window is not None else 0


class Geometry:
    """The page math of a spec, from its fields: groups in order of their first layer."""

    def __init__(self, spec):
        self.spec = spec
        self.tpb = int(spec.tokens_per_block)
        self.max_rewind = int(spec.max_rewind)
        self.scratch_reuse = bool(spec.swa_scratch_reuse)
        self.shared = spec.table_mode == "shared"
        self.max_blocks = cdiv(cdiv(int(spec.max_seq_len) + self.max_rewind + 1, self.tpb), 4) * 4
        windows = [None if w is None else int(w) for w in spec.windows]
        sinks = spec.sink_tokens
        sinks = [int(s) for s in sinks] if not np.isscalar(sinks) else [int(sinks)] * len(windows)
        layers_of: Dict[tuple, List[int]] = {}
        for layer, w in enumerate(windows):
            layers_of.setdefault((w, sinks[layer] if w is not None else 0), []).append(layer)
        self.groups = tuple(Group(i, w, s, tuple(ls), self.tpb) for i, ((w, s), ls) in enumerate(layers_of.items()))
        self.num_layers = len(windows)
        self.layer_group = np.empty(self.num_layers, np.int32)
        self.layer_koff = np.empty(self.num_layers, np.int32)     # 2i for the i-th layer of its group
        for g in self.groups:
            for i, layer in enumerate(g.layers):
                self.layer_group[layer], self.layer_koff[layer] = g.index, 2 * i
        self.group_scale = np.array([g.scale for g in self.groups], np.int32)

    def group(self, g) -> Group:
        """A group by index, or the oracle's group of the same index as another group object."""
        return self.groups[g if isinstance(g, (int, np.integer)) else g.index]

    def planes(self, shared: Optional[bool] = None) -> int:
        return len(self.groups) if (self.shared if shared is None else shared) else self.num_layers

    def stale_range(self, g, history: int) -> Tuple[int, int]:
        """[sink_blocks, max(sink_blocks, (h + 1 - W) // tpb)); empty for full attention."""
        g = self.group(g)
        if g.window is None:
            return (0, 0)
        return (g.sink_blocks, max(g.sink_blocks, (history + 1 - g.window) // self.tpb))

    def scratch_range(self, g, start: int, capacity: int) -> Tuple[int, int]:
        """stale_range(c - max_rewind) ∩ [ceil(c0 / tpb), ceil(c / tpb)) of a chunk c0 -> c; (0, 0) when
        empty (as the step's metadata writes it), with scratch reuse off, or for full attention."""
        g = self.group(g)
        if not self.scratch_reuse or g.window is None:
            return (0, 0)
        lo, hi = self.stale_range(g, capacity - self.max_rewind)
        lo, hi = max(lo, cdiv(start, self.tpb)), min(hi, cdiv(capacity, self.tpb))
        return (lo, hi) if lo < hi else (0, 0)

    def scratch_slots_needed(self, g, num_blocks: int) -> int:
        return cdiv(2 * num_blocks, self.group(g).scale)

    def blocks_with_slot(self, g, history: int, capacity: int, scratch=()) -> set:
        """Blocks that hold a slot of their own: [0, ceil(c / tpb)) minus the stale range at the history
        minus the scratch ranges of the unsettled context chunks."""
        blocks = set(range(cdiv(capacity, self.tpb)))
        blocks -= set(range(*self.stale_range(g, history)))
        for lo, hi in scratch:
            blocks -= set(range(lo, hi))
        return blocks


# --------------------------------------------------------------------------------------------------
# Step outputs: DESIGN.md section 3
# --------------------------------------------------------------------------------------------------
def reference_tables(spec, table, copy_idx, num_contexts=0, begs=None, ends=None, scratch=None, *,
                     shared: Optional[bool] = None, fill: int = BAD, null_slots=None,
                     pad_to: int = 0) -> np.ndarray:
    """The tables of one step, [planes, max_batch, 2, B]; rows >= max(len(copy_idx), pad_to) hold `fill`.

    table: [P, rows, B] base slots at the step's prepare; copy_idx: the table row of each batch entry;
    begs/ends [P, >= num_contexts] and scratch [P, >= num_contexts, M]: the contexts' scratch metadata.
    shared: SHARED tables (default: the spec's table_mode). null_slots: [P] null slot per group
    (DESIGN.md section 10: BAD cells and padding rows hold its page), or None (BAD stays BAD).
    pad_to: rows [num_seqs, pad_to) are padding rows.
    """
    geo = Geometry(spec)
    shared = geo.shared if shared is None else shared
    out = np.full((geo.planes(shared), spec.max_batch, 2, geo.max_blocks), fill, np.int32)
    if shared:
        return reference.convert_shared(table, copy_idx, geo.group_scale, out=out, null_slots=null_slots,
                                        pad_to=pad_to)
    P = len(geo.groups)
    none = np.zeros((P, 0), np.int32)
    return reference.convert_per_layer(table, copy_idx, num_contexts, none if begs is None else begs,
                                       none if ends is None else ends,
                                       np.zeros((P, 0, 0), np.int32) if scratch is None else scratch,
                                       geo.layer_group, geo.group_scale, geo.layer_koff, out=out,
                                       null_slots=null_slots, pad_to=pad_to)


def null_slots(mgr) -> Optional[Tuple[int, ...]]:
    """Each group's null slot (DESIGN.md section 10; CacheSpec(null_slot=True)), None without: the group's
    last slot. The slot counts are the spec's slots_per_group; only a spec sized by memory_bytes takes
    them from the manager's layout (that split is sizing, not the contract)."""
    spec = mgr.spec
    if not spec.null_slot:
        return None
    counts = spec.slots_per_group
    if counts is None:
        counts = mgr.layout.slots_per_group
    elif np.isscalar(counts):
        counts = [counts] * len(Geometry(spec).groups)
    return tuple(int(n) - 1 for n in counts)


def expected_tables(mgr, table_at_prepare: np.ndarray, step, *, null_slot: Optional[bool] = None) -> np.ndarray:
    """The reference tables of `step`'s rows [planes, num_seqs, 2, B], from the host table as it was at
    the step's prepare. null_slot: BAD cells hold the null slot's page (default: the spec's null_slot);
    False gives the plain tables (BAD), which the write positions follow either way."""
    use_null = mgr.spec.null_slot if null_slot is None else null_slot
    return reference_tables(mgr.spec, table_at_prepare, step.rows, step.num_contexts, step.scratch_begs,
                            step.scratch_ends, step.scratch_slots,
                            null_slots=null_slots(mgr) if use_null else None)[:, :step.num_seqs]


def expected_write_positions(spec, tables: np.ndarray, num_tokens, start_positions,
                             shared: Optional[bool] = None, null_slots=None) -> Tuple[np.ndarray, np.ndarray]:
    """Where each new token's K/V goes, read off a step's reference tables: pages [L, T], offsets [T].

    Token t of entry s at position pos goes to the K page of block pos // tpb (clamped to the row) of
    layer l's table; SHARED tables add the layer's K offset. The offset is pos % tpb. Write positions
    never name the null slot: with null_slots (the tables were made with them), a page in group g's
    null slot is BAD here (tables made without null slots need none).
    """
    geo = Geometry(spec)
    shared = geo.shared if shared is None else shared
    counts = np.asarray(num_tokens, np.int64)
    seq = np.repeat(np.arange(len(counts)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    pos = np.asarray(start_positions, np.int64)[seq] + (np.arange(len(seq)) - first)
    blk = np.clip(pos // geo.tpb, 0, geo.max_blocks - 1)
    pages = np.empty((geo.num_layers, len(seq)), np.int32)
    for layer in range(geo.num_layers):
        g = int(geo.layer_group[layer])
        k = tables[g if shared else layer, seq, 0, blk].astype(np.int64)
        if null_slots is not None:      # page // scale is the page's slot (BAD // scale = -1: no slot)
            k = np.where(k // geo.group_scale[g] == int(null_slots[g]), BAD, k)
        pages[layer] = np.where(k == BAD, BAD, k + geo.layer_koff[layer]) if shared else k
    return pages, (pos % geo.tpb).astype(np.int32)


# --------------------------------------------------------------------------------------------------
# Model: the per-request numbers from the calls alone
# --------------------------------------------------------------------------------------------------
@dataclass(eq=False)                 # compared by identity: a re-added id is another request
class ModelRequest:
    rid: Hashable
    prompt: int
    row: int
    history: int = 0
    capacity: int = 0
    scratch: Dict[int, Dict[int, Tuple[int, int]]] = field(default_factory=dict)  # step id -> group -> range


@dataclass
class ModelEntry:
    request: ModelRequest
    tokens: int
    start: int
    context: bool
    scratch: Dict[int, Tuple[int, int]]          # group -> scratch range ((0, 0) when none)


@dataclass
class ModelStep:
    """What a prepared step must look like: batch order (contexts first), tokens, starts, scratch."""

    id: int
    entries: List[ModelEntry]

    @property
    def request_ids(self) -> list:
        return [e.request.rid for e in self.entries]

    @property
    def num_contexts(self) -> int:
        return sum(e.context for e in self.entries)


class Model:
    """History and capacity of every request, its table row (the lowest free one), and the scratch
    ranges of its unsettled context chunks, from add / prepare / settle / free calls alone.

    Counts may be any integer type; the model works in Python ints. It trusts its caller: feed it only
    calls the manager accepted.
    """

    def __init__(self, spec):
        self.geo = Geometry(spec)
        self.requests: Dict[Hashable, ModelRequest] = {}
        self.steps: Dict[int, ModelStep] = {}          # unsettled
        self.free_rows = list(range(spec.max_batch))

    def __contains__(self, rid) -> bool:
        return rid in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def rids(self) -> list:
        return list(self.requests)

    def request(self, rid) -> ModelRequest:
        return self.requests[rid]

    def add(self, rid, prompt_len) -> ModelRequest:
        row = min(self.free_rows)
        self.free_rows.remove(row)
        self.requests[rid] = req = ModelRequest(rid, int(prompt_len), row)
        return req

    def free(self, rid) -> None:
        self.free_rows.append(self.requests.pop(rid).row)

    def prepare(self, step_id: int, contexts=(), generation=(), num_gen_tokens=1) -> ModelStep:
        items = list(contexts.items()) if isinstance(contexts, Mapping) else [tuple(c) for c in contexts]
        entries = []
        for rid, n in [(rid, int(n)) for rid, n in items] + [(rid, int(num_gen_tokens)) for rid in generation]:
            req = self.requests[rid]
            context = len(entries) < len(items)
            start, req.capacity = req.capacity, req.capacity + n
            scratch = {g.index: self.geo.scratch_range(g, start, req.capacity) for g in self.geo.groups}
            if context:
                req.scratch[step_id] = scratch
            entries.append(ModelEntry(req, n, start, context, scratch))
        self.steps[step_id] = step = ModelStep(step_id, entries)
        return step

    def settle(self, step_id: int, accepted=None) -> None:
        """accepted: None (all), request id -> tokens, or a sequence in batch order, as settle takes it."""
        step = self.steps.pop(step_id)
        in_order = None if accepted is None or isinstance(accepted, Mapping) else list(accepted)
        for i, e in enumerate(step.entries):
            req = e.request
            if self.requests.get(req.rid) is not req:     # freed since the prepare
                continue
            if accepted is None or e.context:
                a = e.tokens
            elif isinstance(accepted, Mapping):
                a = int(accepted.get(req.rid, e.tokens))
            else:
                a = int(in_order[i])
            assert 0 <= a <= e.tokens, (req.rid, a, e.tokens)
            req.history += a
            req.capacity -= e.tokens - a
            req.scratch.pop(step_id, None)

    def is_live(self, step_id: int, index: int) -> bool:
        """Whether entry `index` of an unsettled step is still the request it scheduled."""
        req = self.steps[step_id].entries[index].request
        return self.requests.get(req.rid) is req

    def stale_edge(self, rid, g) -> int:
        """(h + 1 - W) // tpb: the stale range's upper end before the sinks clamp it."""
        return (self.requests[rid].history + 1 - self.geo.group(g).window) // self.geo.tpb

    def blocks(self, rid, g) -> set:
        """Blocks of the request that must hold a slot of their own in group g now."""
        req = self.requests[rid]
        g = self.geo.group(g)
        return self.geo.blocks_with_slot(g, req.history, req.capacity, [s[g.index] for s in req.scratch.values()])

    # -- checks ----------------------------------------------------------------------------------
    def check_step(self, step, expected: ModelStep) -> None:
        """The step's batch, tokens, start positions and scratch ranges are the model's."""
        assert list(step.request_ids) == expected.request_ids, (list(step.request_ids), expected.request_ids)
        assert step.num_contexts == expected.num_contexts
        assert [int(n) for n in step.num_tokens] == [e.tokens for e in expected.entries], step.num_tokens
        assert [int(n) for n in step.start_positions] == [e.start for e in expected.entries], step.start_positions
        for k, e in enumerate(expected.entries[:expected.num_contexts]):
            for g in self.geo.groups:
                got = (int(step.scratch_begs[g.index, k]), int(step.scratch_ends[g.index, k]))
                assert got == e.scratch[g.index], (step.id, e.request.rid, g.index, got, e.scratch[g.index])

    def check_table(self, mgr) -> None:
        """Each request's row, history and capacity are the model's, its row holds a slot at exactly the
        model's blocks, and the rows nobody holds are empty."""
        for rid, req in self.requests.items():
            live = mgr.request(rid)
            assert (live.row, live.history, live.capacity) == (req.row, req.history, req.capacity), rid
            for g in self.geo.groups:
                got = set(np.flatnonzero(mgr.table[g.index, req.row] != BAD).tolist())
                want = self.blocks(rid, g)
                assert got == want, (rid, g.index, req.history, req.capacity, sorted(got - want), sorted(want - got))
        for row in self.free_rows:
            assert (mgr.table[:, row] == BAD).all(), f"row {row} is free but not empty"


class Modelled:
    """A manager and its Model driven together: each call goes to the manager first and, when it
    succeeds, to the model; prepare also checks the step against the model."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.model = Model(mgr.spec)
        self.unsettled: list = []       # (Step, ModelStep), in prepare order

    def add(self, rid, prompt_len) -> None:
        self.mgr.add(rid, prompt_len)
        self.model.add(rid, prompt_len)

    def free(self, rid) -> None:
        self.mgr.free(rid)
        self.model.free(rid)

    def prepare(self, contexts=(), generation=(), num_gen_tokens=1, **kw):
        contexts = contexts if isinstance(contexts, Mapping) else list(contexts)
        generation = list(generation)
        step = self.mgr.prepare_batch(contexts, generation, num_gen_tokens, **kw)
        expected = self.model.prepare(step.id, contexts, generation, num_gen_tokens)
        self.model.check_step(step, expected)
        self.unsettled.append((step, expected))
        return step

    def settle(self, step, accepted=None) -> None:
        self.mgr.settle(step, accepted)
        assert self.unsettled[0][0] is step
        self.unsettled.pop(0)
        self.model.settle(step.id, accepted)

    def scratch_held(self) -> Dict[int, list]:
        """Scratch slots held now, per group: those of the unsettled chunks of live requests, as their
        steps' metadata names them (the first ceil(2 * blocks / scale) of each range)."""
        held = {g.index: [] for g in self.model.geo.groups}
        for step, expected in self.unsettled:
            for k in range(expected.num_contexts):
                if not self.model.is_live(step.id, k):
                    continue
                for g in self.model.geo.groups:
                    n = int(step.scratch_ends[g.index, k]) - int(step.scratch_begs[g.index, k])
                    used = self.model.geo.scratch_slots_needed(g, n) if n > 0 else 0
                    held[g.index] += step.scratch_slots[g.index, k, :used].tolist()
        return held

    def check(self) -> None:
        self.model.check_table(self.mgr)
        check_slots(self.mgr, self.scratch_held())


# --------------------------------------------------------------------------------------------------
# Slots
# --------------------------------------------------------------------------------------------------
def check_stats(mgr) -> None:
    """stats(): free + owned + scratch + quarantined = total in every group, none negative."""
    for g in mgr.stats()["groups"]:
        assert g["free"] + g["owned"] + g["scratch"] + g["quarantined"] == g["total"], g
        assert min(g["free"], g["owned"], g["scratch"], g["quarantined"]) >= 0, g


def check_slots(mgr, scratch_held: Optional[Dict[int, list]] = None) -> None:
    """Every slot of every group is exactly one of: in a table cell, held as scratch, free, quarantined.

    scratch_held: group -> scratch slots held now (Modelled.scratch_held); none when omitted.
    """
    check_stats(mgr)
    for p, pool in enumerate(mgr.pools):
        cells = mgr.table[p]
        every = (cells[cells != BAD].tolist() + list((scratch_held or {}).get(p, ())) +
                 pool.free_slots().tolist() + pool.quarantined_slots().tolist())
        assert sorted(every) == list(range(pool.total)), f"group {p}: a slot is lost or owned twice"


def held_slots(mgr, rid) -> list:
    """The slots in the request's table row, per group, ascending."""
    row = mgr.request(rid).row
    return [sorted(int(v) for v in mgr.table[p, row] if v != BAD) for p in range(len(mgr.pools))]


# --------------------------------------------------------------------------------------------------
# A consumer on its own stream
# --------------------------------------------------------------------------------------------------
class Capture:
    """A consumer on its own stream: waits for the step's ready event, copies its tables out, finishes.

    Nothing runs until the device does the work, so what it captured is what a real attention kernel
    would have read at that point of the stream order.
    """

    def __init__(self, mgr):
        self.mgr = mgr
        self.stream = mgr.backend.new_stream("consumer")
        self.items = []   # (step, table at prepare, device buffer)
        self.spare = []   # buffers allocated while nothing is gated (an allocation's memset would queue)

    def reserve(self, count: int) -> "Capture":
        """Allocate buffers for `count` steps now, before a gate holds the streams."""
        be = self.mgr.backend
        self.spare += [be.device_empty(self.mgr.out.size).reshape(self.mgr.out.shape) for _ in range(count)]
        be.synchronize()
        return self

    def consume(self, step) -> None:
        be = self.mgr.backend
        buf = self.spare.pop() if self.spare else be.device_empty(self.mgr.out.size).reshape(self.mgr.out.shape)
        be.wait(self.stream, step.ready)
        be.copy_d2d(buf, self.mgr.out, self.stream)
        step.finish(self.stream)
        self.items.append((step, self.mgr.table.copy(), buf))

    def mismatches(self) -> list:
        """Ids of captured steps whose tables differ from the reference (call after the work ran)."""
        bad = []
        for step, table, buf in self.items:
            got = self.mgr.backend.to_numpy(buf)[:, :step.num_seqs]
            if not np.array_equal(got, expected_tables(self.mgr, table, step)):
                bad.append(step.id)
        return bad
