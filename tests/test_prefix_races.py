"""Race tests for prefix caching: a cached slot is evicted and rewritten while a step that reads it is
held behind a gate. The step must still read the old KV.

Shape (every test): request A's prompt is cached (its KV written through KVStorage, the prefill settled)
and A is freed, so its full blocks are evictable. Request B hits A's prefix; step S (B's prefill of the
rest) is prepared, and its consumer (on its own stream: write S's K/V, then copy every page of B's blocks
out through S's per-layer tables, as an attention kernel would read them) is held by a gate on the
consumer's stream or on the manager stream. B is freed while S can still run (an abort), so its slots
(A's cached ones among them) are released behind S. Then allocation pressure needs exactly as many slots
as B's cached ones; nothing else is free or evictable:

- "prefill": request C, another prompt, prepares its prefill (its K/V written through KVStorage.write);
- "resume": a suspended request R comes back from the host tier (KVStorage.resume), whose copies into
  the fresh slots run on the tier's own stream at once.

With the manager's pools, the quarantine must refuse the slots while S can read them (OutOfSlotsError;
on the GPU after a bounded host wait) and hand them out once the gate has opened, and S's consumer must
read A's and B's KV (an independent oracle: the toy K/V of each token is a pure function of its token
id, position and layer).

The unsafe variant puts a hashed slot straight into the evictable list when its last holder lets go
(EvictWithoutQuarantine, monkeypatched in as the manager's CachingSlotPool). It must hand S's slots to
the pressure while S is held, in both cases. With "resume" the tier's copies then overwrite them before
S's consumer reads: S must see R's KV, proving that the test catches the race. With "prefill" C's writes
come after S's reads anyway, because C's device work waits for S's finish event (the finish-event chain):
S still reads the right KV, and the test checks that chain too.

No sleeps: the gates order everything. On the GPU every kernel the gated code uses is loaded and every
buffer allocated before a gate closes (README, GPU facts).
"""
from __future__ import annotations

import numpy as np
import pytest

import cupykv
import cupykv.manager
from cupykv.allocator import NO_TAG, CachingSlotPool
from cupykv.storage import KVStorage

TPB, H, D = 8, 2, 4
WINDOWS = [64, None]            # a sliding-window group and a full-attention group (prompts < window)
SLOTS = 8                       # per group: the workload below leaves none free or evictable


class EvictWithoutQuarantine(CachingSlotPool):
    """The bug the quarantine prevents: a hashed slot whose last holder lets go is evictable at once,
    although a step that may still read it has not finished."""

    def release(self, slots, tag):
        last = super().release(slots, tag)
        cached = last[self.hashed[last]]
        if len(cached):
            self.qtag[cached] = NO_TAG          # its quarantine entry no longer applies (see _lift)
            self.num_quarantined -= len(cached)
            self._evictable.update((int(s), None) for s in cached)
        return last


# -- the toy model: K/V of a token from (token id, position, layer) alone ------------------------------

def toy_kv(tokens, layer: int):
    """K and V [n, H, D] float32 of tokens at positions 0..n-1."""
    t = np.asarray(tokens, np.float64)[:, None, None]
    pos = np.arange(len(tokens), dtype=np.float64)[:, None, None]
    h = np.arange(H, dtype=np.float64)[None, :, None]
    d = np.arange(D, dtype=np.float64)[None, None, :]
    base = t * 0.37 + layer * 0.11
    k = np.sin(base + pos * 0.173 + h * 1.3 + d * 0.71)
    v = np.cos(base * 1.7 + pos * 0.057 + h * 0.9 + d * 0.43)
    return k.astype(np.float32), v.astype(np.float32)


def tokens_of(first: int, n: int):
    return [first + 7 * i for i in range(n)]


R_TOKENS = tokens_of(3000, 3 * TPB)            # the suspended request: 3 blocks
A_TOKENS = tokens_of(100, 3 * TPB + 1)         # 3 full blocks (cached) and one token
B_TOKENS = A_TOKENS[:3 * TPB] + tokens_of(900, 5)
F_TOKENS = tokens_of(5000, 4 * TPB - 1)        # a filler that takes what is left (its decode opens no block)
C_TOKENS = tokens_of(7000, 3 * TPB)            # the pressure: 3 blocks, another prompt


