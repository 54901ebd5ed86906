"""Prefix caching with a host tier: cached blocks evicted from the device go to host slots and stay hits;
a hit on a host block copies it back, and the KV a later request reads through its tables is the KV the
first request wrote. The spill copy out of an evicted slot is ordered before its new owner's writes:
a gate holds the copy while the new owner's step and writes are enqueued, and a variant without that
ordering reads the new owner's KV instead."""
import numpy as np
import pytest

import cupykv
from cupykv.storage import KVStorage

TPB = 8


def kv_value(token: np.ndarray, pos: np.ndarray, layer: int, role: int) -> np.ndarray:
    """The toy model's K (role 0) or V (role 1) of tokens at positions: [n, heads=1, dim=4], exact in fp32."""
    base = (token * 7 + pos * 3 + layer * 11 + role * 5) % 251
    return (base[:, None, None] + np.arange(4)[None, None, :] / 8.0).astype(np.float32)


def make(backend_name):
    spec = cupykv.CacheSpec(windows=[16, None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB, max_seq_len=256,
                            max_batch=4, slots_per_group=[12, 12], prefix_caching=True, prefix_events=True, swa_scratch_reuse=False,
                            dtype="float32")
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    storage = KVStorage(mgr, host_tier_bytes=1 << 20)
    return mgr, storage


def prefill(mgr, storage, rid, tokens, before_prepare=None):
    n = mgr.add(rid, len(tokens), tokens=tokens)
    pos = np.arange(n, len(tokens))
    tok = np.asarray(tokens)[n:]
    xp = mgr.backend.xp       # K/V on the device before any gate closes (a host array's upload waits)
    kv = [(xp.asarray(kv_value(tok, pos, layer, 0)), xp.asarray(kv_value(tok, pos, layer, 1)))
          for layer in range(mgr.spec.num_layers)]
    mgr.backend.synchronize()
    if before_prepare is not None:
        before_prepare()
    step = mgr.prepare_batch({rid: len(tokens) - n})
    for layer, (k, v) in enumerate(kv):
        storage.write(step, layer, k, v)
    step.finish()
    mgr.settle(step)
    return n


def cached_kv_matches(mgr, storage, rid, tokens, upto: int) -> bool:
    """The KV the request's table rows map for positions [0, upto) equals the toy model's (where held)."""
    mgr.synchronize()
    row = mgr.request(rid).row
    lay = mgr.layout
    ok = True
    for g in lay.groups:
        arr = mgr.backend.to_numpy(storage.arrays[g.index])
        for b in range(upto // TPB):
            slot = int(mgr.table[g.index, row, b])
            if slot < 0:
                continue
            pos = np.arange(b * TPB, (b + 1) * TPB)
            for i, layer in enumerate(g.layers):
                for role in (0, 1):
                    ok &= np.array_equal(arr[slot, 2 * i + role], kv_value(np.asarray(tokens)[pos], pos, layer, role))
    return bool(ok)


@pytest.mark.parametrize("ordered", [True, False], ids=["spill-ordered", "unsafe-no-wait"])
def test_evicted_blocks_go_to_the_host_and_come_back(backend_name, ordered, monkeypatch):
    mgr, storage = make(backend_name)
    be = mgr.backend
    if not ordered:       # the variant without the protection: the new owner does not wait for the spill
        monkeypatch.setattr(mgr.cache, "spill_events", lambda: [])
    a = list(range(100, 140))                      # 5 full blocks
    prefill(mgr, storage, "a", a)
    mgr.free("a")
    mgr.reclaim(wait=True)
    assert mgr.stats()["prefix_cache"]["groups"][1]["evictable_blocks"] == 5
    gate = None

    def close_gate():     # hold the tier stream: the spill copies (enqueued by the prepare) queue behind it
        nonlocal gate
        gate = be.gate(storage.host_tier.stream)

    # c needs every slot of the full-attention group: a's cached blocks are evicted (to the host tier),
    # and c's step writes them while the spill copy is held
    c = list(range(500, 596))                      # 12 full blocks: every slot, 5 of them a's
    be.synchronize()
    prefill(mgr, storage, "c", c, before_prepare=close_gate)
    events = mgr.drain_cache_events()
    stats = mgr.stats()["prefix_cache"]["groups"][1]
    assert stats["evictions"] >= 5 and stats["host_blocks"] >= 5, stats
    assert not any(kind == "removed" and g == 1 for kind, g, _ in events), "spilled blocks stay cached"
    gate.open()
    mgr.free("c")
    mgr.reclaim(wait=True)
    hit = mgr.add("b", 48, tokens=a + [1] * 8)
    assert hit == 40                               # every block of a, from the host tier
    step = mgr.prepare_batch({"b": 8})
    step.finish()
    mgr.settle(step)
    assert cached_kv_matches(mgr, storage, "b", a, 40) == ordered


def test_host_hits_need_free_device_slots(backend_name):
    """A hit on host blocks needs device slots (free or evictable) to copy them into; without them, only
    device blocks count, and nothing is allocated."""
    mgr, storage = make(backend_name)
    a = list(range(100, 140))
    prefill(mgr, storage, "a", a)
    mgr.free("a")
    prefill(mgr, storage, "c", list(range(500, 596)))        # evicts a's blocks to the host tier
    assert mgr.stats()["prefix_cache"]["groups"][1]["host_blocks"] >= 5
    before = mgr.stats()["groups"][1]["free"]
    assert mgr.add("b", 48, tokens=a + [1] * 8) == 0         # c holds every full-attention slot
    assert mgr.stats()["groups"][1]["free"] == before


def check_cache_maps(mgr):
    """The cache's own invariant, against its maps: a hash names at most one block, on the device or on
    the host; each map and its inverse agree; the host tier counts the host blocks the cache names."""
    pc = mgr.cache
    for p in range(mgr.layout.num_groups):
        dev, host = pc.by_hash[p], pc.host_by_hash[p]
        assert not set(dev) & set(host), "a hash cached on the device and on the host"
        assert {h: s for s, h in pc.hash_of[p].items()} == dev
        assert {h: hs for hs, h in pc.host_hash_of[p].items()} == host
    stats = mgr.stats()
    assert ([g["host_blocks"] for g in stats["prefix_cache"]["groups"]] ==
            [g["cached"] for g in stats["host_tier"]["groups"]])


def test_a_block_computed_again_while_cached_on_the_host(backend_name):
    """A request that hits only part of a host-cached prefix (the hit stays below its prompt length)
    computes the rest again: the fresh device block takes the host copy's place (one hash, one block,
    no second "stored" event), and later evictions, hits and KV stay right (before, the hash was named on
    both, a second eviction left the host maps disagreeing, and a later allocation raised KeyError)."""
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB, max_seq_len=128,
                            max_batch=4, slots_per_group=4, prefix_caching=True, prefix_events=True, prefix_retention="all",
                            dtype="float32")
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    storage = KVStorage(mgr, host_tier_bytes=8 * (2 * TPB * 4 * 4))   # 8 host slots (K and V, 4 fp32 a token)
    a = list(range(100, 117))                              # 2 full blocks and a token
    stored = {}

    def run(rid, tokens):
        n = prefill(mgr, storage, rid, tokens)
        assert cached_kv_matches(mgr, storage, rid, tokens, len(tokens) // TPB * TPB)
        mgr.free(rid)
        mgr.reclaim(wait=True)
        for kind, g, h in mgr.drain_cache_events():      # stored and removed alternate per hash
            assert stored.get((g, h), False) != (kind == "stored"), (kind, h)
            stored[(g, h)] = kind == "stored"
        check_cache_maps(mgr)
        # the events name exactly the cached blocks, on the device or on the host
        pc = mgr.cache
        assert {h for (g, h), on in stored.items() if on} == set(pc.by_hash[0]) | set(pc.host_by_hash[0])
        # nothing is suspended: every host slot is free or holds a cached block
        assert [g["used"] for g in mgr.stats()["host_tier"]["groups"]] == [0]
        return n

    assert run("a", a) == 0
    assert run("c", list(range(500, 525))) == 0             # 4 slots: a's blocks go to the host tier
    assert mgr.stats()["prefix_cache"]["groups"][0]["host_blocks"] == 2
    assert run("d", a[:16]) == TPB                          # block 0 from the host; block 1 computed again
    for i in range(6):           # churn: d's blocks and the others evicted to the host tier, until it is full
        run(f"x{i}", list(range(200 + 40 * i, 225 + 40 * i)))
        run(f"a{i}", a)          # a hit on whatever of a's prefix is still cached, with the right KV


def snapshot_on_manager_stream(mgr, array):
    """A copy of `array` taken on the manager stream (after the work enqueued there so far, as a consumer
    reading after step.ready would); returns a function giving it as numpy once the stream has run."""
    be = mgr.backend
    if be.xp is np:
        taken = []
        be.stream.enqueue(lambda: taken.append(array.copy()))
        return lambda: (be.stream.synchronize(), taken[0])[1]
    with be.device_context(), be.stream:
        copy = array.copy()
    return lambda: be.to_numpy(copy)


@pytest.mark.parametrize("ordered", [True, False], ids=["waits-for-the-copy-back", "unsafe-no-wait"])
def test_a_device_hit_on_blocks_still_copied_back_waits_for_the_copy(backend_name, ordered, monkeypatch):
    """a2's host hit copies a's blocks back into device slots and names them there at once; b, added while
    that copy is held by a gate, hits the same slots on the device. b's step must wait for a2's copy (before,
    only a2's steps did): a read after b's step on the manager stream sees a's KV once the gate opens, and
    the variant that forgets the copy reads the slots' previous contents."""
    mgr, storage = make(backend_name)
    be = mgr.backend
    if not ordered:
        monkeypatch.setattr(mgr.cache, "still_arriving", lambda p, slots: False)
    a = list(range(100, 140))                              # 5 full blocks
    prefill(mgr, storage, "a", a)
    mgr.free("a")
    mgr.reclaim(wait=True)
    # c takes every slot by decoding (decode blocks are not cached: they come back free, so a2's copy back
    # below evicts nothing, and no spill copy orders b's step after the tier stream), writing its own KV
    prefill(mgr, storage, "c", [7])
    while mgr.request("c").capacity < 96:
        step = mgr.prepare_batch((), ["c"])
        for layer in range(mgr.spec.num_layers):
            k = mgr.backend.xp.full((1, 1, 4), -1.0, np.float32)
            storage.write(step, layer, k, k)
        step.finish()
        mgr.settle(step)
    assert mgr.stats()["prefix_cache"]["groups"][1]["host_blocks"] == 5
    mgr.free("c")
    mgr.reclaim(wait=True)
    snapshot_on_manager_stream(mgr, storage.arrays[1])()   # warm up the copy before the gate
    be.synchronize()
    gate = be.gate(storage.host_tier.stream)
    assert mgr.add("a2", 48, tokens=a + [1] * 8) == 40     # from the host tier: the copy back is held
    assert mgr.add("b", 48, tokens=a + [2] * 8) == 40      # on the device, the same slots
    slots = mgr.table[1, mgr.request("b").row, :5].copy()
    assert (slots == mgr.table[1, mgr.request("a2").row, :5]).all()
    step = mgr.prepare_batch({"b": 8})
    seen = snapshot_on_manager_stream(mgr, storage.arrays[1])
    gate.open()
    step.finish()
    mgr.settle(step)
    mgr.synchronize()
    pos = np.arange(40)
    g = mgr.layout.groups[1]
    got = seen()[slots]                                    # [5 blocks, pages, tpb, heads, dim]
    want = np.stack([kv_value(np.asarray(a)[pos], pos, layer, role) for layer in g.layers
                     for role in (0, 1)])                   # [pages, 40 positions, heads, dim]
    want = want.reshape(len(want), 5, TPB, 1, 4).swapaxes(0, 1)
    assert np.array_equal(got, want) == ordered


def test_a_host_hit_that_needs_slots_held_by_its_own_device_hits_is_refused_whole(backend_name):
    """add() with hits on both tiers: the host hits need free device slots, and the evictable slots of the
    device hits do not count as room (they become the request's own). With no room, add() falls back to
    what the device alone can give (here nothing) and changes no pool."""
    mgr, storage = make(backend_name)
    a = list(range(100, 140))                            # 5 blocks, 40 tokens
    prefill(mgr, storage, "a", a)
    mgr.free("a")
    mgr.reclaim(wait=True)
    prefill(mgr, storage, "c", list(range(500, 572)))    # 9 blocks: 2 of a's go to the host tier, 3 stay evictable
    mgr.reclaim(wait=True)
    before = mgr.stats()["groups"][1]
    assert before["free"] == 0 and before["evictable"] == 3
    assert mgr.add("b", 48, tokens=a + [1] * 8) == 0
    assert mgr.stats()["groups"][1] == before


def test_evictions_past_the_host_tiers_free_slots_copy_each_host_slot_once(backend_name):
    """One allocation evicts more cached blocks than the host tier has free slots: making way takes host
    slots this same eviction gave earlier blocks. Each host slot must be written once, with the block the
    cache names there (two copies into one host slot in one copy ran at once on CUDA and mixed two blocks'
    KV: the reported wrong prefix hit), and a later hit on it reads exactly that block's KV."""
    from kvcontent import KVChecker
    spec = cupykv.CacheSpec(windows=[None, None], num_kv_heads=2, head_dim=3, tokens_per_block=4, max_seq_len=32,
                            max_batch=2, slots_per_group=6, prefix_caching=True, dtype="float32")
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    slot_bytes = 2 * 2 * 4 * 2 * 3 * 4                  # K and V of 2 layers x tpb x heads x dim x float32
    storage = KVStorage(mgr, host_tier_bytes=slot_bytes)   # one host slot
    check = KVChecker(mgr, storage)
    copies = []
    copy_out = storage.host_tier.copy_out
    storage.host_tier.copy_out = lambda p, dev, host: copies.append(host.tolist()) or copy_out(p, dev, host)
    rng = np.random.default_rng(5)

    def run(rid, tokens, salt):
        hit = mgr.add(rid, len(tokens), tokens=tokens, cache_salt=salt)
        check.add(rid, tokens, salt, hit)
        step = mgr.prepare_batch({rid: len(tokens) - hit})
        check.consume(step, {})
        mgr.settle(step)
        mgr.synchronize()
        check.check()
        mgr.free(rid)
        check.free(rid)
        mgr.reclaim(wait=True)
        return hit

    a, b = rng.integers(0, 99, 8).tolist(), rng.integers(0, 99, 8).tolist()
    run("a", a, "sa")                                    # 2 cached blocks
    run("b", b, "sb")                                    # 2 more: 4 evictable, 2 free
    run("c", rng.integers(0, 99, 20).tolist(), "sc")     # 5 blocks: 3 evicted at once into 1 host slot
    assert copies and all(len(set(h)) == len(h) for h in copies), copies
    assert mgr.cache.host_by_hash[0], "the last evicted block stays cached in the host tier"
    # the host slot holds b's block 0 (evicted last of the three): a hit on it is copied back and read
    assert run("d", b[:4] + rng.integers(0, 99, 3).tolist(), "sb") == 4


def test_copy_runs_refuses_overlapping_destinations(backend_name):
    """copy_runs' runs run at once on CUDA: two that write one place are refused on every backend, before
    anything is copied."""
    mgr = cupykv.KVCacheManager(cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, slots_per_group=4,
                                                 tokens_per_block=4, dtype="float32"), backend=backend_name)
    be = mgr.backend
    src = be.pinned_bytes(4 * 64).reshape(4, 64)
    src[:] = np.arange(4, dtype=np.uint8)[:, None]
    xp = be.xp
    dst = xp.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match="overlapping destination"):
        be.copy_runs(dst, src, [(0, 0, 2), (1, 3, 1)], 64, be.stream)
    be.synchronize()
    assert int(dst.sum()) == 0
    be.copy_runs(dst, src, [(0, 0, 2), (2, 3, 1)], 64, be.stream)     # adjacent, not overlapping
    be.synchronize()
    got = dst if xp is np else dst.get()
    assert got[:, 0].tolist() == [0, 1, 3, 0]
