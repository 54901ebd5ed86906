"""The attention function transformers calls for every layer ("cupykv"): write the layer's new K/V at the
step's write positions, then attend over each sequence's visible pages.

A step's tokens travel as one packed sequence (`input_ids [1, total_tokens]`, entry after entry, with each
token's position in `position_ids`), and the step itself as the keyword argument `cupykv_batch` (a
PagedBatch), which transformers passes through the model to this function. The function:

    k, v [1, kv_heads, T, head_dim] -> pages[write_pages[layer]], pages[write_pages[layer] + 1] at write_offsets
    for each entry e: the keys it can see, (p - W, p] of a query at p (all of [0, p] without a window),
                      gathered block by block through step.tables[layer, e] -> softmax(q k^T * scaling) v

honouring grouped-query heads, logit soft-capping (Gemma 2: tanh(s / c) * c before the mask) and learned
sinks (GPT-OSS's `s_aux`: one logit per query head that joins each row's softmax and has no value). The
arithmetic follows transformers' eager attention (products in the model's dtype, softmax in float32), so
greedy tokens match `model.generate` exactly in float32.

Two paths compute it. "triton" (the default on CUDA, triton_attention.py): one kernel for every feature,
over the step's tables in place. "torch" (the CPU path, and the reference the kernel is tested against):
context chunks one entry at a time, decode entries (one token each) all at once over the blocks each can
see. Every tensor here is a torch tensor over cupykv's buffers (cupykv.interop), ordered after the step's
`ready` on torch's current stream.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from .. import interop
from ..errors import InvalidRequestError
from .config import UnsupportedModelError

NAME = "cupykv"


class PagedBatch:
    """One step as the attention function sees it: torch views of the step's tables, write positions and
    the KV pages of every group, and the packed tokens' layout (host arrays: cu_tokens [num_seqs + 1],
    start positions [num_seqs]).

    Build it after prepare_batch and before the forward; call `finish()` after the forward (the step's
    buffers may be reused by the next prepare_batch once its finish has run on the device).
    attention: "torch" or "triton" (the path that computes attention; see the module's docstring)."""

    def __init__(self, step, storage, attention: str = "torch"):
        import torch
        self.torch = torch
        self.step, self.storage = step, storage
        layout = step.layout
        self.layer_group = [int(g) for g in layout.layer_group]
        self.windows = list(layout.spec.windows)
        self.tpb = layout.tpb
        if layout.spec.table_mode != "per_layer":   # SHARED tables have no row per layer
            raise UnsupportedModelError("the transformers backend needs table_mode='per_layer'")
        self.tables = interop.tables_to_torch(step)                  # int32 [L, max_batch, 2, B]
        self.write_pages, self.write_offsets = interop.write_positions_to_torch(step)
        self.write_pages, self.write_offsets = self.write_pages.long(), self.write_offsets.long()
        self.pages = [interop.pages_to_torch(storage, g) for g in range(storage.num_groups)]
        self.cu = step.cu_tokens()
        self.starts = step.start_positions.astype(np.int64)
        self.total = int(self.cu[-1])
        self.layers_seen: List[int] = []
        self.fast, self.num_loop = None, step.num_seqs
        if attention == "triton":
            from .triton_attention import TritonAttention
            self.fast = TritonAttention(torch, self.tables.device, self.cu, self.starts, step.num_contexts)
        elif attention != "torch":
            raise InvalidRequestError(f"attention={attention!r}: 'torch' or 'triton'")
        else:
            # Decode entries of one token each are attended all at once (attend_decode): their positions and
            # entries on the model's device, once for every layer (the torch path only).
            n = step.num_tokens[step.num_contexts:]
            if len(n) and (n == 1).all():
                device = self.tables.device
                self.num_loop = step.num_contexts
                self.decode_starts = torch.from_numpy(self.starts[step.num_contexts:]).to(device)
                self.decode_entries = torch.arange(step.num_contexts, step.num_seqs, device=device)

    @classmethod
    def probe(cls, spec) -> "PagedBatch":
        """A batch of one token that touches no cache: a forward with it checks that every layer calls the
        cupykv attention with the window the spec has for it (Engine does this before serving)."""
        import torch
        batch = cls.__new__(cls)
        batch.torch, batch.step, batch.storage = torch, None, None
        from ..layout import Layout
        layout = Layout(spec)
        batch.layer_group = [int(g) for g in layout.layer_group]
        batch.windows, batch.tpb = list(spec.windows), layout.tpb
        batch.cu, batch.starts, batch.total = np.array([0, 1]), np.array([0]), 1
        batch.layers_seen, batch.num_loop, batch.fast = [], 1, None
        return batch

    def finish(self) -> None:
        """The forward is enqueued: record the step's finish on torch's current stream."""
        interop.finish_on_torch(self.step)

    # -- one layer ----------------------------------------------------------------------------------
    def write(self, layer: int, key, value) -> None:
        """key, value [1, kv_heads, T, head_dim] -> the layer's pages at the step's write positions."""
        pages = self.pages[self.layer_group[layer]]
        wp, wo = self.write_pages[layer], self.write_offsets
        k = key[0].transpose(0, 1).to(pages.dtype)                  # [T, kv_heads, head_dim] (a strided view)
        v = value[0].transpose(0, 1).to(pages.dtype)
        pages[wp, wo] = k
        pages[wp + 1, wo] = v

    def attend(self, layer: int, query, scaling: float, softcap: Optional[float], sinks) -> "object":
        """query [1, q_heads, T, head_dim] -> [1, T, q_heads, head_dim] over the visible pages."""
        torch = self.torch
        pages = self.pages[self.layer_group[layer]]
        window = self.windows[layer]
        table = self.tables[layer]
        q_heads, kv_heads = query.shape[1], pages.shape[2]
        group = q_heads // kv_heads
        out = query.new_empty((1, self.total, q_heads, query.shape[3]))
        if self.fast is not None:
            self.fast(query[0].transpose(0, 1), pages, table, out[0], window=window, scaling=scaling,
                      softcap=softcap, sinks=sinks)
            return out
        tpb = self.tpb
        if self.num_loop < len(self.starts):
            c0 = int(self.cu[self.num_loop])
            self.attend_decode(layer, query[0, :, c0:].transpose(0, 1), scaling, softcap, sinks, out[0, c0:])
        for e in range(self.num_loop):
            c0, c1, start = int(self.cu[e]), int(self.cu[e + 1]), int(self.starts[e])
            if c1 == c0:
                continue
            end = start + (c1 - c0)                       # keys [lo, end) are visible to some query
            lo = 0 if window is None else max(0, start - window + 1)
            b0, b1 = lo // tpb, -(-end // tpb)
            k_pages = table[e, 0, b0:b1].long()
            v_pages = table[e, 1, b0:b1].long()
            k = pages[k_pages].flatten(0, 1)[lo - b0 * tpb:end - b0 * tpb]      # [keys, kv_heads, head_dim]
            v = pages[v_pages].flatten(0, 1)[lo - b0 * tpb:end - b0 * tpb]
            k = k.to(query.dtype).transpose(0, 1).repeat_interleave(group, dim=0)      # [q_heads, keys, d]
            v = v.to(query.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            q = query[0, :, c0:c1]                                                # [q_heads, n, d]
            scores = torch.matmul(q, k.transpose(1, 2)) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            qpos = torch.arange(start, end, device=q.device)[:, None]
            kpos = torch.arange(lo, end, device=q.device)[None, :]
            hidden = kpos > qpos
            if window is not None:
                hidden |= kpos <= qpos - window
            scores = scores.masked_fill(hidden, float("-inf"))
            if sinks is not None:
                sink = sinks.reshape(-1, 1, 1).expand(-1, c1 - c0, 1).to(scores.dtype)
                scores = torch.cat((scores, sink), dim=-1)
                scores = scores - scores.max(dim=-1, keepdim=True).values
                probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype)
            else:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
            out[0, c0:c1] = torch.matmul(probs, v).transpose(0, 1)
        return out


    def attend_decode(self, layer: int, q, scaling: float, softcap: Optional[float], sinks, out,
                      budget: int = 1 << 26) -> None:
        """The decode entries (one token each) at once: q [m, q_heads, head_dim] -> out [m, q_heads,
        head_dim]. Each entry gathers the blocks its query can see (the window's, or all up to the longest
        sequence) through its table row; positions outside (p - W, p] or past p are masked. Entries go in
        chunks of at most `budget` gathered K elements."""
        torch = self.torch
        pages = self.pages[self.layer_group[layer]]
        window, tpb, table = self.windows[layer], self.tpb, self.tables[layer]
        m, q_heads, d = q.shape
        kv_heads = pages.shape[2]
        starts_host = self.starts[self.num_loop:]
        if window is None:
            span = -(-(int(starts_host.max()) + 1) // tpb)
        else:
            span = -(-window // tpb) + 1
        span = min(span, table.shape[-1])
        step = max(1, budget // (span * tpb * kv_heads * d))
        offsets = torch.arange(span, device=q.device)
        within = torch.arange(tpb, device=q.device)
        for a in range(0, m, step):
            b = min(m, a + step)
            starts = self.decode_starts[a:b]
            first = (starts - window + 1).clamp(min=0) // tpb if window is not None else torch.zeros_like(starts)
            wanted = first[:, None] + offsets                                              # [n, span]
            # Near the table's end the span runs past it: those columns read the last block (any valid
            # index) and are masked by position (kpos from `wanted` is past every query), not counted twice.
            blocks = wanted.clamp(max=table.shape[-1] - 1)
            rows = self.decode_entries[a:b, None]
            k_pages, v_pages = table[rows, 0, blocks].long(), table[rows, 1, blocks].long()
            kpos = (wanted[:, :, None] * tpb + within).flatten(1)                          # [n, span * tpb]
            visible = (kpos <= starts[:, None]) & (k_pages >= 0).repeat_interleave(tpb, dim=1)
            if window is not None:
                visible &= kpos > starts[:, None] - window
            k = pages[k_pages.clamp(min=0)].flatten(1, 2).to(q.dtype)                     # [n, keys, kv_heads, d]
            v = pages[v_pages.clamp(min=0)].flatten(1, 2).to(q.dtype)
            qg = q[a:b].reshape(b - a, kv_heads, q_heads // kv_heads, d)
            scores = torch.einsum("nhgd,nkhd->nhgk", qg, k) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
            if sinks is not None:
                sink = sinks.reshape(1, kv_heads, -1, 1).expand(b - a, -1, -1, 1).to(scores.dtype)
                scores = torch.cat((scores, sink), dim=-1)
                scores = scores - scores.max(dim=-1, keepdim=True).values
                probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype)
            else:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
            out[a:b] = torch.einsum("nhgk,nkhd->nhgd", probs, v).reshape(b - a, q_heads, d)


def cupykv_attention(module, query, key, value, attention_mask, scaling: Optional[float] = None,
                     dropout: float = 0.0, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                     s_aux=None, cupykv_batch: Optional[PagedBatch] = None, **kwargs):
    """transformers' attention interface: (attn_output [batch, T, q_heads, head_dim], None)."""
    batch = cupykv_batch
    if batch is None:
        raise InvalidRequestError("the 'cupykv' attention needs the step: run the model through "
                                  "cupykv.hf.Engine (or pass cupykv_batch=PagedBatch(step, storage) to its forward)")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UnsupportedModelError(f"{type(module).__name__} has no layer_idx: cupykv cannot tell which layer "
                                    "this attention serves")
    if query.shape[0] != 1 or query.shape[2] != batch.total:
        raise InvalidRequestError(f"layer {layer}: query {tuple(query.shape)}; the cupykv attention takes one packed "
                                  f"sequence of the step's {batch.total} tokens ([1, heads, {batch.total}, head_dim])")
    if sliding_window != batch.windows[layer] and not (sliding_window is None and batch.windows[layer] is None):
        raise UnsupportedModelError(f"layer {layer}: the model attends with sliding_window={sliding_window}, the "
                                    f"cache was built for window {batch.windows[layer]} (spec_from_config)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    batch.layers_seen.append(layer)
    if batch.step is None:                  # PagedBatch.probe
        return query.new_zeros((1, 1, query.shape[1], query.shape[3])), None
    batch.write(layer, key, value)
    return batch.attend(layer, query, scaling, softcap, s_aux), None


def register() -> None:
    """Register the function with transformers as attn_implementation="cupykv" (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, cupykv_attention)
