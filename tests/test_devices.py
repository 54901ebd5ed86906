"""One manager, several devices (KVCacheManager(devices=[...])): every device gets the reference tables
and write positions from the one snapshot of each step, each device's consumer is waited for on its own
device, and quarantine lifts only after every device's consumer has finished.

On the host backend the devices are simulated (one SimDevice runs every rank's streams); on a GPU the
same tests run with devices [0, 0] (two mirrors on one GPU), and with [0, 1] where two GPUs exist.
"""
import numpy as np
import pytest

import cupykv
import cupykv.step
from conftest import backend_or_skip, graph_count
from cupykv.storage import KVStorage
from oracle import Capture, check_slots

# "+graphs": use_graphs as a user gets it (small steps launched inline, larger ones replayed); "+replays":
# use_graphs with every step replayed, small ones too, to test the replays (conftest.replays_staging)
STAGINGS = ["snapshot", "snapshot+graphs", "snapshot+replays", "unsafe"]
pytestmark = pytest.mark.usefixtures("replays_staging")


def two_devices(backend_name: str) -> list:
    """[0, 1] where the backend has two devices (two GPUs, or the host backend's simulated ones), else [0, 0]."""
    if backend_name == "cuda":
        import cupy
        return [0, 1] if cupy.cuda.runtime.getDeviceCount() > 1 else [0, 0]
    return [0, 1]


def make(backend_name, staging="snapshot", devices=None, ring_slots=4, **kw):
    spec = cupykv.CacheSpec(windows=[32, None, 32, 64], num_kv_heads=4, head_dim=8, tokens_per_block=8,
                            max_seq_len=1024, max_batch=8, slots_per_group=[160, 400, 200], max_rewind=3,
                            swa_scratch_reuse=True, dtype="float32", **kw)
    return cupykv.KVCacheManager(spec, backend=backend_name, staging=staging.split("+")[0],
                                 use_graphs=staging.endswith(("+graphs", "+replays")), ring_slots=ring_slots,
                                 devices=devices if devices is not None else two_devices(backend_name))


def random_workload(mgr, rng, steps, consume):
    """Arrivals, chunked prefill, decode with speculative tokens and rejections, frees; consume(step) is
    each step's consumer (it must finish every device's part)."""
    prompts, decoding, next_rid = {}, {}, 0
    for _ in range(steps):
        while len(prompts) + len(decoding) < mgr.spec.max_batch - 1 and rng.random() < 0.4:
            n = int(rng.integers(10, 300))
            mgr.add(next_rid, np.int64(n))
            prompts[next_rid] = n
            next_rid += 1
        ctx = {r: min(int(rng.integers(16, 120)), left) for r, left in list(prompts.items())[:2]}
        gen = list(decoding)
        if not ctx and not gen:
            continue
        k = int(rng.integers(1, 4))
        step = mgr.prepare_batch(ctx, gen, num_gen_tokens=k)
        consume(step)
        accepted = {r: int(rng.integers(1, k + 1)) for r in gen}
        mgr.settle(step, accepted)
        for r, n in ctx.items():
            prompts[r] -= n
            if not prompts[r]:
                del prompts[r]
                decoding[r] = int(rng.integers(3, 40))
        for r in gen:
            decoding[r] -= accepted[r]
            if decoding[r] <= 0:
                del decoding[r]
                mgr.free(r)


@pytest.mark.parametrize("staging", ["snapshot", "snapshot+graphs", "snapshot+replays"])
@pytest.mark.parametrize("null_slot", [False, True])
def test_every_device_reads_the_reference_tables(backend_name, staging, null_slot):
    """Each device's tables and write positions equal the reference (oracle.expected_tables) at every step
    of a random workload, so they also equal each other."""
    mgr = make(backend_name, staging, null_slot=null_slot)
    caps = [Capture(mgr, write_positions=True, rank=r) for r in range(len(mgr.devices))]
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)

    def consume(step):
        for cap in caps:
            cap.consume(step)

    random_workload(mgr, rng, 60, consume)
    mgr.synchronize()
    for cap in caps:
        cap.stream.synchronize()
        assert len(cap.items) > 30
        assert cap.mismatches() == [], f"seed {seed}: device {cap.rank} has wrong tables at these steps"
    check_slots(mgr)


GATED_STEPS = 6      # the steps gated_rewrite prepares behind its gate


