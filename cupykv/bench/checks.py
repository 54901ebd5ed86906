"""Checks against the NumPy reference (cupykv.reference) on sampled steps.

At a step's prepare the selected batch entries' table rows are copied (the table changes at the next
step); after the step, cupykv's output rows and each contender's are compared with the reference's
conversion of that copy: PER_LAYER for the PER_LAYER manager, SHARED for the SHARED one.
"""
from __future__ import annotations

import numpy as np

from .. import reference
from ..manager import KVCacheManager

# Sampled steps: four in a row every CHECK_EVERY, so that each case (decode-only runs alternate decode and
# steady steps) is checked in every stretch of the run.
CHECK_EVERY = 20
CHECK_RUN = 4
MAX_FULL_CELLS = 40000       # a step this small (entries x planes) is checked whole, once per case run
MAX_SAMPLED_DECODES = 12


def check_step(j: int, smoke: bool) -> bool:
    """Whether measured step j is checked (every step of a smoke run)."""
    return smoke or j % CHECK_EVERY < CHECK_RUN


def pick_rows(rng: np.random.Generator, num_seqs: int, num_contexts: int, planes: int, full: bool) -> np.ndarray:
    """Batch entries to check: every context plus a sample of decode entries (all when `full` or when
    the step is small), sorted, so the contexts stay first."""
    if full or num_seqs * planes <= 2048:
        return np.arange(num_seqs)
    k = min(num_seqs - num_contexts, MAX_SAMPLED_DECODES)
    gen = rng.choice(np.arange(num_contexts, num_seqs), size=k, replace=False) if k > 0 else []
    return np.sort(np.concatenate([np.arange(num_contexts), np.asarray(gen, np.int64)])).astype(np.int64)


def read_rows(mgr: KVCacheManager, sel: np.ndarray) -> np.ndarray:
    """mgr.out[:, sel] as numpy, ordered after the manager stream's work."""
    be = mgr.backend
    if be.name == "cuda":
        import cupy
        with be.stream:
            sub = mgr.out[:, cupy.asarray(sel)]
            host = cupy.asnumpy(sub, stream=be.stream)
        be.stream.synchronize()
        return host
    return np.array(mgr.out[:, sel], copy=True)


def expected_rows(mgr: KVCacheManager, table_sub: np.ndarray, step, sel: np.ndarray) -> np.ndarray:
    """cupykv.reference on the selected batch entries (contexts first, so the contract's s < num_contexts
    still holds), from a copy of their table rows taken at the step's prepare; PER_LAYER or SHARED as the
    manager's spec says."""
    lay = mgr.layout
    if mgr.spec.table_mode == "shared":
        return reference.convert_shared(table_sub, np.arange(len(sel)), lay.group_scale, max_batch=len(sel))
    nctx = int(np.sum(sel < step.num_contexts))
    return reference.convert_per_layer(table_sub, np.arange(len(sel)), nctx, step.scratch_begs[:, sel[:nctx]],
                                       step.scratch_ends[:, sel[:nctx]], step.scratch_slots[:, sel[:nctx]],
                                       lay.layer_group, lay.group_scale, lay.layer_koff, max_batch=len(sel))


class StepCheck:
    """The sampled check of one step: rows picked and their table rows copied at prepare, then
    `expected` (the reference) to compare every implementation's rows with."""

    def __init__(self, mgr: KVCacheManager, step, rng: np.random.Generator, full: bool):
        self.planes = int(mgr.out.shape[0])
        n = len(step.rows)
        self.sel = pick_rows(rng, n, step.num_contexts, self.planes, full=full and n * self.planes <= MAX_FULL_CELLS)
        self.whole = len(self.sel) == n
        self.table_sub = mgr.table[:, step.rows[self.sel]].copy()
        self._mgr, self._step, self._want = mgr, step, None

    @property
    def expected(self) -> np.ndarray:
        if self._want is None:
            self._want = expected_rows(self._mgr, self.table_sub, self._step, self.sel)
        return self._want

    def cupykv_ok(self) -> bool:
        """The manager's output rows equal the reference's."""
        return bool(np.array_equal(read_rows(self._mgr, self.sel), self.expected))
