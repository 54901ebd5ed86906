"""Every bad call raises its specific error, names the bad thing, leaves mgr.state() unchanged, and the
manager keeps working afterwards (docs/design.md's "Errors": check first, then mutate). Valid calls work with
any integer type: numpy integers give the same state as Python ints."""
import subprocess
import sys

import numpy as np
import pytest

import cupykv
import cupykv.backends.host

from cupykv import (BAD, CacheSpec, CapacityExceededError, CupykvError, DuplicateRequestError,
                    InvalidRequestError, InvalidSpecError, KVCacheManager, OutOfSlotsError, StepOrderError,
                    UnknownRequestError)
from conftest import backend_or_skip
from oracle import Geometry, check_slots, expected_tables

TPB, W = 16, 32
NUMPY_INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


SPEC = dict(windows=[W, None, W], num_kv_heads=2, head_dim=8, tokens_per_block=TPB, max_seq_len=256,
            max_batch=4, slots_per_group=64, max_rewind=2)


def make_mgr(**kw):
    return KVCacheManager(CacheSpec(**dict(SPEC, **kw)), backend="host")


def expect_fail(mgr, exc, needles, fn):
    before = mgr.state()
    with pytest.raises(exc) as ei:
        fn()
    assert isinstance(ei.value, CupykvError)
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert mgr.state() == before
    return ei.value


def check_invariants(mgr):
    """With every step settled: each request holds exactly the blocks the spec says, and every slot is
    owned once, free, or quarantined."""
    assert mgr.stats()["steps_unsettled"] == 0
    geo = Geometry(mgr.spec)
    for g in geo.groups:
        for rid in mgr.request_ids:
            req = mgr.request(rid)
            row = mgr.table[g.index, req.row]
            want = np.zeros(geo.max_blocks, bool)
            want[sorted(geo.blocks_with_slot(g, req.history, req.history))] = True
            assert ((row != BAD) == want).all(), (rid, g.index, req.history, row)
    check_slots(mgr)


def run_step(mgr, contexts=None, generation=(), num_gen_tokens=1, accepted=None):
    """A valid step end to end; its tables are checked against the NumPy reference."""
    step = mgr.prepare_batch(contexts=contexts or {}, generation=generation, num_gen_tokens=num_gen_tokens)
    table = mgr.table.copy()
    step.finish()
    mgr.synchronize()
    got = mgr.backend.to_numpy(mgr.out)
    assert (got[:, :step.num_seqs] == expected_tables(mgr, table, step)).all()
    mgr.settle(step, accepted)
    mgr.synchronize()
    check_invariants(mgr)
    return step


def prefilled(mgr, rid, n):
    mgr.add(rid, n)
    run_step(mgr, contexts={rid: n})


# --------------------------------------------------------------------------------------------------
# unknown ids
# --------------------------------------------------------------------------------------------------
def test_unknown_id_in_contexts():
    mgr = make_mgr()
    mgr.add("A", 20)
    expect_fail(mgr, UnknownRequestError, ["'nope'"], lambda: mgr.prepare_batch(contexts={"nope": 4}))
    # a valid entry next to the unknown one must not get slots either
    expect_fail(mgr, UnknownRequestError, ["'nope'"],
                lambda: mgr.prepare_batch(contexts={"A": 20, "nope": 4}))
    run_step(mgr, contexts={"A": 20})
    assert mgr.request("A").history == 20


def test_unknown_id_in_generation():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    expect_fail(mgr, UnknownRequestError, ["'ghost'"], lambda: mgr.prepare_batch(generation=["A", "ghost"]))
    run_step(mgr, generation=["A"])
    assert mgr.request("A").history == 21


def test_unknown_id_in_settle_map():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    step = mgr.prepare_batch(generation=["A"], num_gen_tokens=2)
    step.finish()
    expect_fail(mgr, UnknownRequestError, ["'B'"], lambda: mgr.settle(step, accepted={"A": 2, "B": 1}))
    mgr.settle(step, accepted={"A": 1})
    mgr.synchronize()
    assert mgr.request("A").history == 21 and mgr.request("A").capacity == 21
    check_invariants(mgr)
    run_step(mgr, generation=["A"])


def test_unknown_id_in_free():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    expect_fail(mgr, UnknownRequestError, ["'nope'"], lambda: mgr.free("nope"))
    expect_fail(mgr, UnknownRequestError, ["[1]"], lambda: mgr.free([1]))   # unhashable
    mgr.free("A")
    expect_fail(mgr, UnknownRequestError, ["'A'"], lambda: mgr.free("A"))   # freed twice
    mgr.add("A", 20)
    run_step(mgr, contexts={"A": 20})


# --------------------------------------------------------------------------------------------------
# duplicates
# --------------------------------------------------------------------------------------------------
def test_duplicate_add():
    mgr = make_mgr()
    mgr.add("A", 20)
    expect_fail(mgr, DuplicateRequestError, ["'A'"], lambda: mgr.add("A", 30))
    assert mgr.request("A").prompt_len == 20
    run_step(mgr, contexts={"A": 20})


def test_duplicate_in_contexts():
    mgr = make_mgr()
    mgr.add("A", 40)
    expect_fail(mgr, DuplicateRequestError, ["'A'"], lambda: mgr.prepare_batch(contexts=[("A", 8), ("A", 8)]))
    run_step(mgr, contexts=[("A", 8)])
    assert mgr.request("A").history == 8


def test_duplicate_in_contexts_and_generation():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    mgr.add("B", 40)
    expect_fail(mgr, DuplicateRequestError, ["'B'"],
                lambda: mgr.prepare_batch(contexts={"B": 8}, generation=["A", "B"]))
    expect_fail(mgr, DuplicateRequestError, ["'A'"], lambda: mgr.prepare_batch(generation=["A", "A"]))
    run_step(mgr, contexts={"B": 8}, generation=["A"])
    assert (mgr.request("A").history, mgr.request("B").history) == (21, 8)


# --------------------------------------------------------------------------------------------------
# sizes and states
# --------------------------------------------------------------------------------------------------
def test_prompt_longer_than_max_seq_len():
    mgr = make_mgr()
    expect_fail(mgr, CapacityExceededError, ["'A'", "257", "max_seq_len=256"], lambda: mgr.add("A", 257))
    expect_fail(mgr, InvalidRequestError, ["'A'", "prompt_len"], lambda: mgr.add("A", 0))
    assert "A" not in mgr
    mgr.add("A", 256)
    run_step(mgr, contexts={"A": 256})


def test_context_chunk_past_the_prompt():
    mgr = make_mgr()
    mgr.add("A", 40)
    expect_fail(mgr, InvalidRequestError, ["'A'", "41"], lambda: mgr.prepare_batch(contexts={"A": 41}))
    run_step(mgr, contexts={"A": 32})
    # 32 of 40 scheduled: 9 more is one too many
    expect_fail(mgr, InvalidRequestError, ["'A'", "9", "32 of 40"], lambda: mgr.prepare_batch(contexts={"A": 9}))
    expect_fail(mgr, InvalidRequestError, ["'A'"], lambda: mgr.prepare_batch(contexts={"A": 0}))
    run_step(mgr, contexts={"A": 8})
    assert mgr.request("A").history == 40


def test_decode_before_prompt_scheduled():
    mgr = make_mgr()
    mgr.add("A", 40)
    expect_fail(mgr, InvalidRequestError, ["'A'", "0 of 40"], lambda: mgr.prepare_batch(generation=["A"]))
    run_step(mgr, contexts={"A": 16})
    expect_fail(mgr, InvalidRequestError, ["'A'", "16 of 40"], lambda: mgr.prepare_batch(generation=["A"]))
    run_step(mgr, contexts={"A": 24})
    run_step(mgr, generation=["A"])
    assert mgr.request("A").history == 41


def test_decode_past_max_seq_len():
    mgr = make_mgr()
    prefilled(mgr, "A", 256)
    # 256 + 3 > max_seq_len 256 + max_rewind 2
    expect_fail(mgr, CapacityExceededError, ["'A'", "max_seq_len=256"],
                lambda: mgr.prepare_batch(generation=["A"], num_gen_tokens=3))
    prefilled(mgr, "B", 200)
    run_step(mgr, generation=["B"])
    assert mgr.request("B").history == 201


