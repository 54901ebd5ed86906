"""KV events in vLLM's wire format (cupykv.kv_events), decoded by msgspec Structs written from vLLM's
published event classes (vllm/distributed/kv_events.py with the layer-group fields, PR #40984), and checked
against the prompts' own tokens: each stored event's blocks chain from its parent and carry the tokens
that were hashed."""
from typing import Any, List, Optional, Union

import pytest

import cupykv
from cupykv import kv_events
from cupykv.errors import InvalidRequestError

msgspec = pytest.importorskip("msgspec", reason="msgspec decodes the events as vLLM's classes do (the test extra)")
pytest.importorskip("msgpack", reason="cupykv.kv_events encodes with msgpack (the events extra)")

TPB = 4
Hash = Union[bytes, int]            # vLLM's ExternalBlockHash


# vLLM's classes, field for field (names, order, defaults, the tag and omit_defaults).
class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: List[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[tuple]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: List[Hash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def served(windows=(8, None), slots=24):
    """A manager with events; two prompts sharing 8 tokens are prefilled and settled with their tokens."""
    spec = cupykv.CacheSpec(windows=list(windows), num_kv_heads=1, head_dim=4, dtype="float32",
                            tokens_per_block=TPB, max_seq_len=64, max_batch=4, slots_per_group=slots,
                            prefix_caching=True, prefix_events=True)
    mgr = cupykv.KVCacheManager(spec, backend="host")
    prompts = {"a": list(range(100, 117)), "b": list(range(100, 108)) + list(range(300, 311))}
    for rid, toks in prompts.items():
        mgr.add(rid, len(toks), tokens=toks)
        step = mgr.prepare_batch({rid: len(toks) - mgr.request(rid).history})
        step.finish()
        mgr.settle(step)
    return mgr, prompts


def decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


@pytest.mark.parametrize("int_hashes", [True, False])
def test_stored_events_decode_as_vllms_classes_and_carry_the_prompts_blocks(int_hashes):
    mgr, prompts = served()
    records = mgr.drain_cache_events(detail=True)
    batch = decode(kv_events.encode(kv_events.event_batch(kv_events.vllm_events(records, mgr.layout, int_hashes),
                                                          ts=12.5, data_parallel_rank=1)))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 1
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert stored and all(isinstance(e, BlockStored) for e in batch.events)
    blocks = []         # per group: hash -> (parent hash, the block's tokens)
    for g, group in enumerate(mgr.layout.groups):
        events = [e for e in stored if e.group_idx == g]
        assert all(e.block_size == TPB and e.medium == "GPU" and e.lora_id is None for e in events)
        assert all(e.kv_cache_spec_kind == ("sliding_window" if group.is_swa else "full_attention")
                   and e.kv_cache_spec_sliding_window == group.window for e in events)
        by_hash = {}
        for e in events:
            assert len(e.token_ids) == TPB * len(e.block_hashes)
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                assert isinstance(h, int if int_hashes else bytes)
                by_hash[h] = (parent, tuple(e.token_ids[i * TPB:(i + 1) * TPB]))
                parent = h
        blocks.append(by_hash)
    # the oracle: the full-attention group stores every full block of each prompt (the shared first blocks
    # once); walked from each chain's last block to its first, the tokens are the prompt's
    full = blocks[1]
    chains = []
    for h in set(full) - {parent for parent, _ in full.values()}:
        chain = [h]
        while full[chain[-1]][0] is not None:
            chain.append(full[chain[-1]][0])
        chains.append([tok for b in reversed(chain) for tok in full[b][1]])
    assert sorted(chains) == sorted(toks[:len(toks) // TPB * TPB] for toks in prompts.values())
    # the window stores the blocks that held a slot when published: the same blocks, tokens and parents
    assert blocks[0] and all(full[h] == v for h, v in blocks[0].items())


def test_removed_events_name_the_evicted_blocks():
    mgr, _ = served(windows=(None,), slots=10)
    mgr.drain_cache_events()
    for rid in ("a", "b"):
        mgr.free(rid)
    mgr.add("c", 30, tokens=list(range(500, 530)))          # needs the cached blocks' slots
    step = mgr.prepare_batch({"c": 30})
    step.finish()
    mgr.settle(step)
    records = mgr.drain_cache_events(detail=True)
    removed = {r[2] for r in records if r[0] == "removed"}
    batch = decode(kv_events.encode(kv_events.event_batch(kv_events.vllm_events(records, mgr.layout))))
    got = {h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed and got == {int.from_bytes(h[:8], "big") for h in removed}
    assert all(e.group_idx == 0 and e.medium == "GPU" for e in batch.events if isinstance(e, BlockRemoved))


def test_the_plain_events_are_unchanged():
    mgr, _ = served()
    plain = mgr.drain_cache_events()
    assert plain and all(len(e) == 3 and e[0] in ("stored", "removed") and len(e[2]) == 16 for e in plain)


def serve(mgr, rid, toks):
    mgr.add(rid, len(toks), tokens=toks)
    step = mgr.prepare_batch({rid: len(toks) - mgr.request(rid).history})
    step.finish()
    mgr.settle(step)


def test_the_publisher_sends_vllms_frames():
    zmq = pytest.importorskip("zmq", reason="publishing needs pyzmq (the events extra)")
    mgr, _ = served()
    mgr.drain_cache_events()
    ctx = zmq.Context()
    endpoint = "inproc://cupykv-events-test"
    pub = kv_events.KVEventPublisher(mgr, endpoint, topic="kv", context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        assert pub.publish() == 0                # nothing stored since the drain: nothing sent
        assert pub.wait_for_subscriber()
        serve(mgr, "c", list(range(700, 717)))
        assert pub.publish() > 0
        assert sub.poll(10_000)
        topic, seq, payload = sub.recv_multipart()
        batch = decode(payload)
        assert topic == b"kv" and 0 <= int.from_bytes(seq, "big") < pub.sequence
        assert any(isinstance(e, BlockStored) for e in batch.events)
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()


def test_a_publisher_needs_a_manager_with_events():
    pytest.importorskip("zmq", reason="publishing needs pyzmq (the events extra)")
    spec = cupykv.CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, dtype="float32", tokens_per_block=TPB,
                            max_seq_len=64, max_batch=2, slots_per_group=8)
    with pytest.raises(InvalidRequestError, match="prefix_events"):
        kv_events.KVEventPublisher(cupykv.KVCacheManager(spec, backend="host"), "inproc://x")
