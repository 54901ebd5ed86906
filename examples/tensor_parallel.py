"""Tensor parallelism on cupykv: one manager, and on each device a KV-head shard and its own tables.

A small model (windows [16, None] * 2; 4 KV heads, 8 query heads, GQA 2:1) split over two ranks: rank r
holds KV heads [2r, 2r + 2) in KVStorage(mgr, rank=r) and computes query heads [4r, 4r + 4). One
KVCacheManager(devices=[...]) decides everything and ships one snapshot per step; each device builds its
own tables and write positions from it (step.on(r)). Requests arrive, prefill in chunks (scratch reuse
on), decode and are freed. Each step, layer by layer (scratch pages alias across layers), every rank, on
a stream of its device, waits on its `ready`, writes its heads' K/V (a deterministic generator sliced to
its heads) and runs paged attention for its heads through ITS OWN tables with the layer's window; then
it finishes its part on that stream: step.on(r).finish(stream). Checked: the ranks' outputs concatenated
over heads equal dense attention over all heads (windows applied); no in-window key lacks a page (BAD
cells are never read); the ranks' tables agree; every slot comes back after the frees.

--devices: CUDA ids, or labels of simulated devices on the host backend. Default: [0, 1] when CuPy sees
2+ GPUs, [0, 0] (two mirrors on one GPU) with one, else the host backend with [0, 1]. Exits non-zero on
any mismatch.

    python examples/tensor_parallel.py [--backend auto|cuda|host] [--devices 0,1]
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

import cupykv                                    # noqa: E402
from cupykv.staging import MODE_DELTA            # noqa: E402
from cupykv.storage import KVStorage             # noqa: E402

KV_HEADS, Q_HEADS, HEAD_DIM = 4, 8, 16
SPEC = dict(windows=[16, None] * 2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, tokens_per_block=8, max_seq_len=256,
            max_batch=8, slots_per_group=256, dtype="float32", swa_scratch_reuse=True, max_step_tokens=512)
# (arrival iteration, prompt length, tokens to generate)
ARRIVALS = [(0, 70, 8), (0, 21, 12), (2, 100, 6), (3, 9, 10), (5, 64, 7), (8, 45, 9), (9, 130, 5)]
CHUNK, ATOL = 48, 2e-4        # prefill chunk (ends mid-block); tolerance of |paged - dense|


def gen_qkv(xp, layer, seeds, positions):
    """q [n, Q_HEADS, D], k and v [n, KV_HEADS, D] float32 for tokens (request seed, position): all heads."""
    seeds = xp.asarray(seeds, dtype=xp.float64)[:, None, None]
    pos = xp.asarray(positions, dtype=xp.float64)[:, None, None]
    d = xp.arange(HEAD_DIM, dtype=xp.float64)[None, None, :]
    hk = xp.arange(KV_HEADS, dtype=xp.float64)[None, :, None]
    hq = xp.arange(Q_HEADS, dtype=xp.float64)[None, :, None]
    base = seeds * 0.37 + layer * 0.11
    k = xp.sin(base + pos * 0.173 + hk * 1.3 + d * 0.71)
    v = xp.cos(base * 1.7 + pos * 0.057 + hk * 0.9 + d * 0.43)
    q = xp.sin(base * 0.5 + pos * 0.091 + hq * 2.1 + d * 0.29) * 2.0
    return q.astype(xp.float32), k.astype(xp.float32), v.astype(xp.float32)


def attend(q, k, v):
    """q [Hq, D], k/v [n, H, D] -> [Hq, D] (GQA: q head h uses kv head h // (Hq // H))."""
    rep = q.shape[0] // k.shape[1]
    k, v = (np.repeat(x, rep, axis=1).astype(np.float64) for x in (k, v))
    logits = np.einsum("hd,nhd->hn", q.astype(np.float64), k) / math.sqrt(q.shape[1])
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (np.einsum("hn,nhd->hd", w / w.sum(axis=1, keepdims=True), v)).astype(np.float32)


def first_key(pos: int, window) -> int:
    return 0 if window is None else max(0, pos - window + 1)


def dense_reference(layer, seed, pos, window):
    """All heads' attention output of the query at `pos`, from K/V regenerated densely (no pages)."""
    keys = np.arange(first_key(pos, window), pos + 1)
    q, _, _ = gen_qkv(np, layer, [seed], [pos])
    _, k, v = gen_qkv(np, layer, np.full(len(keys), seed), keys)
    return attend(q[0], k, v)


# One thread per (token, local query head); table: this layer's [max_batch, 2, B] of this rank; pages:
# [num_pages, tpb, H, D] of this rank's heads. Only in-window keys are visited; one without a valid page
# is counted in *bad and never read.
ATTENTION_SRC = r"""
extern "C" __global__ void paged_attention(const float* q, const int* tok_seq, const int* tok_pos,
        const int* table, const float* pages, float* out, int* bad, int T, int Hq, int H, int B, int tpb,
        int window, long long num_pages, float scale) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * Hq) return;
    const int t = i / Hq, h = i % Hq, kh = h / (Hq / H), s = tok_seq[t], p = tok_pos[t];
    float qv[HEAD_DIM], acc[HEAD_DIM], m = -3.0e38f, l = 0.f;
    for (int d = 0; d < HEAD_DIM; ++d) { qv[d] = q[((long long)t * Hq + h) * HEAD_DIM + d]; acc[d] = 0.f; }
    for (int j = window > 0 ? max(0, p - window + 1) : 0; j <= p; ++j) {
        const int kp = table[(s * 2 + 0) * B + j / tpb], vp = table[(s * 2 + 1) * B + j / tpb];
        if (kp < 0 || kp >= num_pages || vp < 0 || vp >= num_pages) { atomicAdd(bad, 1); continue; }
        const float* kr = pages + (((long long)kp * tpb + j % tpb) * H + kh) * HEAD_DIM;
        const float* vr = pages + (((long long)vp * tpb + j % tpb) * H + kh) * HEAD_DIM;
        float dot = 0.f;
        for (int d = 0; d < HEAD_DIM; ++d) dot += qv[d] * kr[d];
        dot *= scale;
        const float m2 = fmaxf(m, dot), corr = __expf(m - m2), w = __expf(dot - m2);
        l = l * corr + w;
        for (int d = 0; d < HEAD_DIM; ++d) acc[d] = acc[d] * corr + w * vr[d];
        m = m2;
    }
    for (int d = 0; d < HEAD_DIM; ++d) out[((long long)t * Hq + h) * HEAD_DIM + d] = l > 0.f ? acc[d] / l : 0.f;
}
""".replace("HEAD_DIM", str(HEAD_DIM))


def paged_attention(xp, kernel, table, pages, q, ent, pos, window, tpb, bad):
    """[T, Hq, D] attention of this rank's heads through one layer's table (its current stream on CUDA)."""
    T, Hq, D = q.shape
    N, _, H, _ = pages.shape
    if xp is not np:
        out = xp.empty_like(q)
        if T:
            kernel(((T * Hq + 127) // 128,), (128,), (q, ent, pos, table, pages, out, bad, np.int32(T), np.int32(Hq),
                   np.int32(H), np.int32(table.shape[-1]), np.int32(tpb), np.int32(window or 0), np.int64(N),
                   np.float32(1.0 / math.sqrt(D))))
        return out
    out = np.zeros_like(q)
    for t in range(T):
        keys = np.arange(first_key(int(pos[t]), window), int(pos[t]) + 1)
        kp, vp = (table[int(ent[t]), kv, keys // tpb].astype(np.int64) for kv in (0, 1))
        ok = (kp >= 0) & (kp < N) & (vp >= 0) & (vp < N)
        bad[0] += int(np.count_nonzero(~ok))
        if ok.any():
            out[t] = attend(q[t], pages[kp[ok], keys[ok] % tpb], pages[vp[ok], keys[ok] % tpb])
    return out


class Rank:
    """One tensor-parallel rank: its storage (its KV heads), a consumer stream on its device, a counter
    of in-window keys without a page."""

    def __init__(self, mgr, rank: int):
        self.rank, self.mgr, world = rank, mgr, len(mgr.backends)
        self.be = be = mgr.backends[rank]
        self.kv = slice(rank * KV_HEADS // world, (rank + 1) * KV_HEADS // world)
        self.qh = slice(rank * Q_HEADS // world, (rank + 1) * Q_HEADS // world)
        self.storage = KVStorage(mgr, rank=rank)
        self.stream = be.new_stream(f"tp rank {rank}")
        self.bad = be.device_full((1,), 0, np.int32)
        self.kernel = None if be.xp is np else be.xp.RawKernel(ATTENTION_SRC, "paged_attention")
        be.synchronize()

    def on_stream(self):
        """CuPy calls on this rank's device and stream (CUDA); nothing to enter on the host backend."""
        if self.be.xp is np:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.be.device_context())
        stack.enter_context(self.stream)
        return stack

    def run_step(self, step, ent, seeds, pos):
        """Every layer in order (scratch pages alias across layers): write this rank's K/V, then attend.
        Returns per layer a holder whose "out" [T, Hq / world, D] is set once the stream has run it."""
        view = step.on(self.rank)
        assert view.backend is self.be
        xp, tpb, results = self.be.xp, self.mgr.layout.tpb, []
        with self.on_stream():
            self.be.wait(self.stream, view.ready)            # this device's tables and write positions
            d_ent, d_seeds, d_pos = xp.asarray(ent), xp.asarray(seeds), xp.asarray(pos)
            for layer, window in enumerate(self.mgr.spec.windows_tuple):
                q, k, v = gen_qkv(xp, layer, d_seeds, d_pos)
                q = xp.ascontiguousarray(q[:, self.qh])
                self.storage.write(view, layer, k[:, self.kv], v[:, self.kv], stream=self.stream)
                holder, table, pages = {}, view.tables[layer], self.storage.layer_pages(layer)

                def attend_layer(holder=holder, q=q, table=table, pages=pages, window=window):
                    holder["out"] = paged_attention(xp, self.kernel, table, pages, q, d_ent, d_pos, window, tpb,
                                                    self.bad)
                if xp is np:
                    self.stream.enqueue(attend_layer)        # runs after the write, in stream order
                else:
                    attend_layer()
                results.append(holder)
        view.finish(self.stream)                             # after this rank's last read of its tables
        return results

    def outputs(self, results):
        self.stream.synchronize()
        if self.be.xp is np:
            return [h["out"] for h in results]
        with self.be.device_context():
            return [h["out"].get() for h in results]

    def tables(self, step):
        """This rank's tables of the step's rows, on the host (after its manager stream)."""
        return self.be.to_numpy(step.on(self.rank).tables)[:, :step.num_seqs]

    def errors(self) -> int:
        self.be.synchronize()
        return int(self.be.to_numpy(self.bad)[0]) + self.storage.errors()


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    ap.add_argument("--devices", default=None, help="comma-separated device ids, e.g. 0,1 or 0,0")
    args = ap.parse_args(argv)
    backend = args.backend if args.backend != "auto" else ("cuda" if cupykv.cuda_available() else "host")
    if args.devices:
        devices = [int(d) for d in args.devices.split(",")]
    elif backend == "cuda" and cupykv.cuda_available():
        import cupy
        devices = [0, 1] if cupy.cuda.runtime.getDeviceCount() >= 2 else [0, 0]
    else:
        devices = [0, 1]
    if KV_HEADS % len(devices):
        ap.error(f"--devices: {KV_HEADS} KV heads do not split over {len(devices)} devices")
    return backend, devices


def main(argv=None) -> int:
    backend, devices = parse(argv)
    mgr = cupykv.KVCacheManager(cupykv.CacheSpec(**SPEC), backend=backend, devices=devices)
    ranks = [Rank(mgr, r) for r in range(len(devices))]
    pending, reqs, last_step = sorted(ARRIVALS), {}, {}    # rid -> dict(seed, prompt, new, sched, generated)
    worst, steps, checks, table_diffs, scratch, delta, it = 0.0, 0, 0, 0, 0, 0, 0
    while pending or reqs:
        while pending and pending[0][0] <= it:               # arrivals
            _, prompt, new = pending.pop(0)
            seed = len(ARRIVALS) - len(pending)
            mgr.add(f"req{seed}", prompt)
            reqs[f"req{seed}"] = dict(seed=seed, prompt=prompt, new=new, sched=0, generated=0)
        it += 1
        ctx, gen = {}, []
        for rid, r in reqs.items():
            if rid in last_step:
                continue
            if r["sched"] < r["prompt"]:
                if len(ctx) < 2:
                    ctx[rid] = min(CHUNK, r["prompt"] - r["sched"])
            else:
                gen.append(rid)
        if not ctx and not gen:
            continue
        step = mgr.prepare_batch(ctx, gen)
        ent, seeds, pos = [], [], []                         # per new token, batch order
        for e, (rid, n) in enumerate(zip(step.request_ids, step.num_tokens)):
            r, n = reqs[rid], int(n)
            ent, seeds, pos = ent + [e] * n, seeds + [r["seed"]] * n, pos + list(range(r["sched"], r["sched"] + n))
            r["sched"] += n
            if e >= step.num_contexts:
                r["generated"] += n
                if r["generated"] >= r["new"]:
                    last_step[rid] = step.id
        ent, seeds, pos = np.array(ent, np.int32), np.array(seeds, np.int64), np.array(pos, np.int32)
        results = [rank.run_step(step, ent, seeds, pos) for rank in ranks]    # every rank enqueues, then we check
        outs = [rank.outputs(res) for rank, res in zip(ranks, results)]
        for layer, window in enumerate(mgr.spec.windows_tuple):
            full = np.concatenate([o[layer] for o in outs], axis=1)          # [T, Q_HEADS, D]: heads gathered
            for t in range(len(pos)):
                ref = dense_reference(layer, int(seeds[t]), int(pos[t]), window)
                err = np.nan_to_num(np.abs(full[t] - ref), nan=np.inf)      # a NaN is a failure
                worst = max(worst, float(err.max()))
                checks += 1
        table_diffs += sum(int(np.count_nonzero(r.tables(step) != ranks[0].tables(step))) for r in ranks[1:])
        scratch += int((step.scratch_ends - step.scratch_begs).sum()) if step.num_contexts else 0
        delta += step.mode == MODE_DELTA
        mgr.settle(step)
        for rid in [rid for rid, s in last_step.items() if s == step.id]:
            mgr.free(rid)
            del reqs[rid], last_step[rid]
        steps += 1
    errors = sum(r.errors() for r in ranks)
    mgr.reclaim(wait=True)
    leaked = sum(g["total"] - g["free"] for g in mgr.stats()["groups"])
    ok = worst <= ATOL and errors == 0 and table_diffs == 0 and leaked == 0 and scratch > 0
    where = f"{mgr.backend.name}, {'simulated ' if backend == 'host' else ''}devices {devices}"
    print(f"{len(SPEC['windows'])} layers {SPEC['windows']}, {KV_HEADS} KV / {Q_HEADS} query heads over "
          f"{len(devices)} ranks; {scratch} scratch blocks, {delta} DELTA steps; max |concat(ranks) - dense| = "
          f"{worst:.2e} (tol {ATOL:.0e}); in-window keys without a page + bad writes: {errors}; table cells "
          f"differing between ranks: {table_diffs}; slots not returned: {leaked}")
    print(f"tensor_parallel {'OK' if ok else 'FAILED'}: {steps} steps, {checks} attention checks on "
          f"{len(devices)} devices ({where})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
