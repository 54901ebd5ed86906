"""`python -m cupykv.bench`: the benchmark (see cupykv/bench/harness.py for what is measured).

Default: the full matrix (3 shapes x 32k/128k x batch 1/64/256 x 0/8 context chunks) on the GPU,
writing bench.json, bench.md (the README table) and bench.png (with matplotlib) to --out. Each
configuration runs cupykv with PER_LAYER tables beside the torch full-snapshot contender (eager and
compiled), and cupykv with SHARED tables beside the per-group-peer contender (persistent per-group
device tables, a write list per step), each with its floor.
--smoke: a tiny shape and a few steps, on the host backend unless --backend says otherwise.
Exit status 1 when any output differed from cupykv.reference or a configuration failed (timings are
never judged).

Subcommands (each with its own --help):
  python -m cupykv.bench prefix --out DIR      prefix caching: a multi-turn chat trace under three policies
                                               (hit rate, slots, evictions), add() of a 128k prompt, decode
                                               host time with caching on vs off (prefix.json, prefix.md)
  python -m cupykv.bench host-tier --out DIR   host tier: suspend / resume of a 128k-token GPT-OSS-120B
                                               request against a pinned memcpy, fragmented and whole-sequence
                                               copies, overlap with decode steps (host_tier.json, host_tier.md)
  python -m cupykv.bench devices --out DIR     one manager on 1 and 2 devices (devices=[0], [0, 0], [0, 1]):
                                               host and device time per decode step (devices.json, devices.md)
  python -m cupykv.bench serve --out DIR       transformers models served on cupykv against transformers'
                                               continuous batching and generate (serve.json, serve.md)
  python -m cupykv.bench transfer --out DIR    one 128k-token GPT-OSS-120B request moved between two managers:
                                               window-only against the whole sequence, NIXL and loopback
                                               against a plain device copy (transfer.json, transfer.md)
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


def _positive(ap: argparse.ArgumentParser, flag: str, value: Optional[int], minimum: int = 1) -> None:
    if value is not None and value < minimum:
        ap.error(f"{flag} {value}: needs a whole number >= {minimum}")


def _int_arg(text: str) -> int:
    """argparse type: a whole number with an optional k suffix (x 1024)."""
    try:
        vals = _ints(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: needs one whole number")
    return vals[0]


def _names(ap: argparse.ArgumentParser, flag: str, text: str, choices) -> List[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        ap.error(f"{flag} {text!r}: needs at least one of {', '.join(choices)}")
    for x in names:
        if x not in choices:
            ap.error(f"{flag}: unknown {x!r}; choose from {', '.join(choices)}")
    return names


def parse_prefix_args(argv: List[str]):
    """PrefixSettings from `python -m cupykv.bench prefix ...`; bad input exits with status 2."""
    from .prefix_trace import PARTS, PATTERNS, SMOKE_TRACE, PrefixSettings, TraceConfig
    from .prefix_trace import __doc__ as doc
    ap = argparse.ArgumentParser(prog="python -m cupykv.bench prefix", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out", help="directory for prefix.json / prefix.md (default bench_out; "
                    "'' writes nothing)")
    ap.add_argument("--backend", default=None, choices=("auto", "cuda", "host"),
                    help="default: auto (the GPU when usable; host with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and trace, few reps (CI; host backend)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default all)")
    ap.add_argument("--patterns", default=",".join(PATTERNS), help=f"layer patterns: {', '.join(PATTERNS)}")
    ap.add_argument("--tpb", default=None, help="tokens_per_block values, a comma list of powers of two "
                    "(default 16,32; --smoke 8); the decode part uses 32 if listed, else the first")
    ap.add_argument("--conversations", type=int, default=None, help="conversations in the trace (default 40)")
    ap.add_argument("--in-flight", type=int, default=None, help="most requests at once (table rows; default 8)")
    ap.add_argument("--chunk", type=_int_arg, default=None, help="longest prefill chunk in tokens (default 4096)")
    ap.add_argument("--step-tokens", type=_int_arg, default=None, help="tokens per step (default 8192)")
    ap.add_argument("--pool-frac", type=float, default=None,
                    help="slots per group as a fraction of the trace's distinct blocks (default 0.5)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the trace and the prompts (default 0)")
    ap.add_argument("--add-prompt", type=_int_arg, default=None, help="prompt tokens of the add() part (default 128k)")
    ap.add_argument("--reps", type=int, default=None, help="timed add() calls per case (default 7)")
    ap.add_argument("--decode-batch", type=int, default=None, help="decode batch (default 256)")
    ap.add_argument("--decode-ctx", type=_int_arg, default=None, help="decode context: max_seq_len, prompts in "
                    "[3/4 of it, it - steps) (default 32k)")
    ap.add_argument("--decode-steps", type=int, default=None, help="measured decode steps (default 200)")
    ap.add_argument("--decode-warmup", type=int, default=None, help="warm-up decode steps (default 20)")
    ap.add_argument("--emulate", action="store_true", help="host backend: run the step kernels' NumPy emulation "
                    "too (slow; nothing here reads the tables)")
    a = ap.parse_args(argv)
    parts = _names(ap, "--parts", a.parts, PARTS)
    patterns = _names(ap, "--patterns", a.patterns, list(PATTERNS))
    try:
        tpbs = _ints(a.tpb) if a.tpb is not None else ([8] if a.smoke else [16, 32])
    except ValueError as exc:
        ap.error(f"--tpb {a.tpb!r}: {exc}")
    if not tpbs or any(t < 1 or t & (t - 1) for t in tpbs):
        ap.error(f"--tpb {a.tpb!r}: needs powers of two")
    for flag, v, lo in (("--conversations", a.conversations, 1), ("--in-flight", a.in_flight, 1),
                        ("--chunk", a.chunk, 1), ("--step-tokens", a.step_tokens, 2), ("--reps", a.reps, 1),
                        ("--decode-batch", a.decode_batch, 1), ("--decode-steps", a.decode_steps, 2),
                        ("--decode-warmup", a.decode_warmup, 0)):
        _positive(ap, flag, v, lo)
    if a.pool_frac is not None and not a.pool_frac > 0:
        ap.error(f"--pool-frac {a.pool_frac}: needs a positive fraction")
    base = SMOKE_TRACE if a.smoke else TraceConfig()
    trace = TraceConfig(**{**base.__dict__, "seed": a.seed, **{k: v for k, v in (
        ("conversations", a.conversations), ("in_flight", a.in_flight), ("chunk", a.chunk),
        ("step_tokens", a.step_tokens), ("pool_frac", a.pool_frac)) if v is not None}})
    if trace.step_tokens <= trace.in_flight:
        ap.error(f"--step-tokens {trace.step_tokens}: must exceed --in-flight {trace.in_flight} (decode tokens come "
                 "first in a step)")
    d = dict(add_prompt=512, reps=2, decode_batch=4, decode_ctx=1024, decode_steps=6, decode_warmup=2) if a.smoke \
        else dict(add_prompt=131072, reps=7, decode_batch=256, decode_ctx=32768, decode_steps=200, decode_warmup=20)
    pick = lambda name, v: d[name] if v is None else v   # noqa: E731
    add_prompt, decode_ctx = pick("add_prompt", a.add_prompt), pick("decode_ctx", a.decode_ctx)
    steps, warmup = pick("decode_steps", a.decode_steps), pick("decode_warmup", a.decode_warmup)
    if add_prompt < 2 * max(tpbs):
        ap.error(f"--add-prompt {add_prompt}: needs at least two blocks ({2 * max(tpbs)} tokens)")
    if decode_ctx * 3 // 4 >= decode_ctx - steps - warmup - 2 * max(tpbs):
        ap.error(f"--decode-ctx {decode_ctx}: leaves no room for {steps + warmup} decode steps (prompts are drawn "
                 "from [3/4 of it, it - steps))")
    argv_list = list(argv)
    return PrefixSettings(patterns=patterns, tpbs=tpbs, parts=parts, trace=trace, add_prompt=add_prompt,
                          reps=pick("reps", a.reps), decode_batch=pick("decode_batch", a.decode_batch),
                          decode_ctx=decode_ctx, decode_steps=steps, decode_warmup=warmup,
                          backend=a.backend or ("host" if a.smoke else "auto"), emulate=a.emulate, smoke=a.smoke,
                          out=a.out or None, command=" ".join(["python -m cupykv.bench prefix"]
                                                              + [shlex.quote(x) for x in argv_list]))


def parse_host_tier_args(argv: List[str]):
    """HostTierSettings from `python -m cupykv.bench host-tier ...`; bad input exits with status 2. On the
    host backend (--smoke, --backend host, or auto without a GPU) the tiny sizes are the defaults."""
    from ..backends import cuda_available
    from .host_tier_bench import HostTierSettings, smoke_settings
    from .host_tier_bench import __doc__ as doc
    ap = argparse.ArgumentParser(prog="python -m cupykv.bench host-tier", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out", help="directory for host_tier.json / host_tier.md (default "
                    "bench_out; '' writes nothing)")
    ap.add_argument("--backend", default=None, choices=("auto", "cuda", "host"),
                    help="default: auto (the GPU when usable; host, with the tiny sizes, otherwise or with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="the tiny version on the host backend (CI)")
    ap.add_argument("--prompt", type=_int_arg, default=None, help="tokens of the moved request (default 128k)")
    ap.add_argument("--reps", type=int, default=None, help="timed round trips per case (default 5)")
    ap.add_argument("--frag-run", type=int, default=None,
                    help="slots per run in the fragmented case (default 1, the worst case; 0 skips it)")
    ap.add_argument("--bg-requests", type=int, default=None,
                    help="requests decoding during the overlap measurement (default 32; 0 skips it)")
    ap.add_argument("--bg-ctx", type=_int_arg, default=None, help="their context in tokens (default 4096)")
    ap.add_argument("--overlap-reps", type=int, default=None, help="repetitions of the overlap measurement (default 3)")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole-sequence (all full attention) case")
    a = ap.parse_args(argv)
    for flag, v, lo in (("--prompt", a.prompt, 1), ("--reps", a.reps, 1), ("--frag-run", a.frag_run, 0),
                        ("--bg-requests", a.bg_requests, 0), ("--bg-ctx", a.bg_ctx, 1),
                        ("--overlap-reps", a.overlap_reps, 1)):
        _positive(ap, flag, v, lo)
    backend = a.backend or ("host" if a.smoke else "auto")
    tiny = a.smoke or backend == "host" or (backend == "auto" and not cuda_available())
    base = smoke_settings() if tiny else HostTierSettings()
    kw = {k: v for k, v in (("prompt", a.prompt), ("reps", a.reps), ("frag_run", a.frag_run),
                            ("bg_requests", a.bg_requests), ("bg_ctx", a.bg_ctx), ("overlap_reps", a.overlap_reps))
          if v is not None}
    s = HostTierSettings(**{**base.__dict__, **kw})
    if s.prompt < 2 * s.tpb:
        ap.error(f"--prompt {s.prompt}: needs at least two blocks of {s.tpb} tokens")
    s.whole = not a.no_whole
    s.backend = backend
    s.smoke = tiny
    s.out = a.out or None
    s.command = " ".join(["python -m cupykv.bench host-tier"] + [shlex.quote(x) for x in argv])
    return s


def _subcommand(name: str, stem: str, argv: List[str], parse, run, text, markdown) -> int:
    """Parse, run, print the tables, write STEM.json / STEM.md; exit status 0, 1 when a part failed,
    2 on bad arguments or no usable backend."""
    from ..errors import BackendUnavailableError
    from .report import write_named
    settings = parse(argv)
    try:
        result = run(settings)
    except BackendUnavailableError as exc:
        print(f"python -m cupykv.bench {name}: {exc}", file=sys.stderr)
        return 2
    print(text(result))
    if settings.out:
        for path in write_named(result, settings.out, stem, markdown(result)):
            print(f"wrote {path}")
    return 1 if result["failures"] else 0


def main_prefix(argv: List[str]) -> int:
    """`python -m cupykv.bench prefix`: 1 also when the trace's token accounting disagreed with stats()."""
    from .prefix_trace import run_prefix
    from .report import prefix_markdown, prefix_text
    return _subcommand("prefix", "prefix", argv, parse_prefix_args, run_prefix, prefix_text, prefix_markdown)


