"""The layout of one spec: its layer groups (groups.py holds their block rules) and the page math of
the README's Concepts section.

Everything here is a pure function of the spec: no state, no allocation.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from .args import as_count
from .errors import InvalidSpecError
from .groups import LayerGroup, cdiv, make_group
from .spec import INT32_MAX, CacheSpec

BAD = -1
# A run of at least this many BAD cells ships as one value, a fill run (staging.run_values); a run of held
# cells cleared at once by slices (a freed row, a long window release: table.PageTable.take_blocks) is
# logged as a range, which ships as a fill run whatever the step.
FILL_MIN_RUN = 16
# Blocks per 16-byte access of a table row (one int4: the kernels' loads and stores of table cells); every
# row holds a multiple of this many blocks, so each such access is aligned.
QUAD_BLOCKS = 4

# An empty int64 index array (no cells, no rows, no entries), shared by every path with nothing to index,
# so read-only.
NO_INDEX = np.empty(0, np.int64)
NO_INDEX.flags.writeable = False


class Layout:
    """Groups, block counts and page-index math for one spec."""

    def __init__(self, spec: CacheSpec):
        if not isinstance(spec, CacheSpec):
            raise InvalidSpecError(f"Layout(spec={spec!r}): needs a cupykv.CacheSpec")
        self.spec = spec
        self.tpb = spec.tokens_per_block
        self.max_blocks = cdiv(cdiv(spec.max_seq_len + spec.max_rewind + 1, self.tpb), QUAD_BLOCKS) * QUAD_BLOCKS
        by_key: dict = {}
        sinks = spec.sinks_per_layer()
        for layer, window in enumerate(spec.windows_tuple):
            key = (window, sinks[layer] if window is not None else 0)
            by_key.setdefault(key, []).append(layer)
        # groups in order of their first layer, so group ids are deterministic
        self.groups: Tuple[LayerGroup, ...] = tuple(
            make_group(i, key[0], key[1], tuple(layers), tokens_per_block=self.tpb, max_rewind=spec.max_rewind,
                       scratch_reuse=spec.swa_scratch_reuse) for i, (key, layers) in enumerate(by_key.items()))
        self.num_layers = spec.num_layers
        self.layer_group = np.empty(self.num_layers, np.int32)
        self.layer_index = np.empty(self.num_layers, np.int32)   # position of the layer within its group
        for g in self.groups:
            for i, layer in enumerate(g.layers):
                self.layer_group[layer] = g.index
                self.layer_index[layer] = i
        self.layer_koff = (2 * self.layer_index).astype(np.int32)  # K page offset; V is K + 1
        # The layers of each group, for kernels that walk a group's layers: [P + 1] starts into the layer
        # list that follows, then the layer indices, group by group (each group's in layer order).
        starts = np.cumsum([0] + [len(g.layers) for g in self.groups])
        self.group_layers = np.concatenate([starts, *[g.layers for g in self.groups]]).astype(np.int32)
        self.group_scale = np.array([g.scale for g in self.groups], np.int32)
        self.slots_per_group = self._slots_per_group()
        for g, n in zip(self.groups, self.slots_per_group):
            if n * g.scale > INT32_MAX + 1:     # page indices (slot * scale + the layer's page) are int32
                given = ("slots_per_group" if spec.slots_per_group is not None
                         else f"memory_bytes={spec.memory_bytes}, split between the groups,")
                raise InvalidSpecError(f"CacheSpec: {given} gives group {g.index} ({len(g.layers)} layers, {g.scale} "
                                       f"pages a slot) {n} slots, {n * g.scale} pages; int32 page indices allow at "
                                       f"most {(INT32_MAX + 1) // g.scale} slots")
        if spec.null_slot and min(self.slots_per_group) < 2:
            raise InvalidSpecError(f"CacheSpec.null_slot=True: every group needs 2 slots or more (one is the "
                                   f"null slot); slots per group: {self.slots_per_group}")
        # With null_slot, each group's last slot is reserved: never allocated, never written, zero-filled.
        self.null_slots = (tuple(n - 1 for n in self.slots_per_group) if spec.null_slot else None)
        self.allocatable_slots = tuple(n - (1 if spec.null_slot else 0) for n in self.slots_per_group)

    @property
    def num_groups(self) -> int:
        """Layer groups (layers of one window and sink count)."""
        return len(self.groups)

    # -- page math -----------------------------------------------------------------------------
    def layer_offset(self, layer: int, role: int) -> int:
        """Offset of layer's K (role 0) or V (role 1) page inside a slot of its group."""
        return int(self.layer_koff[layer]) + role

    def page_index(self, slot: int, layer: int, role: int) -> int:
        """PER_LAYER page index of (slot, layer, role)."""
        return slot * int(self.group_scale[self.layer_group[layer]]) + self.layer_offset(layer, role)

    # The block rules live on the groups (the manager and the prefix cache call them there); these forward
    # to them for code that holds a Layout and a group (the benchmark's workload, the tests).
    def sink_blocks(self, group: LayerGroup) -> int:
        """Blocks a sliding-window group always keeps (its sink tokens, rounded up to blocks)."""
        return group.sink_blocks

    def stale_range(self, group: LayerGroup, history: int) -> Tuple[int, int]:
        """[lo, hi): the blocks no query after `history` settled tokens can see (empty without a window)."""
        return group.stale_range(as_count(history, "stale_range: history"))

    def scratch_range(self, group: LayerGroup, start: int, capacity: int) -> Tuple[int, int]:
        """[lo, hi): the blocks of a chunk from `start` to `capacity` tokens that get scratch slots."""
        return group.scratch_range(as_count(start, "scratch_range: start"),
                                   as_count(capacity, "scratch_range: capacity"))

    def scratch_slots_needed(self, group: LayerGroup, num_scratch_blocks: int) -> int:
        """Scratch slots that many scratch blocks borrow: ceil(2 * blocks / scale)."""
        return group.scratch_slots_needed(as_count(num_scratch_blocks, "scratch_slots_needed: num_scratch_blocks"))

    # -- sizing --------------------------------------------------------------------------------
    def slot_bytes(self, group: LayerGroup) -> int:
        """Bytes of one slot of the group: K and V of a block for every layer of it."""
        s = self.spec
        return group.scale * self.tpb * s.num_kv_heads * s.head_dim * s.dtype_bytes

    def _slots_per_group(self) -> Tuple[int, ...]:
        s = self.spec
        if s.slots_per_group is not None:
            spg = s.slots_per_group
            if isinstance(spg, (int, np.integer)):
                return (spg,) * self.num_groups
            if isinstance(spg, frozenset):      # by window or (window, sink_tokens): CacheSpec checked the keys
                by = dict(spg)
                missing = [g.window for g in self.groups if (g.window, g.sink_tokens) not in by and g.window not in by]
                if missing:
                    raise InvalidSpecError(f"CacheSpec.slots_per_group={by!r}: no entry for the groups of windows "
                                           f"{missing}")
                return tuple(by.get((g.window, g.sink_tokens), by.get(g.window)) for g in self.groups)
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
