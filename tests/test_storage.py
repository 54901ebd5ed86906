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
import math
import sys

import numpy as np
import pytest

import cupykv
from cupykv.backends.host import DeviceBlockedError, HostBackend
from cupykv.layout import Layout
from cupykv.spec import CacheSpec
from cupykv.staging import pack_snapshot, snapshot_words
from cupykv.storage import KVStorage, StorageDtypeError, bf16_bits_to_f32, f32_to_bf16_bits
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
            row_entry = cupy.full(spec.max_batch, -1, np.int32)
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


@pytest.mark.parametrize("dtype", [5, [1], "float64"])
def test_storage_dtype_that_is_not_one(dtype):
    with pytest.raises(StorageDtypeError, match="storage dtype"):
        KVStorage(make_mgr("host", "shared"), dtype=dtype)


@pytest.mark.parametrize("owner", [None, "manager", 0])
def test_storage_needs_a_manager_or_a_layout(owner):
    with pytest.raises(cupykv.InvalidRequestError, match="KVCacheManager or a Layout"):
        KVStorage(owner)


def test_storage_write_validation():
    mgr = make_mgr("host", "shared")
    st = KVStorage(mgr)
    mgr.add("a", 10)
    step = mgr.prepare_batch({"a": 10})
    with pytest.raises(cupykv.InvalidRequestError, match="shape"):
        st.write(step, 0, np.zeros((9, 2, 4), np.float32), np.zeros((10, 2, 4), np.float32))
    for bad in (99, -1, 1.7, True, "1"):
        with pytest.raises(cupykv.InvalidRequestError, match="write: layer="):
            st.write(step, bad, np.zeros((10, 2, 4), np.float32), np.zeros((10, 2, 4), np.float32))
        with pytest.raises(cupykv.InvalidRequestError, match="gather: layer="):
            st.gather(step, bad)
    step.finish()
    mgr.settle(step)
    step2 = mgr.prepare_batch((), ["a"])
    with pytest.raises(cupykv.StepOrderError, match="latest"):
        st.write(step, 0, np.zeros((10, 2, 4), np.float32), np.zeros((10, 2, 4), np.float32))
    st.write(step2, np.int32(0), np.ones((1, 2, 4), np.float32), np.ones((1, 2, 4), np.float32))
    k, v = st.gather(step2, np.uint8(0))
    assert (k == 1).all() and (v == 1).all()
    step2.finish()
    mgr.synchronize()
    assert st.errors() == 0


def test_page_views_take_a_group_or_layer_in_range():
    """-1 read the last group's pages (Python indexing) before."""
    mgr = make_mgr("host", "shared", null_slot=True)
    st = KVStorage(mgr)
    for call, what in ((st.pages, "pages: group"), (st.null_pages, "null_pages: group"),
                       (st.group_of, "group_of: layer"), (st.layer_pages, "group_of: layer")):
        for bad in (-1, 99, 1.0, True):
            with pytest.raises(cupykv.InvalidRequestError, match=what):
                call(bad)
    assert st.pages(np.int8(1)).shape[0] == mgr.layout.slots_per_group[1] * mgr.layout.groups[1].scale
    assert st.group_of(np.uint16(1)) == int(mgr.layout.layer_group[1])


def test_gather_on_another_stream_waits_for_the_step():
    """The write positions are the step's only once it is ready: a gather on a consumer stream waits on
    step.ready as write() does (before, it read them at once). The manager stream is gated, so the step's
    build cannot have run: the host backend's gather, which waits for its stream, cannot complete."""
    mgr = make_mgr("host", "shared")
    st = KVStorage(mgr)
    be = mgr.backend
    consumer = be.new_stream("consumer")
    mgr.add("a", 8)
    gate = be.gate(be.stream)
    step = mgr.prepare_batch({"a": 8})
    with pytest.raises(DeviceBlockedError):
        st.gather(step, 0, stream=consumer)
    gate.open()
    k = np.full((8, mgr.spec.num_kv_heads, mgr.spec.head_dim), 5, np.float32)
    st.write(step, 0, k, k, stream=consumer)
    assert (st.gather(step, 0, stream=consumer)[0] == 5).all()
    step.finish(consumer)
    mgr.settle(step)


