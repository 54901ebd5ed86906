"""A small serving loop on cupykv: requests arrive, chunked prefill with scratch, decode, finish.

Checked every step: the page tables against the NumPy reference computed from the host state at the
step's prepare; each new token's write position (page and offset) against the tables and the token's
position; and after settle, which blocks of every request hold a slot, against the window rule written
out here (a full-attention group keeps every block, a sliding window the blocks a query can still see).
Runs on the GPU when there is one, on the host backend otherwise.

    python examples/quickstart.py [--backend auto|cuda|host] [--steps N]
"""
import argparse
import sys

import numpy as np

import cupykv
from cupykv import reference


def expected(mgr, table, step):
    lay = mgr.layout
    return reference.convert_per_layer(table, step.rows, step.num_contexts, step.scratch_begs, step.scratch_ends,
                                       step.scratch_slots, lay.layer_group, lay.group_scale, lay.layer_koff,
                                       max_batch=mgr.spec.max_batch)[:, :step.num_seqs]


def write_positions_ok(mgr, step) -> bool:
    """Token t of entry s at position p goes to layer l's page for block p // tpb (the step's own tables),
    offset p % tpb."""
    tpb = mgr.spec.tokens_per_block
    tables = mgr.backend.to_numpy(step.tables)
    pages, offsets = mgr.backend.to_numpy(step.write_pages), mgr.backend.to_numpy(step.write_offsets)
    entry = np.repeat(np.arange(step.num_seqs), step.num_tokens)
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(step.start_positions, step.num_tokens)])
    t = np.arange(len(pos))
    return bool((offsets[t] == pos % tpb).all() and (pages[:, t] == tables[:, entry, 0, pos // tpb]).all())


def blocks_held_ok(mgr) -> bool:
    """Between steps (all settled), a request with h tokens holds a slot for block b < ceil(h / tpb) of a
    full-attention group, and of a window-W group only where the next query (position h, which sees keys
    h - W + 1 .. h) or a later one still sees a key in it: b >= (h + 1 - W) // tpb."""
    tpb = mgr.spec.tokens_per_block
    for rid in mgr.request_ids:
        h = mgr.request(rid).history
        blocks = np.arange(mgr.layout.max_blocks)
        for g in mgr.layout.groups:
            want = blocks < -(-h // tpb)
            if g.window is not None:
                want &= blocks >= max(0, (h + 1 - g.window) // tpb)
            if not np.array_equal(mgr.table[g.index, mgr.request(rid).row] >= 0, want):
                return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()

    # A GPT-OSS-like model in miniature: 8 layers alternating sliding window (256 tokens) and full.
    spec = cupykv.CacheSpec(windows=[256, None] * 4, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                            tokens_per_block=32, max_seq_len=4096, max_batch=16, slots_per_group=[400, 1600],
                            swa_scratch_reuse=True)
    mgr = cupykv.KVCacheManager(spec, backend=args.backend)
    print(f"cupykv {cupykv.__version__}: backend={mgr.backend.name}; "
          f"groups: {[(g.window, g.num_layers) for g in mgr.layout.groups]}; blocks/seq={mgr.layout.max_blocks}")

    rng = np.random.default_rng(0)
    prefill_left = {}      # rid -> prompt tokens not yet scheduled
    decode_left = {}       # rid -> tokens still to generate
    next_rid, checked, peak, tokens_done = 0, 0, [0, 0], 0
    peak_full_equiv = 0    # blocks a full-attention cache would hold for the same requests
    for step_no in range(args.steps):
        # Arrivals: a new request now and then while there is room.
        while len(prefill_left) + len(decode_left) < spec.max_batch and rng.random() < 0.3:
            prompt = int(rng.integers(64, 2500))
            mgr.add(next_rid, prompt)
            prefill_left[next_rid] = prompt
            next_rid += 1
        # This step: at most two prefill chunks of up to 1024 tokens, everyone else decodes.
        contexts = {}
        for rid in list(prefill_left)[:2]:
            contexts[rid] = min(1024, prefill_left[rid])
        generation = list(decode_left)
        if not contexts and not generation:
            continue
        step = mgr.prepare_batch(contexts, generation)
        table_at_prepare = mgr.table.copy()
        # The consumer: wait for the tables, read them (here: check them), then say it is done.
        step.ready.synchronize()
        got = mgr.backend.to_numpy(step.tables)[:, :step.num_seqs]
        if not np.array_equal(got, expected(mgr, table_at_prepare, step)):
            print(f"step {step.id}: page tables differ from the reference", file=sys.stderr)
            return 1
        if not write_positions_ok(mgr, step):
            print(f"step {step.id}: a write position is not its token's page and offset", file=sys.stderr)
            return 1
        checked += 1
        step.finish()
        mgr.settle(step)
        if not blocks_held_ok(mgr):
            print(f"step {step.id}: a request holds other blocks than its windows keep", file=sys.stderr)
            return 1
        tokens_done += int(step.num_tokens.sum())
        for rid, n in contexts.items():
            prefill_left[rid] -= n
            if prefill_left[rid] == 0:
                del prefill_left[rid]
                decode_left[rid] = int(rng.integers(16, 200))
        for rid in generation:
            decode_left[rid] -= 1
            if decode_left[rid] == 0:
                del decode_left[rid]
                mgr.free(rid)
        st = mgr.stats()
        for i, g in enumerate(st["groups"]):
            peak[i] = max(peak[i], g["owned"] + g["scratch"] + g["quarantined"])
        full_equiv = sum(-(-mgr.request(r).capacity // spec.tokens_per_block) for r in mgr.request_ids)
        peak_full_equiv = max(peak_full_equiv, full_equiv)

    mgr.synchronize()
    st = mgr.stats()
    print(f"steps: {checked} checked (tables against the reference, write positions, blocks held), all "
          f"right; tokens scheduled: {tokens_done}; "
          f"requests: {next_rid} arrived, {st['requests']} still live")
    for g in st["groups"]:
        print(f"  group window={g['window']}: slots owned {g['owned']}, scratch {g['scratch']}, "
              f"quarantined {g['quarantined']}, free {g['free']} of {g['total']}")
    swa = mgr.layout.groups[0]
    saved = 1 - peak[0] / max(peak_full_equiv, 1)
    print(f"peak SWA slots in use: {peak[0]} vs {peak_full_equiv} if those layers kept every block: "
          f"{100 * saved:.0f}% of the SWA group's KV memory saved by window release and scratch "
          f"(window={swa.window}, {swa.num_layers} layers)")
    print(f"quickstart OK on the {mgr.backend.name} backend")
    return 0


if __name__ == "__main__":
    sys.exit(main())
