"""The manager's own host cost per decode step: the host backend with its queued work replaced by no-ops.

    python scripts/profile_manager.py [--batch N] [--lines]     (--lines needs line_profiler; batch 256 by default)
"""
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


def prefilled_manager(batch: int = 256, backend: str = "host") -> cupykv.KVCacheManager:
    """A GPT-OSS-120B-shaped manager (32k) with `batch` requests prefilled to 8k-30k tokens (the window
    group has room for one whole prompt: its prefill holds every block until it settles)."""
    spec = cupykv.CacheSpec(windows=[128, None] * 18, num_kv_heads=8, head_dim=64, tokens_per_block=32,
                            max_seq_len=32768, max_batch=batch, slots_per_group=[max(batch * 8, 1024), batch * 1100],
                            max_step_tokens=1 << 22)
    mgr = cupykv.KVCacheManager(spec, backend=backend)
    rng = np.random.default_rng(0)
    for r in range(batch):
        mgr.add(r, int(rng.integers(8192, 30000)))
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


def host_workload(seq: int = 131072, contexts: int = 0):
    """The benchmark's GPT-OSS-120B workload at batch 256 on the host backend, its queued device work no-ops
    from the start (the setup's prefill steps would build 128k tables on the host for minutes, and the
    manager's decisions never read device outputs), set up for decode steps and `contexts` prefills."""
    from cupykv.backends.host import HostBackend
    from cupykv.bench.harness import SHAPES, Settings, Workload
    stub_device_work(HostBackend)
    shape = SHAPES["gpt-oss-120b"]
    st = Settings(shapes=[shape.name], seqs=[seq], batches=[256], contexts=[contexts], steps=60, warmup=5,
                  torch=False, backend="host")
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
    if "--lines" in sys.argv:
        from line_profiler import LineProfiler
        from cupykv import manager, pipeline, staging
        lp = LineProfiler(manager.KVCacheManager._plan, manager.KVCacheManager._commit,
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
