"""Page math of the README's "Concepts" and docs/design.md's "Ranges", checked against numbers worked out
by hand (in the comments).

No manager here: Layout is a pure function of the spec.
"""
import numpy as np
import pytest

import cupykv
from cupykv import CacheSpec, InvalidSpecError, Layout


def gpt_oss_spec(**kw):
    # 36 layers alternating SWA(128) / full, as in GPT-OSS-120B.
    args = dict(windows=[128, None] * 18, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                tokens_per_block=32, max_seq_len=131072, max_batch=256, slots_per_group=1024)
    args.update(kw)
    return CacheSpec(**args)


def gemma3_windows():
    # 5 SWA (1024) : 1 full; layers with index % 6 == 5 are full.
    return [None if i % 6 == 5 else 1024 for i in range(62)]


def gemma3_spec(**kw):
    args = dict(windows=gemma3_windows(), num_kv_heads=8, head_dim=64, dtype="bfloat16",
                tokens_per_block=32, max_seq_len=131072, max_batch=64, slots_per_group=512)
    args.update(kw)
    return CacheSpec(**args)


# --------------------------------------------------------------------------------------------------
# GPT-OSS shape
# --------------------------------------------------------------------------------------------------
def test_gpt_oss_groups():
    lay = Layout(gpt_oss_spec())
    # Group order follows the first layer: layer 0 is SWA -> group 0, layer 1 is full -> group 1.
    assert lay.num_groups == 2
    swa, full = lay.groups
    assert (swa.window, full.window) == (128, None)
    assert swa.layers == tuple(range(0, 36, 2))
    assert full.layers == tuple(range(1, 36, 2))
    # 18 layers each -> scale 2 * 18 = 36.
    assert (swa.scale, full.scale) == (36, 36)
    assert list(lay.group_scale) == [36, 36]
    assert swa.is_swa and not full.is_swa
    assert [int(g) for g in lay.layer_group[:4]] == [0, 1, 0, 1]


@pytest.mark.parametrize("layer,role,offset", [
    (0, 0, 0), (0, 1, 1),        # layer 0 = 1st SWA layer (i=0): K 0, V 1
    (1, 0, 0), (1, 1, 1),        # layer 1 = 1st full layer (i=0)
    (7, 0, 6), (7, 1, 7),        # layer 7 = full, i = 7 // 2 = 3: K 6, V 7
    (34, 0, 34), (34, 1, 35),    # layer 34 = SWA, i = 17: K 34, V 35 (last page of the slot)
    (35, 1, 35),                 # layer 35 = full, i = 17
])
def test_gpt_oss_layer_offsets(layer, role, offset):
    assert Layout(gpt_oss_spec()).layer_offset(layer, role) == offset


@pytest.mark.parametrize("slot,layer,role,page", [
    (0, 0, 0, 0),           # 0 * 36 + 0
    (1, 1, 0, 36),          # 1 * 36 + 0
    (10, 7, 1, 367),        # 10 * 36 + 7
    (5, 34, 1, 215),        # 5 * 36 + 35
    (2, 35, 1, 107),        # 2 * 36 + 35
    (1023, 20, 0, 36848),   # layer 20: SWA i=10 -> K 20; 1023 * 36 + 20 = 36828 + 20
])
def test_gpt_oss_page_index(slot, layer, role, page):
    assert Layout(gpt_oss_spec()).page_index(slot, layer, role) == page


def test_page_indices_of_a_slot_tile_it_exactly():
    # For one slot, the (layer, role) pages of a group cover [slot*scale, (slot+1)*scale) once each.
    lay = Layout(gemma3_spec())
    for g in lay.groups:
        pages = sorted(lay.page_index(7, l, r) for l in g.layers for r in (0, 1))
        assert pages == list(range(7 * g.scale, 8 * g.scale))


