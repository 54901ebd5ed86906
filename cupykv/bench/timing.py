"""How the benchmark times a step: the gate, the CUDA event timer, and the floors.

CudaTimer.measure(stream, call) holds `stream` with the backend's gate (backend.gate(stream)) while the
host enqueues `call`, so the device time between the two timing events around it is the GPU's work
alone, not the host's launch gaps; the gate opens right after the enqueue, so wall time is about
enqueue plus device time. The completion is observed by polling, so an OS wake-up of a sleeping wait is
not counted. HostTimer has the same interface for the host backend: host and wall times only.

Floors (GPU only): host, one memcpyAsync of 4 KiB plus one kernel launch; device, one contiguous
cudaMemsetAsync of a table's live output region.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

# A gate that nobody opens gives up after this long. It is opened right after each enqueue, so only an
# enqueue that waits for its own held stream (a sync inside it) runs into it; short, so that costs 1 s.
GATE_TIMEOUT_S = 1.0
# After this many timed-out gates, gating stops: some enqueue waits on its own stream every step.
MAX_GATE_TIMEOUTS = 8

_NOOP_SRC = r"""
extern "C" __global__ void cupykv_bench_noop(int* p) { if (threadIdx.x == 0 && p[0] == 0x7fffffff) p[0] = 0; }
"""


@dataclass
class Sample:
    """One timed call. device_us is None on the host backend and for a void (timed-out) gated sample."""
    host_us: float
    device_us: Optional[float]
    wall_us: float
    gate_ok: bool = True


Ready = Optional[Callable[[Any], Any]]      # result -> an event with done() and synchronize() (a step's ready)


class HostTimer:
    """The host backend's timer: no device times, no floors (the 'device' is the NumPy emulation)."""

    cuda = False
    timeouts = 0
    enabled = False

    def measure(self, stream, call: Callable[[], Any], ready: Ready = None) -> Tuple[Any, Sample]:
        """call(), then a wait for ready(result) when given; host = the call, wall = call and wait."""
        t0 = time.perf_counter()
        res = call()
        t1 = time.perf_counter()
        if ready is not None:
            ready(res).synchronize()
        t2 = time.perf_counter()
        return res, Sample((t1 - t0) * 1e6, None, (t2 - t0) * 1e6)

    def floor(self, live_bytes: int, reps: int, warmup: int = 5) -> Tuple[List[float], List[float], List[float]]:
        return [], [], []

    def close(self) -> None:
        pass


