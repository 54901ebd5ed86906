"""SlotPool against a plain Python model, and the manager's quarantine of released slots."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cupykv import CacheSpec, KVCacheManager, OutOfSlotsError
from cupykv.allocator import CachingSlotPool, SlotPool, _distinct, _first_occurrences
from oracle import check_slots, check_stats, held_slots


# --------------------------------------------------------------------------------------------------
# SlotPool, by hand
# --------------------------------------------------------------------------------------------------
def test_fresh_pool_allocates_lowest_first():
    pool = SlotPool(10)
    assert pool.num_free == 10 and pool.num_quarantined == 0
    assert pool.allocate(3).tolist() == [0, 1, 2]
    assert pool.allocate(0).tolist() == []
    assert pool.allocate(2).tolist() == [3, 4]
    assert pool.num_free == 5
    assert sorted(pool.free_slots().tolist()) == [5, 6, 7, 8, 9]


def test_give_back_skips_the_quarantine_and_comes_out_lowest_first():
    """give_back (the host tier's pools): the slots are free at once, the caller's array is not kept,
    and they come out next, lowest first, before the slots that were free already."""
    pool = SlotPool(8)
    pool.allocate(5)                              # 0..4 held, 5..7 free
    back = np.array([3, 0, 4])
    pool.give_back(back)
    back[:] = 7                                   # the pool took a copy
    assert pool.num_free == 6 and pool.num_quarantined == 0
    assert pool.allocate(4).tolist() == [0, 3, 4, 5]
    assert sorted(pool.free_slots().tolist()) == [6, 7]


def test_release_goes_to_quarantine_not_free():
    pool = SlotPool(6)
    a = pool.allocate(4)
    pool.release(a[[1, 3]], tag=0)
    assert pool.num_free == 2
    assert pool.num_quarantined == 2
    assert sorted(pool.quarantined_slots().tolist()) == [1, 3]
    assert set(pool.free_slots().tolist()) == {4, 5}
    # quarantined slots are not handed out
    assert pool.allocate(2).tolist() == [4, 5]
    assert pool.num_free == 0


def test_two_holders_letting_go_at_once_quarantine_the_slot_once():
    """A CachingSlotPool slot held twice (a hit) and released by both holders in one call is quarantined
    once and comes back once."""
    pool = CachingSlotPool(4)
    a = pool.allocate(2)
    pool.acquire(a[:1])                         # slot a[0]: two holders
    assert pool.release(np.array([a[0], a[0], a[1]]), tag=3).tolist() == sorted([a[0], a[1]])
    assert pool.num_quarantined == 2 and sorted(pool.quarantined_slots().tolist()) == sorted(a.tolist())
    pool.reclaim(3)
    assert pool.num_quarantined == 0 and pool.num_free == 4
    assert sorted(pool.free_slots().tolist()) == [0, 1, 2, 3]


def test_reclaim_frees_exactly_tags_up_to_t():
    pool = SlotPool(8)
    pool.allocate(8)
    pool.release(np.array([0]), tag=1)
    pool.release(np.array([2, 1]), tag=2)
    pool.release(np.array([3]), tag=2)       # same tag as the last entry
    pool.release(np.array([4]), tag=5)
    assert pool.num_quarantined == 5
    assert pool.quarantined_through(0) == 0
    assert pool.quarantined_through(2) == 4
    assert pool.quarantined_through(4) == 4
    assert pool.quarantined_through(5) == 5
    assert pool.reclaim(0) == 0 and pool.num_free == 0
    assert pool.reclaim(1) == 1
    assert pool.free_slots().tolist() == [0]
    assert pool.reclaim(2) == 3
    assert sorted(pool.free_slots().tolist()) == [0, 1, 2, 3]
    assert pool.quarantined_slots().tolist() == [4]
    assert pool.reclaim(4) == 0
    assert pool.reclaim(5) == 1
    assert pool.num_quarantined == 0 and pool.num_free == 5


def test_one_reclaim_is_reused_lowest_first():
    pool = SlotPool(8)
    pool.allocate(8)
    pool.release(np.array([6, 1, 4]), tag=0)
    pool.reclaim(0)
    assert pool.allocate(3).tolist() == [1, 4, 6]


def test_reuse_order_is_deterministic():
    """Reclaimed slots come back on top, ascending per reclaim; two pools fed the same calls agree."""
    pools = [SlotPool(10), SlotPool(10)]
    for pool in pools:
        pool.allocate(9)                      # 0..8; free {9}
        pool.release(np.array([0]), tag=0)
        pool.reclaim(0)
        pool.release(np.array([8]), tag=1)
        pool.reclaim(1)
    got = [pool.allocate(3).tolist() for pool in pools]
    assert got[0] == got[1] == [8, 0, 9]


# --------------------------------------------------------------------------------------------------
# SlotPool against a model
# --------------------------------------------------------------------------------------------------
class PoolModel:
    def __init__(self, n):
        self.total = n
        self.free = set(range(n))
        self.owned = []          # allocated, in allocation order
        self.quarantine = []     # (tag, [slots]), tags non-decreasing

    def reclaim(self, t):
        keep, moved = [], 0
        for tag, slots in self.quarantine:
            if tag <= t:
                self.free.update(slots)
                moved += len(slots)
            else:
                keep.append((tag, slots))
        self.quarantine = keep
        return moved


ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 6)),
    st.tuples(st.just("release"), st.lists(st.integers(0, 1000), max_size=4, unique=True)),
    st.tuples(st.just("tick"), st.integers(0, 2)),
    st.tuples(st.just("reclaim"), st.integers(-1, 3)),
), max_size=60)


def _check(pool, model):
    free = pool.free_slots().tolist()
    quar = pool.quarantined_slots().tolist()
    assert len(free) == len(set(free)) == pool.num_free
    assert set(free) == model.free
    assert sorted(quar) == sorted(s for _, ss in model.quarantine for s in ss)
    assert pool.num_quarantined == len(quar)
    # conservation: every slot is in exactly one of free / quarantined / owned
    every = free + quar + model.owned
    assert sorted(every) == list(range(model.total))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 24), ops=ops)
def test_pool_matches_model(n, ops):
    pool, twin, model = SlotPool(n), SlotPool(n), PoolModel(n)
    tag = 0
    for op, arg in ops:
        if op == "alloc":
            k = min(arg, len(model.free))
            got = pool.allocate(k).tolist()
            assert twin.allocate(k).tolist() == got          # deterministic
            assert len(got) == k == len(set(got))
            assert set(got) <= model.free
            model.free -= set(got)
            model.owned += got
        elif op == "release":
            if not model.owned:
                continue
            picks = sorted({i % len(model.owned) for i in arg}, reverse=True)
            slots = [model.owned.pop(i) for i in picks]
            pool.release(np.array(slots, np.int32), tag)
            twin.release(np.array(slots, np.int32), tag)
            if slots:
                model.quarantine.append((tag, slots))
        elif op == "tick":
            tag += arg
        else:
            t = tag - 1 + arg        # around the current tag
            assert pool.reclaim(t) == model.reclaim(t)
            twin.reclaim(t)
        _check(pool, model)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.integers(0, 12), max_size=40), dtype=st.sampled_from([np.int32, np.int64]))
def test_distinct_and_first_occurrences_match_numpy_unique(values, dtype):
    """The pools' sort-based helpers against np.unique (values ascending, and the index of each value's
    first occurrence), on arrays with many repeats."""
    a = np.array(values, dtype)
    want, first = np.unique(a, return_index=True)
    got = _distinct(a)
    assert got.dtype == a.dtype and got.tolist() == want.tolist()
    assert got is not a and (len(a) == 0 or not np.shares_memory(got, a))
    assert _first_occurrences(a).tolist() == sorted(first.tolist())


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 24), ks=st.lists(st.integers(0, 5), max_size=10))
def test_allocations_without_release_are_ascending(n, ks):
    pool, nxt = SlotPool(n), 0
    for k in ks:
        k = min(k, pool.num_free)
        assert pool.allocate(k).tolist() == list(range(nxt, nxt + k))
        nxt += k


# --------------------------------------------------------------------------------------------------
# The manager's quarantine, with host-backend gates
# --------------------------------------------------------------------------------------------------
def small_mgr(**kw):
    args = dict(windows=[32, None, 32], num_kv_heads=2, head_dim=8, tokens_per_block=16, max_seq_len=256,
                max_batch=4, slots_per_group=64, max_rewind=2)
    args.update(kw)
    return KVCacheManager(CacheSpec(**args), backend="host")


def group_stat(mgr, key):
    return [g[key] for g in mgr.stats()["groups"]]


def test_free_during_unfinished_step_is_quarantined():
    mgr = small_mgr()
    be = mgr.backend
    mgr.add("A", 40)                      # ceil(40/16) = 3 blocks per group, no scratch:
    gate = be.gate(be.stream)             # stale(40 - 2) hi = (39 - 32) // 16 = 0
    s0 = mgr.prepare_batch(contexts={"A": 40})
    s0.finish()                           # recorded behind the gate: cannot complete
    mgr.settle(s0)
    assert held_slots(mgr, "A") == [[0, 1, 2], [0, 1, 2]]
    assert not s0.is_complete()

    mgr.free("A")
    assert group_stat(mgr, "quarantined") == [3, 3]
    assert group_stat(mgr, "free") == [61, 61]
    assert group_stat(mgr, "owned") == [0, 0]
    check_stats(mgr)
    mgr.reclaim()                          # step 0 still unfinished: nothing moves
    assert group_stat(mgr, "quarantined") == [3, 3]

    mgr.add("B", 40)
    s1 = mgr.prepare_batch(contexts={"B": 40})
    assert held_slots(mgr, "B") == [[3, 4, 5], [3, 4, 5]]   # not 0, 1, 2
    for p in range(2):
        assert not set(held_slots(mgr, "B")[p]) & {0, 1, 2}
        assert not {0, 1, 2} & set(mgr.pools[p].free_slots().tolist())
    assert group_stat(mgr, "quarantined") == [3, 3]
    s1.finish()
    mgr.settle(s1)
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [3, 3]

    gate.open()
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [0, 0]
    assert group_stat(mgr, "free") == [61, 61]
    check_stats(mgr)
    mgr.add("C", 40)
    s2 = mgr.prepare_batch(contexts={"C": 40})
    assert held_slots(mgr, "C") == [[0, 1, 2], [0, 1, 2]]    # A's slots are back
    s2.finish()
    mgr.settle(s2)
    mgr.synchronize()
    check_stats(mgr)


def test_a_later_step_completing_first_lifts_nothing_of_an_earlier_ones():
    """The watermark stops at the oldest in-flight step whose finish has not completed, even when a later
    step's has (its consumer finished on a stream that did not wait for the older one): slots released
    while the older step's consumer may read them stay quarantined until that consumer is done."""
    mgr = small_mgr()
    be = mgr.backend
    for rid in ("A", "B"):
        mgr.add(rid, 40)
        s = mgr.prepare_batch(contexts={rid: 40})
        s.finish()
        mgr.settle(s)
    mgr.synchronize()
    consumer = be.new_stream("consumer")
    gate = be.gate(consumer)
    s0 = mgr.prepare_batch(generation=["A", "B"])
    s0.finish(consumer)                   # held by the gate
    mgr.settle(s0)
    mgr.free("B")                         # s0's consumer may still read B's pages
    assert group_stat(mgr, "quarantined") == [3, 3]
    s1 = mgr.prepare_batch(generation=["A"])
    s1.finish(be.new_stream("other"))     # nothing holds this stream
    assert s1.on(0).finished.wait() and s1.is_complete() and not s0.is_complete()
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [3, 3]
    gate.open()
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [0, 0]
    mgr.settle(s1)
    check_stats(mgr)


