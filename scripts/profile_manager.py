"""The manager's own host cost per decode step: the host backend with its queued work replaced by no-ops.

    python scripts/profile_manager.py [--batch N] [--lines] [--census] [--parts]     (batch 256 by default)

--lines: line_profiler over the step's main functions (needs line_profiler). --parts: perf_counter timers
around the step's parts (time_parts; scripts/host_calls.py --parts times the same on CUDA). --census: what
one step (prepare_batch, finish, settle) executes: Python function calls, calls of C functions (builtins and
numpy's methods; numpy's operators and indexing are not calls and are not counted), and bytecodes.
"""
import collections
import sys
import time

import numpy as np

import cupykv


class _DoneEvent:
    def done(self):
        return True

    def wait(self, timeout=None):
        return True

    def synchronize(self):
        pass


def prefilled_manager(batch: int = 256, backend: str = "host", kv=cupykv, prefix_caching: bool = False
                      ) -> cupykv.KVCacheManager:
    """A GPT-OSS-120B-shaped manager (32k) with `batch` requests prefilled to 8k-30k tokens (the window
    group has room for one whole prompt: its prefill holds every block until it settles). kv: the cupykv
    package to make it with (scripts/ab_in_process.py loads two); prefix_caching: on, the prompts added
    with random tokens (their blocks cached, no two alike)."""
    spec = kv.CacheSpec(windows=[128, None] * 18, num_kv_heads=8, head_dim=64, tokens_per_block=32,
                        max_seq_len=32768, max_batch=batch, slots_per_group=[max(batch * 8, 1024), batch * 1100],
                        max_step_tokens=1 << 22, prefix_caching=prefix_caching)
    mgr = kv.KVCacheManager(spec, backend=backend)
    rng = np.random.default_rng(0)
    for r in range(batch):
        n = int(rng.integers(8192, 30000))
        if prefix_caching:
            mgr.add(r, n, tokens=rng.integers(0, 50000, n))
        else:
            mgr.add(r, n)
        s = mgr.prepare_batch({r: mgr.request(r).prompt_len})
        s.finish()
        mgr.settle(s)
        mgr.synchronize()
    return mgr


def stub_device_work(be) -> None:
    """Replace a host backend's queued device work by no-ops (an instance, or the HostBackend class for
    every backend made afterwards): the manager's decisions never read device outputs."""
    noop = lambda *a, **k: None   # noqa: E731
    for name in ("copy_h2d", "apply_deltas", "build_step", "wait"):
        setattr(be, name, noop)
    be.record = lambda *stream: _DoneEvent()     # (stream) on an instance, (self, stream) on the class


def host_workload(seq: int = 131072, contexts: int = 0, backend: str = "host", steps: int = 60):
    """The benchmark's GPT-OSS-120B workload at batch 256 on the host backend, its queued device work no-ops
    from the start (the setup's prefill steps would build 128k tables on the host for minutes, and the
    manager's decisions never read device outputs), set up for decode steps and `contexts` prefills.
    backend="cuda": on the GPU instead, device work and all. steps: how many decode steps its requests have
    room for (a few more)."""
    from cupykv.bench.harness import SHAPES, Settings, Workload
    if backend == "host":
        from cupykv.backends.host import HostBackend
        stub_device_work(HostBackend)
    shape = SHAPES["gpt-oss-120b"]
    st = Settings(shapes=[shape.name], seqs=[seq], batches=[256], contexts=[contexts], steps=steps, warmup=5,
                  torch=False, backend=backend)
    wl = Workload(shape, seq, 256, contexts, st, np.random.default_rng(0))
    wl.setup_decode()
    if contexts:
        wl.setup_contexts(contexts)
    return wl


def make_manager(batch=256):
    """prefilled_manager on the host backend, its queued device work replaced by no-ops."""
    mgr = prefilled_manager(batch)
    stub_device_work(mgr.backend)
    return mgr


def timed_decode_step(mgr, rids):
    """One decode step of `rids` (the previous step's batch): (prepare_batch seconds, settle seconds, step)."""
    t0 = time.perf_counter()
    s = mgr.prepare_batch((), rids)
    t1 = time.perf_counter()
    s.finish()
    t2 = time.perf_counter()
    mgr.settle(s)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, s


def timer(spent: dict):
    """timed(name, fn): fn wrapped to add the perf_counter seconds of each call to spent[name]."""
    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t0
            return out
        return call
    return timed


