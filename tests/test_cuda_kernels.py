"""The pipeline kernels against the NumPy oracle (cupykv.reference), bit for bit.

Each case runs without and with null slots (CacheSpec.null_slot: BAD table cells and padding rows hold
the group's null page, write positions keep BAD), with random padding rows, in FULL and DELTA mode.

Every test draws fresh random inputs; the seed is printed (pytest shows it for a failing test) and
CUPYKV_TEST_SEED=<seed> replays it. The host backend's emulated kernels run everywhere; the CUDA
kernels run where CuPy sees a GPU.
"""
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from cupykv.backends.host import HostBackend
from cupykv.kernels import INLINE_SNAPSHOT_WORDS, SMALL_INLINE_SNAPSHOT_WORDS
from cupykv.layout import Layout
from cupykv.pipeline import KernelConsts
from cupykv.spec import CacheSpec
from cupykv.staging import (FILL_MIN_RUN, MODE_DELTA, MODE_FULL, RingSlot, graph_buckets, pack_snapshot,
                            snapshot_runs, snapshot_words, unpack_snapshot)
from oracle import expected_write_positions, reference_tables

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


def make_consts(layout: Layout, backend, null_slots=None) -> KernelConsts:
    """The constants object the manager hands to the backend kernels (pipeline.KernelConsts). null_slots: [P]
    each group's null slot (BAD table cells and padding rows hold its page); default: the layout's (BAD: none)."""
    consts = KernelConsts(layout, layout.spec.max_batch, backend)
    if null_slots is not None:
        consts.group_null = np.array(null_slots, np.int32)
        consts.d_group_null = backend.upload(consts.group_null)
    return consts


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
    """Random old/new tables, the deltas between them, a batch with scratch metadata and new tokens."""
    P, rows, B = layout.num_groups, layout.spec.max_batch, layout.max_blocks
    old = random_table(rng, (P, rows, B))
    new = old.copy()
    # rewrite a few whole rows (a new request), clear some (a freed request: a fill run of BAD) or give a
    # stretch of one a single slot (a fill run of it), a scatter of single cells (decode), nothing sometimes
    if rng.random() < 0.8:
        for _ in range(int(rng.integers(0, 3))):
            new[int(rng.integers(0, P)), int(rng.integers(0, rows))] = random_table(rng, B)
        for _ in range(int(rng.integers(0, 3))):
            lo = int(rng.integers(0, B))
            new[int(rng.integers(0, P)), int(rng.integers(0, rows)), lo:lo + int(rng.integers(1, 2 * FILL_MIN_RUN))] = (
                BAD if rng.random() < 0.7 else int(rng.integers(0, NUM_SLOTS)))
        flat = new.reshape(-1)
        picks = rng.integers(0, flat.size, int(rng.integers(0, 20)))
        flat[picks] = random_table(rng, len(picks))
    changed = np.flatnonzero(new.reshape(-1) != old.reshape(-1))
    rewritten = rng.integers(0, new.size, int(rng.integers(0, 5)))    # unchanged cells sent again
    cells = np.unique(np.concatenate((changed, rewritten))).astype(np.int64)
    if rng.random() < 0.5:      # the manager logs cells in order of change: any order, repeats allowed
        cells = rng.permutation(np.concatenate((cells, rng.choice(cells, min(len(cells), 3))))) if len(cells) else cells

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
    tokens = rng.integers(0, 9, num_seqs)
    tokens[rng.random(num_seqs) < 0.2] = 0                               # entries with no new tokens
    cu_tokens = np.concatenate(([0], np.cumsum(tokens))).astype(np.int32)
    # positions anywhere in the row, and past its end sometimes (the kernel clamps the block)
    start_pos = rng.integers(0, (B + 2) * layout.tpb, num_seqs).astype(np.int32)
    # padding rows [num_seqs, pad_to) of a fixed-size batch, half the time
    pad_to = int(rng.integers(num_seqs, rows + 1)) if rng.random() < 0.5 else 0
    # null slots anywhere in the pool's range (the kernels do not care whether a table cell holds the same
    # slot; the manager never allocates it)
    null_slots = rng.integers(0, NUM_SLOTS, P).astype(np.int32)
    # half the time the runs of adjacent changed cells go as written ranges (PageTable.write_runs: a context
    # chunk's new slots), each a run with its values, and only the other cells as cells
    ranges = np.zeros((0, 2), np.int64)
    if rng.random() < 0.5 and len(cells):
        u = np.unique(cells)
        start = u[np.concatenate(([True], u[1:] != u[:-1] + 1))]
        length = np.diff(np.flatnonzero(np.concatenate(([True], u[1:] != u[:-1] + 1, [True]))))
        pick = (length >= 2) & (rng.random(len(start)) < 0.7)
        ranges = np.stack((start[pick], start[pick] + length[pick]), 1)
        covered = np.zeros(new.size, bool)
        for lo, hi in ranges.tolist():
            covered[lo:hi] = True
        cells = cells[~covered[cells]]
    return SimpleNamespace(old=old, new=new, cells=cells, ranges=ranges, num_seqs=num_seqs, num_contexts=num_contexts,
                           copy_idx=copy_idx, begs=begs, ends=ends, scratch=scratch, cu_tokens=cu_tokens,
                           start_pos=start_pos, num_tokens=int(cu_tokens[-1]), pad_to=pad_to,
                           null_slots=null_slots)


