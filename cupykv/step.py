"""Step: one prepared batch, its tables on the device, and the events that order it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, List, Optional

import numpy as np

from .errors import StepOrderError

if TYPE_CHECKING:  # pragma: no cover
    from .manager import KVCacheManager


class Step:
    """One prepared step.

    Batch order is contexts first, then generation entries. Consumers wait on `ready` before reading
    `tables` (or `write_pages` / `write_offsets`) and call finish(stream) after their last read; the
    next step's conversion waits for that.
    """

    def __init__(self, manager: "KVCacheManager", step_id: int, request_ids: List[Hashable], rows: np.ndarray,
                 incarnations: np.ndarray, tokens: np.ndarray, starts: np.ndarray, num_contexts: int):
        self.manager = manager
        self.id = step_id
        self.request_ids = request_ids              # batch order, contexts first
        self.rows = rows                            # table row of each entry (= copy_idx), int32
        self.incarnations = incarnations            # which tenant of the row each entry was (see manager)
        self.num_tokens = tokens                    # tokens scheduled per entry, int64
        self.start_positions = starts               # sequence position of each entry's first new token
        self.num_contexts = num_contexts
        self.ready = None                           # event: tables and write positions are written
        self.finished = None                        # event: the consumer's last read
        self.settled = False
        self.pad_to = 0                             # output rows [num_seqs, pad_to) were written BAD
        self.mode: Optional[int] = None             # staging.MODE_FULL or MODE_DELTA (None: unsafe staging)
        self.free_epoch: Optional[int] = None       # the manager's free count at prepare (see settle)
        # Scratch metadata of the contexts, per group: block range [begs, ends) and the shared slots.
        self.scratch_begs: Optional[np.ndarray] = None     # [P, num_contexts]
        self.scratch_ends: Optional[np.ndarray] = None     # [P, num_contexts]
        self.scratch_slots: Optional[np.ndarray] = None    # [P, num_contexts, M]

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def tables(self):
        """The output buffer (fixed address): [L, max_batch, 2, B] PER_LAYER or [P, max_batch, 2, B]
        SHARED. Rows < num_seqs belong to this step until the next step is prepared."""
        return self.manager.out

    @property
    def write_pages(self):
        """[L, max_step_tokens] K page index of each new token per layer (V = K + 1); the first
        total_tokens columns are this step's, in batch order."""
        return self.manager.write_pages

    @property
    def write_offsets(self):
        """[max_step_tokens] position of each new token inside its page."""
        return self.manager.write_offsets

    def finish(self, stream=None) -> None:
        """Record that the consumer is done reading: an event on `stream` after its last read.

        The default, the manager stream, is right only for a consumer that reads on the host after
        waiting on `ready` (or on the manager stream itself). A consumer on another stream must pass it
        (a backend stream; for a torch stream use cupykv.interop.finish_on_torch): the next step's
        conversion and the release of quarantined slots wait for this event.
        """
        if self.finished is not None:
            raise StepOrderError(f"step {self.id} was already finished")
        be = self.manager.backend
        self.finished = be.record(stream if stream is not None else be.stream)

    def is_complete(self) -> bool:
        """True once the finish event has completed (the step's slots may then be reused)."""
        return self.finished is not None and self.finished.done()

    def __repr__(self) -> str:
        return f"Step(id={self.id}, num_seqs={self.num_seqs}, num_contexts={self.num_contexts})"
