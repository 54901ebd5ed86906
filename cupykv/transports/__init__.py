"""Transports that move a request's KV between two managers' storages (cupykv.transfer keeps the books).

loopback: a copy on one device (or between two host-backend storages), for tests and one-process runs.
nixl: NVIDIA's NIXL (the `nixl` package, an optional extra), imported only when used.
"""
from .loopback import LoopbackTransport

__all__ = ["LoopbackTransport"]
