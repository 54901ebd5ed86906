"""The CUDA backend: the step pipeline on CuPy streams, pinned memory and the RawKernels of
cupykv/kernels/ (step.cu, kv_write.cu, gate.cu; each its own module, see cupykv.kernels).

Same interface as host.HostBackend (the reference version). Importing this module allocates nothing:
streams, events, pinned memory and kernel modules are created by CudaBackend() or on first use, so the
package imports on machines without a GPU.
"""
from __future__ import annotations

import ctypes
import functools
import threading
import time
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import cupy
# (bound now: cupyx is a lazy module, and two threads that first touch it at once can find its attributes
# missing, as two managers made in two threads did)
from cupyx import empty_pinned, zeros_pinned
import numpy as np
from cupy.cuda import driver, runtime

from ..kernels import (INLINE_STEP_KERNELS, MODULES, OPTIONS as KERNEL_OPTIONS, STEP_SYNC_WORDS, STEP_THREADS,
                       TIER_COPY_BLOCKS_TO_DEVICE, TIER_COPY_BLOCKS_TO_HOST, TIER_COPY_THREADS, module_of,
                       module_source)
from ..staging import GRAPH_MIN_COPY_WORDS, MODE_DELTA, MODE_FULL, QUAD_BLOCKS, pow2_at_least, pow2_buckets
from .plan import GraphBuckets, Route, StepPlan
from .runs import run_table

# The step kernels (apply_deltas, build_step): grid caps (threads per block: kernels.STEP_THREADS). Every
# kernel grid-strides and reads its counts from the snapshot, so a cap only bounds the grid; about 32 blocks
# of 256 threads per SM of an H200 is enough to keep its memory busy.
APPLY_MAX_BLOCKS = 1024
APPLY_GRAPH_BLOCKS = 64          # a graph's fixed apply grid: 16k cells per pass
TABLE_MAX_BLOCKS = 4096
TABLE_FILL_BLOCKS = 1024         # FULL tables: enough blocks to keep the device's memory busy (step_grid)
POS_FILL_BLOCKS = 256            # write positions: a decode step's grid grows to about this (step_grid)
DELTA_GRAPH_BLOCKS = 16          # a DELTA graph's table part: a decode step changes a few hundred cells
POS_MAX_BLOCKS = 1024
MEMO_ENTRIES = 256               # validated buffer sets kept by _memo (a few per ring slot in use)
EVENT_POOL = 256                 # idle CUDA events a backend keeps for reuse (record())
# KV storage writes (storage.py): threads per block and grid cap (grid-stride over tokens * row elements).
WRITE_KV_THREADS = 256
WRITE_KV_MAX_BLOCKS = 4096
# cudaMemcpyDefault: the direction follows from the pointers (unified addressing)
MEMCPY_DEFAULT = getattr(runtime, "memcpyDefault", 4)
# cudaMemoryTypeHost: cudaPointerGetAttributes' type of pinned host memory (pageable memory is unregistered)
MEMORY_TYPE_PINNED = getattr(runtime, "memoryTypeHost", 1)
# A gate nobody opens releases its stream after this long, and reports it through close_timeout_hit().
GATE_TIMEOUT_S = 10.0


EVENT_FLAGS = runtime.eventBlockingSync | runtime.eventDisableTiming


def cupy_stream(stream):
    """A CuPy stream object for a torch.cuda.Stream (or any object with .cuda_stream, or a CuPy stream)."""
    if isinstance(stream, cupy.cuda.Stream) or isinstance(stream, getattr(cupy.cuda, "ExternalStream", ())):
        return stream
    if hasattr(stream, "__cuda_stream__") and hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(stream)       # the CUDA stream protocol (CuPy >= 14)
    if hasattr(stream, "cuda_stream"):
        device = getattr(getattr(stream, "device", None), "index", None)
        with warnings.catch_warnings():                     # deprecated in CuPy 14 for from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            return cupy.cuda.ExternalStream(int(stream.cuda_stream), -1 if device is None else int(device))
    if hasattr(stream, "ptr"):
        return stream
    raise TypeError(f"not a stream: {stream!r} (give a torch.cuda.Stream or a cupy stream)")


class CudaEvent:
    """A CUDA event with sleeping host waits (blocking sync), with the interface of host.SimEvent.

    Like a CUDA event, one that was never recorded counts as complete. `ptr` is the raw handle (what
    cupy's Stream.wait_event and get_elapsed_time read; `event` is the same object, for code written for
    a cupy.cuda.Event). Handles come from their backend's pool (CudaBackend.record) and go back to it when
    the CudaEvent is dropped: recording one again cannot mislead anyone, since nobody can query it any more
    and a stream wait enqueued earlier waits for the record it saw then. The handle is a plain int owned
    by this object alone, so no other finalizer can destroy it behind the pool's back (a pooled
    cupy.cuda.Event could be: its own __del__ runs in the same garbage-collection pass as ours).
    """

    __slots__ = ("ptr", "_pool")

    def __init__(self, ptr: Optional[int] = None, pool: Optional[list] = None):
        self.ptr = runtime.eventCreateWithFlags(EVENT_FLAGS) if ptr is None else ptr
        self._pool = pool

    @property
    def event(self) -> "CudaEvent":
        return self

    def record(self, stream: cupy.cuda.Stream) -> "CudaEvent":
        runtime.eventRecord(self.ptr, stream.ptr)
        return self

    def done(self) -> bool:
        return runtime.eventQuery(self.ptr) == 0

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Host wait; False when the event has not completed within `timeout` seconds (None: forever)."""
        if timeout is None:
            runtime.eventSynchronize(self.ptr)
            return True
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
        runtime.eventSynchronize(self.ptr)   # cheap once done; surfaces a sticky CUDA error here, not later
        return True

    def synchronize(self) -> None:
        runtime.eventSynchronize(self.ptr)

    def __del__(self):
        pool = self._pool
        if pool is not None and len(pool) < EVENT_POOL:
            pool.append(self.ptr)
            return
        try:
            runtime.eventDestroy(self.ptr)
        except Exception:       # interpreter shutdown: CUDA may be gone already
            pass


def _destroy_events(pool: list) -> None:
    """A backend's finalizer: destroy its idle event handles (events dropped later are destroyed by the
    CudaEvent once the pool is full)."""
    while pool:
        try:
            runtime.eventDestroy(pool.pop())
        except Exception:
            pass


class CudaGate:
    """Holds a stream (at the point the gate was enqueued) until open() is called.

    Two words of mapped pinned host memory: [0] the flag the gate kernel spins on, [1] set by the kernel
    when it gave up after its timeout. The memory must outlive the kernel: gate words come from
    process-lifetime pages and are never freed or reused (see _new_gate_words).
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


