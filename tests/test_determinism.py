"""Determinism for tensor parallelism with one manager per rank (issue 14, SGLang / TensorRT-LLM style).

Every rank runs its own KVCacheManager and relies on all of them making the same decisions. Two kinds
of test here (docs/determinism.md is their summary):

1. test_identical_calls_identical_decisions: several managers ("ranks") get exactly the same sequence
   of calls (a random, rich workload: adds of varied prompts, chunked prefill, decode, speculative
   decoding with rejections, frees, request ids of mixed types; prefix caching with shared prefixes and
   follow-ups; null slots; a consumer held behind a gate for a few steps). After every call their host
   state, table, stats and cache events must be equal, every step record too, and every step's output
   tables and write positions. Manager 0 is also driven through the oracle (tests/oracle.py: Modelled,
   or PrefixModelled with prefix caching; expected_tables, expected_write_positions, check_slots), so
   the test checks that the shared decisions are right, not only that they agree.

   The finish events must be in the same state on every rank at every point where a manager polls them
   (see 2.). The workload makes that so on both backends: a step read on the host is finished and its
   finish event waited for before the next call; during a hold phase a gate on each manager's consumer
   stream keeps every finish event of the phase pending until the phase's synchronize().

2. What breaks determinism, each test asserting that the divergence really happens: the order of adds
   (table rows), the order of a batch (batch order and slot choice), the order of free() calls (with
   prefix caching: the eviction order), an extra polling call (stats(), reclaim(), ...) on one rank, and
   the timing of finish events (which steps' quarantine has lifted at a prepare: slot choice, prefix
   cache evictions and so hit lengths, OutOfSlotsError). Gates force both interleavings; no sleeps.
   Also pinned down: what does not break it (equal request ids of other types, the process's hash seed,
   use_graphs, the order of free() calls without prefix caching once the next step is prepared).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import cupykv
from cupykv.errors import CupykvError, OutOfSlotsError
from oracle import (BAD, Capture, Modelled, PrefixModelled, check_slots, expected_write_positions,
                    null_slots, reference_tables)

TPB = 8
MAX_REWIND = 3
BASE = dict(windows=[32, None, 64, None, 32, 32], sink_tokens=4, num_kv_heads=1, head_dim=4,
            tokens_per_block=TPB, max_seq_len=192, max_batch=6, max_rewind=MAX_REWIND,
            swa_scratch_reuse=True)
# Groups: window 32 (layers 0, 4, 5; 4 sink tokens), full attention (layers 1, 3), window 64 (layer 2).
# Pools small enough that slots run short now and then (reuse of reclaimed slots, OutOfSlotsError, and
# with prefix caching evictions of cached blocks).
SPECS = {
    "mixed": dict(slots_per_group=[30, 100, 44]),
    "prefix": dict(slots_per_group=[36, 100, 48], prefix_caching=True, prefix_events=True),
    "null_slot": dict(slots_per_group=[30, 100, 44], null_slot=True),
    "prefix_null_all": dict(slots_per_group=[48, 100, 48], prefix_caching=True, prefix_events=True, null_slot=True,
                            prefix_retention="all"),
}
ROUNDS = 100
STATS_RATE = 0.3        # calls after which every rank is asked for stats()


def make_spec(name: str) -> cupykv.CacheSpec:
    return cupykv.CacheSpec(**BASE, **SPECS[name])


def draw_seed() -> int:
    """A fresh seed per run (CUPYKV_DETERMINISM_SEED=N replays one), printed in every failure message."""
    env = os.environ.get("CUPYKV_DETERMINISM_SEED")
    return int(env) if env else int(np.random.SeedSequence().entropy % 2 ** 32)


def step_record(step) -> tuple:
    """Everything a step decided, comparable across managers (ids by repr: 5 and np.int64(5) differ)."""
    return (step.id, [repr(r) for r in step.request_ids], step.rows.tolist(), step.incarnations.tolist(),
            step.num_tokens.tolist(), step.start_positions.tolist(), step.num_contexts, step.pad_to, step.mode,
            step.scratch_begs.tolist(), step.scratch_ends.tolist(), step.scratch_slots.tolist())


def oracle_outputs(mgr, table, step):
    """The reference tables of a step's rows and padding rows, and its write positions (tests/oracle.py)."""
    rows = max(step.num_seqs, step.pad_to)
    nulls = null_slots(mgr)
    tables = reference_tables(mgr.spec, table, step.rows, step.num_contexts, step.scratch_begs, step.scratch_ends,
                              step.scratch_slots, null_slots=nulls, pad_to=step.pad_to)[:, :rows]
    pages, offsets = expected_write_positions(mgr.spec, tables[:, :step.num_seqs], step.num_tokens,
                                              step.start_positions, null_slots=nulls)
    return tables, pages, offsets


