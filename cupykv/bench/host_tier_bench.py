"""The host-tier benchmark behind `python -m cupykv.bench host-tier`.

GPT-OSS-120B's KV shape (36 layers alternating window 128 / full attention, 8 KV heads, head_dim 64,
bfloat16, tokens_per_block 32: a slot of either group is 18 layers x K/V x 32 x 8 x 64 x 2 B = 1.125 MiB)
and one request of --prompt tokens (default 128k), moved to the host tier and back with
KVStorage(mgr, host_tier_bytes=N).suspend / resume. Everything is measured in one run:

  contiguous        the request prefilled alone, so its device slots are one run per group; suspend (D2H)
                    and resume (H2D), --reps each (after one untimed
                    round trip): device time between CUDA timing events recorded on the tier's stream
                    (storage.host_tier.stream) right before the call and right after it (the call's first
                    copy to its last), host enqueue time of the call, bytes (the tier's byte counters) and
                    runs (of slots adjacent on both sides; on CUDA one copy kernel per group and direction
                    moves all of a group's runs: backends/cuda.py copy_runs).
  fragmented        the same request prefilled in lockstep with another one, --frag-run slots at a time,
                    so its slots of a full-attention group alternate with the other's: one run per slot.
  whole-sequence    a spec with every layer full attention, same size otherwise: what a tier that moves
                    every block (not only the sliding window's) copies. The real request's sliding-window
                    group moves only its sinks and in-window blocks.
  memcpy            one memcpyAsync of the contiguous suspend's total bytes between a pinned host buffer
                    and a device buffer, each direction, timed the same way: the bandwidth to compare with.
  overlap           --bg-requests other requests of --bg-ctx tokens decode while the copy runs: each step is
                    prepare_batch, a stand-in for its attention (a reduction kernel over the other requests'
                    full-attention KV, on the manager stream) between the copies an engine makes every
                    step (a token per request up from pinned host memory before it and back after it:
                    memcpys on the manager stream), finish, a host wait for the step, settle. The
                    copy alone, the steps alone (as many as take about as long as the copy) and both
                    together (wall time from the suspend/resume call until the copy and the steps are done);
                    overlap = (alone + alone - together) / the shorter one (1.0: perfect).

Targets (reported, never asserted): host enqueue of suspend() and resume() < 1 ms; tier copy bandwidth
>= 80% of the memcpy's in the same direction.

On the host backend a tiny shape runs instead (the simulated streams have no timing events: device
times and bandwidths are None), so that a smoke test exercises every row.
"""
from __future__ import annotations

import datetime
import gc
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..allocator import slot_runs
from ..layout import cdiv
from ..manager import KVCacheManager
from ..spec import CacheSpec
from ..storage import KVStorage, StorageDtypeError
from .machine import failure, free_device_memory, log, versions
from .prefix_trace import _prefill, _slot_counts
from .record import stats
from .workload import SHAPES, Shape

SMOKE_SHAPE = Shape("gpt-oss-tiny", (16, None) * 2, 1, 8)
MAX_OVERLAP_STEPS = 200          # decode steps per timed loop of the overlap measurement (at most)


@dataclass
class HostTierSettings:
    prompt: int = 131072
    reps: int = 5
    frag_run: int = 1               # slots per run in the fragmented case; 0 skips it
    bg_requests: int = 32           # requests decoding during the overlap measurement; 0 skips it
    bg_ctx: int = 4096
    overlap_reps: int = 3
    whole: bool = True              # the whole-sequence (all full attention) case
    tpb: int = 32
    chunk: int = 8192               # prefill chunk (untimed set-up)
    backend: str = "auto"
    smoke: bool = False
    out: Optional[str] = "bench_host_tier"
    command: str = ""


def smoke_settings(**kw) -> HostTierSettings:
    base = dict(prompt=512, reps=2, frag_run=1, bg_requests=2, bg_ctx=64, overlap_reps=1, tpb=8, chunk=128,
                backend="host", smoke=True)
    base.update(kw)
    return HostTierSettings(**base)


