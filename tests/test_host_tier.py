"""The host tier (docs/design.md's "Host tier"): KVStorage(mgr, host_tier_bytes=N), suspend and resume.

Everything is checked against a toy model whose K/V of a token is a pure function of (token id,
position, layer), so the KV a request must have is known without reading any page: after a round trip
through the host tier, the KV read through the request's table row and the storage's page views, and the
attention of the steps that follow, must equal that model (and a dense attention over it). Which blocks
move and how many bytes come from the oracle's geometry (tests/oracle.py), not from the manager.

Gated tests hold the host tier's copy stream with a gate while the scheduler goes on (other requests
take the freed slots and write them; the resumed request is scheduled and its consumer reads), then open
it: the copies must still have moved the right KV. Each has an unsafe twin that breaks one ordering rule
on purpose (no fence on the D2H copy; no wait for the H2D copy) and must observe wrong data, which proves
that the test catches the race. Everything a gated section needs (buffers, device K/V, kernels) is made
before its gate closes (docs/design.md, "GPU facts the design relies on").
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cupykv
from cupykv import BAD, InvalidRequestError, InvalidSpecError, OutOfSlotsError, StepOrderError, UnknownRequestError
from cupykv.host_tier import HostTierFullError
from cupykv.storage import KVStorage
from oracle import Geometry, Model, check_slots, expected_tables, held_slots

EXAMPLES = int(os.environ.get("CUPYKV_PROPERTY_EXAMPLES", "300"))
H, D, QH, TPB = 2, 4, 4, 8
# groups: (window 16, 4 sinks) = layers 0, 3; full attention = layer 1; (window 24, 4 sinks) = layer 2
WINDOWS = [16, None, 24, 16]
SINKS = 4


# --------------------------------------------------------------------------------------------------
# The toy model: K/V/Q of a token from (token id, position, layer) alone
# --------------------------------------------------------------------------------------------------
def toy_kv(tokens, positions, layer: int):
    """K and V float32 [n, H, D] of tokens at positions for one layer."""
    t = np.asarray(tokens, np.float64)[:, None, None]
    p = np.asarray(positions, np.float64)[:, None, None]
    h = np.arange(H, dtype=np.float64)[None, :, None]
    d = np.arange(D, dtype=np.float64)[None, None, :]
    k = np.sin(t * 0.37 + p * 0.173 + layer * 0.11 + h * 1.3 + d * 0.71 + 0.05)
    v = np.cos(t * 0.61 + p * 0.057 + layer * 0.29 + h * 0.9 + d * 0.43 + 0.05)
    return k.astype(np.float32), v.astype(np.float32)


def toy_q(token: int, pos: int, layer: int) -> np.ndarray:
    h = np.arange(QH, dtype=np.float64)[:, None]
    d = np.arange(D, dtype=np.float64)[None, :]
    return (2.0 * np.sin(token * 0.19 + pos * 0.091 + layer * 0.7 + h * 2.1 + d * 0.29)).astype(np.float32)


def attend(q, k, v) -> np.ndarray:
    """q [QH, D], k/v [n, H, D] -> [QH, D] (GQA: query head h reads kv head h // (QH // H))."""
    rep = q.shape[0] // k.shape[1]
    k = np.repeat(k, rep, axis=1).astype(np.float64)
    v = np.repeat(v, rep, axis=1).astype(np.float64)
    logits = np.einsum("hd,nhd->hn", q.astype(np.float64), k) / math.sqrt(q.shape[1])
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, v)


def visible_keys(pos: int, window, sinks: int) -> np.ndarray:
    """Keys a query at pos sees: [0, pos] for full attention; the sink tokens and (pos - W, pos]."""
    if window is None:
        return np.arange(pos + 1)
    lo = max(0, pos - window + 1)
    return np.concatenate((np.arange(min(sinks, lo)), np.arange(lo, pos + 1)))


def gen_token(seed: int, pos: int) -> int:
    """The token a request 'generates' at a position (decode inputs), distinct from prompt tokens."""
    return 100000 + (seed * 7919 + pos * 31) % 50000


def prompt_tokens(seed: int, n: int, shared_prefix: int = 0) -> List[int]:
    """A prompt whose first shared_prefix tokens are common to every request (prefix cache hits)."""
    return [1000 + 13 * p for p in range(min(n, shared_prefix))] + \
           [5000 + seed * 977 + 17 * p for p in range(shared_prefix, n)]