class CudaTimer:
    """Gate (the backend's) + timing events + floors for one run, on a CUDA backend."""

    cuda = True

    def __init__(self, backend, timeout_s: float = GATE_TIMEOUT_S):
        import cupy
        from cupy.cuda import runtime
        self.cupy, self.runtime = cupy, runtime
        self.backend = backend
        self.timeout_s = timeout_s
        self._noop = cupy.RawModule(code=_NOOP_SRC).get_function("cupykv_bench_noop")
        self.timeouts = 0
        self.enabled = True      # off after MAX_GATE_TIMEOUTS: some enqueue waits on its own stream every step
        self._ev = [cupy.cuda.Event() for _ in range(2)]
        # floor buffers
        self.fstream = cupy.cuda.Stream(non_blocking=True)
        self._small_host = None
        self._small_dev = None
        self._fbuf = None
        # The floor launches the no-op behind a closed gate: its first launch loads it, which would block
        # the host until the gate gives up. Load the gate's kernel and the no-op now, ungated.
        with self.fstream:
            probe = cupy.zeros(1, np.int32)
        self.backend.gate(self.fstream, timeout_s=self.timeout_s).open()
        self._noop((1,), (32,), (probe,), stream=self.fstream)
        self.fstream.synchronize()

    def close(self) -> None:
        try:
            self.cupy.cuda.Device().synchronize()
        except Exception:   # noqa: BLE001
            pass
        self._fbuf = None

    # -- the gate ------------------------------------------------------------------------------
    def _arm(self, stream):
        """Hold `stream` (a cupy stream) from here until the returned gate is opened (None: not gating)."""
        return self.backend.gate(stream, timeout_s=self.timeout_s) if self.enabled else None

    def _gate_ok(self, gate) -> bool:
        """Call after the gated work completed: False when the gate timed out before it was opened."""
        if gate is None or not gate.close_timeout_hit():
            return True
        # The enqueue waited for the held stream (a sync inside it, e.g. the first replay of a new step
        # graph): this sample is void. If that keeps happening, gating would cost a timeout per step,
        # so it stops, and device times from there on include the host's launch gaps.
        self.timeouts += 1
        self.enabled = self.timeouts < MAX_GATE_TIMEOUTS
        return False

    def elapsed_us(self, e0, e1) -> float:
        return self.cupy.cuda.get_elapsed_time(e0, e1) * 1e3

    # -- a timed call --------------------------------------------------------------------------
    def measure(self, stream, call: Callable[[], Any], ready: Ready = None) -> Tuple[Any, Sample]:
        """Time call(), which enqueues its work on `stream`: host = the call; device = between events
        recorded on `stream` before and after it, with the stream held while the host enqueues; wall =
        the call to the completion of ready(result) (or of the end event)."""
        e0, e1 = self._ev
        gate = self._arm(stream)
        try:
            e0.record(stream)
            t0 = time.perf_counter()
            res = call()
            t1 = time.perf_counter()
            e1.record(stream)
        finally:
            if gate is not None:
                gate.open()
        event = ready(res) if ready is not None else None
        if event is not None:
            while not event.done():      # poll: the completion, not a sleeping wait's wake-up
                pass
        else:
            while not e1.done:
                pass
        t2 = time.perf_counter()
        if event is not None:
            event.synchronize()
        e1.synchronize()
        ok = self._gate_ok(gate)
        return res, Sample((t1 - t0) * 1e6, self.elapsed_us(e0, e1) if ok else None, (t2 - t0) * 1e6, ok)

    # -- floors --------------------------------------------------------------------------------
    def floor(self, live_bytes: int, reps: int, warmup: int = 5) -> Tuple[List[float], List[float], List[float]]:
        """Host: memcpyAsync of 4 KiB pinned -> device plus one kernel launch. Device: a memsetAsync of
        live_bytes. Returns (host_us, device_us, wall_us) per rep."""
        cupy, rt, st = self.cupy, self.runtime, self.fstream
        import cupyx
        if self._small_host is None:
            self._small_host = cupyx.zeros_pinned(1024, np.int32)
            with st:
                self._small_dev = cupy.zeros(1024, np.int32)
        if self._fbuf is None or self._fbuf.nbytes < live_bytes:
            self._fbuf = None
            with st:
                self._fbuf = cupy.empty(max(live_bytes, 4) // 4 + 1, np.int32)
            st.synchronize()
        e0, e1 = self._ev
        host, dev, wall = [], [], []
        for i in range(warmup + reps):
            gate = self._arm(st)
            t0 = time.perf_counter()
            rt.memcpyAsync(self._small_dev.data.ptr, self._small_host.ctypes.data, 4096, rt.memcpyHostToDevice,
                           st.ptr)
            self._noop((1,), (32,), (self._small_dev,), stream=st)
            t1 = time.perf_counter()
            e0.record(st)
            rt.memsetAsync(self._fbuf.data.ptr, 0, live_bytes, st.ptr)
            e1.record(st)
            if gate is not None:
                gate.open()
            while not e1.done:
                pass
            t2 = time.perf_counter()
            e1.synchronize()
            if i >= warmup and self._gate_ok(gate):
                host.append((t1 - t0) * 1e6)
                dev.append(self.elapsed_us(e0, e1))
                wall.append((t2 - t0) * 1e6)
        return host, dev, wall


Timer = Union[CudaTimer, HostTimer]


def make_timer(backend) -> Timer:
    """The timer for a backend: CudaTimer (gated, with device times) on 'cuda', HostTimer otherwise."""
    return CudaTimer(backend) if backend.name == "cuda" else HostTimer()
