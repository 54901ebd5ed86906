"""The request table: request ids <-> table rows, and the numbers of each row.

Per-row numbers live in arrays indexed by table row, so that a decode step of hundreds of requests is a
handful of numpy operations rather than a Python loop. A row's incarnation counts its tenants, so a step
can tell whether the request it scheduled in a row is still the one there.

One counter, `moves`, is bumped by every operation that puts a request into a row or takes it out (add,
free), or parks or unparks it (park / unpark: suspended to the host tier, or being sent or received). Everything cached about rows compares it: the validated generation list, and settle's "every
entry of the step is still live" shortcut. Another, `cap_writes`, is bumped by every write of a capacity
(set_capacity, its one writer): the validated list's room, longest entry and phase order (GenBatch)
compare it.
"""
from __future__ import annotations

import heapq
import itertools
from operator import itemgetter
from typing import TYPE_CHECKING, Dict, Hashable, List, Optional, Tuple

import numpy as np

from .errors import DuplicateRequestError, InvalidRequestError, UnknownRequestError

if TYPE_CHECKING:  # pragma: no cover
    from .ledger import StepLedger
    from .step import Step

RequestId = Hashable

# Why a request may not be scheduled (RequestTable.park), and what to do about it.
PARKED = {
    "suspended": "resume it before scheduling it",
    "sending": "its KV is being sent to another instance (KVTransfers.send); call sent() or unsend() first",
    "receiving": "its KV is still arriving (KVTransfers.receive); call received() once the transport is done",
}


def frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class Request:
    """A request's identity and its table row; its numbers live in the RequestTable's per-row arrays."""

    __slots__ = ("rid", "row", "incarnation", "scratch", "_table")

    def __init__(self, table: "RequestTable", rid: RequestId, row: int, incarnation: int):
        self._table = table
        self.rid = rid
        self.row = row
        self.incarnation = incarnation
        self.scratch: Dict[int, List[np.ndarray]] = {}   # step id -> scratch slots per group (unsettled)

    def _live_row(self) -> int:
        if self._table.incarnation[self.row] != self.incarnation:
            raise UnknownRequestError(f"request {self.rid!r} was freed; this Request no longer describes it")
        return self.row

    @property
    def prompt_len(self) -> int:
        """Tokens of its prompt (add's prompt_len)."""
        return int(self._table.prompt[self._live_row()])

    @property
    def history(self) -> int:
        """Tokens whose KV is final (settled)."""
        return int(self._table.hist[self._live_row()])

    @property
    def capacity(self) -> int:
        """Tokens with KV space reserved: history plus the tokens of unsettled steps."""
        return int(self._table.cap[self._live_row()])

    @property
    def suspended(self) -> bool:
        """True while its KV lives in the host tier (KVStorage.suspend) and it holds no device slot."""
        return self.parked == "suspended"

    @property
    def parked(self) -> Optional[str]:
        """Why it may not be scheduled now, or None: "suspended" (KVStorage.suspend), "sending" or
        "receiving" (its KV is moving to or from another instance: transfer.KVTransfers)."""
        return self._table.parked_as.get(self._live_row())

    @property
    def pending(self) -> List["Step"]:
        """Prepared steps of this request that are not settled yet, oldest first."""
        return [s for s in self._table.ledger.unsettled
                if np.any((s.rows == self.row) & (s.incarnations == self.incarnation))]


