"""Interop: torch tensors over cupykv's buffers (DLPack, zero-copy) with explicit stream ordering, and CSR
page lists per group or layer for FlashInfer-style consumers.

Ordering. A step's buffers are written on the manager stream; `step.ready` is recorded after them. Every
export of a step's buffers here makes the consumer's stream (a given torch stream, default
torch.cuda.current_stream()) wait on that event explicitly (pages_to_torch waits on the event it is given,
none by default: KV written on the consumer's stream needs none), then exports with DLPack stream=-1 (no ordering), so nothing depends on which
CuPy stream happens to be current at export time (ndarray.__dlpack__(stream=s) orders s after CuPy's
*current* stream, not after the stream that wrote the data). When the consumer is done, record that on
its stream with finish_on_torch(step, stream); the next prepare_batch waits for it on the device.

Lifetimes. An exported tensor keeps its CuPy owner alive (the DLPack capsule holds a reference). Buffers
the manager owns (tables, write positions, storage) have fixed addresses for the life of the manager.

On the host backend (no GPU) the same functions return CPU tensors sharing the numpy buffers; the wait
is a host wait on the (simulated) event.

torch is imported only when one of these functions is called; without it they raise
InteropUnavailableError (an ImportError and a CupykvError) naming the missing package (finish_on_torch on
the host backend has no torch stream to record on: it finishes on the manager stream, torch or not).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np

from .args import as_count
from .errors import CupykvError, InvalidRequestError, StepOrderError
from .layout import BAD
from .step import DeviceStep, Step


def cupy_stream(stream):
    """A CuPy stream object for a torch.cuda.Stream (or any object with .cuda_stream, or a CuPy stream)."""
    try:
        from .backends.cuda import cupy_stream as convert     # CuPy is imported only when a stream is given
    except ImportError as exc:
        raise InteropUnavailableError(
            "cupykv.interop.cupy_stream needs CuPy, and it is not installed (pip install -e \".[cuda12]\" or "
            "\".[cuda13]\", as the README's install does)") from exc
    return convert(stream)


__all__ = ["InteropUnavailableError", "to_torch", "tables_to_torch", "write_positions_to_torch",
           "pages_to_torch", "finish_on_torch", "cupy_stream", "CsrViews", "CsrBuffers", "csr_views"]


class InteropUnavailableError(CupykvError, ImportError):
    """An interop function needs a package that is not installed (torch; CuPy for cupy_stream)."""


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise InteropUnavailableError(
            "cupykv.interop needs PyTorch, and the 'torch' package is not installed (pip install torch, or "
            "pip install -e \".[torch]\" in a cupykv checkout); the rest of cupykv works without it") from exc
    return torch


def _event_of(step_or_event):
    """A Step or CsrViews (their .ready), an event (CudaEvent, SimEvent, cupy.cuda.Event), or None."""
    if step_or_event is None:
        return None
    if hasattr(step_or_event, "ready") and not hasattr(step_or_event, "record"):
        ev = step_or_event.ready
        if ev is None:
            raise StepOrderError(f"{step_or_event!r} has no ready event (not prepared yet?)")
        return ev
    return step_or_event


def _from_numpy(torch, array: np.ndarray):
    if array.dtype.name == "bfloat16":      # ml_dtypes: torch.from_numpy does not know it
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _export(torch, array):
    """DLPack export that inserts no stream ordering (the caller has ordered the consumer already)."""
    try:
        capsule = array.__dlpack__(stream=-1)       # -1: no synchronization (DLPack protocol)
    except (TypeError, ValueError, BufferError):
        capsule = array.toDlpack()                  # older CuPy: the legacy export never synchronizes
    return torch.from_dlpack(capsule)


def to_torch(array, step_or_event, stream=None):
    """A torch tensor sharing `array`'s memory, safe to read on `stream` once this returns.

    step_or_event: a Step (waits on step.ready), a CsrViews (its ready), an event, or None (no ordering,
    e.g. storage nobody writes concurrently). stream: a torch.cuda.Stream (default: torch's current
    stream on the array's device); it is made to wait on the event with an explicit cudaStreamWaitEvent.
    """
    torch = _torch()
    ev = _event_of(step_or_event)
    if isinstance(array, np.ndarray):          # host backend: a host wait, then a CPU tensor on the buffer
        if ev is not None:
            ev.synchronize()
        return _from_numpy(torch, array)
    import cupy
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"to_torch: expected a cupy or numpy array, got {type(array).__name__}")
    if stream is None:
        stream = torch.cuda.current_stream(array.device.id)
    if ev is not None:
        cupy_stream(stream).wait_event(getattr(ev, "event", ev))
    return _export(torch, array)


def _step_of(step, what: str):
    """The Step or DeviceStep a function was given, else StepOrderError naming it."""
    if not isinstance(step, (Step, DeviceStep)):
        raise StepOrderError(f"{what}: step={step!r} is not a Step (prepare_batch's result, or step.on(rank))")
    return step


def _open_step(step, what: str):
    """_step_of, and the step's buffers may still be read (DeviceStep.check_open: the latest prepared step,
    not finished on that device); a Step of several devices is checked on device 0, whose buffers
    step.tables and step.write_pages are."""
    _step_of(step, what)
    (step if isinstance(step, DeviceStep) else step.on(0)).check_open(what)
    return step


def tables_to_torch(step: Union[Step, DeviceStep], stream=None):
    """The step's output tables as an int32 tensor ([L, max_batch, 2, B] PER_LAYER, [P, ...] SHARED; rows
    < step.num_seqs are this step's), ordered after step.ready on `stream`. The step must be the latest
    prepared and not finished (StepOrderError otherwise: its buffers hold, or may soon hold, a later
    step's tables)."""
    return to_torch(_open_step(step, "tables_to_torch").tables, step, stream)


def write_positions_to_torch(step: Union[Step, DeviceStep], stream=None,
                             trim: bool = True) -> Tuple[object, object]:
    """(pages [L, n], offsets [n]) int32 tensors: K page index of each new token per layer (V = K + 1) and
    its position in the page, batch order; n = sum(step.num_tokens). trim=False gives the full fixed-address
    buffers ([L, max_step_tokens], [max_step_tokens]; the first n entries valid). The step must be open,
    as for tables_to_torch."""
    _open_step(step, "write_positions_to_torch")
    pages, offsets = step.write_pages, step.write_offsets
    if trim:
        n = int(np.sum(step.num_tokens))
        pages, offsets = pages[:, :n], offsets[:n]
    return to_torch(pages, step, stream), to_torch(offsets, step, stream)


def pages_to_torch(storage, group: int, step_or_event=None, stream=None):
    """The page view [slots * scale, tpb, kv_heads, head_dim] of a group of a KVStorage as a tensor
    (bfloat16 storage gives torch.bfloat16). step_or_event orders the consumer after that event only.

    To read what KVStorage.write wrote, write on the consumer's own stream: storage.write(step, layer, k,
    v, stream=stream) is ordered after step.ready on that stream, and every later read on it comes after
    the write, so no event is needed (pass step_or_event=None). A write on the manager stream (the
    default) returns no event: then record one on that stream after the write
    (mgr.backend.record(mgr.backend.stream)) and pass it here."""
    return to_torch(storage.pages(group), step_or_event, stream)


def finish_on_torch(step, stream=None) -> None:
    """step.finish() recorded on a torch stream (default: torch's current stream on the step's device): the
    consumer's last read of the step's buffers is enqueued there. With several devices pass step.on(rank)
    (a stream belongs to one device)."""
    _step_of(step, "finish_on_torch")
    if len(getattr(step, "parts", ())) > 1 and not hasattr(step, "rank"):
        raise StepOrderError(f"step {step.id} runs on {len(step.parts)} devices: finish each with "
                             "finish_on_torch(step.on(rank), stream)")
    if step.backend.xp is np:       # no torch stream to record on: the manager stream (torch not needed)
        step.finish()
        return
    torch = _torch()
    if stream is None:
        stream = torch.cuda.current_stream(step.backend.device_id)
    step.finish(cupy_stream(stream))


# -- CSR views ---------------------------------------------------------------------------------------

class CsrBuffers:
    """Fixed-capacity CSR buffers for one manager (fixed addresses, e.g. for CUDA graphs): indptr
    [max_batch + 1], indices [max_batch * B + 1] (the last word is a scratch target), last_page_len
    [max_batch]. Reused by every csr_views(..., buffers=this) call: like the tables, a step's CSR arrays
    stay valid until the next step's are written (after the previous consumer's finish event)."""

    def __init__(self, manager, rank: int = 0):
        from .manager import KVCacheManager
        if not isinstance(manager, KVCacheManager):
            raise InvalidRequestError(f"CsrBuffers needs the KVCacheManager whose steps it serves, got "
                                      f"{type(manager).__name__}")
        devices = len(manager.pipeline.mirrors)
        rank = as_count(rank, "CsrBuffers: rank", maximum=devices - 1)   # the device's KVCacheManager(devices=...) position
        mirror = manager.pipeline.mirrors[rank]
        be, spec = mirror.backend, manager.spec
        B = manager.layout.max_blocks
        self.outputs = mirror.outputs         # the step outputs these buffers serve (csr_views checks)
        self.rank, self.owner = rank, manager
        self.indptr = be.device_full((spec.max_batch + 1,), 0, np.int32)
        self.indices = be.device_full((spec.max_batch * B + 1,), BAD, np.int32)
        self.last_page_len = be.device_full((spec.max_batch,), 0, np.int32)
        be.synchronize()


class CsrViews:
    """CSR page lists of one step for one group (or one layer); see csr_views().

    Device (int32): kv_indptr [num_seqs + 1], kv_indices_buffer (valid prefix: indptr_host[-1]; kv_indices
    is that prefix), kv_last_page_len [num_seqs]. Host (numpy int32): indptr_host (waits for `ready` on
    first use), last_page_len_host, seq_lens_host (int64). `ready`: the event after which the device
    arrays hold this step's values; consumers wait on it (to_torch(csr.kv_indptr, csr, stream)).
    """

    def __init__(self, step, kind: str, index: int, indptr, indices, last_page_len, last_page_len_host,
                 seq_lens_host, ready, indptr_pending):
        self.step = step
        self.kind, self.index = kind, index            # "group" or "layer", and its index
        self.kv_indptr = indptr
        self.kv_indices_buffer = indices
        self.kv_last_page_len = last_page_len
        self.last_page_len_host = last_page_len_host
        self.seq_lens_host = seq_lens_host
        self.ready = ready
        self._pending = indptr_pending                 # host array filled once `ready` has completed
        self._indptr_host: Optional[np.ndarray] = None

    @property
    def num_seqs(self) -> int:
        """Batch entries listed."""
        return len(self.last_page_len_host)

    @property
    def indptr_host(self) -> np.ndarray:
        """kv_indptr on the host, int32 [num_seqs + 1] (waits for `ready` on first use)."""
        if self._indptr_host is None:
            self.ready.synchronize()
            self._indptr_host = np.array(self._pending, np.int32, copy=True)
            self._pending = None
        return self._indptr_host

    @property
    def num_pages(self) -> int:
        """Pages listed for the whole batch (indptr_host[-1]; may wait for `ready`)."""
        return int(self.indptr_host[-1])

    @property
    def kv_indices(self):
        """The valid prefix of kv_indices_buffer (needs indptr_host, so it may wait for `ready`)."""
        return self.kv_indices_buffer[:self.num_pages]

    def __repr__(self) -> str:
        return f"CsrViews(step={self.step.id}, {self.kind}={self.index}, num_seqs={self.num_seqs})"


def _compact(xp, rows, koff: int, indptr, indices, null_page: int = BAD) -> None:
    """indptr/indices of the entries of rows [n, B] that are neither BAD nor the null page (null_page: the
    K page of the null slot these rows hold in BAD cells, BAD for none), in block order (no host
    synchronization)."""
    n = rows.shape[0]
    indptr[0] = 0
    if n == 0:
        return
    mask = rows != BAD
    if null_page != BAD:
        mask &= rows != np.int32(null_page)
    counts = mask.astype(np.int32)
    xp.cumsum(counts.sum(axis=1, dtype=np.int32), dtype=np.int32, out=indptr[1:n + 1])
    pos = xp.cumsum(counts, axis=1, dtype=np.int32) - 1 + indptr[:n, None]
    target = xp.where(mask, pos, np.int32(indices.size - 1))      # BAD entries go to the scratch word
    vals = rows + np.int32(koff) if koff else rows
    indices[target.reshape(-1)] = vals.reshape(-1)


def csr_views(step, group: Optional[int] = None, *, layer: Optional[int] = None,
              buffers: Optional[CsrBuffers] = None) -> CsrViews:
    """CSR page lists of the step's batch, for one layer group (group=g) or one layer (layer=l).

    For batch entry s (batch order, contexts first), kv_indices[kv_indptr[s]:kv_indptr[s+1]] lists the
    resident pages of the sequence after this step's tokens, in block order: the non-BAD entries of the
    step's K page-index row, blocks 0 .. ceil(len / tpb) - 1, len = start_pos + num_tokens (= seq_lens_host).
    - group=g: SHARED-style K page indices, slot * scale_g; the consumer of layer l adds its K offset
      layer_koff[l] (V = K + 1). Not defined for a group whose scratch blocks this step uses (those pages
      rotate per layer): such a call raises; use layer=.
    - layer=l: that layer's own K page indices (offset included, scratch pages included); V = K + 1.
    Pages index the group's page view [slots * scale, tpb, kv_heads, head_dim] (KVStorage.pages); for a
    FlashInfer-style (k_cache, v_cache) pair use (pages[:-1], pages[1:]) with the same indices.
    kv_last_page_len[s] = (len - 1) % tpb + 1, in [1, tpb]: the last listed page holds the sequence's last
    token. Out-of-window blocks of SWA groups are released (BAD), so they are not listed: with sink tokens
    the list is the sink blocks followed by the blocks from the first in-window resident one on, so a
    consumer that needs absolute positions must not derive them from the list length alone (the table
    row, step.tables, has the block ordinals).
    With CacheSpec(null_slot=True) the tables hold the null slot's page in BAD cells; the lists still hold
    real pages only (the null page is left out as BAD is), so they are the same as without a null slot.
    A CsrBuffers holds one view at a time: a second csr_views call into the same buffers overwrites the
    first.

    Computed on the device from the step's output tables, on the manager stream after step.ready (no host
    synchronization); `ready` orders consumers after it. Call (and read the views) before step.finish().
    buffers: fixed-capacity CsrBuffers to write into (fixed addresses); None allocates per call.
    """
    if (group is None) == (layer is None):
        raise InvalidRequestError("csr_views: give exactly one of group= or layer=")
    _step_of(step, "csr_views")
    if buffers is not None and not isinstance(buffers, CsrBuffers):
        raise InvalidRequestError(f"csr_views: buffers={buffers!r} must be a CsrBuffers (or None)")
    _open_step(step, "csr_views")
    lay, be = step.layout, step.backend
    shared = lay.spec.table_mode == "shared"
    if layer is not None:
        kind, index = "layer", as_count(layer, "csr_views: layer", maximum=lay.num_layers - 1)
        g = int(lay.layer_group[index])
        plane = g if shared else index
        koff = int(lay.layer_koff[index]) if shared else 0
        row_koff = 0 if shared else int(lay.layer_koff[index])     # the K offset inside the table's cells
    else:
        kind, index = "group", as_count(group, "csr_views: group", maximum=lay.num_groups - 1)
        g = index
        plane = g if shared else lay.groups[g].layers[0]      # the group's first layer has K offset 0
        koff = row_koff = 0
        C = step.num_contexts
        if not shared and C and step.scratch_ends is not None and \
                np.any(step.scratch_ends[g, :C] > step.scratch_begs[g, :C]):
            raise InvalidRequestError(f"csr_views: step {step.id} uses scratch blocks in group {g}; their pages "
                                      "differ per layer, so a group-level list is not defined; use layer=")
    n, B, tpb = step.num_seqs, lay.max_blocks, lay.tpb
    # The K page the plane's BAD cells hold with a null slot (left out of the lists like BAD)
    null_page = BAD if lay.null_slots is None else int(lay.null_slots[g]) * int(lay.group_scale[g]) + row_koff
    seq_lens = np.asarray(step.start_positions, np.int64) + np.asarray(step.num_tokens, np.int64)
    last_host = ((seq_lens - 1) % tpb + 1).astype(np.int32)
    if buffers is not None:
        if buffers.outputs is not step.outputs:
            if step.owner is buffers.owner:
                rank = getattr(step, "rank", 0)
                raise InvalidRequestError(f"csr_views: these buffers are device {buffers.rank}'s and the step is "
                                          f"device {rank}'s: use CsrBuffers(manager, rank={rank})")
            raise InvalidRequestError("csr_views: buffers belong to another manager")
        indptr, indices, last = buffers.indptr[:n + 1], buffers.indices, buffers.last_page_len[:n]
    else:
        indptr = indices = last = None
    st = be.stream
    if be.xp is np:
        if indptr is None:
            indptr = np.zeros(n + 1, np.int32)
            indices = np.full(n * B + 1, BAD, np.int32)
            last = np.zeros(n, np.int32)
        out = step.tables

        def run():     # on the simulated manager stream: reads the tables when it runs, as a kernel does
            _compact(np, out[plane, :n, 0, :], koff, indptr, indices, null_page)
            last[:] = last_host
        st.enqueue(run)
        ready = be.record(st)
        pending = indptr
    else:
        import cupy
        with be.device_context(), st:
            if indptr is None:
                indptr = cupy.zeros(n + 1, np.int32)
                indices = cupy.full(n * B + 1, BAD, np.int32)
                last = cupy.zeros(n, np.int32)
            _compact(cupy, step.tables[plane, :n, 0, :], koff, indptr, indices, null_page)
        be.upload_async(last_host, st, out=last)
        pending, ready = be.download_async(indptr, st)
    views = CsrViews(step, kind, index, indptr, indices[:-1], last, last_host, seq_lens, ready, pending)
    # The arrays live at least as long as the step (a consumer on another stream may still read them
    # after the caller dropped its references); a device's view (step.on(rank)) keeps them on its step.
    owner = step.step if isinstance(step, DeviceStep) else step
    keep = getattr(owner, "_interop_keep", None)
    if keep is None:
        keep = owner._interop_keep = []
    keep.append((indptr, indices, last))
    return views
