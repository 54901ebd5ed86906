"""A KV-content oracle: every K/V value a function of what it stands for, read back through the step's tables.

The value of layer l's K (or V) at position p of a request is a function of (salt, the request's tokens up
to and including p, p, l, K or V): two requests that share a salt and a token prefix have the same KV
there, which is exactly what a prefix hit may reuse, and nothing else. The checker's consumer writes each
step's new K/V with KVStorage.write, layer by layer, and after each layer's write gathers every position
that any of the step's queries can see, for every entry, through that step's own `step.tables` (K page and
V page from the table, offset p % tpb). The gathers are enqueued on the manager stream, like a real
consumer's attention reads; `check()` (after a host synchronize) compares them with the values the
positions must hold and raises KVContentError naming the entry, position, page and, where it can, whose
KV the wrong value was.

Used by the KV-content property test (tests/test_kv_content.py), the replay of the CUDA prefix-hit report
(scripts/replay_kv.py) and the GPU suite.
"""
from __future__ import annotations

import hashlib
from typing import Dict, Hashable, List, Sequence

import numpy as np

from cupykv.args import salt_bytes


class KVContentError(AssertionError):
    """A position a query can see read K/V other than the KV the request's tokens there must have."""


def _chain(parent: bytes, token: int) -> bytes:
    return hashlib.blake2b(parent + int(token).to_bytes(8, "little", signed=True), digest_size=16).digest()


def kv_value(prefix_hash: bytes, pos: int, layer: int, role: int, size: int) -> np.ndarray:
    """float32 [size]: the K (role 0) or V (role 1) of one position, integers below 2**24 (exact in any
    storage dtype that holds them: float32 storage is used)."""
    h = hashlib.blake2b(prefix_hash + np.array([pos, layer, role], "<i8").tobytes(), digest_size=4 * size).digest()
    return (np.frombuffer(h, "<u4") >> np.uint32(8)).astype(np.float32)


class _Seq:
    """A request's known tokens and the chained hash after each (hash[p] covers tokens [0, p])."""

    def __init__(self, salt: bytes):
        self.salt = salt
        self.hashes: List[bytes] = []
        self.tokens: List[int] = []

    def set(self, pos: int, tokens: Sequence[int]) -> None:
        """Tokens fed at positions [pos, pos + len(tokens)) (a rewind's later tokens replace rejected ones)."""
        assert pos <= len(self.tokens), (pos, len(self.tokens))
        del self.tokens[pos:], self.hashes[pos:]
        parent = self.hashes[-1] if self.hashes else hashlib.blake2b(b"salt:" + self.salt, digest_size=16).digest()
        for t in tokens:
            parent = _chain(parent, t)
            self.tokens.append(int(t))
            self.hashes.append(parent)


