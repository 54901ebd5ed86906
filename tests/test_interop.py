"""cupykv.interop: CSR views, the missing-torch error, and torch handoff through DLPack.

- CSR views (group and layer level, fresh and fixed-capacity buffers) against an independent compaction
  of the reference tables (cupykv.reference, from the host table at prepare). Host backend in CI. With
  CacheSpec(null_slot=True) too: the lists are the plain tables' (real pages only, no null page).
- Without torch, interop raises InteropUnavailableError naming the package. In CI.
- With torch on the host backend: CPU tensors share the numpy buffers.
- GPU: zero-copy round trips (int32 tables, bfloat16 pages), keep-alive, and stream ordering proven with
  a gate: the manager stream is held, a consumer on another torch stream reads the tables through
  to_torch, the gate opens, and the consumer saw this step's tables. The same read without the explicit
  wait sees the previous step's tables, so the wait is what orders it.
"""
import sys
import time

import numpy as np
import pytest

import cupykv
from cupykv import interop
from cupykv.interop import CsrBuffers, InteropUnavailableError, csr_views
from conftest import backend_or_skip
from oracle import expected_tables
from test_storage import drive, make_mgr

BAD = -1


def torch_or_skip():
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed; the torch interop tests need it (pip install torch)")
    return torch


def torch_cuda_or_skip():
    backend_or_skip("cuda")
    torch = torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA (or sees no GPU); the GPU suite runs on the H200")
    return torch


def reference_csr(mgr, table, step, plane, koff, rows_from="layer"):
    """Independent CSR: per batch entry the non-BAD K entries of the reference row, in block order. The
    plain tables (BAD, no null slot): with null_slot=True the lists are the same, real pages only."""
    ref = expected_tables(mgr, table, step, null_slot=False)
    indptr, indices = [0], []
    for s in range(step.num_seqs):
        row = ref[plane, s, 0].astype(np.int64)
        keep = row[row != BAD] + koff
        indices += keep.tolist()
        indptr.append(len(indices))
    tpb = mgr.layout.tpb
    lens = [int(a) + int(b) for a, b in zip(step.start_positions, step.num_tokens)]
    last = [(n - 1) % tpb + 1 for n in lens]
    return np.array(indptr, np.int32), np.array(indices, np.int32), np.array(last, np.int32)


def check_csr(mgr, csr, table, step, plane, koff, rank=0):
    be = mgr.backends[rank]
    want_ptr, want_idx, want_last = reference_csr(mgr, table, step, plane, koff)
    assert np.array_equal(csr.indptr_host, want_ptr)
    assert np.array_equal(csr.last_page_len_host, want_last)
    csr.ready.synchronize()
    assert np.array_equal(be.to_numpy(csr.kv_indptr), want_ptr)
    assert np.array_equal(be.to_numpy(csr.kv_indices), want_idx)
    assert np.array_equal(be.to_numpy(csr.kv_last_page_len), want_last)
    assert ((want_last >= 1) & (want_last <= mgr.layout.tpb)).all()
    # the last listed page of each sequence holds its last token: it is the table's entry for that block
    ref = expected_tables(mgr, table, step)
    for s in range(step.num_seqs):
        last_block = (int(csr.seq_lens_host[s]) - 1) // mgr.layout.tpb
        assert want_idx[want_ptr[s + 1] - 1] == ref[plane, s, 0, last_block] + koff


