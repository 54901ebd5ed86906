"""A contender of the benchmark: persistent per-group block tables on the device, in torch.

This re-implements the usual way of a newer engine (vLLM's newer model runner, see
shared/notes/reference-systems.md): each layer group has one block table [rows, B] that lives on the
device for the whole run. Each step ships only the cells that changed since the last step, as a write
list of (group, row, block, slot), in a FRESH pinned int32 buffer, so the host may build the next list as
soon as step() returns (torch's caching pinned allocator does not hand a block out again before the copy
that reads it has completed). The list is applied with one index_put over all groups' tables, then the
batch's rows are gathered in batch order into a fixed output with SHARED-style page indices: K = slot *
scale, V = K + 1, BAD (-1) stays BAD. The output has a fixed address (CUDA graphs); rows beyond the
batch keep what earlier steps wrote.

table_writes() is how the benchmark recovers the write list from cupykv's host table (by diffing the
rows of each batch against a shadow of what the device tables hold); an engine's scheduler knows its
new block ids without a diff.

torch is imported lazily: this module imports without torch; PerGroupPeerPath needs it
(TorchUnavailableError otherwise).
"""
from __future__ import annotations

import numpy as np

from .snapshot_path import BAD, require_torch

__all__ = ["PerGroupPeerPath", "table_writes"]

WRITE_FIELDS = 4        # (group, row, block, slot)


def table_writes(shadow: np.ndarray, table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The cells of `rows` where `table` [P, R, B] differs from `shadow` (what the device tables hold),
    as int32 [k, 4] rows (group, row, block, slot), ordered by group, batch position, block; `shadow` is
    updated to match. Rows not in `rows` are left for the step that next gathers them."""
    rows = np.asarray(rows, np.int64)
    cur = table[:, rows]                                    # [P, n, B], a copy
    g, s, b = np.nonzero(cur != shadow[:, rows])
    r = rows[s]
    vals = cur[g, s, b]
    shadow[g, r, b] = vals
    out = np.empty((len(g), WRITE_FIELDS), np.int32)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = g, r, b, vals
    return out


class PerGroupPeerPath:
    """Persistent per-group device block tables, updated from a per-step write list.

    num_groups, rows, max_blocks: the tables' shape [P, rows, B] (plane p is group p's table).
    capacity: the output's batch capacity. group_scale[P]: pages per slot of each group. device: "cuda"
    (pinned write lists, non-blocking copies on the current torch stream) or "cpu".
    """

    def __init__(self, num_groups: int, rows: int, capacity: int, max_blocks: int, group_scale,
                 device: str = "cuda"):
        torch = require_torch("cupykv.bench.peer_path", "the per-group peer contender is written in torch")
        self._t = torch
        P, R, C, B = int(num_groups), int(rows), int(capacity), int(max_blocks)
        for name, v in (("num_groups", P), ("rows", R), ("capacity", C), ("max_blocks", B)):
            if v <= 0:
                raise ValueError(f"PerGroupPeerPath: {name}={v} must be > 0")
        scale = np.asarray(group_scale, np.int32).reshape(-1)
        if scale.shape != (P,) or scale.min() <= 0:
            raise ValueError(f"PerGroupPeerPath: group_scale needs {P} positive entries, got {scale.tolist()}")
        self.num_groups, self.rows, self.capacity, self.max_blocks = P, R, C, B
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        i32 = torch.int32
        self.scale = torch.as_tensor(scale, device=self.device).view(P, 1, 1)
        self.tables = torch.full((P, R, B), BAD, dtype=i32, device=self.device)    # persistent
        self.out = torch.full((P, C, 2, B), BAD, dtype=i32, device=self.device)    # fixed address
        self.h2d_bytes_last_step = 0

    def step(self, writes: np.ndarray, copy_idx: np.ndarray):
        """Apply `writes` (int32 [k, 4]: group, row, block, slot) to the tables and gather the rows
        `copy_idx` (batch order) into out; returns out[:, :num_seqs] ([P, n, 2, B]), enqueued on the
        current torch stream. The caller's arrays may be rewritten as soon as this returns."""
        torch = self._t
        writes = np.asarray(writes, np.int32).reshape(-1, WRITE_FIELDS)
        idx = np.asarray(copy_idx, np.int32).reshape(-1)
        k, n = writes.shape[0], idx.shape[0]
        if n > self.capacity:
            raise ValueError(f"PerGroupPeerPath.step: {n} sequences exceed capacity {self.capacity}")
        # One fresh pinned buffer per step: the write list, then the batch's rows; one copy.
        staged = torch.empty((WRITE_FIELDS * k + n,), dtype=torch.int32, pin_memory=self.pin)
        host = staged.numpy()
        host[:WRITE_FIELDS * k] = writes.reshape(-1)
        host[WRITE_FIELDS * k:] = idx
        dev = staged.to(self.device, non_blocking=True)
        self.h2d_bytes_last_step = int(staged.numel()) * 4
        if k:
            w = dev[:WRITE_FIELDS * k].view(k, WRITE_FIELDS)
            cell = w[:, :3].long()                   # index_put wants int64 indices
            self.tables.index_put_((cell[:, 0], cell[:, 1], cell[:, 2]), w[:, 3])
        if n:
            base = self.tables.index_select(1, dev[WRITE_FIELDS * k:])          # [P, n, B], batch order
            bad = base == BAD
            kp = torch.where(bad, BAD, base * self.scale)
            self.out[:, :n, 0].copy_(kp)
            self.out[:, :n, 1].copy_(torch.where(bad, BAD, kp + 1))
        return self.out[:, :n]
