"""The serving loop of examples/cupy_decode.py with attention in torch, on torch's own stream.

cupykv builds the tables on its manager stream; torch gets them, the write positions and the KV pages
through DLPack (zero-copy), and its stream waits on the step's ready event explicitly
(cupykv.interop). Per layer, in order: torch writes the layer's new K/V at the write positions, gathers
the pages of each sequence through the layer's table, and runs scaled_dot_product_attention with the
window mask. The output is compared with the dense reference attention; the consumer's finish is
recorded on torch's stream (finish_on_torch), so the next step's tables wait for it.

Needs torch; without it, it says so and exits 0 (skipped). Without a GPU that CuPy and torch both see,
the default (--backend auto) runs the same loop on the CPU (host backend, CPU tensors), as --backend host
does; --backend cuda then fails.

    python examples/torch_attention.py [--backend auto|cuda|host]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupykv                                                                  # noqa: E402
from cupykv import interop                                                     # noqa: E402
from cupykv.storage import KVStorage                                           # noqa: E402
from cupy_decode import COMMON, MODELS, Q_HEADS, Workload, dense_reference, gen_qkv   # noqa: E402

ATOL = 1e-3
BAD = -1


def run_model(torch, name, windows, backend):
    F = torch.nn.functional
    spec = cupykv.CacheSpec(windows=windows, **COMMON)
    mgr = cupykv.KVCacheManager(spec, backend=backend)
    storage = KVStorage(mgr)
    lay = mgr.layout
    H, D, tpb = spec.num_kv_heads, spec.head_dim, lay.tpb
    cuda = backend == "cuda"
    device = torch.device("cuda") if cuda else torch.device("cpu")
    ts = torch.cuda.Stream() if cuda else None
    ctx_stream = (lambda: torch.cuda.stream(ts)) if cuda else contextlib.nullcontext
    # the storage is written only by torch, on ts: no event needed to export it
    pages = [interop.pages_to_torch(storage, g, None, ts) for g in range(lay.num_groups)]
    assert all(p.data_ptr() == (storage.pages(g).data.ptr if cuda else storage.pages(g).ctypes.data)
               for g, p in enumerate(pages)), "pages are not zero-copy"
    wl = Workload(mgr)
    worst, bad, steps, tokens, it = 0.0, 0, 0, 0, 0
    while not wl.done():
        ctx, gen = wl.plan(it)
        it += 1
        if not ctx and not gen:
            continue
        step = mgr.prepare_batch(ctx, gen)
        ent, seeds, pos = wl.scheduled(step)
        tables = interop.tables_to_torch(step, ts)               # ts waits on step.ready
        wp, wo = interop.write_positions_to_torch(step, ts)
        outs = []
        with ctx_stream():
            wo_l = wo.long()
            cu = np.concatenate(([0], np.cumsum(step.num_tokens)))
            pos_t = torch.as_tensor(pos, dtype=torch.long, device=device)
            bad_t = torch.zeros((), dtype=torch.long, device=device)
            for layer in range(lay.num_layers):
                window = windows[layer]
                P = pages[int(lay.layer_group[layer])]
                q, k, v = (torch.from_numpy(a).to(device) for a in gen_qkv(np, layer, seeds, pos, H, D))
                kp = wp[layer].long()
                P[kp, wo_l] = k                                   # K at its page, V at page + 1
                P[kp + 1, wo_l] = v
                out = torch.empty_like(q)
                for s in range(step.num_seqs):
                    lo, hi = int(cu[s]), int(cu[s + 1])
                    qp = pos_t[lo:hi]
                    nb = (int(pos[hi - 1]) + tpb) // tpb            # blocks up to the last new token
                    kpage = tables[layer, s, 0, :nb].long()
                    vpage = tables[layer, s, 1, :nb].long()
                    key_pos = torch.arange(nb * tpb, device=device)
                    vis = key_pos[None, :] <= qp[:, None]
                    if window is not None:
                        vis &= key_pos[None, :] > qp[:, None] - window
                    no_page = (kpage < 0).repeat_interleave(tpb)[None, :] | (vpage < 0).repeat_interleave(tpb)[None, :]
                    bad_t += (vis & no_page).sum()                  # an in-window key without a page is a bug
                    mask = vis & ~no_page
                    K = P[kpage.clamp(min=0)].reshape(nb * tpb, H, D)
                    V = P[vpage.clamp(min=0)].reshape(nb * tpb, H, D)
                    rep = Q_HEADS // H
                    Kh = K.repeat_interleave(rep, dim=1).transpose(0, 1)[None]   # [1, Hq, nk, D]
                    Vh = V.repeat_interleave(rep, dim=1).transpose(0, 1)[None]
                    Qh = q[lo:hi].transpose(0, 1)[None]                         # [1, Hq, nq, D]
                    o = F.scaled_dot_product_attention(Qh, Kh, Vh, attn_mask=mask[None, None])
                    out[lo:hi] = o[0].transpose(0, 1)
                outs.append(out)
            host_outs = [o.cpu().numpy() for o in outs]         # on ts: ordered after the attention
            bad += int(bad_t.item())
        interop.finish_on_torch(step, ts)                       # the consumer's last read, on ts
        for layer, out in enumerate(host_outs):
            for t in range(len(pos)):
                ref = dense_reference(layer, int(seeds[t]), int(pos[t]), windows[layer], H, D)
                err = np.nan_to_num(np.abs(out[t] - ref), nan=np.inf)      # a NaN is a failure
                worst = max(worst, float(err.max()))
        mgr.settle(step)
        wl.settled(step)
        steps += 1
        tokens += len(pos)
    mgr.reclaim(wait=True)
    ok = worst <= ATOL and bad == 0
    print(f"{name}: {steps} steps, {tokens} tokens x {len(windows)} layers; max |torch sdpa - dense| = "
          f"{worst:.2e} (tol {ATOL:.0e}); in-window keys without a page: {bad} -> {'OK' if ok else 'FAILED'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch_attention: SKIPPED: torch is not installed (pip install torch); "
              "examples/cupy_decode.py runs without it")
        return 0
    backend = args.backend
    if backend in ("auto", "cuda"):
        if not (cupykv.cuda_available() and torch.cuda.is_available()):
            why = "CuPy sees no GPU" if not cupykv.cuda_available() else "this torch build has no CUDA"
            if backend == "cuda":
                print(f"torch_attention: FAILED: --backend cuda needs a GPU with CuPy and CUDA torch ({why})")
                return 1
            print(f"torch_attention: no GPU with CuPy and CUDA torch ({why}): the host backend and CPU tensors")
            backend = "host"
        else:
            backend = "cuda"
            torch.backends.cuda.matmul.allow_tf32 = False
    print(f"torch_attention: backend={backend}, torch {torch.__version__}; attention = torch "
          f"scaled_dot_product_attention on {'its own CUDA stream' if backend == 'cuda' else 'the CPU'}")
    t0 = time.perf_counter()
    ok = all([run_model(torch, name, m["windows"], backend) for name, m in MODELS.items()])
    print(f"checked: torch reads tables, write positions and pages through DLPack (zero-copy) after an explicit "
          f"wait on step.ready, writes K/V, and its attention == dense reference; finish recorded on torch's "
          f"stream; {time.perf_counter() - t0:.1f} s -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
