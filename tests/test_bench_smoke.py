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


# -- `python -m cupykv.bench prefix` and `python -m cupykv.bench host-tier` on the host backend -------------
from cupykv.bench.__main__ import parse_host_tier_args, parse_prefix_args   # noqa: E402
from cupykv.bench.host_tier_bench import run_host_tier                      # noqa: E402
from cupykv.bench.prefix_trace import (DECODE_VARIANTS, POLICIES, SMOKE_PATTERNS, make_trace,   # noqa: E402
                                       run_prefix, run_trace)


def _prefix_result(tmp_path, extra=()):
    rc = main(["prefix", "--smoke", "--out", str(tmp_path), *extra])
    data = json.loads((tmp_path / "prefix.json").read_text())
    assert (tmp_path / "prefix.md").read_text().startswith("### Prefix-caching benchmark")
    return rc, data


def test_prefix_smoke_rows(tmp_path, capsys):
    rc, data = _prefix_result(tmp_path)
    out = capsys.readouterr().out
    assert rc == 0, data["failures"]
    assert "targets (reported, not asserted)" in out and "cache-boundaries-scratch" in out
    settings = data["meta"]["settings"]
    assert data["meta"]["backend"] == "host" and settings["smoke"]
    trace = make_trace(parse_prefix_args(["--smoke"]).trace)
    # every (pattern, tpb, policy) of the trace, each consistent with stats()
    want = {(p, t, pol.name) for p in settings["patterns"] for t in settings["tpbs"] for pol in POLICIES}
    got = {(r["pattern"], r["tpb"], r["policy"]): r for r in data["trace"]}
    assert set(got) == want and len(data["trace"]) == len(want)
    for key, r in got.items():
        assert r["error"] is None, (key, r["error"])
        assert r["prompt_tokens"] == trace.prompt_tokens and r["requests"] == trace.requests
        assert r["computed_tokens"] + r["hit_tokens"] == r["prompt_tokens"], key
        assert r["consistent"] is True
        if r["caching"]:
            assert r["hit_tokens"] == r["stats_hit_tokens"] > 0, key       # shared system prompts hit
            assert r["stats_query_tokens"] == r["prompt_tokens"] and r["stats_queries"] == r["requests"]
        else:
            assert r["hit_tokens"] == r["stats_hit_tokens"] == 0 and r["computed_tokens"] == r["prompt_tokens"]
        assert len(r["groups"]) == 2 and r["samples"] == 2 * r["steps"]
        for g in r["groups"]:
            assert 0 < g["peak_in_use"] <= g["peak_held"] <= g["total"] == r["pool_slots"]
        assert r["decode_tokens"] == sum(sum(c.gen_len) for c in trace.conversations)
    # add(): cold, warm, warm from a list, per tpb
    cases = {(r["tpb"], r["case"], r["tokens"]): r for r in data["add"]}
    assert set(cases) == {(t, c, k) for t in settings["tpbs"]
                          for c, k in (("cold", "int64 array"), ("warm", "int64 array"), ("warm", "list"))}
    for (tpb, case, _), r in cases.items():
        assert r["error"] is None
        n = r["prompt_tokens"]
        assert r["hit_tokens"] == (0 if case == "cold" else (n - 1) // tpb * tpb)
        for k in ("add_ms", "hash_ms", "lookup_ms"):
            assert r[k]["median"] > 0
    # decode host time: one row per variant, all measured
    assert [r["variant"] for r in data["decode"]] == list(DECODE_VARIANTS)
    for r in data["decode"]:
        assert r["error"] is None and r["n"] == settings["decode_steps"]
        assert r["total_us"]["median"] > 0 and r["vs_off"] > 0
    assert data["decode"][0]["vs_off"] == 1.0
    # the targets: two per (pattern, tpb), one per decode variant with caching on
    assert len(data["targets"]) == 2 * len(settings["patterns"]) * len(settings["tpbs"]) + len(DECODE_VARIANTS) - 1


def test_prefix_trace_with_emulated_kernels():
    """The trace through the host backend's real step pipeline (--emulate) gives the same numbers as with
    the kernels skipped: they are host bookkeeping."""
    s = parse_prefix_args(["--smoke"])
    trace = make_trace(s.trace)
    shape = SMOKE_PATTERNS["gpt-oss"]
    keys = ("hit_tokens", "computed_tokens", "steps", "swa_peak_in_use", "full_peak_held", "full_evictions")
    for policy in POLICIES:
        fast = run_trace(trace, s.trace, "gpt-oss", shape, 8, policy, "host", emulate=False)
        full = run_trace(trace, s.trace, "gpt-oss", shape, 8, policy, "host", emulate=True)
        assert {k: fast[k] for k in keys} == {k: full[k] for k in keys}, policy.name
        assert full["consistent"]


def test_prefix_parts_and_pool_pressure(tmp_path):
    """--parts runs a subset; a small pool evicts, and the accounting still adds up."""
    s = parse_prefix_args(["--smoke", "--parts", "trace", "--pool-frac", "0.05", "--patterns", "gemma",
                           "--tpb", "8,16", "--conversations", "12"])
    result = run_prefix(s)
    assert not result["add"] and not result["decode"] and not result["failures"]
    rows = result["trace"]
    assert len(rows) == 2 * len(POLICIES)
    assert all(r["full_evictions"] > 0 and r["hit_tokens"] > 0 for r in rows if r["caching"])
    for r in rows:
        assert r["consistent"] and r["computed_tokens"] + r["hit_tokens"] == r["prompt_tokens"]


def test_host_tier_smoke_rows(tmp_path, capsys):
    rc = main(["host-tier", "--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "host_tier.json").read_text())
    assert rc == 0, data["failures"]
    assert (tmp_path / "host_tier.md").read_text().startswith("### Host-tier benchmark")
    assert "Copies" in out and "Overlap" in out
    rows = {(r["case"], r["direction"]): r for r in data["copies"]}
    want = {(c, d) for c in ("contiguous", "fragmented", "whole-sequence") for d in ("suspend", "resume")}
    want |= {("memcpy", "D2H"), ("memcpy", "H2D")}
    assert set(rows) == want and len(data["copies"]) == len(want)
    for key, r in rows.items():
        assert r["error"] is None, (key, r["error"])
        assert r["n"] == data["meta"]["settings"]["reps"] and r["host_us"]["median"] > 0
        assert r["device_ms"] is None and r["gbps"] is None      # no timing events on the host backend
        assert r["bytes"] > 0 and r["copies"] >= 1
    cont = rows[("contiguous", "suspend")]
    assert cont["bytes"] == rows[("contiguous", "resume")]["bytes"] == rows[("memcpy", "D2H")]["bytes"]
    assert cont["copies"] == 2                                   # one run per group
    assert rows[("fragmented", "suspend")]["copies"] > cont["copies"]
    assert rows[("fragmented", "suspend")]["bytes"] == cont["bytes"]
    d = data["detail"]
    # the sliding-window group moves only its window; a whole-sequence move copies every block
    assert rows[("whole-sequence", "suspend")]["bytes"] == d["whole_sequence_bytes_counted"] > cont["bytes"]
    assert [r["direction"] for r in data["overlap"]] == ["suspend", "resume"]
    for r in data["overlap"]:
        assert r["error"] is None and r["steps"] >= 5 and r["both_ms"] > 0
    assert {t["config"].split(" (")[0] for t in data["targets"]} == {
        "contiguous suspend", "contiguous resume", "fragmented suspend", "fragmented resume"}


def test_host_tier_defaults_scale_down_on_host():
    s = parse_host_tier_args(["--backend", "host", "--reps", "1", "--no-whole", "--frag-run", "0",
                              "--bg-requests", "0"])
    assert s.smoke and s.prompt < 131072 and s.reps == 1
    result = run_host_tier(s)
    assert not result["failures"]
    assert {r["case"] for r in result["copies"]} == {"contiguous", "memcpy"} and result["overlap"] == []


@pytest.mark.parametrize("argv, says", [
    (["prefix", "--tpb", "12"], "powers of two"),
    (["prefix", "--tpb", "x"], "--tpb 'x'"),
    (["prefix", "--patterns", "llama"], "unknown 'llama'"),
    (["prefix", "--parts", "trace,foo"], "unknown 'foo'"),
    (["prefix", "--parts", ","], "needs at least one"),
    (["prefix", "--step-tokens", "8", "--in-flight", "8"], "must exceed --in-flight"),
    (["prefix", "--chunk", "4q"], "--chunk"),
    (["prefix", "--pool-frac", "0"], "--pool-frac"),
    (["prefix", "--reps", "0"], "--reps 0"),
    (["prefix", "--decode-ctx", "300"], "--decode-ctx 300"),
    (["prefix", "--add-prompt", "16"], "--add-prompt 16"),
    (["host-tier", "--reps", "0"], "--reps 0"),
    (["host-tier", "--prompt", "1k2"], "--prompt"),
    (["host-tier", "--frag-run", "-1"], "--frag-run -1"),
    (["host-tier", "--backend", "tpu"], "--backend"),
])
def test_subcommands_reject_bad_input(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_devices_bench_smoke(tmp_path):
    """`python -m cupykv.bench devices --smoke`: every device set runs the decode workload and the report
    has a row per configuration (timings are not judged)."""
    from cupykv.bench.__main__ import main
    assert main(["devices", "--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "devices.json").read_text())
    assert [r["devices"] for r in report["rows"]] == [[0], [0, 0], [0, 1]]
    assert all(r["prepare_us"]["median"] > 0 for r in report["rows"])
    assert "| [0, 1] |" in (tmp_path / "devices.md").read_text()


def test_transfer_bench_smoke(tmp_path):
    """`python -m cupykv.bench transfer --smoke`: each case moves the bytes its blocks hold (window-only: the
    window and every full-attention block; whole: every block of every layer), through each transport."""
    from cupykv.bench.__main__ import main
    from cupykv.transports.nixl import nixl_available
    assert main(["transfer", "--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "transfer.json").read_text())["rows"]
    kinds = (["nixl"] if nixl_available() else []) + ["loopback"]
    assert [(r["case"], r["transport"]) for r in rows] == [(c, k) for c in ("window-only", "whole") for k in kinds]
    # SMOKE_SHAPE: 4 layers (window 16, full, window 16, full), 1 KV head of 8, 2-byte KV; 300 tokens, 8 a block
    page = 8 * 1 * 8 * 2
    blocks, window = -(-300 // 8), (300 + 1 - 16) // 8
    want = {"window-only": 2 * 2 * page * (blocks - window) + 2 * 2 * page * blocks, "whole": 4 * 2 * page * blocks}
    assert all(r["bytes"] == want[r["case"]] for r in rows)


def test_serve_smoke_runs_and_agrees():
    """`python -m cupykv.bench serve --smoke` (cupykv and padded generate: generate_batch's setup is slow on a
    CPU) runs, writes its table, and both contenders give the same greedy tokens (float32)."""
    import json
    import subprocess
    import sys
    import tempfile
    import pytest
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([sys.executable, "-m", "cupykv.bench", "serve", "--smoke", "--contenders",
                              "cupykv,generate", "--out", out], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "generate agrees with cupykv on 100%" in run.stdout
        rows = json.load(open(f"{out}/serve.json"))["rows"]
        assert [r["contender"] for r in rows] == ["cupykv Engine (torch attention)", "transformers generate (padded batch)"]
        assert rows[0]["hit_tokens"] > 0 and rows[0]["peak_kv_bytes_per_layer"]
