"""Backends: where the step pipeline's copies and kernels run.

Both backends offer the same small interface (see host.HostBackend for the reference version):
streams, events, pinned and device buffers, an H2D copy that reads its source when it executes, and
the three kernels (apply deltas, convert PER_LAYER, convert SHARED). The manager's pipeline is written
once against that interface.
"""
from __future__ import annotations

from ..errors import BackendUnavailableError, InvalidSpecError


def cuda_available() -> bool:
    """True when CuPy is importable and sees a usable GPU. Never raises."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


def make_backend(name: str = "auto"):
    """'cuda', 'host' or 'auto' (cuda when a GPU is usable, host otherwise)."""
    if name == "auto":
        name = "cuda" if cuda_available() else "host"
    if name == "host":
        from .host import HostBackend
        return HostBackend()
    if name == "cuda":
        if not cuda_available():
            raise BackendUnavailableError("backend='cuda' needs CuPy and a CUDA GPU; none is usable here "
                                          "(install cupykv[cuda12] or [cuda13], or use backend='host')")
        from .cuda import CudaBackend
        return CudaBackend()
    raise InvalidSpecError(f"backend={name!r}: must be 'cuda', 'host' or 'auto'")
