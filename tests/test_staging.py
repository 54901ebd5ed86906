"""Snapshot staging: packing, the ring's growth and exhaustion, bytes per step, the mirror."""
import numpy as np
import pytest

import cupykv
from cupykv.kernels import INLINE_SNAPSHOT_WORDS, SMALL_INLINE_SNAPSHOT_WORDS
from cupykv.layout import BAD
from cupykv.staging import (EACH_CELL_MAX, FILL_MIN_RUN, MODE_DELTA, MODE_FULL, pack_snapshot, run_values,
                            runs_from_cells, snapshot_runs, snapshot_words, unpack_snapshot)
from conftest import backend_or_skip, graph_count
from oracle import Capture


def make(backend_name="host", **kw):
    spec = cupykv.CacheSpec(windows=[64, None], num_kv_heads=1, head_dim=8, tokens_per_block=16,
                            max_seq_len=8192, max_batch=32, slots_per_group=4096,
                            max_step_tokens=65536)
    return cupykv.KVCacheManager(spec, backend=backend_name, **kw)


def test_runs_from_cells():
    cells = np.array([3, 4, 5, 9, 11, 12])
    start, coff = runs_from_cells(cells)
    assert start.tolist() == [3, 9, 11] and coff.tolist() == [0, 3, 4, 6]
    start, coff = runs_from_cells(np.empty(0, np.int64))
    assert len(start) == 0 and coff.tolist() == [0]


def cell_values(s: dict) -> tuple:
    """(cells, values) one per changed cell, from an unpacked snapshot's runs, read as the layout says."""
    cells, values = [], []
    for r, start in enumerate(s["run_start"].tolist()):
        n, v = int(s["run_coff"][r + 1] - s["run_coff"][r]), int(s["run_value"][r])
        cells += range(start, start + n)
        values += [int(s["values"][~v])] * n if v < 0 else s["values"][v:v + n].tolist()
    return cells, values


def test_run_values_ship_a_long_run_of_bad_once():
    """Runs of at least FILL_MIN_RUN BAD cells become fill runs (runs of another single value do not), every
    other run ships its values; read back by the layout, every cell gets its value."""
    rng = np.random.default_rng()
    for _ in range(200):
        lens = rng.integers(1, 3 * FILL_MIN_RUN, int(rng.integers(1, 8)))
        coff = np.concatenate(([0], np.cumsum(lens)))
        values = rng.integers(-1, 50, int(coff[-1]))
        uniform = rng.random(len(lens)) < 0.5
        for r in np.flatnonzero(uniform):
            values[coff[r]:coff[r + 1]] = BAD if rng.random() < 0.7 else values[coff[r]]
        first, shipped = run_values(coff, values)
        want_fill = [bool((values[coff[r]:coff[r + 1]] == BAD).all() and lens[r] >= FILL_MIN_RUN)
                     for r in range(len(lens))]
        assert (first < 0).tolist() == want_fill
        assert len(shipped) == len(values) - sum(int(lens[r]) - 1 for r in range(len(lens)) if want_fill[r])
        got = np.concatenate([np.full(lens[r], shipped[~first[r]]) if first[r] < 0
                              else shipped[first[r]:first[r] + lens[r]] for r in range(len(lens))])
        assert np.array_equal(got, values)