def main_host_tier(argv: List[str]) -> int:
    """`python -m cupykv.bench host-tier`: suspend/resume against the pinned copy bandwidth."""
    from .host_tier_bench import run_host_tier
    from .report import host_tier_markdown, host_tier_text
    return _subcommand("host-tier", "host_tier", argv, parse_host_tier_args, run_host_tier, host_tier_text,
                       host_tier_markdown)


def _main_devices(argv: List[str]) -> int:
    from .devices_bench import main as main_devices
    return main_devices(argv)


def _main_transfer(argv: List[str]) -> int:
    from .transfer_bench import main as main_transfer
    return main_transfer(argv)


def _main_serve(argv: List[str]) -> int:
    from .serve import main as main_serve
    return main_serve(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark, print the table and write the outputs; the exit status (0: every output matched
    the reference and every configuration ran; 1: not; 2: bad arguments or no GPU for the full matrix).
    A first argument 'prefix', 'host-tier' or 'devices' runs that benchmark instead."""
    args = sys.argv[1:] if argv is None else list(argv)
    subcommands = {"prefix": main_prefix, "host-tier": main_host_tier, "devices": _main_devices,
                   "serve": _main_serve, "transfer": _main_transfer}
    if args and args[0] in subcommands:
        return subcommands[args[0]](args[1:])
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
