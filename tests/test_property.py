"""Stateful property test: random serving workloads against an independent model of the manager.

The model (oracle.Model) keeps its own history, capacity, row and scratch ranges per request and derives
from the formulas of the README's "Concepts" and docs/design.md's "Ranges" which blocks must hold a slot;
the manager's table must agree after every operation. Each step's tables (captured by a consumer on another stream, gated at random)
must equal the reference computed from the host table at that step's prepare. Counts (prompt lengths,
chunks, num_gen_tokens, accepted tokens) are drawn as Python ints and as every numpy integer type that
holds them.

PrefixMachine runs the same workloads with prefix caching on, against oracle.PrefixModel (the cache of
docs/design.md's "Prefix caching" slot by slot): prompts drawn from a few shared prefixes, follow-ups of earlier
requests' tokens (prompt and reported generation tokens), salts, checkpoints, small pools (evictions),
rewinds and frees in flight. After every call: add's hit, the slots each step took (free first, then the
least recently released evictable ones, never a quarantined one), the cache events; after every rule:
the tables, reference counts (cells + scratch), free / evictable / quarantined slots; at every drain: the
captured tables and write positions against the reference (a write never reaches a shared slot) and
stats().
"""
import os

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cupykv
from cupykv import BAD, OutOfSlotsError
from oracle import Capture, Modelled, PrefixModelled, check_slots

EXAMPLES = int(os.environ.get("CUPYKV_PROPERTY_EXAMPLES", "500"))
# the prefix-caching machine checks much more per call: fewer examples by default (about the same time)
PREFIX_EXAMPLES = int(os.environ.get("CUPYKV_PROPERTY_EXAMPLES", "150"))
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
        self.do(data.draw(st.sampled_from(self.ACTIONS), label="action"), data)

    def do(self, action: str, data) -> None:
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

    def draw_accepted(self, data, s, on_accept=None):
        """Accepted tokens of the oldest unsettled step s: (by request id, in batch order). Live generation
        entries accept up to max_rewind fewer than scheduled when s is their latest step, all of them
        otherwise; on_accept(rid, n) runs after each such draw (it may draw more)."""
        later = [other for other, _ in self.tw.unsettled[1:]]
        accepted, in_order = {}, []
        for k, rid in enumerate(s.request_ids):
            n = int(s.num_tokens[k])
            if not self.model.is_live(s.id, k) or k < s.num_contexts:
                in_order.append(n)
                continue
            latest = not any(rid in other.request_ids for other in later)
            lo = max(0, n - self.spec.max_rewind) if latest else n
            accepted[rid] = count(data, lo, n, f"accept {rid}")
            in_order.append(accepted[rid])
            if on_accept is not None:
                on_accept(rid, accepted[rid])
        return accepted, in_order

    def settle(self, data):
        s, expected = self.tw.unsettled[0]
        accepted, in_order = self.draw_accepted(data, s)
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
            self.open_gate_and_drain()


ManagerMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestManager = ManagerMachine.TestCase


ALPHABET = st.integers(0, 3)          # few token values: tails collide now and then, by accident


