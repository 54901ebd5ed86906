"""A serving loop without torch, checked against a dense reference attention.

Two tiny models: a Gemma-like one (5 sliding-window layers : 1 full, small window) and a GPT-OSS-like one
(alternating). Requests arrive over time, prefill in chunks (scratch reuse on), decode and finish. Each
step, layer by layer in order: the step's new K/V (from a deterministic generator) are written at the
step's write positions (KVStorage.write), then a small paged attention kernel reads K/V through that
layer's page table with the layer's window. Its output is compared with a dense attention computed from
the same generator over the whole sequence (windows applied).

Layers run in order because scratch pages alias across layers: a layer's K/V must be written and read
before the next layer writes. A key inside a query's window must have a page (a BAD page there is a bug
and is counted); keys outside the window are never read, and their blocks are released.

On a GPU (CuPy) the attention is a RawKernel; without one the host backend runs the same pipeline and
the attention runs in NumPy. Exits non-zero when a check fails.

    python examples/cupy_decode.py [--backend auto|cuda|host]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

import cupykv                                    # noqa: E402
from cupykv.storage import KVStorage             # noqa: E402

BAD = -1
Q_HEADS = 4
COMMON = dict(num_kv_heads=2, head_dim=16, tokens_per_block=8, max_seq_len=256, max_batch=8,
              slots_per_group=256, dtype="float32", swa_scratch_reuse=True, max_step_tokens=512)
MODELS = {
    "gemma-like (5 SWA : 1 full, window 16)": dict(windows=[16] * 5 + [None]),
    "gpt-oss-like (alternating, window 24)": dict(windows=[24, None] * 3),
}
# (arrival iteration, prompt length, tokens to generate)
ARRIVALS = [(0, 70, 8), (0, 21, 12), (2, 100, 6), (3, 9, 10), (5, 64, 7), (8, 45, 9), (9, 130, 5), (12, 33, 6)]
CHUNK = 48            # prefill chunk size (not a multiple of tpb: chunks end mid-block)
ATOL = 2e-4


# -- deterministic K/V/Q -----------------------------------------------------------------------------

def gen_qkv(xp, layer, seeds, positions, kv_heads, head_dim, q_heads=Q_HEADS):
    """q [n, q_heads, D], k and v [n, kv_heads, D] float32 for tokens (request seed, position)."""
    seeds = xp.asarray(seeds, dtype=xp.float64)[:, None, None]
    pos = xp.asarray(positions, dtype=xp.float64)[:, None, None]
    d = xp.arange(head_dim, dtype=xp.float64)[None, None, :]
    hk = xp.arange(kv_heads, dtype=xp.float64)[None, :, None]
    hq = xp.arange(q_heads, dtype=xp.float64)[None, :, None]
    base = seeds * 0.37 + layer * 0.11
    k = xp.sin(base + pos * 0.173 + hk * 1.3 + d * 0.71)
    v = xp.cos(base * 1.7 + pos * 0.057 + hk * 0.9 + d * 0.43)
    q = xp.sin(base * 0.5 + pos * 0.091 + hq * 2.1 + d * 0.29) * 2.0
    return q.astype(xp.float32), k.astype(xp.float32), v.astype(xp.float32)


def visible(pos: int, window) -> range:
    """Key positions a query at `pos` sees: (pos - W, pos] for a window W, [0, pos] for full attention."""
    return range(0 if window is None else max(0, pos - window + 1), pos + 1)


def attend(q, k, v):
    """q [Hq, D], k/v [n, H, D] -> [Hq, D] (GQA: q head h uses kv head h // (Hq // H))."""
    rep = q.shape[0] // k.shape[1]
    k = np.repeat(k, rep, axis=1).astype(np.float64)
    v = np.repeat(v, rep, axis=1).astype(np.float64)
    logits = np.einsum("hd,nhd->hn", q.astype(np.float64), k) / math.sqrt(q.shape[1])
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, v).astype(np.float32)


def dense_reference(layer, seed, pos, window, kv_heads, head_dim):
    """Attention output of the query at `pos` from K/V regenerated densely (no pages involved)."""
    keys = np.arange(visible(pos, window).start, pos + 1)
    q, _, _ = gen_qkv(np, layer, [seed], [pos], kv_heads, head_dim)
    _, k, v = gen_qkv(np, layer, np.full(len(keys), seed), keys, kv_heads, head_dim)
    return attend(q[0], k, v)