# --------------------------------------------------------------------------------------------------
# A manager, its storage and host tier, a consumer stream, and the oracle's model of the requests
# --------------------------------------------------------------------------------------------------
class Rig:
    def __init__(self, backend, *, caching=False, slots=64, tier_bytes=None, tier_slots=None, max_batch=6,
                 scratch=True, windows=WINDOWS, sinks=SINKS, max_seq_len=256, retention="boundaries"):
        self.spec = cupykv.CacheSpec(windows=windows, num_kv_heads=H, head_dim=D, dtype="float32",
                                     tokens_per_block=TPB, max_seq_len=max_seq_len, max_batch=max_batch,
                                     slots_per_group=slots, sink_tokens=sinks, swa_scratch_reuse=scratch,
                                     prefix_caching=caching, prefix_events=caching, prefix_retention=retention)
        self.caching = caching
        self.mgr = cupykv.KVCacheManager(self.spec, backend=backend)
        self.be = self.mgr.backend
        self.geo = Geometry(self.spec)
        # slot bytes from the spec (float32): scale * tpb * kv_heads * head_dim * 4
        self.slot_bytes = [g.scale * TPB * H * D * 4 for g in self.geo.groups]
        if tier_slots is not None:      # equal slots_per_group: the tier splits like the device memory
            tier_bytes = tier_slots * sum(self.slot_bytes)
        self.storage = KVStorage(self.mgr, host_tier_bytes=tier_bytes if tier_bytes is not None else 1 << 20)
        self.tier = self.storage.host_tier
        self.consumer = self.be.new_stream("consumer")
        self.model = Model(self.spec)
        self.tokens: Dict[str, List[int]] = {}
        self.seed: Dict[str, int] = {}
        self.suspended: set = set()
        self.unsettled: list = []          # (step, table at prepare) in prepare order
        self.checked_tables = 0
        self.be.synchronize()

    # -- requests ------------------------------------------------------------------------------
    def add(self, rid, prompt_len, shared_prefix=0) -> int:
        seed = len(self.seed) + 1
        toks = prompt_tokens(seed, prompt_len, shared_prefix)
        hit = self.mgr.add(rid, prompt_len, tokens=toks) if self.caching else self.mgr.add(rid, prompt_len)
        req = self.model.add(rid, prompt_len)
        req.history = req.capacity = int(hit)
        self.tokens[rid], self.seed[rid] = toks, seed
        return int(hit)

    def free(self, rid) -> None:
        self.mgr.free(rid)
        self.model.free(rid)
        self.suspended.discard(rid)
        del self.tokens[rid]

    def suspend(self, rid) -> None:
        self.storage.suspend(rid)
        self.suspended.add(rid)

    def resume(self, rid) -> None:
        self.storage.resume(rid)
        self.suspended.discard(rid)

    # -- steps ---------------------------------------------------------------------------------
    def prepare(self, contexts=None, generation=()):
        contexts, generation = dict(contexts or {}), list(generation)
        for rid in generation:                       # the decode input token at the request's capacity
            c = self.model.request(rid).capacity
            if len(self.tokens[rid]) == c:
                self.tokens[rid].append(gen_token(self.seed[rid], c))
        step = self.mgr.prepare_batch(contexts, generation)
        expected = self.model.prepare(step.id, contexts, generation)
        if self.caching:
            # the cache keeps retained windows out of scratch ranges: take the ranges from the step (the
            # tables are still checked against the reference conversion of them)
            for k, e in enumerate(expected.entries[:expected.num_contexts]):
                e.scratch = {g.index: (int(step.scratch_begs[g.index, k]), int(step.scratch_ends[g.index, k]))
                             for g in self.geo.groups}
                e.request.scratch[step.id] = e.scratch
            assert list(step.request_ids) == expected.request_ids
            assert [int(n) for n in step.start_positions] == [e.start for e in expected.entries]
        else:
            self.model.check_step(step, expected)
        self.unsettled.append((step, self.mgr.table.copy()))
        return step

    def positions(self, step):
        """(token ids, positions) of the step's new tokens, batch order."""
        toks, pos = [], []
        for rid, start, n in zip(step.request_ids, step.start_positions, step.num_tokens):
            p = list(range(int(start), int(start) + int(n)))
            toks += [self.tokens[rid][i] for i in p]
            pos += p
        return np.array(toks, np.int64), np.array(pos, np.int64)

    def step_kv(self, step):
        """Per layer (k, v) of the step's new tokens (numpy)."""
        toks, pos = self.positions(step)
        return [toy_kv(toks, pos, layer) for layer in range(self.geo.num_layers)]

    def planned_kv(self, contexts=None, generation=()):
        """Per layer (k, v) of the step prepare(contexts, generation) will make, as device arrays made now:
        a write under a gate then needs no host-to-device copy (nor an allocation)."""
        toks, pos = [], []
        for rid, n in dict(contexts or {}).items():
            c = self.model.request(rid).capacity
            toks += self.tokens[rid][c:c + n]
            pos += list(range(c, c + n))
        for rid in generation:
            c = self.model.request(rid).capacity
            if len(self.tokens[rid]) == c:
                self.tokens[rid].append(gen_token(self.seed[rid], c))
            toks.append(self.tokens[rid][c])
            pos.append(c)
        kv = [toy_kv(toks, pos, layer) for layer in range(self.geo.num_layers)]
        out = [(self.be.upload(k), self.be.upload(v)) for k, v in kv]
        self.be.synchronize()
        return out

    def consume(self, step, check=True, kv=None, stream=None):
        """The consumer: writes the step's K/V layer by layer (on `stream`, default the consumer stream)
        and, with check=True, after each layer's write reads that layer's table and pages and checks K/V
        and attention of every new token against the toy model, and the tables against the reference."""
        st_ = self.consumer if stream is None else stream
        kv = self.step_kv(step) if kv is None else kv
        for layer, (k, v) in enumerate(kv):
            self.storage.write(step, layer, k, v, stream=st_)
            if check:
                st_.synchronize()
                self.check_layer(step, layer)
        step.finish(st_)

    def settle(self, step) -> None:
        assert self.unsettled[0][0] is step
        new = None
        if self.caching:
            new = {rid: [self.tokens[rid][int(s)]] for rid, s in
                   zip(step.request_ids[step.num_contexts:], step.start_positions[step.num_contexts:])
                   if rid in self.model}
        self.mgr.settle(step, new_tokens=new)
        self.model.settle(step.id)
        self.unsettled.pop(0)

    def run(self, contexts=None, generation=(), check=True):
        step = self.prepare(contexts, generation)
        self.consume(step, check=check)
        self.settle(step)
        return step

    def prefill(self, rids, chunk=48, check=True):
        """Chunked prefill of every request in rids, then the steps settle."""
        while True:
            ctx = {r: min(chunk, self.model.request(r).prompt - self.model.request(r).capacity) for r in rids}
            ctx = {r: n for r, n in ctx.items() if n > 0}
            if not ctx:
                return
            self.run(ctx, check=check)

    # -- checks --------------------------------------------------------------------------------
    def check_layer(self, step, layer: int) -> None:
        """After layer `layer` of the step was written: every new token's visible keys have pages in its
        table row whose K/V are the toy model's, attention through them equals the dense reference, and
        the step's tables equal the reference conversion of the host table at its prepare."""
        be, geo = self.be, self.geo
        tables = be.to_numpy(self.mgr.out)
        table_at_prepare = next(t for s, t in self.unsettled if s is step)
        if layer == 0:
            want = expected_tables(self.mgr, table_at_prepare, step)
            assert np.array_equal(tables[:, :step.num_seqs], want), f"step {step.id}: tables differ from the reference"
            self.checked_tables += 1
        pages = be.to_numpy(self.storage.layer_pages(layer))
        g = geo.groups[int(geo.layer_group[layer])]
        for s, (rid, start, n) in enumerate(zip(step.request_ids, step.start_positions, step.num_tokens)):
            toks = np.array(self.tokens[rid], np.int64)
            for pos in range(int(start), int(start) + int(n)):
                keys = visible_keys(pos, g.window, g.sink_tokens)
                kp = tables[layer, s, 0, keys // TPB].astype(np.int64)
                vp = tables[layer, s, 1, keys // TPB].astype(np.int64)
                assert (kp != BAD).all(), f"{rid} pos {pos} layer {layer}: a visible key has no page"
                assert np.array_equal(vp, kp + 1)
                k, v = pages[kp, keys % TPB], pages[vp, keys % TPB]
                kt, vt = toy_kv(toks[keys], keys, layer)
                assert np.array_equal(k, kt) and np.array_equal(v, vt), \
                    f"{rid} pos {pos} layer {layer}: paged K/V differ from the toy model"
                q = toy_q(int(toks[pos]), pos, layer)
                np.testing.assert_allclose(attend(q, k, v), attend(q, kt, vt), rtol=0, atol=1e-6)

    def expected_blocks(self, rid) -> List[set]:
        """Blocks per group the request must hold (oracle geometry, from the model's numbers)."""
        return [self.model.blocks(rid, g) for g in self.geo.groups]

    def check_rows(self) -> None:
        """Resident requests hold exactly the model's blocks; suspended and free rows hold none."""
        for rid in self.model.rids:
            row = self.model.request(rid).row
            live = self.mgr.request(rid)
            assert live.suspended == (rid in self.suspended), rid
            assert (live.row, live.history, live.capacity) == (row, self.model.request(rid).history,
                                                               self.model.request(rid).capacity), rid
            for g, want in zip(self.geo.groups, self.expected_blocks(rid)):
                got = set(np.flatnonzero(self.mgr.table[g.index, row] != BAD).tolist())
                assert got == (set() if rid in self.suspended else want), (rid, g.index, sorted(got), sorted(want))
        for row in self.model.free_rows:
            assert (self.mgr.table[:, row] == BAD).all(), f"free row {row} holds slots"

    def check_conservation(self, scratch_held: Optional[Dict[int, list]] = None) -> None:
        """Every slot is in table cells, held as scratch, free, quarantined or evictable, exactly once;
        reference counts and stats() agree (oracle.check_slots)."""
        check_slots(self.mgr, scratch_held)

    def scratch_held(self) -> Dict[int, list]:
        held = {g.index: [] for g in self.geo.groups}
        for step, _ in self.unsettled:
            for k in range(step.num_contexts):
                rid = step.request_ids[k]
                if rid not in self.model or not self.model.is_live(step.id, k):
                    continue
                for g in self.geo.groups:
                    n = int(step.scratch_ends[g.index, k]) - int(step.scratch_begs[g.index, k])
                    used = self.geo.scratch_slots_needed(g, n) if n > 0 else 0
                    held[g.index] += step.scratch_slots[g.index, k, :used].tolist()
        return held

    def expected_kv(self, rid, p: int, block: int):
        """(layer index in group i, positions, K, V) of a block's settled tokens, per layer of group p."""
        g = self.geo.groups[p]
        hist = self.model.request(rid).history
        pos = np.arange(block * TPB, min((block + 1) * TPB, hist))
        toks = np.array(self.tokens[rid], np.int64)[pos]
        return [(i, pos) + toy_kv(toks, pos, layer) for i, layer in enumerate(g.layers)]

    def check_slot_kv(self, rid, p: int, block: int, slot_data: np.ndarray, where: str) -> None:
        """slot_data [scale, tpb, H, D]: the block's settled K/V of every layer of group p is the toy's."""
        for i, pos, k, v in self.expected_kv(rid, p, block):
            assert np.array_equal(slot_data[2 * i, pos % TPB], k), f"{where}: {rid} group {p} block {block} K"
            assert np.array_equal(slot_data[2 * i + 1, pos % TPB], v), f"{where}: {rid} group {p} block {block} V"

    def check_resident_kv(self, rid) -> None:
        """Through the table row and the storage's page views: the request's settled KV is the toy's
        (call after the device work ran)."""
        row = self.model.request(rid).row
        for g in self.geo.groups:
            pages = self.be.to_numpy(self.storage.pages(g.index))
            for b in np.flatnonzero(self.mgr.table[g.index, row] != BAD).tolist():
                slot = int(self.mgr.table[g.index, row, b])
                self.check_slot_kv(rid, g.index, b, pages[slot * g.scale:(slot + 1) * g.scale], "device")

    def host_copy(self, rid) -> List[np.ndarray]:
        """The host tier's copy of a suspended request, per group [n, scale, tpb, H, D] in block order."""
        held = self.tier.held[rid]
        out = []
        for g, hs in zip(self.geo.groups, held.host_slots):
            out.append(self.tier.pools[g.index][np.asarray(hs, np.int64)].view(np.float32)
                       .reshape(len(hs), g.scale, TPB, H, D))
        return out

    def check_host_kv(self, rid) -> None:
        held = self.tier.held[rid]
        for g, blocks, data in zip(self.geo.groups, held.blocks, self.host_copy(rid)):
            assert sorted(np.asarray(blocks).tolist()) == sorted(self.expected_blocks(rid)[g.index]), (rid, g.index)
            for b, slot_data in zip(np.asarray(blocks).tolist(), data):
                self.check_slot_kv(rid, g.index, b, slot_data, "host tier")

    def slot_bytes_of(self, rid) -> Dict[int, np.ndarray]:
        """Raw contents of the request's device slots, per group, in block order (after a sync)."""
        row = self.model.request(rid).row
        out = {}
        for g in self.geo.groups:
            cells = self.mgr.table[g.index, row]
            slots = cells[cells != BAD].astype(np.int64)
            out[g.index] = self.be.to_numpy(self.storage.arrays[g.index])[slots]
        return out

    def moved_bytes(self, rid) -> int:
        return sum(len(b) * sb for b, sb in zip(self.expected_blocks(rid), self.slot_bytes))

    def host_used(self) -> List[int]:
        return [g["used"] for g in self.mgr.stats()["host_tier"]["groups"]]


def resident_sets(mgr, rid) -> List[set]:
    """The blocks of mgr.resident_blocks(rid), per group."""
    return [set(np.asarray(b).tolist()) for b, _ in mgr.resident_blocks(rid)]


# --------------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "prefix-cache"])
def test_round_trip(backend_name, caching):
    """Suspend, let other requests take and write the freed slots, resume: the KV is what it was, the
    copies moved exactly the sinks and window of SWA groups and every block of full attention, and decode
    continues with attention equal to the dense reference."""
    rig = Rig(backend_name, caching=caching)
    mgr = rig.mgr
    rig.add("a", 101, shared_prefix=64)
    rig.add("b", 30)
    rig.prefill(["a", "b"])
    for _ in range(6):                                  # history 107: not a multiple of tpb
        rig.run(generation=["a", "b"])
    mgr.synchronize()
    rig.check_rows()
    rig.check_resident_kv("a")
    want = rig.expected_blocks("a")
    # SWA groups hold the sink block and the window only; full attention every block
    assert want[0] == {0, 11, 12, 13} and want[1] == set(range(14)) and want[2] == {0, 10, 11, 12, 13}
    assert resident_sets(mgr, "a") == want
    before = rig.slot_bytes_of("a")
    old_slots = [set(s) for s in held_slots(mgr, "a")]
    stats0 = mgr.stats()["host_tier"]
    rig.suspend("a")
    assert mgr.request("a").suspended
    stats1 = mgr.stats()["host_tier"]
    assert stats1["bytes_to_host"] - stats0["bytes_to_host"] == rig.moved_bytes("a")
    assert stats1["suspended"] == 1
    assert rig.host_used() == [len(b) for b in want]
    rig.check_rows()
    rig.check_conservation()
    mgr.synchronize()
    rig.check_host_kv("a")

    # others take the freed slots and write them
    rig.add("c", 70, shared_prefix=64)                 # with caching: hits what "a" published
    rig.add("d", 90)
    rig.prefill(["c", "d"])
    for _ in range(3):
        rig.run(generation=["b", "c", "d"])
    mgr.synchronize()
    taken = [set(mgr.table[p][mgr.table[p] != BAD].tolist()) for p in range(len(rig.geo.groups))]
    assert any(o & t for o, t in zip(old_slots, taken)), "nobody reused the freed slots: the test proves nothing"
    rig.check_host_kv("a")

    stats2 = mgr.stats()["host_tier"]
    rig.resume("a")
    assert not mgr.request("a").suspended
    stats3 = mgr.stats()["host_tier"]
    assert stats3["bytes_to_device"] - stats2["bytes_to_device"] == rig.moved_bytes("a")
    rig.check_rows()
    assert resident_sets(mgr, "a") == want
    rig.check_conservation()
    mgr.synchronize()
    rig.check_resident_kv("a")
    after = rig.slot_bytes_of("a")
    for p in before:
        assert np.array_equal(before[p], after[p]), f"group {p}: slot contents differ after the round trip"
    assert rig.host_used() == [0, 0, 0]            # host slots returned once the copy back completed
    assert mgr.stats()["host_tier"]["suspended"] == 0

    # decode continues: blocks leave the windows, new blocks open; attention checked every step
    for _ in range(20):
        rig.run(generation=["a", "b", "c", "d"])
    mgr.synchronize()
    rig.check_rows()
    for rid in ["a", "b", "c", "d"]:
        rig.check_resident_kv(rid)
    for rid in ["a", "b", "c", "d"]:
        rig.free(rid)
    mgr.reclaim(wait=True)
    rig.check_conservation()
    assert all(g["owned"] == g["scratch"] == g["quarantined"] == 0 for g in mgr.stats()["groups"])
    assert rig.checked_tables > 30


def test_round_trip_moves_only_window_and_sinks(backend_name):
    """A long request: the copies move the sink block and the window of each SWA group, every block of
    full attention (by hand: history 200, tpb 8, window 16 / 24, 4 sink tokens), and nothing else."""
    rig = Rig(backend_name, slots=48)
    mgr = rig.mgr
    rig.add("a", 200)
    rig.prefill(["a"], chunk=64)               # long chunks: scratch in the SWA groups
    mgr.synchronize()
    # stale end = (200 + 1 - W) // 8: 23 for W=16, 22 for W=24; 25 blocks; sink block 0
    hand = [{0, 23, 24}, set(range(25)), {0, 22, 23, 24}]
    assert rig.expected_blocks("a") == hand
    assert resident_sets(mgr, "a") == hand
    before = rig.slot_bytes_of("a")
    rig.suspend("a")
    st_ = mgr.stats()["host_tier"]
    assert st_["bytes_to_host"] == (3 * 4 + 25 * 2 + 4 * 2) * TPB * H * D * 4 == rig.moved_bytes("a")
    assert rig.host_used() == [3, 25, 4]
    mgr.synchronize()
    rig.check_host_kv("a")
    assert all(g["owned"] == 0 for g in mgr.stats()["groups"])     # nothing of "a" stays on the device
    rig.resume("a")
    mgr.synchronize()
    assert mgr.stats()["host_tier"]["bytes_to_device"] == st_["bytes_to_host"]
    assert [g["owned"] for g in mgr.stats()["groups"]] == [3, 25, 4]
    after = rig.slot_bytes_of("a")
    assert all(np.array_equal(before[p], after[p]) for p in before)
    for _ in range(10):
        rig.run(generation=["a"])
    rig.check_rows()


def test_suspend_fresh_and_twice(backend_name):
    """A request that holds nothing yet moves nothing; a request can go round twice, and one resumed
    and suspended again before anything ran still ends with its KV."""
    rig = Rig(backend_name)
    mgr = rig.mgr
    rig.add("new", 40)
    rig.suspend("new")
    assert mgr.stats()["host_tier"]["bytes_to_host"] == 0
    rig.resume("new")
    rig.add("a", 60)
    rig.prefill(["new", "a"])
    for _ in range(3):
        rig.run(generation=["a", "new"])
    mgr.synchronize()
    rig.suspend("a")
    rig.resume("a")                      # copy back queued right behind the copy out (one stream)
    rig.suspend("a")                     # and out again, before anything ran
    rig.resume("a")
    mgr.synchronize()
    rig.check_rows()
    rig.check_resident_kv("a")
    assert rig.host_used() == [0, 0, 0]
    for _ in range(9):
        rig.run(generation=["a", "new"])
    rig.check_conservation()


# --------------------------------------------------------------------------------------------------
# Gated races
# --------------------------------------------------------------------------------------------------
def _unfenced(mgr):
    """UNSAFE: detach releases the slots with the tag of the last step, not a fence on the D2H copy."""
    mgr.ledger.record_fence = lambda event: mgr.ledger.last_prepared


class _Forgetful(dict):
    """UNSAFE: attach's copy-back event is never registered, so no step waits for it."""

    def __setitem__(self, key, value):
        pass


@pytest.mark.parametrize("writer", ["consumer", "manager"])
@pytest.mark.parametrize("variant", ["safe", "unsafe"])
def test_gated_copy_out_vs_reuse(backend_name, variant, writer):
    """The D2H copy is held while the freed slots are handed to another request and rewritten; after the
    gate opens the host copy (and, after resume, the device KV) must still be the old KV. Without the
    fence the slots are reused at once and the copy reads the new owner's KV."""
    rig = Rig(backend_name, slots=40)
    mgr, be = rig.mgr, rig.be
    rig.add("a", 75)
    rig.prefill(["a"])
    for _ in range(3):
        rig.run(generation=["a"])
    rig.add("c", 60)                                     # comes later: prefill while "a" is out
    mgr.synchronize()
    before = rig.slot_bytes_of("a")
    old = [set(s) for s in held_slots(mgr, "a")]
    if variant == "unsafe":
        _unfenced(mgr)
    stream = be.stream if writer == "manager" else rig.consumer
    kv = rig.planned_kv({"c": 60})                      # c's K/V on the device before the gate
    gate = be.gate(rig.tier.stream)
    rig.suspend("a")
    step = rig.prepare({"c": 60})
    rig.consume(step, check=False, kv=kv, stream=stream)
    rig.settle(step)
    taken = [set(s) for s in held_slots(mgr, "c")]
    stream.synchronize()                                 # c's KV is written while the copy waits
    if variant == "safe":
        assert not any(o & t for o, t in zip(old, taken)), "slots of a copy still pending were handed out"
    else:
        assert any(o & t for o, t in zip(old, taken)), "the unsafe variant did not reuse the slots"
    gate.open()
    mgr.synchronize()
    assert not gate.close_timeout_hit()
    rig.check_resident_kv("c")
    copy = rig.host_copy("a")
    intact = all(np.array_equal(copy[p], before[p]) for p in before)
    if variant == "safe":
        assert intact, "the host copy does not hold the KV the request had"
        rig.check_host_kv("a")
        rig.resume("a")
        mgr.synchronize()
        rig.check_resident_kv("a")
        rig.run(generation=["a", "c"])
    else:
        assert not intact, "the unsafe variant copied the right KV: this test does not catch the race"


def consumer_buffers(rig):
    """Buffers for a consumer's copies of the tables and of every storage array (made before a gate)."""
    be = rig.be
    if be.xp is np:
        bufs = [np.empty_like(mgr_out) for mgr_out in [rig.mgr.out] + list(rig.storage.arrays)]
    else:
        with be.stream:
            bufs = [be.xp.empty_like(a) for a in [rig.mgr.out] + list(rig.storage.arrays)]
    be.synchronize()
    return bufs[0], bufs[1:]


@pytest.mark.parametrize("variant", ["safe", "unsafe"])
def test_gated_copy_back_vs_consumer(backend_name, variant):
    """The H2D copy is held while the next step that schedules the resumed request is prepared and its
    consumer runs: the consumer (waiting on step.ready, reading pages through the step's tables) must
    read the restored KV. Without the wait it reads whatever the fresh slots held before."""
    rig = Rig(backend_name, slots=40)
    mgr, be = rig.mgr, rig.be
    rig.add("a", 75)
    rig.add("b", 20)
    rig.prefill(["a", "b"])
    for _ in range(3):
        rig.run(generation=["a", "b"])
    mgr.synchronize()
    before = rig.slot_bytes_of("a")
    rig.suspend("a")
    mgr.synchronize()
    rig.add("x", 80)                    # takes a's old slots and writes its own KV there, then goes
    rig.prefill(["x"])
    rig.free("x")
    mgr.reclaim(wait=True)
    if variant == "unsafe":
        mgr.requests.loading = _Forgetful()
    tbuf, pbufs = consumer_buffers(rig)
    kv = rig.planned_kv(generation=["a", "b"])
    device_before = [be.to_numpy(a) for a in rig.storage.arrays]
    gate = be.gate(rig.tier.stream)
    rig.resume("a")
    fresh = [np.asarray(s, np.int64) for _, s in mgr.resident_blocks("a")]
    assert any(not np.array_equal(device_before[p][fresh[p]], before[p]) for p in before), \
        "the fresh slots already hold a's KV: the copy back has nothing to do and the test proves nothing"
    step = rig.prepare(generation=["a", "b"])
    be.wait(rig.consumer, step.ready)                    # the consumer: reads, then writes the step's K/V
    be.copy_d2d(tbuf, mgr.out, rig.consumer)
    for buf, arr in zip(pbufs, rig.storage.arrays):
        be.copy_d2d(buf, arr, rig.consumer)
    for layer, (k, v) in enumerate(kv):
        rig.storage.write(step, layer, k, v, stream=rig.consumer)
    step.finish(rig.consumer)
    if variant == "safe":
        assert not step.ready.wait(0), "the step's tables were ready before the copy back ran"
    else:
        rig.consumer.synchronize()                       # nothing holds it: it reads now
    gate.open()
    mgr.synchronize()
    rig.consumer.synchronize()
    assert not gate.close_timeout_hit()
    tables = be.to_numpy(tbuf)
    assert np.array_equal(tables[:, :step.num_seqs], expected_tables(mgr, rig.unsettled[-1][1], step))
    pages = [be.to_numpy(b) for b in pbufs]
    s = list(step.request_ids).index("a")
    wrong = []
    for g in rig.geo.groups:
        view = pages[g.index].reshape((-1,) + pages[g.index].shape[2:])
        for b in sorted(rig.expected_blocks("a")[g.index]):
            for i, pos, k, v in rig.expected_kv("a", g.index, b):
                kp = int(tables[g.layers[i], s, 0, b])
                assert kp != BAD, f"group {g.index} block {b}: no page in the resumed request's table"
                if not (np.array_equal(view[kp, pos % TPB], k) and np.array_equal(view[kp + 1, pos % TPB], v)):
                    wrong.append((g.index, b, g.layers[i]))
    if variant == "unsafe":
        assert wrong, "the unsafe variant read the restored KV: this test does not catch the race"
        return
    assert wrong == [], f"the consumer read stale or half-copied KV at (group, block, layer) {wrong}"
    rig.settle(step)
    rig.check_resident_kv("a")
    for _ in range(10):                                  # decode goes on, attention checked
        rig.run(generation=["a", "b"])
    rig.check_rows()


def test_gated_free_before_copy_back(backend_name):
    """A resumed request freed before its copy back ran: its fresh slots may go to another request only
    once that copy has completed (docs/design.md's "Host tier": nobody writes a copy's destination until its event has
    completed), or the late copy overwrites the new owner's KV."""
    rig = Rig(backend_name, slots=40)
    mgr, be = rig.mgr, rig.be
    rig.add("a", 75)
    rig.prefill(["a"])
    rig.run(generation=["a"])
    mgr.synchronize()
    rig.suspend("a")
    mgr.synchronize()
    rig.add("c", 70)
    kv = rig.planned_kv({"c": 70})
    gate = be.gate(rig.tier.stream)
    rig.resume("a")
    fresh = [set(map(int, s)) for _, s in mgr.resident_blocks("a")]
    rig.free("a")                                        # before any step scheduled it
    step = rig.prepare({"c": 70})
    rig.consume(step, check=False, kv=kv)
    rig.settle(step)
    taken = [set(s) for s in held_slots(mgr, "c")]
    rig.consumer.synchronize()                           # c's KV is written while the copy back waits
    gate.open()
    mgr.synchronize()
    assert not gate.close_timeout_hit()
    reused = [sorted(f & t) for f, t in zip(fresh, taken)]
    rig.check_resident_kv("c")                           # fails when the late copy landed in c's slots
    assert not any(reused), f"slots of a pending copy back were handed to another request: {reused}"
    rig.check_conservation()


# --------------------------------------------------------------------------------------------------
# Bad input and faults: each fails with its error and leaves everything as it was
# --------------------------------------------------------------------------------------------------
def tier_state(rig) -> tuple:
    """The manager's state (the tier's with it) and the exact order of the tier's free lists."""
    return rig.mgr.state(), tuple(f.free_slots().tolist() for f in rig.tier._free)


def expect_unchanged(rig, error, fn, *args):
    before = tier_state(rig)
    with pytest.raises(error):
        fn(*args)
    assert tier_state(rig) == before, f"{fn.__name__}{args}: failed but changed the state"


def test_suspend_and_resume_bad_input(backend_name):
    rig = Rig(backend_name)
    mgr, storage = rig.mgr, rig.storage
    rig.add("a", 30)
    rig.add("b", 20)
    rig.prefill(["a", "b"])
    mgr.synchronize()
    expect_unchanged(rig, UnknownRequestError, storage.suspend, "nobody")
    expect_unchanged(rig, UnknownRequestError, storage.resume, "nobody")
    expect_unchanged(rig, UnknownRequestError, storage.resume, [1])          # unhashable: a bare TypeError before
    expect_unchanged(rig, InvalidRequestError, storage.resume, "a")          # resident, not suspended
    # in an unsettled step
    step = rig.prepare(generation=["a"])
    expect_unchanged(rig, StepOrderError, storage.suspend, "a")
    rig.consume(step)
    expect_unchanged(rig, StepOrderError, storage.suspend, "a")              # finished, not settled
    rig.settle(step)
    # settled but not finished: its consumer may still be writing the KV
    step = rig.prepare(generation=["a", "b"])
    rig.settle(step)
    expect_unchanged(rig, StepOrderError, storage.suspend, "a")
    rig.consume(step, check=False)
    rig.suspend("a")
    expect_unchanged(rig, InvalidRequestError, storage.suspend, "a")         # already suspended
    rig.resume("a")
    expect_unchanged(rig, InvalidRequestError, storage.resume, "a")
    # a freed request is unknown to both
    rig.suspend("b")
    rig.free("b")
    expect_unchanged(rig, UnknownRequestError, storage.resume, "b")
    expect_unchanged(rig, UnknownRequestError, storage.suspend, "b")
    mgr.synchronize()
    rig.check_resident_kv("a")
    rig.run(generation=["a"])


def test_scheduling_a_suspended_request(backend_name):
    rig = Rig(backend_name)
    mgr = rig.mgr
    rig.add("a", 30)
    rig.add("b", 20)
    rig.add("p", 50)                       # still has prompt left
    rig.prefill(["a", "b"])
    rig.run({"p": 16})
    rig.run(generation=["a", "b"])         # the manager keeps this validated generation list
    mgr.synchronize()
    rig.suspend("a")
    rig.suspend("p")
    for contexts, generation in (({}, ["a", "b"]), ({}, ["b", "a"]), ({}, ["a"]), ({"p": 8}, ["b"]), ({"p": 8}, [])):
        before = mgr.state()
        with pytest.raises(InvalidRequestError, match="suspended"):
            mgr.prepare_batch(contexts, generation)
        assert mgr.state() == before
    rig.run(generation=["b"])              # the others go on
    rig.resume("a")
    rig.resume("p")
    rig.run({"p": 34}, generation=["a", "b"])
    rig.run(generation=["a", "b", "p"])
    rig.check_rows()


def test_host_tier_full(backend_name):
    """A host pool too small for the request: HostTierFullError, nothing copied or released, the request
    stays resident with its KV; requests that fit still move."""
    rig = Rig(backend_name, tier_slots=4)
    mgr = rig.mgr
    assert [g["total"] for g in mgr.stats()["host_tier"]["groups"]] == [4, 4, 4]   # split like the device
    rig.add("big", 40)                     # 5 blocks of full attention
    rig.add("small", 24)                   # 3 blocks in every group
    rig.add("one", 8)                      # 1 block
    rig.prefill(["big", "small", "one"])
    mgr.synchronize()
    expect_unchanged(rig, HostTierFullError, rig.storage.suspend, "big")
    assert not mgr.request("big").suspended
    rig.suspend("small")
    expect_unchanged(rig, HostTierFullError, rig.storage.suspend, "big")
    rig.add("two", 16)                     # 2 blocks: 3 + 2 > 4
    rig.prefill(["two"])
    expect_unchanged(rig, HostTierFullError, rig.storage.suspend, "two")
    rig.suspend("one")                     # 3 + 1 = 4: exactly full
    assert rig.host_used() == [4, 4, 4]
    rig.run(generation=["big", "two"])     # the refused ones are still resident and decode
    mgr.synchronize()
    for rid in ("big", "two"):
        rig.check_resident_kv(rid)
    rig.check_host_kv("small")
    rig.resume("small")
    mgr.synchronize()
    assert rig.host_used() == [1, 1, 1]
    rig.suspend("two")
    rig.check_rows()
    rig.check_conservation()


def test_resume_out_of_device_slots(backend_name):
    """Resume when a group has too few device slots: OutOfSlotsError, nothing changed, still suspended;
    once slots are back it resumes with its KV."""
    rig = Rig(backend_name, slots=24)
    mgr = rig.mgr
    rig.add("a", 75)                       # 10 blocks of full attention
    rig.prefill(["a"])
    mgr.synchronize()
    rig.suspend("a")
    mgr.synchronize()
    rig.add("x", 150)                      # 19 blocks of full attention: 5 left
    rig.prefill(["x"])
    mgr.synchronize()
    assert mgr.stats()["groups"][1]["free"] < 10
    expect_unchanged(rig, OutOfSlotsError, rig.storage.resume, "a")
    assert mgr.request("a").suspended and "a" in rig.tier.held
    rig.check_host_kv("a")
    rig.free("x")
    rig.resume("a")
    mgr.synchronize()
    rig.check_resident_kv("a")
    rig.run(generation=["a"])
    rig.check_conservation()


def prefilled_a_and_b(backend_name):
    """A rig with requests a (75 tokens) and b (20) prefilled and synchronized; and a's blocks per group."""
    rig = Rig(backend_name)
    rig.add("a", 75)
    rig.add("b", 20)
    rig.prefill(["a", "b"])
    rig.mgr.synchronize()
    return rig, [len(b) for b in rig.expected_blocks("a")]


@pytest.mark.parametrize("gated", [False, True], ids=["copied", "copy-pending"])
def test_free_suspended_returns_host_slots(backend_name, gated):
    """Freeing a suspended request gives its host slots back once its D2H copy has completed (not
    before), and its device slots once that copy and every step so far are done."""
    rig, want = prefilled_a_and_b(backend_name)
    mgr, be = rig.mgr, rig.be
    gate = be.gate(rig.tier.stream) if gated else None
    rig.suspend("a")
    rig.free("a")
    assert mgr.stats()["host_tier"]["suspended"] == 0
    if gated:
        assert rig.host_used() == want, "host slots came back while the copy may still write them"
        assert all(g["quarantined"] >= w for g, w in zip(mgr.stats()["groups"], want))
        rig.run(generation=["b"])           # other work goes on meanwhile
        gate.open()
        assert not gate.close_timeout_hit()
    mgr.synchronize()
    assert rig.host_used() == [0, 0, 0]
    rig.check_conservation()
    rig.free("b")
    mgr.reclaim(wait=True)
    assert all(g["free"] == g["total"] for g in mgr.stats()["groups"])
    assert all(g["free"] == g["total"] for g in mgr.stats()["host_tier"]["groups"])


def test_storage_host_tier_errors(backend_name):
    spec = cupykv.CacheSpec(windows=WINDOWS, num_kv_heads=H, head_dim=D, dtype="float32", tokens_per_block=TPB,
                            max_seq_len=256, max_batch=4, slots_per_group=16, sink_tokens=SINKS)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    slot_bytes = [g.scale * TPB * H * D * 4 for g in Geometry(spec).groups]
    with pytest.raises(InvalidRequestError, match="KVCacheManager"):
        KVStorage(mgr.layout, mgr.backend, "float32", host_tier_bytes=1 << 20)
    for bad in (0, -1, True, 1.5, "1024"):
        with pytest.raises(InvalidSpecError):
            KVStorage(mgr, host_tier_bytes=bad)
    with pytest.raises(InvalidSpecError, match="too small"):
        KVStorage(mgr, host_tier_bytes=sum(slot_bytes) - 1)       # some group gets no slot
    if backend_name == "host":      # (a CUDA host would try to pin it and may take long to refuse)
        with pytest.raises(InvalidSpecError, match="cannot allocate"):
            KVStorage(mgr, host_tier_bytes=2 ** 80)                # a bare ValueError from numpy before
    assert mgr.host_tier is None                                   # the failures left no tier behind
    plain = KVStorage(mgr)
    with pytest.raises(InvalidRequestError, match="no host tier"):
        plain.suspend("a")
    with pytest.raises(InvalidRequestError, match="no host tier"):
        plain.resume("a")
    storage = KVStorage(mgr, host_tier_bytes=sum(slot_bytes))     # exactly one slot of every group
    assert [g["total"] for g in mgr.stats()["host_tier"]["groups"]] == [1, 1, 1]
    with pytest.raises(InvalidRequestError, match="already has a host tier"):
        KVStorage(mgr, host_tier_bytes=1 << 20)
    assert mgr.host_tier is storage.host_tier
    mgr.add("a", 8)
    s = mgr.prepare_batch({"a": 8})
    s.finish()
    mgr.settle(s)
    storage.suspend("a")
    storage.resume("a")
    mgr.synchronize()


@pytest.mark.parametrize("variant", ["safe", "unsafe"])
def test_gated_copy_out_waits_for_the_last_write(backend_name, variant):
    """The consumer of the request's last step is held (its K/V writes not run yet) when the request is
    suspended: the D2H copy must wait for that step's finish, so the host copy has the last token's KV.
    Without the wait the copy reads the slots before the write."""
    rig = Rig(backend_name)
    mgr, be = rig.mgr, rig.be
    rig.add("a", 61)
    rig.prefill(["a"])
    mgr.synchronize()
    if variant == "unsafe":
        check = mgr.residence.check_detach
        mgr.residence.check_detach = lambda rid: (check(rid), [])[1]        # no event for the copy to wait on
    kv = rig.planned_kv(generation=["a"])
    gate = be.gate(rig.consumer)
    step = rig.prepare(generation=["a"])
    rig.consume(step, check=False, kv=kv)                 # held behind the gate, finish recorded after
    rig.settle(step)
    rig.suspend("a")
    copied = rig.tier.held["a"].copied
    if variant == "safe":
        assert not copied.wait(0), "the copy out ran before the last step's consumer finished"
    else:
        rig.tier.stream.synchronize()                     # nothing holds it: it copies now
    gate.open()
    mgr.synchronize()
    rig.consumer.synchronize()
    assert not gate.close_timeout_hit()
    if variant == "unsafe":
        with pytest.raises(AssertionError, match="host tier"):
            rig.check_host_kv("a")
        return
    rig.check_host_kv("a")
    rig.resume("a")
    mgr.synchronize()
    rig.check_resident_kv("a")
    rig.run(generation=["a"])


# --------------------------------------------------------------------------------------------------
# A stateful random test
# --------------------------------------------------------------------------------------------------
PATTERNS = {"mixed": (WINDOWS, SINKS), "gptoss": ([16, None] * 2, 0), "gemma": ([16] * 3 + [None], 0)}


class TierMachine(RuleBasedStateMachine):
    """Random adds, steps, settles, frees, suspends and resumes (gates on the manager stream and on the
    host tier's stream at random; work run part-way at random); after every operation the table rows
    match the model (suspended rows empty), slots are conserved, the host tier holds exactly the
    suspended requests; after each drain every step's tables equal the reference, every resident
    request's KV and every host copy equal the toy model, and the host slots in use are exactly the
    suspended requests' blocks."""

    @initialize(pattern=st.sampled_from(sorted(PATTERNS)), caching=st.booleans(), scratch=st.booleans(),
                slots=st.integers(8, 40), tier_slots=st.integers(2, 24),
                retention=st.sampled_from(["boundaries", "all"]))
    def setup(self, pattern, caching, scratch, slots, tier_slots, retention):
        windows, sinks = PATTERNS[pattern]
        self.rig = Rig("host", caching=caching, slots=slots, tier_slots=tier_slots, scratch=scratch,
                       windows=windows, sinks=sinks, max_batch=5, max_seq_len=160, retention=retention)
        self.gates = {}
        self.captured = []        # (step, table at prepare, tables the consumer read)
        self.copies = []          # (event after a copy, per group the device slots it reads or writes)
        self.next_rid = 0

    ACTIONS = (["add"] * 3 + ["step"] * 6 + ["settle"] * 4 + ["free"] * 3 + ["suspend"] * 3 + ["resume"] * 3
               + ["run"] * 2 + ["drain", "gate", "gate"])

    @rule(data=st.data())
    def act(self, data):
        action = data.draw(st.sampled_from(self.ACTIONS), label="action")
        if data.draw(st.booleans(), label="run what can run first"):
            self.rig.be.device.drain()
        getattr(self, "do_" + action)(data)

    # -- operations ------------------------------------------------------------------------------
    def do_add(self, data):
        rig = self.rig
        if len(rig.model) == rig.spec.max_batch:
            return
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        shared = data.draw(st.sampled_from([0, 16, 40]), label="shared prefix") if rig.caching else 0
        longest = 90
        rig.add(rid, data.draw(st.integers(1, longest), label="prompt"), shared_prefix=shared)

    def do_step(self, data):
        rig = self.rig
        ctx, gen = {}, []
        for rid in rig.model.rids:
            m = rig.model.request(rid)
            if rid in rig.suspended:
                continue
            if m.capacity < m.prompt and data.draw(st.booleans(), label=f"ctx {rid}"):
                ctx[rid] = data.draw(st.integers(1, m.prompt - m.capacity), label=f"chunk {rid}")
            elif m.prompt <= m.capacity < rig.spec.max_seq_len and data.draw(st.booleans(), label=f"gen {rid}"):
                gen.append(rid)
        if not ctx and not gen:
            return
        before = rig.mgr.state()
        try:
            step = rig.prepare(ctx, gen)
        except OutOfSlotsError:
            event("step: OutOfSlotsError")
            assert rig.mgr.state() == before
            return
        be = rig.be
        buf = np.empty_like(rig.mgr.out)
        be.wait(rig.consumer, step.ready)
        be.copy_d2d(buf, rig.mgr.out, rig.consumer)
        self.captured.append((step, rig.unsettled[-1][1], buf))
        rig.consume(step, check=False)

    def do_settle(self, data):
        if self.rig.unsettled:
            self.rig.settle(self.rig.unsettled[0][0])

    def do_free(self, data):
        if len(self.rig.model):
            self.rig.free(data.draw(st.sampled_from(sorted(self.rig.model.rids)), label="free"))

    def pending(self, rid) -> bool:
        return any(rid in s.request_ids and self.rig.model.is_live(s.id, list(s.request_ids).index(rid))
                   for s, _ in self.rig.unsettled)

    def do_suspend(self, data):
        rig = self.rig
        if not len(rig.model):
            return
        rid = data.draw(st.sampled_from(sorted(rig.model.rids)), label="suspend")
        need = [len(b) for b in rig.expected_blocks(rid)]
        tier = rig.mgr.stats()["host_tier"]
        short = any(n > g["total"] - g["used"] for n, g in zip(need, tier["groups"]))
        error = (InvalidRequestError if rid in rig.suspended else StepOrderError if self.pending(rid)
                 else HostTierFullError if short else None)
        event(f"suspend: {error.__name__ if error else 'ok'}")
        if error is not None:
            expect_unchanged(rig, error, rig.storage.suspend, rid)
            return
        slots = [set(c) for c in held_slots(rig.mgr, rid)]
        rig.suspend(rid)
        self.copies.append((rig.be.record(rig.tier.stream), slots))     # completes after the D2H copy
        after = rig.mgr.stats()["host_tier"]
        assert after["bytes_to_host"] - tier["bytes_to_host"] == rig.moved_bytes(rid)
        assert [g["used"] for g in after["groups"]] == [g["used"] + n for g, n in zip(tier["groups"], need)]

    def do_resume(self, data):
        rig = self.rig
        if not len(rig.model):
            return
        rid = data.draw(st.sampled_from(sorted(rig.model.rids)), label="resume")
        if rid not in rig.suspended:
            expect_unchanged(rig, InvalidRequestError, rig.storage.resume, rid)
            return
        tier = rig.mgr.stats()["host_tier"]
        before = tier_state(rig)
        try:
            rig.resume(rid)
        except OutOfSlotsError:
            event("resume: OutOfSlotsError")
            assert tier_state(rig) == before
            need = [len(b) for b in rig.expected_blocks(rid)]
            assert any(n > g["free"] + g["quarantined"] + g["evictable"]
                       for n, g in zip(need, rig.mgr.stats()["groups"])) or self.gates, "resume refused with slots to spare"
            return
        event("resume: ok" + (" (tier gated)" if "tier" in self.gates else ""))
        self.copies.append((rig.be.record(rig.tier.stream), [set(c) for c in held_slots(rig.mgr, rid)]))
        assert rig.mgr.stats()["host_tier"]["bytes_to_device"] - tier["bytes_to_device"] == rig.moved_bytes(rid)

    def do_run(self, data):
        self.rig.be.device.drain()          # whatever no gate holds runs now

    def do_gate(self, data):
        which = data.draw(st.sampled_from(["tier", "manager"]), label="gate")
        if which not in self.gates:
            rig = self.rig
            self.gates[which] = rig.be.gate(rig.tier.stream if which == "tier" else rig.be.stream)

    def do_drain(self, data=None):
        rig = self.rig
        for gate in self.gates.values():
            gate.open()
        self.gates = {}
        rig.mgr.synchronize()
        for step, table, buf in self.captured:
            assert np.array_equal(buf[:, :step.num_seqs], expected_tables(rig.mgr, table, step)), \
                f"step {step.id}: the consumer read tables that differ from the reference"
        self.captured = []
        for rid in rig.model.rids:
            if rid in rig.suspended:
                rig.check_host_kv(rid)
            else:
                rig.check_resident_kv(rid)
        want = [sum(len(rig.expected_blocks(r)[p]) for r in rig.suspended) for p in range(len(rig.geo.groups))]
        assert rig.host_used() == want, (rig.host_used(), want)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def rows_slots_and_host_tier(self):
        if not hasattr(self, "rig"):
            return
        rig = self.rig
        rig.check_rows()
        rig.check_conservation(rig.scratch_held())
        assert set(rig.tier.held) == rig.suspended
        want = [sum(len(rig.expected_blocks(r)[p]) for r in rig.suspended) for p in range(len(rig.geo.groups))]
        assert all(u >= w for u, w in zip(rig.host_used(), want)), (rig.host_used(), want)
        tier = rig.mgr.stats()["host_tier"]
        assert tier["suspended"] == len(rig.suspended)
        if rig.caching and any(p.evictions for p in rig.mgr.pools):
            event("evictions")
        if rig.caching and any(p.num_evictable for p in rig.mgr.pools):
            event("evictable")
        if any(g.get("cached") for g in tier["groups"]):
            event("cached blocks in the host tier")
        # nobody may get a slot that a copy still reads (D2H) or writes (H2D): not free, not evictable
        self.copies = [(e, slots) for e, slots in self.copies if not e.done()]
        for _, slots in self.copies:
            for p, pool in enumerate(rig.mgr.pools):
                up_for_grabs = set(pool.free_slots().tolist())
                if hasattr(pool, "evictable_slots"):
                    up_for_grabs |= set(pool.evictable_slots().tolist())
                assert not slots[p] & up_for_grabs, \
                    f"group {p}: slots {sorted(slots[p] & up_for_grabs)} can be handed out while a copy uses them"

    def teardown(self):
        if hasattr(self, "rig"):
            self.do_drain()


TierMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow],
                                         phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
TestHostTierMachine = TierMachine.TestCase


def test_gated_copy_out_of_prefix_hit_waits_for_its_writer(backend_name):
    """A request whose blocks came from a prefix-cache hit and that has no step of its own yet: its KV
    was written by the publishing request's step, whose consumer is still held. The D2H copy must wait
    for that write too (docs/design.md's "Host tier": copies ordered after the finish of the step that wrote the KV)."""
    rig = Rig(backend_name, caching=True)
    mgr, be = rig.mgr, rig.be
    rig.add("p", 40, shared_prefix=40)
    kv = rig.planned_kv({"p": 40})
    gate = be.gate(rig.consumer)
    step = rig.prepare({"p": 40})
    rig.consume(step, check=False, kv=kv)                 # p's K/V writes wait behind the gate
    rig.settle(step)                                      # published: blocks 0..4 are hits now
    assert rig.add("q", 41, shared_prefix=40) == 40
    rig.suspend("q")
    copied = rig.tier.held["q"].copied
    ran_early = copied.wait(0)
    gate.open()
    mgr.synchronize()
    assert not gate.close_timeout_hit()
    assert not ran_early, "the copy out ran before the KV it copies was written"
    rig.check_host_kv("q")
    rig.resume("q")
    rig.run({"q": 1})
    rig.run(generation=["q", "p"])


def test_resume_evicts_cached_blocks_to_the_host_tier(backend_name):
    """With prefix caching, resume takes evictable cached slots when free ones are short: their blocks are
    copied out to the host tier (and stay hits) before the copy back overwrites the slots. Both the
    resumed request's KV and a later hit on the moved blocks must be the toy model's."""
    rig = Rig(backend_name, caching=True, slots=32, tier_slots=24)
    mgr = rig.mgr
    full = 1                                             # the full-attention group
    rig.add("p", 40, shared_prefix=40)
    rig.prefill(["p"])
    rig.free("p")                                        # its 5 blocks stay cached: evictable
    rig.add("a", 75)
    rig.prefill(["a"])
    mgr.synchronize()
    need = len(rig.expected_blocks("a")[full])
    rig.suspend("a")
    mgr.synchronize()
    pool = mgr.pools[full]
    cached = pool.num_evictable                          # p's blocks, then a's (released later)
    assert cached >= 5
    rig.add("x", (pool.num_free - need + 3) * TPB)      # leaves need - 3 free slots: resume evicts 3
    rig.prefill(["x"])
    mgr.synchronize()
    assert pool.num_free == need - 3 and pool.num_evictable == cached
    rig.resume("a")
    assert mgr.stats()["host_tier"]["groups"][full]["cached"] == 3
    mgr.synchronize()
    rig.check_resident_kv("a")
    assert rig.add("q", 41, shared_prefix=40) == 40      # hits the blocks on the device and on the host
    rig.run({"q": 1})                                    # attention through them checked
    rig.run(generation=["q", "a", "x"])
    rig.check_rows()
    rig.check_conservation()


def test_a_row_reused_after_a_free_during_copy_back_does_not_wait_for_it():
    """A request freed while its copy back is still held (no step waited for it yet): the next request in
    its table row does not wait for that copy (its slots are other ones; the freed ones stay quarantined
    until the copy completes)."""
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=H, head_dim=D, tokens_per_block=TPB, max_seq_len=64,
                            max_batch=2, slots_per_group=16, dtype="float32")
    mgr = cupykv.KVCacheManager(spec, backend="host")
    storage = KVStorage(mgr, host_tier_bytes=1 << 16)
    be = mgr.backend
    mgr.add("A", 20)
    step = mgr.prepare_batch({"A": 20})
    step.finish()
    mgr.settle(step)
    storage.suspend("A")
    mgr.synchronize()
    gate = be.gate(storage.host_tier.stream)        # holds A's copy back
    storage.resume("A")
    row = mgr.request("A").row
    mgr.free("A")
    mgr.add("B", 20)
    assert mgr.request("B").row == row
    step = mgr.prepare_batch({"B": 20})
    step.finish()
    assert step.ready.wait() and step.is_complete()    # nothing of A's holds B's step
    assert mgr.stats()["groups"][0]["quarantined"] == 3
    gate.open()
    mgr.settle(step)
    mgr.synchronize()
    assert mgr.stats()["groups"][0]["quarantined"] == 0


