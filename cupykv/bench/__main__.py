"""`python -m cupykv.bench`: the benchmark (see cupykv/bench/harness.py for what is measured).

Default: the full matrix (3 shapes x 32k/128k x batch 1/64/256 x 0/8 context chunks) on the GPU,
writing bench.json, bench.md (the README table) and bench.png (with matplotlib) to --out. Each
configuration runs cupykv with PER_LAYER tables beside the torch full-snapshot contender (eager and
compiled), and cupykv with SHARED tables beside the per-group-peer contender (persistent per-group
device tables, a write list per step), each with its floor.
--smoke: a tiny shape and a few steps, on the host backend unless --backend says otherwise.
Exit status 1 when any output differed from cupykv.reference or a configuration failed (timings are
never judged).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import List, Optional

from .harness import SHAPES, Settings, run
from .report import summary_text, write_outputs


def _ints(text: str) -> List[int]:
    """A comma list of integers, each with an optional k suffix (x 1024): "32k,128k" -> [32768, 131072].
    ValueError names the part that is not one."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        digits = part[:-1] if mult > 1 else part
        if not digits.isdigit():
            raise ValueError(f"{part!r} is not a whole number (a k suffix multiplies by 1024)")
        out.append(int(digits) * mult)
    return out


def parse_args(argv: Optional[List[str]] = None) -> Settings:
    """The Settings the command line asks for (sys.argv when argv is None); bad input exits with status 2
    and a message naming the flag."""
    ap = argparse.ArgumentParser(prog="python -m cupykv.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--seq", default=None, help="max_seq_len values, e.g. 32k,128k (default 32k,128k)")
    ap.add_argument("--batch", default=None, help="decode batch sizes (default 1,64,256)")
    ap.add_argument("--contexts", default=None, help="context chunks per step (default 0,8)")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per context chunk (default 8192)")
    ap.add_argument("--steps", type=int, default=None,
                    help="measured steps per configuration (default 200; decode-only runs split them between "
                         "the decode and steady cases)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration (default 30)")
    ap.add_argument("--out", default="bench_out", help="directory for bench.json / bench.md / bench.png "
                    "(default bench_out; '' writes nothing)")
    ap.add_argument("--backend", default=None, choices=("auto", "cuda", "host"),
                    help="default: auto (host with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, few steps (CI; host backend)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch contenders")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    ap.add_argument("--no-shared", action="store_true",
                    help="skip the SHARED-table rows (cupykv-shared and the per-group-peer contender)")
    ap.add_argument("--compile", action="store_true", help="with --smoke: run the torch.compile contender too")
    ap.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    a = ap.parse_args(argv)
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    if a.smoke:
        d = dict(seqs=[256], batches=[1, 4], contexts=[0, 2], chunk=32, steps=6, warmup=2, tpb=8,
                 backend="host", compile=a.compile and not a.no_compile)
    else:
        d = dict(seqs=[32768, 131072], batches=[1, 64, 256], contexts=[0, 8], chunk=8192, steps=200, warmup=30,
                 tpb=32, backend="auto", compile=not a.no_compile)
    lists = {}
    for flag, text, default in (("--seq", a.seq, d["seqs"]), ("--batch", a.batch, d["batches"]),
                                ("--contexts", a.contexts, d["contexts"])):
        try:
            lists[flag] = _ints(text) if text is not None else default
        except ValueError as exc:
            ap.error(f"{flag} {text!r}: {exc}")
    seqs, batches, contexts = lists["--seq"], lists["--batch"], lists["--contexts"]
    if not seqs or not batches or not contexts or min(seqs) < 1 or min(batches) < 1:
        ap.error("--seq, --batch and --contexts need positive values (contexts may be 0)")
    if a.chunk is not None and a.chunk < 1:
        ap.error(f"--chunk {a.chunk}: needs a positive number of tokens")
    steps = a.steps if a.steps is not None else d["steps"]
    warmup = a.warmup if a.warmup is not None else d["warmup"]
    if steps < 2 or warmup < 0:
        ap.error("--steps must be >= 2 and --warmup >= 0")
    chunk = a.chunk if a.chunk is not None else d["chunk"]
    argv_list = sys.argv[1:] if argv is None else list(argv)
    return Settings(shapes=shapes, seqs=seqs, batches=batches, contexts=contexts, steps=steps, warmup=warmup,
                    chunk=chunk, tpb=d["tpb"], backend=a.backend or d["backend"],
                    torch=not a.no_torch, compile=d["compile"], seed=a.seed, out=a.out or None, smoke=a.smoke,
                    command=" ".join(["python -m cupykv.bench"] + [shlex.quote(x) for x in argv_list]),
                    plot=not a.no_plot, shared=not a.no_shared)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark, print the table and write the outputs; the exit status (0: every output matched
    the reference and every configuration ran; 1: not; 2: bad arguments or no GPU for the full matrix)."""
    settings = parse_args(argv)
    if settings.backend == "auto" and not settings.smoke:
        from ..backends import cuda_available
        if not cuda_available():
            print("no usable CUDA GPU: the full matrix on the host backend's NumPy emulation would take hours; "
                  "run with --smoke, or force it with --backend host", file=sys.stderr)
            return 2
    result = run(settings)
    print(summary_text(result))
    if settings.out:
        for line in write_outputs(result, settings.out, plot=settings.plot):
            print(("wrote " if not line.startswith("no plot") else "") + line)
    else:
        print("no --out: bench.json / bench.png not written")
    return 0 if result["checked"] and not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