@contextlib.contextmanager
def no_gc():
    """No garbage collection while a gate holds a stream. On the GPU, freeing pinned memory (cudaFreeHost,
    e.g. of an earlier test's manager collected now) waits for the device, so the host would stall until
    the gate times out, and the gate would then let the held finish events complete on that rank only
    (docs/design.md, "GPU facts the design relies on")."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def assert_equal_across(values, what: str) -> None:
    for i, v in enumerate(values[1:], 1):
        same = (v == values[0]) if not isinstance(v, np.ndarray) else np.array_equal(v, values[0])
        assert same, f"{what}: manager {i} differs from manager 0:\n  0: {values[0]!r}\n  {i}: {v!r}"


# --------------------------------------------------------------------------------------------------
# The ranks: the same calls to every manager, compared after each
# --------------------------------------------------------------------------------------------------
class Ranks:
    """Several managers given the same calls. Manager 0 goes through the oracle's driver (Modelled or
    PrefixModelled), which checks each of its calls and its whole state; the others are compared with it
    after every call. With compare=False there is one manager and no checks (the trace digest)."""

    def __init__(self, spec, backends, rng: np.random.Generator, *, compare: bool = True):
        self.spec = spec
        self.rng = rng                  # where stats() is called
        self.compare = compare
        # ring_slots covers a hold phase's steps (no ring growth behind a gate); a host wait for a gated
        # finish event gives up fast on the GPU (the host backend knows at once); use_graphs on manager 1
        # (it must not change a decision).
        self.mgrs = [cupykv.KVCacheManager(spec, backend=b, ring_slots=8, staging_timeout_s=0.05,
                                           use_graphs=(i == 1)) for i, b in enumerate(backends)]
        self.model = None
        if compare:
            self.model = (PrefixModelled if spec.prefix_caching else Modelled)(self.mgrs[0])
        self.captures = [Capture(m, write_positions=True) for m in self.mgrs]
        self.gates = None
        self.calls = 0
        self.log: list = []                   # the last calls, for failure messages
        self.events = [[] for _ in self.mgrs]       # cache events drained after each call
        for i, m in enumerate(self.mgrs):      # every drain (the oracle's too) is recorded
            m.drain_cache_events = self._recording(m.drain_cache_events, self.events[i])
        self.trace = hashlib.blake2b(digest_size=16)
        self.seen = Counter()

    @staticmethod
    def _recording(drain, log):
        def drain_and_record():
            events = drain()
            log.extend(events)
            return events
        return drain_and_record

    # -- calls ---------------------------------------------------------------------------------
    def _each(self, what: str, fn):
        """fn(i, target) on every manager (target: the oracle driver for manager 0); the outcomes (value
        or CupykvError class and message) must agree."""
        self.calls += 1
        self.log = (self.log + [f"#{self.calls} {what}"])[-12:]
        outs, errors = [], []
        for i, m in enumerate(self.mgrs):
            target = self.model if (i == 0 and self.model is not None) else m
            try:
                outs.append(fn(i, target))
                errors.append(None)
            except CupykvError as e:
                outs.append(None)
                errors.append((type(e).__name__, str(e)))
        self.trace.update(repr((what, errors[0])).encode())
        if self.compare:
            assert_equal_across(errors, f"outcome of {what}")
        if errors[0] is not None:
            self.seen[errors[0][0]] += 1
            if errors[0][0] != "OutOfSlotsError":
                raise AssertionError(f"the workload made an invalid call: {what}: {errors[0]}")
        return outs, errors[0]

    def add(self, rid, n, **kw):
        def one(i, t):
            got = t.add(rid, n, **kw)
            return 0 if got is None else got        # Modelled.add returns nothing (no caching: 0)
        outs, _ = self._each(f"add({rid!r}, {n}{', salt' if kw.get('cache_salt') else ''})", one)
        self.trace.update(repr(outs[0]).encode())
        if self.compare:
            assert_equal_across(outs, f"add({rid!r}) cached tokens")
        self.check()
        return outs[0]

    def free(self, rid):
        self._each(f"free({rid!r})", lambda i, t: t.free(rid))
        self.check()

    def prepare(self, contexts, generation, k, pad_to):
        def one(i, t):
            if t is self.model:
                step = t.prepare(contexts, generation, k, pad_to=pad_to)
            else:
                step = t.prepare_batch(contexts, generation, k, pad_to=pad_to)
            return step, self.mgrs[i].table.copy()
        outs, err = self._each(f"prepare({list(contexts.items())}, {generation!r}, k={k}, pad_to={pad_to})", one)
        if err is not None:
            self.check()
            return None
        steps, tables = [s for s, _ in outs], [t for _, t in outs]
        records = [step_record(s) for s in steps]
        self.trace.update(repr(records[0]).encode())
        if self.compare:
            assert_equal_across(records, "step record")
        self.check()
        return steps, tables

    def settle(self, steps, accepted, new_tokens):
        def one(i, t):
            if t is self.model and not self.spec.prefix_caching:
                return t.settle(steps[i], accepted)            # Modelled.settle takes no tokens
            return t.settle(steps[i], accepted, new_tokens=new_tokens)
        self._each(f"settle({steps[0].id}, {accepted!r})", one)
        self.check()

    def synchronize(self):
        def one(i, t):
            if t is self.model and self.spec.prefix_caching:
                return t.synchronize()           # PrefixModelled lifts its model's quarantine too
            return self.mgrs[i].synchronize()
        self._each("synchronize()", one)
        self.check()

    def reclaim(self):
        def one(i, t):
            self.mgrs[i].reclaim()
            if t is self.model and self.spec.prefix_caching:
                t.model.lift(t.finished_through())       # the model lifts what the manager lifted
        self._each("reclaim()", one)
        self.check()

    # -- consumers -------------------------------------------------------------------------------
    def read_on_host(self, steps, tables):
        """The default consumer: wait for ready, read the outputs with to_numpy, finish on the manager
        stream, and wait for the finish event (so it has completed on every rank before the next call)."""
        outs = []
        for m, step in zip(self.mgrs, steps):
            step.ready.synchronize()
            rows, T, to_np = max(step.num_seqs, step.pad_to), step.total_tokens, m.backend.to_numpy
            outs.append((to_np(step.tables)[:, :rows], to_np(step.write_pages)[:, :T], to_np(step.write_offsets)[:T]))
            step.finish()
            m.backend.synchronize()
        self._check_outputs(steps, tables, outs)

    def hold_begin(self, count: int):
        """Hold every manager's consumer stream behind a gate for the next `count` steps."""
        for cap in self.captures:
            cap.reserve(count)
        self._no_gc = no_gc()
        self._no_gc.__enter__()
        self.gates = [m.backend.gate(cap.stream) for m, cap in zip(self.mgrs, self.captures)]

    def read_held(self, steps):
        for cap, step in zip(self.captures, steps):
            cap.consume(step)       # waits for ready, copies the outputs out, finishes on its stream

    def hold_end(self):
        for gate in self.gates:
            gate.open()
        self._no_gc.__exit__(None, None, None)
        self.synchronize()
        for cap in self.captures:
            cap.stream.synchronize()
        assert not any(g.close_timeout_hit() for g in self.gates)
        self.gates = None
        items = [cap.items for cap in self.captures]
        for k in range(len(items[0])):
            steps = [it[k][0] for it in items]
            tables = [it[k][1] for it in items]
            outs = []
            for m, it in zip(self.mgrs, items):
                step, _, buf, pages, offsets, _refs = it[k]
                rows, T, to_np = max(step.num_seqs, step.pad_to), step.total_tokens, m.backend.to_numpy
                outs.append((to_np(buf)[:, :rows], to_np(pages)[:, :T], to_np(offsets)[:T]))
            self._check_outputs(steps, tables, outs)
        if self.compare:   # the oracle's own check of the captured steps (it also checks write targets)
            assert self.captures[0].mismatches() == [], "held steps differ from the reference"
        for cap in self.captures:
            cap.items.clear()

    def _check_outputs(self, steps, tables, outs):
        step = steps[0]
        for t, p, o in outs[:1]:
            self.trace.update(t.tobytes() + p.tobytes() + o.tobytes())
        if not self.compare:
            return
        for j, part in enumerate(("tables", "write pages", "write offsets")):
            assert_equal_across([o[j] for o in outs], f"step {step.id} {part}")
        want = oracle_outputs(self.mgrs[0], tables[0], step)
        for j, part in enumerate(("tables", "write pages", "write offsets")):
            assert np.array_equal(outs[0][j], want[j]), f"step {step.id} {part} differ from the oracle"
        assert not (outs[0][1] == BAD).any(), f"step {step.id}: a new token has no page"

    # -- the comparison after every call -----------------------------------------------------------
    def check(self):
        """After every call: equal cache events, state() and tables, and manager 0 against the oracle;
        on a random third of the calls (the same on every rank) stats() too. stats() polls the finish
        events, so where it is called is part of the call sequence; not polling after every call leaves
        the quarantine to lift at the prepares, as on a rank that never asks for stats."""
        polls = self.rng.random() < STATS_RATE
        if not self.compare:
            if polls:
                self.trace.update(repr(self.mgrs[0].stats()).encode())
            return
        if self.spec.prefix_events:
            self.model.check_events()          # drains manager 0's events against the model's
            for m in self.mgrs[1:]:
                m.drain_cache_events()
            assert_equal_across(self.events, "cache events")
            for log in self.events:
                log.clear()
        if polls:
            self.model.check()                  # manager 0 against the oracle, stats() included
            stats = [self.mgrs[0].stats()] + [m.stats() for m in self.mgrs[1:]]
            assert_equal_across(stats, "stats()")
        elif self.spec.prefix_caching:
            self.model.check(stats=False)
        else:
            self.model.model.check_table(self.mgrs[0])
            check_slots(self.mgrs[0], self.model.scratch_held(), with_stats=False)
        assert_equal_across([m.state() for m in self.mgrs], "state()")
        assert_equal_across([m.table.copy() for m in self.mgrs], "mgr.table")


