"""The NIXL transport: KV moves between two managers' storages with NVIDIA's NIXL (the receiver pulls, READ).

Each side runs one NixlAgent over its KVTransfers. The agent registers every group's KV array once, at
construction (VRAM on the CUDA backend, DRAM on the host backend), so its metadata (metadata(), exchanged
out of band, as vLLM's NixlConnector does in its handshake) lets the other side address any of its slots.

    sender                                        receiver
    agent = NixlAgent(transfers, "prefill-0")     agent = NixlAgent(transfers, "decode-0")
            exchange agent.metadata() both ways: agent.connect(theirs)
    out = agent.send(rid); out.wait_ready()
    ship out.meta.to_dict()  ------------------>  read = agent.read(meta)
                                                     receive() (slots here), then one READ of every block:
                                                     runs of blocks adjacent on both sides are one
                                                     descriptor; tagged with the transfer id
                                                  read.poll() until "DONE" (received() then) or "ERR"
                                                     (unreceive(), and the sender is told)
    agent.poll_sent()  <- NIXL's notification, the transfer id: sent() (or unsend() on a failure notice)

The package: `pip install nixl` picks the CUDA 12 or 13 build; nixl_cu12 / nixl_cu13 are imported as they
are when the meta-package is missing. NIXL completes a READ on the host's poll, with the bytes in place, so
a received request's first step waits for nothing on the device.
"""
from __future__ import annotations

import importlib
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..allocator import run_starts
from ..errors import CupykvError, InvalidRequestError
from ..transfer import Incoming, KVTransfers, Outgoing, TransferMeta

_FAILED = b"cupykv-failed:"         # a receiver's notice that a transfer failed: the sender unsends


class NixlUnavailableError(CupykvError, ImportError):
    """The nixl package is not installed (pip install "cupykv[nixl]")."""


def nixl_api():
    """NIXL's Python API module (nixl._api, or a CUDA build's own), or NixlUnavailableError."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NixlUnavailableError("the NIXL transport needs the nixl package: pip install nixl (or cupykv[nixl])")


def nixl_available() -> bool:
    """Whether the nixl package can be imported here."""
    try:
        nixl_api()
        return True
    except NixlUnavailableError:
        return False


def descriptor_runs(src_addresses: np.ndarray, src_slots: np.ndarray, dst_addresses: np.ndarray,
                    dst_slots: np.ndarray, slot_bytes: int, devices: Tuple[int, int]) -> Tuple[np.ndarray, np.ndarray]:
    """NIXL descriptor arrays (int64 [n, 3]: address, bytes, device) of one group's blocks, source and
    destination: one row per run of blocks whose slots step by one on both sides."""
    starts = run_starts(src_slots, dst_slots)
    nbytes = np.diff(np.append(starts, len(src_slots))) * slot_bytes
    return tuple(np.stack((addresses[starts], nbytes, np.full(len(starts), device)), axis=1).astype(np.int64)
                 for addresses, device in ((src_addresses, devices[0]), (dst_addresses, devices[1])))


class NixlRead:
    """One READ under way on the receiver: poll() until it is "DONE" or "ERR"."""

    def __init__(self, agent: "NixlAgent", inc: Incoming, handle, remote: str, num_descriptors: int):
        self.agent, self.incoming, self.handle, self.remote = agent, inc, handle, remote
        self.num_descriptors = num_descriptors
        self.nbytes = inc.descriptors.nbytes
        self.state = "PROC"

    def poll(self) -> str:
        """The transfer's state: "PROC" while it runs; at "DONE" the request has been received (it may be
        scheduled); at "ERR" it has been unreceived (removed here, its slots released) and the sender
        told. Polling a finished read returns its state again."""
        if self.state != "PROC":
            return self.state
        api = self.agent.agent
        state = api.check_xfer_state(self.handle)
        if state == "PROC":
            return state
        api.release_xfer_handle(self.handle)
        transfers, rid = self.agent.transfers, self.incoming.rid
        if state == "DONE":
            transfers.received(rid)
        else:
            transfers.unreceive(rid)         # the handle is released: NIXL writes nothing more
            api.send_notif(self.remote, _FAILED + self.incoming.meta.transfer_id.encode())
        self.state = state
        return state

    def done(self) -> bool:
        """Whether the READ has ended (poll() is "DONE" or "ERR")."""
        return self.poll() != "PROC"

    def wait(self, timeout: Optional[float] = None) -> str:
        """Poll until the transfer is done or failed (or `timeout` seconds passed); returns the state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() == "PROC":
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(20e-6)
        return self.state


