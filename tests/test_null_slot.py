"""CacheSpec(null_slot=True) through the manager, on both backends (the README's "Reading the tables", null slot).

A manager with null slots and a twin without them (one slot fewer per group, so both allocate the same
slots) run the same workload in lockstep: chunked prefill with scratch reuse, multi-token decode with
rejections, frees, steady decode stretches (DELTA steps), padding rows. Every step:

- the tables equal the oracle's with the null slot (tests/oracle.py expected_tables; padding rows from
  reference_tables(pad_to=)), hold no -1 in the live rows, differ from the twin's exactly where the twin
  holds BAD, and every live cell (K, and V = K + 1) indexes a page of its group's page view;
- the write positions equal the twin's and the oracle's from the plain tables, and none is BAD or in a
  null slot; the host table (and the device mirror) never names a null slot;
- CSR views (per group and per layer) have the same content as the twin's: real pages only;
- K/V written through KVStorage: the null slot's pages stay zero, no write is skipped, and every BAD
  cell of the plain tables reads zeros through the null-slot tables (what a tile-based kernel that loads
  a whole tile sees for a released block).
"""
import numpy as np
import pytest

import cupykv
from cupykv.interop import csr_views
from cupykv.spec import CacheSpec
from cupykv.staging import MODE_DELTA
from cupykv.storage import KVStorage
from conftest import backend_or_skip, replay_every_step
from oracle import (Geometry, check_slots, expected_tables, expected_write_positions, null_slots,
                    reference_tables)

BAD = -1
SLOTS = 120
MODES = {
    # the case: tpb 16 with sliding windows (and scratch reuse, multi-token decode)
    "per_layer_tpb16": dict(windows=[32] * 3 + [None], tokens_per_block=16, max_rewind=2),
    # three groups with sinks
    "per_layer_sinks": dict(windows=[8, None, 24, 8, None, 24], sink_tokens=4, tokens_per_block=8, max_rewind=1),
    # SHARED tables (no scratch)
    "shared": dict(windows=[32, None] * 2, table_mode="shared", swa_scratch_reuse=False, tokens_per_block=16,
                   max_rewind=1),
}
RUNS = [("host", False), ("cuda", False), ("cuda", True)]


def make_spec(mode, null_slot, slots):
    return CacheSpec(num_kv_heads=2, head_dim=4, max_seq_len=256, max_batch=6, slots_per_group=slots,
                     max_step_tokens=256, dtype="float32", null_slot=null_slot, **MODES[mode])


def csr_of(be, csr):
    csr.ready.synchronize()
    return (csr.indptr_host.tolist(), be.to_numpy(csr.kv_indices).tolist(), be.to_numpy(csr.kv_last_page_len).tolist())


