"""Host time of the backend calls inside prepare_batch on the CUDA backend (decode steps whose batch is the
previous one's), next to the raw CUDA calls they are made of.

    python scripts/host_calls.py [batch ...] [--parts] [--no-wait] [--run-parts]     (default 256 1)

Wraps the step plan's run (the copy, the kernels or the graph replay, the ready event), the backend's
record (the consumer's finish) and wait with perf_counter timers; prints the median per step of each and
of prepare_batch itself, with launches and with graphs, how many CUDA events a step had to create (its
backend's pool was empty), and then the median of the bare calls for scale, on an idle stream and while the
stream runs a kernel. --parts: timers around the manager's own parts of a step too. --no-wait: each batch
size a second time without waiting for each step's ready event (as host_floor.py's steps run). --run-parts:
the last step's plan.run taken apart (run_parts).
"""
import sys
import time
from collections import defaultdict

import cupy
import numpy as np

from profile_manager import prefilled_manager, time_parts, timed_decode_step, timer
from cupykv.backends import cuda as cuda_backend
from cupykv.staging import H_NUM_CELLS

spent = defaultdict(float)
timed = timer(spent)


def scope_round_trip(device_id: int) -> None:
    with cuda_backend.DeviceScope(device_id):
        pass


def run_parts(mgr, step) -> None:
    """The last step's plan.run taken apart, each part called 300 times on the manager's own plan: the whole
    run, the device scope, the launch's choice and grid (route, fused_grid), the driver's launch of the
    step kernel alone (an inline launch, with its real parameters: for a small step the inline kernel's
    512-byte snapshot struct; a step copied from its slot is not launched alone) and the ready event's
    record. Every launch enqueues the last step again: its kernel reads the same snapshot, so it writes what
    it wrote (the manager is not used after this)."""
    pipe, be = mgr.pipeline, mgr.backend
    listed, slot = pipe._list, pipe.ring._last
    if listed is None or listed.host is not slot.host:
        print("  run_parts: the last step was not a list step; skipped")
        return
    plan, st = pipe.mirrors[0].plan(slot.twins[0]), be.stream
    words, tokens, entries = listed.words, int(step.num_tokens.sum()), 0
    num_cells = int(slot.host[H_NUM_CELLS])
    inline = plan.route(words, None).launch
    blocks = sum(cuda_backend.fused_grid(plan._grid, step.mode, entries, num_cells, tokens))
    parts = [("plan.run (whole)", lambda: plan.run(st, step.mode, words, num_cells, entries, tokens)),
             ("DeviceScope enter/exit", lambda: scope_round_trip(be.device_id)),
             ("route + fused_grid", lambda: (plan.route(words, None),
                                               cuda_backend.fused_grid(plan._grid, step.mode, entries, num_cells,
                                                                       tokens)))]
    if inline is not None:
        parts.append(("the launch (driver call)", lambda: inline[1](blocks, st.ptr)))
    parts.append(("backend.record", lambda: be.record(st)))
    how = f"inline: {inline[0]} words, {blocks} blocks" if inline is not None else "copied from its slot"
    print(f"the last step's plan.run by part ({how}), medians of 300:")
    for label, fn in parts:
        ts = []
        for _ in range(300):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            st.synchronize()
        print(f"  {label:32s} {np.median(ts) * 1e6:7.1f} us")


def measure(batch: int, steps: int = 250, skip: int = 50, sync: bool = True) -> None:
    """sync: wait for each step's ready event before the next step (the host thread sleeps in the wait, as
    an engine's does when it waits for the GPU); False: steps follow one another with no wait, as in
    host_floor.py (the GPU keeps up: a step's device work is a few microseconds)."""
    mgr = prefilled_manager(batch, backend="cuda")
    be = mgr.backend
    created = [0]
    event_init = cuda_backend.CudaEvent.__init__

    def counted_init(self, ptr=None, pool=None):
        created[0] += ptr is None       # a new handle: the pool had none
        event_init(self, ptr, pool)
    cuda_backend.CudaEvent.__init__ = counted_init
    plan_run = cuda_backend.CudaStepPlan.run
    cuda_backend.CudaStepPlan.run = timed("plan.run (copy+kernels+ready)", plan_run)
    be.record = timed("record (ready + finish)", be.record)      # the ready one inside plan.run too
    be.wait = timed("wait", be.wait)
    restore = time_parts(timed) if "--parts" in sys.argv else []
    rids = list(range(batch))
    try:
        for graphs in (False, True):
            mgr.use_graphs = graphs
            per = defaultdict(list)
            made = 0
            for i in range(steps):
                spent.clear()
                if i == skip:
                    made = created[0]
                prepare, settle, s = timed_decode_step(mgr, rids)
                if sync:
                    s.ready.synchronize()
                if i >= skip:
                    per["prepare_batch (total)"].append(prepare)
                    per["settle"].append(settle)
                    for k, v in spent.items():
                        per[k].append(v)
            print(f"batch {batch}, graphs={graphs}, {'a wait for each step' if sync else 'no wait between steps'}: "
                  f"medians per step over {steps - skip} decode steps")
            for k, v in per.items():
                print(f"  {k:32s} {np.median(v) * 1e6:7.1f} us")
            print(f"  events created (pool empty)      {(created[0] - made) / (steps - skip):7.2f} per step")
    finally:
        del be.record, be.wait          # the instance's timers: the class's methods again
        cuda_backend.CudaStepPlan.run = plan_run
        cuda_backend.CudaEvent.__init__ = event_init
        for owner, name, fn in restore:
            setattr(owner, name, fn)
    if "--run-parts" in sys.argv:
        run_parts(mgr, s)


