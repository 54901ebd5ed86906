"""Output of the benchmark: the stdout table, bench.json, bench.md (for the README) and bench.png."""
from __future__ import annotations

import json
import os
from typing import List, Optional

from .record import is_floor


def _stat(s: Optional[dict], fmt: str = "{:.1f}") -> str:
    """median [p10-p90] of a stats() dict; "-" for none."""
    if not s:
        return "-"
    return f"{fmt.format(s['median'])} [{fmt.format(s['p10'])}-{fmt.format(s['p90'])}]"


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
                    r["contender"], _stat(r["host_us"]), _stat(r["device_us"]), _stat(r["wall_us"]), _kb(r["h2d_bytes"]),
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
    return _grid(HEADER, table_rows(rows), md=True)


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
    written = write_named(result, out_dir, "bench", markdown(result))
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


# -- the prefix-caching and host-tier benchmarks (`python -m cupykv.bench prefix | host-tier`) -------------
def _grid(header: tuple, body: List[tuple], md: bool) -> str:
    """A table as markdown, or as aligned text columns."""
    if md:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(header)]
    return "\n".join(["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
                     + ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body])


def _num(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _targets_lines(targets: List[dict]) -> List[str]:
    if not targets:
        return ["targets: none evaluated (see the errors above)"]
    lines = ["targets (reported, not asserted):"]
    lines += [f"  [{'PASS' if t['ok'] else 'MISS'}] {t['target']}: {t['config']}: {t['text']}" for t in targets]
    lines.append(f"  {sum(t['ok'] for t in targets)} of {len(targets)} met")
    return lines


TRACE_HEADER = ("pattern", "tpb", "policy", "prompt tok", "computed", "hit tok", "hit rate", "1st-turn hit",
                "SWA in use", "SWA held (mean)", "full in use", "full held (mean)", "evictions SWA/full", "steps",
                "check")
ADD_HEADER = ("shape", "tpb", "prompt tok", "case", "tokens", "hit tok", "add ms med [p10-p90]", "hash ms",
              "lookup ms")
DECODE_HEADER = ("shape", "tpb", "batch", "ctx", "variant", "prepare us med [p10-p90]", "settle us med [p10-p90]",
                 "total us med [p10-p90]", "vs off")


def _trace_body(rows: List[dict]) -> List[tuple]:
    out = []
    for r in rows:
        if r.get("error"):
            out.append((r["pattern"], str(r["tpb"]), r["policy"]) + ("-",) * (len(TRACE_HEADER) - 4)
                       + (f"ERROR: {r['error']}"[:120],))
            continue
        mean = lambda kind: sum(g["mean_held"] for g in r["groups"] if (g["window"] is None) == (kind == "full"))  # noqa: E731
        out.append((r["pattern"], str(r["tpb"]), r["policy"], str(r["prompt_tokens"]), str(r["computed_tokens"]),
                    str(r["hit_tokens"]), f"{r['hit_rate']:.1%}",
                    f"{r['first_turn_hit_tokens']}/{r['first_turn_prompt_tokens']}",
                    f"{r['swa_peak_in_use']}", f"{r['swa_peak_held']} ({mean('swa'):.0f})",
                    f"{r['full_peak_in_use']}", f"{r['full_peak_held']} ({mean('full'):.0f})",
                    f"{r['swa_evictions']}/{r['full_evictions']}", str(r["steps"]),
                    "ok" if r["consistent"] else "MISMATCH"))
    return out


def _add_body(rows: List[dict]) -> List[tuple]:
    out = []
    for r in rows:
        if r.get("error"):
            out.append((r["shape"], str(r["tpb"]), str(r["prompt_tokens"]), r["case"], "-", "-",
                        f"ERROR: {r['error']}"[:120], "-", "-"))
            continue
        out.append((r["shape"], str(r["tpb"]), str(r["prompt_tokens"]), r["case"], r["tokens"], str(r["hit_tokens"]),
                    _stat(r["add_ms"], "{:.2f}"), _stat(r["hash_ms"], "{:.2f}"), _stat(r["lookup_ms"], "{:.2f}")))
    return out


def _decode_body(rows: List[dict]) -> List[tuple]:
    out = []
    for r in rows:
        head = (r["shape"], str(r["tpb"]), str(r["batch"]), _seq(r["ctx"]), r["variant"])
        if r.get("error"):
            out.append(head + (f"ERROR: {r['error']}"[:160], "-", "-", "-"))
            continue
        out.append(head + (_stat(r["prepare_us"]), _stat(r["settle_us"]), _stat(r["total_us"]), _num(r["vs_off"])))
    return out


def _prefix_tables(result: dict, md: bool) -> List[str]:
    parts = []
    if result.get("trace"):
        parts += ["Multi-turn chat trace (slot counts per group kind; 'in use' = total - free - evictable, "
                  "'held' = total - free, peaks over stats() after every prepare_batch and settle; mean held "
                  "in parentheses):", "", _grid(TRACE_HEADER, _trace_body(result["trace"]), md), "",
                  "Policies: no-cache = prefix_caching off (scratch reuse on); cache-all-noscratch = caching, "
                  "swa_scratch_reuse=False, prefix_retention='all' (the hit-rate ceiling); "
                  "cache-boundaries-scratch = caching, swa_scratch_reuse=True, prefix_retention='boundaries'. "
                  "Pool: the same slots per group for every group and policy.", ""]
    if result.get("add"):
        parts += ["add() of a long prompt (hashing + lookup; hash = PrefixCache.new_seq, lookup = "
                  "PrefixCache.lookup, timed separately on the same tokens):", "",
                  _grid(ADD_HEADER, _add_body(result["add"]), md), ""]
    if result.get("decode"):
        parts += ["Decode-step host time (prepare_batch + settle; the device work waited for in between, untimed):",
                  "", _grid(DECODE_HEADER, _decode_body(result["decode"]), md), ""]
    return parts


def _head(result: dict, title: str, md: bool) -> List[str]:
    m = result["meta"]
    ver = _versions(m["versions"])
    if md:
        return [f"### {title} ({m['versions'].get('gpu', m['backend'])}, {m['date']})", "",
                f"Command: `{m['command']}`  ", f"Versions: {ver}  ", *[f"{x}  " for x in m["messages"]], ""]
    return [f"{title}, {m['date']}, backend {m['backend']}", f"command: {m['command']}", f"versions: {ver}",
            *m["messages"], ""]


def _tail(result: dict, md: bool) -> List[str]:
    lines = _targets_lines(result.get("targets", []))
    targets = result.get("targets", [])
    if result["meta"].get("settings", {}).get("smoke") and not all(t["ok"] for t in targets):
        lines.append("  (the targets are set for the full-size trace and shapes on a GPU host: a --smoke run's tiny "
                     "pools and prompts miss some of them without anything being wrong)")
    if result.get("failures"):
        lines += ["FAILED:"] + ["  " + f for f in result["failures"]]
    lines.append(f"elapsed: {result['meta']['elapsed_s']} s")
    return (["```"] + lines + ["```", ""]) if md else lines


def prefix_text(result: dict) -> str:
    return "\n".join(_head(result, "cupykv prefix-caching benchmark", False) + _prefix_tables(result, False)
                     + _tail(result, False))


def prefix_markdown(result: dict) -> str:
    return "\n".join(_head(result, "Prefix-caching benchmark", True) + _prefix_tables(result, True)
                     + _tail(result, True))


COPY_HEADER = ("case", "direction", "MiB", "runs", "host enqueue us med [p10-p90]", "device ms med [p10-p90]",
               "GB/s", "vs memcpy")
OVERLAP_HEADER = ("copy", "steps x batch", "copy alone ms", "steps alone ms", "sum ms", "together ms", "overlap",
                  "copy device ms alone / during", "steps ms during")


def _copy_body(rows: List[dict]) -> List[tuple]:
    out = []
    for r in rows:
        if r.get("error"):
            out.append((r["case"], r.get("direction", "-"), "-", "-", f"ERROR: {r['error']}"[:160], "-", "-", "-"))
            continue
        direction = r["direction"] if r["direction"] == r["kind"] else f"{r['direction']} ({r['kind']})"
        out.append((r["case"], direction, _num(r["bytes"] / 2 ** 20 if r["bytes"] else None, "{:.1f}"),
                    _num(r["copies"], "{}"), _stat(r["host_us"]), _stat(r["device_ms"], "{:.2f}"),
                    _num(r["gbps"], "{:.1f}"), _num(r["vs_memcpy"], "{:.0%}")))
    return out


def _overlap_body(rows: List[dict]) -> List[tuple]:
    out = []
    for r in rows:
        if r.get("error"):
            out.append((r["direction"], f"ERROR: {r['error']}"[:160]) + ("-",) * (len(OVERLAP_HEADER) - 2))
            continue
        out.append((r["direction"], f"{r['steps']} x {r['batch']}", _num(r["copy_alone_ms"]), _num(r["steps_alone_ms"]),
                    _num(r["sum_ms"]), _num(r["both_ms"]), _num(r["overlap"], "{:.0%}"),
                    f"{_num(r['copy_device_alone_ms'])} / {_num(r['copy_device_during_ms'])}",
                    _num(r["steps_during_ms"])))
    return out


def _host_tier_tables(result: dict, md: bool) -> List[str]:
    d = result.get("detail") or {}
    parts = []
    if d:
        groups = ", ".join(f"{'full' if g['window'] is None else 'window ' + str(g['window'])}: {g['layers']} layers, "
                           f"{g['slot_bytes'] / 2 ** 20:.3f} MiB/slot" for g in d.get("groups", []))
        parts += [f"{d.get('shape')}, {d.get('dtype')}, tokens_per_block {d.get('tpb')}, one {d.get('prompt')}-token "
                  f"request ({groups}); window-only bytes {d.get('window_only_bytes')}, whole-sequence bytes "
                  f"{d.get('whole_sequence_bytes', d.get('whole_sequence_bytes_counted'))} (counted: "
                  f"{d.get('whole_sequence_bytes_counted')})", ""]
    parts += ["Copies (device time between timing events on the copy's stream around the call; host = the call):",
              "", _grid(COPY_HEADER, _copy_body(result.get("copies", [])), md), ""]
    if result.get("overlap"):
        parts += ["Overlap with other requests' decode steps (wall ms; overlap = (sum - together) / shorter):", "",
                  _grid(OVERLAP_HEADER, _overlap_body(result["overlap"]), md), ""]
    return parts


def host_tier_text(result: dict) -> str:
    return "\n".join(_head(result, "cupykv host-tier benchmark", False) + _host_tier_tables(result, False)
                     + _tail(result, False))


def host_tier_markdown(result: dict) -> str:
    return "\n".join(_head(result, "Host-tier benchmark", True) + _host_tier_tables(result, True)
                     + _tail(result, True))


def write_named(result: dict, out_dir: str, stem: str, markdown_text: str) -> List[str]:
    """STEM.json and STEM.md in out_dir; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(paths[1], "w") as f:
        f.write(markdown_text)
    return paths
