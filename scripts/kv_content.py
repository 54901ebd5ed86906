"""Random serving workloads with the KV-content check (tests/kvcontent.py), many seeds, with a summary line.

    python scripts/kv_content.py [--backend host|cuda] [--seeds N] [--first S] [--calls C] [--timing T]

Exits 1 at the first workload whose reads were wrong (the checker's report names the entry, position and
page), 0 when all read right: "N workloads, S steps, P positions read right".
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")]

from kvcontent import TIMINGS, KVContentError, Workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="host", choices=["host", "cuda"])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--timing", default="lazy", choices=sorted(TIMINGS), help="host backend only")
    a = ap.parse_args()
    steps = positions = 0
    t0 = time.perf_counter()
    for seed in range(a.first, a.first + a.seeds):
        try:
            w = Workload(seed, a.backend, a.timing if a.backend == "host" else "lazy").run(a.calls)
        except KVContentError as e:
            print(f"seed {seed}: FAILED\n{e}")
            return 1
        steps += w.steps
        positions += w.check.positions_checked
    print(f"kv-content ({a.backend}): {a.seeds} workloads, {steps} steps, {positions} positions read right "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
