"""CUDA graphs: consumers captured once read the right pages through the fixed-address tables for many
steps of a changing workload; and the manager's own step runs as graph replays (use_graphs=True).

The capture tests need a GPU; the manager's graph path is also exercised on the host backend by the
race tests and the property test (the host backend enqueues the same work op by op).
"""
import numpy as np
import pytest

import cupykv
from conftest import backend_or_skip, expected_tables

PAD = 8          # the consumer's fixed batch size

CONSUMER = r"""
extern "C" __global__ void read_through_tables(const int* tables, const float* pages, int page_elems,
                                               long long n, int* seen_index, float* seen_value)
{
    // Copy the table entries the consumer would use and read the first element of every page they name.
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int p = tables[i];
        seen_index[i] = p;
        seen_value[i] = p < 0 ? -1.0f : pages[(long long)p * page_elems];
    }
}
"""


def workload(mgr, rng, steps):
    """Yields prepared steps of a changing workload: arrivals, chunked prefill with scratch, decode,
    finishes (rows and slots reused), stale releases. At most PAD entries per step."""
    prompts, decoding, next_rid = {}, {}, 0
    for _ in range(steps):
        while len(prompts) + len(decoding) < PAD - 1 and rng.random() < 0.5:
            n = int(rng.integers(20, 400))
            mgr.add(next_rid, n)
            prompts[next_rid] = n
            next_rid += 1
        ctx = {r: min(160, left) for r, left in list(prompts.items())[:2]}
        gen = list(decoding)
        if not ctx and not gen:
            continue
        step = mgr.prepare_batch(ctx, gen, pad_to=PAD)
        yield step
        mgr.settle(step)
        for r, n in ctx.items():
            prompts[r] -= n
            if not prompts[r]:
                del prompts[r]
                decoding[r] = int(rng.integers(5, 60))
        for r in gen:
            decoding[r] -= 1
            if not decoding[r]:
                del decoding[r]
                mgr.free(r)


def make(use_graphs):
    spec = cupykv.CacheSpec(windows=[32, None, 32, 32], num_kv_heads=1, head_dim=4, tokens_per_block=8,
                            max_seq_len=1024, max_batch=12, slots_per_group=[96, 400], dtype="float32")
    return cupykv.KVCacheManager(spec, backend="cuda", use_graphs=use_graphs)


@pytest.mark.parametrize("use_graphs", [False, True])
def test_captured_cupy_consumer_reads_the_right_pages(use_graphs):
    backend_or_skip("cuda")
    import cupy

    mgr = make(use_graphs)
    lay = mgr.layout
    # Pages the consumer reads: page p of group g holds the value g * 1e6 + p in its first element.
    page_elems = lay.tpb * mgr.spec.num_kv_heads * mgr.spec.head_dim
    total_pages = max(n * g.scale for n, g in zip(lay.slots_per_group, lay.groups))
    pages = cupy.zeros((lay.num_groups, total_pages, page_elems), cupy.float32)
    pages[:, :, 0] = cupy.arange(total_pages, dtype=cupy.float32)[None, :] + \
        1e6 * cupy.arange(lay.num_groups, dtype=cupy.float32)[:, None]
    kernel = cupy.RawKernel(CONSUMER, "read_through_tables")
    cs = cupy.cuda.Stream(non_blocking=True)
    L, B = lay.num_layers, lay.max_blocks
    n = PAD * 2 * B
    seen_index = cupy.zeros((L, PAD, 2, B), cupy.int32)
    seen_value = cupy.zeros((L, PAD, 2, B), cupy.float32)

    def launch(stream):
        # One launch per layer: each layer reads its group's pages through its rows [0, PAD) of the tables.
        for layer in range(L):
            g = int(lay.layer_group[layer])
            kernel((64,), (128,), (mgr.out[layer], pages[g], np.int32(page_elems), np.int64(n),
                                   seen_index[layer], seen_value[layer]), stream=stream)

    launch(cs)                       # compile and load before capturing
    cs.synchronize()
    cs.begin_capture()
    launch(cs)
    graph = cs.end_capture()

    rng = np.random.default_rng()
    checked = 0
    for step in workload(mgr, rng, 120):
        table = mgr.table.copy()
        cs.wait_event(step.ready.event)
        graph.launch(cs)
        step.finish(cs)
        cs.synchronize()
        want = np.full((L, PAD, 2, B), cupykv.BAD, np.int32)
        want[:, :step.num_seqs] = expected_tables(mgr, table, step)
        got = cupy.asnumpy(seen_index)
        assert np.array_equal(got, want), f"step {step.id}: the captured consumer saw other tables"
        values = cupy.asnumpy(seen_value)
        group_of_layer = lay.layer_group[:, None, None, None]
        want_values = np.where(want < 0, -1.0, want + 1e6 * group_of_layer).astype(np.float32)
        assert np.array_equal(values, want_values), f"step {step.id}: the consumer read other pages"
        checked += 1
    assert checked > 60
    if use_graphs:
        assert mgr.backend._graphs, "the manager never replayed a step graph"


@pytest.mark.parametrize("use_graphs", [False, True])
def test_captured_torch_consumer(use_graphs):
    backend_or_skip("cuda")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import cupy
    from cupykv import interop

    mgr = make(use_graphs)
    L, B = mgr.layout.num_layers, mgr.layout.max_blocks
    tables = interop.to_torch(mgr.out, None)                 # zero-copy view; fixed address
    dest = torch.empty((L, PAD, 2, B), dtype=torch.int32, device=tables.device)
    ts = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(ts):
        dest.copy_(tables[:, :PAD])                          # warm-up outside the capture
        ts.synchronize()
        with torch.cuda.graph(graph, stream=ts):
            dest.copy_(tables[:, :PAD])
    cs = cupy.cuda.Stream.from_external(ts)
    rng = np.random.default_rng()
    checked = 0
    for step in workload(mgr, rng, 80):
        table = mgr.table.copy()
        cs.wait_event(step.ready.event)
        with torch.cuda.stream(ts):
            graph.replay()
        step.finish(cs)
        ts.synchronize()
        want = np.full((L, PAD, 2, B), cupykv.BAD, np.int32)
        want[:, :step.num_seqs] = expected_tables(mgr, table, step)
        assert np.array_equal(dest.cpu().numpy(), want), f"step {step.id}"
        checked += 1
    assert checked > 40