def gated_rewrite(mgr, gated_rank: int):
    """Step N behind a gate on one device's manager stream while steps N+1.. rewrite the table (a rewind,
    a free, a new request in the freed row, stale releases); returns (step N, per rank the mismatches).
    With graphs, mgr needs a ring slot for each of the GATED_STEPS steps (ring_slots)."""
    for r in ("a", "b"):
        mgr.add(r, 150)
    s = mgr.prepare_batch({"a": 150, "b": 150})
    s.finish()
    mgr.settle(s)
    mgr.synchronize()
    caps = [Capture(mgr, rank=r).reserve(16) for r in range(len(mgr.devices))]
    # With graphs, every graph first: instantiating one behind the gate can wait for the gated device
    # (docs/design.md, "CUDA graphs"), and the gate would time out; what this tests is the tables, not capture.
    # No slot's copy completes behind the gate, so each step there takes a slot of its own: a slot added
    # there would capture its graphs on first use.
    mgr.capture_graphs()
    graphs = [graph_count(be) for be in mgr.backends]
    be = mgr.backends[gated_rank]
    gate = be.gate(be.stream)
    step = mgr.prepare_batch((), ["a", "b"], num_gen_tokens=3)
    for cap in caps:
        cap.consume(step)
    mgr.settle(step, {"a": 1, "b": 3})
    mgr.free("a")
    mgr.add("new", 200)
    s = mgr.prepare_batch({"new": 200}, ["b"])
    for cap in caps:
        cap.consume(s)
    mgr.settle(s)
    for _ in range(4):
        s = mgr.prepare_batch((), ["new", "b"], num_gen_tokens=3)
        for cap in caps:
            cap.consume(s)
        mgr.settle(s)
    captured = [graph_count(be) - n for be, n in zip(mgr.backends, graphs)]
    gate.open()
    mgr.synchronize()
    for cap in caps:
        cap.stream.synchronize()
    assert captured == [0] * len(mgr.backends), (
        f"graphs captured behind the gate, per device: {captured} (give the manager more ring slots)")
    assert not gate.close_timeout_hit()
    return step, [cap.mismatches() for cap in caps]


@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("gated_rank", [0, 1])
def test_a_gated_device_still_gets_its_steps_tables(backend_name, staging, gated_rank):
    """The race test of test_races.py, per device: one device's manager stream is held while the host
    rewrites the table. With snapshot staging every device's every step is right; the unsafe mode
    (copies from the live table) must fail on the gated device, which proves the test catches the race."""
    mgr = make(backend_name, staging, ring_slots=GATED_STEPS)
    step, bad = gated_rewrite(mgr, gated_rank)
    if staging.startswith("snapshot"):
        assert bad == [[]] * len(mgr.devices), f"steps with wrong tables, per device: {bad}"
    else:
        assert step.id in bad[gated_rank], "the unsafe mode survived: this test does not catch the race"


def freed_slots_reused_while_a_device_reads(mgr) -> bool:
    """Device 1's consumer of a step is held by a gate on its stream; the host frees that step's request,
    device 0's consumer finishes, and new requests take slots. True when a new request got a slot the
    held consumer may still read (the freed request's)."""
    mgr.add("old", 64)
    caps = [Capture(mgr, rank=r).reserve(4) for r in range(len(mgr.devices))]
    held = mgr.backends[1]
    gate = held.gate(caps[1].stream)             # device 1's consumer waits behind it
    step = mgr.prepare_batch({"old": 64})
    for cap in caps:
        cap.consume(step)
    mgr.settle(step)
    old = {int(s) for p in range(mgr.layout.num_groups) for s in mgr.table[p, mgr.request("old").row] if s >= 0}
    mgr.free("old")
    caps[0].stream.synchronize()                 # device 0's consumer has finished
    mgr.backends[0].stream.synchronize()
    mgr.reclaim()
    reused = set()
    for i in range(4):
        rid = f"new{i}"
        mgr.add(rid, 64)
        s = mgr.prepare_batch({rid: 64})
        s.on(0).finish()
        s.on(1).finish(caps[1].stream)
        mgr.settle(s)
        reused |= {int(x) for p in range(mgr.layout.num_groups) for x in mgr.table[p, mgr.request(rid).row]
                   if x >= 0} & old
    gate.open()
    mgr.synchronize()
    return bool(reused)