def pack(case, num_groups: int, mode: int = MODE_FULL, deltas: bool = True, rebuilt=(), held=()) -> np.ndarray:
    """The case as one snapshot (with `deltas`: the new table's values of the changed cells, and of its
    written ranges; rebuilt: a DELTA step's entries written whole; held: the rows kept past the batch)."""
    cells = case.cells if deltas else np.empty(0, np.int64)
    flat = case.new.reshape(-1)
    values = flat[cells]
    run_start, _, _, shipped = snapshot_runs(cells, values)
    written = None
    if deltas and len(case.ranges):
        written = (case.ranges, np.concatenate([flat[lo:hi] for lo, hi in case.ranges.tolist()]).astype(np.int32))
    num_ranges, range_cells = len(case.ranges) if written else 0, len(written[1]) if written else 0
    rebuilt, held = np.asarray(rebuilt, np.int64), np.asarray(held, np.int64)
    words = snapshot_words(case.num_seqs, case.num_contexts, num_groups, case.scratch.shape[2],
                           len(run_start) + num_ranges, len(shipped) + range_cells, len(rebuilt), len(held))
    snap = np.full(words + 7, -7, np.int32)              # slack past the end must not matter
    assert pack_snapshot(snap, 7, case.copy_idx, case.begs, case.ends, case.scratch, cells, values,
                         case.cu_tokens, case.start_pos, mode=mode, pad_to=case.pad_to, rebuilt=rebuilt,
                         held=held, written=written) == words
    return snap


def replaced(case, **fields):
    """A copy of the case with these fields replaced."""
    return SimpleNamespace(**{**vars(case), **fields})


def with_batch(case, copy_idx, pad_to: int = 0):
    """The case with another generation batch (no contexts): its rows, tokens and positions per entry."""
    n = len(copy_idx)
    return replaced(case, copy_idx=np.asarray(copy_idx, np.int32), num_seqs=n, num_contexts=0,
                    begs=case.begs[:, :0], ends=case.ends[:, :0], scratch=case.scratch[:, :0],
                    cu_tokens=case.cu_tokens[:n + 1], start_pos=case.start_pos[:n],
                    num_tokens=int(case.cu_tokens[n]), pad_to=pad_to)


def bumped(table: np.ndarray, rows, stride: int, by: int):
    """(a copy of table with one cell changed in each of `rows`, those flat cells): row j's cell is in group
    j % P at block (stride * j) % B."""
    P, _, B = table.shape
    cells = np.array([np.ravel_multi_index((j % P, int(r), (stride * j) % B), table.shape)
                      for j, r in enumerate(rows)], np.int64)
    out = table.copy()
    out.reshape(-1)[cells] = (out.reshape(-1)[cells] + by) % NUM_SLOTS
    return out, cells


def apply_runs(mirror: np.ndarray, snap: np.ndarray, num_groups: int) -> np.ndarray:
    """The deltas applied in numpy, straight from the snapshot's runs (a fill run: one value for all its
    cells)."""
    s = unpack_snapshot(snap, num_groups)
    flat = mirror.copy().reshape(-1)
    for r in range(len(s["run_start"])):
        lo, hi, v = s["run_coff"][r], s["run_coff"][r + 1], s["run_value"][r]
        flat[s["run_start"][r]:s["run_start"][r] + hi - lo] = s["values"][v:v + hi - lo] if v >= 0 else s["values"][~v]
    return flat.reshape(mirror.shape)


