"""The prefix-caching benchmark behind `python -m cupykv.bench prefix`.

Three parts, each run on every manager side by side in one process:

trace   A synthetic multi-turn chat trace: a few shared system prompts (the first user message of a
        conversation is longer: a pasted document, say), conversations of several turns
        (turn t's prompt = the conversation so far: the system prompt, every earlier user message and
        every token generated for it, then the new user message), arrivals interleaved (several
        conversations in flight, each turn arriving a "think time" after the previous one ended), chunked
        prefill under a per-step token budget, decode between turns with settle(new_tokens=...) reporting
        every decode step's input token, and a pool (slots_per_group, the same for every group and every
        policy) smaller than the trace's distinct content, so that cached blocks get evicted. The same
        trace runs under each policy:

          no-cache                  prefix_caching=False (scratch reuse on)
          cache-all-noscratch       prefix caching, swa_scratch_reuse=False, prefix_retention="all": every
                                    block of every group stays cached: the hit-rate ceiling, most memory
          cache-boundaries-scratch  prefix caching, swa_scratch_reuse=True, prefix_retention="boundaries"

        per layer pattern (GPT-OSS-like: windows alternating 128 / full; Gemma-like: window 1024, 5 SWA :
        1 full) and tokens_per_block. The scheduler is the same for every policy: FCFS admission while the
        table has rows and the requests' reservations (their final length in blocks) fit the pool; decode
        entries first, then prefill chunks of at most --chunk tokens up to --step-tokens per step. A
        policy with hits prefills less, so its timeline is shorter; that is the point of caching.

        Slot counts are sampled with stats() after every prepare_batch (the step's slots are taken, its
        releases not yet made) and after every settle (the step's releases made; its finish event has
        completed first, so nothing it released is still quarantined):

          in use  = total - free - evictable  (held by a request: table cells and scratch borrowings, plus
                                               quarantined slots; not reusable now)
          held    = total - free              (in use + evictable: what the cache keeps out of the free
                                               list; evictable slots are handed out only after every free one)

        Checked (exit status 1 if not): prefill tokens computed + hit tokens == the trace's prompt tokens;
        the hit tokens (sum of add()'s returns) == stats()["prefix_cache"]["hit_tokens"]; query tokens ==
        prompt tokens.

add     add() of one long prompt (default 128k tokens, GPT-OSS-like): hashing + lookup, cold (nothing
        cached) and warm (the same prompt prefilled and freed before, so it hits all but its last block),
        tokens as an int64 array and as a Python list; medians of --reps. The hash (PrefixCache.new_seq) and
        lookup (PrefixCache.lookup) parts are timed separately too.

decode  Host time of a decode step (prepare_batch + settle; the device work is waited for between the two,
        untimed) at --decode-batch requests of about --decode-ctx tokens (GPT-OSS-like), on three managers
        fed the same steps in rotating order: prefix caching off; on (settle without new_tokens); on with
        new_tokens reported as a mapping request id -> [token] (built outside the timed call); on with
        new_tokens as one int64 array in batch order (a sampler's output). Target: on within 10% of off.

On the GPU every manager runs on the CUDA backend. On the host backend the step kernels are skipped
(SkipKernelsBackend: nothing here reads the tables, and their NumPy emulation of 36-62 layers would take
minutes); --emulate runs it. Every number of the trace part is host-side bookkeeping, the same on either
backend; the host times of the add and decode parts are of this machine's CPU either way.
"""
from __future__ import annotations

import datetime
import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backends.host import HostBackend
from ..layout import Layout, cdiv
from ..manager import KVCacheManager
from ..spec import CacheSpec
from .machine import failure, free_device_memory, log, versions
from .record import stats
from .workload import SHAPES, Shape

VOCAB = 200_000

PATTERNS: Dict[str, Shape] = {
    "gpt-oss": SHAPES["gpt-oss-120b"],          # 36 layers, windows alternating 128 / full
    "gemma": SHAPES["gemma-3-27b"],             # 62 layers, window 1024, 5 SWA : 1 full
}
SMOKE_PATTERNS: Dict[str, Shape] = {
    "gpt-oss": Shape("gpt-oss-tiny", (16, None) * 2, 1, 8),
    "gemma": Shape("gemma-tiny", tuple(None if (i + 1) % 6 == 0 else 32 for i in range(6)), 1, 8),
}
PARTS = ("trace", "add", "decode")


