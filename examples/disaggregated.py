"""Prefill on one manager, decode on another: a prompt's KV moves between them window-only.

A GPT-OSS-like model (sliding-window and full-attention layers interleaved): the prefill manager runs the
prompt in chunks and writes its K/V; only the blocks a later query can still see move (every block of the
full-attention layers, the window of the sliding ones); the decode manager, whose slots are assigned
differently, continues the request. Every decode step's attention, read through the decode manager's own
tables and pages, is checked against dense attention over the K/V the oracle gives each position.

Transports: NIXL (the `nixl` package) when it is installed, with the two managers in two processes that
exchange agent metadata and the transfer's meta over a pipe; without NIXL, the loopback transport (a copy
on one device) with both managers in this process. The output says which ran; the exit status is non-zero
on any mismatch.

    python examples/disaggregated.py [--backend auto|cuda|host] [--transport auto|nixl|loopback]
                                     [--processes 1|2]
"""
import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

import cupykv
from cupykv.transfer import KVTransfers

WINDOWS = [32, None, 32, None]          # sliding window 32 and full attention, alternating
TPB, H, D, QH = 16, 2, 32, 4            # tokens per block, KV heads, head size, query heads
PROMPT, CHUNK, DECODE = 300, 128, 24


def spec():
    return cupykv.CacheSpec(windows=WINDOWS, num_kv_heads=H, head_dim=D, dtype="float32", tokens_per_block=TPB,
                            max_seq_len=512, max_batch=4, slots_per_group=96)


def kv(layer: int, positions) -> np.ndarray:
    """The oracle's K at these positions ([n, H, D], float32); V is K rolled by one along D."""
    p = np.asarray(positions, np.float64)[:, None, None]
    hd = np.arange(H * D, dtype=np.float64).reshape(1, H, D)
    return np.sin(0.013 * (p + 1) * (hd + 1) + layer).astype(np.float32)


def query(layer: int, pos: int) -> np.ndarray:
    return np.cos(0.007 * (pos + 3) * (np.arange(QH * D).reshape(QH, D) + 1) + layer).astype(np.float32)


def visible(pos: int, window) -> np.ndarray:
    return np.arange(0 if window is None else max(0, pos - window + 1), pos + 1)


def attend(q, k, v):
    """q [QH, D], k, v [n, H, D] -> [QH, D] (grouped-query heads, float64 softmax)."""
    kk = np.repeat(k.astype(np.float64), QH // H, axis=1)
    vv = np.repeat(v.astype(np.float64), QH // H, axis=1)
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), kk) / np.sqrt(D)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, vv)


def write(storage, step, positions):
    for layer in range(len(WINDOWS)):
        k = kv(layer, positions)
        storage.write(step, layer, k, np.roll(k, 1, axis=2))


def prefill(backend: str):
    mgr = cupykv.KVCacheManager(spec(), backend=backend)
    storage = cupykv.KVStorage(mgr)
    mgr.add("req", PROMPT)
    done = 0
    while done < PROMPT:
        n = min(CHUNK, PROMPT - done)
        step = mgr.prepare_batch({"req": n})
        write(storage, step, np.arange(done, done + n))
        step.finish()
        mgr.settle(step)
        done += n
    return mgr, storage


def decode_manager(backend: str):
    mgr = cupykv.KVCacheManager(spec(), backend=backend)
    storage = cupykv.KVStorage(mgr)
    mgr.add("other", 40)                 # another request first: the received blocks land in other slots
    step = mgr.prepare_batch({"other": 40})
    write(storage, step, np.arange(40))
    step.finish()
    mgr.settle(step)
    return mgr, storage


