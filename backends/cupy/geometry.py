"""The launch geometry of ``normspec_launch_impl.cuh``, in Python: pure functions.

Team sizes, passes, dweight groups, shared memory and grids as the C++ launcher computes
them (each function names its C++ twin). By the design any valid geometry gives the same
bits (every partial sum is the tree of an aligned power-of-two segment, whatever the team
size); these functions mirror the launcher so that both backends run the same launches.
tests/test_cupy_nvrtc.py and tests/test_cupy_launch_parity.py compare them with the C++.
"""

from __future__ import annotations

from collections.abc import Sequence

from .codes import (
    DT_BF16,
    DT_F32,
    GATE_TABLE_MIN_ELEMENTS,
    GATE_TABLE_SLOTS,
    NPS,
    OP_GATED,
    PIPE_PLAN_LEVELS,
    PIPE_STACK_BUDGET,
    STATIC_SMEM_ROOM,
)


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
    for np_ in NPS:
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
            + (GATE_TABLE_SLOTS * 8 if table else 0))


def fits_smem(dynamic_bytes: int, optin: int) -> bool:
    """Whether a block's dynamic shared memory fits what it may opt in to."""
    return dynamic_bytes + STATIC_SMEM_ROOM <= optin


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
    while (cap < PIPE_PLAN_LEVELS
           and pipe_stack_bytes(team_log, np_, vec, cap + 1) <= PIPE_STACK_BUDGET
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
    return op == OP_GATED and dtype_code == DT_BF16 and rows * hidden >= GATE_TABLE_MIN_ELEMENTS


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
    np_ = next(n for n in NPS if n * threads * vec >= hidden)
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
