"""CUDA graphs: consumers captured once read the right pages through the fixed-address tables for many
steps of a changing workload; the manager's own step runs as graph replays (use_graphs=True); with its
graphs captured up front, no prepare_batch waits for the device while a gate holds the manager stream;
and the first capture in a fresh process loads no kernel behind the gate (run as a script, this file
runs that check in a fresh process: see the end of the file). A capture can still wait for the device
in its graph's instantiation (docs/design.md, "CUDA graphs"), so no test here asserts that a capture in a busy
process, with many graphs alive, does not.

The capture tests need a GPU; the manager's graph path is also exercised on the host backend by the
race tests and the property test (the host backend enqueues the same work op by op).
"""
import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest

import cupykv
from conftest import backend_or_skip, expected_tables, graph_count, replay_every_step
from oracle import Capture

PAD = 8          # the consumer's fixed batch size


@pytest.fixture(autouse=True)
def _replays(monkeypatch):
    """Every step here replays its graph, small ones too (see replay_every_step)."""
    replay_every_step(monkeypatch)

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


def make_spec() -> cupykv.CacheSpec:
    return cupykv.CacheSpec(windows=[32, None, 32, 32], num_kv_heads=1, head_dim=4, tokens_per_block=8,
                            max_seq_len=1024, max_batch=12, slots_per_group=[96, 400], dtype="float32")


def make(use_graphs, backend="cuda"):
    return cupykv.KVCacheManager(make_spec(), backend=backend, use_graphs=use_graphs)


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


# -- prepare_batch never waits for the device while it captures a graph -------------------------------------
#
# A gate holds the manager stream while a scheduler thread prepares a burst of steps, each of which needs a
# graph no earlier step had (a new batch-size bucket), and a consumer on its own stream waits on each
# step.ready. Every prepare_batch must return while its step is still queued behind the gate: its ready
# event not done and the gate not timed out. A prepare that waited for the device would return only once
# the gate let go on its own (GATE_S); the thread join bounds how long the test waits for that.

GATE_S = 30.0        # a gate nobody opens lets its stream go after this long
JOIN_S = 20.0        # the scheduler thread's time for the whole burst before the test calls it blocked
PROMPTS = {"p0": 40, "p1": 30, "p2": 30, "p3": 20, "p4": 20, "p5": 20}
BURST = (({"p0": 40}, []),                                      # batch buckets 1, 2, 4, then 8
         ({"p1": 30, "p2": 30}, []),
         ({"p3": 20, "p4": 20, "p5": 20}, []),
         ({}, list(PROMPTS)))


def gated_burst(mgr, gate_s: float = GATE_S, join_s: float = JOIN_S) -> dict:
    """Run BURST behind a gate (see above) and report what prepare_batch saw. Keys: blocked (the thread was
    still in the burst after join_s), blocked_in (its stack then: the call that waited), seen (per step:
    [ready done, gate timed out] when prepare_batch returned), timed_out, mismatches (steps whose tables
    differ from the reference), new_graphs."""
    be = mgr.backend
    for rid, n in PROMPTS.items():
        mgr.add(rid, n)
    cap = Capture(mgr).reserve(len(BURST))
    graphs_before = graph_count(be)
    gate = be.gate(be.stream, timeout_s=gate_s) if be.name == "cuda" else be.gate(be.stream)
    seen, errors = [], []

    def schedule():
        try:
            for contexts, generation in BURST:
                step = mgr.prepare_batch(contexts, generation)
                seen.append([step.ready.done(), gate.close_timeout_hit()])
                cap.consume(step)
                mgr.settle(step)
        except BaseException as exc:      # re-raised in the test's thread
            errors.append(exc)

    worker = threading.Thread(target=schedule, daemon=True)
    worker.start()
    worker.join(join_s)
    blocked = worker.is_alive()
    frame = sys._current_frames().get(worker.ident) if blocked else None
    blocked_in = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else ""
    gate.open()
    worker.join()
    mgr.synchronize()
    cap.stream.synchronize()
    if errors:
        raise errors[0]
    return dict(blocked=blocked, blocked_in=blocked_in, seen=seen, timed_out=gate.close_timeout_hit(),
                mismatches=cap.mismatches(), new_graphs=graph_count(be) - graphs_before)


def check_burst(result: dict, new_graphs: int) -> None:
    assert not result["blocked"], (f"prepare_batch was still inside the burst {JOIN_S} s after the gate closed: "
                                   f"it waited for the gated manager stream, in\n{result['blocked_in']}")
    assert result["seen"] == [[False, False]] * len(BURST), (
        f"[ready done, gate timed out] at each return: {result['seen']}; a prepare_batch returned only after "
        "the device ran its step or the gate let go, so it waited for the device")
    assert not result["timed_out"]
    assert result["mismatches"] == [], f"steps with wrong tables: {result['mismatches']}"
    assert result["new_graphs"] == new_graphs, "the burst did not capture the graphs this test is about"


