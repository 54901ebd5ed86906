"""KV transfer between two managers (cupykv.transfer, the loopback transport; NIXL where installed).

The oracle: every K/V value is a function of (request, layer, position, head, dim), so what a query at
position h must see through the receiver's own tables (the window rule written out here: full attention
sees every position, a sliding window (h - W, h]) is known without either manager.
"""
import json

import numpy as np
import pytest

import cupykv
from cupykv.errors import (DuplicateRequestError, InvalidRequestError, OutOfSlotsError, StepOrderError,
                           UnknownRequestError)
from cupykv.transfer import KVTransfers, TransferLayoutError
from cupykv.transports import LoopbackTransport

from conftest import backend_or_skip

TPB, H, D = 4, 2, 4
WINDOWS = [8, None, 8, None, 8]         # GPT-OSS-like: sliding-window and full layers interleaved


def spec(**over):
    base = dict(windows=WINDOWS, num_kv_heads=H, head_dim=D, dtype="float32", tokens_per_block=TPB,
                max_seq_len=96, max_batch=4, slots_per_group=48)
    base.update(over)
    return cupykv.CacheSpec(**base)


def kv(seed: int, layer: int, positions) -> np.ndarray:
    """K (V is its negative) of these positions: [n, H, D], exact in float32."""
    p = np.asarray(positions, np.float32)[:, None, None]
    return (seed * 10000 + layer * 1000 + p + np.arange(H)[None, :, None] * 0.25
            + np.arange(D)[None, None, :] * 0.0625).astype(np.float32)


def visible(h: int, window) -> np.ndarray:
    """Positions a query at position h sees (the keys (h - W, h], or [0, h] for full attention)."""
    return np.arange(0 if window is None else max(0, h - window + 1), h + 1)


