"""Errors raised by cupykv.

Every public operation validates before it mutates, so when one of these is raised the manager is
exactly as it was before the call.
"""
from __future__ import annotations


class CupykvError(Exception):
    """Base class of every error cupykv raises on purpose."""


class InvalidSpecError(CupykvError, ValueError):
    """A CacheSpec field (or a manager option) has a bad value; the message names the field."""


class SpecTooLargeError(InvalidSpecError, MemoryError):
    """The buffers a CacheSpec sizes (the page table, the outputs, the write positions, the snapshot ring)
    do not fit in this machine's host or device memory; the message names the fields that size them."""


class UnknownRequestError(CupykvError, KeyError):
    """A request id that the manager does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want a readable sentence
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(CupykvError, ValueError):
    """A request id given twice (added twice, or twice in one batch)."""


class InvalidRequestError(CupykvError, ValueError):
    """A call that does not fit the request's state (e.g. decoding before its prompt is scheduled)."""


class OutOfSlotsError(CupykvError):
    """A group's slot pool cannot serve the whole step; nothing was allocated."""


class CapacityExceededError(CupykvError):
    """max_seq_len, max_batch or max_rewind would be exceeded."""


class StagingExhaustedError(CupykvError):
    """Every snapshot slot is still in flight and none completed within the timeout."""


class StepOrderError(CupykvError):
    """Steps used out of order: preparing before the previous step was finished, settling twice, ..."""


class UnknownDeviceError(CupykvError, IndexError):
    """A device rank (step.on(rank)) the manager does not have."""


class BackendUnavailableError(CupykvError, RuntimeError):
    """The requested backend cannot run here (no CuPy, no driver, no GPU)."""
