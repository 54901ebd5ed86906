"""Contender 2 of the benchmark: the usual race fix, "a fresh full snapshot every step", in torch.

This re-implements the per-layer SWA path of the reference system after its race fix (see
shared/notes/reference-systems.md): every step it copies copy_idx, the WHOLE host page table and the
scratch metadata (padded to the staging capacity) into fresh pinned tensors, ships them to the device
with non-blocking copies on the current torch stream, runs the conversion of docs/design.md's
"The conversion contract" with
torch ops over the whole staging capacity into a full [L, capacity, 2, B] output, and copies the first
num_seqs rows into the attention buffer.

The fresh pinned tensors are what makes it race-free: torch's caching pinned allocator does not hand a
block out again until the copies that read it have completed, so the host may rewrite its own buffers
as soon as step() returns. The price is a full host-table copy per step, whatever changed.

torch is imported lazily: this module imports without torch; using it without torch raises
TorchUnavailableError (an ImportError).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import CupykvError
from ..layout import BAD

__all__ = ["BAD", "FullSnapshotPath", "TorchUnavailableError", "convert_snapshot", "require_torch"]


class TorchUnavailableError(CupykvError, ImportError):
    """torch is needed for the snapshot-path contender and is not installed."""


def require_torch(who: str = "cupykv.bench.snapshot_path",
                  what: str = "the contender is a torch re-implementation of the reference system's snapshot path"):
    """The torch module, or TorchUnavailableError naming `who` needs it and why (`what`)."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TorchUnavailableError(
            f"{who} needs PyTorch ({what}); install torch to use it. The rest of cupykv does not need "
            f"torch. (import torch failed: {exc})") from exc
    return torch


def convert_snapshot(table, copy_idx, begs, ends, slots, layer_group, group_scale, layer_off, out):
    """The PER_LAYER conversion (docs/design.md's "The conversion contract") over the whole staging capacity,
    in torch ops.

    table: [P, rows, B] int32; copy_idx: [C] int32 (table row of each staging row); begs/ends: [P, C]
    int32 (begs == ends == 0 for rows that are not contexts); slots: [P, C, W] int32 scratch slot ids;
    layer_group: [L] int64; group_scale: [P] int32; layer_off: [L, 2] int32 (K and V offset of each
    layer inside its group's slot); out: [L, C, 2, B] int32, overwritten.

    Vectorized: no loop over sequences, groups or layers (layers are reached by indexing with
    layer_group). Page indices are computed in int32, like the output.
    """
    import torch

    P, _, B = table.shape
    W = slots.shape[2]
    L = layer_group.shape[0]
    # gather the batch's rows (staging row s -> table row copy_idx[s]), per group
    base = table.index_select(1, copy_idx)                              # [P, C, B]
    blk = torch.arange(B, device=table.device, dtype=torch.int32)
    beg = begs.unsqueeze(-1)                                            # [P, C, 1]
    in_scratch = (blk >= beg) & (blk < ends.unsqueeze(-1))              # [P, C, B]
    t = (blk - beg) * 2                                                 # [P, C, B]
    sg = group_scale.view(P, 1, 1)
    k = torch.clamp(torch.div(t, sg, rounding_mode="floor"), 0, W - 1)  # clamped where not scratch
    slot = torch.gather(slots, 2, k.long())                             # [P, C, B]
    t_mod = torch.remainder(t, sg)                                      # [P, C, B]
    # per layer, role: [L, C, 2, B]
    sl = group_scale.index_select(0, layer_group).view(L, 1, 1, 1)
    off = layer_off.view(L, 1, 2, 1)
    base_l = base.index_select(0, layer_group).unsqueeze(2)             # [L, C, 1, B]
    regular = torch.where(base_l == BAD, BAD, base_l * sl + off)
    scratch = (slot.index_select(0, layer_group).unsqueeze(2) * sl
               + torch.remainder(t_mod.index_select(0, layer_group).unsqueeze(2) + off, sl))
    res = torch.where(in_scratch.index_select(0, layer_group).unsqueeze(2), scratch, regular)
    out.copy_(res)
    return out


