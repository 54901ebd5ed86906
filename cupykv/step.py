"""Step: the record of one prepared batch: what it schedules, where its outputs are, and its events.

A Step needs no manager: it carries the layout, and per device (KVCacheManager(devices=[...])) a
DevicePart with that device's backend, output buffers (StepOutputs, fixed addresses shared by every step
of one manager), ready event and consumer finish, which step.on(rank) shows as a DeviceStep view.
Consumers (interop, storage, attention kernels) take everything they need from it: a Step itself reads
as its first device's view. Nothing a step holds refers back to it, so a step is freed by reference
counting once the manager and its users let go of it (no cycle for the garbage collector to find).
"""
from __future__ import annotations

from typing import Hashable, List, Optional

import numpy as np

from .args import is_count
from .errors import InvalidRequestError, StepOrderError, UnknownDeviceError


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


class DevicePart:
    """What one device holds of a step: its backend, output buffers, ready event and consumer finish. It
    holds no reference back to the step, so a step is freed as soon as nobody holds it (a cycle would leave
    it, and its pooled events, to the garbage collector)."""

    __slots__ = ("rank", "backend", "outputs", "ready", "finished")

    def __init__(self, rank: int, backend, outputs: StepOutputs):
        self.rank = rank                 # the device's position in KVCacheManager(devices=...)
        self.backend = backend           # the backend whose streams and events order this device's work
        self.outputs = outputs
        self.ready = None                # event: this device's tables and write positions are written
        self.finished = None             # event: this device's consumer's last read

    def is_complete(self) -> bool:
        """True once this device's finish event has completed."""
        return self.finished is not None and self.finished.done()

    def holds(self, step_id: int) -> bool:
        """Whether this device's output buffers hold that step's outputs (it is the latest prepared)."""
        return self.outputs.holder == step_id


class DeviceStep:
    """One device's view of a step: that device's output buffers, its ready event and its consumer's
    finish (a DevicePart of the step). Everything else (the batch, the layout, the id) is the step's:
    attributes it does not hold are read from the step, so a DeviceStep goes wherever a Step does (interop,
    KVStorage.write). step.on(rank) makes a new view each call; views of one device share its part and
    are equal.

    Consumers on this device wait on `ready` before reading its tables and call finish(stream) after
    their last read; the step counts as complete once every device's finish has completed.
    """

    __slots__ = ("step", "part")

    def __init__(self, step: "Step", part: DevicePart):
        self.step = step
        self.part = part

    def __getattr__(self, name):
        return getattr(self.step, name)

    def __eq__(self, other) -> bool:
        """Views of the same step on the same device are equal."""
        return isinstance(other, DeviceStep) and other.step is self.step and other.part is self.part

    def __hash__(self) -> int:
        return hash((id(self.step), id(self.part)))

    rank = property(lambda self: self.part.rank, doc="The device's position in KVCacheManager(devices=...).")
    backend = property(lambda self: self.part.backend, doc="The backend whose streams and events order this device's work.")
    outputs = property(lambda self: self.part.outputs, doc="This device's StepOutputs.")
    ready = property(lambda self: self.part.ready, doc="Event: this device's tables and write positions are written.")
    finished = property(lambda self: self.part.finished, doc="Event: this device's consumer's last read (None until finish).")

    @property
    def tables(self):
        """This device's output buffer (fixed address): int32 [L, max_batch, 2, B] PER_LAYER or
        [P, max_batch, 2, B] SHARED. Rows < num_seqs belong to this step until the next step is prepared."""
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

    @property
    def is_current(self) -> bool:
        """True while this device's output buffers hold this step's outputs (until the next prepare)."""
        return self.part.holds(self.step.id)

    def finish(self, stream=None) -> None:
        """Record that this device's consumer is done reading: an event on `stream` (a stream of this
        device's backend; default its manager stream, right only for a consumer that waited on `ready`
        on the host or reads on the manager stream)."""
        part = self.part
        if part.finished is not None:
            raise StepOrderError(f"step {self.step.id} was already finished on device {part.rank}")
        be = part.backend
        if stream is not None and not be.is_stream(stream):
            raise InvalidRequestError(f"step {self.step.id}: finish(stream={stream!r}): not a stream of the {be.name} "
                                      f"backend's device {be.device_id} (device rank {part.rank}; for a torch "
                                      "stream: cupykv.interop.finish_on_torch)")
        part.finished = be.record(stream if stream is not None else be.stream)

    def check_open(self, what: str) -> None:
        """Raise StepOrderError unless work for this step on this device may still be enqueued (KV writes and
        reads at its write positions, CSR views of its tables): the step is the latest prepared (a later
        prepare overwrote its buffers) and its finish was not recorded (work after the finish is covered by
        no event: the next step may overwrite the buffers, and reuse released slots, before it runs)."""
        if not self.is_current:
            raise StepOrderError(f"{what}: step {self.step.id} is not the latest prepared step; its tables and "
                                 "write positions were overwritten by a later prepare_batch")
        if self.finished is not None:
            raise StepOrderError(f"{what}: step {self.step.id} was finished on device {self.rank}; enqueue work for "
                                 "a step (and read what it gives) before step.finish(), which orders the next "
                                 "step after it")

    def is_complete(self) -> bool:
        """True once this device's finish event has completed."""
        return self.part.is_complete()

    def on(self, rank: int) -> "DeviceStep":
        """Another device's view of the same step (Step.on)."""
        return self.step.on(rank)

    def __repr__(self) -> str:
        return f"DeviceStep(id={self.step.id}, rank={self.rank})"


