"""FlashInfer attention over cupykv's CSR page lists, checked against dense attention.

A Gemma-like model (5 sliding-window layers of window 32 : 1 full-attention layer, tpb 16, 8 query heads
on 2 KV heads, head_dim 64) serves a few requests: chunked prefill with scratch reuse, decode, frees,
with null slots on (CacheSpec(null_slot=True): the tables' BAD cells hold a zero page; the CSR lists
hold real pages only, so FlashInfer sees the same lists either way). Each step, on a torch stream and
layer by layer in order (scratch pages alias across layers):

- the layer's new K/V are written with KVStorage.write (on the torch stream);
- context chunks run BatchPrefillWithPagedKVCacheWrapper over csr_views(step, layer=l) (causal);
- decode entries run BatchDecodeWithPagedKVCacheWrapper: one plan per group (csr_views(step, g)) reused
  by every layer of the group with the page views offset by the layer's K offset, or the layer's own
  lists when the step uses scratch blocks in that group;
- window_left = W - 1 (cupykv's window W covers keys (pos - W, pos]), -1 for full attention;
  paged_kv_cache = (pages[koff:koff + m], pages[koff + 1:koff + 1 + m]) of the group's page view (V = K + 1).

Every output is compared with dense attention over the K/V written (float32). FlashInfer derives key
positions from the list length; the lists leave out the released prefix and keep the resident suffix
contiguous, so positions relative to the query are exact for windows without sink tokens (this model has
none; tests/test_flashinfer.py covers sinks).

Needs a GPU, torch and FlashInfer (pip install cupykv[flashinfer]: flashinfer-python==0.6.10 with
apache-tvm-ffi==0.1.11); without them it says so and exits 0 (skipped). FlashInfer compiles its kernels
with nvcc on first use (about 15 s per module on the H200). Exits 1 when a check fails.

    python examples/flashinfer_decode.py [--dtype float16|bfloat16|both]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

import cupykv                                       # noqa: E402
from cupykv import interop                          # noqa: E402
from cupykv.interop import csr_views                # noqa: E402
from cupykv.storage import KVStorage, StorageDtypeError   # noqa: E402

TPB, KV_HEADS, Q_HEADS, HEAD_DIM = 16, 2, 8, 64
WINDOWS = [32] * 5 + [None]
ARRIVALS = [(0, 130, 12), (0, 45, 16), (2, 200, 8), (5, 70, 10)]    # (iteration, prompt, tokens to generate)
CHUNK = 96
ATOL = {"float16": 1e-2, "bfloat16": 4e-2}


def skip(reason: str) -> None:
    print(f"flashinfer_decode: skipped: {reason}")
    sys.exit(0)


def dense_attention(torch, q, k, v, pos, window):
    """q [t, Hq, D] at positions pos [t], k/v [n, H, D]: keys j <= pos (and pos - W < j for a window W)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    ok = j <= pos[:, None]
    if window is not None:
        ok &= j > pos[:, None] - window
    logits = torch.einsum("thd,nhd->thn", q, k) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
    return torch.einsum("thn,nhd->thd", torch.softmax(logits, dim=-1), v)


