"""Engine: greedy generation with a transformers model whose KV cache is cupykv.

One call of `step()`:

    admit     waiting requests take free rows: add() with their tokens (a prefix hit skips the cached part)
    resume    suspended requests come back from the host tier while slots allow
    schedule  every running request with one token to compute decodes it; prompts (and recomputed
              requests) prefill in chunks while max_step_tokens allows. Counts only: a token the previous
              step samples is still on the device when this step is scheduled
    prepare   prepare_batch(contexts, generation); OutOfSlotsError first completes the previous step, then
              preempts the newest running request (suspend to the host tier when there is one with room,
              else free it and compute its tokens again later) and prepares again
    forward   one packed forward of the step's tokens, attn_implementation="cupykv" (attention.py); a
              decode entry whose token the previous step sampled reads it on the device; the greedy tokens
              of the entries that reached their end stay on the device, with a copy to the host under way
    finish    the step's finish on torch's stream
    complete  the previous step: wait for its sampled tokens on the host (this step is already enqueued,
              so the GPU stays busy), settle it (each decode entry reports the token it was fed, so full
              blocks enter the prefix cache), and free the requests it finished

So the CPU prepares step N+1 while the GPU runs step N. A request's KV covers `scheduled` of its tokens
(KV computed or in flight) and `expected` counts its tokens with the one in flight; its next input is
positions [scheduled, expected). A preempted request that lost its KV is added again with all its tokens
as its prompt (prefix caching usually finds most of them), so its output is what it would have been.
"""
from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Hashable, Iterable, List, Optional, Sequence

import numpy as np

from .. import cuda_available
from ..errors import (CapacityExceededError, CupykvError, InvalidRequestError, OutOfSlotsError,
                      UnknownRequestError)
from ..host_tier import HostTierFullError
from ..manager import KVCacheManager
from ..storage import KVStorage
from .attention import NAME, PagedBatch, register
from .triton_attention import available as triton_available
from ..spec import DTYPE_BYTES
from .config import UnsupportedModelError, dtype_name, spec_from_config, text_config



