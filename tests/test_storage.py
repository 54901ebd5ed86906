"""Write positions and KV storage.

- Write positions (mgr.write_pages / write_offsets) against a host model: each new token's page is the
  reference table's entry (cupykv.reference, from the host table at prepare) for its block, its offset
  is its position mod tpb; positions come from the test's own model of the sequence lengths.
- The CUDA write-positions kernel against the host emulation on random snapshots, bit for bit.
- KVStorage: shapes, dtypes, write + read-back, and the end-to-end invariant: after layer l of a step is
  written, every key position visible to the step's queries (window applied) reads the value written for
  it, through layer l's table of that step (scratch pages included).

Host-backend parts run in CI; CUDA parts skip without a GPU.
"""
import sys

import numpy as np
import pytest

import cupykv
from cupykv.backends.host import HostBackend
from cupykv.layout import Layout
from cupykv.spec import CacheSpec
from cupykv.staging import pack_snapshot, snapshot_words
from cupykv.storage import KVStorage, StorageDtypeError
from conftest import backend_or_skip, expected_tables

BAD = -1
MODES = {
    # Gemma-like 5:1 with scratch reuse, multi-token decode with rejections
    "per_layer_scratch": dict(windows=[16] * 5 + [None], max_rewind=2),
    # GPT-OSS-like alternation, three groups with sinks
    "per_layer_sinks": dict(windows=[8, None, 24, 8, None, 24], sink_tokens=4, max_rewind=1),
    # SHARED tables (no scratch)
    "shared": dict(windows=[16, None] * 2, table_mode="shared", swa_scratch_reuse=False, max_rewind=1),
}


def make_mgr(backend_name, mode, **kw):
    args = dict(num_kv_heads=2, head_dim=4, tokens_per_block=8, max_seq_len=256, max_batch=6,
                slots_per_group=200, max_step_tokens=256, dtype="float32")
    args.update(MODES[mode])
    args.update(kw)
    return cupykv.KVCacheManager(CacheSpec(**args), backend=backend_name)


def drive(mgr, on_step, num_steps=36, seed=0, chunk=40, max_new=6):
    """A deterministic serving workload: arrivals, chunked prefill, decode (2 tokens with rejections when
    max_rewind allows), frees. on_step(step, table_at_prepare, starts) runs after prepare, before finish;
    starts[k] is the test's own model of entry k's first new position."""
    rng = np.random.default_rng(seed)
    prompts, sched, gen = {}, {}, {}
    next_id = 0
    for it in range(num_steps):
        if len(prompts) < mgr.spec.max_batch - 1 and (it % 3 == 0 or not prompts):
            rid = f"r{next_id}"
            next_id += 1
            prompts[rid] = int(rng.integers(5, 90))
            sched[rid], gen[rid] = 0, 0
            mgr.add(rid, prompts[rid])
        ctx = {r: min(chunk, prompts[r] - sched[r]) for r in prompts if sched[r] < prompts[r]}
        ctx = dict(list(ctx.items())[:2])
        dec = [r for r in prompts if sched[r] >= prompts[r]]
        k = 2 if mgr.spec.max_rewind >= 1 and it % 2 else 1
        if not ctx and not dec:
            continue
        step = mgr.prepare_batch(ctx, dec, num_gen_tokens=k)
        table = mgr.table.copy()
        starts = [sched[r] for r in step.request_ids]
        on_step(step, table, starts)
        step.finish()
        accepted = {}
        for r in dec:
            accepted[r] = int(rng.integers(1, k + 1)) if k > 1 else 1
        mgr.settle(step, accepted)
        for r, n in ctx.items():
            sched[r] += n
        for r in dec:
            sched[r] += accepted[r]
            gen[r] += accepted[r]
            if gen[r] >= max_new:
                mgr.free(r)
                del prompts[r], sched[r], gen[r]
    mgr.synchronize()


