"""Stateful property test: random serving workloads against an independent model of the manager.

The model keeps its own history and capacity per request and derives from the formulas of DESIGN.md
section 2 which blocks must hold a slot; the manager's table must agree after every operation. Each
step's tables (captured by a consumer on another stream, gated at random) must equal the reference
computed from the host table at that step's prepare.
"""
import os

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cupykv
from cupykv import BAD, OutOfSlotsError
from conftest import Capture

EXAMPLES = int(os.environ.get("CUPYKV_PROPERTY_EXAMPLES", "500"))
TPB = 8


def cdiv(a, b):
    return -(-a // b)


class ModelRequest:
    def __init__(self, prompt):
        self.prompt, self.hist, self.cap = prompt, 0, 0
        self.stale_hi = {}            # group -> blocks below this (past the sinks) were released
        self.scratch = {}             # step id -> {group: (lo, hi)} of unsettled context chunks


class ManagerMachine(RuleBasedStateMachine):
    @initialize(pattern=st.sampled_from(["gptoss", "gemma", "sinks"]), rewind=st.integers(0, 2),
                scratch=st.booleans(), slots=st.integers(40, 160), graphs=st.booleans(), delta=st.booleans(),
                shared=st.booleans())
    def setup(self, pattern, rewind, scratch, slots, graphs, delta, shared):
        windows = {"gptoss": [24, None] * 2, "gemma": [32] * 5 + [None], "sinks": [16, 16, None]}[pattern]
        sinks = 8 if pattern == "sinks" else 0
        self.spec = cupykv.CacheSpec(windows=windows, num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                                     max_seq_len=256, max_batch=6, slots_per_group=slots, max_rewind=rewind,
                                     swa_scratch_reuse=scratch and not shared, sink_tokens=sinks,
                                     table_mode="shared" if shared else "per_layer")
        self.mgr = cupykv.KVCacheManager(self.spec, backend="host", use_graphs=graphs, steady_batch_delta=delta)
        self.lay = self.mgr.layout
        self.cap = Capture(self.mgr)
        self.model = {}
        self.next_rid = 0
        self.gate = None
        self.unsettled = []
        self.unfinished_seen = []     # (step, {group: {slot: (request, block) or "scratch"}})

    # -- operations ------------------------------------------------------------------------------
    ACTIONS = ["add"] * 2 + ["step"] * 6 + ["settle"] * 4 + ["free"] + ["drain"]

    @rule(data=st.data())
    def act(self, data):
        """One operation, drawn with weights so that workloads run many steps."""
        action = data.draw(st.sampled_from(self.ACTIONS), label="action")
        if action == "add":
            self.add(data.draw(st.integers(1, 200), label="prompt"))
        elif action == "step":
            self.step(data)
        elif action == "settle" and self.unsettled:
            self.settle(data)
        elif action == "free" and self.model:
            self.free(data)
        elif action == "drain":
            self.open_gate_and_drain()

    def add(self, prompt):
        if len(self.model) == self.spec.max_batch:
            return
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self.mgr.add(rid, prompt)
        self.model[rid] = ModelRequest(prompt)

    def step(self, data):
        ctx, gen = {}, []
        for rid, m in self.model.items():
            if m.cap < m.prompt and data.draw(st.booleans(), label=f"ctx {rid}"):
                ctx[rid] = data.draw(st.integers(1, m.prompt - m.cap), label=f"chunk {rid}")
            elif m.cap == m.prompt and data.draw(st.booleans(), label=f"gen {rid}"):
                gen.append(rid)
        k = data.draw(st.integers(1, self.spec.max_rewind + 1), label="gen tokens")
        gen = [r for r in gen if self.model[r].cap + k <= self.spec.max_seq_len]
        if not ctx and not gen:
            return
        if self.gate is None and data.draw(st.booleans(), label="gate"):
            self.gate = self.mgr.backend.gate(self.mgr.backend.stream)
        before = self.mgr.state()
        try:
            s = self.mgr.prepare_batch(ctx, gen, num_gen_tokens=k)
        except OutOfSlotsError:
            assert self.mgr.state() == before
            return
        self.cap.consume(s)
        for rid, n in list(ctx.items()) + [(r, k) for r in gen]:
            m = self.model[rid]
            old, m.cap = m.cap, m.cap + n
            if rid in ctx:
                m.scratch[s.id] = {g.index: self.scratch_range(g, old, m.cap) for g in self.lay.groups}
        self.check_scratch_metadata(s, ctx)
        self.unsettled.append(s)
        self.unfinished_seen.append((s, self.seen_by(s)))

    def settle(self, data):
        s = self.unsettled.pop(0)
        accepted = {}
        for k, rid in enumerate(s.request_ids):
            m = self.model.get(rid)
            if m is None or m is not getattr(s, "_model", {}).get(rid, m) or k < s.num_contexts:
                continue
            n = int(s.num_tokens[k])
            latest = not any(rid in later.request_ids for later in self.unsettled)
            lo = max(0, n - self.spec.max_rewind) if latest else n
            accepted[rid] = data.draw(st.integers(lo, n), label=f"accept {rid}")
        self.mgr.settle(s, accepted)
        for k, rid in enumerate(s.request_ids):
            m = self.model.get(rid)
            if m is None:
                continue
            n = int(s.num_tokens[k])
            a = accepted.get(rid, n)
            m.hist += a
            m.cap -= n - a
            m.scratch.pop(s.id, None)
            for g in self.lay.groups:
                if g.window is not None:
                    hi = (m.hist + 1 - g.window) // TPB
                    m.stale_hi[g.index] = max(m.stale_hi.get(g.index, 0), hi)

    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)), label="free")
        self.mgr.free(rid)
        del self.model[rid]

    def open_gate_and_drain(self):
        if self.gate is not None:
            self.gate.open()
            self.gate = None
        self.mgr.synchronize()
        self.check_outputs()

    # -- the model's formulas --------------------------------------------------------------------
    def scratch_range(self, g, start, cap):
        if not self.spec.swa_scratch_reuse or g.window is None:
            return (0, 0)
        sink = cdiv(g.sink_tokens, TPB)
        hi = max(sink, (cap - self.spec.max_rewind + 1 - g.window) // TPB)
        lo, hi = max(sink, cdiv(start, TPB)), min(hi, cdiv(cap, TPB))
        return (lo, hi) if lo < hi else (0, 0)

    def expected_blocks(self, m, g):
        blocks = set(range(cdiv(m.cap, TPB)))
        if g.window is not None:
            sink = cdiv(g.sink_tokens, TPB)
            blocks -= set(range(sink, max(sink, m.stale_hi.get(g.index, 0))))
            for ranges in m.scratch.values():
                blocks -= set(range(*ranges[g.index]))
        return blocks

    def check_scratch_metadata(self, s, ctx):
        for k, rid in enumerate(ctx):
            for g in self.lay.groups:
                lo, hi = self.model[rid].scratch[s.id][g.index]
                assert (s.scratch_begs[g.index, k], s.scratch_ends[g.index, k]) == ((lo, hi) if hi > lo else (0, 0))

    def seen_by(self, s):
        """Slots a step's tables reference, with what they held: (request, block) or 'scratch'."""
        seen = {}
        for g in self.lay.groups:
            d = {}
            for k, rid in enumerate(s.request_ids):
                row = self.mgr.table[g.index, s.rows[k]]
                for b in np.flatnonzero(row != BAD):
                    d[int(row[b])] = (rid, int(b))
                if k < s.num_contexts and s.scratch_ends[g.index, k] > s.scratch_begs[g.index, k]:
                    used = cdiv(2 * int(s.scratch_ends[g.index, k] - s.scratch_begs[g.index, k]), g.scale)
                    for slot in s.scratch_slots[g.index, k, :used]:     # the rest is padding
                        d.setdefault(int(slot), "scratch")
            seen[g.index] = d
        return seen

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def slots_conserved_and_owned_once(self):
        if not hasattr(self, "mgr"):
            return
        stats = self.mgr.stats()
        for g, pool in zip(self.lay.groups, self.mgr.pools):
            owned = []
            for rid in self.mgr.request_ids:
                row = self.mgr.table[g.index, self.mgr.request(rid).row]
                owned += row[row != BAD].tolist()
                for held in self.mgr.request(rid).scratch.values():
                    owned += held[g.index].tolist()
            every = owned + pool.free_slots().tolist() + pool.quarantined_slots().tolist()
            assert sorted(every) == list(range(pool.total)), "a slot is lost or owned twice"
            gs = stats["groups"][g.index]
            assert gs["free"] + gs["owned"] + gs["scratch"] + gs["quarantined"] == gs["total"]

    @invariant()
    def table_rows_match_model(self):
        if not hasattr(self, "mgr"):
            return
        live_rows = set()
        for rid, m in self.model.items():
            row = self.mgr.request(rid).row
            live_rows.add(row)
            for g in self.lay.groups:
                got = set(np.flatnonzero(self.mgr.table[g.index, row] != BAD).tolist())
                assert got == self.expected_blocks(m, g), (rid, g.index, sorted(got))
        for row in set(range(self.spec.max_batch)) - live_rows:
            assert (self.mgr.table[:, row] == BAD).all(), f"row {row} is free but not empty"

    @invariant()
    def released_slots_not_reused_while_seen(self):
        if not hasattr(self, "mgr"):
            return
        self.unfinished_seen = [(s, seen) for s, seen in self.unfinished_seen if not s.is_complete()]
        for s, seen in self.unfinished_seen:
            for g, pool in zip(self.lay.groups, self.mgr.pools):
                free = set(pool.free_slots().tolist())
                now = {}
                for rid in self.mgr.request_ids:
                    row = self.mgr.table[g.index, self.mgr.request(rid).row]
                    for b in np.flatnonzero(row != BAD):
                        now[int(row[b])] = (rid, int(b))
                for slot, what in seen[g.index].items():
                    assert slot not in free, f"slot {slot} seen by unfinished step {s.id} is free"
                    if slot in now and what != "scratch":
                        assert now[slot] == what, f"slot {slot} of step {s.id} now holds {now[slot]}"

    def check_outputs(self):
        bad = self.cap.mismatches()
        assert bad == [], f"steps whose tables differ from the reference: {bad}"
        self.cap.items = [it for it in self.cap.items if not it[0].ready.done()]

    def teardown(self):
        if hasattr(self, "mgr"):
            if self.gate is not None:
                self.gate.open()
            self.mgr.synchronize()
            self.check_outputs()


ManagerMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestManager = ManagerMachine.TestCase
