"""The floor of a step's host work in CPython: the fewest operations any step of this design makes, written
flat, with no layers, no general cases and no error messages, timed beside the manager's own step on the
same host. Floor is a decode step's (below); ChurnFloor and ContextFloor, built on it, the benchmark's churn
step and its context step's prepare (their docstrings say what each adds).

    python scripts/host_floor.py [batch ...]     (default 1 256)
    python scripts/host_floor.py [--churn] [--context]     (the benchmark's churn step: ChurnFloor; its
                                                           context step: ContextFloor)

The decode step is the one scripts/host_calls.py times: a decode step (one token each) of the previous step's
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
import ctypes
import struct
import sys
import time
from operator import itemgetter

import numpy as np

from cupykv.kernels import INLINE_STEP_KERNELS
from cupykv.staging import HEADER_WORDS

BAD, TPB, SHIFT, WINDOW, GROUPS = -1, 32, 5, 128, 2
HEADER = struct.Struct(f"={HEADER_WORDS}i")


class Floor:
    """The state a decode step reads and writes, as flat arrays: `batch` requests of `lengths` tokens (low,
    high) on rows 0..batch-1, `spare` rows more for arrivals, sequences up to max_seq tokens."""

    def __init__(self, batch: int, cuda: bool, max_seq: int = 32768, lengths=(8192, 30000), spare: int = 0):
        self.rng = np.random.default_rng(0)
        self.max_seq, self.lengths = max_seq, lengths
        self.blocks = max_seq // TPB + 4
        rows = batch + spare
        self.rows = np.arange(batch, dtype=np.int64)
        self.rows32 = self.rows.astype(np.int32)
        self.cap = np.zeros(rows, np.int64)
        self.table = np.full((GROUPS, rows, self.blocks), BAD, np.int32)
        self.flat = self.table.reshape(-1)
        slots = rows * self.blocks * 2
        self.stack, self.top = np.arange(slots, dtype=np.int32), slots
        self.stale_done = np.zeros(rows, np.int64)
        for r in range(batch):
            self.prefill(r, int(self.rng.integers(*lengths)))
        self.hist = self.cap.copy()
        self.group_base = (np.arange(GROUPS, dtype=np.int64) * rows * self.blocks)[:, None]
        self.log, self.quarantine = [], []
        self.cu = np.arange(batch + 1, dtype=np.int64)
        self.slot = np.zeros(16384, np.int32)
        self.prev_finished = True
        self.cuda = self.setup_cuda() if cuda else None

    def pop(self, k: int) -> np.ndarray:
        self.top -= k
        return self.stack[self.top:self.top + k]

    def prefill(self, r: int, n: int) -> None:
        """Row r holds a prompt of n tokens (not timed: a prefill step of its own): the full group's blocks all
        of them, the window's those not yet stale (4 or 5)."""
        nb = -(-n // TPB)
        stale = self.stale_done[r] = max(0, (n + 1 - WINDOW) >> SHIFT)
        self.table[1, r, :nb] = self.pop(nb)
        self.table[0, r, stale:nb] = self.pop(nb - stale)
        self.cap[r] = n

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
        kernel = cupy.RawKernel('extern "C" __global__ void step(const int* s, int* out) { out[0] = s[0]; }',
                                "step")
        reads_slot = PackedLaunch(kernel, (ctypes.c_uint64(self.slot.ctypes.data), out))
        stream = cupy.cuda.Stream(non_blocking=True)
        events = [cupy.cuda.Event(disable_timing=True) for _ in range(4)]
        for e in events:
            e.record(stream)
        for _, launch in launches + [(0, reads_slot)]:
            launch(1, stream.ptr)
        stream.synchronize()
        return rt, launches, stream, events, reads_slot

    def prepare(self, rows=None, rows32=None, extra=()) -> tuple:
        """A decode step of one token each for rows (default: the fixed batch) and rows32 (the same, int32);
        extra: more arrays for the snapshot, after the batch's sections."""
        if not self.prev_finished:
            raise RuntimeError("previous step not finished")
        if rows is None:
            rows, rows32 = self.rows, self.rows32
        cap = self.cap[rows]
        end = cap + 1
        if end.max() > self.max_seq:
            raise RuntimeError("capacity")
        lo, hi = (cap + (TPB - 1)) >> SHIFT, (end + (TPB - 1)) >> SHIFT
        opened = (hi > lo).nonzero()[0]
        if len(opened):     # one token each: at most one new block per row
            cells = (self.group_base + (rows[opened] * self.blocks + lo[opened])).reshape(-1)
            self.flat[cells] = self.pop(len(cells))
            self.log.append(cells)
        self.cap[rows] = end
        cells = np.concatenate(self.log) if len(self.log) > 1 else (self.log[0] if self.log else self.cu[:0])
        values = self.flat[cells]
        self.log.clear()
        n, c = len(rows), len(cells)
        header = [0] * HEADER_WORDS
        header[0], header[1], header[2], header[3] = 7, n, c, c
        HEADER.pack_into(self.slot, 0, *header)
        words = HEADER_WORDS + 3 * n + 2 * c + 1 + sum(a.size for a in extra)
        np.concatenate((rows32, self.cu[:n + 1], cap, cells, values) + extra, out=self.slot[HEADER_WORDS:words],
                       casting="unsafe")
        if self.cuda is not None:
            self.cuda_calls(words)
        self.prev_finished = False
        return rows, cap

    def cuda_calls(self, words: int) -> None:
        """The CUDA calls of a step: two polls, the wait for the previous finish, the launch (of a kernel that
        reads the snapshot from the pinned slot when it is too large for every inline kernel), the ready."""
        rt, launches, stream, events, reads_slot = self.cuda
        rt.eventQuery(events[0].ptr)            # the oldest step in flight
        rt.eventQuery(events[1].ptr)            # the ring slot's last copy
        rt.streamWaitEvent(stream.ptr, events[2].ptr)     # the previous step's finish
        for most, launch in launches:
            if words <= most:
                break
        else:
            launch = reads_slot
        launch(1, stream.ptr)
        rt.eventRecord(events[3].ptr, stream.ptr)         # ready

    def settle(self, rows: np.ndarray) -> None:
        hist = self.hist[rows] + 1
        self.hist[rows] = hist
        end = np.maximum(0, (hist + (1 - WINDOW)) >> SHIFT)
        done = self.stale_done[rows]
        moved = (end > done).nonzero()[0]
        if len(moved):      # one token each: at most one block per row falls out of the window
            cells = rows[moved] * self.blocks + done[moved]
            self.quarantine.append(self.flat[cells].copy())
            self.flat[cells] = BAD
            self.log.append(cells)
            self.stale_done[rows[moved]] = end[moved]

    def finish(self) -> None:
        self.prev_finished = True
        if len(self.quarantine) > 8:        # lifted a few steps later
            self.lift()

    def lift(self) -> None:
        """The quarantine's slots back onto the free stack, ascending (the design is deterministic)."""
        freed = np.concatenate(self.quarantine)
        freed.sort(kind="stable")
        self.quarantine.clear()
        self.stack[self.top:self.top + len(freed)] = freed
        self.top += len(freed)


class ChurnFloor(Floor):
    """The floor of the benchmark's churn step (GPT-OSS-120B's two groups, 128k, batch 256): before a decode
    step of the whole list, k requests finish and k arrivals, prefilled in a step of their own (not timed),
    take their places in the list; the steps between are steady (the same list, not timed). What it adds to
    the decode floor, timed as the benchmark times the manager's schedule + prepare + settle:

      schedule: each finished request's rows cleared (its full-attention blocks and its window's, each a run
        of cells, cleared with a slice and logged as a range) and its slots quarantined; its row free.
      prepare: the quarantine lifted, sorted back onto the free stack (every step before it has finished: the
        finished requests' thousands of slots come back here, as they do in the manager's prepare); the new
        list's lookup (ids to rows) and its duplicate and readiness checks, unless it equals the last list
        checked; the entries whose row changed (rebuilt whole by the kernel); the cleared ranges shipped
        beside the cells.
    """

    def __init__(self, batch: int, cuda: bool, max_seq: int = 131072, k: int = 2):
        room = 1024                     # tokens left for decode steps (the benchmark's lengths: max_seq / 4 up)
        super().__init__(batch, cuda, max_seq, (max_seq // 4, max_seq - room), spare=k)
        self.k = k
        self.ids = list(range(batch))               # the decode list, by request id
        self.row_of = {r: r for r in self.ids}
        self.prompt = self.cap.copy()
        self.free_rows = list(range(batch, batch + k))
        self.next_id = batch
        self.checked, self.prev_rows = list(self.ids), self.rows     # the last list checked, its rows
        self.cleared = []                           # (lo, hi) flat ranges cleared since the last step

    def arrive(self) -> list:
        """Not timed: k arrivals prefilled on free rows; returns the list positions they take."""
        pos = sorted(int(p) for p in self.rng.choice(len(self.ids), size=self.k, replace=False))
        self.arrivals = []
        for _ in pos:
            rid, row = self.next_id, self.free_rows.pop()
            self.next_id += 1
            self.prefill(row, int(self.rng.integers(*self.lengths)))
            self.prompt[row] = self.hist[row] = self.cap[row]
            self.row_of[rid] = row
            self.arrivals.append(rid)
        return pos

    def free(self, p: int) -> int:
        """The request at list position p finished: its rows cleared, its slots quarantined; returns its row,
        now free."""
        row = self.row_of.pop(self.ids[p])
        nb = -(-int(self.cap[row]) // TPB)
        full = self.group_base[1, 0] + row * self.blocks
        for lo, hi in ((row * self.blocks + int(self.stale_done[row]), row * self.blocks + nb), (full, full + nb)):
            self.quarantine.append(self.flat[lo:hi].copy())
            self.flat[lo:hi] = BAD
            self.cleared.append((lo, hi))
        self.free_rows.append(row)
        return row

    def schedule(self, pos: list) -> None:
        """The finished requests at positions pos freed; the arrivals take their places."""
        for p, rid in zip(pos, self.arrivals):
            self.free(p)
            self.ids[p] = rid

    def finish(self) -> None:
        self.prev_finished = True           # the quarantine is lifted in the next prepare

    def prepare(self, extra=()) -> tuple:
        if self.quarantine:
            self.lift()
        if self.ids == self.checked:
            rows = self.prev_rows
        else:
            try:
                rows = np.fromiter(itemgetter(*self.ids)(self.row_of), np.int64, len(self.ids))
            except KeyError:
                raise RuntimeError("unknown request") from None
            if np.bincount(rows).max() > 1:
                raise RuntimeError("a request twice")
            if (self.cap[rows] < self.prompt[rows]).any():
                raise RuntimeError("decoding before its prompt is scheduled")
            self.checked = list(self.ids)
        rebuilt = (rows != self.prev_rows).nonzero()[0]
        cleared = np.array(self.cleared, np.int64).reshape(-1)
        self.cleared.clear()
        self.prev_rows = rows
        return super().prepare(rows, rows.astype(np.int32), (rebuilt, cleared) + extra)


class ContextFloor(ChurnFloor):
    """The floor of the benchmark's context step's prepare (its target's measure): a decode step of the list
    (GPT-OSS-120B's two groups, 128k, batch 256) plus one chunk of up to `chunk` tokens for each of `contexts`
    prefilling requests. A prefill that completes joins the list in place of a request that finishes, and a
    new request arrives in its place, from its first chunk (as the benchmark's; not timed), so the next
    prepare looks the changed list up and ships the finished request's cleared rows. What it adds to the
    churn floor's prepare, per chunk:

      the request's lookup (id to row) and checks (not twice in the step, the chunk within its prompt);
      the full-attention group's new blocks: slots popped as one run, written with a slice and logged as a
        range (shipped whole);
      the window group's new blocks that are stale by the time the chunk settles: mapped onto scratch slots
        (popped, into the scratch metadata; 2 pages a block shared by the group's 18 layers), the rest of its
        new blocks a run of own slots written as above;
      the snapshot's context sections (tokens, start positions, scratch ranges and slots) and the written
        ranges with their values, one launch whose kernel reads the snapshot from the pinned slot.

    Its settle (not timed) releases each chunk row's window blocks that left it and the chunk's scratch slots.
    """

    SCALE = 36                      # the window group's pages per slot: K and V of its 18 layers

    def __init__(self, batch: int, cuda: bool, max_seq: int = 131072, contexts: int = 8, chunk: int = 8192):
        super().__init__(batch, cuda, max_seq, k=contexts)
        self.chunk = chunk
        self.width = -(-2 * (chunk // TPB + 1) // self.SCALE)       # scratch slots of a chunk, at most
        self.ctx_ids = []
        for _ in range(contexts):       # staggered, as the benchmark's setup: some chunks already done
            n = int(self.rng.integers(*self.lengths))
            self.ctx_ids.append(self.arrival(self.free_rows.pop(), n, int(self.rng.integers(0, n // chunk)) * chunk))
        self.written, self.borrowed = [], []

    def arrival(self, row: int, n: int, done: int = 0) -> int:
        """A new request of n prompt tokens on `row` (not timed), `done` of them prefilled; returns its id."""
        rid = self.next_id
        self.next_id += 1
        self.row_of[rid] = row
        self.prompt[row] = n
        self.cap[row] = self.hist[row] = self.stale_done[row] = 0
        if done:
            self.prefill(row, done)
            self.hist[row] = done
        return rid

    def prepare(self) -> tuple:
        C = len(self.ctx_ids)
        ctx_rows, tokens, starts = [], [], []
        begs, ends = np.zeros(C, np.int32), np.zeros(C, np.int32)
        scratch = np.zeros((C, self.width), np.int32)
        for c, rid in enumerate(self.ctx_ids):
            row = self.row_of[rid]
            if row in ctx_rows:
                raise RuntimeError("a request twice")
            old = int(self.cap[row])
            n = min(self.chunk, int(self.prompt[row]) - old)
            lo, hi = (old + TPB - 1) >> SHIFT, (old + n + TPB - 1) >> SHIFT
            a = self.group_base[1, 0] + row * self.blocks           # the full-attention group: one run
            self.flat[a + lo:a + hi] = self.pop(hi - lo)
            self.written.append((a + lo, a + hi))
            s_hi = min(hi, max(lo, (old + n + 1 - WINDOW) >> SHIFT))    # the window's blocks stale at settle
            if s_hi > lo:
                k = -(-2 * (s_hi - lo) // self.SCALE)
                scratch[c, :k] = self.pop(k)
                self.borrowed.append(scratch[c, :k])
                begs[c], ends[c] = lo, s_hi
            a = row * self.blocks                                   # the window group: own slots past them
            self.flat[a + s_hi:a + hi] = self.pop(hi - s_hi)
            self.written.append((a + s_hi, a + hi))
            self.cap[row] = old + n
            ctx_rows.append(row)
            tokens.append(n)
            starts.append(old)
        self.ctx_rows = ctx_rows
        written = np.array(self.written, np.int64)
        values = np.concatenate([self.flat[lo:hi] for lo, hi in self.written])
        self.written.clear()
        return ChurnFloor.prepare(self, (np.cumsum(tokens), np.array(starts), begs, ends, scratch.ravel(),
                                         written.ravel(), values))

    def settle(self, rows: np.ndarray) -> None:
        super().settle(rows)
        for c, row in enumerate(self.ctx_rows):
            hist = self.hist[row] = self.cap[row]
            end = max(0, (int(hist) + 1 - WINDOW) >> SHIFT)
            a = row * self.blocks
            vals = self.flat[a + int(self.stale_done[row]):a + end]
            held = vals[vals != BAD]
            if len(held):
                self.quarantine.append(held.copy())
            vals[:] = BAD
            self.cleared.append((a + int(self.stale_done[row]), a + end))
            self.stale_done[row] = end
            if hist == self.prompt[row]:    # it joins the list in place of one that finishes; one arrives
                p = int(self.rng.integers(len(self.ids)))
                freed = self.free(p)
                self.ids[p] = self.ctx_ids[c]
                self.ctx_ids[c] = self.arrival(freed, int(self.rng.integers(*self.lengths)))
        self.quarantine.extend(self.borrowed)
        self.borrowed = []


class Caches:
    """The two conditions a step's host work is timed under, taken in turn in blocks of BLOCK steps whose
    first WARM are not counted (so that a condition does not inherit the caches the one before left): "warm"
    (nothing runs between the steps) and "cold" (a 64 MB pass over memory before the step's timed parts:
    the benchmark runs its contenders, torch among them, between cupykv's prepare_batch and settle and
    before its next schedule; a step timed after the same pass is as slow)."""

    BLOCK, WARM = 10, 3

    def __init__(self):
        self.big = np.zeros(64 << 18, np.int32)

    def condition(self, i: int) -> str:
        return "cold" if (i // self.BLOCK) % 2 else "warm"

    def counted(self, i: int) -> bool:
        return i % self.BLOCK >= self.WARM

    def chill(self, condition: str) -> None:
        if condition == "cold":
            np.add(self.big, 1, out=self.big)


def churn_times(floor: ChurnFloor, caches: Caches, start: int, steps: int, times: dict) -> None:
    """Seconds of the floor's steps number start.. start + steps - 1, as profile_churn.churn_times takes the
    manager's: a churn step on each even number (timed: its parts "sched", "decode" (the prepare), "settle"
    and their sum "total", added to `times` keyed (condition, part)), a steady one on each odd (not timed)."""
    for i in range(start, start + steps):
        cond = caches.condition(i)
        if i % 2:
            caches.chill(cond)
            rows, _ = floor.prepare()
            floor.finish()
            caches.chill(cond)
            floor.settle(rows)
            continue
        pos = floor.arrive()
        caches.chill(cond)
        t0 = time.perf_counter()
        floor.schedule(pos)
        t1 = time.perf_counter()
        rows, _ = floor.prepare()
        t2 = time.perf_counter()
        caches.chill(cond)
        t3 = time.perf_counter()
        floor.finish()
        floor.settle(rows)
        t4 = time.perf_counter()
        if floor.cuda is not None:
            floor.cuda[2].synchronize()
        if caches.counted(i):
            for part, t in (("sched", t1 - t0), ("decode", t2 - t1), ("settle", t4 - t3),
                            ("total", t2 - t0 + t4 - t3)):
                times.setdefault((cond, part), []).append(t)


def context_times(floor: ContextFloor, caches: Caches, start: int, steps: int, times: dict) -> None:
    """Seconds of the floor's context steps' prepare, steps start.. start + steps - 1, added to `times` keyed
    (condition, "prepare"), as profile_context.context_times keys the manager's."""
    for i in range(start, start + steps):
        cond = caches.condition(i)
        caches.chill(cond)
        t0 = time.perf_counter()
        rows, _ = floor.prepare()
        t1 = time.perf_counter()
        floor.finish()
        floor.settle(rows)
        if floor.cuda is not None:
            floor.cuda[2].synchronize()
        if caches.counted(i):
            times.setdefault((cond, "prepare"), []).append(t1 - t0)


def floor_report(title: str, floor: Floor, floor_steps, wl, manager_steps, parts: tuple, cuda: bool,
                 blocks: int) -> None:
    """Print the medians of `parts` for the floor and the manager, warm and cold. Blocks of Caches.BLOCK steps
    of the two in turn, ABBA (so that neither always comes first, and the host's speed, which moves by up to
    2x within a minute on the GPU machines, moves both alike), after two blocks each not counted:
    floor_steps(floor, caches, start, steps, times) adds the floor's to times, manager_steps(wl, start,
    caches) returns the manager's, both keyed (condition, part)."""
    caches, floor_times, mgr_times = Caches(), {}, {}

    def floor_block(start, counted):
        floor_steps(floor, caches, start, Caches.BLOCK, floor_times if counted else {})

    def manager_block(start, counted):
        for k, v in manager_steps(wl, start, caches).items():
            if counted:
                mgr_times.setdefault(k, []).extend(v)
    for b in range(blocks + 2):
        for run in ((floor_block, manager_block) if b % 2 == 0 else (manager_block, floor_block)):
            run(b * Caches.BLOCK, b >= 2)
    labels = {"total": "schedule + prepare + settle", "sched": "schedule", "decode": "prepare"}
    print(f"{title}, {'with' if cuda else 'without'} CUDA calls: medians (us) of "
          + " / ".join(labels.get(p, p) for p in parts))
    for name, times in (("floor", floor_times),
                        (f"manager ({'CUDA' if cuda else 'host backend, no device work'})", mgr_times)):
        print(f"  {name:40s} " + "; ".join(
            f"{cond} " + " / ".join(f"{float(np.median(times[(cond, p)])) * 1e6:.1f}" for p in parts)
            for cond in ("warm", "cold")) + f" ({len(times[('warm', parts[0])])} steps each)")


def context_report(cuda: bool, blocks: int = 16) -> None:
    """The floor's context step and the manager's (the benchmark's workload, as churn_report): the prepare."""
    import profile_context
    from profile_manager import host_workload
    wl = host_workload(contexts=8, backend="cuda" if cuda else "host", steps=(blocks + 2) * Caches.BLOCK)
    floor_report("context step (8 chunks of 8k + 256 decodes, 128k)", ContextFloor(256, cuda), context_times,
                 wl, lambda wl, start, caches: profile_context.context_times(wl, Caches.BLOCK, start, caches=caches),
                 ("prepare",), cuda, blocks)


def churn_report(cuda: bool, blocks: int = 24) -> None:
    """The floor's churn step and the manager's (the benchmark's workload; on the GPU when there is one, else
    on the host backend with no device work): the step's schedule + prepare + settle, then each."""
    import profile_churn
    from profile_manager import host_workload
    wl = host_workload(backend="cuda" if cuda else "host", steps=(blocks + 2) * Caches.BLOCK)
    floor_report("churn step, batch 256, 128k", ChurnFloor(256, cuda), churn_times, wl,
                 lambda wl, start, caches: profile_churn.churn_times(wl, Caches.BLOCK, 0, caches=caches, start=start),
                 ("total", "sched", "decode", "settle"), cuda, blocks)


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
    if "--churn" in sys.argv or "--context" in sys.argv:
        if "--churn" in sys.argv:
            churn_report(cuda)
        if "--context" in sys.argv:
            context_report(cuda)
        return
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