def token_model(step, starts, tpb):
    """(entry, position, block, offset) of every new token of the step, batch order."""
    ent, pos = [], []
    for k, (n, s0) in enumerate(zip(step.num_tokens, starts)):
        ent += [k] * int(n)
        pos += list(range(s0, s0 + int(n)))
    ent, pos = np.array(ent, np.int64), np.array(pos, np.int64)
    return ent, pos, pos // tpb, pos % tpb


def expected_write_pages(mgr, table, step, starts):
    ref = expected_tables(mgr, table, step)          # [planes, num_seqs, 2, B]
    lay = mgr.layout
    ent, pos, blk, off = token_model(step, starts, lay.tpb)
    pages = np.empty((lay.num_layers, len(ent)), np.int64)
    for l in range(lay.num_layers):
        if mgr.spec.table_mode == "shared":
            k = ref[lay.layer_group[l], ent, 0, blk].astype(np.int64)
            pages[l] = np.where(k == BAD, BAD, k + lay.layer_koff[l])
        else:
            pages[l] = ref[l, ent, 0, blk]
    return pages, off


@pytest.mark.parametrize("mode", sorted(MODES))
def test_write_positions_match_host_model(backend_name, mode):
    mgr = make_mgr(backend_name, mode)
    be = mgr.backend
    checked = {"tokens": 0, "scratch": 0}

    def on_step(step, table, starts):
        step.ready.synchronize()
        n = int(step.num_tokens.sum())
        got_pages = be.to_numpy(mgr.write_pages)[:, :n]
        got_off = be.to_numpy(mgr.write_offsets)[:n]
        want_pages, want_off = expected_write_pages(mgr, table, step, starts)
        assert np.array_equal(got_off, want_off), f"step {step.id}: offsets differ"
        assert np.array_equal(got_pages, want_pages), f"step {step.id}: pages differ"
        assert (got_pages != BAD).all(), f"step {step.id}: a new token has no page"
        checked["tokens"] += n
        if step.scratch_ends is not None and step.scratch_ends.size:
            checked["scratch"] += int((step.scratch_ends - step.scratch_begs).sum())

    drive(mgr, on_step)
    assert checked["tokens"] > 300
    if mode == "per_layer_scratch":
        assert checked["scratch"] > 0, "the workload never used scratch blocks"


# -- the CUDA step kernel on corrupt input ----------------------------------------------------------------

def random_step(rng, layout, capacity):
    """A random valid snapshot (counts and positions only matter here)."""
    spec = layout.spec
    n = int(rng.integers(1, spec.max_batch + 1))
    tokens = rng.integers(0, 12, n)
    while tokens.sum() > capacity:
        tokens //= 2
    cu = np.concatenate(([0], np.cumsum(tokens))).astype(np.int32)
    start = rng.integers(0, spec.max_seq_len - 12, n).astype(np.int32)
    P = layout.num_groups
    empty = np.empty(0, np.int64)
    buf = np.zeros(snapshot_words(n, 0, P, 0, 0, 0) + 8, np.int32)
    words = pack_snapshot(buf, 7, np.arange(n, dtype=np.int32), np.zeros((P, 0), np.int32),
                          np.zeros((P, 0), np.int32), np.zeros((P, 0, 0), np.int32), empty, empty, cu, start)
    return buf[:words], int(cu[-1])


