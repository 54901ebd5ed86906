"""CacheSpec: what the model looks like and how much cache to keep."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from .args import as_count, as_flag, is_count, is_ordered
from .errors import InvalidSpecError

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
TABLE_MODES = ("per_layer", "shared")
PREFIX_RETENTIONS = ("boundaries", "all")
# The kernels and the snapshot hold token counts, slots and page indices as int32.
INT32_MAX = 2 ** 31 - 1


def _fail(name: str, value, why: str) -> None:
    raise InvalidSpecError(f"CacheSpec.{name}={value!r}: {why}")


def _count(name: str, value, minimum: int, maximum: Optional[int] = INT32_MAX) -> int:
    """A count field as a Python int in [minimum, maximum] (numpy integers too; bools and floats are
    refused)."""
    return as_count(value, f"CacheSpec.{name}", minimum=minimum, maximum=maximum, error=InvalidSpecError)


def _counts(name: str, value, minimum: int, what: str) -> tuple:
    """A sequence field as a tuple of Python ints, each >= minimum; `what` names one entry ("layer")."""
    if not is_ordered(value):
        _fail(name, value, f"must be an int >= {minimum} or a sequence of them")
    items = tuple(value)
    for i, v in enumerate(items):
        if not is_count(v) or not minimum <= v <= INT32_MAX:
            _fail(name, value, f"{what} {i} has {v!r}; use an int in [{minimum}, {INT32_MAX}]")
    return tuple(int(v) for v in items)


def _choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        _fail(name, value, f"must be one of {sorted(choices)}")


@dataclass(frozen=True)
class CacheSpec:
    """The model's attention layout and the cache's limits.

    windows: one entry per layer, the sliding window in tokens, or None for full attention.
    sink_tokens: tokens at the start of the sequence that SWA layers always keep (an int for
        every layer, or one entry per layer).
    tokens_per_block: tokens in one block (a power of two).
    max_seq_len: the longest sequence (prompt plus generated tokens) a request may reach.
    max_batch: table rows, i.e. the most requests the manager holds at once.
    slots_per_group: slots per layer group: an int for every group, a mapping from a window (None for
        full attention) or a (window, sink_tokens) pair to slots, or a sequence in group order (groups
        are ordered by their first layer); when None, memory_bytes is split between the groups (see
        Layout.slots_per_group).
    swa_scratch_reuse: let context chunks of SWA groups share scratch slots for the blocks that will be
        out of the window once the chunk settles (PER_LAYER tables only).
    max_rewind: the most speculative tokens a single settle may reject.
    table_mode: "per_layer" (out[L, max_batch, 2, B]) or "shared" (out[groups, max_batch, 2, B]).
    max_step_tokens: the most new tokens one step may schedule (sizes the fixed write-position
        buffers); None means 8192 prefill tokens plus max_batch * (1 + max_rewind) decode tokens.
    null_slot: reserve one slot per group that is never allocated or written; BAD cells of the output
        tables (and padding rows) hold its page index instead of -1, as tile-based kernels need.
    prefix_caching: reuse the KV of full blocks shared with earlier requests (add(..., tokens=...)).
    prefix_retention: which out-of-window blocks of sliding-window groups stay cached: "boundaries"
        (the windows of the prompt end, chunk ends, checkpoints and the request's end) or "all".
    prefix_events: record every block the prefix cache stores or removes for
        KVCacheManager.drain_cache_events (a router's view of the cache). They are kept until drained, so
        an engine that records them drains them regularly; off, nothing is kept. Needs prefix_caching.

    Counts may be Python or numpy integers, or 0-d numpy integer arrays (never bools or floats); the spec
    holds them as Python ints, and windows, and sink_tokens and slots_per_group given per layer or group, as
    tuples of them.
    """

    windows: Sequence[Optional[int]]
    num_kv_heads: int = None            # (required: None raises InvalidSpecError naming it)
    head_dim: int = None
    dtype: str = "bfloat16"
    tokens_per_block: int = 32
    max_seq_len: int = 4096
    max_batch: int = 64
    sink_tokens: Union[int, Sequence[int]] = 0
    slots_per_group: Union[None, int, Sequence[int], Mapping] = None
    memory_bytes: Optional[int] = None
    swa_scratch_reuse: bool = True
    max_rewind: int = 0
    table_mode: str = "per_layer"
    max_step_tokens: Optional[int] = None
    null_slot: bool = False
    prefix_caching: bool = False
    prefix_retention: str = "boundaries"
    prefix_events: bool = False
    windows_tuple: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)   # noqa: E731 - frozen dataclass
        windows = tuple(self.windows) if is_ordered(self.windows) else ()
        if not windows:
            _fail("windows", self.windows, "needs one entry per layer (None = full attention)")
        for i, w in enumerate(windows):
            if w is not None and (not is_count(w) or not 0 < w <= INT32_MAX):
                _fail("windows", self.windows, f"layer {i} has window {w!r}; use an int in [1, {INT32_MAX}] "
                      "or None")
        windows = tuple(None if w is None else int(w) for w in windows)
        put("windows", windows)
        put("windows_tuple", windows)
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) is None:
                _fail(name, None, "is required (the KV heads of a layer, and the size of one head)")
        put("num_kv_heads", _count("num_kv_heads", self.num_kv_heads, 1))
        put("head_dim", _count("head_dim", self.head_dim, 1))
        _choice("dtype", self.dtype, DTYPE_BYTES)
        tpb = _count("tokens_per_block", self.tokens_per_block, 1, 2 ** 30)
        if tpb & (tpb - 1):
            _fail("tokens_per_block", self.tokens_per_block, "must be a power of two")
        put("tokens_per_block", tpb)
        put("max_seq_len", _count("max_seq_len", self.max_seq_len, 1))
        put("max_batch", _count("max_batch", self.max_batch, 1))
        if is_count(self.sink_tokens):
            put("sink_tokens", _count("sink_tokens", self.sink_tokens, 0))
        else:
            sinks = _counts("sink_tokens", self.sink_tokens, 0, "layer")
            if len(sinks) != len(windows):
                _fail("sink_tokens", self.sink_tokens, f"needs {len(windows)} entries, one per layer")
            put("sink_tokens", sinks)
        put("max_rewind", _count("max_rewind", self.max_rewind, 0))
        if self.max_step_tokens is not None:
            put("max_step_tokens", _count("max_step_tokens", self.max_step_tokens, 1))
        elif self.step_token_capacity > INT32_MAX:     # the default, from max_batch and max_rewind
            _fail("max_rewind", self.max_rewind,
                  f"the default max_step_tokens, 8192 + max_batch x (1 + max_rewind) = {self.step_token_capacity} "
                  f"with max_batch={self.max_batch}, passes {INT32_MAX}; lower them or give max_step_tokens")
        _choice("table_mode", self.table_mode, TABLE_MODES)
        for name in ("swa_scratch_reuse", "prefix_caching", "null_slot", "prefix_events"):
            put(name, as_flag(getattr(self, name), f"CacheSpec.{name}", InvalidSpecError))
        _choice("prefix_retention", self.prefix_retention, PREFIX_RETENTIONS)
        if self.prefix_events and not self.prefix_caching:
            _fail("prefix_events", self.prefix_events, "records the prefix cache's events: it needs prefix_caching=True")
        if self.table_mode == "shared" and self.swa_scratch_reuse and any(w is not None for w in windows):
            _fail("swa_scratch_reuse", self.swa_scratch_reuse,
                  "scratch pages alias across layers, which SHARED tables cannot express; "
                  "use table_mode='per_layer' or swa_scratch_reuse=False")
        if self.slots_per_group is None and self.memory_bytes is None:
            _fail("slots_per_group", None, "give slots_per_group or memory_bytes")
        if self.memory_bytes is not None:
            put("memory_bytes", _count("memory_bytes", self.memory_bytes, 1, None))
        spg = self.slots_per_group
        if is_count(spg):
            put("slots_per_group", _count("slots_per_group", spg, 1))
        elif isinstance(spg, Mapping):
            windows_of = set(windows)
            sinks_of = self.sink_tokens if isinstance(self.sink_tokens, tuple) else (self.sink_tokens,) * len(windows)
            pairs = set(zip(windows, sinks_of))
            clean = {}
            for key, value in spg.items():
                if not (key in windows_of or (isinstance(key, tuple) and key in pairs)):
                    _fail("slots_per_group", spg, f"key {key!r} is no layer's window (windows {sorted(windows_of, key=str)}) "
                          "or (window, sink_tokens) pair")
                clean[key] = _count(f"slots_per_group[{key!r}]", value, 1)
            put("slots_per_group", frozenset(clean.items()))     # (hashable, as the frozen spec is)
        elif spg is not None:
            put("slots_per_group", _counts("slots_per_group", spg, 1, "group"))

    @property
    def num_layers(self) -> int:
        """Layers of the model (one window each)."""
        return len(self.windows_tuple)

    def sinks_per_layer(self) -> tuple:
        """Sink tokens of every layer (a tuple of ints, one per layer)."""
        if isinstance(self.sink_tokens, int):
            return (self.sink_tokens,) * len(self.windows_tuple)
        return self.sink_tokens

    @property
    def step_token_capacity(self) -> int:
        """The most new tokens one step may schedule: max_step_tokens, or its default."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return 8192 + self.max_batch * (1 + self.max_rewind)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one KV element of the spec's dtype."""
        return DTYPE_BYTES[self.dtype]

    def buffer_sizes(self) -> str:
        """What the manager's buffers grow with (for the error when they do not fit)."""
        return (f"the page table and the outputs grow with max_batch={self.max_batch} x (max_seq_len="
                f"{self.max_seq_len} + max_rewind={self.max_rewind}) / tokens_per_block, the write positions with "
                f"num_layers={self.num_layers} x max_step_tokens={self.step_token_capacity}"
                + ("" if self.max_step_tokens is not None else " (by default 8192 + max_batch x (1 + max_rewind))"))
