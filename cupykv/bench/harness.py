"""The benchmark harness behind `python -m cupykv.bench`.

One manager per (shape, max_seq_len, batch), driven by a realistic workload (lengths uniform in
[max_seq_len / 4, max_seq_len), a few requests finishing and arriving per step); every measured step is
timed for each contender on the same inputs, in the same run:

  cupykv          KVCacheManager.prepare_batch (snapshot of the deltas, one copy, the kernels).
  torch-eager     the reference system's path after its race fix (cupykv.bench.snapshot_path): fresh
  torch-compiled  pinned snapshots of copy_idx, the whole host table and the scratch metadata every step,
                  the conversion over the whole staging capacity, then num_seqs rows to the attention
                  buffer. Checked against cupykv's output every step and against cupykv.reference on
                  sampled rows, so the comparison is of equals.
  floor           host: one memcpyAsync of a few KB plus one kernel launch; device: one contiguous
                  cudaMemsetAsync of the live output region (L * num_seqs * 2 * B * 4 bytes).

Per step and contender: host enqueue time (the call, no sync), device time between two timing events
around the step's work, wall time from the call to the completion of its ready event (observed by
polling, so an OS wake-up of a sleeping wait is not counted), H2D bytes. On the GPU the stream is held
by a gate kernel while the host enqueues, so device time is the GPU's work alone, not the host's launch
gaps; the gate opens right after the enqueue, so wall time is about enqueue plus device time.

Cases: "decode" (decode steps right after max(1, batch/128) requests finished and as many arrived: 2 at
batch 256), "steady" (decode steps whose batch is the same as the previous step's; decode-only runs
alternate the two), "ctx" (decode plus `contexts` prefill chunks of `chunk` tokens each, scratch reuse
on; a prefill that completes joins the decode batch, a random decode request finishes, a new request
arrives). Arrivals of decode-only runs are prefilled in an untimed step; their frees are timed (the
schedule part of the host total). One manager serves every context variant of a (shape, seq, batch), with
max_batch = batch + max(contexts) + churn rows; the torch contender's staging capacity is that max_batch.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import reference
from ..layout import Layout, cdiv
from ..manager import KVCacheManager
from ..spec import CacheSpec

# --------------------------------------------------------------------------------------------------
# shapes and configurations


@dataclass(frozen=True)
class Shape:
    name: str
    windows: Tuple[Optional[int], ...]
    num_kv_heads: int
    head_dim: int


def _gemma3_27b_windows() -> tuple:
    # 62 layers, 5 sliding (window 1024) : 1 global
    return tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62))


SHAPES: Dict[str, Shape] = {
    "gpt-oss-20b": Shape("gpt-oss-20b", (128, None) * 12, 8, 64),
    "gpt-oss-120b": Shape("gpt-oss-120b", (128, None) * 18, 8, 64),
    "gemma-3-27b": Shape("gemma-3-27b", _gemma3_27b_windows(), 16, 128),
}
SMOKE_SHAPE = Shape("tiny", (16, None, 16, None), 1, 8)

CASES_DECODE_ONLY = ("decode", "steady")
CASES_CTX = ("ctx",)
ROW_KEYS = ("shape", "max_seq_len", "batch", "contexts", "case", "contender", "n", "host_us", "device_us",
            "wall_us", "h2d_bytes", "host_total_us", "floor_device_us", "floor_host_us", "device_vs_floor",
            "checked", "error")
STAT_KEYS = ("median", "p10", "p90", "max")


@dataclass
class Settings:
    shapes: Sequence[str]
    seqs: Sequence[int]
    batches: Sequence[int]
    contexts: Sequence[int]
    steps: int = 100
    warmup: int = 30
    chunk: int = 8192
    tpb: int = 32
    backend: str = "auto"
    torch: bool = True
    compile: bool = True
    seed: int = 0
    out: Optional[str] = "bench_out"
    smoke: bool = False
    command: str = ""
    plot: bool = True


def config_rows(settings: Settings) -> List[dict]:
    """Every (shape, seq, batch, contexts, case) the settings ask for, in run order."""
    out = []
    for shape in settings.shapes:
        for seq in settings.seqs:
            for batch in settings.batches:
                for nctx in settings.contexts:
                    for case in (CASES_CTX if nctx else CASES_DECODE_ONLY):
                        out.append(dict(shape=shape, max_seq_len=seq, batch=batch, contexts=nctx, case=case))
    return out


# --------------------------------------------------------------------------------------------------
# statistics and small helpers


def stats(values) -> Optional[dict]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    a = np.asarray(vals, np.float64)
    return dict(median=float(np.median(a)), p10=float(np.percentile(a, 10)), p90=float(np.percentile(a, 90)),
                max=float(a.max()))


def _versions(backend_name: str) -> dict:
    v = dict(python=sys.version.split()[0], numpy=np.__version__, platform=platform.platform())
    try:
        from .. import __version__
        v["cupykv"] = __version__
    except Exception:   # noqa: BLE001
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
        if rev.returncode == 0:
            v["git"] = rev.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except Exception:   # noqa: BLE001
        pass
    # A copied working tree may carry an older .git; whoever runs the benchmark can name the source tree.
    if os.environ.get("CUPYKV_SOURCE_REV"):
        v["git"] = os.environ["CUPYKV_SOURCE_REV"]
    try:
        import cupy
        v["cupy"] = cupy.__version__
        if backend_name == "cuda":
            rt = cupy.cuda.runtime
            v["cuda_runtime"] = rt.runtimeGetVersion()
            v["cuda_driver"] = rt.driverGetVersion()
            name = rt.getDeviceProperties(cupy.cuda.Device().id)["name"]
            v["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:   # noqa: BLE001
        pass
    try:
        import torch
        v["torch"] = torch.__version__
        if torch.cuda.is_available():
            v["torch_cuda"] = torch.version.cuda
    except Exception:   # noqa: BLE001
        pass
    return v


# --------------------------------------------------------------------------------------------------
# GPU timing tools: a gate that holds a stream while the host enqueues, timing events, the floors

_GATE_SRC = r"""
extern "C" __global__ void cupykv_bench_gate(volatile int* flag, int* timed_out, long long max_cycles)
{
    const long long t0 = clock64();
    while (flag[0] == 0) {
        if (clock64() - t0 > max_cycles) { timed_out[0] = 1; return; }
    }
}
extern "C" __global__ void cupykv_bench_noop(int* p) { if (threadIdx.x == 0 && p[0] == 0x7fffffff) p[0] = 0; }
"""


MAX_GATE_TIMEOUTS = 8


class CudaTimer:
    """Gate + timing events for one run. The gate's flag lives in mapped pinned memory, allocated once."""

    def __init__(self, timeout_s: float = 1.0):
        import cupy
        from cupy.cuda import runtime
        self.cupy, self.runtime = cupy, runtime
        mod = cupy.RawModule(code=_GATE_SRC)
        self._gate = mod.get_function("cupykv_bench_gate")
        self._noop = mod.get_function("cupykv_bench_noop")
        self._ptr = runtime.hostAlloc(8, runtime.hostAllocMapped | runtime.hostAllocPortable)
        self._flag = ctypes.c_int.from_address(self._ptr)
        self._timed_out = ctypes.c_int.from_address(self._ptr + 4)
        try:
            khz = int(runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, cupy.cuda.Device().id))
        except Exception:   # noqa: BLE001
            khz = 0
        self._cycles = np.int64(timeout_s * (khz if khz > 0 else 2_000_000) * 1000)
        self.timeouts = 0
        self.enabled = True      # off after MAX_GATE_TIMEOUTS: some enqueue waits on its own stream every step
        # floor buffers
        self.fstream = cupy.cuda.Stream(non_blocking=True)
        self._small_host = None
        self._small_dev = None
        self._fbuf = None
        self._ev = [cupy.cuda.Event() for _ in range(2)]

    def close(self) -> None:
        if self._ptr:
            try:
                self.cupy.cuda.Device().synchronize()
                self.runtime.freeHost(self._ptr)
            except Exception:   # noqa: BLE001
                pass
            self._ptr = 0

    def arm(self, stream) -> None:
        """Hold `stream` (a cupy stream) at this point until open()."""
        if not self.enabled:
            return
        self._flag.value = 0
        self._timed_out.value = 0
        self._gate((1,), (1,), (np.uint64(self._ptr), np.uint64(self._ptr + 4), self._cycles), stream=stream)

    def open(self) -> bool:
        """Release the stream; returns False when the gate had already given up (the sample is void)."""
        self._flag.value = 1
        return True

    def gate_ok(self) -> bool:
        """Call after the gated work completed: False when the gate timed out before open()."""
        bad = self.enabled and self._timed_out.value != 0
        if bad:
            # The enqueue waited for the held stream (a sync inside it, e.g. the first replay of a new step
            # graph): this sample is void. If that keeps happening, gating would cost a timeout per step,
            # so it stops, and device times from there on include the host's launch gaps.
            self.timeouts += 1
            self.enabled = self.timeouts < MAX_GATE_TIMEOUTS
        return not bad

    @staticmethod
    def event():
        import cupy
        return cupy.cuda.Event()

    def elapsed_us(self, e0, e1) -> float:
        return self.cupy.cuda.get_elapsed_time(e0, e1) * 1e3

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
            self.arm(st)
            t0 = time.perf_counter()
            rt.memcpyAsync(self._small_dev.data.ptr, self._small_host.ctypes.data, 4096, rt.memcpyHostToDevice,
                           st.ptr)
            self._noop((1,), (32,), (self._small_dev,), stream=st)
            t1 = time.perf_counter()
            e0.record(st)
            rt.memsetAsync(self._fbuf.data.ptr, 0, live_bytes, st.ptr)
            e1.record(st)
            self.open()
            while not e1.done:
                pass
            t2 = time.perf_counter()
            e1.synchronize()
            if i >= warmup and self.gate_ok():
                host.append((t1 - t0) * 1e6)
                dev.append(self.elapsed_us(e0, e1))
                wall.append((t2 - t0) * 1e6)
        return host, dev, wall

    def free_floor_buffer(self) -> None:
        self._fbuf = None


