"""The CUDA sources compile with this machine's nvcc for sm_90 (skipped without nvcc).

The kernels and their launchers (``normspec_launch.cu``, ``launch_units/*.cu``,
torch-free; the file the CuPy backend shares through ``normspec_kernels.cuh``) are
compiled to objects; the torch-facing ``normspec_cuda.cpp`` is compiled by the host
compiler against torch's and CUDA's headers. A CUDA compile error therefore
shows up here, on any machine with nvcc, before it reaches a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "backends" / "csrc"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


NVCC = _nvcc()
#: The torch-free translation units: the entry points, then the launch units (one forward
#: or backward of one op and dtype each, as the extension build compiles them).
LAUNCH_UNITS = ("normspec_launch.cu",
                *sorted(f"launch_units/{p.name}" for p in (CSRC / "launch_units").glob("*.cu")))
#: What a launch unit's name says it instantiates: dtype, op and direction.
UNIT_DTYPES = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half"}
UNIT_OPS = {"rms": "OP_RMS", "fused": "OP_FUSED", "fused_sum": "OP_FUSED_SUM",
            "gated": "OP_GATED"}
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def test_kernel_sources_include_no_torch_header():
    for name in ("normspec_kernels.cuh", "normspec_pipe.cuh", "normspec_gated_bwd.cuh",
                 "normspec_arith.h", "normspec_launch.h", "normspec_launch_impl.cuh",
                 "normspec_plan.h", *LAUNCH_UNITS):
        text = (CSRC / name).read_text()
        includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', text)
        bad = [i for i in includes if i.split("/")[0] in {"torch", "ATen", "c10"}]
        assert not bad, f"{name} includes torch headers: {bad}"


@needs_nvcc
def test_kernels_compile_for_sm90(tmp_path):
    """Every launch unit compiles (in parallel, as the extension build does), they link into
    one library, and the entry points' calls are exactly what the launch units define."""
    def compile_unit(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        obj = tmp_path / (Path(name).name + ".o")
        cmd = [NVCC, "-arch=sm_90", "-std=c++17", "-O3", "-fmad=false", "-Xcompiler", "-fPIC",
               "-I", str(CSRC), "-c", str(CSRC / name), "-o", str(obj)]
        return obj, subprocess.run(cmd, capture_output=True, text=True)

    # one compile per core at a time (22 at once on CI's two cores only thrash)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        procs = dict(zip(LAUNCH_UNITS, pool.map(compile_unit, LAUNCH_UNITS), strict=True))
    for name, (obj, proc) in procs.items():
        assert proc.returncode == 0, f"{name}:\n{proc.stderr[-6000:]}"
        assert obj.stat().st_size > 0
    # the units link together (no symbol defined twice)
    lib = tmp_path / "libnormspec_launch.so"
    done = subprocess.run([NVCC, "-shared", "-o", str(lib), *(str(o) for o, _ in procs.values())],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]
    nm = shutil.which("nm")
    if nm is None:
        return
    def symbols(name: str, kinds: str) -> set[str]:
        out = subprocess.run([nm, "-C", str(procs[name][0])], capture_output=True, text=True,
                             check=True).stdout
        found = (re.match(r"^\s*(?:[0-9a-fA-F]+\s+)?([A-Za-z])\s+(.*)$", line)
                 for line in out.splitlines())
        return {m.group(2) for m in found
                if m and m.group(1) in kinds
                and re.search(r"launch_detail::(forward|backward)_t<", m.group(2))}

    # the entry points leave every forward_t / backward_t to the units, each of which
    # defines one
    wanted = symbols("normspec_launch.cu", "U")
    assert len(wanted) == 21, wanted
    defined = [symbols(name, "WT") for name in LAUNCH_UNITS[1:]]
    assert all(len(d) == 1 for d in defined), defined
    assert wanted == set().union(*defined), wanted ^ set().union(*defined)


def test_launch_units_instantiate_what_their_names_say():
    """Every (dtype, op, direction) has its unit, and a unit instantiates what its name
    says: a misnamed unit would build, yet leave the timing claims of the docs about
    another kernel (the symbol test above holds the set, this one the names)."""
    seen = set()
    for name in LAUNCH_UNITS[1:]:
        dtype, rest = Path(name).stem.split("_", 1)
        op, direction = rest.rsplit("_", 1)
        macro = {"forward": "NORMSPEC_FORWARD_UNIT", "backward": "NORMSPEC_BACKWARD_UNIT"}
        line = f"{macro[direction]}({UNIT_OPS[op]}, {UNIT_DTYPES[dtype]})"
        assert line in (CSRC / name).read_text().splitlines(), f"{name}: expected {line}"
        seen.add((dtype, op, direction))
    kinds = {(op, "forward") for op in ("rms", "fused", "gated")} | {
        (op, "backward") for op in UNIT_OPS}
    assert seen == {(d, op, direction) for d in UNIT_DTYPES for op, direction in kinds}


def test_extension_build_compiles_every_launch_unit():
    pytest.importorskip("torch")
    from normspec.backends.torch_ext import _build

    assert set(_build.LAUNCH_UNITS) == set(LAUNCH_UNITS[1:])
    assert set(_build.CUDA_SOURCES) >= {"normspec_launch.cu", *LAUNCH_UNITS[1:]}


ROW_VECTOR_PROBE = r"""
#include "normspec_pipe.cuh"
__global__ void probe(const uint4* a, uint4* b) {
  normspec::store_row_vector(b + threadIdx.x, normspec::load_row_vector(a + threadIdx.x));
}
"""


@needs_nvcc
def test_row_vector_cache_policies(tmp_path):
    """The rows' 16-byte loads carry an L2 evict_last policy operand and the stores are
    plain ``st.global``; the probe assembles for sm_90a."""
    src = tmp_path / "probe.cu"
    src.write_text(ROW_VECTOR_PROBE)
    ptx = tmp_path / "probe.ptx"
    base = [NVCC, "-arch=sm_90a", "-std=c++17", "-O3", "-I", str(CSRC), str(src)]
    done = subprocess.run([*base, "-ptx", "-o", str(ptx)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]
    text = ptx.read_text()
    loads = re.findall(r"\bld\.global[.:\w]*\.v4\.\w+", text)
    stores = re.findall(r"\bst\.global[.:\w]*\.v4\.\w+", text)
    assert loads == ["ld.global.L2::cache_hint.v4.u32"], loads
    assert len(stores) == 1 and "cache_hint" not in stores[0] and ".cs." not in stores[0], stores
    assert re.search(r"createpolicy\.fractional\.L2::evict_last\.b64", text), text
    done = subprocess.run([*base, "-cubin", "-o", str(tmp_path / "probe.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]


def _ptx_of(tmp_path: Path, source: str, arch: str, *flags: str) -> str:
    """The PTX nvcc makes of `source` (the kernel headers on its include path) for `arch`."""
    src = tmp_path / "probe.cu"
    src.write_text(source)
    ptx = tmp_path / "probe.ptx"
    done = subprocess.run([NVCC, f"-arch={arch}", "-std=c++17", "-O3", *flags, "-I", str(CSRC),
                           str(src), "-ptx", "-o", str(ptx)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]
    return ptx.read_text()


@needs_nvcc
def test_row_vectors_are_plain_before_sm80(tmp_path):
    """Before sm_80 there is no ``createpolicy``: the default build's row loads are plain
    ``ld.global`` there, and the probe still compiles."""
    text = _ptx_of(tmp_path, ROW_VECTOR_PROBE, "sm_75")
    assert "createpolicy" not in text and "cache_hint" not in text, text
    assert re.findall(r"\bld\.global[.:\w]*\.v4\.\w+", text) == ["ld.global.v4.u32"], text

HF_PACKED_PROBE = r"""
#include "normspec_pipe.cuh"
template __global__ void normspec_fwd_row_kernel<2, __nv_bfloat16, 2, 3, true, 5>(
    const __nv_bfloat16*, const __nv_bfloat16*, const void*, __nv_bfloat16*, __nv_bfloat16*,
    long long, long long, long long, long long, long long, long long, float, float, int, int,
    float*, const float*);
"""
#: The gated backward's GC 7 (hf, bf16 weight, packed weight products).
HF_PACKED_BWD_PROBE = r"""
#include "normspec_pipe.cuh"
template __global__ void normspec_bwd_pipe_kernel<2, __nv_bfloat16, 1, 4, true, 7>(
    const __nv_bfloat16*, const __nv_bfloat16*, const void*, const __nv_bfloat16*,
    const __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, float*, long long, long long,
    long long, long long, long long, long long, long long, long long, float, float, int, int,
    int, const float*);
"""


@needs_nvcc
@pytest.mark.parametrize("probe", [HF_PACKED_PROBE, HF_PACKED_BWD_PROBE],
                         ids=["forward_form_5", "backward_gc_7"])
@pytest.mark.parametrize(("arch", "packed"), [("sm_90", "mul.rn.bf16x2"),
                                              ("sm_80", "fma.rn.bf16x2"), ("sm_75", None)])
def test_hf_packed_weight_product_per_arch(tmp_path, arch, packed, probe):
    """The packed bf16 product (mul_rn_bf16x2) of the hf gated forward's GT form 5 and of
    the backward's GC 7 (both weight products, u for dgate and dxhat) is ``mul.rn.bf16x2``
    from sm_90, ``fma.rn.bf16x2`` with a -0 addend on sm_80, and before sm_80 (no bf16
    arithmetic) the fp32 product rounded: each kernel compiles for each arch, with eight
    products a thread (the forward: two passes of four pairs; the backward: one vector of
    four pairs, two products each) where there is a packed instruction, and no other bf16
    arithmetic."""
    text = _ptx_of(tmp_path, probe, arch, "-fmad=false")
    found = re.findall(r"\b(?:mul|fma)\.rn\.bf16x2\b", text)
    assert found == ([packed] * 8 if packed else []), found


@needs_nvcc
def test_torch_facing_cuda_source_compiles(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils import cpp_extension

    homes = [os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME,
             str(Path(NVCC).resolve().parents[1]), "/usr/local/cuda"]
    cuda_include = next((Path(h) / "include" for h in homes
                         if h and (Path(h) / "include" / "cuda_runtime.h").exists()), None)
    if cuda_include is None:
        pytest.skip("CUDA headers (cuda_runtime.h) not found")
    includes = [*cpp_extension.include_paths(), str(cuda_include),
                sysconfig.get_paths()["include"]]
    # CPU builds of torch ship the c10/cuda headers without their generated macro header
    stub = tmp_path / "stub"
    macro = "c10/cuda/impl/cuda_cmake_macros.h"
    if not any((Path(p) / macro).exists() for p in includes):
        (stub / macro).parent.mkdir(parents=True)
        (stub / macro).write_text("#pragma once\n")
        includes.append(str(stub))
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no host compiler {cxx!r}")
    cmd = [cxx, "-std=c++20", "-fPIC", "-O0", "-ffp-contract=off", "-fsyntax-only",
           "-I", str(CSRC), *(f"-isystem{p}" for p in includes),
           str(CSRC / "normspec_cuda.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]
    del torch


# ---- NVRTC: the kernels header as the CuPy backend compiles it ----------------------------
def _libnvrtc():
    import ctypes
    import ctypes.util
    import glob

    names = []
    found = ctypes.util.find_library("nvrtc")
    if found:
        names.append(found)
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            names += sorted(glob.glob(str(Path(home) / "lib64" / "libnvrtc.so*")))
    try:  # pip wheel nvidia-cuda-nvrtc: nvidia/cuda_nvrtc/lib (CUDA 12), nvidia/cu13/lib (13)
        import nvidia

        for root in nvidia.__path__:
            names += sorted(glob.glob(str(Path(root) / "*" / "lib" / "libnvrtc.so*")))
    except ImportError:
        pass
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


NAME_EXPRESSIONS = [
    f"normspec_fwd_kernel<{op}, {t}, {np}>" for op in (0, 1, 2)
    for t in ("float", "__nv_bfloat16", "__half") for np in (1, 2, 4)
] + [
    f"normspec_bwd_kernel<{op}, {t}, 1>" for op in (0, 1, 2)
    for t in ("float", "__nv_bfloat16", "__half")
] + [
    "normspec_fwd_stream_kernel<2, __nv_bfloat16>",
    "normspec_bwd_stream_kernel<1, __half>",
    "normspec_col_tree_kernel",
]


def test_kernels_compile_with_nvrtc():
    import ctypes

    lib = _libnvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found")
    cuda_includes = [str(Path(h) / "include") for h in
                     (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if h]
    prog = ctypes.c_void_p()
    src = b'#include "normspec_kernels.cuh"\n'
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"normspec.cu", 0, None, None) == 0
    for expr in NAME_EXPRESSIONS:
        assert lib.nvrtcAddNameExpression(prog, expr.encode()) == 0
    opts = [b"--std=c++17", b"--gpu-architecture=compute_90", b"--fmad=true",
            f"-I{CSRC}".encode(), *(f"-I{p}".encode() for p in cuda_includes)]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode(errors="replace")[-6000:]
    for expr in NAME_EXPRESSIONS:
        lowered = ctypes.c_char_p()
        assert lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(lowered)) == 0
        assert lowered.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))


ROW_FORWARD_PROBE = r"""
#include "normspec_pipe.cuh"
template __global__ void normspec_fwd_row_kernel<0, __nv_bfloat16, 1, 8, false, 0>(
    const __nv_bfloat16*, const __nv_bfloat16*, const void*, __nv_bfloat16*, __nv_bfloat16*,
    long long, long long, long long, long long, long long, long long, float, float, int, int,
    float*, const float*);
"""

#: The 256-wide q/k rows' form: one pass, a team of 32 lanes, eight teams a block.
WARP_TEAM_FORWARD_PROBE = ROW_FORWARD_PROBE.replace("1, 8, false", "1, 5, false")


def _entry(ptx: str, name: str) -> str:
    """The PTX of the one ``.entry`` whose mangled name contains `name`."""
    parts = [p for p in re.split(r"(?=\.visible \.entry )", ptx)
             if p.startswith(".visible .entry ") and name in p.split("(", 1)[0]]
    assert len(parts) == 1, [p.split("(", 1)[0] for p in parts]
    return parts[0]


@needs_nvcc
def test_one_row_forward_block_fold_and_row_per_block(tmp_path):
    """The 1 x 2048 bf16 forward's form (one pass, a team of 256 lanes, one block a row):
    its eight warps' partials are folded from shared memory in every lane, so only the five
    in-warp shuffle levels remain, and its row is ``blockIdx.x``, so it never reads
    ``rows`` (parameter 5)."""
    text = _entry(_ptx_of(tmp_path, ROW_FORWARD_PROBE, "sm_90a", "-fmad=false"),
                  "normspec_fwd_row_kernel")
    assert len(re.findall(r"\bshfl\.sync\.", text)) == 5
    assert "_param_5]" not in text


@needs_nvcc
def test_warp_team_forward_row_in_32_bits(tmp_path):
    """The 256-wide bf16 forward's form (a team of one warp): its row is the block's first
    team plus the warp, in 32 bits (no 64-bit shift of a grid-wide thread index); five
    butterfly levels and a broadcast."""
    text = _entry(_ptx_of(tmp_path, WARP_TEAM_FORWARD_PROBE, "sm_90a", "-fmad=false"),
                  "normspec_fwd_row_kernel")
    assert len(re.findall(r"\bshfl\.sync\.", text)) == 6
    assert not re.search(r"\bshr\.[us]64\b", text)


def _offset_adds_around_the_reduction(text: str) -> tuple[int, int]:
    """In one kernel's PTX: the ``add.rn.f32`` instructions that read the ``offset``
    parameter (the forward's parameter 12) before the first ``shfl.sync`` and after the
    last one."""
    reg = re.search(r"ld\.param\.f32\s+(%f\d+), \[\w+_param_12\]", text).group(1)
    lines = text.splitlines()
    shuffles = [i for i, line in enumerate(lines) if "shfl.sync." in line]
    adds = [i for i, line in enumerate(lines)
            if re.search(rf"\badd\.rn\.f32\s.*{re.escape(reg)}\b", line)]
    return (sum(i < shuffles[0] for i in adds), sum(i > shuffles[-1] for i in adds))


@needs_nvcc
@pytest.mark.parametrize(("probe", "before", "after"), [
    (WARP_TEAM_FORWARD_PROBE, 8, 8),
    (ROW_FORWARD_PROBE, 8, 0),
], ids=["warp_team", "whole_block"])
def test_one_pass_forward_scales_the_raw_weight_after_the_reduction(
        tmp_path, probe, before, after):
    """The one-pass bf16 forward of a warp team (the 256-wide q/k rows) keeps a bf16
    weight read as it is raw until the reduction is done and widens it and adds the
    offset for the output: eight offset adds after the last shuffle, beside the fp32
    weight's eight before the first one (its path is unchanged). The whole-block form
    (rows of 2048) scales every weight before the reduction starts."""
    text = _entry(_ptx_of(tmp_path, probe, "sm_90a", "-fmad=false"),
                  "normspec_fwd_row_kernel")
    assert _offset_adds_around_the_reduction(text) == (before, after)


QUAD_FORWARD_PROBE = r"""
#include "normspec_pipe.cuh"
template __global__ void normspec_fwd_quad_kernel<LL_OP, __nv_bfloat16, LL_LANES>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
    __nv_bfloat16*, int, long long, long long, long long, long long, float, float, int,
    float*);
"""


@needs_nvcc
@pytest.mark.parametrize(("op", "lanes_log", "row_loads", "stores", "barriers", "shuffles"), [
    (0, 6, 1, 1, 1, 5), (1, 6, 2, 2, 1, 5), (0, 5, 1, 1, 0, 6), (1, 5, 2, 2, 0, 6),
], ids=["rms256", "fused256", "rms128", "fused128"])
def test_quad_forward_shape(tmp_path, op, lanes_log, row_loads, stores, barriers, shuffles):
    """The q/k forward in vectors of four: each lane loads its four x (and residual) values
    and the weight's in 8-byte loads and stores 8 bytes (the fused op's new residual too);
    five butterfly levels a warp; a row of 256 (two warps) folds the two warp sums through
    shared memory behind one barrier, a row of 128 (one warp) broadcasts lane 0's sum
    instead."""
    source = QUAD_FORWARD_PROBE.replace("LL_OP", str(op)).replace("LL_LANES", str(lanes_log))
    text = _entry(_ptx_of(tmp_path, source, "sm_90a", "-fmad=false"), "normspec_fwd_quad_kernel")
    assert len(re.findall(r"\bld\.global\.L2::cache_hint\.v2\.u32\b", text)) == row_loads
    assert len(re.findall(r"\bld\.global\.nc\.v2\.u32\b", text)) == 1  # the weight
    assert len(re.findall(r"\bst\.global\.v2\.u32\b", text)) == stores
    assert len(re.findall(r"\bbar\.sync\b", text)) == barriers
    assert len(re.findall(r"\bshfl\.sync\.bfly\b", text)) == 5
    assert len(re.findall(r"\bshfl\.sync\.", text)) == shuffles


_BACKWARD_ARGS = """
    const __nv_bfloat16*, const __nv_bfloat16*, const void*, const __nv_bfloat16*,
    const __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, float*, long long, long long,
    long long, long long, long long, long long, long long, long long, float, float, int, int,
    int, const float*);"""

#: The vllm gated backward of the bench's 2^21 x 128 bf16 (a team of 16 lanes, one pass,
#: the saved rstd): with the gate table's convention constants (GC 0) and without.
GATED_BACKWARD_PROBE = (
    '#include "normspec_pipe.cuh"\n'
    "template __global__ void normspec_bwd_pipe_kernel<2, __nv_bfloat16, 1, 4, true, 0>("
    + _BACKWARD_ARGS +
    "\ntemplate __global__ void normspec_bwd_pipe_kernel<2, __nv_bfloat16, 1, 4, true, -1>("
    + _BACKWARD_ARGS + "\n")

#: One row's three 128-bit loads (x, the gate, dy) of the gated backward, as PTX issues them
#: from global memory (the weight's are read-only loads of another width, the rstd's a scalar).
_ROW_VECTOR_LOADS = r"\bld\.global\S*\.v4\.u32\b"


@needs_nvcc
def test_backward_gc_forms_keep_two_rows_ahead(tmp_path):
    """The gate-table constant forms (GC) load a second row set (the team's second row
    before the loop, the row after the next one in it), so their PTX has two more sites of
    a row's three vector loads than the same geometry's form without GC (one row ahead)."""
    ptx = _ptx_of(tmp_path, GATED_BACKWARD_PROBE, "sm_90a", "-fmad=false")
    loads = [len(re.findall(_ROW_VECTOR_LOADS, _entry(ptx, name)))
             for name in ("Li1ELi4ELb1ELin1EE", "Li1ELi4ELb1ELi0EE")]
    assert loads[0] >= 6 and loads[1] == loads[0] + 6, loads


OFFSETS_FIT_MAIN = r"""
#include "normspec_launch_impl.cuh"
#include <cstdio>
int main() {
  // rows, H, which stride (0..5: sx, sr, sdy, sdres, sy, sy2; -1: none) and its value;
  // the other strides 0, as the launcher leaves those an op does not read
  const long long cases[][4] = {@CASES@};
  for (const auto& c : cases) {
    normspec::LaunchArgs a;
    a.rows = c[0];
    a.H = c[1];
    long long* strides[] = {&a.sx, &a.sr, &a.sdy, &a.sdres, &a.sy, &a.sy2};
    if (c[2] >= 0) *strides[c[2]] = c[3];
    printf("%d\n", normspec::launch_detail::offsets_fit_32(a) ? 1 : 0);
  }
}
"""

#: The strides offsets_fit_32 weighs, in LaunchArgs's order (dx's is sy, d2's sy2).
_STRIDES = ("sx", "sr", "sdy", "sdres", "sy", "sy2")

#: ((rows, H, stride name or None, stride), whether the pair kernel's 32-bit offsets fit:
#: every row index within 2^30, the last row's last element within 2^31 - 2).
OFFSETS_FIT_CASES = [
    ((1 << 21, 128, "sx", 128), True),  # the bench's gated backward
    (((1 << 24) - 1, 128, None, 0), True),  # H alone: the last element at 2^31 - 129
    ((1 << 24, 128, None, 0), False),  # ... at 2^31 - 1
    ((715827883, 1, "sx", 3), True),  # the last element at 2^31 - 2 exactly
    ((715827884, 1, "sx", 3), False),
    *(((1 << 19, 128, name, 4096), True) for name in _STRIDES),  # each stride counts
    *((((1 << 19) + 1, 128, name, 4096), False) for name in _STRIDES),
    ((1 << 30, 1, "sx", 1), True),
    (((1 << 30) + 1, 1, "sx", 1), False),  # more rows than the 32-bit group arithmetic allows
    ((0, 128, "sx", 128), True),
]


@needs_nvcc
def test_backward_offsets_fit_32_bits(tmp_path):
    """The launcher's bound for ``normspec_gated_bwd_pair_kernel``'s 32-bit arithmetic
    (compiled and run on the host), at its edges and for each stride, and the CuPy
    backend's the same."""
    rows = []
    for (n, hidden, name, stride), _ in OFFSETS_FIT_CASES:
        which = -1 if name is None else _STRIDES.index(name)
        rows.append("{" + ", ".join(f"{v}LL" for v in (n, hidden, which, stride)) + "}")
    src = tmp_path / "fit.cu"
    src.write_text(OFFSETS_FIT_MAIN.replace("@CASES@", ", ".join(rows)))
    exe = tmp_path / "fit"
    done = subprocess.run([NVCC, "-std=c++17", "-arch=compute_90", "-code=compute_90",
                           "-I", str(CSRC), str(src), "-o", str(exe)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1" if fits else "0" for _, fits in OFFSETS_FIT_CASES]
    from normspec.backends import cupy as cb

    assert [cb.geometry.offsets_fit_32(n, hidden, () if name is None else (stride,))
            for (n, hidden, name, stride), _ in OFFSETS_FIT_CASES] == [
        fits for _, fits in OFFSETS_FIT_CASES]
