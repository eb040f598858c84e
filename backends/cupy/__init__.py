"""``normspec.backends.cupy``: the first-party CUDA kernels through CuPy and NVRTC.

The kernels are the torch extension's own (``backends/csrc``, shipped as package data),
compiled as they are by NVRTC, lazily: one module per (operator, dtype, direction)
holding every template instantiation that module launches (``MODULES``), cached on disk
and memoised per process and device. A compile is announced on stderr; ``available()``,
which the registry asks, compiles all the modules side by side in threads
(``compile_modules``, which ``normspec build`` runs ahead of time).

The host launch logic of ``normspec_launch_impl.cuh`` is mirrored in Python (the
planners below: ``row_forward_launch``, ``pipe_backward_launch``, ...), so that both
backends run the same kernels with the same grids, blocks and shared memory;
tests/test_cupy_launch_parity.py holds the two to that. A call's launches are planned
once per shape, dtypes, flags, alignment and row strides and kept (``_plans``). Every
launch goes through the driver's ``cuLaunchKernelEx`` (ctypes), which also chains the
dweight tree's launches after the backward kernel (programmatic dependent launch, from
sm_90, outside a CUDA graph capture); CuPy's ``RawKernel`` launches only where a driver
before CUDA 12.0 lacks it. Every kernel gives the spec's bits.

| Setting | What it does |
|---|---|
| ``NORMSPEC_CUPY_CACHE_DIR`` | the compiled modules' folder |

Without it the modules are cached in ``$CUPY_CACHE_DIR/normspec``, else in
``~/.cupy/kernel_cache/normspec``.

Python API (torch CUDA tensors *or* CuPy arrays; the result has the input's kind):

* [`rms_norm`][normspec.backends.cupy.rms_norm]`(x, weight, *, eps, offset=0.0)`
* [`fused_add_rms_norm`][normspec.backends.cupy.fused_add_rms_norm]`(x, residual,
  weight, *, eps, offset=0.0, residual_sum="fp32") -> (y, new_residual)`
* [`rms_norm_gated`][normspec.backends.cupy.rms_norm_gated]`(x, gate, weight, *,
  eps, convention="vllm", activation="silu")`
* the explicit backward functions ``rms_norm_backward``, ``fused_add_rms_norm_backward``,
  ``fused_add_rms_norm_backward_from_sum``, ``rms_norm_gated_backward`` (the torch
  extension's arguments and results, ``rstd`` a keyword), and the forwards that also
  return rstd for them, ``rms_norm_with_rstd``, ``fused_add_rms_norm_with_rstd``,
  ``rms_norm_gated_with_rstd`` (no autograd)
* [`available`][normspec.backends.cupy.available]`() -> str | None`

torch tensors enter zero-copy as pointers and strides; outputs are allocated by torch
and come back as torch tensors; kernels run on torch's current stream, and gradients
flow through a ``torch.autograd.Function``. CuPy arrays run on CuPy's current stream and
come back as CuPy arrays.

Why not ``cupy.RawModule(code=...)``: CuPy's compile path appends ``-ftz=true`` after
the caller's options, and NVRTC lets the last ``-ftz`` win: the kernels would flush
subnormals and the results would no longer be the spec's bits. So this module drives
NVRTC itself (``cupy.cuda.nvrtc``, with the torch extension's IEEE flags) and loads the
cubin with ``cupy.RawModule(path=...)``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import json
import math
import os
import struct
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from normspec.environ import positive_int
from normspec.progress import say
from normspec.registry import Backend, OpSupport
from normspec.spec.validation import (
    ACTIVATIONS,
    GATED_CONVENTIONS,
    RESIDUAL_SUMS,
    check_choice,
    check_eps,
    check_input,
    check_like,
    check_offset,
    check_weight,
)

__all__ = [
    "CSRC",
    "MODULES",
    "NVRTC_OPTIONS",
    "PARTS",
    "CupyBackend",
    "NVRTCCompileError",
    "available",
    "backend",
    "backward_geometry",
    "backward_plan",
    "col_tree_last_launch",
    "col_tree_rows_out",
    "compile_kernels",
    "compile_modules",
    "cupy_stream_of",
    "forward_geometry",
    "fused_add_rms_norm",
    "fused_add_rms_norm_backward",
    "fused_add_rms_norm_backward_from_sum",
    "fused_add_rms_norm_with_rstd",
    "gated_row_table_launch",
    "kernel_part",
    "name_expressions",
    "persistent_grid",
    "pipe_backward_geometry",
    "pipe_backward_launch",
    "pipe_backward_plan",
    "pipe_forward_geometry",
    "pipe_forward_launch",
    "quad_forward_launch",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_gated",
    "rms_norm_gated_backward",
    "rms_norm_gated_with_rstd",
    "rms_norm_with_rstd",
    "row_block",
    "row_forward_launch",
    "row_geometry",
    "wants_gate_table",
]

#: The directory of the CUDA sources (package data shared with the torch extension).
CSRC = Path(__file__).resolve().parent.parent / "csrc"
KERNELS = "normspec_pipe.cuh"
#: The headers the NVRTC program includes: the kernels, and the gated backward's pair
#: kernel (``normspec_gated_bwd.cuh``, which the torch extension's launcher includes too).
_INCLUDES = (KERNELS, "normspec_gated_bwd.cuh")
#: Files whose contents key the compile cache.
_SOURCES = ("normspec_pipe.cuh", "normspec_gated_bwd.cuh", "normspec_kernels.cuh",
            "normspec_arith.h")

#: NVRTC options: the IEEE settings of the torch extension's nvcc build
#: (``backends/torch_ext/_build.py``: -fmad=false --ftz=false --prec-div=true
#: --prec-sqrt=true, no fast math). The include paths and ``-arch`` are added per call.
NVRTC_OPTIONS = (
    "-std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
)

# ---- constants of normspec_arith.h / normspec_launch.h --------------------------------
OP_RMS, OP_FUSED, OP_GATED = 0, 1, 2
#: The fused op's backward given the sum s its norm read (a backward only): x = s, no
#: residual row, one gradient row ds (= dx = dresidual).
OP_FUSED_SUM = 3
OP_CODES = {"rms_norm": OP_RMS, "fused_add_rms_norm": OP_FUSED, "rms_norm_gated": OP_GATED}
F_OFFSET, F_ROUNDED, F_HF, F_SIGMOID, F_W_IS_INPUT, F_ALIGNED = 1, 2, 4, 8, 16, 32
F_GATE_TABLE, F_W_RAW, F_DW_FINAL, F_LET_DEPENDENTS = 64, 128, 256, 512
# normspec_launch_impl.cuh: static shared memory kept free, the gate table's slots and
# the smallest launch that fills it, the plan's stack budget per block
_STATIC_SMEM_ROOM = 2048
_GATE_TABLE_SLOTS = 8192
_GATE_TABLE_MIN_ELEMENTS = 1 << 20
_PIPE_STACK_BUDGET = 40960
_PIPE_PLAN_LEVELS = 5
DT_F32, DT_BF16, DT_F16 = 0, 1, 2
#: Kernel template argument T of each dtype code.
CUDA_TYPES = {DT_F32: "float", DT_BF16: "__nv_bfloat16", DT_F16: "__half"}
_TORCH_DT = {torch.float32: DT_F32, torch.bfloat16: DT_BF16, torch.float16: DT_F16}
_CUPY_DT = {"float32": DT_F32, "bfloat16": DT_BF16, "float16": DT_F16}
_DT_NAMES = {DT_F32: "float32", DT_BF16: "bfloat16", DT_F16: "float16"}
#: what each op code's module holds, as the compile notice names it
_MODULE_LABELS = {OP_RMS: "rms_norm", OP_FUSED: "fused_add_rms_norm",
                  OP_GATED: "rms_norm_gated", OP_FUSED_SUM: "fused_add_rms_norm from the sum"}
_NPS = (1, 2, 4)


# ---- the host launch logic of normspec_launch_impl.cuh, in Python ----------------------
# By the design any valid geometry gives the same bits (every partial sum is the
# tree of an aligned power-of-two segment, whatever the team size); these functions
# mirror the C++ launcher so that both backends run the same launches.
# tests/test_cupy_nvrtc.py compares them with the C++ functions compiled on the host.


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``), as ``normspec::next_pow2``."""
    p = 1
    while p < n:
        p <<= 1
    return p


def vec_of(dtype_code: int) -> int:
    """Elements per 16-byte vector (``VecOf<T>``)."""
    return 4 if dtype_code == DT_F32 else 8


def forward_geometry(hidden: int, vec: int) -> tuple[int, int]:
    """``(threads per team, NP)`` of the forward; ``NP == 0`` means the streaming kernel."""
    nvec = (hidden + vec - 1) // vec
    if nvec <= 32:
        return 32, 1
    if nvec <= 1024:
        return next_pow2(nvec), 1
    if nvec <= 2048:
        return 1024, 2
    if nvec <= 4096:
        return 1024, 4
    return 1024, 0


def backward_geometry(hidden: int, vec: int) -> tuple[int, int]:
    """``(threads per team, NP)`` of the backward (teams of at most 256 threads)."""
    nvec = (hidden + vec - 1) // vec
    if nvec <= 32:
        return 32, 1
    if nvec <= 256:
        return next_pow2(nvec), 1
    if nvec <= 512:
        return 256, 2
    if nvec <= 1024:
        return 256, 4
    return 1024, 0


def max_group_log(np_: int) -> int:
    """``MaxGroupLog<NP>``: the largest dweight group (log2) a team holds in registers."""
    return {1: 5, 2: 3, 4: 1}.get(np_, 0)


def grid_for(units: int, per_block: int) -> int:
    """Blocks for ``units`` teams, ``per_block`` teams a block (1 .. 2**30)."""
    blocks = (units + per_block - 1) // per_block
    return int(min(max(blocks, 1), 1 << 30))


