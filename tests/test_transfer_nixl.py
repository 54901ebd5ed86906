"""The NIXL transport (skipped without the nixl package): two agents in one process, over DRAM on the host
backend and VRAM on CUDA, checked against the same K/V oracle as the loopback transport."""
import json
import time

import numpy as np
import pytest

from test_transfer import Side, expected_blocks, sides

nixl = pytest.importorskip("cupykv.transports.nixl")
if not nixl.nixl_available():
    pytest.skip("the nixl package is not installed (pip install nixl, or cupykv[nixl])", allow_module_level=True)

_names = iter(range(1_000_000))


def agents(sender: Side, receiver: Side):
    a = nixl.NixlAgent(sender.transfers, f"prefill-{next(_names)}")
    b = nixl.NixlAgent(receiver.transfers, f"decode-{next(_names)}")
    b.connect(a.metadata())
    a.connect(b.metadata())
    return a, b


@pytest.mark.parametrize("n", [7, 45])
def test_nixl_read_round_trip(backend_name, n):
    sender, receiver = sides(backend_name)
    sender.prefill("r", n, seed=3)
    a, b = agents(sender, receiver)
    out = a.send("r")
    out.wait_ready()
    read = b.read(json.loads(json.dumps(out.meta.to_dict())))
    assert read.wait(timeout=30) == "DONE"
    assert read.num_descriptors <= sum(len(x) for x in expected_blocks(n))
    ended = []
    deadline = time.monotonic() + 30
    while not ended and time.monotonic() < deadline:      # the notification may trail the READ's completion
        ended += a.poll_sent()
    assert ended == [("r", True)] and "r" not in sender.mgr
    receiver.seeds["r"] = 3
    receiver.decode_and_check("r", 10)
    a.close()
    b.close()


def test_nixl_read_of_an_unconnected_sender_changes_nothing(backend_name):
    sender, receiver = sides(backend_name)
    sender.prefill("r", 20, seed=3)
    a = nixl.NixlAgent(sender.transfers, f"prefill-{next(_names)}")
    b = nixl.NixlAgent(receiver.transfers, f"decode-{next(_names)}")
    out = a.send("r")
    before = receiver.mgr.state()
    with pytest.raises(Exception, match="not connected"):
        b.read(out.meta)
    assert receiver.mgr.state() == before
    sender.transfers.unsend("r")


def test_descriptor_runs_merge_blocks_adjacent_on_both_sides():
    src_slots, dst_slots = np.array([3, 4, 5, 9, 10]), np.array([7, 8, 20, 21, 22])
    s, d = nixl.descriptor_runs(src_slots * 100 + 1000, src_slots, dst_slots * 100 + 5000, dst_slots, 100, (0, 1))
    assert s.tolist() == [[1300, 200, 0], [1500, 100, 0], [1900, 200, 0]]
    assert d.tolist() == [[5700, 200, 1], [7000, 100, 1], [7100, 200, 1]]