class _Clock:
    """Timing events on a stream (CUDA) or nothing (host backend: device times are None)."""

    def __init__(self, backend):
        self.cuda = backend.name == "cuda"
        if self.cuda:
            import cupy
            self.cupy = cupy

    def mark(self, stream):
        if not self.cuda:
            return None
        e = self.cupy.cuda.Event()
        e.record(stream)
        return e

    def ms(self, e0, e1) -> Optional[float]:
        if not self.cuda:
            return None
        e1.synchronize()
        return float(self.cupy.cuda.get_elapsed_time(e0, e1))

    def wait(self, e) -> None:
        if self.cuda:
            while not e.done:        # poll: the completion, not a sleeping wait's wake-up
                pass
            e.synchronize()


def _copies(dev_slots: List[np.ndarray], host_slots: List[np.ndarray]) -> int:
    """The runs a move makes: where device and host slots both step by one (allocator.slot_runs)."""
    return sum(len(slot_runs(d, h)) for d, h in zip(dev_slots, host_slots))


class _Rig:
    """A manager with KV storage and a host tier sized for `host_need[p]` slots of each group."""

    def __init__(self, windows, shape: Shape, s: HostTierSettings, max_seq: int, max_batch: int,
                 full_slots: int, swa_slots: int, host_full: int, host_swa: int, messages: List[str]):
        kw = dict(windows=list(windows), num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  tokens_per_block=s.tpb, max_seq_len=max_seq, max_batch=max_batch,
                  max_step_tokens=s.chunk + max_batch)
        slots = _slot_counts(kw, full=full_slots, swa=swa_slots)
        self.mgr = KVCacheManager(CacheSpec(**kw, slots_per_group=slots), backend=s.backend)
        lay = self.mgr.layout
        self.dtype = "bfloat16"
        self._storage_dtype(messages)
        slot_bytes = [lay.slot_bytes(g) for g in lay.groups]     # bfloat16 and float16: 2 bytes either way
        dev = [n * b for n, b in zip(slots, slot_bytes)]
        need = [host_full if g.window is None else host_swa for g in lay.groups]
        nbytes = max(cdiv((k + 1) * b * sum(dev), d) for k, b, d in zip(need, slot_bytes, dev))
        self.storage = KVStorage(self.mgr, dtype=self.dtype, host_tier_bytes=nbytes)
        self.tier = self.storage.host_tier
        self.layout = lay
        self.slot_bytes = slot_bytes

    def _storage_dtype(self, messages: List[str]) -> None:
        from ..storage import resolve_dtype
        try:
            resolve_dtype("bfloat16", self.mgr.backend.xp)
        except StorageDtypeError as exc:
            self.dtype = "float16"
            msg = f"bfloat16 storage unavailable ({exc}); float16 storage instead (the same bytes per slot)"
            if msg not in messages:
                messages.append(msg)

    def close(self) -> None:
        try:
            self.mgr.synchronize()
        except Exception:   # noqa: BLE001
            pass


def _round_trips(rig: _Rig, rid, reps: int, clock: _Clock) -> Dict[str, Dict[str, list]]:
    """suspend + resume of `rid`, reps + 1 times (the first untimed); samples per direction."""
    mgr, st, tier = rig.mgr, rig.storage, rig.tier
    out = {d: dict(host_us=[], device_ms=[], bytes=[], copies=[]) for d in ("suspend", "resume")}
    for r in range(reps + 1):
        gc.collect()             # untimed: no collection of the set-up's garbage inside a timed call
        mgr.synchronize()
        dev = [s for _, s in mgr.resident_blocks(rid)]
        b0 = tier.bytes_to_host
        e0 = clock.mark(tier.stream)
        t0 = time.perf_counter()
        st.suspend(rid)
        t1 = time.perf_counter()
        e1 = clock.mark(tier.stream)
        held = tier.held.get(rid)
        host = list(held.host_slots) if held is not None else None
        mgr.synchronize()
        d_ms = clock.ms(e0, e1)
        if r:
            s = out["suspend"]
            s["host_us"].append((t1 - t0) * 1e6)
            s["device_ms"].append(d_ms)
            s["bytes"].append(tier.bytes_to_host - b0)
            s["copies"].append(_copies(dev, host) if host is not None else None)
        b0 = tier.bytes_to_device
        e0 = clock.mark(tier.stream)
        t0 = time.perf_counter()
        st.resume(rid)
        t1 = time.perf_counter()
        e1 = clock.mark(tier.stream)
        mgr.synchronize()
        d_ms = clock.ms(e0, e1)
        if r:
            s = out["resume"]
            s["host_us"].append((t1 - t0) * 1e6)
            s["device_ms"].append(d_ms)
            s["bytes"].append(tier.bytes_to_device - b0)
            s["copies"].append(_copies([sl for _, sl in mgr.resident_blocks(rid)], host) if host is not None else None)
    return out


