"""Snapshot packing and the pinned snapshot ring.

A step's asynchronous host inputs travel to the device as one int32 snapshot, laid out as below, written
into a pinned ring slot: the step kernel reads it from there over the bus, or a small one travels in the
launch's parameters (pipeline.py's docstring draws both). A ring slot is written again only after the event recorded
after its last copy has completed, and a slot's pinned buffer is dropped only then (when the slot grows:
SnapshotRing._fit): CuPy's pinned pool would hand a dropped buffer to the next allocation while its copy
may still be pending. A grown slot's device buffers are retired, not dropped (kernels may still read them).

Snapshot layout (int32 words; the device kernels read every count and offset from the header). The list
part comes first: what a generation list's decode steps share but for the step id and start positions.
The runs part, the step's own table deltas, comes last (pack_runs), so a step of the same list as the last
one can copy the list part and pack only its runs (pipeline._DecodeList).

    header[HEADER_WORDS]              the list part's words (H_STEP ... H_OFF_REBUILT), then the runs part's
                                      (H_NUM_RUNS ... H_OFF_VALUES)
    copy_idx[num_seqs]                table row of each batch entry (contexts first)
    cu_tokens[num_seqs + 1]           new tokens of batch entry s: [cu_tokens[s], cu_tokens[s+1])
    start_pos[num_seqs]               sequence position of entry s's first new token
    held[num_held]                    the table row whose tables the output keeps, after this step, at each
                                      entry [live, live + num_held) past the batch (live = max(num_seqs,
                                      pad_to)), or a negative value for none (entries.NONE, PADDING): the
                                      changed cells of those rows are written there too
    begs[P, num_contexts]             scratch block range of each context, per group
    ends[P, num_contexts]
    scratch[P, num_contexts, M]       scratch slot ids (M = header[H_SCRATCH_WIDTH])
    rebuilt[num_rebuilt]              DELTA: the entries whose tables are written whole (the others get
                                      only their changed cells); empty in FULL mode (every entry is)
    run_start[num_runs]               table deltas as runs of consecutive cells: flat start index into
                                      table[P, rows, B]
    run_coff[num_runs + 1]            run r is the step's changed cells [run_coff[r], run_coff[r + 1]) (of
                                      num_cells)
    run_value[num_runs]               where run r's values start in values[], or ~v (negative): every cell
                                      of the run takes values[v] (a fill run: a freed row's BAD cells)
    values[num_values]

Which entry holds which row: row_entry[row] (device) is the entry the step that last wrote the row whole
put it at; a changed cell of `row` goes to entry e = row_entry[row] when this step's batch has the row
there (e < live: copy_idx[e] == row, not a context) or held[e - live] == row. The host keeps the same map
(entries.EntryMap) and decides from it which entries a DELTA step rebuilds.
"""
from __future__ import annotations

import functools
import struct
from typing import Dict, List, Optional, Sequence

import numpy as np

from .errors import StagingExhaustedError
from .layout import BAD, FILL_MIN_RUN, NO_INDEX, QUAD_BLOCKS

# The header's words, in the order pack_snapshot writes them: the list part's counts, then its sections'
# offsets in layout order, then the runs part's counts and offsets.
H_STEP, H_NUM_SEQS, H_NUM_CONTEXTS, H_SCRATCH_WIDTH, H_NUM_TOKENS, H_MODE = range(6)
H_PAD_TO = 6               # rows [num_seqs, pad_to) of the output are written BAD or the null page (fixed-size consumers)
H_NUM_HELD, H_NUM_REBUILT = 7, 8
H_OFF_COPY_IDX, H_OFF_CU_TOKENS, H_OFF_START_POS, H_OFF_HELD = range(9, 13)
H_OFF_BEGS, H_OFF_ENDS, H_OFF_SCRATCH, H_OFF_REBUILT = range(13, 17)
H_NUM_RUNS, H_NUM_CELLS, H_NUM_VALUES, H_OFF_RUN_START, H_OFF_RUN_COFF, H_OFF_RUN_VALUE, H_OFF_VALUES = range(17, 24)
HEADER_WORDS = 24

# H_MODE: FULL rewrites the batch's entries of the output whole; DELTA rewrites whole only the rebuilt
# entries (its contexts among them), and the changed cells of the others.
MODE_FULL, MODE_DELTA = 0, 1


