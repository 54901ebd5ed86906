"""Recording: samples and checks per (case, contender), the result rows made from them, and the
issue's targets evaluated on those rows (reported, never asserted)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ROW_KEYS = ("shape", "max_seq_len", "batch", "contexts", "case", "contender", "table_mode", "n", "host_us",
            "device_us", "wall_us", "h2d_bytes", "host_total_us", "floor_device_us", "floor_host_us",
            "device_vs_floor", "checked", "error")
STAT_KEYS = ("median", "p10", "p90", "max")
FLOOR_ON_HOST = "floors are GPU timings; not measured on the host backend"


def stats(values) -> Optional[dict]:
    """median, p10, p90 and max of the values that are not None (None when there are none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    a = np.asarray(vals, np.float64)
    return dict(median=float(np.median(a)), p10=float(np.percentile(a, 10)), p90=float(np.percentile(a, 90)),
                max=float(a.max()))


def is_floor(row: dict) -> bool:
    """A floor row ("floor", "floor-shared"): a measurement of the hardware, not an implementation."""
    return row["contender"].startswith("floor")


def live_bytes(planes: int, num_seqs: int, max_blocks: int) -> int:
    """Bytes of the output rows a step writes: planes (layers, or groups for SHARED) x entries x K/V x B."""
    return planes * num_seqs * 2 * max_blocks * 4


class Recorder:
    """Samples per (case, contender) for one (shape, seq, batch)."""

    def __init__(self):
        self.samples: Dict[Tuple[str, str], Dict[str, list]] = {}
        self.checks: Dict[Tuple[str, str], List[int]] = {}     # [checks done, mismatches]
        self.errors: Dict[Tuple[str, str], str] = {}

    def add(self, case: str, contender: str, **vals) -> None:
        d = self.samples.setdefault((case, contender), {})
        for k, v in vals.items():
            d.setdefault(k, []).append(v)

    def check(self, case: str, contender: str, ok: bool) -> None:
        c = self.checks.setdefault((case, contender), [0, 0])
        c[0] += 1
        c[1] += (not ok)

    def fail(self, cases: Sequence[str], contender: str, why: str) -> None:
        for case in cases:
            self.errors[(case, contender)] = why

    def row(self, base: dict, name: str, floor: Tuple[list, list, list], with_total: bool) -> dict:
        """The result row of contender `name` in the case of `base`; `floor` is (host, device, wall)
        samples of the floor it is compared with; with_total: a cupykv row (schedule + prepare + settle)."""
        case = base["case"]
        s = self.samples.get((case, name), {})
        fh, fd, _ = floor
        fmed = _median(fd)
        dv = stats(s.get("device_us", []))
        chk = self.checks.get((case, name), [0, 0])
        return dict(base, contender=name, n=len(s.get("host_us", [])), host_us=stats(s.get("host_us", [])),
                    device_us=dv, wall_us=stats(s.get("wall_us", [])), h2d_bytes=stats(s.get("h2d_bytes", [])),
                    host_total_us=stats(s.get("host_total_us", [])) if with_total else None,
                    floor_device_us=fmed, floor_host_us=_median(fh),
                    device_vs_floor=(dv["median"] / fmed) if (dv and fmed) else None,
                    checked=(chk[1] == 0) if chk[0] else None, checks=chk[0], mismatches=chk[1],
                    error=self.errors.get((case, name)),
                    gate_timeouts=int(sum(not g for g in s.get("gate_ok", []))))


def _median(samples: list) -> Optional[float]:
    s = stats(samples)
    return s["median"] if s else None


def floor_row(base: dict, name: str, floor: Tuple[list, list, list], cuda: bool) -> dict:
    """The floor's row: host = 4 KiB copy + one launch, device = memset of base's live bytes."""
    fh, fd, fw = floor
    fmed = _median(fd)
    return dict(base, contender=name, n=len(fd) if fd else len(fh), host_us=stats(fh), device_us=stats(fd),
                wall_us=stats(fw), h2d_bytes=stats([4096] * len(fh)) if fh else None, host_total_us=None,
                floor_device_us=fmed, floor_host_us=_median(fh), device_vs_floor=1.0 if fmed else None,
                checked=None, checks=0, mismatches=0, error=None if cuda else FLOOR_ON_HOST)


def error_row(shape: str, seq: int, batch: int, nctx: int, case: str, why: str) -> dict:
    """The row of a configuration that failed before it produced rows."""
    row = {k: None for k in ROW_KEYS}
    row.update(shape=shape, max_seq_len=seq, batch=batch, contexts=nctx, case=case, contender="cupykv",
               table_mode="per_layer", n=0, checked=False, checks=0, mismatches=0, error=why)
    return row


def evaluate_targets(rows: List[dict]) -> List[dict]:
    """The issue's targets, evaluated on the PER_LAYER cupykv rows (reported, never asserted)."""
    out = []
    for r in rows:
        if r["contender"] not in ("cupykv", "cupykv-graphs") or not r["host_us"]:
            continue
        cfg = f"{r['shape']} {r['max_seq_len'] // 1024}k b{r['batch']} c{r['contexts']} {r['case']} {r['contender']}"
        if r["case"] == "decode" and r["device_us"] and r["floor_device_us"]:
            limit = 1.3 * r["floor_device_us"] + 10.0
            out.append(dict(target="device <= 1.3 x floor + 10 us", config=cfg, value=r["device_us"]["median"],
                            limit=limit, unit="us", ok=r["device_us"]["median"] <= limit))
        if r["batch"] >= 256 and r["case"] == "decode":
            out.append(dict(target="prepare_batch host enqueue < 50 us (batch 256)", config=cfg,
                            value=r["host_us"]["median"], limit=50.0, unit="us", ok=r["host_us"]["median"] < 50.0))
            out.append(dict(target="schedule + prepare + settle < 300 us (batch 256)", config=cfg,
                            value=r["host_total_us"]["median"], limit=300.0, unit="us",
                            ok=r["host_total_us"]["median"] < 300.0))
            out.append(dict(target="H2D bytes per decode step < 64 KB (batch 256, p90)", config=cfg,
                            value=r["h2d_bytes"]["p90"], limit=65536, unit="B", ok=r["h2d_bytes"]["p90"] < 65536))
    return out