def assert_same(got: np.ndarray, want: np.ndarray, what: str, case) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = np.argwhere(got != want)
    if len(diff):
        idx = tuple(diff[0])
        pytest.fail(f"{what}: {len(diff)} entries differ; first at {idx}: got {got[idx]}, want {want[idx]} "
                    f"(num_seqs={case.num_seqs}, num_contexts={case.num_contexts})")


def cases(rng, spec_name: str, scenario: str):
    layout = make_layout(spec_name)
    for _ in range(ROUNDS):
        num_seqs, num_contexts = SCENARIOS[scenario](layout.spec.max_batch, rng)
        yield layout, make_case(layout, rng, num_seqs, num_contexts)


class StepBuffers:
    """The device buffers of one step kernel run, pre-filled with SENTINEL, on either backend."""

    def __init__(self, backend, layout: Layout, case, table: np.ndarray, shared: bool, capacity: int,
                 null: bool = False):
        L, P, N, B = layout.num_layers, layout.num_groups, layout.spec.max_batch, layout.max_blocks
        self.backend, self.layout, self.shared = backend, layout, shared
        self.null_slots = case.null_slots if null else None
        self.consts = make_consts(layout, backend, self.null_slots)
        self.mirror = backend.upload(table)
        self.out = backend.device_full((P if shared else L, N, 2, B), SENTINEL)
        self.row_entry = backend.device_full((N,), -1)
        self.pages = backend.device_full((L, capacity), SENTINEL)
        self.offsets = backend.device_full(capacity, SENTINEL)

    def run(self, snap: np.ndarray, mode: int, hints=(None, None, None), path: str = "kernels") -> None:
        """Copy the snapshot in, apply its deltas, build the step; hints: (entries, cells, tokens).

        path "kernels": the copy and the two kernels, each its own call; "plan": the backend's StepPlan,
        what the pipeline runs (on CUDA one cupykv_step launch, its snapshot copied by the kernel), with
        the hints as its counts, or as a graph replay sized by the buckets of the snapshot's counts when
        the hints are None; "inline": the same plan with the snapshot in the launch's parameters
        (cupykv_step_inline_small or cupykv_step_inline, the smallest it fits) where it fits them, as the
        pipeline launches a small step; "inline_large": cupykv_step_inline whatever the snapshot's size."""
        be = self.backend
        if path in ("plan", "inline", "inline_large"):
            slot = RingSlot([be], max(len(snap), INLINE_SNAPSHOT_WORDS))
            slot.host[:len(snap)] = snap
            plan = self.plan(slot, path)
            h = unpack_snapshot(snap, self.layout.num_groups)
            entries, tokens = max(h["num_seqs"], h["pad_to"]), h["num_tokens"]
            graph = None
            if hints[0] is None:
                graph = graph_buckets(len(snap), entries, tokens, slot.capacity, self.layout.spec.max_batch,
                                      self.offsets.size)
                hints = (entries, h["num_cells"], tokens)
            plan.run(be.stream, mode, len(snap), hints[1], hints[0], hints[2], graph)
            be.synchronize()
            return
        host = be.pinned_empty(len(snap))
        host[:] = snap
        dev = be.device_empty(len(snap))
        be.copy_h2d(dev, host, len(snap), be.stream)
        be.apply_deltas(be.stream, dev, self.mirror, self.consts, num_cells=hints[1])
        be.build_step(be.stream, dev, self.mirror, self.out, self.row_entry, self.pages, self.offsets, self.consts,
                      self.shared, mode, num_entries=hints[0], num_cells=hints[1], num_tokens=hints[2])
        be.synchronize()

    def plan(self, slot: RingSlot, path: str):
        """The backend's StepPlan over these buffers for a ring slot; path "plan": one that copies the snapshot
        of every launched step (the host backend's plan always does)."""
        plan = self.backend.step_plan(slot.twins[0], (self.mirror, self.out, self.row_entry, self.pages,
                                                      self.offsets, self.consts), self.shared)
        if path == "plan":
            plan._inline_routes = []
        if path == "inline_large":
            plan._inline_routes = [(fits, route) for fits, route in plan._inline_routes if fits == INLINE_SNAPSHOT_WORDS]
        return plan

    def check(self, case, table: np.ndarray, what: str) -> None:
        """Tables, padding rows, positions and untouched slack against the reference for `table`."""
        be, lay = self.backend, self.layout
        args = (lay.spec, table, case.copy_idx, case.num_contexts, case.begs, case.ends, case.scratch)
        want = reference_tables(*args, shared=self.shared, fill=SENTINEL, null_slots=self.null_slots,
                                pad_to=case.pad_to)
        out = be.to_numpy(self.out)
        assert_same(out, want, f"{what} tables", case)
        live = max(case.num_seqs, case.pad_to)
        assert (out[:, live:] == SENTINEL).all(), f"{what}: rows >= max(num_seqs, pad_to) were written"
        if self.null_slots is not None:     # the null page is in every BAD cell: no -1 left in the live rows
            plain = reference_tables(*args, shared=self.shared, pad_to=case.pad_to)[:, :live]
            assert not (out[:, :live] == BAD).any(), f"{what}: a BAD cell still holds -1 with null slots"
            assert np.array_equal(out[:, :live] != plain, plain == BAD), f"{what}: a cell other than BAD changed"
        # Write positions follow the plain tables (BAD stays BAD with null slots too).
        plain = reference_tables(*args, shared=self.shared, fill=SENTINEL)
        want_pages, want_off = expected_write_positions(lay.spec, plain, np.diff(case.cu_tokens), case.start_pos,
                                                        shared=self.shared)
        t = case.num_tokens
        pages, offsets = be.to_numpy(self.pages), be.to_numpy(self.offsets)
        assert_same(pages[:, :t], want_pages, f"{what} write pages", case)
        assert_same(offsets[:t], want_off, f"{what} write offsets", case)
        assert (pages[:, t:] == SENTINEL).all() and (offsets[t:] == SENTINEL).all(), f"{what}: tokens past the step"