# --------------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------------
class Workload:
    """A random serving loop over Ranks: the driver reads request state from manager 0 (equal on all)."""

    def __init__(self, ranks: Ranks, rng: np.random.Generator):
        self.r, self.rng = ranks, rng
        self.spec = ranks.spec
        self.mgr = ranks.mgrs[0]
        self.next_id = 0
        self.live: dict = {}            # rid -> dict(target=total length, known=token list or None, salt=)
        self.freed_ids: list = []
        self.done_convs: list = []      # (known tokens, salt) of freed requests (follow-up turns)
        self.systems = [rng.integers(1, 50_000, int(n)).tolist() for n in (19, 27, 40)]
        self.pending = None             # (steps, entries) of the step left unsettled (overlap)
        self.last_decode = None         # (generation, k, pad_to) of the last pure decode step
        self.scheduled_later: set = set()

    # -- request ids of mixed types; a freed id comes back now and then, as another type -------------
    def new_id(self):
        if self.freed_ids and self.rng.random() < 0.15:
            value = self.freed_ids.pop(int(self.rng.integers(len(self.freed_ids))))
            self.r.seen["reused_id"] += 1
        else:
            value, self.next_id = self.next_id, self.next_id + 1
        kind = int(self.rng.integers(4))
        return [value, f"req-{value}", np.int64(value), np.int32(value)][kind]

    def add(self):
        rng, prefix = self.rng, self.spec.prefix_caching
        rid = self.new_id()
        kw, known, salt = {}, None, None
        if not prefix:
            n = int(rng.choice([1, 5, 8, 16, 31, 47, 64, 90, 130])) + int(rng.integers(0, 3))
        else:
            if self.done_convs and rng.random() < 0.5:          # a follow-up turn of a finished request
                prev, salt = self.done_convs.pop(int(rng.integers(len(self.done_convs))))
                toks = prev + rng.integers(1, 50_000, int(rng.integers(1, 20))).tolist()
                self.r.seen["follow_up"] += 1
            else:
                system = self.systems[int(rng.integers(len(self.systems)))]
                toks = system + rng.integers(1, 50_000, int(rng.integers(1, 50))).tolist()
                salt = [None, None, None, "tenant-b", b"tenant-b"][int(rng.integers(5))]
            toks = toks[:150]
            n = len(toks)
            kw = dict(tokens=np.array(toks, [np.int64, np.int32][int(rng.integers(2))]) if rng.random() < 0.5 else toks)
            if salt is not None:
                kw["cache_salt"] = salt
            if rng.random() < 0.3:
                kw["checkpoints"] = [min(n, 19)]
            known = list(toks)
        hit = self.r.add(rid, n, **kw)
        self.r.seen["hit_tokens"] += hit
        target = min(self.spec.max_seq_len - 1, n + int(rng.integers(1, 40)))
        self.live[rid] = dict(target=target, known=known, salt=salt)

    def free(self, rid):
        info = self.live.pop(rid)
        self.r.free(rid)
        self.freed_ids.append(int(rid) if not isinstance(rid, str) else int(rid.split("-")[1]))
        if info["known"] is not None and len(info["known"]) < 140:
            self.done_convs.append((info["known"], info["salt"]))

    # -- one round: adds and frees, a step, settles ----------------------------------------------
    def round(self, hold: bool):
        rng, mgr = self.rng, self.mgr
        for rid in [r for r, info in self.live.items() if mgr.request(r).capacity >= info["target"]]:
            if rng.random() < 0.8:
                self.free(rid)
        if self.live and rng.random() < 0.08:                  # an abort, maybe of a request in flight
            self.free(list(self.live)[int(rng.integers(len(self.live)))])
        while len(self.live) < self.spec.max_batch and rng.random() < 0.45:
            self.add()
        if rng.random() < 0.05:
            self.r.reclaim()
        plan = self.plan()
        if plan is None:
            return
        contexts, generation, k, pad_to = plan
        got = self.r.prepare(contexts, generation, k, pad_to)
        if got is None:                                          # out of slots on every rank
            if self.live:
                self.free(list(self.live)[int(rng.integers(len(self.live)))])
            return
        steps, tables = got
        self.r.seen["steps"] += 1
        self.r.seen["contexts"] += len(contexts)
        self.r.seen["scratch"] += int((steps[0].scratch_ends > steps[0].scratch_begs).sum())
        self.r.seen["delta"] += int(steps[0].mode == 1)
        if hold:
            self.r.read_held(steps)
            self.r.seen["held"] += 1
        else:
            self.r.read_on_host(steps, tables)
        if self.pending is not None:                 # the previous step settles after this one's prepare
            self.scheduled_later = set(map(repr, steps[0].request_ids))
            self.settle(*self.pending)
            self.r.seen["overlapped"] += 1
        self.pending = None
        self.scheduled_later = set()
        entries = list(zip(steps[0].request_ids, steps[0].num_tokens.tolist()))
        if rng.random() < 0.35:
            self.pending = (steps, entries, steps[0].num_contexts)
        else:
            self.settle(steps, entries, steps[0].num_contexts)

    def plan(self):
        rng, mgr, spec = self.rng, self.mgr, self.spec
        if self.last_decode is not None and rng.random() < 0.3:     # a steady batch (DELTA tables)
            who, k, pad_to = self.last_decode
            if all(r in self.live and (mgr.request(r).row, mgr.request(r).incarnation) == (row, inc)
                   and mgr.request(r).capacity + k <= spec.max_seq_len for r, row, inc in who):
                return {}, [r for r, _, _ in who], k, pad_to
        rids = list(self.live)
        rng.shuffle(rids)
        contexts, generation = {}, []
        k = int(rng.choice([1, 1, 2, 4])) if rng.random() < 0.5 else 1
        for rid in rids:
            req = mgr.request(rid)
            rest = req.prompt_len - req.capacity
            if rest > 0 and len(contexts) < 3:
                contexts[rid] = int(rest if rng.random() < 0.4 else rng.integers(1, rest + 1))
            elif rest <= 0 and req.capacity + k <= spec.max_seq_len and rng.random() < 0.85:
                generation.append(rid)
        if not contexts and not generation:
            return None
        n = len(contexts) + len(generation)
        pad_to = None if rng.random() < 0.7 else int(rng.integers(n, spec.max_batch + 1))
        self.r.seen["pad"] += pad_to is not None and pad_to > n
        who = [(r, mgr.request(r).row, mgr.request(r).incarnation) for r in generation]
        self.last_decode = (who, k, pad_to) if generation and not contexts else None
        self.r.seen["speculative"] += k > 1 and bool(generation)
        return contexts, generation, k, pad_to

    def settle(self, steps, entries, num_contexts):
        rng = self.rng
        acc, toks = {}, {}
        for j, (rid, n) in enumerate(entries):
            info = self.live.get(rid)
            if j < num_contexts or info is None or not self.same_request(rid, steps[0], j):
                continue                         # a context chunk, or freed since the prepare
            a = n
            if repr(rid) not in self.scheduled_later and rng.random() < 0.4:
                a = int(rng.integers(max(0, n - MAX_REWIND), n + 1))      # speculative tokens rejected
                self.r.seen["rejected_tokens"] += n - a
            acc[rid] = a
            if self.spec.prefix_caching and a > 0:
                if rng.random() < 0.9 and info["known"] is not None:
                    toks[rid] = rng.integers(1, 50_000, a).tolist()
                    info["known"] = info["known"] + toks[rid]
                else:
                    info["known"] = None        # its later blocks are never cached
        if rng.random() < 0.3:                   # accepted in batch order instead of by id
            accepted = [acc.get(rid, n) for rid, n in entries]
        else:
            accepted = acc if acc or rng.random() < 0.5 else None
        self.r.settle(steps, accepted, toks if self.spec.prefix_caching else None)

    def same_request(self, rid, step, j: int) -> bool:
        """Is the live request with this id the one entry j of the step scheduled (not a re-added id)?"""
        req = self.mgr.request(rid)
        return req.row == int(step.rows[j]) and req.incarnation == int(step.incarnations[j])

    def run(self, rounds: int):
        rng = self.rng
        left = 0
        for _ in range(rounds):
            if left == 0 and self.r.gates is None and rng.random() < 0.2:
                left = int(rng.integers(1, 4))
                self.r.hold_begin(left)
            self.round(hold=left > 0)
            if left:
                left -= 1
                if left == 0:
                    self.r.hold_end()
        if self.r.gates is not None:
            self.r.hold_end()
        if self.pending is not None:
            self.settle(*self.pending)
            self.pending = None
        for rid in list(self.live):
            self.free(rid)
        self.r.synchronize()


