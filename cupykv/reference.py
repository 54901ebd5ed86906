"""The NumPy reference of the conversion contract (docs/design.md, "The conversion contract"; the null slot
as the README's "Reading the tables" states it).

Written straight from the contract, for clarity, not speed. It is the oracle that every other
implementation (the host backend's emulated kernels, the CUDA RawKernels) must match bit for bit.

Null slot (CacheSpec(null_slot=True)): null_slots[p] is a slot of group p that is never allocated. A cell
that would be BAD holds that slot's page for the plane instead: PER_LAYER null_slots[p] * scale_p +
layer_offset(l, r), SHARED null_slots[p] * scale_p + r. Padding rows [num_seqs, pad_to) hold the same
(BAD without null slots). null_slots=None is the plain contract: BAD stays BAD.
"""
from __future__ import annotations

import numpy as np

BAD = -1        # the contract's value, stated here again: the oracle imports nothing of the implementation


def _bad_page(null_slots, p: int, scale: int, offset: int) -> int:
    """What a cell without a resident page holds: BAD, or the null slot's page with this offset."""
    if null_slots is None:
        return BAD
    page = int(null_slots[p]) * scale + offset
    return (page + 2 ** 31) % 2 ** 32 - 2 ** 31      # the int32 store's wrap, as for every other cell


def convert_per_layer(table, copy_idx, num_contexts, begs, ends, scratch_slots,
                      layer_group, group_scale, layer_koff, out=None, max_batch=None, null_slots=None,
                      pad_to=0):
    """out[L, max_batch, 2, B]; rows s >= max(len(copy_idx), pad_to) of `out` are left as they were.
    (The manager's DELTA steps also write there the changed cells of rows an entry past the batch still
    holds, docs/design.md "The conversion contract": a step's contract is its rows below max(num_seqs,
    pad_to), which is what the tests compare with this reference.)

    table: [P, rows, B] int32 base slot ids or BAD. copy_idx: [num_seqs] table row of each batch entry.
    begs/ends: [P, num_contexts]; scratch_slots: [P, num_contexts, M]. layer_koff[l] is the K offset of
    layer l inside its group's slot; V is K + 1. null_slots: [P] null slot per group, or None.
    pad_to: rows [num_seqs, pad_to) are padding (BAD, or the null page).
    """
    table = np.asarray(table)
    P, _, B = table.shape
    L = len(layer_group)
    num_seqs = len(copy_idx)
    if out is None:
        out = np.full((L, max_batch or max(num_seqs, pad_to), 2, B), BAD, np.int32)
    for layer in range(L):
        p = int(layer_group[layer])
        scale = int(group_scale[p])
        for role in (0, 1):
            offset = int(layer_koff[layer]) + role
            bad = _bad_page(null_slots, p, scale, offset)
            for s in range(num_seqs):
                base = table[p, int(copy_idx[s])].astype(np.int64)
                row = np.where(base == BAD, bad, base * scale + offset)
                if s < num_contexts:
                    beg, end = int(begs[p][s]), int(ends[p][s])
                    for blk in range(max(beg, 0), min(end, B)):
                        t = (blk - beg) * 2
                        slot = int(scratch_slots[p][s][t // scale])
                        row[blk] = slot * scale + (t % scale + offset) % scale
                out[layer, s, role] = row
            out[layer, num_seqs:max(num_seqs, pad_to), role] = bad
    return out


def convert_shared(table, copy_idx, group_scale, out=None, max_batch=None, null_slots=None, pad_to=0):
    """out[P, max_batch, 2, B]: K = base * scale, V = K + 1; BAD stays BAD, or with null_slots becomes
    null_slots[p] * scale (+ 1 for V). Padding rows [num_seqs, pad_to) likewise."""
    table = np.asarray(table)
    P, _, B = table.shape
    num_seqs = len(copy_idx)
    if out is None:
        out = np.full((P, max_batch or max(num_seqs, pad_to), 2, B), BAD, np.int32)
    for p in range(P):
        scale = int(group_scale[p])
        for role in (0, 1):
            bad = _bad_page(null_slots, p, scale, role)
            for s in range(num_seqs):
                base = table[p, int(copy_idx[s])].astype(np.int64)
                out[p, s, role] = np.where(base == BAD, bad, base * scale + role)
            out[p, num_seqs:max(num_seqs, pad_to), role] = bad
    return out
