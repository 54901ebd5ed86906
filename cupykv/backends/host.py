"""The host backend: the step pipeline on numpy arrays and simulated streams.

A simulated stream is a queue. Queued work (copies, kernels, event records) runs only when a stream or
event is waited on, or when a gate opens, and a queued copy reads its source when it runs, as DMA does.
So the races that an overlap scheduler causes on a GPU reproduce here deterministically, with no GPU.
"""
from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections import deque
from typing import Callable, Deque, List, Optional, Tuple

import numpy as np

from ..errors import CupykvError
from ..staging import BAD, MODE_DELTA, MODE_FULL, unpack_snapshot
from .plan import StepPlan
from .runs import run_table


def available_memory_bytes() -> Optional[int]:
    """What this machine can still give a process: MemAvailable + SwapFree of /proc/meminfo (Linux), else
    the physical memory; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            fields = (line.split(":", 1) for line in f)
            kb = {k: int(v.split()[0]) for k, v in fields if k in ("MemAvailable", "SwapFree")}
        if "MemAvailable" in kb:
            return (kb["MemAvailable"] + kb.get("SwapFree", 0)) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


class DeviceBlockedError(CupykvError):
    """A host wait can never complete: the simulated stream is held by a closed gate."""


class SimDevice:
    """Runs the queued work of every simulated stream, in each stream's order, as far as it can; counts the
    bytes its backends' buffers take."""

    def __init__(self):
        self.streams: List["SimStream"] = []
        self.allocated = 0
        self.memory_bytes = available_memory_bytes()    # when it was made: its buffers are refused past this

    def claim(self, nbytes: int) -> None:
        """Count a buffer of nbytes, or raise MemoryError if the buffers would outgrow the machine's memory.
        numpy hands out large zeroed buffers without touching their pages, so each buffer alone fits; the
        manager fills them, and past the machine's memory the kernel's out-of-memory killer ends the
        process, where a GPU's allocation fails with an error the manager reports."""
        total = self.allocated + int(nbytes)
        if self.memory_bytes is not None and total > self.memory_bytes:
            raise MemoryError(f"the host backend's buffers would take {total} bytes; this machine has "
                              f"{self.memory_bytes} bytes available")
        self.allocated = total

    def release(self, nbytes: int) -> None:
        """A claimed buffer of nbytes was dropped."""
        self.allocated -= nbytes

    def drain(self) -> None:
        progress = True
        while progress:
            progress = False
            for s in self.streams:
                while s.queue and s.queue[0][0]():
                    _, run = s.queue.popleft()
                    run()
                    progress = True


class SimStream:
    def __init__(self, device: SimDevice, name: str = "stream", device_id: int = 0):
        self.device = device
        self.name = name
        self.device_id = device_id          # the simulated device it belongs to (HostBackend.device_id)
        self.queue: Deque[Tuple[Callable[[], bool], Callable[[], None]]] = deque()
        device.streams.append(self)

    def enqueue(self, run: Callable[[], None], ready: Callable[[], bool] = lambda: True) -> None:
        self.queue.append((ready, run))

    def synchronize(self) -> None:
        self.device.drain()
        if self.queue:
            raise DeviceBlockedError(f"{self.name} cannot drain: its work is held by a closed gate")


