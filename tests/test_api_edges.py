"""Edges of the public API that wiring a real model hit (each against its own oracle: the cache's
contract, the layout, the request table)."""
import numpy as np
import pytest

import cupykv
from cupykv.storage import KVStorage


def serve_one(mgr, rid, tokens):
    """add, one context step (finished), settle, free."""
    hit = mgr.add(rid, len(tokens), tokens=tokens)
    step = mgr.prepare_batch({rid: len(tokens) - hit})
    step.finish()
    mgr.settle(step)
    mgr.free(rid)
    return hit


def test_a_host_hit_counts_slots_whose_steps_finished_without_a_poll():
    """A's 4 cached blocks went to the host tier (F evicted them); B with A's prompt must hit 16 tokens
    whether or not anything polled the ledger since the last step finished: add() lifts finished
    quarantine before it counts room for the host blocks."""
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, dtype="float32", tokens_per_block=4,
                            max_seq_len=64, max_batch=2, slots_per_group=6, prefix_caching=True)
    results = []
    for reclaim_first in (False, True):
        mgr = cupykv.KVCacheManager(spec, backend="host")
        KVStorage(mgr, host_tier_bytes=1 << 20)
        a = list(range(1, 18))
        serve_one(mgr, "A", a)
        serve_one(mgr, "F", list(range(100, 121)))
        mgr.synchronize() if reclaim_first else mgr.backend.synchronize()    # the device is done either way
        results.append(mgr.add("B", 17, tokens=a))
    assert results == [16, 16]


def test_a_host_hit_keeps_its_longest_part_that_fits():
    """Room for only some host blocks: the hit is the longest prefix whose host blocks fit (not none)."""
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, dtype="float32", tokens_per_block=4,
                            max_seq_len=64, max_batch=3, slots_per_group=6, prefix_caching=True)
    mgr = cupykv.KVCacheManager(spec, backend="host")
    KVStorage(mgr, host_tier_bytes=1 << 20)
    a = list(range(1, 18))
    serve_one(mgr, "A", a)
    serve_one(mgr, "F", list(range(100, 121)))          # A's 4 blocks to the host, F's 5 cached on the device
    mgr.synchronize()
    mgr.add("G", 17, tokens=list(range(200, 217)))      # holds 4 of the 6 device slots once it runs
    step = mgr.prepare_batch({"G": 17})
    step.finish()
    mgr.settle(step)
    mgr.synchronize()
    free = mgr.stats()["groups"][0]
    room = free["free"] + free["evictable"]
    hit = mgr.add("B", 17, tokens=a)
    assert hit == min(room, 4) * 4 and hit > 0


def test_settle_takes_each_decode_entrys_input_tokens_by_that_name():
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, tokens_per_block=4, max_seq_len=64,
                            max_batch=2, slots_per_group=8, prefix_caching=True)
    mgr = cupykv.KVCacheManager(spec, backend="host")
    mgr.add("a", 3, tokens=[1, 2, 3])
    s0 = mgr.prepare_batch({"a": 3})
    s0.finish()
    mgr.settle(s0)
    s1 = mgr.prepare_batch(generation=["a"])
    s1.finish()
    with pytest.raises(cupykv.InvalidRequestError, match="not both"):
        mgr.settle(s1, input_tokens={"a": [9]}, new_tokens={"a": [9]})
    mgr.settle(s1, input_tokens={"a": [9]})       # the token fed at position 3: block 0 is [1, 2, 3, 9]
    mgr.free("a")
    assert mgr.add("b", 6, tokens=[1, 2, 3, 9, 5, 6]) == 4


def test_slots_per_group_by_window():
    spec = cupykv.CacheSpec(windows=[8, None, 8, 8], num_kv_heads=1, head_dim=4, tokens_per_block=4,
                            slots_per_group={None: 30, 8: 7})
    layout = cupykv.Layout(spec)
    assert {g.window: n for g, n in zip(layout.groups, layout.slots_per_group)} == {8: 7, None: 30}
    with pytest.raises(cupykv.InvalidSpecError, match="no layer's window"):
        cupykv.CacheSpec(windows=[8, None], num_kv_heads=1, head_dim=4, slots_per_group={16: 3, None: 3})
    with pytest.raises(cupykv.InvalidSpecError, match="no entry for the groups of windows"):
        cupykv.Layout(cupykv.CacheSpec(windows=[8, None], num_kv_heads=1, head_dim=4, slots_per_group={8: 3}))


def test_can_add_tells_whether_a_row_is_free():
    mgr = cupykv.KVCacheManager(cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, max_batch=2,
                                                 slots_per_group=8), backend="host")
    assert mgr.can_add()
    mgr.add("a", 3)
    mgr.add("b", 3)
    assert not mgr.can_add()
    with pytest.raises(cupykv.CapacityExceededError):
        mgr.add("c", 3)
    mgr.free("a")
    assert mgr.can_add()


@pytest.mark.parametrize("missing", ["num_kv_heads", "head_dim"])
def test_a_spec_without_heads_or_head_dim_is_an_invalid_spec_naming_it(missing):
    fields = dict(windows=[None], num_kv_heads=1, head_dim=4, slots_per_group=4)
    del fields[missing]
    with pytest.raises(cupykv.InvalidSpecError, match=missing):
        cupykv.CacheSpec(**fields)