def test_write_and_gather_need_the_latest_unfinished_step_of_the_manager():
    """A write or gather enqueued after the step's finish is covered by no event: the next step may reuse
    the write positions and the released slots before it runs (a late write of a freed request's step, held
    on a consumer stream, landed in the next request's KV). Both calls refuse a finished step, a stale one
    and another manager's, as well as things that are not arrays or streams."""
    mgr = make_mgr("host", "shared", slots_per_group=4, max_batch=2)
    st = KVStorage(mgr)
    H, D = mgr.spec.num_kv_heads, mgr.spec.head_dim
    kv = lambda n, x: np.full((n, H, D), x, np.float32)     # noqa: E731
    mgr.add("a", 8)
    s0 = mgr.prepare_batch({"a": 8})
    st.write(s0, 0, kv(8, 1), kv(8, 1))
    s0.finish()
    mgr.settle(s0)
    for call in (lambda: st.write(s0, 0, kv(8, 2), kv(8, 2)), lambda: st.gather(s0, 0)):
        with pytest.raises(cupykv.StepOrderError, match="was finished"):
            call()
    mgr.free("a")
    mgr.synchronize()
    mgr.add("b", 8)
    s1 = mgr.prepare_batch({"b": 8})
    for bad, needle in ((s1.num_tokens.tolist(), "list"), (None, "NoneType")):
        with pytest.raises(cupykv.InvalidRequestError, match=needle):
            st.write(s1, 0, bad, kv(8, 3))
    with pytest.raises(cupykv.InvalidRequestError, match="stream='x'"):
        st.write(s1, 0, kv(8, 3), kv(8, 3), stream="x")
    with pytest.raises(cupykv.InvalidRequestError, match="stream='x'"):
        st.gather(s1, 0, stream="x")
    other = make_mgr("host", "shared")
    other.add("z", 8)
    with pytest.raises(cupykv.StepOrderError, match="manager"):
        st.gather(other.prepare_batch({"z": 8}), 0)
    with pytest.raises(cupykv.StepOrderError, match="manager"):
        st.gather(None, 0)
    st.write(s1, 0, kv(8, 3), kv(8, 3))
    assert (st.gather(s1, 0)[0] == 3).all()
    s1.finish()
    mgr.settle(s1)
    s2 = mgr.prepare_batch((), ["b"])
    with pytest.raises(cupykv.StepOrderError, match="latest"):
        st.gather(s1, 0)
    s2.finish()
    mgr.synchronize()
    slot = int(mgr.table[0, mgr.request("b").row, 0])
    assert (st.pages(0)[slot * mgr.layout.groups[0].scale] == 3).all()     # b's K, untouched by a's
    assert st.errors() == 0


def test_errors_count_skipped_tokens_of_writes_on_another_stream(backend_name):
    """A write on a consumer stream whose write pages are BAD skips every token; errors() waits for that
    write (not only for the manager stream) and counts them."""
    mgr = make_mgr(backend_name, "per_layer_scratch")
    st = KVStorage(mgr)
    mgr.add("a", 10)
    step = mgr.prepare_batch({"a": 10})
    mgr.synchronize()
    be = mgr.backend
    if be.xp is np:
        mgr.write_pages[1, :10] = cupykv.BAD
    else:
        with be.stream:
            mgr.write_pages[1, :10] = cupykv.BAD
    side = be.new_stream()
    kv = be.xp.ones((10, mgr.spec.num_kv_heads, mgr.spec.head_dim), np.float32)
    st.write(step, 1, kv, kv, stream=side)
    st.write(step, 0, kv, kv, stream=side)
    assert st.errors() == 10
    step.finish()


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


# -- dtypes: every float source into every storage dtype, from numpy, CuPy and torch ---------------------
#
# The oracle rounds exactly: a value of the source dtype, as a float64 (exact for all of them), is rounded to
# the storage format's precision by integer arithmetic (Python's round() is half-to-even on the exact value).