# --------------------------------------------------------------------------------------------------
# contender 2: the reference system's snapshot path in torch


class TorchContender:
    """FullSnapshotPath eager or compiled, timed on its own torch stream."""

    def __init__(self, name: str, mgr: KVCacheManager, max_scratch_width: int, compile: bool, timer):
        import torch
        from .snapshot_path import FullSnapshotPath
        self.torch = torch
        self.name = name
        self.timer = timer
        lay = mgr.layout
        self.cuda = mgr.backend.name == "cuda"
        device = "cuda" if self.cuda else "cpu"
        self.path = FullSnapshotPath(lay.num_layers, lay.num_groups, mgr.spec.max_batch, mgr.spec.max_batch,
                                     lay.max_blocks, lay.layer_group, lay.layer_koff, lay.group_scale,
                                     max_scratch_width, device=device, compile=compile)
        self.max_scratch_width = max_scratch_width
        if self.cuda:
            import cupy
            self.stream = torch.cuda.Stream()
            self.cp_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream)
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e1 = torch.cuda.Event(enable_timing=True)
            self.mgr_out = torch.from_dlpack(mgr.out)         # zero-copy view of cupykv's output
        else:
            self.stream = None
            self.mgr_out = torch.from_numpy(mgr.out)

    def warm(self, mgr: KVCacheManager, rows) -> None:
        """One ungated call (compiles when compiled) and a wait."""
        if self.cuda:
            with self.torch.cuda.stream(self.stream):
                self.path.step(mgr.table, rows, 0)
            self.stream.synchronize()
        else:
            self.path.step(mgr.table, rows, 0)

    def run(self, mgr: KVCacheManager, step) -> dict:
        """Time one step on the inputs of cupykv's `step` (the host table is as it was at its prepare)."""
        args = (mgr.table, step.rows, step.num_contexts, step.scratch_begs, step.scratch_ends, step.scratch_slots)
        if step.scratch_slots is not None and step.scratch_slots.shape[2] > self.max_scratch_width:
            raise ValueError(f"scratch width {step.scratch_slots.shape[2]} > {self.max_scratch_width}")
        if not self.cuda:
            t0 = time.perf_counter()
            res = self.path.step(*args)
            t1 = time.perf_counter()
            return dict(host_us=(t1 - t0) * 1e6, device_us=None, wall_us=(t1 - t0) * 1e6,
                        h2d_bytes=self.path.h2d_bytes_last_step, out=res, ok=True)
        torch, tm = self.torch, self.timer
        with torch.cuda.stream(self.stream):
            tm.arm(self.cp_stream)
            self.e0.record(self.stream)
            t0 = time.perf_counter()
            res = self.path.step(*args)
            t1 = time.perf_counter()
            self.e1.record(self.stream)
        tm.open()
        while not self.e1.query():      # poll: the completion, not a sleeping wait's wake-up
            pass
        t2 = time.perf_counter()
        self.e1.synchronize()
        ok = tm.gate_ok()
        return dict(host_us=(t1 - t0) * 1e6, device_us=self.e0.elapsed_time(self.e1) * 1e3 if ok else None,
                    wall_us=(t2 - t0) * 1e6, h2d_bytes=self.path.h2d_bytes_last_step, out=res, ok=ok)

    def equals_cupykv(self, res, n: int) -> bool:
        return bool(self.torch.equal(res, self.mgr_out[:, :n]))


