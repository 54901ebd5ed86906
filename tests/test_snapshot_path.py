"""FullSnapshotPath (benchmark contender 2) against the NumPy reference, bit for bit, on CPU.

Random inputs with a fresh seed every run (printed; set CUPYKV_TEST_SEED to replay one).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from cupykv.layout import Layout
from cupykv.spec import CacheSpec
from oracle import BAD, reference_tables

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="torch is not installed; FullSnapshotPath is a torch contender (pip install torch)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _seed() -> int:
    env = os.environ.get("CUPYKV_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    print(f"test_snapshot_path seed: {seed} (replay with CUPYKV_TEST_SEED={seed})")
    return seed


def _layout() -> Layout:
    return Layout(CacheSpec(windows=[128, None] * 3, num_kv_heads=1, head_dim=8, tokens_per_block=32,
                            max_seq_len=1024, max_batch=8, slots_per_group=64))


ROWS = 12          # table rows (more than the capacity, as a row pool with holes would have)
M = 16             # max scratch width


def _path(lay: Layout, **kw):
    from cupykv.bench.snapshot_path import FullSnapshotPath
    return FullSnapshotPath(lay.num_layers, lay.num_groups, ROWS, lay.spec.max_batch, lay.max_blocks,
                            lay.layer_group, lay.layer_koff, lay.group_scale, M, device="cpu", **kw)


def _random_step(rng, lay: Layout, num_seqs: int, num_contexts: int):
    P, B, C = lay.num_groups, lay.max_blocks, lay.spec.max_batch
    table = rng.integers(0, 64, size=(P, ROWS, B)).astype(np.int32)
    table[rng.random(table.shape) < 0.3] = BAD
    table[:, :, rng.integers(0, B):] = BAD          # a sequence end, shared by every row
    copy_idx = rng.choice(ROWS, size=num_seqs, replace=False).astype(np.int32)
    # begs/ends shaped like the reference system's ([P, capacity]); only the first num_contexts count
    begs = np.zeros((P, C), np.int32)
    ends = np.zeros((P, C), np.int32)
    scratch = rng.integers(0, 64, size=(P, C, M)).astype(np.int32)
    for p in range(P):
        scale = int(lay.group_scale[p])
        for s in range(num_contexts):
            kind = rng.integers(0, 5)
            if kind == 0:                           # no scratch for this context in this group
                b, e = (0, 0) if rng.random() < 0.5 else (7, 3)
            else:
                b = int(rng.integers(-3 if kind == 1 else 0, B))
                cap_end = b + (M * scale) // 2      # longest range M slots can hold
                e = int(rng.integers(b + 1, min(cap_end, B + 4) + 1))
                if kind == 2:
                    e = min(e, B + 2)               # may run past B (clipped by the contract)
            begs[p, s], ends[p, s] = b, e
    return table, copy_idx, begs, ends, scratch


def _reference(lay, table, copy_idx, nctx, begs, ends, scratch):
    return reference_tables(lay.spec, table, copy_idx, nctx, begs, ends, scratch)[:, :len(copy_idx)]


def _run_steps(path, lay, rng, seed, steps=25):
    C = lay.spec.max_batch
    prev = None
    for i in range(steps):
        num_seqs = int(rng.integers(0, C + 1)) if i else C
        nctx = 0 if i % 3 == 0 else int(rng.integers(0, num_seqs + 1))
        table, copy_idx, begs, ends, scratch = _random_step(rng, lay, num_seqs, nctx)
        got = path.step(table, copy_idx, nctx, begs, ends, scratch)
        assert tuple(got.shape) == (lay.num_layers, num_seqs, 2, lay.max_blocks)
        want = _reference(lay, table, copy_idx, nctx, begs, ends, scratch)
        np.testing.assert_array_equal(got.numpy(), want,
                                      err_msg=f"seed {seed}, step {i}, num_seqs {num_seqs}, nctx {nctx}")
        # rows >= num_seqs of the attention buffer keep what the previous step wrote
        after = path.attn.numpy().copy()
        if prev is not None:
            np.testing.assert_array_equal(after[:, num_seqs:], prev[:, num_seqs:], err_msg=f"seed {seed}, step {i}")
        prev = after
        # the caller may rewrite its buffers at once: the result must not move
        table[:] = 5
        copy_idx[:] = 0
        begs[:] = 0
        scratch[:] = 0
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"seed {seed}, step {i} after rewrite")
        # the whole table, copy_idx, and the padded scratch metadata, every step
        P, B = lay.num_groups, lay.max_blocks
        assert path.h2d_bytes_last_step == 4 * (P * ROWS * B + num_seqs + 2 * P * C + P * C * M)


@needs_torch
def test_matches_reference_random():
    seed = _seed()
    rng = np.random.default_rng(seed)
    lay = _layout()
    _run_steps(_path(lay), lay, rng, seed)


@needs_torch
def test_matches_reference_compiled():
    import torch
    seed = _seed()
    rng = np.random.default_rng(seed)
    lay = _layout()
    path = _path(lay, compile=True)
    assert path.compiled
    try:
        path.step(*_random_step(rng, lay, 1, 0)[:2], 0)
    except Exception as exc:  # noqa: BLE001 - inductor needs a working C++ toolchain on CPU
        if isinstance(exc, AssertionError):
            raise
        torch._dynamo.reset()
        pytest.skip(f"torch.compile does not work on this machine's CPU: {type(exc).__name__}: {exc}")
    _run_steps(path, lay, rng, seed, steps=8)


@needs_torch
def test_num_contexts_zero_without_metadata():
    seed = _seed()
    rng = np.random.default_rng(seed)
    lay = _layout()
    path = _path(lay)
    table, copy_idx, begs, ends, scratch = _random_step(rng, lay, 5, 0)
    got = path.step(table, copy_idx, 0)
    np.testing.assert_array_equal(got.numpy(), _reference(lay, table, copy_idx, 0, begs, ends, scratch),
                                  err_msg=f"seed {seed}")


@needs_torch
def test_rejects_bad_inputs():
    lay = _layout()
    path = _path(lay)
    P, B = lay.num_groups, lay.max_blocks
    table = np.zeros((P, ROWS, B), np.int32)
    with pytest.raises(ValueError, match="host_table shape"):
        path.step(table[:, :3], np.zeros(1, np.int32), 0)
    with pytest.raises(ValueError, match="copy_idx"):
        path.step(table, np.array([ROWS], np.int32), 0)
    with pytest.raises(ValueError, match="capacity"):
        path.step(table, np.zeros(lay.spec.max_batch + 1, np.int32), 0)
    with pytest.raises(ValueError, match="num_contexts"):
        path.step(table, np.zeros(2, np.int32), 3)
    begs = np.zeros((P, 1), np.int32)
    ends = np.full((P, 1), B, np.int32)
    with pytest.raises(ValueError, match="more slots"):
        path.step(table, np.zeros(1, np.int32), 1, begs, ends, np.zeros((P, 1, 1), np.int32))


def test_module_imports_without_torch():
    """The module imports with torch unavailable and fails only when used, with an ImportError."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # makes 'import torch' raise ImportError\n"
        "import cupykv.bench.snapshot_path as m\n"
        "try:\n"
        "    m.FullSnapshotPath(1, 1, 1, 1, 4, [0], [0], [2], 1, device='cpu')\n"
        "except ImportError as e:\n"
        "    assert isinstance(e, m.TorchUnavailableError) and 'needs PyTorch' in str(e), e\n"
        "    print('ok')\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
