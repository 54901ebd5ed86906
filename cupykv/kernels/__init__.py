"""The CUDA C++ kernels of the CUDA backend, one file per user, and the exact source of each module.

- step.cu: the per-step device work: cupykv_step (the pipeline's one launch per step; cupykv_step_inline
  and cupykv_step_inline_small for a small step, its snapshot in the launch's parameters), and its parts
  as kernels of their own (cupykv_apply_deltas, cupykv_build_step).
- kv_write.cu: KVStorage writes (cupykv_write_kv_u16, cupykv_write_kv_u32).
- tier_copy.cu: the host tier's copies, both ways (cupykv_copy_runs).
- gate.cu: the test gate (cupykv_gate).

backends/cuda.py compiles each file as its own CuPy RawModule. Constants that Python and a kernel both
rely on are written in no .cu file: module_source() prepends them, generated from the Python values (the
snapshot layout from staging.py, BAD and QUAD_BLOCKS from layout.py, the block size and the rest below). Importing this package needs
neither CuPy nor a GPU, so tests compile exactly this source with NVRTC on machines without one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, NamedTuple, Optional, Tuple

from ..staging import cuda_constants

KERNEL_DIR = Path(__file__).resolve().parent
OPTIONS = ("-std=c++17",)

# Threads per block of every step kernel launch; cupykv_build_step, cupykv_step and cupykv_step_inline declare
# it as their __launch_bounds__, and a launch with more threads than that would fail.
STEP_THREADS = 256

# Words of cupykv_step's phase counters (the next ticket, copy blocks done, apply blocks done, blocks
# exited), a device buffer per mirror that the last block to exit zeroes for the next launch.
STEP_SYNC_WORDS = 4

# Snapshot words a cupykv_step_inline launch carries as its parameter: with the kernel's other parameters
# (128 bytes) within the 4 KB of parameters every CUDA device takes (more costs the launch: the driver copies
# the whole struct into every launch).
INLINE_SNAPSHOT_WORDS = 960
# ... and a cupykv_step_inline_small launch: a small batch's decode step fits it (b1: 30-40 words), and the
# driver's copy of a 0.6 KB parameter block costs the host less than that of a 3.9 KB one.
SMALL_INLINE_SNAPSHOT_WORDS = 128
# The inline step kernels, smallest first: (name, snapshot words it carries).
INLINE_STEP_KERNELS = (("cupykv_step_inline_small", SMALL_INLINE_SNAPSHOT_WORDS),
                       ("cupykv_step_inline", INLINE_SNAPSHOT_WORDS))

# cupykv_copy_runs' launch, per direction: the fewest blocks that move about as much as the bus carries, which
# leaves the other SMs to the model (docs/performance.md, "Host tier"):
# writes to pinned memory need few in flight; reads from it wait a bus round trip each, so more blocks.
# Each block stages TIER_COPY_RUNS_PER_STAGE runs at a time in shared memory (24 bytes each).
TIER_COPY_BLOCKS_TO_HOST = 4
TIER_COPY_BLOCKS_TO_DEVICE = 16
TIER_COPY_THREADS = 512
TIER_COPY_RUNS_PER_STAGE = 256


class KernelModule(NamedTuple):
    file: str                                   # under cupykv/kernels/
    kernels: Tuple[str, ...]                    # its extern "C" entry points
    prelude: Optional[Callable[[], str]] = None  # generated definitions compiled in front of the file


def _step_prelude() -> str:
    return (cuda_constants() + f"constexpr int STEP_THREADS = {STEP_THREADS};\n"
            f"constexpr int INLINE_SNAPSHOT_WORDS = {INLINE_SNAPSHOT_WORDS};\n"
            f"constexpr int SMALL_INLINE_SNAPSHOT_WORDS = {SMALL_INLINE_SNAPSHOT_WORDS};\n"
            f"constexpr int STEP_SYNC_WORDS = {STEP_SYNC_WORDS};\n")


def _tier_copy_prelude() -> str:
    return (f"constexpr int TIER_COPY_THREADS = {TIER_COPY_THREADS};\n"
            f"constexpr int TIER_COPY_RUNS_PER_STAGE = {TIER_COPY_RUNS_PER_STAGE};\n")


MODULES: Dict[str, KernelModule] = {
    "step": KernelModule("step.cu", ("cupykv_apply_deltas", "cupykv_build_step", "cupykv_step",
                                    "cupykv_step_inline", "cupykv_step_inline_small"), _step_prelude),
    "kv_write": KernelModule("kv_write.cu", ("cupykv_write_kv_u16", "cupykv_write_kv_u32")),
    "tier_copy": KernelModule("tier_copy.cu", ("cupykv_copy_runs",), _tier_copy_prelude),
    "gate": KernelModule("gate.cu", ("cupykv_gate",)),
}

_MODULE_OF = {kernel: name for name, module in MODULES.items() for kernel in module.kernels}


def module_of(kernel: str) -> str:
    """The name of the module (a key of MODULES) that defines `kernel`."""
    try:
        return _MODULE_OF[kernel]
    except KeyError:
        raise KeyError(f"no cupykv kernel named {kernel!r}; known: {sorted(_MODULE_OF)}") from None


def module_source(name: str) -> str:
    """The exact source the CUDA backend compiles for module `name` (a key of MODULES): the generated
    definitions, if the module has any, then the file. The #line directive keeps compiler messages on the
    file's own line numbers."""
    module = MODULES[name]
    text = (KERNEL_DIR / module.file).read_text()
    if module.prelude is None:
        return text
    return f'{module.prelude()}#line 1 "{module.file}"\n{text}'
