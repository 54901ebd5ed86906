"""The machine a benchmark runs on: the versions it reports, and the device memory it gives back
between configurations."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import traceback

import numpy as np


def versions(backend_name: str) -> dict:
    """Python, numpy, platform, cupykv and its git revision, and (where present) cupy, CUDA, the GPU and
    torch. CUPYKV_SOURCE_REV names the source revision where the working tree's .git is not it."""
    v = dict(python=sys.version.split()[0], numpy=np.__version__, platform=platform.platform())
    try:
        from .. import __version__
        v["cupykv"] = __version__
    except Exception:   # noqa: BLE001
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=here)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=here)
        if rev.returncode == 0:
            v["git"] = rev.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except Exception:   # noqa: BLE001
        pass
    # A copied working tree may carry an older .git; whoever runs the benchmark can name the source tree.
    if os.environ.get("CUPYKV_SOURCE_REV"):
        v["git"] = os.environ["CUPYKV_SOURCE_REV"]
    try:
        import cupy
        v["cupy"] = cupy.__version__
        if backend_name == "cuda":
            rt = cupy.cuda.runtime
            v["cuda_runtime"] = rt.runtimeGetVersion()
            v["cuda_driver"] = rt.driverGetVersion()
            name = rt.getDeviceProperties(cupy.cuda.Device().id)["name"]
            v["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:   # noqa: BLE001
        pass
    try:
        import torch
        v["torch"] = torch.__version__
        if torch.cuda.is_available():
            v["torch_cuda"] = torch.version.cuda
    except Exception:   # noqa: BLE001
        pass
    return v


def free_device_memory() -> None:
    """Collect garbage and return torch's and CuPy's cached device memory (between configurations: the
    128k / batch 256 outputs are hundreds of MB each)."""
    import gc
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:   # noqa: BLE001
        pass
    try:
        import cupy
        if cupy.is_available():
            cupy.cuda.Device().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
    except Exception:   # noqa: BLE001
        pass


def log(msg: str) -> None:
    """A progress line on stderr (the results go to stdout and the output files)."""
    print(msg, file=sys.stderr, flush=True)


def failure(exc: BaseException, limit: int = 400, prefix: str = "") -> str:
    """Print the traceback of the exception being handled; return its one-line reason for a result row."""
    traceback.print_exc()
    return f"{prefix}{type(exc).__name__}: {exc}"[:limit]
