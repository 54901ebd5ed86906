"""Race tests: step N waits behind a gate while the scheduler drives steps N+1 and N+2 through the public
API; after the gate opens, step N's tables must still describe the host state at step N's prepare.

The unsafe staging mode (copies straight from live host buffers and from pinned arrays dropped after
enqueue) must fail every one of these tests: that proves they catch the race.
"""
import pytest

import cupykv
from conftest import backend_or_skip
from oracle import Capture

# "+graphs": use_graphs as a user gets it (small steps launched inline, larger ones replayed); "+replays":
# use_graphs with every step replayed, small ones too, to test the replays (conftest.replays_staging)
STAGINGS = ["snapshot", "snapshot+graphs", "snapshot+replays", "unsafe"]
pytestmark = pytest.mark.usefixtures("replays_staging")


def make(backend_name, staging, **kw):
    spec = cupykv.CacheSpec(windows=[64, None, 64, 64], num_kv_heads=2, head_dim=8, tokens_per_block=16,
                            max_seq_len=1024, max_batch=8, slots_per_group=256, max_rewind=2, **kw)
    graphs = staging.endswith(("+graphs", "+replays"))
    return cupykv.KVCacheManager(spec, backend=backend_name, staging=staging.split("+")[0], use_graphs=graphs)


def run_gated(mgr, first, then):
    """Prepare step N behind a gate, run `then` (steps N+1...), open the gate, return the mismatching steps."""
    cap = Capture(mgr).reserve(32)
    gate = mgr.backend.gate(mgr.backend.stream)
    step = first()
    cap.consume(step)
    then(cap)
    gate.open()
    mgr.synchronize()
    cap.stream.synchronize()
    assert not gate.close_timeout_hit()
    return step, cap.mismatches()


def check(staging, step, bad):
    """Snapshot staging: every captured step is right. Unsafe staging: the gated step is wrong."""
    if staging.startswith("snapshot"):
        assert bad == [], f"steps with wrong tables: {bad}"
    else:
        assert step.id in bad, "the unsafe mode survived: this test does not catch the race"


def warm(mgr, rids, prompt=100):
    for r in rids:
        mgr.add(r, prompt)
    s = mgr.prepare_batch({r: prompt for r in rids})
    s.finish()
    mgr.settle(s)
    mgr.synchronize()


@pytest.mark.parametrize("staging", STAGINGS)
def test_copy_idx_reordered(backend_name, staging):
    mgr = make(backend_name, staging)
    warm(mgr, ["a", "b", "c"])

    def then(cap):
        s = mgr.prepare_batch((), ["c", "a", "b"])     # the same requests, another order
        cap.consume(s)
        s2 = mgr.prepare_batch((), ["b", "c"])
        cap.consume(s2)

    step, bad = run_gated(mgr, lambda: mgr.prepare_batch((), ["a", "b", "c"]), then)
    check(staging, step, bad)


@pytest.mark.parametrize("staging", STAGINGS)
def test_page_table_rewritten(backend_name, staging):
    """A request is freed, a new one takes its row and slots; stale blocks and a rewind also change the table."""
    mgr = make(backend_name, staging)
    warm(mgr, ["a", "b"], prompt=150)

    def first():
        return mgr.prepare_batch((), ["a", "b"], num_gen_tokens=3)

    def then(cap):
        n = cap.items[0][0]
        mgr.settle(n, {"a": 1, "b": 3})                # a rewinds 2 speculative tokens, b advances
        mgr.free("a")                                  # a's row and slots go
        mgr.add("new", 200)                            # takes a's row
        s = mgr.prepare_batch({"new": 200}, ["b"])
        cap.consume(s)
        mgr.settle(s)
        # b's SWA blocks fall out of the window. 24 tokens in 6 steps: every operation queued behind the
        # gate occupies the launch queue, and a full queue blocks the host (docs/design.md, "GPU facts the design relies on").
        for _ in range(6):
            s = mgr.prepare_batch((), ["new", "b"], num_gen_tokens=4)
            cap.consume(s)
            mgr.settle(s)

    step, bad = run_gated(mgr, first, then)
    check(staging, step, bad)