def primed(backend, layout, case, shared, capacity, null, hint_fn, path) -> "StepBuffers":
    """Buffers whose output holds the FULL tables of the case's batch over its old table (no deltas)."""
    bufs = StepBuffers(backend, layout, case, case.old, shared, capacity, null)
    bufs.run(pack(case, layout.num_groups, deltas=False), MODE_FULL, hint_fn(case), path)
    return bufs


def check_backend(backend, rng, spec_name, scenario, hint_fn=lambda case: (None, None, None), null: bool = False,
                  path: str = "kernels"):
    """FULL steps (per-layer and shared) and, for batches without contexts, a DELTA step after a FULL one;
    null: with the case's null slots; path: StepBuffers.run's."""
    for layout, case in cases(rng, spec_name, scenario):
        P = layout.num_groups
        capacity = case.num_tokens + 5
        for shared in (False, True):
            bufs = StepBuffers(backend, layout, case, case.old, shared, capacity, null)
            snap = pack(case, P)
            bufs.run(snap, MODE_FULL, hint_fn(case), path)
            assert np.array_equal(backend.to_numpy(bufs.mirror), apply_runs(case.old, snap, P))
            assert np.array_equal(backend.to_numpy(bufs.mirror), case.new)
            bufs.check(case, case.new, f"{backend.name} FULL shared={shared}")
            entry = backend.to_numpy(bufs.row_entry)
            assert (entry[case.copy_idx] == np.arange(case.num_seqs)).all()
            if case.num_contexts:
                # DELTA with contexts: the chunks written whole (their scratch blocks), the generation
                # entries their changed cells.
                bufs = primed(backend, layout, case, shared, capacity, null, hint_fn, path)
                bufs.run(pack(case, P, mode=MODE_DELTA, rebuilt=np.arange(case.num_contexts)), MODE_DELTA,
                         hint_fn(case), path)
                bufs.check(case, case.new, f"{backend.name} DELTA with contexts shared={shared}")
                continue
            # DELTA: the output holds the old table's FULL tables; the deltas bring it to the new one.
            bufs = primed(backend, layout, case, shared, capacity, null, hint_fn, path)
            bufs.check(case, case.old, f"{backend.name} FULL (before DELTA) shared={shared}")
            bufs.run(pack(case, P, mode=MODE_DELTA), MODE_DELTA, hint_fn(case), path)
            bufs.check(case, case.new, f"{backend.name} DELTA shared={shared}")
            # A DELTA step whose batch has every row at another entry writes no changed cell (the rows are
            # not where row_entry says), when the host rebuilds nothing.
            if case.num_seqs > 1:
                bufs = primed(backend, layout, case, shared, capacity, null, hint_fn, path)
                before = backend.to_numpy(bufs.out)
                newer, bumps = bumped(case.new, case.copy_idx, 1, 1)     # a changed cell in every batch row
                moved = replaced(case, new=newer, cells=np.union1d(case.cells, bumps).astype(np.int64),
                                 copy_idx=np.roll(case.copy_idx, 1))
                bufs.run(pack(moved, P, mode=MODE_DELTA), MODE_DELTA, hint_fn(moved), path)
                assert np.array_equal(backend.to_numpy(bufs.out), before), "a cell went to an entry its row left"
            check_rebuilt_and_held(backend, layout, case, shared, capacity, null, hint_fn, path)