def test_resumed_host_slots_return_only_after_the_copy_back(backend_name):
    """resume() hands the request's host slots back only once the copy back has completed: until then
    the copy reads them, and a suspend in between must not be given them (it would count them free)."""
    rig, want = prefilled_a_and_b(backend_name)
    mgr, be = rig.mgr, rig.be
    rig.suspend("a")
    mgr.synchronize()                       # the copy out has completed
    gate = be.gate(rig.tier.stream)         # hold the copy back
    rig.resume("a")
    assert rig.host_used() == want, "host slots came back while the copy back may still read them"
    gate.open()
    assert not gate.close_timeout_hit()
    mgr.synchronize()
    assert rig.host_used() == [0] * len(want)


def test_a_suspend_copy_in_flight_is_not_a_step_in_flight(backend_name):
    """max_steps_in_flight counts prepared steps only: a suspend whose copy to the host is still running
    (the ledger's fence for it) neither refuses nor holds back the next prepare_batch."""
    rig, _ = prefilled_a_and_b(backend_name)
    mgr, be = rig.mgr, rig.be
    mgr.max_steps_in_flight = 1
    mgr.ledger.timeout_s = 0.2              # a wait for the copy would fail this fast
    gate = be.gate(rig.tier.stream)         # the suspend's copy out is held
    rig.suspend("a")
    assert mgr.steps_in_flight == [] and mgr.stats()["steps_in_flight"] == 0
    s = mgr.prepare_batch((), ["b"])
    s.finish()
    assert mgr.request("a").suspended
    gate.open()
    assert not gate.close_timeout_hit()
    mgr.synchronize()
    assert [t.id for t in mgr.steps_in_flight] == []
    mgr.settle(s)