class Rig:
    """A manager with prefix caching, its storage (with a host tier) and a consumer stream."""

    def __init__(self, backend_name: str):
        spec = cupykv.CacheSpec(windows=WINDOWS, num_kv_heads=H, head_dim=D, tokens_per_block=TPB,
                                max_seq_len=64, max_batch=8, slots_per_group=SLOTS, dtype="float32",
                                prefix_caching=True, prefix_events=True)
        # A host wait for slots that a gated step holds gives up after staging_timeout_s on the GPU (the
        # host backend knows at once that the gate holds it); it bounds the test, it is not measured.
        self.mgr = mgr = cupykv.KVCacheManager(spec, backend=backend_name, staging_timeout_s=0.25)
        self.be = be = mgr.backend
        self.xp = be.xp
        self.host = self.xp is np
        self.storage = KVStorage(mgr, host_tier_bytes=1 << 16)
        self.consumer = be.new_stream("consumer")
        self.layers = len(WINDOWS)
        # everything the gated part uses, allocated now
        self.kv = {}                                                # name -> per layer (k, v) device arrays
        self.kbuf = be.device_full((self.layers, 4, TPB, H, D), 0, np.float32)
        self.vbuf = be.device_full((self.layers, 4, TPB, H, D), 0, np.float32)
        be.synchronize()

    def on(self, stream, fn) -> None:
        """Run fn in `stream` order: enqueued on a simulated stream, or its CuPy calls on the stream."""
        if self.host:
            stream.enqueue(fn)
        else:
            with stream:
                fn()

    def prepare_kv(self, name: str, tokens, start: int) -> None:
        """The toy K/V of tokens[start:] per layer, on the device before any gate closes."""
        per_layer = []
        for layer in range(self.layers):
            k, v = (a[start:] for a in toy_kv(tokens, layer))
            per_layer.append((k, v) if self.host else (self.be.upload(k), self.be.upload(v)))
        self.kv[name] = per_layer

    def write(self, step, name: str, stream=None) -> None:
        for layer, (k, v) in enumerate(self.kv[name]):
            self.storage.write(step, layer, k, v, stream=stream)

    def prefill(self, rid: str, tokens) -> int:
        """add + one prefill chunk of the uncached rest, K/V written, finished and settled; the hit."""
        hit = self.mgr.add(rid, len(tokens), tokens=tokens)
        self.prepare_kv(rid, tokens, hit)
        step = self.mgr.prepare_batch({rid: len(tokens) - hit})
        self.write(step, rid)
        step.finish()
        self.mgr.settle(step)
        self.mgr.synchronize()
        return hit

    def consume(self, step, name: str, blocks: int) -> None:
        """S's consumer on its stream: write the step's K/V, then read every page of the first `blocks`
        blocks of batch entry 0 through the step's per-layer tables; finish after the last read."""
        self.be.wait(self.consumer, step.ready)
        self.write(step, name, stream=self.consumer)
        xp, tables = self.xp, step.tables
        for layer in range(self.layers):
            pages = self.storage.layer_pages(layer)

            def read(layer=layer, pages=pages):
                xp.take(pages, tables[layer, 0, 0, :blocks], axis=0, out=self.kbuf[layer, :blocks])
                xp.take(pages, tables[layer, 0, 1, :blocks], axis=0, out=self.vbuf[layer, :blocks])
            self.on(self.consumer, read)
        step.finish(self.consumer)

    def read_back(self, n: int):
        """What the consumer read: K and V [layers, n, H, D] (after its stream has run)."""
        k = self.be.to_numpy(self.kbuf).reshape(self.layers, -1, H, D)[:, :n]
        v = self.be.to_numpy(self.vbuf).reshape(self.layers, -1, H, D)[:, :n]
        return k, v


def expected(tokens):
    kv = [toy_kv(tokens, layer) for layer in range(len(WINDOWS))]
    return np.stack([k for k, _ in kv]), np.stack([v for _, v in kv])


def slots_in_use(mgr, rid) -> list:
    row = mgr.request(rid).row
    return [set(int(s) for s in mgr.table[p, row] if s != cupykv.BAD) for p in range(len(mgr.pools))]


