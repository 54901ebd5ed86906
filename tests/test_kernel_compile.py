"""Compile-check the CUDA kernel modules with NVRTC; needs no GPU (cupy.RawModule would).

Each module is compiled from cupykv.kernels.module_source(name), the exact source the CUDA backend loads:
the constants the kernels share with Python (the snapshot header layout of staging.py, BAD, the block
size) are generated from the Python values and prepended, so no test keeps two copies of them equal;
instead these tests check that no .cu file defines one of them itself.

Runs in CI wherever CuPy and an NVRTC wheel are installed; skips, saying why, where they are not.
"""
import re

import pytest

from cupykv import kernels, layout, staging


def _is_missing_library(exc: BaseException) -> bool:
    # cuda.pathfinder raises DynamicLibNotFoundError (a RuntimeError) when no NVRTC library is found;
    # match by name so this test does not depend on where that class lives.
    return any(cls.__name__ == "DynamicLibNotFoundError" for cls in type(exc).__mro__)


def _compile(source: str, name: str):
    """(True, PTX) or (False, compiler log)."""
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        pytest.skip(f"cupy is not importable ({exc}); install cupy-cuda12x to compile-check the kernels")
    try:
        prog = nvrtc.createProgram(source, name, [], [])
    except Exception as exc:
        if _is_missing_library(exc):
            pytest.skip(f"no NVRTC library ({exc}); install nvidia-cuda-nvrtc-cu12 to compile-check the kernels")
        raise
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_90", *kernels.OPTIONS])
    except Exception as exc:
        if _is_missing_library(exc):
            pytest.skip(f"no NVRTC library ({exc}); install nvidia-cuda-nvrtc-cu12 to compile-check the kernels")
        return False, f"{exc}\n{nvrtc.getProgramLog(prog)}"
    ptx = nvrtc.getPTX(prog)
    return True, ptx.decode() if isinstance(ptx, bytes) else ptx