@dataclass
class _Request:
    rid: Hashable
    tokens: List[int]                  # prompt, then generated
    prompt_len: int
    max_new: int
    salt: object = None
    scheduled: int = 0                 # tokens whose KV is computed or in a step in flight
    expected: int = 0                  # len(tokens), plus one while a step in flight samples its next token
    state: str = "waiting"             # waiting | running | suspended | done
    order: int = 0                     # admission order (the newest is preempted first)
    hit_tokens: int = 0
    added_at: float = 0.0              # time.perf_counter() at add_request

    @property
    def generated(self) -> List[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class EngineStats:
    """What an Engine did: forwards (steps) and their tokens, tokens generated, prompt tokens and those a
    prefix hit served, preemptions by kind; with profile, peak KV and GPU idle time."""
    steps: int = 0
    forward_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    preempted_suspend: int = 0
    preempted_recompute: int = 0
    step_tokens: List[int] = field(default_factory=list)
    # per layer kind ("full", "window W"): the most KV bytes one layer held (slots owned by requests and
    # scratch, at a step's prepare); recorded with Engine(profile=True)
    peak_kv_bytes_per_layer: Dict[str, int] = field(default_factory=dict)
    # per sliding-window kind, at that peak: what the window allows, each request held its window's blocks
    # plus one, and one step's chunk on top (ceil(W / tpb) + 1 blocks each, ceil(max_step_tokens / tpb) + 1)
    window_bound_bytes_per_layer: Dict[str, int] = field(default_factory=dict)
    # with profile=True on CUDA: seconds of forward passes, and of the GPU's idle gaps between one forward's
    # end and the next one's start (what the host did meanwhile: cupykv's prepare, the batch, the launch)
    forward_s: float = 0.0
    idle_s: float = 0.0
    # of that idle time, what cupykv's calls could explain: for each gap, at most the host seconds spent in
    # cupykv (add, prepare_batch, the batch's views, settle, free, suspend, resume) since the last launch
    idle_cupykv_s: float = 0.0
    # host seconds in cupykv's calls, in all
    cupykv_host_s: float = 0.0
    # seconds from each request's add_request to its first token on the host, in the order they came
    first_token_s: List[float] = field(default_factory=list)


def attention_path(attention: str, device, head_dim: int) -> str:
    """The attention path the engine uses: "triton" or "torch" (see Engine's `attention`). "auto" takes the
    Triton kernel on CUDA when triton is installed and head_dim is a power of two (the kernel tiles it
    whole); naming "triton" where it cannot run is refused with InvalidRequestError."""
    if attention not in ("auto", "torch", "triton"):
        raise InvalidRequestError(f"attention={attention!r}: 'auto', 'triton' or 'torch'")
    if attention == "auto":
        fits = device.type == "cuda" and triton_available(device) and not head_dim & (head_dim - 1)
        return "triton" if fits else "torch"
    if attention == "triton" and not triton_available(device):
        raise InvalidRequestError(f"attention='triton' needs triton and a CUDA device (the model is on "
                                  f"{device}; on the CPU only under TRITON_INTERPRET=1)")
    if attention == "triton" and head_dim & (head_dim - 1):
        raise InvalidRequestError(f"attention='triton': head_dim {head_dim} is not a power of two "
                                  "(the Triton kernel needs one); use attention='torch'")
    return attention


class Engine:
    """Continuous batching over a cupykv cache for a transformers causal LM (greedy decoding).

    model: a transformers decoder-only model (its config names the layer windows; see spec_from_config).
    max_batch: requests held at once. memory_bytes: KV pool bytes (None: room for max_batch requests of
    max_seq_len tokens). max_step_tokens: tokens per forward (None: 512 + max_batch). host_tier_bytes: a
    pinned host pool for preempted requests and evicted cached blocks (0: none; preempted requests are
    computed again). backend: "auto" (cuda when the model is on a GPU, else host), "cuda" or "host".
    max_seq_len: the longest prompt + output (None: the config's max_position_embeddings). profile: record
    the peak KV bytes per layer kind and, on CUDA, the GPU's idle time between forwards (EngineStats).
    eos_token_id: a token id (or several) that ends a request, kept as its last token, as generate()
    does; None: every request runs to max_new_tokens. A request in the step already enqueued when its
    end token reaches the host is freed then, and that step's token for it is dropped.
    attention: "auto" (the Triton kernel on CUDA when triton is installed, else torch), "triton" or "torch"
    (see cupykv.hf.attention)."""

    def __init__(self, model, *, max_batch: int, tokens_per_block: int = 16, memory_bytes: Optional[int] = None,
                 max_step_tokens: Optional[int] = None, prefix_caching: bool = True, host_tier_bytes: int = 0,
                 swa_scratch_reuse: bool = True, backend: str = "auto", use_graphs: bool = False,
                 max_seq_len: Optional[int] = None, profile: bool = False, eos_token_id=None,
                 attention: str = "auto"):
        import torch
        self.torch, self.model = torch, model
        config = getattr(model, "config", None)
        if config is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no config: not a transformers model")
        param = next(model.parameters())
        self.device = param.device
        dtype = dtype_name(param.dtype)
        if dtype not in DTYPE_BYTES:
            raise UnsupportedModelError(f"model dtype {param.dtype}: cupykv stores float32, float16 or bfloat16 KV")
        if backend == "auto":
            backend = "cuda" if self.device.type == "cuda" else "host"
        if backend == "cuda" and (self.device.type != "cuda" or not cuda_available()):
            raise InvalidRequestError(f"backend='cuda' needs the model on a CUDA device and CuPy with a GPU "
                                      f"(the model is on {self.device})")
        if backend == "host" and self.device.type != "cpu":
            raise InvalidRequestError(f"backend='host' keeps the KV in host memory: the model must be on the CPU "
                                      f"(it is on {self.device}); use backend='cuda'")
        self.max_step_tokens = int(max_step_tokens) if max_step_tokens is not None else 512 + max_batch
        c = text_config(config)
        seq = int(max_seq_len) if max_seq_len is not None else int(getattr(c, "max_position_embeddings", 4096))
        spec_args = dict(tokens_per_block=tokens_per_block, max_batch=max_batch, dtype=dtype, max_seq_len=seq,
                         prefix_caching=bool(prefix_caching), swa_scratch_reuse=bool(swa_scratch_reuse),
                         max_step_tokens=self.max_step_tokens + max_batch)
        # slots per group: room for max_batch requests of max_seq_len tokens and a prefill chunk, or that
        # split scaled to memory_bytes
        spec_args["slots_per_group"] = self._slots(spec_from_config(config, slots_per_group=1, **spec_args),
                                                   memory_bytes)
        spec = spec_from_config(config, **spec_args)
        self.spec = spec
        self.attention = attention_path(attention, self.device, spec.head_dim)
        register()
        self._probe()                   # refuses a model it cannot serve before anything is allocated
        self.mgr = KVCacheManager(spec, backend=backend, use_graphs=use_graphs)
        self.storage = KVStorage(self.mgr, host_tier_bytes=int(host_tier_bytes) if host_tier_bytes else None)
        self.requests: Dict[Hashable, _Request] = {}
        self.waiting: List[_Request] = []
        self._ids = itertools.count()
        self._in_flight: Optional[_InFlight] = None
        self.profile = bool(profile)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos = {int(t) for t in eos}
        self._events: List[tuple] = []          # (start, end, cupykv host s before it) of each forward, with profile
        self._since_launch = 0.0                # host seconds in cupykv since the last forward's launch
        self._order = itertools.count()
        self.stats = EngineStats()

    def _forward(self, batch, input_ids, position_ids):
        """The model's forward over one packed sequence with the cupykv attention (the model's own
        attn_implementation is restored after)."""
        config = self.model.config
        saved = config._attn_implementation
        try:
            config._attn_implementation = NAME
            with self.torch.no_grad():
                return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                  cupykv_batch=batch, logits_to_keep=0).logits
        finally:
            config._attn_implementation = saved

    def _probe(self) -> None:
        """One token through the model with a batch that touches no cache: every layer must call the cupykv
        attention, with the window the spec has for it (UnsupportedModelError otherwise)."""
        torch = self.torch
        batch = PagedBatch.probe(self.spec)
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        try:
            self._forward(batch, one, one)
        except UnsupportedModelError:
            raise
        except Exception as exc:        # the model's own refusal (e.g. cross-attention needs encoder states)
            raise UnsupportedModelError(f"{type(self.model).__name__}: a forward with the cupykv attention failed "
                                        f"({type(exc).__name__}: {exc})") from exc
        missing = sorted(set(range(len(self.spec.windows))) - set(batch.layers_seen))
        if missing:
            raise UnsupportedModelError(f"{type(self.model).__name__}: layers {missing} do not call the cupykv "
                                        "attention (an attention implementation that bypasses the backend)")

    def _slots(self, spec, memory_bytes: Optional[int]) -> List[int]:
        """Slots per group: what max_batch requests of max_seq_len tokens hold (every block with full
        attention; the window and two blocks with a sliding one) plus a prefill chunk's blocks for sliding
        groups; scaled down to memory_bytes when given (a chunk's blocks kept whole)."""
        from ..layout import Layout
        lay = Layout(spec)
        tpb, chunk = lay.tpb, min(lay.max_blocks, -(-self.max_step_tokens // lay.tpb) + 1)
        want, extra = [], []
        for g in lay.groups:
            per_request = lay.max_blocks if g.window is None else min(lay.max_blocks, -(-g.window // tpb) + 2)
            want.append(spec.max_batch * per_request)
            extra.append(0 if g.window is None else chunk)
        if memory_bytes is None:
            return [w + x for w, x in zip(want, extra)]
        sizes = [lay.slot_bytes(g) for g in lay.groups]
        fixed = sum(x * b for x, b in zip(extra, sizes))
        scale = (int(memory_bytes) - fixed) / sum(w * b for w, b in zip(want, sizes))
        if scale <= 0:
            raise InvalidRequestError(f"memory_bytes={memory_bytes}: too small for one prefill chunk of "
                                      f"max_step_tokens={self.max_step_tokens} ({fixed} bytes)")
        return [max(1, int(w * scale)) + x for w, x in zip(want, extra)]

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, rid: Optional[Hashable] = None,
                    cache_salt=None) -> Hashable:
        """Queue a prompt (token ids) for max_new_tokens greedy tokens; returns its id. Refused with a
        CupykvError, nothing queued, when it is empty, too long or could never fit the pool."""
        tokens = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        if rid is None:
            rid = next(self._ids)
            while rid in self.requests:                 # (auto ids skip the ids callers chose)
                rid = next(self._ids)
        if rid in self.requests:
            raise InvalidRequestError(f"request {rid!r} exists already")
        if not tokens:
            raise InvalidRequestError(f"request {rid!r}: empty prompt")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise InvalidRequestError(f"request {rid!r}: max_new_tokens={max_new_tokens!r} must be an int >= 1")
        need = len(tokens) + int(max_new_tokens)
        if need > self.spec.max_seq_len:
            raise CapacityExceededError(f"request {rid!r}: prompt of {len(tokens)} tokens + {max_new_tokens} new "
                                        f"exceeds max_seq_len={self.spec.max_seq_len}")
        self._check_fits(rid, need)
        req = _Request(rid, tokens, len(tokens), int(max_new_tokens), cache_salt, expected=len(tokens),
                       added_at=time.perf_counter())
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def _check_fits(self, rid, length: int) -> None:
        lay = self.mgr.layout
        for g, slots in zip(lay.groups, lay.slots_per_group):
            blocks = -(-length // lay.tpb)
            if g.window is not None:
                blocks = min(blocks, -(-g.window // lay.tpb) + 2 + -(-self.max_step_tokens // lay.tpb))
            if blocks > slots:
                raise OutOfSlotsError(f"request {rid!r}: {length} tokens need {blocks} slots of group {g.index} "
                                      f"(window {g.window}); the pool has {slots}: it can never fit")

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or suspended (step() has work)."""
        return any(r.state != "done" for r in self.requests.values())

    def result(self, rid) -> List[int]:
        """The tokens generated so far for a request (UnknownRequestError for an id it does not hold)."""
        req = self.requests.get(rid) if isinstance(rid, Hashable) else None
        if req is None:
            raise UnknownRequestError(f"request {rid!r} is not in this engine (generate() forgets its requests "
                                      "when it returns)")
        return list(req.generated)

    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int, *, cache_salt=None) -> List[List[int]]:
        """Greedy tokens for every prompt (max_new_tokens each), in order. A prompt add_request refuses
        refuses the call: none of its prompts stays queued."""
        rids: List[Hashable] = []
        try:
            for p in prompts:
                rids.append(self.add_request(p, max_new_tokens, cache_salt=cache_salt))
        except Exception:
            queued = set(rids)              # by this call, not admitted yet: no step ran since
            self.waiting = [w for w in self.waiting if w.rid not in queued]
            for r in rids:
                del self.requests[r]
            raise
        while any(self.requests[r].state != "done" for r in rids):
            self.step()
        self.flush()
        out = [self.result(r) for r in rids]
        for r in rids:
            del self.requests[r]
        return out

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> Dict[Hashable, int]:
        """Enqueue one forward of the scheduled tokens and complete the previous one; returns {request:
        token} for the tokens that became known (the previous step's, one step behind the device)."""
        self._admit()
        self._resume()
        while True:
            contexts, generation = self._schedule()
            if not contexts and not generation:
                done = self.flush()
                if not done and (self.waiting or any(r.state == "suspended" for r in self.requests.values())):
                    raise OutOfSlotsError("no request can run: the pool is too small for the waiting ones")
                return done
            try:
                with self._in_cupykv():
                    step = self.mgr.prepare_batch([(r.rid, n) for r, n in contexts], [r.rid for r in generation])
                break
            except OutOfSlotsError:
                if self._in_flight is not None:         # its settle may release slots, and preemption
                    done = self.flush()                 # needs every request settled
                    return done
                if not self._preempt():
                    raise
        previous, self._in_flight = self._in_flight, self._launch(step, contexts, generation, self._in_flight)
        return self._complete(previous) if previous is not None else {}

    def flush(self) -> Dict[Hashable, int]:
        """Complete the step in flight (wait for its tokens, settle it); returns its tokens. With profile,
        the forwards' times and the idle gaps between them are added to stats (the GPU was busy, or waiting
        for the host, in between)."""
        previous, self._in_flight = self._in_flight, None
        out = self._complete(previous) if previous is not None else {}
        if self._events:
            self._events[-1][1].synchronize()
            s = self.stats
            for (a, b, _), (c, _, cupykv_s) in zip(self._events, self._events[1:]):
                idle = max(0.0, b.elapsed_time(c) / 1e3)
                s.idle_s += idle
                s.idle_cupykv_s += min(idle, cupykv_s)
            s.forward_s += sum(a.elapsed_time(b) / 1e3 for a, b, _ in self._events)
            self._events = []
        return out

    @contextmanager
    def _in_cupykv(self):
        """Count the host time of the cupykv calls inside (stats.cupykv_host_s, and the idle attribution)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.stats.cupykv_host_s += dt
            self._since_launch += dt

    def _record_kv(self) -> None:
        lay = self.mgr.layout
        peak = self.stats.peak_kv_bytes_per_layer
        held_by = len(self.mgr.request_ids)
        for g, st in zip(lay.groups, self.mgr.stats()["groups"]):
            kind = "full" if g.window is None else f"window {g.window}"
            block = lay.slot_bytes(g) // g.num_layers
            held = (st["owned"] + st["scratch"]) * block
            if held > peak.get(kind, -1):
                peak[kind] = held
                if g.window is not None:
                    blocks = held_by * (-(-g.window // lay.tpb) + 1) + -(-self.max_step_tokens // lay.tpb) + 1
                    self.stats.window_bound_bytes_per_layer[kind] = blocks * block

    def _admit(self) -> None:
        mgr = self.mgr
        while self.waiting and len(mgr.request_ids) < self.spec.max_batch:
            req = self.waiting[0]
            with self._in_cupykv():
                hit = mgr.add(req.rid, len(req.tokens), tokens=req.tokens if self.spec.prefix_caching else None,
                              cache_salt=req.salt)
            self.waiting.pop(0)
            req.scheduled, req.state, req.order = hit, "running", next(self._order)
            req.hit_tokens += hit
            self.stats.hit_tokens += hit
            self.stats.prompt_tokens += len(req.tokens)

    def _resume(self) -> None:
        for req in sorted((r for r in self.requests.values() if r.state == "suspended"), key=lambda r: r.order):
            try:
                with self._in_cupykv():
                    self.storage.resume(req.rid)
            except OutOfSlotsError:
                return
            req.state = "running"

    def _schedule(self):
        """(contexts [(request, tokens)], generation [request]) within max_step_tokens, decode first."""
        running = sorted((r for r in self.requests.values() if r.state == "running"), key=lambda r: r.order)
        running = [r for r in running if r.expected - r.prompt_len < r.max_new or r.scheduled < r.expected - 1]
        generation = [r for r in running
                      if r.scheduled == r.expected - 1 and r.scheduled >= self.mgr.request(r.rid).prompt_len]
        budget = self.max_step_tokens - len(generation)
        contexts = []
        for r in running:
            left = self.mgr.request(r.rid).prompt_len - r.scheduled
            if left > 0 and budget > 0:
                n = min(left, budget)
                contexts.append((r, n))
                budget -= n
        return contexts, generation

    def _preempt(self) -> bool:
        """Make room: the newest running request leaves the device. False when there is none."""
        running = [r for r in self.requests.values() if r.state == "running"]
        if len(running) < 2:
            return False
        victim = max(running, key=lambda r: r.order)
        if self.storage.host_tier is not None:
            try:
                with self._in_cupykv():
                    self.storage.suspend(victim.rid)
                victim.state = "suspended"
                self.stats.preempted_suspend += 1
                return True
            except (HostTierFullError, CupykvError):
                pass
        with self._in_cupykv():
            self.mgr.free(victim.rid)           # computed again later, all its tokens as the prompt
        victim.state, victim.scheduled = "waiting", 0
        self.waiting.insert(0, victim)
        self.stats.preempted_recompute += 1
        return True

    def _launch(self, step, contexts, generation, previous) -> "_InFlight":
        """Enqueue the step's forward; its sampled tokens stay on the device (and start for the host)."""
        torch, dev = self.torch, self.device
        entries = [r for r, _ in contexts] + generation
        ids = np.concatenate([np.asarray(r.tokens[r.scheduled:r.scheduled + n], np.int64) for r, n in contexts] +
                             [np.asarray([r.tokens[-1] if r.expected == len(r.tokens) else -1], np.int64)
                              for r in generation])
        # decode entries whose token the previous step sampled: read it there, on the device
        late = [(len(ids) - len(generation) + j, previous.index[r.rid]) for j, r in enumerate(generation)
                if r.expected > len(r.tokens)]
        cu = step.cu_tokens()
        ends = [e for e, r in enumerate(entries)
                if e >= len(contexts) or r.scheduled + contexts[e][1] == r.expected]
        fed = {r.rid: r.tokens[-1] for r in generation if r.expected == len(r.tokens)}
        for r, n in contexts:
            r.scheduled += n
        for r in generation:
            r.scheduled += 1
        for e in ends:
            entries[e].expected += 1
        if self.profile:
            self._record_kv()
        with self._in_cupykv():
            batch = PagedBatch(step, self.storage, self.attention)
        timed = self.profile and dev.type == "cuda"
        try:
            if timed:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                cupykv_s, self._since_launch = self._since_launch, 0.0
            input_ids = torch.from_numpy(ids).to(dev)
            if late:
                at, src = (torch.tensor(x, device=dev) for x in zip(*late))
                input_ids[at] = previous.sampled[src]
            position_ids = torch.from_numpy(step.token_positions()).to(dev)[None]
            logits = self._forward(batch, input_ids[None], position_ids)
            sampled = logits[0, torch.from_numpy(cu[1:][ends] - 1).to(dev)].argmax(-1) if ends else None
            if timed:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((start, end, cupykv_s))
        finally:
            batch.finish()
        host, ready = None, None
        if sampled is not None:
            host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=dev.type == "cuda")
            host.copy_(sampled, non_blocking=True)
            if dev.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
        s = self.stats
        s.steps += 1
        s.forward_tokens += len(ids)
        s.step_tokens.append(len(ids))
        return _InFlight(step, [entries[e] for e in ends], {entries[e].rid: j for j, e in enumerate(ends)},
                         generation, fed, sampled, host, ready, input_ids if late else None,
                         [j for j, _ in late])

    def _complete(self, f: "_InFlight") -> Dict[Hashable, int]:
        """The step's tokens on the host, its settle, and the requests it finished."""
        if f.ready is not None:
            f.ready.synchronize()
        tokens = f.host.tolist() if f.host is not None else []
        if f.late_ids is not None:          # the decode inputs this step read on the device, for settle
            late = f.late_ids[f.late].tolist()
            for j, token in zip(f.late, late):
                f.fed[f.generation[j - (len(f.late_ids) - len(f.generation))].rid] = token
        new = ({r.rid: [f.fed[r.rid]] for r in f.generation if r.state != "done"} if self.spec.prefix_caching
               else None)
        with self._in_cupykv():
            self.mgr.settle(f.step, input_tokens=new)
        out = {}
        for r, token in zip(f.sampled_by, tokens):
            if r.state == "done":               # it ended (an end token) after this step was enqueued
                continue
            r.tokens.append(int(token))
            out[r.rid] = int(token)
            if len(r.tokens) == r.prompt_len + 1:
                self.stats.first_token_s.append(time.perf_counter() - r.added_at)
            if len(r.generated) >= r.max_new or int(token) in self.eos:
                r.state = "done"
                with self._in_cupykv():
                    self.mgr.free(r.rid)
        self.stats.generated_tokens += len(tokens)
        return out


@dataclass
class _InFlight:
    """A step whose forward is enqueued and whose tokens are not on the host yet."""
    step: object
    sampled_by: List[_Request]           # the requests whose next token the step samples, in order
    index: Dict[Hashable, int]           # request -> its place in `sampled`
    generation: List[_Request]           # the step's decode entries
    fed: Dict[Hashable, int]             # decode entry -> the token it was fed (known on the host)
    sampled: object                      # torch [len(sampled_by)] on the model's device, or None
    host: object                         # its copy on the host (pinned), complete once `ready` is
    ready: object                        # torch.cuda.Event after the copy, or None
    late_ids: object                     # the step's input ids where some came from the device, else None
    late: List[int]                      # their places in it