FORMATS = {"float16": (11, -14, 15), "bfloat16": (8, -126, 127), "float32": (24, -126, 127)}   # bits, emin, emax
WORDS = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32}


def round_to(x: float, storage: str) -> float:
    """x rounded to the nearest value of `storage` (ties to even; past the largest finite value: inf)."""
    bits, emin, emax = FORMATS[storage]
    if not np.isfinite(x) or x == 0:
        return x
    e = max(math.frexp(abs(x))[1] - 1, emin)           # |x| in [2^e, 2^(e+1)); subnormals use emin's spacing
    ulp = 2.0 ** (e - bits + 1)
    r = round(abs(x) / ulp) * ulp                      # exact: ulp is a power of two
    r = math.inf if r >= 2.0 ** (emax + 1) else r
    return math.copysign(r, x)


def expected_words(values: np.ndarray, storage: str) -> np.ndarray:
    """The storage words of `values` (float64) rounded to `storage`."""
    rounded = np.array([round_to(float(x), storage) for x in values.ravel()]).reshape(values.shape)
    if storage == "bfloat16":                          # exact in float32, and bfloat16 is its top half
        return (rounded.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return rounded.astype(storage).view(WORDS[storage])


def bf16_value(words: np.ndarray) -> np.ndarray:
    """The values of raw bfloat16 words, from the format's definition (float64)."""
    w = words.astype(np.int64)
    sign = np.where(w & 0x8000, -1.0, 1.0)
    exp, man = (w >> 7) & 0xFF, (w & 0x7F).astype(np.float64)
    value = np.where(exp == 0, man / 128 * 2.0 ** -126, (1 + man / 128) * 2.0 ** (exp.astype(np.float64) - 127))
    value = np.where(exp == 0xFF, np.where(man == 0, np.inf, np.nan), value)
    return sign * value


def source_values(rng, source: str, shape) -> np.ndarray:
    """float64 values that the source dtype holds exactly: random ones, ties of every narrowing (halfway
    between two bfloat16 / float16 neighbours), tiny and huge ones."""
    n = int(np.prod(shape))
    if source == "bfloat16":
        words = rng.integers(0, 0x10000, n).astype(np.uint16)
        words[(words & 0x7F80) == 0x7F80] &= 0xBFFF                    # finite only: clear an exponent bit
        return bf16_value(words).reshape(shape)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
    f32_ties = (np.float32(1.0) + np.arange(8, dtype=np.float32) * np.float32(2.0 ** -8)
                + np.float32(2.0 ** -9)).astype(np.float64)             # halfway between bfloat16 neighbours
    x[:8] = f32_ties * [1, -1, 2, -2, 3e-3, -3e3, 1e-38, 3e38]
    x[8] = 1 + 2.0 ** -11                                              # halfway between float16 neighbours
    with np.errstate(over="ignore"):                                   # float16 holds the large ones as inf
        return x.astype(source).astype(np.float64).reshape(shape)


def make_source(producer: str, source: str, values: np.ndarray, device: str):
    """values as a `source` array of `producer` ('numpy', 'cupy', 'torch' on `device`, 'cpu' or 'cuda')."""
    if source == "bfloat16":
        words = expected_words(values, "bfloat16")                     # exact: values are bfloat16 already
        if producer == "torch":
            torch = pytest.importorskip("torch", reason="torch is not installed")
            return torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).to(device)
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 numpy/CuPy arrays need ml_dtypes")
        if producer == "cupy":
            import cupy
            return cupy.asarray(words).view(ml_dtypes.bfloat16)
        return words.view(ml_dtypes.bfloat16)
    host = values.astype(source)
    if producer == "numpy":
        return host
    if producer == "cupy":
        import cupy
        return cupy.asarray(host)
    torch = pytest.importorskip("torch", reason="torch is not installed")
    return torch.from_numpy(host).to(device)


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("source", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("producer", ["numpy", "cupy", "torch"])
def test_write_converts_every_source_dtype(backend_name, producer, source, storage):
    """K/V of every float dtype, from each producer, land in the storage rounded to nearest even, or copied
    as raw words when the dtypes match."""
    if producer == "cupy" and backend_name != "cuda":
        pytest.skip("CuPy arrays go to the CUDA backend's storage")
    mgr = make_mgr(backend_name, "per_layer_sinks")
    st = storage_or_skip(mgr, storage)
    mgr.add("r0", 12)
    step = mgr.prepare_batch({"r0": 12})
    shape = (12, mgr.spec.num_kv_heads, mgr.spec.head_dim)
    values = source_values(np.random.default_rng(7), source, shape)
    device = "cuda" if backend_name == "cuda" else "cpu"
    k, v = (make_source(producer, source, x, device) for x in (values, -values))
    st.write(step, 0, k, v)
    gk, gv = st.gather(step, 0)
    got_k, got_v = (np.asarray(mgr.backend.to_numpy(g)).view(WORDS[storage]) for g in (gk, gv))
    assert np.array_equal(got_k, expected_words(values, storage)), f"K {producer} {source} -> {storage}"
    assert np.array_equal(got_v, expected_words(-values, storage)), f"V {producer} {source} -> {storage}"
    step.finish()
    assert st.errors() == 0


def test_write_rejects_non_float_dtypes_before_writing():
    mgr = make_mgr("host", "shared")
    st = KVStorage(mgr)
    mgr.add("a", 10)
    step = mgr.prepare_batch({"a": 10})
    ok = np.ones((10, 2, 4), np.float32)
    for bad in (np.ones((10, 2, 4), np.int32), np.ones((10, 2, 4), np.complex64), np.ones((10, 2, 4), bool)):
        message = f"v has dtype {bad.dtype.name}; float32 storage takes float16"
        with pytest.raises(StorageDtypeError, match=message) as info:
            st.write(step, 0, ok, bad)
        assert isinstance(info.value, cupykv.CupykvError)
    step.finish()
    mgr.synchronize()
    assert not any(a.any() for a in st.arrays), "a rejected write changed the storage"


def test_bf16_rounding_matches_the_exact_oracle():
    """f32_to_bf16_bits against exact rounding over random float32 bit patterns (every exponent, subnormals)
    and the edge cases: ties both ways, the overflow threshold, zeros, infinities; NaN stays NaN."""
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    edge = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x00008000,
                     0x00018000, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF],
                    np.uint32)
    x = np.concatenate((words, edge)).view(np.float32)
    got = f32_to_bf16_bits(np, x)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], expected_words(x[~nan].astype(np.float64), "bfloat16"))
    assert np.isnan(bf16_value(got[nan])).all()
    assert np.array_equal(got[nan] & 0x8000, (x[nan].view(np.uint32) >> 16).astype(np.uint16) & 0x8000)
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (a second oracle) is not installed")
    assert np.array_equal(got[~nan], x[~nan].astype(ml_dtypes.bfloat16).view(np.uint16))


