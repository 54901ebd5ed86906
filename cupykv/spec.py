"""CacheSpec: what the model looks like and how much cache to keep."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from .errors import InvalidSpecError

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
TABLE_MODES = ("per_layer", "shared")


def _fail(name: str, value, why: str) -> None:
    raise InvalidSpecError(f"CacheSpec.{name}={value!r}: {why}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(name: str, value) -> None:
    if not _is_int(value) or value <= 0:
        _fail(name, value, "must be a positive int")


@dataclass(frozen=True)
class CacheSpec:
    """The model's attention layout and the cache's limits.

    windows: one entry per layer, the sliding window in tokens, or None for full attention.
    sink_tokens: tokens at the start of the sequence that SWA layers always keep (an int for
        every layer, or one entry per layer).
    tokens_per_block: tokens in one block (a power of two).
    max_seq_len: the longest sequence (prompt plus generated tokens) a request may reach.
    max_batch: table rows, i.e. the most requests the manager holds at once.
    slots_per_group: slots per layer group (an int for every group, or a sequence in group order);
        when None, memory_bytes is split between the groups (see Layout.slots_per_group).
    swa_scratch_reuse: let context chunks of SWA groups share scratch slots for the blocks that will be
        out of the window once the chunk settles (PER_LAYER tables only).
    max_rewind: the most speculative tokens a single settle may reject.
    table_mode: "per_layer" (out[L, max_batch, 2, B]) or "shared" (out[groups, max_batch, 2, B]).
    max_step_tokens: the most new tokens one step may schedule (sizes the fixed write-position
        buffers); None means 8192 prefill tokens plus max_batch * (1 + max_rewind) decode tokens.
    """

    windows: Sequence[Optional[int]]
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    tokens_per_block: int = 32
    max_seq_len: int = 4096
    max_batch: int = 64
    sink_tokens: Union[int, Sequence[int]] = 0
    slots_per_group: Union[None, int, Sequence[int]] = None
    memory_bytes: Optional[int] = None
    swa_scratch_reuse: bool = True
    max_rewind: int = 0
    table_mode: str = "per_layer"
    max_step_tokens: Optional[int] = None
    windows_tuple: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        windows = tuple(self.windows) if self.windows is not None else ()
        if len(windows) == 0:
            _fail("windows", self.windows, "needs one entry per layer (None = full attention)")
        for i, w in enumerate(windows):
            if w is not None and (not _is_int(w) or w <= 0):
                _fail("windows", self.windows, f"layer {i} has window {w!r}; use a positive int or None")
        object.__setattr__(self, "windows_tuple", windows)
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        if self.dtype not in DTYPE_BYTES:
            _fail("dtype", self.dtype, f"must be one of {sorted(DTYPE_BYTES)}")
        _positive_int("tokens_per_block", self.tokens_per_block)
        if self.tokens_per_block & (self.tokens_per_block - 1):
            _fail("tokens_per_block", self.tokens_per_block, "must be a power of two")
        _positive_int("max_seq_len", self.max_seq_len)
        _positive_int("max_batch", self.max_batch)
        sinks = self.sinks_per_layer()
        for i, s in enumerate(sinks):
            if not _is_int(s) or s < 0:
                _fail("sink_tokens", self.sink_tokens, f"layer {i} has {s!r}; use an int >= 0")
        if not _is_int(self.max_rewind) or self.max_rewind < 0:
            _fail("max_rewind", self.max_rewind, "must be an int >= 0")
        if self.max_step_tokens is not None:
            _positive_int("max_step_tokens", self.max_step_tokens)
        if self.table_mode not in TABLE_MODES:
            _fail("table_mode", self.table_mode, f"must be one of {TABLE_MODES}")
        if self.table_mode == "shared" and self.swa_scratch_reuse and any(w is not None for w in windows):
            _fail("swa_scratch_reuse", self.swa_scratch_reuse,
                  "scratch pages alias across layers, which SHARED tables cannot express; "
                  "use table_mode='per_layer' or swa_scratch_reuse=False")
        if self.slots_per_group is None and self.memory_bytes is None:
            _fail("slots_per_group", None, "give slots_per_group or memory_bytes")
        if self.memory_bytes is not None:
            _positive_int("memory_bytes", self.memory_bytes)
        spg = self.slots_per_group
        if spg is not None:
            for v in ([spg] if _is_int(spg) else list(spg)):
                if not _is_int(v) or v <= 0:
                    _fail("slots_per_group", spg, "every entry must be a positive int")

    @property
    def num_layers(self) -> int:
        return len(self.windows_tuple)

    def sinks_per_layer(self) -> tuple:
        if _is_int(self.sink_tokens):
            return (self.sink_tokens,) * len(self.windows_tuple)
        sinks = tuple(self.sink_tokens)
        if len(sinks) != len(self.windows_tuple):
            _fail("sink_tokens", self.sink_tokens, f"needs {len(self.windows_tuple)} entries, one per layer")
        return sinks

    @property
    def step_token_capacity(self) -> int:
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return 8192 + self.max_batch * (1 + self.max_rewind)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