def kernel_constants() -> Dict[str, int]:
    """The snapshot layout as the step kernels see it: every header word index (H_*), HEADER_WORDS,
    MODE_FULL / MODE_DELTA, BAD and QUAD_BLOCKS, by name. This module (and layout.py for BAD and QUAD_BLOCKS) is
    their only definition."""
    header = sorted((value, name) for name, value in globals().items() if name.startswith("H_"))
    return {**{name: value for value, name in header}, "HEADER_WORDS": HEADER_WORDS,
            "MODE_FULL": MODE_FULL, "MODE_DELTA": MODE_DELTA, "BAD": BAD, "QUAD_BLOCKS": QUAD_BLOCKS}


def cuda_constants() -> str:
    """kernel_constants() as CUDA C++ (`constexpr int NAME = value;`, one a line), which the CUDA backend
    prepends to cupykv/kernels/step.cu: the kernels read the header through these names and define none."""
    return "".join(f"constexpr int {name} = {int(value)};\n" for name, value in kernel_constants().items())


def pow2_at_least(n: int) -> int:
    """The power of two a count rounds up to (graph buckets: batch size, tokens, copy words)."""
    return 1 << max(int(n) - 1, 0).bit_length()


# A step graph replay rounds its copy up to at least this many words and its token count to at least this
# many tokens (graph_buckets): fewer graphs, each a little larger than a decode step needs.
GRAPH_MIN_COPY_WORDS, GRAPH_MIN_TOKENS = 1024, 256


@functools.lru_cache(maxsize=4096)
def graph_buckets(words: int, entries: int, tokens: int, slot_capacity: int, max_batch: int,
                  token_capacity: int) -> tuple:
    """(copy words, batch bucket, token bucket) of the step graph that replays a step: each count rounded up
    to a power of two, capped at its buffer's size (the kernels read the true counts from the snapshot).
    entries: the entries the step writes whole (0, a DELTA step that rebuilds none, stays 0). Cached, as
    a pure function: a step's counts are mostly the last one's."""
    return (min(pow2_at_least(max(words, GRAPH_MIN_COPY_WORDS)), slot_capacity),
            min(pow2_at_least(entries), max_batch) if entries else 0,
            min(pow2_at_least(max(tokens, GRAPH_MIN_TOKENS)), token_capacity))


def pow2_buckets(lowest: int, cap: int) -> list:
    """The sizes a count in [1, cap] rounds up to: powers of two from the first one >= lowest, capped at
    cap (the last bucket is cap itself)."""
    cap = max(int(cap), 1)
    size = pow2_at_least(lowest)
    buckets = [min(size, cap)]
    while size < cap:
        size *= 2
        buckets.append(min(size, cap))
    return buckets


def runs_from_cells(cells: np.ndarray):
    """Flat cell indices -> (run_start, run_coff): maximal runs of consecutive ascending cells, in order.
    Any order and repeats are fine (the values of a repeated cell are equal); sorted input packs tightest."""
    n = len(cells)
    if n == 0:
        return _NO_RUNS
    # run r covers cells[coff[r]:coff[r + 1]]; a run breaks wherever consecutive cells are not adjacent.
    # The break mask is written in place: at decode sizes each numpy call costs more than the data.
    breaks = np.empty(n + 1, bool)
    breaks[0] = breaks[n] = True
    np.not_equal(cells[1:], cells[:-1] + 1, out=breaks[1:n])
    coff = breaks.nonzero()[0]
    return cells[coff[:-1]], coff


_NO_RUNS = (NO_INDEX, np.zeros(1, np.int64))     # read-only use: packed, never written
_NO_RUNS[1].flags.writeable = False
_ONE_BAD = np.full(1, BAD, np.int32)
_ONE_BAD.flags.writeable = False

# A step with at most this many changed cells ships each cell as a run of its own (run_coff 0, 1, 2, ...):
# finding the runs takes more numpy calls than the words they would save (docs/host_profile.md in git history). A
# context chunk's new slots come as written ranges, a freed row as a cleared range; what such a step still
# logs cell by cell is mostly a block opened or released per row, seldom adjacent. When some are (a window
# release of 16-63 blocks a row: a chunk's, in a group without scratch reuse), each-cell runs ship up to
# 4 words a cell where their fill run would ship 4 words in all: at most 252 words more a step.
EACH_CELL_MAX = 64
_EACH_CELL = np.arange(EACH_CELL_MAX + 1, dtype=np.int64)     # read-only use: packed, never written
_EACH_CELL.flags.writeable = False


