"""Prefix caching as the manager sees it: one hook object, called at the same points whether caching is on or
off, so the manager reads the same either way.

    KVCacheManager.add        admit(...)            a new request: its hit, its cached blocks in its rows
    StepPlanner.plan          scratch_range(...)    a chunk's scratch range (retained windows kept out)
    KVCacheManager._commit    chunk_end(...)        a chunk's end is a boundary whose window stays cached
                              copies_before()       the step's work waits for the copies out of evicted blocks
                              committed()
    KVCacheManager.settle     settle(...)           blocks whose tokens are now final are published
                              release_window(...)   blocks leaving a window: released (and unhashed or kept)
    KVCacheManager.free       end(row)              every cached block the row holds keeps its hash

NoPrefixCaching does the plain thing at each point; PrefixCaching overrides them over a PrefixCache (which
owns hashes, lookup, retention and the host copies: prefix_cache.py).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from .groups import LayerGroup
from .prefix_cache import PrefixCache
from .table import expand_ranges, range_pairs

# A settle clears a row's window release by slices (PageTable.take_blocks: a Python call for each such row,
# logged as a range) from this many blocks on; shorter ones go as the cells of all rows in one vectorised
# pass (slicing releases of 16-63 blocks row by row doubled a SHARED chunk's settle).
SLICE_MIN_BLOCKS = 64


class NoPrefixCaching:
    """The hook with prefix caching off."""

    cache: Optional[PrefixCache] = None

    def __init__(self, layout, requests, page_table, pools):
        self.layout, self.requests, self.page_table, self.pools = layout, requests, page_table, pools

    def admit(self, rid, n: int, tokens, salt: bytes, marks: List[int]) -> int:
        """Register the checked request; returns its cached prompt tokens."""
        self.requests.add(rid, n)
        return 0

    def scratch_range(self, g: LayerGroup, row: int, start: int, end: int) -> Tuple[int, int]:
        return g.scratch_range(start, end)

    def chunk_end(self, row: int, end: int) -> None:
        pass

    def copies_before(self) -> list:
        """Events the step's device work must wait for."""
        return []

    def committed(self) -> None:
        pass

    def settle(self, step, entries: Optional[np.ndarray], rows: np.ndarray, hist: np.ndarray, acc: np.ndarray,
               reported) -> None:
        """The step's live entries (None: all of them) settled: rows now hold hist tokens, acc accepted."""

    def end(self, row: int) -> None:
        pass

    def release_window(self, g: LayerGroup, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, tag: int) -> None:
        """Release group g's blocks [lo, hi) of each row (hi > lo), which left the window. A long chunk's
        settle clears each long range as one (a decode step's rows release a block or two), unless the group
        reuses scratch: then most of such a range is scratch blocks that never held a slot, and cells cost
        less."""
        count = hi - lo
        longest = np.maximum.reduce(count)      # (the ufunc: .max() wraps it in Python)
        table, pool = self.page_table, self.pools[g.index]
        if longest >= SLICE_MIN_BLOCKS and not g.scratch_reuse:
            whole = count >= SLICE_MIN_BLOCKS
            for row, a, b in zip(rows[whole].tolist(), lo[whole].tolist(), hi[whole].tolist()):
                pool.release(table.take_blocks(g.index, row, a, b), tag)
            part = ~whole
            pair_rows, blocks = expand_ranges(rows[part], lo[part], hi[part])
        else:
            pair_rows, blocks = range_pairs(rows, lo, count, longest)
        _, slots = table.take(table.cells(g.index, pair_rows, blocks))
        pool.release(slots, tag)

    def stats(self) -> Optional[dict]:
        return None

    def state(self) -> Optional[tuple]:
        return None