@pytest.mark.parametrize("null_slot", [False, True], ids=["bad", "null_slot"])
@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("mode", ["per_layer_scratch", "per_layer_sinks", "shared"])
def test_csr_views_against_reference(backend_name, mode, fixed, null_slot):
    mgr = make_mgr(backend_name, mode, null_slot=null_slot)
    lay = mgr.layout
    shared = mgr.spec.table_mode == "shared"
    buffers = CsrBuffers(mgr) if fixed else None
    seen = {"group": 0, "layer": 0, "refused": 0}

    def ptr(a):
        return a.data.ptr if hasattr(a.data, "ptr") else a.__array_interface__["data"][0]

    def on_step(step, table, starts):
        for g in lay.groups:
            scratch = (not shared and step.num_contexts and
                       (step.scratch_ends[g.index] > step.scratch_begs[g.index]).any())
            if scratch:
                with pytest.raises(cupykv.InvalidRequestError, match="layer="):
                    csr_views(step, g.index, buffers=buffers)
                seen["refused"] += 1
            else:
                csr = csr_views(step, g.index, buffers=buffers)
                check_csr(mgr, csr, table, step, g.index if shared else g.layers[0], 0)
                seen["group"] += 1
        for l in range(lay.num_layers):
            csr = csr_views(step, layer=l, buffers=buffers)
            plane = lay.layer_group[l] if shared else l
            check_csr(mgr, csr, table, step, plane, lay.layer_koff[l] if shared else 0)
            seen["layer"] += 1
            if fixed:    # the fixed-capacity buffers are used in place
                assert ptr(csr.kv_indptr) == ptr(buffers.indptr)
                assert ptr(csr.kv_indices_buffer) == ptr(buffers.indices)
                assert ptr(csr.kv_last_page_len) == ptr(buffers.last_page_len)

    drive(mgr, on_step, num_steps=20)
    assert seen["group"] > 10 and seen["layer"] > 40
    if mode == "per_layer_scratch":
        assert seen["refused"] > 0


def test_csr_views_of_each_device(backend_name):
    """A device's view of a step (step.on(rank)) goes to csr_views as the step does: each device's lists,
    from its own tables, against the reference."""
    from test_devices import two_devices
    mgr = cupykv.KVCacheManager(make_mgr(backend_name, "per_layer_sinks").spec, backend=backend_name,
                                devices=two_devices(backend_name))
    lay, checked = mgr.layout, [0, 0]

    def on_step(step, table, starts):
        for rank in range(len(mgr.devices)):
            view = step.on(rank)
            for layer in range(lay.num_layers):     # layer lists: defined with scratch blocks too
                check_csr(mgr, csr_views(view, layer=layer), table, view, layer, 0, rank)
            checked[rank] += 1

    drive(mgr, on_step, num_steps=12)
    assert checked[0] == checked[1] > 5


def test_csr_views_argument_errors():
    mgr = make_mgr("host", "shared")
    mgr.add("a", 20)
    step = mgr.prepare_batch({"a": 20})
    with pytest.raises(cupykv.InvalidRequestError, match="exactly one"):
        csr_views(step)
    with pytest.raises(cupykv.InvalidRequestError, match="exactly one"):
        csr_views(step, 0, layer=0)
    with pytest.raises(cupykv.InvalidRequestError, match=r"group=7 must be in \[0, 1\]"):
        csr_views(step, 7)
    for bad in (1.7, True, "1", -1):
        with pytest.raises(cupykv.InvalidRequestError, match="layer="):
            csr_views(step, layer=bad)
    csr_views(step, layer=np.int64(1)).ready.synchronize()     # numpy ints are counts
    with pytest.raises(cupykv.StepOrderError, match="not a Step"):
        csr_views(None, 0)
    with pytest.raises(cupykv.InvalidRequestError, match="CsrBuffers"):
        csr_views(step, 0, buffers="x")
    for rank in (1, -1, 0.0):           # a one-device manager; -1 read the last device before
        with pytest.raises(cupykv.InvalidRequestError, match="rank"):
            CsrBuffers(mgr, rank=rank)
    step.finish()
    with pytest.raises(cupykv.StepOrderError, match="was finished"):   # its CSR work would follow the finish
        csr_views(step, 0)
    mgr.settle(step)
    mgr.prepare_batch((), ["a"])
    with pytest.raises(cupykv.StepOrderError, match="latest"):
        csr_views(step, 0)