@pytest.mark.parametrize("unit", [1, 3, 16, 48, 1040])
def test_copy_runs_moves_exactly_the_runs(backend_name, unit):
    """backend.copy_runs (the host tier's copies; on CUDA a cupykv_copy_runs launch each way) against
    NumPy slicing, both directions (runs as a list of triples one way, an array the other): one long run
    (longer than one pass of the kernel's grid, in bytes and in 16-byte words; unaligned on the host side
    for the odd unit sizes) beside runs of adjacent units from a random pairing of the other host and
    device units (more runs than a block stages); units outside the runs keep their bytes; malformed and
    out-of-range runs (and runs that are not integers; on CUDA, a host buffer that is not pinned) raise
    before anything is enqueued; the table of runs is the backend's own copy."""
    from cupykv.backends import make_backend
    from cupykv.backends.runs import run_table
    from cupykv.allocator import slot_runs as _runs
    from cupykv.kernels import (TIER_COPY_BLOCKS_TO_DEVICE, TIER_COPY_BLOCKS_TO_HOST, TIER_COPY_RUNS_PER_STAGE,
                                TIER_COPY_THREADS)
    be = make_backend(backend_name)
    rng = np.random.default_rng(unit)
    grid = max(TIER_COPY_BLOCKS_TO_HOST, TIER_COPY_BLOCKS_TO_DEVICE) * TIER_COPY_THREADS
    long_run = -(-(grid + 1) // 16) * 16        # > a pass of either direction's grid, in bytes and in words
    units = long_run + 2 * TIER_COPY_RUNS_PER_STAGE + 100
    host = be.pinned_bytes(units * unit)
    host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
    dev_start = rng.integers(0, 256, units * unit, dtype=np.uint8)
    dev = be.upload(dev_start)
    moved = long_run + rng.choice(units - long_run, size=units - long_run - 7, replace=False)   # device -> host
    host_rest = np.concatenate([[0], np.arange(long_run + 1, units)])   # the long run takes host units 1..long_run
    to = host_rest[rng.permutation(len(host_rest))[:len(moved)]]
    keep = rng.random(len(moved)) < 0.4                                 # some units move as runs of their neighbours
    moved[keep], to[keep] = np.sort(moved[keep]), np.sort(to[keep])
    runs = [(0, 1, long_run)] + [tuple(r) for r in _runs(moved, to).tolist()]   # (device unit, host unit, n)
    moved, to = np.concatenate([np.arange(long_run), moved]), np.concatenate([np.arange(1, long_run + 1), to])
    assert len(runs) > TIER_COPY_RUNS_PER_STAGE + 1
    expected = host.copy().reshape(units, unit)
    expected[to] = dev_start.reshape(units, unit)[moved]
    be.copy_runs(host, dev, [(h, d, n) for d, h, n in runs], unit, be.stream)
    be.synchronize()
    np.testing.assert_array_equal(host.reshape(units, unit), expected)
    host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)            # and back: host units -> device units
    expected = dev_start.reshape(units, unit).copy()
    expected[moved] = host.reshape(units, unit)[to]
    be.copy_runs(dev, host, np.array(runs), unit, be.stream)
    be.synchronize()
    np.testing.assert_array_equal(be.to_numpy(dev).reshape(units, unit), expected)
    before, dev_before = host.copy(), be.to_numpy(dev)
    for bad in ([(units - 1, 0, 2)], [(0, units - 1, 2)], [(0, -1, 1)], [(0, 0, -1)], [(2 ** 61, 0, 1)]):
        with pytest.raises(ValueError, match="out of range"):
            be.copy_runs(host, dev, runs[:3] + bad, unit, be.stream)
    for bad in ([(0, 0), (1, 1), (2, 2)], np.zeros((2, 4), np.int64), np.zeros(3, np.int64),
                np.zeros((0, 4), np.int64)):
        with pytest.raises(ValueError, match="triples"):
            be.copy_runs(host, dev, bad, unit, be.stream)
    for bad in (np.array([(0.7, 0, 1.9)]), np.array([(2 ** 63, 0, 1)], np.uint64), [(0, 0, 2 ** 64)]):
        with pytest.raises(ValueError, match="integers"):
            be.copy_runs(host, dev, bad, unit, be.stream)
    pageable = np.zeros_like(host)
    if backend_name == "cuda":      # the kernel reaches host memory at its device address: pinned only
        for dst, src in ((pageable, dev), (dev, pageable)):
            with pytest.raises(ValueError, match="not pinned"):
                be.copy_runs(dst, src, runs[:3], unit, be.stream)
    be.synchronize()
    np.testing.assert_array_equal(host, before)
    np.testing.assert_array_equal(be.to_numpy(dev), dev_before)
    assert not pageable.any()
    given = np.array(runs)
    table = run_table(given, unit, host.nbytes, host.nbytes)
    assert np.array_equal(table, given) and not np.shares_memory(table, given)    # a copy: the caller's to change