def test_pack_unpack_round_trip():
    rng = np.random.default_rng()
    P, C, M, n = 3, 2, 4, 5
    # scattered cells, a freed row's cells (BAD), a stretch of one slot, and a prefill's new slots
    cells = np.concatenate((np.unique(rng.integers(0, 1000, 40)), np.arange(2000, 2040), np.arange(3000, 3020),
                            np.arange(4000, 4020)))
    values = np.concatenate((rng.integers(0, 99, len(cells) - 80), np.full(40, BAD), np.full(20, 7),
                             np.arange(500, 520)))
    args = dict(copy_idx=rng.integers(0, 9, n), begs=rng.integers(0, 9, (P, C)), ends=rng.integers(0, 9, (P, C)),
                scratch=rng.integers(0, 99, (P, C, M)), cells=cells, values=values,
                cu_tokens=np.cumsum([0, 3, 1, 1, 1, 1]), start_pos=rng.integers(0, 99, n))
    start, _ = runs_from_cells(cells)
    words = snapshot_words(n, C, P, M, len(start), len(cells) - 39)     # one fill run (BAD); 7s go as they are
    buf = np.zeros(words + 7, np.int32)
    assert pack_snapshot(buf, 41, **args) == words
    got = unpack_snapshot(buf, P)
    for key in ("copy_idx", "begs", "ends", "scratch", "cu_tokens", "start_pos"):
        assert np.array_equal(got[key], args[key]), key
    assert got["num_cells"] == len(cells)
    got_cells, got_values = cell_values(got)
    assert got_cells == cells.tolist() and got_values == values.tolist()
    assert got["step"] == 41 and got["num_seqs"] == n and got["num_contexts"] == C


def copies_from_the_slot(backend_name, monkeypatch) -> None:
    """On CUDA, every launch copies its snapshot from its ring slot when it runs (no inline launch, whose
    snapshot the driver copies at enqueue and which so holds no slot): as the host backend's steps do."""
    if backend_name == "cuda":
        from cupykv.backends.cuda import CudaStepPlan
        from cupykv.backends.plan import StepPlan
        monkeypatch.setattr(CudaStepPlan, "route", StepPlan.route)      # the copy route, always


def test_ring_grows_then_raises_when_exhausted(backend_name, monkeypatch):
    """Steps whose copies read their ring slots hold them until the copies ran: the ring grows to its bound,
    then a prepare waits for a slot and fails, changing nothing; a slot whose copy completed is reused."""
    copies_from_the_slot(backend_name, monkeypatch)
    mgr = make(backend_name, ring_slots=2, max_ring_slots=3, staging_timeout_s=0.2)
    mgr.add("a", 16)
    gate = mgr.backend.gate(mgr.backend.stream)       # no snapshot copy can complete
    steps = []
    s = mgr.prepare_batch({"a": 16})
    s.finish()
    for _ in range(2):                                # slots 2 and 3: the ring grows to its bound
        s = mgr.prepare_batch((), ["a"])
        s.finish()
        steps.append(s)
    assert len(mgr.ring.slots) == 3 and mgr.ring.in_flight() == 3
    before = mgr.state()
    with pytest.raises(cupykv.StagingExhaustedError, match="snapshot slots"):
        mgr.prepare_batch((), ["a"])
    assert mgr.state() == before
    gate.open()
    mgr.synchronize()
    s = mgr.prepare_batch((), ["a"])                  # a completed slot is reused, the ring stays at 3
    s.finish()
    assert len(mgr.ring.slots) == 3


