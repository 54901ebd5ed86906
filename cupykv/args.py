"""Argument normalisation at the API edge.

Every count a user passes (a Python int or any numpy integer, never a bool) becomes a Python int here,
before any arithmetic: numpy integers keep their dtype through arithmetic, so `np.uint64(1)` turns an
int64 sum into float64 and `np.int16(200) * 200` wraps. Nothing past the API edge sees a numpy scalar.
"""
from __future__ import annotations

from typing import Optional, Type

import numpy as np

from .errors import CupykvError, InvalidRequestError


def is_count(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_count(value, what: str, *, minimum: int = 0, maximum: Optional[int] = None,
             error: Type[CupykvError] = InvalidRequestError) -> int:
    """`value` as a Python int in [minimum, maximum]; otherwise `error` naming `what` and the value.

    what: how the message names the argument, e.g. "num_gen_tokens" or "request 'a': accepted".
    """
    if not is_count(value):
        raise error(f"{what}={value!r} must be an int (Python or numpy), not {type(value).__name__}")
    n = int(value)
    if n < minimum or (maximum is not None and n > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise error(f"{what}={value!r} must be {bound}")
    return n