def test_step_kernel_survives_corrupt_snapshot():
    """Garbage counts and rows (as the unsafe staging mode can produce) write inside the buffers and never
    fault; offsets stay in [0, tpb)."""
    backend_or_skip("cuda")
    import cupy
    from cupykv.backends.cuda import CudaBackend
    from cupykv.staging import H_NUM_SEQS, H_OFF_COPY_IDX, H_OFF_CU_TOKENS, H_OFF_START_POS, MODE_FULL
    from test_cuda_kernels import make_consts
    rng = np.random.default_rng(2)
    spec = CacheSpec(windows=[32, None], num_kv_heads=1, head_dim=8, tokens_per_block=16, max_seq_len=500,
                     max_batch=4, slots_per_group=50, max_step_tokens=64)
    lay = Layout(spec)
    cuda = CudaBackend()
    cc = make_consts(lay, cuda)
    for _ in range(10):
        snap, _ = random_step(rng, lay, 64)
        h = snap[:16]
        n = int(h[H_NUM_SEQS])
        snap[h[H_OFF_CU_TOKENS]:h[H_OFF_CU_TOKENS] + n + 1] = rng.integers(-1000, 1000, n + 1)
        snap[h[H_OFF_START_POS]:h[H_OFF_START_POS] + n] = rng.integers(-10 ** 9, 10 ** 9, n)
        snap[h[H_OFF_COPY_IDX]:h[H_OFF_COPY_IDX] + n] = rng.integers(-10 ** 9, 10 ** 9, n)
        h[H_NUM_SEQS] = int(rng.integers(0, 2 * spec.max_batch))
        with cuda.stream:
            dsnap = cupy.asarray(snap.copy())
            dsnap = cupy.concatenate([dsnap, cupy.zeros(64, np.int32)])   # a too-large num_seqs stays inside
            mirror = cupy.asarray(rng.integers(-1, 50, (lay.num_groups, spec.max_batch, lay.max_blocks)).astype(np.int32))
            out = cupy.zeros((lay.num_layers, spec.max_batch, 2, lay.max_blocks), np.int32)
            row_entry = cupy.full((spec.max_batch, 2), -1, np.int32)
            dp = cupy.zeros((lay.num_layers, 64), np.int32)
            do = cupy.zeros(64, np.int32)
        cuda.build_step(cuda.stream, dsnap, mirror, out, row_entry, dp, do, cc, False, MODE_FULL)
        cuda.stream.synchronize()
        assert ((cupy.asnumpy(do) >= 0) & (cupy.asnumpy(do) < lay.tpb)).all()


# -- KVStorage ------------------------------------------------------------------------------------------

def storage_or_skip(mgr, dtype):
    try:
        return KVStorage(mgr, dtype=dtype)
    except StorageDtypeError as exc:
        assert dtype == "bfloat16" and "ml_dtypes" in str(exc) or "bfloat16" in str(exc)
        pytest.skip(f"bfloat16 storage is not available here: {exc}")


def test_storage_shapes_and_views():
    mgr = make_mgr("host", "per_layer_sinks")
    st = KVStorage(mgr)
    lay = mgr.layout
    assert st.num_groups == lay.num_groups
    for g, arr in zip(lay.groups, st.arrays):
        assert arr.shape == (200, g.scale, 8, 2, 4) and arr.dtype == np.float32
        view = st.pages(g.index)
        assert view.shape == (200 * g.scale, 8, 2, 4)
        assert np.shares_memory(view, arr)
        for layer in g.layers:
            assert st.layer_pages(layer).shape == view.shape
    # page p of the view is [p // scale, p % scale] of the array
    g = lay.groups[0]
    st.arrays[0][3, 1] = 7.0
    assert (st.pages(0)[3 * g.scale + 1] == 7.0).all()
    # storage without a manager
    st2 = KVStorage(Layout(mgr.spec), HostBackend(), "float16")
    assert st2.arrays[0].dtype == np.float16 and st2.manager is None
    assert st2.nbytes == sum(a.nbytes for a in st2.arrays)


def test_storage_dtype_errors(monkeypatch):
    mgr = make_mgr("host", "shared")
    with pytest.raises(StorageDtypeError, match="float64"):
        KVStorage(mgr, dtype="float64")
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)     # as if it were not installed
    with pytest.raises(StorageDtypeError, match="ml_dtypes") as info:
        KVStorage(mgr, dtype="bfloat16")
    assert isinstance(info.value, cupykv.CupykvError) and isinstance(info.value, TypeError)


