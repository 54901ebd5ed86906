"""cupykv: a paged KV-cache manager for models with mixed attention windows, on CuPy.

Importing cupykv creates no stream, event, pinned buffer or device array, and works without CuPy.
"""
from .errors import (BackendUnavailableError, CapacityExceededError, CupykvError, DuplicateRequestError,
                     InvalidRequestError, InvalidSpecError, OutOfSlotsError, SpecTooLargeError,
                     StagingExhaustedError, StepOrderError, UnknownDeviceError, UnknownRequestError)
from .layout import BAD, Layout, LayerGroup
from .manager import KVCacheManager, Request
from .step import Step
from .spec import CacheSpec
from .backends import cuda_available
from . import host_tier, interop, storage      # cupykv.storage.KVStorage etc. after `import cupykv`
from .host_tier import HostTierFullError
from .interop import InteropUnavailableError
from .storage import KVStorage, StorageDtypeError

__version__ = "0.1.0"

__all__ = [
    "BAD", "CacheSpec", "KVCacheManager", "KVStorage", "Layout", "LayerGroup", "Request", "Step", "cuda_available",
    "CupykvError", "InvalidSpecError", "SpecTooLargeError", "UnknownRequestError", "DuplicateRequestError",
    "InvalidRequestError",
    "OutOfSlotsError", "CapacityExceededError", "StagingExhaustedError", "StepOrderError",
    "UnknownDeviceError", "BackendUnavailableError", "HostTierFullError", "InteropUnavailableError", "StorageDtypeError",
]