# Gate words: two int32 per gate in mapped pinned host memory, from pages that live for the whole process and
# are never reused or freed. Freeing them (cudaFreeHost, e.g. from a finalizer when the garbage collector
# drops an old backend) synchronizes the whole device: if another gate is spinning at that moment, the host
# blocks until that gate times out. Reusing words is unsafe too while an old gate kernel may still run.
GATES_PER_PAGE = 512
_gate_lock = threading.Lock()
_gate_words: List[int] = []        # unused word pairs of the current page (addresses), popped from the end


def _new_gate_words() -> int:
    with _gate_lock:
        if not _gate_words:
            page = runtime.hostAlloc(GATES_PER_PAGE * 8, runtime.hostAllocMapped | runtime.hostAllocPortable)
            _gate_words.extend(page + 8 * i for i in reversed(range(GATES_PER_PAGE)))
        return _gate_words.pop()


# Kernel loading. Under lazy loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2) a function
# that cuModuleGetFunction returned may be only partially loaded: the driver finishes loading it when it is
# first launched or when a graph containing it is instantiated, and that loading may synchronize the whole
# context (CUDA Programming Guide, Lazy Loading: "Potential Hazards"). Done while another stream is held (a
# test gate, a long consumer kernel), it blocks the host until that stream drains. cuFuncLoad (drivers of
# CUDA 12.4 and later) finishes loading a function on request; CuPy does not wrap it, so ctypes calls it.
_CU_FUNCTION_LOADING_STATE_LOADED = 1
_CU_MODULE_LAZY_LOADING = 2
_libcuda = None


def _driver_function(name: str):
    """A function of the CUDA driver library (the one CuPy loaded), or None where there is none."""
    global _libcuda
    if _libcuda is None:
        _libcuda = False
        for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                _libcuda = ctypes.CDLL(lib)
                break
            except OSError:
                continue
    return getattr(_libcuda, name, None) if _libcuda else None


def finish_loading(function_ptr: int) -> bool:
    """Finish loading a CUfunction now (cuFuncLoad). False where the driver has no cuFuncLoad or it failed:
    the function then loads on its first launch or graph instantiation, as without this call (and
    CUDA_MODULE_LOADING=EAGER, set before CUDA starts, loads everything up front instead)."""
    load = _driver_function("cuFuncLoad")
    return load is not None and load(ctypes.c_void_p(function_ptr)) == 0


def function_loaded(function_ptr: int) -> Optional[bool]:
    """Whether the driver has fully loaded a CUfunction (cuFuncIsLoaded); None where it cannot tell."""
    is_loaded = _driver_function("cuFuncIsLoaded")
    if is_loaded is None:
        return None
    state = ctypes.c_int(-1)
    if is_loaded(ctypes.byref(state), ctypes.c_void_p(function_ptr)) != 0:
        return None
    return state.value == _CU_FUNCTION_LOADING_STATE_LOADED


def module_loading_mode() -> Optional[str]:
    """'lazy' or 'eager' (cuModuleGetLoadingMode, set by CUDA_MODULE_LOADING), None where unknown."""
    get_mode = _driver_function("cuModuleGetLoadingMode")
    mode = ctypes.c_int(0)
    if get_mode is None or get_mode(ctypes.byref(mode)) != 0:
        return None
    return "lazy" if mode.value == _CU_MODULE_LAZY_LOADING else "eager"


class DeviceScope:
    """Makes a device current for a `with` block and restores the previous one after it.

    One cudaGetDevice when the device is current already (every call of a one-device manager), unlike
    `with cupy.cuda.Device(id)`, which also sets the device again on exit; a new object per block, so
    threads never share the saved device (CuPy keeps it on the Device object).
    """

    __slots__ = ("device_id", "previous")

    def __init__(self, device_id: int):
        self.device_id = device_id

    def __enter__(self) -> "DeviceScope":
        self.previous = runtime.getDevice()
        if self.previous != self.device_id:
            runtime.setDevice(self.device_id)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous != self.device_id:
            runtime.setDevice(self.previous)


def device_count() -> int:
    """CUDA devices this process can see."""
    return int(runtime.getDeviceCount())