def test_few_cells_ship_each_as_a_run_and_round_trip():
    """A step with at most EACH_CELL_MAX changed cells (a decode step's few, or a context step's, whose
    chunks' new slots come as written ranges) ships each cell as a run of its own, adjacent ones and repeats
    included, BAD values among them, then its written ranges as a run each with their values, then its
    cleared ranges as fill runs; unpacked as the kernels read it, every cell carries its value. One more
    cell and adjacent cells merge into runs again."""
    rng = np.random.default_rng(5)
    for n in (0, 1, 2, EACH_CELL_MAX - 1, EACH_CELL_MAX, EACH_CELL_MAX + 1):
        for contexts in (0, 1):
            cells = np.sort(rng.choice(np.arange(0, 3 * n + 1), n, replace=False)).astype(np.int64)
            if n > 2:
                cells[-1] = cells[0]            # a cell logged twice
            values = rng.integers(-1, 99, n).astype(np.int32)
            if n:
                values[cells == cells[0]] = values[0]
            run_start, run_coff, run_value, shipped = snapshot_runs(cells, values)
            if n <= EACH_CELL_MAX:
                assert len(run_start) == n and run_coff.tolist() == list(range(n + 1)) and shipped is values
            else:
                assert len(run_start) == len(runs_from_cells(cells)[0])
                assert len(run_start) < n or n < 3          # merged: some cells are adjacent
            cleared = np.array([[5000, 5000 + FILL_MIN_RUN], [6000, 6100]], np.int64) if n % 2 else None
            written = None
            if contexts:            # a chunk's new slots as written ranges (one of them a single cell)
                ranges = np.array([[7000, 7013], [8000, 8001], [8001, 8040]], np.int64)
                written = (ranges, rng.integers(-1, 99, 53).astype(np.int32))
            words = snapshot_words(2, contexts, 1, 0, len(run_start) + (0 if cleared is None else 2)
                                   + (0 if written is None else 3),
                                   len(shipped) + (cleared is not None) + (0 if written is None else 53))
            buf = np.zeros(words + 3, np.int32)
            begs = np.zeros((1, contexts), np.int32)
            assert pack_snapshot(buf, 3, np.arange(2), begs, begs, np.zeros((1, contexts, 0), np.int32), cells, values,
                                 np.array([0, 1, 2]), np.array([5, 6]), cleared=cleared, written=written) == words
            got = unpack_snapshot(buf, 1)
            want_cells, want_values = cells.tolist(), values.tolist()
            if written is not None:
                want_cells += [c for lo, hi in written[0].tolist() for c in range(lo, hi)]
                want_values += written[1].tolist()
            if cleared is not None:
                bad = [c for lo, hi in cleared.tolist() for c in range(lo, hi)]
                want_cells, want_values = want_cells + bad, want_values + [BAD] * len(bad)
            assert got["num_cells"] == len(want_cells)
            assert cell_values(got) == (want_cells, want_values)
            assert got["begs"].shape == (1, contexts) and got["cu_tokens"].tolist() == [0, 1, 2]


def test_decode_ships_only_what_changed():
    mgr = make()
    for r in range(32):
        mgr.add(r, 2000)
    s = mgr.prepare_batch({r: 2000 for r in range(32)})
    s.finish()
    big = mgr.h2d_bytes_last_step
    written = int(np.count_nonzero(mgr.table != cupykv.BAD))
    prefill = s
    mgr.settle(s)
    sizes = []
    for _ in range(40):
        s = mgr.prepare_batch((), range(32))
        s.finish()
        mgr.settle(s)
        sizes.append(mgr.h2d_bytes_last_step)
    table_bytes = mgr.table.nbytes
    # New rows go as runs (a value per written cell, three run words per row and group), not as the table.
    scratch_words = prefill.scratch_slots.size + 2 * prefill.scratch_begs.size
    assert big <= 4 * (written + 3 * 2 * 32 + scratch_words + 3 * 32) + 256
    assert big < table_bytes / 2
    # Decode: a handful of new or released cells per step plus the batch's rows.
    assert max(sizes) < 4096 and max(sizes) < table_bytes / 50