def torch_status(settings: Settings, backend_name: str) -> Tuple[bool, str]:
    if not settings.torch:
        return False, "torch contender disabled (--no-torch)"
    try:
        import torch
    except Exception as exc:   # noqa: BLE001
        return False, f"torch is not installed ({type(exc).__name__}: {exc}); torch contenders skipped " \
                      f"(pip install 'cupykv[torch]')"
    if backend_name == "cuda" and not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no usable CUDA; torch contenders skipped"
    return True, f"torch {torch.__version__}"


def _reset_dynamo() -> None:
    try:
        import torch
        torch._dynamo.reset()
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    except Exception:   # noqa: BLE001
        pass


# --------------------------------------------------------------------------------------------------
# the workload


class Workload:
    """A manager for one (shape, max_seq_len, batch) and the requests that drive it."""

    def __init__(self, shape: Shape, max_seq_len: int, batch: int, max_ctx: int, settings: Settings,
                 rng: np.random.Generator):
        self.shape, self.max_seq_len, self.batch, self.max_ctx = shape, max_seq_len, batch, max_ctx
        self.settings, self.rng = settings, rng
        self.chunk = settings.chunk
        self.churn_k = max(1, round(batch / 128))     # finished = arrived per churn step: 2 at batch 256
        rows = batch + max_ctx + self.churn_k
        tpb = settings.tpb
        max_step_tokens = max(2 * max_seq_len, max_ctx * self.chunk + rows)
        probe = Layout(CacheSpec(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads,
                                 head_dim=shape.head_dim, tokens_per_block=tpb, max_seq_len=max_seq_len,
                                 max_batch=rows, slots_per_group=1))
        B = probe.max_blocks
        slots = []
        for g in probe.groups:
            if g.window is None:
                n = (rows + self.churn_k + max_ctx) * B + 64
            else:
                keep = cdiv(g.window, tpb) + 4 + probe.sink_blocks(g)
                scratch = probe.scratch_slots_needed(g, cdiv(max_step_tokens, tpb) + 2 * rows)
                n = 2 * rows * keep + 2 * scratch + 256
            slots.append(int(n))
        self.spec = CacheSpec(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads,
                              head_dim=shape.head_dim, tokens_per_block=tpb, max_seq_len=max_seq_len,
                              max_batch=rows, slots_per_group=slots, swa_scratch_reuse=True,
                              max_step_tokens=max_step_tokens)
        self.mgr = KVCacheManager(self.spec, backend=settings.backend)
        self.lay = self.mgr.layout
        # scratch width of a context chunk of `chunk` tokens (one block more for an unaligned start)
        self.scratch_width = max([self.lay.scratch_slots_needed(g, cdiv(self.chunk, tpb) + 1)
                                  for g in self.lay.groups if g.window is not None] or [1])
        self.scratch_width = max(self.scratch_width, 1)
        total = 2 * (settings.warmup + settings.steps) + 16
        self.len_lo = max(1, max_seq_len // 4)
        self.len_hi = max_seq_len - total
        if self.len_hi <= self.len_lo:
            raise ValueError(f"max_seq_len={max_seq_len} leaves no room for {total} decode steps; use fewer steps")
        self.next_rid = 0
        self.decode: List[int] = []
        self.prefilling: List[int] = []

    # -- requests ------------------------------------------------------------------------------
    def new_len(self) -> int:
        return int(self.rng.integers(self.len_lo, self.len_hi))

    def add(self, n: int) -> List[Tuple[int, int]]:
        out = []
        for _ in range(n):
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            ln = self.new_len()
            self.mgr.add(rid, ln)
            out.append((rid, ln))
        return out

    def untimed_step(self, contexts=None, generation=()) -> None:
        step = self.mgr.prepare_batch(contexts=contexts or {}, generation=list(generation))
        step.ready.synchronize()
        step.finish()
        self.mgr.settle(step)

    def prefill(self, items: List[Tuple[int, int]]) -> None:
        """Untimed: (request, tokens) as large context chunks, packed up to max_step_tokens per step."""
        cap = self.spec.step_token_capacity
        pending = [(rid, ln) for rid, ln in items]
        while pending:
            ctx, tokens = {}, 0
            while pending and (not ctx or tokens + pending[0][1] <= cap):
                rid, ln = pending.pop(0)
                ctx[rid] = ln
                tokens += ln
            self.untimed_step(ctx)
        self.mgr.synchronize()

    def setup_decode(self) -> None:
        self.decode = [rid for rid, _ in self.add_and_prefill(self.batch)]

    def add_and_prefill(self, n: int) -> List[Tuple[int, int]]:
        items = self.add(n)
        self.prefill(items)
        return items

    def setup_contexts(self, n: int) -> None:
        """n requests in prefill, staggered: each already has a random number of chunks done."""
        items = self.add(n)
        self.prefilling = [rid for rid, _ in items]
        ahead = {}
        for rid, ln in items:
            chunks = int(self.rng.integers(0, cdiv(ln, self.chunk)))
            if chunks:
                ahead[rid] = chunks * self.chunk
        self.prefill(list(ahead.items()))

    def remaining(self, rid) -> int:
        r = self.mgr.request(rid)
        return r.prompt_len - r.capacity

    # -- per-step scheduling ---------------------------------------------------------------------
    def pre_churn_decode_only(self, i: int) -> Optional[List[int]]:
        """Untimed part of a decode-only step: on churn steps, the arrivals are added and prefilled.
        Returns the positions in the decode list they replace (None: a steady step)."""
        if i % 2:
            return None
        k = min(self.churn_k, len(self.decode))
        pos = sorted(int(p) for p in self.rng.choice(len(self.decode), size=k, replace=False))
        self._arrivals = [rid for rid, _ in self.add_and_prefill(k)]
        return pos

    def schedule_decode_only(self, pos: Optional[List[int]]) -> Tuple[dict, List[int], str]:
        """Timed: the finished requests are freed and the batch is built."""
        if pos is None:
            return {}, list(self.decode), "steady"
        for p, new in zip(pos, self._arrivals):
            self.mgr.free(self.decode[p])
            self.decode[p] = new
        return {}, list(self.decode), "decode"

    def schedule_ctx(self) -> Tuple[dict, List[int], str]:
        """Timed: prefills that completed join the decode batch (a random decode request finishes and
        is freed for each) and new arrivals take their place; every prefilling request gets a chunk."""
        for k, rid in enumerate(self.prefilling):
            if self.remaining(rid) == 0:
                p = int(self.rng.integers(len(self.decode))) if self.decode else None
                if p is None:
                    self.decode.append(rid)
                else:
                    self.mgr.free(self.decode[p])
                    self.decode[p] = rid
                rid_new, self.next_rid = self.next_rid, self.next_rid + 1
                self.mgr.add(rid_new, self.new_len())
                self.prefilling[k] = rid_new
        ctx = {rid: min(self.chunk, self.remaining(rid)) for rid in self.prefilling}
        return ctx, list(self.decode), "ctx"

    def close(self) -> None:
        try:
            self.mgr.synchronize()
        except Exception:   # noqa: BLE001
            pass


# --------------------------------------------------------------------------------------------------
# checks against the NumPy reference


def _read_rows(mgr: KVCacheManager, sel: np.ndarray) -> np.ndarray:
    """out[:, sel] as numpy, ordered after the manager stream's work."""
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
    still holds), from a copy of their table rows taken at the step's prepare."""
    lay = mgr.layout
    nctx = int(np.sum(sel < step.num_contexts))
    return reference.convert_per_layer(table_sub, np.arange(len(sel)), nctx, step.scratch_begs[:, sel[:nctx]],
                                       step.scratch_ends[:, sel[:nctx]], step.scratch_slots[:, sel[:nctx]],
                                       lay.layer_group, lay.group_scale, lay.layer_koff, max_batch=len(sel))