def _copy_rows(case: str, detail: str, samples: Dict[str, Dict[str, list]]) -> List[dict]:
    rows = []
    for direction, s in samples.items():
        dev = stats(s["device_ms"])
        nbytes = int(np.median(s["bytes"])) if s["bytes"] else None
        copies = [c for c in s["copies"] if c is not None]
        rows.append(dict(case=case, detail=detail, direction=direction,
                         kind="D2H" if direction in ("suspend", "D2H") else "H2D", n=len(s["host_us"]),
                         bytes=nbytes, copies=int(np.median(copies)) if copies else None,
                         host_us=stats(s["host_us"]), device_ms=dev,
                         gbps=(nbytes / (dev["median"] * 1e-3) / 1e9) if (dev and nbytes) else None,
                         vs_memcpy=None, error=None))
    return rows


def _memcpy(backend, nbytes: int, reps: int, clock: _Clock) -> Dict[str, Dict[str, list]]:
    """One pinned <-> device copy of nbytes each way, reps + 1 times (the first untimed)."""
    host = backend.pinned_bytes(nbytes)
    if backend.name == "cuda":
        import cupy
        stream = backend.new_stream("memcpy")
        with stream:
            dev = cupy.empty(nbytes, np.uint8)
        stream.synchronize()
    else:
        stream = backend.new_stream("memcpy")
        dev = np.zeros(nbytes, np.uint8)
    out = {d: dict(host_us=[], device_ms=[], bytes=[], copies=[]) for d in ("D2H", "H2D")}
    for r in range(reps + 1):
        for direction, (dst, src) in (("D2H", (host, dev)), ("H2D", (dev, host))):
            e0 = clock.mark(stream)
            t0 = time.perf_counter()
            backend.copy_bytes(dst, src, stream)
            t1 = time.perf_counter()
            e1 = clock.mark(stream)
            stream.synchronize()
            if r:
                s = out[direction]
                s["host_us"].append((t1 - t0) * 1e6)
                s["device_ms"].append(clock.ms(e0, e1))
                s["bytes"].append(nbytes)
                s["copies"].append(1)
    return out


class _Decoder:
    """The other requests' decode steps for the overlap measurement (see the module docstring)."""

    def __init__(self, rig: _Rig, rids: List[str]):
        self.rig, self.rids = rig, rids
        mgr = rig.mgr
        be = mgr.backend
        full = [g.index for g in rig.layout.groups if g.window is None][0]
        slots = np.concatenate([s for rid in rids for p, (_, s) in enumerate(mgr.resident_blocks(rid)) if p == full])
        lo, hi = int(slots.min()), int(slots.max()) + 1
        arr = rig.storage.arrays[full][lo:hi]
        self.kv = arr.reshape(-1).view(be.xp.int32)
        self.bytes = int(self.kv.nbytes)
        self.be = be
        self.tokens = be.device_full((len(rids),), 0, np.int32)       # the input and sampled tokens' stand-in
        self.tokens_host = be.pinned_bytes(self.tokens.nbytes).view(np.int32)
        if be.name == "cuda":
            with be.stream:
                self.kv.sum()                      # compile and load the reduction before timing
            be.stream.synchronize()

    def _attention(self) -> None:
        be = self.be
        if be.name == "cuda":
            with be.stream:
                self.kv.sum()
        else:
            kv = self.kv
            be.stream.enqueue(lambda: kv.sum())

    def steps(self, n: int) -> float:
        """n decode steps, each waited for; returns the wall time in ms."""
        mgr = self.rig.mgr
        t0 = time.perf_counter()
        for _ in range(n):
            step = mgr.prepare_batch(generation=self.rids)
            self.be.copy_bytes(self.tokens, self.tokens_host, self.be.stream)
            self._attention()
            self.be.copy_bytes(self.tokens_host, self.tokens, self.be.stream)
            step.finish()
            step.finished.synchronize()
            mgr.settle(step)
        return (time.perf_counter() - t0) * 1e3


