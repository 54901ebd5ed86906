"""FlashInfer (0.6.10) attention through cupykv's CSR views, against dense attention (GPU only).

A serving workload (arrivals, chunked prefill, decode, frees) on a model with three layer groups: a
sliding window of 32 without sinks, full attention, and a window of 48 with 16 sink tokens; tpb 16, GQA
(8 query heads on 2 KV heads), head_dim 64; fp16 and bf16 storage, scratch reuse on and off (on: with
null slots, CacheSpec(null_slot=True)). Each step, on a torch stream and layer by layer in order (scratch
pages alias across layers): the layer's new K/V go through KVStorage.write, then FlashInfer runs over
csr_views with window_left = W - 1 (-1 for full attention) and paged_kv_cache = (K view, V view) of the
group's page view (V = K + 1):

- context chunks: BatchPrefillWithPagedKVCacheWrapper (fa2, causal); decodes: BatchDecodeWithPagedKV-
  CacheWrapper; mixed steps split the lists at the first generation entry;
- lists="layer": csr_views(step, layer=l), one plan per layer; lists="group": csr_views(step, g), one plan
  per group reused by every layer of the group with the views offset by the layer's K offset
  (pages[koff:], pages[koff + 1:]); a group whose scratch blocks the step uses falls back to layer lists.

Every output is compared with dense attention over the K/V the test wrote (float32, the stored values).

Positions: FlashInfer derives a sequence's key positions from its page list (kv_len = (pages - 1) * tpb +
last_page_len). A list that leaves out the released prefix keeps the resident suffix contiguous, so its
positions relative to the query are exact: right for windows without sinks (checked: such lists are
seen). With sink tokens the list is the sink blocks followed by that suffix; in the derived positions
the sink blocks sit just before the suffix, which starts at or before the window's first key, so
window_left = W - 1 masks them out: FlashInfer computes plain sliding-window attention, without the
sinks. That is what is checked for the sink group (and that it differs from window-plus-sinks attention
where the sinks lie outside the window). The sinks take a second pass: a decode over the first
ceil(n / tpb) pages of each list with last_page_len making n = min(sink_tokens, pos - W + 1) keys and
window_left = -1, checked against dense attention over keys [0, n); merge the two with their LSEs
(flashinfer.merge_state).

Skips, saying why, without a GPU, torch or FlashInfer (pip install cupykv[flashinfer]). FlashInfer
JIT-compiles its kernels with nvcc on first use (a few modules, about 15 s each on the H200).
"""
import math

import numpy as np
import pytest

import cupykv
from cupykv import interop
from cupykv.interop import csr_views
from cupykv.spec import CacheSpec
from cupykv.storage import KVStorage, StorageDtypeError
from conftest import backend_or_skip

TPB = 16
WINDOWS = [32, None, 48, 32, None, 48]
SINKS = [0, 0, 16, 0, 0, 16]
KV_HEADS, Q_HEADS, HEAD_DIM = 2, 8, 64
# (arrival iteration, prompt length, tokens to generate)
ARRIVALS = [(0, 150, 14), (0, 70, 20), (3, 200, 10), (6, 41, 16), (9, 120, 8)]
CHUNK = 96
ATOL = {"float16": 1e-2, "bfloat16": 4e-2}
WORKSPACE_BYTES = 64 << 20


def flashinfer_or_skip():
    backend_or_skip("cuda")
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed; the FlashInfer tests need it (pip install cupykv[flashinfer])")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA (or sees no GPU)")
    try:
        import flashinfer
    except Exception as exc:       # ImportError, or a broken install (a missing apache-tvm-ffi, say)
        pytest.skip(f"flashinfer is not importable ({type(exc).__name__}: {exc}); pip install cupykv[flashinfer] "
                    "(flashinfer-python==0.6.10, apache-tvm-ffi==0.1.11)")
    return torch, flashinfer