@pytest.mark.parametrize("pool", ["quarantine", "unsafe"])
@pytest.mark.parametrize("writer", ["prefill", "resume"])
@pytest.mark.parametrize("gated", ["consumer", "manager"])
def test_evicted_cached_slot_rewritten_while_step_reads_it(backend_name, gated, writer, pool, monkeypatch):
    if pool == "unsafe":
        monkeypatch.setattr(cupykv.manager, "CachingSlotPool", EvictWithoutQuarantine)
    rig = Rig(backend_name)
    mgr, be = rig.mgr, rig.be
    assert all(type(p) is (EvictWithoutQuarantine if pool == "unsafe" else CachingSlotPool) for p in mgr.pools)

    # R: prefilled, then suspended to the host tier (its device slots are released)
    assert rig.prefill("r", R_TOKENS) == 0
    rig.storage.suspend("r")
    mgr.synchronize()
    # A: prefilled and freed: its three full blocks are cached (evictable), its last slot free
    assert rig.prefill("a", A_TOKENS) == 0
    mgr.free("a")
    mgr.synchronize()
    # F takes the free slots and evicts two of R's (evicted least recently released first)
    assert rig.prefill("f", F_TOKENS) == 0
    # B hits A's three blocks
    assert mgr.add("b", len(B_TOKENS), tokens=B_TOKENS) == 3 * TPB
    a_slots = slots_in_use(mgr, "b")
    rig.prepare_kv("b", B_TOKENS, 3 * TPB)
    if writer == "prefill":
        assert mgr.add("c", len(C_TOKENS), tokens=C_TOKENS) == 0
        rig.prepare_kv("c", C_TOKENS, 0)

    # Warm up what the gated part runs (the write kernel, CuPy's take) on the consumer stream: a decode
    # step of F that fills its last block (no slot taken).
    warm = mgr.prepare_batch((), ["f"])
    rig.prepare_kv("warm", F_TOKENS + [1], len(F_TOKENS))
    rig.consume(warm, "warm", 4)
    mgr.settle(warm)
    mgr.synchronize()
    be.synchronize()

    gate = be.gate(rig.consumer if gated == "consumer" else be.stream)
    s = mgr.prepare_batch({"b": len(B_TOKENS) - 3 * TPB})
    rig.consume(s, "b", 4)
    read_by_s = slots_in_use(mgr, "b")           # A's three cached slots and B's own for block 3
    for p, cached in enumerate(a_slots):
        assert cached < read_by_s[p]
        assert mgr.pools[p].num_free == 0 and mgr.pools[p].num_evictable == 0, mgr.stats()["groups"][p]
    mgr.free("b")                     # an abort: S is not settled, its consumer has not run

    def pressure():
        if writer == "prefill":
            step = mgr.prepare_batch({"c": len(C_TOKENS)})
            rig.write(step, "c")      # on the manager stream, after C's tables are ready
            step.finish()
            return step, slots_in_use(mgr, "c")
        rig.storage.resume("r")
        rig.storage.host_tier.stream.synchronize()     # the copies into the fresh slots have run
        return None, slots_in_use(mgr, "r")

    if pool == "quarantine":
        with pytest.raises(cupykv.OutOfSlotsError):
            pressure()
    else:
        _, got = pressure()
        assert got == a_slots, "the unsafe pool did not hand out the cached slots S reads"

    gate.open()
    mgr.synchronize()
    be.synchronize()
    assert not gate.close_timeout_hit()
    k, v = rig.read_back(len(B_TOKENS))
    want_k, want_v = expected(B_TOKENS)
    right = np.array_equal(k, want_k) and np.array_equal(v, want_v)
    if pool == "quarantine" or writer == "prefill":
        assert right, "step S read KV other than A's and B's"
    else:
        assert not right, "the unsafe pool survived: this test does not catch the race"
        r_k, r_v = expected(R_TOKENS)
        assert np.array_equal(k[:, :3 * TPB], r_k) and np.array_equal(v[:, :3 * TPB], r_v), \
            "S read something, but not the resumed request's KV"

    if pool == "quarantine":          # the gate has opened and S finished: the slots may go now
        mgr.settle(s)
        _, got = pressure()
        assert all(g <= r for g, r in zip(got, read_by_s)), (got, read_by_s)