class NixlAgent:
    """A NIXL agent over one side's KVTransfers (see the module docstring for the protocol).

    name: the agent's name, unique among the agents that talk to each other. backends: NIXL backends to
    create (UCX moves GPU memory within and between hosts)."""

    def __init__(self, transfers: KVTransfers, name: str, backends: Sequence[str] = ("UCX",)):
        api = nixl_api()
        self.transfers, self.name = transfers, str(name)
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=list(backends)))
        storage = transfers.storage
        self.memory, self.device_id = storage.memory_kind, storage.device_id
        regions = [(address, nbytes, self.device_id, "") for address, nbytes, _ in storage.regions()]
        self._registered = self.agent.register_memory(regions, self.memory)
        self._remotes: List[str] = []
        self._sending: Dict[str, object] = {}       # transfer id -> the sender's request id

    def metadata(self) -> bytes:
        """This agent's metadata (its registered memory, how to reach it), for the other side's connect()."""
        return self.agent.get_agent_metadata()

    def connect(self, remote_metadata: bytes) -> str:
        """Load another agent's metadata; returns its name."""
        remote = self.agent.add_remote_agent(remote_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        self._remotes.append(remote)
        return remote

    # -- the sender ------------------------------------------------------------------------------
    def send(self, rid, tokens=None) -> Outgoing:
        """KVTransfers.send, with this agent named in the meta for the receiver."""
        out = self.transfers.send(rid, tokens)
        out.meta.source["agent"] = self.name
        self._sending[out.meta.transfer_id] = rid
        return out

    def poll_sent(self) -> List[Tuple[object, bool]]:
        """The requests whose transfers ended since the last call, as (request id, ok): ok ones are sent()
        (freed here), failed ones unsent() (schedulable here again)."""
        ended = []
        for messages in self.agent.get_new_notifs().values():
            for msg in messages:
                failed = msg.startswith(_FAILED)
                tid = (msg[len(_FAILED):] if failed else msg).decode()
                rid = self._sending.pop(tid, None)
                if rid is None:
                    continue            # not one of ours (or already handled)
                (self.transfers.unsend if failed else self.transfers.sent)(rid)
                ended.append((rid, not failed))
        return ended

    # -- the receiver ----------------------------------------------------------------------------
    def read(self, meta: Union[TransferMeta, Mapping], rid=None) -> NixlRead:
        """KVTransfers.receive, then one READ of every block from the sender named in the meta (connected
        before), tagged with the transfer id; poll the returned NixlRead."""
        if not isinstance(meta, TransferMeta):
            meta = TransferMeta.from_dict(meta)
        remote = meta.source.get("agent")
        if remote not in self._remotes:
            raise InvalidRequestError(f"NIXL read: the sender's agent {remote!r} is not connected "
                                      f"(connected: {self._remotes})")
        inc = self.transfers.receive(meta, rid)
        try:
            handle, count = self._post(meta, inc, remote)
        except BaseException:
            self.transfers.unreceive(inc.rid)       # nothing was posted: nothing writes the slots
            raise
        return NixlRead(self, inc, handle, remote, count)

    def _post(self, meta: TransferMeta, inc: Incoming, remote: str):
        src, dst = meta.source_descriptors(), inc.descriptors
        local, far = [], []
        for g in range(len(dst.blocks)):
            s, d = descriptor_runs(src.addresses[g], src.slots[g], dst.addresses[g], dst.slots[g],
                                   dst.slot_bytes[g], (src.device_id, dst.device_id))
            far.append(s)
            local.append(d)
        local_descs = self.agent.get_xfer_descs(np.concatenate(local), self.memory)
        remote_descs = self.agent.get_xfer_descs(np.concatenate(far), src.memory)
        handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, remote,
                                            meta.transfer_id.encode())
        if self.agent.transfer(handle, meta.transfer_id.encode()) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise CupykvError(f"NIXL READ of request {inc.rid!r} failed to start")
        return handle, sum(len(x) for x in local)

    def close(self) -> None:
        """Forget the remote agents and deregister the storage (after every transfer has ended)."""
        for remote in self._remotes:
            self.agent.remove_remote_agent(remote)
        self._remotes.clear()
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self._registered = None