def run_ranks(spec_name: str, seed: int, backends, rounds: int = ROUNDS, compare: bool = True) -> Ranks:
    ranks = Ranks(make_spec(spec_name), backends, np.random.default_rng([seed, 1]), compare=compare)
    Workload(ranks, np.random.default_rng(seed)).run(rounds)
    return ranks


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_identical_calls_identical_decisions(backend_name, spec_name):
    """Three managers given the same calls make the same decisions, after every call, and manager 0's
    are the oracle's. On the GPU the third manager runs on the host backend: a CPU-only rank agrees."""
    seed = draw_seed()
    print(f"seed={seed} (CUPYKV_DETERMINISM_SEED={seed} replays it)")
    backends = [backend_name, backend_name, "host"]
    ranks = Ranks(make_spec(spec_name), backends, np.random.default_rng([seed, 1]))
    try:
        Workload(ranks, np.random.default_rng(seed)).run(ROUNDS)
    except AssertionError as e:
        gc.enable()                             # a failure inside a hold phase
        calls = "\n  ".join(ranks.log)
        raise AssertionError(f"seed={seed} spec={spec_name} (CUPYKV_DETERMINISM_SEED={seed} replays it); "
                             f"last calls:\n  {calls}\n{e}") from e
    seen = ranks.seen
    # The workload really was rich (else agreement would prove little).
    assert seen["steps"] >= 40 and seen["held"] >= 3 and seen["overlapped"] >= 3, (seed, seen)
    assert seen["contexts"] >= 10 and seen["speculative"] >= 3 and seen["rejected_tokens"] > 0, (seed, seen)
    assert seen["scratch"] > 0 and seen["pad"] > 0, (seed, seen)
    if make_spec(spec_name).prefix_caching:
        assert seen["hit_tokens"] > 0 and seen["follow_up"] > 0, (seed, seen)
    for m in ranks.mgrs:           # everything given back at the end
        for g in m.stats()["groups"]:
            assert g["owned"] == g["scratch"] == g["quarantined"] == 0, g


