"""Compile-check cupykv/kernels/pipeline.cu with NVRTC; needs no GPU (cupy.RawModule would).

Runs in CI wherever CuPy and an NVRTC wheel are installed; skips, saying why, where they are not.
"""
import re
from pathlib import Path

import pytest

from cupykv import staging

SOURCE = Path(__file__).resolve().parent.parent / "cupykv" / "kernels" / "pipeline.cu"
KERNELS = ("cupykv_apply_deltas", "cupykv_build_step", "cupykv_write_kv_u16", "cupykv_write_kv_u32", "cupykv_gate")


def _is_missing_library(exc: BaseException) -> bool:
    # cuda.pathfinder raises DynamicLibNotFoundError (a RuntimeError) when no NVRTC library is found;
    # match by name so this test does not depend on where that class lives.
    return any(cls.__name__ == "DynamicLibNotFoundError" for cls in type(exc).__mro__)


def _compile_ptx(source: str) -> str:
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        pytest.skip(f"cupy is not importable ({exc}); install cupy-cuda12x to compile-check the kernels")
    try:
        prog = nvrtc.createProgram(source, "pipeline.cu", [], [])
    except Exception as exc:
        if _is_missing_library(exc):
            pytest.skip(f"no NVRTC library ({exc}); install nvidia-cuda-nvrtc-cu12 to compile-check the kernels")
        raise
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_90", "-std=c++17"])
    except Exception as exc:
        if _is_missing_library(exc):
            pytest.skip(f"no NVRTC library ({exc}); install nvidia-cuda-nvrtc-cu12 to compile-check the kernels")
        pytest.fail(f"pipeline.cu does not compile: {exc}\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def test_pipeline_compiles_with_nvrtc():
    ptx = _compile_ptx(SOURCE.read_text())
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    for name in KERNELS:
        # extern "C": the PTX entry is the plain name, which is what RawModule.get_function looks up
        assert name in entries, f"kernel {name} missing from the PTX entries {sorted(entries)}"


def test_header_indices_match_staging():
    """The kernels read the snapshot header by index; the indices must be staging.py's."""
    found = dict(re.findall(r"constexpr int (H_\w+) = (\d+);", SOURCE.read_text()))
    expected = {name: getattr(staging, name) for name in dir(staging) if name.startswith("H_")}
    assert expected, "staging.py defines no H_* header indices"
    assert {k: int(v) for k, v in found.items()} == expected
    assert max(expected.values()) < staging.HEADER_WORDS
