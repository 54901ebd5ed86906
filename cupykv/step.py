"""Step: the record of one prepared batch: what it schedules, where its outputs are, and its events.

A Step needs no manager: it carries the layout and backend its buffers belong to, and the output
buffers themselves (StepOutputs, fixed addresses shared by every step of one manager). Consumers
(interop, storage, attention kernels) take everything they need from it.
"""
from __future__ import annotations

from typing import Hashable, List, Optional

import numpy as np

from .errors import StepOrderError


class StepOutputs:
    """The device buffers every step of one manager writes its outputs into (fixed addresses, for CUDA
    graphs), and which step they hold now.

    tables: int32 [L, max_batch, 2, B] (PER_LAYER) or [P, max_batch, 2, B] (SHARED).
    write_pages: int32 [L, max_step_tokens], K page index of each new token per layer (V = K + 1).
    write_offsets: int32 [max_step_tokens], position of each new token inside its page.
    """

    __slots__ = ("tables", "write_pages", "write_offsets", "holder")

    def __init__(self, tables, write_pages, write_offsets):
        self.tables = tables
        self.write_pages = write_pages
        self.write_offsets = write_offsets
        self.holder = -1             # id of the step whose outputs these buffers hold (the latest prepared)


class Step:
    """One prepared step.

    Batch order is contexts first, then generation entries. Consumers wait on `ready` before reading
    `tables` (or `write_pages` / `write_offsets`) and call finish(stream) after their last read; the
    next step's conversion waits for that.
    """

    def __init__(self, step_id: int, request_ids: List[Hashable], rows: np.ndarray, incarnations: np.ndarray,
                 tokens: np.ndarray, starts: np.ndarray, num_contexts: int, *, layout, backend,
                 outputs: StepOutputs, owner: object, pad_to: int = 0, moves: int = 0):
        self.id = step_id
        self.request_ids = request_ids              # batch order, contexts first
        self.rows = rows                            # int32 [num_seqs]: table row of each entry (= copy_idx)
        self.incarnations = incarnations            # int64 [num_seqs]: which tenant of the row each entry was
        self.num_tokens = tokens                    # int64 [num_seqs]: tokens scheduled per entry
        self.start_positions = starts               # int64 [num_seqs]: position of each entry's first new token
        self.num_contexts = num_contexts
        self.pad_to = pad_to                        # output rows [num_seqs, pad_to) were written BAD (or the null page)
        self.moves = moves                          # the request table's move count at prepare (see settle)
        self.layout = layout                        # cupykv.Layout of the manager
        self.backend = backend                      # the backend whose streams and events order this step
        self.outputs = outputs
        self.owner = owner                          # identity of the preparing manager (compared, never used)
        self.ready = None                           # event: tables and write positions are written
        self.finished = None                        # event: the consumer's last read
        self.settled = False
        self.mode: Optional[int] = None             # staging.MODE_FULL or MODE_DELTA (None: unsafe staging)
        # Scratch metadata of the contexts, per group: block range [begs, ends) and the shared slots.
        self.scratch_begs: Optional[np.ndarray] = None     # int32 [P, num_contexts]
        self.scratch_ends: Optional[np.ndarray] = None     # int32 [P, num_contexts]
        self.scratch_slots: Optional[np.ndarray] = None    # int32 [P, num_contexts, M]

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def is_current(self) -> bool:
        """True while the output buffers hold this step's outputs (until the next prepare_batch)."""
        return self.outputs.holder == self.id

    @property
    def tables(self):
        """The output buffer (fixed address): int32 [L, max_batch, 2, B] PER_LAYER or [P, max_batch, 2, B]
        SHARED. Rows < num_seqs belong to this step until the next step is prepared."""
        return self.outputs.tables

    @property
    def write_pages(self):
        """int32 [L, max_step_tokens]: K page index of each new token per layer (V = K + 1); the first
        total_tokens columns are this step's, in batch order."""
        return self.outputs.write_pages

    @property
    def write_offsets(self):
        """int32 [max_step_tokens]: position of each new token inside its page."""
        return self.outputs.write_offsets

    def finish(self, stream=None) -> None:
        """Record that the consumer is done reading: an event on `stream` after its last read.

        The default, the manager stream, is right only for a consumer that reads on the host after
        waiting on `ready` (or on the manager stream itself). A consumer on another stream must pass it
        (a backend stream; for a torch stream use cupykv.interop.finish_on_torch): the next step's
        conversion and the release of quarantined slots wait for this event.
        """
        if self.finished is not None:
            raise StepOrderError(f"step {self.id} was already finished")
        be = self.backend
        self.finished = be.record(stream if stream is not None else be.stream)

    def is_complete(self) -> bool:
        """True once the finish event has completed (the step's slots may then be reused)."""
        return self.finished is not None and self.finished.done()

    def __repr__(self) -> str:
        return f"Step(id={self.id}, num_seqs={self.num_seqs}, num_contexts={self.num_contexts})"