@pytest.mark.parametrize("direction", ["to_host", "to_device"])
@pytest.mark.parametrize("variant", ["safe", "unsafe"])
def test_gated_cuda_copy_runs_keeps_its_runs_table(direction, variant, monkeypatch):
    """CUDA: copy_runs hands its kernel the runs in a pinned table, kept (keep_until) until an event
    after the launch. The copy's stream is held by a gate while the next pinned allocations of the
    table's size are zeroed (CuPy's pinned pool hands a dropped block to the next allocation at once);
    after the gate opens the runs must have moved. Unsafe: keep_until keeps nothing, the kernel reads a
    zeroed table (runs of no bytes) and moves nothing, which proves the test sees the race."""
    from conftest import backend_or_skip
    from cupykv.backends import make_backend
    be = make_backend(backend_or_skip("cuda"))
    import cupyx                # (after the skip: CuPy may be missing here)
    unit, units = 64, 256
    rng = np.random.default_rng(11)
    host = be.pinned_bytes(units * unit)
    host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
    dev_start = rng.integers(0, 256, units * unit, dtype=np.uint8)
    dev = be.upload(dev_start)
    runs = np.array([(0, 5, 10), (20, 100, 30), (200, 40, 7)], np.int64)       # (dst unit, src unit, n)
    dst, src = (host, dev) if direction == "to_host" else (dev, host)
    src_units = (dev_start if direction == "to_host" else host.copy()).reshape(units, unit)
    start = (host.copy() if direction == "to_host" else dev_start).reshape(units, unit)
    expected = start.copy()
    for d0, s0, n in runs.tolist():
        expected[d0:d0 + n] = src_units[s0:s0 + n]
    stream = be.new_stream("copies")
    be.copy_runs(dst, src, [(0, 0, 0)], unit, stream)          # loads the kernel before the gate
    warm = [cupyx.empty_pinned(runs.shape, np.int64) for _ in range(8)]   # free blocks in the pool, so the
    del warm                                                 # gated allocations below need no cudaHostAlloc
    stream.synchronize()
    if variant == "unsafe":
        monkeypatch.setattr(type(be), "keep_until", lambda self, event, *objs: None)
    gate = be.gate(stream)
    be.copy_runs(dst, src, runs, unit, stream)
    scratch = [cupyx.empty_pinned(runs.shape, np.int64) for _ in range(8)]
    for buf in scratch:
        buf[...] = 0
    gate.open()
    stream.synchronize()
    assert not gate.close_timeout_hit()
    got = (host if direction == "to_host" else be.to_numpy(dev)).reshape(units, unit)
    if variant == "safe":
        np.testing.assert_array_equal(got, expected)
    else:
        assert np.array_equal(got, start), "the unsafe variant's kernel read its runs: the test sees no race"


