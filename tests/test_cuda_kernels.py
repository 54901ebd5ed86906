"""The pipeline kernels against the NumPy oracle (cupykv.reference), bit for bit.

Every test draws fresh random inputs; the seed is printed (pytest shows it for a failing test) and
CUPYKV_TEST_SEED=<seed> replays it. The host backend's emulated kernels run everywhere; the CUDA
kernels run where CuPy sees a GPU.
"""
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from cupykv import reference
from cupykv.backends.host import HostBackend
from cupykv.layout import Layout
from cupykv.spec import CacheSpec
from cupykv.staging import pack_snapshot, runs_from_cells, snapshot_words, unpack_snapshot

BAD = -1
SENTINEL = 12345          # pre-fills outputs: rows >= num_seqs must still hold it afterwards
NUM_SLOTS = 1000
ROUNDS = 3                # fresh random cases per parametrisation

SPECS = {
    # GPT-OSS-like alternation: two groups of equal scale
    "swa128_full_x3": dict(windows=[128, None] * 3, tokens_per_block=16, max_seq_len=480, max_batch=8),
    # Gemma-like 5:1: scales 20 and 4
    "swa_5to1": dict(windows=([64] * 5 + [None]) * 2, tokens_per_block=16, max_seq_len=1000, max_batch=6),
    # smallest B (4): one quad per row
    "full_only_b4": dict(windows=[None] * 3, tokens_per_block=32, max_seq_len=64, max_batch=4),
    # three groups with sinks, scales 6, 4 and 2
    "three_groups": dict(windows=[32, 256, None, 32, 256, 32], sink_tokens=4, tokens_per_block=8,
                         max_seq_len=700, max_batch=5),
    # B = 2504: several thread blocks per row
    "long_rows": dict(windows=[128, None], tokens_per_block=16, max_seq_len=40000, max_batch=3),
}

# (num_seqs, num_contexts) as functions of max_batch and the rng
SCENARIOS = {
    "one_decode": lambda n, rng: (1, 0),
    "one_context": lambda n, rng: (1, 1),
    "full_decode": lambda n, rng: (n, 0),
    "full_context": lambda n, rng: (n, n),
    "full_mixed": lambda n, rng: (n, int(rng.integers(0, n + 1))),
    "random": lambda n, rng: (lambda s: (s, int(rng.integers(0, s + 1))))(int(rng.integers(1, n + 1))),
}