@pytest.mark.parametrize("export", ["tables_to_torch", "write_positions_to_torch"])
def test_torch_exports_refuse_a_step_whose_buffers_moved_on(export):
    """The exports hand out the fixed-address buffers; those hold a step's tables only until the next
    prepare, and may be overwritten once it is finished: both are refused before torch is imported (so in
    CI too), as csr_views refuses them, instead of handing out a later step's tables ordered after an
    older step's ready event. Not a Step: refused by name."""
    fn = getattr(interop, export)
    mgr = make_mgr("host", "shared")
    mgr.add("a", 20)
    step = mgr.prepare_batch({"a": 20})
    for bad in (None, "step", mgr):
        with pytest.raises(cupykv.StepOrderError, match=f"{export}: step=.* is not a Step"):
            fn(bad)
    step.finish()
    with pytest.raises(cupykv.StepOrderError, match=f"{export}: step 0 was finished"):
        fn(step)
    mgr.settle(step)
    later = mgr.prepare_batch((), ["a"])
    with pytest.raises(cupykv.StepOrderError, match=f"{export}: step 0 is not the latest"):
        fn(step)
    with pytest.raises(cupykv.StepOrderError, match="is not the latest"):
        fn(step.on(0))
    later.finish()
    mgr.settle(later)


def test_cupy_stream_without_cupy_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupykv.backends.cuda", None)     # its import now fails, as without CuPy
    with pytest.raises(InteropUnavailableError, match="needs CuPy"):
        interop.cupy_stream(object())


def test_missing_torch_raises_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)     # `import torch` now raises ImportError
    mgr = make_mgr("host", "shared")
    mgr.add("a", 20)
    step = mgr.prepare_batch({"a": 20})
    for call in (lambda: interop.tables_to_torch(step), lambda: interop.to_torch(mgr.out, step),
                 lambda: interop.write_positions_to_torch(step)):
        with pytest.raises(InteropUnavailableError, match="'torch' package is not installed") as info:
            call()
        assert isinstance(info.value, ImportError) and isinstance(info.value, cupykv.CupykvError)
    # the rest works without torch
    step.finish()
    mgr.settle(step)
    assert csr_views(mgr.prepare_batch((), ["a"]), 0).indptr_host.tolist() == [0, 3]   # 21 tokens, tpb 8


def test_host_backend_torch_tensors_share_buffers():
    torch = torch_or_skip()
    mgr = make_mgr("host", "per_layer_scratch")
    mgr.add("a", 40)
    step = mgr.prepare_batch({"a": 40})
    t = interop.tables_to_torch(step)                  # waits (host) for the step's tables
    assert t.dtype == torch.int32 and tuple(t.shape) == mgr.out.shape
    assert np.shares_memory(t.numpy(), mgr.out)
    pages, offs = interop.write_positions_to_torch(step)
    assert tuple(pages.shape) == (6, 40) and offs.tolist() == [i % 8 for i in range(40)]
    interop.finish_on_torch(step)
    mgr.settle(step)


# -- GPU --------------------------------------------------------------------------------------------

def cuda_mgr(**kw):
    return make_mgr("cuda", "per_layer_scratch", **kw)


def test_dlpack_round_trip_int32_tables():
    torch = torch_cuda_or_skip()
    import cupy
    mgr = cuda_mgr()
    for r in "abc":
        mgr.add(r, 30)
    step = mgr.prepare_batch({r: 30 for r in "abc"})
    table = mgr.table.copy()
    ts = torch.cuda.Stream()
    t = interop.tables_to_torch(step, ts)
    assert t.dtype == torch.int32 and tuple(t.shape) == mgr.out.shape
    assert t.data_ptr() == mgr.out.data.ptr, "not zero-copy"
    with torch.cuda.stream(ts):
        got = t[:, :3].cpu().numpy()
    assert np.array_equal(got, expected_tables(mgr, table, step))
    pages, offs = interop.write_positions_to_torch(step, ts)
    assert pages.data_ptr() == mgr.write_pages.data.ptr and tuple(pages.shape) == (6, 90)
    with torch.cuda.stream(ts):
        assert np.array_equal(pages.cpu().numpy(), cupy.asnumpy(mgr.write_pages[:, :90]))
        assert offs.cpu().tolist() == [i % 8 for i in range(30)] * 3
    # and back: torch -> cupy shares the same memory
    back = cupy.from_dlpack(t)
    assert back.data.ptr == mgr.out.data.ptr
    interop.finish_on_torch(step, ts)
    mgr.settle(step)
    mgr.synchronize()


