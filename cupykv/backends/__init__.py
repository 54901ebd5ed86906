"""Backends: where the step pipeline's copies and kernels run.

Both backends offer the same small interface (see host.HostBackend for the reference version):
streams, events, pinned and device buffers, an H2D copy that reads its source when it executes, the
step's two kernels (apply the deltas, build the tables and write positions), and step_plan(): a step's
device work planned once per ring-slot twin and run every step (plan.py; on CUDA one launch). The
manager's pipeline is written once against that interface.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

from ..args import is_count, is_ordered
from ..errors import BackendUnavailableError, InvalidSpecError


# What cupykv reads of a backend object first; a backend offers all of host.HostBackend's interface.
BACKEND_INTERFACE = ("xp", "stream", "is_stream", "record", "wait", "synchronize", "pinned_empty", "device_empty",
                     "step_plan")


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


def _why_no_cuda() -> str:
    """What cuda_available() found missing, for an error message."""
    try:
        import cupy
    except Exception as exc:      # noqa: BLE001  (an import can fail in many ways: a missing library too)
        return (f"CuPy does not import ({type(exc).__name__}: {exc}); install it with pip install -e "
                "\".[cuda12]\" or \".[cuda13]\"")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:      # noqa: BLE001
        return f"CuPy {cupy.__version__} is installed but finds no usable GPU or driver ({exc})"
    return f"CuPy {cupy.__version__} is installed and sees {count} device(s), none usable"


def make_backend(name: str = "auto", device: Optional[int] = None):
    """'cuda', 'host' or 'auto' (cuda when a GPU is usable, host otherwise); device: the CUDA device
    (default: the current one)."""
    return make_backends(name, None if device is None else [device])[0]


def make_backends(backend: Union[str, object] = "auto", devices: Optional[Sequence[int]] = None) -> list:
    """One backend per device of `devices` (None: one, on the current device).

    backend: 'cuda', 'host', 'auto', or a backend object (only with devices=None or one device: it is
    that device's). On the host backend the devices are simulated: one SimDevice runs every rank's
    streams, so a stream of one rank can wait for an event of another, as on GPUs.
    """
    ids = _device_ids(devices)
    if not isinstance(backend, str):
        if ids is not None and len(ids) > 1:
            raise InvalidSpecError(f"devices={list(devices)}: pass backend by name ('cuda', 'host', 'auto'); "
                                   "a backend object serves one device")
        missing = [name for name in BACKEND_INTERFACE if not hasattr(backend, name)]
        if missing:
            raise InvalidSpecError(f"backend={backend!r}: not a backend (no {', '.join(missing)}); pass 'cuda', "
                                   "'host', 'auto' or a backend object such as cupykv.backends.host.HostBackend()")
        return [backend]
    name = backend
    if name == "auto":
        name = "cuda" if cuda_available() else "host"
    if name == "host":
        from .host import HostBackend, SimDevice
        sim = SimDevice()
        return [HostBackend(device=sim, device_id=d) for d in (ids or [0])]
    if name == "cuda":
        if not cuda_available():
            raise BackendUnavailableError(f"backend='cuda' needs CuPy and a CUDA GPU; {_why_no_cuda()} "
                                          "(or use backend='host', or 'auto')")
        from .cuda import CudaBackend, device_count
        count = device_count()
        for d in ids or ():
            if d >= count:
                raise InvalidSpecError(f"devices={list(devices)}: device {d} does not exist (this machine has "
                                       f"{count} CUDA device(s))")
        return [CudaBackend(device=d) for d in (ids or [None])]
    raise InvalidSpecError(f"backend={name!r}: must be 'cuda', 'host' or 'auto'")


def _device_ids(devices) -> Optional[List[int]]:
    """devices as a list of non-negative ints (numpy ints too); None stays None."""
    if devices is None:
        return None
    if not is_ordered(devices):
        raise InvalidSpecError(f"devices={devices!r}: must be a list of device ids, e.g. [0, 1]")
    ids = list(devices)
    if not ids:
        raise InvalidSpecError("devices=[]: needs at least one device")
    for d in ids:
        if not is_count(d) or d < 0:        # numpy integers and 0-d integer arrays too
            raise InvalidSpecError(f"devices={ids}: {d!r} is not a device id (a non-negative integer)")
    return [int(d) for d in ids]
