"""The benchmark runs end to end on the host backend with a tiny shape (no timing is judged)."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from cupykv import reference
from cupykv.bench.__main__ import main, parse_args
from cupykv.bench.harness import run
from cupykv.bench.peer_path import table_writes
from cupykv.bench.record import ROW_KEYS, STAT_KEYS
from cupykv.bench.report import write_outputs
from cupykv.bench.snapshot_path import BAD
from cupykv.bench.workload import SMOKE_SHAPE, Workload, config_rows

HAVE_TORCH = importlib.util.find_spec("torch") is not None
SMOKE = ["--smoke", "--steps", "4", "--warmup", "1", "--no-plot"]
# Rows of a host run without torch: each implementation's own and the floors (not measured on the host).
OWN = {"cupykv": "per_layer", "cupykv-shared": "shared"}
FLOORS = {"floor": "per_layer", "floor-shared": "shared"}
TORCH = {"torch-eager": "per_layer", "per-group-peer": "shared"}
GRAPHS = {"cupykv-graphs": "per_layer", "cupykv-shared-graphs": "shared"}     # twins with use_graphs=True


def _check_rows(settings, result, contenders):
    rows = result["rows"]
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        assert not missing, f"row {row.get('contender')} lacks {missing}"
    by_key = {(r["shape"], r["max_seq_len"], r["batch"], r["contexts"], r["case"], r["contender"]): r for r in rows}
    assert len(by_key) == len(rows), "two rows for one (configuration, contender)"
    # a smoke run runs the tiny shape in place of the shapes asked for
    expected = {("tiny" if settings.smoke else c["shape"], c["max_seq_len"], c["batch"], c["contexts"], c["case"])
                for c in config_rows(settings)}
    assert expected, "the smoke settings configure no rows"
    assert len(rows) == len(expected) * len(contenders), sorted({r["contender"] for r in rows})
    for cfg in expected:
        for name in contenders:
            key = cfg + (name,)
            assert key in by_key, f"no row for {key}"
            row = by_key[key]
            assert row["table_mode"] == {**OWN, **GRAPHS, **FLOORS, **TORCH}[name], key
            if name in FLOORS:
                assert row["error"] and row["device_us"] is None     # GPU timings, not measured on the host
                continue
            assert row["error"] is None, row["error"]
            # decode-only runs alternate churn ("decode") and unchanged ("steady") steps
            want_n = settings.steps // 2 if cfg[4] in ("decode", "steady") else settings.steps
            assert row["n"] == want_n, key
            for metric in ("host_us", "wall_us", "h2d_bytes"):
                assert set(STAT_KEYS) <= set(row[metric]), (key, metric)
            assert row["device_us"] is None          # the host backend has no device timer
            # the output was compared with cupykv.reference (and, for torch, with cupykv) in this run
            assert row["checks"] > 0 and row["mismatches"] == 0 and row["checked"] is True, key
            if name in OWN or name in GRAPHS:
                assert set(STAT_KEYS) <= set(row["host_total_us"])
            else:
                assert row["host_total_us"] is None
    assert result["checked"] is True
    assert {c[4] for c in expected} == {"decode", "steady", "ctx"}


def test_smoke_run_json(tmp_path):
    settings = parse_args(SMOKE + ["--out", str(tmp_path)])
    assert settings.backend == "host" and settings.smoke and settings.shared
    result = run(settings)
    written = write_outputs(result, str(tmp_path), plot=False)
    assert str(tmp_path / "bench.json") in written
    loaded = json.loads((tmp_path / "bench.json").read_text())
    contenders = list(OWN) + list(FLOORS) + (list(TORCH) if HAVE_TORCH else [])
    _check_rows(settings, loaded, contenders)
    meta = loaded["meta"]
    assert meta["backend"] == "host" and meta["command"].startswith("python -m cupykv.bench")
    assert "numpy" in meta["versions"] and meta["date"]
    assert meta["settings"]["table_modes"] == ["per_layer", "shared"]
    if not HAVE_TORCH:
        # the torch contenders, the per-group peer among them, are skipped with the reason
        assert any("torch" in m and "skipped" in m and "per-group-peer" in m for m in meta["messages"])
    md = (tmp_path / "bench.md").read_text()
    assert "Benchmark" in md and "cupykv-shared" in md and "SHARED tables" in md


def test_smoke_without_torch(tmp_path):
    settings = parse_args(SMOKE + ["--no-torch", "--out", str(tmp_path)])
    result = run(settings)
    _check_rows(settings, result, list(OWN) + list(FLOORS))
    assert not any(r["contender"] in TORCH or r["contender"].startswith("torch") for r in result["rows"])
    assert any("--no-torch" in m for m in result["meta"]["messages"])


def test_smoke_without_shared(tmp_path):
    settings = parse_args(SMOKE + ["--no-torch", "--no-shared", "--out", str(tmp_path)])
    assert not settings.shared
    result = run(settings)
    _check_rows(settings, result, ["cupykv", "floor"])
    assert any("--no-shared" in m for m in result["meta"]["messages"])
    assert result["meta"]["settings"]["table_modes"] == ["per_layer"]


def test_smoke_with_graph_twins():
    """The -graphs rows (twin managers made with use_graphs=True; on the GPU by default) come out of the
    host backend's op-by-op replay, checked, each mode's rows before its floor."""
    settings = parse_args(SMOKE + ["--no-torch", "--batch", "2", "--contexts", "0,1"])
    settings.graphs = True
    result = run(settings)
    names = list(OWN) + list(GRAPHS) + list(FLOORS)
    _check_rows(settings, result, names)
    order = [r["contender"] for r in result["rows"] if r["case"] == "decode"]
    assert order == ["cupykv", "cupykv-graphs", "floor", "cupykv-shared", "cupykv-shared-graphs", "floor-shared"]


def test_cli_prints_table(tmp_path, capsys):
    rc = main(SMOKE + ["--no-torch", "--out", str(tmp_path), "--batch", "2", "--contexts", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "contender" in out and "cupykv" in out and "cupykv-shared" in out and "ctx" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {r["batch"] for r in data["rows"]} == {2} and {r["contexts"] for r in data["rows"]} == {1}


@pytest.mark.parametrize("argv, says", [
    (["--shapes", "llama-9000"], "unknown shape"),
    (["--seq", "abc"], "--seq 'abc'"),
    (["--batch", "2x"], "--batch '2x'"),
    (["--batch", "0"], "positive"),
    (["--seq", "0"], "positive"),
    (["--contexts", "-1"], "--contexts '-1'"),
    (["--chunk", "0"], "--chunk 0"),
    (["--steps", "1"], "--steps"),
])
def test_cli_rejects_bad_input(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_peer_write_lists_rebuild_the_shared_tables():
    """The per-group peer's write lists (table_writes), applied to persistent tables and gathered in
    batch order, give the SHARED reference tables at every step of a churning workload (numpy stands in
    for the torch apply and gather, so this runs without torch)."""
    settings = parse_args(SMOKE + ["--no-torch"])
    wl = Workload(SMOKE_SHAPE, 256, 4, 2, settings, np.random.default_rng(3), shared=True)
    mgr = wl.shared
    lay = mgr.layout
    scale = lay.group_scale.reshape(-1, 1, 1)
    shadow = np.full(mgr.table.shape, BAD, np.int32)
    device = np.full(mgr.table.shape, BAD, np.int32)          # the persistent per-group tables
    wl.setup_decode()
    wl.setup_contexts(2)
    writes_seen = 0
    for i in range(12):
        plan = wl.plan_ctx() if i % 3 == 2 else wl.plan_decode_only(wl.pre_churn_decode_only(i))
        for m in wl.managers:
            wl.apply(m, plan)
        steps = [m.prepare_batch(contexts=plan.contexts, generation=plan.generation) for m in wl.managers]
        step = steps[1]
        writes = table_writes(shadow, mgr.table, step.rows)
        assert writes.dtype == np.int32 and writes.shape[1] == 4
        g, r, b, slot = writes.T
        device[g, r, b] = slot
        writes_seen += len(writes)
        base = device[:, step.rows]
        k = np.where(base == BAD, BAD, base * scale)
        got = np.stack([k, np.where(base == BAD, BAD, k + 1)], axis=2)
        want = reference.convert_shared(mgr.table, step.rows, lay.group_scale)
        assert np.array_equal(got, want), f"step {i}"
        assert np.array_equal(shadow[:, step.rows], mgr.table[:, step.rows])
        for m, st in zip(wl.managers, steps):
            st.ready.synchronize()
            st.finish()
            m.settle(st)
    assert writes_seen > 0
    wl.close()