def test_free_before_settle_while_step_unfinished():
    mgr = small_mgr()
    be = mgr.backend
    mgr.add("A", 32)
    gate = be.gate(be.stream)
    s0 = mgr.prepare_batch(contexts={"A": 32})
    s0.finish()
    mgr.free("A")                          # step 0 still unsettled and unfinished
    assert group_stat(mgr, "quarantined") == [2, 2]
    mgr.settle(s0)                         # A is gone: nothing more to release
    assert group_stat(mgr, "quarantined") == [2, 2]
    check_stats(mgr)
    mgr.add("B", 16)
    s1 = mgr.prepare_batch(contexts={"B": 16})
    assert held_slots(mgr, "B") == [[2], [2]]
    s1.finish()
    mgr.settle(s1)
    gate.open()
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [0, 0]
    assert group_stat(mgr, "owned") == [1, 1]
    assert sorted(mgr.pools[0].free_slots().tolist()) == [0, 1] + list(range(3, 64))


def test_free_quarantines_behind_the_last_prepared_step():
    # Step 0 (A) has finished; step 1 (B) has not. free(A) is tagged with step 1, the last step prepared
    # when the release happened, so A's slots wait for step 1 too.
    mgr = small_mgr()
    be = mgr.backend
    mgr.add("A", 16)
    mgr.add("B", 16)
    s0 = mgr.prepare_batch(contexts={"A": 16})
    s0.finish()
    mgr.settle(s0)
    mgr.synchronize()
    assert s0.is_complete()
    gate = be.gate(be.stream)
    s1 = mgr.prepare_batch(contexts={"B": 16})
    s1.finish()
    mgr.free("A")
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [1, 1]
    mgr.add("C", 16)
    mgr.settle(s1)
    s2 = mgr.prepare_batch(contexts={"C": 16})
    assert held_slots(mgr, "C") == [[2], [2]]          # not A's slot 0
    s2.finish()
    mgr.settle(s2)
    gate.open()
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [0, 0]
    check_stats(mgr)


