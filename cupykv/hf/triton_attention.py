"""The fast attention path on CUDA: one Triton kernel that reads a layer's KV pages through cupykv's table.

Every feature the transformers backend serves runs in this one kernel: sliding windows (a query at p sees
keys (p - W, p]), grouped-query heads, logit soft-capping (Gemma 2) and learned sinks (GPT-OSS's `s_aux`).
FlashInfer's paged wrappers express the window (`window_left = W - 1`) and soft-capping but not learned
sink logits, and they compile each variant on first use; one kernel of our own keeps every model on the same
path. The torch path in attention.py is the reference it is tested against.

A launch covers tiles of query tokens: a tile is up to BLOCK_T consecutive tokens of one entry (one token
for a decode entry), and a program serves one (tile, kv head) pair, its GROUP query heads stacked with the
tile's tokens into BLOCK_M rows:

    row r = token (r // GROUP) of the tile, query head kv_head * GROUP + r % GROUP
    for key blocks of BLOCK_N positions from the first one a row of the tile can see to the tile's last:
        page = table[entry, 0 (K) or 1 (V), position // TPB]; the key at pages[page, position % TPB, kv_head]
        scores = q k^T * scaling (soft-capped) masked to (p - W, p]; an online softmax in float32 whose
        running maximum and sum start at the row's sink logit (max = sink, sum = 1) when there are sinks

Scores and the softmax are float32 (transformers' eager path rounds the products to the model's dtype first:
in float32 the two agree to rounding, which is what the token-exact tests check).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np


def kernel():
    """The kernel, imported on first use (triton compiles it, or interprets it when TRITON_INTERPRET=1 was
    set before triton was first imported)."""
    from .triton_kernel import paged_attention
    return paged_attention


def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def tiles_of(cu: np.ndarray, starts: np.ndarray, entries: range, block_t: int) -> np.ndarray:
    """int32 [num_tiles, 4] (entry, first token, tokens, first position): each entry's tokens cut into
    tiles of at most block_t."""
    rows = []
    for e in entries:
        c0, c1, p = int(cu[e]), int(cu[e + 1]), int(starts[e])
        for a in range(c0, c1, block_t):
            rows.append((e, a, min(block_t, c1 - a), p + a - c0))
    return np.asarray(rows, np.int32).reshape(-1, 4)


class TritonAttention:
    """The kernel's launches for one step: the tiles (uploaded once, used by every layer) and the block
    sizes for the model's head size and grouping.

    cu [num_seqs + 1] and starts [num_seqs] (host arrays): the step's packed-token layout; decode entries
    (one token each) come after num_contexts context entries and get one-token tiles."""

    def __init__(self, torch, device, cu: np.ndarray, starts: np.ndarray, num_contexts: int):
        self.torch, self.device = torch, device
        self._cu, self._starts, self._num_contexts = cu, starts, num_contexts
        self._uploaded = {}                 # (block_t, first entry, end entry) -> tiles on the device

    def _tiles(self, block_t: int, entries: range):
        key = (block_t, entries.start, entries.stop)
        if key not in self._uploaded:
            t = tiles_of(self._cu, self._starts, entries, block_t)
            self._uploaded[key] = self.torch.from_numpy(t).to(self.device) if len(t) else None
        return self._uploaded[key]

    def __call__(self, q, pages, table, out, *, window: Optional[int], scaling: float,
                 softcap: Optional[float], sinks) -> None:
        """q [T, q_heads, D] -> out [T, q_heads, D] (any strides with a unit last one); pages [num_pages,
        TPB, kv_heads, D] of the layer's group; table int32 [max_batch, 2, blocks] (the layer's K and V
        pages per entry); sinks [q_heads] or None."""
        torch = self.torch
        T, q_heads, D = q.shape
        kv_heads, tpb = pages.shape[2], pages.shape[1]
        group = q_heads // kv_heads
        if D != _pow2(D):
            raise ValueError(f"head_dim {D}: the Triton path needs a power of two")
        block_n = 64 if D <= 128 else 32
        ieee = q.dtype == torch.float32
        if sinks is not None:
            sinks = sinks.float().contiguous()
        nc = self._num_contexts
        parts = []
        if nc:
            m_ctx = 64 if D <= 128 else 32
            parts.append((max(1, m_ctx // group), range(0, nc)))
        if len(self._starts) > nc:
            parts.append((1, range(nc, len(self._starts))))
        fn = kernel()
        for block_t, entries in parts:
            tiles = self._tiles(block_t, entries)
            if tiles is None:
                continue
            block_m = max(16, _pow2(block_t * group))
            fn[(tiles.shape[0], kv_heads)](
                q, out, pages, table, tiles, sinks if sinks is not None else q,
                float(scaling), float(softcap or 1.0), int(window or 0),
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                pages.stride(0), pages.stride(1), pages.stride(2), table.stride(0), table.stride(1),
                GROUP=group, BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_N=block_n, D=D, TPB=tpb,
                HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None,
                IEEE=ieee, FOR_LOOP=not _interpreted(fn), num_warps=4 if D <= 128 else 8)


def available(device) -> bool:
    """Whether the Triton path can run for tensors on `device` (CUDA with triton installed, or any device
    under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