def _overlap(rig: _Rig, rid, dec: _Decoder, copy_ms: Optional[float], reps: int, clock: _Clock) -> List[dict]:
    mgr, st, tier = rig.mgr, rig.storage, rig.tier
    step_ms = dec.steps(5) / 5
    n = 5 if not copy_ms else int(min(MAX_OVERLAP_STEPS, max(5, round(copy_ms / max(step_ms, 1e-3)))))
    res = {d: dict(copy_alone=[], copy_dev_alone=[], loop_alone=[], both=[], copy_dev_during=[], loop_during=[])
           for d in ("suspend", "resume")}
    call = {"suspend": st.suspend, "resume": st.resume}

    def copy_alone(direction: str) -> Tuple[float, Optional[float]]:
        mgr.synchronize()
        e0 = clock.mark(tier.stream)
        t0 = time.perf_counter()
        call[direction](rid)
        e1 = clock.mark(tier.stream)
        clock.wait(e1)
        tier.stream.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        return wall, clock.ms(e0, e1)

    def both(direction: str) -> Tuple[float, Optional[float], float]:
        mgr.synchronize()
        e0 = clock.mark(tier.stream)
        t0 = time.perf_counter()
        call[direction](rid)
        e1 = clock.mark(tier.stream)
        loop = dec.steps(n)
        clock.wait(e1)
        tier.stream.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        return wall, clock.ms(e0, e1), loop

    def ensure(direction: str) -> None:
        """A is resident before a suspend, suspended before a resume (untimed)."""
        suspended = mgr.request(rid).suspended
        if direction == "suspend" and suspended:
            st.resume(rid)
        elif direction == "resume" and not suspended:
            st.suspend(rid)
        mgr.synchronize()

    for _ in range(reps):
        for direction in ("suspend", "resume"):
            r = res[direction]
            ensure(direction)
            r["loop_alone"].append(dec.steps(n))
            wall, dev = copy_alone(direction)
            r["copy_alone"].append(wall)
            r["copy_dev_alone"].append(dev)
            ensure(direction)
            wall, dev, loop = both(direction)
            r["both"].append(wall)
            r["copy_dev_during"].append(dev)
            r["loop_during"].append(loop)
    ensure("suspend")                       # resident again
    rows = []
    for direction, r in res.items():
        med = {k: (float(np.median([x for x in v if x is not None])) if any(x is not None for x in v) else None)
               for k, v in r.items()}
        total = med["copy_alone"] + med["loop_alone"]
        shorter = min(med["copy_alone"], med["loop_alone"])
        rows.append(dict(direction=direction, steps=n, batch=len(dec.rids), attention_bytes=dec.bytes,
                         copy_alone_ms=med["copy_alone"], copy_device_alone_ms=med["copy_dev_alone"],
                         steps_alone_ms=med["loop_alone"], sum_ms=total, both_ms=med["both"],
                         overlap=(total - med["both"]) / shorter if shorter else None,
                         copy_device_during_ms=med["copy_dev_during"], steps_during_ms=med["loop_during"],
                         reps=reps, error=None))
    return rows