class Step:
    """One prepared step.

    Batch order is contexts first, then generation entries. Consumers wait on `ready` before reading
    `tables` (or `write_pages` / `write_offsets`) and call finish(stream) after their last read; the
    next step's conversion waits for that. With several devices each has its own tables, events and
    finish: step.on(rank) (a DeviceStep); `ready`, `tables`, ... of the Step are device 0's.
    """

    def __init__(self, step_id: int, request_ids: List[Hashable], rows: np.ndarray, incarnations: np.ndarray,
                 tokens: np.ndarray, starts: np.ndarray, num_contexts: int, *, layout, owner: object,
                 pad_to: int = 0, moves: int = 0, index_rows: Optional[np.ndarray] = None,
                 list_key: Optional[tuple] = None):
        self.id = step_id
        self.request_ids = request_ids              # batch order, contexts first
        self.rows = rows                            # int32 [num_seqs]: table row of each entry (= copy_idx)
        self.incarnations = incarnations            # int64 [num_seqs]: which tenant of the row each entry was
        self.num_tokens = tokens                    # int64 [num_seqs]: tokens scheduled per entry
        self.start_positions = starts               # int64 [num_seqs]: position of each entry's first new token
        self.num_contexts = num_contexts
        self.pad_to = pad_to                        # output rows [num_seqs, pad_to) were written BAD (or the null page)
        self.moves = moves                          # the request table's move count at prepare (see settle)
        # a pure decode step of a validated generation list: (its serial, tokens per entry, pad_to); two steps
        # with one key schedule the same rows and tokens (pipeline._DecodeList reuses its work); else None
        self.list_key = list_key
        # int64 [num_seqs]: rows again, as the manager indexes its per-row arrays with them (read only)
        self.index_rows = index_rows if index_rows is not None else rows.astype(np.int64)
        self.layout = layout                        # cupykv.Layout of the manager
        self.owner = owner                          # identity of the preparing manager (compared, never used)
        self.parts: List[DevicePart] = []           # per device, in KVCacheManager(devices=...) order (the pipeline's)
        self.settled = False
        self.mode: Optional[int] = None             # staging.MODE_FULL or MODE_DELTA (None: unsafe staging)
        # Scratch metadata of the contexts, per group: block range [begs, ends) and the shared slots.
        self.scratch_begs: Optional[np.ndarray] = None     # int32 [P, num_contexts]
        self.scratch_ends: Optional[np.ndarray] = None     # int32 [P, num_contexts]
        self.scratch_slots: Optional[np.ndarray] = None    # int32 [P, num_contexts, M]

    def on(self, rank: int) -> DeviceStep:
        """The step on one device: rank is the device's position in KVCacheManager(devices=...)."""
        if not is_count(rank) or not 0 <= rank < len(self.parts):
            raise UnknownDeviceError(f"step {self.id}: rank={rank!r}; the manager has {len(self.parts)} device(s) "
                                     f"(rank: an int in [0, {len(self.parts)}))")
        return DeviceStep(self, self.parts[int(rank)])

    @property
    def devices(self) -> List[DeviceStep]:
        """The step's view on every device, in KVCacheManager(devices=...) order (new views each call)."""
        return [DeviceStep(self, part) for part in self.parts]

    # Device 0's part (the only one of a one-device manager).
    backend = property(lambda self: self.parts[0].backend, doc="Device 0's backend.")
    outputs = property(lambda self: self.parts[0].outputs, doc="Device 0's output buffers.")
    ready = property(lambda self: self.parts[0].ready, doc="Device 0's ready event.")
    tables = property(lambda self: self.parts[0].outputs.tables, doc=DeviceStep.tables.__doc__)
    write_pages = property(lambda self: self.parts[0].outputs.write_pages, doc=DeviceStep.write_pages.__doc__)
    write_offsets = property(lambda self: self.parts[0].outputs.write_offsets, doc=DeviceStep.write_offsets.__doc__)
    is_current = property(lambda self: self.parts[0].holds(self.id), doc=DeviceStep.is_current.__doc__)

    @property
    def finished(self):
        """Device 0's finish event (None until recorded); see is_finished() for every device."""
        return self.parts[0].finished

    @property
    def num_seqs(self) -> int:
        """Batch entries (contexts first, then generation)."""
        return len(self.rows)

    @property
    def total_tokens(self) -> int:
        """New tokens of the whole step (the write positions' valid prefix)."""
        return int(self.num_tokens.sum())

    # -- per token: what every consumer that packs the step's tokens into one batch needs (host arrays) --
    def cu_tokens(self) -> np.ndarray:
        """int64 [num_seqs + 1]: entry e's new tokens are the packed tokens [cu[e], cu[e + 1])."""
        cu = np.zeros(self.num_seqs + 1, np.int64)
        np.cumsum(self.num_tokens, out=cu[1:])
        return cu

    def token_entries(self) -> np.ndarray:
        """int64 [total_tokens]: the batch entry of each packed token."""
        return np.repeat(np.arange(self.num_seqs, dtype=np.int64), self.num_tokens)

    def token_positions(self) -> np.ndarray:
        """int64 [total_tokens]: each packed token's position in its sequence (its RoPE position, and the
        key position its K/V is written at)."""
        cu = self.cu_tokens()
        return np.arange(cu[-1], dtype=np.int64) + np.repeat(self.start_positions - cu[:-1], self.num_tokens)

    def finish(self, stream=None) -> None:
        """Record that the consumer is done reading: an event on `stream` after its last read.

        The default, the manager stream, is right only for a consumer that reads on the host after
        waiting on `ready` (or on the manager stream itself). A consumer on another stream must pass it
        (a backend stream; for a torch stream use cupykv.interop.finish_on_torch): the next step's
        conversion and the release of quarantined slots wait for this event. With several devices, a
        stream belongs to one of them: call step.on(rank).finish(stream) for each; finish() without a
        stream finishes every device on its manager stream.
        """
        if stream is not None and len(self.parts) > 1:
            raise StepOrderError(f"step {self.id} runs on {len(self.parts)} devices: finish each with "
                                 "step.on(rank).finish(stream)")
        done = [part.rank for part in self.parts if part.finished is not None]
        if len(done) == len(self.parts):
            raise StepOrderError(f"step {self.id} was already finished")
        if done:
            raise StepOrderError(f"step {self.id} was already finished on device(s) {done}: finish the others "
                                 f"with step.on(rank).finish(stream) (unfinished: {self.unfinished_ranks()})")
        for part in self.parts:
            DeviceStep(self, part).finish(stream)

    def is_finished(self) -> bool:
        """True once every device's finish was recorded (not necessarily completed)."""
        for part in self.parts:     # a loop, not all(): this runs on every prepare
            if part.finished is None:
                return False
        return True

    def unfinished_ranks(self) -> List[int]:
        """The devices whose finish was not recorded yet."""
        return [part.rank for part in self.parts if part.finished is None]

    def is_complete(self) -> bool:
        """True once every device's finish event has completed (the step's slots may then be reused)."""
        for part in self.parts:     # a loop, not all(): the ledger polls this on every prepare
            if not part.is_complete():
                return False
        return True

    def wait_finished(self, timeout: Optional[float] = None) -> bool:
        """Host wait for every device's recorded finish event; False when one did not complete in time, or
        was never recorded (finish() not called on that device: nothing will complete). timeout: seconds
        (None: no limit)."""
        seconds = isinstance(timeout, (int, float, np.integer, np.floating)) and not isinstance(timeout, bool)
        if timeout is not None and not (seconds and timeout >= 0):
            raise InvalidRequestError(f"step {self.id}: wait_finished(timeout={timeout!r}): seconds >= 0, or None")
        for part in self.parts:
            if part.finished is None or not part.finished.wait(timeout):
                return False
        return True

    def __repr__(self) -> str:
        return f"Step(id={self.id}, num_seqs={self.num_seqs}, num_contexts={self.num_contexts})"
