"""The loopback transport: the receiver's backend copies the sender's blocks into its own slots.

Both storages live on one device (two CUDA managers of one GPU, or two host-backend managers), so a transfer
is one copy_runs per group (a run: blocks whose slots step by one on both sides), on the receiver's transfer
stream after the sender's `ready` event; the event after the copies is the transfer's completion, which the
receiver's first step waits for on the device and the sender polls before sent().
"""
from __future__ import annotations

from typing import Optional

from ..allocator import slot_runs
from ..errors import InvalidRequestError
from ..transfer import Incoming, KVTransfers, Outgoing


class LoopbackRead:
    """One transfer under way: done() once the copies have run; `event` is the device event after them."""

    def __init__(self, event, nbytes: int):
        self.event, self.nbytes = event, nbytes

    def done(self) -> bool:
        """Whether the copies have run."""
        return self.event.done()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait on the host for the copies (up to timeout seconds; None: as long as it takes); whether they ran."""
        return self.event.wait(timeout)


class LoopbackTransport:
    """Moves KV from `sender`'s storage to `receiver`'s (KVTransfers of two managers on one device)."""

    name = "loopback"

    def __init__(self, sender: KVTransfers, receiver: KVTransfers):
        a, b = sender.storage, receiver.storage
        if a.memory_kind != b.memory_kind or a.device_id != b.device_id:
            raise InvalidRequestError(f"the loopback transport copies on one device: sender {a.memory_kind} "
                                      f"device {a.device_id}, receiver {b.memory_kind} device {b.device_id}")
        self.sender, self.receiver = sender, receiver

    def read(self, out: Outgoing, inc: Incoming) -> LoopbackRead:
        """Enqueue the copies of out's blocks into inc's (after out.ready) and return the transfer; the
        caller then marks the receiver's request received (ready=the transfer's event) and, once done(),
        the sender's sent()."""
        if out.meta.transfer_id != inc.meta.transfer_id:
            raise InvalidRequestError(f"loopback read: sender request {out.rid!r} and receiver request "
                                      f"{inc.rid!r} are not one transfer")
        src, dst = self.sender.storage, self.receiver.storage
        be, stream = dst.backend, self.receiver.stream
        out.ready.wait(0)       # (polls; on the host backend it also runs the sender's simulated device)
        be.wait(stream, out.ready)
        for g, (s, d, n) in enumerate(zip(out.descriptors.slots, inc.descriptors.slots,
                                          inc.descriptors.slot_bytes)):
            runs = slot_runs(d, s)           # (receiver slot, sender slot, n)
            be.copy_runs(dst.arrays[g], src.arrays[g], runs, n, stream)
        return LoopbackRead(be.record(stream), inc.descriptors.nbytes)