def run_values(run_coff: np.ndarray, values: np.ndarray):
    """(run_value, the values to ship) for runs over `values` (one per changed cell; page-table values, so
    slots >= 0 or BAD): a run of at least FILL_MIN_RUN cells that are all BAD ships one BAD, as a fill run
    (run_value ~v), and every other run its values in order (run_value: where they start). The layout and
    the kernels take a fill run of any value; only BAD is worth looking for."""
    n, num_runs = len(values), len(run_coff) - 1
    if n - num_runs + 1 < FILL_MIN_RUN:          # no run is that long
        return run_coff[:-1], values
    long = ((run_coff[1:] - run_coff[:-1]) >= FILL_MIN_RUN).nonzero()[0]
    # a run of BAD starts and ends on BAD (the runs of new slots a prefill writes do not), and as slots are
    # >= 0 it is all BAD when its largest value is
    bounds = zip(long.tolist(), run_coff[long].tolist(), run_coff[long + 1].tolist())
    fills = [(r, start, end) for r, start, end in bounds
             if values[start] == BAD and values[end - 1] == BAD and np.maximum.reduce(values[start:end]) == BAD]
    if not fills:
        return run_coff[:-1], values
    # The values between fill runs stay contiguous: they ship as slices, each fill run as its first value,
    # and every later run's values start that many fewer words on.
    pieces, run_value, at = [], run_coff[:-1].copy(), 0
    for r, start, end in fills:
        pieces.append(values[at:start + 1])
        at = end
        run_value[r + 1:] -= end - start - 1
        run_value[r] = ~run_value[r]
    pieces.append(values[at:])
    return run_value, np.concatenate(pieces)


def snapshot_runs(cells: np.ndarray, values: np.ndarray):
    """(run_start, run_coff, run_value, shipped): the runs pack_snapshot ships changed cells (int64) with
    values (int32) as. At most EACH_CELL_MAX cells: each cell a run of its own; else their runs of adjacent
    cells (runs_from_cells), a run of FILL_MIN_RUN or more BAD cells as one BAD (run_values)."""
    if len(cells) <= EACH_CELL_MAX:
        run_coff = _EACH_CELL[:len(cells) + 1]
        return cells, run_coff, run_coff[:-1], values
    run_start, run_coff = runs_from_cells(cells)
    return (run_start, run_coff) + run_values(run_coff, values)


def step_word(step_id: int) -> int:
    """The header's H_STEP word of a step id (its low 31 bits: an int32 that stays non-negative)."""
    return step_id & 0x7FFFFFFF


def snapshot_words(num_seqs: int, num_contexts: int, num_groups: int, scratch_width: int,
                   num_runs: int, num_values: int, num_rebuilt: int = 0, num_held: int = 0) -> int:
    """The words of a snapshot with these counts (num_values: the values shipped; at most the changed
    cells, fewer with fill runs)."""
    return (HEADER_WORDS + num_seqs + 2 * num_groups * num_contexts + num_groups * num_contexts * scratch_width
            + num_runs + (num_runs + 1) + num_runs + num_values + (num_seqs + 1) + num_seqs + num_rebuilt
            + num_held)


def _ranges_after(runs: tuple, lo: np.ndarray, past: np.ndarray, run_value: np.ndarray, values: np.ndarray) -> tuple:
    """runs (run_start, run_coff, run_value, shipped) followed by the ranges starting at lo (int64 [n]) with
    cumulative lengths past (int64 [n]), whose run values are run_value and whose values follow the shipped
    ones."""
    run_start, run_coff, first, shipped = runs
    return (np.concatenate((run_start, lo)), np.concatenate((run_coff, run_coff[-1] + past)),
            np.concatenate((first, run_value)), np.concatenate((shipped, values)))


def pack_snapshot(buf: np.ndarray, step_id: int, copy_idx, begs, ends, scratch, cells, values,
                  cu_tokens, start_pos, mode: int = MODE_FULL, pad_to: int = 0, rebuilt=None,
                  held=None, cleared=None, written=None) -> int:
    """Write one step's inputs into `buf` (int32, large enough); returns the words used.

    begs/ends: [P, num_contexts]; scratch: [P, num_contexts, M]; rebuilt: DELTA mode's entries to write
    whole (None: none); held: the rows kept past the batch (None: none); cells, values, cleared, written:
    the table deltas, as pack_runs takes them.
    """
    rebuilt = NO_INDEX if rebuilt is None else rebuilt
    held = NO_INDEX if held is None else held
    sections = (copy_idx, cu_tokens, start_pos, held, begs.ravel(), ends.ravel(), scratch.ravel(), rebuilt)
    words = [step_word(step_id), len(copy_idx), begs.shape[1], scratch.shape[2],
             int(cu_tokens[-1]) if len(cu_tokens) else 0, mode, pad_to, len(held), len(rebuilt)]
    # Each section starts where the one before it ends. The empty ones (most of a decode step's) are left out
    # of the concatenation, whose cost grows with the number of arrays more than with their data.
    pieces, pos = [], HEADER_WORDS
    for a in sections:
        words.append(pos)
        if a.size:
            pieces.append(a)
            pos += a.size
    # One struct pack and one concatenation straight into the buffer: at decode sizes each numpy call (a
    # list assigned to a slice is one, with a conversion per item) costs more than the data.
    _LIST_HEADER.pack_into(buf, 0, *words)
    if pieces:
        np.concatenate(pieces, out=buf[HEADER_WORDS:pos])
    return pack_runs(buf, pos, cells, values, cleared, written)