@dataclass(frozen=True)
class Policy:
    name: str
    caching: bool
    scratch: bool
    retention: str


POLICIES: Tuple[Policy, ...] = (
    Policy("no-cache", False, True, "boundaries"),
    Policy("cache-all-noscratch", True, False, "all"),
    Policy("cache-boundaries-scratch", True, True, "boundaries"),
)
CEILING, CANDIDATE = "cache-all-noscratch", "cache-boundaries-scratch"


@dataclass
class TraceConfig:
    """The synthetic chat trace and the scheduler that replays it. Ranges are inclusive."""
    systems: int = 3
    system_len: Tuple[int, int] = (1024, 4096)
    conversations: int = 40
    turns: Tuple[int, int] = (3, 6)
    first_user_len: Tuple[int, int] = (128, 4096)   # the first message (often with a pasted document)
    user_len: Tuple[int, int] = (32, 512)
    gen_len: Tuple[int, int] = (16, 64)
    think: Tuple[int, int] = (4, 64)          # steps from a turn's end to the next turn's arrival
    arrival_gap: Tuple[int, int] = (0, 16)    # steps between the first turns of consecutive conversations
    in_flight: int = 8                        # table rows: the most requests at once
    chunk: int = 4096                         # the longest prefill chunk
    step_tokens: int = 8192                   # tokens per step (decode tokens first, then chunks)
    pool_frac: float = 0.5                    # slots per group = this x the trace's distinct blocks
    seed: int = 0


SMOKE_TRACE = TraceConfig(systems=2, system_len=(40, 90), conversations=6, turns=(2, 3), first_user_len=(5, 60),
                          user_len=(5, 30),
                          gen_len=(2, 6), think=(0, 4), arrival_gap=(0, 3), in_flight=3, chunk=48,
                          step_tokens=96, pool_frac=0.5)


@dataclass
class PrefixSettings:
    """What `python -m cupykv.bench prefix` runs."""
    patterns: Sequence[str] = ("gpt-oss", "gemma")
    tpbs: Sequence[int] = (16, 32)
    parts: Sequence[str] = PARTS
    trace: TraceConfig = field(default_factory=TraceConfig)
    add_prompt: int = 131072
    reps: int = 7
    decode_batch: int = 256
    decode_ctx: int = 32768
    decode_steps: int = 200
    decode_warmup: int = 20
    backend: str = "auto"
    emulate: bool = False           # host backend: run the step kernels' NumPy emulation too
    smoke: bool = False
    out: Optional[str] = "bench_prefix"
    command: str = ""


def make_trace_backend(name: str, emulate: bool = False):
    """The backend of one manager: CUDA as is; on the host backend, unless `emulate`, one whose step kernels
    (apply_deltas, build_step) enqueue nothing: nothing here reads the tables, every number these parts
    report is host bookkeeping, and the NumPy emulation of 36-62 layers of tables would take most of the
    run (minutes instead of seconds at the default sizes)."""
    from ..backends import make_backend
    if name != "host" or emulate:
        return make_backend(name)
    return SkipKernelsBackend()


class SkipKernelsBackend(HostBackend):
    """HostBackend whose step kernels do nothing (the simulated streams, events and copies remain)."""

    def apply_deltas(self, stream, *args, **kwargs) -> None:
        pass

    def build_step(self, stream, *args, **kwargs) -> None:
        pass




def _shapes(smoke: bool) -> Dict[str, Shape]:
    return SMOKE_PATTERNS if smoke else PATTERNS


# ---------------------------------------------------------------------------------------------------
# the trace
# ---------------------------------------------------------------------------------------------------
@dataclass
class Conversation:
    index: int
    system: int                 # which system prompt
    system_len: int
    start: int                  # step at which its first turn arrives
    tokens: np.ndarray          # int64: the whole conversation (system, user 0, generated 0, user 1, ...)
    prompt_end: List[int]       # turn t's prompt is tokens[:prompt_end[t]]
    gen_len: List[int]          # decode steps of turn t; their input tokens follow its prompt
    think: List[int]            # steps from the end of turn t to the arrival of turn t + 1