def test_quarantine_waits_for_every_devices_consumer(backend_name, monkeypatch):
    """Slots freed while one device's consumer may still read them stay quarantined until that device's
    finish has completed, whatever the other devices did. The variant that lifts quarantine on device
    0's finish alone (Step.is_complete patched) reuses them: the check catches it."""
    mgr = make(backend_name)
    assert not freed_slots_reused_while_a_device_reads(mgr)
    check_slots(mgr)
    monkeypatch.setattr(cupykv.step.Step, "is_complete", lambda self: self.devices[0].is_complete())
    unprotected = make(backend_name)
    assert freed_slots_reused_while_a_device_reads(unprotected), (
        "the variant without per-device quarantine reused nothing: this test does not catch the hazard")


def test_finish_per_device(backend_name):
    """With several devices a step is finished per device; the next prepare names the devices not
    finished, and changes nothing."""
    mgr = make(backend_name)
    mgr.add("a", 40)
    step = mgr.prepare_batch({"a": 40})
    other = mgr.backends[1].new_stream()
    with pytest.raises(cupykv.StepOrderError, match="step.on"):
        step.finish(other)
    if len(set(mgr.devices)) > 1:         # (two backends of one GPU share its streams)
        with pytest.raises(cupykv.InvalidRequestError, match="device 0"):
            step.on(0).finish(other)          # device 1's stream: accepted before on the host backend
        assert step.on(0).finished is None
    step.on(0).finish()
    assert not step.is_finished()
    mgr.settle(step)
    before = mgr.state()
    with pytest.raises(cupykv.StepOrderError, match=r"device\(s\) \[1\]"):
        mgr.prepare_batch((), ["a"])
    assert mgr.state() == before
    step.on(1).finish(other)
    with pytest.raises(cupykv.StepOrderError, match="already finished"):
        step.on(1).finish()
    mgr.synchronize()
    assert step.is_complete()
    s = mgr.prepare_batch((), ["a"])
    s.finish()                                    # no stream: every device, on its manager stream
    assert all(v.finished is not None for v in s.devices)
    with pytest.raises(IndexError, match="2 device"):
        s.on(2)
    assert s.on(np.int64(1)) == s.devices[1] != s.devices[0] and s.on(1) in s.devices and s.on(1).rank == 1
    assert len({s.on(1), s.on(1), s.on(0)}) == 2 and s.on(1) != step.on(1)


def test_a_step_nobody_holds_is_freed_without_the_garbage_collector(backend_name):
    """A step and its device views form no reference cycle: once the manager has moved past a step and
    the last view of it is dropped, it is freed at once, and on CUDA its finish events are back in their
    backend's pool for the next steps (left to the collector, they would come back only when it ran)."""
    import gc
    import weakref
    mgr = make(backend_name)
    mgr.add("a", 40)
    gc.collect()
    gc.disable()
    try:
        step = mgr.prepare_batch({"a": 40})
        step.finish()
        mgr.settle(step)
        ref, view = weakref.ref(step), step.on(1)
        # (a ready event is held by the ring slot it was recorded for, until the slot's next step)
        handles = [(part.backend, part.finished.ptr) for part in step.parts if hasattr(part.finished, "ptr")]
        del step
        for _ in range(2):          # the manager's latest and previous step move past it
            s = mgr.prepare_batch((), ["a"])
            s.finish()
            mgr.settle(s)
        del s
        mgr.synchronize()           # and the ledger lets go of every completed step
        assert ref() is not None, "a view keeps its step"
        assert view.request_ids == ["a"] and view.rank == 1
        del view
        assert ref() is None, "the step outlived its last reference: something holds it in a cycle"
        for be, ptr in handles:
            assert ptr in be._events, "a freed step's finish event did not go back to its backend's pool"
    finally:
        gc.enable()