@pytest.mark.parametrize("max_seq_len,max_rewind,blocks", [
    # ceil((131072 + 0 + 1) / 32) = ceil(4096.03) = 4097 -> next multiple of 4 = 4100
    (131072, 0, 4100),
    # ceil((131072 + 3 + 1) / 32) = ceil(4096.125) = 4097 -> 4100
    (131072, 3, 4100),
    # ceil((131071 + 0 + 1) / 32) = 4096 exactly, already a multiple of 4
    (131071, 0, 4096),
    # ceil((131071 + 3 + 1) / 32) = ceil(4096.09) = 4097 -> 4100: max_rewind needs room
    (131071, 3, 4100),
    # ceil(4097 / 32) = 129 -> 132
    (4096, 0, 132),
    # ceil(32 / 32) = 1 -> 4
    (31, 0, 4),
])
def test_max_blocks(max_seq_len, max_rewind, blocks):
    assert Layout(gpt_oss_spec(max_seq_len=max_seq_len, max_rewind=max_rewind)).max_blocks == blocks


@pytest.mark.parametrize("h,stale", [
    (0, (0, 0)),       # (0 + 1 - 128) // 32 = -4 -> clamped to 0: empty
    (127, (0, 0)),     # (128 - 128) // 32 = 0
    (128, (0, 0)),     # 1 // 32 = 0: the query at 128 sees [1, 128], block 0 still needed
    (159, (0, 1)),     # 32 // 32 = 1: query at 159 sees [32, 159], block 0 = [0, 32) is stale
    (160, (0, 1)),     # 33 // 32 = 1: window [33, 160] still touches block 1 = [32, 64)
    (191, (0, 2)),     # 64 // 32 = 2
    (1000, (0, 27)),   # 873 // 32 = 27: window [873, 1000]; block 27 = [864, 896) still needed
])
def test_gpt_oss_stale_range(h, stale):
    lay = Layout(gpt_oss_spec())
    swa, full = lay.groups
    assert lay.stale_range(swa, h) == stale
    assert lay.stale_range(full, h) == (0, 0)      # full attention: never stale


# --------------------------------------------------------------------------------------------------
# Gemma-3 shape
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tpb", [1, 4, 16])
def test_block_room_is_what_the_last_block_has_left(tpb):
    """block_room(c): the most tokens a sequence of c tokens takes without opening a block (new_blocks),
    for ints and arrays alike."""
    spec = CacheSpec(windows=[None], num_kv_heads=1, head_dim=4, tokens_per_block=tpb, max_seq_len=256,
                     max_batch=1, slots_per_group=8)
    g = Layout(spec).groups[0]
    caps = np.arange(0, 70, dtype=np.int64)
    rooms = g.block_room(caps)
    for c, room in zip(caps.tolist(), rooms.tolist()):
        assert g.block_room(c) == room
        lo, hi = g.new_blocks(c, c + room)
        assert lo == hi, (c, room)                  # no block opens within the room
        lo, hi = g.new_blocks(c, c + room + 1)
        assert hi == lo + 1, (c, room)              # the next token opens one
        assert 0 <= room < tpb


def test_gemma3_groups():
    lay = Layout(gemma3_spec())
    swa, full = lay.groups
    assert (swa.window, full.window) == (1024, None)
    # full layers: 5, 11, 17, 23, 29, 35, 41, 47, 53, 59 -> 10; SWA: 62 - 10 = 52
    assert full.layers == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    assert swa.num_layers == 52 and full.num_layers == 10
    assert (swa.scale, full.scale) == (104, 20)


def test_group_layers_list_each_groups_layers():
    """Layout.group_layers (what the step kernels walk a group's layers by): [P + 1] starts, then each
    group's layers in layer order, against the layers whose layer_group is that group."""
    for spec in (gpt_oss_spec(), gemma3_spec(),
                 CacheSpec(windows=[32, 256, None, 32, 256, 32], sink_tokens=4, num_kv_heads=1, head_dim=8,
                           tokens_per_block=8, max_seq_len=700, max_batch=5, slots_per_group=64)):
        lay = Layout(spec)
        P, L = lay.num_groups, lay.num_layers
        gl = lay.group_layers
        assert gl.dtype == np.int32 and gl.shape == (P + 1 + L,)
        starts, layers = gl[:P + 1], gl[P + 1:]
        for p in range(P):
            assert list(layers[starts[p]:starts[p + 1]]) == list(np.flatnonzero(lay.layer_group == p))
        assert starts[0] == 0 and starts[P] == L


