"""`python -m cupykv.bench transfer`: a long request's KV moved between two managers on one device.

One request of --seq tokens (default 131072) of the GPT-OSS-120B shape (36 layers, windows alternating 128
and full, 8 KV heads of 64, 2-byte KV) is prefilled on a sender manager (untimed) and moved to a receiver
manager whose slots are assigned differently, --repeat times per configuration:

    window-only   the real path: only the blocks a later query can see (every block of the full layers,
                  the window of the sliding ones)
    whole         the same model with every layer full attention: what a transfer that ignores windows moves

through each transport available (NIXL with two agents in one process, the loopback copy), beside a plain
device-to-device copy of the same bytes (one cudaMemcpyAsync of a contiguous buffer) in the same run.
Per transfer: bytes, wall time from the receiver's post to its completion (NIXL: polled; loopback: the copy's
event), bandwidth; host time of the sender's send() and sent() and of the receiver's receive() + post and
received() (NIXL: sent is the time from the receiver's completion until the sender has seen NIXL's notice
and freed the request). Medians. Writes transfer.json / transfer.md to --out. Timings are never judged; the exit status
is 1 only when a configuration failed.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional

import numpy as np

from ..manager import KVCacheManager
from ..spec import CacheSpec
from ..storage import KVStorage
from ..transfer import KVTransfers
from .machine import failure, log
from .report import write_named
from .workload import SHAPES, SMOKE_SHAPE


def make_spec(windows, shape, seq: int, tpb: int) -> CacheSpec:
    blocks = -(-seq // tpb)
    # a sliding-window group holds the window and a prefill chunk's blocks
    slots = [blocks + 8 if w is None else -(-w // tpb) + -(-8192 // tpb) + 16 for w in windows]
    # a group per distinct window: slots_per_group by window
    per_window = {w: s for w, s in zip(windows, slots)}
    return CacheSpec(windows=list(windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                     dtype="float16", tokens_per_block=tpb, max_seq_len=seq + 64, max_batch=2,
                     max_step_tokens=8192, slots_per_group=per_window)


def prefilled(spec: CacheSpec, backend: str, seq: int, offset: int):
    """A manager with a request "r" of seq tokens settled (K/V not written: only the bytes' paths are timed);
    offset: a first request of that many tokens, so the two sides' slots differ."""
    mgr = KVCacheManager(spec, backend=backend)
    storage = KVStorage(mgr)
    if offset:
        mgr.add("pad", offset)
        step = mgr.prepare_batch({"pad": offset})
        step.finish()
        mgr.settle(step)
    return mgr, storage


def fill(mgr, rid: str, n: int) -> None:
    mgr.add(rid, n)
    done = 0
    while done < n:
        c = min(8192, n - done)
        step = mgr.prepare_batch({rid: c})
        step.finish()
        mgr.settle(step)
        done += c


def one_transfer(kind: str, sender: KVTransfers, receiver: KVTransfers, agents, seq: int) -> Dict:
    fill(sender.manager, "r", seq)
    t0 = time.perf_counter()
    out = agents[0].send("r") if kind == "nixl" else sender.send("r")
    t_send = time.perf_counter() - t0
    out.wait_ready()
    meta = out.meta.to_dict()
    t0 = time.perf_counter()
    if kind == "nixl":
        read = agents[1].read(meta)
        t_post = time.perf_counter() - t0
        t_start = time.perf_counter()
        while read.poll() == "PROC":
            pass
        wall = time.perf_counter() - t_start
        if read.state != "DONE":
            raise RuntimeError(f"NIXL READ ended {read.state}")
        t0 = time.perf_counter()          # received() ran inside poll(): time it apart from the wait
        nbytes, descriptors = read.nbytes, read.num_descriptors
        t_received = None            # (received() runs inside the poll that sees DONE)
        ended = []
        while not ended:
            ended = agents[0].poll_sent()
        t_sent = time.perf_counter() - t0
    else:
        from ..transports import LoopbackTransport
        inc = receiver.receive(meta)
        cuda = receiver.storage.memory_kind == "VRAM"
        marks = _timing_events(2) if cuda else None     # (the pool's events do not time)
        if cuda:
            marks[0].record(receiver.stream)
        t_start = time.perf_counter()
        read = LoopbackTransport(sender, receiver).read(out, inc)
        t_post = time.perf_counter() - t0
        if cuda:
            marks[1].record(receiver.stream)
        read.wait()
        if cuda:
            marks[1].synchronize()
        wall = cupy_elapsed(marks) if cuda else time.perf_counter() - t_start
        t0 = time.perf_counter()
        receiver.received("r", ready=read.event)
        t_received = time.perf_counter() - t0
        t0 = time.perf_counter()
        sender.sent("r")
        t_sent = time.perf_counter() - t0
        nbytes, descriptors = inc.descriptors.nbytes, None
    receiver.manager.free("r")
    receiver.manager.reclaim(wait=True)
    sender.manager.reclaim(wait=True)
    return dict(bytes=nbytes, seconds=wall, descriptors=descriptors, send_us=t_send * 1e6, post_us=t_post * 1e6,
                received_us=None if t_received is None else t_received * 1e6, sent_us=t_sent * 1e6)


def _timing_events(n: int) -> list:
    import cupy
    return [cupy.cuda.Event() for _ in range(n)]


def cupy_elapsed(marks) -> float:
    """Seconds between two recorded, completed cupy.cuda.Events."""
    import cupy
    return cupy.cuda.get_elapsed_time(marks[0], marks[1]) / 1e3


def plain_copy(nbytes: int, repeat: int) -> List[float]:
    """Seconds of one device-to-device cudaMemcpyAsync of nbytes, repeat times."""
    import cupy
    src, dst = cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
    out = []
    for _ in range(repeat + 1):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        dst.data.copy_from_device_async(src.data, nbytes)
        b.record()
        b.synchronize()
        out.append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
    del src, dst
    return out[1:]


def run_case(label: str, windows, shape, seq: int, tpb: int, backend: str, kinds: List[str], repeat: int) -> List[Dict]:
    spec = make_spec(windows, shape, seq, tpb)
    _, a_store = prefilled(spec, backend, seq, 0)
    _, b_store = prefilled(spec, backend, seq, 4 * tpb)
    sender, receiver = KVTransfers(a_store), KVTransfers(b_store)
    rows = []
    agents = None
    for kind in kinds:
        if kind == "nixl":
            from ..transports.nixl import NixlAgent
            agents = (NixlAgent(sender, f"bench-send-{label}"), NixlAgent(receiver, f"bench-recv-{label}"))
            agents[1].connect(agents[0].metadata())
            agents[0].connect(agents[1].metadata())
        runs = [one_transfer(kind, sender, receiver, agents, seq) for _ in range(repeat + 1)][1:]
        med = {k: None if runs[0][k] is None else float(np.median([r[k] for r in runs]))
               for k in ("seconds", "send_us", "post_us", "received_us", "sent_us")}
        rows.append(dict(case=label, transport=kind, bytes=runs[0]["bytes"], descriptors=runs[0]["descriptors"],
                         **med, gbps=runs[0]["bytes"] / med["seconds"] / 1e9))
        if agents is not None:
            for a in agents:
                a.close()
            agents = None
    if backend == "cuda":
        secs = float(np.median(plain_copy(rows[0]["bytes"], repeat)))
        rows.append(dict(case=label, transport="plain copy", bytes=rows[0]["bytes"], descriptors=1, seconds=secs,
                         gbps=rows[0]["bytes"] / secs / 1e9))
    return rows


def markdown(rows: List[Dict], meta: Dict) -> str:
    lines = [f"### KV transfer, one request of {meta['seq']} tokens ({meta['shape']}, tokens per block "
             f"{meta['tpb']}, {meta['backend']} backend{', ' + meta['device'] if meta.get('device') else ''})", "",
             f"Command: `{meta['command']}`; medians of {meta['repeat']} transfers.", "",
             "| case | transport | MB | descriptors | ms | GB/s | send us | receive+post us | received us | sent us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['transport']} | failed: {r['error']} | | | | | | | |")
            continue

        def us(k):
            return f"{r[k]:.0f}" if r.get(k) is not None else ""
        lines.append(f"| {r['case']} | {r['transport']} | {r['bytes'] / 1e6:.1f} | {r.get('descriptors') or ''} | "
                     f"{r['seconds'] * 1e3:.2f} | {r['gbps']:.1f} | {us('send_us')} | {us('post_us')} | "
                     f"{us('received_us')} | {us('sent_us')} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    import shlex
    import sys
    ap = argparse.ArgumentParser(prog="python -m cupykv.bench transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out", help="directory for transfer.json / transfer.md ('' writes nothing)")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--seq", type=int, default=131072, help="the request's tokens (default 131072)")
    ap.add_argument("--tpb", type=int, default=16, help="tokens_per_block (default 16)")
    ap.add_argument("--repeat", type=int, default=5, help="measured transfers per configuration (default 5)")
    ap.add_argument("--transports", default="auto", help="nixl,loopback (default: those available)")
    ap.add_argument("--smoke", action="store_true", help="tiny run on the host backend (CI)")
    a = ap.parse_args(argv)
    from ..backends import cuda_available
    backend = "host" if a.smoke else (a.backend if a.backend != "auto" else ("cuda" if cuda_available() else "host"))
    shape = SMOKE_SHAPE if a.smoke else SHAPES["gpt-oss-120b"]
    seq, tpb, repeat = (300, 8, 2) if a.smoke else (a.seq, a.tpb, a.repeat)
    if a.transports == "auto":
        from ..transports.nixl import nixl_available
        kinds = (["nixl"] if nixl_available() else []) + ["loopback"]
    else:
        kinds = [k for k in a.transports.split(",") if k]
    rows: List[Dict] = []
    cases = (("window-only", shape.windows), ("whole", tuple(None for _ in shape.windows)))
    for label, windows in cases:
        log(f"{label} ...")
        try:
            rows += run_case(label, windows, shape, seq, tpb, backend, kinds, repeat)
        except Exception as exc:  # noqa: BLE001 - reported in the row; the others go on
            rows.append(dict(case=label, transport=",".join(kinds), error=failure(exc, 300)))
    device = None
    if backend == "cuda":
        import cupy
        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    meta = dict(backend=backend, seq=seq, tpb=tpb, repeat=repeat, shape=shape.name, device=device,
                command=" ".join(["python -m cupykv.bench transfer"] + [shlex.quote(x) for x in
                                                                         (sys.argv[2:] if argv is None else argv)]))
    md = markdown(rows, meta)
    print(md)
    if a.out:
        write_named(dict(meta=meta, rows=rows), a.out, "transfer", md)
    return 1 if any("error" in r for r in rows) else 0