def _whole_entry_threads(planes: int, groups: int, max_blocks: int, entries: int) -> int:
    """Threads for writing `entries` entries whole: a thread per (group, entry, quad of blocks) writes that
    quad into all of the group's planes; where that gives fewer than TABLE_FILL_BLOCKS blocks, the grid
    grows towards a thread per plane quad and the kernel splits each group's layers over the extra threads
    (it reads the split from the grid)."""
    quads = entries * (max_blocks // QUAD_BLOCKS)
    return max(groups * quads, min(planes * quads, TABLE_FILL_BLOCKS * STEP_THREADS))


def _position_threads(groups: int, layers: int, tokens: int) -> int:
    """Threads for the write positions of `tokens` new tokens: a thread per (group, token) writes the token's
    page into each layer of its group; where that gives fewer than POS_FILL_BLOCKS blocks (a decode step:
    gemma-3-27b's window group has 52 layers, which 256 tokens would walk on two blocks), the grid grows
    towards a thread per (layer, token) and the kernel splits each group's layers over the extra threads.
    A long context step already fills the grid and keeps a thread per item."""
    return max(groups * tokens, min(layers * tokens, POS_FILL_BLOCKS * STEP_THREADS))


def step_grid(planes: int, groups: int, max_blocks: int, max_batch: int, capacity: int, layers: int, mode: int,
              num_entries: Optional[int], num_cells: Optional[int], num_tokens: Optional[int]):
    """(table blocks, position blocks) of a build_step launch. num_entries: the entries the step writes
    whole (FULL: the batch and its padding; DELTA: the rebuilt ones); num_cells: changed table cells.
    None counts size the grid for a graph: entries for max_batch, a fixed DELTA cell grid, tokens for the
    capacity. layers: the model's layers (_position_threads)."""
    cells = DELTA_GRAPH_BLOCKS * STEP_THREADS if num_cells is None else max(int(num_cells), 1)
    if mode == MODE_DELTA:
        rebuilt = max_batch if num_entries is None else min(max(int(num_entries), 0), max_batch)
        threads = max(cells, _whole_entry_threads(planes, groups, max_blocks, rebuilt) if rebuilt else 0)
    else:       # the changed cells of entries held past the batch are written too
        entries = max_batch if num_entries is None else min(max(int(num_entries), 1), max_batch)
        threads = max(cells, _whole_entry_threads(planes, groups, max_blocks, entries))
    table = -(-threads // STEP_THREADS)
    tokens = capacity if num_tokens is None else min(max(int(num_tokens), 1), capacity)
    pos = -(-_position_threads(groups, layers, tokens) // STEP_THREADS)
    return min(max(table, 1), TABLE_MAX_BLOCKS), min(pos, POS_MAX_BLOCKS)


def apply_grid(num_cells: Optional[int]) -> int:
    """Blocks of an apply_deltas launch for num_cells changed cells (None: a graph's fixed grid)."""
    hint = APPLY_GRAPH_BLOCKS * STEP_THREADS if num_cells is None else max(int(num_cells), 1)
    return min(-(-hint // STEP_THREADS), APPLY_MAX_BLOCKS)


@functools.lru_cache(maxsize=4096)
def fused_grid(shape: tuple, mode: int, num_entries: Optional[int], num_cells: Optional[int],
               num_tokens: Optional[int]) -> tuple:
    """(apply, table, position) blocks of a cupykv_step launch: apply_grid (none without changed cells) and
    step_grid for a plan's shape (planes, groups, max_blocks, max_batch, capacity, layers) and a step's counts.
    Cached, as a pure function: a step's counts are mostly the last one's, and the lookup costs a launch
    less Python than the arithmetic."""
    table, pos = step_grid(*shape, mode, num_entries, num_cells, num_tokens)
    return (0 if num_cells == 0 else apply_grid(num_cells)), table, pos


class ParamBytes:
    """A by-value kernel parameter read from host memory at `address`: PackedLaunch passes the address itself
    as the parameter's pointer, so the driver copies the parameter's bytes from there when it enqueues the
    launch."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address


class PackedLaunch:
    """A kernel with its arguments packed once into the array of argument pointers cuLaunchKernel takes.

    CuPy's RawKernel call converts and checks every argument on every launch; cupykv_step and
    cupykv_step_inline, launched every step, skip that (docs/host_profile.md in git history has what it cost). args: cupy arrays (passed as their device pointers), np.int32 and np.int64 scalars,
    ParamBytes, in the kernel's parameter order. A cell (`cells[i].value`) may change between launches: the
    driver copies the arguments, ParamBytes' bytes included, when a launch is enqueued, or captured into a
    graph.
    """

    __slots__ = ("function", "args", "cells", "params", "ptr")

    def __init__(self, kernel: cupy.RawKernel, args: tuple):
        self.function = kernel.kernel.ptr
        self.args = args                  # holds the arrays whose pointers the cells hold
        self.cells = [None if isinstance(a, ParamBytes) else _argument_cell(a) for a in args]
        self.params = (ctypes.c_void_p * len(self.cells))(*[
            a.address if c is None else ctypes.addressof(c) for a, c in zip(args, self.cells)])
        self.ptr = ctypes.addressof(self.params)

    def __call__(self, blocks: int, stream_ptr: int) -> None:
        driver.launchKernel(self.function, blocks, 1, 1, STEP_THREADS, 1, 1, 0, stream_ptr, self.ptr, 0)


def _argument_cell(arg):
    if isinstance(arg, ctypes.c_uint64):      # a raw device address
        return arg
    if isinstance(arg, cupy.ndarray):
        return ctypes.c_uint64(arg.data.ptr)
    if isinstance(arg, np.int32):
        return ctypes.c_int32(int(arg))
    if isinstance(arg, np.int64):
        return ctypes.c_int64(int(arg))
    raise TypeError(f"PackedLaunch: unsupported argument {type(arg).__name__} "
                    "(cupy array, np.int32, np.int64 or ParamBytes)")


# cupykv_step's arguments that change from step to step (indices into _fused_launch_args; cupykv_step_inline's
# arguments end as cupykv_step's do, so the last two indices hold for both), and its copy phase's grid: 4 words
# per thread, at most COPY_MAX_BLOCKS blocks (they grid-stride).
STEP_ARG_COPY_WORDS, STEP_ARG_COPY_BLOCKS, STEP_ARG_APPLY_BLOCKS, STEP_ARG_TABLE_BLOCKS = 2, -4, -3, -2
COPY_WORDS_PER_BLOCK = 4 * STEP_THREADS
COPY_MAX_BLOCKS = 16


def _fused_launch_args(host_snap, build_args: tuple, mirror_size: np.int64, sync) -> tuple:
    """cupykv_step's arguments from cupykv_build_step's (CudaBackend._step_launch_args, without its table
    block count): the pinned slot's device address, the snapshot twin, the copy size, the mirror and its
    size, the rest of the build's, then the phase grids and the sync counters. The per-step values are
    placeholders (STEP_ARG_*), set before each launch."""
    snap, mirror, rest = build_args[0], build_args[1], build_args[2:]
    return (host_snap, snap, np.int32(0), mirror, mirror_size) + rest + (np.int32(0),) * 3 + (sync,)


def _inline_launch_args(host_address: int, build_args: tuple, mirror_size: np.int64, sync) -> tuple:
    """cupykv_step_inline's arguments: the snapshot by value from the pinned slot at host_address, then
    cupykv_step's from the mirror on, without the copy's block count."""
    fused = _fused_launch_args(None, build_args, mirror_size, sync)
    return (ParamBytes(host_address),) + fused[3:STEP_ARG_COPY_BLOCKS] + fused[STEP_ARG_COPY_BLOCKS + 1:]


class CudaStepPlan(StepPlan):
    """StepPlan on the CUDA backend: one cupykv_step launch per step (kernels/step.cu: the snapshot copy, the
    delta apply and the build as phases of one grid), its arguments checked and packed once, so that run()
    is a cuLaunchKernel (or a cudaGraphLaunch) and an event record from the backend's pool, under one
    device scope. A launched (not replayed) step that fits an inline kernel's snapshot struct is a
    cupykv_step_inline launch instead (cupykv_step_inline_small where it fits that one's smaller struct):
    its snapshot goes in the launch's parameters, and no phase reads it over the bus."""

    # With graphs, a step that fits the smallest inline kernel is launched, not replayed (_inline). False
    # replays every step: for the graph tests, which are about replays, and A/B runs'
    # side of comparison.
    small_steps_inline_under_graphs = True

    def __init__(self, backend: "CudaBackend", twin, buffers: tuple, shared: bool):
        super().__init__(backend, twin, buffers, shared)
        mirror, out, row_entry, pages, offsets, consts = buffers
        self.planes, fixed = backend._step_launch_args(twin.dev, *buffers, shared)
        self.capacity = twin.capacity
        self._fits = min(twin.dev.size, twin.host.size)
        with backend.device_context():
            # The kernel reads the pinned slot at its host address: under unified addressing (every 64-bit
            # CUDA platform) pinned host memory is directly accessible from every device at that address.
            # (cudaPointerGetAttributes would say so too, but not in a thread that has no current context
            # yet: there it reports a device address of 0.)
            host = ctypes.c_uint64(twin.host.ctypes.data)
            self._sync = backend.device_empty(STEP_SYNC_WORDS)     # cupykv_step's phase counters, zero between launches
            self._step = PackedLaunch(backend._kernel("cupykv_step"), _fused_launch_args(
                host, fixed, np.int64(mirror.size), self._sync))
            # An inline kernel's driver copy reads its whole snapshot struct at the slot's address: only the
            # kernels whose struct the slot holds (smallest first, as (words, launch)).
            inlines = [(words, PackedLaunch(backend._kernel(name), _inline_launch_args(
                host.value, fixed, np.int64(mirror.size), self._sync)))
                for name, words in INLINE_STEP_KERNELS if twin.host.size >= words]
        # (words, the route of a step that fits it): made once, a step only picks one
        self._inline_routes = [(inline[0], Route(inline, False, inline[0])) for inline in inlines]
        self._grid = (self.planes, consts.num_groups, int(consts.max_blocks), int(consts.max_batch),
                      int(pages.shape[1]), int(consts.num_layers))
        # A graph bakes in every buffer address, so all of them are in its key (a backend may serve several
        # managers), and the backend keeps the buffers alive with the graph.
        self._graph_buffers = (twin.host, twin.dev, mirror, out, row_entry, pages, offsets, consts.d_layer_koff,
                               consts.d_group_scale, consts.d_group_null, consts.d_group_layers, self._sync)
        # a small int for the buffers' addresses and sizes, fixed for the life of the plan (hashing the addresses
        # at every replay would cost the host more than the lookup)
        key = (tuple(_address(b) for b in self._graph_buffers), self.capacity, self.shared)
        self._graph_key = backend._graph_keys.setdefault(key, len(backend._graph_keys))

    def route(self, words: int, graph: GraphBuckets = None) -> Route:
        """The one rule for how a step travels: the smallest inline kernel that carries `words` (its struct
        is what goes to the device, and nothing reads the slot after the enqueue), or a copy from the slot
        (too large, or a graph replay).

        With graphs (graph: the step's buckets), only the smallest inline kernel takes a step from its
        replay: such a launch costs the device a few microseconds less than the replay, which reads its
        snapshot over the bus, and the host about as much; the large kernel's costs the host more than a
        replay (docs/host_profile.md in git history, "Small steps launch inline under graphs too")."""
        routes = (self._inline_routes if graph is None else
                  self._inline_routes[:1] if self.small_steps_inline_under_graphs else ())
        for fits, route in routes:
            if words <= fits:
                return route
        return super().route(words, graph)

    def run(self, stream, mode: int, words: int, num_cells: int, num_entries: int, num_tokens: int,
            graph: GraphBuckets = None, route: Optional[Route] = None) -> CudaEvent:
        be = self.backend
        with DeviceScope(be.device_id):
            inline = (route or self.route(words, graph)).launch
            if graph is None or inline is not None:
                self._enqueue(stream.ptr, mode, words, num_cells, num_entries, num_tokens, inline)
            else:
                key = self._key(mode, graph)
                replay = be._graphs.get(key)
                if replay is None:
                    replay = self._capture(key, mode, graph)
                runtime.graphLaunch(replay.graphExec, stream.ptr)
            return be.record(stream)

    def capture(self, mode: int, graph: tuple) -> bool:
        """Capture the step graph of these buckets unless it exists; True when captured now."""
        key = self._key(mode, graph)
        if key in self.backend._graphs:
            return False
        with self.backend.device_context():
            self._capture(key, mode, graph)
        return True

    def _key(self, mode: int, graph: tuple) -> tuple:
        copy_words, seqs, tokens = graph      # seqs: the bucket of the entries written whole (step_grid)
        return self._graph_key, mode, seqs, tokens, copy_words

    def _enqueue(self, stream_ptr: int, mode: int, words: int, num_cells: Optional[int],
                 num_entries: Optional[int], num_tokens: Optional[int],
                 inline: Optional[Tuple[int, PackedLaunch]] = None) -> None:
        """The step's launch, eager or into a capture. num_cells None: a graph's fixed apply grid; 0: no
        apply blocks. inline: None, or the inline kernel that _inline chose: the snapshot goes in the
        launch's parameters, no copy."""
        if words > self._fits:
            raise ValueError(f"step copy: {words} words do not fit the ring slot ({self._fits})")
        apply, table, pos = fused_grid(self._grid, mode, num_entries, num_cells, num_tokens)
        if inline is not None:
            launch, copy = inline[1], 0
        else:
            launch, copy = self._step, min(-(-words // COPY_WORDS_PER_BLOCK), COPY_MAX_BLOCKS)
            launch.cells[STEP_ARG_COPY_WORDS].value = words
            launch.cells[STEP_ARG_COPY_BLOCKS].value = copy
        launch.cells[STEP_ARG_APPLY_BLOCKS].value = apply
        launch.cells[STEP_ARG_TABLE_BLOCKS].value = table
        launch(copy + apply + table + pos, stream_ptr)

    def _capture(self, key: tuple, mode: int, graph: tuple):
        """Capture, instantiate and upload one step graph.

        The kernels are fully loaded first (load_kernels): under lazy loading, instantiating a graph whose
        kernels were never launched loads them, and loading may synchronize the context, which blocks
        the host until every busy stream drains. The instantiation itself (in end_capture) can still make
        the host wait for busy streams, now and then (measured on the H200: docs/design.md, "CUDA graphs"), which is
        why capture_graphs() before serving is the way to keep prepare_batch off the device. The capture
        stream exists from construction and is idle, so the upload (which sets up the graph's device
        resources) does not queue behind the manager stream, and the first replay there only runs the graph.
        """
        be = self.backend
        be.load_kernels("step")
        cs = be._capture_stream
        copy_words, seqs, tokens = graph
        # Relaxed: another thread of the process (a consumer allocating memory, say) may make any CUDA call
        # while this capture runs; the stricter modes would make such calls fail. The capture itself makes
        # one asynchronous call: the launch.
        cs.begin_capture(runtime.streamCaptureModeRelaxed)
        try:
            self._enqueue(cs.ptr, mode, copy_words, None, seqs, tokens)
        finally:
            replay = cs.end_capture()
        replay.upload(cs)
        be._graphs[key] = replay
        be._graph_buffers[key] = self._graph_buffers
        return replay


def _address(buf) -> int:
    return buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data.ptr


def _require_device(arr, name: str, align: int = 4) -> None:
    if not isinstance(arr, cupy.ndarray) or arr.dtype != np.int32 or not arr.flags.c_contiguous:
        raise TypeError(f"{name}: needs a C-contiguous cupy int32 array, got "
                        f"{type(arr).__name__} {getattr(arr, 'dtype', None)}")
    if arr.data.ptr % align:
        raise ValueError(f"{name}: the kernels need {align}-byte alignment; got pointer {arr.data.ptr:#x}")


_CUDA_ERROR_MEMORY_ALLOCATION = 2       # cudaErrorMemoryAllocation (CUDA's driver_types.h)


def _zeros_pinned(count: int, dtype) -> np.ndarray:
    """cupyx.zeros_pinned, with a failure to pin the memory raised as the MemoryError it is (CUDA reports
    it as a runtime error), as a device allocation that does not fit is."""
    try:
        return zeros_pinned(count, dtype)
    except runtime.CUDARuntimeError as e:
        if e.status != _CUDA_ERROR_MEMORY_ALLOCATION:
            raise
        raise MemoryError(f"cannot pin {count * np.dtype(dtype).itemsize} bytes of host memory ({e})") from e


def capture_step_graphs(plans: Iterable["CudaStepPlan"], seqs_buckets: Sequence[int],
                        tokens_buckets: Sequence[int], min_copy_words: int = GRAPH_MIN_COPY_WORDS,
                        modes: Sequence[int] = (MODE_FULL, MODE_DELTA)) -> int:
    """Capture now every step graph that these plans (one per ring-slot twin) can need, so that
    prepare_batch only replays.

    Their number is bounded: slots x modes x batch buckets x token buckets x copy buckets (a DELTA graph's
    batch bucket is that of its rebuilt entries: none, or up to half of the largest batch bucket). Copy
    buckets are the powers of two from min_copy_words, capped at each slot's capacity (pow2_buckets),
    which is how staging.graph_buckets rounds a step's copy size; pass the batch and token buckets the
    same way. Call while nothing holds the device, e.g. when the
    manager is made. Graphs already captured are skipped; returns how many were captured now. A slot
    added or grown later captures on first use.
    """
    captured = 0
    for plan in plans:
        for mode in modes:
            delta = int(mode) == MODE_DELTA
            half = pow2_at_least(seqs_buckets[-1] // 2)       # DELTA rebuilds at most half the batch
            for seqs in ([0] + [b for b in seqs_buckets if b <= half] if delta else seqs_buckets):
                for tokens in tokens_buckets:
                    for copy_words in pow2_buckets(min_copy_words, plan.capacity):
                        captured += plan.capture(int(mode), (copy_words, seqs, tokens))
    return captured


class Memo:
    """memo(tag, buffers, make): make() once per (tag, buffers by identity). A manager's buffers are fixed
    for its life, so each step's calls skip re-validating them and re-reading their pointers. An entry
    holds its buffers, so their ids cannot be reused while it exists."""

    def __init__(self):
        self.entries: dict = {}

    def __call__(self, tag: str, buffers: tuple, make):
        key = (tag,) + tuple(map(id, buffers))
        hit = self.entries.get(key)
        if hit is None:
            if len(self.entries) >= MEMO_ENTRIES:
                self.entries.clear()     # buffers replaced over time (grown ring slots, tests) are let go
            hit = self.entries[key] = (make(), buffers)
        return hit[0]


@functools.lru_cache(maxsize=None)
def clock_rate_khz(device_id: int) -> int:
    """The device's SM clock (a fast one, 2 GHz, where the driver cannot tell: a timeout errs long)."""
    try:
        khz = int(runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, device_id))
    except Exception:
        khz = 0
    return khz if khz > 0 else 2_000_000


class KernelModules:
    """One device's kernel modules: compiled once per process (CuPy keeps the binary on disk and the module
    in memory), loaded on the device on first use or by load(); with preload, each function is fully
    loaded when its module is (finish_loading)."""

    def __init__(self, device_id: int, preload: bool):
        self.device_id, self.preload = device_id, preload
        self.modules: Dict[str, Dict[str, cupy.RawKernel]] = {}
        self.kernels: Dict[str, cupy.RawKernel] = {}

    def load(self, *modules: str) -> None:
        with DeviceScope(self.device_id):
            for name in modules or tuple(MODULES):
                self._module_kernels(name)

    def state(self) -> dict:
        kernels = {name: function_loaded(kernel.kernel.ptr)
                   for loaded in self.modules.values() for name, kernel in loaded.items()}
        return {"mode": module_loading_mode(), "kernels": kernels}

    def _module_kernels(self, module: str) -> Dict[str, cupy.RawKernel]:
        loaded = self.modules.get(module)
        if loaded is None:
            raw = cupy.RawModule(code=module_source(module), options=KERNEL_OPTIONS)
            loaded = {}
            for name in MODULES[module].kernels:
                kernel = loaded[name] = raw.get_function(name)
                if self.preload:
                    finish_loading(kernel.kernel.ptr)
            self.modules[module] = loaded
        return loaded

    def kernel(self, name: str) -> cupy.RawKernel:
        kernel = self.kernels.get(name)
        if kernel is None:
            kernel = self.kernels[name] = self._module_kernels(module_of(name))[name]
        return kernel


class CudaBackend:
    """CuPy streams and events, pinned host buffers, and the pipeline RawKernels.

    device: the CUDA device (default: the current one). Every allocation, event and launch of this backend
    happens on it (the backend makes it current for the call and restores the previous one), and its
    kernels are compiled and loaded there; copies and stream waits need no current device.
    preload: compile (once per process; CuPy's disk cache after that) and fully load the step kernels now,
    and fully load every module when it is first loaded (load_kernels), so that no prepare_batch, eager or
    graph-capturing, loads a kernel while other work holds the device. False is the behaviour before
    that, kept to diagnose it: modules compile on first use, and the driver finishes loading a kernel
    only at its first launch or at the first instantiation of a graph that contains it.
    """

    name = "cuda"
    xp = cupy

    def __init__(self, preload: bool = True, device: Optional[int] = None):
        self.preload = bool(preload)
        self.device_id = cupy.cuda.Device(device).id
        with self.device_context():
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._context = driver.ctxGetCurrent()      # the device's primary context: its streams' (is_stream)
            # Made now, not at the first capture: that capture may come while another stream is held, and
            # nothing that can wait for the device may run then.
            self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        self._streams: "weakref.WeakSet[cupy.cuda.Stream]" = weakref.WeakSet()
        self._loaded = KernelModules(self.device_id, self.preload)
        self._graphs: dict = {}
        self._graph_buffers: dict = {}
        self._graph_keys: dict = {}     # a plan's buffer addresses -> a small int (its graphs' keys hash that)
        self._memo = Memo()
        self._copy_ptrs: dict = {}
        self._events: List[int] = []        # idle event handles of this device (CudaEvent)
        weakref.finalize(self, _destroy_events, self._events)
        # (event, objects): buffers that enqueued work may still read (pinned staging, inputs of a launch on
        # another stream); dropped once the event recorded after that work has completed. See keep_until.
        self._keep: List[tuple] = []
        if preload:
            self.load_kernels("step")

    def device_context(self) -> "DeviceScope":
        """`with backend.device_context():` makes this backend's device current for the block."""
        return DeviceScope(self.device_id)

    # -- streams and events --------------------------------------------------------------------
    def is_stream(self, obj) -> bool:
        """Whether obj is a stream this backend can enqueue on: a CuPy stream, or an external one, of this
        backend's device (an event of one device cannot be recorded on another's stream)."""
        return (isinstance(obj, (cupy.cuda.Stream, cupy.cuda.ExternalStream))
                and driver.streamGetCtx(obj.ptr) == self._context)

    def new_stream(self, name: str = "stream") -> cupy.cuda.Stream:
        """A non-blocking stream (so nothing is implicitly ordered with the legacy default stream)."""
        with self.device_context():
            stream = cupy.cuda.Stream(non_blocking=True)
        self._streams.add(stream)
        return stream

    def record(self, stream: cupy.cuda.Stream) -> CudaEvent:
        """An event recorded on `stream` (a stream of this backend's device), from this backend's pool."""
        pool = self._events
        try:
            event = CudaEvent(pool.pop(), pool)
        except IndexError:
            with self.device_context():     # an event belongs to the device current when it is made
                event = CudaEvent(pool=pool)
        return event.record(stream)

    def wait(self, stream: cupy.cuda.Stream, event) -> None:
        """Make `stream` wait for `event` (a CudaEvent or a cupy.cuda.Event)."""
        runtime.streamWaitEvent(stream.ptr, event.ptr)

    def gate(self, stream: cupy.cuda.Stream, timeout_s: float = GATE_TIMEOUT_S) -> CudaGate:
        """Enqueue a gate on `stream`: work enqueued after it runs only once gate.open() is called.

        While a gate spins, anything that synchronizes the device blocks the host until the gate opens or
        times out: cudaFreeHost, and loading a kernel (the first launch of any CuPy or torch kernel in the
        process, see load_kernels). Warm up every kernel the gated code uses before closing a gate.
        """
        self.load_kernels("gate")            # now, before anything is held
        ptr = _new_gate_words()
        gate = CudaGate(ptr)
        max_cycles = int(timeout_s * clock_rate_khz(self.device_id) * 1000)
        # Under unified addressing the host pointer of mapped pinned memory is valid on the device.
        with self.device_context():
            self._kernel("cupykv_gate")((1,), (1,), (np.uint64(ptr), np.uint64(ptr + 4), np.int64(max_cycles)),
                                        stream=stream)
        return gate

    def synchronize(self) -> None:
        """Wait (sleeping, not spinning) for the manager stream and every stream from new_stream()."""
        for stream in [self.stream, *list(self._streams)]:
            self.record(stream).synchronize()

    # -- memory --------------------------------------------------------------------------------
    def pinned_empty(self, words: int) -> np.ndarray:
        """A zeroed pinned int32 buffer. The caller must keep it alive as long as copies may read it:
        CuPy's pinned pool hands a dropped block to the next allocation at once."""
        return _zeros_pinned(words, np.int32)

    def pinned_temp(self, words: int) -> np.ndarray:
        """A fresh pinned buffer from CuPy's pool (only for the documented unsafe staging mode)."""
        return empty_pinned(words, np.int32)

    def device_empty(self, words: int) -> cupy.ndarray:
        """A zeroed device int32 buffer, initialised in order on the manager stream."""
        with self.device_context(), self.stream:
            return cupy.zeros(words, np.int32)

    def device_full(self, shape, value, dtype=np.int32) -> cupy.ndarray:
        with self.device_context(), self.stream:
            return cupy.full(shape, value, dtype)

    def to_numpy(self, arr) -> np.ndarray:
        """A host copy of `arr`, ordered after the work already enqueued on the manager stream."""
        if isinstance(arr, np.ndarray):
            return np.array(arr, copy=True)
        return cupy.asnumpy(arr, stream=self.stream)

    def upload(self, arr: np.ndarray) -> cupy.ndarray:
        """A device copy of a host array (set-up time only: this waits for the copy)."""
        host = np.ascontiguousarray(arr)
        with self.device_context(), self.stream:
            dev = cupy.empty(host.shape, host.dtype)
            dev.set(host, stream=self.stream)
        self.stream.synchronize()
        return dev

    # -- copies: enqueued on `stream`; each reads its source when it executes ------------------
    def copy_h2d(self, dst: cupy.ndarray, src: np.ndarray, words: int, stream: cupy.cuda.Stream) -> None:
        """Copy the first `words` int32 of pinned `src` into `dst`. `src` must not be written again
        until an event recorded after this copy has completed."""
        # Pointers are cached per (dst, src), but src only through a weak reference: holding it would keep
        # alive a pinned buffer its owner dropped, which is exactly what the unsafe mode's race tests need
        # to happen (and what a caller must not rely on).
        hit = self._copy_ptrs.get((id(dst), id(src)))
        if hit is None or hit[0]() is not src or hit[1] is not dst:
            if len(self._copy_ptrs) >= MEMO_ENTRIES:
                self._copy_ptrs.clear()
            hit = self._copy_ptrs[(id(dst), id(src))] = (weakref.ref(src), dst, dst.data.ptr, src.ctypes.data,
                                                         min(dst.size, src.size))
        _, _, dst_ptr, src_ptr, fits = hit
        if words > fits:
            raise ValueError(f"copy_h2d: {words} words do not fit (dst {dst.size}, src {src.size})")
        runtime.memcpyAsync(dst_ptr, src_ptr, words * 4, runtime.memcpyHostToDevice, stream.ptr)

    def pinned_bytes(self, nbytes: int) -> np.ndarray:
        """A zeroed pinned uint8 buffer, kept by the caller for as long as copies may touch it."""
        return _zeros_pinned(nbytes, np.uint8)

    def copy_bytes(self, dst, src, stream: cupy.cuda.Stream) -> None:
        """Copy contiguous `src` into contiguous `dst` (equal nbytes; pinned host or device arrays, either
        way) in `stream` order. The copy reads and writes when it runs: neither buffer may be touched
        until an event recorded after it has completed."""
        if dst.nbytes != src.nbytes or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError(f"copy_bytes: needs contiguous arrays of equal size ({dst.nbytes} vs {src.nbytes} B)")
        if src.nbytes:
            runtime.memcpyAsync(_address(dst), _address(src), src.nbytes, MEMCPY_DEFAULT, stream.ptr)

    def copy_runs(self, dst, src, runs, unit_bytes: int, stream: cupy.cuda.Stream) -> None:
        """For each (dst_start, src_start, n) of `runs` (disjoint), copy n units of unit_bytes from contiguous
        `src` to contiguous `dst` (pinned host or device; between host and device a host buffer that is not
        pinned raises ValueError), in `stream` order, the same rules as copy_bytes.

        Between host and device, either way, one cupykv_copy_runs launch (kernels/tier_copy.cu) moves every
        run with the SMs, which read or write the pinned buffer at its device address, not memcpys: a copy
        engine running a large device-to-host copy starts no other stream's copy in that direction until it
        is done (it would hold up an engine's per-step copies for the whole move), and a memcpy per run
        blocks the host once the stream's queue is full (80 ms for the 4100 runs of a fragmented 128k
        request; docs/host_profile.md in git history). The runs go to the kernel in a pinned buffer kept until an event
        after the launch has completed. Device to device or host to host, one memcpyAsync per run."""
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError("copy_runs: needs contiguous arrays")
        table = run_table(runs, unit_bytes, dst.nbytes, src.nbytes)
        if not len(table):
            return
        to_host, to_device = isinstance(dst, np.ndarray), isinstance(dst, cupy.ndarray)
        if (to_host and isinstance(src, cupy.ndarray)) or (to_device and isinstance(src, np.ndarray)):
            host = _address(dst if to_host else src)
            attributes = runtime.pointerGetAttributes(host)
            if attributes.type != MEMORY_TYPE_PINNED or attributes.devicePointer != host:
                raise ValueError("copy_runs: the host buffer is not pinned memory mapped at its own address "
                                 "(backend.pinned_bytes): the copy kernel reaches it at that address")
            self._copy_runs_by_kernel(dst, src, table, unit_bytes, stream,
                                      TIER_COPY_BLOCKS_TO_HOST if to_host else TIER_COPY_BLOCKS_TO_DEVICE)
        else:
            self._copy_runs_by_memcpy(dst, src, table, unit_bytes, stream)

    def _copy_runs_by_kernel(self, dst, src, table: np.ndarray, unit_bytes: int, stream: cupy.cuda.Stream,
                             blocks: int) -> None:
        """One cupykv_copy_runs launch of `blocks` blocks for a checked [num_runs, 3] table (run_table) in units."""
        pinned = empty_pinned(table.shape, np.int64)
        np.multiply(table, unit_bytes, out=pinned)           # byte offsets and sizes
        with self.device_context():
            self._kernel("cupykv_copy_runs")((blocks,), (TIER_COPY_THREADS,), (
                np.uint64(pinned.ctypes.data), np.int32(len(table)), np.uint64(_address(dst)),
                np.uint64(_address(src))), stream=stream)
        self.keep_until(self.record(stream), pinned)

    def _copy_runs_by_memcpy(self, dst, src, table: np.ndarray, unit_bytes: int, stream: cupy.cuda.Stream) -> None:
        """One memcpyAsync per run of a checked [num_runs, 3] table (run_table) in units."""
        dst_ptr, src_ptr = _address(dst), _address(src)
        for d, s, nbytes in (table * unit_bytes).tolist():
            runtime.memcpyAsync(dst_ptr + d, src_ptr + s, nbytes, MEMCPY_DEFAULT, stream.ptr)

    def copy_d2d(self, dst: cupy.ndarray, src: cupy.ndarray, stream: cupy.cuda.Stream) -> None:
        if dst.nbytes != src.nbytes or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError(f"copy_d2d: needs contiguous arrays of equal size ({dst.nbytes} vs {src.nbytes} B)")
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, runtime.memcpyDeviceToDevice, stream.ptr)

    # -- kernels -------------------------------------------------------------------------------
    def apply_deltas(self, stream: cupy.cuda.Stream, snap: cupy.ndarray, mirror: cupy.ndarray, consts,
                     num_cells: Optional[int] = None) -> None:
        """Apply the snapshot's table deltas to the device mirror [P, rows, B].

        num_cells only sizes the grid (the kernel reads the true count from the snapshot and grid-strides);
        None gives a fixed grid, for graph capture.
        """
        def check():
            _require_device(snap, "snap")
            _require_device(mirror, "mirror")
            return snap, mirror, np.int64(mirror.size)

        args = self._memo("apply_deltas", (snap, mirror), check)
        with self.device_context():
            self._kernel("cupykv_apply_deltas")((apply_grid(num_cells),), (STEP_THREADS,), args, stream=stream)

    def build_step(self, stream: cupy.cuda.Stream, snap: cupy.ndarray, mirror: cupy.ndarray, out: cupy.ndarray,
                   row_entry: cupy.ndarray, pages: cupy.ndarray, offsets: cupy.ndarray, consts, shared: bool,
                   mode: int = MODE_FULL, num_entries: Optional[int] = None, num_cells: Optional[int] = None,
                   num_tokens: Optional[int] = None) -> None:
        """The step's tables and write positions, in one launch after apply_deltas (see cupykv_build_step).

        out: PER_LAYER [L, max_batch, 2, B] or SHARED [P, max_batch, 2, B]; FULL mode rewrites rows
        [0, num_seqs) and writes the padding rows [num_seqs, pad_to) as BAD cells, DELTA mode the rebuilt
        entries and the changed cells of the others (the header decides; both modes also write the changed
        cells of rows held past the batch). A BAD cell holds BAD, or the null slot's page where
        consts.d_group_null names one for the group (write positions keep BAD either way). row_entry
        int32 [rows]: the entry each row was last written whole at. pages [L, capacity] /
        offsets [capacity]: where each new token's K/V goes. mode and the counts only size the grid; the
        kernel reads the truth from the snapshot, so a stale hint costs time, never correctness.
        num_tokens=None sizes the positions for the capacity.
        """
        planes, fixed = self._memo("build_step", (snap, mirror, out, row_entry, pages, offsets, consts, shared),
                                   lambda: self._step_launch_args(snap, mirror, out, row_entry, pages, offsets,
                                                                  consts, shared))
        table_blocks, pos_blocks = step_grid(planes, consts.num_groups, int(consts.max_blocks),
                                             int(consts.max_batch), int(pages.shape[1]), int(consts.num_layers),
                                             mode, num_entries, num_cells, num_tokens)
        args = fixed + (np.int32(table_blocks),)
        with self.device_context():
            self._kernel("cupykv_build_step")((table_blocks + pos_blocks,), (STEP_THREADS,), args, stream=stream)

    @staticmethod
    def _step_launch_args(snap, mirror, out, row_entry, pages, offsets, consts, shared: bool):
        """Check build_step's buffers; returns (planes, the launch arguments but the last)."""
        B, max_batch = int(consts.max_blocks), int(consts.max_batch)
        if B % QUAD_BLOCKS:
            raise ValueError(f"build_step: max_blocks={B} must be a multiple of {QUAD_BLOCKS}")
        _require_device(snap, "snap")
        _require_device(mirror, "mirror", align=16)
        _require_device(out, "out", align=16)
        _require_device(row_entry, "row_entry")
        _require_device(pages, "pages")
        _require_device(offsets, "offsets")
        _require_device(consts.d_group_null, "consts.d_group_null")
        _require_device(consts.d_group_layers, "consts.d_group_layers")
        if consts.d_group_layers.shape != (consts.num_groups + 1 + consts.num_layers,):
            raise ValueError(f"build_step: consts.d_group_layers has shape {consts.d_group_layers.shape}, "
                             f"expected ({consts.num_groups + 1 + consts.num_layers},) (Layout.group_layers)")
        if consts.d_group_null.shape != (consts.num_groups,):
            raise ValueError(f"build_step: consts.d_group_null has shape {consts.d_group_null.shape}, expected "
                             f"({consts.num_groups},) (each group's null slot, or BAD)")
        planes = consts.num_groups if shared else consts.num_layers
        if out.shape != (planes, max_batch, 2, B):
            raise ValueError(f"build_step: out has shape {out.shape}, expected {(planes, max_batch, 2, B)}")
        if row_entry.shape != (consts.rows,):
            raise ValueError(f"build_step: row_entry has shape {row_entry.shape}, expected {(consts.rows,)}")
        if pages.ndim != 2 or pages.shape[0] != consts.num_layers or offsets.shape != (pages.shape[1],):
            raise ValueError(f"build_step: pages {pages.shape} / offsets {offsets.shape} must be "
                             f"[{consts.num_layers}, capacity] / [capacity]")
        tpb = int(consts.tokens_per_block)
        if tpb <= 0 or tpb & (tpb - 1):
            raise ValueError(f"build_step: tokens_per_block={tpb} must be a power of two")
        fixed = (snap, mirror, out, row_entry, pages, offsets, consts.d_layer_koff,
                 consts.d_group_scale, consts.d_group_null, consts.d_group_layers, np.int32(consts.num_layers),
                 np.int32(consts.num_groups),
                 np.int32(consts.rows), np.int32(max_batch), np.int32(B), np.int32(pages.shape[1]), np.int32(tpb),
                 np.int32(1 if shared else 0))
        return planes, fixed

    def step_plan(self, twin, buffers: tuple, shared: bool) -> "CudaStepPlan":
        """The step launches for a ring-slot twin and a mirror's buffers, checked and packed once (see
        plan.StepPlan for the buffers; CudaStepPlan for what run() costs)."""
        return CudaStepPlan(self, twin, buffers, shared)

    capture_step_graphs = staticmethod(capture_step_graphs)     # (the module's function: it needs only the plans)

    @property
    def num_step_graphs(self) -> int:
        """Step graphs captured so far (each is kept for the life of the backend)."""
        return len(self._graphs)

    def write_kv(self, stream: cupy.cuda.Stream, pages: cupy.ndarray, offsets: cupy.ndarray, k: cupy.ndarray,
                 v: cupy.ndarray, dst: cupy.ndarray, num_tokens: int, tokens_per_block: int,
                 errors: cupy.ndarray) -> None:
        """dst[pages[t], offsets[t]] = k[t], dst[pages[t] + 1, offsets[t]] = v[t] for t < num_tokens.

        dst: a page view [num_pages, tpb, ...] (C-contiguous); k, v: C-contiguous [num_tokens, ...] of dst's
        dtype (2 or 4 bytes); pages, offsets: int32 rows of the write positions. Tokens whose page is out of
        range (BAD included) are skipped and counted in errors[0]. The caller keeps k and v alive until the
        launch has run (see keep_until).
        """
        _require_device(pages, "pages")
        _require_device(offsets, "offsets")
        _require_device(errors, "errors")
        for name, arr in (("k", k), ("v", v), ("dst", dst)):
            if not isinstance(arr, cupy.ndarray) or not arr.flags.c_contiguous or arr.dtype != dst.dtype:
                raise TypeError(f"write_kv: {name} must be a C-contiguous cupy array of dtype {dst.dtype}")
        n = int(num_tokens)
        row = int(np.prod(dst.shape[2:], dtype=np.int64))
        if k.size != n * row or v.size != n * row or pages.size < n or offsets.size < n:
            raise ValueError(f"write_kv: {n} tokens of {row} elements; k {k.shape}, v {v.shape}, "
                             f"pages {pages.shape}, offsets {offsets.shape}")
        if n == 0 or row == 0:
            return
        names = {2: "cupykv_write_kv_u16", 4: "cupykv_write_kv_u32"}
        if dst.itemsize not in names:
            raise TypeError(f"write_kv: element size {dst.itemsize} B is not supported (2 or 4)")
        blocks = min(max(-(-(n * row) // WRITE_KV_THREADS), 1), WRITE_KV_MAX_BLOCKS)
        args = (pages, offsets, k, v, dst, np.int32(n), np.int32(row), np.int32(tokens_per_block),
                np.int64(dst.shape[0]), errors)
        with self.device_context():
            self._kernel(names[dst.itemsize])((blocks,), (WRITE_KV_THREADS,), args, stream=stream)

    # -- lifetimes and small asynchronous transfers ---------------------------------------------
    def keep_until(self, event, *objs) -> None:
        """Keep `objs` alive until `event` (recorded after the last work that reads or writes them) has
        completed. CuPy's pools hand a dropped block to the next allocation at once, whatever work on another
        stream (or a pending DMA into pinned memory) still uses it."""
        self._keep = [(e, o) for e, o in self._keep if not e.done()]
        self._keep.append((event, objs))

    def upload_async(self, host: np.ndarray, stream: cupy.cuda.Stream, out: Optional[cupy.ndarray] = None):
        """Copy a small host array to the device in `stream` order, without blocking the host.

        Goes through a pinned staging buffer kept alive until the copy has run (a copy from pageable memory
        would wait for the stream to drain). Returns `out` (same size and dtype) or a new device array.
        """
        host = np.ascontiguousarray(host)
        if out is None:
            with self.device_context(), stream:
                out = cupy.empty(host.shape, host.dtype)
        elif not out.flags.c_contiguous or out.nbytes != host.nbytes:
            raise ValueError(f"upload_async: out must be contiguous with {host.nbytes} bytes")
        if host.nbytes:
            staging = empty_pinned(host.shape, host.dtype)
            staging[...] = host
            runtime.memcpyAsync(out.data.ptr, staging.ctypes.data, host.nbytes, runtime.memcpyHostToDevice,
                                stream.ptr)
            self.keep_until(self.record(stream), staging)
        return out

    def download_async(self, dev: cupy.ndarray, stream: cupy.cuda.Stream):
        """Start a device-to-host copy of `dev` in `stream` order. Returns (pinned host array, event): the host
        array holds the data once the event has completed; it is kept alive until then even if dropped."""
        if not dev.flags.c_contiguous:
            raise ValueError("download_async: needs a contiguous device array")
        host = empty_pinned(dev.shape, dev.dtype)
        if dev.nbytes:
            runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, dev.nbytes, runtime.memcpyDeviceToHost, stream.ptr)
        event = self.record(stream)
        self.keep_until(event, host, dev)
        return host, event

    # -- kernels -------------------------------------------------------------------------------
    def load_kernels(self, *modules: str) -> None:
        """Compile and fully load kernel modules now: 'step', 'kv_write', 'tier_copy', 'gate' (default: all).

        Compiling happens once per process (CuPy keeps the binary on disk and the module in memory);
        loading finishes each function on the device (finish_loading; not with preload=False), which may
        synchronize the context: call this while no stream of the process is held (before a gate, before
        long consumer work). A module not loaded here is loaded on the first use of one of its kernels.
        """
        self._loaded.load(*modules)

    def kernel_loading_state(self) -> dict:
        """Diagnostics: {'mode': module_loading_mode(), 'kernels': {kernel: fully loaded?}} for the modules
        this backend has loaded (None where the driver cannot tell)."""
        return self._loaded.state()

    def _kernel(self, name: str) -> cupy.RawKernel:
        """The named kernel; its module is compiled and loaded on first use (load_kernels)."""
        return self._loaded.kernel(name)