class Side:
    """A manager, its storage and transfers; requests' seeds for the oracle."""

    def __init__(self, backend: str, host_tier_bytes=None, **over):
        self.mgr = cupykv.KVCacheManager(spec(**over), backend=backend)
        self.storage = cupykv.KVStorage(self.mgr, host_tier_bytes=host_tier_bytes)
        self.transfers = KVTransfers(self.storage)
        self.seeds = {}

    def run(self, rid, tokens: int, start: int, ctx: bool):
        mgr = self.mgr
        step = mgr.prepare_batch({rid: tokens} if ctx else {}, [] if ctx else [rid])
        pos = np.arange(start, start + tokens)
        for layer in range(len(WINDOWS)):
            k = kv(self.seeds[rid], layer, pos)
            self.storage.write(step, layer, k, -k)
        return step

    def prefill(self, rid, n: int, seed: int, chunk: int = 12):
        self.mgr.add(rid, n)
        self.seeds[rid] = seed
        done = 0
        while done < n:
            c = min(chunk, n - done)
            step = self.run(rid, c, done, ctx=True)
            step.finish()
            self.mgr.settle(step)
            done += c

    def decode_and_check(self, rid, steps: int):
        """Decode `steps` tokens; at each step every position the new token's query sees, in every layer,
        must read the oracle's K/V through this manager's tables."""
        mgr, be = self.mgr, self.mgr.backend
        for _ in range(steps):
            h = mgr.request(rid).history
            step = self.run(rid, 1, h, ctx=False)
            tables = be.to_numpy(step.tables)
            entry = list(step.request_ids).index(rid)
            for layer, window in enumerate(WINDOWS):
                pages = be.to_numpy(self.storage.layer_pages(layer))
                pos = visible(h, window)
                k_pages = tables[layer, entry, 0, pos // TPB]
                v_pages = tables[layer, entry, 1, pos // TPB]
                assert (k_pages >= 0).all(), (layer, h)
                want = kv(self.seeds[rid], layer, pos)
                np.testing.assert_array_equal(pages[k_pages, pos % TPB], want, err_msg=f"K layer {layer} at {h}")
                np.testing.assert_array_equal(pages[v_pages, pos % TPB], -want, err_msg=f"V layer {layer} at {h}")
            step.finish()
            mgr.settle(step)

    def books(self):
        """What 'as it was' compares: live requests, their histories and table cells, free slots per group."""
        mgr = self.mgr
        mgr.reclaim(wait=True)
        reqs = tuple((repr(r), mgr.request(r).history, mgr.request(r).parked) for r in mgr.request_ids)
        return (reqs, mgr.page_table.flat.tobytes(),
                tuple(tuple(sorted(p.free_slots().tolist())) for p in mgr.pools))


def expected_blocks(h: int):
    """Per group (windows in group order: the sliding window first), the blocks that must move."""
    end = -(-h // TPB)
    swa = np.arange(max(0, (h + 1 - 8) // TPB), end)
    return [swa, np.arange(end)]


def sides(backend_name, **over):
    be = backend_or_skip(backend_name)
    sender, receiver = Side(be), Side(be, **over)
    receiver.prefill("other", 10, seed=7)       # the receiver's slots are assigned differently
    return sender, receiver


def move(sender, receiver, rid, gate=False):
    out = sender.transfers.send(rid)
    inc = receiver.transfers.receive(json.loads(json.dumps(out.meta.to_dict())))     # as another process gets it
    transport = LoopbackTransport(sender.transfers, receiver.transfers)
    held = receiver.mgr.backend.gate(receiver.transfers.stream) if gate else None
    read = transport.read(out, inc)
    return out, inc, read, held


@pytest.mark.parametrize("n", [1, 7, 30, 45])
def test_round_trip_reads_the_senders_kv_through_the_receivers_tables(backend_name, n):
    sender, receiver = sides(backend_name)
    sender.prefill("r", n, seed=3)
    out, inc, read, _ = move(sender, receiver, "r")
    receiver.transfers.received("r", ready=read.event)
    receiver.seeds["r"] = 3
    read.wait()
    sender.transfers.sent("r")
    assert "r" not in sender.mgr and receiver.mgr.request("r").history == n
    assert not np.array_equal(np.concatenate(out.descriptors.slots), np.concatenate(inc.descriptors.slots))
    receiver.decode_and_check("r", 12)          # the window slides over received and new blocks alike
    receiver.decode_and_check("other", 2)


@pytest.mark.parametrize("n", [5, 30, 45, 77])
def test_only_the_visible_blocks_move(backend_name, n):
    sender, receiver = sides(backend_name, max_seq_len=96)
    sender.prefill("r", n, seed=3)
    out, inc, read, _ = move(sender, receiver, "r")
    want = expected_blocks(n)
    assert [list(b) for b in out.meta.blocks] == [w.tolist() for w in want]
    slot_bytes = [int(a[0].nbytes) for a in sender.storage.arrays]
    assert slot_bytes == [3 * 2 * TPB * H * D * 4, 2 * 2 * TPB * H * D * 4]    # 3 SWA layers, 2 full ones
    assert out.descriptors.nbytes == inc.descriptors.nbytes == sum(len(w) * b for w, b in zip(want, slot_bytes))
    rows = out.descriptors.rows()
    assert [(g, b) for g, b, _, _ in rows] == [(g, int(b)) for g, w in enumerate(want) for b in w]
    base = [r[0] for r in sender.storage.regions()]
    assert all(a == base[g] + int(s) * slot_bytes[g]
               for g, (addrs, slots) in enumerate(zip(out.descriptors.addresses, out.descriptors.slots))
               for a, s in zip(addrs.tolist(), slots.tolist()))
    read.wait()
    receiver.transfers.received("r")
    sender.transfers.sent("r")
    assert receiver.transfers.stats()["bytes_received"] == sender.transfers.stats()["bytes_sent"] == out.descriptors.nbytes


def fenced_transfer(backend_name):
    """Send, hold the transport's copy behind a gate, let the sender serve another request meanwhile (it
    would take and overwrite the sent request's slots if they were free), open the gate, check the KV."""
    sender, receiver = sides(backend_name)
    sender.prefill("r", 30, seed=3)
    out, inc, read, gate = move(sender, receiver, "r", gate=True)
    if "r" in sender.mgr:
        with pytest.raises(StepOrderError, match="sending"):
            sender.mgr.free("r")
    sender.prefill("next", 60, seed=5)          # takes every free slot it needs, writes its KV
    gate.open()
    read.wait()
    receiver.transfers.received("r")
    receiver.seeds["r"] = 3
    if "r" in sender.transfers.sending:
        sender.transfers.sent("r")
    receiver.decode_and_check("r", 1)


def test_the_senders_slots_are_not_reused_before_the_transfer_is_done(backend_name):
    fenced_transfer(backend_name)


def test_without_the_fence_the_transfer_reads_another_requests_kv(backend_name, monkeypatch):
    """The negative control: a send that lets its slots go at once (no fence) is caught by the same check."""
    send = KVTransfers.send

    def unfenced(self, rid, tokens=None):
        out = send(self, rid, tokens)
        self.sent(rid)           # the slots go back to the pool while the transport has not read them
        return out
    monkeypatch.setattr(KVTransfers, "send", unfenced)
    with pytest.raises(AssertionError):
        fenced_transfer(backend_name)


def test_a_failed_transfer_leaves_both_managers_as_they_were(backend_name):
    sender, receiver = sides(backend_name)
    sender.prefill("r", 30, seed=3)
    before = sender.mgr.state(), receiver.books()
    out, inc, read, gate = move(sender, receiver, "r", gate=True)
    with pytest.raises(InvalidRequestError, match="receiving"):
        receiver.mgr.prepare_batch({}, ["r"])
    with pytest.raises(StepOrderError, match="unreceive"):
        receiver.mgr.free("r")
    receiver.transfers.unreceive("r", stopped=read.event)       # its slots wait for the copies
    used = set(np.concatenate(inc.descriptors.slots).tolist())
    receiver.mgr.reclaim()
    gate.open()
    read.wait()
    sender.transfers.unsend("r")
    assert sender.mgr.state() == before[0]
    assert receiver.books() == before[1]
    assert used
    sender.decode_and_check("r", 3)             # the sender serves it again


def test_a_receiver_that_gives_up_keeps_its_slots_until_the_transport_stops(backend_name):
    """unreceive(stopped=event): the slots stay quarantined while the gated copy may still write them."""
    sender, receiver = sides(backend_name)
    sender.prefill("r", 30, seed=3)
    out, inc, read, gate = move(sender, receiver, "r", gate=True)
    receiver.transfers.unreceive("r", stopped=read.event)
    receiver.mgr.reclaim()
    held = [set(s.tolist()) for s in inc.descriptors.slots]
    free = [set(p.free_slots().tolist()) for p in receiver.mgr.pools]
    assert all(not (h & f) for h, f in zip(held, free))
    gate.open()
    read.wait()
    receiver.mgr.reclaim()
    assert all(h <= set(p.free_slots().tolist()) for h, p in zip(held, receiver.mgr.pools))
    sender.transfers.unsend("r")


def received_then_suspended(backend_name):
    """Receive behind a gated transport copy, mark it received, suspend it before any step: the copy to the
    host tier must wait for the transport's, and the slots it leaves must not go to another request while
    the transport may still write them. "y" then needs exactly the slots r's transfer did not take (so it
    would take r's first, were they free), the gate opens, and both requests must read their own KV."""
    be = backend_or_skip(backend_name)
    sender, receiver = Side(be), Side(be, host_tier_bytes=1 << 20, slots_per_group=[8, 8])
    sender.prefill("r", 16, seed=3)
    out, inc, read, gate = move(sender, receiver, "r", gate=True)
    receiver.transfers.received("r", ready=read.event)
    receiver.seeds["r"] = 3
    receiver.storage.suspend("r")
    receiver.mgr.reclaim()
    receiver.prefill("y", 16, seed=5)
    gate.open()
    read.wait()
    sender.transfers.sent("r")
    receiver.decode_and_check("y", 1)
    receiver.mgr.free("y")
    receiver.mgr.reclaim(wait=True)
    receiver.storage.resume("r")
    receiver.decode_and_check("r", 2)


def test_a_received_request_suspended_before_its_first_step_keeps_its_kv(backend_name):
    received_then_suspended(backend_name)


def test_without_waiting_for_the_transport_a_suspend_loses_the_received_kv(backend_name, monkeypatch):
    """The negative control: a suspend that waits only for the latest step (not the transport's copy) is
    caught by the same checks."""
    from cupykv.residence import Residence
    check = Residence.check_detach

    def steps_only(self, rid):
        loading = self.requests.loading.get(self.requests.get(rid).row)
        return [e for e in check(self, rid) if e is not loading]
    monkeypatch.setattr(Residence, "check_detach", steps_only)
    with pytest.raises(AssertionError):
        received_then_suspended(backend_name)


def test_bad_events_and_metas_are_refused_and_change_nothing(backend_name):
    sender, receiver = sides(backend_name)
    sender.prefill("r", 30, seed=3)
    out = sender.transfers.send("r")
    wire = json.loads(json.dumps(out.meta.to_dict()))
    before = receiver.mgr.state()
    for field, value in [("blocks", None), ("blocks", [1, 2]), ("blocks", "ab"), ("layout", None), ("layout", [])]:
        with pytest.raises(InvalidRequestError, match="blocks|layout"):
            receiver.transfers.receive({**wire, field: value})
        assert receiver.mgr.state() == before and "r" not in receiver.mgr
    inc = receiver.transfers.receive(wire)
    read = LoopbackTransport(sender.transfers, receiver.transfers).read(out, inc)
    read.wait()
    before = receiver.mgr.state()
    for call, name in [(receiver.transfers.received, "ready"), (receiver.transfers.unreceive, "stopped")]:
        for bad in ("not-an-event", 12345):
            with pytest.raises(InvalidRequestError, match=name):
                call("r", bad)
            assert receiver.mgr.state() == before
    receiver.transfers.received("r", ready=read.event)
    sender.transfers.sent("r")
    receiver.seeds["r"] = 3
    receiver.decode_and_check("r", 2)


@pytest.mark.parametrize("over, field", [
    (dict(tokens_per_block=8), "tokens_per_block"),
    (dict(windows=[16, None, 16, None, 16]), "groups"),
    (dict(windows=[8, None, 8, None, None]), "groups"),
    (dict(num_kv_heads=4), "num_kv_heads"),
    (dict(head_dim=8), "head_dim"),
    (dict(dtype="float16"), "dtype"),
])
def test_mismatched_layouts_are_refused_before_anything_moves(backend_name, over, field):
    be = backend_or_skip(backend_name)
    sender, receiver = Side(be), Side(be, **over)
    sender.prefill("r", 30, seed=3)
    out = sender.transfers.send("r")
    before = receiver.mgr.state()
    with pytest.raises(TransferLayoutError, match=field):
        receiver.transfers.receive(out.meta)
    assert receiver.mgr.state() == before and "r" not in receiver.mgr
    sender.transfers.unsend("r")


def test_receive_is_all_or_nothing(backend_name):
    sender, receiver = sides(backend_name, slots_per_group=[8, 12])
    receiver.prefill("more", 24, seed=9)         # the receiver's full-attention group is nearly full now
    sender.prefill("r", 30, seed=3)
    out = sender.transfers.send("r")
    before = receiver.mgr.state()
    with pytest.raises(OutOfSlotsError, match="group 1"):
        receiver.transfers.receive(out.meta)
    assert receiver.mgr.state() == before
    sender.transfers.unsend("r")


def test_bad_calls_are_refused_and_change_nothing(backend_name):
    sender, receiver = sides(backend_name)
    sender.prefill("r", 30, seed=3)
    mgr = sender.mgr
    step = sender.run("r", 1, 30, ctx=False)
    with pytest.raises(StepOrderError):                 # in an unsettled step
        sender.transfers.send("r")
    step.finish()
    mgr.settle(step)
    mgr.add("empty", 5)
    with pytest.raises(InvalidRequestError, match="history 0"):
        sender.transfers.send("empty")
    with pytest.raises(InvalidRequestError, match="not being sent"):
        sender.transfers.sent("r")
    out = sender.transfers.send("r")
    with pytest.raises(InvalidRequestError, match="sending"):
        sender.transfers.send("r")
    with pytest.raises(InvalidRequestError, match="sending"):
        mgr.prepare_batch({}, ["r"])
    receiver.mgr.add("r", 3)
    before = receiver.mgr.state()
    with pytest.raises(DuplicateRequestError):
        receiver.transfers.receive(out.meta)
    meta = out.meta.to_dict()
    meta["blocks"] = [b[1:] for b in meta["blocks"]]
    with pytest.raises(InvalidRequestError, match="visible blocks"):
        receiver.transfers.receive(meta, rid="r2")
    with pytest.raises(InvalidRequestError, match="lacks"):
        receiver.transfers.receive({"history": 3}, rid="r2")
    assert receiver.mgr.state() == before
    cached = Side(backend_or_skip(backend_name), prefix_caching=True)
    with pytest.raises(InvalidRequestError, match="prefix caching"):
        cached.transfers.receive(out.meta)
    sender.transfers.unsend("r")
    sender.decode_and_check("r", 1)


def test_tokens_travel_in_the_meta(backend_name):
    sender, receiver = sides(backend_name)
    sender.prefill("r", 9, seed=3)
    toks = list(range(100, 109))
    out = sender.transfers.send("r", tokens=toks)
    assert json.loads(json.dumps(out.meta.to_dict()))["tokens"] == toks
    with pytest.raises(UnknownRequestError):
        sender.transfers.send("other-id-that-is-not-there")
    sender.transfers.unsend("r")
    with pytest.raises(InvalidRequestError, match="9"):
        sender.transfers.send("r", tokens=toks[:5])