class FlashInferModel:
    def __init__(self, torch, flashinfer, dtype: str):
        self.torch = torch
        spec = cupykv.CacheSpec(windows=WINDOWS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                                tokens_per_block=TPB, max_seq_len=256, max_batch=4, slots_per_group=96,
                                swa_scratch_reuse=True, null_slot=True, max_step_tokens=256)
        self.mgr = cupykv.KVCacheManager(spec, backend="cuda")
        self.storage = KVStorage(self.mgr)            # StorageDtypeError where bfloat16 is not available
        self.lay = self.mgr.layout
        self.dtype, self.tdtype = dtype, getattr(torch, dtype)
        self.ts = torch.cuda.Stream()
        self.pages = [interop.pages_to_torch(self.storage, g, None, self.ts) for g in range(self.lay.num_groups)]

        def workspace():
            return torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="fa2")
        self.K, self.V = {}, {}
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(0)
        self.worst, self.failures = 0.0, []
        self.counts = dict(prefill=0, decode=0, group_plan_reuse=0, released_lists=0)

    def lists(self, csr, lo, hi):
        ip, ts = csr.indptr_host, self.ts
        indptr = interop.to_torch(csr.kv_indptr, csr, ts)
        indices = interop.to_torch(csr.kv_indices, csr, ts)
        last = interop.to_torch(csr.kv_last_page_len, csr, ts)
        return ((indptr[lo:hi + 1] - indptr[lo]).contiguous(), indices[int(ip[lo]):int(ip[hi])].contiguous(),
                last[lo:hi].contiguous())

    def views(self, group, koff):
        pages = self.pages[group]
        m = pages.shape[0] - 1 - koff
        return pages[koff:koff + m], pages[koff + 1:koff + 1 + m]

    def step(self, ctx, dec):
        torch, lay = self.torch, self.lay
        step = self.mgr.prepare_batch(ctx, dec)
        C, n, T = step.num_contexts, step.num_seqs, step.total_tokens
        cu = np.concatenate(([0], np.cumsum(step.num_tokens)))
        tc = int(cu[C])
        lens = step.start_positions + step.num_tokens
        common = dict(q_data_type=self.tdtype, kv_data_type=self.tdtype)
        with torch.cuda.stream(self.ts):
            for g in lay.groups:
                wl = -1 if g.window is None else g.window - 1
                scratch = bool(C) and bool((step.scratch_ends[g.index, :C] > step.scratch_begs[g.index, :C]).any())
                group_csr = None
                if n > C and not scratch:        # one decode plan for the whole group
                    group_csr = csr_views(step, g.index)
                    self.decode.plan(*self.lists(group_csr, C, n), Q_HEADS, KV_HEADS, HEAD_DIM, TPB,
                                     window_left=wl, **common)
                for i, layer in enumerate(g.layers):
                    q, k, v = (torch.randn(T, h, HEAD_DIM, generator=self.gen, device="cuda").to(self.tdtype)
                               for h in (Q_HEADS, KV_HEADS, KV_HEADS))
                    self.storage.write(step, layer, k, v, stream=self.ts)
                    for s, rid in enumerate(step.request_ids):
                        if (layer, rid) not in self.K:
                            self.K[layer, rid] = torch.zeros(256, KV_HEADS, HEAD_DIM, device="cuda")
                            self.V[layer, rid] = torch.zeros(256, KV_HEADS, HEAD_DIM, device="cuda")
                        a, b = int(step.start_positions[s]), int(lens[s])
                        self.K[layer, rid][a:b] = k[cu[s]:cu[s + 1]].float()
                        self.V[layer, rid][a:b] = v[cu[s]:cu[s + 1]].float()
                    layer_csr = csr_views(step, layer=layer)
                    out = torch.empty(T, Q_HEADS, HEAD_DIM, dtype=self.tdtype, device="cuda")
                    if C:
                        qo = torch.from_numpy(cu[:C + 1].astype(np.int32)).cuda()
                        self.prefill.plan(qo, *self.lists(layer_csr, 0, C), Q_HEADS, KV_HEADS, HEAD_DIM, TPB,
                                          causal=True, window_left=wl, **common)
                        out[:tc] = self.prefill.run(q[:tc], self.views(g.index, 0))
                        self.counts["prefill"] += 1
                    if n > C:
                        if group_csr is None:
                            self.decode.plan(*self.lists(layer_csr, C, n), Q_HEADS, KV_HEADS, HEAD_DIM, TPB,
                                             window_left=wl, **common)
                            koff = 0
                        else:
                            koff = int(lay.layer_koff[layer])
                            self.counts["group_plan_reuse"] += i > 0
                        out[tc:] = self.decode.run(q[tc:], self.views(g.index, koff))
                        self.counts["decode"] += 1
                    listed = np.diff(layer_csr.indptr_host)
                    for s, rid in enumerate(step.request_ids):
                        N = int(lens[s])
                        self.counts["released_lists"] += g.window is not None and listed[s] < -(-N // TPB)
                        pos = torch.arange(int(step.start_positions[s]), N, device="cuda")
                        want = dense_attention(torch, q[cu[s]:cu[s + 1]].float(), self.K[layer, rid][:N],
                                               self.V[layer, rid][:N], pos, g.window)
                        diff = (out[cu[s]:cu[s + 1]].float() - want).abs()
                        err = float(diff.nan_to_num(nan=float("inf")).max())        # a NaN is a failure
                        self.worst = max(self.worst, err)
                        if err > ATOL[self.dtype]:
                            self.failures.append(f"step {step.id} layer {layer} entry {s}: max error {err:.4g}")
            interop.finish_on_torch(step, self.ts)
        return step

    def run(self):
        mgr = self.mgr
        prompts, todo, sched = {}, {}, {}
        arrivals = list(ARRIVALS)
        it = steps = 0
        while arrivals or prompts:
            while arrivals and arrivals[0][0] <= it:
                _, prompt, gen = arrivals.pop(0)
                rid = f"req-{it}-{len(prompts)}"
                prompts[rid], todo[rid], sched[rid] = prompt, gen, 0
                mgr.add(rid, prompt)
            it += 1
            ctx = {r: min(CHUNK, prompts[r] - sched[r]) for r in prompts if sched[r] < prompts[r]}
            ctx = dict(list(ctx.items())[:2])
            dec = [r for r in prompts if sched[r] >= prompts[r]]
            if not ctx and not dec:
                continue
            mgr.settle(self.step(ctx, dec))
            steps += 1
            for r, c in ctx.items():
                sched[r] += c
            for r in dec:
                sched[r] += 1
                todo[r] -= 1
                if todo[r] == 0:
                    mgr.free(r)
                    del prompts[r], todo[r], sched[r]
        mgr.synchronize()
        return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float16", "bfloat16", "both"], default="both")
    args = ap.parse_args()
    if not cupykv.cuda_available():
        skip("no usable CUDA GPU (CuPy missing or no driver)")
    try:
        import torch
    except ImportError:
        skip("torch is not installed (pip install cupykv[flashinfer])")
    if not torch.cuda.is_available():
        skip("this torch build has no CUDA")
    try:
        import flashinfer
    except Exception as exc:
        skip(f"flashinfer is not importable ({type(exc).__name__}: {exc}); pip install cupykv[flashinfer]")
    failed = False
    for dtype in (["float16", "bfloat16"] if args.dtype == "both" else [args.dtype]):
        try:
            model = FlashInferModel(torch, flashinfer, dtype)
        except StorageDtypeError as exc:
            print(f"{dtype}: skipped ({exc})")
            continue
        steps = model.run()
        c = model.counts
        print(f"flashinfer {flashinfer.__version__}, {dtype}: {steps} steps; {c['prefill']} prefill and "
              f"{c['decode']} decode calls (layer by layer; {c['group_plan_reuse']} decode calls reused their "
              f"group's plan), {c['released_lists']} lists without their released prefix; every output against "
              f"dense attention with windows: worst error {model.worst:.3g} (tolerance {ATOL[dtype]})")
        if model.failures:
            failed = True
            print(f"{dtype}: FAILED, {len(model.failures)} outputs differ; first: {model.failures[0]}")
        elif not (c["prefill"] and c["decode"] and c["group_plan_reuse"] and c["released_lists"]):
            failed = True
            print(f"{dtype}: FAILED, the workload did not cover every path: {c}")
    print("flashinfer_decode: FAILED" if failed else "flashinfer_decode: all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
