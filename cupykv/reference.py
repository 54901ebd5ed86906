"""The NumPy reference of the conversion contract (DESIGN.md section 3).

Written straight from the contract, for clarity, not speed. It is the oracle that every other
implementation (the host backend's emulated kernels, the CUDA RawKernels) must match bit for bit.
"""
from __future__ import annotations

import numpy as np

BAD = -1


def convert_per_layer(table, copy_idx, num_contexts, begs, ends, scratch_slots,
                      layer_group, group_scale, layer_koff, out=None, max_batch=None):
    """out[L, max_batch, 2, B]; rows s >= len(copy_idx) of `out` are left as they were.

    table: [P, rows, B] int32 base slot ids or BAD. copy_idx: [num_seqs] table row of each batch entry.
    begs/ends: [P, num_contexts]; scratch_slots: [P, num_contexts, M]. layer_koff[l] is the K offset of
    layer l inside its group's slot; V is K + 1.
    """
    table = np.asarray(table)
    P, _, B = table.shape
    L = len(layer_group)
    num_seqs = len(copy_idx)
    if out is None:
        out = np.full((L, max_batch or num_seqs, 2, B), BAD, np.int32)
    for layer in range(L):
        p = int(layer_group[layer])
        scale = int(group_scale[p])
        for role in (0, 1):
            offset = int(layer_koff[layer]) + role
            for s in range(num_seqs):
                base = table[p, int(copy_idx[s])].astype(np.int64)
                row = np.where(base == BAD, BAD, base * scale + offset)
                if s < num_contexts:
                    beg, end = int(begs[p][s]), int(ends[p][s])
                    for blk in range(max(beg, 0), min(end, B)):
                        t = (blk - beg) * 2
                        slot = int(scratch_slots[p][s][t // scale])
                        row[blk] = slot * scale + (t % scale + offset) % scale
                out[layer, s, role] = row
    return out


def convert_shared(table, copy_idx, group_scale, out=None, max_batch=None):
    """out[P, max_batch, 2, B]: K = base * scale, V = K + 1, BAD stays BAD."""
    table = np.asarray(table)
    P, _, B = table.shape
    num_seqs = len(copy_idx)
    if out is None:
        out = np.full((P, max_batch or num_seqs, 2, B), BAD, np.int32)
    for p in range(P):
        scale = int(group_scale[p])
        for s in range(num_seqs):
            base = table[p, int(copy_idx[s])].astype(np.int64)
            for role in (0, 1):
                out[p, s, role] = np.where(base == BAD, BAD, base * scale + role)
    return out
