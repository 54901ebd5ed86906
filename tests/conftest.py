import numpy as np
import pytest

import cupykv
from cupykv import reference

BACKENDS = ["host", "cuda"]


def backend_or_skip(name: str) -> str:
    if name == "cuda" and not cupykv.cuda_available():
        pytest.skip("no usable CUDA GPU here (CuPy missing or no driver); the GPU suite runs on the H200")
    return name


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    return backend_or_skip(request.param)


def expected_tables(mgr: cupykv.KVCacheManager, table_at_prepare: np.ndarray, step: cupykv.Step) -> np.ndarray:
    """The reference output of `step`, from the host table as it was at the step's prepare."""
    lay = mgr.layout
    if mgr.spec.table_mode == "shared":
        ref = reference.convert_shared(table_at_prepare, step.rows, lay.group_scale, max_batch=mgr.spec.max_batch)
    else:
        ref = reference.convert_per_layer(table_at_prepare, step.rows, step.num_contexts, step.scratch_begs,
                                          step.scratch_ends, step.scratch_slots, lay.layer_group,
                                          lay.group_scale, lay.layer_koff, max_batch=mgr.spec.max_batch)
    return ref[:, :step.num_seqs]


class Capture:
    """A consumer on its own stream: waits for the step's ready event, copies its tables out, finishes.

    Nothing runs until the device does the work, so what it captured is what a real attention kernel
    would have read at that point of the stream order.
    """

    def __init__(self, mgr: cupykv.KVCacheManager):
        self.mgr = mgr
        self.stream = mgr.backend.new_stream("consumer")
        self.items = []   # (step, table at prepare, device buffer)
        self.spare = []   # buffers allocated while nothing is gated (an allocation's memset would queue)

    def reserve(self, count: int) -> "Capture":
        """Allocate buffers for `count` steps now, before a gate holds the streams."""
        be = self.mgr.backend
        self.spare += [be.device_empty(self.mgr.out.size).reshape(self.mgr.out.shape) for _ in range(count)]
        be.synchronize()
        return self

    def consume(self, step: cupykv.Step) -> None:
        be = self.mgr.backend
        buf = self.spare.pop() if self.spare else be.device_empty(self.mgr.out.size).reshape(self.mgr.out.shape)
        be.wait(self.stream, step.ready)
        be.copy_d2d(buf, self.mgr.out, self.stream)
        step.finish(self.stream)
        self.items.append((step, self.mgr.table.copy(), buf))

    def mismatches(self) -> list:
        """Ids of captured steps whose tables differ from the reference (call after the work ran)."""
        bad = []
        for step, table, buf in self.items:
            got = self.mgr.backend.to_numpy(buf)[:, :step.num_seqs]
            if not np.array_equal(got, expected_tables(self.mgr, table, step)):
                bad.append(step.id)
        return bad