@pytest.mark.parametrize("layer,role,offset", [
    (0, 0, 0),
    (4, 1, 9),       # SWA i=4 -> K 8, V 9
    (6, 0, 10),      # SWA: layers 0..4 before it -> i=5 -> K 10
    (61, 0, 102),    # SWA i = 61 - 10 full layers below it = 51 -> K 102
    (61, 1, 103),    # ... V 103 = scale - 1
    (5, 0, 0),       # 1st full layer
    (59, 1, 19),     # 10th full layer, i=9 -> V 19 = scale - 1
])
def test_gemma3_layer_offsets(layer, role, offset):
    assert Layout(gemma3_spec()).layer_offset(layer, role) == offset


@pytest.mark.parametrize("slot,layer,role,page", [
    (3, 61, 1, 415),    # 3 * 104 + 103
    (7, 59, 0, 158),    # 7 * 20 + 18
    (0, 11, 1, 3),      # full i=1 -> V 3
    (2, 12, 0, 2 * 104 + 20),   # layer 12: SWA, full layers below: 5, 11 -> i = 10 -> K 20
])
def test_gemma3_page_index(slot, layer, role, page):
    assert Layout(gemma3_spec()).page_index(slot, layer, role) == page


@pytest.mark.parametrize("rewind,start,cap,scratch", [
    # chunk [0, 8192): stale_range(8192 - 0) hi = (8193 - 1024) // 32 = 7169 // 32 = 224
    #   ∩ [ceil(0/32)=0, ceil(8192/32)=256) -> [0, 224)
    (0, 0, 8192, (0, 224)),
    # max_rewind 4: stale_range(8188) hi = (8189 - 1024) // 32 = 7165 // 32 = 223 -> [0, 223)
    (4, 0, 8192, (0, 223)),
    # chunk [8192, 16384): stale(16384) hi = 15361 // 32 = 480; lo = ceil(8192/32) = 256 -> [256, 480)
    (0, 8192, 16384, (256, 480)),
    # max_rewind 4: stale(16380) hi = 15357 // 32 = 479 -> [256, 479)
    (4, 8192, 16384, (256, 479)),
    # chunk [0, 1024): stale(1024) hi = 1 // 32 = 0 -> empty
    (0, 0, 1024, (0, 0)),
    # chunk [8192, 8200): stale(8200) hi = 7177 // 32 = 224 < lo = 256 -> empty
    (0, 8192, 8200, (0, 0)),
    # unaligned start [100, 4196): stale(4196) hi = 3173 // 32 = 99; lo = ceil(100/32) = 4
    #   (block 3 = [96, 128) already holds tokens 96..99 in its own slot) -> [4, 99)
    (0, 100, 4196, (4, 99)),
])
def test_gemma3_scratch_range(rewind, start, cap, scratch):
    lay = Layout(gemma3_spec(max_rewind=rewind))
    swa, full = lay.groups
    assert lay.scratch_range(swa, start, cap) == scratch
    assert lay.scratch_range(full, start, cap) == (0, 0)


@pytest.mark.parametrize("h,stale", [
    (8192, (0, 224)),     # (8193 - 1024) // 32 = 224
    (16384, (0, 480)),    # 15361 // 32 = 480
    (1024, (0, 0)),       # 1 // 32 = 0
    (1055, (0, 1)),       # 32 // 32 = 1
])
def test_gemma3_stale_range(h, stale):
    lay = Layout(gemma3_spec())
    assert lay.stale_range(lay.groups[0], h) == stale
    assert lay.stale_range(lay.groups[1], h) == (0, 0)


def test_scratch_off_gives_no_scratch():
    lay = Layout(gemma3_spec(swa_scratch_reuse=False))
    assert lay.scratch_range(lay.groups[0], 0, 8192) == (0, 0)