def test_storage_per_device_holds_its_share_of_heads(backend_name):
    """KVStorage(mgr, rank=r) holds num_kv_heads // world heads on rank r's device; each rank writes its
    heads at its own write positions, and reading them back through the ranks equals a one-device
    storage that wrote every head."""
    mgr = make(backend_name)
    world = len(mgr.devices)
    single = cupykv.KVCacheManager(mgr.spec, backend=backend_name)
    stores = [KVStorage(mgr, rank=r) for r in range(world)]
    whole = KVStorage(single)
    assert [s.num_kv_heads for s in stores] == [mgr.spec.num_kv_heads // world] * world
    rng = np.random.default_rng(0)
    for rid, n in (("a", 37), ("b", 90)):
        mgr.add(rid, n)
        single.add(rid, n)
    for ctx, gen in (({"a": 37, "b": 50}, []), ({"b": 40}, ["a"]), ({}, ["a", "b"])):
        steps = [m.prepare_batch(ctx, gen) for m in (mgr, single)]
        T = steps[0].total_tokens
        for layer in range(mgr.layout.num_layers):
            k, v = (rng.standard_normal((T, mgr.spec.num_kv_heads, mgr.spec.head_dim)).astype(np.float32)
                    for _ in range(2))
            whole.write(steps[1], layer, as_backend(single, k), as_backend(single, v))
            h = mgr.spec.num_kv_heads // world
            for r, store in enumerate(stores):
                with mgr.backends[r].device_context():
                    store.write(steps[0].on(r), layer, as_backend(mgr, k[:, r * h:(r + 1) * h], r),
                                as_backend(mgr, v[:, r * h:(r + 1) * h], r))
            want = [single.backend.to_numpy(a) for a in whole.gather(steps[1], layer)]
            got = [np.concatenate([store.backend.to_numpy(part[i]) for store, part in
                                   zip(stores, [s.gather(steps[0], layer) for s in stores])], axis=1)
                   for i in range(2)]
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), f"layer {layer}"
        for m, s in zip((mgr, single), steps):
            s.finish()
            m.settle(s)
    assert all(s.errors() == 0 for s in stores)


def as_backend(mgr, array, rank=0):
    """A numpy array as an array of the manager's rank-r backend (a device array on CUDA)."""
    be = mgr.backends[rank]
    if be.xp is np:
        return np.ascontiguousarray(array)
    with be.device_context():
        return be.xp.asarray(np.ascontiguousarray(array))


@pytest.mark.parametrize("devices, match", [([], "at least one"), (["0"], "not a device id"), ([-1], "not a device id"),
                                            ([True], "not a device id"), ("01", "list of device ids"),
                                            (3, "list of device ids")])
def test_bad_devices(devices, match):
    spec = make("host").spec
    with pytest.raises(cupykv.InvalidSpecError, match=match):
        cupykv.KVCacheManager(spec, backend="host", devices=devices)


def test_bad_per_device_storage():
    mgr = make("host", devices=[np.int32(0), np.int64(1)])
    assert mgr.devices == [0, 1]
    with pytest.raises(cupykv.InvalidRequestError, match="rank"):
        KVStorage(mgr, rank=2)
    with pytest.raises(cupykv.InvalidSpecError, match="host tier"):
        KVStorage(mgr, rank=0, host_tier_bytes=1 << 20)
    with pytest.raises(cupykv.InvalidSpecError, match="backend by name"):
        cupykv.KVCacheManager(mgr.spec, backend=mgr.backend, devices=[0, 1])
    three = cupykv.KVCacheManager(mgr.spec, backend="host", devices=[0, 1, 2])
    with pytest.raises(cupykv.InvalidSpecError, match="split evenly"):
        KVStorage(three, rank=0)
    mgr.add("a", 16)
    step = mgr.prepare_batch({"a": 16})
    store = KVStorage(mgr, rank=1)
    kv = np.zeros((16, 2, mgr.spec.head_dim), np.float32)
    with pytest.raises(cupykv.StepOrderError, match="device 1's"):
        store.write(step.on(0), 0, kv, kv)


def test_cuda_devices_out_of_range():
    backend_or_skip("cuda")
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    with pytest.raises(cupykv.InvalidSpecError, match="does not exist"):
        cupykv.KVCacheManager(make("cuda").spec, backend="cuda", devices=[0, n])


def test_finish_on_torch_needs_a_device_view():
    """finish_on_torch takes step.on(rank) with several devices: a stream belongs to one device (on every
    backend, so the host backend catches the mistake too)."""
    from cupykv.interop import finish_on_torch
    mgr = make("host")
    mgr.add("a", 16)
    step = mgr.prepare_batch({"a": 16})
    with pytest.raises(cupykv.StepOrderError, match="step.on"):
        finish_on_torch(step)
    assert step.unfinished_ranks() == [0, 1]
    finish_on_torch(step.on(0))
    finish_on_torch(step.on(1))
    assert step.is_finished()