def time_parts(timed) -> list:
    """Timers around the manager's own parts of a step: each replaced by timed(label, original) (a timer adds a
    few tenths of a microsecond); returns (owner, name, original) to put back."""
    from cupykv import ledger, manager, pipeline, planner, step
    parts = [(planner.StepPlanner, "plan"), (manager.KVCacheManager, "_commit"),
             (ledger.StepLedger, "poll"), (pipeline.StepPipeline, "acquire"), (pipeline.StepPipeline, "launch"),
             (pipeline, "pack_snapshot"), (pipeline.StepPipeline, "_entries"), (ledger.StepLedger, "record"),
             (step.Step, "finish"), (manager.KVCacheManager, "_release_stale")]
    restore = []
    for owner, name in parts:
        fn = getattr(owner, name)
        restore.append((owner, name, fn))
        setattr(owner, name, timed(f"{getattr(owner, '__name__', '').split('.')[-1]}.{name}", fn))
    return restore


def decode_step(mgr, rids) -> None:
    s = mgr.prepare_batch((), rids)
    s.finish()
    mgr.settle(s)


def census(step, steps: int = 20) -> None:
    """Print what `step` executes per call, averaged over `steps` calls: Python function calls and C calls
    (sys.setprofile), then bytecodes in separate calls (instruction events: sys.monitoring from Python
    3.12, where sys.settrace no longer reports opcodes, sys.settrace before)."""
    calls, c_calls, opcodes, where = collections.Counter(), collections.Counter(), [0], collections.Counter()

    def on_call(frame, event, arg):
        if event == "call":
            calls[frame.f_code.co_name] += 1
        elif event == "c_call":
            c_calls[getattr(arg, "__qualname__", repr(arg))] += 1

    def on_opcode(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            opcodes[0] += 1
            where[frame.f_code.co_qualname] += 1
        return on_opcode

    def run(start, stop):
        start()
        try:
            for _ in range(steps):
                step()
        finally:
            stop()

    run(lambda: sys.setprofile(on_call), lambda: sys.setprofile(None))
    c_calls.pop("setprofile", None)
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        run(lambda: sys.settrace(on_opcode), lambda: sys.settrace(None))
    else:
        tool = mon.PROFILER_ID
        mon.use_tool_id(tool, "census")
        def on_instruction(code, offset):
            opcodes[0] += 1
            where[code.co_qualname] += 1
        mon.register_callback(tool, mon.events.INSTRUCTION, on_instruction)
        try:
            run(lambda: mon.set_events(tool, mon.events.INSTRUCTION), lambda: mon.set_events(tool, 0))
        finally:
            mon.free_tool_id(tool)
    print(f"census per step: {sum(calls.values()) / steps:.0f} Python calls, {sum(c_calls.values()) / steps:.0f} "
          f"C calls, {opcodes[0] / steps:.0f} bytecodes (Python {sys.version.split()[0]})")
    print("  C calls:", ", ".join(f"{name} {n / steps:g}" for name, n in c_calls.most_common(12)))
    print("  bytecodes by function (own):", ", ".join(f"{name} {n / steps:g}" for name, n in where.most_common(24)))


def main():
    batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 256
    mgr = make_manager(batch)
    rids = list(range(mgr.spec.max_batch))
    tp, ts = [], []
    for _ in range(500):
        prepare, settle, _ = timed_decode_step(mgr, rids)
        tp.append(prepare)
        ts.append(settle)
    print(f"batch {len(rids)} decode: prepare_batch median {np.median(tp) * 1e6:.0f} us, "
          f"settle median {np.median(ts) * 1e6:.0f} us (no device work)")
    if "--parts" in sys.argv:
        spent, per = collections.defaultdict(float), collections.defaultdict(list)
        restore = time_parts(timer(spent))
        for _ in range(300):
            spent.clear()
            prepare, settle, _ = timed_decode_step(mgr, rids)
            per["prepare_batch (total)"].append(prepare)
            per["settle"].append(settle)
            for k, v in spent.items():
                per[k].append(v)
        for owner, name, fn in restore:
            setattr(owner, name, fn)
        print(f"batch {len(rids)} decode, host backend, the manager's parts timed: medians per step")
        for k, v in per.items():
            print(f"  {k:32s} {np.median(v) * 1e6:7.1f} us")
    if "--census" in sys.argv:
        census(lambda: decode_step(mgr, rids))
    if "--lines" in sys.argv:
        from line_profiler import LineProfiler
        from cupykv import manager, pipeline, planner, staging
        lp = LineProfiler(planner.StepPlanner.plan, manager.KVCacheManager._commit,
                          pipeline.StepPipeline._enqueue, staging.pack_snapshot)
        lp.enable()
        for _ in range(200):
            s = mgr.prepare_batch((), rids)
            s.finish()
            mgr.settle(s)
        lp.disable()
        lp.print_stats(output_unit=1e-6)


if __name__ == "__main__":
    main()
