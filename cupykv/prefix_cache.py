"""Prefix caching: block hashes, lookup, publishing, and which sliding-window blocks to keep hashed.

Contract (docs/design.md, "Prefix caching"):

- Only full blocks are cached, content-addressed: h_b = H(h_{b-1}, salt, tokens of block b) with
  h_{-1} = H(salt, a fingerprint of the spec's group layout); H is BLAKE2b-128 over the tokens as
  little-endian int64, so every rank and every run agrees. The cache maps (group, h_b) -> slot.
- A block is published (hit-able) when all its tokens are settled and accepted.
- Hit length n (a multiple of tpb, n < prompt_len): the largest n for which every group holds every block
  a query at position n can see: all of [0, n / tpb) for full attention; the sink blocks and
  [stale_end(n), n / tpb) for a sliding window.
- Retention (sliding-window groups): a block leaving the window is unhashed when released (so it is
  reused first), unless it lies in a retained range: the window of a boundary (the prompt end, each
  context chunk's end, each caller checkpoint) plus one block before it, or it came from a hit (another
  request's boundary kept it). At free, every block keeps its hash: the request's last window.
  retention="all" keeps every block hashed (the hit-rate ceiling, the most memory).
- Retention follows the content, not the releasing request: a cached block that lies in a retained range
  of any request (met when that request hits it, publishes it or finds it published by another slot, gets
  the boundary, or is freed with it in its window) is marked (`kept`), and keeps its hash whichever holder
  releases it last; the mark ends with the cache entry. (Two requests sharing a prefix, prefilled
  together: the blocks carry the first one's slots, and the second one's prompt-end window keeps them.)

Slot bookkeeping (reference counts, evictable, quarantine) is the pools' (allocator.CachingSlotPool);
this module only names slots: `pool.hashed[slot]` is set while a hash maps to the slot.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import repeat
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .args import Reported
from .groups import LayerGroup
from .layout import BAD, Layout

HASH_BYTES = 16
STORED, REMOVED = "stored", "removed"


def _h(first: bytes, *rest) -> bytes:
    """H: BLAKE2b-128 over the parts in order (bytes-like)."""
    h = hashlib.blake2b(first, digest_size=HASH_BYTES)
    for part in rest:
        h.update(part)
    return h.digest()


def _ignore(event: tuple) -> None:
    """An event nobody records (CacheSpec.prefix_events off)."""


@dataclass
class CachedSeq:
    """What the cache knows of one request: its tokens, their block hashes, its boundaries."""
    salt: bytes
    hashes: List[bytes]                  # hash of each full block of known tokens, in order
    tail: Optional[np.ndarray]           # int64: the known tokens after the last full block, until begin()
                                         # moves them to the cache's row (PrefixCache.tail_tokens)
    boundaries: List[int]                # positions whose window is retained (prompt end, chunk ends, ...)
    hit_blocks: int = 0                  # blocks [0, hit_blocks) came from a hit
    published: int = 0                   # blocks [0, published) were offered, in every group
    margin: List = field(default_factory=list)    # per group: (block, slot) released last, hash kept
    ranges: Dict = field(default_factory=dict)    # group -> the retained block ranges, a list of (lo, hi)
    # with events recorded: each hashed block's tokens (little-endian int64 bytes) until it is published,
    # for the stored event (a router rebuilds the prefix from them); None: not kept
    block_tokens: Optional[List[Optional[bytes]]] = None

    def parent(self, fingerprint: bytes) -> bytes:
        """The hash the request's next block chains from (h_{-1} before its first block)."""
        return self.hashes[-1] if self.hashes else _h(self.salt, fingerprint)

    def hash_blocks(self, tokens: np.ndarray, tpb: int, fingerprint: bytes) -> np.ndarray:
        """Hash the full blocks of `tokens` (int64, following self.hashes); returns the rest (fewer than tpb)."""
        full = len(tokens) // tpb
        raw = memoryview(np.ascontiguousarray(tokens[:full * tpb], "<i8")).cast("B")
        step, salt, append = tpb * 8, self.salt, self.hashes.append
        parent = self.parent(fingerprint)
        for at in range(0, full * step, step):         # (a long prompt: thousands of blocks, one chain)
            parent = _h(parent, salt, raw[at:at + step])
            append(parent)
        if self.block_tokens is not None:
            self.block_tokens += [bytes(raw[at:at + step]) for at in range(0, full * step, step)]
        return tokens[full * tpb:]