@pytest.mark.parametrize("group,n,slots", [
    (0, 0, 0),
    (0, 1, 1),      # ceil(2 / 104)
    (0, 52, 1),     # ceil(104 / 104)
    (0, 53, 2),     # ceil(106 / 104)
    (0, 224, 5),    # ceil(448 / 104) = ceil(4.3): chunk [0, 8192) above
    (0, 223, 5),    # ceil(446 / 104)
    (1, 10, 1),     # ceil(20 / 20)
    (1, 11, 2),     # ceil(22 / 20)
])
def test_gemma3_scratch_slots_needed(group, n, slots):
    lay = Layout(gemma3_spec())
    assert lay.scratch_slots_needed(lay.groups[group], n) == slots


def test_gpt_oss_scratch_slots_needed():
    lay = Layout(gpt_oss_spec())
    swa = lay.groups[0]
    assert lay.scratch_slots_needed(swa, 18) == 1   # 36 / 36
    assert lay.scratch_slots_needed(swa, 19) == 2   # 38 / 36


# --------------------------------------------------------------------------------------------------
# sink tokens
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sink,blocks", [(0, 0), (1, 1), (4, 1), (32, 1), (33, 2), (64, 2), (65, 3)])
def test_sink_blocks(sink, blocks):
    lay = Layout(gpt_oss_spec(sink_tokens=sink))
    assert lay.sink_blocks(lay.groups[0]) == blocks   # ceil(sink / 32)
    assert lay.groups[1].sink_tokens == 0             # full attention ignores sinks
    assert lay.sink_blocks(lay.groups[1]) == 0


@pytest.mark.parametrize("h,stale", [
    (0, (1, 1)),       # hi clamps to the sink block count
    (100, (1, 1)),     # (101 - 128) // 32 < 1
    (159, (1, 1)),     # 32 // 32 = 1 = sink_blocks: block 0 is the sink, kept
    (191, (1, 2)),     # 64 // 32 = 2 -> block 1 stale
    (1000, (1, 27)),   # 873 // 32 = 27
])
def test_stale_range_with_sinks(h, stale):
    lay = Layout(gpt_oss_spec(sink_tokens=4))    # 4 sink tokens -> 1 sink block
    assert lay.stale_range(lay.groups[0], h) == stale
    assert lay.stale_range(lay.groups[1], h) == (0, 0)


def test_scratch_range_with_sinks():
    # Gemma with 4 sink tokens: chunk [0, 8192) -> stale [1, 224) ∩ [0, 256) = [1, 224)
    lay = Layout(gemma3_spec(sink_tokens=4))
    assert lay.scratch_range(lay.groups[0], 0, 8192) == (1, 224)


def test_per_layer_sinks_split_groups():
    # (128, 0), (128, 4) and full: 3 groups; sinks on the full layer do not make it a new group.
    spec = CacheSpec(windows=[128, 128, None, None], sink_tokens=[0, 4, 0, 7], num_kv_heads=1, head_dim=8,
                     tokens_per_block=32, slots_per_group=8)
    lay = Layout(spec)
    assert [(g.window, g.sink_tokens, g.layers) for g in lay.groups] == [
        (128, 0, (0,)), (128, 4, (1,)), (None, 0, (2, 3))]
    assert list(lay.group_scale) == [2, 2, 4]
    assert lay.page_index(5, 3, 1) == 5 * 4 + 3


# --------------------------------------------------------------------------------------------------
# slots from memory_bytes
# --------------------------------------------------------------------------------------------------
def _slot_bytes_by_hand(scale, tpb, heads, dim, dtype_bytes):
    # a slot is [scale, tpb, kv_heads, head_dim] of dtype
    return scale * tpb * heads * dim * dtype_bytes


def test_gpt_oss_slot_bytes():
    lay = Layout(gpt_oss_spec())
    # 36 * 32 * 8 * 64 * 2 = 1,179,648
    assert [lay.slot_bytes(g) for g in lay.groups] == [1179648, 1179648]


