"""Residence: which requests hold device slots, and letting a row's slots go (a freed request's, through
KVCacheManager.free; a suspended one's). For the host tier (host_tier.HostTier moves the KV; this keeps
the books), check and act come in pairs: check_detach / detach, check_attach / attach; for a transfer
between managers (transfer.KVTransfers), visible_blocks and check_room / receive.

A detached (suspended) request keeps its row, history and capacity; its slots are released behind a
ledger fence on the event after the copies that read them, its table rows are cleared, and it may not be
scheduled. Attaching takes slots for the same blocks (all or nothing) and makes the next step that
schedules the request wait for the copy back.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from .errors import InvalidRequestError, OutOfSlotsError, StepOrderError
from .requests import Request, RequestId


class Residence:
    def __init__(self, manager):
        self.layout, self.requests, self.table = manager.layout, manager.requests, manager.page_table
        self.pools, self.ledger = manager.pools, manager.ledger

    def row_span(self, row: int) -> int:
        """Blocks [0, span) of a row are the only ones that may hold a slot: those its capacity covers.

        Invariant relied on (by the scans of a freed or suspended request's row, which then cost that
        request's blocks, not max_blocks): a block gets a slot only from the tokens scheduled into it (a
        step's new blocks, a prefix hit's blocks below its cached tokens, a resumed request's own blocks),
        and a rewind releases the blocks past the capacity it leaves."""
        return self.layout.groups[0].new_blocks(0, int(self.requests.cap[row]))[1]

    def release_row(self, row: int, tag: int) -> None:
        """Let go of every slot the row holds, in every group, and clear its cells (a freed or suspended
        request); slots left with no holder are quarantined under `tag`."""
        span = self.row_span(row)
        for p in range(self.layout.num_groups):
            self.pools[p].release(self.table.take_blocks(p, row, 0, span), tag)

    def resident_blocks(self, rid: RequestId) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Per group (blocks int64 [n], slots int32 [n]): the request's blocks that hold a device slot (all
        blocks for full attention; the sinks and the window for a sliding window)."""
        row, table = self.requests.get(rid).row, self.table
        span = self.row_span(row)
        out = []
        for p in range(self.layout.num_groups):
            cells = table.row_cells(p, row, span)
            out.append((cells - table.cells(p, row, 0), table.flat[cells].copy()))
        return out

    def check_detach(self, rid: RequestId) -> List[object]:
        """Raise unless the request could leave the device now: known, resident, in no unsettled step, and
        the latest step finished. Returns the events that copies of the request's KV must wait for:
        - the latest step's finish while it may still run, since the request's blocks may have been written
          by any earlier step (its own, or another request's whose blocks it hit), and each step's finish
          comes after the previous one's;
        - the copy that brought its KV here (a resume, a received transfer) while no step has waited for
          it: that copy may run on another stream and still be writing."""
        req = self.requests.get(rid)
        if req.parked:
            raise InvalidRequestError(f"request {rid!r} is already {req.parked}")
        pending = req.pending
        if pending:
            raise StepOrderError(f"request {rid!r} is in unsettled step {pending[0].id}: settle it first")
        latest = self.ledger.latest
        running = latest is not None and not latest.is_complete()
        if running and not latest.is_finished():
            raise StepOrderError(f"request {rid!r}: step {latest.id} is not finished; call step.finish(stream) "
                                 "after its consumer's last write, then suspend")
        loading = self.requests.loading.get(req.row)
        return [e for e in (latest.finished if running else None, loading) if e is not None]

    def detach(self, rid: RequestId, copied) -> None:
        """The request leaves the device (its KV was copied out): its slots are released, quarantined until
        `copied` (the event after the copies that read them) and every step prepared so far completed; its
        rows are cleared. It keeps its history and row, and may not be scheduled until attach."""
        req = self.requests.get(rid)
        self.check_detach(rid)
        tag = self.ledger.record_fence(copied)
        self.requests.loading.pop(req.row, None)        # (copied comes after it: the copies waited for it)
        self.release_row(req.row, tag)
        self.requests.park(req.row, "suspended")

    def check_attach(self, rid: RequestId, counts: Sequence[int]) -> Request:
        """Raise unless the suspended request can get counts[p] device slots of every group p now (this
        may wait for finish events whose quarantine would cover a shortfall)."""
        req = self.requests.get(rid)
        if not req.suspended:
            raise InvalidRequestError(f"request {rid!r} is not suspended")
        self.check_room(rid, counts, "to resume")
        return req

    def check_room(self, rid: RequestId, counts: Sequence[int], why: str) -> None:
        """OutOfSlotsError unless counts[p] device slots of every group p can be had now (this may wait for
        finish events whose quarantine would cover a shortfall)."""
        for p, need in enumerate(counts):
            if need > self.pools[p].num_available and need > self.ledger.available(p):
                self.ledger.wait_for_slots(p, need)
                if need > self.ledger.available(p):
                    raise OutOfSlotsError(f"request {rid!r}: group {p} needs {need} slots {why}; "
                                          f"{self.ledger.available(p)} free")

    def attach(self, rid: RequestId, blocks: Sequence[np.ndarray], copy_back):
        """The suspended request takes device slots for blocks[p] of every group (all or nothing) and is
        resident again. copy_back(slots per group) enqueues its KV's copies into them and returns the event
        after them, which the next step that schedules the request waits for on the device. Returns it."""
        req = self.check_attach(rid, [len(b) for b in blocks])
        self.ledger.poll()
        slots = [self.pools[p].allocate(len(b)) for p, b in enumerate(blocks)]
        loaded = copy_back(slots)
        for p, (b, s) in enumerate(zip(blocks, slots)):
            self.table.write(self.table.cells(p, req.row, b), s)
        self.requests.unpark(req.row)
        self.requests.loading[req.row] = loaded
        return loaded

    # -- transfers between managers (transfer.KVTransfers moves the bytes' descriptors; this keeps the books)
    def visible_blocks(self, row: int, history: int) -> List[np.ndarray]:
        """Per group, the blocks (int64, ascending) a query after `history` tokens can still see: every block
        of a full-attention group, the sink blocks and the window of a sliding-window one."""
        out = []
        for g in self.layout.groups:
            end = int(g.new_blocks(0, history)[1])
            sinks = min(g.sink_blocks, end)
            out.append(np.concatenate((np.arange(sinks), np.arange(max(sinks, int(g.stale_end(history))), end)))
                       .astype(np.int64))
        return out

    def receive(self, rid: RequestId, prompt_len: int, history: int, blocks: Sequence[np.ndarray]) -> Tuple[Request, List[np.ndarray]]:
        """Add a request whose first `history` tokens' KV will arrive from elsewhere: it takes fresh slots for
        blocks[p] of every group (the visible blocks at that history; check_room passed), its history and
        capacity are `history`, and it is parked "receiving". Returns it and its slots per group."""
        self.ledger.poll()
        req = self.requests.add(rid, prompt_len)
        row = req.row
        self.requests.hist[row] = history
        self.requests.set_capacity(row, history)
        slots = []
        for g, b in zip(self.layout.groups, blocks):
            s = self.pools[g.index].allocate(len(b))
            self.table.write(self.table.cells(g.index, row, b), s)
            slots.append(s)
            # blocks below the window were never here: the window's release starts at its edge
            self.requests.stale_done[g.index, row] = max(g.sink_blocks, int(g.stale_end(history)))
        self.requests.park(row, "receiving")
        return req, slots
