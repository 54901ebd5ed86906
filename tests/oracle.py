"""The tests' oracle: what the manager must produce, worked out from the contract alone.

Written from the contract as docs/design.md states it ("The conversion contract", "Ranges") and the
README's "Concepts", independent of the implementation: the layer groups, block counts and ranges are
derived here from the spec's own fields (never from cupykv.layout), and only the conversion itself is
delegated to cupykv.reference, the NumPy statement of the conversion contract.

- Geometry(spec): layer groups, scale and offsets, B, stale and scratch ranges, and which blocks of a
  sequence hold a slot of their own.
- reference_tables / expected_tables / expected_write_positions: the step outputs.
- Model: history, capacity, row and unsettled scratch ranges per request, from the calls alone;
  Modelled drives a manager and its Model together and checks the manager after each call.
- check_slots / check_stats / held_slots: slot conservation and reading a request's slots.
- Capture: a consumer on its own stream that copies each step's tables (and write positions) out for a
  later comparison.
- PrefixModel / PrefixModelled: the prefix cache of docs/design.md's "Prefix caching" (block identity by salt and token
  prefix, reference counts, quarantine, LRU eviction, publishing, retention, hits), driven with a
  manager made with CacheSpec(prefix_caching=True) and checked against it after every call.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Set, Tuple

import numpy as np

from cupykv import reference
from cupykv.errors import OutOfSlotsError

BAD = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------------
# Geometry: the README's "Concepts" and docs/design.md's "Ranges"
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

    # -- prefix caching: docs/design.md's "Prefix caching" ---------------------------------------------
    def hit_needs(self, g, blocks: int) -> set:
        """Blocks of group g that a query at n = blocks * tpb sees, so a hit of that length needs them
        cached: all of [0, blocks) for full attention; the sinks and [max(sinks, (n + 1 - W) // tpb),
        blocks) for a window W (the blocks a request holds with history = capacity = n)."""
        n = blocks * self.tpb
        return self.blocks_with_slot(g, n, n)

    def retained_window(self, g, pos: int) -> Tuple[int, int]:
        """The blocks a boundary at `pos` keeps cached in a sliding-window group, above the sinks: what a
        hit at floor(pos / tpb) * tpb needs, plus one block before it."""
        g = self.group(g)
        b = pos // self.tpb
        return (max(g.sink_blocks, self.stale_range(g, b * self.tpb)[1] - 1), b)


# --------------------------------------------------------------------------------------------------
# Step outputs: docs/design.md's "The conversion contract"
# --------------------------------------------------------------------------------------------------
def reference_tables(spec, table, copy_idx, num_contexts=0, begs=None, ends=None, scratch=None, *,
                     shared: Optional[bool] = None, fill: int = BAD, null_slots=None,
                     pad_to: int = 0) -> np.ndarray:
    """The tables of one step, [planes, max_batch, 2, B]; rows >= max(len(copy_idx), pad_to) hold `fill`.

    table: [P, rows, B] base slots at the step's prepare; copy_idx: the table row of each batch entry;
    begs/ends [P, >= num_contexts] and scratch [P, >= num_contexts, M]: the contexts' scratch metadata.
    shared: SHARED tables (default: the spec's table_mode). null_slots: [P] null slot per group
    (docs/design.md, "Consumers in detail", null slot: BAD cells and padding rows hold its page), or None (BAD
    stays BAD).
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
    """Each group's null slot (docs/design.md, "Consumers in detail"; CacheSpec(null_slot=True)), None without: the group's
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


def expected_tables(mgr, table_at_prepare: np.ndarray, step, *, null_slot: Optional[bool] = None,
                    padded: bool = False) -> np.ndarray:
    """The reference tables of `step`'s rows [planes, num_seqs, 2, B], from the host table as it was at
    the step's prepare. null_slot: BAD cells hold the null slot's page (default: the spec's null_slot);
    False gives the plain tables (BAD), which the write positions follow either way. padded: the padding
    rows [num_seqs, pad_to) too, [planes, max(num_seqs, pad_to), 2, B]."""
    use_null = mgr.spec.null_slot if null_slot is None else null_slot
    live = max(step.num_seqs, step.pad_to) if padded else step.num_seqs
    return reference_tables(mgr.spec, table_at_prepare, step.rows, step.num_contexts, step.scratch_begs,
                            step.scratch_ends, step.scratch_slots, null_slots=null_slots(mgr) if use_null else None,
                            pad_to=step.pad_to if padded else 0)[:, :live]


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


def _in_batch_order(accepted):
    """settle's accepted as a list when given in batch order, else None."""
    return None if accepted is None or isinstance(accepted, Mapping) else list(accepted)


def _accepted_tokens(entry, i: int, accepted, in_order) -> int:
    """The tokens settle accepts for batch entry i (contexts whole; None: all)."""
    if accepted is None or entry.context:
        a = entry.tokens
    elif isinstance(accepted, Mapping):
        a = int(accepted.get(entry.request.rid, entry.tokens))
    else:
        a = int(in_order[i])
    assert 0 <= a <= entry.tokens, (entry.request.rid, a, entry.tokens)
    return a


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
        in_order = _in_batch_order(accepted)
        for i, e in enumerate(step.entries):
            req = e.request
            if self.requests.get(req.rid) is not req:     # freed since the prepare
                continue
            a = _accepted_tokens(e, i, accepted, in_order)
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
# Prefix caching: docs/design.md's "Prefix caching" (the rules are also in cupykv/prefix_cache.py's docstring)
# --------------------------------------------------------------------------------------------------
STORED, REMOVED = "stored", "removed"


def salt_key(salt) -> bytes:
    """cache_salt as the cache tells requests apart by it: None = no salt, str as UTF-8, bytes as is."""
    if salt is None:
        return b""
    return salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)


class BlockIds:
    """What makes two full blocks the same block: block b of one sequence is block b of another iff
    their salts and tokens[0:(b + 1) * tpb] agree (the hash chain h_b covers the salt and every earlier
    block). The model interns (previous block, this block's tokens) instead of hashing: an id per
    distinct (salt, token prefix)."""

    def __init__(self, tpb: int):
        self.tpb = tpb
        self._ids: Dict[tuple, int] = {}

    def extend(self, salt: bytes, ids: List[int], tokens: Sequence[int]) -> None:
        """Append to `ids` (the ids of the first len(ids) blocks of `tokens`) the ids of its other full
        blocks."""
        tpb = self.tpb
        parent = ids[-1] if ids else ("salt", salt)
        for b in range(len(ids), len(tokens) // tpb):
            parent = self._ids.setdefault((parent, tuple(tokens[b * tpb:(b + 1) * tpb])), len(self._ids))
            ids.append(parent)


@dataclass(eq=False)
class PrefixRequest(ModelRequest):
    salt: bytes = b""
    tokens: List[int] = field(default_factory=list)       # known tokens: the prompt, then reported ones
    ids: List[int] = field(default_factory=list)          # content id of each full block of `tokens`
    complete: bool = True                                 # every accepted generation token was reported
    boundaries: List[int] = field(default_factory=list)   # prompt end, checkpoints, chunk ends
    hit: int = 0                                          # blocks [0, hit) came from a hit
    published: Dict[int, int] = field(default_factory=dict)            # group -> blocks [0, n) offered
    slots: Dict[int, Dict[int, int]] = field(default_factory=dict)     # group -> block -> slot (its row)
    scratch_slots: Dict[int, Dict[int, List[int]]] = field(default_factory=dict)  # step -> group -> slots
    margin: Dict[int, Tuple[int, int, Optional[int]]] = field(default_factory=dict)  # group -> newest block
    #                                                  out of the window: (block, slot, cache entry serial)


class PrefixModel(Model):
    """The prefix cache of docs/design.md's "Prefix caching" on top of Model, slot by slot, from the calls alone:

    - a block's identity is its salt and token prefix (BlockIds); a group caches at most one slot per
      identity; `slot_of[g]` / `id_of[g]` are the cached (hashed) slots;
    - holders of a slot = the table cells holding it plus scratch borrowings; at zero it is quarantined
      (tag = the last prepared step) until every step up to the tag has finished, then free, or evictable
      if still cached (a hit, not free);
    - allocation takes free slots first, then the least recently released evictable ones (which leave
      the cache); which free slot is taken is the manager's choice: the model reads the table and checks
      that the slot was free (or the right evictable one);
    - a block is published (cached) at the settle that makes all its tokens settled and accepted, if the
      request's row holds a slot for it then (not scratch) and its identity is not cached yet: prompt
      blocks always, decode blocks only while every accepted token was reported (settle's new_tokens);
    - a block of a sliding-window group leaving the window loses its cache entry unless it lies in the
      retained window of a boundary (prompt end, checkpoints, chunk ends: Geometry.retained_window),
      came from a hit, or is the newest block that left the window (it loses its entry at the request's
      next release, if nobody holds it and it is still the same entry; so when the request ends first,
      the block before its last window stays cached); with retention "all", and at free and rewind,
      blocks keep their entries. Retention follows the content: an entry whose block lies in a
      boundary's retained window of any request is marked (`retained`) when that request hits it,
      publishes the block (whichever slot holds the entry), gets the boundary, or is freed with it in its
      window; a marked entry stays when any holder lets go of it, and the mark ends with the entry.
      Otherwise, when several holders let go of a slot in one settle, it leaves the cache if any of them
      drops it, and else the last holder to let go decides. A cached slot nobody holds that leaves the
      cache is free;
    - a hit is the largest n = b * tpb < prompt_len such that every group caches every block a query at
      n sees (Geometry.hit_needs); the request starts with history = capacity = n holding those slots;
    - a chunk's scratch range keeps the retained windows (its own end's included) out: the longest run
      of the rest (any longest run is accepted);
    - events: ("stored" | "removed", group, content id) in the order of the calls.

    Calls go through plan (pure) and apply for prepare_batch, because the model reads which free slots
    the manager chose; PrefixModelled drives both.
    """

    def __init__(self, spec):
        super().__init__(spec)
        assert spec.prefix_caching, "PrefixModel models a manager with prefix caching on"
        spg = spec.slots_per_group
        assert spg is not None, "PrefixModel needs CacheSpec.slots_per_group"
        P = len(self.geo.groups)
        reserved = 1 if getattr(spec, "null_slot", False) else 0       # the null slot is never allocated
        self.totals = [int(n) - reserved for n in ([spg] * P if np.isscalar(spg) else spg)]
        self.retention = spec.prefix_retention
        self.ids = BlockIds(self.geo.tpb)
        self.slot_of: List[Dict[int, int]] = [{} for _ in range(P)]      # content id -> slot
        self.id_of: List[Dict[int, int]] = [{} for _ in range(P)]        # slot -> content id
        self.serial: List[Dict[int, int]] = [{} for _ in range(P)]       # slot -> its cache entry's serial
        self.retained: List[Set[int]] = [set() for _ in range(P)]        # content ids a retained window marked
        self.entries = 0
        self.holders = [[0] * n for n in self.totals]
        self.free_slots: List[Set[int]] = [set(range(n)) for n in self.totals]
        self.quarantine: List[Dict[int, Tuple[int, int]]] = [{} for _ in range(P)]   # slot -> (tag, released)
        self.evictable: List[Dict[int, int]] = [{} for _ in range(P)]    # slot -> when released
        self.handed_out_by: List[Dict[int, int]] = [{} for _ in range(P)]  # slot -> step that last allocated it
        self.events: List[Tuple[str, int, int]] = []
        self.queries = self.query_tokens = self.hit_tokens = 0
        self.evictions = [0] * P
        self.last_prepared = -1
        self.clock = 0                       # one tick per settle and free: "when released"

    # -- lookup ------------------------------------------------------------------------------------
    def lookup(self, ids: List[int], prompt_len: int) -> int:
        """Blocks of the longest hit for a prompt whose full blocks have these ids."""
        for b in range((prompt_len - 1) // self.geo.tpb, 0, -1):
            if all(ids[j] in self.slot_of[g.index] for g in self.geo.groups for j in self.geo.hit_needs(g, b)):
                return b
        return 0

    def expected_hit(self, prompt_len: int, tokens, salt=None) -> int:
        """Cached tokens add() would return now for this prompt (changes nothing)."""
        ids: List[int] = []
        self.ids.extend(salt_key(salt), ids, [int(t) for t in tokens])
        return self.lookup(ids, int(prompt_len)) * self.geo.tpb

    # -- requests ----------------------------------------------------------------------------------
    def add(self, rid, prompt_len, tokens=None, salt=None, checkpoints=()) -> int:
        """Register the request; returns the cached prompt tokens (the hit)."""
        prompt, tpb = int(prompt_len), self.geo.tpb
        row = min(self.free_rows)
        self.free_rows.remove(row)
        req = PrefixRequest(rid, prompt, row, salt=salt_key(salt), tokens=[int(t) for t in tokens],
                            boundaries=[prompt] + sorted({int(c) for c in checkpoints}))
        assert len(req.tokens) == prompt
        self.ids.extend(req.salt, req.ids, req.tokens)
        hit = self.lookup(req.ids, prompt)
        for g in self.geo.groups:
            req.slots[g.index] = {}
            for b in sorted(self.geo.hit_needs(g, hit)):
                s = self.slot_of[g.index][req.ids[b]]
                self._hold(g.index, s)
                req.slots[g.index][b] = s
            req.published[g.index] = hit
        req.history = req.capacity = hit * tpb
        req.hit = hit
        self._mark(req, range(hit))
        self.requests[rid] = req
        self.queries, self.query_tokens, self.hit_tokens = self.queries + 1, self.query_tokens + prompt, self.hit_tokens + hit * tpb
        return hit * tpb

    def free(self, rid) -> None:
        """Release every slot of the request (every cached block keeps its cache entry)."""
        req = self.requests[rid]
        self.clock += 1
        if self.retention != "all":       # its last window
            for g in self.geo.groups:
                if g.window is not None:
                    self.retained[g.index].update(req.ids[b] for b in req.slots[g.index]
                                                  if b < len(req.ids) and req.ids[b] in self.slot_of[g.index])
        for g, held in req.slots.items():
            self._let_go(g, [(s, False) for s in held.values()])
            held.clear()
        for per_group in req.scratch_slots.values():
            for g, slots in per_group.items():
                self._let_go(g, [(s, False) for s in slots])
        req.scratch_slots.clear()
        super().free(rid)

    # -- steps -------------------------------------------------------------------------------------
    def scratch_choices(self, req: PrefixRequest, g, start: int, capacity: int) -> List[Tuple[int, int]]:
        """The scratch ranges a chunk start -> capacity may get: the longest runs of the spec's scratch
        range without the retained windows of the request's boundaries and of the chunk's end."""
        lo, hi = self.geo.scratch_range(g, start, capacity)
        if lo >= hi:
            return [(0, 0)]
        windows = [self.geo.retained_window(g, pos) for pos in [*req.boundaries, capacity]]
        ok = [b for b in range(lo, hi) if not any(a <= b < z for a, z in windows)]
        runs: List[List[int]] = []
        for b in ok:
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + 1
            else:
                runs.append([b, b + 1])
        if not runs:
            return [(0, 0)]
        longest = max(z - a for a, z in runs)
        return [(a, z) for a, z in runs if z - a == longest]

    def plan(self, contexts=(), generation=(), num_gen_tokens=1):
        """(entries, slots needed per group) of a step; changes nothing."""
        items = list(contexts.items()) if isinstance(contexts, Mapping) else [tuple(c) for c in contexts]
        tpb, need, entries = self.geo.tpb, [0] * len(self.geo.groups), []
        for k, (rid, n) in enumerate([(rid, int(n)) for rid, n in items] +
                                     [(rid, int(num_gen_tokens)) for rid in generation]):
            req, context = self.requests[rid], k < len(items)
            start, cap = req.capacity, req.capacity + n
            choices = {}
            for g in self.geo.groups:
                choices[g.index] = self.scratch_choices(req, g, start, cap) if context else [(0, 0)]
                s_lo, s_hi = choices[g.index][0]
                need[g.index] += cdiv(cap, tpb) - cdiv(start, tpb) - (s_hi - s_lo)
                if s_hi > s_lo:
                    need[g.index] += self.geo.scratch_slots_needed(g, s_hi - s_lo)
            entries.append((req, n, start, context, choices))
        return entries, need

    def available(self, g: int, finished_through: Optional[int] = None) -> int:
        """Slots allocation could take: free and evictable, and with finished_through, those whose
        quarantine that watermark lifts."""
        lifted = 0 if finished_through is None else sum(
            tag <= finished_through for tag, _ in self.quarantine[g].values())
        return len(self.free_slots[g]) + len(self.evictable[g]) + lifted

    def fits(self, need: List[int], finished_through: Optional[int] = None) -> bool:
        return all(n <= self.available(g, finished_through) for g, n in enumerate(need))

    def apply(self, step, planned, table: np.ndarray) -> ModelStep:
        """The step prepared: take the slots it got (read from the manager's table and the step's
        scratch metadata), checking they were free or the least recently released evictable ones."""
        entries, _ = planned
        tpb = self.geo.tpb
        assert step.id == self.last_prepared + 1, (step.id, self.last_prepared)
        self.last_prepared = step.id
        taken: Dict[int, List[int]] = {g.index: [] for g in self.geo.groups}
        model_entries = []
        for k, (req, n, start, context, choices) in enumerate(entries):
            cap = start + n
            scratch = {}
            for g in self.geo.groups:
                p = g.index
                got = (int(step.scratch_begs[p, k]), int(step.scratch_ends[p, k])) if context else (0, 0)
                assert got in choices[p], (f"step {step.id} request {req.rid!r} group {p}: scratch range {got}; "
                                           f"the model allows {choices[p]}")
                scratch[p] = got
                for b in range(cdiv(start, tpb), cdiv(cap, tpb)):
                    if not got[0] <= b < got[1]:
                        s = int(table[p, req.row, b])
                        assert s != BAD, f"step {step.id} request {req.rid!r} group {p}: block {b} got no slot"
                        assert b not in req.slots[p], (req.rid, p, b)
                        req.slots[p][b] = s
                        taken[p].append(s)
                if got[1] > got[0]:
                    used = self.geo.scratch_slots_needed(g, got[1] - got[0])
                    borrowed = [int(s) for s in step.scratch_slots[p, k, :used]]
                    req.scratch_slots.setdefault(step.id, {})[p] = borrowed
                    taken[p] += borrowed
            req.capacity = cap
            if context:
                req.scratch[step.id] = scratch
                req.boundaries.append(cap)
                self._mark(req, range(min(req.published.values())), [cap])
            model_entries.append(ModelEntry(req, n, start, context, scratch))
        for p, slots in taken.items():
            self._hand_out(p, slots, step.id)
        self.check_write_targets(step.id, model_entries)
        self.steps[step.id] = expected = ModelStep(step.id, model_entries)
        return expected

    def check_write_targets(self, step_id: int, entries: List[ModelEntry]) -> None:
        """Every new token's K/V goes to a scratch slot or a slot of the request's own: one holder, not
        cached (cached blocks are full and immutable; a hit leaves at least one token to compute)."""
        for e in entries:
            for b in range(e.start // self.geo.tpb, cdiv(e.start + e.tokens, self.geo.tpb)):
                for p, (lo, hi) in e.scratch.items():
                    if lo <= b < hi:
                        continue
                    s = e.request.slots[p][b]
                    assert self.holders[p][s] == 1 and s not in self.id_of[p], (
                        f"step {step_id} writes block {b} of {e.request.rid!r} (group {p}) into slot {s}: "
                        f"{self.holders[p][s]} holders, cached={s in self.id_of[p]}")

    def settle(self, step_id: int, accepted=None, new_tokens=None) -> None:
        """History advances; rejected tokens give their blocks back; scratch returns; blocks completed by
        settled, accepted, known tokens are published; out-of-window blocks are released (kept cached
        inside retained windows)."""
        step = self.steps.pop(step_id)
        self.clock += 1
        tpb, new_tokens = self.geo.tpb, (new_tokens or {})
        in_order = _in_batch_order(accepted)
        live: List[PrefixRequest] = []
        stale_before = {}
        for i, e in enumerate(step.entries):
            req = e.request
            if self.requests.get(req.rid) is not req:     # freed since the prepare
                continue
            a = _accepted_tokens(e, i, accepted, in_order)
            stale_before[req.rid] = {g.index: self.geo.stale_range(g, req.history)[1] for g in self.geo.groups}
            req.history += a
            req.capacity -= e.tokens - a
            req.scratch.pop(step_id, None)
            for p, slots in req.scratch_slots.pop(step_id, {}).items():
                self._let_go(p, [(s, False) for s in slots])
            if not e.context and a > 0:
                if req.rid in new_tokens:
                    toks = [int(t) for t in new_tokens[req.rid]]
                    assert len(toks) == a, (req.rid, toks, a)
                    if req.complete:
                        req.tokens += toks
                        self.ids.extend(req.salt, req.ids, req.tokens)
                else:
                    req.complete = False      # its later blocks can never be published
            live.append(req)
        for req in live:                  # rejected tokens: their blocks were never full, never cached
            for g in self.geo.groups:
                held = req.slots[g.index]
                want = self.blocks(req.rid, g)
                assert want <= set(held), (req.rid, g.index, sorted(want - set(held)))
                back = [b for b in sorted(set(held) - want) if b >= cdiv(req.capacity, tpb)]
                self._let_go(g.index, [(held.pop(b), False) for b in back])
        for req in live:
            self._publish(req)
        for g in self.geo.groups:         # out of the window: one release of every row, as one call
            if g.window is None:
                continue
            p, out, margins = g.index, [], []
            for req in live:
                held = req.slots[p]
                end = self.geo.stale_range(g, req.history)[1]
                if end <= stale_before[req.rid][p]:
                    continue                      # no block left this row's window: no release
                gone = sorted(set(held) - self.blocks(req.rid, g))
                top = end - 1                     # the newest block out of the window keeps its entry ...
                out += [(held.pop(b), not (self.kept(req, g, b) or b == top)) for b in gone]
                out = [(s, d and self.id_of[p].get(s) not in self.retained[p]) for s, d in out]
                if self.retention == "all":
                    continue
                old = req.margin.get(p)           # ... until this release, unless something else keeps it
                if (old is not None and not self.kept(req, g, old[0])
                        and self.id_of[p].get(old[1]) not in self.retained[p]):
                    b, slot, serial = old
                    if serial is not None and self.serial[p].get(slot) == serial and self.holders[p][slot] == 0:
                        margins.append(slot)
                if top in gone:
                    slot = [s for s, _ in out][len(out) - len(gone) + gone.index(top)]
                    req.margin[p] = (top, slot, self.serial[p].get(slot))
            self._let_go(p, out)
            for slot in margins:
                if slot in self.id_of[p]:
                    self._forget(p, slot)

    def _publish(self, req: PrefixRequest) -> None:
        full = min(req.history // self.geo.tpb, len(req.ids))
        for p in range(len(self.geo.groups)):
            start = req.published[p]
            for b in range(req.published[p], full):
                s, cid = req.slots[p].get(b), req.ids[b]
                if s is None:                          # scratch, or stale before it was full
                    continue
                if s in self.id_of[p]:                 # from a hit: cached already
                    assert self.id_of[p][s] == cid, (req.rid, p, b, s)
                    continue
                if cid not in self.slot_of[p]:         # another slot holds this block cached: keep that
                    self.slot_of[p][cid], self.id_of[p][s] = s, cid
                    self.entries += 1
                    self.serial[p][s] = self.entries
                    self.events.append((STORED, p, cid))
            req.published[p] = max(req.published[p], full)
            self._mark(req, range(start, full), groups=[p])      # after: the entries it named count too

    def _mark(self, req: PrefixRequest, blocks, boundaries=None, groups=None) -> None:
        """Mark retained the cached entries of these blocks of the request that lie in the retained window
        of one of its boundaries (or of `boundaries`), in the sliding-window groups (or `groups`)."""
        if self.retention == "all":
            return
        for g in self.geo.groups:
            if g.window is None or (groups is not None and g.index not in groups):
                continue
            windows = [self.geo.retained_window(g, pos) for pos in (req.boundaries if boundaries is None else boundaries)]
            for b in blocks:
                if (b < len(req.ids) and req.ids[b] in self.slot_of[g.index]
                        and any(lo <= b < hi for lo, hi in windows)):
                    self.retained[g.index].add(req.ids[b])

    def kept(self, req: PrefixRequest, g, b: int) -> bool:
        """Whether block b of a sliding-window group keeps its cache entry when it leaves the window."""
        if self.retention == "all" or b < req.hit:
            return True
        return any(lo <= b < hi for lo, hi in (self.geo.retained_window(g, pos) for pos in req.boundaries))

    # -- slots -------------------------------------------------------------------------------------
    def _hold(self, p: int, s: int) -> None:
        """One more holder of a cached slot (a hit): back from quarantine or from the evictable list."""
        if self.holders[p][s] == 0:
            if s in self.quarantine[p]:
                del self.quarantine[p][s]
            else:
                assert s in self.evictable[p], f"group {p}: cached slot {s} has no holder and is not evictable"
                del self.evictable[p][s]
        self.holders[p][s] += 1

    def _let_go(self, p: int, slots: List[Tuple[int, bool]]) -> None:
        """Drop one holder of each (slot, drop); a slot left with none is quarantined, and leaves the
        cache if one of these holders dropped it."""
        for s, _ in slots:
            self.holders[p][s] -= 1
            assert self.holders[p][s] >= 0, (p, s)
        dropped = {s for s, d in slots if d}
        for s in sorted({s for s, _ in slots}):
            if self.holders[p][s] == 0:
                self.quarantine[p][s] = (self.last_prepared, self.clock)
                if s in dropped and s in self.id_of[p]:
                    self._forget(p, s)

    def _forget(self, p: int, s: int) -> None:
        cid = self.id_of[p].pop(s)
        self.retained[p].discard(cid)
        del self.slot_of[p][cid]
        del self.serial[p][s]
        self.events.append((REMOVED, p, cid))
        if s in self.evictable[p]:                # nobody holds it, no longer a hit: free
            del self.evictable[p][s]
            self.free_slots[p].add(s)

    def _hand_out(self, p: int, slots: List[int], step_id: int) -> None:
        """The slots a step took from group p: free ones first, then the least recently released
        evictable ones."""
        assert len(set(slots)) == len(slots), f"group {p}: step {step_id} got a slot twice: {sorted(slots)}"
        free, evictable = self.free_slots[p], self.evictable[p]
        evicted = [s for s in slots if s not in free]
        wrong = [s for s in evicted if s not in evictable]
        assert not wrong, (f"group {p}: step {step_id} got slots {wrong} that are neither free nor evictable "
                           f"(held: {[self.holders[p][s] for s in wrong]}, quarantined: "
                           f"{[s in self.quarantine[p] for s in wrong]})")
        if evicted:
            assert len(slots) - len(evicted) == len(free), (
                f"group {p}: step {step_id} evicted {evicted} while free slots were left")
            newest = max(evictable[s] for s in evicted)
            rest = [t for s, t in evictable.items() if s not in evicted]
            assert not rest or newest <= min(rest), (
                f"group {p}: step {step_id} evicted {evicted} (released at {[evictable[s] for s in evicted]}) "
                f"before slots released earlier ({min(rest)})")
        for s in slots:
            if s in free:
                free.remove(s)
            else:
                del evictable[s]
                self._forget(p, s)
                self.evictions[p] += 1
            self.holders[p][s] = 1
            self.handed_out_by[p][s] = step_id

    def lift(self, finished_through: int) -> None:
        """Quarantine ends for slots tagged with a step <= finished_through."""
        for p, quarantine in enumerate(self.quarantine):
            for s, (tag, when) in list(quarantine.items()):
                if tag <= finished_through:
                    del quarantine[s]
                    if s in self.id_of[p]:
                        self.evictable[p][s] = when
                    else:
                        self.free_slots[p].add(s)

    def drain_events(self) -> List[Tuple[str, int, int]]:
        events, self.events = self.events, []
        return events

    def scratch_held(self) -> Dict[int, list]:
        held = {g.index: [] for g in self.geo.groups}
        for req in self.requests.values():
            for per_group in req.scratch_slots.values():
                for p, slots in per_group.items():
                    held[p] += slots
        return held

    # -- checks ------------------------------------------------------------------------------------
    def check_table(self, mgr) -> None:
        """Each request's row, history and capacity are the model's; its row holds exactly the model's
        slots (which are the blocks Model.blocks names); the rows nobody holds are empty."""
        for rid, req in self.requests.items():
            live = mgr.request(rid)
            assert (live.row, live.history, live.capacity) == (req.row, req.history, req.capacity), (
                rid, (live.row, live.history, live.capacity), (req.row, req.history, req.capacity))
            for g in self.geo.groups:
                row = mgr.table[g.index, req.row]
                got = {int(b): int(row[b]) for b in np.flatnonzero(row != BAD)}
                assert got == req.slots[g.index], (rid, g.index, got, req.slots[g.index])
                assert set(got) == self.blocks(rid, g), (rid, g.index, sorted(got), sorted(self.blocks(rid, g)))
        for row in self.free_rows:
            assert (mgr.table[:, row] == BAD).all(), f"row {row} is free but not empty"

    def check_pools(self, mgr) -> None:
        """Reference counts, free, evictable (in release order) and quarantined slots are the model's.
        Call after mgr.reclaim() and lift() with the same finish watermark."""
        for p, pool in enumerate(mgr.pools):
            refs = pool.refs.tolist()
            assert refs == self.holders[p], (
                f"group {p}: refs differ at {[s for s in range(len(refs)) if refs[s] != self.holders[p][s]]}")
            free = pool.free_slots().tolist()
            assert len(free) == len(set(free)), f"group {p}: a slot is free twice: {sorted(free)}"
            assert set(free) == self.free_slots[p], (p, sorted(set(free) ^ self.free_slots[p]))
            evictable = pool.evictable_slots().tolist()
            assert set(evictable) == set(self.evictable[p]), (p, sorted(set(evictable) ^ set(self.evictable[p])))
            when = [self.evictable[p][s] for s in evictable]
            assert when == sorted(when), f"group {p}: evictable slots out of release order"
            assert set(pool.quarantined_slots().tolist()) == set(self.quarantine[p]), (
                p, sorted(set(pool.quarantined_slots().tolist()) ^ set(self.quarantine[p])))

    def check_stats(self, mgr) -> None:
        """stats() per group and stats()['prefix_cache'] are the model's counts."""
        st = mgr.stats()
        scratch = self.scratch_held()
        for p, g in enumerate(st["groups"]):
            owned = len({s for req in self.requests.values() for s in req.slots[p].values()})
            want = dict(free=len(self.free_slots[p]), owned=owned, scratch=len(scratch[p]),
                        quarantined=len(self.quarantine[p]), evictable=len(self.evictable[p]))
            assert {k: g[k] for k in want} == want, (p, g, want)
        pc = st["prefix_cache"]
        assert (pc["queries"], pc["query_tokens"], pc["hit_tokens"]) == (
            self.queries, self.query_tokens, self.hit_tokens), pc
        for p, g in enumerate(pc["groups"]):
            want = dict(cached_blocks=len(self.slot_of[p]), evictable_blocks=len(self.evictable[p]),
                        evictions=self.evictions[p])
            assert {k: g[k] for k in want} == want, (p, g, want)


class PrefixModelled(Modelled):
    """A manager with prefix caching and its PrefixModel driven together. Every call is checked: add's
    hit, the step's batch and scratch, the slots it took, the cache events; check() compares the whole
    state (tables, reference counts, free / evictable / quarantined slots, stats)."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.model = PrefixModel(mgr.spec)
        self.unsettled: list = []
        self.prepared: list = []         # every Step, by id
        self.done_through = -1           # every step up to this id has finished (its finish event ran)
        P = len(self.model.geo.groups)
        self.live = [set() for _ in range(P)]    # per group: hashes stored and not removed (from events)
        self.hash_of: Dict[int, bytes] = {}       # content id -> its hash, once the events pin it down
        self.id_of_hash: Dict[bytes, int] = {}

    def finished_through(self) -> int:
        while (self.done_through + 1 < len(self.prepared)
               and self.prepared[self.done_through + 1].is_complete()):
            self.done_through += 1
        return self.done_through

    def add(self, rid, prompt_len, tokens=None, cache_salt=None, checkpoints=()) -> int:
        got = self.mgr.add(rid, prompt_len, tokens=tokens, cache_salt=cache_salt, checkpoints=checkpoints)
        want = self.model.add(rid, prompt_len, tokens, cache_salt, checkpoints)
        assert got == want, f"add({rid!r}): {got} cached tokens; the model says {want}"
        self.check_events()
        return got

    def free(self, rid) -> None:
        self.mgr.free(rid)
        self.model.free(rid)
        self.check_events()

    def prepare(self, contexts=(), generation=(), num_gen_tokens=1, **kw):
        contexts = contexts if isinstance(contexts, Mapping) else list(contexts)
        generation = list(generation)
        planned = self.model.plan(contexts, generation, num_gen_tokens)
        before = self.mgr.state()
        try:
            step = self.mgr.prepare_batch(contexts, generation, num_gen_tokens, **kw)
        except OutOfSlotsError:
            assert self.mgr.state() == before
            wm = self.finished_through()      # what the manager waited for counts, though not lifted yet
            assert not self.model.fits(planned[1], wm), (
                f"out of slots, but the model has them: need {planned[1]}, "
                f"available {[self.model.available(p, wm) for p in range(len(planned[1]))]}")
            raise
        self.prepared.append(step)
        self.model.lift(self.finished_through())      # what the prepare's own reclaim lifted
        assert self.model.fits(planned[1]), (f"step {step.id} took {planned[1]} slots; the model has only "
                                             f"{[self.model.available(p) for p in range(len(planned[1]))]}")
        expected = self.model.apply(step, planned, self.mgr.table)
        self.model.check_step(step, expected)
        self.unsettled.append((step, expected))
        self.check_events()
        return step

    def settle(self, step, accepted=None, new_tokens=None, model_tokens=None) -> None:
        """model_tokens: the model's mapping of the tokens when new_tokens is the batch-order form."""
        self.mgr.settle(step, accepted, new_tokens=new_tokens)
        assert self.unsettled[0][0] is step
        self.unsettled.pop(0)
        self.model.settle(step.id, accepted, new_tokens if model_tokens is None else model_tokens)
        self.check_events()

    def scratch_held(self) -> Dict[int, list]:
        return self.model.scratch_held()

    def check_events(self) -> None:
        """The call's cache events are the model's: as many stored and removed per group, each hash 16
        bytes, stored only when not cached and removed only when cached; and one block always has one
        hash, two blocks never share one (pinned down as the events single them out)."""
        got, want = self.mgr.drain_cache_events(), self.model.drain_events()
        count = lambda events: Counter((kind, p) for kind, p, _ in events)     # noqa: E731
        assert count(got) == count(want), f"cache events {count(got)}; the model's {count(want)}"
        for kind, p, h in got:
            assert isinstance(h, bytes) and len(h) == 16, h
            if kind == STORED:
                assert h not in self.live[p], f"group {p}: hash {h.hex()} stored twice"
                self.live[p].add(h)
            else:
                assert h in self.live[p], f"group {p}: hash {h.hex()} removed but not cached"
                self.live[p].remove(h)
        for p, live in enumerate(self.live):
            assert len(live) == len(self.model.slot_of[p]), (p, len(live), len(self.model.slot_of[p]))
        for kind in (STORED, REMOVED):
            for p in range(len(self.live)):
                hashes = [h for k, q, h in got if (k, q) == (kind, p)]
                ids = [c for k, q, c in want if (k, q) == (kind, p)]
                for c in ids:
                    if c in self.hash_of:
                        assert self.hash_of[c] in hashes, f"group {p}: a {kind} block has another hash now"
                for h in hashes:
                    if h in self.id_of_hash:
                        assert self.id_of_hash[h] in ids, f"group {p}: {kind} hash {h.hex()} names another block"
                new_ids = [c for c in ids if c not in self.hash_of]
                new_hashes = [h for h in hashes if h not in self.id_of_hash]
                if len(new_ids) == 1 and len(new_hashes) == 1:
                    self.hash_of[new_ids[0]], self.id_of_hash[new_hashes[0]] = new_hashes[0], new_ids[0]

    def synchronize(self) -> None:
        """mgr.synchronize(): the device drains, the manager lifts the quarantine of finished steps."""
        self.mgr.synchronize()
        self.model.lift(self.finished_through())

    def check_stats(self) -> None:
        """stats() (which lifts the quarantine of finished steps first) against the model."""
        self.model.lift(self.finished_through())
        self.model.check_stats(self.mgr)

    def check(self, stats: bool = True) -> None:
        """The whole state against the model. The model lifts quarantine only where the manager does
        (prepare, synchronize, reclaim, stats), so checking without stats changes nothing."""
        self.model.check_table(self.mgr)
        self.model.check_pools(self.mgr)
        check_slots(self.mgr, self.scratch_held(), with_stats=False)
        if stats:
            self.check_stats()
            self.model.check_pools(self.mgr)


# --------------------------------------------------------------------------------------------------
# Slots
# --------------------------------------------------------------------------------------------------
def check_stats(mgr) -> None:
    """stats(): free + owned + scratch + quarantined + evictable = total in every group, none negative
    (evictable: hashed slots nobody holds, only with prefix caching)."""
    for g in mgr.stats()["groups"]:
        parts = [g["free"], g["owned"], g["scratch"], g["quarantined"], g.get("evictable", 0)]
        assert sum(parts) == g["total"], g
        assert min(parts) >= 0, g


def check_slots(mgr, scratch_held: Optional[Dict[int, list]] = None, with_stats: bool = True) -> None:
    """Every slot of every group is exactly one of: in table cells, held as scratch, free, quarantined,
    evictable. Without prefix caching a slot is in at most one cell; with it, a slot may be in several
    (a hit shares it), and its reference count is the number of cells plus scratch borrowings.

    scratch_held: group -> scratch slots held now (Modelled.scratch_held); none when omitted.
    with_stats: also check stats() (which lifts the quarantine of finished steps, as every call of it does).
    """
    if with_stats:
        check_stats(mgr)
    for p, pool in enumerate(mgr.pools):
        cells = mgr.table[p]
        in_cells = cells[cells != BAD].tolist()
        scratch = list((scratch_held or {}).get(p, ()))
        caching = hasattr(pool, "refs")
        evictable = pool.evictable_slots().tolist() if caching else []
        every = (sorted(set(in_cells)) if caching else in_cells) + scratch + pool.free_slots().tolist() + \
            pool.quarantined_slots().tolist() + evictable
        assert sorted(every) == list(range(pool.total)), f"group {p}: a slot is lost or owned twice"
        if caching:
            holders = np.bincount(np.array(in_cells + scratch, np.int64), minlength=pool.total)
            assert np.array_equal(pool.refs, holders), (
                f"group {p}: refs != table cells + scratch at slots {np.flatnonzero(pool.refs != holders).tolist()}")


def held_slots(mgr, rid) -> list:
    """The slots in the request's table row, per group, ascending."""
    row = mgr.request(rid).row
    return [sorted(int(v) for v in mgr.table[p, row] if v != BAD) for p in range(len(mgr.pools))]


# --------------------------------------------------------------------------------------------------
# A consumer on its own stream
# --------------------------------------------------------------------------------------------------
class Capture:
    """A consumer on its own stream: waits for the step's ready event, copies its tables out (and, with
    write_positions=True, its write positions), finishes.

    Nothing runs until the device does the work, so what it captured is what a real attention kernel
    would have read at that point of the stream order. rank: the device whose tables it reads (a manager
    with devices=[...]); it finishes that device's part of each step only.
    """

    def __init__(self, mgr, write_positions: bool = False, rank: int = 0):
        self.mgr = mgr
        self.rank = rank
        self.backend = mgr.backends[rank]
        self.outputs = mgr.pipeline.mirrors[rank].outputs
        self.stream = self.backend.new_stream("consumer")
        self.write_positions = write_positions
        self.items = []   # (step, table at prepare, device buffer[, write pages, write offsets, refs])
        self.spare = []   # buffers allocated while nothing is gated (an allocation's memset would queue)

    def _buffers(self):
        be, out = self.backend, self.outputs
        bufs = [be.device_empty(out.tables.size).reshape(out.tables.shape)]
        if self.write_positions:
            bufs += [be.device_empty(out.write_pages.size).reshape(out.write_pages.shape),
                     be.device_empty(out.write_offsets.size).reshape(out.write_offsets.shape)]
        # They are zeroed on the manager stream, after the step's ready event: the copies into them on the
        # consumer stream must come after that zeroing, not just after the step.
        be.wait(self.stream, be.record(be.stream))
        return bufs

    def reserve(self, count: int) -> "Capture":
        """Allocate buffers for `count` steps now, before a gate holds the streams."""
        self.spare += [self._buffers() for _ in range(count)]
        self.backend.synchronize()
        return self

    def consume(self, step) -> None:
        be, mgr, out, view = self.backend, self.mgr, self.outputs, step.on(self.rank)
        bufs = self.spare.pop() if self.spare else self._buffers()
        be.wait(self.stream, view.ready)
        be.copy_d2d(bufs[0], out.tables, self.stream)
        if self.write_positions:
            be.copy_d2d(bufs[1], out.write_pages, self.stream)
            be.copy_d2d(bufs[2], out.write_offsets, self.stream)
        view.finish(self.stream)
        item = (step, mgr.table.copy(), bufs[0])
        if self.write_positions:    # the reference counts at the prepare: whom each write may reach
            item += (bufs[1], bufs[2], [pool.refs.copy() if hasattr(pool, "refs") else None for pool in mgr.pools])
        self.items.append(item)

    def mismatches(self) -> list:
        """Ids of captured steps whose tables (or write positions) differ from the reference, or that write
        into a slot somebody else holds too (call after the work ran)."""
        bad = []
        geo = Geometry(self.mgr.spec)
        for step, table, buf, *extra in self.items:
            to_np = self.backend.to_numpy
            want = expected_tables(self.mgr, table, step, padded=True)     # padding rows read BAD too
            ok = np.array_equal(to_np(buf)[:, :want.shape[1]], want)
            want = want[:, :step.num_seqs]
            if ok and extra:
                pages, offsets, refs = extra
                T = step.total_tokens
                wp, wo = expected_write_positions(self.mgr.spec, want, step.num_tokens, step.start_positions,
                                                  null_slots=null_slots(self.mgr))
                got_p, got_o = to_np(pages)[:, :T], to_np(offsets)[:T]
                ok = np.array_equal(got_p, wp) and np.array_equal(got_o, wo) and not (got_p == BAD).any()
                for layer in range(geo.num_layers):          # a write goes to a slot of one holder only
                    g = int(geo.layer_group[layer])
                    if ok and refs[g] is not None:
                        ok = bool((refs[g][got_p[layer] // geo.group_scale[g]] == 1).all())
            if not ok:
                bad.append(step.id)
        return bad