def test_history_never_exceeds_max_seq_len():
    mgr = make_mgr()
    prefilled(mgr, "A", 256)
    with pytest.raises(CapacityExceededError, match="max_seq_len"):
        step = mgr.prepare_batch(generation=["A"], num_gen_tokens=1)
        step.finish()
        mgr.settle(step)                    # all accepted: history would be 257


def test_decode_at_max_seq_len_without_rewind():
    mgr = make_mgr(max_rewind=0)
    prefilled(mgr, "A", 255)
    run_step(mgr, generation=["A"])         # 256 = max_seq_len: fine
    expect_fail(mgr, CapacityExceededError, ["'A'", "max_seq_len=256"],
                lambda: mgr.prepare_batch(generation=["A"]))


def test_more_requests_than_rows():
    mgr = make_mgr()
    for rid in "ABCD":
        mgr.add(rid, 16)
    expect_fail(mgr, CapacityExceededError, ["'E'", "max_batch=4"], lambda: mgr.add("E", 16))
    run_step(mgr, contexts={"A": 16, "B": 16, "C": 16, "D": 16})
    mgr.free("C")
    mgr.add("E", 16)
    assert mgr.request("E").row == 2         # C's row, the lowest free
    run_step(mgr, contexts={"E": 16})


# --------------------------------------------------------------------------------------------------
# settle
# --------------------------------------------------------------------------------------------------
def test_reject_more_than_max_rewind():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    step = mgr.prepare_batch(generation=["A"], num_gen_tokens=4)
    step.finish()
    # 4 scheduled, 1 accepted: 3 rejected > max_rewind 2
    expect_fail(mgr, CapacityExceededError, ["'A'", "3", "max_rewind=2"],
                lambda: mgr.settle(step, accepted={"A": 1}))
    expect_fail(mgr, CapacityExceededError, ["'A'", "max_rewind=2"], lambda: mgr.settle(step, accepted=[0]))
    mgr.settle(step, accepted={"A": 2})      # 2 rejected: allowed
    mgr.synchronize()
    req = mgr.request("A")
    assert (req.history, req.capacity) == (22, 22)
    check_invariants(mgr)
    run_step(mgr, generation=["A"])


def test_accepted_out_of_range():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    mgr.add("B", 40)
    step = mgr.prepare_batch(contexts={"B": 16}, generation=["A"], num_gen_tokens=2)
    step.finish()
    expect_fail(mgr, InvalidRequestError, ["'A'", "accepted=3"], lambda: mgr.settle(step, accepted={"A": 3}))
    expect_fail(mgr, InvalidRequestError, ["'A'", "accepted=-1"], lambda: mgr.settle(step, accepted={"A": -1}))
    expect_fail(mgr, InvalidRequestError, ["'A'"], lambda: mgr.settle(step, accepted={"A": 1.5}))
    expect_fail(mgr, InvalidRequestError, ["'B'", "whole"], lambda: mgr.settle(step, accepted={"B": 8}))
    expect_fail(mgr, InvalidRequestError, ["1 entries", "2"], lambda: mgr.settle(step, accepted=[2]))
    expect_fail(mgr, InvalidRequestError, ["one count per batch entry", "(1, 2)"],
                lambda: mgr.settle(step, accepted=np.array([[16, 1]])))
    expect_fail(mgr, InvalidRequestError, ["'A'", "accepted=5"], lambda: mgr.settle(step, accepted=[16, 5]))
    mgr.settle(step, accepted=[16, 1])
    mgr.synchronize()
    assert (mgr.request("A").history, mgr.request("B").history) == (21, 16)
    check_invariants(mgr)
    run_step(mgr, contexts={"B": 24}, generation=["A"])


def test_step_token_capacity_is_exact():
    """max_step_tokens new tokens fit one step; one more is refused, with nothing reserved."""
    mgr = make_mgr(max_step_tokens=np.int64(40))
    mgr.add("A", 24)
    mgr.add("B", 17)
    expect_fail(mgr, CapacityExceededError, ["41 tokens", "max_step_tokens=40"],
                lambda: mgr.prepare_batch(contexts={"A": 24, "B": 17}))
    run_step(mgr, contexts={"A": 24, "B": 16})


def test_rejecting_tokens_of_a_step_a_later_step_rescheduled():
    """Under an overlap scheduler, a step's speculative tokens can be rejected only until the request is
    scheduled again: settling the older step with a rejection then is refused, state unchanged."""
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    s1 = mgr.prepare_batch(generation=["A"], num_gen_tokens=2)
    s1.finish()
    s2 = mgr.prepare_batch(generation=["A"], num_gen_tokens=2)     # A again, before s1 settles
    expect_fail(mgr, StepOrderError, ["'A'", f"step {s1.id}", f"step {s2.id} already scheduled"],
                lambda: mgr.settle(s1, accepted={"A": 1}))
    s2.finish()
    mgr.settle(s1)
    mgr.settle(s2, accepted={"A": 1})
    mgr.synchronize()
    assert mgr.request("A").history == 23
    check_invariants(mgr)


def test_decoding_one_token_short_of_the_prompt():
    mgr = make_mgr()
    mgr.add("A", 20)
    run_step(mgr, contexts={"A": 19})
    expect_fail(mgr, InvalidRequestError, ["'A'", "whole prompt"], lambda: mgr.prepare_batch(generation=["A"]))
    run_step(mgr, contexts={"A": 1})
    run_step(mgr, generation=["A"])


def test_settle_out_of_order_and_twice():
    mgr = make_mgr()
    mgr.add("A", 20)
    mgr.add("B", 20)
    s0 = mgr.prepare_batch(contexts={"A": 20})
    s0.finish()
    s1 = mgr.prepare_batch(contexts={"B": 20})
    s1.finish()
    expect_fail(mgr, StepOrderError, ["step 0", "1"], lambda: mgr.settle(s1))
    mgr.settle(s0)
    expect_fail(mgr, StepOrderError, ["step 0", "already settled"], lambda: mgr.settle(s0))
    mgr.settle(s1)
    expect_fail(mgr, StepOrderError, ["step 1"], lambda: mgr.settle(s1))
    expect_fail(mgr, StepOrderError, ["step 0"], lambda: s0.finish())
    mgr.synchronize()
    check_invariants(mgr)
    run_step(mgr, generation=["A", "B"])


def test_step_of_another_manager():
    mgr, other = make_mgr(), make_mgr()
    other.add("A", 20)
    step = other.prepare_batch(contexts={"A": 20})
    step.finish()
    mgr.add("A", 20)
    expect_fail(mgr, StepOrderError, ["another manager"], lambda: mgr.settle(step))
    run_step(mgr, contexts={"A": 20})


def test_prepare_before_previous_step_finished():
    mgr = make_mgr()
    mgr.add("A", 20)
    mgr.add("B", 20)
    s0 = mgr.prepare_batch(contexts={"A": 20})
    expect_fail(mgr, StepOrderError, ["step 0", "finish"], lambda: mgr.prepare_batch(contexts={"B": 20}))
    s0.finish()
    mgr.settle(s0)
    run_step(mgr, contexts={"B": 20})


def test_finish_on_something_that_is_not_a_stream():
    mgr = make_mgr()
    mgr.add("A", 20)
    step = mgr.prepare_batch(contexts={"A": 20})
    for bad in ("x", 0, object()):
        expect_fail(mgr, cupykv.InvalidRequestError, ["finish(stream=", "not a stream of the host backend"],
                    lambda: step.finish(bad))
        assert not step.is_finished()
    other = make_mgr()           # its streams are drained by its own synchronize, not this manager's
    expect_fail(mgr, cupykv.InvalidRequestError, ["finish(stream=", "not a stream of the host backend"],
                lambda: step.finish(other.backend.new_stream()))
    step.finish(mgr.backend.new_stream())
    mgr.settle(step)
    run_step(mgr, generation=["A"])


def test_csr_buffers_of_another_device_are_named_so():
    from cupykv.interop import CsrBuffers, csr_views
    mgr = KVCacheManager(make_mgr().spec, backend="host", devices=[0, 1])
    mgr.add("A", 20)
    step = mgr.prepare_batch({"A": 20})
    expect_fail(mgr, cupykv.InvalidRequestError, ["device 0's", "device 1's", "rank=1"],
                lambda: csr_views(step.on(1), 0, buffers=CsrBuffers(mgr, rank=0)))
    expect_fail(mgr, cupykv.InvalidRequestError, ["another manager"],
                lambda: csr_views(step.on(1), 0, buffers=CsrBuffers(KVCacheManager(mgr.spec, backend="host"))))
    csr_views(step.on(1), 0, buffers=CsrBuffers(mgr, rank=1))
    for bad in (None, mgr.spec):
        with pytest.raises(cupykv.InvalidRequestError, match="CsrBuffers needs the KVCacheManager"):
            CsrBuffers(bad)
    with pytest.raises(StepOrderError, match="finish_on_torch: step=None is not a Step"):
        cupykv.interop.finish_on_torch(None)


