"""The benchmark run behind `python -m cupykv.bench`: the run loop over the matrix of configurations.

One Workload per (shape, max_seq_len, batch) (workload.py) drives a PER_LAYER manager and, unless
--no-shared, a SHARED one with the same requests; every measured step is timed for each implementation
on the same inputs, in the same run:

  cupykv                 KVCacheManager.prepare_batch, PER_LAYER tables, scratch reuse on (snapshot of
  cupykv-graphs          the deltas, one copy, the kernels); -graphs: a twin manager with use_graphs=True
                         (GPU only), fed the same steps.
  torch-eager            the reference system's path after its race fix, on the PER_LAYER manager's
  torch-compiled         inputs (contenders.py, snapshot_path.py).
  floor                  host: memcpyAsync of 4 KiB + one launch; device: memset of L x num_seqs x 2 x B
                         int32 (timing.py).
  cupykv-shared          the same on a SHARED-table manager (no scratch reuse: SHARED tables cannot
  cupykv-shared-graphs   express it).
  per-group-peer         persistent per-group device tables from a per-step write list, on the SHARED
                         manager's inputs (contenders.py, peer_path.py).
  floor-shared           the floor of the SHARED live region (P x num_seqs x 2 x B int32).

Per step and implementation: host enqueue time (the call, no sync), device time between two timing
events around the step's work with the stream held by the backend's gate while the host enqueues, wall
time from the call to the completion of its ready event (polled), H2D bytes. Every output is checked
against cupykv.reference on sampled steps (checks.py), and each contender against cupykv every step.

Cases: "decode" (decode steps right after max(1, batch/128) requests finished and as many arrived: 2 at
batch 256), "steady" (decode steps whose batch is the same as the previous step's; decode-only runs
alternate the two), "ctx" (decode plus `contexts` prefill chunks of `chunk` tokens each; a prefill that
completes joins the decode batch, a random decode request finishes, a new request arrives). Arrivals of
decode-only runs are prefilled in an untimed step; their frees are timed (the schedule part of the host
total). One workload serves every context variant of a (shape, seq, batch), with max_batch = batch +
max(contexts) + churn rows; the torch contenders' staging capacity is that max_batch.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..manager import KVCacheManager
from .checks import StepCheck, check_step
from .contenders import TorchContender, make_contenders, torch_status
from .machine import failure, free_device_memory, log, versions
from .record import ROW_KEYS, STAT_KEYS, Recorder, error_row, evaluate_targets, floor_row, is_floor, live_bytes
from .timing import Timer, make_timer
from .workload import (CASES_CTX, CASES_DECODE_ONLY, SHAPES, SMOKE_SHAPE, Plan, Settings, Shape, Workload,
                       cases_for, config_rows)

# The names scripts and tests import from here.
__all__ = ["CASES_CTX", "CASES_DECODE_ONLY", "ROW_KEYS", "SHAPES", "SMOKE_SHAPE", "STAT_KEYS", "Settings", "Shape",
           "Workload", "config_rows", "evaluate_targets", "run", "run_shape"]

Floor = Tuple[list, list, list]         # host, device, wall samples


LABELS = {"per_layer": "cupykv", "shared": "cupykv-shared"}
FLOOR_NAMES = {"per_layer": "floor", "shared": "floor-shared"}


class Variant:
    """One manager of a configuration and what runs on its steps: its own row (`name`) and the
    contenders fed its inputs (on the manager without step graphs)."""

    def __init__(self, mgr: KVCacheManager, table_mode: str, graphs: bool):
        self.mgr = mgr
        self.table_mode = table_mode
        self.graphs = graphs
        self.name = LABELS[table_mode] + ("-graphs" if graphs else "")
        self.planes = int(mgr.out.shape[0])
        self.contenders: List[TorchContender] = []
        self.failed: List[str] = []          # contenders that could not start (their rows carry the error)
        self.full_check_done = False

    def close(self) -> None:
        for c in self.contenders:
            c.close()
        self.contenders = []


def _variants(wl: Workload, settings: Settings, timer: Timer, use_torch: bool, rec: Recorder, cases: List[str],
              prefix: str, messages: List[str]) -> List[Variant]:
    out = []
    # Any batch of the decode batch's size warms a contender up (its shapes; the peer's tables follow).
    rows = np.arange(len(wl.decode), dtype=np.int32)
    for mgr, (table_mode, graphs) in zip(wl.managers, wl.kinds):
        v = Variant(mgr, table_mode, graphs)
        if use_torch and not graphs:
            v.contenders, failed, notes = make_contenders(mgr, timer, settings.compile, wl.scratch_width, rows)
            messages.extend(f"{prefix}: {note}" for note in notes)
            for name, why in failed.items():
                rec.fail(cases, name, why)
                v.failed.append(name)
                messages.append(f"{prefix}: {name} unavailable: {why}"[:300])
        out.append(v)
    return out


def _step(v: Variant, wl: Workload, plan: Plan, plan_s: float, j: Optional[int], settings: Settings, timer: Timer,
          rec: Recorder, check_rng: np.random.Generator) -> None:
    """One step of `plan` on one manager and its contenders; recorded when j (measured index) is set."""
    mgr, case, name = v.mgr, plan.case, v.name
    ts0 = time.perf_counter()
    wl.apply(mgr, plan)                      # the frees and adds: the manager's part of scheduling
    ts1 = time.perf_counter()
    step, sample = timer.measure(mgr.backend.stream,
                                 lambda: mgr.prepare_batch(contexts=plan.contexts, generation=plan.generation),
                                 ready=lambda st: st.ready)
    h2d = mgr.h2d_bytes_last_step
    n = len(step.rows)
    check = None
    if j is not None and check_step(j, settings.smoke):
        check = StepCheck(mgr, step, check_rng, full=not v.full_check_done)   # copies the rows at prepare
        v.full_check_done = v.full_check_done or check.whole
    # contenders on the same inputs
    results = []
    for c in v.contenders:
        try:
            out, s, c_h2d = c.run(mgr, step)
            results.append((c, out, s, c_h2d, c.equals_cupykv(out, n)))
        except Exception as exc:   # noqa: BLE001 - recorded in the row; the other implementations go on
            rec.errors[(case, c.name)] = f"{type(exc).__name__}: {exc}"[:300]
    if check is not None:
        rec.check(case, name, check.cupykv_ok())
        for c, out, _, _, _ in results:
            rec.check(case, c.name, np.array_equal(c.rows(out, check.sel), check.expected))
    ts2 = time.perf_counter()
    step.finish()
    mgr.settle(step)
    ts3 = time.perf_counter()
    if j is None:
        return
    rec.add(case, name, host_us=sample.host_us, device_us=sample.device_us, wall_us=sample.wall_us, h2d_bytes=h2d,
            host_total_us=(plan_s + (ts1 - ts0) + (ts3 - ts2)) * 1e6 + sample.host_us, gate_ok=sample.gate_ok)
    for c, out, s, c_h2d, eq in results:
        rec.add(case, c.name, host_us=s.host_us, device_us=s.device_us, wall_us=s.wall_us, h2d_bytes=c_h2d,
                gate_ok=s.gate_ok)
        rec.check(case, c.name, eq)


def run_shape(settings: Settings, shape: Shape, seq: int, batch: int, rng: np.random.Generator,
              check_rng: np.random.Generator, timer: Timer, use_torch: bool, messages: List[str]) -> List[dict]:
    """All context variants of one (shape, seq, batch) on one workload; returns the result rows."""
    ctx_list = list(settings.contexts)
    cases = [case for nctx in ctx_list for case in cases_for(nctx)]
    wl = Workload(shape, seq, batch, max(ctx_list), settings, rng, shared=settings.shared,
                  graphs=timer.cuda if settings.graphs is None else settings.graphs)
    lay = wl.lay
    B, L = lay.max_blocks, lay.num_layers
    t_setup = time.perf_counter()
    wl.setup_decode()
    setup_s = time.perf_counter() - t_setup
    rec = Recorder()
    variants = _variants(wl, settings, timer, use_torch, rec, cases, f"{shape.name} {seq} {batch}", messages)
    floors: Dict[Tuple[int, str], Floor] = {}
    for nctx in ctx_list:
        if nctx:
            wl.setup_contexts(nctx)
        for v in variants:
            if not v.graphs:
                floors[(nctx, v.table_mode)] = timer.floor(live_bytes(v.planes, batch + nctx, B),
                                                           min(settings.steps, 50))
            v.full_check_done = False
        for i in range(settings.warmup + settings.steps):
            j = i - settings.warmup if i >= settings.warmup else None
            # schedule: the untimed prefill of decode-only arrivals first, then the decisions (timed)
            pos = wl.pre_churn_decode_only(i) if not nctx else None
            tp0 = time.perf_counter()
            plan = wl.plan_ctx() if nctx else wl.plan_decode_only(pos)
            plan_s = time.perf_counter() - tp0
            for v in variants:
                _step(v, wl, plan, plan_s, j, settings, timer, rec, check_rng)
    wl.close()
    rows = []
    for nctx in ctx_list:
        for case in cases_for(nctx):
            for mode in dict.fromkeys(v.table_mode for v in variants):     # PER_LAYER first
                group = [v for v in variants if v.table_mode == mode]
                base = dict(shape=shape.name, max_seq_len=seq, batch=batch, contexts=nctx, case=case,
                            table_mode=mode, num_layers=L, num_groups=lay.num_groups, max_blocks=B,
                            max_batch=group[0].mgr.spec.max_batch, num_seqs=batch + nctx,
                            live_bytes=live_bytes(group[0].planes, batch + nctx, B),
                            churn_per_step=wl.churn_k if not nctx else None)
                floor = floors[(nctx, mode)]
                # cupykv's rows (with step graphs and without), the contenders', then the floor
                rows.extend(rec.row(base, v.name, floor, with_total=True) for v in group)
                rows.extend(rec.row(base, name, floor, with_total=False)
                            for v in group for name in [c.name for c in v.contenders] + v.failed)
                rows.append(floor_row(base, FLOOR_NAMES[mode], floor, timer.cuda))
    for v in variants:
        v.close()
    log(f"  setup {setup_s:.1f} s")
    return rows


def run(settings: Settings) -> dict:
    """Run the whole matrix; returns the result dict (report.write_outputs writes it)."""
    from ..backends import make_backend
    started = time.perf_counter()
    backend = make_backend(settings.backend)        # the timer's gate runs on it
    backend_name = settings.backend = backend.name
    messages: List[str] = []
    # Inductor's pool of compile worker processes competes for the CPUs with the host side being timed
    # (torch's multi-threaded CPU copies slowed by ~6 ms per step while the pool started): compile in
    # process instead. Set before torch is imported; an explicit setting wins.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    use_torch, torch_msg = torch_status(settings.torch, backend_name)
    messages.append(torch_msg if use_torch else f"NOTE: {torch_msg}; running cupykv and the floors only")
    if not settings.shared:
        messages.append("SHARED-table rows disabled (--no-shared)")
    if backend_name != "cuda":
        messages.append("host backend: device times and floors are not measurable (reported as None); "
                        "host and wall times are of the NumPy emulation")
    timer = make_timer(backend)
    rng = np.random.default_rng(settings.seed)
    # The checks sample rows from their own generator: the workload is the same whatever is checked.
    check_rng = np.random.default_rng([settings.seed, 1])
    shapes = [SMOKE_SHAPE] if settings.smoke else [SHAPES[s] for s in settings.shapes]
    rows: List[dict] = []
    failures: List[str] = []
    try:
        for shape in shapes:
            for seq in settings.seqs:
                for batch in settings.batches:
                    t0 = time.perf_counter()
                    log(f"{shape.name} max_seq_len={seq} batch={batch} contexts={list(settings.contexts)} ...")
                    try:
                        rows += run_shape(settings, shape, seq, batch, rng, check_rng, timer, use_torch, messages)
                    except Exception as exc:   # noqa: BLE001 - report it, run the other shapes
                        why = failure(exc)
                        failures.append(f"{shape.name} {seq} {batch}: {why}")
                        messages.append(f"ERROR {shape.name} max_seq_len={seq} batch={batch}: {why}")
                        for nctx in settings.contexts:
                            for case in cases_for(nctx):
                                rows.append(error_row(shape.name, seq, batch, nctx, case, why))
                    log(f"  done in {time.perf_counter() - t0:.1f} s (total {time.perf_counter() - started:.0f} s)")
                    free_device_memory()
    finally:
        if timer.timeouts:
            off = "" if timer.enabled else (" and gating was switched off after that, so later device "
                                            "times include host launch gaps")
            messages.append(f"WARNING: {timer.timeouts} gated sample(s) timed out (an enqueue waited on its own "
                            f"stream); they were dropped{off}")
        timer.close()
    targets = evaluate_targets(rows)
    mine = [r for r in rows if not is_floor(r) and not r.get("error")]
    checked = all(r["checked"] is not False for r in mine) and any(r["checked"] for r in mine)
    table_modes = ["per_layer"] + (["shared"] if settings.shared else [])
    return dict(
        meta=dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  command=settings.command, backend=backend_name, versions=versions(backend_name),
                  settings=dict(shapes=[s.name for s in shapes], seqs=list(settings.seqs),
                                batches=list(settings.batches), contexts=list(settings.contexts),
                                steps=settings.steps, warmup=settings.warmup, chunk=settings.chunk,
                                tokens_per_block=settings.tpb, seed=settings.seed, torch=use_torch,
                                compile=settings.compile and use_torch, table_mode="per_layer",
                                table_modes=table_modes),
                  torch=torch_msg, messages=messages, elapsed_s=round(time.perf_counter() - started, 1)),
        rows=rows, targets=targets, checked=checked, failures=failures)
