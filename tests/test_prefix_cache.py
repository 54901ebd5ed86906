"""Prefix caching (docs/design.md's "Prefix caching") against the contract: explicit expected hits, worked out by hand
in each test, and oracle.PrefixModel (the cache slot by slot) behind every call.

Every test runs through Harness: each call goes to the manager and to the model (PrefixModelled checks
add's hit, the slots a step takes, the cache events), each step's tables and write positions are
captured by a consumer on its own stream and compared with the reference (a write never reaches a slot
with another holder), and the whole state is compared with the model after every step. Parametrized
over backend_name: the host backend here, CUDA on the GPU machine.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import cupykv
from cupykv import BAD, OutOfSlotsError
from oracle import Capture, Geometry, PrefixModelled

TPB, W = 8, 32
HERE = os.path.dirname(os.path.abspath(__file__))


def toks(seed: int, n: int) -> list:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


class Harness:
    """A manager with prefix caching, its model, and a capturing consumer."""

    def __init__(self, backend_name, staging_timeout_s=10.0, **kw):
        spec = dict(windows=[W, None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB, max_seq_len=256,
                    max_batch=6, slots_per_group=64, prefix_caching=True, prefix_events=True)
        spec.update(kw)
        self.mgr = cupykv.KVCacheManager(cupykv.CacheSpec(**spec), backend=backend_name,
                                         staging_timeout_s=staging_timeout_s)
        self.tw = PrefixModelled(self.mgr)
        self.model = self.tw.model
        self.cap = Capture(self.mgr, write_positions=True)
        self.gate = None

    @property
    def tpb(self):
        return self.mgr.spec.tokens_per_block

    def add(self, rid, tokens, salt=None, checkpoints=()):
        hit = self.tw.add(rid, len(tokens), tokens=tokens, cache_salt=salt, checkpoints=checkpoints)
        assert hit % self.tpb == 0 and 0 <= hit < len(tokens), hit
        assert self.mgr.request(rid).history == self.mgr.request(rid).capacity == hit
        return hit

    def query(self, rid, tokens, salt=None):
        """The hit a request with this prompt gets now (added, then freed)."""
        hit = self.add(rid, tokens, salt)
        self.free(rid)
        return hit

    def free(self, rid):
        self.tw.free(rid)
        self.tw.check(stats=False)

    def step(self, contexts=(), generation=(), k=1, accepted=None, new_tokens=None, settle=True, model_tokens=None):
        """model_tokens: the model's mapping of new_tokens when they are given in batch order."""
        s = self.tw.prepare(contexts, generation, k)
        self.cap.consume(s)
        if self.gate is None:
            self.mgr.backend.synchronize()     # finished on both backends (no poll: the next prepare's)
        if settle:
            self.tw.settle(s, accepted, new_tokens, model_tokens)
        self.tw.check(stats=False)
        return s

    def prefill(self, rid, chunks=None):
        req = self.mgr.request(rid)
        for n in chunks or [req.prompt_len - req.capacity]:
            self.step({rid: n})

    def decode(self, rid, new_tokens=None, report=True):
        """One token per step; new_tokens: the token ids (report=False: accepted without reporting)."""
        for t in new_tokens:
            self.step((), [rid], new_tokens={rid: [t]} if report else None)

    def close_gate(self):
        self.cap.reserve(16)
        self.gate = self.mgr.backend.gate(self.mgr.backend.stream)

    def open_gate(self):
        self.gate.open()
        self.gate = None
        self.tw.synchronize()

    def slots(self, rid, group):
        """{block: slot} of the request's row in a group."""
        row = self.mgr.table[group, self.mgr.request(rid).row]
        return {int(b): int(row[b]) for b in np.flatnonzero(row != BAD)}

    def stats(self):
        return self.mgr.stats()

    def verify(self):
        """Every captured step's tables and write positions are the reference; the whole state is the
        model's, stats() included."""
        assert self.gate is None
        self.tw.synchronize()
        self.cap.stream.synchronize()
        assert self.cap.mismatches() == []
        self.cap.items.clear()
        self.tw.check(stats=True)


@pytest.fixture
def harness(backend_name, request):
    made, failed = [], request.session.testsfailed

    def make(**kw):
        h = Harness(backend_name, **kw)
        made.append(h)
        return h
    yield make
    for h in made:              # every test ends with a full check of what it built
        if h.gate is not None:
            h.open_gate()
        if request.session.testsfailed == failed:     # (not after the test failed: one report)
            h.verify()


