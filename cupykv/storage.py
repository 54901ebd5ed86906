"""KV storage owned by cupykv: one device array per layer group, addressed by the manager's page indices.

Group g holds `[slots_g, scale_g, tpb, kv_heads, head_dim]`; its page view `[slots_g * scale_g, tpb,
kv_heads, head_dim]` is what page indices address (DESIGN.md section 2): page p of layer l is
`pages(group(l))[p]`, K at the index the tables give, V at K + 1.

Users may bring their own storage and use only the tables; this class is the simple default, and the
writer of each step's new K/V at the step's write positions (`KVCacheManager.write_pages` /
`write_offsets`).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from .errors import CupykvError, InvalidRequestError, StepOrderError
from .layout import Layout

DTYPES = ("float16", "bfloat16", "float32")


class StorageDtypeError(CupykvError, TypeError):
    """The requested storage dtype is not available here (bfloat16 needs the ml_dtypes package)."""


def resolve_dtype(dtype, xp=np) -> np.dtype:
    """'float16' | 'bfloat16' | 'float32' (or a numpy dtype) -> the numpy dtype `xp` arrays are made of.

    bfloat16 is ml_dtypes.bfloat16 (CuPy >= 14 accepts it when ml_dtypes is installed)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in DTYPES:
        raise StorageDtypeError(f"storage dtype {dtype!r}: must be one of {DTYPES}")
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise StorageDtypeError("bfloat16 storage needs the 'ml_dtypes' package (pip install ml_dtypes); "
                                "or use dtype='float16' / 'float32'") from None
    dt = np.dtype(ml_dtypes.bfloat16)
    if xp is not np:
        try:
            xp.empty(1, dt)
        except Exception as exc:
            raise StorageDtypeError(f"this CuPy ({getattr(xp, '__version__', '?')}) cannot make bfloat16 arrays "
                                    f"({exc}); bfloat16 needs CuPy >= 14 with ml_dtypes installed") from None
    return dt


