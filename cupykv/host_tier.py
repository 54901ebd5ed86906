"""The host tier: a pinned host pool per layer group, and suspend / resume of a request's KV.

A device slot of group g is one contiguous range of KVStorage.arrays[g] ([scale, tpb, kv_heads,
head_dim]), so a request moves as runs of adjacent slots, one backend.copy_runs per group and direction
on the tier's own copy stream, overlapping with other steps' device work. On CUDA each is one copy
kernel, not memcpys: a copy engine busy with a large device-to-host copy holds up the small copies other
streams make in that direction meanwhile (an engine's sampled tokens each step) until it is done, and a
memcpy per run blocks the host once the stream's queue is full (backends/cuda.py, copy_runs). Both
directions follow the rule the snapshots follow: nobody writes a copy's source or destination until the
event after it has completed, and no pinned buffer is dropped while a copy may touch it (the pool is
allocated once, for the life of the tier).

    suspend: copy stream waits for the latest step's finish (every step that wrote the KV came before)
             D2H copies of the resident blocks -> `copied` event
             residence.detach: device slots released, quarantined until `copied` (and every step so far)
    resume:  residence.attach: device slots taken (all or nothing), table rows restored, and
             H2D copies -> `loaded` event; the next step that schedules the request waits for it on the
             device before its tables are ready
             host slots return to the pool once `loaded` has completed
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Sequence, Tuple

import numpy as np

from .allocator import SlotPool, slot_runs
from .errors import CupykvError, InvalidRequestError, InvalidSpecError


class HostTierFullError(CupykvError):
    """The host tier has too few free slots for the request; nothing was copied or released."""


@dataclass
class _Suspended:
    blocks: List[np.ndarray]         # per group: block ordinals that held a slot
    host_slots: List[np.ndarray]     # per group: where they went in the host pool
    copied: object                   # event after the D2H copies


class HostTier:
    """Pinned host slots per group (host_tier_bytes split like the device memory), and the requests
    whose KV they hold."""

    def __init__(self, storage, manager, nbytes: int):
        self.manager, self.storage, self.backend = manager, storage, storage.backend
        slot_bytes = [int(a[0].nbytes) for a in storage.arrays]
        device = [int(a.nbytes) for a in storage.arrays]
        slots = [int(nbytes * d / sum(device)) // b for d, b in zip(device, slot_bytes)]
        if min(slots) < 1:
            raise InvalidSpecError(f"host_tier_bytes={nbytes}: too small for one slot of every group "
                                   f"(slot bytes per group: {slot_bytes})")
        self.slot_bytes = slot_bytes
        self.pools: List[np.ndarray] = []
        try:
            for n, b in zip(slots, slot_bytes):
                self.pools.append(self.backend.pinned_bytes(n * b).reshape(n, b))
        except (MemoryError, ValueError, RuntimeError) as exc:    # numpy's, and CUDA's through CuPy
            self.pools.clear()          # what was pinned goes back now, not with the traceback
            raise InvalidSpecError(f"host_tier_bytes={nbytes}: cannot allocate that much pinned host memory "
                                   f"({type(exc).__name__}: {exc})") from exc
        self._free = [SlotPool(n) for n in slots]       # free host slots per group (no quarantine: _returning)
        self._returning: List[Tuple[object, int, np.ndarray]] = []   # (event, group, host slots)
        self.held: Dict[Hashable, _Suspended] = {}
        self.stream = self.backend.new_stream("host tier")
        self.bytes_to_host = self.bytes_to_device = 0
        self.cache = manager.cache
        if self.cache is not None:     # with prefix caching, blocks evicted from the device come here
            self.cache.attach_host(self)

    def suspend(self, rid: Hashable) -> None:
        """Move the request's resident KV to host slots and release its device slots (see module doc)."""
        mgr, be = self.manager, self.backend
        after = mgr.residence.check_detach(rid)
        resident = mgr.residence.resident_blocks(rid)
        self._poll()
        cached = [len(self.cache.host_hash_of[p]) if self.cache else 0 for p in range(len(resident))]
        short = [p for p, (b, _) in enumerate(resident) if len(b) > self._free[p].num_free + cached[p]]
        if short:
            p = short[0]
            raise HostTierFullError(f"request {rid!r}: group {p} needs {len(resident[p][0])} host slots; "
                                    f"{self._free[p].num_free} free and {cached[p]} holding cached blocks that "
                                    "would make way (the request stays resident)")
        # -- nothing has changed so far --
        host = [self._take(p, len(b)) for p, (b, _) in enumerate(resident)]
        for event in after:
            be.wait(self.stream, event)
        for p, ((_, dev), hs) in enumerate(zip(resident, host)):
            self._copy(p, dev, hs, to_host=True)
        copied = be.record(self.stream)
        mgr.residence.detach(rid, copied)
        self.held[rid] = _Suspended([b for b, _ in resident], host, copied)

    def resume(self, rid: Hashable) -> None:
        """Bring a suspended request's KV back into fresh device slots (all or nothing; OutOfSlotsError
        and nothing changed when they are not there)."""
        self.manager.request(rid)               # unknown (or unhashable) ids raise UnknownRequestError
        held = self.held.get(rid)
        if held is None:
            raise InvalidRequestError(f"request {rid!r} is not suspended")

        def copy_back(slots: Sequence[np.ndarray]):
            for p, (dev, hs) in enumerate(zip(slots, held.host_slots)):
                self._copy(p, dev, hs, to_host=False)      # after the D2H copies: same stream
            return self.backend.record(self.stream)

        loaded = self.manager.residence.attach(rid, held.blocks, copy_back)
        del self.held[rid]
        self._returning += [(loaded, p, hs) for p, hs in enumerate(held.host_slots)]

    # -- cached blocks (with prefix caching; the cache names them, see PrefixCache._evicted) ---------
    def cache_slot(self, p: int):
        """A free host slot of group p for an evicted cached block, or None."""
        self._poll()
        return int(self._free[p].allocate(1)[0]) if self._free[p].num_free else None

    def release_cache_slot(self, p: int, host_slot: int) -> None:
        """A cached block's host slot is free again (the cache dropped the block without reading it). Any
        copy still writing it runs on the tier stream, before every later copy into it."""
        self._free[p].give_back(np.array([host_slot]))

    def copy_out(self, p: int, dev_slots: np.ndarray, host_slots: np.ndarray):
        """Copy device slots (evictable: their quarantine has lifted) to host slots; returns the event."""
        self._copy(p, dev_slots, host_slots, to_host=True)
        return self.backend.record(self.stream)

    def copy_in(self, p: int, host_slots: np.ndarray, dev_slots: np.ndarray):
        """Copy host slots into fresh device slots; the host slots return after the copy. Returns its event."""
        self._copy(p, dev_slots, host_slots, to_host=False)
        loaded = self.backend.record(self.stream)
        self._returning.append((loaded, p, host_slots))
        return loaded

    def _take(self, p: int, n: int) -> np.ndarray:
        """n host slots of group p for a suspended request's blocks: free ones (the top of the free stack
        first, so a fresh tier's slots come in one ascending run), then the least recently cached blocks'
        (their blocks leave the cache). suspend has checked that there are n."""
        free = self._free[p].allocate(min(n, self._free[p].num_free))
        if len(free) == n:
            return free
        return np.concatenate((free, np.array([self.cache.drop_host_block(p) for _ in range(n - len(free))],
                                              free.dtype)))

    def forget(self, rid: Hashable) -> None:
        """The request was freed: its host slots return once its D2H copy has completed."""
        held = self.held.pop(rid, None)
        if held is not None:
            self._returning += [(held.copied, p, hs) for p, hs in enumerate(held.host_slots)]

    def stats(self) -> dict:
        """Per group host slots (total / free / used by suspended requests / cached blocks), and the bytes
        copied each way so far."""
        self._poll()
        cached = [len(t) for t in self.cache.host_hash_of] if self.cache else [0] * len(self.pools)
        return dict(groups=[dict(total=len(pool), free=free.num_free, used=len(pool) - free.num_free - c, cached=c)
                            for pool, free, c in zip(self.pools, self._free, cached)],
                    suspended=len(self.held), bytes_to_host=self.bytes_to_host, bytes_to_device=self.bytes_to_device)

    def state(self) -> tuple:
        """A comparable snapshot (KVCacheManager.state): the suspended requests and their slots, every
        group's free host slots with those on their way back (a poll moves them, which no caller can tell),
        and the bytes copied."""
        back: List[List[int]] = [[] for _ in self.pools]
        for _, p, hs in self._returning:
            back[p] += hs.tolist()
        held = tuple((repr(rid), tuple(b.tobytes() for b in s.blocks), tuple(h.tobytes() for h in s.host_slots))
                     for rid, s in self.held.items())
        return (held, tuple(tuple(sorted(f.free_slots().tolist() + b)) for f, b in zip(self._free, back)),
                self.bytes_to_host, self.bytes_to_device)

    # -- internals -------------------------------------------------------------------------------
    def _copy(self, p: int, dev_slots: np.ndarray, host_slots: np.ndarray, to_host: bool) -> None:
        dev, host = self.storage.arrays[p], self.pools[p]
        runs = slot_runs(dev_slots, host_slots)       # (device slot, host slot, n)
        moved = len(host_slots) * self.slot_bytes[p]
        if to_host:
            self.backend.copy_runs(host, dev, runs[:, [1, 0, 2]], self.slot_bytes[p], self.stream)
            self.bytes_to_host += moved
        else:
            self.backend.copy_runs(dev, host, runs, self.slot_bytes[p], self.stream)
            self.bytes_to_device += moved

    def _poll(self) -> None:
        keep = []
        for event, p, hs in self._returning:
            if event.done():
                self._free[p].give_back(hs)
            else:
                keep.append((event, p, hs))
        self._returning = keep