def capture_up_front(mgr) -> int:
    """Every step graph the manager's ring slots can need, captured now."""
    return mgr.capture_graphs()


def test_up_front_buckets_cover_the_pipelines_rounding():
    """Every bucket the pipeline rounds a count to (batch size, tokens, copy words) is one that
    capture_up_front enumerates, so an up-front capture leaves no key for prepare_batch to capture."""
    from cupykv.staging import pow2_at_least, pow2_buckets
    for lowest, cap in ((1, 12), (1, 256), (256, 4096), (256, 100), (1024, 1210), (1024, 700)):
        buckets = set(pow2_buckets(lowest, cap))
        rounded = {min(pow2_at_least(max(n, lowest)), cap) for n in range(1, cap + 1)}
        assert rounded == buckets, (lowest, cap)


def test_a_burst_behind_a_gate_does_not_block_prepare_on_the_host_backend():
    """The host backend runs the burst without graphs: its prepare_batch must not wait for the simulated
    stream either. (On a GPU the burst's captures could wait in their instantiation: the up-front and
    fresh-process tests below cover the GPU.)"""
    check_burst(gated_burst(make(use_graphs=True, backend="host")), new_graphs=0)


def test_first_capture_in_a_fresh_process_does_not_wait_for_the_device():
    """The same burst in a new process, where no kernel of the step module was ever loaded: under lazy
    loading the first graph instantiation would load them, and loading may synchronize the context."""
    backend_or_skip("cuda")
    result = run_fresh_process()
    before = result["loading"]["before"]
    assert all(v in (True, None) for v in before["kernels"].values()), (
        f"step kernels not loaded before the first capture: {before}")
    check_burst(result, new_graphs=len(BURST))


def test_a_kernel_module_loaded_behind_the_gate_blocks_prepare():
    """The variant without the fix blocks: the same burst in a fresh process whose backend loads its step
    module on first use (CudaBackend(preload=False), the loading of before the fix). The first capture
    then loads the module (cuModuleLoadData) while the gate holds the manager stream, and the driver makes
    the host wait for the gate: check_burst must fail on it. This is what makes the test above a test."""
    backend_or_skip("cuda")
    result = run_fresh_process("--no-preload", "--gate-s", "8", "--join-s", "4")
    assert result["loading"]["before"]["kernels"] == {}, "the step module was loaded before the gate closed"
    with pytest.raises(AssertionError, match="waited for the gated manager stream"):
        check_burst(result, new_graphs=len(BURST))
    assert "_module_kernels" in result["blocked_in"], (
        f"the burst blocked somewhere other than the module load:\n{result['blocked_in']}")
    assert result["mismatches"] == [], f"steps with wrong tables once the gate let go: {result['mismatches']}"


def test_graphs_captured_up_front_leave_prepare_nothing_to_capture():
    """capture_step_graphs covers every graph the pipeline asks for: the gated burst and a workload of
    shrinking batches, steady (DELTA), DELTA steps that write entries whole, and FULL steps capture
    nothing more, and every table is right."""
    backend_or_skip("cuda")
    mgr = make(use_graphs=True)
    captured = capture_up_front(mgr)
    assert captured == mgr.backend.num_step_graphs > 0
    assert capture_up_front(mgr) == 0, "a second up-front capture captured again"
    check_burst(gated_burst(mgr), new_graphs=0)
    cap, live, modes = Capture(mgr), list(PROMPTS), set()
    for i in range(24):
        batch = list(live)
        if i % 8 == 2 and len(batch) > 1:     # two entries change: DELTA, both written whole
            batch[0], batch[1] = batch[1], batch[0]
        if i % 8 == 5:                        # every entry changes: FULL
            batch = batch[::-1]
        step = mgr.prepare_batch((), batch)
        modes.add(step.mode)
        cap.consume(step)
        cap.stream.synchronize()          # every ring slot free again: no slot grows or gets added
        mgr.settle(step)
        if i % 4 == 3 and len(live) > 1:
            mgr.free(live.pop())
    assert mgr.backend.num_step_graphs == captured, "a prepare_batch captured a graph the up-front pass missed"
    assert cap.mismatches() == []
    assert len(modes) == 2, f"the workload never ran both modes: {modes}"