class KVStorage:
    """Per-group KV arrays on the manager's backend (device arrays on CUDA, numpy on the host backend).

    KVStorage(manager) uses the manager's layout, backend and spec dtype; KVStorage(layout, backend,
    dtype) makes storage without a manager (write() then needs no step; use the arrays directly).
    """

    def __init__(self, manager_or_layout, backend=None, dtype=None):
        from .manager import KVCacheManager
        if isinstance(manager_or_layout, KVCacheManager):
            self.manager: Optional[KVCacheManager] = manager_or_layout
            self.layout: Layout = manager_or_layout.layout
            backend = backend if backend is not None else manager_or_layout.backend
        elif isinstance(manager_or_layout, Layout):
            self.manager = None
            self.layout = manager_or_layout
            if backend is None:
                raise InvalidRequestError("KVStorage(layout, backend, dtype): a layout needs a backend")
        else:
            raise TypeError(f"KVStorage needs a KVCacheManager or a Layout, got {type(manager_or_layout).__name__}")
        if isinstance(backend, str):
            from .backends import make_backend
            backend = make_backend(backend)
        self.backend = backend
        self.xp = backend.xp
        spec = self.layout.spec
        self.dtype = resolve_dtype(dtype if dtype is not None else spec.dtype, self.xp)
        self.tokens_per_block = self.layout.tpb
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.arrays: List = []
        for g, slots in zip(self.layout.groups, self.layout.slots_per_group):
            shape = (slots, g.scale, self.tokens_per_block, self.num_kv_heads, self.head_dim)
            self.arrays.append(self._zeros(shape))
        self._errors = self._zeros((1,), np.int32)
        self._sync()   # zero-filled before any stream uses them

    # -- views -----------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.arrays)

    def group_of(self, layer: int) -> int:
        return int(self.layout.layer_group[layer])

    def pages(self, group: int):
        """Page view of a group: [slots * scale, tpb, kv_heads, head_dim] (a view, no copy)."""
        a = self.arrays[group]
        return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])

    def layer_pages(self, layer: int):
        """The page view that layer's page indices address (its group's)."""
        return self.pages(self.group_of(layer))

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    # -- writes ----------------------------------------------------------------------------------
    def write(self, step, layer: int, k, v, stream=None) -> None:
        """Write K/V of the step's new tokens for one layer at the step's write positions.

        k, v: [num_tokens, kv_heads, head_dim] in batch order (num_tokens = sum(step.num_tokens)), of any
        float dtype (converted to the storage dtype). Enqueued on `stream` (default: the manager stream,
        where it is ordered after step.ready; another stream is made to wait on step.ready first). k and v
        must be ready on that stream; they are kept alive until the write has run.

        With scratch reuse, layers alias each other's scratch pages: write layer l and run its attention
        before writing layer l + 1. Call before the next prepare_batch (it overwrites the write positions).
        Tokens whose write page is BAD or out of range are skipped and counted (see errors()).
        """
        mgr = self.manager
        if mgr is None or getattr(step, "outputs", None) is not mgr.outputs:
            raise StepOrderError("KVStorage.write: the step must come from the manager this storage was made for")
        if not step.is_current:
            raise StepOrderError(f"KVStorage.write: step {step.id} is not the latest prepared step; its write "
                                 "positions were overwritten by a later prepare_batch")
        if not 0 <= int(layer) < self.layout.num_layers:
            raise InvalidRequestError(f"KVStorage.write: layer {layer} out of range [0, {self.layout.num_layers})")
        layer = int(layer)
        n = int(np.sum(step.num_tokens))
        want = (n, self.num_kv_heads, self.head_dim)
        for name, a in (("k", k), ("v", v)):
            if tuple(a.shape) != want:
                raise InvalidRequestError(f"KVStorage.write: {name} has shape {tuple(a.shape)}, expected {want} "
                                          "(the step's new tokens, batch order)")
        be = self.backend
        st = be.stream if stream is None else stream
        if st is not be.stream:
            be.wait(st, step.ready)
        dst = self.layer_pages(layer)
        pages = step.write_pages[layer]
        offsets = step.write_offsets
        if self.xp is np:
            self._write_host(st, pages, offsets, k, v, dst, n)
            return
        import cupy
        with st:
            kd = cupy.ascontiguousarray(cupy.asarray(k), dtype=self.dtype)
            vd = cupy.ascontiguousarray(cupy.asarray(v), dtype=self.dtype)
        be.write_kv(st, pages, offsets, kd, vd, dst, n, self.tokens_per_block, self._errors)
        be.keep_until(be.record(st), k, v, kd, vd)

    def _write_host(self, stream, pages, offsets, k, v, dst, n) -> None:
        tpb, errors = self.tokens_per_block, self._errors
        k = np.asarray(k)
        v = np.asarray(v)

        def run():   # on the simulated stream: reads the write positions when it runs, as the kernel does
            p = pages[:n].astype(np.int64)
            o = offsets[:n].astype(np.int64)
            ok = (p >= 0) & (p + 1 < dst.shape[0]) & (o >= 0) & (o < tpb)
            errors[0] += int(np.count_nonzero(~ok))
            dst[p[ok], o[ok]] = k[ok].astype(dst.dtype)
            dst[p[ok] + 1, o[ok]] = v[ok].astype(dst.dtype)
        stream.enqueue(run)

    def gather(self, step, layer: int, stream=None) -> Tuple[object, object]:
        """Read back K/V of the step's new tokens for one layer from their write positions:
        ([num_tokens, kv_heads, head_dim], same for V; undefined for tokens whose write page is BAD). Ordered on `stream` (default the manager stream)
        after the work already enqueued there; on the host backend this waits for it."""
        be = self.backend
        n = int(np.sum(step.num_tokens))
        st = be.stream if stream is None else stream
        dst = self.layer_pages(int(layer))
        # A token whose write page is BAD was not written (errors() counts it): its values here are
        # undefined (index -1 reads the last page).
        if self.xp is np:
            st.synchronize()
            p = step.write_pages[int(layer), :n].astype(np.int64)
            o = step.write_offsets[:n].astype(np.int64)
            return dst[p, o].copy(), dst[p + 1, o].copy()
        with st:
            p = step.write_pages[int(layer), :n]
            o = step.write_offsets[:n]
            return dst[p, o], dst[p + 1, o]

    def errors(self) -> int:
        """Tokens skipped so far because their write page was BAD or out of range (waits for the device)."""
        self._sync()
        return int(self.backend.to_numpy(self._errors)[0])

    # -- internals -------------------------------------------------------------------------------
    def _zeros(self, shape, dtype=None):
        dtype = self.dtype if dtype is None else dtype
        if self.xp is np:
            return np.zeros(shape, dtype)
        with self.backend.stream:     # allocation and memset in manager-stream order (cupy-pitfalls)
            return self.xp.zeros(shape, dtype)

    def _sync(self) -> None:
        self.backend.stream.synchronize()