# --------------------------------------------------------------------------------------------------
# What breaks determinism (and what does not): each divergence is asserted, and each manager is still
# right by the oracle; they just decided differently.
# --------------------------------------------------------------------------------------------------
def small_manager(backend_name, **kw) -> cupykv.KVCacheManager:
    """Two groups (window 32, full attention), tpb 8. A host wait for a gated finish event gives up
    after staging_timeout_s on the GPU (bounds the test; nothing is timed)."""
    spec = dict(windows=[32, None], num_kv_heads=1, head_dim=4, tokens_per_block=TPB, max_seq_len=128,
                max_batch=6, slots_per_group=40)
    spec.update(kw)
    return cupykv.KVCacheManager(cupykv.CacheSpec(**spec), backend=backend_name, staging_timeout_s=0.05)


def step_on_host(mgr, contexts=(), generation=(), k=1, accepted=None, new_tokens=None):
    """prepare, read the outputs after ready (checked against the oracle), finish, wait for the finish
    event, settle. Returns (step, (tables, write pages, write offsets))."""
    step = mgr.prepare_batch(contexts, generation, k)
    table = mgr.table.copy()
    step.ready.synchronize()
    to_np, T = mgr.backend.to_numpy, step.total_tokens
    outs = (to_np(step.tables)[:, :step.num_seqs], to_np(step.write_pages)[:, :T], to_np(step.write_offsets)[:T])
    for got, want in zip(outs, oracle_outputs(mgr, table, step)):
        assert np.array_equal(got, want), f"step {step.id} differs from the oracle"
    step.finish()
    mgr.backend.synchronize()
    mgr.settle(step, accepted, new_tokens=new_tokens)
    return step, outs