def run_fresh_process(*args: str) -> dict:
    """Run this file as a script (a new Python process) and return its JSON report."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=GATE_S + JOIN_S + 300)
    assert proc.returncode == 0, f"the fresh process failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fresh_process_report(preload: bool, gate_s: float = GATE_S, join_s: float = JOIN_S) -> dict:
    """gated_burst in this process, with a new backend, plus the driver's loading state of the kernels
    before and after. preload=False is the loading of before the fix: nothing loads the step module before
    the first prepare_batch, which loads it (compile, cuModuleLoadData) behind the gate."""
    from cupykv.backends.cuda import CudaBackend
    be = CudaBackend(preload=preload)
    mgr = cupykv.KVCacheManager(make_spec(), backend=be, use_graphs=True)
    before = be.kernel_loading_state()
    result = gated_burst(mgr, gate_s, join_s)
    result["loading"] = {"before": before, "after": be.kernel_loading_state()}
    return result


PROBE_S = 5.0


def _record_error(call, errors: list) -> None:
    try:
        call()
    except Exception as exc:
        errors.append(exc)


def probe_host_waits() -> dict:
    """Diagnosis, not a test: which CUDA calls make the host wait while a gate holds another stream. Each
    runs on a thread while a fresh gate spins; True: it had not returned after PROBE_S (it waited for the
    gate), or the error it raised. Kernels are "new" when no earlier call launched, loaded or instantiated
    them; everything a probe needs besides its one call is made before its gate closes."""
    import cupy
    from cupy.cuda import runtime
    from cupykv.backends.cuda import CudaBackend, finish_loading
    be = CudaBackend()
    held, side, capture = be.new_stream(), be.new_stream(), be.new_stream()
    with side:
        word = cupy.zeros(1, np.int32)
    count = iter(range(1000))

    def new_module():
        """(module, kernel name): a module of its own (unique source), not compiled or loaded yet."""
        name = f"cupykv_probe_{next(count)}"
        return cupy.RawModule(code=f'extern "C" __global__ void {name}(int* p) {{ p[0] += 1; }}'), name

    def new_kernel():
        """A kernel whose module is loaded (compiled, cuModuleLoadData, cuModuleGetFunction), never launched."""
        raw, name = new_module()
        return raw.get_function(name)

    def graph_of(kernel):
        capture.begin_capture()
        kernel((1,), (1,), (word,), stream=capture)
        return capture.end_capture()

    warm = new_kernel()
    warm((1,), (1,), (word,), stream=side)
    be.synchronize()
    kept = []
    probes = {
        "create a stream": lambda: kept.append(cupy.cuda.Stream(non_blocking=True)),
        "compile and load a new module": lambda m=new_module(): kept.append(m[0].get_function(m[1])),
        "cuFuncLoad a new kernel": lambda k=new_kernel(): finish_loading(k.kernel.ptr),
        "first launch of a new kernel": lambda k=new_kernel(): k((1,), (1,), (word,), stream=side),
        "capture and instantiate a graph of a new kernel": lambda k=new_kernel(): kept.append(graph_of(k)),
        "capture and instantiate a graph of a loaded kernel": lambda: kept.append(graph_of(warm)),
        "upload a new graph on an idle stream": lambda g=graph_of(warm): g.upload(side),
        "first launch of a new graph, not uploaded, on an idle stream": lambda g=graph_of(warm): g.launch(side),
        "first launch of a new graph, not uploaded, on the held stream": lambda g=graph_of(warm): g.launch(held),
        "cudaMalloc 256 MiB": lambda: kept.append(("free", runtime.malloc(256 << 20))),
        "cudaHostAlloc 64 MiB": lambda: kept.append(("freeHost", runtime.hostAlloc(64 << 20, 0))),
    }
    be.synchronize()
    waited = {}
    for name, call in probes.items():
        gate = be.gate(held, timeout_s=GATE_S)
        errors = []
        worker = threading.Thread(target=_record_error, args=(call, errors), daemon=True)
        worker.start()
        worker.join(PROBE_S)
        waited[name] = worker.is_alive()
        gate.open()
        worker.join()
        be.synchronize()
        if errors:
            waited[name] = f"raised {errors[0]!r}"
    for item in kept:
        if isinstance(item, tuple):
            getattr(runtime, item[0])(item[1])
    return {"loading_mode": be.kernel_loading_state()["mode"], "waited": waited}


if __name__ == "__main__":
    # python tests/test_graphs.py [--no-preload] [--gate-s S] [--join-s S] | --probe: the fresh-process
    # burst (one JSON line); with --no-preload, the kernel loading from before the fix; --probe:
    # probe_host_waits().
    if "--probe" in sys.argv[1:]:
        print(json.dumps(probe_host_waits()))
    else:
        argv = sys.argv[1:]
        replay_every_step(pytest.MonkeyPatch())      # as the fixture does for the tests in this process

        def seconds(flag: str, default: float) -> float:
            return float(argv[argv.index(flag) + 1]) if flag in argv else default

        print(json.dumps(fresh_process_report("--no-preload" not in argv, seconds("--gate-s", GATE_S),
                                              seconds("--join-s", JOIN_S))))