class FullSnapshotPath:
    """The reference system's per-layer path after its race fix, for the benchmark.

    num_layers, num_groups: L and P. rows: rows of the host page table. capacity: staging capacity
    (max batch). max_blocks: B. layer_group[L], layer_koff[L] (K offset of the layer inside its group's
    slot; V is K + 1), group_scale[P]: from cupykv.layout.Layout. max_scratch_width: M, the most scratch
    slots per (group, context). device: "cuda" (pinned snapshots) or "cpu" (plain host tensors).
    compile: wrap the conversion in torch.compile(dynamic=False).

    Buffers allocated once: the device staging buffers, the full output [L, capacity, 2, B] and the
    attention buffer [L, capacity, 2, B] (both start as BAD). step() returns a view of the attention
    buffer's first num_seqs rows (dim 1); rows beyond num_seqs keep what earlier steps wrote.
    """

    def __init__(self, num_layers: int, num_groups: int, rows: int, capacity: int, max_blocks: int,
                 layer_group, layer_koff, group_scale, max_scratch_width: int, device="cuda",
                 compile: bool = False):
        torch = require_torch()
        self._t = torch
        L, P = int(num_layers), int(num_groups)
        self.num_layers, self.num_groups = L, P
        self.rows, self.capacity, self.max_blocks = int(rows), int(capacity), int(max_blocks)
        self.max_scratch_width = int(max_scratch_width)
        for name in ("num_layers", "num_groups", "rows", "capacity", "max_blocks", "max_scratch_width"):
            if getattr(self, name) <= 0:
                raise ValueError(f"FullSnapshotPath: {name}={getattr(self, name)} must be > 0")
        lg = np.asarray(layer_group, np.int64).reshape(-1)
        koff = np.asarray(layer_koff, np.int32).reshape(-1)
        scale = np.asarray(group_scale, np.int32).reshape(-1)
        if lg.shape != (L,) or koff.shape != (L,) or scale.shape != (P,):
            raise ValueError(f"FullSnapshotPath: layer_group {lg.shape} and layer_koff {koff.shape} need "
                             f"({L},), group_scale {scale.shape} needs ({P},)")
        if lg.min() < 0 or lg.max() >= P or scale.min() <= 0:
            raise ValueError("FullSnapshotPath: layer_group must be in [0, num_groups), group_scale > 0")
        self.group_scale_np = scale
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        dev, i32 = self.device, torch.int32
        C, B, M, R = self.capacity, self.max_blocks, self.max_scratch_width, self.rows
        # constants
        self.layer_group = torch.as_tensor(lg, device=dev)
        self.group_scale = torch.as_tensor(scale, device=dev)
        self.layer_off = torch.as_tensor(np.stack([koff, koff + 1], axis=1).astype(np.int32), device=dev)
        # device staging buffers (fixed addresses; stale rows beyond num_seqs stay valid row ids)
        self.d_table = torch.zeros((P, R, B), dtype=i32, device=dev)
        self.d_copy_idx = torch.zeros((C,), dtype=i32, device=dev)
        self.d_begs = torch.zeros((P, C), dtype=i32, device=dev)
        self.d_ends = torch.zeros((P, C), dtype=i32, device=dev)
        self.d_slots = torch.zeros((P, C, M), dtype=i32, device=dev)
        # outputs
        self.full_out = torch.full((L, C, 2, B), BAD, dtype=i32, device=dev)
        self.attn = torch.full((L, C, 2, B), BAD, dtype=i32, device=dev)
        self.compiled = bool(compile)
        self._convert = torch.compile(convert_snapshot, dynamic=False) if compile else convert_snapshot
        self.h2d_bytes_last_step = 0

    # -- per step --------------------------------------------------------------------------------
    def _snapshot(self, arr: np.ndarray):
        """A fresh pinned (cuda) or plain (cpu) host tensor holding a copy of arr."""
        torch = self._t
        snap = torch.empty(arr.shape, dtype=torch.int32, pin_memory=self.pin)
        snap.copy_(torch.from_numpy(np.ascontiguousarray(arr) if arr.flags.writeable else arr.copy()))
        return snap

    def _snapshot_padded(self, arr: np.ndarray, shape):
        """A fresh pinned/plain tensor of `shape`, zero outside arr's leading corner."""
        torch = self._t
        snap = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin)
        snap.zero_()
        if arr.size:
            snap[tuple(slice(0, n) for n in arr.shape)].copy_(torch.from_numpy(arr))
        return snap

    def _check(self, host_table, copy_idx, num_contexts, begs, ends, scratch):
        P, R, B, C, M = self.num_groups, self.rows, self.max_blocks, self.capacity, self.max_scratch_width
        table = np.ascontiguousarray(host_table, dtype=np.int32)
        if table.shape != (P, R, B):
            raise ValueError(f"FullSnapshotPath.step: host_table shape {table.shape}, expected {(P, R, B)}")
        idx = np.ascontiguousarray(copy_idx, dtype=np.int32).reshape(-1)
        n = idx.shape[0]
        if n > C:
            raise ValueError(f"FullSnapshotPath.step: {n} sequences exceed capacity {C}")
        if n and (idx.min() < 0 or idx.max() >= R):
            raise ValueError(f"FullSnapshotPath.step: copy_idx must be in [0, {R})")
        nctx = int(num_contexts)
        if not 0 <= nctx <= n:
            raise ValueError(f"FullSnapshotPath.step: num_contexts={nctx} must be in [0, num_seqs={n}]")
        if nctx == 0:
            e2 = np.zeros((P, 0), np.int32)
            return table, idx, nctx, e2, e2, np.zeros((P, 0, 0), np.int32)
        bg = np.ascontiguousarray(np.asarray(begs)[:, :nctx], dtype=np.int32)
        en = np.ascontiguousarray(np.asarray(ends)[:, :nctx], dtype=np.int32)
        sc = np.ascontiguousarray(np.asarray(scratch)[:, :nctx], dtype=np.int32)
        if bg.shape != (P, nctx) or en.shape != (P, nctx) or sc.ndim != 3 or sc.shape[:2] != (P, nctx):
            raise ValueError(f"FullSnapshotPath.step: begs/ends need ({P}, {nctx}) and scratch ({P}, {nctx}, M), "
                             f"got {bg.shape}, {en.shape}, {sc.shape}")
        if sc.shape[2] > M:
            raise ValueError(f"FullSnapshotPath.step: scratch width {sc.shape[2]} > max_scratch_width {M}")
        # the scratch slots each non-empty range needs: t // scale for its last block must be < width
        lo = np.maximum(bg, 0).astype(np.int64)
        hi = np.minimum(en, B).astype(np.int64)
        live = hi > lo
        if live.any():
            need = ((hi - 1 - bg) * 2) // self.group_scale_np[:, None].astype(np.int64) + 1
            if int(need[live].max()) > sc.shape[2]:
                raise ValueError("FullSnapshotPath.step: a scratch range needs more slots than scratch holds")
        return table, idx, nctx, bg, en, sc

    def step(self, host_table: np.ndarray, copy_idx: np.ndarray, num_contexts: int,
             begs: Optional[np.ndarray] = None, ends: Optional[np.ndarray] = None,
             scratch: Optional[np.ndarray] = None):
        """One step; returns attn[:, :num_seqs] (a view of the attention buffer), enqueued on the current
        torch stream. The caller's numpy arrays may be rewritten as soon as this returns."""
        P, C, M = self.num_groups, self.capacity, self.max_scratch_width
        table, idx, nctx, bg, en, sc = self._check(host_table, copy_idx, num_contexts, begs, ends, scratch)
        n = idx.shape[0]
        # fresh host snapshots, every step, of everything the conversion reads
        s_idx = self._snapshot(idx)
        s_table = self._snapshot(table)
        s_begs = self._snapshot_padded(bg, (P, C))
        s_ends = self._snapshot_padded(en, (P, C))
        s_slots = self._snapshot_padded(sc, (P, C, M))
        # H2D on the current stream; the pinned allocator keeps each block until its copy is done
        if n:
            self.d_copy_idx[:n].copy_(s_idx, non_blocking=True)
        self.d_table.copy_(s_table, non_blocking=True)
        self.d_begs.copy_(s_begs, non_blocking=True)
        self.d_ends.copy_(s_ends, non_blocking=True)
        self.d_slots.copy_(s_slots, non_blocking=True)
        self.h2d_bytes_last_step = sum(int(s.numel()) * 4 for s in (s_idx, s_table, s_begs, s_ends, s_slots))
        # conversion over the whole staging capacity, then the first num_seqs rows to the attention buffer
        self._convert(self.d_table, self.d_copy_idx, self.d_begs, self.d_ends, self.d_slots,
                      self.layer_group, self.group_scale, self.layer_off, self.full_out)
        if n:
            self.attn[:, :n].copy_(self.full_out[:, :n])
        return self.attn[:, :n]