# --------------------------------------------------------------------------------------------------
# hits
# --------------------------------------------------------------------------------------------------
SYSTEM = toks(1, 100)


@pytest.mark.parametrize("windows,scratch,retention,checkpoints,want", [
    ([None, None], True, "boundaries", [], 96),       # full attention keeps every block
    ([W, None], True, "boundaries", [100], 96),       # a checkpoint at the system prompt's end
    ([W, None], False, "boundaries", [100], 96),
    ([W, None], False, "boundaries", [], 0),          # blocks 8, 9 of the window at 96 left it unhashed
    ([W, None], False, "all", [], 96),                # ... unless every block stays cached
    ([W, None], True, "all", [], 0),                  # scratch blocks have no KV: nothing to keep
], ids=["full", "checkpoint", "checkpoint-no-scratch", "no-checkpoint", "retain-all", "retain-all-scratch"])
def test_shared_system_prompt(harness, windows, scratch, retention, checkpoints, want):
    """Requests that share a 100-token system prompt hit its 12 full blocks (96 tokens) when the window
    of position 96 is still cached: always for full attention, for a window of 32 only through a
    checkpoint (or retention 'all' without scratch): A's prompt end (120) keeps blocks [10, 15) only."""
    h = harness(windows=windows, swa_scratch_reuse=scratch, prefix_retention=retention)
    assert h.add("A", SYSTEM + toks(2, 20), checkpoints=checkpoints) == 0
    s = h.step({"A": 120}, settle=False)
    a_slots = [h.slots("A", g) for g in range(len(h.mgr.pools))]     # before the window moves on
    h.tw.settle(s)
    for i, rid in enumerate("BCD"):
        assert h.add(rid, SYSTEM + toks(10 + i, 13 + i)) == want
        for g, slots in enumerate(a_slots):        # the hit maps A's own slots, for the blocks it needs
            got = h.slots(rid, g)
            assert all(slots[b] == s for b, s in got.items()), (rid, g)
            assert sorted(got) == sorted(Geometry(h.mgr.spec).hit_needs(g, want // TPB))
        h.prefill(rid)
    if want:
        full = len(h.mgr.pools) - 1                 # the full-attention group: 4 holders of each block
        assert (h.mgr.pools[full].refs[[a_slots[full][b] for b in range(12)]] == 4).all()
    h.step((), ["A", "B", "C", "D"])


def test_second_turn_hits_prompt_and_decode_blocks(harness):
    """Turn 1: a 60-token prompt and 13 decoded tokens reported through new_tokens (history 73); turn 2
    repeats them and adds more: 72 tokens hit (9 blocks; the window at 72 is blocks [5, 9), held by A
    when it was freed), on A's very slots, decode blocks 7 and 8 included."""
    h = harness()
    prompt, gen = toks(3, 60), toks(4, 13)
    h.add("A", prompt)
    h.prefill("A")
    h.decode("A", gen)
    a = [h.slots("A", g) for g in range(2)]
    h.free("A")
    assert h.add("B", prompt + gen + toks(5, 21)) == 72
    assert h.slots("B", 1) == {b: a[1][b] for b in range(9)}
    assert h.slots("B", 0) == {b: a[0][b] for b in range(5, 9)}
    h.prefill("B")
    h.decode("B", toks(6, 3))


def test_second_turn_without_new_tokens_hits_the_prompt_only(harness):
    """Decode tokens that settle without being reported are unknown to the cache: turn 2 hits the
    prompt's 7 full blocks (56 tokens; the prompt end keeps blocks [2, 7) of the window)."""
    h = harness()
    prompt, gen = toks(3, 60), toks(4, 13)
    h.add("A", prompt)
    h.prefill("A")
    h.decode("A", gen, report=False)
    h.free("A")
    assert h.add("B", prompt + gen + toks(5, 21)) == 56


def test_decode_blocks_after_an_unreported_step_are_never_cached(harness):
    """Once one settle advances a request without its tokens, none of its later blocks can be hashed
    (the hash chain needs every token), even when later steps report theirs: a follow-up carrying the
    reported tokens without the unreported one must not hit past the prompt."""
    h = harness(windows=[None])
    prompt = toks(7, 16)
    h.add("A", prompt)
    h.prefill("A")
    h.decode("A", [1, 2, 3])                       # reported: positions 16..18
    h.step((), ["A"])                              # position 19: not reported
    h.decode("A", list(range(20, 41)))             # reported: 20..40 (three more block boundaries)
    assert h.stats()["prefix_cache"]["groups"][0]["cached_blocks"] == 2      # the prompt's only
    h.free("A")
    assert h.query("B", prompt + [1, 2, 3] + list(range(20, 41)) + [0]) == 16


def test_a_follow_up_hits_the_window_of_the_request_end(backend_name):
    """The request's end (its window when freed) is a retained boundary (docs/design.md's "Prefix caching"; the newest
    block that left the window keeps its hash until the next release, for the ends one token short of a
    block boundary). After a 40-token prompt and d reported tokens (history h = 40 + d), a follow-up
    that repeats them hits floor(h / tpb) * tpb, whatever h is. (The prompt end's window, blocks
    [0, 5), covers the short cases.)"""
    wrong = {}
    for decoded in range(0, 6 * TPB):
        h = Harness(backend_name, max_seq_len=128)
        prompt, gen = toks(8, 40), toks(9, decoded)
        h.add("A", prompt)
        h.prefill("A")
        h.decode("A", gen)
        end = 40 + decoded
        h.free("A")
        got = h.add("B", prompt + gen + toks(10, 9))
        if got != end // TPB * TPB:
            wrong[end] = got
        h.verify()
    assert wrong == {}, f"history at free -> hit of the follow-up (want floor(h / {TPB}) * {TPB}): {wrong}"


@pytest.mark.parametrize("length", [1, 7, 8, 9, 16, 17, 63, 64])
def test_hit_is_a_multiple_of_tpb_below_prompt_len(harness, length):
    """A prompt entirely cached still leaves at least one token to compute: the hit is the largest
    multiple of tpb below prompt_len, and the first step writes a block of the request's own."""
    h = harness(windows=[None])
    base = toks(11, 64)
    h.add("A", base)
    h.prefill("A")
    h.free("A")
    want = (length - 1) // TPB * TPB
    assert h.add("B", base[:length]) == want
    h.prefill("B")                                 # the write positions are checked: own slots only
    h.decode("B", [1, 2])


def test_salts_keep_requests_apart(harness):
    """Only requests with the same salt share blocks; the salt is in every block's hash."""
    h = harness(windows=[None])
    prompt = toks(12, 40)
    h.add("A", prompt, salt="tenant-a")
    h.prefill("A")
    assert h.query("B", prompt) == 0
    assert h.query("C", prompt, salt="tenant-b") == 0
    assert h.query("D", prompt, salt=b"tenant-b") == 0
    assert h.query("E", prompt, salt="tenant-a") == 32
    h.add("F", prompt)                             # no salt: its own blocks, other hashes
    h.prefill("F")
    assert h.query("G", prompt) == 32
    assert h.query("H", prompt, salt="tenant-a") == 32
    assert h.stats()["prefix_cache"]["groups"][0]["cached_blocks"] == 10      # 5 blocks each


def test_hashes_of_salted_and_unsalted_blocks_differ():
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, tokens_per_block=4, max_seq_len=64,
                            max_batch=4, slots_per_group=32, prefix_caching=True, prefix_events=True)
    got = {}
    for salt in (None, "x", b"y"):
        mgr = cupykv.KVCacheManager(spec, backend="host")
        mgr.add("A", 12, tokens=list(range(12)), cache_salt=salt)
        s = mgr.prepare_batch({"A": 12})
        s.finish()
        mgr.settle(s)
        got[salt] = [h for _, _, h in mgr.drain_cache_events()]
        assert len(set(got[salt])) == 3
    assert not set(got[None]) & set(got["x"]) and not set(got["x"]) & set(got[b"y"]) \
        and not set(got[None]) & set(got[b"y"])


# --------------------------------------------------------------------------------------------------
# retention, scratch, checkpoints
# --------------------------------------------------------------------------------------------------
def test_checkpoint_makes_a_mid_prompt_position_hitable_with_scratch(harness):
    """A 200-token prompt in one chunk with scratch on: without a checkpoint its blocks [0, 20) are
    scratch and a follow-up diverging at 90 hits nothing; a checkpoint at 90 keeps the window of 88
    plus one block ([6, 11)) out of the scratch range, so the follow-up hits 88."""
    prompt = toks(13, 200)
    for checkpoints, want, scratch in (([], 0, (0, 20)), ([90], 88, (11, 20))):
        h = harness(max_seq_len=256)
        h.add("A", prompt, checkpoints=checkpoints)
        s = h.step({"A": 200})
        assert (int(s.scratch_begs[0, 0]), int(s.scratch_ends[0, 0])) == scratch
        assert h.add("B", prompt[:90] + toks(14, 30)) == want
        if want:
            assert sorted(h.slots("B", 0)) == [7, 8, 9, 10]
        h.prefill("B")


def test_follow_up_diverging_inside_the_last_block_hits_the_boundary_before(harness):
    """Each retained window keeps one block more than its own hit needs: a follow-up that diverges
    inside the boundary's last block still hits the block boundary before it (prompt end 128: 120;
    checkpoint 64: 56)."""
    h = harness()
    prompt = toks(15, 128)
    h.add("A", prompt, checkpoints=[64])
    h.prefill("A")
    assert h.query("B", prompt[:125] + toks(16, 10)) == 120       # needs blocks [11, 15): 11 is the +1
    assert h.query("C", prompt[:62] + toks(17, 10)) == 56         # needs [3, 7): 3 is the +1
    assert h.query("D", prompt[:64] + toks(18, 10)) == 64
    assert h.query("E", prompt + toks(19, 10)) == 128


BOUNDARIES = [45, 70, 120, 150, 200]


def test_scratch_on_and_off_hit_the_same_at_every_boundary(backend_name):
    """A 200-token prompt in chunks 70, 80, 50 with checkpoints at 45 and 120, then 3 decoded tokens:
    with scratch on and off, a follow-up diverging at each chunk end, checkpoint and the prompt end hits
    floor(pos / tpb) * tpb, the same both ways."""
    prompt = toks(20, 200)
    hits = {}
    for scratch in (True, False):
        h = Harness(backend_name, swa_scratch_reuse=scratch)
        h.add("A", prompt, checkpoints=[45, 120])
        h.prefill("A", [70, 80, 50])
        h.decode("A", [1, 2, 3])
        hits[scratch] = [h.query(f"q{p}", prompt[:p] + toks(p, 10)) for p in BOUNDARIES]
        h.verify()
    assert hits[True] == hits[False] == [p // TPB * TPB for p in BOUNDARIES]


def test_blocks_from_a_hit_keep_their_hash_when_they_leave_the_window(harness):
    """B hit A's checkpoint window; when those blocks leave B's window, they stay cached (another
    request's boundary kept them), so C still hits there after A and B are gone."""
    h = harness()
    prompt = toks(21, 100)
    h.add("A", prompt, checkpoints=[48])
    h.prefill("A")
    h.free("A")
    assert h.add("B", prompt[:48] + toks(22, 100)) == 48
    h.prefill("B")                          # B's history 148: blocks [2, 6) left its window
    h.free("B")
    assert h.add("C", prompt[:50] + toks(23, 10)) == 48


def test_a_prompt_end_window_is_kept_when_another_request_named_its_blocks(harness):
    """Q and R share 6 blocks and are prefilled in one step: the shared blocks carry Q's slots (published
    first), and R's identical ones are never named. When they leave Q's window, R's prompt-end window
    (blocks 2..6 of the window group at tpb 4, window 16) keeps them: R's prompt hits 28 afterwards,
    as it does when R was prefilled alone."""
    h = harness(windows=[16, None], tokens_per_block=4, max_seq_len=128, swa_scratch_reuse=False)
    q = toks(31, 60)
    r = q[:24] + toks(32, 5)
    assert h.add("Q", q) == 0 and h.add("R", r) == 0
    h.step({"Q": 60, "R": 29})
    h.free("R")
    h.free("Q")
    h.tw.synchronize()
    assert [g["evictions"] for g in h.stats()["prefix_cache"]["groups"]] == [0, 0]
    assert h.query("S", r) == 28


def test_hit_blocks_in_a_freed_request_window_stay_cached_when_their_computer_lets_go(harness):
    """R hits 28 tokens Q computed and still holds, then is freed: its last window (blocks 4..8) and its
    prompt-end window stay hit-able (32) after Q, the last holder, moves its window past them."""
    h = harness(windows=[16, None], tokens_per_block=4, max_seq_len=128, swa_scratch_reuse=False)
    q = toks(33, 20)
    h.add("Q", q)
    h.prefill("Q")
    more = toks(34, 24)
    h.decode("Q", more[:8])                  # history 28: Q holds window blocks 3..6
    r = q + more[:8] + toks(35, 5)
    assert h.add("R", r) == 28
    h.prefill("R")
    h.free("R")
    assert h.query("S0", r) == 32
    h.decode("Q", more[8:])                  # blocks 5, 6 leave Q's window
    h.tw.synchronize()
    assert [g["evictions"] for g in h.stats()["prefix_cache"]["groups"]] == [0, 0]
    assert h.query("S", r) == 32


def test_retention_all_keeps_every_block_without_scratch(harness):
    h = harness(swa_scratch_reuse=False, prefix_retention="all")
    prompt = toks(24, 150)
    h.add("A", prompt)
    h.prefill("A", [50, 100])
    for p in (17, 40, 77, 100, 149):
        assert h.query(f"q{p}", prompt[:p] + toks(p, 5)) == p // TPB * TPB


def test_sink_blocks_are_part_of_every_hit(harness):
    """With 8 sink tokens (one block) the hit maps the sink block and the window's blocks."""
    h = harness(windows=[16, None], sink_tokens=8)
    prompt = toks(25, 90)
    h.add("A", prompt, checkpoints=[56])
    h.prefill("A")
    assert h.add("B", prompt[:60] + toks(26, 20)) == 56
    assert sorted(h.slots("B", 0)) == [0, 5, 6]        # the sink, then blocks [(57 - 16) // 8, 7)
    assert h.slots("B", 0)[0] == h.slots("A", 0)[0]
    h.prefill("B")


# --------------------------------------------------------------------------------------------------
# reference counts, eviction, quarantine
# --------------------------------------------------------------------------------------------------
def lru_harness(harness):
    """A pool of 8 slots, blocks of 4 tokens, full attention: A, B, C (2 blocks each) run and are
    freed in that order, so 6 slots are evictable (least recently released: A's) and 2 are free."""
    h = harness(windows=[None], tokens_per_block=4, slots_per_group=8, max_seq_len=64)
    prompts = {r: toks(30 + i, 8) for i, r in enumerate("ABC")}
    slots = {}
    for r, p in prompts.items():
        h.add(r, p)
        h.prefill(r)
        slots[r] = sorted(h.slots(r, 0).values())
        h.free(r)
    h.tw.synchronize()
    st = h.stats()
    assert (st["groups"][0]["evictable"], st["groups"][0]["free"]) == (6, 2)
    got = st["prefix_cache"]["groups"][0]
    assert (got["cached_blocks"], got["evictable_blocks"], got["evictions"]) == (6, 6, 0)
    return h, prompts, slots


def test_evictions_take_free_slots_first_then_the_least_recently_released(harness):
    h, prompts, slots = lru_harness(harness)
    h.mgr.drain_cache_events()
    h.add("D", toks(40, 16))
    h.prefill("D")                                      # 4 blocks: the 2 free slots, then A's
    assert sorted(h.slots("D", 0).values()) == sorted(set(range(8)) - set(slots["B"]) - set(slots["C"]))
    st = h.stats()["prefix_cache"]["groups"][0]           # B's and C's blocks, D's 4; A's 2 evicted
    assert (st["cached_blocks"], st["evictable_blocks"], st["evictions"]) == (8, 4, 2)
    assert h.query("qA", prompts["A"] + [0]) == 0       # A's blocks are gone
    assert h.query("qB", prompts["B"] + [0]) == 8
    assert h.query("qC", prompts["C"] + [0]) == 8


def test_a_hit_makes_a_slot_recently_used(harness):
    """B's blocks are hit (and released again) after C's were released: the next eviction takes C's,
    not B's, though B ran first."""
    h, prompts, slots = lru_harness(harness)
    h.add("D", toks(40, 16))
    h.prefill("D")                                      # the 2 free slots and A's
    h.tw.synchronize()
    assert h.query("qB", prompts["B"] + [0]) == 8       # B's slots: released after C's now
    h.free("D")                                         # D's 4 (cached) blocks: released last
    h.tw.synchronize()
    h.add("E", toks(41, 8))
    h.prefill("E")                                      # no free slot: the least recently released
    assert sorted(h.slots("E", 0).values()) == slots["C"]
    assert h.query("qC", prompts["C"] + [0]) == 0
    assert h.query("qB2", prompts["B"] + [0]) == 8
    assert h.query("qD", toks(40, 16) + [0]) == 16


def test_eviction_events_name_the_evicted_blocks(backend_name):
    """'removed' events carry the hashes the 'stored' events gave the evicted blocks."""
    h = Harness(backend_name, windows=[None], tokens_per_block=4, slots_per_group=4, max_seq_len=64)
    events = []
    orig = h.mgr.drain_cache_events

    def drain():
        got = orig()
        events.extend(got)
        return got
    h.mgr.drain_cache_events = drain
    h.add("A", toks(50, 8))
    h.prefill("A")
    stored_a = [x for kind, _, x in events if kind == "stored"]
    assert len(stored_a) == 2
    h.free("A")
    h.tw.synchronize()
    h.add("B", toks(51, 16))
    h.prefill("B")
    removed = [x for kind, _, x in events if kind == "removed"]
    assert sorted(removed) == sorted(stored_a)
    assert h.stats()["prefix_cache"]["groups"][0]["evictions"] == 2
    h.verify()


def test_out_of_slots_counts_evictable_slots_but_not_held_or_quarantined_ones(harness):
    h = harness(windows=[None], tokens_per_block=4, slots_per_group=8, max_seq_len=64)
    p = toks(60, 12)
    h.add("A", p)
    h.prefill("A")                     # 3 slots held
    h.add("B", toks(61, 24))
    with pytest.raises(OutOfSlotsError):
        h.step({"B": 24})              # 6 > 5 free
    h.free("A")                        # quarantined until the steps that may read them finish
    h.tw.synchronize()                 # ... now evictable
    h.step({"B": 24})                  # 5 free + 1 evicted
    assert h.stats()["prefix_cache"]["groups"][0]["evictions"] == 1


def test_hit_on_a_slot_still_in_quarantine(harness):
    """A's slots are released while the step that read them is still running (gated): B hits them out
    of quarantine; nobody else gets them while B holds them or while they are quarantined again.
    (A refused step waits for finish events first: on the GPU, behind the gate, only briefly.)"""
    h = harness(windows=[None], tokens_per_block=4, slots_per_group=8, max_seq_len=64, staging_timeout_s=0.05)
    prompt = toks(70, 8)
    h.add("A", prompt)
    h.prefill("A")
    h.close_gate()
    h.decode("A", [5])                 # gated: still running when A goes
    a = h.slots("A", 0)
    h.free("A")                        # slots 0, 1 (cached) and 2 quarantined behind the gate
    assert h.add("B", prompt + [5, 6]) == 8
    assert h.slots("B", 0) == {0: a[0], 1: a[1]}
    assert (h.mgr.pools[0].refs[[a[0], a[1]]] == 1).all()
    h.add("C", toks(71, 24))
    with pytest.raises(OutOfSlotsError):
        h.step({"C": 24})              # 6 blocks: 5 free; A's block 2 is quarantined, 0 and 1 are B's
    h.step({"C": 16})                  # 4 of the 5 free slots
    assert not set(h.slots("C", 0).values()) & set(a.values())
    h.step({"B": 2})                   # B's own block 2: the last free slot
    h.free("B")                        # 0 and 1 quarantined again, under B's step now
    h.add("E", toks(72, 4))
    with pytest.raises(OutOfSlotsError):
        h.step({"E": 4})               # held or quarantined, every slot
    assert h.add("F", prompt + [5, 7]) == 8        # a hit still works: it only reads
    h.free("F")
    h.open_gate()
    h.step({"E": 4})                   # now A's block 2 (free) or an evictable one
    st = h.stats()["groups"][0]
    assert st["quarantined"] == 0
    assert h.query("D", prompt + [5, 7]) == 8


def test_hit_on_a_quarantined_slot_released_again_before_the_next_step(harness):
    """A is freed (its slots quarantined under the last step's id), B hits them and is freed before any
    step is prepared (the same id again). Once the step finishes, each slot is one evictable slot:
    stats count it once, and a step that needs one slot more than there are is refused cleanly."""
    h = harness(windows=[None], tokens_per_block=4, slots_per_group=6, max_seq_len=64)
    prompt = toks(80, 12)
    h.add("A", prompt)
    h.step({"A": 12})
    h.free("A")
    assert h.add("B", prompt) == 8
    h.free("B")
    h.mgr.backend.synchronize()        # finished, not polled yet: the next prepare lifts it
    h.add("C", toks(81, 28))
    with pytest.raises(OutOfSlotsError):
        h.step({"C": 28})              # 7 blocks; the pool has 6
    h.tw.synchronize()
    st = h.stats()["groups"][0]
    assert (st["free"], st["quarantined"], st["evictable"], st["owned"]) == (3, 0, 3, 0), st


def test_shared_slots_count_every_holder(harness):
    """Three live requests share A's first 6 blocks: each slot has 3 holders; their own blocks one."""
    h = harness(windows=[None])
    base = toks(90, 50)
    h.add("A", base)
    h.prefill("A")
    for r in "BC":
        assert h.add(r, base[:49] + toks(ord(r), 20)) == 48
        h.prefill(r)
    refs = h.mgr.pools[0].refs
    shared = [h.slots("A", 0)[b] for b in range(6)]
    assert (refs[shared] == 3).all()
    assert all(refs[s] == 1 for r in "ABC" for b, s in h.slots(r, 0).items() if b >= 6)
    h.step((), ["A", "B", "C"])
    h.free("A")
    assert (h.mgr.pools[0].refs[shared] == 2).all()


def test_free_in_flight_keeps_what_was_settled(harness):
    """A request freed with a chunk in flight: the chunk settles for nobody (nothing of it is cached),
    the blocks its first chunk settled stay cached (its end: every block keeps its hash)."""
    h = harness()
    prompt = toks(100, 120)
    h.add("A", prompt)
    h.step({"A": 64})
    s = h.step({"A": 56}, settle=False)
    h.free("A")
    h.tw.settle(s)
    assert h.query("B", prompt + [1]) == 64
    assert h.stats()["prefix_cache"]["groups"][1]["cached_blocks"] == 8


# --------------------------------------------------------------------------------------------------
# speculative decoding
# --------------------------------------------------------------------------------------------------
def test_rejected_speculative_tokens_never_reach_the_cache(harness):
    """Three draft tokens per step, some rejected: only accepted tokens (reported through new_tokens)
    make blocks. A follow-up continuing with a rejected draft hits the prompt only; one continuing with
    the accepted tokens hits the decode block too."""
    h = harness(windows=[None], tokens_per_block=4, max_rewind=3, max_seq_len=64)
    prompt = toks(110, 8)
    h.add("A", prompt)
    h.prefill("A")
    h.step((), ["A"], k=3, accepted={"A": 1}, new_tokens={"A": [501]})          # rejects 2 drafts
    assert h.stats()["prefix_cache"]["groups"][0]["cached_blocks"] == 2
    h.step((), ["A"], k=3, accepted={"A": 3}, new_tokens={"A": [502, 503, 504]})
    h.step((), ["A"], k=3, accepted={"A": 0}, new_tokens={"A": []})             # rejects all
    h.step((), ["A"], k=3, accepted=[2], new_tokens={"A": [505, 506]})
    assert h.mgr.request("A").history == 8 + 1 + 3 + 2
    h.free("A")
    assert h.query("B", prompt + [501, 777, 778, 779, 1]) == 8
    assert h.query("C", prompt + [501, 502, 503, 504, 505, 506, 1]) == 12


@pytest.mark.parametrize("container", ["list", "int32 array", "mapping", "mapping in another order"])
def test_tokens_in_batch_order_cache_what_a_mapping_would(harness, container):
    """settle(new_tokens=) as one sequence in batch order, or as a mapping whose keys are the generation
    entries in batch order or in another (each its own path to the same entries): the model takes the same
    tokens as a mapping and checks the cache after every step. Three requests decode 3 draft tokens a step
    beside a context chunk (tpb 4: entries fill a block exactly, stop short of it, or run past its end),
    accepting 0-3; then follow-ups hit each request's decode blocks, and not past what it accepted."""
    h = harness(windows=[None], tokens_per_block=4, max_rewind=3, max_seq_len=96)
    prompts = {rid: toks(130 + i, 6) for i, rid in enumerate("ABC")}
    for rid, p in prompts.items():
        h.add(rid, p)
        h.prefill(rid)
    h.add("D", toks(140, 30))
    kept = {rid: list(p) for rid, p in prompts.items()}
    pattern = [(3, 1, 2), (2, 3, 0), (3, 3, 3), (1, 0, 2), (3, 2, 3), (0, 3, 1)]
    for i, counts in enumerate(pattern):
        new = {rid: [600 + 10 * i + j + 100 * k for j in range(n)] for k, (rid, n) in enumerate(zip("ABC", counts))}
        flat = [t for rid in "ABC" for t in new[rid]]
        given = {"list": flat, "int32 array": np.array(flat, np.int32), "mapping": new,
                 "mapping in another order": {rid: new[rid] for rid in "CAB"}}[container]
        h.step({"D": 5}, list("ABC"), k=3, accepted=[5, *counts], new_tokens=given, model_tokens=new)
        for rid in "ABC":
            kept[rid] += new[rid]
    for rid in "ABC":
        full = len(kept[rid]) // 4 * 4           # every accepted token was reported: its full blocks are cached
        h.free(rid)
        assert h.query(rid + "'", kept[rid][:full] + [1]) == full
        assert h.query(rid + "''", kept[rid][:full - 1] + [999, 1]) == full - 4


# --------------------------------------------------------------------------------------------------
# hashes
# --------------------------------------------------------------------------------------------------
HASH_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
from test_prefix_cache import workload_hashes
print(repr(workload_hashes({windows!r}, {slots!r})))
"""


def workload_hashes(windows=(32, None), slots=64):
    """The hashes a fixed workload stores, in order."""
    spec = cupykv.CacheSpec(windows=list(windows), num_kv_heads=1, head_dim=4, tokens_per_block=8,
                            max_seq_len=128, max_batch=2, slots_per_group=slots, prefix_caching=True, prefix_events=True)
    mgr = cupykv.KVCacheManager(spec, backend="host")
    mgr.add("A", 50, tokens=toks(120, 50), cache_salt="s")
    s = mgr.prepare_batch({"A": 50})
    s.finish()
    mgr.settle(s)
    s = mgr.prepare_batch((), ["A"])
    s.finish()
    mgr.settle(s, new_tokens={"A": [7]})
    return [h.hex() for kind, _, h in mgr.drain_cache_events() if kind == "stored"]


def test_block_hashes_are_stable_across_managers_and_processes():
    """Every rank and every run agree: the same workload stores the same hashes in another manager and
    in another process (another PYTHONHASHSEED); the pool size is no part of them, the layout is."""
    here = workload_hashes()
    assert len(here) == 11 and len(set(here)) == 6       # 6 blocks, 5 of them in both groups (block 0 of
    #                                                      the window group was scratch)
    assert workload_hashes() == here
    assert workload_hashes(slots=48) == here
    assert not set(workload_hashes(windows=(16, None))) & set(here)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", HASH_SCRIPT.format(here=HERE, windows=(32, None), slots=64)],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert eval(out) == here


def test_lookup_against_the_hit_rule_over_random_cache_contents():
    """PrefixCache.lookup against the contract's rule, brute force (a hit of b blocks needs, in every group,
    each block a query at position b * tpb can see: all of [0, b) for full attention; the sink blocks and
    [max(sinks, (n + 1 - window) // tpb), b) for a window), over random sets of cached blocks per group
    (seeded), with and without sinks; the slots are the cached slot of each such block."""
    rng = np.random.default_rng(7)
    for sinks in (0, TPB, 2 * TPB):
        mgr = cupykv.KVCacheManager(cupykv.CacheSpec(
            windows=[W, None, 2 * W], sink_tokens=sinks, num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
            max_seq_len=256, max_batch=2, slots_per_group=64, prefix_caching=True, prefix_events=True), backend="host")
        pc, groups = mgr.cache, mgr.layout.groups
        hashes = [bytes([i]) * 16 for i in range(24)]
        for _ in range(300):
            cached = [set(np.flatnonzero(rng.random(24) < rng.choice([0.5, 0.9, 1.0])).tolist()) for _ in groups]
            pc.by_hash = [{hashes[b]: 1000 * g.index + b for b in c} for g, c in zip(groups, cached)]
            prompt = int(rng.integers(1, 24 * TPB + 2))

            def visible(g, b):
                if g.window is None:
                    return set(range(b))
                sink_blocks = sinks // TPB
                stale_end = max(sink_blocks, (b * TPB + 1 - g.window) // TPB)
                return set(range(min(b, sink_blocks))) | set(range(stale_end, b))

            top = min(24, (prompt - 1) // TPB)
            want = max(b for b in range(top + 1) if all(visible(g, b) <= c for g, c in zip(groups, cached)))
            hit, hits = pc.lookup(hashes, prompt, with_host=False)
            assert hit == want, (sinks, prompt, cached)
            for g, (blocks, slots, on_host) in zip(groups, hits):
                assert blocks.tolist() == sorted(visible(g, hit))
                assert slots.tolist() == [1000 * g.index + x for x in blocks.tolist()] and not on_host.any()
