"""Replay a recorded call sequence (tests/data/cuda_prefix_host_tier_kv.md's format) through the public API,
with the KV-content checker (tests/kvcontent.py) as every step's consumer.

    python scripts/replay_kv.py [TRACE] [--backend host|cuda] [--eager]

Every `sync` line synchronizes the manager and checks every read so far. --eager (host backend only) runs
queued simulated work as soon as it can, as a fast GPU does, instead of at the next host wait. Exits 1
with the checker's report when a position read wrong KV, 0 when the whole trace read right.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import cupykv  # noqa: E402
from cupykv.storage import KVStorage  # noqa: E402
from kvcontent import KVChecker, KVContentError, make_eager  # noqa: E402

TRACE = os.path.join(HERE, "..", "tests", "data", "cuda_prefix_host_tier_kv.md")
SPEC = dict(windows=[None, 149, None, None, 149], tokens_per_block=4, num_kv_heads=2, head_dim=3, dtype="float32",
            max_seq_len=55, max_batch=4, max_rewind=2, sink_tokens=[0, 0, 0, 5, 5], table_mode="per_layer",
            swa_scratch_reuse=True, null_slot=False, prefix_caching=True, prefix_retention="boundaries",
            prefix_events=False, slots_per_group=[24, 24, 24])
HOST_TIER_BYTES = 3715

TRUNCATED = "truncated"
LINE = re.compile(r"^\[\d+:\d+\] (.*)$")


def lit(text: str):
    return ast.literal_eval(text.replace("array(", "(").strip())


def parse(path: str):
    """The trace's calls, in order: (verb, fields)."""
    calls = []
    for raw in open(path):
        m = LINE.match(raw.strip())
        if not m:
            continue
        body = m.group(1)
        if body == "sync":
            calls.append(("sync", {}))
        elif body.startswith("add("):
            m2 = re.match(r"add\((.*), (\d+), salt=(.*), checkpoints=(\[.*?\])\) -> (\d+); tokens=(\[.*\])$", body)
            rid, n, salt, marks, hit, toks = m2.groups()
            calls.append(("add", dict(rid=lit(rid), n=int(n), salt=lit(salt), checkpoints=lit(marks), hit=int(hit),
                                      tokens=lit(toks))))
        elif body.startswith("prepare "):
            m2 = re.match(r"prepare (\d+): contexts=(\[.*?\]) generation=(\[.*?\]) k=(\d+) pad_to=(\w+) "
                          r"gen_tokens=(\[.*\])$", body)
            sid, ctx, gen, k, pad, toks = m2.groups()
            calls.append(("prepare", dict(id=int(sid), contexts=lit(ctx), generation=lit(gen), k=int(k),
                                          pad_to=None if pad == "None" else int(pad), gen_tokens=lit(toks))))
        elif body.startswith("settle("):
            m2 = re.match(r"settle\(step (\d+), accepted=(\[.*?\]), new_tokens=(.*)$", body)
            sid, acc, new = m2.groups()
            # numpy wrapped a long array over lines the trace lost: the tokens are the entries' fed ones
            new = lit(new[:-1]) if new.endswith(")") else TRUNCATED
            calls.append(("settle", dict(id=int(sid), accepted=lit(acc), new_tokens=new)))
        elif body.startswith("free("):
            m2 = re.match(r"free\((.*)\) \[", body)
            calls.append(("free", dict(rid=lit(m2.group(1)))))
        elif body.startswith(("suspend(", "resume(")):
            verb, rid = re.match(r"(\w+)\((.*)\)$", body).groups()
            calls.append((verb, dict(rid=lit(rid))))
        else:
            raise ValueError(f"unknown call: {body}")
    return calls


HISTORY: list = []       # (trace call index, what) of every slot event, with --history


def record_history(mgr, where: list) -> None:
    """Log every move of a device or host slot (allocation, eviction, release, tier copies) for the report
    of a failure: which event last touched the slot that read wrong."""
    from cupykv.allocator import CachingSlotPool
    from cupykv.host_tier import HostTier

    def wrap(cls, name, show):
        orig = getattr(cls, name)

        def logged(self, *a, **kw):
            out = orig(self, *a, **kw)
            HISTORY.append((where[0], show(self, a + tuple(kw.values()), out)))
            return out
        setattr(cls, name, logged)

    pool_no = {id(pool): p for p, pool in enumerate(mgr.pools)}
    wrap(CachingSlotPool, "allocate", lambda self, a, out: f"g{pool_no.get(id(self))} allocate {out.tolist()}")
    wrap(CachingSlotPool, "release", lambda self, a, out: f"g{pool_no.get(id(self))} release {list(a[0])} tag {a[1]} -> quarantined {out.tolist()}")
    wrap(CachingSlotPool, "acquire", lambda self, a, out: f"g{pool_no.get(id(self))} acquire {list(a[0])}")
    wrap(HostTier, "_copy", lambda self, a, out: f"g{a[0]} tier copy {'D2H' if a[3] else 'H2D'} dev {list(a[1])} host {list(a[2])}")


