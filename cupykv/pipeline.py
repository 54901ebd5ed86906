"""The per-step device work over a backend: pack the snapshot, copy it, apply the table deltas to the
device mirror, build the tables and write positions, record the step's ready event.

Order of one step (everything after the host packing is asynchronous):

    host:   pack the step's inputs into a free pinned ring slot (never one whose copy may be pending); a
            step of the last step's list copies that step's snapshot there, writes its id and positions
            and packs its own table deltas
    then, on each device's manager stream (one Mirror per device; one device by default):
            wait for the previous step's finish on it     (its consumer's reads come before our writes)
            run the backend's StepPlan for the slot's twin (backends/plan.py; on CUDA one cupykv_step
            launch, or its graph replay with use_graphs; a small launched step's snapshot goes in the
            parameters of a cupykv_step_inline launch instead, copied by the driver at enqueue):
                copy the ring slot to its twin there       (reads the pinned slot, never the live table)
                apply the deltas to the mirror             (nothing to apply when no table cell changed)
                build the tables and write positions       (FULL: the batch's entries; DELTA: the changed
                                                           cells and the entries not current: entries.py)
            record its `ready` (also the twin's copy event: the slot is reused only after every twin's;
                                                           an inline launch leaves the slot free at once)

Every device gets the same snapshot, so the same mode and the same tables.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .layout import BAD, NO_INDEX, Layout
from .staging import (GRAPH_MIN_TOKENS, H_NUM_CELLS, H_OFF_RUN_START, H_OFF_START_POS, H_STEP, MODE_DELTA,
                      MODE_FULL, SnapshotRing, graph_buckets, pack_runs, pack_snapshot, pow2_buckets,
                      snapshot_words, step_word)
from .entries import EntryMap, most_rebuilt
from .step import DevicePart, Step, StepOutputs

# The ring's first slots are sized for a full batch with this many delta runs and changed cells; a larger
# step grows its slot (staging.SnapshotRing).
RING_RUNS, RING_CELLS = 64, 1024


class _NeverDone:
    """The copy event of a slot whose stream could not even record one after a failed run: the slot is
    never reused (the device is unusable by then)."""

    def done(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        return False


def _after_failure(backend):
    """An event after whatever a failed step's run enqueued on the backend's stream."""
    try:
        return backend.record(backend.stream)
    except Exception:       # noqa: BLE001  (the stream is broken: nothing recorded will ever complete)
        return _NeverDone()


class _DecodeList:
    """What the steps of one decode list reuse (Step.list_key: the same validated rows, tokens per entry and
    padding). The pipeline keeps one, of the last step, and drops it at every launch that is not of its
    key (StepPipeline._enqueue: its one invalidation point).

    cu: the list's token offsets [0, cumsum(num_tokens)...]. template: after a DELTA step of the list that
    rebuilt no entry, its snapshot (host, words): the next step rebuilds none either, so its snapshot's list
    part is the template's but for its id and start positions; it copies the template, writes those two,
    and packs only its own table deltas (staging.pack_runs) unless it has none and the template had none
    either (a quiet step)."""

    __slots__ = ("key", "cu", "host", "words", "list_words", "_starts")

    def __init__(self, key: tuple, cu: np.ndarray):
        self.key, self.cu = key, cu
        self.host = None            # no template yet

    def keep_template(self, host: np.ndarray, words: int) -> None:
        self.host, self.words = host, words
        self.list_words = int(host[H_OFF_RUN_START])        # where the runs part starts
        self._starts = int(host[H_OFF_START_POS])

    def repack(self, buf: np.ndarray, step: Step, cells: np.ndarray, values: np.ndarray,
               cleared: Optional[np.ndarray], written) -> int:
        """Write `step`'s snapshot into `buf` (a ring slot; the deltas as pack_snapshot takes them); returns
        its words. buf then holds the template."""
        quiet = self.words == self.list_words + 1       # the template's runs part is empty: run_coff = [0]
        if buf is not self.host:
            # The list part, and the empty runs part with it: the template's own deltas are not this step's,
            # and buf is sized for this step's snapshot, which may be shorter than the template's.
            n = self.words if quiet else self.list_words
            buf[:n] = self.host[:n]
            self.host = buf
        buf[H_STEP] = step_word(step.id)
        buf[self._starts:self._starts + len(step.rows)] = step.start_positions
        if len(cells) or cleared is not None or written is not None or not quiet:
            self.words = pack_runs(buf, self.list_words, cells, values, cleared, written)
        return self.words


class KernelConsts:
    """Per-manager constants the kernels need (host copies, and device copies for the CUDA backend)."""

    def __init__(self, layout: Layout, max_batch: int, backend):
        self.num_groups, self.num_layers = layout.num_groups, layout.num_layers
        self.rows = self.max_batch = max_batch
        self.max_blocks, self.tokens_per_block = layout.max_blocks, layout.tpb
        self.layer_group, self.layer_koff, self.group_scale = layout.layer_group, layout.layer_koff, layout.group_scale
        self.d_layer_koff = backend.upload(layout.layer_koff)
        self.d_group_scale = backend.upload(layout.group_scale)
        self.d_group_layers = backend.upload(layout.group_layers)
        # Each group's null slot (CacheSpec.null_slot: BAD cells of the tables and padding rows hold its page),
        # BAD where the spec has none. The mirror and the write positions keep BAD either way.
        nulls = layout.null_slots if layout.null_slots is not None else (BAD,) * layout.num_groups
        self.group_null = np.array(nulls, np.int32)
        self.d_group_null = backend.upload(self.group_null)


class Mirror:
    """One device's side of the pipeline, on its backend: the device mirror of the host table, the output
    buffers and the kernel constants.

    mirror: int32 [P, rows, B]; row_entry: int32 [rows], the output entry each row was last written whole
    at (the changed cells of later steps go there; see entries.py); outputs: the tables and write positions.
    """

    def __init__(self, layout: Layout, backend, rank: int):
        spec = layout.spec
        self.rank, self.backend = rank, backend
        self.shared = spec.table_mode == "shared"
        P, rows, B = layout.num_groups, spec.max_batch, layout.max_blocks
        self.consts = KernelConsts(layout, rows, backend)
        self.mirror = backend.device_full((P, rows, B), BAD, np.int32)
        self.row_entry = backend.device_full((rows,), -1, np.int32)
        planes = P if self.shared else layout.num_layers
        self.outputs = out = StepOutputs(backend.device_full((planes, rows, 2, B), BAD, np.int32),
                                         backend.device_full((layout.num_layers, spec.step_token_capacity), BAD,
                                                             np.int32),
                                         backend.device_full((spec.step_token_capacity,), 0, np.int32))
        # What the step launches take after the snapshot (fixed for the life of the manager).
        self.buffers = (self.mirror, out.tables, self.row_entry, out.write_pages, out.write_offsets, self.consts)
        self._plans: dict = {}       # id(ring-slot twin) -> its StepPlan (the plans' one owner)

    def plan(self, twin):
        """The backend's StepPlan for a ring-slot twin of this device, made again when the slot has grown."""
        plan = self._plans.get(id(twin))
        if plan is None or not plan.fits(twin):
            plan = self._plans[id(twin)] = self.backend.step_plan(twin, self.buffers, self.shared)
        return plan


