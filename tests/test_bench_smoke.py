"""The benchmark harness runs end to end on the host backend with a tiny shape (no timing is judged)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from cupykv.bench.__main__ import main, parse_args
from cupykv.bench.harness import ROW_KEYS, STAT_KEYS, config_rows, run
from cupykv.bench.report import write_outputs

HAVE_TORCH = importlib.util.find_spec("torch") is not None
SMOKE = ["--smoke", "--steps", "4", "--warmup", "1", "--no-plot"]


def _check_rows(settings, result, contenders):
    rows = result["rows"]
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        assert not missing, f"row {row.get('contender')} lacks {missing}"
    by_key = {(r["shape"], r["max_seq_len"], r["batch"], r["contexts"], r["case"], r["contender"]): r for r in rows}
    expected = config_rows(settings)
    assert expected, "the smoke settings configure no rows"
    for cfg in expected:
        shape = "tiny" if settings.smoke else cfg["shape"]
        for name in contenders:
            key = (shape, cfg["max_seq_len"], cfg["batch"], cfg["contexts"], cfg["case"], name)
            assert key in by_key, f"no row for {key}"
            row = by_key[key]
            if name == "floor":
                continue
            assert row["error"] is None, row["error"]
            # decode-only runs alternate churn ("decode") and unchanged ("steady") steps
            want_n = settings.steps // 2 if cfg["case"] in ("decode", "steady") else settings.steps
            assert row["n"] == want_n, key
            for metric in ("host_us", "wall_us", "h2d_bytes"):
                assert set(STAT_KEYS) <= set(row[metric]), (key, metric)
            assert row["device_us"] is None          # the host backend has no device timer
            # the output was compared with cupykv.reference (and, for torch, with cupykv) in this run
            assert row["checks"] > 0 and row["mismatches"] == 0 and row["checked"] is True, key
            if name == "cupykv":
                assert set(STAT_KEYS) <= set(row["host_total_us"])
    assert result["checked"] is True
    assert {c["case"] for c in expected} == {"decode", "steady", "ctx"}


def test_smoke_run_json(tmp_path):
    settings = parse_args(SMOKE + ["--out", str(tmp_path)])
    assert settings.backend == "host" and settings.smoke
    result = run(settings)
    written = write_outputs(result, str(tmp_path), plot=False)
    assert str(tmp_path / "bench.json") in written
    loaded = json.loads((tmp_path / "bench.json").read_text())
    contenders = ["cupykv", "floor"] + (["torch-eager"] if HAVE_TORCH else [])
    _check_rows(settings, loaded, contenders)
    meta = loaded["meta"]
    assert meta["backend"] == "host" and meta["command"].startswith("python -m cupykv.bench")
    assert "numpy" in meta["versions"] and meta["date"]
    if not HAVE_TORCH:
        assert any("torch" in m and "skipped" in m for m in meta["messages"])
    assert "Benchmark" in (tmp_path / "bench.md").read_text()


def test_smoke_without_torch(tmp_path):
    settings = parse_args(SMOKE + ["--no-torch", "--out", str(tmp_path)])
    result = run(settings)
    _check_rows(settings, result, ["cupykv", "floor"])
    assert not any(r["contender"].startswith("torch") for r in result["rows"])
    assert any("--no-torch" in m for m in result["meta"]["messages"])


def test_cli_prints_table(tmp_path, capsys):
    rc = main(SMOKE + ["--no-torch", "--out", str(tmp_path), "--batch", "2", "--contexts", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "contender" in out and "cupykv" in out and "ctx" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {r["batch"] for r in data["rows"]} == {2} and {r["contexts"] for r in data["rows"]} == {1}


def test_cli_rejects_unknown_shape():
    with pytest.raises(SystemExit):
        parse_args(["--shapes", "llama-9000"])
