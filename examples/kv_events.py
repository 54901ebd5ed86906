"""Prefix-cache events in vLLM's wire format, published over ZMQ to a local subscriber (what a router such as
NVIDIA Dynamo or llm-d consumes to pick the instance that holds a prompt's prefix).

Two prompts that share a system prompt are served with prefix caching; after each settle the publisher
sends the blocks stored and removed since the last batch. The subscriber decodes each batch and rebuilds,
from the stored events alone (hashes, parent hashes, token ids), which token prefixes this instance holds;
the example checks that against the prompts and exits non-zero on a mismatch. Runs on the GPU when there
is one, on the host backend otherwise; needs the `events` extra (msgpack, pyzmq).

    python examples/kv_events.py [--backend auto|cuda|host]
"""
import argparse
import sys


import cupykv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    args = ap.parse_args(argv)
    try:
        import msgpack
        import zmq
        from cupykv.kv_events import KVEventPublisher
    except ImportError as e:
        print(f"this example needs the events extra (pip install msgpack pyzmq): {e}")
        return 1
    tpb = 16
    spec = cupykv.CacheSpec(windows=[128, None], num_kv_heads=2, head_dim=64, dtype="float16",
                            tokens_per_block=tpb, max_seq_len=1024, max_batch=8, slots_per_group=128,
                            prefix_caching=True, prefix_events=True)
    mgr = cupykv.KVCacheManager(spec, backend=args.backend)
    print(f"backend: {mgr.backend.name}")
    ctx = zmq.Context()
    endpoint = "inproc://kv-events"
    publisher = KVEventPublisher(mgr, endpoint, topic="kv-events", context=ctx)
    subscriber = ctx.socket(zmq.SUB)
    subscriber.connect(endpoint)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    if not publisher.wait_for_subscriber(timeout_s=10):
        print("no subscriber joined")
        return 1

    system = list(range(1000, 1000 + 5 * tpb))
    prompts = {"alice": system + list(range(5000, 5040)), "bob": system + list(range(7000, 7070))}
    blocks = {}         # what the subscriber learns: hash -> (parent hash, tokens), full-attention group
    batches = 0
    for rid, toks in prompts.items():
        cached = mgr.add(rid, len(toks), tokens=toks)
        step = mgr.prepare_batch({rid: len(toks) - cached})
        step.finish()
        mgr.settle(step)
        print(f"{rid}: {len(toks)} prompt tokens, {cached} from the prefix cache")
        if publisher.publish() and subscriber.poll(10_000):      # one batch for the events of this settle
            topic, seq, payload = subscriber.recv_multipart()
            batch = msgpack.unpackb(payload, raw=False)
            batches += 1
            for ev in batch["events"]:
                if ev["type"] == "BlockStored" and ev["kv_cache_spec_kind"] == "full_attention":
                    parent = ev["parent_block_hash"]
                    for i, h in enumerate(ev["block_hashes"]):
                        blocks[h] = (parent, ev["token_ids"][i * tpb:(i + 1) * tpb])
                        parent = h
    publisher.close()
    subscriber.close(linger=0)
    ctx.term()
    # every chain the subscriber saw, from its last block back to the first, must be a prompt's full blocks
    held = []
    for h in set(blocks) - {p for p, _ in blocks.values()}:
        chain = [h]
        while chain[-1] in blocks and blocks[chain[-1]][0] is not None:
            chain.append(blocks[chain[-1]][0])
        if all(b in blocks for b in chain):
            held.append([t for b in reversed(chain) for t in blocks[b][1]])
    want = [toks[:len(toks) // tpb * tpb] for toks in prompts.values()]
    print(f"subscriber: {batches} batches, {len(blocks)} full-attention blocks, {len(held)} prefixes held")
    ok = all(any(h == w[:len(h)] for w in want) for h in held) and len(held) >= 1
    print("prefixes rebuilt from the events match the prompts: " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