def _entries(ptx: str) -> dict:
    """PTX entry name -> the directives between its parameter list and its body (.maxntid and the like)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\.entry\s+(\w+)\s*\([^)]*\)([^{]*)\{", ptx)}


def _without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


@pytest.mark.parametrize("module", sorted(kernels.MODULES))
def test_module_compiles_with_nvrtc(module):
    """What the backend loads compiles, and defines exactly its own kernels: the files split the kernels
    by user, so none is in two modules and none is missing."""
    ok, out = _compile(kernels.module_source(module), kernels.MODULES[module].file)
    assert ok, f"{kernels.MODULES[module].file} does not compile as the backend loads it: {out}"
    # extern "C": the PTX entry is the plain name, which is what RawModule.get_function looks up
    assert set(_entries(out)) == set(kernels.MODULES[module].kernels)


def test_build_step_launch_bound_is_the_launch_block_size():
    """cupykv_build_step's __launch_bounds__ comes from kernels.STEP_THREADS, the block size the backend
    launches it with; a launch with more threads than the bound would fail on the device."""
    ok, ptx = _compile(kernels.module_source("step"), "step.cu")
    assert ok, ptx
    bound = re.search(r"\.maxntid\s+(\d+)", _entries(ptx)["cupykv_build_step"])
    assert bound is not None, "cupykv_build_step has no .maxntid: its __launch_bounds__ is gone"
    assert int(bound.group(1)) == kernels.STEP_THREADS
    from cupykv.backends import cuda     # importable without a GPU (cupy is, see the module docstring)
    assert cuda.STEP_THREADS == kernels.STEP_THREADS


def test_step_cu_relies_on_the_generated_constants():
    """step.cu alone does not compile: it reads the header through names only the generated prelude
    defines. If it compiled, the file would carry its own copy of them again."""
    ok, log = _compile((kernels.KERNEL_DIR / "step.cu").read_text(), "step.cu")
    assert not ok, "step.cu compiles without the generated constants: it defines them itself again"
    assert "H_" in log or "STEP_THREADS" in log, log


def test_no_cu_file_defines_a_shared_constant():
    """No .cu file defines (constexpr, #define, enum or assignment) a name the backend generates, so
    Python's value is the only one."""
    generated = set(staging.kernel_constants()) | {"STEP_THREADS", "INLINE_SNAPSHOT_WORDS",
                                                    "SMALL_INLINE_SNAPSHOT_WORDS"}
    files = sorted(kernels.KERNEL_DIR.glob("*.cu"))
    assert {f.name for f in files} == {m.file for m in kernels.MODULES.values()}, "a .cu file no module loads"
    for path in files:
        text = _without_comments(path.read_text())
        for name in generated:
            definition = re.search(rf"#\s*define\s+{name}\b|\b{name}\s*=(?!=)|\b{name}\s*\{{", text)
            assert definition is None, f"{path.name} defines {name} ({definition.group(0)!r})"


def test_generated_constants_describe_a_valid_header():
    """The generated lines are staging's header layout: every H_* word index once, each a distinct word
    inside HEADER_WORDS (two names on one word would make a kernel read the wrong field), distinct modes,
    and layout's BAD."""
    lines = staging.cuda_constants().splitlines()
    parsed = dict(re.fullmatch(r"constexpr int (\w+) = (-?\d+);", line).groups() for line in lines)
    assert len(parsed) == len(lines), "a name is generated twice"
    parsed = {name: int(value) for name, value in parsed.items()}
    header = {name: getattr(staging, name) for name in dir(staging) if name.startswith("H_")}
    assert header and {n: v for n, v in parsed.items() if n.startswith("H_")} == header
    assert len(set(header.values())) == len(header), f"two header fields share a word: {header}"
    assert all(0 <= v < staging.HEADER_WORDS for v in header.values())
    assert parsed["HEADER_WORDS"] == staging.HEADER_WORDS
    assert parsed["MODE_FULL"] != parsed["MODE_DELTA"]
    assert parsed["BAD"] == layout.BAD



def _kernel_param_kinds(entry: str) -> list:
    """The PTX parameter types (u64, u32, ...) of one kernel of the step module, compiled here."""
    return [kind for kind, _ in _kernel_param_sizes(entry)]


def _kernel_param_sizes(entry: str) -> list:
    """(kind, bytes) of each PTX parameter of one kernel of the step module: ("u64", 8), ("u32", 4), and
    ("b8", n) for a struct passed by value."""
    ok, ptx = _compile(kernels.module_source("step"), "step.cu")
    assert ok, ptx
    params = re.search(r"\.entry\s+" + entry + r"\s*\(([^)]*)\)", ptx).group(1)
    sizes = []
    for decl in params.split(","):
        struct = re.search(r"\.b8\s+\w+\[(\d+)\]", decl)
        kind = "b8" if struct else re.search(r"\.param\s+\.(\w+)", decl).group(1)
        sizes.append((kind, int(struct.group(1)) if struct else int(kind[1:]) // 8))
    return sizes


def _build_step_args(monkeypatch, null_slot: bool):
    """(consts, mirror, the arguments CudaBackend packs for cupykv_build_step but the table block count), for
    a small two-group layout, with numpy stand-ins for the device arrays."""
    import types
    import numpy as np
    from cupykv.backends import cuda
    from cupykv.layout import Layout
    from cupykv.pipeline import KernelConsts
    from cupykv.spec import CacheSpec

    lay = Layout(CacheSpec(windows=[32, None], num_kv_heads=1, head_dim=8, tokens_per_block=16, max_seq_len=200,
                           max_batch=3, slots_per_group=10, null_slot=null_slot))
    monkeypatch.setattr(cuda, "_require_device", lambda *a, **k: None)
    consts = KernelConsts(lay, 3, types.SimpleNamespace(upload=np.array))
    B, L = lay.max_blocks, lay.num_layers
    mirror = np.zeros((lay.num_groups, 3, B), np.int32)
    _, fixed = cuda.CudaBackend._step_launch_args(
        np.zeros(64, np.int32), mirror, np.zeros((L, 3, 2, B), np.int32), np.zeros(3, np.int32),
        np.zeros((L, 8), np.int32), np.zeros(8, np.int32), consts, False)
    return consts, mirror, fixed


def test_build_step_launch_arguments_match_the_kernel_signature(monkeypatch):
    """The arguments CudaBackend passes to cupykv_build_step (its buffers and the per-manager device constants,
    the null slots included, then the int32 scalars and the table block count) line up one for one with the
    kernel's parameters: pointers where the kernel takes pointers, 32-bit ints where it takes ints. A
    mismatch would only show on a GPU, as garbage."""
    import numpy as np

    kinds = _kernel_param_kinds("cupykv_build_step")
    consts, _, fixed = _build_step_args(monkeypatch, null_slot=True)
    args = fixed + (np.int32(1),)                       # build_step appends the table block count
    passed = ["u64" if isinstance(a, np.ndarray) else "u32" if isinstance(a, np.int32) else type(a).__name__
              for a in args]
    assert passed == kinds, f"launch arguments {passed} vs kernel parameters {kinds}"
    assert any(a is consts.d_group_null for a in args), "the null slots do not reach the kernel"


def test_step_launch_arguments_match_the_kernel_signature(monkeypatch):
    """The arguments the pipeline's one launch per step passes to cupykv_step (built from cupykv_build_step's,
    test above) line up one for one with the kernel's parameters, and the per-step values the plan sets
    before each launch (copy words, the phase grids) sit where the kernel reads them."""
    import ctypes
    import numpy as np

    kinds = _kernel_param_kinds("cupykv_step")        # skips without CuPy, before the import below needs it
    from cupykv.backends import cuda
    _, mirror, fixed = _build_step_args(monkeypatch, null_slot=False)
    sync = np.zeros(4, np.int32)
    args = cuda._fused_launch_args(ctypes.c_uint64(0), fixed, np.int64(mirror.size), sync)
    passed = ["u64" if isinstance(a, (np.ndarray, ctypes.c_uint64, np.int64)) else
              "u32" if isinstance(a, np.int32) else type(a).__name__ for a in args]
    assert passed == kinds, f"launch arguments {passed} vs kernel parameters {kinds}"
    names = re.findall(r"cupykv_step\(([^)]*)\)", kernels.module_source("step"))[-1]
    names = [p.split()[-1].lstrip("*") for p in names.replace("\n", " ").split(",")]
    assert len(names) == len(args)
    for index, name in ((cuda.STEP_ARG_COPY_WORDS, "copy_words"), (cuda.STEP_ARG_COPY_BLOCKS, "copy_blocks"),
                        (cuda.STEP_ARG_APPLY_BLOCKS, "apply_blocks"), (cuda.STEP_ARG_TABLE_BLOCKS, "table_blocks")):
        assert names[index] == name and isinstance(args[index], np.int32)
    assert args[-1] is sync and args[1] is fixed[0] and args[3] is mirror


@pytest.mark.parametrize("kernel,words", kernels.INLINE_STEP_KERNELS)
def test_inline_step_launch_arguments_match_the_kernel_signature(monkeypatch, kernel, words):
    """Each inline step kernel takes the snapshot by value (its words, read from the ring slot's host
    address), then cupykv_step's arguments from the mirror on but the copy's; the phase grids the plan
    sets sit at the same indices as in cupykv_step; and all its parameters fit in the 4 KB every CUDA device
    takes (a larger launch fails on older drivers and costs every launch the copy)."""
    import numpy as np

    sizes = _kernel_param_sizes(kernel)       # skips without CuPy, before the import below
    from cupykv.backends import cuda
    _, mirror, fixed = _build_step_args(monkeypatch, null_slot=False)
    sync = np.zeros(4, np.int32)
    args = cuda._inline_launch_args(0x1000, fixed, np.int64(mirror.size), sync)
    passed = [("b8", words * 4) if isinstance(a, cuda.ParamBytes) else
              ("u64", 8) if isinstance(a, (np.ndarray, np.int64)) else
              ("u32", 4) if isinstance(a, np.int32) else (type(a).__name__, 0) for a in args]
    assert passed == sizes, f"launch arguments {passed} vs kernel parameters {sizes}"
    assert args[0].address == 0x1000 and args[1] is mirror and args[-1] is sync
    source = kernels.module_source("step")
    assert f"STEP_INLINE_KERNEL({kernel}, " in source      # both are made by one macro, from its parameter list
    names = re.findall(r"\bNAME\(([^)]*)\)", source)[-1]
    names = [p.split()[-1].lstrip("*") for p in names.replace("\\", " ").replace("\n", " ").split(",")]
    assert len(names) == len(args)
    for index, name in ((cuda.STEP_ARG_APPLY_BLOCKS, "apply_blocks"), (cuda.STEP_ARG_TABLE_BLOCKS, "table_blocks")):
        assert names[index] == name and isinstance(args[index], np.int32)
    end = 0
    for kind, size in sizes:               # each parameter at its alignment: its size, the struct's 4
        align = 4 if kind == "b8" else size
        end = -(-end // align) * align + size
    assert end <= 4096, f"{kernel} takes {end} bytes of parameters"