@pytest.mark.parametrize("make,budget,scales", [
    (gpt_oss_spec, 40 << 30, (36, 36)),
    (gemma3_spec, 20 << 30, (104, 20)),
    (gemma3_spec, 1 << 28, (104, 20)),
    (gpt_oss_spec, 1 << 30, (36, 36)),         # 910.2 slots in all; SWA's share 910.2 * 6/4106 = 1.3
])
def test_memory_bytes_split(make, budget, scales):
    spec = make(slots_per_group=None, memory_bytes=budget)
    lay = Layout(spec)
    slots = lay.slots_per_group
    assert len(slots) == 2
    assert all(isinstance(s, int) and s > 0 for s in slots)
    used = sum(n * _slot_bytes_by_hand(sc, 32, 8, 64, 2) for n, sc in zip(slots, scales))
    assert used <= budget


def test_memory_bytes_full_gets_more_than_swa():
    # 40 GiB / 1,179,648 B = 36408.9 slots in all. An SWA(128) request needs a handful of blocks, a
    # full one up to 4100, so any sane split gives the full group far more slots.
    slots = Layout(gpt_oss_spec(slots_per_group=None, memory_bytes=40 << 30)).slots_per_group
    assert slots[1] > 100 * slots[0]
    assert sum(slots) <= 36408


def test_memory_bytes_too_small():
    with pytest.raises(InvalidSpecError, match="memory_bytes"):
        Layout(gpt_oss_spec(slots_per_group=None, memory_bytes=1000))


def test_slots_per_group_int_and_list():
    assert Layout(gpt_oss_spec(slots_per_group=7)).slots_per_group == (7, 7)
    assert Layout(gpt_oss_spec(slots_per_group=[3, 9])).slots_per_group == (3, 9)


# --------------------------------------------------------------------------------------------------
# CacheSpec validation
# --------------------------------------------------------------------------------------------------
GOOD = dict(windows=[32, None, 32], num_kv_heads=2, head_dim=8, tokens_per_block=16, max_seq_len=256,
            max_batch=4, slots_per_group=64, max_rewind=2)


def build(**kw):
    """Spec plus layout: some checks (slots_per_group length) need the group count."""
    args = dict(GOOD)
    args.update(kw)
    spec = CacheSpec(**args)
    return Layout(spec)


def test_good_spec_builds():
    lay = build()
    assert lay.num_groups == 2


@pytest.mark.parametrize("field,kw", [
    ("windows", dict(windows=[])),
    ("windows", dict(windows=None)),
    ("windows", dict(windows=[32, -1])),
    ("windows", dict(windows=[32, 0])),
    ("windows", dict(windows=[32.0, None])),
    ("windows", dict(windows=["32"])),
    ("windows", dict(windows=[True, None])),
    ("tokens_per_block", dict(tokens_per_block=24)),
    ("tokens_per_block", dict(tokens_per_block=0)),
    ("tokens_per_block", dict(tokens_per_block=-16)),
    ("num_kv_heads", dict(num_kv_heads=0)),
    ("head_dim", dict(head_dim=-8)),
    ("dtype", dict(dtype="int7")),
    ("dtype", dict(dtype="fp8")),
    ("max_rewind", dict(max_rewind=-1)),
    ("max_rewind", dict(max_rewind=1.5)),
    ("max_seq_len", dict(max_seq_len=0)),
    ("max_batch", dict(max_batch=0)),
    ("table_mode", dict(table_mode="bogus")),
    ("swa_scratch_reuse", dict(table_mode="shared", swa_scratch_reuse=True)),
    ("slots_per_group", dict(slots_per_group=None, memory_bytes=None)),
    ("slots_per_group", dict(slots_per_group=[64])),            # 2 groups
    ("slots_per_group", dict(slots_per_group=[64, 64, 64])),
    ("slots_per_group", dict(slots_per_group=0)),
    ("slots_per_group", dict(slots_per_group=[64, -1])),
    ("memory_bytes", dict(slots_per_group=None, memory_bytes=-5)),
    ("sink_tokens", dict(sink_tokens=-1)),
    ("sink_tokens", dict(sink_tokens=[0, 0])),                  # 3 layers
    # not ints: bools, floats, a number where a sequence goes, a list where a string goes
    ("windows", dict(windows=5)),
    ("dtype", dict(dtype=["float16"])),
    ("table_mode", dict(table_mode=["shared"])),
    ("sink_tokens", dict(sink_tokens=1.5)),
    ("sink_tokens", dict(sink_tokens=True)),
    ("sink_tokens", dict(sink_tokens=[0, 1.5, 0])),
    ("slots_per_group", dict(slots_per_group=1.5)),
    ("slots_per_group", dict(slots_per_group=True)),
    ("slots_per_group", dict(slots_per_group=[64, True])),
    ("tokens_per_block", dict(tokens_per_block=True)),
    ("tokens_per_block", dict(tokens_per_block=16.0)),
    ("max_seq_len", dict(max_seq_len=256.0)),
    ("max_batch", dict(max_batch=True)),
    ("num_kv_heads", dict(num_kv_heads=2.0)),
    ("head_dim", dict(head_dim=True)),
    ("max_rewind", dict(max_rewind=True)),
    ("max_rewind", dict(max_rewind=np.float64(2))),
    ("memory_bytes", dict(slots_per_group=None, memory_bytes=1.5e9)),
    ("max_step_tokens", dict(max_step_tokens=True)),
    ("swa_scratch_reuse", dict(swa_scratch_reuse="yes")),
])
def test_bad_spec_field(field, kw):
    with pytest.raises(InvalidSpecError) as ei:
        build(**kw)
    msg = str(ei.value)
    assert field in msg
    value = kw[field]                  # named as given: the whole field, or each entry of a sequence
    for v in (value if isinstance(value, list) else [value]):
        assert repr(v) in msg, (repr(v), msg)
    assert isinstance(ei.value, ValueError)
    assert isinstance(ei.value, cupykv.CupykvError)


