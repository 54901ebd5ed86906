"""What the benchmark runs: the model shapes, the settings, and the scheduling workload.

One Workload per (shape, max_seq_len, batch) owns the managers (the PER_LAYER one, plus a SHARED one when
asked for) and the requests that drive them: lengths uniform in [max_seq_len / 4, max_seq_len), a few
requests finishing and arriving per step. Every scheduling decision is made once per step (a Plan) and
applied to each manager in turn, so all managers see the same requests, lengths and batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..layout import Layout, cdiv
from ..manager import KVCacheManager
from ..spec import CacheSpec


@dataclass(frozen=True)
class Shape:
    """The attention layout of a model: per-layer windows (None = full attention) and KV head sizes."""
    name: str
    windows: Tuple[Optional[int], ...]
    num_kv_heads: int
    head_dim: int


def _gemma3_27b_windows() -> tuple:
    # 62 layers, 5 sliding (window 1024) : 1 global
    return tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62))


SHAPES: Dict[str, Shape] = {
    "gpt-oss-20b": Shape("gpt-oss-20b", (128, None) * 12, 8, 64),
    "gpt-oss-120b": Shape("gpt-oss-120b", (128, None) * 18, 8, 64),
    "gemma-3-27b": Shape("gemma-3-27b", _gemma3_27b_windows(), 16, 128),
}
SMOKE_SHAPE = Shape("tiny", (16, None, 16, None), 1, 8)

CASES_DECODE_ONLY = ("decode", "steady")
CASES_CTX = ("ctx",)


def cases_for(contexts: int) -> Tuple[str, ...]:
    """The cases a run with `contexts` prefill chunks per step records."""
    return CASES_CTX if contexts else CASES_DECODE_ONLY


@dataclass
class Settings:
    """Everything a benchmark run is configured by (the CLI builds one; scripts build their own)."""
    shapes: Sequence[str]
    seqs: Sequence[int]
    batches: Sequence[int]
    contexts: Sequence[int]
    steps: int = 100
    warmup: int = 30
    chunk: int = 8192
    tpb: int = 32
    backend: str = "auto"
    torch: bool = True
    compile: bool = True
    seed: int = 0
    out: Optional[str] = "bench_out"
    smoke: bool = False
    command: str = ""
    plot: bool = True
    shared: bool = True          # also run a SHARED-table manager (cupykv-shared rows, the per-group peer)
    # Twins of the managers with use_graphs=True (the -graphs rows). None: on the GPU only; the host
    # backend replays a "graph" op by op, which only tests can want.
    graphs: Optional[bool] = None


def config_rows(settings: Settings) -> List[dict]:
    """Every (shape, seq, batch, contexts, case) the settings ask for, in run order."""
    out = []
    for shape in settings.shapes:
        for seq in settings.seqs:
            for batch in settings.batches:
                for nctx in settings.contexts:
                    for case in cases_for(nctx):
                        out.append(dict(shape=shape, max_seq_len=seq, batch=batch, contexts=nctx, case=case))
    return out


@dataclass
class Plan:
    """One step's scheduling decisions, made once and applied to every manager.

    ops: ("free", rid) and ("add", rid, prompt_len) in order (the order decides which freed row a new
    request gets, so every manager gets the same rows).
    """
    contexts: Dict[int, int]
    generation: List[int]
    case: str
    ops: List[tuple] = field(default_factory=list)


class Workload:
    """The managers for one (shape, max_seq_len, batch) and the requests that drive them.

    `mgr` is the PER_LAYER manager (scratch reuse on); with shared=True, `shared` is a SHARED-table
    manager (no scratch reuse: SHARED tables cannot express it) fed the same requests; with graphs=True
    each of them has a twin made with use_graphs=True. `managers` lists them all, PER_LAYER first, each
    twin after its manager, and `kinds` says what each is: (table_mode, use_graphs).
    """

    def __init__(self, shape: Shape, max_seq_len: int, batch: int, max_ctx: int, settings: Settings,
                 rng: np.random.Generator, shared: bool = False, graphs: bool = False):
        self.shape, self.max_seq_len, self.batch, self.max_ctx = shape, max_seq_len, batch, max_ctx
        self.settings, self.rng = settings, rng
        self.chunk = settings.chunk
        self.churn_k = max(1, round(batch / 128))     # finished = arrived per churn step: 2 at batch 256
        rows = batch + max_ctx + self.churn_k
        tpb = settings.tpb
        max_step_tokens = max(2 * max_seq_len, max_ctx * self.chunk + rows)
        base = dict(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                    tokens_per_block=tpb, max_seq_len=max_seq_len, max_batch=rows)
        probe = Layout(CacheSpec(**base, slots_per_group=1))
        B = probe.max_blocks

        def slots(scratch_reuse: bool) -> List[int]:
            out = []
            for g in probe.groups:
                if g.window is None:
                    n = (rows + self.churn_k + max_ctx) * B + 64
                else:
                    keep = cdiv(g.window, tpb) + 4 + probe.sink_blocks(g)
                    step_blocks = cdiv(max_step_tokens, tpb) + 2 * rows
                    # a step's blocks that are stale when it settles: scratch slots with reuse, every block
                    # without it; twice, for the previous step's still in quarantine
                    chunk = probe.scratch_slots_needed(g, step_blocks) if scratch_reuse else step_blocks
                    n = 2 * rows * keep + 2 * chunk + 256
                out.append(int(n))
            return out

        self.spec = CacheSpec(**base, slots_per_group=slots(True), swa_scratch_reuse=True,
                              max_step_tokens=max_step_tokens)
        specs = [self.spec]
        if shared:
            self.shared_spec = CacheSpec(**base, slots_per_group=slots(False), swa_scratch_reuse=False,
                                         table_mode="shared", max_step_tokens=max_step_tokens)
            specs.append(self.shared_spec)
        self.managers: List[KVCacheManager] = []
        self.kinds: List[Tuple[str, bool]] = []
        for spec in specs:
            # The twin with step graphs is a manager of its own (use_graphs is a constructor argument):
            # both get every step, so they are compared on the same steps.
            for use_graphs in ((False, True) if graphs else (False,)):
                self.managers.append(KVCacheManager(spec, backend=settings.backend, use_graphs=use_graphs))
                self.kinds.append((spec.table_mode, use_graphs))
        self.mgr = self.managers[0]
        self.shared: Optional[KVCacheManager] = (self.managers[self.kinds.index(("shared", False))]
                                                 if shared else None)
        self.lay = self.mgr.layout
        # scratch width of a context chunk of `chunk` tokens (one block more for an unaligned start)
        self.scratch_width = max([self.lay.scratch_slots_needed(g, cdiv(self.chunk, tpb) + 1)
                                  for g in self.lay.groups if g.window is not None] or [1])
        self.scratch_width = max(self.scratch_width, 1)
        total = 2 * (settings.warmup + settings.steps) + 16
        self.len_lo = max(1, max_seq_len // 4)
        self.len_hi = max_seq_len - total
        if self.len_hi <= self.len_lo:
            raise ValueError(f"max_seq_len={max_seq_len} leaves no room for {total} decode steps; use fewer steps")
        self.next_rid = 0
        self.decode: List[int] = []
        self.prefilling: List[int] = []

    # -- requests ------------------------------------------------------------------------------
    def new_len(self) -> int:
        return int(self.rng.integers(self.len_lo, self.len_hi))

    def _new_request(self) -> Tuple[int, int]:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        return rid, self.new_len()

    def add(self, n: int) -> List[Tuple[int, int]]:
        """n new requests (id, prompt length), added to every manager."""
        out = [self._new_request() for _ in range(n)]
        for mgr in self.managers:
            for rid, ln in out:
                mgr.add(rid, ln)
        return out

    def untimed_step(self, contexts=None, generation=()) -> None:
        for mgr in self.managers:
            step = mgr.prepare_batch(contexts=contexts or {}, generation=list(generation))
            step.ready.synchronize()
            step.finish()
            mgr.settle(step)

    def prefill(self, items: List[Tuple[int, int]]) -> None:
        """Untimed: (request, tokens) as large context chunks, packed up to max_step_tokens per step."""
        cap = self.spec.step_token_capacity
        pending = [(rid, ln) for rid, ln in items]
        while pending:
            ctx, tokens = {}, 0
            while pending and (not ctx or tokens + pending[0][1] <= cap):
                rid, ln = pending.pop(0)
                ctx[rid] = ln
                tokens += ln
            self.untimed_step(ctx)
        for mgr in self.managers:
            mgr.synchronize()

    def setup_decode(self) -> None:
        self.decode = [rid for rid, _ in self.add_and_prefill(self.batch)]

    def add_and_prefill(self, n: int) -> List[Tuple[int, int]]:
        items = self.add(n)
        self.prefill(items)
        return items

    def setup_contexts(self, n: int) -> None:
        """n requests in prefill, staggered: each already has a random number of chunks done."""
        items = self.add(n)
        self.prefilling = [rid for rid, _ in items]
        ahead = {}
        for rid, ln in items:
            chunks = int(self.rng.integers(0, cdiv(ln, self.chunk)))
            if chunks:
                ahead[rid] = chunks * self.chunk
        self.prefill(list(ahead.items()))

    def remaining(self, rid) -> int:
        """Prompt tokens of `rid` not yet scheduled (every manager agrees between steps)."""
        r = self.mgr.request(rid)
        return r.prompt_len - r.capacity

    # -- per-step scheduling ---------------------------------------------------------------------
    def pre_churn_decode_only(self, i: int) -> Optional[List[int]]:
        """Untimed part of a decode-only step: on churn steps, the arrivals are added and prefilled.
        Returns the positions in the decode list they replace (None: a steady step)."""
        if i % 2:
            return None
        k = min(self.churn_k, len(self.decode))
        pos = sorted(int(p) for p in self.rng.choice(len(self.decode), size=k, replace=False))
        self._arrivals = [rid for rid, _ in self.add_and_prefill(k)]
        return pos

    def plan_decode_only(self, pos: Optional[List[int]]) -> Plan:
        """The finished requests (freed) and the batch; `pos` from pre_churn_decode_only."""
        if pos is None:
            return Plan({}, list(self.decode), "steady")
        ops = []
        for p, new in zip(pos, self._arrivals):
            ops.append(("free", self.decode[p]))
            self.decode[p] = new
        return Plan({}, list(self.decode), "decode", ops)

    def plan_ctx(self) -> Plan:
        """Prefills that completed join the decode batch (a random decode request finishes and is freed
        for each) and new arrivals take their place; every prefilling request gets a chunk."""
        ops: List[tuple] = []
        arrived: Dict[int, int] = {}
        for k, rid in enumerate(self.prefilling):
            if self.remaining(rid) == 0:
                p = int(self.rng.integers(len(self.decode))) if self.decode else None
                if p is None:
                    self.decode.append(rid)
                else:
                    ops.append(("free", self.decode[p]))
                    self.decode[p] = rid
                rid_new, ln = self._new_request()
                ops.append(("add", rid_new, ln))
                arrived[rid_new] = ln
                self.prefilling[k] = rid_new
        ctx = {rid: min(self.chunk, arrived[rid] if rid in arrived else self.remaining(rid))
               for rid in self.prefilling}
        return Plan(ctx, list(self.decode), "ctx", ops)

    @staticmethod
    def apply(mgr: KVCacheManager, plan: Plan) -> None:
        """The plan's frees and adds on one manager (the part of scheduling a manager does)."""
        for op in plan.ops:
            if op[0] == "free":
                mgr.free(op[1])
            else:
                mgr.add(op[1], op[2])

    def schedule_decode_only(self, pos: Optional[List[int]]) -> Tuple[dict, List[int], str]:
        """plan_decode_only applied to every manager: (contexts, generation, case)."""
        return self._schedule(self.plan_decode_only(pos))

    def _schedule(self, plan: Plan) -> Tuple[dict, List[int], str]:
        for mgr in self.managers:
            self.apply(mgr, plan)
        return plan.contexts, plan.generation, plan.case

    def close(self) -> None:
        for mgr in self.managers:
            try:
                mgr.synchronize()
            except Exception:   # noqa: BLE001
                pass