def row_slots(mgr, rid) -> list:
    """The slot of every block of the request, per group (BAD where none)."""
    return mgr.table[:, mgr.request(rid).row].tolist()


def test_add_order_changes_rows_not_outputs(backend_name):
    """add() takes the lowest free row, so the order of adds decides the rows: the host tables
    (mgr.table, state(), step.rows) differ. The outputs are in batch order and slots are handed out in
    batch order, so with the same batches the output tables and write positions stay equal."""
    a, b = small_manager(backend_name), small_manager(backend_name)
    a.add("x", 20)
    a.add("y", 30)
    b.add("y", 30)
    b.add("x", 20)
    assert (a.request("x").row, a.request("y").row) == (0, 1)
    assert (b.request("x").row, b.request("y").row) == (1, 0)
    outs = []
    for m in (a, b):
        steps = [step_on_host(m, {"x": 20, "y": 30})] + [step_on_host(m, (), ["x", "y"]) for _ in range(6)]
        outs.append(steps)
    assert not np.array_equal(a.table, b.table) and a.state() != b.state()
    for (sa, oa), (sb, ob) in zip(*outs):
        assert sa.rows.tolist() != sb.rows.tolist()
        assert all(np.array_equal(p, q) for p, q in zip(oa, ob)), f"step {sa.id}: outputs differ"
    assert row_slots(a, "x") == row_slots(b, "x") and row_slots(a, "y") == row_slots(b, "y")


@pytest.mark.parametrize("part", ["generation", "contexts"])
def test_batch_order_changes_batch_and_slots(backend_name, part):
    """The order of the generation list (or of the contexts mapping) is the batch order, and new blocks
    get their slots in batch order: the same requests in another order give another batch and other
    slots, which stay different for the life of those blocks."""
    a, b = small_manager(backend_name), small_manager(backend_name)
    for m in (a, b):
        m.add("x", 16)
        m.add("y", 16)
    if part == "contexts":
        sa, _ = step_on_host(a, {"x": 16, "y": 16})
        sb, _ = step_on_host(b, {"y": 16, "x": 16})
    else:
        for m in (a, b):
            step_on_host(m, {"x": 16, "y": 16})
        sa, _ = step_on_host(a, (), ["x", "y"])        # position 16 opens block 2 of both
        sb, _ = step_on_host(b, (), ["y", "x"])
    assert sa.request_ids == ["x", "y"] and sb.request_ids == ["y", "x"]
    assert row_slots(a, "x") != row_slots(b, "x") and row_slots(a, "y") != row_slots(b, "y")
    for m in (a, b):                                    # later identical calls do not bring them together
        for _ in range(3):
            step_on_host(m, (), ["x", "y"], k=4)
    assert row_slots(a, "x") != row_slots(b, "x")


def test_free_order_without_prefix_caching_converges(backend_name):
    """Without prefix caching, the order of free() calls between two prepares changes state() (the dirty
    log and the quarantine entry list the cells and slots in call order) but no decision: the slots of
    one release are sorted when their quarantine lifts, and the next prepare ships the log. From the
    next prepare_batch on the managers are equal again."""
    a, b = small_manager(backend_name), small_manager(backend_name)
    for m in (a, b):
        m.add("x", 24)
        m.add("y", 24)
        step_on_host(m, {"x": 24, "y": 24})
    a.free("x")
    a.free("y")
    b.free("y")
    b.free("x")
    assert a.state() != b.state()
    for m in (a, b):
        m.add("z", 40)
        step_on_host(m, {"z": 40})
        m.add("w", 9)
    assert a.state() == b.state() and np.array_equal(a.table, b.table)
    for m in (a, b):
        step_on_host(m, {"w": 9}, ["z"])
    assert a.state() == b.state()


def test_free_order_with_prefix_caching_changes_evictions_and_hits(backend_name):
    """With prefix caching, slots whose quarantine lifts become evictable in the order they were
    released, and eviction takes the least recently released first. Freeing x then y (rank a) or y then
    x (rank b) makes the next eviction drop x's blocks on a and y's on b: the same follow-up prompt then
    hits on one rank and misses on the other (add() returns different cached lengths)."""
    tokens = {"x": list(range(100, 124)), "y": list(range(500, 524)), "z": list(range(900, 924))}
    a, b = (small_manager(backend_name, slots_per_group=6, prefix_caching=True, prefix_events=True) for _ in range(2))
    for m in (a, b):
        for rid in ("x", "y"):
            m.add(rid, 24, tokens=tokens[rid])
        step_on_host(m, {"x": 24, "y": 24})
    a.free("x")
    a.free("y")
    b.free("y")
    b.free("x")
    for m in (a, b):
        m.synchronize()
        m.drain_cache_events()
        m.add("z", 24, tokens=tokens["z"])
        step_on_host(m, {"z": 24})                     # no free slot left: evicts 3 cached blocks a group
        assert [g["evictions"] for g in m.stats()["prefix_cache"]["groups"]] == [3, 3]
    hits = [(m.add("x2", 25, tokens=tokens["x"] + [7]), m.add("y2", 25, tokens=tokens["y"] + [7])) for m in (a, b)]
    assert hits == [(0, 24), (24, 0)]