def test_storage_write_validation():
    mgr = make_mgr("host", "shared")
    st = KVStorage(mgr)
    mgr.add("a", 10)
    step = mgr.prepare_batch({"a": 10})
    with pytest.raises(cupykv.InvalidRequestError, match="shape"):
        st.write(step, 0, np.zeros((9, 2, 4)), np.zeros((10, 2, 4)))
    with pytest.raises(cupykv.InvalidRequestError, match="layer"):
        st.write(step, 99, np.zeros((10, 2, 4)), np.zeros((10, 2, 4)))
    step.finish()
    mgr.settle(step)
    step2 = mgr.prepare_batch((), ["a"])
    with pytest.raises(cupykv.StepOrderError, match="latest"):
        st.write(step, 0, np.zeros((10, 2, 4)), np.zeros((10, 2, 4)))
    st.write(step2, 0, np.ones((1, 2, 4)), np.ones((1, 2, 4)))
    step2.finish()
    mgr.synchronize()
    assert st.errors() == 0


def kv_value(layer, rid, pos, shape):
    """A deterministic K (V = -K) for a token: distinct per (layer, request, position)."""
    base = (layer * 1000 + int(rid[1:]) * 37 + pos) % 2000
    return (base / 64.0 + np.arange(int(np.prod(shape))).reshape(shape) / 256.0).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_storage_write_and_read_through_tables(backend_name, mode, dtype):
    mgr = make_mgr(backend_name, mode)
    st = storage_or_skip(mgr, dtype)
    be, lay, xp = mgr.backend, mgr.layout, mgr.backend.xp
    H, D, tpb = mgr.spec.num_kv_heads, mgr.spec.head_dim, lay.tpb
    windows = mgr.spec.windows_tuple
    sinks = mgr.spec.sinks_per_layer()
    counts = {"keys": 0}

    def as_dtype(a):
        return np.asarray(a).astype(st.dtype).astype(np.float32)

    def on_step(step, table, starts):
        ent, pos, _, _ = token_model(step, starts, tpb)
        rids = step.request_ids
        for l in range(lay.num_layers):
            k = np.stack([kv_value(l, rids[e], p, (H, D)) for e, p in zip(ent, pos)])
            st.write(step, l, xp.asarray(k), xp.asarray(-k))
            # read back at the write positions
            gk, gv = st.gather(step, l)
            assert np.array_equal(np.asarray(be.to_numpy(gk), np.float32), as_dtype(k))
            assert np.array_equal(np.asarray(be.to_numpy(gv), np.float32), as_dtype(-k))
            # every key visible to the step's queries, through layer l's table of this step
            tab = be.to_numpy(mgr.out)
            pages = np.asarray(be.to_numpy(st.layer_pages(l)), np.float32)
            plane = lay.layer_group[l] if mgr.spec.table_mode == "shared" else l
            koff = lay.layer_koff[l] if mgr.spec.table_mode == "shared" else 0
            W = windows[l]
            for e in range(step.num_seqs):
                q_hi = starts[e] + int(step.num_tokens[e]) - 1
                q_lo = starts[e]
                lo = 0 if W is None else max(0, q_lo - W + 1)
                keys = list(range(0, min(sinks[l], q_hi + 1))) if W is not None else []
                keys = sorted(set(keys + list(range(lo, q_hi + 1))))
                for j in keys:
                    pk = int(tab[plane, e, 0, j // tpb])
                    pv = int(tab[plane, e, 1, j // tpb])
                    assert pk != BAD and pv != BAD, f"step {step.id} layer {l}: key {j} has no page"
                    pk, pv = pk + koff, pv + koff
                    want = as_dtype(kv_value(l, rids[e], j, (H, D)))
                    assert np.array_equal(pages[pk, j % tpb], want), f"step {step.id} layer {l} key {j}: K"
                    assert np.array_equal(pages[pv, j % tpb], -want), f"step {step.id} layer {l} key {j}: V"
                    counts["keys"] += 1

    drive(mgr, on_step, num_steps=24)
    assert st.errors() == 0
    assert counts["keys"] > 1000