class PrefixMachine(ManagerMachine):
    """ManagerMachine with prefix caching on, driven through oracle.PrefixModelled."""

    @initialize(pattern=st.sampled_from(["gptoss", "gemma", "sinks"]), rewind=st.integers(0, 2),
                scratch=st.booleans(), slots=st.integers(10, 48), graphs=st.booleans(), delta=st.booleans(),
                shared=st.booleans(), retention=st.sampled_from(["boundaries", "boundaries", "all"]),
                prefixes=st.lists(st.tuples(st.integers(16, 120), st.integers(0, 2 ** 16)), min_size=1, max_size=3))
    def setup(self, pattern, rewind, scratch, slots, graphs, delta, shared, retention, prefixes):
        # windows short enough that decoding soon moves past the prompt's retained window (one of exactly
        # one block, one that is no multiple of the block)
        windows = {"gptoss": [12, None] * 2, "gemma": [8] * 5 + [None], "sinks": [16, 16, None]}[pattern]
        sinks = 8 if pattern == "sinks" else 0
        self.spec = cupykv.CacheSpec(windows=windows, num_kv_heads=1, head_dim=4, tokens_per_block=TPB,
                                     max_seq_len=256, max_batch=6, slots_per_group=slots, max_rewind=rewind,
                                     swa_scratch_reuse=scratch and not shared, sink_tokens=sinks,
                                     table_mode="shared" if shared else "per_layer",
                                     prefix_caching=True, prefix_events=True, prefix_retention=retention)
        self.mgr = cupykv.KVCacheManager(self.spec, backend="host", use_graphs=graphs, steady_batch_delta=delta)
        self.tw = PrefixModelled(self.mgr)
        self.model = self.tw.model
        self.geo = self.model.geo
        self.cap = Capture(self.mgr, write_positions=True)
        self.next_rid = 0
        self.gate = None
        self.unfinished_seen = []     # (step, {group: slots its tables reference})
        self.prefixes = [np.random.default_rng(seed).integers(0, 10, n).tolist() for n, seed in prefixes]
        self.turns = []               # token lists of freed requests (prompt + reported tokens): follow-ups
        self.salt_of = {}

    ACTIONS = ["add"] * 3 + ["step"] * 5 + ["settle"] * 4 + ["serve"] * 2 + ["free"] * 2 + ["cancel", "device", "squeeze", "burst", "drain"]

    def do(self, action: str, data) -> None:
        if action == "serve":
            self.serve(data)
        elif action == "cancel":           # a request that goes before it is ever scheduled (its hit
            self.add(data)                 # slots are released under the same step id as they came)
            if self.model.rids:
                self.tw.free(self.model.rids[-1])
        elif action == "device":           # the device finishes the work; the manager has not looked yet
            if self.gate is None:
                self.mgr.backend.synchronize()
        elif action == "squeeze":
            self.squeeze(data)
        elif action == "burst":            # long enough to decode past the prompt's retained windows
            self.serve(data)
            for _ in range(data.draw(st.integers(1, 48), label="burst")):
                self.decode_all(data)
        else:
            super().do(action, data)

    def serve(self, data):
        """Every request's whole remaining prompt (or one decode token), then settle every step: requests
        get far enough for follow-ups to hit their blocks."""
        ctx = {rid: m.prompt - m.capacity for rid, m in ((r, self.model.request(r)) for r in self.model.rids)
               if m.capacity < m.prompt}
        gen = [rid for rid in self.model.rids if self.model.request(rid).capacity == self.model.request(rid).prompt
               and self.model.request(rid).capacity < self.spec.max_seq_len]
        if ctx or gen:
            try:
                s = self.tw.prepare(ctx, gen)
            except OutOfSlotsError:
                pass
            else:
                self.cap.consume(s)
                self.unfinished_seen.append((s, self.seen_by(s)))
        while self.tw.unsettled:
            self.settle(data)

    def squeeze(self, data):
        """A chunk sized so that some group needs exactly the slots allocation can take now (free,
        evictable, quarantine the finished steps lift), or one more: accepted, or refused cleanly."""
        waiting = [r for r in self.model.rids if self.model.request(r).capacity < self.model.request(r).prompt]
        if not waiting:
            return
        rid = data.draw(st.sampled_from(waiting), label="squeeze")
        m, extra = self.model.request(rid), data.draw(st.integers(0, 1), label="one more")
        if self.gate is None:     # every step finishes (not polled): the prepare's decision is known now
            self.mgr.backend.synchronize()
        wm = self.tw.finished_through()
        for n in range(m.prompt - m.capacity, 0, -1):
            need = self.model.plan({rid: n})[1]
            short = [need[p] - self.model.available(p, wm) for p in range(len(need))]
            if max(short) == extra:
                try:
                    s = self.tw.prepare({rid: n})          # the model checks the decision either way
                except OutOfSlotsError:
                    assert extra == 1 or self.gate is not None
                    return
                assert extra == 0 or self.gate is not None
                self.cap.consume(s)
                self.unfinished_seen.append((s, self.seen_by(s)))
                return

    def decode_all(self, data):
        """One decode step of every request that can, settled at once (tokens reported, mostly)."""
        gen = [r for r in self.model.rids if self.model.request(r).capacity == self.model.request(r).prompt
               or self.model.request(r).capacity > self.model.request(r).prompt]
        gen = [r for r in gen if self.model.request(r).capacity < self.spec.max_seq_len]
        unfinished = len(self.tw.prepared) - 1 - self.tw.finished_through()
        if gen and not self.tw.unsettled and unfinished < 48:          # max_steps_in_flight is 64
            try:
                s = self.tw.prepare((), gen)
            except OutOfSlotsError:
                return
            self.cap.consume(s)
            if self.gate is None and data.draw(st.integers(0, 3), label="device keeps up") > 0:
                self.mgr.backend.synchronize()
            self.settle(data)

    def add(self, data):
        if len(self.model) == self.spec.max_batch:
            return
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        live = [self.model.request(r).tokens for r in self.model.rids]
        kind = data.draw(st.sampled_from(["prefix", "prefix", "turn", "live", "fresh"]), label="prompt kind")
        pool = {"prefix": self.prefixes, "turn": self.turns, "live": live}.get(kind) or [[]]
        base = pool[data.draw(st.integers(0, len(pool) - 1), label="base")]
        cut = data.draw(st.sampled_from([len(base), len(base), None]), label="share all") or \
            data.draw(st.integers(0, len(base)), label="shared part")
        tail = data.draw(st.lists(ALPHABET, min_size=0 if cut else 1, max_size=40), label="tail")
        tokens = (list(base[:cut]) + tail)[:200]
        n = len(tokens)
        salt = data.draw(st.sampled_from([None] * 6 + ["a", b"b"]), label="salt")
        checkpoints = data.draw(st.lists(st.integers(1, n), max_size=2), label="checkpoints")
        if data.draw(st.booleans(), label="tokens as numpy"):
            tokens = np.array(tokens, data.draw(st.sampled_from([np.int64, np.int32, np.uint16]), label="dtype"))
        self.tw.add(rid, count(data, n, n, "prompt"), tokens=tokens, cache_salt=salt, checkpoints=checkpoints)

    def settle(self, data):
        s, expected = self.tw.unsettled[0]
        new_tokens = {}

        def report(rid, n):
            if data.draw(st.integers(0, 9), label=f"report {rid}") > 0:     # mostly reported
                new_tokens[rid] = data.draw(st.lists(ALPHABET, min_size=int(n), max_size=int(n)),
                                            label=f"tokens {rid}")

        accepted, in_order = self.draw_accepted(data, s, report)
        as_sequence = data.draw(st.booleans(), label="accepted in batch order")
        live = [rid for k, rid in enumerate(s.request_ids) if k >= s.num_contexts and self.model.is_live(s.id, k)]
        if all(rid in new_tokens for rid in live) and data.draw(st.booleans(), label="tokens in batch order"):
            # every generation entry's accepted tokens as one sequence; an entry freed since the prepare
            # carries tokens too (ignored), as many as it accepted (all of them)
            flat = []
            for k, rid in enumerate(s.request_ids[s.num_contexts:], s.num_contexts):
                flat += new_tokens[rid] if self.model.is_live(s.id, k) else [0] * in_order[k]
            if data.draw(st.booleans(), label="batch-order tokens as numpy"):
                flat = np.array(flat, data.draw(st.sampled_from([np.int64, np.int32, np.uint16]), label="dtype"))
            self.tw.settle(s, in_order if as_sequence else accepted, new_tokens=flat, model_tokens=new_tokens)
            return
        self.tw.settle(s, in_order if as_sequence else accepted, new_tokens=new_tokens)

    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model.rids)), label="free")
        self.turns.append(list(self.model.request(rid).tokens))
        self.tw.free(rid)

    def open_gate_and_drain(self):
        if self.gate is not None:
            self.gate.open()
            self.gate = None
        self.tw.synchronize()
        self.check_outputs()
        self.tw.check(stats=True)

    # -- invariants (none of them polls the manager: the quarantine lifts only where a caller's would) --
    @invariant()
    def slots_conserved_and_owned_once(self):
        if hasattr(self, "mgr"):
            check_slots(self.mgr, self.tw.scratch_held(), with_stats=False)   # refs = cells + scratch
            self.model.check_pools(self.mgr)

    @invariant()
    def released_slots_not_reused_while_seen(self):
        """A slot an unfinished step's tables reference is neither free nor evictable, and no step after
        it was handed it (a hit may share it: that only reads)."""
        if not hasattr(self, "mgr"):
            return
        self.unfinished_seen = [(s, seen) for s, seen in self.unfinished_seen if not s.is_complete()]
        for s, seen in self.unfinished_seen:
            for g, pool in zip(self.geo.groups, self.mgr.pools):
                idle = set(pool.free_slots().tolist()) | set(pool.evictable_slots().tolist())
                for slot in seen[g.index]:
                    assert slot not in idle, f"slot {slot} seen by unfinished step {s.id} is free or evictable"
                    assert self.model.handed_out_by[g.index][slot] <= s.id, (
                        f"group {g.index}: slot {slot} seen by unfinished step {s.id} was handed out by step "
                        f"{self.model.handed_out_by[g.index][slot]}")


PrefixMachine.TestCase.settings = settings(max_examples=PREFIX_EXAMPLES, stateful_step_count=50, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestPrefixCaching = PrefixMachine.TestCase