def decode_and_check(mgr, storage) -> float:
    """Decode DECODE tokens; every layer's attention through the tables against dense attention. Returns
    the largest difference."""
    be, worst = mgr.backend, 0.0
    for _ in range(DECODE):
        pos = mgr.request("req").history
        step = mgr.prepare_batch((), ["req"])
        write(storage, step, [pos])
        tables = be.to_numpy(step.tables)
        for layer, window in enumerate(WINDOWS):
            pages = be.to_numpy(storage.layer_pages(layer))
            seen = visible(pos, window)
            k = pages[tables[layer, 0, 0, seen // TPB], seen % TPB]
            v = pages[tables[layer, 0, 1, seen // TPB], seen % TPB]
            want_k = kv(layer, seen)
            got = attend(query(layer, pos), k, v)
            want = attend(query(layer, pos), want_k, np.roll(want_k, 1, axis=2))
            worst = max(worst, float(np.abs(got - want).max()))
        step.finish()
        mgr.settle(step)
    return worst


def whole_sequence_bytes(storage, history: int) -> int:
    """What moving every block of every group would take."""
    return sum(-(-history // TPB) * int(a[0].nbytes) for a in storage.arrays)


def report(moved: int, whole: int, worst: float, transport: str, where: str) -> int:
    ok = worst < 1e-5
    print(f"transport: {transport} ({where})")
    print(f"moved {moved / 1024:.1f} KiB window-only, {whole / 1024:.1f} KiB for the whole sequence "
          f"({moved / whole:.0%})")
    print(f"decode: {DECODE} steps on the receiving manager, attention vs dense: max |diff| {worst:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def run_loopback(backend: str) -> int:
    from cupykv.transports import LoopbackTransport
    a_mgr, a_store = prefill(backend)
    b_mgr, b_store = decode_manager(backend)
    sender, receiver = KVTransfers(a_store), KVTransfers(b_store)
    out = sender.send("req")
    inc = receiver.receive(out.meta.to_dict())
    read = LoopbackTransport(sender, receiver).read(out, inc)
    receiver.received("req", ready=read.event)        # its first step waits for the copies on the device
    read.wait()
    sender.sent("req")
    worst = decode_and_check(b_mgr, b_store)
    return report(inc.descriptors.nbytes, whole_sequence_bytes(b_store, PROMPT), worst, "loopback",
                  "two managers in one process")


def nixl_prefill(backend: str, conn, two_processes: bool) -> None:
    """The sending side: prefill, offer the KV over NIXL, wait for the receiver's READ to finish."""
    from cupykv.transports.nixl import NixlAgent
    mgr, storage = prefill(backend)
    agent = NixlAgent(KVTransfers(storage), "prefill")
    conn.send(agent.metadata())
    agent.connect(conn.recv())
    out = agent.send("req")
    out.wait_ready()
    conn.send(out.meta.to_dict())
    ended, deadline = [], time.monotonic() + 60
    while not ended and time.monotonic() < deadline:
        ended = agent.poll_sent()
    conn.send(("sent", ended, "req" in mgr))
    conn.recv()                      # the receiver is done with our memory
    agent.close()


def nixl_decode(backend: str, conn):
    from cupykv.transports.nixl import NixlAgent
    mgr, storage = decode_manager(backend)
    agent = NixlAgent(KVTransfers(storage), "decode")
    agent.connect(conn.recv())
    conn.send(agent.metadata())
    meta = conn.recv()
    read = agent.read(meta)
    state = read.wait(timeout=60)
    if state != "DONE":
        print(f"NIXL READ ended in state {state}")
        return 1, read, 0.0
    worst = decode_and_check(mgr, storage)
    return 0, read, worst


def _prefill_process(backend, conn):
    nixl_prefill(backend, conn, True)


def run_nixl(backend: str, processes: int) -> int:
    if processes == 2:
        here, there = mp.Pipe()
        child = mp.get_context("spawn").Process(target=_prefill_process, args=(backend, there))
        child.start()
        where = "two processes"
    else:
        import threading
        here, there = mp.Pipe()
        child = threading.Thread(target=nixl_prefill, args=(backend, there, False))
        child.start()
        where = "two agents in one process"
    failed, read, worst = nixl_decode(backend, here)
    if not here.poll(120):
        print("the sending side did not report back")
        return 1
    _, ended, still_there = here.recv()
    here.send("bye")
    child.join(60)
    if ended != [("req", True)] or still_there:
        print(f"the sender did not see the transfer complete: {ended}")
        failed = 1
    if failed:
        return 1
    store_bytes = read.nbytes
    whole = sum(-(-PROMPT // TPB) * n for n in read.incoming.descriptors.slot_bytes)
    return report(store_bytes, whole, worst, f"NIXL ({read.num_descriptors} descriptors)", where)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "host"])
    ap.add_argument("--transport", default="auto", choices=["auto", "nixl", "loopback"])
    ap.add_argument("--processes", type=int, default=2, choices=[1, 2])
    args = ap.parse_args(argv)
    backend = "cuda" if args.backend == "auto" and cupykv.cuda_available() else (
        "host" if args.backend == "auto" else args.backend)
    transport = args.transport
    if transport == "auto":
        from cupykv.transports.nixl import nixl_available
        transport = "nixl" if nixl_available() else "loopback"
        if transport == "loopback":
            print("NIXL is not installed (pip install nixl): using the loopback transport")
    print(f"backend: {backend}")
    if transport == "loopback":
        return run_loopback(backend)
    return run_nixl(backend, args.processes)


if __name__ == "__main__":
    sys.exit(main())