@pytest.fixture
def rng():
    seed = int(os.environ.get("CUPYKV_TEST_SEED") or np.random.SeedSequence().entropy)
    print(f"seed={seed} (replay with CUPYKV_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def make_layout(name: str) -> Layout:
    return Layout(CacheSpec(num_kv_heads=1, head_dim=8, slots_per_group=NUM_SLOTS, **SPECS[name]))


def make_consts(layout: Layout, backend) -> SimpleNamespace:
    """The constants object the manager hands to the backend kernels."""
    return SimpleNamespace(
        num_groups=layout.num_groups, num_layers=layout.num_layers, rows=layout.spec.max_batch,
        max_batch=layout.spec.max_batch, max_blocks=layout.max_blocks,
        layer_group=layout.layer_group, layer_koff=layout.layer_koff, group_scale=layout.group_scale,
        d_layer_group=backend.upload(layout.layer_group), d_layer_koff=backend.upload(layout.layer_koff),
        d_group_scale=backend.upload(layout.group_scale))


def random_table(rng, shape) -> np.ndarray:
    table = rng.integers(0, NUM_SLOTS, shape).astype(np.int32)
    table[rng.random(shape) < 0.3] = BAD
    return table


def random_range(rng, B: int):
    """A scratch block range [beg, end), biased towards the edge cases."""
    kind = rng.integers(0, 6)
    if kind == 0:
        return 0, 0                                     # what the manager writes for "no scratch"
    if kind == 1:
        k = int(rng.integers(0, B + 1))
        return k, k                                     # empty, elsewhere
    if kind == 2:
        return 0, int(rng.integers(1, B + 1))           # starts at block 0
    if kind == 3:
        return int(rng.integers(0, B)), B               # ends at B
    if kind == 4:
        return 0, B                                     # the whole row
    beg = int(rng.integers(0, B))
    return beg, int(rng.integers(beg + 1, B + 1))


def make_case(layout: Layout, rng, num_seqs: int, num_contexts: int) -> SimpleNamespace:
    """Random old/new tables, the deltas between them, and one packed snapshot."""
    P, rows, B = layout.num_groups, layout.spec.max_batch, layout.max_blocks
    old = random_table(rng, (P, rows, B))
    new = old.copy()
    # rewrite a few whole rows (a new request), a scatter of single cells (decode), and nothing sometimes
    if rng.random() < 0.8:
        for _ in range(int(rng.integers(0, 3))):
            new[int(rng.integers(0, P)), int(rng.integers(0, rows))] = random_table(rng, B)
        flat = new.reshape(-1)
        picks = rng.integers(0, flat.size, int(rng.integers(0, 20)))
        flat[picks] = random_table(rng, len(picks))
    changed = np.flatnonzero(new.reshape(-1) != old.reshape(-1))
    rewritten = rng.integers(0, new.size, int(rng.integers(0, 5)))    # unchanged cells sent again
    cells = np.unique(np.concatenate((changed, rewritten))).astype(np.int64)
    values = new.reshape(-1)[cells]

    copy_idx = rng.permutation(rows)[:num_seqs].astype(np.int32)
    begs = np.zeros((P, num_contexts), np.int32)
    ends = np.zeros((P, num_contexts), np.int32)
    width = 0
    for p in range(P):
        scale = int(layout.group_scale[p])
        for s in range(num_contexts):
            begs[p, s], ends[p, s] = random_range(rng, B)
            width = max(width, -(-int(ends[p, s] - begs[p, s]) * 2 // scale))
    if num_contexts:
        width += int(rng.integers(0, 2))                                  # unused padding columns
    scratch = rng.integers(0, NUM_SLOTS, (P, num_contexts, width)).astype(np.int32)
    cu_tokens = np.concatenate(([0], np.cumsum(rng.integers(1, 9, num_seqs)))).astype(np.int32)
    start_pos = rng.integers(0, 100, num_seqs).astype(np.int32)

    run_start, _ = runs_from_cells(cells)
    words = snapshot_words(num_seqs, num_contexts, P, width, len(run_start), len(values))
    snap = np.full(words + 7, -7, np.int32)              # slack past the end must not matter
    assert pack_snapshot(snap, 42, copy_idx, begs, ends, scratch, cells, values, cu_tokens, start_pos) == words
    return SimpleNamespace(old=old, new=new, snap=snap, words=words, num_runs=len(run_start),
                           num_seqs=num_seqs, num_contexts=num_contexts, copy_idx=copy_idx, begs=begs,
                           ends=ends, scratch=scratch)


def apply_runs(mirror: np.ndarray, snap: np.ndarray, num_groups: int) -> np.ndarray:
    """The deltas applied in numpy, straight from the snapshot's runs."""
    s = unpack_snapshot(snap, num_groups)
    flat = mirror.copy().reshape(-1)
    for r in range(len(s["run_start"])):
        lo, hi = s["run_voff"][r], s["run_voff"][r + 1]
        flat[s["run_start"][r]:s["run_start"][r] + hi - lo] = s["values"][lo:hi]
    return flat.reshape(mirror.shape)


def expected_tables(layout: Layout, case) -> tuple:
    L, P, N, B = layout.num_layers, layout.num_groups, layout.spec.max_batch, layout.max_blocks
    per_layer = reference.convert_per_layer(
        case.new, case.copy_idx, case.num_contexts, case.begs, case.ends, case.scratch,
        layout.layer_group, layout.group_scale, layout.layer_koff, out=np.full((L, N, 2, B), SENTINEL, np.int32))
    shared = reference.convert_shared(case.new, case.copy_idx, layout.group_scale,
                                      out=np.full((P, N, 2, B), SENTINEL, np.int32))
    return per_layer, shared


def assert_same(got: np.ndarray, want: np.ndarray, what: str, case) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = np.argwhere(got != want)
    if len(diff):
        idx = tuple(diff[0])
        pytest.fail(f"{what}: {len(diff)} entries differ; first at {idx}: got {got[idx]}, want {want[idx]} "
                    f"(num_seqs={case.num_seqs}, num_contexts={case.num_contexts})")
    assert (got[:, case.num_seqs:] == SENTINEL).all(), f"{what}: rows >= num_seqs were written"


def cases(rng, spec_name: str, scenario: str):
    layout = make_layout(spec_name)
    for _ in range(ROUNDS):
        num_seqs, num_contexts = SCENARIOS[scenario](layout.spec.max_batch, rng)
        yield layout, make_case(layout, rng, num_seqs, num_contexts)


# -- host backend (runs everywhere) -------------------------------------------------------------------
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_host_kernels_match_reference(rng, spec_name, scenario):
    for layout, case in cases(rng, spec_name, scenario):
        backend = HostBackend()
        consts = make_consts(layout, backend)
        L, P, N, B = layout.num_layers, layout.num_groups, layout.spec.max_batch, layout.max_blocks
        mirror = case.old.copy()
        out = np.full((L, N, 2, B), SENTINEL, np.int32)
        out_shared = np.full((P, N, 2, B), SENTINEL, np.int32)
        backend.apply_deltas(backend.stream, case.snap, mirror, consts)
        backend.convert(backend.stream, case.snap, mirror, out, consts, shared=False)
        backend.convert(backend.stream, case.snap, mirror, out_shared, consts, shared=True)
        backend.synchronize()
        assert np.array_equal(mirror, apply_runs(case.old, case.snap, P))
        assert np.array_equal(mirror, case.new)
        want, want_shared = expected_tables(layout, case)
        assert_same(out, want, "host per_layer", case)
        assert_same(out_shared, want_shared, "host shared", case)


def test_deltas_cover_every_change(rng):
    """The test's own generator: applying the runs turns the old table into the new one."""
    layout = make_layout("three_groups")
    for _ in range(20):
        case = make_case(layout, rng, 3, 2)
        assert np.array_equal(apply_runs(case.old, case.snap, layout.num_groups), case.new)


# -- CUDA backend -------------------------------------------------------------------------------------
def _gpu_available() -> bool:
    try:
        import cupy
        return bool(cupy.is_available())
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not _gpu_available(), reason="CuPy sees no usable CUDA GPU")


@pytest.fixture(scope="module")
def cuda_backend():
    from cupykv.backends.cuda import CudaBackend
    return CudaBackend()


# grid-size hints: none (grids sized for capacity), exact, and too small (the kernels must grid-stride)
HINTS = {"none": lambda c: (None, None), "exact": lambda c: (c.num_seqs, c.num_runs), "small": lambda c: (1, 1)}


@requires_gpu
@pytest.mark.parametrize("hints", sorted(HINTS))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_cuda_kernels_match_reference(rng, cuda_backend, spec_name, scenario, hints):
    backend = cuda_backend
    for layout, case in cases(rng, spec_name, scenario):
        consts = make_consts(layout, backend)
        L, P, N, B = layout.num_layers, layout.num_groups, layout.spec.max_batch, layout.max_blocks
        num_seqs_hint, num_runs_hint = HINTS[hints](case)
        snap_host = backend.pinned_empty(len(case.snap))
        snap_host[:] = case.snap
        snap = backend.device_empty(len(case.snap))
        mirror = backend.upload(case.old)
        out = backend.device_full((L, N, 2, B), SENTINEL)
        out_shared = backend.device_full((P, N, 2, B), SENTINEL)
        stream = backend.stream
        backend.copy_h2d(snap, snap_host, case.words, stream)
        backend.apply_deltas(stream, snap, mirror, consts, num_runs=num_runs_hint)
        backend.convert(stream, snap, mirror, out, consts, shared=False, num_seqs=num_seqs_hint)
        backend.convert(stream, snap, mirror, out_shared, consts, shared=True, num_seqs=num_seqs_hint)
        backend.synchronize()
        assert np.array_equal(backend.to_numpy(mirror), apply_runs(case.old, case.snap, P))
        want, want_shared = expected_tables(layout, case)
        assert_same(backend.to_numpy(out), want, "cuda per_layer", case)
        assert_same(backend.to_numpy(out_shared), want_shared, "cuda shared", case)


@requires_gpu
def test_cuda_gate_holds_stream_until_opened(cuda_backend):
    backend = cuda_backend
    stream = backend.new_stream("gated")
    src = backend.pinned_empty(4)
    src[:] = 1
    dst = backend.device_full(4, 0)
    backend.synchronize()
    gate = backend.gate(stream)
    backend.copy_h2d(dst, src, 4, stream)
    copied = backend.record(stream)
    assert not copied.wait(0.05), "the copy ran although the gate is closed"
    src[:] = 2                     # a queued copy reads its source when it runs, so it must see this
    gate.open()
    assert copied.wait(5.0)
    assert not gate.close_timeout_hit()
    assert backend.to_numpy(dst).tolist() == [2, 2, 2, 2]


@requires_gpu
def test_cuda_gate_times_out(cuda_backend):
    backend = cuda_backend
    stream = backend.new_stream("forgotten gate")
    gate = backend.gate(stream, timeout_s=0.05)
    passed = backend.record(stream)
    start = time.monotonic()
    assert passed.wait(10.0), "a gate nobody opens must release its stream after its timeout"
    assert gate.close_timeout_hit()
    assert time.monotonic() - start < 5.0
