"""`python -m cupykv.bench devices`: what a second device costs a step (KVCacheManager(devices=...)).

One decode workload (GPT-OSS-120B layer pattern, batch 256, prompts uniform in [max_seq_len / 4,
max_seq_len), prefilled untimed) runs on managers with devices [0], [0, 0] (two mirrors on one GPU) and,
where the machine has two GPUs, [0, 1]; each with and without step graphs, side by side in one run.
Per step: host time of prepare_batch and of settle; device time, the GPU work of the step on each
device's manager stream between timing events, with every manager stream held by a gate during the
enqueue (so launch gaps of the host do not count), reported as the slowest device's; medians.
Writes devices.json and devices.md to --out. Timings are never judged; the exit status is 1 only when a
configuration failed.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional

import numpy as np

from ..layout import Layout, cdiv
from ..manager import KVCacheManager
from ..spec import CacheSpec
from .machine import failure, log
from .record import stats
from .report import write_named
from .workload import SHAPES


def device_sets(backend_name: str) -> List[List[int]]:
    sets = [[0], [0, 0]]
    if backend_name == "cuda":
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 1:
            sets.append([0, 1])
    else:
        sets.append([0, 1])
    return sets


def make_spec(seq: int, batch: int, tpb: int) -> CacheSpec:
    shape = SHAPES["gpt-oss-120b"]
    base = dict(windows=list(shape.windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                tokens_per_block=tpb, max_seq_len=seq, max_batch=batch, max_step_tokens=2 * seq,
                swa_scratch_reuse=True)
    lay = Layout(CacheSpec(**base, slots_per_group=1))
    step_blocks = cdiv(2 * seq, tpb) + 2 * batch
    slots = [batch * lay.max_blocks + 64 if g.window is None else
             2 * batch * (cdiv(g.window, tpb) + 4) + 2 * lay.scratch_slots_needed(g, step_blocks) + 256
             for g in lay.groups]
    return CacheSpec(**base, slots_per_group=slots)


def run_config(spec: CacheSpec, backend: str, devices: List[int], graphs: bool, lengths: np.ndarray,
               steps: int, warmup: int) -> dict:
    mgr = KVCacheManager(spec, backend=backend, devices=devices, use_graphs=graphs)
    mgr.capture_graphs()
    rids = list(range(len(lengths)))
    for rid, n in zip(rids, lengths.tolist()):
        mgr.add(rid, n)
    pending, cap = list(zip(rids, lengths.tolist())), spec.step_token_capacity
    while pending:                                     # untimed prefill, big chunks
        ctx, tokens = {}, 0
        while pending and tokens + pending[0][1] <= cap:
            rid, n = pending.pop(0)
            ctx[rid], tokens = n, tokens + n
        step = mgr.prepare_batch(ctx)
        step.finish()
        mgr.settle(step)
    mgr.synchronize()
    cuda = mgr.backend.name == "cuda"
    if cuda:
        import cupy
        events = []
        for be in mgr.backends:       # an event belongs to the device current when it is made
            with be.device_context():
                events.append((cupy.cuda.Event(), cupy.cuda.Event()))
    prepare_us, settle_us, device_us = [], [], []
    for i in range(warmup + steps):
        gates = []
        if cuda:
            for be, (start, _) in zip(mgr.backends, events):
                gates.append(be.gate(be.stream, timeout_s=2.0))
                with be.device_context():
                    start.record(be.stream)
        t0 = time.perf_counter()
        step = mgr.prepare_batch((), rids)
        t1 = time.perf_counter()
        if cuda:
            for be, (_, end) in zip(mgr.backends, events):
                with be.device_context():
                    end.record(be.stream)
            for g in gates:
                g.open()
        for view in step.devices:
            view.ready.synchronize()
        step.finish()
        t2 = time.perf_counter()
        mgr.settle(step)
        t3 = time.perf_counter()
        if i >= warmup:
            prepare_us.append((t1 - t0) * 1e6)
            settle_us.append((t3 - t2) * 1e6)
            if cuda and not any(g.close_timeout_hit() for g in gates):
                device_us.append(max(cupy.cuda.get_elapsed_time(s, e) * 1e3 for s, e in events))
    mgr.synchronize()
    return dict(devices=devices, graphs=graphs, prepare_us=stats(prepare_us), settle_us=stats(settle_us),
                device_us=stats(device_us))


def markdown(rows: List[dict], meta: dict) -> str:
    lines = [f"Decode, GPT-OSS-120B layer pattern, batch {meta['batch']}, max_seq_len {meta['seq']}, tpb "
             f"{meta['tpb']}, {meta['steps']} steps, medians ({meta['backend']} backend).", "",
             "| devices | graphs | prepare host us | + vs one device | settle host us | device us (slowest) |",
             "|---|---|---|---|---|---|"]
    one = {r["graphs"]: r for r in rows if r.get("devices") == [0] and "error" not in r}

    def med(r, key):
        return r[key]["median"] if r.get(key) else None

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['devices']} | {r['graphs']} | failed: {r['error']} | | | |")
            continue
        base = one.get(r["graphs"])
        extra = med(r, "prepare_us") - med(base, "prepare_us") if base is not None else None
        dev = med(r, "device_us")
        lines.append(f"| {r['devices']} | {'on' if r['graphs'] else 'off'} | {med(r, 'prepare_us'):.1f} | "
                     f"{'' if extra is None else f'{extra:+.1f}'} | {med(r, 'settle_us'):.1f} | "
                     f"{'' if dev is None else f'{dev:.1f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupykv.bench devices", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out", help="directory for devices.json / devices.md ('' writes nothing)")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--seq", type=int, default=32768, help="max_seq_len (default 32768)")
    ap.add_argument("--batch", type=int, default=256, help="decode batch (default 256)")
    ap.add_argument("--tpb", type=int, default=32, help="tokens_per_block (default 32)")
    ap.add_argument("--steps", type=int, default=200, help="measured steps (default 200)")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    ap.add_argument("--smoke", action="store_true", help="tiny run on the host backend (CI)")
    a = ap.parse_args(argv)
    from ..backends import cuda_available
    backend = "host" if a.smoke else (a.backend if a.backend != "auto" else ("cuda" if cuda_available() else "host"))
    seq, batch, steps, warmup = (1024, 4, 4, 1) if a.smoke else (a.seq, a.batch, a.steps, a.warmup)
    for flag, v, lo in (("--seq", seq, 256), ("--batch", batch, 1), ("--steps", steps, 2), ("--warmup", warmup, 0)):
        if v < lo:
            ap.error(f"{flag} {v}: needs at least {lo}")
    if seq - (steps + warmup + 2) <= seq // 4:
        ap.error(f"--seq {seq}: leaves no room for {steps + warmup} decode steps")
    spec = make_spec(seq, batch, 8 if a.smoke else a.tpb)
    rng = np.random.default_rng(0)
    lengths = rng.integers(seq // 4, seq - steps - warmup - 2, batch)
    rows: List[Dict] = []
    for devices in device_sets(backend):
        for graphs in ((False,) if backend == "host" else (False, True)):
            log(f"devices {devices} graphs {graphs} ...")
            try:
                rows.append(run_config(spec, backend, devices, graphs, lengths, steps, warmup))
            except Exception as exc:  # noqa: BLE001 - reported in the row; the others go on
                rows.append(dict(devices=devices, graphs=graphs, error=failure(exc, 300)))
    meta = dict(backend=backend, seq=seq, batch=batch, tpb=spec.tokens_per_block, steps=steps)
    md = markdown(rows, meta)
    print(md)
    if a.out:
        write_named(dict(meta=meta, rows=rows), a.out, "devices", md)
    return 1 if any("error" in r for r in rows) else 0
