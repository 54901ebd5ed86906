"""The prefix cache's events in vLLM's KV-event wire format, for routers (NVIDIA Dynamo, llm-d) that pick an
instance by the prefixes it holds.

The format is vLLM's `vllm/distributed/kv_events.py` as of the layer-group fields (vLLM PR #40984): a
msgpack map per batch, {"ts": float, "events": [...], "data_parallel_rank": int (left out when None)}, each
event a map tagged by its class name under "type", its fields in declaration order, optional fields left
out when they hold their default (msgspec's omit_defaults):

    BlockStored   block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
                  [extra_keys], [group_idx], [kv_cache_spec_kind], [kv_cache_spec_sliding_window]
    BlockRemoved  block_hashes, medium, [group_idx]

cupykv sends one event per run of chained blocks of one group (a BlockStored's hashes chain from its
parent_block_hash), group_idx the layer group, kv_cache_spec_kind "full_attention" or "sliding_window"
with the window, medium "GPU". Block hashes are 64-bit unsigned ints by default (the first 8 bytes of
cupykv's 16-byte hash, big-endian), or the 16 raw bytes (int_hashes=False): vLLM's ExternalBlockHash is
either. A block evicted to the host tier stays stored: a hit on it brings it back.

publish: a ZMQ publisher socket sends (topic, sequence number as 8 bytes big-endian, payload), as vLLM's
ZmqEventPublisher does (the `events` extra: msgpack and pyzmq; neither is imported by cupykv's core). It is
an XPUB socket (a PUB that also hands out its subscribers' subscriptions), so wait_for_subscriber() can
hold the first batch until someone listens: a PUB drops what it sends before a subscription arrives.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import numpy as np

from .errors import CupykvError, InvalidRequestError

MEDIUM = "GPU"
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"


class EventsUnavailableError(CupykvError, ImportError):
    """msgpack (or pyzmq, to publish) is not installed: pip install "cupykv[events]"."""


def _hash(h: bytes, int_hashes: bool):
    return int.from_bytes(h[:8], "big") if int_hashes else bytes(h)


def vllm_events(records: Sequence[tuple], layout, int_hashes: bool = True) -> List[dict]:
    """KVCacheManager.drain_cache_events(detail=True) records as vLLM event maps (in order; consecutive
    records of one kind and group, each stored block chaining from the one before, go in one event)."""
    out: List[dict] = []
    last = None                 # (kind, group, last hash) of the event being extended
    for rec in records:
        kind, p, h = rec[0], rec[1], rec[2]
        g = layout.groups[p]
        if kind == "stored":
            parent, tokens = rec[3], rec[4]
            toks = [] if tokens is None else np.frombuffer(tokens, "<i8").tolist()
            if last is not None and last[:2] == ("stored", p) and parent == last[2]:
                ev = out[-1]
                ev["block_hashes"].append(_hash(h, int_hashes))
                ev["token_ids"] += toks
            else:
                ev = {"type": "BlockStored", "block_hashes": [_hash(h, int_hashes)],
                      "parent_block_hash": None if parent is None else _hash(parent, int_hashes),
                      "token_ids": toks, "block_size": layout.tpb, "lora_id": None, "medium": MEDIUM,
                      "lora_name": None, "group_idx": p,
                      "kv_cache_spec_kind": SLIDING_WINDOW if g.is_swa else FULL_ATTENTION}
                if g.is_swa:
                    ev["kv_cache_spec_sliding_window"] = g.window
                out.append(ev)
        else:
            if last is not None and last[:2] == ("removed", p):
                out[-1]["block_hashes"].append(_hash(h, int_hashes))
            else:
                out.append({"type": "BlockRemoved", "block_hashes": [_hash(h, int_hashes)], "medium": MEDIUM,
                            "group_idx": p})
        last = (kind, p, h)
    return out


def event_batch(events: List[dict], ts: Optional[float] = None, data_parallel_rank: Optional[int] = None) -> dict:
    """vLLM's KVEventBatch as a map (data_parallel_rank left out when None)."""
    batch = {"ts": time.time() if ts is None else float(ts), "events": events}
    if data_parallel_rank is not None:
        batch["data_parallel_rank"] = int(data_parallel_rank)
    return batch


def encode(batch: dict) -> bytes:
    """The batch as msgpack bytes (what vLLM's publisher sends as the payload)."""
    try:
        import msgpack
    except ImportError:
        raise EventsUnavailableError("encoding KV events needs msgpack: pip install msgpack "
                                     "(or cupykv[events])") from None
    return msgpack.packb(batch, use_bin_type=True)


class KVEventPublisher:
    """Publishes a manager's prefix-cache events on a ZMQ PUB socket in vLLM's format.

    manager: a KVCacheManager with CacheSpec(prefix_caching=True, prefix_events=True). endpoint: bound when it
    holds "*" or is ipc:// or inproc://, else connected (vLLM's rule). Call publish() after settle (or any
    call that may store or remove cached blocks); it sends one batch when there are events."""

    def __init__(self, manager, endpoint: str = "tcp://*:5557", topic: str = "", *,
                 data_parallel_rank: Optional[int] = None, int_hashes: bool = True, context=None):
        try:
            import zmq
        except ImportError:
            raise EventsUnavailableError("publishing KV events needs pyzmq: pip install pyzmq "
                                         "(or cupykv[events])") from None
        if not manager.spec.prefix_events:
            raise InvalidRequestError("KVEventPublisher: the manager records no prefix-cache events; make it with "
                                      "CacheSpec(..., prefix_caching=True, prefix_events=True)")
        self.manager, self.topic = manager, topic.encode()
        self.data_parallel_rank, self.int_hashes = data_parallel_rank, int_hashes
        self.socket = (context or zmq.Context.instance()).socket(zmq.XPUB)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.sequence = 0

    def wait_for_subscriber(self, timeout_s: float = 10.0) -> bool:
        """Wait until a subscriber's subscription has arrived (or timeout_s passed); returns whether one has."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return False
        self.socket.recv()          # the subscription frame (b"\x01" + its topic)
        return True

    def publish(self) -> int:
        """Send the events since the last call as one batch; returns how many events it held."""
        events = vllm_events(self.manager.drain_cache_events(detail=True), self.manager.layout, self.int_hashes)
        if not events:
            return 0
        payload = encode(event_batch(events, data_parallel_rank=self.data_parallel_rank))
        self.socket.send_multipart((self.topic, self.sequence.to_bytes(8, "big"), payload))
        self.sequence += 1
        return len(events)

    def close(self) -> None:
        """Close the socket (batches not yet delivered are dropped)."""
        self.socket.close(linger=0)