def test_freed_rows_ship_as_fill_runs(backend_name):
    """Freeing requests clears their rows; the next step ships each cleared stretch as a fill run (a few
    words, not a value per cell), and the device mirror still equals the host table after it
    (debug_verify_mirror checks)."""
    mgr = make(backend_name, debug_verify_mirror=True)
    for r in range(8):
        mgr.add(r, 4000)
    s = mgr.prepare_batch({r: 4000 for r in range(8)})
    s.finish()
    mgr.settle(s)
    held = int(np.count_nonzero(mgr.table != cupykv.BAD))
    for r in range(6):
        mgr.free(r)
    s = mgr.prepare_batch((), [6, 7])
    s.finish()
    mgr.settle(s)
    assert held > 6 * (4000 // 16) and int(np.count_nonzero(mgr.table != cupykv.BAD)) < held / 3
    # 6 rows x 2 groups of fill runs (3 run words and a value each), the batch's 2 rows and the header; on
    # CUDA that fits a launch's parameters, which carry their whole block (a value per cell would not fit)
    limit = 4 * INLINE_SNAPSHOT_WORDS if backend_name == "cuda" else 4 * (6 * 2 * 4 + 64 + 64)
    assert mgr.h2d_bytes_last_step <= limit


@pytest.mark.parametrize("blocks", [FILL_MIN_RUN - 1, FILL_MIN_RUN, 40])
def test_a_short_freed_row_ships_as_a_fill_run(blocks):
    """A freed request's row of at least FILL_MIN_RUN held blocks is logged as a range, so even a decode step
    of a few cells (each cell a run of its own) ships it as one fill run; a shorter row goes cell by cell.
    The words shipped are counted from what the step logged (host backend: the copy is the snapshot)."""
    mgr = make(debug_verify_mirror=True)
    tpb = mgr.spec.tokens_per_block
    mgr.add("short", blocks * tpb)
    mgr.add("d", 100)
    s = mgr.prepare_batch({"short": blocks * tpb, "d": 100})
    s.finish()
    mgr.settle(s)
    row = mgr.request("short").row
    window_cells, full_cells = (int(np.count_nonzero(mgr.table[p, row] != cupykv.BAD)) for p in (0, 1))
    assert full_cells == blocks and 0 < window_cells < FILL_MIN_RUN
    mgr.free("short")
    s = mgr.prepare_batch((), ["d"])           # opens no block: the freed row is all the step changes
    s.finish()
    mgr.settle(s)
    runs = window_cells + (1 if blocks >= FILL_MIN_RUN else full_cells)
    # (and one entry past the batch: the freed request's, held section of the entry map)
    assert mgr.h2d_bytes_last_step == 4 * snapshot_words(1, 0, 2, 0, runs, runs, 0, 1)


def test_verify_mirror_debug_option():
    mgr = make(debug_verify_mirror=True)
    for r in range(4):
        mgr.add(r, 300)
    for _ in range(3):
        s = mgr.prepare_batch({r: 100 for r in range(4)})
        s.finish()
        mgr.settle(s)
    mgr.free(2)                      # changes not yet shipped are skipped by the check
    mgr.verify_mirror()
    mgr.mirror[0, 0, 0] = 12345      # a corrupt mirror is caught
    with pytest.raises(AssertionError, match="mirror differs"):
        mgr.verify_mirror()


def test_steady_batch_rewrites_only_changed_cells(backend_name):
    """Decode steps with the previous step's batch use DELTA mode; tables still equal the reference."""
    spec = cupykv.CacheSpec(windows=[32, None, 32], num_kv_heads=1, head_dim=8, tokens_per_block=8,
                            max_seq_len=2048, max_batch=8, slots_per_group=2048)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    cap = Capture(mgr)
    for r in range(6):
        mgr.add(r, 100 + 7 * r)
    s = mgr.prepare_batch({r: 100 + 7 * r for r in range(6)})
    cap.consume(s)
    mgr.settle(s)
    modes, live = [], [0, 1, 2, 3, 4, 5]
    for i in range(40):
        batch = live if i % 10 else live[::-1]          # now and then another order
        s = mgr.prepare_batch((), batch)
        cap.consume(s)
        mgr.settle(s)
        modes.append(s.mode)
        if i == 25:
            mgr.free(3)
            mgr.add("new", 50)
            live = [0, 1, 2, 4, 5, "new"]
            s = mgr.prepare_batch({"new": 50}, live[:-1])
            cap.consume(s)
            mgr.settle(s)
            modes.append(s.mode)
    mgr.synchronize()
    assert cap.mismatches() == []
    assert modes.count(MODE_DELTA) >= 30 and modes.count(MODE_FULL) >= 4
    assert modes[0] == MODE_FULL and modes[10] == MODE_FULL and modes[11] == MODE_FULL


@pytest.mark.parametrize("pad_to", [None, 8])
def test_kept_batch_positions_rewrite_only_the_entries_that_changed(backend_name, pad_to):
    """An engine that keeps batch positions: a finished request's entry is taken by an arrival, prefilled
    in a step of its own first (contexts only), or the batch shrinks at its end. The decode step after
    such a prefill is DELTA (it rebuilds the entries whose row changed; the others, held past the prefill's
    short batch, got their changed cells meanwhile), and every step's tables equal the reference."""
    spec = cupykv.CacheSpec(windows=[32, None, 32], num_kv_heads=1, head_dim=8, tokens_per_block=8,
                            max_seq_len=2048, max_batch=8, slots_per_group=2048)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    cap = Capture(mgr)
    rng = np.random.default_rng(5)
    decode = list(range(6))
    for r in decode:
        mgr.add(r, 60 + 9 * r)
    s = mgr.prepare_batch({r: 60 + 9 * r for r in decode}, pad_to=pad_to)
    cap.consume(s)
    mgr.settle(s)
    after_prefill, next_id = [], 6
    for i in range(40):
        if i % 4 == 1:            # an arrival takes a finished request's entry
            p = int(rng.integers(len(decode)))
            mgr.free(decode[p])
            mgr.add(next_id, 30 + i)
            s = mgr.prepare_batch({next_id: 30 + i})        # padding rows here would overwrite the held ones
            cap.consume(s)
            mgr.settle(s)
            decode[p], next_id = next_id, next_id + 1
        if i == 30:               # the last request finishes and nobody takes its entry
            mgr.free(decode.pop())
        s = mgr.prepare_batch((), decode, pad_to=pad_to)
        cap.consume(s)
        mgr.settle(s)
        if i % 4 == 1:
            after_prefill.append(s.mode)
    mgr.synchronize()
    assert cap.mismatches() == []
    assert after_prefill == [MODE_DELTA] * len(after_prefill)


def test_a_row_that_moves_leaves_its_old_entry(backend_name):
    """[A, B, C, D], then [A, B] (C and D held past the batch), then D at entry 0 for a while (its tables
    written whole there, and its new blocks go there), then [A, B, C, D] again: entry 3 must be written
    again, not taken as still holding D."""
    spec = cupykv.CacheSpec(windows=[16, None], num_kv_heads=1, head_dim=8, tokens_per_block=8,
                            max_seq_len=1024, max_batch=6, slots_per_group=4096)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    cap = Capture(mgr)
    for r in "ABCD":
        mgr.add(r, 20)
    for batch in [{r: 20 for r in "ABCD"}, ["A", "B", "C", "D"], ["A", "B"]] + [["D", "A"]] * 12 + [list("ABCD")]:
        s = mgr.prepare_batch(batch) if isinstance(batch, dict) else mgr.prepare_batch((), batch)
        cap.consume(s)
        mgr.settle(s)
    mgr.synchronize()
    assert cap.mismatches() == []


@pytest.mark.parametrize("seed", range(4))
def test_random_batch_edits_keep_every_table_right(backend_name, seed):
    """Random edits of the batch from step to step (entries taken by other requests, two entries swapped,
    the batch cut or grown at its end, a context chunk in front, padding on and off), prefills and frees
    in between: every step's tables equal the reference, whichever entries the map lets a step keep."""
    spec = cupykv.CacheSpec(windows=[16, None], num_kv_heads=1, head_dim=8, tokens_per_block=8,
                            max_seq_len=1024, max_batch=10, slots_per_group=4096)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    cap = Capture(mgr)
    rng = np.random.default_rng(seed)
    ready, fresh, next_id, modes = [], [], 0, []
    for i in range(60):
        while len(ready) + len(fresh) < 9:        # requests to draw from: prefilled ones and new ones
            mgr.add(next_id, int(rng.integers(8, 90)))
            fresh.append(next_id)
            next_id += 1
        batch = list(ready[:8])
        edit = rng.integers(5)
        if edit == 0 and len(batch) > 1:
            a, b = rng.choice(len(batch), 2, replace=False)
            batch[a], batch[b] = batch[b], batch[a]
        elif edit == 1 and batch:
            batch.pop()
        elif edit == 2 and len(batch) > 2:
            batch = batch[:int(rng.integers(1, len(batch)))]
        contexts = {}
        if fresh and (rng.random() < 0.4 or not batch):
            rid = fresh.pop(0)
            contexts[rid] = mgr.request(rid).prompt_len
        pad = int(rng.integers(len(contexts) + len(batch), 11)) if rng.random() < 0.3 else None
        s = mgr.prepare_batch(contexts, batch, pad_to=pad)
        cap.consume(s)
        mgr.settle(s)
        modes.append(s.mode)
        ready += list(contexts)
        if ready and rng.random() < 0.25:         # a request finishes; an arrival may take its entry
            gone = ready.pop(int(rng.integers(len(ready))))
            mgr.free(gone)
        if len(ready) > 2 and rng.random() < 0.3:
            j = int(rng.integers(len(ready)))
            ready.insert(int(rng.integers(len(ready))), ready.pop(j))
    mgr.synchronize()
    assert cap.mismatches() == []
    assert MODE_DELTA in modes and MODE_FULL in modes


def test_padding_rows_read_bad(backend_name):
    mgr = make(backend_name)
    for r in range(5):
        mgr.add(r, 40)
    s = mgr.prepare_batch({r: 40 for r in range(5)})
    s.finish()
    mgr.settle(s)
    s = mgr.prepare_batch((), [0, 1], pad_to=4)
    s.ready.synchronize()
    out = mgr.backend.to_numpy(mgr.out)
    assert (out[:, 2:4] == cupykv.BAD).all()
    assert (out[:, :2, :, 0] != cupykv.BAD).all()
    assert (out[:, 4, :, 0] != cupykv.BAD).all()      # row 4 (the prefill step's) is past pad_to: untouched
    s.finish()
    before = mgr.state()
    with pytest.raises(cupykv.InvalidRequestError, match="pad_to"):
        mgr.prepare_batch((), [0, 1, 2], pad_to=2)
    assert mgr.state() == before


def grown_slot_workload(mgr):
    """Decode steps on small snapshots, then a prefill whose snapshot outgrows its ring slot, then decode
    steps that come back to that slot; every step captured. Returns (the Capture, the grown slot). On CUDA
    every step must copy its snapshot (copies_from_the_slot): inline launches would stay on one slot."""
    cap = Capture(mgr, write_positions=True)

    def step(contexts, generation):
        s = mgr.prepare_batch(contexts, generation)
        cap.consume(s)
        mgr.settle(s)
        mgr.synchronize()             # every slot free again: the ring reuses its slots instead of adding
        cap.stream.synchronize()

    mgr.add("small", 40)
    step({"small": 40}, [])
    for _ in range(len(mgr.ring.slots)):              # every ring slot carries a step (and has its plan)
        step({}, ["small"])
    slots = list(mgr.ring.slots)
    capacities = [slot.capacity for slot in slots]
    for r in range(31):
        mgr.add(r, 2000)
    step({r: 2000 for r in range(31)}, [])            # thousands of changed cells: too big for a slot
    grown = [slot for slot, c in zip(slots, capacities) if slot.capacity > c]
    for _ in range(2 * len(mgr.ring.slots)):          # the grown slot comes round again
        step({}, ["small", *range(31)])
    return cap, grown


def test_a_grown_ring_slot_gets_a_new_step_plan(backend_name, monkeypatch):
    """A ring slot that grows gets new buffers, so each device's step plan for it is made again; the steps
    after the growth still get the reference's tables and write positions. A plan kept past the growth
    (fits() always true) sends the grown slot's steps to the old, smaller buffers, and the test sees it."""
    copies_from_the_slot(backend_name, monkeypatch)
    mgr = make(backend_name)
    cap, grown = grown_slot_workload(mgr)
    assert grown, "no ring slot grew: the test does not reach the path it is about"
    m = mgr.pipeline.mirrors[0]
    for slot in grown:
        plan = m.plan(slot.twins[0])
        assert plan.dev is slot.twins[0].dev and plan.host is slot.host
    assert cap.mismatches() == []


def test_a_stale_step_plan_is_caught(backend_name, monkeypatch):
    from cupykv.backends.plan import StepPlan
    from cupykv.backends import cuda_available
    plans = [StepPlan]
    if backend_name == "cuda" and cuda_available():
        from cupykv.backends.cuda import CudaStepPlan
        plans.append(CudaStepPlan)
    for cls in plans:
        monkeypatch.setattr(cls, "fits", lambda self, twin: True)
    copies_from_the_slot(backend_name, monkeypatch)
    mgr = make(backend_name)
    try:
        cap, grown = grown_slot_workload(mgr)
    except ValueError as e:       # the CUDA plan checks each copy against the slot size it was made for
        assert "do not fit the ring slot" in str(e), e
        return
    assert grown and cap.mismatches(), "a plan kept past its slot's growth went unnoticed"



def slots_taken(mgr, monkeypatch) -> list:
    """The ring slots mgr's steps take from now on, in order (the list fills as they are acquired)."""
    taken, acquire = [], mgr.ring.acquire
    monkeypatch.setattr(mgr.ring, "acquire", lambda words: taken.append(acquire(words)) or taken[-1])
    return taken


def test_the_ring_hands_out_an_unread_slot_again(backend_name, monkeypatch):
    """acquire hands out the slot it handed out last again while nothing reads it (an inline launch's, on
    CUDA): a gated burst of small launched steps takes that one slot. Steps that read their slot (every step
    of the host backend, CUDA's copies) take the slots in turn, never one whose copy is pending (the ring
    grows instead)."""
    mgr = make(backend_name, ring_slots=3)
    mgr.add("a", 16)
    taken = slots_taken(mgr, monkeypatch)

    def step(contexts=()):
        s = mgr.prepare_batch(contexts, [] if contexts else ["a"])
        s.finish()
        mgr.settle(s)
    step({"a": 16})
    mgr.synchronize()
    gate = mgr.backend.gate(mgr.backend.stream)         # what reads a slot stays pending
    for _ in range(3):
        step()
    copies_from_the_slot(backend_name, monkeypatch)
    for _ in range(2):
        step()
    gate.open()
    mgr.synchronize()
    assert not gate.close_timeout_hit()
    slots = mgr.ring.slots
    if backend_name == "cuda":      # the copy takes the unread slot, the next one the slot after it in turn
        assert taken == [slots[0]] * 5 + [slots[1]] and len(slots) == 3
    else:
        assert taken == [slots[0], slots[1], slots[2], slots[0], slots[3], slots[4]]


def test_small_steps_launch_inline_under_graphs_too(monkeypatch):
    """With use_graphs, a step whose snapshot fits the smallest inline kernel (kernels.INLINE_STEP_KERNELS:
    a small batch's decode step) is launched with the snapshot in its parameters instead of replayed: it
    replays no graph, so it captures none, ships that kernel's struct and leaves its ring slot unread. A
    larger step replays its graph (captured on first use) and ships its copy bucket. Every step's tables are
    the reference's."""
    backend_or_skip("cuda")
    mgr = make("cuda", use_graphs=True)
    rids = [f"r{i}" for i in range(20)]
    for r in rids:
        mgr.add(r, 16)
    cap = Capture(mgr).reserve(8)
    seen, taken = [], slots_taken(mgr, monkeypatch)

    def step(contexts, generation):
        before = graph_count(mgr.backend)
        s = mgr.prepare_batch(contexts, generation)
        cap.consume(s)
        seen.append((graph_count(mgr.backend) - before, mgr.h2d_bytes_last_step, taken[-1].unread()))
        mgr.settle(s)

    step({r: 16 for r in rids}, [])       # 20 contexts: a copied snapshot, a new graph
    step({}, ["r0"])                      # one decode entry: inline
    step({}, rids)                        # 20 entries, 19 opening a block: replayed
    step({}, ["r3"])
    step({}, rids[:2])
    mgr.synchronize()
    cap.stream.synchronize()
    assert cap.mismatches() == []
    small = (0, SMALL_INLINE_SNAPSHOT_WORDS * 4, True)
    assert seen[1] == seen[3] == seen[4] == small, seen
    assert seen[0][0] == 1 and seen[0][1] >= 4 * 1024 and not seen[0][2], seen
    assert seen[2][1] >= 4 * 1024 and not seen[2][2], seen