class GenBatch:
    """A generation list that passed the lookup, duplicate and readiness checks.

    Decode steps usually schedule the same requests as the step before, so the table keeps the last
    validated list and skips those checks when the next list is equal to it and no request moved since
    (`moves`). A request that could decode stays able to (its capacity never drops below its prompt:
    rewinds undo only generated tokens). The arrays are shared by the steps that schedule this list, so
    they are read-only.

    As of the capacities after the table's cap_writes-th capacity write (`at`), the list knows its
    longest entry (`longest`, the largest capacity: a decode step of k tokens checks longest + k against
    max_seq_len), and may know its room (`room`: how many more tokens every entry can take before one of
    them opens a block or passes max_seq_len; a decode step of this list that fits in it skips those
    checks; -1 when not worked out). The list's own decode steps keep both (keep); any other capacity write
    (a rewind, a step of another list) leaves them stale until a step works them out again.

    A list that decodes k tokens a step, k dividing tokens_per_block, opens a block in each entry every
    tokens_per_block / k steps, always at the same phase of that period (`openings`): as of the same
    capacity write, the list keeps its entries ordered by phase, and a step finds the entries that open a
    block by slicing them out instead of comparing every entry's blocks. Kept and made stale like `room`;
    built only on the second of two such steps in a row (building costs a few steps' savings).
    """

    __slots__ = ("ids", "serial", "rows", "rows32", "incarnations", "moves", "k", "tokens", "room", "longest", "at",
                 "_phase_k", "_phase", "_steady", "_by_phase", "_rows_by_phase", "_phase_bounds")

    def __init__(self, ids: List[RequestId], rows: np.ndarray, incarnations: np.ndarray, moves: int, serial: int):
        self.ids = ids
        self.serial = serial            # unique per list made: (serial, k) names a decode step's batch (Step.list_key)
        self.rows = frozen(rows)                             # int64, for indexing the per-row arrays
        self.rows32 = frozen(rows.astype(np.int32))          # Step.rows
        self.incarnations = frozen(incarnations)
        self.moves = moves
        self.k, self.tokens = 0, rows[:0]                    # num_tokens of the last k asked for
        self.room, self.longest, self.at = -1, 0, -1
        self._phase_k = self._phase = 0                      # 0: no phase order (see openings)
        self._steady = False             # the list's last decode step knew its capacities (see openings)
        self._by_phase = self._rows_by_phase = rows[:0]      # list positions and rows, by phase
        self._phase_bounds: List[int] = []

    def matches(self, ids: List[RequestId], moves: int) -> bool:
        """Equal ids hash equal (Python's rule for dict keys), so with no move since, an equal list maps
        to the same rows."""
        if moves != self.moves:
            return False
        try:
            return ids == self.ids
        except Exception:        # an id whose == misbehaves (an array): let the full checks report it
            return False

    def knows(self, cap_writes: int) -> bool:
        """Whether `longest`, `room` and the phase order hold for the capacities after capacity write
        cap_writes (the table's latest: this list's own decode step was the last write)."""
        return self.at == cap_writes

    def has_room(self, k: int, cap_writes: int) -> bool:
        """Whether k more tokens for every entry open no block and pass no max_seq_len (see room)."""
        return self.at == cap_writes and k <= self.room

    def keep(self, room: int, longest: int, cap_writes: int, known: bool, phased: bool) -> None:
        """After a decode step of this list (the capacity write cap_writes): its room (-1: not worked out)
        and its longest entry; known: whether the step knew its capacities (knows() held); phased: whether
        it took its openings from the phase order (which then moves to the next phase; otherwise it is
        dropped)."""
        self.room, self.longest, self.at, self._steady = room, longest, cap_writes, known
        if phased:
            self._phase = (self._phase + 1) % (len(self._phase_bounds) - 1)
        else:
            self._phase_k = 0

    def openings(self, k: int, cap: np.ndarray, group) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """For a decode step of k tokens when knows() holds (cap: int64 [entries], the capacities the list's
        own last step left; group: a LayerGroup, whose block rules every group shares for generation
        tokens): the list positions and rows (int64 [opened], in list order) of the entries whose tokens
        open a block; None when k does not divide tokens_per_block, or when there is no order for k and
        the list's last decode step did not know its capacities either: the order is built on the second
        of two such steps in a row, so that a list whose known steps come one at a time (a new list, a
        rewind every other step) does not pay for an order it would use once.

        An entry's tokens open a block when what its last block has left (group.block_room) is below k.
        That drops by k a step, so with k dividing tokens_per_block it is below k once every
        tokens_per_block / k steps, first after block_room // k steps: the entry's phase."""
        tpb = group.tokens_per_block
        if tpb % k:
            return None
        if self._phase_k != k:
            if not self._steady:
                return None
            phase = group.block_room(cap) // k
            order = np.argsort(phase, kind="stable")         # stable: list order within a phase
            self._by_phase, self._rows_by_phase = order, self.rows[order]
            self._phase_bounds = np.searchsorted(phase[order], np.arange(tpb // k + 1)).tolist()
            self._phase_k, self._phase = k, 0
        lo, hi = self._phase_bounds[self._phase], self._phase_bounds[self._phase + 1]
        return self._by_phase[lo:hi], self._rows_by_phase[lo:hi]

    def tokens_for(self, k: int) -> np.ndarray:
        if k != self.k:
            self.k, self.tokens = k, frozen(np.full(len(self.rows), k, np.int64))
        return self.tokens


class RequestTable:
    """Rows of the page table and who holds them, with each row's numbers (int64 [rows] arrays)."""

    def __init__(self, rows: int, num_groups: int, sink_blocks: np.ndarray, ledger: "StepLedger"):
        self.hist = np.zeros(rows, np.int64)            # settled tokens
        self.cap = np.zeros(rows, np.int64)             # reserved tokens (history + unsettled steps)
        self.prompt = np.zeros(rows, np.int64)
        self.incarnation = np.zeros(rows, np.int64)
        self.last_scheduled = np.full(rows, -1, np.int64)          # id of the last step that scheduled the row
        self.stale_done = np.zeros((num_groups, rows), np.int64)   # per group: blocks below were released
        self.parked = np.zeros(rows, bool)              # may not be scheduled: suspended, sending or receiving
        self.parked_as: Dict[int, str] = {}             # row -> why (PARKED: its reason and what to do)
        self.loading: Dict[int, object] = {}            # row -> event after its KV's copy back (resume)
        self._sink_blocks = sink_blocks
        self.requests: Dict[RequestId, Request] = {}
        self.row_of: Dict[RequestId, int] = {}
        self.free_rows = list(range(rows))
        self.moves = 0
        self.cap_writes = 0
        self.ledger = ledger                            # its unsettled steps: Request.pending
        self._gen: Optional[GenBatch] = None
        self._serials = itertools.count()

    def scratch_held(self, num_groups: int) -> Tuple[int, ...]:
        """Scratch slots held per group (by the context chunks of unsettled steps)."""
        held = [0] * num_groups
        for req in self.requests.values():
            for per_group in req.scratch.values():
                for p, slots in enumerate(per_group):
                    held[p] += len(slots)
        return tuple(held)

    def __len__(self) -> int:
        return len(self.requests)

    def get(self, rid: RequestId) -> Request:
        try:
            return self.requests[rid]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {rid!r}") from None

    def check_new(self, rid: RequestId) -> None:
        try:
            known = rid in self.requests
        except TypeError:
            raise InvalidRequestError(f"request id {rid!r} is not hashable") from None
        if known:
            raise DuplicateRequestError(f"request {rid!r} is already added")

    def add(self, rid: RequestId, prompt_len: int) -> Request:
        """Put a request into the lowest free row (the caller checked check_new and free_rows)."""
        row = heapq.heappop(self.free_rows)
        self.hist[row] = 0
        self.set_capacity(row, 0)
        self.prompt[row] = prompt_len
        self.last_scheduled[row] = -1
        self.parked[row] = False
        self.stale_done[:, row] = self._sink_blocks
        req = self.requests[rid] = Request(self, rid, row, int(self.incarnation[row]))
        self.row_of[rid] = row
        self.moves += 1
        return req

    def set_capacity(self, rows, values) -> None:
        """cap[rows] = values: every write of a capacity goes through here (cap_writes counts them)."""
        self.cap[rows] = values
        self.cap_writes += 1

    def remove(self, rid: RequestId) -> Request:
        req = self.requests.pop(rid)
        del self.row_of[rid]
        self.incarnation[req.row] += 1      # steps still holding the row now see it as someone else's
        self.loading.pop(req.row, None)
        self.parked[req.row] = False
        self.parked_as.pop(req.row, None)
        heapq.heappush(self.free_rows, req.row)
        self.moves += 1
        return req

    def park(self, row: int, reason: str) -> None:
        """The row's request may not be scheduled until unpark (reason: a key of PARKED): a move."""
        self.parked[row] = True
        self.parked_as[row] = reason
        self.moves += 1

    def unpark(self, row: int) -> None:
        self.parked[row] = False
        self.parked_as.pop(row, None)
        self.moves += 1

    def check_schedulable(self, rid: RequestId, row: int) -> None:
        """InvalidRequestError unless the row's request may be scheduled (it is not parked)."""
        reason = self.parked_as.get(row)
        if reason is not None:
            raise InvalidRequestError(f"request {rid!r} is {reason}: {PARKED[reason]}")

    # -- generation lists ------------------------------------------------------------------------
    @property
    def last_generation(self) -> Optional[GenBatch]:
        """The last validated generation list (None before the first): generation_batch reuses it while
        it matches."""
        return self._gen

    def generation_batch(self, gen_ids: List[RequestId], ctx_rows: List[int]) -> Optional[GenBatch]:
        """The validated generation list (known ids, no duplicates with each other or with the contexts,
        whole prompt scheduled); the last one is reused while it matches. None for an empty list."""
        batch = self._gen
        if batch is not None and batch.matches(gen_ids, self.moves):
            if ctx_rows:          # the cached list has no duplicates; a context may still repeat an entry
                self._check_no_duplicates(gen_ids, batch.rows, ctx_rows)
            return batch
        if not gen_ids:
            return None
        try:
            found = itemgetter(*gen_ids)(self.row_of)       # a tuple, or the one row of a list of one
            rows = (np.fromiter(found, np.int64, len(gen_ids)) if len(gen_ids) > 1
                    else np.array([found], np.int64))
        except (KeyError, TypeError):
            bad = next(r for r in gen_ids if not self._known(r))
            raise UnknownRequestError(f"unknown request id {bad!r}") from None
        self._check_no_duplicates(gen_ids, rows, ctx_rows)
        # (counting the table's few hundred flags is one C call; most steps find none and skip the gather)
        if np.count_nonzero(self.parked) and self.parked[rows].any():
            i = int(np.argmax(self.parked[rows]))
            self.check_schedulable(gen_ids[i], int(rows[i]))
        cap = self.cap[rows]
        unready = cap < self.prompt[rows]
        if unready.any():
            i = int(np.argmax(unready))
            raise InvalidRequestError(f"request {gen_ids[i]!r}: cannot decode before its whole prompt "
                                      f"is scheduled ({cap[i]} of {self.prompt[rows[i]]} tokens)")
        self._gen = batch = GenBatch(gen_ids, rows, self.incarnation[rows], self.moves, next(self._serials))
        return batch

    def _check_no_duplicates(self, gen_ids: List[RequestId], rows: np.ndarray, ctx_rows: List[int]) -> None:
        """No row twice among the generation rows, nor one of the contexts' (which are distinct already)."""
        seen = np.bincount(rows, minlength=len(self.hist))
        # (the few context rows one by one: a list index costs a conversion and a scatter more than that)
        if np.maximum.reduce(seen) > 1 or any(seen[row] for row in ctx_rows):
            ctx = set(ctx_rows)
            dup = next(r for r in gen_ids if seen[self.row_of[r]] > 1 or self.row_of[r] in ctx)
            raise DuplicateRequestError(f"request {dup!r} appears twice in one step")

    def _known(self, rid) -> bool:
        try:
            return rid in self.row_of
        except TypeError:
            return False

    def state(self) -> tuple:
        reqs = tuple((repr(r.rid), r.row, r.incarnation,
                      tuple((k, tuple(a.tobytes() for a in v)) for k, v in sorted(r.scratch.items())))
                     for r in self.requests.values())
        arrays = tuple(a.tobytes() for a in (self.hist, self.cap, self.prompt, self.incarnation,
                                             self.last_scheduled, self.stale_done, self.parked))
        return reqs, arrays, tuple(sorted(self.free_rows)), tuple(sorted(self.parked_as.items()))
