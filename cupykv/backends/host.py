"""The host backend: the step pipeline on numpy arrays and simulated streams.

A simulated stream is a queue. Queued work (copies, kernels, event records) runs only when a stream or
event is waited on, or when a gate opens, and a queued copy reads its source when it runs, as DMA does.
So the races that an overlap scheduler causes on a GPU reproduce here deterministically, with no GPU.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Callable, Deque, List, Optional, Tuple

import numpy as np

from ..errors import CupykvError
from ..staging import MODE_DELTA, unpack_snapshot

BAD = -1


class DeviceBlockedError(CupykvError):
    """A host wait can never complete: the simulated stream is held by a closed gate."""


class SimDevice:
    """Runs the queued work of every simulated stream, in each stream's order, as far as it can."""

    def __init__(self):
        self.streams: List["SimStream"] = []

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
    def __init__(self, device: SimDevice, name: str = "stream"):
        self.device = device
        self.name = name
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

    def __init__(self):
        self.device = SimDevice()
        self.stream = SimStream(self.device, "manager stream")
        self.pinned_pool = SimPinnedPool()

    # streams and events
    def new_stream(self, name: str = "stream") -> SimStream:
        return SimStream(self.device, name)

    def record(self, stream: SimStream) -> SimEvent:
        return SimEvent(self.device).record(stream)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        stream.enqueue(lambda: None, ready=event.done)

    def gate(self, stream: SimStream) -> SimGate:
        return SimGate(self, stream)

    def synchronize(self) -> None:
        for s in self.device.streams:
            s.synchronize()

    # memory
    def pinned_empty(self, words: int) -> np.ndarray:
        return np.zeros(words, np.int32)

    def pinned_temp(self, words: int) -> np.ndarray:
        return self.pinned_pool.empty(words)

    def device_empty(self, words: int) -> np.ndarray:
        return np.zeros(words, np.int32)

    def device_full(self, shape, value, dtype=np.int32) -> np.ndarray:
        return np.full(shape, value, dtype)

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

    def copy_d2d(self, dst: np.ndarray, src: np.ndarray, stream: SimStream) -> None:
        stream.enqueue(lambda: np.copyto(dst, src))

    # kernels (emulated; the CUDA versions live in cupykv/kernels/pipeline.cu)
    def apply_deltas(self, stream: SimStream, snap: np.ndarray, mirror: np.ndarray, consts,
                     num_runs: Optional[int] = None) -> None:
        def run():
            s = unpack_snapshot(snap, consts.num_groups)
            flat = mirror.reshape(-1)
            for start, lo, hi in zip(s["run_start"], s["run_voff"][:-1], s["run_voff"][1:]):
                flat[start:start + hi - lo] = s["values"][lo:hi]
        stream.enqueue(run)

    def convert(self, stream: SimStream, snap: np.ndarray, mirror: np.ndarray, out: np.ndarray, consts,
                shared: bool, num_seqs: Optional[int] = None) -> None:
        def run():
            s = unpack_snapshot(snap, consts.num_groups)
            if s["mode"] == MODE_DELTA:
                return
            n, c = s["num_seqs"], s["num_contexts"]
            out[:, n:max(n, min(s["pad_to"], out.shape[1]))] = BAD           # padding rows of a fixed batch
            base = mirror[:, s["copy_idx"], :].astype(np.int64)            # [P, n, B]
            bad = base == BAD
            if shared:
                for r in (0, 1):
                    v = base * consts.group_scale[:, None, None] + r
                    out[:, :n, r, :] = np.where(bad, BAD, v)
                return
            blocks = np.arange(base.shape[2])
            for layer in range(consts.num_layers):
                p = consts.layer_group[layer]
                scale = int(consts.group_scale[p])
                for r in (0, 1):
                    off = int(consts.layer_koff[layer]) + r
                    vals = np.where(bad[p], BAD, base[p] * scale + off)
                    if c:
                        beg, end = s["begs"][p][:, None], s["ends"][p][:, None]
                        inside = (blocks[None, :] >= beg) & (blocks[None, :] < end)
                        t = np.where(inside, (blocks[None, :] - beg) * 2, 0)
                        slot = np.take_along_axis(s["scratch"][p], t // scale, axis=1) if s["scratch_width"] \
                            else np.zeros_like(t)
                        vals[:c] = np.where(inside, slot * scale + (t % scale + off) % scale, vals[:c])
                    out[layer, :n, r, :] = vals
        stream.enqueue(run)

    def convert_delta(self, stream: SimStream, snap: np.ndarray, out: np.ndarray, consts, shared: bool,
                      num_values: Optional[int] = None) -> None:
        """DELTA mode: rewrite the output cells of the changed table cells that belong to the batch."""
        def run():
            s = unpack_snapshot(snap, consts.num_groups)
            if s["mode"] != MODE_DELTA:
                return
            B, rows = consts.max_blocks, consts.rows
            lengths = np.diff(s["run_voff"])
            cells = np.repeat(s["run_start"], lengths) + (np.arange(len(s["values"])) -
                                                          np.repeat(s["run_voff"][:-1], lengths))
            entry = {int(r): k for k, r in enumerate(s["copy_idx"])}
            for cell, base in zip(cells.tolist(), s["values"].tolist()):
                p, row, b = cell // (rows * B), (cell // B) % rows, cell % B
                if row not in entry:
                    continue
                k, scale = entry[row], int(consts.group_scale[p])
                planes = [(p, 0)] if shared else [(l, int(consts.layer_koff[l])) for l in range(consts.num_layers)
                                                   if consts.layer_group[l] == p]
                for plane, off in planes:
                    for r in (0, 1):
                        out[plane, k, r, b] = BAD if base == BAD else base * scale + off + r
        stream.enqueue(run)

    def launch_step_graph(self, stream: SimStream, slot, mirror, out, pages, offsets, consts, shared: bool,
                          seqs_bucket: int, copy_words: int) -> None:
        """What the CUDA backend captures as a graph, enqueued op by op: the copy of the slot's first
        copy_words words, then every kernel, each reading its counts from the snapshot header."""
        self.copy_h2d(slot.dev, slot.host, copy_words, stream)
        self.apply_deltas(stream, slot.dev, mirror, consts)
        self.convert(stream, slot.dev, mirror, out, consts, shared)
        self.convert_delta(stream, slot.dev, out, consts, shared)
        self.write_positions(stream, slot.dev, out, pages, offsets, consts, shared)

    def write_positions(self, stream: SimStream, snap: np.ndarray, out: np.ndarray, pages: np.ndarray,
                        offsets: np.ndarray, consts, shared: bool, num_tokens: Optional[int] = None) -> None:
        """pages[l, t]: K page index of new token t for layer l (V = K + 1); offsets[t]: its slot in the page.
        Read from the step's output tables, so scratch tokens land on their scratch pages."""
        def run():
            s = unpack_snapshot(snap, consts.num_groups)
            cu = s["cu_tokens"]
            # clamped like the CUDA kernel, so a corrupt snapshot (unsafe mode) gives garbage, not a crash
            seq = np.repeat(np.arange(s["num_seqs"]), np.maximum(np.diff(cu), 0))[:offsets.size]
            n = len(seq)
            pos = s["start_pos"][seq] + (np.arange(n) - cu[seq] + cu[0])
            block = np.clip(pos // consts.tokens_per_block, 0, out.shape[3] - 1)
            offsets[:n] = pos % consts.tokens_per_block
            for layer in range(consts.num_layers):
                if shared:
                    k = out[consts.layer_group[layer], seq, 0, block]
                    pages[layer, :n] = np.where(k == BAD, BAD, k + consts.layer_koff[layer])
                else:
                    pages[layer, :n] = out[layer, seq, 0, block]
        stream.enqueue(run)