def _call(verb, f, mgr, storage, check, steps, fed_of, hits, log) -> None:
    if verb == "sync":
        mgr.synchronize()
        check.check()
    elif verb == "add":
        hit = mgr.add(f["rid"], f["n"], tokens=f["tokens"], cache_salt=f["salt"], checkpoints=f["checkpoints"])
        hits[f["rid"]] = (hit, f["hit"])
        check.add(f["rid"], f["tokens"], f["salt"], hit)
    elif verb == "prepare":
        step = mgr.prepare_batch(f["contexts"], f["generation"], num_gen_tokens=f["k"], pad_to=f["pad_to"])
        if step.id != f["id"]:
            log(f"note: step id {step.id} where the trace has {f['id']}")
        steps[f["id"]] = step
        fed_of[f["id"]] = dict(zip(f["generation"], f["gen_tokens"])), f["generation"]
        check.consume(step, fed_of[f["id"]][0])
    elif verb == "settle":
        if f["id"] not in steps:                # its prepare was refused
            return
        new = f["new_tokens"]
        if new == TRUNCATED:    # every generation entry's accepted tokens, in batch order
            fed, gen = fed_of[f["id"]]
            new = [t for rid, a in zip(gen, f["accepted"][len(f["accepted"]) - len(gen):]) for t in fed[rid][:a]]
        if isinstance(new, (tuple, list)):
            new = np.array(new, np.int64)
        mgr.settle(steps.pop(f["id"]), f["accepted"], input_tokens=new)
    elif verb == "free":
        mgr.free(f["rid"])
        check.free(f["rid"])
    elif verb == "suspend":
        storage.suspend(f["rid"])
    elif verb == "resume":
        storage.resume(f["rid"])


def replay(path: str, backend: str = "host", eager: bool = False, lazy: str = "", history: bool = False,
           log=print) -> KVChecker:
    """Run the trace; raises KVContentError at the first sync whose reads were wrong."""
    mgr = cupykv.KVCacheManager(cupykv.CacheSpec(**SPEC), backend=backend)
    if eager:
        make_eager(mgr.backend, lazy)
    storage = KVStorage(mgr, host_tier_bytes=HOST_TIER_BYTES)
    check = KVChecker(mgr, storage)
    steps, fed_of, hits = {}, {}, {}
    where = [0]
    if history:
        record_history(mgr, where)
    refused = []
    for i, (verb, f) in enumerate(parse(path)):
        where[0] = (i, verb, f.get("rid", f.get("id")))
        try:
            _call(verb, f, mgr, storage, check, steps, fed_of, hits, log)
        except cupykv.CupykvError as exc:      # another timing took other paths: the call is skipped
            refused.append(f"{verb} {f.get('rid', f.get('id'))!r}: {type(exc).__name__}")
    if refused:
        log(f"note: {len(refused)} calls refused here (the trace's timing took other paths): {refused[:5]}")
    mgr.synchronize()
    check.check()
    differ = {rid: h for rid, h in hits.items() if h[0] != h[1]}
    if differ:
        log(f"note: hits that differ from the trace's (got, trace): {differ}")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=TRACE)
    ap.add_argument("--backend", default="host", choices=["host", "cuda"])
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--history", action="store_true", help="on a failure, print the slot events of group 0")
    ap.add_argument("--lazy", default="", help="with --eager: streams whose name has this stay lazy "
                    "(e.g. 'host tier', 'manager')")
    a = ap.parse_args()
    try:
        check = replay(a.trace, a.backend, a.eager, a.lazy, a.history)
    except KVContentError as e:
        print(f"replay ({a.backend}{', eager' if a.eager else ''}): FAILED\n{e}")
        for where, what in HISTORY[-400:]:
            print(where, what)
        return 1
    print(f"replay ({a.backend}{', eager' if a.eager else ''}): OK, {check.steps_checked} steps, "
          f"{check.positions_checked} positions read right")
    return 0


if __name__ == "__main__":
    sys.exit(main())