def pack_runs(buf: np.ndarray, pos: int, cells, values, cleared=None, written=None) -> int:
    """Write a step's table deltas into `buf` from word `pos` on (the runs part: the last of the snapshot)
    and their header words; returns the snapshot's words.

    cells: flat indices of changed table cells (int64, any order; a repeated cell must carry the same value
    each time) and `values` their values (int32, slots or BAD), shipped as snapshot_runs gives them;
    written: None or (int64 [n >= 1, 2] flat ranges [lo, hi), int32 their cells' values range after range),
    each range shipped as a run after the cells' runs; cleared: None or int64 [n >= 1, 2], flat ranges
    [lo, hi) that hold BAD in every cell, each shipped as a fill run after those.
    """
    runs = snapshot_runs(cells, values)
    num_cells = len(cells)
    if written is not None:         # each range's values, where its run's values start
        ranges, written_values = written
        length = ranges[:, 1] - ranges[:, 0]
        past = length.cumsum()
        runs = _ranges_after(runs, ranges[:, 0], past, len(runs[3]) + past - length, written_values)
    if cleared is not None:         # every range's one value is the same BAD, shipped once
        runs = _ranges_after(runs, cleared[:, 0], (cleared[:, 1] - cleared[:, 0]).cumsum(),
                             np.full(len(cleared), ~len(runs[3]), np.int64), _ONE_BAD)
    run_start, run_coff, run_value, shipped = runs
    if written is not None or cleared is not None:
        num_cells = int(run_coff[-1])
    n = len(run_start)
    end = pos + 3 * n + 1 + len(shipped)
    _RUNS_HEADER.pack_into(buf, _LIST_HEADER.size, n, num_cells, len(shipped), pos, pos + n, pos + 2 * n + 1,
                           pos + 3 * n + 1)
    np.concatenate(runs, out=buf[pos:end])
    return end


# The header's words as native int32 (the buffer's dtype): the list part's, then the runs part's (H_NUM_RUNS on),
# which start where the list part's bytes end.
_LIST_HEADER = struct.Struct(f"={H_NUM_RUNS}i")
_RUNS_HEADER = struct.Struct(f"={HEADER_WORDS - H_NUM_RUNS}i")


def unpack_snapshot(snap: np.ndarray, num_groups: int) -> dict:
    """The inverse of pack_snapshot (used by the host backend's kernels and by tests)."""
    h = snap[:HEADER_WORDS]
    n, c, m, r = int(h[H_NUM_SEQS]), int(h[H_NUM_CONTEXTS]), int(h[H_SCRATCH_WIDTH]), int(h[H_NUM_RUNS])

    def sect(off, count, shape=None):
        a = snap[int(h[off]):int(h[off]) + count]
        return a.reshape(shape) if shape else a

    return dict(
        step=int(h[H_STEP]), mode=int(h[H_MODE]), pad_to=int(h[H_PAD_TO]), num_seqs=n, num_contexts=c,
        scratch_width=m, num_tokens=int(h[H_NUM_TOKENS]),
        copy_idx=sect(H_OFF_COPY_IDX, n), begs=sect(H_OFF_BEGS, num_groups * c, (num_groups, c)),
        ends=sect(H_OFF_ENDS, num_groups * c, (num_groups, c)),
        scratch=sect(H_OFF_SCRATCH, num_groups * c * m, (num_groups, c, m)),
        num_cells=int(h[H_NUM_CELLS]),
        run_start=sect(H_OFF_RUN_START, r), run_coff=sect(H_OFF_RUN_COFF, r + 1),
        run_value=sect(H_OFF_RUN_VALUE, r), values=sect(H_OFF_VALUES, int(h[H_NUM_VALUES])),
        cu_tokens=sect(H_OFF_CU_TOKENS, n + 1), start_pos=sect(H_OFF_START_POS, n),
        rebuilt=sect(H_OFF_REBUILT, int(h[H_NUM_REBUILT])), held=sect(H_OFF_HELD, int(h[H_NUM_HELD])))