class StepPipeline:
    """The device side of a manager: the snapshot ring and a Mirror per device (backends: one per device,
    in KVCacheManager(devices=...) order; device 0's is `backend`)."""

    def __init__(self, layout: Layout, backends: Sequence, *, ring_slots: int, max_ring_slots: int,
                 timeout_s: float, use_graphs: bool, steady_batch_delta: bool):
        spec = layout.spec
        self.backends = list(backends)
        self.backend = self.backends[0]
        self.use_graphs = use_graphs
        self.steady_batch_delta = steady_batch_delta
        self.mirrors = [Mirror(layout, be, rank) for rank, be in enumerate(self.backends)]
        P, rows = layout.num_groups, spec.max_batch
        words = snapshot_words(rows, 0, P, 0, RING_RUNS, RING_CELLS, most_rebuilt(rows), rows)
        self.ring = SnapshotRing(self.backends, words, ring_slots, max_ring_slots, timeout_s)
        self.entries = EntryMap(rows, rows)     # which output entry holds which row (its one owner)
        self._graph_caps = (rows, spec.step_token_capacity)     # what graph buckets are capped at (the outputs')
        self.force_full = False      # a launch failed part-way: the outputs may hold anything
        self.h2d_bytes_last_step = 0
        self._prev: Optional[Step] = None
        self._list: Optional[_DecodeList] = None        # the last step's, if a decode list's

    # Device 0's buffers (the only ones of a one-device manager).
    consts = property(lambda self: self.mirrors[0].consts)
    mirror = property(lambda self: self.mirrors[0].mirror)
    row_entry = property(lambda self: self.mirrors[0].row_entry)
    outputs = property(lambda self: self.mirrors[0].outputs)

    def acquire(self, words: int):
        """A ring slot for a snapshot of `words` words (may wait for a slot's copy; see SnapshotRing)."""
        return self.ring.acquire(words)

    def launch(self, step: Step, slot, cells: np.ndarray, values: np.ndarray, cleared: Optional[np.ndarray],
               written, after) -> None:
        """Enqueue the step's device work on every device's manager stream, each after the previous step's
        finish on that device and the events `after` (copies of resumed KV); sets step.mode, step.parts
        and their ready events. The table deltas: cells (int64) and values (int32), and the ranges cleared
        to BAD, cleared (None or int64 [n, 2], [lo, hi)), and the ranges written whole with their values,
        written (None or a pair of arrays; PageTable.logged)."""
        step.parts = [DevicePart(m.rank, m.backend, m.outputs) for m in self.mirrors]
        prev = self._prev.parts if self._prev is not None else ()
        for part in prev:
            part.backend.wait(part.backend.stream, part.finished)
        for event in after:
            for m in self.mirrors:
                m.backend.wait(m.backend.stream, event)
        allow_delta, self.force_full = not self.force_full, True    # until fully enqueued
        self._enqueue(step, slot, cells, values, cleared, written, allow_delta)
        self.force_full = False
        self._prev = step
        for m in self.mirrors:
            m.outputs.holder = step.id

    def _enqueue(self, step: Step, slot, cells, values, cleared, written, allow_delta: bool) -> None:
        listed, self._list = self._list, None
        if step.list_key is None:
            listed = None
        elif listed is None or listed.key != step.list_key:
            listed = _DecodeList(step.list_key, step.cu_tokens())
        cu_tokens = listed.cu if listed is not None else step.cu_tokens()
        if listed is not None and listed.host is not None and allow_delta:
            step.mode, entries = MODE_DELTA, 0
            words = listed.repack(slot.host, step, cells, values, cleared, written)
        else:
            rebuilt, held = self._entries(step, allow_delta)
            step.mode = MODE_FULL if rebuilt is None else MODE_DELTA
            words = pack_snapshot(slot.host, step.id, step.rows, step.scratch_begs, step.scratch_ends,
                                  step.scratch_slots, cells, values, cu_tokens, step.start_positions,
                                  mode=step.mode, pad_to=step.pad_to, rebuilt=rebuilt, held=held, cleared=cleared,
                                  written=written)
            # the entries whose tables the step writes whole: the batch and its padding (a FULL grid and graph
            # bucket cover one at least), or the rebuilt ones
            entries = max(step.num_seqs, step.pad_to, 1) if rebuilt is None else len(rebuilt)
            if listed is not None:
                listed.host = None          # (a template of the list's earlier steps is not this one's)
                if step.mode == MODE_DELTA and not entries:
                    listed.keep_template(slot.host, words)
        # the cells the apply covers: the ranges' cells too, as packed (a step without ranges skips the read)
        num_cells = len(cells) if cleared is None and written is None else int(slot.host[H_NUM_CELLS])
        tokens = int(cu_tokens[-1])
        # Buckets keep the number of graphs small (every device has the same buffer sizes).
        graph = graph_buckets(words, entries, tokens, slot.capacity, *self._graph_caps) if self.use_graphs else None
        h2d_words = 0
        for m, twin, part in zip(self.mirrors, slot.twins, step.parts):
            plan = m.plan(twin)
            # One event for both: the twin's copy is done when the step is (an event between the copy and
            # the kernels would cost the GPU time every step, and the slot is reused only later). A run whose
            # snapshot went in its launch leaves nothing that reads the slot: it is free again at once.
            route = plan.route(words, graph)
            try:
                part.ready = plan.run(m.backend.stream, step.mode, words, num_cells, entries, tokens, graph, route)
                twin.copied = part.ready if route.reads_slot else None
            except BaseException:
                # A run that failed part-way may have enqueued what reads the slot (the copy, a launch whose
                # ready record failed): the slot is not handed out again before the stream has run it.
                twin.copied = _after_failure(m.backend)
                raise
            h2d_words += route.h2d_words
        self.h2d_bytes_last_step = h2d_words * 4
        self._list = listed

    def capture_graphs(self) -> int:
        """Capture now every step graph the ring slots can need on every device (CUDA backend with
        use_graphs; 0 elsewhere), with the buckets the steps round to; returns how many were captured."""
        captured = 0
        for m in self.mirrors:
            capture = getattr(m.backend, "capture_step_graphs", None)
            if capture is None or not self.use_graphs:
                continue
            captured += capture([m.plan(s.twins[m.rank]) for s in self.ring.slots],
                                pow2_buckets(1, m.consts.max_batch),
                                pow2_buckets(GRAPH_MIN_TOKENS, m.outputs.write_offsets.size))
        return captured

    def _entries(self, step: Step, allow_delta: bool):
        """(rebuilt, held) of the step from the entry map (EntryMap.advance): rebuilt None means FULL.
        allow_delta False (a launch failed part-way before) forgets what the outputs hold."""
        entries = self.entries
        if not allow_delta:
            entries.forget()
        return entries.advance(step.rows, step.num_contexts, step.pad_to, allow_delta and self.steady_batch_delta)

    def verify_mirror(self, table) -> None:
        """Debug: wait for each device's manager stream and check its mirror against the host table (a
        PageTable). Cells logged since the last prepare are skipped: the mirrors hold their value at that
        prepare."""
        for m in self.mirrors:
            m.backend.stream.synchronize()
            mirror = m.backend.to_numpy(m.mirror).reshape(-1)
            ok = np.ones(mirror.size, bool)
            ok[table.logged_cells()] = False
            bad = np.flatnonzero(ok & (mirror != table.flat))
            if len(bad):
                raise AssertionError(f"device {m.rank}'s mirror differs from the host table at {len(bad)} cells, "
                                     f"first flat index {int(bad[0])}")


