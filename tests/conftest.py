import os

import pytest

import cupykv

# Without a GPU, Triton kernels (cupykv.hf's fast attention path) run under Triton's interpreter, which must be
# chosen before triton is first imported.
if not cupykv.cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from oracle import Capture, expected_tables  # noqa: F401 - for the test files that import them from here

BACKENDS = ["host", "cuda"]


def backend_or_skip(name: str) -> str:
    if name == "cuda" and not cupykv.cuda_available():
        pytest.skip("no usable CUDA GPU here (CuPy missing or no driver); the GPU suite runs on the H200")
    return name


def graph_count(backend) -> int:
    """Step graphs the backend holds (none on the host backend)."""
    return getattr(backend, "num_step_graphs", 0)


def replay_every_step(monkeypatch) -> None:
    """Make every step of a CUDA manager with use_graphs replay its graph, small ones too (by default a step
    that fits the smallest inline kernel is launched instead: tests/test_staging.py checks that), for the
    tests of the replays themselves. Nothing to do without a GPU."""
    if cupykv.cuda_available():
        from cupykv.backends.cuda import CudaStepPlan
        monkeypatch.setattr(CudaStepPlan, "small_steps_inline_under_graphs", False)


@pytest.fixture
def replays_staging(request, monkeypatch):
    """replay_every_step for the cases of a test parametrized by staging whose staging ends in "+replays"."""
    params = getattr(request.node, "callspec", None)
    if params is not None and str(params.params.get("staging", "")).endswith("+replays"):
        replay_every_step(monkeypatch)


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    return backend_or_skip(request.param)
