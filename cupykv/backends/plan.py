"""A step's device work on one device, split into plan and run (FlashInfer's split, for the step pipeline).

plan (StepPlan(...), once per ring-slot twin and mirror): the buffers the step's copy and kernels read and
write, fixed for as long as the twin keeps its buffers. run (every step): the copy of the snapshot, the
delta apply, the build of the tables and write positions (or the one graph replay that does all three),
and the step's ready event.

StepPlan composes a backend's primitives (copy_h2d, apply_deltas, build_step, record)
and is what the host backend runs; the CUDA backend's plan (cuda.CudaStepPlan) does the same work with
its arguments packed once and raw CUDA calls.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

# (copy words, batch bucket, token bucket) of a graph replay (staging.graph_buckets), or None: no graph.
GraphBuckets = Optional[Tuple[int, int, int]]


class Route(NamedTuple):
    """How a step's snapshot travels, decided once per step (StepPlan.route)."""
    launch: object          # the CUDA plan's inline launch (words, PackedLaunch) carrying it, or None
    reads_slot: bool        # run() leaves work on the stream that reads the ring slot's host buffer (the
                            # copy): the slot may be written again only after run()'s event; False where the
                            # snapshot travels in the launch itself, copied by the driver at enqueue
    h2d_words: int          # snapshot words taken to the device (a graph replay copies its bucket)


class StepPlan:
    """One device's step launches for one ring-slot twin (staging.SlotTwin) and one mirror's buffers.

    buffers: (mirror int32 [P, rows, B], tables int32 PER_LAYER [L, rows, 2, B] or SHARED [P, rows, 2, B],
    row_entry int32 [rows], write_pages int32 [L, capacity], write_offsets int32 [capacity], consts),
    as pipeline.Mirror.buffers holds them. Valid while `twin.dev` and `twin.host` are the buffers it was
    made with (fits()); a ring slot that grows needs a new plan.
    """

    def __init__(self, backend, twin, buffers: tuple, shared: bool):
        self.backend, self.twin, self.buffers, self.shared = backend, twin, buffers, bool(shared)
        self.dev, self.host = twin.dev, twin.host
        self._copy_routes: dict = {}        # h2d words -> Route: made once per size (most steps repeat one)

    def fits(self, twin) -> bool:
        """Whether this plan is still right for `twin` (its buffers were not replaced by a grown slot)."""
        return self.twin is twin and self.dev is twin.dev and self.host is twin.host

    def route(self, words: int, graph: GraphBuckets = None) -> Route:
        """How a step of `words` snapshot words (and these graph buckets) travels: here always a copy."""
        h2d = graph[0] if graph is not None else words
        route = self._copy_routes.get(h2d)
        if route is None:
            if len(self._copy_routes) >= 1024:      # sizes are bounded by the slot; keep the memo small anyway
                self._copy_routes.clear()
            route = self._copy_routes[h2d] = Route(None, True, h2d)
        return route

    def run(self, stream, mode: int, words: int, num_cells: int, num_entries: int, num_tokens: int,
            graph: GraphBuckets = None, route: Optional[Route] = None):
        """Enqueue the step on `stream` and return its ready event (recorded after all of it).

        words: snapshot words to copy; num_cells: changed table cells (no apply launch when 0);
        num_entries / num_tokens: the entries written whole (FULL: the batch, padding included; DELTA: the
        rebuilt ones) and the new tokens (they size the grids; the kernels read the true counts from the
        snapshot). graph: run the step as the graph of these buckets does (copy graph[0] words, apply with
        a fixed grid, size the build for the buckets); the CUDA plan replays that graph. route: the
        step's route(words, graph), when the caller has it.
        """
        be, (mirror, out, row_entry, pages, offsets, consts) = self.backend, self.buffers
        if graph is not None:       # what a captured graph holds: its bucket's copy, an apply whatever the count
            words, num_cells = graph[0], None
            num_entries, num_tokens = graph[1], graph[2]
        be.copy_h2d(self.dev, self.host, words, stream)
        if num_cells != 0:         # a steady decode step often changes no cell: one launch fewer
            be.apply_deltas(stream, self.dev, mirror, consts, num_cells=num_cells)
        be.build_step(stream, self.dev, mirror, out, row_entry, pages, offsets, consts, self.shared, mode,
                      num_entries=num_entries, num_cells=num_cells, num_tokens=num_tokens)
        return be.record(stream)
