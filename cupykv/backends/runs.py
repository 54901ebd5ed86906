"""The runs of a backend's copy_runs (the host tier's copies), checked the same way on every backend."""
from __future__ import annotations

import numpy as np

INT64_MAX = np.iinfo(np.int64).max


def run_table(runs, unit_bytes: int, dst_nbytes: int, src_nbytes: int) -> np.ndarray:
    """runs, (dst_start, src_start, n) triples in units of unit_bytes (an iterable of triples or an
    [num_runs, 3] integer array), as a new int64 [num_runs, 3] table (the caller's array is not kept).
    ValueError, before anything is copied, for anything but integer triples in int64's range or for a run
    outside either buffer (compared in units, so no product can wrap)."""
    given = np.asarray(runs if isinstance(runs, np.ndarray) else list(runs))
    if given.shape != (0,) and (given.ndim != 2 or given.shape[1] != 3):
        raise ValueError(f"copy_runs: runs must be (dst_start, src_start, n) triples; got shape {given.shape}")
    if given.size and (given.dtype.kind not in "iu" or given.dtype.kind == "u" and given.max() > INT64_MAX):
        raise ValueError(f"copy_runs: runs must be integers in int64's range; got {given.dtype} runs")
    table = given.astype(np.int64).reshape(-1, 3)
    d0, s0, n = table.T
    dst_units, src_units = dst_nbytes // unit_bytes, src_nbytes // unit_bytes
    bad = np.flatnonzero((np.minimum(np.minimum(d0, s0), n) < 0) | (d0 > dst_units) | (s0 > src_units)
                         | (n > dst_units - d0) | (n > src_units - s0))
    if len(bad):
        raise ValueError(f"copy_runs: run {tuple(table[bad[0]].tolist())} of {unit_bytes} B units is out of range")
    if len(table) > 1:      # the CUDA copy kernel runs every run at once: two that write one place race
        order = np.argsort(d0, kind="stable")
        ends = d0[order] + n[order]
        clash = np.flatnonzero(ends[:-1] > d0[order][1:])
        if len(clash):
            a, b = table[order[clash[0]]].tolist(), table[order[clash[0] + 1]].tolist()
            raise ValueError(f"copy_runs: runs {tuple(a)} and {tuple(b)} of {unit_bytes} B units write overlapping "
                             "destination ranges")
    return table