@pytest.mark.parametrize("poll", ["stats", "reclaim", "steps_in_flight"])
def test_extra_poll_changes_slot_choice(backend_name, poll):
    """stats(), reclaim() and steps_in_flight lift the quarantine of finished steps, like every prepare.
    Between two releases tagged with the same step (a settle's out-of-window blocks, then a free), one
    extra poll on rank a lifts the first release alone; rank b lifts both at its next prepare, as one
    sorted release. The free lists then hold the same slots in another order, and the next step maps
    z's blocks to other slots on a than on b (c, b's twin, agrees with b). Polling calls are part of the
    call sequence."""
    a, b, c = (small_manager(backend_name) for _ in range(3))       # c: b's twin, the control
    for m in (a, b, c):
        m.add("x", 100)
        m.add("y", 20)
        step_on_host(m, {"x": 100, "y": 20})
    for _ in range(4):                                  # decode until a settle releases a block of x
        for m in (a, b, c):
            step_on_host(m, (), ["x", "y"], k=4)
        if a.pools[0].num_quarantined:
            break
    assert a.pools[0].num_quarantined and a.state() == b.state() == c.state()
    {"stats": a.stats, "reclaim": a.reclaim, "steps_in_flight": lambda: a.steps_in_flight}[poll]()
    for m in (a, b, c):
        m.free("y")                                    # the same tag as the settle's release
        m.add("z", 60)
        step_on_host(m, {"z": 60})
    assert b.state() == c.state()
    assert row_slots(a, "z") != row_slots(b, "z")        # z's blocks hold other slots on a


@pytest.fixture
def gated():
    """For tests that hold streams behind gates: no garbage collection meanwhile (see no_gc)."""
    with no_gc():
        yield