class Lockstep:
    """The manager with null slots, its twin without, and the checks of one step."""

    def __init__(self, backend_name, mode, use_graphs, pad):
        self.mgr = cupykv.KVCacheManager(make_spec(mode, True, SLOTS), backend=backend_name, use_graphs=use_graphs)
        self.twin = cupykv.KVCacheManager(make_spec(mode, False, SLOTS - 1), backend=backend_name,
                                          use_graphs=use_graphs)
        self.pad = pad
        self.geo = Geometry(self.mgr.spec)
        self.nulls = null_slots(self.mgr)
        assert self.nulls == (SLOTS - 1,) * len(self.geo.groups)   # the group's last slot
        self.storage = KVStorage(self.mgr)
        self.rng = np.random.default_rng(7)
        self.seen = dict(steps=0, delta=0, bad_cells=0, pad_rows=0, csr=0, scratch=0, tokens=0)

    def step(self, ctx, dec, k):
        mgr, twin, be, geo = self.mgr, self.twin, self.mgr.backend, self.geo
        pad_to = self.pad if self.pad else None
        step = mgr.prepare_batch(ctx, dec, num_gen_tokens=k, pad_to=pad_to)
        tstep = twin.prepare_batch(ctx, dec, num_gen_tokens=k, pad_to=pad_to)
        table = mgr.table.copy()
        assert np.array_equal(table, twin.table), "the twin allocated other slots"
        for p, null in enumerate(self.nulls):
            assert not (table[p] == null).any(), f"group {p}: the host table names the null slot"
        step.ready.synchronize()
        tstep.ready.synchronize()
        n, live = step.num_seqs, max(step.num_seqs, self.pad)
        out, tout = be.to_numpy(mgr.out), be.to_numpy(twin.out)

        # tables: the oracle with null slots, padding rows included
        assert np.array_equal(out[:, :n], expected_tables(mgr, table, step)), f"step {step.id}: tables"
        want = reference_tables(mgr.spec, table, step.rows, step.num_contexts, step.scratch_begs, step.scratch_ends,
                                step.scratch_slots, null_slots=self.nulls, pad_to=self.pad)
        assert np.array_equal(out[:, :live], want[:, :live]), f"step {step.id}: padding rows"
        plain = expected_tables(mgr, table, step, null_slot=False)
        assert np.array_equal(tout[:, :n], plain), f"step {step.id}: the twin's tables"
        assert not (out[:, :live] == BAD).any(), f"step {step.id}: -1 left in a table with null slots"
        assert np.array_equal(out[:, :n] != tout[:, :n], tout[:, :n] == BAD), f"step {step.id}: a resident cell changed"
        assert np.array_equal(out[:, :live, 1], out[:, :live, 0] + 1), f"step {step.id}: V is not K + 1"
        for plane in range(out.shape[0]):      # every live K cell, its V and (SHARED) any layer's, is a page
            g = plane if geo.shared else int(geo.layer_group[plane])
            top_koff = 2 * (len(geo.groups[g].layers) - 1) if geo.shared else 0
            k = out[plane, :live, 0].astype(np.int64)
            assert ((k >= 0) & (k + top_koff + 1 < SLOTS * int(geo.group_scale[g]))).all(), \
                f"step {step.id}: a page outside the group's page view"
        self.seen["bad_cells"] += int((tout[:, :n] == BAD).sum())
        self.seen["pad_rows"] += live - n
        self.seen["delta"] += step.mode == MODE_DELTA
        if step.scratch_ends is not None and step.scratch_ends.size:
            self.seen["scratch"] += int((step.scratch_ends - step.scratch_begs).sum())

        # write positions: the twin's, the oracle's from the plain tables; never BAD, never a null slot
        T = step.total_tokens
        wp, wo = be.to_numpy(mgr.write_pages)[:, :T], be.to_numpy(mgr.write_offsets)[:T]
        assert np.array_equal(wp, be.to_numpy(twin.write_pages)[:, :T])
        assert np.array_equal(wo, be.to_numpy(twin.write_offsets)[:T])
        want_p, want_o = expected_write_positions(mgr.spec, plain, step.num_tokens, step.start_positions)
        assert np.array_equal(wp, want_p) and np.array_equal(wo, want_o), f"step {step.id}: write positions"
        # the same read off the null-slot tables, mapping the null page back to BAD
        np_p, _ = expected_write_positions(mgr.spec, expected_tables(mgr, table, step), step.num_tokens,
                                           step.start_positions, null_slots=self.nulls)
        assert np.array_equal(wp, np_p)
        assert (wp != BAD).all(), f"step {step.id}: a new token has no page"
        for layer in range(geo.num_layers):
            g = int(geo.layer_group[layer])
            assert not (wp[layer] // geo.group_scale[g] == self.nulls[g]).any(), "a write targets the null slot"
        self.seen["tokens"] += T

        # CSR views: the twin's content (real pages only)
        for g in geo.groups:
            scratch = (not geo.shared and step.num_contexts and
                       (step.scratch_ends[g.index] > step.scratch_begs[g.index]).any())
            if not scratch:
                assert csr_of(be, csr_views(step, g.index)) == csr_of(be, csr_views(tstep, g.index))
                self.seen["csr"] += 1
        for layer in range(geo.num_layers):
            got = csr_of(be, csr_views(step, layer=layer))
            assert got == csr_of(be, csr_views(tstep, layer=layer)), f"step {step.id}: layer {layer} CSR"
            g = int(geo.layer_group[layer])
            assert not any(i // int(geo.group_scale[g]) == self.nulls[g] for i in got[1]), "CSR lists a null page"
            self.seen["csr"] += 1

        # storage: write every layer, then read K and V of every BAD cell through the null-slot tables
        heads, dim = mgr.spec.num_kv_heads, mgr.spec.head_dim
        for layer in range(geo.num_layers):
            kv = self.rng.uniform(0.5, 1.5, (2, T, heads, dim)).astype(np.float32)
            self.storage.write(step, layer, kv[0], kv[1])
        mgr.backend.stream.synchronize()
        for layer in range(geo.num_layers):
            g = int(geo.layer_group[layer])
            pages = be.to_numpy(self.storage.pages(g))
            plane = g if geo.shared else layer
            koff = int(geo.layer_koff[layer]) if geo.shared else 0
            cells = out[plane, :live, 0][np.concatenate([plain[plane, :, 0] == BAD,
                                                         np.ones((live - n, plain.shape[-1]), bool)])] + koff
            assert not pages[cells].any() and not pages[cells + 1].any(), "a BAD cell reads a non-zero page"
        step.finish()
        tstep.finish()
        self.seen["steps"] += 1
        return step, tstep

    def settle(self, step, tstep, accepted):
        self.mgr.settle(step, accepted)
        self.twin.settle(tstep, accepted)


def run_workload(ls: Lockstep, num_steps=40):
    """Arrivals, chunked prefill (chunks up to 96 tokens, two at a time), decode of 1 or 2 tokens with
    rejections, frees after a few tokens, and stretches without arrivals (steady decode: DELTA steps)."""
    rng = np.random.default_rng(3)
    prompts, sched, gen = {}, {}, {}
    next_id = 0
    spec = ls.mgr.spec
    for it in range(num_steps):
        if len(prompts) < spec.max_batch - 1 and (it % 8 == 0 or not prompts):
            for _ in range(int(rng.integers(1, 3))):
                if len(prompts) < spec.max_batch - 1:
                    rid = f"r{next_id}"
                    next_id += 1
                    prompts[rid], sched[rid], gen[rid] = int(rng.integers(20, 200)), 0, 0
                    ls.mgr.add(rid, prompts[rid])
                    ls.twin.add(rid, prompts[rid])
        ctx = {r: min(96, prompts[r] - sched[r]) for r in prompts if sched[r] < prompts[r]}
        ctx = dict(list(ctx.items())[:2])
        dec = [r for r in prompts if sched[r] >= prompts[r]]
        k = 2 if spec.max_rewind >= 1 and it % 2 else 1
        if not ctx and not dec:
            continue
        step, tstep = ls.step(ctx, dec, k)
        accepted = {r: int(rng.integers(1, k + 1)) if k > 1 else 1 for r in dec}
        ls.settle(step, tstep, accepted)
        for r, n in ctx.items():
            sched[r] += n
        for r in dec:
            sched[r] += accepted[r]
            gen[r] += accepted[r]
            if gen[r] >= 12 or sched[r] + 2 >= spec.max_seq_len:
                ls.mgr.free(r)
                ls.twin.free(r)
                del prompts[r], sched[r], gen[r]
    ls.mgr.synchronize()
    ls.twin.synchronize()


@pytest.mark.parametrize("pad", [0, 6], ids=["no_pad", "pad_to_6"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("run", RUNS, ids=["host", "cuda", "cuda_graphs"])
def test_null_slot_tables_against_reference(run, mode, pad, monkeypatch):
    backend_name, use_graphs = run
    backend_or_skip(backend_name)
    if use_graphs:              # every step replays, small ones too (the "cuda" run launches them)
        replay_every_step(monkeypatch)
    ls = Lockstep(backend_name, mode, use_graphs, pad)
    run_workload(ls)
    mgr = ls.mgr
    mgr.verify_mirror()                 # the mirror keeps BAD: it equals the host table
    check_slots(mgr)
    assert mgr.stats()["groups"][0]["total"] == SLOTS - 1       # the null slot is never in a pool
    for g in range(mgr.layout.num_groups):
        assert not ls.storage.null_pages(g).any(), f"group {g}: the null slot's pages were written"
    assert ls.storage.errors() == 0, "a write was skipped"
    seen = ls.seen
    assert seen["steps"] >= 30 and seen["bad_cells"] > 1000 and seen["tokens"] > 300 and seen["csr"] > 100
    assert seen["delta"] > 0, "the workload never had a steady (DELTA) step"
    if pad:
        assert seen["pad_rows"] > 0
    if mode == "per_layer_tpb16":
        assert seen["scratch"] > 0, "the workload never used scratch blocks"


def test_null_slot_off_keeps_bad():
    """Without null_slot the tables keep BAD (the plain contract) and the storage has no null pages."""
    mgr = cupykv.KVCacheManager(make_spec("per_layer_tpb16", False, SLOTS), backend="host")
    assert null_slots(mgr) is None and mgr.layout.null_slots is None
    mgr.add("a", 40)
    step = mgr.prepare_batch({"a": 40}, pad_to=3)
    step.ready.synchronize()
    out = mgr.backend.to_numpy(mgr.out)
    assert (out[:, 1:3] == BAD).all() and (out[:, 0] == BAD).any()
    assert KVStorage(mgr).null_pages(0) is None
    step.finish()


def test_null_slot_needs_two_slots():
    with pytest.raises(cupykv.InvalidSpecError, match="null_slot"):
        cupykv.KVCacheManager(make_spec("shared", True, 1), backend="host")