def retained_ranges(g: LayerGroup, boundaries: Sequence[int], tpb: int) -> List[Tuple[int, int]]:
    """Block ranges a hit at each boundary needs (its window and sinks are the group's rules), plus one block
    before the window, so a follow-up that diverges in the boundary's last block still hits the block
    boundary before it."""
    out = []
    for pos in boundaries:
        b = pos // tpb
        out.append((max(g.sink_blocks, int(g.stale_end(b * tpb)) - 1), b))
    return out


def longest_run(mask: np.ndarray) -> Tuple[int, int]:
    """[a, b): the longest run of True in mask (bool [n]; the first of equal ones), (0, 0) when none."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    if len(edges) == 0:
        return 0, 0
    runs = edges.reshape(-1, 2)
    a, b = runs[np.argmax(runs[:, 1] - runs[:, 0])]
    return int(a), int(b)


class PrefixCache:
    """Hash maps per group, the cached sequences by table row, statistics and events."""

    def __init__(self, layout: Layout, pools: Sequence, retention: str = "boundaries", events: bool = False):
        self.layout, self.groups, self.tpb = layout, layout.groups, layout.tpb
        self.pools, self.retention, spec = pools, retention, layout.spec
        self.fingerprint = repr((self.tpb, spec.num_kv_heads, spec.head_dim, spec.dtype,
                                 [(g.window, g.sink_tokens, g.layers) for g in self.groups])).encode()
        self.by_hash: List[Dict[bytes, int]] = [{} for _ in self.groups]
        self.hash_of: List[Dict[int, bytes]] = [{} for _ in self.groups]
        self.seqs: Dict[int, CachedSeq] = {}
        self.kept: List[set] = [set() for _ in self.groups]     # per group: hashes a retained range marked
        self._windowed = [g for g in self.groups if not g.keeps_every_block]
        # per table row: False once a settle advanced the request without reporting its tokens (its later
        # blocks can never be published)
        self.complete = np.ones(layout.spec.max_batch, bool)
        # per table row: the known tokens after the request's last full block, tail_tokens[row, :tail_len[row]]
        # (one array for all rows, so a step's reported tokens are appended in a few numpy operations)
        self.tail_tokens = np.zeros((layout.spec.max_batch, self.tpb), "<i8")     # hashed as little-endian int64
        self.tail_len = np.zeros(layout.spec.max_batch, np.int64)
        # every block stored or removed, kept until drained (None: not recorded; CacheSpec.prefix_events: only a
        # caller that drains them should keep them): (STORED, group, hash, parent hash or None, its tokens as
        # little-endian int64 bytes) or (REMOVED, group, hash)
        self.events: Optional[List[tuple]] = [] if events else None
        self._event = self.events.append if events else _ignore
        self.queries = self.query_tokens = self.hit_tokens = 0
        self.host = None                                  # a HostTier taking evicted blocks (attach_host)
        self.host_by_hash: List[Dict[bytes, int]] = [{} for _ in self.groups]
        self.host_hash_of: List["OrderedDict[int, bytes]"] = [OrderedDict() for _ in self.groups]  # LRU first
        self.pending: list = []
        # Device slots a copy back from the host tier may still be writing, per group: slot -> the copy's
        # event. Every copy of the tier runs on its one stream, so the latest copy's event (last_copy_in)
        # covers all earlier ones.
        self.arriving: List[Dict[int, object]] = [{} for _ in self.groups]
        self.last_copy_in = None
        for p, pool in enumerate(pools):
            pool.on_evict = lambda slots, p=p: self._evicted(p, slots)

    # -- hashing and lookup ----------------------------------------------------------------------
    def new_seq(self, tokens: np.ndarray, salt: bytes, boundaries: List[int]) -> CachedSeq:
        """A request's sequence with its prompt's full blocks hashed."""
        seq = CachedSeq(salt, [], None, boundaries, block_tokens=[] if self.events is not None else None)
        seq.tail = seq.hash_blocks(tokens, self.tpb, self.fingerprint)
        return seq

    def lookup(self, hashes: List[bytes], prompt_len: int, with_host: bool = True
               ) -> Tuple[int, List[Tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """(b, per group (blocks, slots, on_host)) for the longest hit n = b * tpb: the blocks a query at
        n sees (int64 [k], ascending), the slot each is cached in (int64 [k]: a device slot, or a host
        slot where on_host, bool [k]). Blocks in the host tier count unless with_host is False."""
        top = min(len(hashes), (prompt_len - 1) // self.tpb)
        with_host = with_host and self.host is not None
        ok = np.ones(top + 1, bool)            # ok[b]: a hit of b blocks is complete in every group so far
        b = np.arange(top + 1)
        for g, table, host in zip(self.groups, self.by_hash, self.host_by_hash):
            have = np.fromiter(map(table.__contains__, hashes[:top]), bool, top)
            if with_host and host:
                have |= np.fromiter(map(host.__contains__, hashes[:top]), bool, top)
            run = np.concatenate(([0], np.cumsum(have)))            # run[b] = cached blocks among [0, b)
            start = np.minimum(g.stale_end(b * self.tpb), b)
            sinks = np.minimum(b, g.sink_blocks)
            ok &= (run[b] - run[start] == b - start) & (run[sinks] == sinks)
        hit = int(np.flatnonzero(ok)[-1])
        out = []
        for g, table, host in zip(self.groups, self.by_hash, self.host_by_hash):
            start = min(int(g.stale_end(hit * self.tpb)), hit)
            sinks = min(g.sink_blocks, start)
            blocks = np.concatenate((np.arange(sinks), np.arange(start, hit)))
            seen = hashes[:sinks] + hashes[start:hit]
            slots = np.fromiter(map(table.get, seen, repeat(-1)), np.int64, len(seen))
            on_host = slots < 0                 # (a hit block not on the device is in the host tier)
            if on_host.any():
                slots[on_host] = [host[h] for h, there in zip(seen, on_host.tolist()) if there]
            out.append((blocks, slots, on_host))
        return hit, out

    # -- the host tier -----------------------------------------------------------------------------
    def attach_host(self, host) -> None:
        """Blocks evicted from the device go to `host` (a HostTier) while it has room, and stay hits."""
        self.host = host

    def _evicted(self, p: int, slots: np.ndarray) -> None:
        """Cached device slots were handed to a new owner: their blocks go to the host tier when it takes
        them (least recently cached host blocks make way), else they leave the cache. Relies on a hash
        being named in at most one of by_hash[p] and host_by_hash[p] (publish and bring_back keep it so)."""
        if self.host is None:
            self._forget(p, slots.tolist())
            return
        # host slot -> the device slot copied into it. Making way can take a host slot this very call gave
        # an earlier evicted block (the tier has fewer free slots than blocks are evicted): that block left
        # the cache again, and its copy must go too. Two copies into one host slot in one copy_runs would
        # run at once on CUDA (the copy kernel's threads split every run) and leave a mix of both blocks
        # under the later one's hash.
        moves: Dict[int, int] = {}
        for s in slots.tolist():
            h = self.hash_of[p].pop(s, None)
            if h is None:
                continue
            del self.by_hash[p][h]
            self.kept[p].discard(h)
            hs = self.host.cache_slot(p)
            if hs is None and self.host_hash_of[p]:            # make way: the least recently cached goes
                hs, old = self.host_hash_of[p].popitem(last=False)
                del self.host_by_hash[p][old]
                self._event((REMOVED, p, old))
            if hs is None:
                self._event((REMOVED, p, h))
                continue
            self.host_by_hash[p][h], self.host_hash_of[p][hs] = hs, h
            moves[hs] = s
        if moves:
            host, dev = (np.array(a, np.int64) for a in zip(*moves.items()))
            # the slots' new owner writes them only after this copy: its step waits for the event
            self.pending.append(self.host.copy_out(p, dev, host))

    def bring_back(self, p: int, hashes: List[bytes], host_slots: List[int], allocate):
        """Host blocks hit by a new request: copied into `allocate(n)` fresh device slots and named there
        again; their host slots return to the tier after the copy. Returns (device slots, copy event).

        The host blocks leave the host maps before the allocation, which may evict device blocks to the
        host tier: those copies take other host slots, and run before ours on the tier stream (a slot
        evicted into our allocation is copied out before our copy overwrites it)."""
        for h, hs in zip(hashes, host_slots):
            del self.host_by_hash[p][h], self.host_hash_of[p][hs]
        slots = allocate(len(hashes))
        for h, s in zip(hashes, slots.tolist()):
            self.by_hash[p][h], self.hash_of[p][s] = s, h
        self.pools[p].hashed[slots] = True
        self.last_copy_in = loaded = self.host.copy_in(p, np.array(host_slots, np.int64), slots)
        arriving = self.arriving[p]
        for s in [s for s, event in arriving.items() if event.done()]:
            del arriving[s]
        arriving.update(dict.fromkeys(slots.tolist(), loaded))
        return slots, loaded

    def still_arriving(self, p: int, slots: np.ndarray) -> bool:
        """Whether a copy back from the host tier (an earlier request's hit) may still be writing one of
        these device slots of group p: a request that hits them must wait for last_copy_in too."""
        arriving = self.arriving[p]
        if not arriving:
            return False
        for s in slots.tolist():
            event = arriving.get(s)
            if event is not None and not event.done():
                return True
        return False

    def drop_host_block(self, p: int) -> int:
        """The least recently cached host block of group p leaves the cache; returns its host slot."""
        hs, h = self.host_hash_of[p].popitem(last=False)
        del self.host_by_hash[p][h]
        self._event((REMOVED, p, h))
        return hs

    def spill_events(self) -> list:
        """Events the next step must wait for on the device (copies out of slots it may write); the
        manager clears them once that step is enqueued."""
        return list(self.pending)

    # -- requests --------------------------------------------------------------------------------
    def begin(self, row: int, seq: CachedSeq) -> None:
        seq.published = seq.hit_blocks
        seq.margin = [None] * len(self.groups)
        self.seqs[row] = seq
        self.complete[row] = True
        self.tail_len[row] = n = len(seq.tail)
        self.tail_tokens[row, :n] = seq.tail
        seq.tail = None
        self._retain(seq, 0, seq.hit_blocks)

    def end(self, row: int, table: np.ndarray) -> None:
        """The request in `row` is freed; table: int32 [P, rows, B] before its row is released. The cached
        blocks of its last window (what it holds in each sliding-window group) are marked kept."""
        seq = self.seqs.pop(row)
        if self.retention == "all":
            return
        for g in self._windowed:
            held = np.flatnonzero(table[g.index, row, :len(seq.hashes)] != BAD).tolist()
            self._mark(g.index, [seq.hashes[b] for b in held])

    def _retain(self, seq: CachedSeq, lo: int, hi: int, ranges=None) -> None:
        """Mark kept the cached blocks of [lo, hi) of the request that lie in its retained ranges (or in
        `ranges`, per group), in every sliding-window group."""
        if self.retention == "all":
            return
        top = min(hi, len(seq.hashes))
        for g in self._windowed:
            self._mark(g.index, [seq.hashes[blk] for a, b in (self._ranges(seq, g) if ranges is None else ranges[g.index])
                                 for blk in range(max(a, lo), min(b, top))])

    def _mark(self, p: int, hashes: List[bytes]) -> None:
        """Mark kept those of these hashes that group p caches."""
        by_hash = self.by_hash[p]
        self.kept[p].update(h for h in hashes if h in by_hash)

    def _extend(self, rows: np.ndarray, use: np.ndarray, reported: Reported) -> None:
        """Append the reported tokens of the entries where `use` (bool [n]; their requests' tokens are all
        known) to the tails of their rows (int64 [n], distinct); the blocks they complete are hashed (for
        publishing decode blocks). Tokens that reach at most the end of the row's block are written in one
        scatter, and a row they fill is hashed from tail_tokens; more (accepted speculative tokens past a
        block's end, rare) go the prompt's way, one row at a time."""
        tpb, held, starts, tokens = self.tpb, self.tail_len[rows], reported.offsets[:-1], reported.tokens
        counts = reported.offsets[1:] - starts
        grown = held + counts
        one_each = len(tokens) == len(rows) and (counts == 1).all()     # entry j's token is tokens[j]
        if one_each and use.all():
            # A decode step's one token for each entry, every row's tokens known: each token fits (a tail is
            # hashed as soon as it fills, so tail_len < tpb), so no mask is needed.
            self.tail_tokens.reshape(-1)[rows * tpb + held] = tokens
            self.tail_len[rows] = grown
            filled, past = rows[grown == tpb], ()
        else:
            fits = use & (grown <= tpb)
            # every token's flat place in tail_tokens, as if it were taken (the mask keeps the ones that are)
            if one_each:
                place, mask = rows * tpb + held, fits
            else:
                place = np.repeat(rows * tpb + held - starts, counts) + np.arange(len(tokens))
                mask = np.repeat(fits, counts)
            self.tail_tokens.reshape(-1)[place[mask]] = tokens[mask]
            self.tail_len[rows[fits]] = grown[fits]
            filled, past = rows[fits & (grown == tpb)], np.flatnonzero(use & ~fits).tolist()
        for row in filled.tolist():
            seq = self.seqs[row]
            seq.hashes.append(_h(seq.parent(self.fingerprint), seq.salt, self.tail_tokens[row].data))
            if seq.block_tokens is not None:
                seq.block_tokens.append(self.tail_tokens[row].tobytes())
            self.tail_len[row] = 0
        for j in past:
            row, n = int(rows[j]), int(held[j])
            rest = self.seqs[row].hash_blocks(np.concatenate((self.tail_tokens[row, :n], tokens[starts[j]:starts[j]
                                                              + counts[j]])), self.tpb, self.fingerprint)
            self.tail_len[row] = len(rest)
            self.tail_tokens[row, :len(rest)] = rest

    def publish(self, rows: List[int], histories: List[int], table: np.ndarray) -> None:
        """Offer each request's full settled blocks to the cache (rows[i] has histories[i] tokens settled):
        block b of group p maps to the slot in table[p, row, b] (int32 [P, rows, B]) unless the hash is
        taken, the cell holds no slot (scratch, stale) or the slot is named already."""
        groups = list(zip(self.by_hash, self.hash_of, self.host_by_hash))
        named = [[] for _ in groups]            # per group: the slots this call names (pool.hashed set after)
        for row, history in zip(rows, histories):
            seq = self.seqs[row]
            lo, full = seq.published, min(history // self.tpb, len(seq.hashes))
            if full <= lo:                      # (most rows: a decode block without its tokens reported)
                continue
            seq.published, hashes = full, seq.hashes[lo:full]
            for p, ((by_hash, names, host), slots) in enumerate(zip(groups, table[:, row, lo:full].tolist())):
                for b, (h, slot) in enumerate(zip(hashes, slots), lo):
                    if slot != BAD and h not in by_hash and slot not in names:   # (names: the slots pool.hashed marks)
                        by_hash[h] = slot
                        names[slot] = h
                        named[p].append(slot)
                        hs = host.pop(h, None)
                        if hs is None:
                            self._event((STORED, p, h, seq.hashes[b - 1] if b else None,
                                         seq.block_tokens[b] if seq.block_tokens is not None else None))
                        else:       # computed again while cached on the host: the device copy takes its place
                            del self.host_hash_of[p][hs]        # (the same hash, still stored: no event)
                            self.host.release_cache_slot(p, hs)
            if seq.block_tokens is not None:           # offered in every group now: no later event needs them
                seq.block_tokens[lo:full] = [None] * (full - lo)
            if lo < max(seq.boundaries) // self.tpb:    # a retained range reaches them (no decode block)
                self._retain(seq, lo, full)
        for pool, slots in zip(self.pools, named):
            if slots:
                pool.hashed.put(slots, True)    # (a list as an index converts slowly: put takes it at C speed)

    def settle(self, step_rows: np.ndarray, index: np.ndarray, num_contexts: int, rows: np.ndarray,
               hist: np.ndarray, acc: np.ndarray, reported: Optional[Reported], table: np.ndarray) -> None:
        """A step settled: take its reported tokens, then publish the blocks it completed.

        step_rows: the step's table rows (int32 [num_seqs]); index: its live entries (int64, ascending);
        rows, hist, acc: their rows, new histories and accepted tokens; reported: the entries' reported
        tokens (args.generation_tokens) or None; table: int32 [P, rows, B].
        """
        n = len(step_rows)
        if reported is not None and len(reported.entries) == n - num_contexts and len(index) == n:
            # every generation entry reported its tokens, and none was freed (a decode step's usual case):
            # the entries are num_contexts..n - 1 and their rows `rows` (index is every entry)
            self._extend(rows[num_contexts:], self.complete[rows[num_contexts:]], reported)
        else:
            silent = (index >= num_contexts) & (acc > 0)        # generation entries that advanced ...
            if reported is not None and len(reported.entries):
                entries = reported.entries
                said = np.zeros(n, bool)        # masks over the step's entries (isin sorts: more than this costs)
                said[entries] = True
                silent &= ~said[index]                           # ... without reporting their tokens
                rows_of = step_rows[entries].astype(np.int64)
                use = self.complete[rows_of]
                if len(index) < n:              # entries freed since the prepare: their rows may be others' now
                    live = np.zeros(n, bool)
                    live[index] = True
                    use &= live[entries]
                self._extend(rows_of, use, reported)
            self.complete[rows[silent]] = False
        shift = self.tpb.bit_length() - 1
        crossed = np.flatnonzero((hist >> shift) > ((hist - acc) >> shift))     # rows that completed a block
        if len(crossed):
            self.publish(rows[crossed].tolist(), hist[crossed].tolist(), table)

    def leaving(self, g: LayerGroup, rows: List[int], ends: List[int], blocks: List[int],
                slots: List[int]) -> List[int]:
        """Slots that leave the cache as out-of-window blocks of these requests are released: row
        rows[i] releases blocks[ends[i - 1]:ends[i]] (ascending), whose table cells held slots[...] (the
        same ranges). The blocks outside every retained range leave; each row's newest keeps its hash
        until the row's next release: if the request ends first, it is the block before its last window.
        Returns slots to unhash once nobody holds them. (Plain Python: a settle releases a few blocks
        per request, and numpy costs more than the work at that size.)"""
        if self.retention == "all":
            return []
        p = g.index
        kept, names, refs, drop, start = self.kept[p], self.hash_of[p], self.pools[p].refs, [], 0
        for row, end in zip(rows, ends):
            lo, start = start, end
            seq = self.seqs.get(row)
            if seq is None or lo == end:
                continue
            if end - lo > 1:                      # (a decode step's rows release one block each: only the newest)
                drop += [s for b, s in zip(blocks[lo:end - 1], slots[lo:end - 1])
                         if s != BAD and not self._keeps(seq, g, b) and names.get(s) not in kept]
            old = seq.margin[p]
            if old is not None:
                b, slot = old
                h = names.get(slot)               # still the same block's slot (not evicted and reused since)?
                if (h is not None and h not in kept and b < len(seq.hashes) and h == seq.hashes[b]
                        and refs[slot] == 0 and not self._keeps(seq, g, b)):
                    drop.append(slot)
            if slots[end - 1] != BAD:
                seq.margin[p] = (blocks[end - 1], slots[end - 1])
        return drop

    def _keeps(self, seq: CachedSeq, g: LayerGroup, block: int) -> bool:
        """Does this block of the request keep its hash when released (a hit's block: another request's
        boundaries kept it; or inside a retained range)? (A block marked kept by any request keeps it too:
        leaving checks.)"""
        return block < seq.hit_blocks or any(lo <= block < hi for lo, hi in self._ranges(seq, g))

    def _ranges(self, seq: CachedSeq, g: LayerGroup) -> List[Tuple[int, int]]:
        """The request's retained block ranges in group g (cached until its boundaries change)."""
        ranges = seq.ranges.get(g.index)
        if ranges is None:
            ranges = seq.ranges[g.index] = retained_ranges(g, seq.boundaries, self.tpb)
        return ranges

    def add_boundary(self, row: int, pos: int) -> None:
        """A position whose window stays cached (a context chunk's end); its published blocks are kept."""
        seq = self.seqs[row]
        seq.boundaries.append(pos)
        seq.ranges.clear()
        self._retain(seq, 0, seq.published,
                     {g.index: retained_ranges(g, [pos], self.tpb) for g in self._windowed})

    def scratch_range(self, g: LayerGroup, row: int, start: int, capacity: int) -> Tuple[int, int]:
        """The chunk's scratch range with the retained ranges of the request's boundaries (and of the
        chunk's own end) taken out: the longest run of the rest, so retained windows are real blocks."""
        lo, hi = g.scratch_range(start, capacity)
        seq = self.seqs.get(row)
        if hi <= lo or seq is None:
            return lo, hi
        free = np.ones(hi - lo, bool)
        for a, b in retained_ranges(g, [*seq.boundaries, capacity], self.tpb):
            free[max(a, lo) - lo:max(min(b, hi), lo) - lo] = False
        a, b = longest_run(free)
        return (lo + a, lo + b) if b > a else (0, 0)

    # -- forgetting ------------------------------------------------------------------------------
    def unhash(self, p: int, slots: np.ndarray) -> None:
        """Slots released for good (out of the window, not retained): no longer hits, reused first."""
        named = [s for s in slots.tolist() if s in self.hash_of[p]]      # (the slots pool.hashed marks)
        if named:
            self.pools[p].unname(np.array(named, np.int32))
            self._forget(p, named)

    def _forget(self, p: int, slots: List[int]) -> None:
        for s in slots:
            h = self.hash_of[p].pop(s, None)
            if h is not None:
                del self.by_hash[p][h]
                self.kept[p].discard(h)
                self._event((REMOVED, p, h))

    # -- introspection ---------------------------------------------------------------------------
    def drain_events(self) -> List[tuple]:
        """The events recorded since the last drain (the cache records them: events=True)."""
        events = self.events.copy()     # (the list itself stays: _event appends to it)
        self.events.clear()
        return events

    def state(self) -> tuple:
        seqs = tuple((row, s.salt, tuple(self.tail_tokens[row, :self.tail_len[row]].tolist()), tuple(s.hashes), tuple(s.boundaries), s.hit_blocks,
                      bool(self.complete[row]), s.published, tuple(s.margin)) for row, s in sorted(self.seqs.items()))
        return (tuple(tuple(sorted(t.items())) for t in self.by_hash), seqs, None if self.events is None else len(self.events),
                tuple(tuple(sorted(k)) for k in self.kept),
                tuple(tuple(t.items()) for t in self.host_hash_of),
                self.queries, self.query_tokens, self.hit_tokens)
