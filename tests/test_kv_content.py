"""KV content through the public API: every position a query can see holds the KV of the request's own
tokens there (tests/kvcontent.py), under random serving workloads with prefix caching, salts, a small host
tier (cached blocks move both ways), suspend/resume, rewinds and an overlap scheduler, and in the replay of
the call sequence of a report where a prefix hit read another request's KV on CUDA.

On the host backend each workload also runs with the simulated streams eager (queued work runs as soon as it
can, as on a GPU ahead of the host) and with one stream held behind the others (the host tier's, or the
manager's): a wait missing between two streams shows as wrong KV in one of these timings. CUPYKV_KV_SEEDS
sets the number of random workloads per case (the GPU suite runs many more)."""
import os
import sys

import pytest

from conftest import backend_or_skip
from kvcontent import TIMINGS, Workload

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import replay_kv  # noqa: E402

SEEDS = int(os.environ.get("CUPYKV_KV_SEEDS", "12"))
CASES = [("host", t) for t in TIMINGS] + [("cuda", "device")]


@pytest.mark.parametrize("backend,timing", CASES)
def test_replay_of_the_cuda_prefix_hit_report(backend, timing):
    backend_or_skip(backend)
    check = replay_kv.replay(replay_kv.TRACE, backend, eager=TIMINGS.get(timing) is not None,
                             lazy=TIMINGS.get(timing) or "", log=lambda *a: None)
    assert check.steps_checked > 150 and check.positions_checked > 40000


@pytest.mark.parametrize("backend,timing", CASES)
def test_random_workloads_read_their_own_kv(backend, timing):
    backend_or_skip(backend)
    steps = 0
    for seed in range(SEEDS):
        w = Workload(seed, backend, timing).run(500)
        steps += w.steps
    assert steps > 10 * SEEDS