# -- paged attention ---------------------------------------------------------------------------------

ATTENTION_SRC = r"""
extern "C" __global__ void paged_attention(const float* __restrict__ q, const int* __restrict__ tok_seq,
                                           const int* __restrict__ tok_pos, const int* __restrict__ table,
                                           const float* __restrict__ pages, float* __restrict__ out,
                                           int* __restrict__ bad, int T, int Hq, int H, int B, int tpb,
                                           int window, long long num_pages, float scale)
{
    // One thread per (token, query head). table: this layer's [max_batch, 2, B]; pages: [num_pages, tpb, H, D].
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * Hq)
        return;
    const int t = i / Hq, h = i % Hq, kh = h / (Hq / H);
    const int s = tok_seq[t], p = tok_pos[t];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    float qv[HEAD_DIM], acc[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) {
        qv[d] = q[(static_cast<long long>(t) * Hq + h) * HEAD_DIM + d];
        acc[d] = 0.f;
    }
    float m = -3.0e38f, l = 0.f;        // running max (a finite -inf: exp(m - m2) is 0 on the first key)
    for (int j = lo; j <= p; ++j) {
        const int blk = j / tpb;
        const int kp = table[(s * 2 + 0) * B + blk];
        const int vp = table[(s * 2 + 1) * B + blk];
        if (kp < 0 || kp >= num_pages || vp < 0 || vp >= num_pages) {   // an in-window key without a page
            atomicAdd(bad, 1);
            continue;
        }
        const float* kr = pages + ((static_cast<long long>(kp) * tpb + j % tpb) * H + kh) * HEAD_DIM;
        const float* vr = pages + ((static_cast<long long>(vp) * tpb + j % tpb) * H + kh) * HEAD_DIM;
        float dot = 0.f;
        for (int d = 0; d < HEAD_DIM; ++d)
            dot += qv[d] * kr[d];
        dot *= scale;
        const float m2 = fmaxf(m, dot);
        const float corr = __expf(m - m2), w = __expf(dot - m2);
        l = l * corr + w;
        for (int d = 0; d < HEAD_DIM; ++d)
            acc[d] = acc[d] * corr + w * vr[d];
        m = m2;
    }
    for (int d = 0; d < HEAD_DIM; ++d)
        out[(static_cast<long long>(t) * Hq + h) * HEAD_DIM + d] = l > 0.f ? acc[d] / l : 0.f;
}
"""


_KERNELS: dict = {}


def _attention_kernel(head_dim):
    """One RawKernel per head_dim for the process (its module is loaded once, on the first launch)."""
    if head_dim not in _KERNELS:
        import cupy
        _KERNELS[head_dim] = cupy.RawKernel(ATTENTION_SRC.replace("HEAD_DIM", str(head_dim)), "paged_attention")
    return _KERNELS[head_dim]