def floor_calls():
    """The calls the benchmark's floor times on the host (bench.timing.CudaTimer.floor), on buffers of their
    own: (enqueue, stream, kernel, its device buffer, the pinned 4 KB source); enqueue() is a 4 KB
    memcpyAsync and one launch of an empty kernel."""
    k = cupy.RawKernel('extern "C" __global__ void noop(int* p) {}', "noop")
    dev = cupy.zeros(1024, np.int32)
    host = cupy.cuda.alloc_pinned_memory(4096)
    st = cupy.cuda.Stream(non_blocking=True)
    k((1,), (32,), (dev,), stream=st)
    rt = cupy.cuda.runtime

    def enqueue():
        rt.memcpyAsync(dev.data.ptr, host.ptr, 4096, rt.memcpyHostToDevice, st.ptr)
        k((1,), (32,), (dev,), stream=st)
    return enqueue, st, k, dev, host


def bare_calls() -> None:
    """The raw calls a step is made of, for scale."""
    _, st, k, dev, host = floor_calls()
    packed = cuda_backend.PackedLaunch(k, (dev,))
    ev = cupy.cuda.Event(block=True, disable_timing=True)
    cs = cupy.cuda.Stream(non_blocking=True)
    cs.begin_capture()
    k((1,), (32,), (dev,), stream=cs)
    graph = cs.end_capture()
    graph.upload(st)
    rt = cupy.cuda.runtime

    # A kernel that keeps the stream busy for about 100 us, so that a call can be timed while the stream has
    # work in flight, as a step's calls do (the step's own launch, the consumer's kernels).
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }''', "spin")
    cycles = np.int64(200_000)
    spin((1,), (1,), (cycles,), stream=st)
    st.synchronize()
    wait_for = cupy.cuda.Event(block=True, disable_timing=True)
    wait_for.record(cs)
    print("bare calls (medians of 300), on an idle stream / while the stream runs a 100 us kernel:")
    for label, fn in (("RawKernel call, 1 arg", lambda: k((1,), (32,), (dev,), stream=st)),
                      ("PackedLaunch, 1 arg", lambda: packed(1, st.ptr)),
                      ("memcpyAsync 4 KB pinned", lambda: rt.memcpyAsync(dev.data.ptr, host.ptr, 4096,
                                                                         rt.memcpyHostToDevice, st.ptr)),
                      ("Event() + record", lambda: cupy.cuda.Event(block=True, disable_timing=True).record(st)),
                      ("eventRecord (raw)", lambda: rt.eventRecord(ev.ptr, st.ptr)),
                      ("graph.launch (cupy)", lambda: graph.launch(st)),
                      ("graphLaunch (raw)", lambda: rt.graphLaunch(graph.graphExec, st.ptr)),
                      ("streamWaitEvent (raw)", lambda: rt.streamWaitEvent(st.ptr, wait_for.ptr)),
                      ("DeviceScope enter/exit", lambda: scope_round_trip(0))):
        medians = []
        for busy in (False, True):
            ts = []
            for _ in range(300):
                if busy:
                    spin((1,), (1,), (cycles,), stream=st)
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
                if busy:
                    st.synchronize()
            st.synchronize()
            medians.append(np.median(ts) * 1e6)
        print(f"  {label:32s} {medians[0]:7.1f} / {medians[1]:7.1f} us")


if __name__ == "__main__":
    for b in [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [256, 1]:
        measure(b)
        if "--no-wait" in sys.argv:
            measure(b, sync=False)
    bare_calls()