def test_adjacent_slots_move_as_one_run_each_way(backend_name, monkeypatch):
    """On a fresh tier a request's host slots are taken in ascending order, so device slots that are
    adjacent stay adjacent on the host: each group's copy is as many runs as its device slots have
    stretches of consecutive slots in block order (counted here from resident_blocks): one for the
    full-attention group of a request prefilled alone. Taking the slots in any other order would copy
    slot by slot."""
    def stretches_of(rid):
        dev = [np.asarray(s) for _, s in mgr.resident_blocks(rid)]
        return [1 + int(np.count_nonzero(np.diff(d) != 1)) if len(d) else 0 for d in dev], [len(d) for d in dev]

    rig = Rig(backend_name, slots=48)
    mgr = rig.mgr
    rig.add("a", 200)
    rig.prefill(["a"], chunk=64)
    mgr.synchronize()
    stretches, sizes = stretches_of("a")
    assert stretches[1] == 1 and sizes[1] == 25   # full attention, alone: its 25 slots in one stretch
    calls = []
    copy_runs = type(rig.be).copy_runs

    def counting(self, dst, src, runs, unit_bytes, stream):
        calls.append(len(runs))                  # the tier passes an [n, 3] array
        return copy_runs(self, dst, src, runs, unit_bytes, stream)

    monkeypatch.setattr(type(rig.be), "copy_runs", counting)
    rig.suspend("a")
    assert calls == stretches
    assert [sorted(h.tolist()) == h.tolist() for h in rig.tier.held["a"].host_slots] == [True] * 3
    mgr.synchronize()
    rig.check_host_kv("a")
    calls.clear()
    rig.resume("a")
    mgr.synchronize()
    assert calls == stretches_of("a")[0]
    rig.run(generation=["a"])
    rig.check_rows()


def test_runs_are_the_maximal_stretches_on_both_sides():
    """allocator.slot_runs against a loop over the pairs: a run goes on while both sides step by one."""
    from cupykv.allocator import slot_runs as _runs
    rng = np.random.default_rng(7)
    for _ in range(500):
        n = int(rng.integers(0, 14))
        a = np.cumsum(rng.integers(-2, 3, n)) + 40     # steps of -2..2 on both sides: descending ones too
        b = np.cumsum(rng.integers(-2, 3, n)) + 40
        expected = []
        for x, y in zip(a.tolist(), b.tolist()):
            if expected and x == expected[-1][0] + expected[-1][2] and y == expected[-1][1] + expected[-1][2]:
                expected[-1][2] += 1
            else:
                expected.append([x, y, 1])
        got = _runs(a, b)
        assert got.dtype == np.int64 and got.shape == (len(expected), 3)
        assert got.tolist() == expected
