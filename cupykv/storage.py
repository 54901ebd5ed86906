"""KV storage owned by cupykv: one device array per layer group, addressed by the manager's page indices.

Group g holds `[slots_g, scale_g, tpb, kv_heads, head_dim]`; its page view `[slots_g * scale_g, tpb,
kv_heads, head_dim]` is what page indices address (README, Concepts): page p of layer l is
`pages(group(l))[p]`, K at the index the tables give, V at K + 1.

With CacheSpec(null_slot=True) each group's last slot is the null slot: the tables' BAD cells (and
padding rows) hold its pages, so a tile-based kernel that loads K/V for a released block reads a page of
zeros inside the pool. The arrays are zero-filled at construction, the manager never allocates that slot,
and no write position names it (BAD write positions are skipped and counted), so it stays zero
(null_pages(group) is its pages).

Users may bring their own storage and use only the tables; this class is the simple default, and the
writer of each step's new K/V at the step's write positions (`KVCacheManager.write_pages` /
`write_offsets`).

K/V come in as numpy, CuPy or torch arrays of float16, bfloat16 or float32. torch tensors are
taken through DLPack (torch's __cuda_array_interface__ has no bfloat16), and bfloat16 is handled as raw
16-bit words: copied as they are into bfloat16 storage, and converted with integer arithmetic otherwise
(exact widening, round to nearest even when narrowing), so no CuPy kernel ever needs CuPy's bfloat16 type
(some of its conversions do not compile: "no instance of constructor bfloat16::bfloat16").
"""
from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import numpy as np

from .args import as_count
from .errors import CupykvError, InvalidRequestError, InvalidSpecError, SpecTooLargeError, StepOrderError
from .host_tier import HostTier
from .layout import Layout
from .spec import DTYPE_BYTES
from .step import DeviceStep

DTYPES = tuple(DTYPE_BYTES)     # the spec's KV dtypes: what storage holds, and what write() takes for K and V


class StorageDtypeError(CupykvError, TypeError):
    """The requested storage dtype is not available here (bfloat16 needs the ml_dtypes package)."""


def resolve_dtype(dtype, xp=np) -> np.dtype:
    """'float16' | 'bfloat16' | 'float32' (or a numpy dtype) -> the numpy dtype `xp` arrays are made of.

    bfloat16 is ml_dtypes.bfloat16 (CuPy >= 14 accepts it when ml_dtypes is installed)."""
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except (TypeError, ValueError):
        raise StorageDtypeError(f"storage dtype {dtype!r}: must be one of {DTYPES}") from None
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


def dtype_name(array) -> str:
    """The dtype name of a numpy, CuPy or torch array ('float16', 'bfloat16', ...), without converting it."""
    dt = getattr(array, "dtype", None)
    if dt is None:
        return np.asarray(array).dtype.name
    return getattr(dt, "name", None) or str(dt).rsplit(".", 1)[-1]     # torch.dtype has no name: 'torch.bfloat16'


def bf16_bits_to_f32(xp, bits):
    """Raw bfloat16 words (uint16) -> float32 (exact: bfloat16 is the top half of a float32)."""
    return (bits.astype(xp.uint32) << np.uint32(16)).view(xp.float32)


def f32_to_bf16_bits(xp, x):
    """float32 -> raw bfloat16 words (uint16), rounded to nearest, ties to even (as torch and ml_dtypes do);
    overflow gives inf, NaN stays a quiet NaN of the same sign."""
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return xp.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), rounded).astype(xp.uint16)


def storage_words(xp, array, source: str, storage: str):
    """K or V as C-contiguous raw words of the storage dtype (uint16 for float16 and bfloat16, uint32 for
    float32). array: an xp array of dtype `source`; a bfloat16 source comes as its raw uint16 words.
    Already-matching data is not converted (zero-copy when contiguous)."""
    if source == "bfloat16":
        if storage == "bfloat16":
            return xp.ascontiguousarray(array)
        wide = bf16_bits_to_f32(xp, array)
        return wide.view(xp.uint32) if storage == "float32" else wide.astype(xp.float16).view(xp.uint16)
    if storage == "bfloat16":
        return f32_to_bf16_bits(xp, array.astype(xp.float32, copy=False))
    words = xp.uint16 if storage == "float16" else xp.uint32
    return xp.ascontiguousarray(array.astype(storage, copy=False)).view(words)


def _address(array) -> int:
    """The first byte of a numpy or CuPy array."""
    return int(array.ctypes.data) if isinstance(array, np.ndarray) else int(array.data.ptr)


