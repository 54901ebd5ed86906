"""The CUDA backend: the step pipeline on CuPy streams, pinned memory and the RawKernels of
cupykv/kernels/pipeline.cu.

Same interface as host.HostBackend (the reference version). Importing this module allocates nothing:
streams, events, pinned memory and the kernel module are created by CudaBackend() or on first use, so the
package imports on machines without a GPU.
"""
from __future__ import annotations

import ctypes
import time
import weakref
from pathlib import Path
from typing import List, Optional

import cupy
import cupyx
import numpy as np
from cupy.cuda import runtime

KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "pipeline.cu"
KERNEL_OPTIONS = ("-std=c++17",)

# Threads per block of the delta kernel (threads stride over one run's values) and the grid used when
# the caller gives no run count: a fixed grid keeps launches graph-capturable, and the kernel grid-strides.
DELTA_THREADS = 128
DELTA_MAX_BLOCKS = 1024
DELTA_DEFAULT_BLOCKS = 256
# Conversion: threads per block along B (each thread writes 4 blocks); grid.y at most this many entries.
CONVERT_MAX_THREADS = 128
GRID_Y_MAX = 65535
# A gate nobody opens releases its stream after this long, and reports it through close_timeout_hit().
GATE_TIMEOUT_S = 10.0


class CudaEvent:
    """A CUDA event with sleeping host waits (block=True), with the interface of host.SimEvent.

    Like a CUDA event, one that was never recorded counts as complete.
    """

    def __init__(self):
        self.event = cupy.cuda.Event(block=True, disable_timing=True)

    def record(self, stream: cupy.cuda.Stream) -> "CudaEvent":
        self.event.record(stream)
        return self

    def done(self) -> bool:
        return bool(self.event.done)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Host wait; False when the event has not completed within `timeout` seconds (None: forever)."""
        if timeout is None:
            self.event.synchronize()
            return True
        deadline = time.monotonic() + timeout
        while not self.event.done:
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
        self.event.synchronize()   # cheap once done; surfaces a sticky CUDA error here, not later
        return True

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaGate:
    """Holds a stream (at the point the gate was enqueued) until open() is called.

    Two words of mapped pinned host memory: [0] the flag the gate kernel spins on, [1] set by the kernel
    when it gave up after its timeout. The memory must outlive the kernel, so the backend keeps every
    gate's allocation until the backend itself is collected.
    """

    def __init__(self, ptr: int):
        self._flag = ctypes.c_int.from_address(ptr)
        self._timed_out = ctypes.c_int.from_address(ptr + 4)
        self._flag.value = 0
        self._timed_out.value = 0

    def open(self) -> None:
        self._flag.value = 1

    def close_timeout_hit(self) -> bool:
        """True when the kernel stopped waiting on its own (the test never opened the gate in time)."""
        return self._timed_out.value != 0


def _free_host(ptrs: List[int]) -> None:
    for ptr in ptrs:
        try:
            runtime.freeHost(ptr)
        except Exception:   # interpreter shutdown or a dead context: nothing left to protect
            pass
    ptrs.clear()


def _require_device(arr, name: str, align: int = 4) -> None:
    if not isinstance(arr, cupy.ndarray) or arr.dtype != np.int32 or not arr.flags.c_contiguous:
        raise TypeError(f"{name}: needs a C-contiguous cupy int32 array, got "
                        f"{type(arr).__name__} {getattr(arr, 'dtype', None)}")
    if arr.data.ptr % align:
        raise ValueError(f"{name}: the kernels need {align}-byte alignment; got pointer {arr.data.ptr:#x}")


class CudaBackend:
    """CuPy streams and events, pinned host buffers, and the pipeline RawKernels."""

    name = "cuda"
    xp = cupy

    def __init__(self):
        self.device_id = cupy.cuda.Device().id
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._streams: "weakref.WeakSet[cupy.cuda.Stream]" = weakref.WeakSet()
        self._module: Optional[cupy.RawModule] = None
        self._kernels: dict = {}
        self._clock_khz: Optional[int] = None
        # Gate allocations stay alive as long as the backend: freeing them while a gate kernel may still
        # read them is a use-after-free, and cudaFreeHost synchronizes the whole device.
        self._gate_ptrs: List[int] = []
        self._gates_finalizer = weakref.finalize(self, _free_host, self._gate_ptrs)

    # -- streams and events --------------------------------------------------------------------
    def new_stream(self, name: str = "stream") -> cupy.cuda.Stream:
        """A non-blocking stream (so nothing is implicitly ordered with the legacy default stream)."""
        stream = cupy.cuda.Stream(non_blocking=True)
        self._streams.add(stream)
        return stream

    def record(self, stream: cupy.cuda.Stream) -> CudaEvent:
        return CudaEvent().record(stream)

    def wait(self, stream: cupy.cuda.Stream, event) -> None:
        """Make `stream` wait for `event` (a CudaEvent or a raw cupy.cuda.Event)."""
        stream.wait_event(getattr(event, "event", event))

    def gate(self, stream: cupy.cuda.Stream, timeout_s: float = GATE_TIMEOUT_S) -> CudaGate:
        """Enqueue a gate on `stream`: work enqueued after it runs only once gate.open() is called."""
        ptr = runtime.hostAlloc(8, runtime.hostAllocMapped | runtime.hostAllocPortable)
        self._gate_ptrs.append(ptr)
        gate = CudaGate(ptr)
        max_cycles = int(timeout_s * self._clock_rate_khz() * 1000)
        # Under unified addressing the host pointer of mapped pinned memory is valid on the device.
        self._kernel("cupykv_gate")((1,), (1,), (np.uint64(ptr), np.uint64(ptr + 4), np.int64(max_cycles)),
                                    stream=stream)
        return gate

    def synchronize(self) -> None:
        """Wait (sleeping, not spinning) for the manager stream and every stream from new_stream()."""
        for stream in [self.stream, *list(self._streams)]:
            CudaEvent().record(stream).synchronize()

    # -- memory --------------------------------------------------------------------------------
    def pinned_empty(self, words: int) -> np.ndarray:
        """A zeroed pinned int32 buffer. The caller must keep it alive as long as copies may read it:
        CuPy's pinned pool hands a dropped block to the next allocation at once."""
        return cupyx.zeros_pinned(words, np.int32)

    def pinned_temp(self, words: int) -> np.ndarray:
        """A fresh pinned buffer from CuPy's pool (only for the documented unsafe staging mode)."""
        return cupyx.empty_pinned(words, np.int32)

    def device_empty(self, words: int) -> cupy.ndarray:
        """A zeroed device int32 buffer, initialised in order on the manager stream."""
        with self.stream:
            return cupy.zeros(words, np.int32)

    def device_full(self, shape, value, dtype=np.int32) -> cupy.ndarray:
        with self.stream:
            return cupy.full(shape, value, dtype)

    def to_numpy(self, arr) -> np.ndarray:
        """A host copy of `arr`, ordered after the work already enqueued on the manager stream."""
        if isinstance(arr, np.ndarray):
            return np.array(arr, copy=True)
        return cupy.asnumpy(arr, stream=self.stream)

    def upload(self, arr: np.ndarray) -> cupy.ndarray:
        """A device copy of a host array (set-up time only: this waits for the copy)."""
        host = np.ascontiguousarray(arr)
        with self.stream:
            dev = cupy.empty(host.shape, host.dtype)
            dev.set(host, stream=self.stream)
        self.stream.synchronize()
        return dev

    # -- copies: enqueued on `stream`; each reads its source when it executes ------------------
    def copy_h2d(self, dst: cupy.ndarray, src: np.ndarray, words: int, stream: cupy.cuda.Stream) -> None:
        """Copy the first `words` int32 of pinned `src` into `dst`. `src` must not be written again
        until an event recorded after this copy has completed."""
        if words > dst.size or words > src.size:
            raise ValueError(f"copy_h2d: {words} words do not fit (dst {dst.size}, src {src.size})")
        runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, words * 4, runtime.memcpyHostToDevice, stream.ptr)

    def copy_d2d(self, dst: cupy.ndarray, src: cupy.ndarray, stream: cupy.cuda.Stream) -> None:
        if dst.nbytes != src.nbytes or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError(f"copy_d2d: needs contiguous arrays of equal size ({dst.nbytes} vs {src.nbytes} B)")
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, runtime.memcpyDeviceToDevice, stream.ptr)

    # -- kernels -------------------------------------------------------------------------------
    def apply_deltas(self, stream: cupy.cuda.Stream, snap: cupy.ndarray, mirror: cupy.ndarray, consts,
                     num_runs: Optional[int] = None) -> None:
        """Apply the snapshot's table deltas to the device mirror [P, rows, B].

        num_runs only sizes the grid (the kernel reads the true count from the snapshot); None gives a
        fixed grid, for graph capture.
        """
        _require_device(snap, "snap")
        _require_device(mirror, "mirror")
        blocks = DELTA_DEFAULT_BLOCKS if num_runs is None else min(max(int(num_runs), 1), DELTA_MAX_BLOCKS)
        self._kernel("cupykv_apply_deltas")((blocks,), (DELTA_THREADS,), (snap, mirror), stream=stream)

    def convert(self, stream: cupy.cuda.Stream, snap: cupy.ndarray, mirror: cupy.ndarray, out: cupy.ndarray,
                consts, shared: bool, num_seqs: Optional[int] = None) -> None:
        """Build the step's page tables into `out` (DESIGN.md section 3).

        PER_LAYER: out [L, max_batch, 2, B]; SHARED: out [P, max_batch, 2, B]. Rows s >= num_seqs (from
        the snapshot) are not touched. num_seqs only sizes the grid; None sizes it for max_batch.
        """
        B, max_batch = int(consts.max_blocks), int(consts.max_batch)
        if B % 4:
            raise ValueError(f"convert: max_blocks={B} must be a multiple of 4")
        _require_device(snap, "snap")
        _require_device(mirror, "mirror", align=16)
        _require_device(out, "out", align=16)
        lead = consts.num_groups if shared else consts.num_layers
        if out.shape != (lead, max_batch, 2, B):
            raise ValueError(f"convert: out has shape {out.shape}, expected {(lead, max_batch, 2, B)}")
        quads = B // 4
        threads = min(CONVERT_MAX_THREADS, -(-quads // 32) * 32)
        rows_hint = max_batch if num_seqs is None else int(num_seqs)
        grid = (-(-quads // threads), min(max(rows_hint, 1), max_batch, GRID_Y_MAX))
        if shared:
            args = (snap, mirror, out, consts.d_group_scale, np.int32(consts.num_groups), np.int32(consts.rows),
                    np.int32(max_batch), np.int32(B))
            self._kernel("cupykv_convert_shared")(grid, (threads,), args, stream=stream)
        else:
            args = (snap, mirror, out, consts.d_layer_group, consts.d_layer_koff, consts.d_group_scale,
                    np.int32(consts.num_layers), np.int32(consts.rows), np.int32(max_batch), np.int32(B))
            self._kernel("cupykv_convert_per_layer")(grid, (threads,), args, stream=stream)

    # -- internals -----------------------------------------------------------------------------
    def _kernel(self, name: str) -> cupy.RawKernel:
        """The named kernel of pipeline.cu; the module is compiled on first use (cached on disk by CuPy)."""
        kernel = self._kernels.get(name)
        if kernel is None:
            if self._module is None:
                self._module = cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=KERNEL_OPTIONS)
            kernel = self._kernels[name] = self._module.get_function(name)
        return kernel

    def _clock_rate_khz(self) -> int:
        if self._clock_khz is None:
            try:
                self._clock_khz = int(runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, self.device_id))
            except Exception:
                self._clock_khz = 0
            if self._clock_khz <= 0:
                self._clock_khz = 2_000_000   # a fast SM clock: the timeout errs on the long side
        return self._clock_khz