def test_dlpack_round_trip_bfloat16_pages():
    torch = torch_cuda_or_skip()
    import cupy
    from cupykv.storage import KVStorage, StorageDtypeError
    mgr = cuda_mgr()
    try:
        st = KVStorage(mgr, dtype="bfloat16")
    except StorageDtypeError as exc:
        pytest.skip(f"bfloat16 storage unavailable: {exc}")
    mgr.add("a", 20)
    step = mgr.prepare_batch({"a": 20})
    with mgr.backend.stream:                                # inputs ready on the stream that writes them
        k = cupy.arange(20 * 2 * 4, dtype=np.float32).reshape(20, 2, 4) / 8
        nk = -k
    st.write(step, 2, k, nk)
    g = mgr.layout.layer_group[2]
    ts = torch.cuda.Stream()
    wt = torch.cuda.Event()
    ev = mgr.backend.record(mgr.backend.stream)            # after the write, on the manager stream
    pages = interop.pages_to_torch(st, g, ev, ts)
    assert pages.dtype == torch.bfloat16 and pages.data_ptr() == st.pages(g).data.ptr
    assert tuple(pages.shape) == st.pages(g).shape
    wp, wo = interop.write_positions_to_torch(step, ts)
    with torch.cuda.stream(ts):
        got = pages[wp[2].long(), wo.long()].float().cpu().numpy()
        gotv = pages[wp[2].long() + 1, wo.long()].float().cpu().numpy()
        pages[0, 0, 0, 0] = 3.5                              # torch writes, cupy reads
        wt.record(ts)
    assert np.array_equal(got, cupy.asnumpy(k)) and np.array_equal(gotv, -cupy.asnumpy(k))
    wt.synchronize()
    assert float(st.pages(g)[0, 0, 0, 0].astype(np.float32)) == 3.5
    interop.finish_on_torch(step, ts)
    mgr.settle(step)
    mgr.synchronize()


def test_exported_tensor_keeps_owner_alive():
    torch = torch_cuda_or_skip()
    import cupy
    import gc
    a = cupy.arange(1 << 20, dtype=np.int32)
    ev = cupy.cuda.Event()
    ev.record()
    t = interop.to_torch(a, ev)
    ptr = a.data.ptr
    del a
    gc.collect()
    b = cupy.full(1 << 20, 7, np.int32)                    # would reuse the block if it had been freed
    assert b.data.ptr != ptr
    torch.cuda.synchronize()
    assert int(t[12345].item()) == 12345


@pytest.mark.parametrize("explicit_wait", [True, False], ids=["to_torch", "no_wait_reads_stale"])
def test_consumer_stream_ordered_by_explicit_wait(explicit_wait):
    """Hold the manager stream with a gate; a torch consumer on its own stream reads the next step's tables.

    With to_torch (explicit wait on step.ready) the consumer is held too and then sees the new tables.
    Without the wait (plain torch.from_dlpack, CuPy's current stream being the default one) it runs at
    once and reads the previous step's tables: this variant asserts that failure, proving the wait matters.
    """
    torch = torch_cuda_or_skip()
    import cupy
    mgr = cuda_mgr()
    be = mgr.backend
    for r in "abc":
        mgr.add(r, 40)
    s0 = mgr.prepare_batch({r: 40 for r in "abc"})
    s0.finish()
    mgr.settle(s0)
    mgr.synchronize()
    old = cupy.asnumpy(mgr.out)
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):        # warm up the torch kernels used below: loading a kernel module while
        torch.from_dlpack(mgr.out)[:, :3].clone().cpu()   # the gate spins would block until it times out
    ts.synchronize()
    gate = be.gate(be.stream)
    try:
        step = mgr.prepare_batch((), ["c", "a", "b"])      # another order: other rows in every plane
        table = mgr.table.copy()
        want = expected_tables(mgr, table, step)
        assert not np.array_equal(old[:, :3], want), "the test needs tables that differ from the last step's"
        if explicit_wait:
            t = interop.tables_to_torch(step, ts)
        else:
            t = torch.from_dlpack(mgr.out)
        done = torch.cuda.Event()
        with torch.cuda.stream(ts):
            snap = t[:, :3].clone()
            done.record(ts)
        if explicit_wait:
            time.sleep(0.05)
            assert not done.query(), "the consumer ran while the manager stream was held"
            gate.open()
            ts.synchronize()
            assert np.array_equal(snap.cpu().numpy(), want)
        else:
            ts.synchronize()                                  # completes with the gate still closed
            got = snap.cpu().numpy()
            assert np.array_equal(got, old[:, :3]) and not np.array_equal(got, want), \
                "without the explicit wait the consumer should read the previous step's tables"
            gate.open()
    finally:
        gate.open()
    interop.finish_on_torch(step, ts)
    mgr.synchronize()
    assert not gate.close_timeout_hit()