def test_steps_past_max_in_flight_wait_for_the_oldest():
    """A loop that never waits on the host (prepare, finish, settle, prepare again) runs past
    max_steps_in_flight: prepare_batch waits for the oldest finish events, as for ring slots and
    quarantined slots (a GPU completes them by itself; the host backend runs its queued work when waited
    on), and never holds more steps in flight than the bound."""
    mgr = KVCacheManager(CacheSpec(**SPEC), backend="host", max_steps_in_flight=np.int32(3))
    prefilled(mgr, "A", 20)
    for _ in range(12):
        step = mgr.prepare_batch(generation=["A"])
        assert len(mgr.ledger.in_flight) <= 3
        table = mgr.table.copy()
        step.finish()
        mgr.settle(step)
    mgr.synchronize()
    assert (mgr.backend.to_numpy(mgr.out)[:, :1] == expected_tables(mgr, table, step)).all()
    check_invariants(mgr)


def test_steps_past_max_in_flight_fail_when_the_oldest_cannot_finish():
    mgr = KVCacheManager(CacheSpec(**SPEC), backend="host", max_steps_in_flight=2, staging_timeout_s=0.01)
    prefilled(mgr, "A", 20)
    gate = mgr.backend.gate(mgr.backend.stream)      # holds every finish event recorded after it
    for _ in range(2):
        step = mgr.prepare_batch(generation=["A"])
        step.finish()
        mgr.settle(step)
    expect_fail(mgr, StepOrderError, ["2 steps are in flight", "max_steps_in_flight=2", "staging_timeout_s=0.01"],
                lambda: mgr.prepare_batch(generation=["A"]))
    gate.open()
    run_step(mgr, generation=["A"])


def test_out_of_slots_counts_lifted_quarantine_once():
    """Slots whose quarantine a completed step has lifted (not yet polled) count as free in the error, not
    also as quarantined: free + quarantined never exceeds the pool."""
    spec = CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, tokens_per_block=4, max_seq_len=64, max_batch=4,
                     slots_per_group=10)
    mgr = KVCacheManager(spec, backend="host")
    mgr.add("a", 16)
    mgr.add("b", 8)
    s = mgr.prepare_batch({"a": 16, "b": 8})
    s.finish()
    mgr.settle(s)
    mgr.free("a")                   # its 4 slots quarantined behind step 0
    mgr.backend.synchronize()       # step 0 has completed; nothing has polled the ledger since
    mgr.add("c", 40)                # 10 blocks: the 8 slots b does not hold are not enough
    expect_fail(mgr, OutOfSlotsError, ["needs 10", "8 free, 0 quarantined"], lambda: mgr.prepare_batch({"c": 40}))
    mgr.free("b")
    s = mgr.prepare_batch({"c": 40})
    assert len(s.rows) == 1


def test_a_duplicate_id_is_reported_as_such_with_pad_to():
    """pad_to's lower bound is the step's entries once its ids are checked: a repeated id is a
    DuplicateRequestError, not a pad_to error; pad_to out of range still names pad_to."""
    mgr = make_mgr()
    prefilled(mgr, "A", 16)
    prefilled(mgr, "B", 16)
    expect_fail(mgr, DuplicateRequestError, ["'A' appears twice"],
                lambda: mgr.prepare_batch(generation=["A", "A"], pad_to=1))
    expect_fail(mgr, InvalidRequestError, ["pad_to=1", "[2, "], lambda: mgr.prepare_batch(generation=["A", "B"], pad_to=1))
    expect_fail(mgr, InvalidRequestError, ["pad_to=99", f"{mgr.spec.max_batch}]"],
                lambda: mgr.prepare_batch(generation=["A"], pad_to=np.int16(99)))
    expect_fail(mgr, InvalidRequestError, ["pad_to=True"], lambda: mgr.prepare_batch(generation=["A"], pad_to=True))
    assert mgr.prepare_batch(generation=["A", "B"], pad_to=np.uint8(2)).pad_to == 2


# --------------------------------------------------------------------------------------------------
# out of slots
# --------------------------------------------------------------------------------------------------
def test_out_of_slots():
    # 4 slots per group. A: prompt 64 -> blocks 0..3; SWA block 0 is scratch (stale(64 - 2) hi =
    # (63 - 32) // 16 = 1): 3 own + 1 scratch = 4 in group 0, 4 own in group 1. After settling h=64,
    # SWA stale hi = (65 - 32) // 16 = 2 frees the scratch slot and block 1's slot: group 0 has 2 free,
    # group 1 has 0.
    mgr = make_mgr(slots_per_group=4)
    prefilled(mgr, "A", 64)
    assert [g["free"] for g in mgr.stats()["groups"]] == [2, 0]
    mgr.add("B", 16)
    expect_fail(mgr, OutOfSlotsError, ["group 1", "needs 1", "0 free"], lambda: mgr.prepare_batch(contexts={"B": 16}))
    # all or nothing: A's decode (block 4, one slot per group) fits group 0 but not group 1
    expect_fail(mgr, OutOfSlotsError, ["group 1", "needs 1"], lambda: mgr.prepare_batch(generation=["A"]))
    mgr.free("A")
    mgr.synchronize()
    run_step(mgr, contexts={"B": 16})
    mgr.add("C", 48)                         # 3 blocks; 3 free in each group; no scratch (stale(46)=0)
    mgr.add("D", 16)                         # one more: 4 > 3
    expect_fail(mgr, OutOfSlotsError, ["needs 4", "3 free"], lambda: mgr.prepare_batch(contexts={"C": 48, "D": 16}))
    run_step(mgr, contexts={"C": 48})
    # settled h=48: SWA stale hi = (49 - 32) // 16 = 1 -> C's block 0 goes back to group 0
    assert [g["free"] for g in mgr.stats()["groups"]] == [1, 0]


def numpy_spec_manager():
    spec = cupykv.CacheSpec(windows=[32, None], num_kv_heads=np.int64(1), head_dim=8, tokens_per_block=16,
                            max_seq_len=np.int32(256), max_batch=4, slots_per_group=np.int64(64))
    return cupykv.KVCacheManager(spec, backend="host")


def test_one_id_as_generation_is_refused():
    mgr = numpy_spec_manager()
    mgr.add("req-1", 16)
    before = mgr.state()
    with pytest.raises(InvalidRequestError, match="list of request ids"):
        mgr.prepare_batch(generation="req-1")
    assert mgr.state() == before


def test_request_handle_of_a_freed_request_raises():
    mgr = numpy_spec_manager()
    mgr.add("req-1", 16)
    req = mgr.request("req-1")
    mgr.free("req-1")
    mgr.add("other", 20)                          # takes the same row
    with pytest.raises(UnknownRequestError, match="was freed"):
        req.prompt_len


def test_no_ring_slots_is_refused():
    with pytest.raises(cupykv.InvalidSpecError, match="ring_slots"):
        cupykv.KVCacheManager(numpy_spec_manager().spec, backend="host", ring_slots=0, max_ring_slots=0)


def test_failed_mirror_check_leaves_the_step_registered():
    spec = cupykv.CacheSpec(windows=[32, None], num_kv_heads=1, head_dim=8, tokens_per_block=16,
                            max_seq_len=256, max_batch=4, slots_per_group=64)
    mgr = cupykv.KVCacheManager(spec, backend="host", debug_verify_mirror=True)
    mgr.add("a", 10)
    gate = mgr.backend.gate(mgr.backend.stream)
    with pytest.raises(Exception, match="closed gate"):
        mgr.prepare_batch({"a": 10})              # the debug check cannot wait for a gated stream
    step = mgr.latest_step                        # ...but the step exists and can be finished and settled
    assert step is not None and step.num_seqs == 1
    gate.open()
    step.finish()
    mgr.settle(step)
    assert mgr.request("a").history == 10


