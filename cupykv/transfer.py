"""Moving a request's KV from one manager to another (prefill/decode disaggregation), whatever moves the bytes.

Only what a later query can still see moves: every block of a full-attention group, the sink blocks and the
window of a sliding-window group (Residence.visible_blocks). A transport (transports/: NIXL, or a loopback
copy on one device) moves them by the descriptors the two sides hand out; this module keeps both
managers' books, and neither side's slots are reused while the transport may touch them.

    sender (KVTransfers of the prefill manager)      receiver (KVTransfers of the decode manager)
    out = send(rid)
        checked: no unsettled step, the latest one finished
        the request is parked "sending": it holds its slots and may not be scheduled or freed
        out.meta: TransferMeta, plain data for the receiver
    out.wait_ready()   (the steps that wrote the KV have run)
    hand out.meta to the receiver  ------------------->  inc = receive(meta)
                                                            layouts compared (TransferLayoutError), then
                                                            slots for exactly meta's blocks (all or nothing:
                                                            OutOfSlotsError); parked "receiving"
                                                         the transport reads out's blocks into inc's
                                                         received(rid, ready)   history = meta.history; its
                                                            first step waits for `ready` (if any) on the device
    sent(rid)   <---- the transport says it is done ----
        the request is freed here (slots quarantined as by free())
    On failure: unsend(rid) puts the sender's request back as it was (resident, schedulable), once the
    transport has stopped reading; unreceive(rid, stopped) removes the receiver's request and releases its
    slots once `stopped` (the event after which nothing writes them) has completed.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .args import as_count, token_ids
from .errors import CapacityExceededError, CupykvError, InvalidRequestError
from .requests import RequestId


class TransferLayoutError(CupykvError, ValueError):
    """The two managers' KV layouts differ (tokens per block, windows, heads, dtype, ...): nothing moved."""


def layout_signature(storage) -> Dict[str, object]:
    """What must be equal on both sides for a slot's bytes to mean the same KV: the block size, each group's
    window, sink tokens and layers, the KV heads and head size this storage holds, the dtype and the slot's
    bytes (plain data)."""
    lay = storage.layout
    return dict(tokens_per_block=lay.tpb,
                groups=[[g.window, g.sink_tokens, list(g.layers)] for g in lay.groups],
                num_kv_heads=storage.num_kv_heads, head_dim=storage.head_dim, dtype=storage.dtype.name,
                slot_bytes=[int(a[0].nbytes) for a in storage.arrays])


def check_layouts(mine: Mapping, theirs: Mapping) -> None:
    """TransferLayoutError naming every field that differs (InvalidRequestError when theirs, from the wire,
    is not the mapping layout_signature makes)."""
    if not isinstance(theirs, Mapping):
        raise InvalidRequestError(f"the sender's layout is a {type(theirs).__name__}, not the mapping "
                                  "layout_signature makes")
    names = sorted(set(mine) | set(theirs))
    diff = [f"{k}: here {mine.get(k)!r}, sender {_plain(theirs.get(k))!r}" for k in names
            if _plain(mine.get(k)) != _plain(theirs.get(k))]
    if diff:
        raise TransferLayoutError("the KV layouts differ, so no KV was moved: " + "; ".join(diff))


