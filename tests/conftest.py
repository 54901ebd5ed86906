import pytest

import cupykv
from oracle import Capture, expected_tables  # noqa: F401 - for the test files that import them from here

BACKENDS = ["host", "cuda"]


def backend_or_skip(name: str) -> str:
    if name == "cuda" and not cupykv.cuda_available():
        pytest.skip("no usable CUDA GPU here (CuPy missing or no driver); the GPU suite runs on the H200")
    return name


def graph_count(backend) -> int:
    """Step graphs the backend holds (none on the host backend)."""
    return getattr(backend, "num_step_graphs", 0)


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    return backend_or_skip(request.param)
