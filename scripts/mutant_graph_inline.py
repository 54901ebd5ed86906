"""The control of tests/test_staging.py::test_small_steps_launch_inline_under_graphs_too: with every step
under graphs replayed (the behaviour before small steps launched inline), the test must fail.

    PYTHONPATH=. python scripts/mutant_graph_inline.py
"""
import sys
from pathlib import Path

import cupykv  # noqa: E402

if not cupykv.cuda_available():
    sys.exit("needs a usable CUDA GPU (the test it runs is a CUDA test)")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_staging  # noqa: E402
from cupykv.backends.cuda import CudaStepPlan  # noqa: E402

CudaStepPlan.small_steps_inline_under_graphs = False
try:
    test_staging.test_small_steps_launch_inline_under_graphs_too()
except AssertionError as exc:
    print("the control fails the test, as it must:", str(exc).splitlines()[0][:160])
else:
    sys.exit("the control passed: the test does not see whether small steps replay")