def test_shortage_covered_by_quarantine_waits_for_the_gate():
    # 4 slots per group. A holds all 4 (prompt 64 -> 4 blocks; SWA: block 0 is scratch, stale(62) hi =
    # (63 - 32) // 16 = 1, so 3 own + 1 scratch slot). Freed while its step is held by the gate, they
    # are quarantined; a new request cannot get them until the gate opens.
    mgr = small_mgr(slots_per_group=4)
    be = mgr.backend
    mgr.add("A", 64)
    gate = be.gate(be.stream)
    s0 = mgr.prepare_batch(contexts={"A": 64})
    assert group_stat(mgr, "scratch") == [1, 0]
    assert group_stat(mgr, "free") == [0, 0]
    s0.finish()
    mgr.settle(s0)
    mgr.free("A")
    assert group_stat(mgr, "quarantined") == [4, 4]
    mgr.add("B", 16)
    before = mgr.state()
    with pytest.raises(OutOfSlotsError, match="quarantined"):
        mgr.prepare_batch(contexts={"B": 16})
    assert mgr.state() == before
    gate.open()
    s1 = mgr.prepare_batch(contexts={"B": 16})     # the quarantine is lifted on the way
    assert held_slots(mgr, "B") == [[0], [0]]
    s1.finish()
    mgr.settle(s1)
    mgr.synchronize()
    assert group_stat(mgr, "free") == [3, 3]
    check_stats(mgr)