class Attention:
    """Paged attention through one layer's table: a CuPy RawKernel, or NumPy on the host backend."""

    def __init__(self, backend, head_dim):
        self.host = backend.xp is np
        self.kernel = None
        if not self.host:
            self.kernel = _attention_kernel(head_dim)

    def __call__(self, table, pages, q, tok_seq, tok_pos, window, tpb, bad):
        """table [max_batch, 2, B] (one layer), pages [N, tpb, H, D], q [T, Hq, D]; returns out [T, Hq, D].
        bad: a one-element counter of in-window keys without a valid page. Runs on the current stream."""
        T, Hq, D = q.shape
        N, _, H, _ = pages.shape
        if not self.host:
            import cupy
            out = cupy.empty_like(q)
            threads = 128
            args = (q, tok_seq, tok_pos, table, pages, out, bad, np.int32(T), np.int32(Hq), np.int32(H),
                    np.int32(table.shape[-1]), np.int32(tpb), np.int32(window or 0), np.int64(N),
                    np.float32(1.0 / math.sqrt(D)))
            if T:
                self.kernel(((T * Hq + threads - 1) // threads,), (threads,), args)
            return out
        out = np.zeros_like(q)
        for t in range(T):
            s, p = int(tok_seq[t]), int(tok_pos[t])
            keys = np.arange(visible(p, window).start, p + 1)
            kp = table[s, 0, keys // tpb].astype(np.int64)
            vp = table[s, 1, keys // tpb].astype(np.int64)
            ok = (kp >= 0) & (kp < N) & (vp >= 0) & (vp < N)
            bad[0] += int(np.count_nonzero(~ok))
            if ok.any():
                out[t] = attend(q[t], pages[kp[ok], keys[ok] % tpb], pages[vp[ok], keys[ok] % tpb])
        return out


# -- the serving loop --------------------------------------------------------------------------------

class Workload:
    """Arrivals, chunked prefill, decode, finish. Scheduling state advances at prepare (so a scheduler may
    run ahead of settle); a request is freed after the step that scheduled its last token is settled."""

    def __init__(self, mgr, arrivals=ARRIVALS, chunk=CHUNK, max_contexts=2):
        self.mgr = mgr
        self.arrivals = sorted(arrivals)
        self.chunk, self.max_contexts = chunk, max_contexts
        self.reqs = {}          # rid -> dict(seed, prompt, new, sched, generated)
        self.next_arrival = 0
        self.last_step = {}     # rid -> id of the step that scheduled its last token

    def done(self) -> bool:
        return self.next_arrival == len(self.arrivals) and not self.reqs

    def plan(self, it):
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival][0] <= it:
            _, prompt, new = self.arrivals[self.next_arrival]
            rid = f"req{self.next_arrival}"
            self.mgr.add(rid, prompt)
            self.reqs[rid] = dict(seed=self.next_arrival + 1, prompt=prompt, new=new, sched=0, generated=0)
            self.next_arrival += 1
        ctx, gen = {}, []
        for rid, r in self.reqs.items():
            if rid in self.last_step:
                continue
            if r["sched"] < r["prompt"]:
                if len(ctx) < self.max_contexts:
                    ctx[rid] = min(self.chunk, r["prompt"] - r["sched"])
            else:
                gen.append(rid)
        return ctx, gen

    def scheduled(self, step):
        """Token positions of the step, batch order: (entry, request seed, position) arrays."""
        ent, seeds, pos = [], [], []
        for k, (rid, n) in enumerate(zip(step.request_ids, step.num_tokens)):
            r = self.reqs[rid]
            ent += [k] * int(n)
            seeds += [r["seed"]] * int(n)
            pos += list(range(r["sched"], r["sched"] + int(n)))
            r["sched"] += int(n)
            if k >= step.num_contexts:
                r["generated"] += int(n)
                if r["generated"] >= r["new"]:
                    self.last_step[rid] = step.id
        return np.array(ent, np.int32), np.array(seeds, np.int64), np.array(pos, np.int32)

    def settled(self, step):
        for rid in [r for r, s in self.last_step.items() if s == step.id]:
            self.mgr.free(rid)
            del self.reqs[rid], self.last_step[rid]


class Runner:
    """Enqueues one step's layers on a compute stream and keeps what is needed to check it."""

    def __init__(self, mgr, storage, compute):
        self.mgr, self.storage, self.compute = mgr, storage, compute
        self.be = mgr.backend
        self.host = self.be.xp is np
        self.attn = Attention(self.be, mgr.spec.head_dim)
        self.bad = self.be.device_full((1,), 0, np.int32)
        self.be.synchronize()

    def launch(self, fn):
        """Run fn in compute-stream order: enqueued on the simulated stream, or CuPy calls on the stream."""
        if self.host:
            self.compute.enqueue(fn)
        else:
            with self.compute:
                fn()

    def run_step(self, step, ent, seeds, pos):
        """All layers of a step, in order: write the layer's new K/V, then its attention. Returns a list of
        (layer, holder) where holder["out"] is filled when the work has run."""
        mgr, st, xp = self.mgr, self.storage, self.be.xp
        spec, lay = mgr.spec, mgr.layout
        H, D, tpb = spec.num_kv_heads, spec.head_dim, lay.tpb
        results = []
        if not self.host:
            with self.compute:
                d_ent, d_pos = xp.asarray(ent), xp.asarray(pos)
        else:
            d_ent, d_pos = ent, pos
        for layer in range(lay.num_layers):
            window = spec.windows_tuple[layer]
            if self.host:
                q, k, v = gen_qkv(np, layer, seeds, pos, H, D)
            else:
                with self.compute:
                    q, k, v = gen_qkv(xp, layer, seeds, pos, H, D)
            st.write(step, layer, k, v, stream=self.compute)
            holder = {}
            table, pages = mgr.out[layer], st.layer_pages(layer)

            def attend_layer(holder=holder, q=q, table=table, pages=pages, window=window):
                holder["out"] = self.attn(table, pages, q, d_ent, d_pos, window, tpb, self.bad)
            self.launch(attend_layer)
            results.append((layer, holder))
        return results

    def bad_keys(self) -> int:
        self.be.synchronize()
        return int(self.be.to_numpy(self.bad)[0])


def check_step(mgr, results, seeds, pos):
    """Max |paged - dense reference| over the step's tokens and layers (after the work has run)."""
    worst = 0.0
    spec = mgr.spec
    for layer, holder in results:
        out = holder["out"]
        out = out if isinstance(out, np.ndarray) else out.get()
        for t in range(len(pos)):
            ref = dense_reference(layer, int(seeds[t]), int(pos[t]), spec.windows_tuple[layer],
                                  spec.num_kv_heads, spec.head_dim)
            err = np.nan_to_num(np.abs(out[t] - ref), nan=np.inf)      # a NaN is a failure
            worst = max(worst, float(err.max()))
    return worst


def swa_blocks_held(mgr):
    """Most blocks any live request holds in a sliding-window group (out-of-window blocks are released)."""
    most = 0
    for g in mgr.layout.groups:
        if g.window is not None:
            for rid in mgr.request_ids:
                most = max(most, int(np.count_nonzero(mgr.table[g.index, mgr.request(rid).row] != BAD)))
    return most


def run_model(name, windows, backend):
    spec = cupykv.CacheSpec(windows=windows, **COMMON)
    mgr = cupykv.KVCacheManager(spec, backend=backend)
    storage = KVStorage(mgr)
    compute = mgr.backend.new_stream("compute")
    runner = Runner(mgr, storage, compute)
    wl = Workload(mgr)
    worst, steps, tokens, scratch_blocks, held = 0.0, 0, 0, 0, 0
    it = 0
    while not wl.done():
        ctx, gen = wl.plan(it)
        it += 1
        if not ctx and not gen:
            continue
        step = mgr.prepare_batch(ctx, gen)
        ent, seeds, pos = wl.scheduled(step)
        results = runner.run_step(step, ent, seeds, pos)
        step.finish(compute)
        compute.synchronize()
        worst = max(worst, check_step(mgr, results, seeds, pos))
        if step.num_contexts:
            scratch_blocks += int((step.scratch_ends - step.scratch_begs).sum())
        mgr.settle(step)
        wl.settled(step)
        held = max(held, swa_blocks_held(mgr))
        steps += 1
        tokens += len(pos)
    bad = runner.bad_keys()
    write_errors = storage.errors()
    mgr.reclaim(wait=True)
    stats = mgr.stats()
    leaked = sum(g["total"] - g["free"] for g in stats["groups"])
    limit = max(w for w in windows if w is not None) // spec.tokens_per_block + 2
    ok = worst <= ATOL and bad == 0 and write_errors == 0 and leaked == 0 and held <= limit and scratch_blocks > 0
    print(f"{name}: {steps} steps, {tokens} tokens x {len(windows)} layers, {scratch_blocks} scratch blocks; "
          f"max |paged - dense| = {worst:.2e} (tol {ATOL:.0e}); in-window keys without a page: {bad}; "
          f"bad write positions: {write_errors}; SWA blocks held per request <= {held} (limit {limit}); "
          f"slots not returned after free: {leaked} -> {'OK' if ok else 'FAILED'}")
    return ok


def parse_backend(argv, doc: str) -> str:
    """The examples' one option: --backend auto|cuda|host, resolved ('auto': the GPU when there is one)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    backend = ap.parse_args(argv).backend
    if backend == "auto":
        backend = "cuda" if cupykv.cuda_available() else "host"
    return backend


def main(argv=None) -> int:
    backend = parse_backend(argv, __doc__)
    print(f"cupy_decode: backend={backend} ({'CuPy RawKernel' if backend == 'cuda' else 'NumPy'} paged attention)")
    t0 = time.perf_counter()
    ok = all([run_model(name, m["windows"], backend) for name, m in MODELS.items()])
    print(f"checked: paged attention through per-layer tables == dense reference attention (windows applied), "
          f"no in-window key without a page, all slots returned; {time.perf_counter() - t0:.1f} s -> "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