def evaluate_host_tier_targets(result: dict) -> List[dict]:
    out = []
    copies = [r for r in result.get("copies", []) if not r.get("error")]
    memcpy = {r["kind"]: r for r in copies if r["case"] == "memcpy"}
    for r in copies:
        if r["case"] not in ("contiguous", "fragmented"):
            continue
        cfg = f"{r['case']} {r['direction']} ({r['copies']} runs)"
        if r["host_us"]:
            v = r["host_us"]["median"]
            out.append(dict(target="host enqueue of suspend()/resume() < 1 ms", config=cfg, value=v, limit=1000.0,
                            text=f"{v:.0f} us", ok=v < 1000.0))
        m = memcpy.get(r["kind"])
        if r["gbps"] and m and m.get("gbps"):
            ratio = r["gbps"] / m["gbps"]
            out.append(dict(target=f"tier copy bandwidth >= 80% of one pinned memcpy ({r['kind']})", config=cfg,
                            value=ratio, limit=0.8, text=f"{r['gbps']:.1f} / {m['gbps']:.1f} GB/s = {ratio:.0%}",
                            ok=ratio >= 0.8))
    return out


def run_host_tier(s: HostTierSettings) -> dict:
    from ..backends import cuda_available, make_backend
    started = time.perf_counter()
    backend_name = s.backend if s.backend != "auto" else ("cuda" if cuda_available() else "host")
    s.backend = backend_name
    backend = make_backend(backend_name)
    clock = _Clock(backend)
    shape = SMOKE_SHAPE if s.smoke or backend_name != "cuda" else SHAPES["gpt-oss-120b"]
    messages: List[str] = []
    if backend_name != "cuda":
        messages.append("host backend: a tiny shape; simulated streams have no timing events, so device times and "
                        "bandwidths are None and host times are of the NumPy emulation")
    failures: List[str] = []
    copies: List[dict] = []
    overlap: List[dict] = []
    tpb = s.tpb
    blocks = cdiv(s.prompt, tpb)
    window = max(w for w in shape.windows if w is not None)
    swa_keep = cdiv(window, tpb) + 2
    # the other requests grow by the overlap measurement's decode steps (5 to calibrate, 4 loops per rep)
    bg_len = s.bg_ctx + 5 + 4 * s.overlap_reps * MAX_OVERLAP_STEPS + tpb
    bg_blocks = s.bg_requests * cdiv(bg_len, tpb)
    max_seq = cdiv(max(s.prompt, bg_len) + 2 * tpb, tpb) * tpb
    max_batch = s.bg_requests + 4
    full_slots = max(blocks + bg_blocks, 2 * blocks if s.frag_run else 0) + 256
    swa_slots = swa_keep * (max_batch + 2) + 2 * cdiv(s.chunk + max_batch, tpb) + 256
    detail = {}
    rig = None
    try:
        log(f"host tier: {shape.name}, {s.prompt}-token request, {full_slots} full-attention slots ...")
        rig = _Rig(shape.windows, shape, s, max_seq, max_batch, full_slots, swa_slots, blocks + 8, swa_keep + 8,
                   messages)
        lay = rig.layout
        detail = dict(shape=shape.name, layers=lay.num_layers, groups=[dict(window=g.window, layers=g.num_layers,
                      slot_bytes=b) for g, b in zip(lay.groups, rig.slot_bytes)], dtype=rig.dtype, tpb=tpb,
                      prompt=s.prompt, host_tier_bytes=int(sum(p.nbytes for p in rig.tier.pools)),
                      whole_sequence_bytes_counted=blocks * sum(rig.slot_bytes))
        mgr = rig.mgr
        mgr.add("A", s.prompt)
        _prefill(mgr, {"A": s.prompt}, s.chunk)
        log("host tier: contiguous round trips ...")
        contiguous = _round_trips(rig, "A", s.reps, clock)
        copies += _copy_rows("contiguous", "one run of slots per group", contiguous)
        total = int(np.median(contiguous["suspend"]["bytes"]))
        detail["window_only_bytes"] = total
        log(f"host tier: memcpy baseline of {total} bytes ...")
        copies += _copy_rows("memcpy", "one pinned <-> device memcpyAsync of the contiguous suspend's bytes",
                             _memcpy(rig.mgr.backend, total, s.reps, clock))
        if s.bg_requests:
            log(f"host tier: overlap with {s.bg_requests} requests decoding ...")
            try:
                bg = [f"bg{i}" for i in range(s.bg_requests)]
                for rid in bg:
                    mgr.add(rid, s.bg_ctx)
                _prefill(mgr, {rid: s.bg_ctx for rid in bg}, s.chunk)
                dec = _Decoder(rig, bg)
                copy_ms = stats(contiguous["suspend"]["device_ms"])
                overlap = _overlap(rig, "A", dec, copy_ms["median"] if copy_ms else None, s.overlap_reps, clock)
                for rid in bg:
                    mgr.free(rid)
            except Exception as exc:   # noqa: BLE001
                why = failure(exc)
                failures.append(f"overlap: {why}")
                overlap = [dict(direction=d, error=why) for d in ("suspend", "resume")]
        mgr.free("A")
        mgr.synchronize()
        if s.frag_run:
            log(f"host tier: fragmented (runs of {s.frag_run} slots) ...")
            try:
                mgr.add("B", s.prompt)
                mgr.add("C", s.prompt)
                left = s.prompt
                run_tokens = s.frag_run * tpb
                while left:
                    c = min(run_tokens, left)
                    step = mgr.prepare_batch(contexts={"B": c, "C": c})
                    step.ready.synchronize()
                    step.finish()
                    mgr.settle(step)
                    left -= c
                mgr.synchronize()
                copies += _copy_rows("fragmented", f"slots in runs of {s.frag_run} (prefilled in lockstep with "
                                     "another request)", _round_trips(rig, "B", s.reps, clock))
                mgr.free("B")
                mgr.free("C")
            except Exception as exc:   # noqa: BLE001
                why = failure(exc)
                failures.append(f"fragmented: {why}")
                copies += [dict(case="fragmented", direction=d, error=why) for d in ("suspend", "resume")]
    except Exception as exc:   # noqa: BLE001
        why = failure(exc)
        failures.append(f"host tier: {why}")
        have = {(r["case"], r.get("direction")) for r in copies}
        for case in ("contiguous", "memcpy", "fragmented"):
            for d in (("D2H", "H2D") if case == "memcpy" else ("suspend", "resume")):
                if (case, d) not in have:
                    copies.append(dict(case=case, direction=d, error=why))
    finally:
        if rig is not None:
            rig.close()
        rig = None
        free_device_memory()
    if s.whole:
        log("host tier: whole-sequence spec (every layer full attention) ...")
        try:
            wrig = _Rig((None,) * len(shape.windows), shape, s, max_seq, 4, blocks + 64, 0, blocks + 8, 0, messages)
            wrig.mgr.add("W", s.prompt)
            _prefill(wrig.mgr, {"W": s.prompt}, s.chunk)
            copies += _copy_rows("whole-sequence", "all layers full attention, same size: every block moves",
                                 _round_trips(wrig, "W", s.reps, clock))
            detail["whole_sequence_bytes"] = copies[-1]["bytes"]
            wrig.close()
            del wrig
        except Exception as exc:   # noqa: BLE001
            why = failure(exc)
            failures.append(f"whole-sequence: {why}")
            copies += [dict(case="whole-sequence", direction=d, error=why) for d in ("suspend", "resume")]
        free_device_memory()
    memcpy = {r["kind"]: r for r in copies if r["case"] == "memcpy" and not r.get("error")}
    for r in copies:
        m = memcpy.get(r.get("kind"))
        if not r.get("error") and r["case"] != "memcpy" and r["gbps"] and m and m.get("gbps"):
            r["vs_memcpy"] = r["gbps"] / m["gbps"]
    result = dict(copies=copies, overlap=overlap, failures=failures, detail=detail)
    result["targets"] = evaluate_host_tier_targets(result)
    result["meta"] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), command=s.command,
        backend=backend_name, versions=versions(backend_name), messages=messages,
        settings=dict(prompt=s.prompt, reps=s.reps, frag_run=s.frag_run, bg_requests=s.bg_requests, bg_ctx=s.bg_ctx,
                      overlap_reps=s.overlap_reps, whole=s.whole, tpb=s.tpb, chunk=s.chunk, smoke=s.smoke),
        elapsed_s=round(time.perf_counter() - started, 1))
    return result