def test_stale_swa_blocks_are_quarantined_until_the_step_finishes():
    # A: prompt 64 in one chunk, then 32 decode steps. Settling history h releases SWA blocks below
    # (h + 1 - 32) // 16. With the gate closed, those slots stay quarantined.
    mgr = small_mgr()
    be = mgr.backend
    mgr.add("A", 64)
    s = mgr.prepare_batch(contexts={"A": 64})
    s.finish()
    mgr.settle(s)
    mgr.synchronize()
    # after h=64: stale hi = 33 // 16 = 2: blocks 0 (scratch) and 1 released; own SWA blocks 2, 3
    assert group_stat(mgr, "owned") == [2, 4]
    gate = be.gate(be.stream)
    held = set()
    for _ in range(32):                     # h 64 -> 96: stale hi (97 - 32) // 16 = 4
        before = set(held_slots(mgr, "A")[0])
        s = mgr.prepare_batch(generation=["A"])
        s.finish()
        mgr.settle(s)
        held |= before - set(held_slots(mgr, "A")[0])
    assert len(held) == 2                   # blocks 2 and 3 went stale
    assert group_stat(mgr, "quarantined")[0] == 2
    assert not held & set(mgr.pools[0].free_slots().tolist())
    gate.open()
    mgr.reclaim()
    assert group_stat(mgr, "quarantined") == [0, 0]
    assert held <= set(mgr.pools[0].free_slots().tolist())
    check_stats(mgr)


def test_a_window_block_released_by_an_older_settle_stays_quarantined_for_the_later_step():
    """Overlap: step n+1 is prepared before step n settles, so n+1's tables still map the window blocks
    that settle(n) releases. Those slots must stay quarantined until n+1 finishes, not only until n does
    (the quarantine tag is the latest prepared step, not the settled one)."""
    def held(rid):
        return [set(slots.tolist()) for _, slots in mgr.resident_blocks(rid)]

    mgr = small_mgr()
    mgr.add("A", 40)
    s = mgr.prepare_batch(contexts={"A": 40})
    s.finish()
    mgr.settle(s)
    released = None
    for _ in range(64):          # decode in overlapped pairs until a settle releases a window block
        older = mgr.prepare_batch(generation=["A"])
        older.finish()
        later = mgr.prepare_batch(generation=["A"])
        before = held("A")
        mgr.settle(older)
        gone = [b - a for b, a in zip(before, held("A"))]
        if any(gone):
            released = gone
            break
        later.finish()
        mgr.settle(later)
    assert released is not None, "no window block left the window"
    mgr.synchronize()            # the older step is complete; the later one is not even finished
    for p, slots in enumerate(released):
        assert not slots & set(mgr.pools[p].free_slots().tolist()), \
            f"group {p}: slots {sorted(slots)} are free while the later step's tables still map them"
    later.finish()
    mgr.settle(later)
    mgr.synchronize()
    for p, slots in enumerate(released):
        assert slots <= set(mgr.pools[p].free_slots().tolist())
    check_stats(mgr)


