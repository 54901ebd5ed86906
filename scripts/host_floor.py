"""The floor of a decode step's host work in CPython: the fewest operations any step of this design makes,
written as two flat functions with no layers, no general cases and no error messages, timed beside the
manager's own step on the same host.

    python scripts/host_floor.py [batch ...]     (default 1 256)

The step is the one scripts/host_calls.py times: a decode step (one token each) of the previous step's
batch, GPT-OSS-120B's two groups (a 128-token window and full attention), 32 tokens a block, requests at
8k-30k tokens. What it keeps of a real step:

  prepare: the previous step was finished; each request's capacity + 1 within max_seq_len; the blocks the
    new tokens open, a slot of each group popped for each and written into the table and the dirty log; the
    snapshot (a struct-packed header, then the batch's rows, the cumulative tokens and the start
    positions, then the changed cells and their values, concatenated into a pinned slot, in the manager's
    section order); on CUDA: the oldest in-flight step's finish and the ring slot's last copy polled, the
    wait for the previous finish, one launch of a kernel that takes the slot's first words as a parameter,
    as many as the smallest inline step kernel that carries the snapshot (kernels.INLINE_STEP_KERNELS)
    takes, the ready event; a record of the step.
  settle: history advances by one token each; the window's blocks that fell out of it are cleared from the
    table, logged and quarantined.

What it leaves out, and the manager does: the generation list's validation (here the same list object), the
slot accounting of a step that may run out, the ledger and its quarantine lifting, the entry map, graph
replays, contexts, scratch, prefix caching, the host tier, several devices, and every check that makes a
bad call an error. So this is a floor, not a rival: the manager's step cannot cost less.
"""
import struct
import sys
import time

import numpy as np

from cupykv.kernels import INLINE_STEP_KERNELS

BAD, TPB, SHIFT, WINDOW, MAX_SEQ, BLOCKS, GROUPS = -1, 32, 5, 128, 32768, 1028, 2
HEADER = struct.Struct("=24i")


