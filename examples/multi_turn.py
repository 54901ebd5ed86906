"""Multi-turn chat with prefix caching, checked against dense attention.

Several conversations share a system prompt. Each turn is a new request whose prompt is the whole
conversation so far (the previous prompt, the tokens generated for it, the new user message), so every
later turn finds most of its prompt cached: add() returns the cached tokens, their blocks are already in
the request's table rows, and the prefill computes (and writes through KVStorage.write) only the rest, in
chunks (scratch reuse on). Each turn then decodes a few tokens, reported with settle(new_tokens=...) so
that the blocks they fill are cached for the next turn, and the request is freed.

The toy model is deterministic: the K/V (and Q) of a token is a pure function of (token id, position,
layer) (cupy_decode.gen_qkv with the token id as its seed), so a dense reference can recompute K/V for
the whole sequence without any page. After every step, for every layer and every token of the step,
paged attention through that layer's table (step.tables[layer], the storage's page view; the layer's
window and sink tokens) must equal dense attention over the full sequence. A cache hit that mapped the
wrong block, or a cached slot that was overwritten, shows up as a mismatch.

It also checks each turn's hit against the prefix-cache contract (no slot is evicted here): turn 0
hits the shared system prompt (kept hit-able by a checkpoint) once a request with the same cache salt
has settled it, and 0 with another salt; a later turn hits every full block of the previous turn's
sequence, prompt and generated tokens.

The paged attention is written once over an array module: CuPy on the GPU backend (on its own stream,
ordered after step.ready), NumPy on the host backend (enqueued on the simulated stream, so it reads the
tables and pages when the stream runs). Exits non-zero when a check fails.

    python examples/multi_turn.py [--backend auto|cuda|host]
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # run from a checkout without installing
sys.path.insert(0, str(HERE))          # the toy K/V generator and the reference attention of cupy_decode

import cupykv                                               # noqa: E402
from cupykv.storage import KVStorage                        # noqa: E402
from cupy_decode import attend, gen_qkv, parse_backend   # noqa: E402

COMMON = dict(num_kv_heads=2, head_dim=16, tokens_per_block=8, max_seq_len=320, max_batch=8, slots_per_group=256,
              dtype="float32", swa_scratch_reuse=True, prefix_caching=True, max_step_tokens=512)
MODELS = {
    "gpt-oss-like (alternating, window 32, 4 sink tokens)": dict(windows=[32, None, 32, None], sink_tokens=4),
    "gemma-like (3 SWA : 1 full, window 16)": dict(windows=[16, 16, 16, None]),
}
SYSTEM_LEN = 45       # not a multiple of tokens_per_block: the shared part ends mid-block
CHUNK = 64            # prefill chunk: longer than the window, so long chunks borrow scratch slots
VOCAB = 32000
ATOL = 2e-4


@dataclass
class Conversation:
    name: str
    salt: Optional[str]
    start: int                       # iteration of its first turn
    user_lens: List[int]             # user message length per turn
    decode_lens: List[int]           # tokens generated per turn
    tokens: List[int] = field(default_factory=list)    # the conversation so far
    turn: int = 0
    ready_at: int = 0                # iteration its next turn may start


# Conversation "d" has another cache salt: it shares the system prompt's tokens but must not hit them.
CONVERSATIONS = [
    Conversation("a", None, 0, [20, 11, 80, 6], [5, 4, 6, 3]),
    Conversation("b", None, 1, [9, 31, 5, 14], [4, 6, 5, 5]),
    Conversation("c", None, 1, [27, 6, 12, 75], [6, 3, 4, 4]),
    Conversation("d", "tenant-d", 2, [16, 22, 7], [5, 5, 6]),
]


def system_prompt() -> List[int]:
    return [(101 + 37 * i) % VOCAB for i in range(SYSTEM_LEN)]


def user_tokens(conv: int, turn: int, n: int) -> List[int]:
    return [(5000 + 977 * conv + 131 * turn + 17 * i) % VOCAB for i in range(n)]


def generated_token(conv: int, pos: int) -> int:
    return (20000 + 389 * conv + 53 * pos) % VOCAB


# -- attention ---------------------------------------------------------------------------------------

def visible_keys(pos: int, window, sinks: int) -> np.ndarray:
    """Key positions a query at `pos` sees: all of [0, pos] for full attention; the sink tokens and
    (pos - W, pos] for a window W."""
    if window is None:
        return np.arange(pos + 1)
    lo = max(0, pos - window + 1)
    return np.concatenate((np.arange(min(sinks, lo)), np.arange(lo, pos + 1)))


def key_matrix(positions: np.ndarray, window, sinks: int):
    """Per query token its visible key positions, padded: keys [T, K] int32, valid [T, K] bool."""
    lists = [visible_keys(int(p), window, sinks) for p in positions]
    width = max([len(k) for k in lists] or [1])
    keys = np.zeros((len(lists), width), np.int32)
    valid = np.zeros((len(lists), width), bool)
    for t, k in enumerate(lists):
        keys[t, :len(k)], valid[t, :len(k)] = k, True
    return keys, valid


def paged_attention(xp, table, pages, q, seq, keys, valid, tpb: int, bad):
    """Attention of each query through one layer's page table, in any array module (CuPy or NumPy).

    table [max_batch, 2, B] (K page, V page per block), pages [N, tpb, H, D], q [T, Hq, D], seq [T] the
    batch entry of each query, keys / valid [T, K] its visible key positions. A visible key without a
    valid page is counted in bad[0] (and left out)."""
    blk = keys // tpb
    kp = table[seq[:, None], 0, blk].astype(xp.int64)
    vp = table[seq[:, None], 1, blk].astype(xp.int64)
    n = pages.shape[0]
    ok = valid & (kp >= 0) & (kp < n) & (vp >= 0) & (vp < n)
    bad += xp.count_nonzero(valid & ~ok)
    off = keys % tpb
    k = pages[xp.where(ok, kp, 0), off].astype(xp.float32)          # [T, K, H, D]
    v = pages[xp.where(ok, vp, 0), off].astype(xp.float32)
    rep = q.shape[1] // k.shape[2]                                  # GQA: query head h reads kv head h // rep
    k, v = xp.repeat(k, rep, axis=2), xp.repeat(v, rep, axis=2)
    logits = xp.einsum("thd,tkhd->thk", q, k) / np.float32(math.sqrt(q.shape[2]))
    logits = xp.where(ok[:, None, :], logits, np.float32(-np.inf))
    w = xp.exp(logits - logits.max(axis=2, keepdims=True))
    w = w / w.sum(axis=2, keepdims=True)
    return xp.einsum("thk,tkhd->thd", w, v)


def dense_attention(tokens: np.ndarray, layer: int, pos: int, window, sinks: int, H: int, D: int):
    """The reference: K/V of the visible keys recomputed from the toy model (no pages involved)."""
    keys = visible_keys(pos, window, sinks)
    q, _, _ = gen_qkv(np, layer, tokens[pos:pos + 1], [pos], H, D)
    _, k, v = gen_qkv(np, layer, tokens[keys], keys, H, D)
    return attend(q[0], k, v)


# -- the chat server ----------------------------------------------------------------------------------

@dataclass
class Turn:
    conv: int
    rid: str
    prompt_len: int
    hit: int
    expected_hit: int
    sched: int                       # next position to schedule
    computed: int = 0                # prefill tokens computed
    decoded: int = 0
    decode_len: int = 0


class Chat:
    def __init__(self, backend: str, model: dict):
        self.spec = spec = cupykv.CacheSpec(**COMMON, **model)
        self.mgr = mgr = cupykv.KVCacheManager(spec, backend=backend)
        self.be = be = mgr.backend
        self.xp = be.xp
        self.host = self.xp is np
        self.storage = KVStorage(mgr)
        self.compute = be.new_stream("compute")
        self.bad = be.device_full((1,), 0, np.int32)
        be.synchronize()
        self.tpb = spec.tokens_per_block
        self.windows = spec.windows_tuple
        self.sinks = spec.sinks_per_layer()
        self.convs = [Conversation(c.name, c.salt, c.start, list(c.user_lens), list(c.decode_lens), ready_at=c.start)
                      for c in CONVERSATIONS]
        self.active = {}             # conversation index -> Turn
        self.done: List[Turn] = []
        self.system_settled = set()  # cache salts whose system prompt some request has settled
        self.worst = 0.0
        self.steps = self.scratch_blocks = self.checked = 0
        self.failures: List[str] = []

    # -- turns ---------------------------------------------------------------------------------------
    def start_turns(self, it: int) -> None:
        for c, conv in enumerate(self.convs):
            if c in self.active or conv.turn >= len(conv.user_lens) or it < conv.ready_at:
                continue
            if conv.turn == 0:
                conv.tokens = system_prompt()
                expected = (SYSTEM_LEN // self.tpb * self.tpb) if conv.salt in self.system_settled else 0
            else:
                # every full block of the previous turn's sequence (prompt + generated) was published
                expected = len(conv.tokens) // self.tpb * self.tpb
            conv.tokens = conv.tokens + user_tokens(c, conv.turn, conv.user_lens[conv.turn])
            rid = f"{conv.name}{conv.turn}"
            hit = self.mgr.add(rid, len(conv.tokens), tokens=conv.tokens, cache_salt=conv.salt,
                               checkpoints=[SYSTEM_LEN])
            req = self.mgr.request(rid)
            if (req.history, req.capacity) != (hit, hit):
                self.failures.append(f"{rid}: history/capacity {req.history}/{req.capacity} after a hit of {hit}")
            self.active[c] = Turn(c, rid, len(conv.tokens), hit, expected, sched=hit,
                                  decode_len=conv.decode_lens[conv.turn])

    def plan(self):
        ctx, gen = {}, []
        for turn in self.active.values():
            if turn.sched < turn.prompt_len:
                if len(ctx) < 2:
                    ctx[turn.rid] = min(CHUNK, turn.prompt_len - turn.sched)
            else:
                gen.append(turn.rid)
        return ctx, gen

    def schedule(self, step):
        """Token ids and positions of the step's tokens (batch order); decode tokens join the conversation."""
        by_rid = {t.rid: t for t in self.active.values()}
        seq, pos, ids, new_tokens = [], [], [], {}
        for e, (rid, n) in enumerate(zip(step.request_ids, step.num_tokens.tolist())):
            turn = by_rid[rid]
            conv = self.convs[turn.conv]
            if e >= step.num_contexts:                    # a decode token: the model "sampled" it
                conv.tokens.append(generated_token(turn.conv, turn.sched))
                new_tokens[rid] = conv.tokens[turn.sched:turn.sched + n]
                turn.decoded += n
            else:
                turn.computed += n
            seq += [e] * n
            pos += range(turn.sched, turn.sched + n)
            ids += conv.tokens[turn.sched:turn.sched + n]
            turn.sched += n
        return np.array(seq, np.int32), np.array(pos, np.int32), np.array(ids, np.int64), new_tokens

    # -- one step ------------------------------------------------------------------------------------
    def run_layers(self, step, seq, pos, ids):
        """Per layer, in order (scratch pages alias across layers): write the step's K/V, then attend."""
        xp, spec = self.xp, self.spec
        H, D = spec.num_kv_heads, spec.head_dim
        results = []
        masks = {}
        if not self.host:
            with self.compute:
                d_seq = xp.asarray(seq)
        else:
            d_seq = seq
        for layer in range(len(self.windows)):
            key = (self.windows[layer], self.sinks[layer])
            if key not in masks:
                keys, valid = key_matrix(pos, *key)
                if not self.host:
                    with self.compute:
                        keys, valid = xp.asarray(keys), xp.asarray(valid)
                masks[key] = keys, valid
            keys, valid = masks[key]
            if self.host:
                q, k, v = gen_qkv(np, layer, ids, pos, H, D)
            else:
                with self.compute:
                    q, k, v = gen_qkv(xp, layer, ids, pos, H, D)
            self.storage.write(step, layer, k, v, stream=self.compute)   # waits on step.ready first
            holder = {}
            table, pages = step.tables[layer], self.storage.layer_pages(layer)

            def attend_layer(holder=holder, table=table, pages=pages, q=q, keys=keys, valid=valid):
                holder["out"] = paged_attention(xp, table, pages, q, d_seq, keys, valid, self.tpb, self.bad)
            if self.host:
                self.compute.enqueue(attend_layer)        # runs when the simulated stream does
            else:
                with self.compute:
                    attend_layer()
            results.append(holder)
        return results

    def check(self, results, seq, pos, step) -> None:
        spec = self.spec
        by_rid = {t.rid: t for t in self.active.values()}
        for layer, holder in enumerate(results):
            out = self.be.to_numpy(holder["out"]) if not self.host else holder["out"]
            for t in range(len(pos)):
                conv = self.convs[by_rid[step.request_ids[seq[t]]].conv]
                ref = dense_attention(np.array(conv.tokens, np.int64), layer, int(pos[t]), self.windows[layer],
                                      self.sinks[layer], spec.num_kv_heads, spec.head_dim)
                self.worst = max(self.worst, float(np.nan_to_num(np.abs(out[t] - ref), nan=np.inf).max()))
                self.checked += 1

    def finish_turns(self, it: int) -> None:
        for c, turn in list(self.active.items()):
            conv = self.convs[c]
            hist = self.mgr.request(turn.rid).history
            if hist >= SYSTEM_LEN // self.tpb * self.tpb:
                self.system_settled.add(conv.salt)
            if turn.decoded >= turn.decode_len:
                self.mgr.free(turn.rid)
                del self.active[c]
                self.done.append(turn)
                conv.turn += 1
                conv.ready_at = it + 1 + c % 2            # the user "thinks" for a step or two

    def run(self) -> bool:
        mgr, it = self.mgr, 0
        while self.active or any(c.turn < len(c.user_lens) for c in self.convs):
            self.start_turns(it)
            it += 1
            ctx, gen = self.plan()
            if not ctx and not gen:
                continue
            step = mgr.prepare_batch(ctx, gen)
            seq, pos, ids, new_tokens = self.schedule(step)
            results = self.run_layers(step, seq, pos, ids)
            step.finish(self.compute)
            self.compute.synchronize()
            self.check(results, seq, pos, step)
            if step.num_contexts:
                self.scratch_blocks += int((step.scratch_ends - step.scratch_begs).sum())
            mgr.settle(step, new_tokens=new_tokens)
            self.finish_turns(it)
            self.steps += 1
        return self.report()

    def report(self) -> bool:
        mgr = self.mgr
        self.be.synchronize()
        bad = int(self.be.to_numpy(self.bad)[0])
        write_errors = self.storage.errors()
        mgr.reclaim(wait=True)
        stats = mgr.stats()
        pc = stats["prefix_cache"]
        evictions = sum(g["evictions"] for g in pc["groups"])
        leaked = sum(g["total"] - g["free"] - g["evictable"] for g in stats["groups"])
        for c, conv in enumerate(self.convs):
            turns = sorted((t for t in self.done if t.conv == c), key=lambda t: t.rid)
            print(f"  {conv.name} (salt {conv.salt}): cached/prompt tokens (prefill computed) per turn: "
                  + ", ".join(f"{t.hit}/{t.prompt_len} ({t.computed})" for t in turns))
            for t in turns:
                if t.hit != t.expected_hit and evictions == 0:
                    self.failures.append(f"{t.rid}: {t.hit} prompt tokens cached, the contract says {t.expected_hit}")
                if t.computed != t.prompt_len - t.hit:
                    self.failures.append(f"{t.rid}: computed {t.computed} prefill tokens of {t.prompt_len - t.hit}")
        prompt_tokens = sum(t.prompt_len for t in self.done)
        computed = sum(t.computed for t in self.done)
        hits = sum(t.hit for t in self.done)
        later = [t for t in self.done if t.rid[-1] != "0"]
        if self.worst > ATOL:
            self.failures.append(f"max |paged - dense| = {self.worst:.2e} > {ATOL:.0e}")
        for what, n in (("in-window keys without a page", bad), ("bad write positions", write_errors),
                        ("slots neither free nor evictable after every free", leaked),
                        ("evictions (the pools are sized for none)", evictions)):
            if n:
                self.failures.append(f"{what}: {n}")
        if self.scratch_blocks == 0:
            self.failures.append("no chunk used scratch slots (the workload should exercise them)")
        if pc["hit_tokens"] != hits:
            self.failures.append(f"stats()['prefix_cache']['hit_tokens'] = {pc['hit_tokens']}; add() returned {hits}")
        if not all(t.hit > 0 for t in later):
            self.failures.append("a later turn had no cache hit")
        print(f"{len(self.done)} turns in {len(self.convs)} conversations, {self.steps} steps, "
              f"{self.checked} (token, layer) checks; prompt tokens {prompt_tokens}, cached {hits} "
              f"({pc['hit_tokens']} by stats()), prefill computed {computed}; "
              f"{self.scratch_blocks} scratch blocks; evictions {evictions}")
        print(f"max |paged - dense| = {self.worst:.2e} (tol {ATOL:.0e}); in-window keys without a page: {bad}; "
              f"bad write positions: {write_errors}; slots leaked: {leaked}")
        for f in self.failures:
            print(f"FAILED: {f}")
        return not self.failures


def main(argv=None) -> int:
    backend = parse_backend(argv, __doc__)
    print(f"multi_turn: backend={backend} ({'CuPy' if backend == 'cuda' else 'NumPy'} paged attention); "
          f"{COMMON['tokens_per_block']} tokens/block, system prompt {SYSTEM_LEN} tokens, prefill chunk {CHUNK}")
    t0 = time.perf_counter()
    results = []
    for name, model in MODELS.items():
        print(f"{name}: windows {model['windows']}")
        ok = Chat(backend, model).run()
        print(f"{name}: {'OK' if ok else 'FAILED'}")
        results.append(ok)
    ok = all(results)
    print(f"checked: every turn's cache hit per the contract, only the uncached prompt computed, paged attention "
          f"through per-layer tables == dense attention over the whole conversation (windows and sinks), "
          f"all slots returned; {time.perf_counter() - t0:.1f} s -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