# --------------------------------------------------------------------------------------------------
# integer types: numpy integers are counts like Python ints, in their value, never in their dtype
# --------------------------------------------------------------------------------------------------
def workload(mgr, I):
    """Valid calls with every count passed as I(n); yields after each call. With rejections (max_rewind
    2), a step with contexts and generation, a decode of more than tpb tokens, pad_to, and accepted as a
    mapping and in batch order."""
    steps = []

    def prepare(*a, **kw):
        steps.append(mgr.prepare_batch(*a, **kw))
        steps[-1].finish()
        return steps[-1]

    mgr.add("A", I(20))
    mgr.add("B", I(40))
    yield "add"
    prepare({"A": I(20)})
    yield "prefill A"
    mgr.settle(steps[-1])
    yield "settle prefill A"
    prepare({"B": I(16)}, ["A"], num_gen_tokens=I(1))       # contexts and generation in one step
    yield "chunk of B + decode A"
    mgr.settle(steps[-1], {"A": I(1)})
    yield "settle chunk + decode"
    prepare((), ["A"], num_gen_tokens=I(2))
    yield "decode A by 2"
    mgr.settle(steps[-1], {"A": I(1)})                     # one token rejected
    yield "settle with a rejection"
    prepare([("B", I(24))], ["A"], num_gen_tokens=I(2), pad_to=I(3))
    yield "last chunk of B + decode A, padded"
    mgr.settle(steps[-1], [I(24), I(2)])                    # accepted in batch order
    yield "settle in batch order"
    prepare((), ["A", "B"], num_gen_tokens=I(TPB + 4))      # more than a block per entry
    yield "decode of more than tpb tokens"
    mgr.settle(steps[-1], {"A": I(TPB + 2), "B": I(TPB + 4)})
    yield "settle the long decode"
    mgr.free("A")
    yield "free"
    for s in steps:
        yield s


def run_twins(ref, got, I):
    """Run the workload on `ref` with Python ints and on `got` with I; states agree after every call, and
    every step agrees with its twin."""
    for a, b in zip(workload(ref, int), workload(got, I)):
        if isinstance(a, str):
            assert got.state() == ref.state(), a
        else:
            assert b.num_tokens.dtype == a.num_tokens.dtype and b.start_positions.dtype == a.start_positions.dtype
            assert np.array_equal(b.num_tokens, a.num_tokens) and np.array_equal(b.start_positions, a.start_positions)
    ref.synchronize()
    got.synchronize()
    assert np.array_equal(got.backend.to_numpy(got.out), ref.backend.to_numpy(ref.out))
    check_invariants(got)


def zero_d(n):
    """n as a 0-d numpy integer array (what np.asarray(n) and some reductions return)."""
    return np.array(n, np.uint16)


@pytest.mark.parametrize("int_type", NUMPY_INTS + (zero_d,), ids=lambda t: t.__name__)
def test_numpy_integer_counts_give_the_same_state_as_python_ints(int_type):
    run_twins(make_mgr(), make_mgr(), int_type)


def test_numpy_uint64_decode_in_a_step_with_contexts_settles_once():
    """np.uint64(1) next to context chunks once turned num_tokens into float64, and settle raised after
    history had advanced (a retry advanced it again)."""
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    mgr.add("B", 40)
    step = run_step(mgr, contexts={"B": 16}, generation=["A"], num_gen_tokens=np.uint64(1))
    assert step.num_tokens.tolist() == [16, 1] and step.num_tokens.dtype.kind == "i"
    assert (mgr.request("A").history, mgr.request("B").history) == (21, 16)
    expect_fail(mgr, StepOrderError, ["step 1", "already settled"], lambda: mgr.settle(step))
    assert (mgr.request("A").history, mgr.request("B").history) == (21, 16)


@pytest.mark.parametrize("int_type", (int,) + NUMPY_INTS, ids=lambda t: t.__name__)
def test_numpy_num_gen_tokens_past_max_seq_len_is_refused(int_type):
    """cap + k > max_seq_len with k <= tpb; k = 12 > max_seq_len once wrapped max_seq_len - k as np.uint64
    and was accepted."""
    mgr = make_mgr(max_seq_len=10)
    prefilled(mgr, "A", 4)
    expect_fail(mgr, CupykvError, ["12", "10"], lambda: mgr.prepare_batch((), ["A"], num_gen_tokens=int_type(12)))
    expect_fail(mgr, CapacityExceededError, ["'A'", "max_seq_len=10"],
                lambda: mgr.prepare_batch((), ["A"], num_gen_tokens=int_type(7)))
    run_step(mgr, generation=["A"], num_gen_tokens=int_type(6))
    assert mgr.request("A").history == 10


@pytest.mark.parametrize("int_type", [t for t in (int,) + NUMPY_INTS if t is int or np.iinfo(t).max >= 200],
                         ids=lambda t: t.__name__)
def test_numpy_num_gen_tokens_times_batch_is_not_wrapped(int_type):
    """200 requests x num_gen_tokens 200 is a 40,000-token step (np.int16 once wrapped k * n)."""
    mgr = make_mgr(max_batch=200, max_step_tokens=1000, slots_per_group=3000)
    for r in range(200):
        mgr.add(r, 4)
    run_step(mgr, contexts={r: 4 for r in range(200)})
    expect_fail(mgr, CapacityExceededError, ["40000", "max_step_tokens=1000"],
                lambda: mgr.prepare_batch((), range(200), num_gen_tokens=int_type(200)))
    run_step(mgr, generation=range(200), num_gen_tokens=int_type(5))
    assert mgr.request(199).history == 9