@dataclass
class Trace:
    systems: List[np.ndarray]
    conversations: List[Conversation]

    @property
    def requests(self) -> int:
        return sum(len(c.prompt_end) for c in self.conversations)

    @property
    def prompt_tokens(self) -> int:
        return sum(sum(c.prompt_end) for c in self.conversations)

    @property
    def max_len(self) -> int:
        return max(c.prompt_end[-1] + c.gen_len[-1] for c in self.conversations)

    def distinct_blocks(self, tpb: int) -> int:
        """Full blocks of distinct content: the system prompts, and each conversation past its system prompt."""
        return (sum(len(s) // tpb for s in self.systems)
                + sum(cdiv(len(c.tokens) - c.system_len, tpb) for c in self.conversations))


def _between(rng: np.random.Generator, lo_hi: Tuple[int, int]) -> int:
    lo, hi = lo_hi
    return int(rng.integers(lo, hi + 1))


def make_trace(cfg: TraceConfig) -> Trace:
    """The trace of a config: deterministic in cfg.seed, the same for every policy and backend."""
    rng = np.random.default_rng(cfg.seed)
    systems = [rng.integers(0, VOCAB, _between(rng, cfg.system_len)).astype(np.int64) for _ in range(cfg.systems)]
    convs, start = [], 0
    for i in range(cfg.conversations):
        s = int(rng.integers(cfg.systems))
        parts, ends, gens = [systems[s]], [], []
        pos = len(systems[s])
        for t in range(_between(rng, cfg.turns)):
            u, g = _between(rng, cfg.first_user_len if t == 0 else cfg.user_len), max(1, _between(rng, cfg.gen_len))
            parts.append(rng.integers(0, VOCAB, u).astype(np.int64))
            pos += u
            ends.append(pos)
            parts.append(rng.integers(0, VOCAB, g).astype(np.int64))
            gens.append(g)
            pos += g
        thinks = [_between(rng, cfg.think) for _ in ends]
        convs.append(Conversation(i, s, len(systems[s]), start, np.concatenate(parts), ends, gens, thinks))
        start += _between(rng, cfg.arrival_gap)
    return Trace(systems, convs)


def trace_pool_slots(trace: Trace, cfg: TraceConfig, tpb: int) -> int:
    """Slots per group: pool_frac of the distinct blocks, but room for the two longest requests and a
    step's blocks at least (admission keeps the requests' reservations within the pool)."""
    longest = cdiv(trace.max_len, tpb) + 2
    return max(int(round(cfg.pool_frac * trace.distinct_blocks(tpb))), 2 * longest + cdiv(cfg.step_tokens, tpb) + 16)


@dataclass
class _Active:
    rid: tuple
    conv: Conversation
    turn: int
    prompt_len: int
    gen_len: int
    reserve: int
    scheduled: int = 0
    decoded: int = 0


class _Peaks:
    """Peak slot counts per group over stats() samples (definitions in the module docstring)."""

    def __init__(self, num_groups: int):
        self.in_use = [0] * num_groups
        self.held = [0] * num_groups
        self.scratch = [0] * num_groups
        self.held_sum = [0] * num_groups
        self.samples = 0

    def sample(self, mgr: KVCacheManager) -> None:
        self.samples += 1
        for p, g in enumerate(mgr.stats()["groups"]):
            self.in_use[p] = max(self.in_use[p], g["total"] - g["free"] - g["evictable"])
            self.held[p] = max(self.held[p], g["total"] - g["free"])
            self.scratch[p] = max(self.scratch[p], g["scratch"])
            self.held_sum[p] += g["total"] - g["free"]


def trace_spec(shape: Shape, tpb: int, policy: Policy, trace: Trace, cfg: TraceConfig) -> CacheSpec:
    return CacheSpec(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                     tokens_per_block=tpb, max_seq_len=cdiv(trace.max_len + 1, tpb) * tpb, max_batch=cfg.in_flight,
                     slots_per_group=trace_pool_slots(trace, cfg, tpb), swa_scratch_reuse=policy.scratch,
                     prefix_caching=policy.caching, prefix_retention=policy.retention, max_step_tokens=cfg.step_tokens)


def run_trace(trace: Trace, cfg: TraceConfig, pattern: str, shape: Shape, tpb: int, policy: Policy,
              backend: str, emulate: bool = False) -> dict:
    """Replay the trace on one manager; returns its result row."""
    spec = trace_spec(shape, tpb, policy, trace, cfg)
    mgr = KVCacheManager(spec, backend=make_trace_backend(backend, emulate))
    lay = mgr.layout
    pool = spec.slots_per_group
    budget_slots = pool - cdiv(cfg.step_tokens, tpb) - 8      # admission: reservations must fit in this
    peaks = _Peaks(lay.num_groups)
    arrivals = [(c.start, c.index) for c in trace.conversations]
    heapq.heapify(arrivals)
    convs = trace.conversations
    turn_of = [0] * len(convs)
    queue: deque = deque()
    active: List[_Active] = []
    reserved = 0
    now = steps = 0
    prompt_tokens = hit_tokens = computed = decoded = 0
    first_prompt = first_hit = 0
    t_start = time.perf_counter()
    while arrivals or queue or active:
        while arrivals and arrivals[0][0] <= now:
            queue.append(convs[heapq.heappop(arrivals)[1]])
        while queue and len(active) < cfg.in_flight:
            conv = queue[0]
            t = turn_of[conv.index]
            n, g = conv.prompt_end[t], conv.gen_len[t]
            need = cdiv(n + g, tpb) + 1
            if reserved + need > budget_slots and active:
                break                  # FCFS: the head waits for room
            queue.popleft()
            rid = (conv.index, t)
            if policy.caching:
                hit = mgr.add(rid, n, tokens=conv.tokens[:n], checkpoints=[conv.system_len])
            else:
                hit = mgr.add(rid, n)
            active.append(_Active(rid, conv, t, n, g, need, scheduled=hit))
            reserved += need
            prompt_tokens += n
            hit_tokens += hit
            if t == 0:
                first_prompt += n
                first_hit += hit
        if not active:
            if arrivals:
                now = max(now + 1, arrivals[0][0])
                continue
            raise RuntimeError("the trace scheduler stalled with requests queued and none active")
        gen = [a for a in active if a.scheduled == a.prompt_len and a.decoded < a.gen_len]
        budget = cfg.step_tokens - len(gen)
        ctx: Dict[tuple, int] = {}
        for a in active:
            if a.scheduled < a.prompt_len and budget > 0:
                c = min(cfg.chunk, a.prompt_len - a.scheduled, budget)
                ctx[a.rid] = c
                budget -= c
        step = mgr.prepare_batch(contexts=ctx, generation=[a.rid for a in gen])
        peaks.sample(mgr)
        step.ready.synchronize()
        step.finish()
        step.finished.synchronize()
        new_tokens = ({a.rid: [int(a.conv.tokens[a.prompt_len + a.decoded])] for a in gen}
                      if policy.caching and gen else None)
        mgr.settle(step, new_tokens=new_tokens)
        peaks.sample(mgr)
        steps += 1
        for a in active:
            if a.rid in ctx:
                a.scheduled += ctx[a.rid]
                computed += ctx[a.rid]
        done = []
        for a in gen:
            a.decoded += 1
            decoded += 1
            if a.decoded == a.gen_len:
                done.append(a)
        for a in done:
            mgr.free(a.rid)
            active.remove(a)
            reserved -= a.reserve
            turn_of[a.conv.index] = a.turn + 1
            if a.turn + 1 < len(a.conv.prompt_end):
                heapq.heappush(arrivals, (now + 1 + a.conv.think[a.turn], a.conv.index))
        now += 1
    wall = time.perf_counter() - t_start
    mgr.synchronize()
    st = mgr.stats()
    pc = st["prefix_cache"] or {}
    pc_groups = pc.get("groups") or [dict(cached_blocks=0, evictable_blocks=0, evictions=0)] * lay.num_groups
    groups = []
    for p, g in enumerate(lay.groups):
        groups.append(dict(group=p, window=g.window, layers=g.num_layers, total=pool,
                           peak_in_use=peaks.in_use[p], peak_held=peaks.held[p], peak_scratch=peaks.scratch[p],
                           mean_held=round(peaks.held_sum[p] / max(1, peaks.samples), 1),
                           evictions=int(pc_groups[p]["evictions"]), cached_blocks_end=int(pc_groups[p]["cached_blocks"])))
    swa = [gr for gr in groups if gr["window"] is not None]
    full = [gr for gr in groups if gr["window"] is None]
    stats_hit = pc.get("hit_tokens", 0) if policy.caching else 0
    stats_query = pc.get("query_tokens", prompt_tokens) if policy.caching else prompt_tokens
    consistent = (computed + hit_tokens == prompt_tokens and stats_hit == hit_tokens and stats_query == prompt_tokens
                  and prompt_tokens == trace.prompt_tokens)
    return dict(pattern=pattern, shape=shape.name, num_layers=lay.num_layers, tpb=tpb, policy=policy.name,
                caching=policy.caching, scratch=policy.scratch, retention=policy.retention if policy.caching else None,
                pool_slots=pool, requests=trace.requests, steps=steps, prompt_tokens=prompt_tokens,
                hit_tokens=hit_tokens, computed_tokens=computed, decode_tokens=decoded,
                hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
                first_turn_prompt_tokens=first_prompt, first_turn_hit_tokens=first_hit,
                stats_hit_tokens=int(stats_hit), stats_query_tokens=int(stats_query),
                stats_queries=int(pc.get("queries", 0)) if policy.caching else 0, consistent=bool(consistent),
                groups=groups,
                swa_peak_in_use=sum(g["peak_in_use"] for g in swa), swa_peak_held=sum(g["peak_held"] for g in swa),
                full_peak_in_use=sum(g["peak_in_use"] for g in full), full_peak_held=sum(g["peak_held"] for g in full),
                swa_evictions=sum(g["evictions"] for g in swa), full_evictions=sum(g["evictions"] for g in full),
                samples=peaks.samples, wall_s=round(wall, 3), error=None)


def trace_error_row(pattern: str, shape: Shape, tpb: int, policy: Policy, why: str) -> dict:
    return dict(pattern=pattern, shape=shape.name, tpb=tpb, policy=policy.name, caching=policy.caching,
                scratch=policy.scratch, retention=policy.retention if policy.caching else None, consistent=False,
                error=why)


# ---------------------------------------------------------------------------------------------------
# add() of a long prompt
# ---------------------------------------------------------------------------------------------------
def _slot_counts(spec_kw: dict, full: int, swa: int) -> List[int]:
    probe = Layout(CacheSpec(**spec_kw, slots_per_group=1))
    return [full if g.window is None else swa for g in probe.groups]


def _prefill(mgr: KVCacheManager, items: Dict, chunk: int) -> None:
    """Untimed: prefill requests {rid: prompt_len} in chunks, several requests per step, up to `chunk`
    tokens per step."""
    left = dict(items)
    while left:
        ctx, budget = {}, chunk
        for rid in list(left):
            if budget <= 0:
                break
            c = min(left[rid], budget)
            ctx[rid] = c
            budget -= c
            left[rid] -= c
            if not left[rid]:
                del left[rid]
        step = mgr.prepare_batch(contexts=ctx)
        step.ready.synchronize()
        step.finish()
        mgr.settle(step)
    mgr.synchronize()


def _ms(samples: List[float]) -> Optional[dict]:
    return stats([s * 1e3 for s in samples])


def bench_add(shape: Shape, tpb: int, prompt_len: int, reps: int, backend: str, seed: int,
              emulate: bool = False) -> List[dict]:
    """Rows: add() of a prompt_len-token prompt cold, warm, warm with a list; hash and lookup parts."""
    rng = np.random.default_rng([seed, tpb, 7])
    chunk = min(8192, prompt_len)
    kw = dict(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
              tokens_per_block=tpb, max_seq_len=cdiv(prompt_len + 1, tpb) * tpb + tpb, max_batch=4,
              max_step_tokens=chunk)
    blocks = cdiv(prompt_len, tpb)
    slots = _slot_counts(kw, full=blocks + 64, swa=2 * cdiv(chunk, tpb) + 64)
    mgr = KVCacheManager(CacheSpec(**kw, slots_per_group=slots, prefix_caching=True),
                         backend=make_trace_backend(backend, emulate))
    cache = mgr.cache
    warm_tokens = rng.integers(0, VOCAB, prompt_len).astype(np.int64)
    mgr.add("seed", prompt_len, tokens=warm_tokens)
    _prefill(mgr, {"seed": prompt_len}, chunk)
    mgr.free("seed")
    mgr.synchronize()
    rows = []
    warm_list = warm_tokens.tolist()
    cases = (("cold", "int64 array", None), ("warm", "int64 array", warm_tokens), ("warm", "list", warm_list))
    for case, kind, toks in cases:
        add_s, hash_s, lookup_s, hits = [], [], [], []
        for r in range(reps + 1):                         # one extra, untimed: the first call warms caches up
            t = toks if toks is not None else rng.integers(0, VOCAB, prompt_len).astype(np.int64)
            t_arr = np.asarray(t, np.int64)
            h0 = time.perf_counter()
            seq = cache.new_seq(t_arr, b"", [prompt_len])
            h1 = time.perf_counter()
            cache.lookup(seq.hashes, prompt_len)
            h2 = time.perf_counter()
            rid = f"{case}-{kind}-{r}"
            a0 = time.perf_counter()
            hit = mgr.add(rid, prompt_len, tokens=t)
            a1 = time.perf_counter()
            mgr.free(rid)
            mgr.synchronize()
            if r:
                add_s.append(a1 - a0)
                hash_s.append(h1 - h0)
                lookup_s.append(h2 - h1)
                hits.append(hit)
        rows.append(dict(shape=shape.name, tpb=tpb, prompt_tokens=prompt_len, blocks=blocks, case=case, tokens=kind,
                         hit_tokens=int(np.median(hits)), reps=reps, add_ms=_ms(add_s), hash_ms=_ms(hash_s),
                         lookup_ms=_ms(lookup_s), error=None))
    del mgr
    return rows


# ---------------------------------------------------------------------------------------------------
# decode-step host time, prefix caching on vs off
# ---------------------------------------------------------------------------------------------------
DECODE_VARIANTS = ("caching-off", "caching-on", "caching-on+new_tokens", "caching-on+new_tokens[array]")


def bench_decode(shape: Shape, tpb: int, batch: int, ctx: int, steps: int, warmup: int, backend: str,
                 seed: int, emulate: bool = False) -> List[dict]:
    """Rows, one per variant: host us of prepare_batch, settle and both, per decode step."""
    rng = np.random.default_rng([seed, tpb, 11])
    total = steps + warmup
    lo, hi = max(tpb, ctx * 3 // 4), ctx - total - 2 * tpb
    if hi <= lo:
        raise ValueError(f"--decode-ctx {ctx} leaves no room for {total} decode steps")
    lens = rng.integers(lo, hi, batch)
    chunk = max(min(65536, int(lens.sum())), int(lens.max()))
    kw = dict(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
              tokens_per_block=tpb, max_seq_len=ctx, max_batch=batch, max_step_tokens=chunk)
    probe = Layout(CacheSpec(**kw, slots_per_group=1))
    swa_keep = max([cdiv(g.window, tpb) + 3 + g.sink_blocks for g in probe.groups if g.window is not None] or [1])
    slots = _slot_counts(kw, full=batch * cdiv(ctx, tpb) + 256,
                         swa=batch * swa_keep + 2 * cdiv(chunk, tpb) + 2 * batch + 256)
    mgrs = {name: KVCacheManager(CacheSpec(**kw, slots_per_group=slots, prefix_caching=(name != "caching-off")),
                                 backend=make_trace_backend(backend, emulate)) for name in DECODE_VARIANTS}
    rids = list(range(batch))
    prompts = [rng.integers(0, VOCAB, int(n)).astype(np.int64) for n in lens]
    for name, mgr in mgrs.items():
        for rid, toks in zip(rids, prompts):
            if mgr.cache is not None:
                mgr.add(rid, len(toks), tokens=toks)
            else:
                mgr.add(rid, len(toks))
        _prefill(mgr, {rid: len(t) for rid, t in zip(rids, prompts)}, chunk)
    samples = {name: dict(prepare=[], settle=[], total=[]) for name in DECODE_VARIANTS}
    errors: Dict[str, str] = {}
    names = list(DECODE_VARIANTS)
    for i in range(total):
        toks = rng.integers(0, VOCAB, batch)
        reported = {"caching-on+new_tokens": {rid: [t] for rid, t in zip(rids, toks.tolist())},
                    "caching-on+new_tokens[array]": toks}
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:          # rotate the order: no variant always goes first
            if name in errors:
                continue
            mgr = mgrs[name]
            nt = reported.get(name)
            try:
                t0 = time.perf_counter()
                step = mgr.prepare_batch(generation=rids)
                t1 = time.perf_counter()
                step.ready.synchronize()
                step.finish()
                t2 = time.perf_counter()
                mgr.settle(step, new_tokens=nt)
                t3 = time.perf_counter()
            except Exception as exc:   # noqa: BLE001 - this variant stops; its row says why
                errors[name] = failure(exc, prefix=f"decode step {i}: ")
                continue
            if i >= warmup:
                s = samples[name]
                s["prepare"].append((t1 - t0) * 1e6)
                s["settle"].append((t3 - t2) * 1e6)
                s["total"].append((t1 - t0 + t3 - t2) * 1e6)
    rows = []
    off = stats(samples["caching-off"]["total"])
    base = off["median"] if off and "caching-off" not in errors else None
    for name in DECODE_VARIANTS:
        s = samples[name]
        tot = stats(s["total"]) if name not in errors else None
        pc = mgrs[name].stats()["prefix_cache"] if name not in errors else None
        rows.append(dict(shape=shape.name, tpb=tpb, batch=batch, ctx=ctx, variant=name,
                         n=len(s["total"]) if name not in errors else 0,
                         prepare_us=stats(s["prepare"]) if tot else None, settle_us=stats(s["settle"]) if tot else None,
                         total_us=tot, vs_off=tot["median"] / base if (tot and base) else None,
                         cached_blocks=sum(g["cached_blocks"] for g in pc["groups"]) if pc else 0,
                         error=errors.get(name)))
    for name, mgr in mgrs.items():
        if name not in errors:
            mgr.synchronize()
    return rows


def evaluate_prefix_targets(result: dict) -> List[dict]:
    """The targets (reported, never asserted)."""
    out = []
    by = {(r["pattern"], r["tpb"], r["policy"]): r for r in result.get("trace", []) if not r.get("error")}
    for (pattern, tpb, policy), r in sorted(by.items()):
        if policy != CANDIDATE or (pattern, tpb, CEILING) not in by:
            continue
        ceil = by[(pattern, tpb, CEILING)]
        cfg = f"{pattern} tpb{tpb}"
        ratio = r["hit_tokens"] / ceil["hit_tokens"] if ceil["hit_tokens"] else (1.0 if not r["hit_tokens"] else 0.0)
        out.append(dict(target="scratch on: hit tokens >= 95% of scratch off (retention all)", config=cfg,
                        value=ratio, limit=0.95, text=f"{r['hit_tokens']} / {ceil['hit_tokens']} = {ratio:.1%}",
                        ok=ratio >= 0.95))
        sr = r["swa_peak_in_use"] / ceil["swa_peak_in_use"] if ceil["swa_peak_in_use"] else None
        out.append(dict(target="scratch on: peak SWA slots in use <= 90% of scratch off", config=cfg, value=sr,
                        limit=0.9, text=f"{r['swa_peak_in_use']} / {ceil['swa_peak_in_use']}"
                        + (f" = {sr:.1%}" if sr is not None else "") + f" (held incl. evictable: "
                        f"{r['swa_peak_held']} / {ceil['swa_peak_held']})", ok=sr is not None and sr <= 0.9))
    for r in result.get("decode", []):
        if r.get("error") or r["variant"] == "caching-off" or r["vs_off"] is None:
            continue
        out.append(dict(target="decode host time (prepare + settle) within 10% of caching off",
                        config=f"{r['shape']} tpb{r['tpb']} b{r['batch']} {r['ctx'] // 1024}k {r['variant']}",
                        value=r["vs_off"], limit=1.10,
                        text=f"{r['total_us']['median']:.0f} us = {r['vs_off']:.2f} x off", ok=r["vs_off"] <= 1.10))
    return out


def run_prefix(s: PrefixSettings) -> dict:
    from ..backends import cuda_available, make_backend
    started = time.perf_counter()
    backend_name = s.backend if s.backend != "auto" else ("cuda" if cuda_available() else "host")
    if backend_name == "cuda":
        make_backend("cuda")          # BackendUnavailableError now, not in the first part
    shapes = _shapes(s.smoke)
    messages: List[str] = []
    if backend_name != "cuda":
        messages.append("host backend: " + ("the step kernels' NumPy emulation runs (waited for outside every "
                                            "timed call)" if s.emulate else "the step kernels are skipped (nothing "
                                            "reads the tables; --emulate runs their NumPy emulation)"))
    result: Dict = dict(trace=[], add=[], decode=[], failures=[])
    cfg = s.trace
    if "trace" in s.parts:
        trace = make_trace(cfg)
        messages.append(f"trace: {trace.requests} requests ({len(trace.conversations)} conversations, "
                        f"{len(trace.systems)} system prompts), {trace.prompt_tokens} prompt tokens, longest "
                        f"sequence {trace.max_len}; " + ", ".join(
                            f"tpb {t}: {trace.distinct_blocks(t)} distinct blocks, pool {trace_pool_slots(trace, cfg, t)} "
                            f"slots per group" for t in s.tpbs))
        for pattern in s.patterns:
            shape = shapes[pattern]
            for tpb in s.tpbs:
                for policy in POLICIES:
                    log(f"prefix trace: {pattern} tpb {tpb} {policy.name} ...")
                    try:
                        row = run_trace(trace, cfg, pattern, shape, tpb, policy, backend_name, s.emulate)
                    except Exception as exc:   # noqa: BLE001 - reported in the row; the others go on
                        why = failure(exc)
                        result["failures"].append(f"trace {pattern} tpb{tpb} {policy.name}: {why}")
                        row = trace_error_row(pattern, shape, tpb, policy, why)
                    result["trace"].append(row)
                    free_device_memory()
        for r in result["trace"]:
            if not r.get("error") and not r["consistent"]:
                result["failures"].append(f"trace {r['pattern']} tpb{r['tpb']} {r['policy']}: computed "
                                          f"{r['computed_tokens']} + hit {r['hit_tokens']} vs prompt "
                                          f"{r['prompt_tokens']}; stats hit {r['stats_hit_tokens']}, query "
                                          f"{r['stats_query_tokens']}")
    add_shape = shapes["gpt-oss"]
    if "add" in s.parts:
        for tpb in s.tpbs:
            log(f"prefix add: {s.add_prompt} tokens, tpb {tpb} ...")
            try:
                result["add"] += bench_add(add_shape, tpb, s.add_prompt, s.reps, backend_name, cfg.seed, s.emulate)
            except Exception as exc:   # noqa: BLE001
                why = failure(exc)
                result["failures"].append(f"add tpb{tpb}: {why}")
                result["add"].append(dict(shape=add_shape.name, tpb=tpb, prompt_tokens=s.add_prompt, case="all",
                                          error=why))
            free_device_memory()
    if "decode" in s.parts:
        tpb = 32 if 32 in s.tpbs else s.tpbs[0]
        log(f"prefix decode: batch {s.decode_batch}, {s.decode_ctx} tokens, tpb {tpb} ...")
        try:
            result["decode"] = bench_decode(add_shape, tpb, s.decode_batch, s.decode_ctx, s.decode_steps,
                                            s.decode_warmup, backend_name, cfg.seed, s.emulate)
        except Exception as exc:   # noqa: BLE001
            why = failure(exc)
            result["failures"].append(f"decode: {why}")
            result["decode"] = [dict(shape=add_shape.name, tpb=tpb, batch=s.decode_batch, ctx=s.decode_ctx,
                                     variant=v, error=why) for v in DECODE_VARIANTS]
        for r in result["decode"]:
            if r.get("error") and not any(r["error"] in f for f in result["failures"]):
                result["failures"].append(f"decode {r['variant']}: {r['error']}")
        free_device_memory()
    result["targets"] = evaluate_prefix_targets(result)
    result["meta"] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), command=s.command,
        backend=backend_name, versions=versions(backend_name), messages=messages,
        settings=dict(patterns=list(s.patterns), shapes={p: shapes[p].name for p in s.patterns}, tpbs=list(s.tpbs),
                      parts=list(s.parts), trace=dict(cfg.__dict__), policies=[p.__dict__ for p in POLICIES],
                      add_prompt=s.add_prompt, reps=s.reps, decode_batch=s.decode_batch, decode_ctx=s.decode_ctx,
                      decode_steps=s.decode_steps, decode_warmup=s.decode_warmup, smoke=s.smoke),
        elapsed_s=round(time.perf_counter() - started, 1))
    return result