class PrefixCaching(NoPrefixCaching):
    """The hook with prefix caching on, over `cache`."""

    def __init__(self, layout, requests, page_table, pools, ledger, cache: PrefixCache):
        super().__init__(layout, requests, page_table, pools)
        self.ledger, self.cache = ledger, cache

    def admit(self, rid, n: int, tokens, salt: bytes, marks: List[int]) -> int:
        """The longest cached prefix of the prompt whose blocks fit: device blocks are taken back (or waited
        for, while an earlier hit's copy back is under way), host blocks copied back into fresh slots (the
        request's first step waits for the copy)."""
        cache, reqs, table, tpb = self.cache, self.requests, self.page_table, self.layout.tpb
        seq = cache.new_seq(tokens, salt, [n, *marks])
        hit, hits = cache.lookup(seq.hashes, n)
        if cache.host is not None and any(on_host.any() for _, _, on_host in hits):
            self.ledger.poll()          # finished steps' slots count as room for the host blocks
            # the longest hit whose host blocks fit (a shorter lookup prefers device copies; one with no
            # host block always fits)
            while hit and not self._room_for_host_hits(hits):
                hit, hits = cache.lookup(seq.hashes, hit * tpb)
        # -- nothing has changed so far --
        row = reqs.add(rid, n).row
        reqs.hist[row] = cached = hit * tpb
        reqs.set_capacity(row, cached)
        for g, (hit_blocks, hit_slots, on_host) in zip(self.layout.groups, hits):
            some_on_host = on_host.any()
            blocks, slots = (hit_blocks[~on_host], hit_slots[~on_host]) if some_on_host else (hit_blocks, hit_slots)
            if len(blocks):
                self.pools[g.index].acquire(slots)
                table.write(table.cells(g.index, row, blocks), slots)
                if cache.still_arriving(g.index, slots):     # an earlier hit's copy back: wait for it too
                    reqs.loading[row] = cache.last_copy_in
            # (one event per row: the tier copies on one stream, so a group's later event covers an earlier one)
            if some_on_host:
                blocks, host_slots = hit_blocks[on_host], hit_slots[on_host]
                slots, reqs.loading[row] = cache.bring_back(g.index, [seq.hashes[b] for b in blocks.tolist()],
                                                            host_slots.tolist(), self.pools[g.index].allocate)
                table.write(table.cells(g.index, row, blocks), slots)
            reqs.stale_done[g.index, row] = max(g.sink_blocks, min(int(g.stale_end(cached)), hit))
        seq.hit_blocks = hit
        cache.begin(row, seq)
        cache.queries, cache.query_tokens, cache.hit_tokens = cache.queries + 1, cache.query_tokens + n, cache.hit_tokens + cached
        return cached

    def _room_for_host_hits(self, hits) -> bool:
        """Every group can allocate a slot for each hit host block, after the hit device blocks were taken
        back from the evictable list. hits: per group (blocks, slots, on_host), as PrefixCache.lookup."""
        for pool, (_, slots, on_host) in zip(self.pools, hits):
            n = int(np.count_nonzero(on_host))
            if n and n > pool.num_available - pool.count_evictable(slots[~on_host]):
                return False
        return True

    def scratch_range(self, g: LayerGroup, row: int, start: int, end: int) -> Tuple[int, int]:
        return self.cache.scratch_range(g, row, start, end)

    def chunk_end(self, row: int, end: int) -> None:
        self.cache.add_boundary(row, end)

    def copies_before(self) -> list:
        return self.cache.spill_events()        # evicted blocks are copied out before their slots are reused

    def committed(self) -> None:
        self.cache.pending.clear()

    def settle(self, step, entries: Optional[np.ndarray], rows: np.ndarray, hist: np.ndarray, acc: np.ndarray,
               reported) -> None:
        index = np.arange(step.num_seqs) if entries is None else entries
        self.cache.settle(step.rows, index, step.num_contexts, rows, hist, acc, reported, self.page_table.array)

    def end(self, row: int) -> None:
        self.cache.end(row, self.page_table.array)

    def release_window(self, g: LayerGroup, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, tag: int) -> None:
        """Blocks outside every retained window leave the cache once nobody holds them."""
        count = hi - lo
        table, pool = self.page_table, self.pools[g.index]
        pair_rows, blocks = range_pairs(rows, lo, count, np.maximum.reduce(count))
        cells = table.cells(g.index, pair_rows, blocks)
        drop = self.cache.leaving(g, rows.tolist(), count.cumsum().tolist(), blocks.tolist(),
                                  table.flat[cells].tolist())       # each row's blocks in order
        _, slots = table.take(cells)
        pool.release(slots, tag)
        if drop:
            drop = np.array(drop, np.int32)
            self.cache.unhash(g.index, drop[pool.refs[drop] == 0])

    def stats(self) -> dict:
        """The cache's counters and, per group, its blocks (cached, evictable, evicted, on the host)."""
        c = self.cache
        return dict(queries=c.queries, query_tokens=c.query_tokens, hit_tokens=c.hit_tokens,
                    groups=[dict(cached_blocks=len(table), evictable_blocks=pool.num_evictable,
                                 evictions=pool.evictions, host_blocks=len(host))
                            for table, pool, host in zip(c.by_hash, self.pools, c.host_by_hash)])

    def state(self) -> tuple:
        return self.cache.state()