@pytest.mark.parametrize("field,value", [("tokens_per_block", np.int64(16)), ("max_rewind", np.int8(2)),
                                         ("max_seq_len", np.int16(32767)), ("max_batch", np.int8(4)),
                                         ("slots_per_group", np.uint16(64)), ("num_kv_heads", np.uint8(2)),
                                         ("head_dim", np.array(8))],
                         ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_numpy_spec_fields_build_the_same_manager(field, value):
    """Spec fields as numpy integers once broke KVCacheManager() (AttributeError, OverflowError,
    'negative dimensions'); they are ints like any other."""
    spec = CacheSpec(**dict(SPEC, **{field: value}))
    assert type(getattr(spec, field)) is int and getattr(spec, field) == value
    ref = make_mgr(**{field: int(value)})
    assert spec == ref.spec
    run_twins(ref, KVCacheManager(spec, backend="host"), int)


# --------------------------------------------------------------------------------------------------
# malformed arguments: a CupykvError naming the argument and its value, never a bare TypeError
# --------------------------------------------------------------------------------------------------
BIG = 2 ** 70


def test_malformed_batch_arguments():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    mgr.add("B", 40)
    expect_fail(mgr, CupykvError, ["generation", "5"], lambda: mgr.prepare_batch(generation=5))
    expect_fail(mgr, CupykvError, ["generation", "set", "batch order"], lambda: mgr.prepare_batch(generation={"A"}))
    expect_fail(mgr, CupykvError, ["generation", "dict"], lambda: mgr.prepare_batch(generation={"A": 1}))
    expect_fail(mgr, CupykvError, ["contexts", "5"], lambda: mgr.prepare_batch(contexts=5))
    # 0-d arrays iterate as nothing or not at all; a set of pairs has no batch order
    expect_fail(mgr, CupykvError, ["generation", "array(0)"], lambda: mgr.prepare_batch(generation=np.array(0)))
    expect_fail(mgr, CupykvError, ["generation", "array(5)"], lambda: mgr.prepare_batch(generation=np.array(5)))
    expect_fail(mgr, CupykvError, ["contexts", "array(0)"], lambda: mgr.prepare_batch(contexts=np.array(0)))
    expect_fail(mgr, CupykvError, ["contexts"], lambda: mgr.prepare_batch(contexts={("B", 16)}))
    expect_fail(mgr, CupykvError, ["context", "7"], lambda: mgr.prepare_batch(contexts=[7]))
    expect_fail(mgr, CupykvError, ["'B'", str(BIG)], lambda: mgr.prepare_batch(contexts={"B": BIG}))
    expect_fail(mgr, CupykvError, ["'B'", str(BIG)], lambda: mgr.prepare_batch(contexts=[("B", BIG)]))
    expect_fail(mgr, CupykvError, ["'B'", "1.5"], lambda: mgr.prepare_batch(contexts={"B": 1.5}))
    expect_fail(mgr, CupykvError, ["'B'", "True"], lambda: mgr.prepare_batch(contexts={"B": True}))
    expect_fail(mgr, CupykvError, [str(BIG)], lambda: mgr.prepare_batch(generation=["A"], num_gen_tokens=BIG))
    expect_fail(mgr, CupykvError, ["num_gen_tokens", "True"],
                lambda: mgr.prepare_batch(generation=["A"], num_gen_tokens=True))
    run_step(mgr, contexts={"B": 16}, generation=["A"])


class _OldStyleSequence:
    """A sequence with only __getitem__ and __len__ (iter() takes it, through the sequence protocol)."""

    def __init__(self, items):
        self.items = list(items)

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def test_an_old_style_sequence_is_a_spec_sequence_and_a_batch_order():
    spec = CacheSpec(**dict(SPEC, windows=_OldStyleSequence(SPEC["windows"]), slots_per_group=_OldStyleSequence([64] * 2)))
    assert spec.windows == tuple(SPEC["windows"]) and spec.slots_per_group == (64, 64)
    mgr = KVCacheManager(spec, backend="host")
    mgr.add("A", 16)
    assert mgr.prepare_batch(_OldStyleSequence([("A", 16)]), _OldStyleSequence([])).request_ids == ["A"]


def test_dict_views_are_batch_orders():
    """A dict's keys() and items() keep its order: they are accepted where a list is (and a set is not)."""
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    mgr.add("B", 40)
    step = mgr.prepare_batch(contexts={"B": 16}.items(), generation={"A": None}.keys())
    assert step.request_ids == ["B", "A"]
    step.finish()
    mgr.settle(step, {"B": 16, "A": 1}.values())
    assert (mgr.request("A").history, mgr.request("B").history) == (21, 16)


def test_malformed_settle_arguments():
    mgr = make_mgr()
    prefilled(mgr, "A", 20)
    step = mgr.prepare_batch(generation=["A"], num_gen_tokens=2)
    step.finish()
    expect_fail(mgr, CupykvError, ["accepted", "5"], lambda: mgr.settle(step, 5))
    expect_fail(mgr, CupykvError, ["accepted", "batch order"], lambda: mgr.settle(step, {1}))
    expect_fail(mgr, CupykvError, ["'A'", "accepted", str(BIG)], lambda: mgr.settle(step, {"A": BIG}))
    expect_fail(mgr, CupykvError, ["accepted"], lambda: mgr.settle(step, [BIG]))
    expect_fail(mgr, CupykvError, ["'A'", "accepted", "True"], lambda: mgr.settle(step, {"A": True}))
    mgr.settle(step, {"A": np.uint64(1)})
    mgr.synchronize()
    assert (mgr.request("A").history, mgr.request("A").capacity) == (21, 21)
    check_invariants(mgr)
    run_step(mgr, generation=["A"])


@pytest.mark.parametrize("field,value", [("windows", {W: 0, None: 1}), ("sink_tokens", {0: 0, 1: 0, 2: 0}),
                                         ("slots_per_group", {64, 32}), ("windows", np.array(W))])
def test_a_mapping_or_set_is_not_a_spec_sequence(field, value):
    """A dict would give its keys, a set its own order: neither is one entry per layer or group."""
    with pytest.raises(InvalidSpecError, match=field):
        CacheSpec(**dict(SPEC, **{field: value}))


@pytest.mark.parametrize("devices", [np.array(0), {0: "a", 1: "b"}, {0, 1}])
def test_devices_must_be_a_list(devices):
    with pytest.raises(InvalidSpecError, match="devices"):
        KVCacheManager(make_mgr().spec, backend="host", devices=devices)


@pytest.mark.parametrize("rank", [2, -1, "0", 1.0, None, True])
def test_a_rank_the_manager_does_not_have(rank):
    mgr = KVCacheManager(make_mgr().spec, backend="host", devices=[0, 1])
    mgr.add("A", 4)
    step = mgr.prepare_batch({"A": 4})
    with pytest.raises(cupykv.UnknownDeviceError, match="2 device") as ei:
        step.on(rank)
    assert isinstance(ei.value, IndexError)


@pytest.mark.parametrize("option,value", [("staging", np.array(["snapshot"])), ("staging", None),
                                          ("max_steps_in_flight", 0), ("max_steps_in_flight", -3),
                                          ("max_steps_in_flight", 1.5), ("max_steps_in_flight", True),
                                          ("staging_timeout_s", -1), ("staging_timeout_s", "10"),
                                          ("use_graphs", "no"), ("use_graphs", 1), ("debug_verify_mirror", "no"),
                                          ("steady_batch_delta", "no"), ("backend", None), ("backend", 5)])
def test_bad_manager_option(option, value):
    """Options that were accepted and then broke the manager (max_steps_in_flight=0: every prepare failed)."""
    spec = make_mgr().spec
    with pytest.raises(InvalidSpecError) as ei:
        KVCacheManager(spec, **{"backend": "host", option: value})
    assert option in str(ei.value) and repr(value) in str(ei.value), str(ei.value)


def test_use_graphs_takes_only_a_bool():
    """The setter too: a truthy string such as "no" must not switch graphs on."""
    mgr = make_mgr()
    with pytest.raises(InvalidRequestError, match="use_graphs='no'"):
        mgr.use_graphs = "no"
    assert mgr.use_graphs is False
    mgr.use_graphs = np.bool_(True)
    assert mgr.use_graphs is True


@pytest.mark.parametrize("kw,needles", [
    (dict(windows=[2 ** 31, None]), ["windows", "layer 0", str(2 ** 31)]),      # stale_end overflowed in settle
    (dict(windows=[2 ** 64, None]), ["windows", str(2 ** 64)]),
    (dict(tokens_per_block=2 ** 64), ["tokens_per_block", str(2 ** 64)]),        # new_blocks overflowed
    (dict(tokens_per_block=2 ** 31), ["tokens_per_block"]),
    (dict(max_seq_len=2 ** 31), ["max_seq_len"]),
    (dict(slots_per_group=[8, 2 ** 31]), ["slots_per_group", "group 1"]),
    (dict(sink_tokens=2 ** 40), ["sink_tokens"]),
    (dict(max_batch=2 ** 16, max_rewind=2 ** 15), ["max_rewind", "max_batch=65536", "max_step_tokens"]),
])
def test_spec_counts_past_int32_are_refused(kw, needles):
    """The kernels and the snapshot hold these as int32: a larger value must be refused when the spec is
    made, not overflow in a later settle after part of it was applied."""
    with pytest.raises(InvalidSpecError) as ei:
        CacheSpec(**dict(SPEC, **kw))
    for needle in needles:
        assert needle in str(ei.value), (needle, str(ei.value))


def test_buffers_that_do_not_fit_raise_a_spec_error(monkeypatch):
    """A spec whose buffers the machine cannot hold raises SpecTooLargeError (a MemoryError too) naming the
    fields that size them, not numpy's bare MemoryError (the allocation failure is injected: a real one
    would take this machine's memory)."""
    def no_memory(self, words):
        raise MemoryError(f"Unable to allocate {words * 4} bytes")
    monkeypatch.setattr(cupykv.backends.host.HostBackend, "pinned_empty", no_memory)
    with pytest.raises(cupykv.SpecTooLargeError) as ei:
        KVCacheManager(CacheSpec(**SPEC), backend="host")
    assert isinstance(ei.value, MemoryError) and isinstance(ei.value, InvalidSpecError)
    for needle in ("Unable to allocate", "max_batch=4", "max_seq_len=256", "max_rewind=2", "max_step_tokens="):
        assert needle in str(ei.value), (needle, str(ei.value))


def test_host_buffers_past_the_machines_memory_raise_a_spec_error(monkeypatch):
    """numpy hands out each large zeroed buffer without touching it, so buffers that together outgrow the
    machine were all granted, and filling them got the process killed. The host backend counts them against
    the memory the machine had when the manager was made: here a machine with room for the page table and
    the mirror but not the outputs (a real one would take this machine's memory)."""
    spec = CacheSpec(**SPEC)
    probe = KVCacheManager(spec, backend="host")
    table_bytes = probe.page_table.array.nbytes
    monkeypatch.setattr(cupykv.backends.host, "available_memory_bytes", lambda: 2 * table_bytes + 4096)
    with pytest.raises(cupykv.SpecTooLargeError) as ei:
        KVCacheManager(spec, backend="host")
    assert "this machine has" in str(ei.value) and "max_seq_len=256" in str(ei.value), str(ei.value)
    monkeypatch.setattr(cupykv.backends.host, "available_memory_bytes", lambda: 64 * probe.backend.device.allocated)
    mgr = KVCacheManager(spec, backend="host")         # fits: the same steps as a manager made without the count
    for m in (probe, mgr):
        m.add("A", 20)
        step = m.prepare_batch({"A": 20})
        step.finish()
        m.settle(step)
    assert mgr.state() == probe.state()



def test_kv_storage_past_the_machines_memory_raises_a_spec_error():
    """KVStorage's arrays are counted as the manager's buffers are: past the machine's memory they raise
    SpecTooLargeError naming the fields that size them, and nothing stays counted, so a storage that fits
    is made afterwards (numpy granted every array before, untouched, and filling them got the process
    killed)."""
    from cupykv.storage import KVStorage
    mgr = make_mgr(dtype="float32")
    dev = mgr.backend.device
    kv_bytes = sum(a.nbytes for a in KVStorage(mgr).arrays)      # dropped at once: its count goes with it
    before, counted = mgr.state(), dev.allocated
    dev.memory_bytes = counted + kv_bytes * 3 // 4                # room for float16 arrays, not float32
    ei = expect_fail(mgr, cupykv.SpecTooLargeError, ["KVStorage", "num_kv_heads=2", "head_dim=8", "float32",
                                                    "this machine has"], lambda: KVStorage(mgr))
    assert isinstance(ei, MemoryError)
    del ei
    assert dev.allocated == counted
    storage = KVStorage(mgr, dtype="float16")
    assert dev.allocated >= counted + sum(a.nbytes for a in storage.arrays)
    mgr.add("A", 20)
    run_step(mgr, {"A": 20})
    assert mgr.request("A").history == 20
    del storage
    assert dev.allocated == counted


def test_a_host_tier_that_does_not_fit_leaves_nothing_counted():
    """The host tier pins one pool per group; when a later group's pool is refused, the pools already pinned
    go back with the error, so a tier that fits is accepted afterwards (the earlier pools stayed counted)."""
    import gc
    from cupykv.storage import KVStorage
    mgr = make_mgr(dtype="float16")
    dev = mgr.backend.device
    before, counted = mgr.state(), dev.allocated
    dev.memory_bytes = counted + (3 << 24)
    with pytest.raises(InvalidSpecError, match="host_tier_bytes=67108864: cannot allocate"):
        KVStorage(mgr, host_tier_bytes=1 << 26)
    gc.collect()        # (no cycle holds them; this only makes the point independent of the interpreter)
    assert dev.allocated == counted and mgr.host_tier is None and mgr.state() == before
    storage = KVStorage(mgr, host_tier_bytes=int(0.7 * (1 << 26)))
    assert mgr.host_tier is storage.host_tier


_TOO_LARGE_ON_THE_GPU = """
import pytest
import cupykv
import cupykv.backends.host
from cupykv import CacheSpec, KVCacheManager
from cupykv.backends.cuda import CudaBackend
spec = CacheSpec(windows=[None] * 128, num_kv_heads=1, head_dim=8, tokens_per_block=32, max_batch=2 ** 16,
                 max_seq_len=2 ** 15, slots_per_group=64, table_mode="shared", max_step_tokens=2 ** 31 - 1)
with pytest.raises(cupykv.SpecTooLargeError) as ei:
    KVCacheManager(spec, backend="cuda")
assert isinstance(ei.value, MemoryError) and "max_step_tokens=2147483647" in str(ei.value), str(ei.value)
with pytest.raises(MemoryError, match="cannot pin"):
    CudaBackend().pinned_empty(2 ** 42)
mgr = KVCacheManager(CacheSpec(**SPEC), backend="cuda")
mgr.add("A", 20)
step = mgr.prepare_batch({"A": 20})
step.finish()
mgr.settle(step)
assert mgr.request("A").history == 20
print("ok")
"""


def test_cuda_buffers_past_the_gpu_raise_a_spec_error():
    """On the GPU: write positions of 128 layers x (2^31 - 1) tokens (1 TiB) do not fit an H200; the
    manager raises SpecTooLargeError, and a manager of the usual size runs after it. Pinning more host
    memory than there is raises a MemoryError too (CUDA reports it as a runtime error). In a process of its
    own: CuPy empties its memory pools when an allocation fails, after which the gated tests of
    test_devices.py have timed out on their gates in the same process."""
    backend_or_skip("cuda")
    done = subprocess.run([sys.executable, "-c", f"SPEC = {SPEC!r}\n" + _TOO_LARGE_ON_THE_GPU],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_page_indices_past_int32_are_refused():
    """slots x pages a slot must fit int32 page indices (the null slot's page wrapped negative before)."""
    layers = 64                           # one full-attention group: 128 pages a slot
    limit = 2 ** 31 // (2 * layers)
    spec = dict(SPEC, windows=[None] * layers, max_batch=1, max_seq_len=64, max_rewind=0, null_slot=True)
    with pytest.raises(InvalidSpecError, match=f"at most {limit} slots"):
        cupykv.Layout(CacheSpec(**dict(spec, slots_per_group=limit + 1)))
    assert cupykv.Layout(CacheSpec(**dict(spec, slots_per_group=limit))).null_slots == (limit - 1,)
    with pytest.raises(InvalidSpecError, match="memory_bytes=.*split between the groups.*int32 page indices"):
        cupykv.Layout(CacheSpec(**dict(spec, slots_per_group=None, memory_bytes=2 ** 80)))


@pytest.mark.parametrize("int_type", NUMPY_INTS, ids=lambda t: t.__name__)
def test_layout_rules_take_numpy_counts(int_type):
    """The Layout's forwarding helpers give for numpy counts what they give for Python ints (unsigned
    ones overflowed in the window arithmetic)."""
    lay = make_mgr(swa_scratch_reuse=True).layout
    for g in lay.groups:
        for n in (0, 5, 40, 100):
            assert lay.stale_range(g, int_type(n)) == lay.stale_range(g, n)
            assert lay.scratch_range(g, int_type(n // 2), int_type(n)) == lay.scratch_range(g, n // 2, n)
            assert lay.scratch_slots_needed(g, int_type(n)) == lay.scratch_slots_needed(g, n)


def test_bad_layout_argument():
    with pytest.raises(InvalidSpecError, match="CacheSpec"):
        cupykv.Layout(None)


def test_settle_takes_the_step_not_a_device_view():
    mgr = make_mgr()
    mgr.add("A", 20)
    step = mgr.prepare_batch({"A": 20})
    step.finish()
    expect_fail(mgr, StepOrderError, ["settle takes the Step", "step.on(0)"], lambda: mgr.settle(step.on(0)))
    mgr.settle(step)


@pytest.mark.parametrize("timeout", ["x", -1, True, float("nan"), [1]], ids=repr)
def test_wait_finished_takes_seconds_or_none(timeout):
    mgr = make_mgr()
    mgr.add("A", 20)
    step = mgr.prepare_batch({"A": 20})
    step.finish()
    with pytest.raises(InvalidRequestError, match="timeout"):
        step.wait_finished(timeout)
    assert step.wait_finished(np.float32(5)) is True and step.wait_finished(None) is True


@pytest.mark.parametrize("wait", ["no", 1, None, np.array(True)], ids=repr)
def test_reclaim_takes_only_a_bool(wait):
    """A truthy string such as "no" must not make reclaim wait for every finish event."""
    mgr = make_mgr()
    mgr.add("A", 20)
    mgr.prepare_batch({"A": 20})
    expect_fail(mgr, InvalidRequestError, ["reclaim: wait", repr(wait)], lambda: mgr.reclaim(wait))


def test_a_step_finished_on_some_devices_names_the_rest():
    mgr = KVCacheManager(make_mgr().spec, backend="host", devices=[0, 1, 2])
    mgr.add("A", 20)
    step = mgr.prepare_batch({"A": 20})
    step.on(1).finish()
    with pytest.raises(StepOrderError, match=r"finished on device\(s\) \[1\].*unfinished: \[0, 2\]"):
        step.finish()
    step.on(0).finish()
    step.on(2).finish()
    with pytest.raises(StepOrderError, match="step 0 was already finished$"):
        step.finish()
    mgr.settle(step)


def test_numpy_ranks_and_device_ids_work():
    """Ranks and device ids are counts: numpy integers and 0-d integer arrays work as ints do."""
    spec = make_mgr().spec
    mgr = KVCacheManager(spec, backend="host", devices=[np.array(0), np.int64(1)])
    assert mgr.devices == [0, 1]
    mgr.add("A", 20)
    step = mgr.prepare_batch({"A": 20})
    assert step.on(np.array(1)) == step.on(1) and step.on(np.uint8(0)) == step.on(0)
    step.finish()
    mgr.settle(step)


def test_wait_finished_of_a_step_never_finished_is_false():
    """Nothing will complete for a device whose finish was never recorded."""
    mgr = make_mgr()
    mgr.add("A", 20)
    step = mgr.prepare_batch({"A": 20})
    assert step.wait_finished(0.01) is False
    step.finish()
    assert step.wait_finished(5) is True


def test_membership_of_an_unhashable_id_is_false():
    mgr = make_mgr()
    mgr.add("A", 20)
    assert "A" in mgr and [1] not in mgr and "B" not in mgr


def test_numpy_manager_options_work():
    mgr = KVCacheManager(make_mgr().spec, backend="host", max_steps_in_flight=np.int8(16), ring_slots=np.uint8(2),
                         max_ring_slots=np.int16(4), staging_timeout_s=np.float32(5))
    run_twins(make_mgr(), mgr, int)


# --------------------------------------------------------------------------------------------------
# prefix caching: add(tokens=, cache_salt=, checkpoints=) and settle(new_tokens=)
# --------------------------------------------------------------------------------------------------
def cached_mgr(**kw):
    return make_mgr(prefix_caching=True, prefix_events=True, **kw)


def cached_prefill(mgr, rid, tokens):
    assert mgr.add(rid, len(tokens), tokens=tokens) == 0
    run_step(mgr, contexts={rid: len(tokens)})


def check_cached_invariants(mgr):
    """check_invariants for a manager whose requests may share slots (hits): every slot is in cells,
    free, quarantined or evictable, and its reference count is its cells."""
    assert mgr.stats()["steps_unsettled"] == 0
    check_slots(mgr)


PROMPT = list(range(100, 140))          # 40 tokens: 2 full blocks of 16


@pytest.mark.parametrize("tokens,needles", [
    (None, ["'Z'", "tokens", "40"]),                        # prefix caching needs them
    (PROMPT[:39], ["'Z'", "tokens", "40"]),                 # too short
    (PROMPT + [1], ["'Z'", "tokens", "40"]),                # too long
    ([], ["'Z'", "tokens", "40"]),
    ([float(t) for t in PROMPT], ["'Z'", "tokens", "int"]),
    (np.array(PROMPT, np.float64), ["'Z'", "tokens", "float64"]),
    (np.array(PROMPT, np.float32), ["'Z'", "tokens", "float32"]),
    ("x" * 40, ["'Z'", "tokens", "str"]),
    (b"x" * 40, ["'Z'", "tokens", "bytes"]),
    ([str(t) for t in PROMPT], ["'Z'", "tokens", "a str"]),
    (PROMPT[:39] + [1.5], ["'Z'", "tokens", "1.5, a float"]),
    (PROMPT[:39] + [None], ["'Z'", "tokens", "None"]),      # reported as an int64 overflow before
    (PROMPT[:39] + [True], ["'Z'", "tokens"]),
    (np.array(PROMPT, bool), ["'Z'", "tokens"]),
    (PROMPT[:39] + [2 ** 70], ["'Z'", "tokens", "int64"]),
    (PROMPT[:39] + [-2 ** 63 - 1], ["'Z'", "tokens", "int64"]),
    (np.array(PROMPT[:39] + [2 ** 63], np.uint64), ["'Z'", "tokens", "int64"]),
    (np.array([PROMPT], np.int64), ["'Z'", "tokens", "40"]),          # 2-D
    (5, ["'Z'", "tokens", "int"]),
    ({t: t for t in PROMPT}, ["'Z'", "tokens"]),
], ids=lambda v: type(v).__name__ if not isinstance(v, list) else f"list{len(v)}")
def test_bad_tokens(tokens, needles):
    mgr = cached_mgr()
    cached_prefill(mgr, "A", PROMPT)
    expect_fail(mgr, CupykvError, needles, lambda: mgr.add("Z", 40, tokens=tokens))
    assert mgr.add("Z", 40, tokens=PROMPT) == 32           # still works, and nothing was counted
    assert mgr.stats()["prefix_cache"]["queries"] == 2


@pytest.mark.parametrize("salt", [5, 1.5, ["a"], ("a",), {"a": 1}, True, np.int64(3), "\ud800"], ids=repr)
def test_bad_salt(salt):
    mgr = cached_mgr()
    cached_prefill(mgr, "A", PROMPT)
    expect_fail(mgr, CupykvError, ["cache_salt", repr(salt)], lambda: mgr.add("Z", 40, tokens=PROMPT, cache_salt=salt))
    assert mgr.add("Z", 40, tokens=PROMPT, cache_salt="s") == 0


@pytest.mark.parametrize("checkpoints,needles", [
    ([0], ["checkpoint", "0"]),                     # positions are in [1, prompt_len]
    ([-1], ["checkpoint", "-1"]),
    ([41], ["checkpoint", "41"]),
    ([10, 2 ** 70], ["checkpoint", str(2 ** 70)]),
    ([1.5], ["checkpoint", "1.5"]),
    ([np.float64(8)], ["checkpoint", "8"]),
    ([True], ["checkpoint", "True"]),
    (["8"], ["checkpoint", "'8'"]),
    ([None], ["checkpoint", "None"]),
    (8, ["checkpoints", "8"]),                      # one position, not a list of them
    ("8", ["checkpoints", "'8'"]),
    (None, ["checkpoints", "None"]),
    (np.array(8), ["checkpoints", "array(8)"]),     # 0-d: iterating it raised a bare TypeError
    ({8: 1}, ["checkpoints", "{8: 1}"]),            # a mapping's keys are not meant as positions
])
def test_bad_checkpoints(checkpoints, needles):
    mgr = cached_mgr()
    expect_fail(mgr, CupykvError, ["'Z'"] + needles,
                lambda: mgr.add("Z", 40, tokens=PROMPT, checkpoints=checkpoints))
    mgr.add("Z", 40, tokens=PROMPT, checkpoints=[1, 40, np.int16(20)])
    run_step(mgr, contexts={"Z": 40})


def test_bad_tokens_are_refused_without_prefix_caching_too():
    mgr = make_mgr()
    expect_fail(mgr, CupykvError, ["tokens"], lambda: mgr.add("Z", 40, tokens=[1.5] * 40))
    expect_fail(mgr, CupykvError, ["checkpoint", "41"], lambda: mgr.add("Z", 40, checkpoints=[41]))
    assert mgr.add("Z", 40) == 0


@pytest.mark.parametrize("kind", [list, tuple, np.int64, np.int32, np.uint16, np.uint64, "object"])
def test_every_token_container_hits_the_same_blocks(kind):
    """Token ids of any integer container are the same ids: a prompt given as int32 or uint16 array hits
    the blocks a list published (hashes are of the values, not of the container's bytes)."""
    mgr = cached_mgr()
    cached_prefill(mgr, "A", PROMPT)
    toks = (kind(PROMPT) if kind in (list, tuple) else
            np.array([np.int64(t) for t in PROMPT], object) if kind == "object" else np.array(PROMPT, kind))
    assert mgr.add("Z", 40, tokens=toks) == 32


def new_tokens_mgr():
    """A (prefilled) decodes 2 speculative tokens; B has a context chunk in the same step."""
    mgr = cached_mgr()
    cached_prefill(mgr, "A", PROMPT)
    mgr.add("B", 40, tokens=list(range(40)))
    step = mgr.prepare_batch(contexts={"B": 20}, generation=["A"], num_gen_tokens=2)
    step.finish()
    return mgr, step


@pytest.mark.parametrize("accepted,new_tokens,exc,needles", [
    (None, {"A": [1]}, InvalidRequestError, ["'A'", "2"]),                 # 2 accepted, 1 reported
    (None, {"A": [1, 2, 3]}, InvalidRequestError, ["'A'", "2"]),
    ({"A": 1}, {"A": [1, 2]}, InvalidRequestError, ["'A'", "1"]),          # a rejected token reported
    ({"A": 0}, {"A": [1]}, InvalidRequestError, ["'A'", "0"]),
    (None, {"A": [1.0, 2.0]}, InvalidRequestError, ["'A'", "int"]),
    (None, {"A": ["1", "2"]}, InvalidRequestError, ["'A'"]),
    (None, {"A": "12"}, InvalidRequestError, ["'A'", "str"]),
    (None, {"A": [1, 2 ** 70]}, InvalidRequestError, ["'A'", "int64"]),
    (None, {"A": [1, None]}, InvalidRequestError, ["'A'"]),
    (None, {"A": [True, 2]}, InvalidRequestError, ["'A'"]),
    (None, {"A": None}, InvalidRequestError, ["'A'"]),
    (None, {"A": 7}, InvalidRequestError, ["'A'"]),
    (None, {"B": [1] * 20}, InvalidRequestError, ["'B'", "context"]),     # a context entry's tokens
    (None, {"nope": [1, 2]}, UnknownRequestError, ["'nope'"]),
    (None, {("A",): [1, 2]}, UnknownRequestError, ["('A',)"]),
    (None, {5: [1, 2]}, UnknownRequestError, ["5"]),
    (None, [[1, 2]], InvalidRequestError, ["new_tokens", "shape"]),        # batch order: one flat sequence
    (None, "A", InvalidRequestError, ["new_tokens"]),
    (None, 7, InvalidRequestError, ["new_tokens"]),
    (None, [1], InvalidRequestError, ["new_tokens", "batch order", "2"]),  # A accepted 2 (B is a context)
    (None, [1, 2, 3], InvalidRequestError, ["new_tokens", "2"]),
    ({"A": 1}, np.array([1, 2]), InvalidRequestError, ["new_tokens", "1"]),
    (None, np.array([1.0, 2.0]), InvalidRequestError, ["new_tokens", "int"]),
    (None, np.zeros((1, 2), np.int64), InvalidRequestError, ["new_tokens", "shape"]),
    (None, [1, 2 ** 70], InvalidRequestError, ["new_tokens", "int64"]),
    (None, np.array([1, 2 ** 63], np.uint64), InvalidRequestError, ["new_tokens", "int64"]),
    (None, [True, 2], InvalidRequestError, ["new_tokens"]),
    (None, [1, None], InvalidRequestError, ["new_tokens"]),
])
def test_bad_new_tokens(accepted, new_tokens, exc, needles):
    mgr, step = new_tokens_mgr()
    expect_fail(mgr, exc, needles, lambda: mgr.settle(step, accepted, new_tokens=new_tokens))
    good = {"A": [7, 8]} if accepted is None else {"A": [7, 8][:next(iter(accepted.values()))]}
    mgr.settle(step, accepted, new_tokens=good)
    mgr.synchronize()
    check_cached_invariants(mgr)
    assert mgr.request("A").history == 40 + len(good["A"])


@pytest.mark.parametrize("rid,key", [(2 ** 53 + 1, np.float64(2 ** 53)), (0.1, np.float32(0.1))])
def test_new_tokens_key_equal_to_an_id_but_not_the_same_key_is_unknown(rid, key):
    """A mapping's key is a request id as a dict finds it (hash, then ==), even when the key is == to the
    step's one generation id in its place (NumPy 2 compares np.float64(2**53) with the int 2**53 + 1 as
    equal, and np.float32(0.1) with the float 0.1, but their hashes differ): unknown, nothing changed."""
    assert key == rid and hash(key) != hash(rid)
    mgr = cached_mgr()
    cached_prefill(mgr, rid, PROMPT)
    step = mgr.prepare_batch(generation=[rid])
    step.finish()
    expect_fail(mgr, UnknownRequestError, ["new_tokens", repr(key)], lambda: mgr.settle(step, new_tokens={key: [7]}))
    mgr.settle(step, new_tokens={rid: [7]})
    assert mgr.request(rid).history == len(PROMPT) + 1


@pytest.mark.parametrize("form", ["mapping", "batch order"])
def test_new_tokens_of_a_freed_request_are_accepted_and_ignored(form):
    mgr, step = new_tokens_mgr()
    mgr.free("A")
    mgr.settle(step, new_tokens={"A": [7, 8]} if form == "mapping" else [7, 8])
    mgr.synchronize()
    check_cached_invariants(mgr)


@pytest.mark.parametrize("field,value", [("prefix_caching", "yes"), ("prefix_caching", 1),
                                         ("prefix_retention", "some"), ("prefix_retention", None),
                                         ("prefix_retention", 3), ("prefix_events", "yes"),
                                         ("prefix_events", 1)])
def test_bad_prefix_spec_fields(field, value):
    kw = dict(SPEC, prefix_caching=True, prefix_events=True)
    kw[field] = value
    with pytest.raises(InvalidSpecError) as ei:
        CacheSpec(**kw)
    assert field in str(ei.value) and repr(value) in str(ei.value), str(ei.value)


def test_prefix_events_need_prefix_caching():
    with pytest.raises(InvalidSpecError) as ei:
        CacheSpec(**dict(SPEC, prefix_events=True))
    assert "prefix_events" in str(ei.value) and "prefix_caching=True" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("caching", [False, True])
def test_draining_cache_events_that_are_not_recorded_is_an_error(caching):
    mgr = make_mgr(prefix_caching=caching)
    if caching:
        cached_prefill(mgr, "A", PROMPT)        # blocks stored: events a recording manager would keep
    expect_fail(mgr, InvalidRequestError, ["drain_cache_events", "prefix_events=True"], mgr.drain_cache_events)


def test_cache_events_off_keep_nothing_and_decide_the_same():
    """A manager that records no events keeps none (nothing grows until a drain that never comes) and
    makes the same decisions as one that records them."""
    on, off = cached_mgr(), make_mgr(prefix_caching=True)
    for mgr in (on, off):
        cached_prefill(mgr, "A", PROMPT)
        mgr.free("A")
        hit = mgr.add("B", len(PROMPT), tokens=PROMPT)
        assert hit > 0                          # A's blocks
        run_step(mgr, contexts={"B": len(PROMPT) - hit})
        mgr.synchronize()
    kinds = {kind for kind, _, _ in on.drain_cache_events()}
    assert "stored" in kinds, kinds
    assert off.cache.events is None
    assert on.stats() == off.stats()
    assert on.page_table.state() == off.page_table.state()
    assert [p.state() for p in on.pools] == [p.state() for p in off.pools]


def test_a_step_within_the_lists_room_checks_its_padding_and_tokens():
    """A decode step of the last validated list that fits the list's room takes a plan of its own
    (StepPlanner.plan_in_room); its padding, its tokens and the previous step's finish are checked all the same,
    with the state unchanged."""
    mgr = make_mgr(max_step_tokens=4)
    mgr.add("a", 8)
    for _ in range(2):
        s = mgr.prepare_batch({"a": 4})
        s.finish()
        mgr.settle(s)
    for _ in range(2):          # the list's second step knows its room (10 tokens: 6 before block 1)
        s = mgr.prepare_batch((), ["a"])
        s.finish()
        mgr.settle(s)
    assert mgr.requests.last_generation.has_room(1, mgr.requests.cap_writes)
    expect_fail(mgr, InvalidRequestError, ["pad_to=0", "[1, 4]"], lambda: mgr.prepare_batch((), ["a"], pad_to=0))
    expect_fail(mgr, InvalidRequestError, ["pad_to=5", "[1, 4]"], lambda: mgr.prepare_batch((), ["a"], pad_to=5))
    assert mgr.requests.last_generation.has_room(5, mgr.requests.cap_writes)
    expect_fail(mgr, CapacityExceededError, ["5 tokens", "max_step_tokens=4"],
                lambda: mgr.prepare_batch((), ["a"], num_gen_tokens=5))
    s = mgr.prepare_batch((), ["a"], num_gen_tokens=np.uint8(4), pad_to=np.int64(4))     # and then the step
    assert (s.num_seqs, int(s.num_tokens[0]), s.pad_to) == (1, 4, 4)
    assert mgr.requests.last_generation.has_room(1, mgr.requests.cap_writes)
    expect_fail(mgr, StepOrderError, [f"step {s.id} is not finished"], lambda: mgr.prepare_batch((), ["a"]))