def pick_rows(rng, num_seqs: int, num_contexts: int, num_layers: int, full: bool) -> np.ndarray:
    """Every context plus a sample of decode entries (all when `full`), sorted."""
    if full or num_seqs * num_layers <= 2048:
        return np.arange(num_seqs)
    k = min(num_seqs - num_contexts, 12)
    gen = rng.choice(np.arange(num_contexts, num_seqs), size=k, replace=False) if k > 0 else []
    return np.sort(np.concatenate([np.arange(num_contexts), np.asarray(gen, np.int64)])).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# the run


class Recorder:
    """Samples per (case, contender) for one (shape, seq, batch)."""

    def __init__(self):
        self.samples: Dict[Tuple[str, str], Dict[str, list]] = {}
        self.checks: Dict[Tuple[str, str], List[int]] = {}     # [checks done, mismatches]
        self.errors: Dict[Tuple[str, str], str] = {}

    def add(self, case: str, contender: str, **vals) -> None:
        d = self.samples.setdefault((case, contender), {})
        for k, v in vals.items():
            d.setdefault(k, []).append(v)

    def check(self, case: str, contender: str, ok: bool) -> None:
        c = self.checks.setdefault((case, contender), [0, 0])
        c[0] += 1
        c[1] += (not ok)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_shape(settings: Settings, shape: Shape, seq: int, batch: int, rng, timer, use_torch: bool,
              messages: List[str]) -> List[dict]:
    """All context variants of one (shape, seq, batch) on one manager; returns the result rows."""
    ctx_list = list(settings.contexts)
    wl = Workload(shape, seq, batch, max(ctx_list), settings, rng)
    mgr, lay = wl.mgr, wl.lay
    cuda = mgr.backend.name == "cuda"
    B, L = lay.max_blocks, lay.num_layers
    t_setup = time.perf_counter()
    wl.setup_decode()
    setup_s = time.perf_counter() - t_setup
    rec = Recorder()
    contenders: List[TorchContender] = []
    if use_torch:
        kinds = [("torch-eager", False)] + ([("torch-compiled", True)] if settings.compile else [])
        for name, comp in kinds:
            try:
                if comp:
                    _reset_dynamo()
                c = TorchContender(name, mgr, wl.scratch_width, comp, timer)
                t0 = time.perf_counter()
                c.warm(mgr, np.array([mgr.request(r).row for r in wl.decode], np.int32))
                if comp:
                    messages.append(f"{shape.name} {seq} {batch}: torch.compile warm-up "
                                    f"{time.perf_counter() - t0:.1f} s")
                contenders.append(c)
            except Exception as exc:   # noqa: BLE001
                for nctx in ctx_list:
                    for case in (CASES_CTX if nctx else CASES_DECODE_ONLY):
                        rec.errors[(case, name)] = f"{type(exc).__name__}: {exc}"[:300]
                messages.append(f"{shape.name} {seq} {batch}: {name} unavailable: {type(exc).__name__}: {exc}"[:300])
    e0 = e1 = None
    if cuda:
        e0, e1 = timer.event(), timer.event()
    floors: Dict[int, Tuple[list, list, list]] = {}
    for nctx in ctx_list:
        if nctx:
            wl.setup_contexts(nctx)
        num_seqs = batch + nctx
        live = L * num_seqs * 2 * B * 4
        floors[nctx] = timer.floor(live, min(settings.steps, 50)) if cuda else ([], [], [])
        full_check_done = False
        for i in range(settings.warmup + settings.steps):
            measured = i >= settings.warmup
            j = i - settings.warmup
            # schedule (the untimed prefill of decode-only arrivals first)
            pos = wl.pre_churn_decode_only(i) if not nctx else None
            ts0 = time.perf_counter()
            ctx, gen, case = wl.schedule_ctx() if nctx else wl.schedule_decode_only(pos)
            ts1 = time.perf_counter()
            # cupykv; every other pair of steps with its step graphs (use_graphs), same workload
            graphs = cuda and (i // 2) % 2 == 1
            mgr.use_graphs = graphs
            name = "cupykv-graphs" if graphs else "cupykv"
            if cuda:
                timer.arm(mgr.backend.stream)
                e0.record(mgr.backend.stream)
            t0 = time.perf_counter()
            step = mgr.prepare_batch(contexts=ctx, generation=gen)
            t1 = time.perf_counter()
            if cuda:
                e1.record(mgr.backend.stream)
                timer.open()
                while not step.ready.done():     # poll: the completion, not a sleeping wait's wake-up
                    pass
            step.ready.synchronize()
            t2 = time.perf_counter()
            h2d = mgr.h2d_bytes_last_step
            dev = None
            gate_ok = True
            if cuda:
                e1.synchronize()
                gate_ok = timer.gate_ok()
                dev = timer.elapsed_us(e0, e1) if gate_ok else None
            n = step.num_seqs
            # reference check on sampled steps: copy the selected rows of the table as at prepare
            # sampled steps: four in a row every 20, so each case and each cupykv variant is checked
            check_now = measured and (settings.smoke or j % 20 < 4)
            sel = table_sub = None
            if check_now:
                sel = pick_rows(rng, n, step.num_contexts, L, full=not full_check_done and n * L <= 40000)
                full_check_done = full_check_done or len(sel) == n
                table_sub = mgr.table[:, step.rows[sel]].copy()
            # contenders on the same inputs
            con_results = []
            for c in contenders:
                try:
                    r = c.run(mgr, step)
                    eq = c.equals_cupykv(r["out"], n)
                    con_results.append((c, r, eq))
                except Exception as exc:   # noqa: BLE001
                    rec.errors[(case, c.name)] = f"{type(exc).__name__}: {exc}"[:300]
            if check_now:
                want = expected_rows(mgr, table_sub, step, sel)
                got = _read_rows(mgr, sel)
                rec.check(case, name, np.array_equal(got, want))
                for c, r, eq in con_results:
                    got_c = (r["out"][:, sel.tolist()].cpu().numpy() if c.cuda else r["out"].numpy()[:, sel])
                    rec.check(case, c.name, np.array_equal(got_c, want))
            ts2 = time.perf_counter()
            step.finish()
            mgr.settle(step)
            ts3 = time.perf_counter()
            if measured:
                rec.add(case, name, host_us=(t1 - t0) * 1e6, device_us=dev, wall_us=(t2 - t0) * 1e6,
                        h2d_bytes=h2d, host_total_us=((ts1 - ts0) + (t1 - t0) + (ts3 - ts2)) * 1e6,
                        gate_ok=gate_ok)
                for c, r, eq in con_results:
                    rec.add(case, c.name, host_us=r["host_us"], device_us=r["device_us"], wall_us=r["wall_us"],
                            h2d_bytes=r["h2d_bytes"], gate_ok=r["ok"])
                    rec.check(case, c.name, eq)
            for c, r, eq in con_results:
                r["out"] = None
    wl.close()
    rows = []
    for nctx in ctx_list:
        fh, fd, fw = floors[nctx]
        floor_dev = stats(fd)
        floor_host = stats(fh)
        for case in (CASES_CTX if nctx else CASES_DECODE_ONLY):
            base = dict(shape=shape.name, max_seq_len=seq, batch=batch, contexts=nctx, case=case,
                        num_layers=L, num_groups=lay.num_groups, max_blocks=B, max_batch=mgr.spec.max_batch,
                        num_seqs=batch + nctx, live_bytes=live_bytes(L, batch + nctx, B),
                        churn_per_step=wl.churn_k if not nctx else None)
            fmed = floor_dev["median"] if floor_dev else None
            mine = ["cupykv", "cupykv-graphs"] if cuda else ["cupykv"]
            for name in mine + [c.name for c in contenders] + \
                    [k[1] for k in rec.errors if k[0] == case and k[1] not in [c.name for c in contenders]]:
                s = rec.samples.get((case, name), {})
                dv = stats(s.get("device_us", []))
                chk = rec.checks.get((case, name), [0, 0])
                row = dict(base, contender=name, n=len(s.get("host_us", [])), host_us=stats(s.get("host_us", [])),
                           device_us=dv, wall_us=stats(s.get("wall_us", [])), h2d_bytes=stats(s.get("h2d_bytes", [])),
                           host_total_us=stats(s.get("host_total_us", [])) if name in mine else None,
                           floor_device_us=fmed, floor_host_us=floor_host["median"] if floor_host else None,
                           device_vs_floor=(dv["median"] / fmed) if (dv and fmed) else None,
                           checked=(chk[1] == 0) if chk[0] else None, checks=chk[0], mismatches=chk[1],
                           error=rec.errors.get((case, name)),
                           gate_timeouts=int(sum(not g for g in s.get("gate_ok", []))))
                rows.append(row)
            rows.append(dict(base, contender="floor", n=len(fd) if fd else len(fh), host_us=floor_host,
                             device_us=floor_dev, wall_us=stats(fw),
                             h2d_bytes=stats([4096] * len(fh)) if fh else None, host_total_us=None,
                             floor_device_us=fmed, floor_host_us=floor_host["median"] if floor_host else None,
                             device_vs_floor=1.0 if fmed else None, checked=None, checks=0, mismatches=0,
                             error=None if cuda else "floors are GPU timings; not measured on the host backend"))
    for c in contenders:
        c.path = None
    del contenders
    _log(f"  setup {setup_s:.1f} s")
    return rows


def _error_row(shape: str, seq: int, batch: int, nctx: int, case: str, why: str) -> dict:
    row = {k: None for k in ROW_KEYS}
    row.update(shape=shape, max_seq_len=seq, batch=batch, contexts=nctx, case=case, contender="cupykv", n=0,
               checked=False, checks=0, mismatches=0, error=why)
    return row


def live_bytes(num_layers: int, num_seqs: int, max_blocks: int) -> int:
    return num_layers * num_seqs * 2 * max_blocks * 4


def _free_device_memory() -> None:
    import gc
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:   # noqa: BLE001
        pass
    try:
        import cupy
        if cupy.is_available():
            cupy.cuda.Device().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
    except Exception:   # noqa: BLE001
        pass


def evaluate_targets(rows: List[dict]) -> List[dict]:
    """The issue's targets, evaluated on the cupykv rows (reported, never asserted)."""
    out = []
    for r in rows:
        if r["contender"] not in ("cupykv", "cupykv-graphs") or not r["host_us"]:
            continue
        cfg = f"{r['shape']} {r['max_seq_len'] // 1024}k b{r['batch']} c{r['contexts']} {r['case']} {r['contender']}"
        if r["case"] == "decode" and r["device_us"] and r["floor_device_us"]:
            limit = 1.3 * r["floor_device_us"] + 10.0
            out.append(dict(target="device <= 1.3 x floor + 10 us", config=cfg, value=r["device_us"]["median"],
                            limit=limit, unit="us", ok=r["device_us"]["median"] <= limit))
        if r["batch"] >= 256 and r["case"] == "decode":
            out.append(dict(target="prepare_batch host enqueue < 50 us (batch 256)", config=cfg,
                            value=r["host_us"]["median"], limit=50.0, unit="us", ok=r["host_us"]["median"] < 50.0))
            out.append(dict(target="schedule + prepare + settle < 300 us (batch 256)", config=cfg,
                            value=r["host_total_us"]["median"], limit=300.0, unit="us",
                            ok=r["host_total_us"]["median"] < 300.0))
            out.append(dict(target="H2D bytes per decode step < 64 KB (batch 256, p90)", config=cfg,
                            value=r["h2d_bytes"]["p90"], limit=65536, unit="B", ok=r["h2d_bytes"]["p90"] < 65536))
    return out


def run(settings: Settings) -> dict:
    """Run the whole matrix; returns the result dict (also written to settings.out when set)."""
    from ..backends import make_backend
    started = time.perf_counter()
    probe_backend = make_backend(settings.backend)
    backend_name = probe_backend.name
    del probe_backend
    settings.backend = backend_name
    messages: List[str] = []
    # Inductor's pool of compile worker processes competes for the CPUs with the host side being timed
    # (torch's multi-threaded CPU copies slowed by ~6 ms per step while the pool started): compile in
    # process instead. Set before torch is imported; an explicit setting wins.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    use_torch, torch_msg = torch_status(settings, backend_name)
    messages.append(torch_msg if use_torch else f"NOTE: {torch_msg}; running cupykv and the floors only")
    if backend_name != "cuda":
        messages.append("host backend: device times and floors are not measurable (reported as None); "
                        "host and wall times are of the NumPy emulation")
    timer = CudaTimer() if backend_name == "cuda" else None
    rng = np.random.default_rng(settings.seed)
    shapes = [SMOKE_SHAPE] if settings.smoke else [SHAPES[s] for s in settings.shapes]
    rows: List[dict] = []
    failures: List[str] = []
    try:
        for shape in shapes:
            for seq in settings.seqs:
                for batch in settings.batches:
                    t0 = time.perf_counter()
                    _log(f"{shape.name} max_seq_len={seq} batch={batch} contexts={list(settings.contexts)} ...")
                    try:
                        rows += run_shape(settings, shape, seq, batch, rng, timer, use_torch, messages)
                    except Exception as exc:   # noqa: BLE001 - report it, run the other shapes
                        import traceback
                        traceback.print_exc()
                        why = f"{type(exc).__name__}: {exc}"[:400]
                        failures.append(f"{shape.name} {seq} {batch}: {why}")
                        messages.append(f"ERROR {shape.name} max_seq_len={seq} batch={batch}: {why}")
                        for nctx in settings.contexts:
                            for case in (CASES_CTX if nctx else CASES_DECODE_ONLY):
                                rows.append(_error_row(shape.name, seq, batch, nctx, case, why))
                    _log(f"  done in {time.perf_counter() - t0:.1f} s (total {time.perf_counter() - started:.0f} s)")
                    _free_device_memory()
    finally:
        if timer is not None:
            if timer.timeouts:
                off = "" if timer.enabled else (" and gating was switched off after that, so later device "
                                                "times include host launch gaps")
                messages.append(f"WARNING: {timer.timeouts} gated sample(s) timed out (an enqueue waited on its own "
                                f"stream); they were dropped{off}")
            timer.close()
    targets = evaluate_targets(rows)
    mine = [r for r in rows if r["contender"] != "floor" and not r.get("error")]
    checked = all(r["checked"] is not False for r in mine) and any(r["checked"] for r in mine)
    result = dict(
        meta=dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  command=settings.command, backend=backend_name, versions=_versions(backend_name),
                  settings=dict(shapes=[s.name for s in shapes], seqs=list(settings.seqs),
                                batches=list(settings.batches), contexts=list(settings.contexts),
                                steps=settings.steps, warmup=settings.warmup, chunk=settings.chunk,
                                tokens_per_block=settings.tpb, seed=settings.seed, torch=use_torch,
                                compile=settings.compile and use_torch, table_mode="per_layer"),
                  torch=torch_msg, messages=messages, elapsed_s=round(time.perf_counter() - started, 1)),
        rows=rows, targets=targets, checked=checked, failures=failures)
    return result