class SlotTwin:
    """A ring slot as one device sees it: the slot's pinned buffer (shared by every device), this device's
    copy of it, and the event after this device's last copy of it. What the backends' step launches take."""

    __slots__ = ("slot", "dev", "copied")

    def __init__(self, slot: "RingSlot", backend, words: int):
        self.slot = slot
        self.dev = backend.device_empty(words)
        self.copied = None          # event after the last work that reads `host` (its step's ready), or None

    host = property(lambda self: self.slot.host)
    capacity = property(lambda self: self.slot.capacity)

    def busy(self) -> bool:
        return self.copied is not None and not self.copied.done()


class RingSlot:
    """One pinned snapshot buffer and its twin on each device (KVCacheManager(devices=...); one device
    by default). The buffer is written again only after every twin's copy of it has completed."""

    def __init__(self, backends: Sequence, words: int):
        self.host = backends[0].pinned_empty(words)
        self.twins = [SlotTwin(self, be, words) for be in backends]
        self.retired: List = []     # outgrown device buffers kernels may still read; kept alive

    @property
    def capacity(self) -> int:
        return len(self.host)

    def busy(self) -> bool:
        for twin in self.twins:      # a loop: it runs for every acquire, and a generator costs more
            if twin.busy():
                return True
        return False

    def unread(self) -> bool:
        """Whether no device's work reads the pinned buffer since its last step was enqueued (an inline
        launch's snapshot is copied by the driver at enqueue)."""
        for twin in self.twins:
            if twin.copied is not None:
                return False
        return True

    def wait(self, timeout_s: float) -> bool:
        """Host wait for every twin's copy; False when one did not complete within timeout_s."""
        return all(t.copied is None or t.copied.wait(timeout_s) for t in self.twins)


class SnapshotRing:
    """Pinned snapshot slots, reused only once every device's copy event has completed.

    Slots are handed out in turn, except that a slot nothing read after its step's enqueue (an inline
    launch's: SlotTwin.copied None) is handed out again at once: a run of small launched steps stays on one
    slot, whose list snapshot (pipeline._DecodeList) is then patched in place. Steps that read their
    slot (copies, graph replays) go round, so each slot gets its step graphs early, not behind a busy stream.
    When every slot is in flight the ring grows, up to max_slots; then it waits for the oldest slot,
    up to timeout_s, and raises StagingExhaustedError. It never hands out a busy slot.
    """

    def __init__(self, backends: Sequence, words: int, initial_slots: int = 4, max_slots: int = 64,
                 timeout_s: float = 10.0):
        self.backends = list(backends)
        self.words = words
        self.max_slots = max_slots
        self.timeout_s = timeout_s
        self.slots: List[RingSlot] = [RingSlot(self.backends, words) for _ in range(initial_slots)]
        self._next = 0
        self._last: Optional[RingSlot] = None      # the slot handed out last

    def acquire(self, words: int) -> RingSlot:
        last = self._last
        if last is not None and last.unread():
            return self._fit(last, words)
        self._last = slot = self._take(words)
        return slot

    def _take(self, words: int) -> RingSlot:
        n = len(self.slots)
        for k in range(n):
            slot = self.slots[(self._next + k) % n]
            if not slot.busy():
                self._next = (self._next + k + 1) % n
                return self._fit(slot, words)
        if n < self.max_slots:
            slot = RingSlot(self.backends, max(words, self.words))
            self.slots.append(slot)
            return slot
        oldest = self.slots[self._next]
        if not oldest.wait(self.timeout_s):
            raise StagingExhaustedError(
                f"all {n} snapshot slots are still being copied after {self.timeout_s} s; is the manager "
                f"stream blocked (a gate, a consumer event that never completes)?")
        self._next = (self._next + 1) % n
        return self._fit(oldest, words)

    def _fit(self, slot: RingSlot, words: int) -> RingSlot:
        if words > slot.capacity:
            # Every copy of the slot has completed, so its pinned buffer may go; kernels may still read the
            # device buffers, so those are retired, not dropped.
            new = max(words, 2 * slot.capacity)
            slot.host = self.backends[0].pinned_empty(new)
            for twin, be in zip(slot.twins, self.backends):
                slot.retired.append(twin.dev)
                twin.dev = be.device_empty(new)
        return slot

    def in_flight(self) -> int:
        return sum(s.busy() for s in self.slots)
