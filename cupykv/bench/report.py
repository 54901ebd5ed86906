"""Output of the benchmark: the stdout table, bench.json, bench.md (for the README) and bench.png."""
from __future__ import annotations

import json
import os
from typing import List, Optional

from .record import is_floor


def _us(s: Optional[dict]) -> str:
    if not s:
        return "-"
    return f"{s['median']:.1f} [{s['p10']:.1f}-{s['p90']:.1f}]"


def _kb(s: Optional[dict]) -> str:
    if not s:
        return "-"
    return f"{s['median'] / 1024:.1f} [{s['p90'] / 1024:.1f}]"


def _seq(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _ok(r: dict) -> str:
    if r.get("error") and not r.get("n"):
        return "n/a"
    if r["checked"] is None:
        return "" if is_floor(r) else "not sampled"
    return "yes" if r["checked"] else "NO"


HEADER = ("shape", "seq", "batch", "ctx", "case", "contender", "host us med [p10-p90]",
          "device us med [p10-p90]", "wall us med [p10-p90]", "H2D KB med [p90]", "dev/floor", "checked")


def table_rows(rows: List[dict]) -> List[tuple]:
    out = []
    for r in rows:
        ratio = f"{r['device_vs_floor']:.2f}" if r.get("device_vs_floor") else "-"
        out.append((r["shape"], _seq(r["max_seq_len"]), str(r["batch"]), str(r["contexts"]), r["case"],
                    r["contender"], _us(r["host_us"]), _us(r["device_us"]), _us(r["wall_us"]), _kb(r["h2d_bytes"]),
                    ratio, _ok(r)))
    return out


def text_table(rows: List[dict]) -> str:
    body = table_rows(rows)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)), "  ".join("-" * w for w in widths)]
    prev = None
    for r, b in zip(rows, body):
        key = (r["shape"], r["max_seq_len"], r["batch"], r["contexts"], r["case"])
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        lines.append("  ".join(c.ljust(w) for c, w in zip(b, widths)))
    return "\n".join(lines)


def markdown_table(rows: List[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for b in table_rows(rows):
        lines.append("| " + " | ".join(b) + " |")
    return "\n".join(lines)


def targets_text(targets: List[dict]) -> str:
    if not targets:
        return "targets: none applicable to this run (device targets need the GPU; host/H2D targets batch 256)"
    lines = ["targets (reported, not asserted):"]
    for t in targets:
        unit = t["unit"]
        v = f"{t['value']:.1f} {unit}" if unit == "us" else f"{t['value'] / 1024:.1f} KB"
        lim = f"{t['limit']:.1f} {unit}" if unit == "us" else f"{t['limit'] / 1024:.1f} KB"
        lines.append(f"  [{'PASS' if t['ok'] else 'MISS'}] {t['target']}: {t['config']}: {v} (limit {lim})")
    n_ok = sum(t["ok"] for t in targets)
    lines.append(f"  {n_ok} of {len(targets)} met")
    return "\n".join(lines)


def _versions(v: dict) -> str:
    return ", ".join(f"{k} {v[k]}" for k in ("gpu", "cupykv", "git", "python", "numpy", "cupy", "cuda_runtime",
                                             "cuda_driver", "torch", "torch_cuda") if k in v)


def summary_text(result: dict) -> str:
    m = result["meta"]
    ver = _versions(m["versions"])
    lines = [f"cupykv benchmark, {m['date']}, backend {m['backend']}", f"command: {m['command']}",
             f"versions: {ver}", *m["messages"], "",
             text_table(result["rows"]), "", targets_text(result["targets"]), "",
             "outputs checked against cupykv.reference: "
             + ("all rows OK" if result["checked"] else "MISMATCH (see rows marked NO)"),
             *(["FAILED configurations:"] + ["  " + f for f in result["failures"]] if result.get("failures") else []),
             f"elapsed: {m['elapsed_s']} s"]
    return "\n".join(lines)


def _tables(s: dict) -> str:
    if "shared" not in s.get("table_modes", ()):
        return "PER_LAYER tables"
    return ("PER_LAYER tables (SHARED tables, without scratch reuse, for cupykv-shared, per-group-peer and "
            "floor-shared)")


def markdown(result: dict) -> str:
    m = result["meta"]
    v = m["versions"]
    ver = _versions(v)
    s = m["settings"]
    return "\n".join([
        f"### Benchmark ({v.get('gpu', m['backend'])}, {m['date']})", "",
        f"Command: `{m['command']}`  ", f"Versions: {ver}  ",
        f"Settings: {s['warmup']} warm-up + {s['steps']} measured steps per configuration, tokens per block "
        f"{s['tokens_per_block']}, context chunks of {s['chunk']} tokens, {_tables(s)}, seed {s['seed']}.  ",
        "host: the call's enqueue (no sync); device: GPU time between events around the step's work (the stream "
        "is held while the host enqueues); wall: call to ready event; floor: memcpyAsync + one launch (host), "
        "memset of the live output region (device).", "",
        markdown_table(result["rows"]), "", "```", targets_text(result["targets"]), "```", ""])


def write_outputs(result: dict, out_dir: str, plot: bool = True) -> List[str]:
    """bench.json, bench.md and (with matplotlib) bench.png; returns the paths written and notes."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    p = os.path.join(out_dir, "bench.json")
    with open(p, "w") as f:
        json.dump(result, f, indent=1, default=float)
    written.append(p)
    p = os.path.join(out_dir, "bench.md")
    with open(p, "w") as f:
        f.write(markdown(result))
    written.append(p)
    if plot:
        written.append(write_plot(result, os.path.join(out_dir, "bench.png")))
    return written


def write_plot(result: dict, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:   # noqa: BLE001
        return f"no plot: matplotlib is not installed ({type(exc).__name__}); pip install 'cupykv[plot]'"
    rows = result["rows"]
    keys = []
    for r in rows:
        k = (r["shape"], r["max_seq_len"], r["batch"], r["contexts"], r["case"])
        if k not in keys:
            keys.append(k)
    contenders = []
    for r in rows:
        if r["contender"] not in contenders:
            contenders.append(r["contender"])
    by = {(r["shape"], r["max_seq_len"], r["batch"], r["contexts"], r["case"], r["contender"]): r for r in rows}
    labels = [f"{s} {_seq(q)} b{b} c{c} {case}" for s, q, b, c, case in keys]
    metrics = [("device_us", "device time per step (us, median)"), ("host_us", "host enqueue (us, median)"),
               ("h2d_bytes", "H2D bytes per step (median)")]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(10, 0.45 * len(keys) + 3), 4 * len(metrics)))
    width = 0.8 / max(1, len(contenders))
    x = list(range(len(keys)))
    for ax, (metric, title) in zip(axes, metrics):
        for ci, name in enumerate(contenders):
            vals = []
            for k in keys:
                r = by.get(k + (name,))
                s = r.get(metric) if r else None
                vals.append(s["median"] if s else 0.0)
            ax.bar([xi + (ci - (len(contenders) - 1) / 2) * width for xi in x], vals, width, label=name)
        ax.set_title(title)
        if any(by.get(k + (n,), {}).get(metric) for k in keys for n in contenders):
            ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=75, ha="right", fontsize=7)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="y", alpha=0.3)
    m = result["meta"]
    fig.suptitle(f"cupykv benchmark, {m['versions'].get('gpu', m['backend'])}, {m['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
