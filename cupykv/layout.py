"""Layer groups and the page math of DESIGN.md section 2.

Everything here is a pure function of the spec: no state, no allocation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from .errors import InvalidSpecError
from .spec import CacheSpec

BAD = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share a window and sink count, and so share one slot pool."""

    index: int
    window: Optional[int]        # None = full attention
    sink_tokens: int
    layers: Tuple[int, ...]      # model layer ids, in order

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def scale(self) -> int:
        """Pages per slot: K and V of every layer of the group."""
        return 2 * len(self.layers)

    @property
    def is_swa(self) -> bool:
        return self.window is not None


class Layout:
    """Groups, block counts and page-index math for one spec."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.tpb = spec.tokens_per_block
        self.max_blocks = cdiv(cdiv(spec.max_seq_len + spec.max_rewind + 1, self.tpb), 4) * 4
        by_key: dict = {}
        sinks = spec.sinks_per_layer()
        for layer, window in enumerate(spec.windows_tuple):
            key = (window, sinks[layer] if window is not None else 0)
            by_key.setdefault(key, []).append(layer)
        # groups in order of their first layer, so group ids are deterministic
        self.groups: Tuple[LayerGroup, ...] = tuple(
            LayerGroup(i, key[0], key[1], tuple(layers)) for i, (key, layers) in enumerate(by_key.items()))
        self.num_layers = spec.num_layers
        self.layer_group = np.empty(self.num_layers, np.int32)
        self.layer_index = np.empty(self.num_layers, np.int32)   # position of the layer within its group
        for g in self.groups:
            for i, layer in enumerate(g.layers):
                self.layer_group[layer] = g.index
                self.layer_index[layer] = i
        self.layer_koff = (2 * self.layer_index).astype(np.int32)  # K page offset; V is K + 1
        self.group_scale = np.array([g.scale for g in self.groups], np.int32)
        self.slots_per_group = self._slots_per_group()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # -- page math -----------------------------------------------------------------------------
    def layer_offset(self, layer: int, role: int) -> int:
        """Offset of layer's K (role 0) or V (role 1) page inside a slot of its group."""
        return int(self.layer_koff[layer]) + role

    def page_index(self, slot: int, layer: int, role: int) -> int:
        """PER_LAYER page index of (slot, layer, role)."""
        return slot * int(self.group_scale[self.layer_group[layer]]) + self.layer_offset(layer, role)

    def sink_blocks(self, group: LayerGroup) -> int:
        return cdiv(group.sink_tokens, self.tpb)

    def stale_range(self, group: LayerGroup, history: int) -> Tuple[int, int]:
        """Blocks no future query can see once `history` tokens are settled: [lo, hi)."""
        if group.window is None:
            return (0, 0)
        lo = self.sink_blocks(group)
        return (lo, max(lo, (history + 1 - group.window) // self.tpb))

    def scratch_range(self, group: LayerGroup, start: int, capacity: int) -> Tuple[int, int]:
        """Blocks of a context chunk [start, capacity) that get scratch pages instead of own slots.

        stale_range(capacity - max_rewind) ∩ [ceil(start / tpb), ceil(capacity / tpb)); `start` is the
        sequence length before the chunk (the history when the previous chunk has settled).
        Empty (0, 0) when scratch reuse is off or the group has full attention.
        """
        if not self.spec.swa_scratch_reuse or group.window is None:
            return (0, 0)
        lo, hi = self.stale_range(group, capacity - self.spec.max_rewind)
        lo = max(lo, cdiv(start, self.tpb))
        hi = min(hi, cdiv(capacity, self.tpb))
        return (lo, hi) if lo < hi else (0, 0)

    def scratch_slots_needed(self, group: LayerGroup, num_scratch_blocks: int) -> int:
        return cdiv(num_scratch_blocks * 2, group.scale)

    # -- sizing --------------------------------------------------------------------------------
    def slot_bytes(self, group: LayerGroup) -> int:
        s = self.spec
        return group.scale * self.tpb * s.num_kv_heads * s.head_dim * s.dtype_bytes

    def _slots_per_group(self) -> Tuple[int, ...]:
        s = self.spec
        if s.slots_per_group is not None:
            spg = s.slots_per_group
            if isinstance(spg, (int, np.integer)):
                return (spg,) * self.num_groups
            spg = tuple(spg)
            if len(spg) != self.num_groups:
                raise InvalidSpecError(
                    f"CacheSpec.slots_per_group={spg!r}: needs {self.num_groups} entries, one per layer group")
            return spg
        # Split memory_bytes in proportion to what each group needs per request: full attention keeps
        # every block, SWA keeps the window (plus one block for the partial edge, one for the next block
        # and the sinks).
        weights = []
        for g in self.groups:
            blocks = self.max_blocks if g.window is None else min(
                self.max_blocks, cdiv(g.window, self.tpb) + 2 + self.sink_blocks(g))
            weights.append(blocks * self.slot_bytes(g))
        total = sum(weights)
        slots = tuple(int(s.memory_bytes * w / total) // self.slot_bytes(g) for g, w in zip(self.groups, weights))
        if min(slots) <= 0:
            raise InvalidSpecError(f"CacheSpec.memory_bytes={s.memory_bytes}: too small for one slot per group "
                                   f"(slot bytes per group: {[self.slot_bytes(g) for g in self.groups]})")
        return slots