def _is_torch(array) -> bool:
    return type(array).__module__.partition(".")[0] == "torch"


def _torch_bf16_words(tensor):
    """A torch bfloat16 tensor's raw 16-bit words, as a torch int16 view (shares memory)."""
    return tensor.detach().view(sys.modules["torch"].int16)


class KVStorage:
    """Per-group KV arrays on the manager's backend (device arrays on CUDA, numpy on the host backend).

    KVStorage(manager) uses the manager's layout, backend and spec dtype; KVStorage(layout, backend,
    dtype) makes the arrays alone, without a manager (pages(), layer_pages(); write() and gather() take a
    step, so they need a KVStorage(manager)).

    rank: with a multi-device manager (KVCacheManager(devices=[...])), the device this storage lives on
    (its position in `devices`). Each rank holds its share of the KV heads, num_kv_heads // len(devices)
    (tensor parallelism splits heads; every rank has the same slots and page indices), and writes at the
    write positions of step.on(rank).
    """

    def __init__(self, manager_or_layout, backend=None, dtype=None, *, host_tier_bytes: Optional[int] = None,
                 rank: int = 0):
        from .manager import KVCacheManager
        self.rank, world = 0, 1
        if isinstance(manager_or_layout, KVCacheManager):
            self.manager: Optional[KVCacheManager] = manager_or_layout
            self.layout: Layout = manager_or_layout.layout
            world = len(manager_or_layout.backends)
            self.rank = as_count(rank, "KVStorage: rank", maximum=world - 1)
            if backend is not None and backend is not manager_or_layout.backends[self.rank]:
                raise InvalidRequestError("KVStorage(manager, backend): the backend must be the manager's "
                                          "(or leave it out)")
            backend = manager_or_layout.backends[self.rank]
        elif isinstance(manager_or_layout, Layout):
            self.manager = None
            self.layout = manager_or_layout
            if backend is None:
                raise InvalidRequestError("KVStorage(layout, backend, dtype): a layout needs a backend")
            from .backends import make_backend
            backend = make_backend(backend)         # a name, or an object checked as the manager checks it
        else:
            raise InvalidRequestError(f"KVStorage needs a KVCacheManager or a Layout, got "
                                      f"{type(manager_or_layout).__name__}")
        self.backend = backend
        self.xp = backend.xp
        spec = self.layout.spec
        self.dtype = resolve_dtype(dtype if dtype is not None else spec.dtype, self.xp)
        self.tokens_per_block = self.layout.tpb
        if spec.num_kv_heads % world:
            raise InvalidSpecError(f"KVStorage: num_kv_heads={spec.num_kv_heads} does not split evenly over "
                                   f"{world} devices")
        tier_bytes = None
        if host_tier_bytes is not None:      # checked before anything is allocated
            if world > 1:
                raise InvalidSpecError("KVStorage(host_tier_bytes=...): the host tier serves one-device managers "
                                       f"only; this manager has {world} devices")
            if self.manager is None:
                raise InvalidRequestError("KVStorage(host_tier_bytes=...) needs a KVCacheManager")
            if self.manager.host_tier is not None:
                raise InvalidRequestError("this manager already has a host tier (one KVStorage per manager)")
            tier_bytes = as_count(host_tier_bytes, "host_tier_bytes", minimum=1, error=InvalidSpecError)
        self.num_kv_heads, self.head_dim = spec.num_kv_heads // world, spec.head_dim
        self.arrays: List = []
        try:
            for g, slots in zip(self.layout.groups, self.layout.slots_per_group):
                shape = (slots, g.scale, self.tokens_per_block, self.num_kv_heads, self.head_dim)
                self.arrays.append(self._zeros(shape))
            self._errors = self._zeros((1,), np.int32)
        except MemoryError as e:
            self.arrays.clear()          # what was allocated goes back now, not with the traceback
            raise SpecTooLargeError(
                f"KVStorage: the KV arrays do not fit ({e}): per group slots x pages a slot x tokens_per_block="
                f"{self.tokens_per_block} x num_kv_heads={self.num_kv_heads} x head_dim={self.head_dim} x "
                f"{self.dtype.itemsize} bytes ({self.dtype.name}), with slots per group "
                f"{list(self.layout.slots_per_group)}") from e
        if hasattr(backend, "load_kernels"):
            # Now, while this waits for the device anyway: loading the write (and host-tier copy) kernels at
            # their first use could wait for every busy stream (lazy loading; CudaBackend.load_kernels).
            backend.load_kernels("kv_write", *(("tier_copy",) if tier_bytes is not None else ()))
        self._sync()   # zero-filled before any stream uses them
        self._words = np.uint16 if self.dtype.itemsize == 2 else np.uint32    # what the write kernel copies
        self._writes: List = []        # events after writes on streams other than the manager stream
        self.host_tier: Optional[HostTier] = None
        if tier_bytes is not None:
            self.host_tier = HostTier(self, self.manager, tier_bytes)
            self.manager.attach_host_tier(self.host_tier)

    # -- the host tier -----------------------------------------------------------------------------
    def suspend(self, rid) -> None:
        """Copy the request's resident KV (every block of full-attention groups; the sink and in-window
        blocks of sliding-window groups) to host slots and release its device slots (quarantined until
        the copy has completed); its table rows are cleared until resume. It may not be in an unsettled
        step. HostTierFullError (nothing changed, still resident) when the host tier is short."""
        self._tier().suspend(rid)

    def resume(self, rid) -> None:
        """Take device slots (all or nothing: OutOfSlotsError and nothing changed), copy the KV back and
        restore the table rows; the next step that schedules the request waits for the copy on the device
        before its tables are ready."""
        self._tier().resume(rid)

    def _tier(self) -> "HostTier":
        if self.host_tier is None:
            raise InvalidRequestError("this KVStorage has no host tier: KVStorage(mgr, host_tier_bytes=N)")
        return self.host_tier

    # -- views -----------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """The layer groups, one KV array each."""
        return len(self.arrays)

    def group_of(self, layer: int) -> int:
        """The group of a layer (whose array holds its pages)."""
        layer = as_count(layer, "KVStorage.group_of: layer", maximum=self.layout.num_layers - 1)
        return int(self.layout.layer_group[layer])

    def pages(self, group: int):
        """Page view of a group: [slots * scale, tpb, kv_heads, head_dim] (a view, no copy)."""
        a = self.arrays[as_count(group, "KVStorage.pages: group", maximum=len(self.arrays) - 1)]
        return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])

    def layer_pages(self, layer: int):
        """The page view that layer's page indices address (its group's)."""
        return self.pages(self.group_of(layer))

    def null_pages(self, group: int):
        """The null slot's pages of a group, [scale, tpb, kv_heads, head_dim] (a view; always zeros), or
        None when the spec has no null slot (CacheSpec.null_slot)."""
        group = as_count(group, "KVStorage.null_pages: group", maximum=len(self.arrays) - 1)
        nulls = self.layout.null_slots
        return None if nulls is None else self.arrays[group][nulls[group]]

    def regions(self) -> List[Tuple[int, int, int]]:
        """Per group (address, bytes, slot bytes) of its KV array: slot s of group g is the slot-bytes bytes
        at address + s * slot bytes (what a transport registers and addresses)."""
        return [(_address(a), int(a.nbytes), int(a[0].nbytes)) for a in self.arrays]

    @property
    def memory_kind(self) -> str:
        """Where the arrays live, in NIXL's words: "VRAM" (CUDA backend) or "DRAM" (host backend)."""
        return "DRAM" if self.xp is np else "VRAM"

    @property
    def device_id(self) -> int:
        """The CUDA device of the arrays (0 on the host backend)."""
        return 0 if self.xp is np else int(self.backend.device_id)

    @property
    def nbytes(self) -> int:
        """Bytes of every group's KV array."""
        return sum(int(a.nbytes) for a in self.arrays)

    # -- writes ----------------------------------------------------------------------------------
    def write(self, step, layer: int, k, v, stream=None) -> None:
        """Write K/V of the step's new tokens for one layer at the step's write positions.

        k, v: [num_tokens, kv_heads, head_dim] in batch order (num_tokens = sum(step.num_tokens)): numpy,
        CuPy or torch arrays of float16, bfloat16 or float32, converted to the storage dtype (rounded to
        nearest even) unless they already have it (float64 is refused: the GPU's narrowing of float64
        differs from numpy's near the float32 limits; convert it yourself). torch tensors are
        taken through DLPack; on the host backend they must be CPU tensors. Other dtypes raise
        StorageDtypeError naming both dtypes.

        Enqueued on `stream`: a CuPy stream or a torch.cuda.Stream (default: the manager stream, where it
        is ordered after step.ready; another stream is made to wait on step.ready first). On the host
        backend the write has run when this returns (unless a test's gate holds the stream), so a host
        consumer (numpy, or torch CPU tensors over pages_to_torch) reads it with no event. k and v must be
        ready on that stream (a torch tensor's DLPack export also orders it after torch's current stream);
        they are kept alive until the write has run. A consumer that writes on its own stream reads the
        pages on that stream after the write with no further event. A numpy k or v on the CUDA backend is
        copied to the device first, which waits for that copy.

        With scratch reuse, layers alias each other's scratch pages: write layer l and run its attention
        before writing layer l + 1. Call before step.finish(): a finished step is refused, since the next
        prepare_batch could overwrite the write positions (and reuse released slots) before a later write ran.
        Tokens whose write page is BAD or out of range are skipped and counted (see errors()).
        """
        step = self._writable(step, "write")
        layer = as_count(layer, "KVStorage.write: layer", maximum=self.layout.num_layers - 1)
        n = int(np.sum(step.num_tokens))
        want = (n, self.num_kv_heads, self.head_dim)
        sources = []
        for name, a in (("k", k), ("v", v)):
            if not hasattr(a, "shape"):
                raise InvalidRequestError(f"KVStorage.write: {name} is a {type(a).__name__}; expected an array of "
                                          f"shape {want} (numpy, CuPy or torch)")
            if tuple(a.shape) != want:
                raise InvalidRequestError(f"KVStorage.write: {name} has shape {tuple(a.shape)}, expected {want} "
                                          "(the step's new tokens, batch order)")
            sources.append(self._source_dtype(name, a))
        be = self.backend
        st = self._stream(stream, step, "write")
        dst = self.layer_pages(layer).view(self._words)
        pages = step.write_pages[layer]
        offsets = step.write_offsets
        if self.xp is np:
            self._write_host(st, pages, offsets, self._host_array("k", k), self._host_array("v", v), sources,
                             dst, n)
            # The consumer is on the host: it reads the pages next (a torch CPU tensor over them, say), as a
            # GPU consumer reads on the stream it wrote on. So the simulated device runs what it can now, this
            # write included, unless a gate holds the stream (a race test's interleaving stays its own).
            be.device.drain()
            return
        import cupy
        with be.device_context(), st:      # DLPack orders st after the producer's stream; the conversions run on st
            kd, vd = (storage_words(cupy, self._device_array(a), src, self.dtype.name)
                      for a, src in zip((k, v), sources))
        be.write_kv(st, pages, offsets, kd, vd, dst, n, self.tokens_per_block, self._errors)
        written = be.record(st)
        be.keep_until(written, k, v, kd, vd)
        if st is not be.stream:       # errors() waits for it: the skipped-token count is updated on st
            self._writes = [e for e in self._writes if not e.done()] + [written]

    def _write_host(self, stream, pages, offsets, k, v, sources, dst, n) -> None:
        tpb, errors, storage = self.tokens_per_block, self._errors, self.dtype.name

        def run():   # on the simulated stream: reads the write positions and K/V when it runs, as the kernel does
            p = pages[:n].astype(np.int64)
            o = offsets[:n].astype(np.int64)
            ok = (p >= 0) & (p + 1 < dst.shape[0]) & (o >= 0) & (o < tpb)
            errors[0] += int(np.count_nonzero(~ok))
            with np.errstate(over="ignore", invalid="ignore"):    # inf and NaN, silently, as on the device
                dst[p[ok], o[ok]] = storage_words(np, k, sources[0], storage)[ok]
                dst[p[ok] + 1, o[ok]] = storage_words(np, v, sources[1], storage)[ok]
        stream.enqueue(run)

    def gather(self, step, layer: int, stream=None) -> Tuple[object, object]:
        """Read back K/V of the step's new tokens for one layer from their write positions:
        ([num_tokens, kv_heads, head_dim], same for V; undefined for tokens whose write page is BAD).
        Ordered on `stream` (default the manager stream; another stream is made to wait on step.ready first)
        after the work already enqueued there; on the host backend this waits for it. As for write(): the
        latest prepared step, before its finish."""
        be = self.backend
        step = self._writable(step, "gather")
        layer = as_count(layer, "KVStorage.gather: layer", maximum=self.layout.num_layers - 1)
        n = int(np.sum(step.num_tokens))
        st = self._stream(stream, step, "gather")
        # Gathered as raw words: CuPy's indexing kernels need no bfloat16 type then.
        dst = self.layer_pages(layer).view(self._words)
        # A token whose write page is BAD was not written (errors() counts it): its values here are
        # undefined (index -1 reads the last page).
        if self.xp is np:
            st.synchronize()
            p = step.write_pages[layer, :n].astype(np.int64)
            o = step.write_offsets[:n].astype(np.int64)
            return dst[p, o].view(self.dtype), dst[p + 1, o].view(self.dtype)
        with be.device_context(), st:
            p = step.write_pages[layer, :n]
            o = step.write_offsets[:n]
            return dst[p, o].view(self.dtype), dst[p + 1, o].view(self.dtype)

    def errors(self) -> int:
        """Tokens skipped so far because their write page was BAD or out of range (waits for the device:
        the manager stream and every write enqueued on another stream)."""
        for written in self._writes:
            written.synchronize()
        self._writes = []
        self._sync()
        return int(self.backend.to_numpy(self._errors)[0])

    # -- internals -------------------------------------------------------------------------------
    def _writable(self, step, what: str):
        """The step's view on this storage's device, if its write positions may be used now: a step of this
        storage's manager, open on this device (DeviceStep.check_open)."""
        mgr = self.manager
        if mgr is None or getattr(step, "owner", None) is not mgr:
            raise StepOrderError(f"KVStorage.{what}: the step must come from the manager this storage was made for")
        step = self._view(step)
        step.check_open(f"KVStorage.{what}")
        return step

    def _view(self, step):
        """The step as this storage's device sees it (step.on(rank)); a DeviceStep must be of that rank."""
        if not isinstance(step, DeviceStep):
            return step.on(self.rank)
        if step.rank != self.rank:
            raise StepOrderError(f"this KVStorage is device {self.rank}'s; got step.on({step.rank})")
        return step

    def _zeros(self, shape, dtype=None):
        # allocated and filled in manager-stream order (cupy-pitfalls), counted against the host backend's memory
        return self.backend.device_full(shape, 0, self.dtype if dtype is None else dtype)

    def _sync(self) -> None:
        self.backend.stream.synchronize()

    def _stream(self, stream, step, what: str):
        """The stream work for `step` goes on: the manager stream by default, else `stream` (a stream of this
        storage's backend; torch streams become CuPy streams on the CUDA backend), made to wait on
        step.ready (the write positions are the step's once it is ready)."""
        be = self.backend
        if stream is None:
            return be.stream
        if self.xp is not np and not hasattr(stream, "ptr"):
            from .backends.cuda import cupy_stream
            try:
                stream = cupy_stream(stream)
            except TypeError:
                pass            # refused below
        if not be.is_stream(stream):
            raise InvalidRequestError(f"KVStorage.{what}: stream={stream!r} is not a stream of the "
                                      f"{be.name} backend's device {be.device_id} (or a torch.cuda.Stream of it)")
        if stream is not be.stream:
            be.wait(stream, step.ready)
        return stream

    def _source_dtype(self, name: str, array) -> str:
        source = dtype_name(array)
        if source not in DTYPES:
            raise StorageDtypeError(f"KVStorage.write: {name} has dtype {source}; {self.dtype.name} storage takes "
                                    f"{', '.join(DTYPES)}")
        return source

    @staticmethod
    def _host_array(name: str, array) -> np.ndarray:
        """A numpy view of a host K/V argument; bfloat16 as its raw uint16 words."""
        if _is_torch(array):
            if array.device.type != "cpu":
                raise InvalidRequestError(f"KVStorage.write: {name} is a {array.device} tensor; the host backend's "
                                          "storage takes CPU tensors (or numpy arrays)")
            if dtype_name(array) == "bfloat16":
                return _torch_bf16_words(array).numpy().view(np.uint16)
            return array.detach().numpy()
        array = np.asarray(array)
        return array.view(np.uint16) if array.dtype.name == "bfloat16" else array

    @staticmethod
    def _device_array(array):
        """A CuPy view of a K/V argument (zero-copy on the device; a host array is copied); bfloat16 as its
        raw uint16 words, so that nothing downstream needs CuPy's bfloat16 type."""
        import cupy
        if _is_torch(array):
            if dtype_name(array) == "bfloat16":
                return cupy.from_dlpack(_torch_bf16_words(array)).view(cupy.uint16)
            return cupy.from_dlpack(array.detach())
        if not isinstance(array, cupy.ndarray):
            if isinstance(array, np.ndarray) or not hasattr(array, "__dlpack__"):
                host = np.asarray(array)
                return cupy.asarray(host.view(np.uint16) if host.dtype.name == "bfloat16" else host)
            array = cupy.from_dlpack(array)
        return array.view(cupy.uint16) if array.dtype.name == "bfloat16" else array