class HeldConsumer:
    """A consumer on its own stream behind a gate: its finish events stay pending until open()."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.cap = Capture(mgr, write_positions=True).reserve(4)
        self.gate = mgr.backend.gate(self.cap.stream)

    def open(self):
        self.gate.open()
        self.mgr.backend.synchronize()      # every finish event has completed now (no poll: no API call)

    def check(self):
        assert not self.gate.close_timeout_hit()
        assert self.cap.mismatches() == [], "a held step differs from the oracle"


def test_finish_timing_changes_slot_choice(backend_name, gated):
    """The same calls on two ranks; only when step N's consumer finishes differs. prepare_batch lifts
    the quarantine of finished steps (ledger.poll in _commit) before it allocates, and lifted slots are
    reused first: on rank a (N finished before the next prepare) request z gets x's old slots, on rank b
    (N's consumer still held) it gets fresh ones. Both are right; they differ for good."""
    a, b = small_manager(backend_name, slots_per_group=12), small_manager(backend_name, slots_per_group=12)
    held = {}
    for m in (a, b):
        m.add("x", 24)
        step_on_host(m, {"x": 24})
        m.add("z", 24)
        held[m] = HeldConsumer(m)
        step = m.prepare_batch((), ["x"])              # step N: x decodes at 24, opening block 3
        held[m].cap.consume(step)
        m.settle(step)
        m.free("x")                                    # x's 4 slots per group: quarantined behind step N
    old = [sorted(s for s in row if s != BAD) for row in held[a].cap.items[0][1][:, 0]]
    assert old == [[0, 1, 2, 3], [0, 1, 2, 3]]
    held[a].open()                                     # rank a: N's consumer is done before the prepare
    steps = {m: m.prepare_batch({"z": 24}) for m in (a, b)}
    for m in (a, b):
        held[m].cap.consume(steps[m])
    held[b].open()                                     # rank b: only now
    for m in (a, b):
        m.settle(steps[m])
        m.synchronize()
        held[m].check()
    assert step_record(steps[a]) == step_record(steps[b])     # the same batch (z has no slot metadata)
    za, zb = row_slots(a, "z"), row_slots(b, "z")
    assert [sorted(set(g) - {BAD}) for g in za] == [[0, 1, 2]] * 2      # x's old slots, reused
    assert [sorted(set(g) - {BAD}) for g in zb] == [[4, 5, 6]] * 2      # fresh ones
    assert a.state() != b.state()


def test_finish_timing_changes_prefix_hits(backend_name, gated):
    """With prefix caching the timing decides evictions, and so hits. A request y is aborted while its
    prefill step N runs; the next step needs 3 slots with 2 free. Rank a (N finished) takes y's slots back
    from quarantine; rank b (N still held) evicts one of p's cached blocks, which it reports ("removed").
    The same follow-up prompt of p then hits 24 tokens on rank a and none on rank b."""
    P, Y, Z = list(range(100, 124)), list(range(500, 524)), list(range(900, 924))
    F = list(range(2000, 2032))
    ranks = [small_manager(backend_name, slots_per_group=12, prefix_caching=True, prefix_events=True) for _ in range(2)]
    held, steps, events = {}, {}, {}
    for m in ranks:
        m.add("p", 24, tokens=P)                       # cached, then evictable: 3 blocks a group
        step_on_host(m, {"p": 24})
        m.free("p")
        m.add("f", 32, tokens=F)                       # a filler that holds 4 slots a group
        step_on_host(m, {"f": 32})
        m.synchronize()
        m.drain_cache_events()
        m.add("y", 24, tokens=Y)
        held[m] = HeldConsumer(m)
        step = m.prepare_batch({"y": 24})              # step N
        held[m].cap.consume(step)
        m.free("y")                                    # aborted in flight: 3 slots quarantined behind N
        m.settle(step)
        m.add("z", 24, tokens=Z)
        assert [g["free"] for g in m.stats()["groups"]] == [2, 2]
    a, b = ranks
    held[a].open()
    for m in ranks:
        steps[m] = m.prepare_batch({"z": 24})
        held[m].cap.consume(steps[m])
    held[b].open()
    for m in ranks:
        m.settle(steps[m])
        m.synchronize()
        held[m].check()
        events[m] = [kind for kind, _, _ in m.drain_cache_events()]
    assert events[a].count("removed") == 0 and events[b].count("removed") == 2     # one block per group
    assert [m.add("q", 29, tokens=P + [7] * 5) for m in ranks] == [24, 0]


def test_finish_timing_changes_out_of_slots(backend_name, gated):
    """A step that needs slots still quarantined behind an unfinished step: rank a's consumer has
    finished, so it prepares; rank b's is held, so its prepare raises OutOfSlotsError (on the GPU after
    waiting staging_timeout_s for the event) and leaves b as it was; b succeeds once its consumer is done."""
    a, b = small_manager(backend_name, slots_per_group=4), small_manager(backend_name, slots_per_group=4)
    held = {}
    for m in (a, b):
        m.add("x", 24)
        step_on_host(m, {"x": 24})
        held[m] = HeldConsumer(m)
        step = m.prepare_batch((), ["x"])              # opens block 3: every slot is x's
        held[m].cap.consume(step)
        m.settle(step)
        m.free("x")
        m.add("z", 24)
    held[a].open()
    sa = a.prepare_batch({"z": 24})
    held[a].cap.consume(sa)
    before = b.state()
    with pytest.raises(OutOfSlotsError):
        b.prepare_batch({"z": 24})
    assert b.state() == before
    held[b].open()
    sb = b.prepare_batch({"z": 24})
    held[b].cap.consume(sb)
    for m, s in ((a, sa), (b, sb)):
        m.settle(s)
        m.synchronize()
        held[m].check()
    assert step_record(sa)[1:] == step_record(sb)[1:]       # the same batch, one step id later on b


def test_equal_ids_of_other_types_make_the_same_decisions(backend_name):
    """Request ids are dict keys: 5 and np.int64(5) are the same request. Ranks that receive the ids as
    other (equal) types make the same decisions; only state() differs, since it names ids by repr."""
    a, b = small_manager(backend_name, max_rewind=1), small_manager(backend_name, max_rewind=1)
    ids_a, ids_b = [5, 6, 7], [np.int64(5), np.int32(6), 7]
    outs = []
    for m, ids in ((a, ids_a), (b, ids_b)):
        for rid, n in zip(ids, (30, 9, 17)):
            m.add(rid, n)
        got = [step_on_host(m, dict(zip(ids, (30, 9, 17))))]
        got += [step_on_host(m, (), ids, k=2, accepted={ids[0]: 1}) for _ in range(4)]
        m.free(ids[1])
        got += [step_on_host(m, (), [ids[2], ids[0]]) for _ in range(3)]
        outs.append(got)
    for (sa, oa), (sb, ob) in zip(*outs):
        assert step_record(sa)[1] != step_record(sb)[1] and sa.request_ids == sb.request_ids
        assert step_record(sa)[2:] == step_record(sb)[2:]
        assert all(np.array_equal(p, q) for p, q in zip(oa, ob))
    assert np.array_equal(a.table, b.table)
    sa, sb = a.state(), b.state()
    assert sa[0] == sb[0] and sa[2:] == sb[2:]          # table, pools, ledger, scratch
    assert sa[1] != sb[1]                               # the request table: ids by repr


TRACE = """
import sys
sys.path.insert(0, {tests!r})
import test_determinism as t
print(t.run_ranks({spec!r}, {seed}, ["host"], rounds={rounds}, compare=False).trace.hexdigest())
"""


def test_decisions_do_not_depend_on_the_hash_seed():
    """Ranks are separate processes, each with its own string-hash seed (PYTHONHASHSEED). The decisions
    of the random workload (string, int and numpy ids; prefix caching) hash to the same digest in this
    process and in two others with other hash seeds: nothing iterates a set or dict in hash order."""
    seed, rounds = draw_seed(), 40
    here = run_ranks("prefix", seed, ["host"], rounds=rounds, compare=False).trace.hexdigest()
    code = TRACE.format(tests=str(Path(__file__).parent), spec="prefix", seed=seed, rounds=rounds)
    digests = []
    for hash_seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        digests.append(out.stdout.strip())
    assert digests == [here, here], f"seed={seed}: digests {digests} != {here}"