class KVChecker:
    """The consumer of every step: writes K/V, gathers every visible position, checks at check()."""

    def __init__(self, mgr, storage):
        self.mgr, self.storage = mgr, storage
        spec = mgr.spec
        self.layout = mgr.layout
        self.tpb = spec.tokens_per_block
        self.heads, self.dim = storage.num_kv_heads, storage.head_dim
        self.size = self.heads * self.dim
        self.per_layer = spec.table_mode == "per_layer"
        self.seqs: Dict[Hashable, _Seq] = {}
        self.reads: List[tuple] = []
        self.steps_checked = self.positions_checked = 0
        self.xp = storage.xp

    # -- requests ---------------------------------------------------------------------------------
    def add(self, rid, tokens: Sequence[int], salt, hit: int) -> None:
        seq = self.seqs[rid] = _Seq(salt_bytes(salt))
        seq.set(0, tokens)
        seq.prompt_len, seq.hit, seq.name = len(tokens), hit, repr(rid)

    def free(self, rid) -> None:
        self.seqs.pop(rid)

    # -- a step -----------------------------------------------------------------------------------
    def consume(self, step, gen_tokens: Dict[Hashable, Sequence[int]]) -> None:
        """Write the step's K/V layer by layer and gather what its queries see; then step.finish().
        gen_tokens: the tokens fed to each generation entry (num_tokens of them)."""
        n = int(np.sum(step.num_tokens))
        entries = []     # (rid, start, count)
        for e, rid in enumerate(step.request_ids):
            start, count = int(step.start_positions[e]), int(step.num_tokens[e])
            seq = self.seqs[rid]
            if e >= step.num_contexts:
                seq.set(start, gen_tokens[rid])
            assert len(seq.tokens) >= start + count, (rid, start, count, len(seq.tokens))
            entries.append((rid, start, count))
        for layer in range(self.layout.num_layers):
            k = np.empty((n, self.heads, self.dim), np.float32)
            v = np.empty_like(k)
            t = 0
            for rid, start, count in entries:
                seq = self.seqs[rid]
                for p in range(start, start + count):
                    k[t] = kv_value(seq.hashes[p], p, layer, 0, self.size).reshape(self.heads, self.dim)
                    v[t] = kv_value(seq.hashes[p], p, layer, 1, self.size).reshape(self.heads, self.dim)
                    t += 1
            self.storage.write(step, layer, k, v)
            self._gather(step, layer, entries)
        step.finish()
        self.steps_checked += 1

    def _visible(self, layer: int, start: int, count: int) -> np.ndarray:
        g = self.layout.groups[int(self.layout.layer_group[layer])]
        end = start + count
        if g.window is None:
            return np.arange(end)
        lo = max(0, start - g.window + 1)
        sinks = np.arange(min(g.sink_tokens, lo))
        return np.concatenate((sinks, np.arange(lo, end)))

    def _gather(self, step, layer: int, entries) -> None:
        xp = self.xp
        group = int(self.layout.layer_group[layer])
        ent, pos = [], []
        for e, (rid, start, count) in enumerate(entries):
            p = self._visible(layer, start, count)
            ent.append(np.full(len(p), e))
            pos.append(p)
        ent = np.concatenate(ent).astype(np.int64) if ent else np.zeros(0, np.int64)
        pos = np.concatenate(pos).astype(np.int64) if pos else np.zeros(0, np.int64)
        if not len(pos):
            return
        blk, off = pos // self.tpb, pos % self.tpb
        layout_group = self.layout.groups[group]
        tables, pages = step.tables, self.storage.pages(group)
        be = self.storage.backend
        read = dict(hashes=[self.seqs[entries[e][0]].hashes[p] for e, p in zip(ent.tolist(), pos.tolist())])

        def run():      # on the manager stream, after the layer's write (as an attention kernel would read)
            e, b, o = xp.asarray(ent), xp.asarray(blk), xp.asarray(off)
            if self.per_layer:
                kpage, vpage = tables[layer][e, 0, b], tables[layer][e, 1, b]
            else:               # SHARED: the group's base page; the layer's offset added as a consumer would
                base = tables[group][e, 0, b]
                kpage = xp.where(base < 0, -1, base + 2 * layout_group.layers.index(layer))
                vpage = xp.where(base < 0, -1, kpage + 1)
            kv = xp.stack((pages[xp.maximum(kpage, 0), o], pages[xp.maximum(vpage, 0), o]), axis=1)
            read.update(kpage=kpage.copy(), vpage=vpage.copy(), kv=kv.copy())   # the next steps reuse both

        if xp is np:
            be.stream.enqueue(run)          # the simulated stream runs it in order, when it runs
        else:
            with be.device_context(), be.stream:
                run()
        self.reads.append((step.id, layer, group, [entries[e] for e in ent.tolist()], ent, pos, read))

    # -- checking ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Compare every read since the last check (call after the device finished them)."""
        reads, self.reads = self.reads, []
        for step_id, layer, group, ents, ent, pos, read in reads:
            hashes = read["hashes"]
            kpage, vpage = self._host(read["kpage"]), self._host(read["vpage"])
            kv = self._host(read["kv"]).reshape(len(pos), 2, self.size)
            want = np.stack([np.stack((kv_value(h, p, layer, 0, self.size), kv_value(h, p, layer, 1, self.size)))
                             for h, p in zip(hashes, pos.tolist())])
            bad = (kpage < 0) | (vpage < 0) | (kv != want).any(axis=(1, 2))
            self.positions_checked += len(pos)
            if bad.any():
                lines = []
                for j in np.flatnonzero(bad)[:6].tolist():
                    rid, start, count = ents[j]
                    lines.append(f"  entry {int(ent[j])} ({rid!r}, queries [{start}, {start + count})) pos {int(pos[j])} "
                                 f"block {int(pos[j]) // self.tpb}: K page {int(kpage[j])}, V page {int(vpage[j])}: "
                                 f"got K {kv[j, 0, :3].tolist()} V {kv[j, 1, :3].tolist()}, want K "
                                 f"{want[j, 0, :3].tolist()} V {want[j, 1, :3].tolist()}")
                raise KVContentError(f"step {step_id} layer {layer} (group {group}): {int(bad.sum())} of {len(pos)} "
                                     "visible positions read wrong K/V:\n" + "\n".join(lines))

    def _host(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else a.get()


# -- timing of the host backend's simulated streams ---------------------------------------------------
def make_eager(backend, lazy: str = "") -> None:
    """Run the host backend's queued work as soon as it can run, as a GPU that is ahead of the host does;
    streams whose name contains `lazy` (when given) run only when a host wait needs them, as a GPU stream
    that is behind does. One stream running ahead of another exposes a missing cross-stream wait that the
    default (everything waits for the next host wait) hides."""
    device = backend.device

    def drain():        # every stream but the lazy ones, as far as each can go
        progress = True
        while progress:
            progress = False
            for s in device.streams:
                if lazy and lazy in s.name:
                    continue
                while s.queue and s.queue[0][0]():
                    s.queue.popleft()[1]()
                    progress = True

    def eager(stream):
        enqueue = stream.enqueue

        def run_now(run, ready=lambda: True):
            enqueue(run, ready)
            drain()
        stream.enqueue = run_now
        return stream

    for stream in device.streams:
        eager(stream)
    new_stream = backend.new_stream
    backend.new_stream = lambda name="stream": eager(new_stream(name))


TIMINGS = {"lazy": None, "eager": "", "tier-behind": "host tier", "manager-behind": "manager"}


# -- random serving workloads ------------------------------------------------------------------------
def workload_spec(rng, cupykv):
    """A small random spec with prefix caching: mixed windows and sinks, small pools (evictions)."""
    pattern = rng.choice(["repro", "gptoss", "gemma", "sinks"])
    windows, sinks = {"repro": ([None, 11, None, None, 11], [0, 0, 0, 5, 5]),
                      "gptoss": ([9, None, 9, None], 0), "gemma": ([6] * 3 + [None], 0),
                      "sinks": ([12, 12, None], 4)}[pattern]
    tpb = int(rng.choice([2, 4]))
    return cupykv.CacheSpec(windows=windows, sink_tokens=sinks, tokens_per_block=tpb, num_kv_heads=2, head_dim=3,
                            dtype="float32", max_seq_len=56, max_batch=4, max_rewind=int(rng.integers(0, 3)),
                            swa_scratch_reuse=bool(rng.integers(2)), prefix_caching=True,
                            slots_per_group=int(rng.integers(16, 40)), table_mode="per_layer")


class Workload:
    """An overlap scheduler driven at random through the public API, every step consumed by a KVChecker:
    shared prompt prefixes and follow-ups, salts, checkpoints, chunked prefill, decode of 1-4 tokens with
    rejected speculative tokens (rewinds), settles up to 3 steps behind, frees mid-flight, suspend/resume
    through a small host tier. Calls the manager refuses (out of slots, not yet settled, ...) are skipped:
    a refused call changes nothing, which the next steps' reads check too."""

    def __init__(self, seed: int, backend: str = "host", timing: str = "lazy", host_tier_bytes=None):
        import cupykv
        self.cupykv = cupykv
        self.rng = rng = np.random.default_rng(seed)
        self.spec = workload_spec(rng, cupykv)
        self.mgr = cupykv.KVCacheManager(self.spec, backend=backend)
        if backend == "host" and TIMINGS[timing] is not None:
            make_eager(self.mgr.backend, TIMINGS[timing])
        slot_bytes = self.spec.tokens_per_block * 2 * 3 * 4 * 2     # one layer's K and V of a block
        tier = host_tier_bytes if host_tier_bytes is not None else int(rng.integers(3, 12)) * slot_bytes * len(self.spec.windows)
        from cupykv.storage import KVStorage
        self.storage = KVStorage(self.mgr, host_tier_bytes=tier)
        self.check = KVChecker(self.mgr, self.storage)
        self.prefixes = [rng.integers(0, 50, int(rng.integers(8, 30))).tolist() for _ in range(3)]
        self.salts = [None, "alpha", b"beta"]
        self.next_rid = 0
        self.unsettled = []        # (step, {rid: tokens fed}) oldest first
        self.turns = []            # finished requests' (tokens, salt): follow-ups start with them
        self.done = {}             # rid -> tokens known (prompt + fed), for follow-ups
        self.steps = self.refused = 0

    # -- actions ------------------------------------------------------------------------------------
    def add(self) -> None:
        rng = self.rng
        if self.turns and rng.random() < 0.4:
            base, salt = self.turns[int(rng.integers(len(self.turns)))]
        else:
            base, salt = self.prefixes[int(rng.integers(3))], self.salts[int(rng.integers(3))]
        keep = int(rng.integers(1, len(base) + 1))
        tokens = list(base[:keep]) + rng.integers(0, 50, int(rng.integers(1, 12))).tolist()
        tokens = tokens[:self.spec.max_seq_len - 8]
        marks = sorted(set(rng.integers(1, len(tokens) + 1, int(rng.integers(0, 3))).tolist()))
        rid = self.next_rid
        hit = self.mgr.add(rid, len(tokens), tokens=tokens, cache_salt=salt, checkpoints=marks)
        self.next_rid += 1
        self.check.add(rid, tokens, salt, hit)
        self.done[rid] = (list(tokens), salt)

    def prepare(self) -> None:
        rng, mgr = self.rng, self.mgr
        contexts, generation = [], []
        for rid in mgr.request_ids:
            req = mgr.request(rid)
            if req.suspended or rng.random() < 0.25:
                continue
            left = req.prompt_len - req.capacity
            if left > 0:
                contexts.append((rid, int(min(left, rng.integers(1, 20)))))
            elif req.capacity < self.spec.max_seq_len - 6:
                generation.append(rid)
        if not contexts and not generation and rng.random() < 0.8:
            return
        k = int(rng.integers(1, 5))
        n = len(contexts) + len(generation)
        pad = int(rng.integers(max(n, 1), self.spec.max_batch + 1)) if rng.random() < 0.2 else None
        step = mgr.prepare_batch(contexts, generation, num_gen_tokens=k, pad_to=pad)
        fed = {rid: rng.integers(0, 50, k).tolist() for rid in generation}
        self.check.consume(step, fed)
        self.unsettled.append((step, fed))
        self.steps += 1

    def settle(self) -> None:
        step, fed = self.unsettled[0]
        rng = self.rng
        accepted = [int(c) if e < step.num_contexts or rng.random() < 0.7
                    else int(rng.integers(max(0, int(c) - self.spec.max_rewind), int(c) + 1))
                    for e, c in enumerate(step.num_tokens)]
        try:
            self._settle(step, fed, accepted)
        except self.cupykv.StepOrderError:         # a rewind the manager refuses (not the request's latest step)
            self._settle(step, fed, [int(c) for c in step.num_tokens])

    def _settle(self, step, fed, accepted) -> None:
        live = [rid in self.mgr for rid in step.request_ids]
        report = self.rng.random() < 0.8
        new = {rid: fed[rid][:a] for rid, a, ok in zip(step.request_ids[step.num_contexts:],
                                                      accepted[step.num_contexts:], live[step.num_contexts:]) if ok}
        self.mgr.settle(step, accepted, new_tokens=new if report else None)
        self.unsettled.pop(0)
        for rid, a, ok in zip(step.request_ids[step.num_contexts:], accepted[step.num_contexts:],
                              live[step.num_contexts:]):
            if ok:
                self.done[rid][0].extend(fed[rid][:a])

    def free(self, finished: bool = True) -> None:
        """Free a request that has decoded a few tokens (finished), or any (an abort, maybe mid-flight)."""
        mgr = self.mgr
        rids = [r for r in mgr.request_ids if not finished or mgr.request(r).history >= mgr.request(r).prompt_len + 3]
        if not rids:
            return
        rid = rids[int(self.rng.integers(len(rids)))]
        self.mgr.free(rid)
        self.check.free(rid)
        tokens, salt = self.done.pop(rid)
        self.turns = (self.turns + [(tokens, salt)])[-8:]

    def suspend_or_resume(self) -> None:
        rids = self.mgr.request_ids
        rid = rids[int(self.rng.integers(len(rids)))]
        if self.mgr.request(rid).suspended:
            self.storage.resume(rid)
        else:
            self.storage.suspend(rid)

    def sync(self) -> None:
        self.mgr.synchronize()
        self.check.check()

    def run(self, calls: int) -> "Workload":
        """`calls` random calls, then settle everything and check every read."""
        CupykvError = self.cupykv.CupykvError
        rng, mgr = self.rng, self.mgr
        for _ in range(calls):
            r = rng.random()
            try:
                if r < 0.12 and len(mgr.request_ids) < self.spec.max_batch:
                    self.add()
                elif r < 0.5:
                    self.prepare()
                elif r < 0.78 and (len(self.unsettled) > 3 or (self.unsettled and rng.random() < 0.6)):
                    self.settle()
                elif r < 0.86 and mgr.request_ids:
                    self.free()
                elif r < 0.92 and mgr.request_ids:
                    self.suspend_or_resume()
                elif r < 0.94 and mgr.request_ids and rng.random() < 0.3:
                    self.free(finished=False)      # maybe mid-flight: later settles skip it
                elif r > 0.97:
                    self.sync()
            except CupykvError:
                self.refused += 1
            if len(self.unsettled) > 3:
                self.settle()
        while self.unsettled:
            self.settle()
        self.sync()
        return self