class Floor:
    """The state a decode step reads and writes, as flat arrays."""

    def __init__(self, batch: int, cuda: bool):
        rng = np.random.default_rng(0)
        self.rows = np.arange(batch, dtype=np.int64)
        self.rows32 = self.rows.astype(np.int32)
        self.cap = rng.integers(8192, 30000, batch).astype(np.int64)
        self.hist = self.cap.copy()
        self.table = np.full((GROUPS, batch, BLOCKS), BAD, np.int32)
        self.flat = self.table.reshape(-1)
        slots = batch * BLOCKS * 2
        self.stack, self.top = np.arange(slots, dtype=np.int32), slots
        for r in range(batch):      # each request's blocks: the full group all of them, the window its last 5
            n = -(-int(self.cap[r]) // TPB)
            self.table[1, r, :n] = self.pop(n)
            self.table[0, r, max(0, n - 5):n] = self.pop(min(n, 5))
        self.stale_done = np.maximum(0, (self.hist + 1 - WINDOW) >> SHIFT)
        self.group_base = (np.arange(GROUPS, dtype=np.int64) * batch * BLOCKS)[:, None]
        self.log, self.quarantine = [], []
        self.cu = np.arange(batch + 1, dtype=np.int64)
        self.slot = np.zeros(16384, np.int32)
        self.prev_finished = True
        self.cuda = self.setup_cuda() if cuda else None

    def pop(self, k: int) -> np.ndarray:
        self.top -= k
        return self.stack[self.top:self.top + k]

    def setup_cuda(self):
        import cupy
        import cupyx
        from cupy.cuda import runtime as rt
        from cupykv.backends.cuda import PackedLaunch, ParamBytes
        self.slot = cupyx.empty_pinned(16384, np.int32)
        out = cupy.zeros(4, np.int32)
        launches = []       # (struct words, launch), smallest first
        for _, words in INLINE_STEP_KERNELS:
            kernel = cupy.RawKernel(f'''
                struct Snap {{ int w[{words}]; }};
                extern "C" __global__ void step(const __grid_constant__ Snap s, int* out) {{ out[0] = s.w[0]; }}''',
                                    "step")
            launches.append((words, PackedLaunch(kernel, (ParamBytes(self.slot.ctypes.data), out))))
        stream = cupy.cuda.Stream(non_blocking=True)
        events = [cupy.cuda.Event(disable_timing=True) for _ in range(4)]
        for e in events:
            e.record(stream)
        for _, launch in launches:
            launch(1, stream.ptr)
        stream.synchronize()
        return rt, launches, stream, events

    def prepare(self) -> tuple:
        if not self.prev_finished:
            raise RuntimeError("previous step not finished")
        rows = self.rows
        cap = self.cap[rows]
        end = cap + 1
        if end.max() > MAX_SEQ:
            raise RuntimeError("capacity")
        lo, hi = (cap + (TPB - 1)) >> SHIFT, (end + (TPB - 1)) >> SHIFT
        opened = (hi > lo).nonzero()[0]
        if len(opened):     # one token each: at most one new block per row
            cells = (self.group_base + (rows[opened] * BLOCKS + lo[opened])).reshape(-1)
            self.flat[cells] = self.pop(len(cells))
            self.log.append(cells)
        self.cap[rows] = end
        cells = np.concatenate(self.log) if len(self.log) > 1 else (self.log[0] if self.log else self.cu[:0])
        values = self.flat[cells]
        self.log.clear()
        n, c = len(rows), len(cells)
        header = [0] * 24
        header[0], header[1], header[2], header[3] = 7, n, c, c
        HEADER.pack_into(self.slot, 0, *header)
        words = 24 + 3 * n + 2 * c + 1
        np.concatenate((self.rows32, self.cu, cap, cells, values), out=self.slot[24:words], casting="unsafe")
        if self.cuda is not None:
            self.cuda_calls(words)
        self.prev_finished = False
        return rows, cap

    def cuda_calls(self, words: int) -> None:
        """The CUDA calls of a step: two polls, the wait for the previous finish, the launch, the ready."""
        rt, launches, stream, events = self.cuda
        rt.eventQuery(events[0].ptr)            # the oldest step in flight
        rt.eventQuery(events[1].ptr)            # the ring slot's last copy
        rt.streamWaitEvent(stream.ptr, events[2].ptr)     # the previous step's finish
        for most, launch in launches:
            if words <= most:
                break
        launch(1, stream.ptr)
        rt.eventRecord(events[3].ptr, stream.ptr)         # ready

    def settle(self, rows: np.ndarray) -> None:
        hist = self.hist[rows] + 1
        self.hist[rows] = hist
        end = np.maximum(0, (hist + (1 - WINDOW)) >> SHIFT)
        done = self.stale_done[rows]
        moved = (end > done).nonzero()[0]
        if len(moved):      # one token each: at most one block per row falls out of the window
            cells = rows[moved] * BLOCKS + done[moved]
            self.quarantine.append(self.flat[cells].copy())
            self.flat[cells] = BAD
            self.log.append(cells)
            self.stale_done[rows[moved]] = end[moved]

    def finish(self) -> None:
        self.prev_finished = True
        if len(self.quarantine) > 8:        # lifted a few steps later
            freed = np.concatenate(self.quarantine)
            self.quarantine.clear()
            self.stack[self.top:self.top + len(freed)] = freed
            self.top += len(freed)


def timed_floor_step(floor: Floor, wait: bool = False) -> tuple:
    """One floor step: (prepare seconds, settle seconds), as profile_manager.timed_decode_step times the
    manager's. wait: then wait for the stream (CUDA), as host_calls.py waits for each step's ready event."""
    t0 = time.perf_counter()
    rows, _ = floor.prepare()
    t1 = time.perf_counter()
    floor.finish()
    t2 = time.perf_counter()
    floor.settle(rows)
    t3 = time.perf_counter()
    if wait and floor.cuda is not None:
        floor.cuda[2].synchronize()
    return t1 - t0, t3 - t2


def medians_us(timed, steps: int = 600, skip: int = 100) -> list:
    """Median prepare and settle microseconds over `steps` calls of `timed` (the first `skip` not counted)."""
    times = [timed()[:2] for _ in range(steps)][skip:]
    return [float(np.median(t)) * 1e6 for t in zip(*times)]


def main():
    try:
        import cupy
        cuda = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (no CuPy or no driver: the numpy part alone)
        cuda = False
    sys.path.insert(0, "scripts")
    from profile_manager import make_manager, timed_decode_step
    for batch in [int(a) for a in sys.argv[1:]] or [1, 256]:
        floor = Floor(batch, cuda)
        fp, fs = medians_us(lambda: timed_floor_step(floor))
        # the manager's step on the host backend (its device work as no-ops), on the same host
        mgr, ids = make_manager(batch), list(range(batch))
        mp, ms = medians_us(lambda: timed_decode_step(mgr, ids))
        print(f"batch {batch}: floor prepare {fp:.1f} us ({'with' if cuda else 'without'} its CUDA calls), "
              f"settle {fs:.1f} us; the manager (host backend, no device work) prepare {mp:.1f} us, "
              f"settle {ms:.1f} us")
        if cuda:        # as host_calls.py's steps run by default: a wait for the GPU after each step
            wp, ws = medians_us(lambda: timed_floor_step(floor, wait=True))
            print(f"batch {batch}: floor prepare {wp:.1f} us, settle {ws:.1f} us with a wait for the stream "
                  "after each step")


if __name__ == "__main__":
    main()