def test_finish_on_torch_orders_next_step():
    """finish_on_torch records on the torch stream: the next step's conversion waits for it."""
    torch = torch_cuda_or_skip()
    mgr = cuda_mgr()
    be = mgr.backend
    mgr.add("a", 30)
    s0 = mgr.prepare_batch({"a": 30})
    ts = torch.cuda.Stream()
    interop.tables_to_torch(s0, ts)
    gate = be.gate(interop.cupy_stream(ts))                  # hold the consumer's stream
    try:
        interop.finish_on_torch(s0, ts)
        mgr.settle(s0)
        s1 = mgr.prepare_batch((), ["a"])
        time.sleep(0.05)
        assert not s0.finished.done() and not s1.ready.done(), "the next step did not wait for the consumer"
        gate.open()
        s1.ready.synchronize()
        assert s0.finished.done()
    finally:
        gate.open()
    s1.finish()
    mgr.synchronize()
    assert not gate.close_timeout_hit()


def test_csr_views_to_torch_on_gpu():
    torch = torch_cuda_or_skip()
    mgr = cuda_mgr()
    for r in "ab":
        mgr.add(r, 50)
    s0 = mgr.prepare_batch({"a": 50, "b": 50})
    s0.finish()
    mgr.settle(s0)
    step = mgr.prepare_batch((), ["b", "a"])
    table = mgr.table.copy()
    csr = csr_views(step, 1)                                 # the full-attention group
    ts = torch.cuda.Stream()
    indptr = interop.to_torch(csr.kv_indptr, csr, ts)
    indices = interop.to_torch(csr.kv_indices, csr, ts)
    last = interop.to_torch(csr.kv_last_page_len, csr, ts)
    want_ptr, want_idx, want_last = reference_csr(mgr, table, step, mgr.layout.groups[1].layers[0], 0)
    with torch.cuda.stream(ts):
        assert indptr.cpu().numpy().tolist() == want_ptr.tolist()
        assert indices.cpu().numpy().tolist() == want_idx.tolist()
        assert last.cpu().numpy().tolist() == want_last.tolist()
    interop.finish_on_torch(step, ts)
    mgr.synchronize()


def test_a_host_torch_consumer_reads_what_write_wrote_without_an_event():
    """Host backend: KVStorage.write has run when it returns, so torch CPU tensors over the pages see it
    at once (one consumer code for both backends: a GPU consumer reads on the stream it wrote on)."""
    torch = pytest.importorskip("torch")
    from cupykv import interop
    spec = cupykv.CacheSpec(windows=[None, 8], num_kv_heads=2, head_dim=4, tokens_per_block=4, max_seq_len=64,
                            max_batch=2, slots_per_group=8, dtype="float32")
    mgr = cupykv.KVCacheManager(spec, backend="host")
    storage = cupykv.KVStorage(mgr)
    mgr.add("a", 6)
    step = mgr.prepare_batch({"a": 6})
    pages_k, offsets = interop.write_positions_to_torch(step)
    for layer in range(2):
        k = torch.randn(6, 2, 4)
        v = torch.randn(6, 2, 4)
        storage.write(step, layer, k, v)
        pages = interop.pages_to_torch(storage, storage.group_of(layer))      # no event passed
        assert torch.equal(pages[pages_k[layer].long(), offsets.long()], k)
        assert torch.equal(pages[pages_k[layer].long() + 1, offsets.long()], v)
    step.finish()