def dense_attention(torch, q, k, v, allowed):
    """q [t, Hq, D], k/v [n, H, D] float32, allowed [t, n] bool -> [t, Hq, D] (GQA: q head h reads kv head
    h // (Hq // H)); softmax scale 1 / sqrt(D), FlashInfer's default."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    logits = torch.einsum("thd,nhd->thn", q, k) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("thn,nhd->thd", torch.softmax(logits, dim=-1), v)


def keys_allowed(torch, pos, n, window, sinks):
    """[t, n]: key j is seen by a query at pos[i]: j <= pos and (full, or pos - W < j, or j < sinks)."""
    j = torch.arange(n, device=pos.device)[None, :]
    p = pos[:, None]
    ok = j <= p
    if window is not None:
        ok &= (j > p - window) | (j < sinks)
    return ok


class Consumer:
    """The model's attention through FlashInfer, and the checks."""

    def __init__(self, torch, flashinfer, dtype, scratch, lists):
        self.torch, self.fi = torch, flashinfer
        spec = CacheSpec(windows=WINDOWS, sink_tokens=SINKS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                         tokens_per_block=TPB, max_seq_len=320, max_batch=5, slots_per_group=128,
                         swa_scratch_reuse=scratch, max_step_tokens=256, null_slot=scratch)
        self.mgr = cupykv.KVCacheManager(spec, backend="cuda")
        try:
            self.storage = KVStorage(self.mgr)
        except StorageDtypeError as exc:
            pytest.skip(f"{dtype} storage is not available here: {exc}")
        self.lay = self.mgr.layout
        self.lists = lists
        self.tdtype = getattr(torch, dtype)
        self.atol = ATOL[dtype]
        self.ts = torch.cuda.Stream()
        # written only on ts (KVStorage.write(stream=ts)): no event needed to read them there
        self.pages = [interop.pages_to_torch(self.storage, g, None, self.ts) for g in range(self.lay.num_groups)]

        def workspace():
            return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
        self.sink_decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="fa2")
        self.K, self.V = {}, {}            # (layer, rid) -> float32 [max_seq_len, H, D]: what was written
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(1234)
        self.worst = 0.0
        self.seen = dict(checks=0, prefill=0, decode=0, group_plans=0, group_reuse=0, layer_plans=0,
                         released_lists=0, sink_released=0, sinks_differ=0, sink_passes=0, scratch=0)

    # -- FlashInfer ------------------------------------------------------------------------------------
    def views(self, group, koff):
        """(K view, V view) for page indices p that address K at pages[p + koff] (V one page further)."""
        pages = self.pages[group]
        m = pages.shape[0] - 1 - koff
        return pages[koff:koff + m], pages[koff + 1:koff + 1 + m]

    def sublists(self, csr, lo, hi):
        """indptr, indices, last_page_len (torch, int32, on ts after csr.ready) of batch entries [lo, hi)."""
        ts = self.ts
        ip = csr.indptr_host
        indptr = interop.to_torch(csr.kv_indptr, csr, ts)
        indices = interop.to_torch(csr.kv_indices, csr, ts)
        last = interop.to_torch(csr.kv_last_page_len, csr, ts)
        return ((indptr[lo:hi + 1] - indptr[lo]).contiguous(), indices[int(ip[lo]):int(ip[hi])].contiguous(),
                last[lo:hi].contiguous())

    def plan(self, csr, step, window_left):
        """Plan the prefill wrapper for the contexts and the decode wrapper for the generation entries."""
        torch = self.torch
        C, n = step.num_contexts, step.num_seqs
        common = dict(q_data_type=self.tdtype, kv_data_type=self.tdtype)
        if C:
            qo = np.concatenate(([0], np.cumsum(step.num_tokens[:C]))).astype(np.int32)
            indptr, indices, last = self.sublists(csr, 0, C)
            self.prefill.plan(torch.from_numpy(qo).cuda(), indptr, indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, TPB,
                              causal=True, window_left=window_left, **common)
        if n > C:
            indptr, indices, last = self.sublists(csr, C, n)
            self.decode.plan(indptr, indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, TPB, window_left=window_left,
                             **common)

    def attend(self, step, q, group, koff):
        torch = self.torch
        C, n = step.num_contexts, step.num_seqs
        tc = int(np.sum(step.num_tokens[:C]))
        kv = self.views(group, koff)
        parts = []
        if C:
            parts.append(self.prefill.run(q[:tc], kv))
            self.seen["prefill"] += 1
        if n > C:
            parts.append(self.decode.run(q[tc:], kv))
            self.seen["decode"] += 1
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    # -- one step ----------------------------------------------------------------------------------------
    def step(self, ctx, dec, expected_starts):
        torch, mgr, lay, ts = self.torch, self.mgr, self.lay, self.ts
        step = mgr.prepare_batch(ctx, dec)
        assert step.start_positions.tolist() == expected_starts, "the manager's positions differ from the test's"
        C, n, T = step.num_contexts, step.num_seqs, step.total_tokens
        cu = np.concatenate(([0], np.cumsum(step.num_tokens)))
        lens = step.start_positions + step.num_tokens
        with torch.cuda.stream(ts):
            for g in lay.groups:
                scratch = bool(C) and bool((step.scratch_ends[g.index, :C] > step.scratch_begs[g.index, :C]).any())
                self.seen["scratch"] += scratch
                window_left = -1 if g.window is None else g.window - 1
                group_csr = csr_views(step, g.index) if self.lists == "group" and not scratch else None
                if group_csr is not None:
                    self.plan(group_csr, step, window_left)
                    self.seen["group_plans"] += 1
                for i, layer in enumerate(g.layers):
                    q = torch.randn(T, Q_HEADS, HEAD_DIM, generator=self.gen, device="cuda").to(self.tdtype)
                    k = torch.randn(T, KV_HEADS, HEAD_DIM, generator=self.gen, device="cuda").to(self.tdtype)
                    v = torch.randn(T, KV_HEADS, HEAD_DIM, generator=self.gen, device="cuda").to(self.tdtype)
                    self.storage.write(step, layer, k, v, stream=ts)
                    for s, rid in enumerate(step.request_ids):
                        if (layer, rid) not in self.K:
                            shape = (mgr.spec.max_seq_len, KV_HEADS, HEAD_DIM)
                            self.K[layer, rid] = torch.zeros(shape, device="cuda")
                            self.V[layer, rid] = torch.zeros(shape, device="cuda")
                        p0 = int(step.start_positions[s])
                        self.K[layer, rid][p0:int(lens[s])] = k[cu[s]:cu[s + 1]].float()
                        self.V[layer, rid][p0:int(lens[s])] = v[cu[s]:cu[s + 1]].float()
                    if group_csr is not None:
                        csr, koff = group_csr, int(lay.layer_koff[layer])
                        self.seen["group_reuse"] += i > 0
                    else:
                        csr, koff = csr_views(step, layer=layer), 0
                        self.plan(csr, step, window_left)
                        self.seen["layer_plans"] += 1
                    out = self.attend(step, q, g.index, koff)
                    self.check(step, layer, g, q, out, csr, cu, lens)
                    if g.sink_tokens and n > C:
                        self.check_sink_pass(step, layer, g, q, csr, koff, cu)
            interop.finish_on_torch(step, ts)
        return step

    def check(self, step, layer, g, q, out, csr, cu, lens):
        torch = self.torch
        listed = np.diff(csr.indptr_host)
        for s, rid in enumerate(step.request_ids):
            n = int(lens[s])
            pos = torch.arange(int(step.start_positions[s]), n, device="cuda")
            k, v = self.K[layer, rid][:n], self.V[layer, rid][:n]
            qs = q[cu[s]:cu[s + 1]].float()
            want = dense_attention(torch, qs, k, v, keys_allowed(torch, pos, n, g.window, 0))
            got = out[cu[s]:cu[s + 1]].float()
            err = float((got - want).abs().max())
            self.worst = max(self.worst, err)
            kind = "context" if s < step.num_contexts else "decode"
            assert err <= self.atol, (f"step {step.id} layer {layer} entry {s} ({kind}, positions {int(pos[0])}.."
                                      f"{n - 1}, window {g.window}): max error {err:.4g} > {self.atol}")
            self.seen["checks"] += 1
            if listed[s] < -(-n // TPB):                   # the released prefix is left out of the list
                self.seen["sink_released" if g.sink_tokens else "released_lists"] += 1
            if g.sink_tokens and int(pos[0]) - g.window + 1 > 0:
                with_sinks = dense_attention(torch, qs, k, v, keys_allowed(torch, pos, n, g.window, g.sink_tokens))
                self.seen["sinks_differ"] += float((got - with_sinks).abs().max()) > 5 * self.atol

    def check_sink_pass(self, step, layer, g, q, csr, koff, cu):
        """The sinks' own pass for the decode entries whose sinks lie before the window."""
        torch = self.torch
        ip = csr.indptr_host
        indices = interop.to_torch(csr.kv_indices, csr, self.ts)
        rows, counts, pieces, last = [], [], [], []
        for s in range(step.num_contexts, step.num_seqs):
            n_sink = min(g.sink_tokens, int(step.start_positions[s]) - g.window + 1)
            if n_sink <= 0:
                continue
            npages = -(-n_sink // TPB)
            rows.append(s)
            counts.append(npages)
            pieces.append(indices[int(ip[s]):int(ip[s]) + npages])
            last.append(n_sink - (npages - 1) * TPB)
        if not rows:
            return
        indptr = torch.tensor(np.concatenate(([0], np.cumsum(counts))), dtype=torch.int32, device="cuda")
        last_t = torch.tensor(last, dtype=torch.int32, device="cuda")
        self.sink_decode.plan(indptr, torch.cat(pieces).contiguous(), last_t, Q_HEADS, KV_HEADS, HEAD_DIM, TPB,
                              window_left=-1, q_data_type=self.tdtype, kv_data_type=self.tdtype)
        qs = torch.cat([q[cu[s]:cu[s + 1]] for s in rows])
        got = self.sink_decode.run(qs, self.views(g.index, koff)).float()
        for i, s in enumerate(rows):
            rid, n_sink = step.request_ids[s], (int(counts[i]) - 1) * TPB + int(last[i])
            k, v = self.K[layer, rid][:n_sink], self.V[layer, rid][:n_sink]
            allowed = torch.ones(1, n_sink, dtype=torch.bool, device="cuda")
            want = dense_attention(torch, qs[i:i + 1].float(), k, v, allowed)
            err = float((got[i:i + 1] - want).abs().max())
            assert err <= self.atol, f"step {step.id} layer {layer} entry {s}: sink pass max error {err:.4g}"
            self.seen["sink_passes"] += 1


def run_workload(cons: Consumer):
    mgr = cons.mgr
    prompts, todo, sched, made = {}, {}, {}, {}
    arrivals = list(ARRIVALS)
    it = 0
    while arrivals or prompts:
        while arrivals and arrivals[0][0] <= it:
            _, prompt, gen = arrivals.pop(0)
            rid = f"r{len(made)}"
            made[rid] = True
            prompts[rid], todo[rid], sched[rid] = prompt, gen, 0
            mgr.add(rid, prompt)
        it += 1
        ctx = {r: min(CHUNK, prompts[r] - sched[r]) for r in prompts if sched[r] < prompts[r]}
        ctx = dict(list(ctx.items())[:2])
        dec = [r for r in prompts if sched[r] >= prompts[r]]
        if not ctx and not dec:
            continue
        starts = [sched[r] for r in ctx] + [sched[r] for r in dec]
        step = cons.step(ctx, dec, starts)
        mgr.settle(step)
        for r, n in ctx.items():
            sched[r] += n
        for r in dec:
            sched[r] += 1
            todo[r] -= 1
            if todo[r] == 0:
                mgr.free(r)
                del prompts[r], todo[r], sched[r]
        assert it < 200, "the workload does not finish"
    mgr.synchronize()


@pytest.mark.parametrize("lists", ["layer", "group"])
@pytest.mark.parametrize("scratch", [False, True], ids=["scratch_off", "scratch_on+null_slot"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flashinfer_matches_dense_attention(dtype, scratch, lists):
    torch, flashinfer = flashinfer_or_skip()
    cons = Consumer(torch, flashinfer, dtype, scratch, lists)
    run_workload(cons)
    seen = cons.seen
    print(f"flashinfer {flashinfer.__version__} {dtype} scratch={scratch} lists={lists}: {seen}, "
          f"worst error {cons.worst:.3g}")
    assert seen["checks"] > 300 and seen["prefill"] > 20 and seen["decode"] > 100
    assert seen["released_lists"] > 0, "no list left out a released prefix (window without sinks)"
    assert seen["sink_released"] > 0, "no sink-group list left out a released block"
    assert seen["sinks_differ"] > 0, "window-only and window-plus-sinks attention never differed"
    assert seen["sink_passes"] > 20
    if scratch:
        assert seen["scratch"] > 0, "the workload never used scratch blocks"
    if lists == "group":
        assert seen["group_plans"] > 0 and seen["group_reuse"] > 0
    else:
        assert seen["group_plans"] == 0