class UnsafeStaging(StepPipeline):
    """UNSAFE, for the race tests only: the step's metadata from a pinned pool array dropped right after
    enqueue, and each mirror copied whole from the live host table. Both are read when the copies run, not
    at prepare, which is the race cupykv exists to prevent; the race tests prove they catch it here."""

    def __init__(self, layout: Layout, backends: Sequence, table, **kw):
        super().__init__(layout, backends, **kw)
        self.table = table.array            # the live host table
        self.max_batch, self.num_groups = layout.spec.max_batch, layout.num_groups
        self._dev: List = [None] * len(self.mirrors)

    def acquire(self, words: int):
        return None

    def _enqueue(self, step: Step, slot, cells, values, cleared, written, allow_delta: bool) -> None:
        # Sized for the largest batch, as a persistent metadata buffer would be: every step (and any other
        # pinned allocation of that size class) gets the block the previous one dropped.
        words = snapshot_words(self.max_batch, self.max_batch, self.num_groups,
                               max(16, step.scratch_slots.shape[2]), 0, 0)
        tmp = self.backend.pinned_temp(words)
        words = pack_snapshot(tmp, step.id, step.rows, step.scratch_begs, step.scratch_ends, step.scratch_slots,
                              NO_INDEX, NO_INDEX, step.cu_tokens(), step.start_positions)
        for m, part in zip(self.mirrors, step.parts):
            be, st, out = m.backend, m.backend.stream, m.outputs
            if self._dev[m.rank] is None or len(self._dev[m.rank]) < words:
                self._dev[m.rank] = be.device_empty(max(words, 4096))
            dev = self._dev[m.rank]
            be.copy_h2d(dev, tmp, words, st)
            be.copy_h2d(m.mirror, self.table, self.table.size, st)
            be.build_step(st, dev, m.mirror, out.tables, m.row_entry, out.write_pages, out.write_offsets, m.consts,
                          m.shared, MODE_FULL, num_entries=step.num_seqs, num_tokens=step.total_tokens)
            part.ready = be.record(st)
        self.h2d_bytes_last_step = (words + self.table.size) * 4 * len(self.mirrors)
