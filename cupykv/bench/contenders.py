"""The torch contenders, each timed on its own torch stream on the inputs of cupykv's step:

  torch-eager      the reference system's path after its race fix (snapshot_path.FullSnapshotPath): fresh
  torch-compiled   pinned snapshots of copy_idx, the whole host table and the scratch metadata every
                   step, the conversion over the whole staging capacity, then num_seqs rows to the
                   attention buffer. PER_LAYER tables, fed by the PER_LAYER manager.
  per-group-peer   persistent per-group device block tables updated from a fresh pinned write list of
                   the cells changed since the last step, then a gather of the batch's rows
                   (peer_path.PerGroupPeerPath). SHARED tables, fed by the SHARED manager.

Each is checked against cupykv's output every step and against cupykv.reference on sampled steps (by
the harness), so the comparison is of equals. torch is optional: without it the harness skips these
and says why (torch_status).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from ..manager import KVCacheManager
from .peer_path import PerGroupPeerPath, table_writes
from .snapshot_path import BAD
from .timing import Sample, Timer


class TorchContender:
    """What every torch contender shares: its own torch stream (wrapped as a cupy stream for the gate
    and the timing events), a zero-copy view of the cupykv output it is compared with, and read-back.

    Subclasses set `path` (with h2d_bytes_last_step) and implement warm() and enqueue().
    """

    table_mode = "per_layer"

    def __init__(self, name: str, mgr: KVCacheManager, timer: Timer):
        import torch
        self.torch = torch
        self.name = name
        self.timer = timer
        self.cuda = mgr.backend.name == "cuda"
        self.device = "cuda" if self.cuda else "cpu"
        self.path: Any = None
        if self.cuda:
            import cupy
            self.stream = torch.cuda.Stream()
            self.cp_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream)
            self.mgr_out = torch.from_dlpack(mgr.out)         # zero-copy view of cupykv's output
        else:
            self.stream = self.cp_stream = None
            self.mgr_out = torch.from_numpy(mgr.out)

    def warm(self, mgr: KVCacheManager, rows: np.ndarray) -> None:
        """One ungated call on the batch `rows` (compiles when compiled) and a wait."""
        raise NotImplementedError

    def enqueue(self, mgr: KVCacheManager, step) -> Callable[[], Any]:
        """Untimed preparation for `step`; returns the call to time (it enqueues the contender's work on
        the current torch stream and returns its output tables)."""
        raise NotImplementedError

    def _untimed(self, call: Callable[[], Any]) -> None:
        if not self.cuda:
            call()
            return
        with self.torch.cuda.stream(self.stream):
            call()
        self.stream.synchronize()

    def run(self, mgr: KVCacheManager, step) -> Tuple[Any, Sample, int]:
        """Time one step on the inputs of cupykv's `step` (the host table is as it was at its prepare);
        returns (output tables, timing, H2D bytes)."""
        call = self.enqueue(mgr, step)
        if self.cuda:
            with self.torch.cuda.stream(self.stream):
                out, sample = self.timer.measure(self.cp_stream, call)
        else:
            out, sample = self.timer.measure(None, call)
        return out, sample, self.path.h2d_bytes_last_step

    def equals_cupykv(self, res, n: int) -> bool:
        """The contender's output equals cupykv's first n rows (both are complete when this is called)."""
        return bool(self.torch.equal(res, self.mgr_out[:, :n]))

    def rows(self, res, sel: np.ndarray) -> np.ndarray:
        """Batch entries `sel` of the output, as numpy."""
        return res[:, sel.tolist()].cpu().numpy() if self.cuda else res.numpy()[:, sel]

    def close(self) -> None:
        self.path = None


class SnapshotContender(TorchContender):
    """FullSnapshotPath eager or compiled (PER_LAYER)."""

    def __init__(self, name: str, mgr: KVCacheManager, max_scratch_width: int, compile: bool, timer: Timer):
        from .snapshot_path import FullSnapshotPath
        super().__init__(name, mgr, timer)
        lay = mgr.layout
        self.compiled = compile
        self.path = FullSnapshotPath(lay.num_layers, lay.num_groups, mgr.spec.max_batch, mgr.spec.max_batch,
                                     lay.max_blocks, lay.layer_group, lay.layer_koff, lay.group_scale,
                                     max_scratch_width, device=self.device, compile=compile)
        self.max_scratch_width = max_scratch_width

    def warm(self, mgr: KVCacheManager, rows: np.ndarray) -> None:
        self._untimed(lambda: self.path.step(mgr.table, rows, 0))

    def enqueue(self, mgr: KVCacheManager, step) -> Callable[[], Any]:
        args = (mgr.table, step.rows, step.num_contexts, step.scratch_begs, step.scratch_ends, step.scratch_slots)
        if step.scratch_slots is not None and step.scratch_slots.shape[2] > self.max_scratch_width:
            raise ValueError(f"scratch width {step.scratch_slots.shape[2]} > {self.max_scratch_width}")
        return lambda: self.path.step(*args)


class PeerContender(TorchContender):
    """PerGroupPeerPath (SHARED), fed the cells of the host table that changed since it last saw them.

    The write list is recovered by diffing the batch's rows of mgr.table against a shadow of what the
    device tables hold, OUTSIDE the timed region: an engine's scheduler knows the block ids it appended
    or dropped (vLLM's scheduler output lists them per request) and never diffs a table, and a diff of
    the batch's rows (8 MB at 128k / batch 256) would time numpy, not the path. Packing the list into
    the fresh pinned buffer, the copy, the apply and the gather are timed.
    """

    table_mode = "shared"

    def __init__(self, name: str, mgr: KVCacheManager, timer: Timer):
        super().__init__(name, mgr, timer)
        P, R, B = mgr.table.shape
        self.path = PerGroupPeerPath(P, R, mgr.spec.max_batch, B, mgr.layout.group_scale, device=self.device)
        self.shadow = np.full((P, R, B), BAD, np.int32)      # what the device tables hold

    def warm(self, mgr: KVCacheManager, rows: np.ndarray) -> None:
        writes = table_writes(self.shadow, mgr.table, rows)
        self._untimed(lambda: self.path.step(writes, rows))

    def enqueue(self, mgr: KVCacheManager, step) -> Callable[[], Any]:
        writes = table_writes(self.shadow, mgr.table, step.rows)       # untimed, see the class doc
        rows = step.rows
        return lambda: self.path.step(writes, rows)


def torch_status(enabled: bool, backend_name: str) -> Tuple[bool, str]:
    """(whether the torch contenders run, why or why not)."""
    if not enabled:
        return False, "torch contenders disabled (--no-torch)"
    try:
        import torch
    except Exception as exc:   # noqa: BLE001
        return False, f"torch is not installed ({type(exc).__name__}: {exc}); torch contenders " \
                      f"(torch-eager, torch-compiled, per-group-peer) skipped (pip install 'cupykv[torch]')"
    if backend_name == "cuda" and not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no usable CUDA; torch contenders skipped"
    return True, f"torch {torch.__version__}"


def _reset_dynamo() -> None:
    # Each configuration compiles its own shapes: start from an empty cache, and allow enough entries
    # that no recompile limit falls back to eager in the middle of a run.
    try:
        import torch
        torch._dynamo.reset()
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    except Exception:   # noqa: BLE001
        pass


def make_contenders(mgr: KVCacheManager, timer: Timer, compile: bool, max_scratch_width: int,
                    warm_rows: np.ndarray) -> Tuple[List[TorchContender], Dict[str, str], List[str]]:
    """The contenders for `mgr`'s table mode, each warmed up on the batch `warm_rows`.

    Returns (contenders, {name: why} for those that could not start, notes for the log).
    """
    kinds: List[Tuple[str, Callable[[], TorchContender]]]
    if mgr.spec.table_mode == "shared":
        kinds = [("per-group-peer", lambda: PeerContender("per-group-peer", mgr, timer))]
    else:
        kinds = [("torch-eager", lambda: SnapshotContender("torch-eager", mgr, max_scratch_width, False, timer))]
        if compile:
            kinds.append(("torch-compiled",
                          lambda: SnapshotContender("torch-compiled", mgr, max_scratch_width, True, timer)))
    out: List[TorchContender] = []
    failed: Dict[str, str] = {}
    notes: List[str] = []
    for name, make in kinds:
        try:
            compiled = name == "torch-compiled"
            if compiled:
                _reset_dynamo()
            c = make()
            t0 = time.perf_counter()
            c.warm(mgr, warm_rows)
            if compiled:
                notes.append(f"torch.compile warm-up {time.perf_counter() - t0:.1f} s")
            out.append(c)
        except Exception as exc:   # noqa: BLE001 - reported in the rows and the log; the run goes on
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
    return out, failed, notes
