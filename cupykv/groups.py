"""Layer groups and their block rules: which blocks of a sequence hold a slot, which are stale, which a
context chunk maps onto scratch, what a rewind gives back.

Full attention and sliding window differ in one hook, `stale_end` (like vLLM's get_num_skipped_tokens):
a full-attention group never lets a block go stale; a sliding-window group lets every block below the
window go, except its sink blocks. Every other rule is written once, on top of that hook, and works on
Python ints and on int64 arrays alike, so the manager's vectorised hot path and the readable rule are the
same code.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Tuple

import numpy as np


def cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share a window and sink count, and so share one slot pool: full attention.

    tokens_per_block, max_rewind and scratch_reuse come from the spec (a group's rules depend on them).
    """

    index: int
    window: Optional[int]        # None = full attention
    sink_tokens: int
    layers: Tuple[int, ...]      # model layer ids, in order
    tokens_per_block: int = 1
    max_rewind: int = 0
    scratch_reuse: bool = False

    keeps_every_block = True     # no block ever goes stale: settle need not look at this group

    @property
    def num_layers(self) -> int:
        """Layers in the group."""
        return len(self.layers)

    @cached_property
    def scale(self) -> int:
        """Pages per slot: K and V of every layer of the group."""
        return 2 * len(self.layers)

    @property
    def is_swa(self) -> bool:
        """Whether the group slides (has a window)."""
        return self.window is not None

    @cached_property
    def sink_blocks(self) -> int:
        """Blocks at the start of a sequence that never go stale (ceil(sink_tokens / tpb))."""
        return cdiv(self.sink_tokens, self.tokens_per_block)

    @cached_property
    def _shift(self) -> int:
        return self.tokens_per_block.bit_length() - 1     # tokens_per_block is a power of two

    # -- the hook ----------------------------------------------------------------------------------
    def stale_end(self, history):
        """End of the stale range once `history` tokens are settled (an int or an int64 array): blocks
        [sink_blocks, stale_end) can be seen by no future query. Full attention: nothing is stale."""
        return self.sink_blocks if isinstance(history, (int, np.integer)) else np.full_like(history, self.sink_blocks)

    # -- rules built on it -------------------------------------------------------------------------
    def stale_range(self, history: int) -> Tuple[int, int]:
        """Blocks no future query can see once `history` tokens are settled: [lo, hi); empty when none is,
        (0, 0) for full attention and (sink_blocks, sink_blocks) for a window."""
        lo, hi = self.sink_blocks, int(self.stale_end(history))
        return (lo, hi) if hi > lo else ((0, 0) if self.keeps_every_block else (lo, lo))

    def scratch_range(self, start: int, capacity: int) -> Tuple[int, int]:
        """Blocks of a context chunk [start, capacity) that get scratch pages instead of own slots.

        stale_range(capacity - max_rewind) ∩ [ceil(start / tpb), ceil(capacity / tpb)): the blocks that
        are stale by the time the chunk settles, even if max_rewind tokens are rejected. `start` is the
        sequence length before the chunk. (0, 0) when scratch reuse is off or nothing qualifies.
        """
        if not self.scratch_reuse or self.keeps_every_block:     # (nothing is ever stale)
            return (0, 0)
        lo, hi = self.stale_range(capacity - self.max_rewind)
        first, end = self.new_blocks(start, capacity)
        lo, hi = max(lo, first), min(hi, end)
        return (lo, hi) if lo < hi else (0, 0)

    def scratch_slots_needed(self, num_scratch_blocks: int) -> int:
        """Scratch slots a chunk borrows: every layer aliases them, two pages per block."""
        return cdiv(num_scratch_blocks * 2, self.scale)

    def new_blocks(self, start, capacity):
        """Blocks that tokens [start, capacity) open: [ceil(start / tpb), ceil(capacity / tpb)) (ints or
        int64 arrays, >= 0)."""
        up = self.tokens_per_block - 1
        return (start + up) >> self._shift, (capacity + up) >> self._shift

    def block_room(self, capacity):
        """Tokens a sequence of `capacity` tokens can take before it opens a block: what its last block has
        left (new_blocks(capacity, capacity + block_room(capacity)) is empty; ints or int64 arrays)."""
        return (self.new_blocks(0, capacity)[1] << self._shift) - capacity

    def rewind_blocks(self, capacity: int, rejected: int) -> Tuple[int, int]:
        """Blocks that rejecting the last `rejected` of `capacity` tokens gives back (never stale ones:
        a rewind only undoes the newest tokens)."""
        lo, hi = self.new_blocks(capacity - rejected, capacity)
        return lo, hi


@dataclass(frozen=True)
class SlidingWindowGroup(LayerGroup):
    """A sliding-window group: a query at position h sees keys (h - window, h] and the sink tokens."""

    keeps_every_block = False

    def stale_end(self, history):
        edge = (history + (1 - self.window)) >> self._shift     # floor division by tpb (may be negative)
        return max(self.sink_blocks, edge) if isinstance(edge, int) else np.maximum(self.sink_blocks, edge)


def make_group(index: int, window: Optional[int], sink_tokens: int, layers: Tuple[int, ...], *,
               tokens_per_block: int, max_rewind: int, scratch_reuse: bool) -> LayerGroup:
    cls = LayerGroup if window is None else SlidingWindowGroup
    return cls(index, window, sink_tokens if window is not None else 0, tuple(layers), tokens_per_block,
               max_rewind, scratch_reuse)
