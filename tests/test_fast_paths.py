"""The host fast paths of prepare_batch and settle, checked against an independent model, the NumPy
reference, the general paths, and the previous snapshot packing.

- Decode steps reuse the last validated generation list (no lookup, duplicate or readiness checks) and
  allocate only for the requests whose new tokens open a block, which a list decoding step after step
  takes from its phase order.
- settle releases only the SWA blocks whose window edge crossed a block boundary, and takes a path
  without rewind checks when every entry is live and every token accepted.
- runs_from_cells was rewritten for speed; the packed bytes must not change.
"""
import numpy as np
import pytest

import cupykv
from cupykv import BAD, CapacityExceededError, InvalidRequestError, OutOfSlotsError, UnknownRequestError
from cupykv import pipeline, staging
from cupykv.planner import StepPlanner
from conftest import Capture, expected_tables

TPB = 8


def cdiv(a, b):
    return -(-a // b)


def make_mgr(windows=(16, None, 24), sinks=0, rewind=3, slots=400, max_batch=8, **kw):
    spec = cupykv.CacheSpec(windows=list(windows), num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                            max_seq_len=512, max_batch=max_batch, slots_per_group=slots, max_rewind=rewind,
                            sink_tokens=sinks, swa_scratch_reuse=False)
    return cupykv.KVCacheManager(spec, backend="host", **kw)


class Model:
    """History and capacity per request, and the blocks that must hold a slot (the formulas of the README
    concepts: blocks [0, ceil(cap / tpb)) minus the stale range of each SWA group)."""

    def __init__(self, mgr):
        self.mgr, self.lay = mgr, mgr.layout
        self.req = {}             # rid -> [hist, cap, {group: stale hi}]

    def add(self, rid, prompt):
        self.mgr.add(rid, prompt)
        self.req[rid] = [0, 0, {}]

    def free(self, rid):
        self.mgr.free(rid)
        del self.req[rid]

    def scheduled(self, step):
        for rid, n in zip(step.request_ids, step.num_tokens):
            self.req[rid][1] += int(n)

    def settled(self, step, accepted):
        for rid, n in zip(step.request_ids, step.num_tokens):
            if rid not in self.req:
                continue
            m = self.req[rid]
            a = accepted.get(rid, int(n)) if accepted else int(n)
            m[0] += a
            m[1] -= int(n) - a
            for g in self.lay.groups:
                if g.window is not None:
                    m[2][g.index] = max(m[2].get(g.index, 0), (m[0] + 1 - g.window) // TPB)

    def stale_edge(self, rid, g):
        return (self.req[rid][0] + 1 - g.window) // TPB

    def check(self):
        for rid, (hist, cap, stale) in self.req.items():
            row = self.mgr.request(rid).row
            assert (self.mgr.request(rid).history, self.mgr.request(rid).capacity) == (hist, cap)
            for g in self.lay.groups:
                want = set(range(cdiv(cap, TPB)))
                if g.window is not None:
                    sink = cdiv(g.sink_tokens, TPB)
                    want -= set(range(sink, max(sink, stale.get(g.index, 0))))
                got = set(np.flatnonzero(self.mgr.table[g.index, row] != BAD).tolist())
                assert got == want, (rid, g.index, hist, cap, sorted(got - want), sorted(want - got))


def prefill(model, cap, rids_prompts):
    for rid, prompt in rids_prompts:
        model.add(rid, prompt)
    s = model.mgr.prepare_batch({rid: p for rid, p in rids_prompts})
    model.scheduled(s)
    cap.consume(s)
    model.mgr.settle(s)
    model.settled(s, None)
    model.check()


@pytest.mark.parametrize("k", [1, 3, TPB, TPB + 3])
@pytest.mark.parametrize("windows,sinks", [((16, None, 24), 0), ((16, 16, None), 8), ((24, None), 0)])
def test_decode_steps_match_model_and_reference(k, windows, sinks):
    """Decode steps where some requests open a block and some SWA blocks go stale, with the cached
    generation list, overlapping steps (settled one step late), a free, an add, and rewinds."""
    mgr = make_mgr(windows, sinks)
    model, cap = Model(mgr), Capture(mgr)
    rng = np.random.default_rng(k * 7 + len(windows) + sinks)
    prefill(model, cap, [(f"r{i}", int(rng.integers(1, 60))) for i in range(6)])
    gen = sorted(model.req)
    crossed = stale = 0                        # steps where some (all, when k >= tpb) requests did so
    some = (lambda n, of: 0 < n < of) if k < TPB else (lambda n, of: n > 0)
    pending = []
    for it in range(40):
        if it == 15:                           # a free in the middle: the cached list goes stale
            model.free(gen[2])
            gen = gen[:2] + gen[3:]
        if it == 25:                           # an add and a prefill while the others keep decoding
            model.add("late", 20)
            s = mgr.prepare_batch({"late": 20}, gen, num_gen_tokens=k)
        else:
            s = mgr.prepare_batch((), gen, num_gen_tokens=k)
        before = {rid: model.req[rid][1] for rid in gen}
        model.scheduled(s)
        cap.consume(s)
        crossed_now = sum(cdiv(model.req[r][1], TPB) > cdiv(before[r], TPB) for r in gen)
        crossed += some(crossed_now, len(gen))
        pending.append(s)
        if len(pending) == 2:                  # the overlap scheduler: settle the previous step
            old = pending.pop(0)
            edges = {r: [model.stale_edge(r, g) for g in mgr.layout.groups if g.window] for r in model.req}
            mgr.settle(old)
            model.settled(old, None)
            moved = sum(edges[r] != [model.stale_edge(r, g) for g in mgr.layout.groups if g.window]
                        for r in edges if r in model.req)
            stale += some(moved, len(edges))
        model.check()
        if it == 25:
            gen = gen + ["late"]
        if it % 9 == 8 and pending:            # a rewind from the latest step: the general settle
            last = pending.pop(0)
            acc = {r: int(rng.integers(max(0, k - mgr.spec.max_rewind), k + 1)) for r in gen if r in last.request_ids
                   and r != "late"}
            mgr.settle(last, acc)
            model.settled(last, acc)
            model.check()
    for s in pending:
        mgr.settle(s)
        model.settled(s, None)
    model.check()
    mgr.synchronize()
    assert cap.mismatches() == []
    assert crossed > 5 and stale > 5, (crossed, stale)      # the workload exercised both fast paths


@pytest.mark.parametrize("mode,scratch", [("per_layer", False), ("shared", False), ("per_layer", True)])
def test_long_window_releases_by_range_match_model_and_reference(backend_name, mode, scratch):
    """A settle whose rows release many window blocks at once (a long chunk's: at least
    prefix_hook.SLICE_MIN_BLOCKS) clears each such row's range as one (PageTable.take_blocks, logged as a range
    and shipped as a fill run), beside rows that release a block or none in the same settle; with scratch reuse such a
    range is mostly scratch blocks without a slot, and goes cell by cell. Checked against the oracle's model (the blocks
    that hold a slot, scratch included, and every slot's whereabouts) and each step's tables against the
    reference; chunks are settled one step late, and each request's row is freed and taken by the next
    request in the same interval."""
    from cupykv.prefix_hook import SLICE_MIN_BLOCKS
    from oracle import Modelled
    spec = cupykv.CacheSpec(windows=[16, None, 24], num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                            max_seq_len=4096, max_batch=6, slots_per_group=3000, table_mode=mode,
                            swa_scratch_reuse=scratch)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name, debug_verify_mirror=True)
    tw, cap = Modelled(mgr), Capture(mgr)
    calls = {"range": 0, "cells": 0}        # window releases in the settle running now: by range, by cells
    table = mgr.page_table
    take_blocks, take = table.take_blocks, table.take

    def counted_take_blocks(p, row, lo=0, hi=None):
        calls["range"] += hi is not None
        return take_blocks(p, row, lo, hi)

    def counted_take(cells):
        calls["cells"] += len(cells) > 0
        return take(cells)

    table.take_blocks, table.take = counted_take_blocks, counted_take
    long_chunk = (SLICE_MIN_BLOCKS + 40) * TPB
    pending, mixed, by_range = [], 0, 0

    def step(contexts, generation=()):
        nonlocal mixed, by_range
        pending.append(tw.prepare(contexts, generation))
        cap.consume(pending[-1])
        if len(pending) == 2:
            calls.update(range=0, cells=0)
            tw.settle(pending.pop(0))
            mixed += calls["range"] > 0 and calls["cells"] > 0
            by_range += calls["range"]
            tw.check()

    for rid, n in (("d0", 30), ("d1", 50)):
        tw.add(rid, n)
    step({"d0": 30, "d1": 50})
    for it in range(8):
        rid, short = f"L{it}", f"S{it}"
        tw.add(rid, 2 * long_chunk + 5)
        tw.add(short, 12 * TPB)
        # two long chunks of one request in a row (the second prepared before the first settles), the first
        # beside a short request's whole prompt (its settle releases a few window blocks: cells), then the tail
        for chunks in ({rid: long_chunk, short: 12 * TPB}, {rid: long_chunk}, {rid: 5}):
            step(chunks, ["d0", "d1"] if it % 2 and rid not in chunks or it % 4 == 3 else ())
        tw.free(rid)                    # its row: the next request's, in the same interval
        tw.free(short)
    for s in pending:
        tw.settle(s)
    tw.check()
    mgr.synchronize()
    assert cap.mismatches() == []
    # without scratch reuse, long ranges and short ones in one settle; with it, every release by cells
    assert (by_range, mixed) == (0, 0) if scratch else (by_range >= 8 and mixed >= 8), (by_range, mixed)


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_decode_steps_within_the_room_match_model_and_reference(batch, monkeypatch):
    """A small decode batch skips the block and max_seq_len checks while its steps fit the list's room
    (GenBatch.room), and every list checks max_seq_len against its longest entry as its own last step left
    it (GenBatch.longest; a batch of 8 keeps no room): every block still opens with its first token, a
    rewind or a step of another list makes both be worked out again, and a step that would pass
    max_seq_len (not a block's end here) is still refused whole."""
    spec = cupykv.CacheSpec(windows=[16, None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                            max_seq_len=157, max_batch=8, slots_per_group=400, max_rewind=3)
    mgr = cupykv.KVCacheManager(spec, backend="host")
    model, cap = Model(mgr), Capture(mgr)
    in_room, known = [], []         # per step planned: by plan_in_room (True) or by plan (False)
    plan_in_room, plan, knows = (StepPlanner.plan_in_room, StepPlanner.plan,
                                 cupykv.requests.GenBatch.knows)

    def planned_in_room(self, *args):
        p = plan_in_room(self, *args)
        if p is not None:
            in_room.append(True)
        return p
    monkeypatch.setattr(StepPlanner, "plan_in_room", planned_in_room)
    monkeypatch.setattr(StepPlanner, "plan", lambda self, *a: in_room.append(False) or plan(self, *a))
    monkeypatch.setattr(cupykv.requests.GenBatch, "knows",
                        lambda self, at: known.append(knows(self, at)) or known[-1])
    rng = np.random.default_rng(batch)
    ids, refused, n = [], 0, 0
    for it in range(160):
        while len(ids) < batch:                # a new request whenever one reached max_seq_len
            rid, n = f"r{n}", n + 1
            prefill(model, cap, [(rid, int(rng.integers(1, 40)))])
            ids.append(rid)
        k = int(rng.choice([1, 1, 1, 2, 3, TPB + 1]))
        gen = ids if batch == 1 or it % 11 else ids[:1]     # now and then another list
        if max(model.req[r][1] for r in gen) + k > spec.max_seq_len:
            before = mgr.state()
            with pytest.raises(CapacityExceededError, match="max_seq_len"):
                mgr.prepare_batch((), gen, num_gen_tokens=k)
            assert mgr.state() == before
            refused += 1
            full = max(gen, key=lambda r: model.req[r][1])
            model.free(full)
            ids.remove(full)
            continue
        s = mgr.prepare_batch((), gen, num_gen_tokens=k)
        model.scheduled(s)
        cap.consume(s)
        acc = {r: int(rng.integers(k - min(k, 3), k + 1)) for r in gen} if it % 7 == 6 else None
        mgr.settle(s, acc)             # rejected tokens: a capacity write outside the list's steps
        model.settled(s, acc)
        model.check()
    mgr.synchronize()
    assert cap.mismatches() == []
    assert refused >= 2 and known.count(True) > 25 and known.count(False) > 10, (refused, known.count(True))
    if batch < 8:
        assert sum(in_room) > 25 and in_room.count(False) > 20, in_room.count(True)
    else:
        assert not any(in_room)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_openings_by_phase_match_model_reference_and_the_general_path(k, monkeypatch):
    """A decode list of k tokens a step (k dividing tokens_per_block, batch * k >= tokens_per_block: no
    room kept) takes the entries that open a block from its phase order (GenBatch.openings) while its own
    steps made the last capacity writes. Checked against the model (the blocks each request holds), each
    step's tables against the reference, and a twin manager that works every step out from the capacities
    (no validated-list cache): the same state after every settle. Steps overlap (settled one late); a
    rewind and a context step beside the list make the order stale, a step of another list and frees with
    adds replace the list, and the order is built again after two steps in a row that know the list's
    capacities."""
    fast, slow = make_mgr(slots=1000, max_batch=12), make_mgr(slots=1000, max_batch=12)
    orig_batch = slow.requests.generation_batch

    def uncached(gen_ids, ctx_rows):
        slow.requests._gen = None
        return orig_batch(gen_ids, ctx_rows)

    monkeypatch.setattr(slow.requests, "generation_batch", uncached)
    monkeypatch.setattr(slow.planner, "plan_in_room", lambda gen, gen_ids, k, pad_to: None)
    found, built = [], []
    openings = cupykv.requests.GenBatch.openings

    def counted(self, k_, cap_, group):
        built.append(self._phase_k != k_ and self._steady)
        found.append(openings(self, k_, cap_, group))
        return found[-1]

    monkeypatch.setattr(cupykv.requests.GenBatch, "openings", counted)
    model, cap = Model(fast), Capture(fast)
    rng = np.random.default_rng(k)
    n, pending = 0, []

    def add(rid, prompt):
        model.add(rid, prompt)
        slow.add(rid, prompt)

    def prepare(contexts, gen):
        s_fast = fast.prepare_batch(contexts, gen, num_gen_tokens=k)
        s_slow = slow.prepare_batch(contexts, gen, num_gen_tokens=k)
        model.scheduled(s_fast)
        cap.consume(s_fast)
        s_slow.finish()
        return s_fast, s_slow

    def settle(pair, acc=None):
        fast.settle(pair[0], acc)
        slow.settle(pair[1], acc)
        model.settled(pair[0], acc)
        model.check()
        assert fast.state() == slow.state()

    def fresh(count):
        nonlocal n
        pairs = {f"r{n + i}": int(rng.integers(1, 90)) for i in range(count)}
        n += count
        for rid, p in pairs.items():
            add(rid, p)
        settle(prepare(pairs, []))
        return list(pairs)

    def free_longest():
        while pending:
            settle(pending.pop(0))
        rid = max(ids, key=lambda r: model.req[r][1])
        model.free(rid)
        slow.free(rid)
        ids.remove(rid)

    ids = fresh(9)
    for it in range(160):
        kind = it % 20
        if max(model.req[r][1] for r in ids) + 2 * k > fast.spec.max_seq_len:
            free_longest()
            ids += fresh(1)
        if kind == 17:                       # a free: the list is validated again
            free_longest()
        contexts = {}
        if kind == 7:                        # a context step beside the list: another step's capacity write
            rid, n = f"r{n}", n + 1
            add(rid, 2 * TPB)
            contexts = {rid: 2 * TPB}
        gen = ids[1:] if kind == 13 else ids         # another list for a step
        pending.append(prepare(contexts, gen))
        ids += list(contexts)
        if kind == 3:                        # a rewind of the latest step: a capacity write outside the list's steps
            while len(pending) > 1:
                settle(pending.pop(0))
            settle(pending.pop(0), {r: int(rng.integers(k - min(k, 3), k + 1)) for r in gen})
        elif len(pending) == 2:
            settle(pending.pop(0))
    while pending:
        settle(pending.pop(0))
    fast.synchronize()
    assert cap.mismatches() == []
    used = [f for f in found if f is not None]
    assert len(used) > 50 and sum(built) >= 10 and sum(len(f[0]) > 0 for f in used) > 30, \
        (len(used), sum(built), sum(len(f[0]) > 0 for f in used))


def _twin_managers(monkeypatch):
    """Two managers fed the same calls: `fast` as is, `slow` without the validated-list cache (nor the
    plan of a step within the list's room, which takes the list from it) and with settle checking every
    entry's liveness."""
    fast, slow = make_mgr(rewind=2), make_mgr(rewind=2)
    orig_batch, orig_settle = slow.requests.generation_batch, slow.settle

    def uncached(gen_ids, ctx_rows):
        slow.requests._gen = None
        return orig_batch(gen_ids, ctx_rows)

    def checking_settle(step, accepted=None):
        step.moves = -1          # as if a request had moved since the prepare
        return orig_settle(step, accepted)

    monkeypatch.setattr(slow.requests, "generation_batch", uncached)
    monkeypatch.setattr(slow.planner, "plan_in_room", lambda gen, gen_ids, k, pad_to: None)
    monkeypatch.setattr(slow, "settle", checking_settle)
    return fast, slow


def test_fast_paths_leave_the_same_state_as_the_general_paths(monkeypatch):
    fast, slow = _twin_managers(monkeypatch)
    rng = np.random.default_rng(5)
    prompts = [int(p) for p in rng.integers(1, 80, 7)]
    words = []
    for mgr in (fast, slow):
        for i, p in enumerate(prompts):
            mgr.add(i, p)
        s = mgr.prepare_batch({i: p for i, p in enumerate(prompts)})
        s.finish()
        mgr.settle(s)
    ids = list(range(7))
    for it in range(60):
        k = int(rng.integers(1, 3))
        acc = None if it % 5 else {i: int(rng.integers(0, k + 1)) for i in ids}
        for mgr in (fast, slow):
            s = mgr.prepare_batch((), ids, num_gen_tokens=k)
            s.finish()
            words.append(mgr.h2d_bytes_last_step)
            mgr.settle(s, acc)
        assert fast.state() == slow.state(), it
        assert words[-1] == words[-2]


def test_cached_list_is_dropped_on_free():
    mgr = make_mgr()
    for rid, p in (("a", 10), ("b", 20)):
        mgr.add(rid, p)
    s = mgr.prepare_batch({"a": 10, "b": 20})
    s.finish()
    mgr.settle(s)
    s = mgr.prepare_batch((), ["a", "b"])
    s.finish()
    s.request_ids.reverse()                    # the step's list is its own: the cache must not see this
    mgr.settle(s)
    s = mgr.prepare_batch((), ["a", "b"])      # a cache hit
    assert list(s.request_ids) == ["a", "b"] and mgr.request("a").row == s.rows[0]
    s.finish()
    mgr.settle(s)
    mgr.free("a")
    before = mgr.state()
    with pytest.raises(UnknownRequestError, match="'a'"):
        mgr.prepare_batch((), ["a", "b"])
    assert mgr.state() == before
    mgr.add("a", 30)                           # the same id in the same row, prompt not scheduled yet
    with pytest.raises(InvalidRequestError, match="cannot decode before its whole prompt"):
        mgr.prepare_batch((), ["a", "b"])
    assert mgr.state() != before and mgr.request("a").capacity == 0
    s = mgr.prepare_batch({"a": 30}, ["b"])
    s.finish()
    mgr.settle(s)
    s = mgr.prepare_batch((), ["a", "b"])
    assert s.start_positions.tolist() == [30, 23]


def test_errors_on_a_cache_hit_leave_the_state_unchanged():
    mgr = make_mgr(windows=(None,), slots=7, max_batch=2)
    mgr.add("a", 500)
    mgr.add("b", 8)
    s = mgr.prepare_batch({"b": 8})
    s.finish()
    mgr.settle(s)
    for _ in range(100):                       # b runs out of slots: 7 slots of 8 tokens
        try:
            s = mgr.prepare_batch((), ["b"])
        except OutOfSlotsError:
            break
        s.finish()
        mgr.settle(s)
    else:
        pytest.fail("never ran out of slots")
    before = mgr.state()
    with pytest.raises(OutOfSlotsError):
        mgr.prepare_batch((), ["b"])
    assert mgr.state() == before
    mgr = make_mgr(windows=(None,), slots=100, max_batch=2)
    mgr.add("c", 503)
    s = mgr.prepare_batch({"c": 503})
    s.finish()
    mgr.settle(s)
    s = mgr.prepare_batch((), ["c"])            # validates and caches the list
    s.finish()
    mgr.settle(s)
    before = mgr.state()
    with pytest.raises(CapacityExceededError, match=r"'c': 504 \+ 9 tokens exceeds max_seq_len=512"):
        mgr.prepare_batch((), ["c"], num_gen_tokens=9)
    assert mgr.state() == before


def _runs_from_cells_before(cells):
    """runs_from_cells as it was before the in-place rewrite (the oracle of the packed bytes)."""
    if len(cells) == 0:
        return np.empty(0, np.int64), np.zeros(1, np.int64)
    voff = np.flatnonzero(np.concatenate(([True], cells[1:] != cells[:-1] + 1, [True])))
    return cells[voff[:-1]], voff


def _random_cells(rng):
    n = int(rng.choice([0, 1, 2, 3, 17, 40, 300]))
    starts = rng.integers(0, 5000, n)
    lens = rng.integers(1, 6, n)
    cells = np.repeat(starts, lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))
    return np.unique(cells).astype(np.int64)


def test_runs_and_packed_bytes_unchanged(monkeypatch):
    """runs_from_cells gives what it gave before its in-place rewrite, and every snapshot that finds its runs
    (more than EACH_CELL_MAX cells) packs the same bytes with either."""
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(400):
        cells = _random_cells(rng)
        got, want = staging.runs_from_cells(cells), _runs_from_cells_before(cells)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and np.array_equal(g, w)
        P, C, M, n = int(rng.integers(1, 4)), int(rng.integers(0, 3)), int(rng.integers(0, 3)), int(rng.integers(0, 9))
        args = (int(rng.integers(0, 1 << 40)), rng.integers(0, 64, n).astype(np.int32),
                rng.integers(0, 9, (P, C)).astype(np.int32), rng.integers(0, 9, (P, C)).astype(np.int32),
                rng.integers(0, 99, (P, C, M)).astype(np.int32), cells,
                rng.integers(-1, 999, len(cells)).astype(np.int32),
                np.concatenate(([0], np.cumsum(rng.integers(1, 9, n)))), rng.integers(0, 999, n))
        kw = dict(mode=int(rng.integers(0, 2)), pad_to=int(rng.integers(0, 64)))
        run_start, _, _, shipped = staging.snapshot_runs(cells, args[6])
        words = staging.snapshot_words(n, C, P, M, len(run_start), len(shipped))
        new, old = np.full(words + 8, 7, np.int32), np.full(words + 8, 7, np.int32)
        assert staging.pack_snapshot(new, *args, **kw) == words
        with monkeypatch.context() as m:
            m.setattr(staging, "runs_from_cells", _runs_from_cells_before)
            assert staging.pack_snapshot(old, *args, **kw) == words
        assert new.tobytes() == old.tobytes()
        if len(cells) > staging.EACH_CELL_MAX:          # a snapshot that finds runs
            assert len(run_start) == len(want[0])
            compared += 1
    assert compared > 90, compared


def test_take_blocks_by_slices_matches_the_gathers():
    """PageTable.take_blocks clears a row whose held cells form one run with a slice, logged as a range,
    instead of gathers: the slots it returns, the table after it and the cells its dirty log covers are
    what gathering the row's held cells gives, for rows of one run, of several runs, of one cell and of
    none; a range is logged as cleared only while it holds BAD."""
    from cupykv.backends import make_backends
    from cupykv.layout import FILL_MIN_RUN
    from cupykv.table import PageTable
    rng = np.random.default_rng(3)
    be = make_backends("host", None)[0]
    ranged = 0
    for trial in range(300):
        P, rows, B = 2, 3, int(rng.integers(1, 12 * FILL_MIN_RUN))
        table = PageTable(be, P, rows, B)
        p, row = int(rng.integers(P)), int(rng.integers(rows))
        seg = np.full(B, BAD, np.int32)
        kind = trial % 4
        if kind == 0:                               # one run (long ones logged as a range)
            lo = int(rng.integers(0, max(1, B // 4)))
            hi = int(rng.integers(max(lo + 1, B // 2), B + 1))
            seg[lo:hi] = rng.permutation(1000)[:hi - lo]
        elif kind == 1:                             # held cells with holes (a window, scratch blocks)
            held = rng.random(B) < 0.5
            seg[held] = rng.permutation(1000)[:int(held.sum())]
        elif kind == 2:                             # one cell
            seg[int(rng.integers(B))] = int(rng.integers(1000))
        table.array[p, row] = seg
        table.array[1 - p, row] = 7                 # the other group's row and the other rows stay
        before = table.array.copy()
        want_cells = np.flatnonzero(seg != BAD) + (p * rows + row) * B
        vals = table.take_blocks(p, row)
        assert vals.dtype == np.int32 and np.array_equal(vals, seg[seg != BAD]), trial
        after = before.copy()
        after[p, row] = BAD
        assert np.array_equal(table.array, after), trial
        assert np.array_equal(np.sort(table.logged_cells()), want_cells), trial
        assert table.num_logged() == len(want_cells), trial
        cells, cleared, _ = table.logged()
        cleared = np.zeros((0, 2), np.int64) if cleared is None else cleared
        shipped = np.concatenate([cells] + [np.arange(lo, hi) for lo, hi in cleared.tolist()])
        assert np.array_equal(np.sort(shipped), want_cells), trial
        assert all(np.all(table.flat[lo:hi] == BAD) for lo, hi in cleared.tolist()), trial
        vals[:] = 5                                 # the slots are the caller's copy
        assert np.array_equal(table.array, after), trial
        assert all(hi - lo >= FILL_MIN_RUN for lo, hi in cleared.tolist()), trial
        ranged += len(cleared) > 0
        if len(cleared):                    # written again before the step: a written range, its current values
            lo, hi = cleared[0].tolist()
            table.write(np.array([hi - 1], np.int64), 9)
            cells, cleared, written = table.logged()
            assert cleared is None and written[0].tolist() == [[lo, hi]], trial
            assert written[1].tolist() == [BAD] * (hi - lo - 1) + [9] and cells.tolist() == [hi - 1], trial
            assert table.flat[hi - 1] == 9
    assert ranged > 20, ranged


# -- steps with no entries, and a step whose launch fails ------------------------------------------------

@pytest.mark.parametrize("pad_to", [None, 3])
def test_empty_step(backend_name, pad_to):
    """A step with no entries (an idle step of a fixed-size consumer: padding only) is a valid step."""
    spec = cupykv.CacheSpec(windows=[16, None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                            max_seq_len=256, max_batch=4, slots_per_group=64)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name)
    mgr.add("a", 20)
    s = mgr.prepare_batch({"a": 20})
    s.finish()
    mgr.settle(s)
    empty = mgr.prepare_batch((), [], pad_to=pad_to)
    empty.ready.synchronize()
    assert empty.num_seqs == 0 and empty.num_tokens.sum() == 0
    if pad_to:
        assert (mgr.backend.to_numpy(mgr.out)[:, :pad_to] == BAD).all()
    empty.finish()
    mgr.settle(empty)
    assert mgr.request("a").history == 20
    s = mgr.prepare_batch((), ["a"])            # and the manager goes on
    s.ready.synchronize()
    got = mgr.backend.to_numpy(mgr.out)[:, :1]
    assert np.array_equal(got, expected_tables(mgr, mgr.table.copy(), s))


def prepare_with_a_failed_build(monkeypatch, mgr, *args) -> None:
    """prepare_batch(*args) on the host backend with its build raising: a step's run that fails part-way,
    after its snapshot copy and delta apply were enqueued."""
    be = mgr.backend
    real = be.build_step

    def broken(*a, **k):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(be, "build_step", broken)
    with pytest.raises(RuntimeError):
        mgr.prepare_batch(*args)
    monkeypatch.setattr(be, "build_step", real)


def test_failed_launch_forces_a_full_step(monkeypatch):
    """If enqueueing a step's device work raises, the changed cells are not lost and the next step rewrites
    whole rows (the output may hold a partly built step), whatever its batch."""
    mgr = make_mgr(windows=(16, None))
    for r in ("a", "b"):
        mgr.add(r, 31)
    s = mgr.prepare_batch({"a": 31, "b": 31})
    s.finish()
    mgr.settle(s)
    s = mgr.prepare_batch((), ["a", "b"])
    s.finish()
    mgr.settle(s)
    be = mgr.backend
    prepare_with_a_failed_build(monkeypatch, mgr, (), ["a", "b"])     # token 32 opens block 4: cells change
    mgr.synchronize()
    s = mgr.prepare_batch((), ["a", "b"])
    assert s.mode == staging.MODE_FULL
    s.ready.synchronize()
    assert np.array_equal(be.to_numpy(mgr.out)[:, :2], expected_tables(mgr, mgr.table.copy(), s))


def test_a_failed_launch_keeps_its_ring_slot_until_the_stream_ran_it(monkeypatch):
    """A step whose run fails after its snapshot copy was enqueued (the host backend queues the copy, then
    the build raises) keeps its ring slot busy: the next steps take other slots, so the pending copy reads
    the failed step's snapshot, and the recovery step's tables are the reference's. (Without the rule the
    slot looks free, a later step repacks it before the copy runs, and the mirror runs ahead of the
    table.) A gate holds the manager stream until every step is enqueued, which forces the interleaving."""
    mgr = make_mgr(windows=(None,), ring_slots=2)
    for r in ("a", "b"):
        mgr.add(r, TPB)
    s = mgr.prepare_batch({"a": TPB, "b": TPB})
    s.ready.synchronize()
    s.finish()
    mgr.settle(s)
    be = mgr.backend
    gate = be.gate(be.stream)
    prepare_with_a_failed_build(monkeypatch, mgr, (), ["a", "b"])     # opens block 1: copy and apply queued
    g = mgr.prepare_batch((), ["a", "b"])           # the recovery step: FULL
    assert g.mode == staging.MODE_FULL
    g_table = mgr.table.copy()
    consumer = be.new_stream("consumer")
    seen = be.device_empty(mgr.out.size).reshape(mgr.out.shape)
    be.wait(consumer, g.ready)
    be.copy_d2d(seen, mgr.out, consumer)            # what a consumer of g reads after g.ready
    g.finish(consumer)
    mgr.free("b")                                   # the next step clears b's cells
    mgr.prepare_batch((), ["a"])
    gate.open()
    be.synchronize()
    assert np.array_equal(be.to_numpy(seen)[:, :2], expected_tables(mgr, g_table, g))


def test_a_step_that_ships_only_ranges(backend_name):
    """A step whose table changes are only cleared ranges (a freed request's row, and a decode step that
    opens no block) still applies them: its apply grid counts the ranges' cells. The mirror is checked
    against the host table after the step, and the tables against the reference."""
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB, max_seq_len=1024,
                            max_batch=4, slots_per_group=400)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name, debug_verify_mirror=True)
    cap = Capture(mgr)
    mgr.add("long", 100 * TPB)
    mgr.add("d", TPB + 1)
    s = mgr.prepare_batch({"long": 100 * TPB, "d": TPB + 1})
    cap.consume(s)
    mgr.settle(s)
    mgr.free("long")                       # 100 blocks: one range
    cells, cleared, _ = mgr.page_table.logged()
    assert len(cells) == 0 and cleared is not None and len(cleared) == 1
    s = mgr.prepare_batch((), ["d"])       # token TPB + 1 opens no block
    cap.consume(s)
    mgr.settle(s)
    mgr.synchronize()
    assert cap.mismatches() == []


def test_ranges_across_features(monkeypatch):
    """Cleared ranges beside every feature that writes or clears table rows: prefix caching (hits written at
    add, freed rows), the host tier (suspend clears a row, resume writes it again), two devices, graphs,
    padding, speculative rejections, steps settled late, and rows freed and taken again in one interval.
    Every snapshot ships exactly the logged cells with the host table's values (unpacked as the kernels
    read them), each device's mirror is checked after every step, and every step's tables on every device
    against the reference."""
    from cupykv import pipeline
    from cupykv.backends.host import _deltas
    from cupykv.storage import KVStorage
    seen = {"ranges": 0, "expanded": 0}
    pack, current = pipeline.pack_snapshot, {}

    def checked_pack(buf, *args, cleared=None, **kw):
        words = pack(buf, *args, cleared=cleared, **kw)
        mgr = current["mgr"]
        snap = staging.unpack_snapshot(buf[:words], mgr.layout.num_groups)
        assert snap["num_cells"] == int(snap["run_coff"][-1])
        cells, values = _deltas(snap)
        assert np.array_equal(values, mgr.page_table.flat[cells])
        assert np.array_equal(np.unique(cells), np.unique(mgr.page_table.logged_cells()))
        seen["ranges"] += 0 if cleared is None else len(cleared)
        return words

    monkeypatch.setattr(pipeline, "pack_snapshot", checked_pack)
    for seed in range(24):
        rng = np.random.default_rng(seed)
        caching, scratch = bool(rng.integers(2)), bool(rng.integers(2))
        tier = rng.random() < (0.3 if caching else 0.6)
        spec = cupykv.CacheSpec(windows=[32, None, 64], num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                                max_seq_len=2048, max_batch=6, slots_per_group=1500, max_rewind=3,
                                swa_scratch_reuse=scratch, dtype="float32", prefix_caching=caching,
                                table_mode="shared" if not scratch and rng.integers(2) else "per_layer",
                                sink_tokens=int(rng.choice([0, 8])))
        mgr = cupykv.KVCacheManager(spec, backend="host", debug_verify_mirror=True,
                                    devices=None if tier else [0, 1], use_graphs=bool(rng.integers(2)))
        current["mgr"] = mgr
        expand = mgr.page_table._still_cleared

        def counted_expand(expand=expand, table=mgr.page_table):
            before = len(table._cleared)
            out = expand()
            seen["expanded"] += before - (0 if out is None else len(out))
            return out

        mgr.page_table._still_cleared = counted_expand
        tier_of = KVStorage(mgr, host_tier_bytes=1 << 22).host_tier if tier else None
        caps = [Capture(mgr, rank=r) for r in range(len(mgr.backends))]
        prompts, decoding, suspended, pending, nid = {}, [], set(), [], 0

        def busy():
            return {r for s, _ in pending for r in s.request_ids}

        for it in range(100):
            for r in [r for r in decoding if r not in busy() and rng.random() < 0.1]:
                mgr.free(r)                 # rows given to the adds below, in the same interval
                decoding.remove(r)
                suspended.discard(r)
            while len(prompts) + len(decoding) < spec.max_batch and rng.random() < 0.5:
                n = int(rng.integers(10, 1900))
                ids = np.concatenate((1000 + 13 * np.arange(min(n, 700)), 5000 + 977 * nid + np.arange(700, n)))
                cached = mgr.add(nid, n, tokens=ids) if caching else mgr.add(nid, n)
                prompts[nid] = n - cached
                nid += 1
            if tier_of is not None and not pending:
                for r in decoding:
                    if r in suspended and rng.random() < 0.5:
                        try:
                            tier_of.resume(r)
                            suspended.discard(r)
                        except OutOfSlotsError:
                            pass
                    elif r not in suspended and rng.random() < 0.15:
                        try:
                            tier_of.suspend(r)
                            suspended.add(r)
                        except cupykv.host_tier.HostTierFullError:
                            pass
            ctx = {r: min(left, int(rng.choice([8, 100, 700, 1200])))
                   for r, left in list(prompts.items())[:2] if r not in busy()}
            k = int(rng.integers(1, 4))
            gen = [r for r in decoding if r not in suspended and r not in busy()
                   and mgr.request(r).capacity + k <= spec.max_seq_len]
            if ctx or gen:
                pad = int(rng.integers(len(ctx) + len(gen), spec.max_batch + 1)) if rng.random() < 0.3 else None
                try:
                    step = mgr.prepare_batch(ctx, gen, num_gen_tokens=k, pad_to=pad)
                except OutOfSlotsError:
                    step = None
                if step is not None:
                    for c in caps:
                        c.consume(step)
                    pending.append((step, {r: int(rng.integers(1, k + 1)) for r in gen}))
                    for r, n in ctx.items():
                        prompts[r] -= n
                        if not prompts[r]:
                            del prompts[r]
                            decoding.append(r)
            while pending and (step is None or len(pending) > int(rng.integers(0, 3))):
                mgr.settle(*pending.pop(0))
        while pending:
            mgr.settle(*pending.pop(0))
        mgr.synchronize()
        for c in caps:
            assert c.mismatches() == [], seed
    assert seen["ranges"] > 100 and seen["expanded"] > 20, seen


# -- list steps: the last snapshot repacked ---------------------------------------------------------------

@pytest.mark.parametrize("ring_slots", [1, 4])
def test_list_steps_repack_what_the_general_pack_packs(backend_name, ring_slots, monkeypatch):
    """A decode step of the previous step's very list, which rebuilt no entry, copies the previous step's
    snapshot, writes its id and start positions and packs its own table deltas (pipeline._DecodeList;
    a quiet step, with no delta after one with none, packs nothing). Every such snapshot must be the bytes
    pack_snapshot gives for the step, and every step's tables and write positions the reference's, across
    block openings, window releases, another list now and then, a change of padding or of tokens per entry,
    a failed launch, frees and adds outside the list. With one ring slot, every step writes the slot that
    holds the template."""
    from cupykv import pipeline
    spec = cupykv.CacheSpec(windows=[16, None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                            max_seq_len=4096, max_batch=6, slots_per_group=600, max_rewind=2)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name, ring_slots=ring_slots)
    cap = Capture(mgr, write_positions=True)
    repacked, repack = [], pipeline._DecodeList.repack

    def checked(self, buf, step, cells, values, cleared, written):
        words = repack(self, buf, step, cells, values, cleared, written)
        entries = mgr.pipeline.entries          # a list step rebuilds nothing; the entries past it stay held
        rebuilt, held = np.zeros(0, np.int64), entries.holder[max(len(step.rows), step.pad_to):entries.held_end]
        want = np.zeros(words + 64, np.int32)
        n = staging.pack_snapshot(want, step.id, step.rows, step.scratch_begs, step.scratch_ends,
                                  step.scratch_slots, cells, values,
                                  np.concatenate(([0], np.cumsum(step.num_tokens))), step.start_positions,
                                  mode=staging.MODE_DELTA, pad_to=step.pad_to, rebuilt=rebuilt, held=held,
                                  cleared=cleared, written=written)
        deltas = len(cells) > 0 or cleared is not None or written is not None
        repacked.append((n == words and np.array_equal(buf[:words], want[:n]), step.id, deltas))
        return words
    monkeypatch.setattr(pipeline._DecodeList, "repack", checked)
    rng = np.random.default_rng(ring_slots)
    for r, n in (("a", 21), ("b", 40), ("c", 9)):
        mgr.add(r, n)
    s = mgr.prepare_batch({"a": 21, "b": 40, "c": 9})
    cap.consume(s)
    mgr.settle(s)
    ids, k, pad, other = ["a"], 1, None, 0
    for it in range(400):
        if it % 50 == 49:
            ids = ["a", "b"] if len(ids) == 1 else ["a"]        # another list from now on
        if it % 37 == 36:
            k = 2 if k == 1 else 1
        if it % 61 == 60:
            pad = 4 if pad is None else None
        if it % 23 == 22:       # a request outside the list comes and goes
            mgr.add(f"x{other}", 5)
            s = mgr.prepare_batch({f"x{other}": 5})
            cap.consume(s)
            mgr.settle(s)
            mgr.free(f"x{other}")
            other += 1
        if it == 200 and backend_name == "host":
            prepare_with_a_failed_build(monkeypatch, mgr, (), ids, k, pad)
            mgr.synchronize()
        gen = ids if it % 29 != 28 else ["c"]                   # one step of another list
        s = mgr.prepare_batch((), gen, num_gen_tokens=k, pad_to=pad)
        cap.consume(s)
        mgr.settle(s, None if it % 13 else [int(rng.integers(0, k + 1)) for _ in gen])
        if ring_slots == 1:     # the slot's copy done: the ring keeps its one slot, which every step writes
            mgr.synchronize()
    mgr.synchronize()
    assert cap.mismatches() == []
    bad = [i for ok, i, _ in repacked if not ok]
    with_deltas = sum(deltas for _, _, deltas in repacked)
    assert len(repacked) - with_deltas > 100 and with_deltas > 20 and not bad, (len(repacked), with_deltas, bad[:5])


def test_a_list_step_after_one_with_many_deltas_fits_its_smaller_slot(backend_name):
    """A step of the list whose previous step shipped many deltas (a prefix-cache hit's blocks, written into
    another request's row by add()) grew its ring slot; the next step of the list, with few deltas, gets
    another slot sized for its own snapshot. Its repack copies the list part, not the template's deltas,
    and packs its own; every step's tables and write positions are the reference's. A repack that copies the
    whole template there writes past the slot."""
    spec = cupykv.CacheSpec(windows=[None, None], num_kv_heads=1, head_dim=4, tokens_per_block=16,
                            max_seq_len=32768, max_batch=8, slots_per_group=8000, max_step_tokens=40000,
                            prefix_caching=True)
    mgr = cupykv.KVCacheManager(spec, backend=backend_name, ring_slots=2)
    cap = Capture(mgr, write_positions=True)
    rng = np.random.default_rng(0)
    repacked, repack = [], pipeline._DecodeList.repack

    def step(contexts, generation):
        s = mgr.prepare_batch(contexts, generation)
        cap.consume(s)
        mgr.settle(s)
        mgr.synchronize()       # every slot free again: the ring reuses them
        return s
    mgr.add("a", 20, tokens=rng.integers(0, 1000, 20))
    step({"a": 20}, [])
    tokens = rng.integers(0, 1000, 20000)
    mgr.add("b", 20000, tokens=tokens)
    for _ in range(20):         # chunks small enough for the ring's first slots
        step({"b": 1000}, [])
    for _ in range(3):
        step({}, ["a"])
    mgr.add("c", 20000, tokens=tokens)        # c's row gets b's 1250 cached blocks a group: written ranges

    def counted(self, buf, step, *deltas):
        repacked.append((self.words, len(buf)))
        return repack(self, buf, step, *deltas)
    pipeline._DecodeList.repack = counted
    try:
        for _ in range(4):
            step({}, ["a"])
    finally:
        pipeline._DecodeList.repack = repack
    # the first of these steps ships c's written ranges, and its snapshot is the next one's template; that
    # one is repacked into a slot shorter than the template
    assert any(words > size for words, size in repacked), repacked
    assert cap.mismatches() == []