def check_rebuilt_and_held(backend, layout, case, shared, capacity, null, hint_fn, path):
    """Entries written whole in a DELTA step, and entries held past the batch, against the reference.

    FULL of the old table with the case's batch A; then, with the deltas to the new table, a FULL step of
    a shorter batch A[:m] that keeps A[m:] past it (held): those entries must get their rows' changed
    cells; then a DELTA step of a batch like A with some entries taken by other rows (rebuilt) and
    the rest where they were: the whole output must be the new table's tables of that batch."""
    P, rows, n = layout.num_groups, layout.spec.max_batch, case.num_seqs
    m = n // 2
    # a changed cell in every row that will be held past the short batch, so that holding shows
    new, held_cells = bumped(case.new, case.copy_idx[m:], 1, 1)
    case = replaced(case, new=new, cells=np.union1d(case.cells, held_cells).astype(np.int64))
    a = with_batch(case, case.copy_idx)
    spare = np.setdiff1d(np.arange(rows), a.copy_idx)            # rows not in A take some of its entries
    bufs = primed(backend, layout, a, shared, capacity, null, hint_fn, path)
    short = with_batch(case, a.copy_idx[:m])
    bufs.run(pack(short, P, held=a.copy_idx[m:]), MODE_FULL, hint_fn(short), path)
    want = reference_tables(layout.spec, case.new, a.copy_idx, 0, a.begs, a.ends, a.scratch, shared=shared,
                            null_slots=bufs.null_slots)
    assert_same(backend.to_numpy(bufs.out)[:, m:n], want[:, m:n], f"{backend.name} held entries", a)
    b = a.copy_idx.copy()
    swap = [e for e in range(n) if e % 3 == 1][:max(1, n // 4)]
    b[swap[:len(spare)]] = spare[:len(swap)]
    if len(swap) > 1:
        b[swap[0]], b[swap[-1]] = b[swap[-1]], b[swap[0]]
    rebuilt = np.flatnonzero(b != a.copy_idx)
    # the DELTA step brings changed cells too, in rows it writes whole and in rows it does not
    newer, cells = bumped(case.new, b, 3, 7)
    later = replaced(with_batch(case, b), new=newer, cells=cells)
    bufs.run(pack(later, P, mode=MODE_DELTA, rebuilt=rebuilt), MODE_DELTA, hint_fn(later), path)
    bufs.check(later, newer, f"{backend.name} DELTA with {len(rebuilt)} rebuilt entries shared={shared}")


# -- host backend (runs everywhere) -------------------------------------------------------------------
@pytest.mark.parametrize("null", [False, True], ids=["bad", "null_slot"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("path", ["kernels", "plan"])
def test_host_kernels_match_reference(rng, spec_name, scenario, null, path):
    check_backend(HostBackend(), rng, spec_name, scenario, null=null, path=path)


def test_deltas_cover_every_change(rng):
    """The test's own generator: applying the runs turns the old table into the new one."""
    layout = make_layout("three_groups")
    for _ in range(20):
        case = make_case(layout, rng, 3, 2)
        assert np.array_equal(apply_runs(case.old, pack(case, layout.num_groups), layout.num_groups), case.new)


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


# grid-size hints (entries, changed cells, tokens): none (grids sized for capacity, as in a graph), exact, and
# too small (the kernels must grid-stride)
HINTS = {"none": lambda c: (None, None, None),
         "exact": lambda c: (max(c.num_seqs, c.pad_to), len(c.cells) + int((c.ranges[:, 1] - c.ranges[:, 0]).sum()),
                             c.num_tokens),
         "small": lambda c: (1, 1, 1)}


# StepBuffers.run's paths with each hint; with no hints the plan replays a graph, which copies the snapshot
# (only on the paths without inline kernels: on an inline path a step that fits the small one is launched)
PATH_HINTS = [(path, hints) for path in ("kernels", "plan", "inline", "inline_large") for hints in sorted(HINTS)
              if hints != "none" or not path.startswith("inline")]


@requires_gpu
@pytest.mark.parametrize("null", [False, True], ids=["bad", "null_slot"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("path,hints", PATH_HINTS)
def test_cuda_kernels_match_reference(rng, cuda_backend, spec_name, scenario, hints, null, path):
    """path "plan" is cupykv_step, the pipeline's one launch per step (eager, and captured into a graph with
    the "none" hints), "inline" the smallest inline kernel the snapshot fits (cupykv_step_inline_small for
    the cases without deltas and some with, cupykv_step_inline for most; the long rows' fit neither) and
    "inline_large" cupykv_step_inline where the snapshot fits its parameters, against the same oracle."""
    check_backend(cuda_backend, rng, spec_name, scenario, HINTS[hints], null=null, path=path)


@requires_gpu
@pytest.mark.parametrize("table_blocks", [1, 2, 3, 7])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("path", ["kernels", "plan", "inline", "inline_large"])
def test_cuda_tables_on_any_grid(rng, cuda_backend, monkeypatch, spec_name, table_blocks, path):
    """The FULL tables split each group's layers over as many threads per (group, entry, quad) as the grid
    has to spare (none, when the items outnumber the grid's threads and it strides over them): grids of a
    few blocks, which step_grid never picks for these shapes, give splits from 1 up to the layer count
    (most of them, not every one, per spec) and partial last strides, against the same oracle; the write
    positions (a thread per group and token) get as few blocks and split their layers the same way over the
    threads to spare, and so do the changed cells (a thread per cell) of a DELTA step that rebuilds no entry
    (the other steps keep a thread per cell: check_rebuilt_and_held's)."""
    from cupykv.backends import cuda
    sized = cuda.step_grid
    monkeypatch.setattr(cuda, "step_grid", lambda *a: (table_blocks, min(sized(*a)[1], table_blocks)))
    for scenario in ("full_mixed", "random"):
        check_backend(cuda_backend, rng, spec_name, scenario, HINTS["exact"], null=bool(rng.integers(0, 2)),
                      path=path)


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
@pytest.mark.parametrize("inline", ["inline", "inline_large"])
def test_an_inline_snapshot_is_the_slot_at_enqueue(rng, cuda_backend, inline):
    """An inline kernel's snapshot is a launch parameter, which the driver copies when the launch is
    enqueued: the ring slot rewritten after the launch, while a gate still holds the stream, does not change
    what the step builds (the snapshot fits cupykv_step_inline_small; "inline_large" launches
    cupykv_step_inline with it). The control is the same plan without the inline launch (cupykv_step copies
    the slot when it runs): the same rewrite reaches its tables, so the gate held both launches past the
    rewrite."""
    be, layout = cuda_backend, make_layout("swa128_full_x3")
    case = replaced(make_case(layout, rng, 3, 0), pad_to=0)
    moved = with_batch(case, np.roll(case.copy_idx, 1))      # the same rows, each at another entry
    first, second = pack(case, layout.num_groups, deltas=False), pack(moved, layout.num_groups, deltas=False)
    assert len(first) == len(second) <= SMALL_INLINE_SNAPSHOT_WORDS
    built = {}
    for path in (inline, "plan"):
        bufs = StepBuffers(be, layout, case, case.new, False, case.num_tokens + 5)
        slot = RingSlot([be], INLINE_SNAPSHOT_WORDS)
        slot.host[:len(first)] = first
        plan = bufs.plan(slot, path)
        if path == inline:      # the struct the launch carries
            assert plan.route(len(first)).h2d_words == (INLINE_SNAPSHOT_WORDS if inline == "inline_large"
                                                  else SMALL_INLINE_SNAPSHOT_WORDS)
        be.synchronize()
        gate = be.gate(be.stream)
        plan.run(be.stream, MODE_FULL, len(first), 0, case.num_seqs, case.num_tokens)
        slot.host[:len(second)] = second
        gate.open()
        be.synchronize()
        assert not gate.close_timeout_hit(), "the gate timed out: the launch may have run before the rewrite"
        built[path] = bufs
    built[inline].check(case, case.new, "inline launch, its slot rewritten after the enqueue")
    built["plan"].check(moved, case.new, "the control (the copy reads the rewritten slot)")


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


@pytest.mark.parametrize("backend_name", ["host", "cuda"])
def test_apply_skips_cells_outside_the_mirror(backend_name, request):
    """A corrupt delta run (negative start, or past the end) writes only the cells inside the mirror, and a
    fill run sets all its cells to its one value, on both backends alike."""
    if backend_name == "cuda":
        if not _gpu_available():
            pytest.skip("CuPy sees no usable CUDA GPU")
        backend = request.getfixturevalue("cuda_backend")
    else:
        backend = HostBackend()
    layout = make_layout("full_only_b4")
    size = layout.num_groups * layout.spec.max_batch * layout.max_blocks
    run_start = np.array([-2, 5, size - 2, 9], np.int64)
    coff = np.array([0, 4, 6, 10, 12], np.int64)
    first = np.array([0, 4, 6, ~10], np.int64)          # the last run: a fill run of values[10]
    values = np.arange(100, 111, dtype=np.int32)
    empty = np.zeros((layout.num_groups, 0), np.int32)
    snap = np.zeros(200, np.int32)
    # pack_snapshot takes cells; build the header by hand around hand-made runs instead
    from cupykv import staging as stg
    stg.pack_snapshot(snap, 1, np.zeros(0, np.int32), empty, empty, np.zeros((layout.num_groups, 0, 0), np.int32),
                      np.empty(0, np.int64), np.empty(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int64))
    h = snap[:stg.HEADER_WORDS]
    base = int(h[stg.H_OFF_CU_TOKENS]) + 1
    for off, arr in ((stg.H_OFF_RUN_START, run_start), (stg.H_OFF_RUN_COFF, coff), (stg.H_OFF_RUN_VALUE, first),
                     (stg.H_OFF_VALUES, values)):
        h[off] = base
        snap[base:base + len(arr)] = arr
        base += len(arr)
    h[stg.H_NUM_RUNS], h[stg.H_NUM_CELLS], h[stg.H_NUM_VALUES] = len(run_start), coff[-1], len(values)
    consts = make_consts(layout, backend)
    mirror = backend.device_full(size, -5)
    host = backend.pinned_empty(len(snap))
    host[:] = snap
    dev = backend.device_empty(len(snap))
    backend.copy_h2d(dev, host, len(snap), backend.stream)
    backend.apply_deltas(backend.stream, dev, mirror, consts)
    backend.synchronize()
    want = np.full(size, -5, np.int32)
    want[[0, 1]] = [102, 103]                   # the first run's cells -2, -1 are skipped
    want[[5, 6]] = [104, 105]
    want[[size - 2, size - 1]] = [106, 107]     # the third run's cells size, size + 1 are skipped
    want[[9, 10]] = 110
    assert np.array_equal(backend.to_numpy(mirror), want)


@requires_gpu
def test_pooled_events_survive_a_garbage_cycle(cuda_backend):
    """Events dropped inside reference cycles go back to the backend's pool still usable: reusing them records
    and completes. A pool of cupy.cuda.Event objects fails this: the garbage collector runs cupy's finalizer,
    which destroys the handle, in the same pass as the one that returns the object to the pool."""
    import gc
    be = cuda_backend
    gc.collect()
    pooled = len(be._events)
    for _ in range(8):
        event = be.record(be.stream)
        cycle = [event]
        cycle.append(cycle)
        del event, cycle
    gc.collect()
    assert len(be._events) >= max(pooled, 8), "the events in the cycles did not come back to the pool"
    for _ in range(len(be._events) + 2):
        event = be.record(be.stream)
        event.synchronize()
        assert event.done()