def _plain(value):
    """Lists for tuples, recursively (what a msgpack or JSON round trip makes of them)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _same_blocks(got, want: Sequence[np.ndarray]) -> bool:
    """Whether got (from the wire: per group a list of block ordinals) names exactly the blocks of want."""
    try:
        return len(got) == len(want) and all(np.array_equal(np.asarray(g, np.int64), w) for g, w in zip(got, want))
    except (TypeError, ValueError, OverflowError):
        return False


def _check_event(event, what: str) -> None:
    """InvalidRequestError unless event is None or an event of a backend (what its record() returns)."""
    if event is not None and not (callable(getattr(event, "done", None)) and callable(getattr(event, "wait", None))):
        raise InvalidRequestError(f"{what}={event!r}: not an event of this manager's backend (an event its "
                                  "record(stream) returns, such as the loopback read's event) nor None")


@dataclass
class Descriptors:
    """The blocks of one request on one side, as regions of its storage.

    Per group g: blocks[g] (int64 [n], the block ordinals, ascending), slots[g] (int64 [n], the slots that
    hold them) and addresses[g] (int64 [n], each slot's first byte; a slot is slot_bytes[g] contiguous bytes
    of KVStorage.arrays[g]: K and V of every layer of the group for tokens_per_block tokens). memory: "VRAM"
    (CUDA backend) or "DRAM" (host backend), device_id: the CUDA device (0 on the host backend)."""
    blocks: List[np.ndarray]
    slots: List[np.ndarray]
    addresses: List[np.ndarray]
    slot_bytes: List[int]
    memory: str
    device_id: int

    @property
    def nbytes(self) -> int:
        """Bytes of every block."""
        return sum(len(b) * n for b, n in zip(self.blocks, self.slot_bytes))

    def rows(self) -> List[Tuple[int, int, int, int]]:
        """(group, block, address, bytes) for every block, group by group."""
        return [(g, int(b), int(a), n) for g, (bs, addrs, n) in enumerate(zip(self.blocks, self.addresses,
                                                                                  self.slot_bytes))
                for b, a in zip(bs.tolist(), addrs.tolist())]


def storage_descriptors(storage, blocks: Sequence[np.ndarray], slots: Sequence[np.ndarray]) -> Descriptors:
    """Descriptors of these blocks in these slots of `storage`."""
    regions = storage.regions()
    addresses = [base + np.asarray(s, np.int64) * n for (base, _, n), s in zip(regions, slots)]
    return Descriptors([np.asarray(b, np.int64) for b in blocks], [np.asarray(s, np.int64) for s in slots],
                       addresses, [n for _, _, n in regions], storage.memory_kind, storage.device_id)


@dataclass
class TransferMeta:
    """What a receiver needs to take a request's KV (plain data: to_dict / from_dict cross a process).

    transfer_id: unique per send (a transport's tag). request_id: the sender's id (the receiver's by
    default). prompt_len, history: the prompt and the tokens whose KV moves (a query at position history
    comes next). tokens: the token ids of those tokens, when the sender knew them, else None. blocks: per
    group the block ordinals that move; source: where they are on the sender (addresses per group, slot
    bytes, memory kind, device, the NIXL agent's name when it has one). layout: layout_signature of the
    sender's storage."""
    transfer_id: str
    request_id: object
    prompt_len: int
    history: int
    blocks: List[List[int]]
    source: Dict[str, object]
    layout: Dict[str, object]
    tokens: Optional[List[int]] = None

    def to_dict(self) -> dict:
        """The meta as plain data (ints, strings, lists, dicts): msgpack or JSON carry it to a receiver."""
        return dict(transfer_id=self.transfer_id, request_id=self.request_id, prompt_len=self.prompt_len,
                    history=self.history, blocks=self.blocks, source=self.source, layout=self.layout,
                    tokens=self.tokens)

    @classmethod
    def from_dict(cls, d: Mapping) -> "TransferMeta":
        """The meta from to_dict()'s form; InvalidRequestError naming the fields it lacks."""
        missing = [k for k in ("transfer_id", "request_id", "prompt_len", "history", "blocks", "source", "layout")
                   if k not in d]
        if missing:
            raise InvalidRequestError(f"transfer metadata lacks {missing}")
        return cls(**{k: d[k] for k in ("transfer_id", "request_id", "prompt_len", "history", "blocks", "source",
                                        "layout")}, tokens=d.get("tokens"))

    def source_descriptors(self) -> Descriptors:
        """The sender's descriptors, as the meta carries them."""
        s = self.source
        return Descriptors([np.asarray(b, np.int64) for b in self.blocks], [np.asarray(x, np.int64) for x in s["slots"]],
                           [np.asarray(a, np.int64) for a in s["addresses"]], list(s["slot_bytes"]), s["memory"],
                           int(s["device_id"]))


@dataclass
class Outgoing:
    """A request being sent: its meta for the receiver, its blocks here, and `ready` (an event after every
    step that wrote its KV; a transport reads only after it)."""
    rid: RequestId
    meta: TransferMeta
    descriptors: Descriptors
    ready: object

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """Wait on the host until the KV is written (before handing the meta to a receiver in another
        process, whose transport cannot wait for this event)."""
        return self.ready.wait(timeout)


@dataclass
class Incoming:
    """A request being received: the blocks to fill here (descriptors), and its meta."""
    rid: RequestId
    meta: TransferMeta
    descriptors: Descriptors


class KVTransfers:
    """Both sides of KV transfers for one KVStorage (one-device managers): send / sent / unsend on the
    sender, receive / received / unreceive on the receiver (see the module docstring for the order).

    The core never imports a transport: the NIXL and loopback transports (cupykv.transports) take the
    Outgoing and Incoming records this hands out."""

    def __init__(self, storage):
        mgr = storage.manager
        if mgr is None:
            raise InvalidRequestError("KVTransfers needs a KVStorage made for a manager: KVStorage(mgr)")
        if len(mgr.backends) > 1:
            raise InvalidRequestError("KVTransfers serves one-device managers; this one has "
                                      f"{len(mgr.backends)} devices")
        self.storage, self.manager = storage, mgr
        self.layout = layout_signature(storage)
        self.stream = storage.backend.new_stream("transfers")
        self.sending: Dict[RequestId, Outgoing] = {}
        self.receiving: Dict[RequestId, Incoming] = {}
        self.bytes_sent = self.bytes_received = 0

    # -- the sender ------------------------------------------------------------------------------
    def send(self, rid: RequestId, tokens=None) -> Outgoing:
        """Offer the request's visible KV to a receiver: it is parked "sending" (not schedulable, its slots
        held) until sent() or unsend(). tokens: the token ids of its history, carried in the meta for a
        receiver that wants them. StepOrderError while it is in an unsettled step or the latest step is not
        finished; InvalidRequestError when it is parked already or has no history."""
        mgr = self.manager
        req = mgr.request(rid)
        if req.parked:
            raise InvalidRequestError(f"request {rid!r} is {req.parked}: it cannot be sent now")
        after = mgr.residence.check_detach(rid)
        history = req.history
        if history < 1:
            raise InvalidRequestError(f"request {rid!r} has no KV to send yet (history 0)")
        toks = None if tokens is None else token_ids(tokens, f"request {rid!r}: tokens", history).tolist()
        blocks = mgr.residence.visible_blocks(req.row, history)
        table = mgr.page_table
        slots = [table.flat[table.cells(p, req.row, b)].astype(np.int64) for p, b in enumerate(blocks)]
        for p, s in enumerate(slots):
            if (s < 0).any():       # the rules guarantee it; a hole would send garbage
                raise AssertionError(f"request {rid!r}: group {p} block {int(blocks[p][np.argmax(s < 0)])} "
                                     "is visible but holds no slot")
        # -- nothing has changed so far --
        be = self.storage.backend
        for event in after:
            be.wait(self.stream, event)
        ready = be.record(self.stream)
        desc = storage_descriptors(self.storage, blocks, slots)
        source = dict(slots=[s.tolist() for s in slots], addresses=[a.tolist() for a in desc.addresses],
                      slot_bytes=desc.slot_bytes, memory=desc.memory, device_id=desc.device_id)
        meta = TransferMeta(uuid.uuid4().hex, rid, req.prompt_len, history, [b.tolist() for b in blocks],
                            source, self.layout, toks)
        mgr.requests.park(req.row, "sending")
        out = self.sending[rid] = Outgoing(rid, meta, desc, ready)
        return out

    def sent(self, rid: RequestId) -> None:
        """The transport has read the request's KV: the request is freed here (its slots quarantined until
        the steps prepared so far have finished, as free() does)."""
        out = self._outgoing(rid)
        self.manager.requests.unpark(self.manager.request(rid).row)
        del self.sending[rid]
        self.manager.free(rid)
        self.bytes_sent += out.descriptors.nbytes

    def unsend(self, rid: RequestId) -> None:
        """The transfer failed or was given up, and the transport no longer reads the request's slots: the
        request is resident and schedulable again, as before send()."""
        self._outgoing(rid)
        del self.sending[rid]
        self.manager.requests.unpark(self.manager.request(rid).row)

    def _outgoing(self, rid: RequestId) -> Outgoing:
        return self._record(self.sending, rid, "sent")

    def _incoming(self, rid: RequestId) -> "Incoming":
        return self._record(self.receiving, rid, "received")

    def _record(self, records: dict, rid: RequestId, what: str):
        """The live request's record in `records`, or InvalidRequestError (UnknownRequestError if unknown)."""
        self.manager.request(rid)
        try:
            return records[rid]
        except (KeyError, TypeError):
            raise InvalidRequestError(f"request {rid!r} is not being {what}") from None

    # -- the receiver ----------------------------------------------------------------------------
    def receive(self, meta: Union[TransferMeta, Mapping], rid: Optional[RequestId] = None) -> Incoming:
        """Take a request whose KV a sender offers (its TransferMeta or that as a dict): the layouts must be
        equal (TransferLayoutError), the blocks must be the visible ones at meta.history, and slots for all
        of them must be free (OutOfSlotsError); on any error nothing changed. The request (id `rid`, default
        meta.request_id) is added with history meta.history and parked "receiving" until received() or
        unreceive(). Returns where its blocks go here (Incoming.descriptors)."""
        mgr = self.manager
        if not isinstance(meta, TransferMeta):
            meta = TransferMeta.from_dict(meta)
        rid = meta.request_id if rid is None else rid
        check_layouts(self.layout, meta.layout)
        if mgr.cache is not None:
            raise InvalidRequestError(f"request {rid!r}: this manager has prefix caching on; received KV cannot "
                                      "join its prefix cache (receive into a manager without prefix_caching)")
        mgr.requests.check_new(rid)
        spec = mgr.spec
        prompt = as_count(meta.prompt_len, f"request {rid!r}: prompt_len", minimum=1)
        history = as_count(meta.history, f"request {rid!r}: history", minimum=1)
        if max(prompt, history) > spec.max_seq_len:
            raise CapacityExceededError(f"request {rid!r}: prompt_len={prompt} and history={history} must fit "
                                        f"max_seq_len={spec.max_seq_len}")
        if not mgr.requests.free_rows:
            raise CapacityExceededError(f"request {rid!r}: all max_batch={spec.max_batch} rows are in use")
        want = mgr.residence.visible_blocks(0, history)
        if not _same_blocks(meta.blocks, want):
            raise InvalidRequestError(f"request {rid!r}: the meta's blocks are not the visible blocks at history "
                                      f"{history} (per group, expected {[len(w) for w in want]} blocks)")
        mgr.residence.check_room(rid, [len(b) for b in want], "to receive its KV")
        # -- nothing has changed so far --
        _, slots = mgr.residence.receive(rid, prompt, history, want)
        inc = self.receiving[rid] = Incoming(rid, meta, storage_descriptors(self.storage, want, slots))
        return inc

    def received(self, rid: RequestId, ready=None) -> None:
        """The transport has written the request's KV (or will have by `ready`, an event of this device
        after the writes, which the first step that schedules the request waits for): it may be scheduled,
        its history meta.history."""
        inc = self._incoming(rid)
        _check_event(ready, f"received({rid!r}): ready")
        row = self.manager.request(rid).row
        del self.receiving[rid]
        reqs = self.manager.requests
        reqs.unpark(row)
        if ready is not None:
            reqs.loading[row] = ready
        self.bytes_received += inc.descriptors.nbytes

    def unreceive(self, rid: RequestId, stopped=None) -> None:
        """The transfer failed or was given up: the request is removed and its slots released, quarantined
        until `stopped` (an event after which the transport writes nothing more; None: it already has)."""
        self._incoming(rid)
        _check_event(stopped, f"unreceive({rid!r}): stopped")
        reqs = self.manager.requests
        row = self.manager.request(rid).row
        del self.receiving[rid]
        reqs.unpark(row)
        if stopped is not None:
            reqs.loading[row] = stopped         # free() fences the slots on it
        self.manager.free(rid)

    def stats(self) -> dict:
        """Requests being sent and received now, and the bytes moved by completed transfers."""
        return dict(sending=len(self.sending), receiving=len(self.receiving), bytes_sent=self.bytes_sent,
                    bytes_received=self.bytes_received)