@pytest.mark.parametrize("staging", STAGINGS)
def test_scratch_metadata_changed(backend_name, staging):
    mgr = make(backend_name, staging)
    for r, n in (("x", 600), ("y", 400), ("z", 500)):
        mgr.add(r, n)

    def first():
        return mgr.prepare_batch({"x": 600})

    def then(cap):
        mgr.settle(cap.items[0][0])
        s = mgr.prepare_batch({"y": 400, "z": 300})   # other contexts, other scratch slots
        cap.consume(s)
        assert s.scratch_ends.max() > 0

    step, bad = run_gated(mgr, first, then)
    assert step.scratch_ends.max() > 0                 # the gated step really had scratch
    check(staging, step, bad)


@pytest.mark.parametrize("staging", STAGINGS)
def test_pinned_pool_recycled(backend_name, staging):
    """Dropping references and allocating pinned arrays of the same size class while the copy is gated."""
    mgr = make(backend_name, staging)
    warm(mgr, ["a", "b", "c", "d"])

    def then(cap):
        junk = []
        for words in (64, 128, 256, 512, 1024):
            for _ in range(4):
                a = mgr.backend.pinned_temp(words)
                a[:] = 7
                junk.append(a)
        del junk                                      # and give them back, dirty

    step, bad = run_gated(mgr, lambda: mgr.prepare_batch((), ["d", "c", "b", "a"]), then)
    check(staging, step, bad)


@pytest.mark.parametrize("graphs", [False, True], ids=["launched", "graphs"])
@pytest.mark.parametrize("ring_slots", [1, 4])
@pytest.mark.parametrize("variant", ["inline", "copy released at enqueue"])
def test_an_inline_step_frees_its_ring_slot_at_enqueue(variant, ring_slots, graphs, monkeypatch):
    """A launched step whose snapshot goes in its launch's parameters (cupykv_step_inline; the driver copies
    them when it enqueues the launch) leaves nothing that reads its ring slot: the slot is free at once, so
    one slot serves every step behind a gate, each step's tables its own (with four slots the ring hands
    that slot out again: SnapshotRing). With graphs these small steps are launched the same way. The
    control releases the slot at enqueue for steps that copy it when they run (cupykv_step, or a graph
    replay): the next steps rewrite the slot before the gated copies read it, and the test sees the wrong
    tables."""
    backend_or_skip("cuda")
    from cupykv.backends.cuda import CudaStepPlan
    if variant != "inline":
        route = CudaStepPlan.route      # copied from the slot, and the slot released at enqueue all the same
        monkeypatch.setattr(CudaStepPlan, "route",
                            lambda self, words, graph=None: route(self, words, graph)._replace(launch=None, reads_slot=False))
    spec = cupykv.CacheSpec(windows=[64, None, 64, 64], num_kv_heads=2, head_dim=8, tokens_per_block=16,
                            max_seq_len=1024, max_batch=8, slots_per_group=256, max_rewind=2)
    mgr = cupykv.KVCacheManager(spec, backend="cuda", ring_slots=ring_slots, max_ring_slots=ring_slots,
                                staging_timeout_s=0.2, use_graphs=graphs)
    warm(mgr, ["a", "b", "c"])
    mgr.capture_graphs()        # the control's replays: none is captured behind the gate

    def then(cap):
        for batch in (["c", "a", "b"], ["b"], ["a", "c"], ["c", "b", "a"]):
            cap.consume(mgr.prepare_batch((), batch))

    step, bad = run_gated(mgr, lambda: mgr.prepare_batch((), ["a", "b", "c"]), then)
    assert len(mgr.ring.slots) == ring_slots
    if variant == "inline":
        assert bad == [], f"steps with wrong tables: {bad}"
    else:
        assert step.id in bad, "the early release survived: this test does not catch the race"