def test_spec_counts_become_python_ints():
    """numpy integers are counts; the spec holds Python ints (and tuples of them) whatever it was given."""
    spec = CacheSpec(windows=[np.int64(32), None, np.uint16(32)], num_kv_heads=np.int8(2), head_dim=np.uint8(8),
                     tokens_per_block=np.int64(16), max_seq_len=np.int16(32767), max_batch=np.int8(4),
                     sink_tokens=[np.int32(4), 0, np.uint64(4)], slots_per_group=np.array([64, 32]),
                     memory_bytes=np.int64(1 << 20), max_rewind=np.int8(2), max_step_tokens=np.uint32(512),
                     swa_scratch_reuse=np.bool_(True))
    assert spec.windows == spec.windows_tuple == (32, None, 32)
    assert spec.sink_tokens == (4, 0, 4) and spec.slots_per_group == (64, 32)
    ints = [spec.num_kv_heads, spec.head_dim, spec.tokens_per_block, spec.max_seq_len, spec.max_batch,
            spec.memory_bytes, spec.max_rewind, spec.max_step_tokens, *spec.sink_tokens, *spec.slots_per_group,
            spec.windows[0], spec.windows[2]]
    assert all(type(v) is int for v in ints), [type(v) for v in ints]
    assert type(spec.swa_scratch_reuse) is bool
    assert spec == CacheSpec(windows=(32, None, 32), num_kv_heads=2, head_dim=8, tokens_per_block=16,
                             max_seq_len=32767, max_batch=4, sink_tokens=(4, 0, 4), slots_per_group=[64, 32],
                             memory_bytes=1 << 20, max_rewind=2, max_step_tokens=512)
    assert {spec: 1}[spec] == 1                                             # frozen and hashable
    lay = Layout(spec)
    assert lay.max_blocks == 2052 and lay.slots_per_group == (64, 32)     # ceil(32770 / 16) = 2049 -> 2052
    assert type(CacheSpec(**dict(GOOD, sink_tokens=np.int64(3))).sink_tokens) is int


def test_shared_mode_valid_without_scratch_or_without_swa():
    assert build(table_mode="shared", swa_scratch_reuse=False).num_groups == 2
    assert build(windows=[None, None], table_mode="shared", swa_scratch_reuse=True).num_groups == 1
