"""What a graph replay would pay to carry a step's snapshot in its kernel's parameters, as a launch does.

A captured graph's kernel parameters are fixed, so a replay of cupykv's step reads its snapshot from the pinned
ring slot over the bus. `cuGraphExecKernelNodeSetParams` can replace a node's parameters (and grid) before
each replay; the driver copies them at that call, as it copies a launch's when the launch is enqueued. This
times, for a kernel that reads a header and 64 words at the offset it gives (snapshot_probe.py's pattern):

  launch, parameters: cuLaunchKernel with a 3.8 KB __grid_constant__ struct (cupykv_step_inline's way);
  replay, pinned: a graph of a kernel that copies a 1024-word bucket from pinned memory, then reads it
    (what a step graph replay does now);
  set params + replay: the parameter kernel's graph, its node's parameters set from the slot, then replayed.

Host: the call(s) alone. Device: GPU time between events around them, the stream held by the CUDA backend's
gate while the host enqueues. Each replay's output is checked against the slot as it was at the set-params
call (the probe writes -1 into the slot right after every call, so a kernel that read it late sees -1).

    python scripts/graph_params_probe.py [reps]
"""
import ctypes
import sys
import time

import cupy
import numpy as np
from cupy.cuda import driver

from snapshot_probe import USE, pinned_snapshot     # scripts/ is on the path when run as a script

SRC = USE + r"""
struct Snap { int w[960]; };

extern "C" __global__ void k_copy(const int* s, int* twin, int words, int* out)
{
    for (int i = threadIdx.x; i < words; i += blockDim.x)
        twin[i] = s[i];
    __syncthreads();
    use(twin, out);
}
extern "C" __global__ void k_param(const __grid_constant__ Snap s, int* out) { use(s.w, out); }
"""


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS (the _v2 layout of CUDA 12 and 13)."""
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p)]


def _cuda_fn(lib, *names):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return fn
    raise RuntimeError(f"libcuda has none of {names}")


def main(reps: int = 400) -> None:
    from cupykv.backends.cuda import CudaBackend
    be = CudaBackend()
    lib = ctypes.CDLL("libcuda.so.1")
    set_params = _cuda_fn(lib, "cuGraphExecKernelNodeSetParams_v2", "cuGraphExecKernelNodeSetParams")
    get_nodes = _cuda_fn(lib, "cuGraphGetNodes")
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",))
    stream = be.stream
    words = 1024
    host, snap = pinned_snapshot(words)
    twin = cupy.empty(words, np.int32)
    out = cupy.zeros(words, np.int32)
    cells = {
        "copy": [ctypes.c_uint64(host.ptr), ctypes.c_uint64(twin.data.ptr), ctypes.c_int32(words),
                 ctypes.c_uint64(out.data.ptr)],
        "param": [None, ctypes.c_uint64(out.data.ptr)],
    }
    params = {k: (ctypes.c_void_p * len(c))(*[host.ptr if x is None else ctypes.addressof(x) for x in c])
              for k, c in cells.items()}
    fns = {"copy": mod.get_function("k_copy").kernel.ptr, "param": mod.get_function("k_param").kernel.ptr}
    for k in fns:         # loaded and run once before any gate: loading a kernel waits for the held stream
        driver.launchKernel(fns[k], 1, 1, 1, 256, 1, 1, 0, stream.ptr, ctypes.addressof(params[k]), 0)
    stream.synchronize()

    graphs = {}
    for k in fns:
        cs = cupy.cuda.Stream(non_blocking=True)
        cs.begin_capture()
        driver.launchKernel(fns[k], 1, 1, 1, 256, 1, 1, 0, cs.ptr, ctypes.addressof(params[k]), 0)
        g = cs.end_capture()
        g.upload(cs)
        cs.synchronize()
        graphs[k] = g
    node = ctypes.c_void_p()
    n = ctypes.c_size_t(1)
    assert get_nodes(ctypes.c_void_p(graphs["param"].graph), ctypes.byref(node), ctypes.byref(n)) == 0 and n.value == 1
    node_params = KernelNodeParams(fns["param"], 1, 1, 1, 256, 1, 1, 0, ctypes.addressof(params["param"]), None,
                                   None, None)
    exec_param = ctypes.c_void_p(graphs["param"].graphExec)

    def launch_param():
        driver.launchKernel(fns["param"], 1, 1, 1, 256, 1, 1, 0, stream.ptr, ctypes.addressof(params["param"]), 0)

    def replay_copy():
        cupy.cuda.runtime.graphLaunch(graphs["copy"].graphExec, stream.ptr)

    def set_and_replay():
        rc = set_params(exec_param, node, ctypes.byref(node_params))
        if rc:
            raise RuntimeError(f"cuGraphExecKernelNodeSetParams: CUresult {rc}")
        cupy.cuda.runtime.graphLaunch(graphs["param"].graphExec, stream.ptr)

    cases = {"launch, parameters (3.8 KB)": (launch_param, True),
             "replay, pinned (1024-word copy)": (replay_copy, False),
             "set params + replay (3.8 KB)": (set_and_replay, True)}
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    print(f"{'case':36s} {'device us':>10s} {'host us':>9s}  checked")
    for name, (call, snapshots) in cases.items():
        dt, ht, wrong = [], [], 0
        for i in range(reps):
            snap[16 + 5] = i               # the value this call's kernel must read
            gate = be.gate(stream)
            e0.record(stream)
            t = time.perf_counter()
            call()
            ht.append(time.perf_counter() - t)
            snap[16 + 5] = -1              # rewritten after the call: a kernel that read the slot late sees -1
            e1.record(stream)
            gate.open()
            e1.synchronize()
            dt.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
            got = int(out[5])
            wrong += got != (i if snapshots else -1)
        skip = min(20, reps // 2)
        print(f"{name:36s} {np.median(dt[skip:]):10.2f} {np.median(ht[skip:]) * 1e6:9.2f}  "
              f"{'reads its snapshot' if snapshots else 'reads the slot late'}: {reps - wrong} of {reps}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