def backward_plan(dtype_code: int, rows: int, hidden: int, sm_count: int) -> tuple[int, int]:
    """``(glog, groups)``: each backward team reduces groups of ``2**glog`` rows and the
    workspace has ``groups`` fp32 rows of ``hidden`` (``normspec::backward_plan``)."""
    threads, np_ = backward_geometry(hidden, vec_of(dtype_code))
    glog = 0
    if np_ > 0:
        per_sm = max(2048 // threads, 1)
        target = sm_count * per_sm
        prow = next_pow2(rows)
        ml = max_group_log(np_)
        while glog < ml and (1 << (glog + 1)) <= prow:
            r = 1 << (glog + 1)
            if (rows + r - 1) // r < target:
                break
            glog += 1
    r = 1 << glog
    return glog, (rows + r - 1) // r


def pipe_backward_geometry(hidden: int, vec: int) -> tuple[int, int]:
    """``(team_log, NP)`` of the pipelined backward (``normspec::pipe_geometry`` with
    ``backward``); ``(0, 0)`` for rows of more than 1024 vectors.
    One pass up to 32 vectors, then teams of half the vectors (two passes), 256 x 4
    from 513 vectors on."""
    return _pipe_geometry(hidden, vec, 32)


def pipe_forward_geometry(hidden: int, vec: int) -> tuple[int, int]:
    """``(team_log, NP)`` of the persistent pipelined forward (``normspec::pipe_geometry``
    without ``backward``); ``(0, 0)`` for rows of more than 1024 vectors.
    One pass up to 16 vectors, then as the backward's."""
    return _pipe_geometry(hidden, vec, 16)


def _pipe_geometry(hidden: int, vec: int, one_pass: int) -> tuple[int, int]:
    nvec = (hidden + vec - 1) // vec
    if nvec <= one_pass:
        threads = next_pow2(nvec)
    elif nvec <= 512:
        threads = next_pow2(nvec) // 2
    else:
        threads = 256
    for np_ in _NPS:
        if np_ * threads * vec >= hidden:
            return threads.bit_length() - 1, np_
    return 0, 0


def pipe_block(team_log: int) -> int:
    """Threads per block of the pipelined kernels (``PipeGeometry::block``)."""
    return 256 if team_log <= 5 else 1 << team_log


def pipe_stack_bytes(team_log: int, np_: int, vec: int, glog: int) -> int:
    """The dweight stacks of a pipelined backward block: glog levels of NP * VEC floats
    per thread (``normspec::pipe_stack_bytes``)."""
    return glog * np_ * vec * 4 * pipe_block(team_log)


def pipe_smem_bytes(team_log: int, np_: int, vec: int, glog: int, table: bool) -> int:
    """Dynamic shared memory of the pipelined backward: the dweight stacks, the weight
    factors and, with ``table``, the gate table of (act, act') pairs."""
    weights = (np_ * vec * 4) << team_log
    return (pipe_stack_bytes(team_log, np_, vec, glog) + weights
            + (_GATE_TABLE_SLOTS * 8 if table else 0))


def fits_smem(dynamic_bytes: int, optin: int) -> bool:
    """Whether a block's dynamic shared memory fits what it may opt in to."""
    return dynamic_bytes + _STATIC_SMEM_ROOM <= optin


def pipe_backward_plan(dtype_code: int, rows: int, hidden: int, sm_count: int,
                       optin: int) -> tuple[int, int, int, int] | None:
    """``(team_log, NP, glog, groups)`` of the pipelined backward for aligned rows
    (``normspec::backward_plan_for``), ``None`` for rows of more than
    1024 vectors. The largest groups, within five stack levels of at most 40 KiB a
    block, that leave a group for at least half of the teams the device holds."""
    vec = vec_of(dtype_code)
    team_log, np_ = pipe_backward_geometry(hidden, vec)
    if np_ == 0:
        return None
    cap = 0
    while (cap < _PIPE_PLAN_LEVELS
           and pipe_stack_bytes(team_log, np_, vec, cap + 1) <= _PIPE_STACK_BUDGET
           and fits_smem(pipe_smem_bytes(team_log, np_, vec, cap + 1, False), optin)):
        cap += 1
    block = pipe_block(team_log)
    teams = sm_count * (2048 // block) * (block >> team_log)
    prow = next_pow2(rows)
    glog = 0
    while glog < cap and (1 << (glog + 1)) <= prow:
        r = 1 << (glog + 1)
        if 2 * ((rows + r - 1) // r) < teams:
            break
        glog += 1
    r = 1 << glog
    return team_log, np_, glog, (rows + r - 1) // r


def wants_gate_table(op: int, dtype_code: int, rows: int, hidden: int) -> bool:
    """Whether a launch reads act(z) from a gate table (``wants_gate_table`` of the
    launcher): bf16 gated launches of at least 2**20 elements."""
    return op == OP_GATED and dtype_code == DT_BF16 and rows * hidden >= _GATE_TABLE_MIN_ELEMENTS


def bwd_row_wide(rows: int, sm_count: int) -> bool:
    """Whether the one-row backward of 128 threads x 2 passes runs as 256 threads x 1
    (``bwd_row_wide`` of the launcher: at most 8 x SMs rows)."""
    return rows <= 8 * sm_count


def gated_gc(hf: bool, w_is_input: bool) -> int:
    """The gate-table backward's convention constants ``GC`` (``launch_bwd_pipe``): 0 the
    vllm convention, 1 transformers' with an fp32 weight, 7 transformers' with a weight of
    the input dtype (its weight products in packed bf16)."""
    if not hf:
        return 0
    return 7 if w_is_input else 1


class BackwardLaunch(NamedTuple):
    """One launch of the pipelined backward's family (``launch_bwd_pipe``).

    ``name`` is the kernel's name expression: ``normspec_bwd_pipe_kernel`` (persistent
    teams), ``normspec_bwd_row_kernel`` (the rms norm's one-row groups, a team per row)
    or ``normspec_gated_bwd_pair_kernel`` (the gate-table backward, two rows a team per
    iteration); ``shape`` is ``(threads per block, dynamic shared memory, team_log)``."""

    name: str
    glog: int
    groups: int
    table: bool
    shape: tuple[int, int, int]

    @property
    def kind(self) -> str:
        """``"pipe"``, ``"row"`` or ``"pair"``: which kernel, hence which arguments."""
        if self.name.startswith("normspec_bwd_row_kernel"):
            return "row"
        if self.name.startswith("normspec::normspec_gated_bwd_pair_kernel"):
            return "pair"
        return "pipe"


def pipe_backward_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int,
                         optin: int, strides: Sequence[int] = (), *, saved: bool = False,
                         hf: bool = False, w_is_input: bool = False) -> BackwardLaunch | None:
    """The launch of the pipelined backward's family for aligned rows (``launch_bwd_pipe``
    of the torch extension's launcher), ``None`` where it does not apply (rows of more
    than 1024 vectors).

    Rows that fill the team exactly in the common geometries (one pass of 16 or 32 lanes,
    two of 128 or 256 threads) run the constant-geometry forms: for the rms norm's one-row
    groups ``normspec_bwd_row_kernel``, 256 threads x 1 pass instead of 128 x 2 where
    ``bwd_row_wide``; for the bf16 gated op with the gate table and the forward's rstd
    (`saved`) the convention as constants (``gated_gc`` of `hf` and `w_is_input`), in
    ``normspec_gated_bwd_pair_kernel`` where the groups have two rows or more and every
    offset fits 32 bits (``offsets_fit_32``; `strides`: the row strides of the launch's
    tensors). `saved`: the forward's rstd is given (and read)."""
    plan = pipe_backward_plan(dtype_code, rows, hidden, sm_count, optin)
    if plan is None:
        return None
    team_log, np_, glog, groups = plan
    vec = vec_of(dtype_code)
    t = CUDA_TYPES[dtype_code]
    table = (wants_gate_table(op, dtype_code, rows, hidden)
             and fits_smem(pipe_smem_bytes(team_log, np_, vec, glog, True), optin))
    lo = 4 if np_ == 1 else 7
    full = np_ <= 2 and hidden == (np_ * vec) << team_log and team_log in (lo, lo + 1)
    flag = "true" if saved else "false"
    if full and op == OP_RMS and glog == 0:
        np_r, tl_r = ((1, 8) if (np_, team_log) == (2, 7) and bwd_row_wide(rows, sm_count)
                      else (np_, team_log))
        return BackwardLaunch(f"normspec_bwd_row_kernel<{t}, {np_r}, {tl_r}, {flag}>", glog,
                              groups, False, (pipe_block(tl_r), 0, tl_r))
    block = pipe_block(team_log)
    if full and op == OP_GATED and dtype_code == DT_BF16 and np_ == 1 and saved and table:
        gc = gated_gc(hf, w_is_input)
        if glog >= 1 and offsets_fit_32(rows, hidden, strides):
            smem = (glog - 1) * vec * 4 * 256 + _GATE_TABLE_SLOTS * 8
            name = f"normspec::normspec_gated_bwd_pair_kernel<{t}, {team_log}, {gc}>"
            return BackwardLaunch(name, glog, groups, True, (block, smem, team_log))
        return BackwardLaunch(f"normspec_bwd_pipe_kernel<{op}, {t}, 1, {team_log}, true, {gc}>",
                              glog, groups, True,
                              (block, pipe_smem_bytes(team_log, 1, vec, glog, True), team_log))
    name = (f"normspec_bwd_pipe_kernel<{op}, {t}, {np_}, "
            f"{team_log if full else -1}, {flag}, -1>")
    smem = pipe_smem_bytes(team_log, np_, vec, glog, table)
    return BackwardLaunch(name, glog, groups, table, (block, smem, team_log))


def persistent_grid(groups: int, team_log: int, per_sm: int, sm_count: int) -> int:
    """Blocks of a persistent launch: enough for every group's team, at most the
    resident blocks (``normspec::persistent_grid``)."""
    per_block = pipe_block(team_log) >> team_log
    need = (groups + per_block - 1) // per_block
    return grid_for(min(need, per_sm * sm_count), 1)


def col_tree_rows_out(groups: int) -> int:
    """Rows left after one level of the workspace row tree (16 at a time)."""
    c = min(next_pow2(groups), 16)
    return (groups + c - 1) // c


def col_tree_launch(groups: int, hidden: int) -> tuple[int, int, tuple[int, int, int]]:
    """``(rows out, clog, grid)`` of one ``normspec_col_tree_kernel`` launch (block 256)."""
    c = min(next_pow2(groups), 16)
    clog = c.bit_length() - 1
    gout = (groups + c - 1) // c
    return gout, clog, (grid_for(hidden, 256), min(gout, 65535), 1)


#: Rows of the workspace tree that one ``normspec_col_tree_last_kernel`` launch folds.
COL_TREE_LAST_MAX = 256


def col_tree_last_launch(groups: int, hidden: int) -> tuple[int, int, tuple[int, int, int]]:
    """``(clog1, slog, grid)`` of the ``normspec_col_tree_last_kernel`` launch (block
    16 x 16) that folds the last ``groups <= COL_TREE_LAST_MAX`` workspace rows and casts
    to the weight's dtype: ``2**slog`` segments of ``2**clog1 = min(16, P)`` rows, ``P``
    the next power of two of ``groups`` (``normspec::col_tree_last_logs``)."""
    p = next_pow2(groups)
    c1 = min(p, 16)
    return c1.bit_length() - 1, (p // c1).bit_length() - 1, (grid_for(hidden, 16), 1, 1)


def row_geometry(hidden: int, vec: int, two_inputs: bool, rows: int,
                 sm_count: int) -> tuple[int, int]:
    """``(team_log, NP)`` of the one-row forward (``normspec::row_geometry``); ``(0, 0)``
    for rows of more than 1024 vectors (not eligible).

    Four vectors per thread for the rms norm and two for the ops with two row tensors
    (at most 256 threads, then more passes); few rows double the team, up to one vector
    per thread, while the teams' threads stay within ``sm_count * 1024``."""
    nvec = (hidden + vec - 1) // vec
    if nvec > 1024:
        return 0, 0
    threads = min(256, max(1, next_pow2(nvec) // (2 if two_inputs else 4)))
    while threads < min(256, next_pow2(nvec)) and rows * threads * 2 <= sm_count * 1024:
        threads *= 2
    np_ = next(n for n in _NPS if n * threads * vec >= hidden)
    return threads.bit_length() - 1, np_


def row_block(team_log: int, rows: int, sm_count: int) -> int:
    """Threads per block of the one-row forward (``normspec::row_block``): the team from
    64 lanes on; smaller teams share 256-thread blocks, or one-warp blocks where the
    launch has at least 8 waves of resident threads (``sm_count * 2048 * 8``). The kernels'
    whole-block forms take their row from ``blockIdx.x``, so a team of 64+ lanes must stay
    one block of its own."""
    if team_log > 5:
        return 1 << team_log
    if rows << team_log >= sm_count * 2048 * 8:
        return 32
    return 256


#: lanes (log2) a row of the quad forward, by the row's length (``quad_lanes_log``)
_QUAD_LANES_LOG = {256: 6, 128: 5}


def quad_forward_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int,
                        w_raw: bool
                        ) -> tuple[str, tuple[int, int, int], tuple[int, int, int]] | None:
    """``(kernel name expression, grid, block)`` of the q/k forward in vectors of four
    (``normspec::launch_detail::launch_quad``) for aligned rows, ``None`` where it does not
    apply: rms and fused rows of 256 or 128 16-bit elements with a weight read as it is
    (`w_raw`), whose one-row forward would be one pass of 32 or 16 lanes, and whose
    four-element lanes number at most ``sm_count * 128``; 256-thread blocks."""
    ll = _QUAD_LANES_LOG.get(hidden)
    if (ll is None or not w_raw or dtype_code == DT_F32 or op not in (OP_RMS, OP_FUSED)
            or rows << ll > sm_count * 128):
        return None
    if row_geometry(hidden, vec_of(dtype_code), op != OP_RMS, rows, sm_count) != (ll - 1, 1):
        return None
    return (f"normspec_fwd_quad_kernel<{op}, {CUDA_TYPES[dtype_code]}, {ll}>",
            (grid_for(rows, 256 >> ll), 1, 1), (256, 1, 1))


def _row_default_np(op: int) -> int:
    return 4 if op == OP_RMS else 2


def row_forward_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int
                       ) -> tuple[str, tuple[int, int, int], tuple[int, int, int], int] | None:
    """``(kernel name expression, grid, block, team_log)`` of the one-row forward for
    aligned rows, ``None`` where it does not apply (rows longer than 1024 vectors).
    Rows that fill the team exactly run the constant-geometry form (``FULL_TL =
    team_log``, ``forward_row_t``): with the default passes (teams of 2..256 lanes) or
    with one pass (the small-row teams of 16..256 lanes)."""
    vec = vec_of(dtype_code)
    team_log, np_ = row_geometry(hidden, vec, op != OP_RMS, rows, sm_count)
    if np_ == 0:
        return None
    full = (row_index_fits_32(rows) and hidden == (np_ * vec) << team_log
            and ((np_ == _row_default_np(op) and 1 <= team_log <= 8)
                 or (np_ == 1 and 4 <= team_log <= 8)))
    block = row_block(team_log, rows, sm_count)
    name = (f"normspec_fwd_row_kernel<{op}, {CUDA_TYPES[dtype_code]}, {np_}, "
            f"{team_log if full else -1}>")
    return name, (grid_for(rows, block >> team_log), 1, 1), (block, 1, 1), team_log


#: Team sizes (log2) of the one-row forward's forms that read act(z) from the global gate
#: table (``forward_row_with_global_table``: two passes, rows of 64..1024 bf16).
_GLOBAL_TABLE_TEAM_LOGS = range(2, 7)
#: The kernel that fills the global gate table of one activation.
FILL_GATE_TABLE_KERNEL = "normspec_fill_gate_table_kernel<__nv_bfloat16>"


def gt_form(hf: bool, w_is_input: bool, w_raw: bool) -> int:
    """The GT forward's form (``normspec_fwd_row_kernel``'s ``GTF``; ``gt_form_of`` of the
    launcher): the vllm convention's own form 1, or 4 with the weight read in the input
    dtype (`w_raw`); the transformers convention's 2 (fp32 weight), 3 (a weight of the input
    dtype) or 5 (that weight read as it is, products in packed bf16)."""
    if not hf:
        return 4 if w_raw else 1
    if not w_is_input:
        return 2
    return 5 if w_raw else 3


def gated_row_table_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int,
                           *, hf: bool = False, w_is_input: bool = False, w_raw: bool = False
                           ) -> tuple[str, tuple[int, int, int], tuple[int, int, int], int] | None:
    """``(kernel name expression, grid, block, team_log)`` of the one-row forward that reads
    act(z) from the gate table in global memory (``GT``), for aligned bf16 gated launches
    of at least 2**20 elements whose rows fill a two-pass team of 4..64 lanes
    (``forward_row_with_global_table``), in the form ``gt_form(hf, w_is_input, w_raw)``;
    ``None`` elsewhere."""
    if not (wants_gate_table(op, dtype_code, rows, hidden) and row_index_fits_32(rows)):
        return None
    vec = vec_of(dtype_code)
    team_log, np_ = row_geometry(hidden, vec, True, rows, sm_count)
    if np_ != 2 or hidden != (np_ * vec) << team_log or team_log not in _GLOBAL_TABLE_TEAM_LOGS:
        return None
    block = row_block(team_log, rows, sm_count)
    form = gt_form(hf, w_is_input, w_raw)
    name = f"normspec_fwd_row_kernel<{op}, {CUDA_TYPES[dtype_code]}, 2, {team_log}, true, {form}>"
    return name, (grid_for(rows, block >> team_log), 1, 1), (block, 1, 1), team_log


def row_index_fits_32(rows: int) -> bool:
    """Whether the one-row forward's constant forms may take `rows`: they index a row in 32
    bits (``row_index_fits_32`` in the launcher), so more than ``2**31 - 1`` rows take the
    general form."""
    return rows <= 0x7FFFFFFF


def offsets_fit_32(rows: int, hidden: int, strides: Sequence[int]) -> bool:
    """Whether a launch of `rows` rows of `hidden` elements with these row `strides` may
    run ``normspec_gated_bwd_pair_kernel``, which does its row and offset arithmetic in 32
    bits: at most ``2**30`` rows and a last element, ``(rows - 1) * max(strides, hidden) +
    hidden - 1``, of at most ``2**31 - 2`` (``offsets_fit_32`` in the launcher)."""
    m = max((hidden, *strides))
    return rows <= 1 << 30 and m <= 0x7FFFFFFF and (rows - 1) * m <= 0x7FFFFFFF - hidden


class ForwardPipeLaunch(NamedTuple):
    """The persistent pipelined forward's launch (``pipe_forward_launch``)."""

    name: str  # kernel name expression
    block: int  # threads per block
    smem: int  # dynamic shared memory: the weight factors, then the gate table
    team_log: int
    table: bool  # the per-block gate table (F_GATE_TABLE)


def pipe_forward_launch(op: int, dtype_code: int, rows: int, hidden: int, optin: int
                        ) -> ForwardPipeLaunch | None:
    """The persistent pipelined forward (``normspec_fwd_pipe_kernel``; ``forward_pipe_t``
    of the launcher) for aligned rows of at most 1024 vectors, ``None`` elsewhere. The
    launcher runs it where the one-row forward does not run: bf16 gated launches with a
    gate table (``wants_gate_table``) that the global table's forms do not take (rows that
    do not fill a two-pass team of 4..64 lanes, a stream being captured before the table's
    first fill). Each block builds the gate table in its shared memory where it fits; rows
    that fill a team of 4..32 lanes in one or two passes then run the constant-geometry
    form."""
    vec = vec_of(dtype_code)
    team_log, np_ = pipe_forward_geometry(hidden, vec)
    if np_ == 0:
        return None
    weights = (np_ * vec * 4) << team_log
    table = (wants_gate_table(op, dtype_code, rows, hidden)
             and fits_smem(weights + _GATE_TABLE_SLOTS * 4, optin))
    full = table and np_ <= 2 and hidden == (np_ * vec) << team_log and 2 <= team_log <= 5
    name = (f"normspec_fwd_pipe_kernel<{op}, {CUDA_TYPES[dtype_code]}, {np_}, "
            f"{team_log if full else -1}>")
    return ForwardPipeLaunch(name, pipe_block(team_log),
                             weights + (_GATE_TABLE_SLOTS * 4 if table else 0), team_log, table)


def forward_launch(op: int, dtype_code: int, rows: int, hidden: int
                   ) -> tuple[str, tuple[int, int, int], tuple[int, int, int]]:
    """``(kernel name expression, grid, block)`` of the register or streaming forward."""
    threads, np_ = forward_geometry(hidden, vec_of(dtype_code))
    t = CUDA_TYPES[dtype_code]
    if np_ == 0:
        return f"normspec_fwd_stream_kernel<{op}, {t}>", (grid_for(rows, 1), 1, 1), (1024, 1, 1)
    tpb = 4 if threads == 32 else 1
    return (f"normspec_fwd_kernel<{op}, {t}, {np_}>", (grid_for(rows, tpb), 1, 1),
            (threads, tpb, 1))


def backward_launch(op: int, dtype_code: int, rows: int, hidden: int, groups: int
                    ) -> tuple[str, tuple[int, int, int], tuple[int, int, int], bool]:
    """``(kernel name expression, grid, block, takes glog)`` of the backward."""
    threads, np_ = backward_geometry(hidden, vec_of(dtype_code))
    t = CUDA_TYPES[dtype_code]
    if np_ == 0:
        return (f"normspec_bwd_stream_kernel<{op}, {t}>", (grid_for(rows, 1), 1, 1),
                (1024, 1, 1), False)
    tpb = 4 if threads == 32 else 1
    return (f"normspec_bwd_kernel<{op}, {t}, {np_}>", (grid_for(groups, tpb), 1, 1),
            (threads, tpb, 1), True)


#: The pipelined backward's constant forms: (NP, team_log).
_BWD_FULL_FORMS = ((1, 4), (1, 5), (2, 7), (2, 8))
#: The one-row rms backward's forms: the constant forms and the wide one (256 x 1).
_BWD_ROW_FORMS = (*_BWD_FULL_FORMS, (1, 8))
#: The gated backward's convention constants (``gated_gc``).
_GATED_GCS = (0, 1, 7)
#: The GT forward's forms (``gt_form``).
_GT_FORMS = range(1, 6)


def _backward_names(op: int, t: str) -> list[str]:
    """The backward kernels of one (op, dtype) module, the dweight tree's included."""
    names = [
        *(f"normspec_bwd_kernel<{op}, {t}, {n}>" for n in _NPS),
        *(f"normspec_bwd_pipe_kernel<{op}, {t}, {n}, -1, {s}, -1>"
          for s in ("false", "true") for n in _NPS),
        *(f"normspec_bwd_pipe_kernel<{op}, {t}, {n}, {tl}, {s}, -1>"
          for s in ("false", "true") for n, tl in _BWD_FULL_FORMS),
        f"normspec_bwd_stream_kernel<{op}, {t}>",
    ]
    if op == OP_RMS:
        names += [f"normspec_bwd_row_kernel<{t}, {n}, {tl}, {s}>"
                  for s in ("false", "true") for n, tl in _BWD_ROW_FORMS]
    if op == OP_GATED and t == CUDA_TYPES[DT_BF16]:
        names += [f"normspec_bwd_pipe_kernel<{op}, {t}, 1, {tl}, true, {gc}>"
                  for tl in (4, 5) for gc in _GATED_GCS]
        names += [f"normspec::normspec_gated_bwd_pair_kernel<{t}, {tl}, {gc}>"
                  for tl in (4, 5) for gc in _GATED_GCS]
    # the tree; the last tree kernel for an fp32 weight or one of the input dtype
    return [*names, "normspec_col_tree_kernel",
            *dict.fromkeys(f"normspec_col_tree_last_kernel<{w}>" for w in ("float", t))]


#: The two modules of an (op, dtype): its forward kernels and its backward kernels (those
#: of the dweight tree included), compiled apart so that a machine's first compiles run
#: side by side in halves.
PARTS = ("forward", "backward")
#: Name prefixes of the kernels a backward module holds (``kernel_part``).
_BACKWARD_PREFIXES = ("normspec_bwd_", "normspec::normspec_gated_bwd_pair_kernel",
                      "normspec_col_tree")


def kernel_part(name: str) -> str:
    """The module (``PARTS``) that holds the kernel ``name`` (a name expression)."""
    return "backward" if name.startswith(_BACKWARD_PREFIXES) else "forward"


def name_expressions(op: int, dtype_code: int, part: str | None = None) -> list[str]:
    """Every instantiation one (op, dtype) holds (all the launchers can pick): the
    ``part`` module's, ``"forward"`` or ``"backward"``, or by default both together.
    ``OP_FUSED_SUM`` has backward kernels only. Raises ``ValueError`` for another
    ``part``."""
    t = CUDA_TYPES[dtype_code]
    if part not in (None, *PARTS):
        raise ValueError(f"part: expected one of {PARTS} or None, got {part!r}")
    backward = _backward_names(op, t) if part != "forward" else []
    if op == OP_FUSED_SUM or part == "backward":
        return backward
    dnp = _row_default_np(op)
    return [
        *(f"normspec_fwd_row_kernel<{op}, {t}, {n}, -1>" for n in _NPS),
        *(f"normspec_fwd_row_kernel<{op}, {t}, {dnp}, {tl}>" for tl in range(1, 9)),
        *(f"normspec_fwd_row_kernel<{op}, {t}, 1, {tl}>" for tl in range(4, 9)),
        *(f"normspec_fwd_quad_kernel<{op}, {t}, {ll}>" for ll in _QUAD_LANES_LOG.values()
          if dtype_code != DT_F32 and op in (OP_RMS, OP_FUSED)),
        *(f"normspec_fwd_kernel<{op}, {t}, {n}>" for n in _NPS),
        f"normspec_fwd_stream_kernel<{op}, {t}>",
        *(f"normspec_fwd_pipe_kernel<{op}, {t}, {n}, -1>" for n in _NPS),
        *backward,
        # the global gate table and the forms that read it (large bf16 gated forwards)
        *((FILL_GATE_TABLE_KERNEL,
           *(f"normspec_fwd_row_kernel<{op}, {t}, 2, {tl}, true, {f}>"
             for f in _GT_FORMS for tl in _GLOBAL_TABLE_TEAM_LOGS),
           # the persistent forward's constant forms (with the per-block table)
           *(f"normspec_fwd_pipe_kernel<{op}, {t}, {n}, {tl}>"
             for n in (1, 2) for tl in range(2, 6)))
          if op == OP_GATED and dtype_code == DT_BF16 else ()),
    ]


class _Args(NamedTuple):
    """``normspec::LaunchArgs``: pointers (0 = nullptr), strides in elements. A named
    tuple: ``_replace`` costs about a tenth of ``dataclasses.replace`` on a frozen
    dataclass, which took a quarter of the forward's host-side planning (two a call)."""

    x: int = 0
    r: int = 0
    dy: int = 0
    dres: int = 0
    y: int = 0
    y2: int = 0
    w: int = 0
    rows: int = 0
    H: int = 0
    sx: int = 0
    sr: int = 0
    sdy: int = 0
    sdres: int = 0
    sy: int = 0
    sy2: int = 0
    eps: float = 0.0
    offset: float = 0.0
    flags: int = 0


def with_alignment(a: _Args, esize: int) -> _Args:
    """Set ``F_ALIGNED`` when every row pointer allows 16-byte vector access
    (``set_alignment`` of normspec_launch_impl.cuh)."""
    # one test of the pointers' and the present rows' strides' low bits together (each
    # call runs it; the strides are not negative, ``_collapsible_stride``)
    pointers = a.x | a.r | a.dy | a.dres | a.y | a.y2 | a.w
    strides = ((a.sx if a.x else 0) | (a.sr if a.r else 0) | (a.sdy if a.dy else 0)
               | (a.sdres if a.dres else 0) | (a.sy if a.y else 0) | (a.sy2 if a.y2 else 0))
    ok = pointers % 16 == 0 and (strides * esize) % 16 == 0
    return _with_flags(a, a.flags | F_ALIGNED) if ok else a


_new_tuple = tuple.__new__


def _with_flags(a: _Args, flags: int) -> _Args:
    """``a`` with ``flags`` (its last field), in a third of ``_replace``'s time."""
    return _new_tuple(_Args, (*a[:-1], flags))


def _collapsible_stride(shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """Row stride (elements) when the leading dims collapse into one (``collapsible_rows``
    of normspec_host.h); ``None`` otherwise. Negative strides are refused (a copy is taken)."""
    hidden = shape[-1]
    if hidden != 1 and strides[-1] != 1:
        return None
    rs: int | None = None
    expect = 0
    for d in range(len(shape) - 2, -1, -1):
        if shape[d] == 1:
            continue
        if strides[d] < 0:
            return None
        if rs is None:
            rs = strides[d]
        elif strides[d] != expect:
            return None
        expect = strides[d] * shape[d]
    return hidden if rs is None else rs


# ---- CuPy: import, NVRTC, modules ---------------------------------------------------
_lock = threading.RLock()
_modules: dict[tuple[int, int, int, str], tuple[Any, dict[str, str]]] = {}
_functions: dict[tuple[int, int, int, str], Any] = {}
_sm_counts: dict[int, int] = {}
# the global gate table of each device (both activations) and which halves are filled
_gate_tables: dict[int, Any] = {}
_gate_tables_filled: set[tuple[int, bool]] = set()
_smem_optins: dict[int, int] = {}
_occupancy: dict[tuple, int] = {}
_pdl_devices: dict[int, bool] = {}
_compile_error: str | None = None
#: one lock per module image (its digest): one thread compiles it, the others wait
_compile_locks: dict[str, threading.Lock] = {}


class NVRTCCompileError(RuntimeError):
    """NVRTC rejected the kernel sources; the message holds the first lines of its log."""


def _import_cupy() -> tuple[Any, str | None]:
    try:
        import cupy
    except ImportError as exc:
        return None, (f"CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x): "
                      f"{exc}")
    except Exception as exc:  # a broken CUDA install can fail at import
        return None, f"CuPy failed to import: {type(exc).__name__}: {exc}"
    return cupy, None


def _cupy() -> Any:
    cp, reason = _import_cupy()
    if reason is not None:
        raise RuntimeError(f"normspec cupy backend: {reason}")
    return cp


def sources_digest() -> str:
    """sha256 over the kernel sources: part of the cache key (NVRTC's own includes are
    not hashed by anyone else)."""
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()


def source_text() -> str:
    """The NVRTC program: the shared header as it is (the digest line keys caches)."""
    includes = "".join(f'#include "{name}"\n' for name in _INCLUDES)
    return f"// normspec sources sha256 {sources_digest()}\n{includes}"


def cuda_include_dir() -> str | None:
    """A directory holding ``cuda_bf16.h`` / ``cuda_fp16.h`` for NVRTC, or ``None``."""
    candidates = []
    cp, _ = _import_cupy()
    if cp is not None:
        try:
            path = cp.cuda.get_cuda_path()
        except Exception:
            path = None
        if path:
            candidates.append(Path(path) / "include")
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_bf16.h").exists():
            return str(c)
    return None


def compile_options(arch_flag: str) -> tuple[str, ...]:
    """Full NVRTC options for ``arch_flag`` (``-arch=sm_90`` or ``-arch=compute_90``);
    part of the compile cache's key."""
    inc = [f"-I{CSRC}"]
    cuda_inc = cuda_include_dir()
    if cuda_inc:
        inc.append(f"-I{cuda_inc}")
    return (*NVRTC_OPTIONS, *inc, arch_flag)


def compile_kernels(names: Sequence[str], arch: str) -> tuple[bytes, dict[str, str], str]:
    """Compile the sources with NVRTC for ``arch`` (``"sm_90"`` gives a cubin,
    ``"compute_90"`` PTX); returns ``(image, {name expression: lowered name}, log)``.

    Needs CuPy and NVRTC only, no GPU. Raises
    [`NVRTCCompileError`][normspec.backends.cupy.NVRTCCompileError].
    """
    cp = _cupy()
    nvrtc = cp.cuda.nvrtc
    options = compile_options(f"-arch={arch}")
    prog = nvrtc.createProgram(source_text(), "normspec_cupy.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            head = "\n".join(log.strip().splitlines()[:12])
            raise NVRTCCompileError(f"NVRTC compile failed ({exc}):\n{head}") from exc
        log = nvrtc.getProgramLog(prog)
        image = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
        if isinstance(image, str):
            image = image.encode()
        mapping = {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    return image, mapping, log


def _cache_dir() -> Path:
    if os.environ.get("NORMSPEC_CUPY_CACHE_DIR"):
        return Path(os.environ["NORMSPEC_CUPY_CACHE_DIR"])
    base = os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache"
    return Path(base) / "normspec"


def _device_arch(cp: Any, dev: int) -> str:
    """``sm_XX`` when NVRTC targets the device directly, else PTX of the nearest lower arch."""
    cc = int(cp.cuda.Device(dev).compute_capability)
    supported = sorted(int(a) for a in cp.cuda.nvrtc.getSupportedArchs())
    if cc in supported:
        return f"sm_{cc}"
    lower = [a for a in supported if a <= cc] or supported[:1]
    return f"compute_{lower[-1]}"


def _module_image(cp: Any, dev: int, op: int, dt: int, part: str
                  ) -> tuple[Path, dict[str, str]]:
    """The disk-cached image of (op, dtype)'s ``part`` module for device ``dev``'s target
    and its name mapping, compiled by NVRTC first when the cache lacks it (the compile announced on
    stderr, with its time: tens of seconds a module). Loads nothing: needs no context.
    One thread compiles a given module at a time (others wait for its image); different
    modules compile side by side (NVRTC's compile releases the GIL)."""
    global _compile_error
    arch = _device_arch(cp, dev)
    names = name_expressions(op, dt, part)
    ident = json.dumps([source_text(), compile_options(f"-arch={arch}"), arch,
                        list(cp.cuda.nvrtc.getVersion()), names])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:32]
    cache = _cache_dir()
    image_path = cache / f"{digest}.{'cubin' if arch.startswith('sm_') else 'ptx'}"
    map_path = cache / f"{digest}.json"
    with _lock:
        compile_lock = _compile_locks.setdefault(digest, threading.Lock())
    with compile_lock:
        mapping = None
        if image_path.exists() and map_path.exists():
            try:
                mapping = json.loads(map_path.read_text())
            except (OSError, ValueError):
                mapping = None
        if mapping is None or set(mapping) != set(names):
            what = f"the {_MODULE_LABELS[op]} {part} kernels ({_DT_NAMES[dt]}, {arch})"
            say(f"normspec cupy: compiling {what} with NVRTC: their first use here, "
                f"cached in {cache} afterwards...")
            start = time.perf_counter()
            try:
                image, mapping, _ = compile_kernels(names, arch)
            except NVRTCCompileError as exc:
                _compile_error = str(exc)
                raise
            say(f"normspec cupy: compiled {what} in {time.perf_counter() - start:.0f} s")
            cache.mkdir(parents=True, exist_ok=True)
            _atomic_write(image_path, image)
            _atomic_write(map_path, json.dumps(mapping).encode())
    return image_path, mapping


def _module(dev: int, op: int, dt: int, part: str) -> tuple[Any, dict[str, str]]:
    """(op, dtype)'s ``part`` module on device ``dev`` and its name mapping, memoised per
    process: its image from the disk cache, else compiled by NVRTC and cached
    (``_module_image``; no process-wide lock is held through a compile)."""
    key = (dev, op, dt, part)
    hit = _modules.get(key)
    if hit is not None:
        return hit
    cp = _cupy()
    image_path, mapping = _module_image(cp, dev, op, dt, part)
    with _lock:
        hit = _modules.get(key)
        if hit is None:
            with cp.cuda.Device(dev):
                hit = _modules[key] = (cp.RawModule(path=str(image_path)), mapping)
    return hit


#: every module's (op, dtype, part): what ``available()`` and ``normspec build`` prepare
MODULES = tuple((op, dt, part) for op in (OP_RMS, OP_FUSED, OP_GATED, OP_FUSED_SUM)
                for dt in (DT_F32, DT_BF16, DT_F16) for part in PARTS
                if not (op == OP_FUSED_SUM and part == "forward"))


def compile_modules(dev: int | None = None, *, jobs: int | None = None) -> float:
    """Compiles every module the disk cache lacks for device ``dev``'s target (the
    current device by default), ``jobs`` at a time in threads: by default ``$MAX_JOBS``
    (the torch extension builds' variable) or else one per CPU core. Returns the seconds
    it took. On a machine's first use this is the 21 NVRTC compiles, each up to tens of
    seconds on one core, which one after another would take minutes.
    Raises [`NVRTCCompileError`][normspec.backends.cupy.NVRTCCompileError] (the
    first module's failure, after the others finished)."""
    cp = _cupy()
    if dev is None:
        dev = cp.cuda.runtime.getDevice()
    if jobs is None:
        jobs = _max_jobs()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(jobs, len(MODULES))),
                                               thread_name_prefix="normspec-nvrtc") as pool:
        futures = [pool.submit(_module_image, cp, dev, *module) for module in MODULES]
    for future in futures:
        if future.exception() is not None:
            raise future.exception()
    return time.perf_counter() - start


def _max_jobs() -> int:
    """``$MAX_JOBS`` when it is a positive integer (else a ``ValueError`` naming it), or
    the number of CPU cores this process may use."""
    jobs = positive_int("MAX_JOBS", "a positive integer (how many NVRTC compiles run at once)")
    if jobs is not None:
        return jobs
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _kernel(dev: int, op: int, dt: int, name: str) -> Any:
    key = (dev, op, dt, name)
    fn = _functions.get(key)
    if fn is None:
        module, mapping = _module(dev, op, dt, kernel_part(name))
        _bind_primary_context()  # CuPy loads the module here through the driver
        with _lock:
            fn = _functions[key] = module.get_function(mapping[name])
    return fn


def _global_gate_table(cp: Any, dev: int, sig: bool) -> int | None:
    """The address of the filled gate table of one activation on device ``dev`` (a CuPy
    array kept for the process), or ``None`` while the current stream is being captured
    before the first fill (the caller then runs the persistent forward, whose blocks build
    the table in shared memory). The first call per
    device and activation fills it on the current stream and waits for it."""
    half = _GATE_TABLE_SLOTS * 4 if sig else 0  # bytes: the sigmoid's table comes second
    if (dev, sig) in _gate_tables_filled:
        return int(_gate_tables[dev].data.ptr) + half
    stream = cp.cuda.get_current_stream()
    if _capturing(cp, stream):  # no allocation, launch or wait inside a capture
        return None
    with _lock:
        tab = _gate_tables.get(dev)
        if tab is None:
            tab = _gate_tables[dev] = cp.empty(2 * _GATE_TABLE_SLOTS, dtype=cp.float32)
    ptr = int(tab.data.ptr) + half
    _launch(_kernel(dev, OP_GATED, DT_BF16, FILL_GATE_TABLE_KERNEL),
            (_GATE_TABLE_SLOTS // 256, 1, 1), (256, 1, 1), KernelArgs("Qi", (ptr, int(sig))))
    stream.synchronize()
    _gate_tables_filled.add((dev, sig))
    return ptr


def _capturing(cp: Any, stream: Any) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph (when the runtime cannot
    tell, as if it were: the caller then takes the path that needs no table)."""
    try:
        rt = cp.cuda.runtime
        return rt.streamIsCapturing(stream.ptr) != rt.streamCaptureStatusNone
    except Exception:
        return True


def _sm_count(cp: Any, dev: int) -> int:
    n = _sm_counts.get(dev)
    if n is None:
        props = cp.cuda.runtime.getDeviceProperties(dev)
        n = _sm_counts[dev] = max(int(props["multiProcessorCount"]), 1)
    return n


def available(*, compile: bool = True) -> str | None:
    """``None`` when the backend can run here, else why not (CuPy missing, no GPU,
    NVRTC failure with the first lines of its log, a module the driver refuses). With
    ``compile`` (the default) every module is compiled (cached on disk afterwards) and
    loaded now for the current device: device 0 unless the caller chose another
    (``torch.cuda.set_device``, CuPy's ``Device``), so that asking creates no context on a
    device the process does not use."""
    cp, reason = _import_cupy()
    if reason is not None:
        return reason
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA GPU usable by CuPy ({type(exc).__name__}: {exc})"
    if count == 0:
        return "no CUDA GPU visible to CuPy"
    if _compile_error is not None:
        return _compile_error
    if compile:
        try:
            dev = cp.cuda.runtime.getDevice()
            compile_modules(dev)  # those the disk cache lacks, side by side
            for op, dt, part in MODULES:
                _, mapping = _module(dev, op, dt, part)
                with cp.cuda.Device(dev):  # loaded too: a cubin the driver refuses
                    _kernel(dev, op, dt, next(iter(mapping)))
        except (NVRTCCompileError, ValueError) as exc:  # ValueError: the build defines
            return str(exc)
        except Exception as exc:
            return f"loading the NVRTC module failed: {type(exc).__name__}: {exc}"
    return None


# ---- the two kinds of input -------------------------------------------------------
_RAW_TORCH = {4: torch.int32, 2: torch.int16}


def _is_cupy_array(obj: object) -> bool:
    t = type(obj)
    return t.__name__ == "ndarray" and t.__module__.split(".")[0] == "cupy"


def _kind(name: str, obj: object) -> str:
    """``"torch"`` or ``"cupy"``; anything else is refused with the argument's name."""
    if isinstance(obj, torch.Tensor):
        return "torch"
    if _is_cupy_array(obj):
        return "cupy"
    t = type(obj)
    if t.__name__ == "ndarray" and t.__module__.split(".")[0] == "numpy":
        raise TypeError(
            f"{name}: expected a CUDA torch.Tensor or a CuPy array, got a numpy.ndarray "
            "(host memory; move it to the GPU with cupy.asarray or torch.as_tensor(..., "
            "device='cuda'))"
        )
    raise TypeError(
        f"{name}: expected a CUDA torch.Tensor or a CuPy array, got {t.__module__}.{t.__name__}"
    )


def _check_torch_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        raise ValueError(
            f"x: expected a CUDA tensor or a CuPy array, got a torch.Tensor on {x.device} "
            "(the cupy backend runs on CUDA GPUs only)"
        )


def _cp_dtype_code(a: Any) -> int | None:
    return _CUPY_DT.get(a.dtype.name)


def _cp_check_input(name: str, a: Any) -> None:
    if _cp_dtype_code(a) is None:
        raise TypeError(
            f"{name}: expected dtype in (float32, bfloat16, float16), got {a.dtype.name}"
        )
    if a.ndim < 1 or a.shape[-1] < 1:
        raise ValueError(f"{name}: expected shape (..., H) with H >= 1, got {tuple(a.shape)}")


def _cp_device(a: Any) -> str:
    return f"cuda:{a.device.id}"


def _cp_check_like(name: str, t: object, x: Any) -> None:
    if not _is_cupy_array(t):
        raise TypeError(
            f"{name}: expected a CuPy array (like x), got {type(t).__module__}."
            f"{type(t).__name__}"
        )
    if tuple(t.shape) != tuple(x.shape):
        raise ValueError(
            f"{name}: expected the shape of x, {tuple(x.shape)}, got {tuple(t.shape)}"
        )
    if t.dtype != x.dtype:
        raise TypeError(f"{name}: expected the dtype of x, {x.dtype.name}, got {t.dtype.name}")
    if t.device.id != x.device.id:
        raise ValueError(
            f"{name}: expected the device of x, {_cp_device(x)}, got {_cp_device(t)}"
        )


def _cp_check_weight(w: object, x: Any) -> None:
    if not _is_cupy_array(w):
        raise TypeError(
            f"weight: expected a CuPy array (like x), got {type(w).__module__}."
            f"{type(w).__name__}"
        )
    hidden = x.shape[-1]
    if w.ndim != 1 or w.shape[0] != hidden:
        raise ValueError(
            f"weight: expected shape ({hidden},) to match x's last dimension, "
            f"got {tuple(w.shape)}"
        )
    if w.dtype.name not in ("float32", x.dtype.name):
        raise TypeError(
            f"weight: expected dtype float32 or x's dtype ({x.dtype.name}), got {w.dtype.name}"
        )
    if w.device.id != x.device.id:
        raise ValueError(f"weight: expected the device of x, {_cp_device(x)}, got {_cp_device(w)}")


def _validate(rows: Mapping[str, object], weight: object) -> str:
    """Check the row inputs (``x``, or the fused backward's sum ``s``, first) and the
    weight; returns the input kind."""
    names = list(rows)
    x = rows[names[0]]
    kind = _kind(names[0], x)
    if kind == "torch":
        check_input(names[0], x)
        for n in names[1:]:
            check_like(n, rows[n], x)
        check_weight(weight, x)
    else:
        _cp_check_input(names[0], x)
        for n in names[1:]:
            _cp_check_like(n, rows[n], x)
        _cp_check_weight(weight, x)
    return kind


class _Side:
    """What differs between torch and CuPy inputs: views, allocation, stream, results."""

    def __init__(self, cp: Any, dev: int) -> None:
        self.cp, self.dev = cp, dev

    def raw(self, a: Any) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


class _TorchSide(_Side):
    def __init__(self, cp: Any, dev: int) -> None:
        super().__init__(cp, dev)
        self.device = torch.device("cuda", dev)

    @contextmanager
    def context(self) -> Iterator[None]:
        with self.cp.cuda.Device(self.dev), _torch_stream_for_cupy(self.cp, self.dev):
            yield

    def raw(self, t: torch.Tensor) -> Any:
        """``t``'s bits as a torch view of the integer dtype of the same width: the
        kernels take pointers and strides, which torch gives without a CuPy view."""
        return t.detach().view(_RAW_TORCH[t.element_size()])

    def rows(self, t: torch.Tensor) -> tuple[Any, int]:
        """``(tensor read, row stride in elements)`` (``_row_view``): ``t`` itself where
        its rows collapse into one stride, else a bitwise contiguous copy."""
        rs = _collapsible_stride(t.shape, t.stride())
        return (t, rs) if rs is not None else _row_view(self.cp, self.raw(t))

    def empty_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (empty_like: quicker than torch.empty with x's shape and dtype)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, out

    def empty_f32(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        return out, out

    def weight_f32(self, w: torch.Tensor, dt: int) -> torch.Tensor:
        return w.detach().to(torch.float32).contiguous()

    def zeros_like(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(weight)


class _CupySide(_Side):
    @contextmanager
    def context(self) -> Iterator[None]:
        with self.cp.cuda.Device(self.dev):
            yield

    def raw(self, a: Any) -> Any:
        return a.view(self.cp.uint32 if a.itemsize == 4 else self.cp.uint16)

    def rows(self, a: Any) -> tuple[Any, int]:
        """``(array read, row stride in elements)`` (``_row_view`` of its bits)."""
        return _row_view(self.cp, self.raw(a))

    def empty_rows(self, x: Any) -> tuple[Any, Any]:
        out = self.cp.empty(x.shape, dtype=x.dtype)
        return out, self.raw(out)

    def empty_f32(self, shape: tuple[int, ...]) -> tuple[Any, Any]:
        out = self.cp.empty(shape, dtype=self.cp.float32)
        return out, out

    def weight_f32(self, w: Any, dt: int) -> Any:
        cp = self.cp
        code = _cp_dtype_code(w)
        if code == DT_BF16:  # exact: bf16 bits are the top half of the fp32 bits
            bits = cp.ascontiguousarray(w.view(cp.uint16)).astype(cp.uint32)
            return (bits << 16).view(cp.float32)
        return cp.ascontiguousarray(w.astype(cp.float32, copy=False))

    def zeros_like(self, weight: Any) -> Any:
        return self.cp.zeros_like(weight)


def cupy_stream_of(cp: Any, stream: torch.cuda.Stream, dev: int) -> Any:
    """A CuPy stream object for a torch CUDA stream (the same CUDA stream, not a new one)."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream, dev)


#: torch's current stream of a device as a raw handle, without building a torch Stream
#: (``torch.cuda.current_stream`` took about half a call's host time); torch's own
#: generated code calls it so. ``None`` where this torch lacks it.
_torch_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: CuPy stream objects for torch's streams, by (device, handle): wrappers that own nothing
_cupy_streams: dict[tuple[int, int], Any] = {}


def _torch_stream_for_cupy(cp: Any, dev: int) -> Any:
    """A CuPy stream object for torch's current stream on ``dev`` (kept per handle)."""
    if _torch_raw_stream is None:  # pragma: no cover - a torch without the raw handle
        return cupy_stream_of(cp, torch.cuda.current_stream(dev), dev)
    handle = _torch_raw_stream(dev)
    stream = _cupy_streams.get((dev, handle))
    if stream is None:
        if len(_cupy_streams) >= 256:
            _cupy_streams.clear()
        from_external = getattr(cp.cuda.Stream, "from_external", None)  # CuPy 14+
        stream = (from_external(_StreamHandle(handle)) if from_external is not None
                  else cp.cuda.ExternalStream(handle, dev))
        _cupy_streams[dev, handle] = stream
    return stream


class _StreamHandle:
    """A raw CUDA stream handle offered through the CUDA stream protocol (what CuPy 14's
    ``Stream.from_external`` takes; its ``ExternalStream`` is deprecated)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def _side(kind: str, x: Any) -> _TorchSide | _CupySide:
    """The side of ``x``'s kind and device (kept: building one per call costs host
    time)."""
    cp = _cupy()
    dev = x.get_device() if kind == "torch" else x.device.id
    side = _sides.get((kind, dev))
    if side is None or side.cp is not cp:  # (the tests stand in for CuPy)
        side = _sides[kind, dev] = (_TorchSide if kind == "torch" else _CupySide)(cp, dev)
    return side


_sides: dict[tuple[str, int], _TorchSide | _CupySide] = {}


def _dtype_code(kind: str, x: Any) -> int:
    return _TORCH_DT[x.dtype] if kind == "torch" else _CUPY_DT[x.dtype.name]


def _row_view(cp: Any, a: Any) -> tuple[Any, int]:
    """``(array read, row stride in elements)``; a contiguous (bitwise) copy when the
    rows do not collapse into one stride. ``a`` is a CuPy array or a torch tensor (an
    integer view of the rows' bits, so that the copy is bitwise too)."""
    if isinstance(a, torch.Tensor):
        rs = _collapsible_stride(a.shape, a.stride())
        if rs is None:
            a = a.contiguous()
            rs = a.shape[-1]
        return a, rs
    item = a.itemsize
    rs = None
    if all(s % item == 0 for s in a.strides):
        rs = _collapsible_stride(a.shape, [s // item for s in a.strides])
    if rs is None:
        a = cp.ascontiguousarray(a)
        rs = a.shape[-1]
    return a, rs


def _ptr(a: Any) -> int:
    """The device address of a torch tensor's or a CuPy array's first element."""
    return a.data_ptr() if isinstance(a, torch.Tensor) else int(a.data.ptr)


def _numel(x: Any) -> int:
    return int(x.numel()) if isinstance(x, torch.Tensor) else int(x.size)


def _base_flags(op: int, x: Any, weight: Any, offset: float, params: Mapping[str, Any]) -> int:
    flags = F_OFFSET if (op != OP_GATED and offset != 0.0) else 0
    if weight.dtype == x.dtype:
        flags |= F_W_IS_INPUT
    if op in (OP_FUSED, OP_FUSED_SUM) and params.get("residual_sum", "fp32") == "rounded":
        flags |= F_ROUNDED
    if op == OP_GATED:
        if params.get("convention", "vllm") == "hf":
            flags |= F_HF
        if params.get("activation", "silu") == "sigmoid":
            flags |= F_SIGMOID
    return flags


class KernelArgs(NamedTuple):
    """A launch's kernel arguments: ``codes``, one letter for each (``Q`` a pointer or
    other uint64, ``q`` int64, ``i`` int32, ``f`` float32, as ``struct`` spells them),
    and ``values``, Python numbers (a float32's already rounded where it overflows,
    ``_f32_arg``). The driver launch packs the values by the codes into one buffer
    (``_packed_params``), far quicker than a NumPy scalar for each argument."""

    codes: str
    values: tuple

    def numpy(self) -> tuple:
        """The arguments as NumPy scalars of their C types (what CuPy's ``RawKernel``
        takes)."""
        import numpy as np

        types = {"Q": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32}
        return tuple(types[c](v) for c, v in zip(self.codes, self.values, strict=True))


#: the codes of ``_pack``'s arguments: the forward's five pointers and six longs, the
#: backward's eight and eight
_FWD_CODES = "QQQQQ" "qqqqqq" "ffi"
_BWD_CODES = "QQQQQQQQ" "qqqqqqqq" "ffi"
#: normspec_fwd_quad_kernel's: the five pointers, the rows (int32), four strides, eps,
#: offset, the flags and rstd_out
_QUAD_CODES = "QQQQQ" "i" "qqqq" "ffi" "Q"


def _launch(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: KernelArgs,
            shared_mem: int = 0, *, chained: bool = False) -> None:
    """Launches ``fn`` on the current stream through the driver's ``cuLaunchKernelEx``
    (``_launch_driver``); ``chained``: as a programmatic dependent launch
    (``_launch_chained``; the caller has asked ``chained_launches``). Where the driver
    lacks ``cuLaunchKernelEx`` (before CUDA 12.0), through CuPy's ``RawKernel``. The
    driver launch with a configuration built once is the quickest of the three."""
    if chained:
        _launch_chained(fn, grid, block, args, shared_mem)
    elif _cu_launch_kernel_ex() is not None:
        _launch_driver(fn, grid, block, args, shared_mem, None, 0)
    else:
        _launch_rawkernel(fn, grid, block, args, shared_mem)


def _launch_rawkernel(fn: Any, grid: tuple[int, ...], block: tuple[int, ...],
                      args: KernelArgs, shared_mem: int) -> None:
    """Launches ``fn`` through CuPy's ``RawKernel`` (drivers before CUDA 12.0): CuPy's
    launch is the driver's ``cuLaunchKernel``, which needs a current context as
    ``cuLaunchKernelEx`` does, so a ``CUDA_ERROR_INVALID_CONTEXT`` (CuPy's
    ``CUDADriverError``, its ``status``) binds the primary context and launches again
    once, as ``_launch_driver`` does."""
    values = args.numpy()
    try:
        fn(grid, block, values, shared_mem=shared_mem)
    except Exception as exc:
        if getattr(exc, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
            raise
        _bind_primary_context()
        fn(grid, block, values, shared_mem=shared_mem)


# ---- chained launches: programmatic dependent launch through the driver API ----------
# CuPy's RawKernel takes no launch attributes, so the chained tree launches go through
# cuLaunchKernelEx (CUDA 12.0+), as normspec_launch.cu's launch_chained does through
# cudaLaunchKernelEx. cuda.h (13.0): CUlaunchConfig, CUlaunchAttribute (an id, padding to
# 8 bytes, a 64-byte value union) and CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# = 6, whose value is an int at the union's start.
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _CuLaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint64 * 8)]


class _CuLaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_CuLaunchAttribute)), ("num_attrs", ctypes.c_uint)]


#: each argument code's ``struct`` format, each value in an 8-byte slot of one buffer: the
#: driver reads each parameter through its own pointer, an int32 or float32 from its
#: slot's first four bytes (little-endian)
_SLOT_CODES = {"Q": "Q", "q": "q", "i": "i4x", "f": "f4x"}
#: this thread's argument buffers: (packer, buffer, the pointers into it) by argument codes
_arg_layouts = threading.local()
#: this thread's launch configurations (pointers to them, which the driver reads) by
#: (grid, block, shared memory, stream, number of attributes): building one per launch
#: costs host time
_launch_configs = threading.local()
_CONFIGS_MAX = 1024
_cu_launch_kernel_ex_fn: list[Any] = []  # [] until looked up, then [function or None]
#: the one launch attribute of every chained launch (built once; launches point at it)
_CHAINED_ATTRS = (_CuLaunchAttribute * 1)()
_CHAINED_ATTRS[0].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CHAINED_ATTRS[0].value[0] = 1  # programmaticStreamSerializationAllowed


def _cu_launch_kernel_ex() -> Any | None:
    """The driver's ``cuLaunchKernelEx`` (ctypes), or ``None`` where the driver library
    cannot be loaded or lacks it (a driver older than CUDA 12.0)."""
    if not _cu_launch_kernel_ex_fn:
        fn = None
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError):
            pass
        if fn is not None:
            fn.argtypes = [ctypes.POINTER(_CuLaunchConfig), ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
            fn.restype = ctypes.c_int
        _cu_launch_kernel_ex_fn.append(fn)
    return _cu_launch_kernel_ex_fn[0]


def _pdl_capable(cp: Any, dev: int) -> bool:
    """Whether the kernels on ``dev`` may be chained: compiled for sm_90 or later (their
    ``griddepcontrol.wait`` is then real; the extension asks the tree kernel's
    ``ptxVersion``, which here is the NVRTC target) and a driver with cuLaunchKernelEx
    (cached per device)."""
    ok = _pdl_devices.get(dev)
    if ok is None:
        arch = int(_device_arch(cp, dev).partition("_")[2])
        ok = _pdl_devices[dev] = arch >= 90 and _cu_launch_kernel_ex() is not None
    return ok


def _current_stream_capturing(cp: Any) -> bool:
    """Whether CuPy's current stream (torch's, inside ``_TorchSide.context``) is being
    captured into a CUDA graph (``_capturing``)."""
    return _capturing(cp, cp.cuda.get_current_stream())


def chained_launches(cp: Any, dev: int) -> bool:
    """Whether the dweight tree's launches are chained after the backward kernel on the
    current stream, as in the extension (``normspec::chained_launches``): not on devices
    or code before sm_90, and not inside a CUDA graph capture."""
    return _pdl_capable(cp, dev) and not _current_stream_capturing(cp)


def _launch_chained(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: KernelArgs,
                    shared_mem: int) -> None:
    """``fn`` on the current stream with programmatic stream serialization: its blocks may
    be scheduled while the kernel before it runs (which calls
    ``griddepcontrol.launch_dependents``); they wait for it in ``griddepcontrol.wait``."""
    _launch_driver(fn, grid, block, args, shared_mem, _CHAINED_ATTRS, 1)


def _launch_driver(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: KernelArgs,
                   shared_mem: int, attrs: Any, num_attrs: int) -> None:
    """``fn`` on the current stream through the driver's ``cuLaunchKernelEx`` with
    ``num_attrs`` launch attributes ``attrs`` (``None`` and 0, or ``_CHAINED_ATTRS`` and
    1: the kept configurations are told apart by the number); ``args`` packed by
    ``_packed_params``. The driver call goes through ctypes' ``CDLL``, which lets other
    Python threads run while it waits (a launch can wait for room in the launch queue);
    ``PyDLL``, which holds the GIL, would be slightly quicker."""
    launch = _cu_launch_kernel_ex()
    if launch is None:  # chained_launches said no; a caller that did not ask
        raise RuntimeError("a driver launch needs the driver's cuLaunchKernelEx")
    # (host time matters here: the CuPy backend's calls are host-bound)
    stream = _cupy().cuda.get_current_stream().ptr
    configs = _launch_configs.__dict__
    key = (grid, block, shared_mem, stream, num_attrs)
    config = configs.get(key)
    if config is None:
        if len(configs) >= _CONFIGS_MAX:
            configs.clear()
        config = configs[key] = ctypes.pointer(_CuLaunchConfig(
            _pad_dims(grid), _pad_dims(block), shared_mem, stream or None, attrs, num_attrs))
    params = _packed_params(args)
    status = launch(config, fn.kernel.ptr, params, None)
    if status == _CUDA_ERROR_INVALID_CONTEXT:  # rare: a thread's first CUDA work
        _bind_primary_context()
        status = launch(config, fn.kernel.ptr, params, None)
    if status != 0:
        raise _driver_error(status, "cuLaunchKernelEx")


#: cuda.h's CUDA_ERROR_INVALID_CONTEXT: no context is current in the calling thread
_CUDA_ERROR_INVALID_CONTEXT = 201


def _bind_primary_context() -> None:
    """Makes the current device's primary context current in the calling thread.

    A thread that no CUDA runtime call has touched has no current context: the runtime
    binds one lazily at its first call, the driver's launch does not and fails with
    ``CUDA_ERROR_INVALID_CONTEXT``. Autograd's device thread can reach the CuPy backward
    before any runtime call there.
    ``cudaSetDevice`` binds the device's primary context and makes it current at once
    (CUDA 12.0+, ``cuda_runtime_api.h``). The launch calls this after that failure; the
    cold paths whose driver calls come before any launch (a module's load in ``_kernel``,
    a kernel's attributes and occupancy in ``_prepare_pipe_kernel``) call it first."""
    runtime = _cupy().cuda.runtime
    runtime.setDevice(runtime.getDevice())


def _packed_params(args: KernelArgs) -> Any:
    """The driver's ``kernelParams`` for ``args``: their values packed into this thread's
    buffer for their codes, whose parameter pointers are built once with it (the driver
    copies the values at the launch)."""
    codes, values = args
    layouts = _arg_layouts.__dict__
    layout = layouts.get(codes)
    if layout is None:
        packer = struct.Struct("<" + "".join(_SLOT_CODES[c] for c in codes))
        buffer = ctypes.create_string_buffer(max(packer.size, 8))
        base = ctypes.addressof(buffer)
        params = (ctypes.c_void_p * max(len(codes), 1))(*range(base, base + 8 * len(codes), 8))
        layout = layouts[codes] = (packer, buffer, params)
    packer, buffer, params = layout
    packer.pack_into(buffer, 0, *values)
    return params


def _driver_error(status: int, what: str) -> RuntimeError:
    """CuPy's error for a driver status (named by the driver), or a plain one naming the
    status where the driver library cannot name it."""
    try:
        from cupy_backends.cuda.api import driver

        return driver.CUDADriverError(status)
    except Exception:  # no libcuda to name it
        return RuntimeError(f"{what} failed: CUresult {status}")


def _pad_dims(dims: tuple[int, ...]) -> tuple[int, ...]:
    return dims if len(dims) == 3 else (*dims, *(1,) * (3 - len(dims)))


def _smem_optin(cp: Any, dev: int) -> int:
    """Shared memory a block may opt in to on ``dev`` (cached)."""
    n = _smem_optins.get(dev)
    if n is None:
        rt = cp.cuda.runtime
        n = _smem_optins[dev] = int(
            rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))
    return n


def _prepare_pipe_kernel(fn: Any, key: tuple, block: int, smem: int, optin: int) -> int:
    """Lets ``fn`` use the device's opt-in shared memory (past 48 KiB a kernel must ask,
    as ``normspec::allow_smem`` does) and returns its resident blocks per SM for
    ``block`` threads and ``smem`` bytes (cached per ``key``; 1 if the driver cannot
    tell, as in the C++ launcher: only the grid depends on it, not the bits)."""
    per_sm = _occupancy.get(key)
    if per_sm is None:
        _bind_primary_context()  # the attribute and occupancy calls go to the driver
        if smem + _STATIC_SMEM_ROOM > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = optin - int(fn.shared_size_bytes)
        try:
            from cupy_backends.cuda.api import driver

            per_sm = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(
                fn.kernel.ptr, block, smem))
        except Exception:  # any driver failure: the C++ launcher's fallback
            per_sm = 1
        per_sm = _occupancy[key] = max(per_sm, 1)
    return per_sm


def _f32_arg(v: float) -> float:
    """``v`` as a float32 kernel argument will hold it: ``struct`` rounds as the C cast
    does (NumPy's ``float32``) but refuses what rounds to infinity, which is given here
    (from 2**128 - 2**103 up, the midpoint past the largest float32, rounded to even)."""
    return v if -_F32_ROUNDS_TO_INF < v < _F32_ROUNDS_TO_INF else math.copysign(math.inf, v)


_F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def _pack(a: _Args, ptrs: tuple[int, ...], longs: tuple[int, ...]) -> tuple:
    """The values of the arguments most kernels start with: pointers (``Q``), int64 rows
    and strides (``q``), then eps, offset (``f``) and the flags (``i``)."""
    return (*ptrs, *longs, _f32_arg(a.eps), _f32_arg(a.offset), a.flags)


def _weight_as_is(weight: Any, x: Any, dt: int) -> Any | None:
    """``weight`` itself where the pipelined and one-row kernels may read it in the input
    dtype (``F_W_RAW``: a contiguous, 16-byte aligned 16-bit weight of ``x``'s dtype; the
    torch extension's ``offer_weight_as_is``), which saves an fp32 copy and its kernel;
    else ``None``."""
    if dt == DT_F32 or weight.dtype != x.dtype:
        return None
    if isinstance(weight, torch.Tensor):
        if not weight.is_contiguous():
            return None
    elif not weight.flags.c_contiguous:
        return None
    return weight if _ptr(weight) % 16 == 0 else None


def _with_weight(side: _TorchSide | _CupySide, a: _Args, weight: Any, dt: int,
                 as_is: Any | None, keep: list) -> _Args:
    """``a`` with the weight the launch reads: ``as_is`` (read in the input dtype,
    ``F_W_RAW``) or an fp32 copy, the alignment flag then set again for its pointer."""
    if as_is is not None:
        keep.append(as_is)
        return _with_weight_ptr(a, _ptr(as_is), a.flags | F_W_RAW)
    w32 = side.weight_f32(weight, dt)
    keep.append(w32)
    esize = 4 if dt == DT_F32 else 2
    return with_alignment(_with_weight_ptr(a, _ptr(w32), a.flags & ~F_ALIGNED), esize)


_W_FIELD = _Args._fields.index("w")


def _with_weight_ptr(a: _Args, w: int, flags: int) -> _Args:
    """``a`` with the weight pointer ``w`` and ``flags`` (``_with_flags``' way)."""
    return _new_tuple(_Args, (*a[:_W_FIELD], w, *a[_W_FIELD + 1:-1], flags))


# ---- launch plans: what a call launches, decided once per shape ----------------------
# A call's launches depend on its shape, dtypes, flags, alignment and row strides, not on
# its pointers: the planners' answers are kept per such key (``_plans``), so that a
# repeated shape costs the backend a dictionary lookup instead of its planners (most of a
# small call's host time).

#: the flags a plan depends on (the others only travel to the kernels)
_PLAN_FLAGS = F_ALIGNED | F_HF | F_SIGMOID | F_W_IS_INPUT
#: plans kept before the cache starts again (shapes that vary without end, as the tokens
#: of prefills, must not grow it without bound)
_PLANS_MAX = 4096
_plans: dict[tuple, Any] = {}


def clear_launch_plans() -> None:
    """Forgets every kept plan (the tests do, before they stand in for the planners'
    device queries)."""
    _plans.clear()


def _keep_plan(key: tuple, plan: Any) -> Any:
    if len(_plans) >= _PLANS_MAX:
        _plans.clear()
    _plans[key] = plan
    return plan


class _FwdPlan(NamedTuple):
    """A forward's launch: ``form`` ``"gt"`` (the one-row forward reading the global gate
    table), ``"row"`` (the one-row forward), ``"quad"`` (the q/k forward in vectors of
    four), ``"pipe"`` (the persistent forward) or
    ``"reg"`` (the register or streaming kernels, which read an fp32 weight)."""

    form: str
    fn: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0
    team_log: int = 0
    table: bool = False  # the persistent forward's per-block gate table (F_GATE_TABLE)


def _forward_plan(cp: Any, dev: int, op: int, dt: int, rows: int, hidden: int, flags: int,
                  as_is: bool, gtab: bool) -> _FwdPlan:
    """The forward's launch (kept per key): `flags` the call's (F_ALIGNED: every row and
    the weight it reads allow 16-byte vectors), `as_is` whether the weight may be read in
    the input dtype, `gtab` whether the global gate table may be had (not in a capture
    before its first fill)."""
    key = ("fwd", dev, op, dt, rows, hidden, flags & _PLAN_FLAGS, as_is, gtab)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    if flags & F_ALIGNED:
        # forward_t: the global gate table's forms, else the one-row forward where no
        # gate table is wanted, else the persistent forward (its per-block table)
        sm_count = _sm_count(cp, dev)
        row = None
        if gtab:
            row = gated_row_table_launch(op, dt, rows, hidden, sm_count,
                                         hf=bool(flags & F_HF),
                                         w_is_input=bool(flags & F_W_IS_INPUT), w_raw=as_is)
            if row is not None:
                name, grid, block, team_log = row
                return _keep_plan(key, _FwdPlan("gt", _kernel(dev, op, dt, name), grid, block,
                                                team_log=team_log))
        if not wants_gate_table(op, dt, rows, hidden):
            quad = quad_forward_launch(op, dt, rows, hidden, sm_count, as_is)
            if quad is not None:
                name, grid, block = quad
                return _keep_plan(key, _FwdPlan("quad", _kernel(dev, op, dt, name), grid,
                                                block))
            row = row_forward_launch(op, dt, rows, hidden, sm_count)
        if row is not None:
            name, grid, block, team_log = row
            return _keep_plan(key, _FwdPlan("row", _kernel(dev, op, dt, name), grid, block,
                                            team_log=team_log))
        optin = _smem_optin(cp, dev)
        pipe = pipe_forward_launch(op, dt, rows, hidden, optin)
        if pipe is not None:
            fn = _kernel(dev, op, dt, pipe.name)
            per_sm = _prepare_pipe_kernel(fn, (dev, op, dt, pipe.name, pipe.smem), pipe.block,
                                          pipe.smem, optin)
            grid = (persistent_grid(rows, pipe.team_log, per_sm, sm_count), 1, 1)
            return _keep_plan(key, _FwdPlan("pipe", fn, grid, (pipe.block, 1, 1), pipe.smem,
                                            pipe.team_log, pipe.table))
    name, grid, block = forward_launch(op, dt, rows, hidden)
    return _keep_plan(key, _FwdPlan("reg", _kernel(dev, op, dt, name), grid, block))


def _forward(kind: str, op: int, rows: Sequence[Any], weight: Any, eps: float,
             params: Mapping[str, Any], *, keep_rstd: bool = False) -> tuple[Any, ...]:
    """The forward kernel on validated inputs; returns the outputs (input's kind) and,
    with ``keep_rstd``, last, each row's rstd (fp32, ``x.shape[:-1]``) as the kernels
    write it for the backward to read."""
    x = rows[0]
    n_out = 2 if op == OP_FUSED else 1
    side = _side(kind, x)
    offset = float(params.get("offset", 0.0)) if op != OP_GATED else 0.0
    with side.context():
        outs = [side.empty_rows(x) for _ in range(n_out)]
        rstd = side.empty_f32(tuple(x.shape[:-1])) if keep_rstd else None
        results = (*(o for o, _ in outs), *((rstd[0],) if rstd is not None else ()))
        if _numel(x) == 0:
            return results
        cp = side.cp
        dt = _dtype_code(kind, x)
        xv, sx = side.rows(x)
        hidden = int(x.shape[-1])
        nrows = _numel(x) // hidden
        r, sr = (0, 0)
        keep = [xv]
        if op != OP_RMS:
            rv, sr = side.rows(rows[1])
            keep.append(rv)
            r = _ptr(rv)
        a = _Args(x=_ptr(xv), r=r, y=_ptr(outs[0][1]),
                  y2=_ptr(outs[1][1]) if op == OP_FUSED else 0,
                  rows=nrows, H=hidden, sx=sx, sr=sr, sy=hidden,
                  sy2=hidden if op == OP_FUSED else 0,
                  eps=eps, offset=offset, flags=_base_flags(op, x, weight, offset, params))
        a = with_alignment(a, 4 if dt == DT_F32 else 2)  # the rows' (the weight's below)
        as_is = _weight_as_is(weight, x, dt) if a.flags & F_ALIGNED else None
        plan = _forward_plan(cp, side.dev, op, dt, nrows, hidden, a.flags, as_is is not None,
                             True)
        gtab = None
        if plan.form == "gt":
            gtab = _global_gate_table(cp, side.dev, bool(a.flags & F_SIGMOID))
            if gtab is None:  # a capture before the table's first fill
                plan = _forward_plan(cp, side.dev, op, dt, nrows, hidden, a.flags,
                                     as_is is not None, False)
        # the one-row and persistent kernels read a 16-bit weight as it is; the register
        # kernels fp32
        a = _with_weight(side, a, weight, dt, as_is if plan.form != "reg" else None, keep)
        if plan.form != "reg" and not a.flags & F_ALIGNED:  # an fp32 weight off 16 bytes
            plan = _forward_plan(cp, side.dev, op, dt, nrows, hidden, a.flags, False, False)
        rstd_ptr = _ptr(rstd[1]) if rstd is not None else 0
        if plan.table:
            a = _with_flags(a, a.flags | F_GATE_TABLE)
        args = _pack(a, (a.x, a.r, a.w, a.y, a.y2), (a.rows, a.H, a.sx, a.sr, a.sy, a.sy2))
        if plan.form == "pipe":
            _launch(plan.fn, plan.grid, plan.block,
                    KernelArgs(_FWD_CODES + "iQ", (*args, plan.team_log, rstd_ptr)), plan.smem)
        elif plan.form == "reg":
            _launch(plan.fn, plan.grid, plan.block, KernelArgs(_FWD_CODES + "Q", (*args, rstd_ptr)))
        elif plan.form == "quad":
            # the pointers, the rows as int32, four strides (no H), eps, offset, flags, rstd
            _launch(plan.fn, plan.grid, plan.block,
                    KernelArgs(_QUAD_CODES, (*args[:5], a.rows, *args[7:], rstd_ptr)))
        else:
            # the one-row kernel also takes the team size (log2), then rstd_out and the
            # global gate table of the GT forms (else none)
            _launch(plan.fn, plan.grid, plan.block,
                    KernelArgs(_FWD_CODES + "iQQ", (*args, plan.team_log, rstd_ptr, gtab or 0)))
        del keep
        return results


class _TreePlan(NamedTuple):
    """dweight from a backward's fp32 workspace rows (``_fold_dweight``): the tree levels
    of 16 rows ``(rows out, clog, grid)`` while more than ``COL_TREE_LAST_MAX`` are left,
    then ``last``, the one launch for the rest and the cast to the weight's dtype
    ``(kernel, clog1, slog, grid)``, ``None`` where one fp32 row is left of an fp32
    weight (already its dweight)."""

    tree_fn: Any
    levels: tuple[tuple[int, int, tuple[int, int, int]], ...]
    last: tuple[Any, int, int, tuple[int, int, int]] | None


def _tree_plan(dev: int, op: int, dt: int, wdt: int, groups: int, hidden: int) -> _TreePlan:
    levels = []
    g = groups
    while g > COL_TREE_LAST_MAX:
        level = col_tree_launch(g, hidden)
        levels.append(level)
        g = level[0]
    last = None
    if _tree_follows(g, wdt):
        clog1, slog, lgrid = col_tree_last_launch(g, hidden)
        last = (_kernel(dev, op, dt, f"normspec_col_tree_last_kernel<{CUDA_TYPES[wdt]}>"),
                clog1, slog, lgrid)
    tree_fn = _kernel(dev, op, dt, "normspec_col_tree_kernel") if levels else None
    return _TreePlan(tree_fn, tuple(levels), last)


class _BwdPlan(NamedTuple):
    """A backward's launches: ``form`` ``"row"``, ``"pair"`` or ``"pipe"`` (the pipelined
    family, ``BackwardLaunch.kind``) or ``"reg"`` (the register or streaming kernels);
    ``final``: one group whose kernel stores dweight itself, else ``tree``."""

    form: str
    fn: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    team_log: int
    glog: int
    groups: int
    table: bool
    takes_glog: bool  # the register kernels' glog argument
    final: bool
    tree: _TreePlan | None


def _backward_plan(cp: Any, dev: int, op: int, dt: int, wdt: int, rows: int, hidden: int,
                   flags: int, strides: tuple[int, ...], saved: bool) -> _BwdPlan:
    """The backward's launches (kept per key): `flags` the call's (F_ALIGNED: every row
    and the weight it reads allow 16-byte vectors), `strides` the rows' ``(sx, sr, sdy,
    sdres, sy, sy2)``, `saved` whether the forward's rstd is read."""
    key = ("bwd", dev, op, dt, wdt, rows, hidden, flags & _PLAN_FLAGS, strides, saved)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    sms = _sm_count(cp, dev)
    pipe = None
    if flags & F_ALIGNED:
        optin = _smem_optin(cp, dev)
        pipe = pipe_backward_launch(op, dt, rows, hidden, sms, optin, strides, saved=saved,
                                    hf=bool(flags & F_HF),
                                    w_is_input=bool(flags & F_W_IS_INPUT))
    if pipe is not None:
        name, glog, groups, table, (block, smem, team_log) = pipe
        fn = _kernel(dev, op, dt, name)
        if pipe.kind == "row":  # a team per row: no persistent grid, no stacks
            grid = (grid_for(rows, block >> team_log), 1, 1)
        else:  # the persistent kernels: their resident blocks per SM
            per_sm = _prepare_pipe_kernel(fn, (dev, op, dt, name, smem), block, smem, optin)
            grid = (persistent_grid(groups, team_log, per_sm, sms), 1, 1)
        final = groups == 1 and dt != DT_F32 and wdt == dt
        tree = None if final else _tree_plan(dev, op, dt, wdt, groups, hidden)
        return _keep_plan(key, _BwdPlan(pipe.kind, fn, grid, (block, 1, 1), smem, team_log,
                                        glog, groups, table, False, final, tree))
    glog, groups = backward_plan(dt, rows, hidden, sms)
    name, grid, block3, takes_glog = backward_launch(op, dt, rows, hidden, groups)
    return _keep_plan(key, _BwdPlan("reg", _kernel(dev, op, dt, name), grid, block3, 0, 0,
                                    glog, groups, False, takes_glog, False,
                                    _tree_plan(dev, op, dt, wdt, groups, hidden)))


def _backward(kind: str, op: int, grads: Sequence[Any], rows: Sequence[Any], weight: Any,
              eps: float, params: Mapping[str, Any], *, rstd: Any | None = None
              ) -> tuple[Any, ...]:
    """The backward kernels and the dweight row tree; returns ``(*row grads, dweight)``.
    ``rstd``: the forward's (``_forward(..., keep_rstd=True)``), which the pipelined
    kernels then read instead of recomputing it. ``OP_FUSED_SUM``: ``rows`` is the sum
    s alone, ``grads`` (dy, dresidual_out), one row gradient ds."""
    x = rows[0]
    n_rowgrads = 2 if op in (OP_FUSED, OP_GATED) else 1
    side = _side(kind, x)
    offset = float(params.get("offset", 0.0)) if op != OP_GATED else 0.0
    with side.context():
        outs = [side.empty_rows(x) for _ in range(n_rowgrads)]
        if _numel(x) == 0:
            return (*(o for o, _ in outs), side.zeros_like(weight))
        cp = side.cp
        dt = _dtype_code(kind, x)
        esize = 4 if dt == DT_F32 else 2
        hidden = int(x.shape[-1])
        nrows = _numel(x) // hidden
        xv, sx = side.rows(x)
        dyv, sdy = side.rows(grads[0])
        keep = [xv, dyv]
        r = sr = dres = sdres = 0
        if op in (OP_FUSED, OP_GATED):
            rv, sr = side.rows(rows[1])
            keep.append(rv)
            r = _ptr(rv)
        if op in (OP_FUSED, OP_FUSED_SUM):
            drv, sdres = side.rows(grads[1])
            keep.append(drv)
            dres = _ptr(drv)
        a = _Args(x=_ptr(xv), r=r, dy=_ptr(dyv), dres=dres, y=_ptr(outs[0][1]),
                  y2=_ptr(outs[1][1]) if n_rowgrads == 2 else 0,
                  rows=nrows, H=hidden, sx=sx, sr=sr, sdy=sdy, sdres=sdres, sy=hidden,
                  sy2=hidden if n_rowgrads == 2 else 0,
                  eps=eps, offset=offset, flags=_base_flags(op, x, weight, offset, params))
        a = with_alignment(a, esize)  # the rows' (the weight's below)
        reads_rstd = rstd is not None
        as_is = _weight_as_is(weight, x, dt) if a.flags & F_ALIGNED else None
        wdt = _dtype_code(kind, weight)
        strides = (a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2)
        plan = _backward_plan(cp, side.dev, op, dt, wdt, nrows, hidden, a.flags, strides,
                              reads_rstd)
        # the pipelined family reads a 16-bit weight as it is; the register kernels fp32
        a = _with_weight(side, a, weight, dt, as_is if plan.form != "reg" else None, keep)
        if plan.form != "reg" and not a.flags & F_ALIGNED:  # an fp32 weight off 16 bytes
            plan = _backward_plan(cp, side.dev, op, dt, wdt, nrows, hidden, a.flags, strides,
                                  reads_rstd)
        rstd_ptr = _ptr(rstd) if reads_rstd else 0
        chained = False  # the dweight tree's launches chained after the backward kernel
        groups = plan.groups
        if plan.final:  # one group: the kernel stores dweight itself in the weight's dtype
            dweight, wsv = side.empty_rows(weight)
            a = _with_flags(a, a.flags | F_DW_FINAL)
        else:
            ws, wsv = side.empty_f32((groups, hidden))
            a, chained = _chain_the_tree(a, groups, wdt, cp, side.dev)
        if plan.form == "row":  # a team per row
            args = _pack(a, (a.x, a.w, a.dy, a.y, _ptr(wsv)), (a.rows, a.sx, a.sdy, a.sy))
            _launch(plan.fn, plan.grid, plan.block,
                    KernelArgs("QQQQQqqqqffiQ", (*args, rstd_ptr)))
        elif plan.form == "pair":  # 32-bit rows and strides, the saved rstd, no eps
            _launch(plan.fn, plan.grid, plan.block, KernelArgs(
                "QQQQQQQiiiiiifiiiQ",
                (a.x, a.r, a.w, a.dy, a.y, a.y2, _ptr(wsv), a.rows, a.sx, a.sr, a.sdy, a.sy,
                 a.sy2, _f32_arg(a.offset), a.flags, plan.glog, groups, rstd_ptr)), plan.smem)
        else:  # the pipelined backward (persistent teams, dweight stacks in shared
            # memory) or the register kernels
            if plan.table:
                a = _with_flags(a, a.flags | F_GATE_TABLE)
            args = _pack(a, (a.x, a.r, a.w, a.dy, a.dres, a.y, a.y2, _ptr(wsv)),
                         (a.rows, a.H, a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2))
            if plan.form == "pipe":
                args = KernelArgs(_BWD_CODES + "iiQ", (*args, plan.team_log, plan.glog, rstd_ptr))
            elif plan.takes_glog:
                args = KernelArgs(_BWD_CODES + "i", (*args, plan.glog))
            else:
                args = KernelArgs(_BWD_CODES, args)
            _launch(plan.fn, plan.grid, plan.block, args, plan.smem)
        if not plan.final:
            dweight = _fold_dweight(side, plan.tree, ws, wsv, hidden, weight, chained=chained)
        del keep
        return (*(o for o, _ in outs), dweight)


def _tree_follows(groups: int, weight_dtype_code: int) -> bool:
    """Whether tree kernels follow a backward of ``groups`` dweight groups (not when its
    one fp32 row is an fp32 weight's dweight)."""
    return not (groups == 1 and weight_dtype_code == DT_F32)


def _chain_the_tree(a: _Args, groups: int, weight_dtype_code: int, cp: Any, dev: int
                    ) -> tuple[_Args, bool]:
    """``(a, chained)``: where tree kernels follow and ``chained_launches`` allows it, the
    backward kernel's arguments with F_LET_DEPENDENTS and ``True`` (the tree's launches
    are then chained after it); else ``a`` as it is and ``False``."""
    if _tree_follows(groups, weight_dtype_code) and chained_launches(cp, dev):
        return _with_flags(a, a.flags | F_LET_DEPENDENTS), True
    return a, False


def _fold_dweight(side: _TorchSide | _CupySide, tree: _TreePlan, ws: Any, wsv: Any,
                  hidden: int, weight: Any, *, chained: bool = False) -> Any:
    """dweight from the backward's fp32 workspace rows ``ws`` (``wsv`` the view the
    kernels read) by ``tree`` (``_tree_plan``). ``chained``: each launch a programmatic
    dependent one (the backward kernel had F_LET_DEPENDENTS)."""
    g = ws.shape[0]
    for gout, clog, tgrid in tree.levels:
        out, outv = side.empty_f32((gout, hidden))
        _launch(tree.tree_fn, tgrid, (256, 1, 1),
                KernelArgs("QQqqi", (_ptr(wsv), _ptr(outv), g, hidden, clog)), chained=chained)
        ws, wsv, g = out, outv, gout
    if tree.last is None:  # one fp32 row already is an fp32 weight's dweight
        return ws.reshape(hidden)
    dweight, dwv = side.empty_rows(weight)
    last, clog1, slog, lgrid = tree.last
    _launch(last, lgrid, (16, 16, 1),
            KernelArgs("QQqqii", (_ptr(wsv), _ptr(dwv), g, hidden, clog1, slog)),
            chained=chained)
    return dweight


# ---- autograd for torch inputs ------------------------------------------------------
def _norm_reads_new_residual(x: torch.Tensor, params: Mapping[str, Any]) -> bool:
    """Whether the fused forward's new residual is the very sum its norm read: the
    "rounded" convention, or float32 rows (where both conventions coincide)."""
    return params.get("residual_sum", "fp32") == "rounded" or x.dtype == torch.float32


class _NormFunction(torch.autograd.Function):
    """Forward = the forward kernel, which also writes each row's rstd; backward = the
    backward kernels (the spec's), reading that rstd. Where the fused op's new residual is
    the sum its norm read, the backward reads that one row tensor instead of x and the
    residual and writes ds once: dx and dresidual are the same bits by the spec (the torch
    extension's ``fused_add_rms_norm_backward_from_sum``)."""

    @staticmethod
    def forward(ctx, op: int, eps: float, params: dict, weight, *rows):
        ctx.op, ctx.eps, ctx.params = op, eps, params
        *outs, rstd = _forward("torch", op, rows, weight, eps, params, keep_rstd=True)
        ctx.from_sum = op == OP_FUSED and _norm_reads_new_residual(rows[0], params)
        if ctx.from_sum:
            ctx.save_for_backward(weight, rstd, outs[1])
        else:
            ctx.save_for_backward(weight, rstd, *rows)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        weight, rstd, *rows = ctx.saved_tensors
        grads = [torch.zeros_like(rows[0]) if g is None else g for g in grad_outputs]
        if ctx.from_sum:
            ds, dweight = _backward("torch", OP_FUSED_SUM, grads, rows, weight, ctx.eps,
                                    ctx.params, rstd=rstd)
            return (None, None, None, dweight, ds, ds)
        *row_grads, dweight = _backward("torch", ctx.op, grads, rows, weight, ctx.eps,
                                        ctx.params, rstd=rstd)
        return (None, None, None, dweight, *row_grads)


def _check_params(eps: float, params: dict[str, Any]) -> float:
    """Checks eps and the op's parameters (``params`` updated in place); returns eps."""
    eps = check_eps(eps)
    if "offset" in params:
        params["offset"] = check_offset(params["offset"])
    for key, choices in (("residual_sum", RESIDUAL_SUMS), ("convention", GATED_CONVENTIONS),
                         ("activation", ACTIVATIONS)):
        if key in params:
            params[key] = check_choice(key, params[key], choices)
    return eps


_OP_NAMES = {code: name for name, code in OP_CODES.items()}


def _run(op: int, rows: Mapping[str, Any], weight: Any, eps: float,
         params: dict[str, Any], *, with_rstd: bool = False) -> tuple[Any, ...]:
    kind = _validate(rows, weight)
    eps = _check_params(eps, params)
    values = list(rows.values())
    if kind == "torch":
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in [*values, weight])
        if grad and with_rstd:
            name = _OP_NAMES[op]
            raise ValueError(
                f"{name}_with_rstd: builds no autograd graph, and an input requires grad; "
                f"call {name} (its autograd keeps rstd itself) or run under torch.no_grad()")
        _check_torch_device(values[0])
        _cupy()
        if grad:
            return _NormFunction.apply(op, eps, params, weight, *values)
    else:
        _cupy()
    return _forward(kind, op, values, weight, eps, params, keep_rstd=with_rstd)


def _check_rstd(kind: str, rstd: Any, x: Any) -> None:
    """The forward's rstd given to a backward: float32, the shape of x without its last
    dimension, contiguous, of x's kind and on x's device (as the torch extension's
    ``given_rstd``)."""
    if rstd is None:
        return
    want = tuple(x.shape[:-1])
    if kind == "torch":
        if not isinstance(rstd, torch.Tensor):
            raise TypeError(f"rstd: expected a torch.Tensor like x, got {type(rstd).__name__}")
        dtype, contiguous = str(rstd.dtype).removeprefix("torch."), rstd.is_contiguous()
        device, x_device = rstd.device, x.device
    else:
        if not _is_cupy_array(rstd):
            raise TypeError(f"rstd: expected a CuPy array like x, got {type(rstd).__name__}")
        dtype, contiguous = rstd.dtype.name, bool(rstd.flags.c_contiguous)
        device, x_device = f"cuda:{rstd.device.id}", f"cuda:{x.device.id}"
    if dtype != "float32":
        raise TypeError(f"rstd: expected dtype float32, got {dtype}")
    if tuple(rstd.shape) != want:
        raise ValueError("rstd: expected the shape of x without its last dimension, "
                         f"{want}, got {tuple(rstd.shape)}")
    if not contiguous:
        raise ValueError("rstd: expected a contiguous array")
    if device != x_device:
        raise ValueError(f"rstd: expected the device of x, {x_device}, got {device}")


def _run_backward(op: int, grads: Mapping[str, Any], rows: Mapping[str, Any], weight: Any,
                  eps: float, params: dict[str, Any], rstd: Any | None = None
                  ) -> tuple[Any, ...]:
    kind = _validate(rows, weight)
    x = next(iter(rows.values()))
    for n, g in grads.items():
        (check_like if kind == "torch" else _cp_check_like)(n, g, x)
    eps = _check_params(eps, params)
    _check_rstd(kind, rstd, x)
    if op == OP_FUSED_SUM and params["residual_sum"] != "rounded" and (
            _dtype_code(kind, x) != DT_F32):
        raise ValueError(
            "residual_sum: the backward from the saved sum needs 'rounded' or float32 rows "
            f"(the norm of 'fp32' reads the unrounded sum), got 'fp32' with s of dtype "
            f"{_dtype_name(kind, x)}")
    if kind == "torch":
        _check_torch_device(x)
    _cupy()
    with torch.no_grad():
        return _backward(kind, op, list(grads.values()), list(rows.values()), weight, eps,
                         params, rstd=rstd)


def _dtype_name(kind: str, x: Any) -> str:
    return str(x.dtype) if kind == "torch" else x.dtype.name


# ---- public operators ---------------------------------------------------------------
def rms_norm(x: Any, weight: Any, *, eps: float, offset: float = 0.0) -> Any:
    """RMSNorm, bitwise equal to [`normspec.spec.rms_norm`][normspec.spec.rms_norm.rms_norm].

    ``x`` (``(..., H)``) and ``weight`` (``(H,)``, fp32 or ``x``'s dtype) are CUDA torch
    tensors (differentiable) or CuPy arrays; the result has the same kind.
    """
    return _run(OP_RMS, {"x": x}, weight, eps, {"offset": offset})[0]


def fused_add_rms_norm(x: Any, residual: Any, weight: Any, *, eps: float, offset: float = 0.0,
                       residual_sum: str = "fp32") -> tuple[Any, Any]:
    """Residual add + RMSNorm, bitwise equal to
    [`normspec.spec.fused_add_rms_norm`][normspec.spec.fused_add.fused_add_rms_norm].

    Returns ``(y, new_residual)``.
    """
    y, res = _run(OP_FUSED, {"x": x, "residual": residual}, weight, eps,
                  {"offset": offset, "residual_sum": residual_sum})
    return y, res


def rms_norm_gated(x: Any, gate: Any, weight: Any, *, eps: float, convention: str = "vllm",
                   activation: str = "silu") -> Any:
    """Gated RMSNorm, bitwise equal to
    [`normspec.spec.rms_norm_gated`][normspec.spec.gated.rms_norm_gated].
    """
    return _run(OP_GATED, {"x": x, "gate": gate}, weight, eps,
                {"convention": convention, "activation": activation})[0]


def rms_norm_with_rstd(x: Any, weight: Any, *, eps: float, offset: float = 0.0
                       ) -> tuple[Any, Any]:
    """``(y, rstd)``: [`rms_norm`][normspec.backends.cupy.rms_norm] and each row's
    rstd as the forward kernel computed it (float32, ``x.shape[:-1]``: the spec's bits),
    for the explicit backward's ``rstd``, which then reads it instead of recomputing it
    (the torch extension's ``rms_norm_with_rstd``). It builds no autograd graph: torch
    inputs that require grad are refused (``rms_norm``'s autograd keeps rstd itself).
    """
    y, rstd = _run(OP_RMS, {"x": x}, weight, eps, {"offset": offset}, with_rstd=True)
    return y, rstd


def fused_add_rms_norm_with_rstd(x: Any, residual: Any, weight: Any, *, eps: float,
                                 offset: float = 0.0, residual_sum: str = "fp32"
                                 ) -> tuple[Any, Any, Any]:
    """``(y, new_residual, rstd)``:
    [`fused_add_rms_norm`][normspec.backends.cupy.fused_add_rms_norm] and each
    row's rstd, as in
    [`rms_norm_with_rstd`][normspec.backends.cupy.rms_norm_with_rstd].
    """
    y, res, rstd = _run(OP_FUSED, {"x": x, "residual": residual}, weight, eps,
                        {"offset": offset, "residual_sum": residual_sum}, with_rstd=True)
    return y, res, rstd


def rms_norm_gated_with_rstd(x: Any, gate: Any, weight: Any, *, eps: float,
                             convention: str = "vllm", activation: str = "silu"
                             ) -> tuple[Any, Any]:
    """``(y, rstd)``: [`rms_norm_gated`][normspec.backends.cupy.rms_norm_gated] and
    each row's rstd, as in
    [`rms_norm_with_rstd`][normspec.backends.cupy.rms_norm_with_rstd].
    """
    y, rstd = _run(OP_GATED, {"x": x, "gate": gate}, weight, eps,
                   {"convention": convention, "activation": activation}, with_rstd=True)
    return y, rstd


def rms_norm_backward(dy: Any, x: Any, weight: Any, *, eps: float, offset: float = 0.0,
                      rstd: Any | None = None) -> tuple[Any, Any]:
    """``(dx, dweight)`` of [`rms_norm`][normspec.backends.cupy.rms_norm].
    ``rstd``: the forward's (``rms_norm_with_rstd``), read instead of recomputed (the same
    bits)."""
    dx, dw = _run_backward(OP_RMS, {"dy": dy}, {"x": x}, weight, eps, {"offset": offset},
                           rstd)
    return dx, dw


def fused_add_rms_norm_backward(dy: Any, dresidual_out: Any, x: Any, residual: Any, weight: Any,
                                *, eps: float, offset: float = 0.0,
                                residual_sum: str = "fp32", rstd: Any | None = None
                                ) -> tuple[Any, Any, Any]:
    """``(dx, dresidual, dweight)`` of
    [`fused_add_rms_norm`][normspec.backends.cupy.fused_add_rms_norm]; ``rstd`` as
    in [`rms_norm_backward`][normspec.backends.cupy.rms_norm_backward]."""
    dx, dres, dw = _run_backward(
        OP_FUSED, {"dy": dy, "dresidual_out": dresidual_out}, {"x": x, "residual": residual},
        weight, eps, {"offset": offset, "residual_sum": residual_sum}, rstd)
    return dx, dres, dw


def fused_add_rms_norm_backward_from_sum(dy: Any, dresidual_out: Any, s: Any, weight: Any, *,
                                         eps: float, offset: float = 0.0,
                                         residual_sum: str = "rounded",
                                         rstd: Any | None = None) -> tuple[Any, Any]:
    """``(ds, dweight)`` of
    [`fused_add_rms_norm`][normspec.backends.cupy.fused_add_rms_norm] from the
    sum ``s`` its norm read: the forward's new residual where that is the sum,
    ``residual_sum="rounded"`` or float32 rows (the torch extension's
    ``fused_add_rms_norm_backward_from_sum``). ``ds`` is both dx and dresidual (the same
    bits by the spec); one row tensor is read instead of x and the residual. ``rstd`` as
    in [`rms_norm_backward`][normspec.backends.cupy.rms_norm_backward]."""
    ds, dw = _run_backward(
        OP_FUSED_SUM, {"dy": dy, "dresidual_out": dresidual_out}, {"s": s}, weight, eps,
        {"offset": offset, "residual_sum": residual_sum}, rstd)
    return ds, dw


def rms_norm_gated_backward(dy: Any, x: Any, gate: Any, weight: Any, *, eps: float,
                            convention: str = "vllm", activation: str = "silu",
                            rstd: Any | None = None) -> tuple[Any, Any, Any]:
    """``(dx, dgate, dweight)`` of
    [`rms_norm_gated`][normspec.backends.cupy.rms_norm_gated]; ``rstd`` as in
    [`rms_norm_backward`][normspec.backends.cupy.rms_norm_backward]."""
    dx, dg, dw = _run_backward(OP_GATED, {"dy": dy}, {"x": x, "gate": gate}, weight, eps,
                               {"convention": convention, "activation": activation}, rstd)
    return dx, dg, dw


# ---- the registry backend -------------------------------------------------------------
def _cupy_version() -> str | None:
    import importlib.metadata

    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_OPS = ("rms_norm", "fused_add_rms_norm", "rms_norm_gated")


class CupyBackend(Backend):
    """The normspec CUDA kernels compiled by NVRTC and launched through CuPy."""

    name = "cupy"
    ops = {op: OpSupport(backward="full", devices=("cuda",), weight_dtypes=("fp32", "same"))
           for op in _OPS}

    @property
    def source(self) -> str:  # type: ignore[override]
        version = _cupy_version() or "(not installed)"
        return f"CuPy {version} NVRTC RawModule of backends/csrc/{KERNELS}"

    def prepare(self) -> None:
        """Compiles the NVRTC modules the disk cache lacks for the current device's target
        (device 0 in registry.statuses' fresh thread), loading none: no context is made.
        ``available()`` then loads them on its caller's device (compiling for that
        device's target too, where it differs)."""
        if available(compile=False) is None:
            compile_modules()

    def available(self) -> str | None:
        return available()

    def build(self, verbose: bool = True) -> str:
        """``normspec build``: compiles the modules the disk cache lacks for the current
        device (side by side, [`compile_modules`][normspec.backends.cupy.compile_modules])
        and loads them. Returns what it did; "skipped" with the reason where CuPy or a GPU
        is missing. Raises ``RuntimeError`` with NVRTC's or the driver's reason."""
        if _compile_error is None:  # CuPy or a GPU missing: nothing to build here
            reason = available(compile=False)
            if reason is not None:
                return f"skipped: {reason}"
        start = time.perf_counter()
        reason = available()
        if reason is not None:
            raise RuntimeError(f"normspec cupy: {reason}")
        return (f"{len(MODULES)} NVRTC modules ready in {_cache_dir()} "
                f"({time.perf_counter() - start:.0f} s)")

    def library_version(self) -> str | None:
        return _cupy_version()

    def forward(self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
                eps: float, **params: Any) -> tuple[torch.Tensor, ...]:
        if op == "rms_norm":
            return (rms_norm(rows["x"], weight, eps=eps, **params),)
        if op == "fused_add_rms_norm":
            return fused_add_rms_norm(rows["x"], rows["residual"], weight, eps=eps, **params)
        if op == "rms_norm_gated":
            return (rms_norm_gated(rows["x"], rows["gate"], weight, eps=eps, **params),)
        raise ValueError(f"op: unknown operator {op!r}; expected one of {list(_OPS)}")


#: The registry entry point object (``cupy = "normspec.backends.cupy:backend"``).
backend = CupyBackend()
# CuPy (where installed) is imported with this module, in the importing thread: prepare()
# runs in a thread of its own beside other backends' imports (registry.statuses), and two
# threads importing the same modules can meet one half initialised
_import_cupy()
