"""Stateful property test: random serving workloads against an independent model of the manager.

The model (oracle.Model) keeps its own history, capacity, row and scratch ranges per request and derives
from the formulas of DESIGN.md section 2 which blocks must hold a slot; the manager's table must agree
after every operation. Each step's tables (captured by a consumer on another stream, gated at random)
must equal the reference computed from the host table at that step's prepare. Counts (prompt lengths,
chunks, num_gen_tokens, accepted tokens) are drawn as Python ints and as every numpy integer type that
holds them.
"""
import os

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cupykv
from cupykv import BAD, OutOfSlotsError
from oracle import Capture, Modelled, check_slots

EXAMPLES = int(os.environ.get("CUPYKV_PROPERTY_EXAMPLES", "500"))
TPB = 8
INT_TYPES = (int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


def count(data, lo, hi, label):
    """An int in [lo, hi] as a Python int or as a numpy integer type that holds it."""
    n = data.draw(st.integers(lo, hi), label=label)
    fits = [t for t in INT_TYPES if t is int or np.iinfo(t).min <= n <= np.iinfo(t).max]
    return data.draw(st.sampled_from(fits), label=f"{label} type")(n)


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
        self.tw = Modelled(self.mgr)
        self.model = self.tw.model
        self.geo = self.model.geo
        self.cap = Capture(self.mgr)
        self.next_rid = 0
        self.gate = None
        self.unfinished_seen = []     # (step, {group: {slot: (request, block) or "scratch"}})

    # -- operations ------------------------------------------------------------------------------
    ACTIONS = ["add"] * 2 + ["step"] * 6 + ["settle"] * 4 + ["free"] + ["drain"]

    @rule(data=st.data())
    def act(self, data):
        """One operation, drawn with weights so that workloads run many steps."""
        action = data.draw(st.sampled_from(self.ACTIONS), label="action")
        if action == "add":
            self.add(data)
        elif action == "step":
            self.step(data)
        elif action == "settle" and self.tw.unsettled:
            self.settle(data)
        elif action == "free" and len(self.model):
            self.free(data)
        elif action == "drain":
            self.open_gate_and_drain()

    def add(self, data):
        if len(self.model) == self.spec.max_batch:
            return
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self.tw.add(rid, count(data, 1, 200, "prompt"))

    def step(self, data):
        ctx, gen = {}, []
        for rid in self.model.rids:
            m = self.model.request(rid)
            if m.capacity < m.prompt and data.draw(st.booleans(), label=f"ctx {rid}"):
                ctx[rid] = count(data, 1, m.prompt - m.capacity, f"chunk {rid}")
            elif m.capacity == m.prompt and data.draw(st.booleans(), label=f"gen {rid}"):
                gen.append(rid)
        k = count(data, 1, self.spec.max_rewind + 1, "gen tokens")
        gen = [r for r in gen if self.model.request(r).capacity + int(k) <= self.spec.max_seq_len]
        if not ctx and not gen:
            return
        if self.gate is None and data.draw(st.booleans(), label="gate"):
            self.gate = self.mgr.backend.gate(self.mgr.backend.stream)
        before = self.mgr.state()
        try:
            s = self.tw.prepare(ctx, gen, num_gen_tokens=k)      # checks batch, tokens and scratch ranges
        except OutOfSlotsError:
            assert self.mgr.state() == before
            return
        self.cap.consume(s)
        self.unfinished_seen.append((s, self.seen_by(s)))

    def settle(self, data):
        s, expected = self.tw.unsettled[0]
        later = [other for other, _ in self.tw.unsettled[1:]]
        accepted = {}
        in_order = []
        for k, rid in enumerate(s.request_ids):
            n = int(s.num_tokens[k])
            if not self.model.is_live(s.id, k) or k < s.num_contexts:
                in_order.append(n)
                continue
            latest = not any(rid in other.request_ids for other in later)
            lo = max(0, n - self.spec.max_rewind) if latest else n
            accepted[rid] = count(data, lo, n, f"accept {rid}")
            in_order.append(accepted[rid])
        as_sequence = data.draw(st.booleans(), label="accepted in batch order")
        self.tw.settle(s, in_order if as_sequence else accepted)

    def free(self, data):
        self.tw.free(data.draw(st.sampled_from(sorted(self.model.rids)), label="free"))

    def open_gate_and_drain(self):
        if self.gate is not None:
            self.gate.open()
            self.gate = None
        self.mgr.synchronize()
        self.check_outputs()

    def seen_by(self, s):
        """Slots a step's tables reference, with what they held: (request, block) or 'scratch'."""
        seen = {}
        for g in self.geo.groups:
            d = {}
            for k, rid in enumerate(s.request_ids):
                row = self.mgr.table[g.index, s.rows[k]]
                for b in np.flatnonzero(row != BAD):
                    d[int(row[b])] = (rid, int(b))
                if k < s.num_contexts and s.scratch_ends[g.index, k] > s.scratch_begs[g.index, k]:
                    used = self.geo.scratch_slots_needed(g, int(s.scratch_ends[g.index, k] - s.scratch_begs[g.index, k]))
                    for slot in s.scratch_slots[g.index, k, :used]:     # the rest is padding
                        d.setdefault(int(slot), "scratch")
            seen[g.index] = d
        return seen

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def slots_conserved_and_owned_once(self):
        if hasattr(self, "mgr"):
            check_slots(self.mgr, self.tw.scratch_held())

    @invariant()
    def table_rows_match_model(self):
        if hasattr(self, "mgr"):
            self.model.check_table(self.mgr)

    @invariant()
    def released_slots_not_reused_while_seen(self):
        if not hasattr(self, "mgr"):
            return
        self.unfinished_seen = [(s, seen) for s, seen in self.unfinished_seen if not s.is_complete()]
        for s, seen in self.unfinished_seen:
            for g, pool in zip(self.geo.groups, self.mgr.pools):
                free = set(pool.free_slots().tolist())
                now = {}
                for rid in self.model.rids:
                    row = self.mgr.table[g.index, self.model.request(rid).row]
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