class SimEvent:
    """An event; like a CUDA event, one that was never recorded counts as complete."""

    def __init__(self, device: SimDevice):
        self.device = device
        self._done = True

    def record(self, stream: SimStream) -> "SimEvent":
        self._done = False
        stream.enqueue(lambda: setattr(self, "_done", True))
        return self

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Host wait; returns False when the event cannot complete (held by a closed gate)."""
        self.device.drain()
        return self._done

    def synchronize(self) -> None:
        if not self.wait():
            raise DeviceBlockedError("event cannot complete: its stream is held by a closed gate")


class SimGate:
    """Holds a stream at the point it was enqueued until the test opens it."""

    def __init__(self, backend: "HostBackend", stream: SimStream):
        self.backend = backend
        self.opened = False
        stream.enqueue(lambda: None, ready=lambda: self.opened)

    def open(self) -> None:
        self.opened = True
        self.backend.device.drain()

    def close_timeout_hit(self) -> bool:   # the CUDA gate can time out; the simulated one cannot
        return False


class SimPinnedPool:
    """Models CuPy's pinned pool: power-of-two size classes, most recently freed block handed out first,
    a block returns to the pool as soon as the array handed out dies, whatever copy still reads it."""

    def __init__(self):
        self.free: dict = {}

    def empty(self, words: int) -> np.ndarray:
        size = 1 << max(0, int(words - 1).bit_length())
        blocks = self.free.setdefault(size, [])
        block = blocks.pop() if blocks else np.zeros(size, np.int32)
        arr = block[:words]
        weakref.finalize(arr, blocks.append, block)
        return arr


class HostBackend:
    """numpy 'device' arrays and simulated streams."""

    name = "host"
    xp = np

    def __init__(self, device: Optional[SimDevice] = None, device_id: int = 0):
        # Ranks of one multi-device manager share a SimDevice, so that draining runs every rank's streams.
        self.device = device if device is not None else SimDevice()
        self.device_id = device_id          # a label: the simulated device this backend stands for
        self.stream = SimStream(self.device, f"manager stream {device_id}", device_id)
        self.pinned_pool = SimPinnedPool()

    # streams and events
    def is_stream(self, obj) -> bool:
        """Whether obj is a stream this backend can enqueue on: a simulated stream of its device (one that
        this backend's synchronize drains)."""
        return isinstance(obj, SimStream) and obj.device is self.device and obj.device_id == self.device_id

    def new_stream(self, name: str = "stream") -> SimStream:
        return SimStream(self.device, name, self.device_id)

    def record(self, stream: SimStream) -> SimEvent:
        return SimEvent(self.device).record(stream)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        stream.enqueue(lambda: None, ready=event.done)

    def gate(self, stream: SimStream) -> SimGate:
        return SimGate(self, stream)

    def synchronize(self) -> None:
        for s in self.device.streams:
            s.synchronize()

    def device_context(self):
        """What CudaBackend enters for its device; nothing to enter here."""
        return contextlib.nullcontext()

    # memory
    def _zeros(self, shape, dtype) -> np.ndarray:
        nbytes = int(math.prod(shape) if isinstance(shape, tuple) else shape) * np.dtype(dtype).itemsize
        self.device.claim(nbytes)       # (Python ints: no overflow)
        arr = np.zeros(shape, dtype)
        weakref.finalize(arr, self.device.release, nbytes)      # counted for as long as the buffer lives
        return arr

    def pinned_empty(self, words: int) -> np.ndarray:
        return self._zeros(words, np.int32)

    def pinned_temp(self, words: int) -> np.ndarray:
        return self.pinned_pool.empty(words)

    def device_empty(self, words: int) -> np.ndarray:
        return self._zeros(words, np.int32)

    def device_full(self, shape, value, dtype=np.int32) -> np.ndarray:
        arr = self._zeros(shape, dtype)
        arr.fill(value)
        return arr

    def to_numpy(self, arr) -> np.ndarray:
        return np.array(arr, copy=True)

    def upload(self, arr: np.ndarray) -> np.ndarray:
        return np.array(arr, copy=True)

    # copies: each reads its source when it runs, not when it is enqueued
    def copy_h2d(self, dst: np.ndarray, src: np.ndarray, words: int, stream: SimStream) -> None:
        # Like DMA, the queued copy holds the memory, not the array: a pool block whose array died is
        # recycled (SimPinnedPool) while this copy still reads it.
        raw = src.base if src.base is not None else src
        offset = (src.__array_interface__["data"][0] - raw.__array_interface__["data"][0]) // src.itemsize
        raw = raw.reshape(-1)

        def run():
            dst.reshape(-1)[:words] = raw[offset:offset + words]
        stream.enqueue(run)

    def pinned_bytes(self, nbytes: int) -> np.ndarray:
        return self._zeros(nbytes, np.uint8)

    def copy_bytes(self, dst: np.ndarray, src: np.ndarray, stream: SimStream) -> None:
        """Copy contiguous src into dst (equal nbytes, any dtypes) when the queued copy runs."""
        if dst.nbytes != src.nbytes or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError(f"copy_bytes: needs contiguous arrays of equal size ({dst.nbytes} vs {src.nbytes} B)")
        d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
        stream.enqueue(lambda: np.copyto(d, s))

    def copy_runs(self, dst: np.ndarray, src: np.ndarray, runs, unit_bytes: int, stream: SimStream) -> None:
        """copy_bytes for each (dst_start, src_start, n) run of unit_bytes units, when the queued copy runs."""
        d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
        runs = run_table(runs, unit_bytes, d.size, s.size).tolist()

        def run():
            for d0, s0, n in runs:
                d[d0 * unit_bytes:(d0 + n) * unit_bytes] = s[s0 * unit_bytes:(s0 + n) * unit_bytes]
        stream.enqueue(run)

    def copy_d2d(self, dst: np.ndarray, src: np.ndarray, stream: SimStream) -> None:
        stream.enqueue(lambda: np.copyto(dst, src))

    # kernels (emulated; the CUDA versions live in cupykv/kernels/step.cu)
    def apply_deltas(self, stream: SimStream, snap: np.ndarray, mirror: np.ndarray, consts,
                     num_cells: Optional[int] = None) -> None:
        def run():
            s = unpack_snapshot(snap, consts.num_groups)
            flat = mirror.reshape(-1)
            cells, values = _deltas(s)
            inside = (cells >= 0) & (cells < flat.size)      # the kernel skips cells outside the mirror
            flat[cells[inside]] = values[inside]
        stream.enqueue(run)

    def build_step(self, stream: SimStream, snap: np.ndarray, mirror: np.ndarray, out: np.ndarray,
                   row_entry: np.ndarray, pages: np.ndarray, offsets: np.ndarray, consts, shared: bool,
                   mode: int = MODE_FULL, num_entries: Optional[int] = None, num_cells: Optional[int] = None,
                   num_tokens: Optional[int] = None) -> None:
        """The tables (FULL or DELTA, as the snapshot says) and the write positions, from the mirror after
        apply_deltas. mode and the counts are grid hints on the GPU and are ignored here."""
        def run():
            s = unpack_snapshot(snap, consts.num_groups)
            # The entries written whole first, then the changed cells: on the GPU they run side by side, and
            # this order is the one in which a cell written to an entry it should skip would show.
            if s["mode"] == MODE_DELTA:
                if len(s["rebuilt"]):
                    _full_tables(s, mirror, out, row_entry, consts, shared, entries=s["rebuilt"])
            else:
                _full_tables(s, mirror, out, row_entry, consts, shared)
            _delta_tables(s, out, row_entry, consts, shared)
            _write_positions(s, mirror, pages, offsets, consts, shared)
        stream.enqueue(run)

    def step_plan(self, twin, buffers: tuple, shared: bool) -> StepPlan:
        """The step launches for a ring-slot twin and a mirror's buffers (plan.StepPlan)."""
        return StepPlan(self, twin, buffers, shared)


# -- the step kernel's parts, emulated (cupykv_build_step in kernels/step.cu) -------------------------------


def _group_null(consts, p: int) -> int:
    """Group p's null slot (consts.group_null[p]; BAD when the spec has none)."""
    return int(consts.group_null[p])


def _table_entries(base, null, scale, off: int):
    """table_entry of step.cu: base * scale + off; a BAD base takes the null slot (BAD for none)."""
    base = np.where(base == BAD, null, base)
    return np.where(base == BAD, BAD, base * scale + off)


def _entries(base, blocks, beg, end, slots, scale: int, off: int, null: int = BAD):
    """per_layer_entry of step.cu, vectorized (arrays broadcast; slots [..., M] or None for no scratch):
    blocks in [beg, end) map onto the context's scratch slots, the rest onto their own slot; a BAD base
    gives the null slot's page (null = BAD: BAD, as for the write positions)."""
    vals = _table_entries(base, null, scale, off)
    inside = (blocks >= beg) & (blocks < end)
    if inside.any():
        t = np.where(inside, (blocks - beg) * 2, 0)
        slot = np.take_along_axis(slots, t // scale, axis=-1) if slots is not None else 0
        vals = np.where(inside, slot * scale + (t % scale + off) % scale, vals)
    return vals


def _context_scratch(s: dict, p: int, n: int):
    """beg, end [n] and slots [n, M] (None without scratch columns) of group p; zeros past the contexts."""
    c, m = s["num_contexts"], s["scratch_width"]
    beg, end = np.zeros(n, np.int64), np.zeros(n, np.int64)
    beg[:min(c, n)], end[:min(c, n)] = s["begs"][p][:n], s["ends"][p][:n]
    slots = None
    if m:
        slots = np.zeros((n, m), np.int64)
        slots[:min(c, n)] = s["scratch"][p][:n]
    return beg, end, slots


def _full_tables(s: dict, mirror, out, row_entry, consts, shared: bool, entries=None) -> None:
    """Every cell of the batch's entries and padding rows [num_seqs, pad_to); entries: only these (a DELTA
    step's rebuilt entries, padding rows among them)."""
    max_batch, rows = out.shape[1], mirror.shape[1]
    n = max(0, min(s["num_seqs"], max_batch))
    live = max(n, min(s["pad_to"], max_batch))
    if not live:
        return
    idx = np.arange(live) if entries is None else np.clip(np.asarray(entries, np.int64), 0, live - 1)
    pad = idx[idx >= n]                                              # padding rows of a fixed batch: as BAD cells
    for plane in range(out.shape[0]) if len(pad) else ():
        p = plane if shared else int(consts.layer_group[plane])
        off = 0 if shared else int(consts.layer_koff[plane])
        for r in (0, 1):
            out[plane, pad, r] = _table_entries(np.int64(BAD), _group_null(consts, p), int(consts.group_scale[p]),
                                                off + r)
    idx = idx[idx < n]
    batch_rows = np.clip(s["copy_idx"][idx], 0, rows - 1)
    row_entry[batch_rows] = idx
    base = mirror[:, batch_rows, :].astype(np.int64)                 # [P, len(idx), B]
    if shared:
        scale = consts.group_scale[:, None, None].astype(np.int64)
        for r in (0, 1):
            out[:, idx, r, :] = _table_entries(base, consts.group_null[:, None, None], scale, r)
        return
    blocks = np.arange(base.shape[2])[None, :]
    scratch = [_context_scratch(s, p, n) for p in range(consts.num_groups)]
    for layer in range(consts.num_layers):
        p = int(consts.layer_group[layer])
        beg, end, slots = scratch[p]
        for r in (0, 1):
            out[layer, idx, r, :] = _entries(base[p], blocks, beg[idx, None], end[idx, None],
                                             None if slots is None else slots[idx], int(consts.group_scale[p]),
                                             int(consts.layer_koff[layer]) + r, _group_null(consts, p))


def _deltas(s: dict):
    """(flat table cell, value) of each of the step's changed cells (delta_at in step.cu: run r covers cells
    [run_coff[r], run_coff[r + 1]); its values start at values[run_value[r]], or a fill run's one value is
    values[~run_value[r]]), the run found as the kernel's find_run does. A corrupt snapshot (unsafe staging)
    gives some garbage cells, not necessarily the kernel's (this stops at the runs' end and clamps the value
    index, inside the snapshot), and never an error; no runs or no values: no cells."""
    start, coff, first, values = s["run_start"], s["run_coff"], s["run_value"], s["values"]
    r = min(len(start), len(coff) - 1, len(first))
    if r <= 0 or not len(values):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    i = np.arange(min(max(s["num_cells"], 0), max(int(coff[r]), 0)))   # a valid snapshot's runs cover num_cells
    run = np.clip(np.searchsorted(coff[1:r], i, side="right"), 0, r - 1)
    k = i - coff[run]
    v = first[run].astype(np.int64)
    return start[run].astype(np.int64) + k, values[np.clip(np.where(v >= 0, v + k, ~v), 0, len(values) - 1)]


def _delta_tables(s: dict, out, row_entry, consts, shared: bool) -> None:
    """The changed cells of the entries not written whole that hold their row: a generation entry of a
    DELTA batch, or an entry past the batch that the held section names (see staging's layout)."""
    B, rows, max_batch = consts.max_blocks, consts.rows, out.shape[1]
    n = max(0, min(s["num_seqs"], max_batch))
    live = max(n, min(s["pad_to"], max_batch))
    copy_idx, held, full = s["copy_idx"], s["held"][:max_batch - live], s["mode"] != MODE_DELTA
    cells, values = _deltas(s)
    for cell, base in zip(cells.tolist(), values.tolist()):
        p, row, b = cell // (rows * B), (cell // B) % rows, cell % B
        if cell < 0 or p >= consts.num_groups:
            continue
        k = int(row_entry[row])
        here = (not full and s["num_contexts"] <= k < n and copy_idx[k] == row if k < live
                else k - live < len(held) and held[k - live] == row)
        if k < 0 or not here:
            continue
        scale, null = int(consts.group_scale[p]), _group_null(consts, p)
        planes = [(p, 0)] if shared else [(l, int(consts.layer_koff[l])) for l in range(consts.num_layers)
                                           if consts.layer_group[l] == p]
        for plane, off in planes:
            for r in (0, 1):
                out[plane, k, r, b] = _table_entries(np.int64(base), null, scale, off + r)


def _write_positions(s: dict, mirror, pages, offsets, consts, shared: bool) -> None:
    """pages[l, t]: K page index of new token t for layer l (V = K + 1); offsets[t]: its place in the page.
    Same rules as the tables, from the mirror, except that a BAD base stays BAD with a null slot too (no
    write targets it); clamped like the kernel, so a corrupt snapshot (unsafe staging) gives garbage, not
    a crash."""
    rows, B = mirror.shape[1], mirror.shape[2]
    n = max(0, min(s["num_seqs"], consts.max_batch))
    cu = s["cu_tokens"][:n + 1]
    seq = np.repeat(np.arange(n), np.maximum(np.diff(cu), 0))[:offsets.size]
    t = len(seq)
    pos = s["start_pos"][seq] + (np.arange(t) - cu[seq] + cu[0])
    block = np.clip(pos // consts.tokens_per_block, 0, B - 1)
    offsets[:t] = pos % consts.tokens_per_block
    row = np.clip(s["copy_idx"][seq], 0, rows - 1)
    for layer in range(consts.num_layers):
        p = int(consts.layer_group[layer])
        base = mirror[p, row, block].astype(np.int64)
        scale, off = int(consts.group_scale[p]), int(consts.layer_koff[layer])
        if shared:
            pages[layer, :t] = np.where(base == BAD, BAD, base * scale + off)
        else:
            beg, end, slots = _context_scratch(s, p, n)
            # one token per row: a trailing axis of one block, so _entries' scratch lookup lines up
            pages[layer, :t] = _entries(base[:, None], block[:, None], beg[seq][:, None], end[seq][:, None],
                                        None if slots is None else slots[seq], scale, off)[:, 0]