def test_bf16_widening_is_exact():
    words = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):                                # signalling NaNs stay NaN
        got = bf16_bits_to_f32(np, words).astype(np.float64)
    want = bf16_value(words)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


def test_write_on_the_consumers_torch_stream_needs_no_event():
    """pages_to_torch(storage, g, None, stream) reads what write(..., stream=the same torch stream) wrote:
    the write is ordered on that stream (after step.ready), so no event is needed in between."""
    backend_or_skip("cuda")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cupykv import interop
    mgr = make_mgr("cuda", "per_layer_sinks")
    st = KVStorage(mgr, dtype="float16")
    mgr.add("r0", 12)
    step = mgr.prepare_batch({"r0": 12})
    values = source_values(np.random.default_rng(5), "float32", (12, 2, 4))
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        k = torch.from_numpy(values.astype(np.float32)).to("cuda", non_blocking=True)
        st.write(step, 0, k, -k, stream=ts)
        pages = interop.pages_to_torch(st, st.group_of(0), None, ts)
        p = interop.write_positions_to_torch(step, ts)[0][0].long()
        o = interop.write_positions_to_torch(step, ts)[1].long()
        got = pages[p, o].clone()
    interop.finish_on_torch(step, ts)
    ts.synchronize()
    assert np.array_equal(got.cpu().numpy().view(np.uint16), expected_words(values, "float16"))