def test_a_shortage_the_quarantine_cannot_cover_fails_without_waiting(monkeypatch):
    """When even the free and quarantined slots together fall short, prepare_batch raises OutOfSlotsError
    at once: waiting for finish events (up to staging_timeout_s each on a GPU) could not help."""
    mgr = small_mgr(slots_per_group=4)
    be = mgr.backend
    mgr.add("A", 64)
    gate = be.gate(be.stream)
    s0 = mgr.prepare_batch(contexts={"A": 64})
    s0.finish()
    mgr.settle(s0)
    mgr.free("A")
    assert group_stat(mgr, "quarantined") == [4, 4]
    mgr.add("B", 96)             # 6 blocks of the full group: more than free + quarantined
    waited = []
    monkeypatch.setattr(type(s0), "wait_finished", lambda self, timeout=None: waited.append(self.id) or False)
    with pytest.raises(OutOfSlotsError):
        mgr.prepare_batch(contexts={"B": 96})
    assert waited == [], "waited for finish events whose quarantine cannot cover the shortfall"
    assert group_stat(mgr, "quarantined") == [4, 4]
    gate.open()


# --------------------------------------------------------------------------------------------------
# A freed or suspended request's row: scanned up to its capacity's last block, cleared whole
# --------------------------------------------------------------------------------------------------
def settled_step(mgr, accepted=None, **batch):
    """One step of prepare_batch(**batch), finished and settled."""
    s = mgr.prepare_batch(**batch)
    s.finish()
    mgr.settle(s, accepted)


@pytest.mark.parametrize("caching", [False, True])
def test_a_freed_row_is_cleared_up_to_its_capacitys_last_block(caching):
    # Rows far shorter than max_blocks, whose capacity ends inside a block, at a block's end, after a rewind
    # and after a prefix hit: free() scans each row only up to its capacity's last block, and must still
    # clear every cell that holds a slot (a scan that stopped a block short would leave the partial block's
    # slot in a free row).
    mgr = small_mgr(max_seq_len=4096, windows=[32, None], slots_per_group=512, max_batch=6, max_rewind=6,
                    prefix_caching=caching)
    tpb = mgr.layout.tpb
    lengths = {"inside": 3 * tpb + 5, "edge": 4 * tpb, "rewound": 2 * tpb - 1, "hit": 3 * tpb + 5}
    first = {"inside": 0, "edge": 1000, "rewound": 2000, "hit": 0}      # "hit" repeats "inside"'s prompt
    for rid, n in lengths.items():
        tokens = np.arange(first[rid], first[rid] + n, dtype=np.int64)
        cached = mgr.add(rid, n, **(dict(tokens=tokens) if caching else {}))
        assert cached == (3 * tpb if caching and rid == "hit" else 0)
        settled_step(mgr, contexts={rid: n - cached})
    # "rewound" opens a block and gives it back
    settled_step(mgr, {"inside": 3, "edge": 1, "rewound": 1, "hit": 2}, generation=list(lengths), num_gen_tokens=3)
    rows = {rid: mgr.request(rid).row for rid in lengths}
    assert mgr.request("rewound").capacity == 2 * tpb
    spans = {rid: -(-mgr.request(rid).capacity // tpb) for rid in lengths}
    for rid, row in rows.items():
        held = [np.flatnonzero(mgr.table[p, row] != -1) for p in range(2)]
        assert held[1].max() == spans[rid] - 1          # the last block of its capacity holds a slot
        mgr.free(rid)
        assert (mgr.table[:, row] == -1).all(), rid
        check_slots(mgr)
    mgr.synchronize()
    check_slots(mgr)


def test_a_suspended_row_is_cleared_and_resumed_with_the_blocks_it_held():
    from cupykv.storage import KVStorage
    mgr = small_mgr(max_seq_len=4096, windows=[32, None], slots_per_group=512, dtype="float32")
    storage = KVStorage(mgr, host_tier_bytes=1 << 20)
    tpb = mgr.layout.tpb
    for rid, n in (("a", 5 * tpb + 3), ("b", 2 * tpb)):
        mgr.add(rid, n)
        settled_step(mgr, contexts={rid: n})
    row = mgr.request("a").row
    before = [mgr.table[p, row].copy() for p in range(2)]
    blocks = [b for b, _ in mgr.resident_blocks("a")]
    assert [b.tolist() for b in blocks] == [np.flatnonzero(t != -1).tolist() for t in before]
    storage.suspend("a")
    assert (mgr.table[:, row] == -1).all()
    check_slots(mgr)
    storage.resume("a")
    assert [np.flatnonzero(mgr.table[p, row] != -1).tolist() for p in range(2)] == [b.tolist() for b in blocks]
    mgr.synchronize()
    check_slots(mgr)
