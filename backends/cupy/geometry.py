"""The launch geometry of ``backends/csrc/normspec_plan.h``, in Python: pure functions.

Team sizes, passes, dweight groups and shared memory as the C++ plan computes them, each
function named after its C++ twin (``forward_geometry`` is ``geometry``); ``planner``
builds the launch plan from them. By the design any valid geometry gives the same bits
(every partial sum is the tree of an aligned power-of-two segment, whatever the team
size); the two backends run the same launches because tests/test_launch_plan.py holds
this plan to the C++ one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .codes import (
    DT_BF16,
    DT_F32,
    GATE_TABLE_MIN_ELEMENTS,
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


def grid_for(units: int, per_block: int) -> int:
    """Blocks for ``units`` teams, ``per_block`` teams a block (1 .. 2**30)."""
    blocks = (units + per_block - 1) // per_block
    return int(min(max(blocks, 1), 1 << 30))


def forward_geometry(hidden: int, vec: int) -> tuple[int, int]:
    """``(threads per team, NP)`` of the register forward (``geometry``); ``NP == 0``
    means the streaming kernel."""
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
    """``(threads per team, NP)`` of the register backward (teams of at most 256)."""
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


class BackwardGroups(NamedTuple):
    """The backward's dweight groups (``BackwardPlan``): teams reduce groups of
    ``2**glog`` rows into ``groups`` workspace rows; ``pipe``: the pipelined kernels', of
    teams of ``2**team_log`` threads and ``np`` passes."""

    glog: int = 0
    groups: int = 0
    pipe: int = 0
    team_log: int = 0
    np: int = 0


def backward_plan(dtype_code: int, rows: int, hidden: int, sm_count: int) -> BackwardGroups:
    """The register kernels' groups: the largest that leave every resident team a group."""
    threads, np_ = backward_geometry(hidden, vec_of(dtype_code))
    glog = 0
    if np_ > 0:
        target = sm_count * max(2048 // threads, 1)
        prow = next_pow2(rows)
        ml = max_group_log(np_)
        while glog < ml and (1 << (glog + 1)) <= prow:
            r = 1 << (glog + 1)
            if (rows + r - 1) // r < target:
                break
            glog += 1
    r = 1 << glog
    return BackwardGroups(glog, (rows + r - 1) // r)


class PipeGeometry(NamedTuple):
    """Teams of ``2**team_log`` threads with ``np`` passes (0: not eligible)."""

    team_log: int = 0
    np: int = 0

    @property
    def block(self) -> int:
        """Threads per block of the pipelined kernels."""
        return 256 if self.team_log <= 5 else 1 << self.team_log


def with_passes(threads: int, hidden: int, vec: int) -> PipeGeometry:
    """Teams of ``threads`` (at most 256) with the fewest passes that cover ``hidden``."""
    if threads > 256:
        return PipeGeometry()
    for np_ in NPS:
        if np_ * threads * vec >= hidden:
            return PipeGeometry((threads - 1).bit_length(), np_)
    return PipeGeometry()


def pipe_geometry(hidden: int, vec: int, backward: bool) -> PipeGeometry:
    """The pipelined kernels' teams: one pass up to 16 vectors (32 in the backward), teams
    of half the vectors up to 512, 256 x 4 for 513..1024 vectors."""
    nvec = (hidden + vec - 1) // vec
    if nvec <= (32 if backward else 16):
        threads = next_pow2(nvec)
    elif nvec <= 512:
        threads = next_pow2(nvec) // 2
    else:
        threads = 256
    return with_passes(threads, hidden, vec)


def row_index_fits_32(rows: int) -> bool:
    """Whether the one-row forward's constant forms may take ``rows`` (32-bit row index)."""
    return rows <= 0x7FFFFFFF


def row_geometry(hidden: int, vec: int, two_inputs: bool, rows: int, sms: int
                 ) -> PipeGeometry:
    """The one-row forward's teams: four vectors a thread for the rms norm, two for the
    ops with two row tensors; few rows double the team, up to one vector a thread, while
    the teams' threads stay within ``sms * 1024``."""
    nvec = (hidden + vec - 1) // vec
    threads = min(256, max(1, next_pow2(nvec) // (2 if two_inputs else 4)))
    one_vector = min(next_pow2(nvec), 256)
    while threads < one_vector and rows * threads * 2 <= sms * 1024:
        threads *= 2
    return with_passes(threads, hidden, vec)


def row_block(g: PipeGeometry, rows: int, sms: int) -> int:
    """Threads per block of the one-row forward: a team of 64+ lanes is its block; smaller
    teams share 256-thread blocks, or one-warp blocks from 8 waves of resident threads."""
    if g.team_log > 5:
        return 1 << g.team_log
    if rows << g.team_log >= sms * 2048 * 8:
        return 32
    return 256


def fits_smem(dynamic_bytes: int, optin: int) -> bool:
    """Whether a block's dynamic shared memory fits what it may opt in to."""
    return dynamic_bytes + STATIC_SMEM_ROOM <= optin


def pipe_stack_bytes(g: PipeGeometry, vec: int, glog: int) -> int:
    """The dweight stacks of a pipelined backward block."""
    return glog * g.np * vec * 4 * g.block


def pipe_weight_bytes(g: PipeGeometry, vec: int) -> int:
    """The weight factors (NP * VEC floats a lane)."""
    return (g.np * vec * 4) << g.team_log


def pipe_max_glog(g: PipeGeometry, vec: int, optin: int) -> int:
    """The deepest dweight stacks within the budget a block and the opt-in limit."""
    weights = pipe_weight_bytes(g, vec)
    level = 0
    while (level < PIPE_PLAN_LEVELS
           and pipe_stack_bytes(g, vec, level + 1) <= PIPE_STACK_BUDGET
           and fits_smem(pipe_stack_bytes(g, vec, level + 1) + weights, optin)):
        level += 1
    return level


def backward_plan_aligned(dtype_code: int, rows: int, hidden: int, aligned: bool,
                          sm_count: int, optin: int) -> BackwardGroups:
    """The backward's groups (``backward_plan_aligned``): the pipelined kernels' for
    aligned rows of at most 1024 vectors, the largest that leave a group for at least half
    of the teams the device holds; else ``backward_plan``."""
    vec = vec_of(dtype_code)
    g = pipe_geometry(hidden, vec, True) if aligned else PipeGeometry()
    if g.np == 0:
        return backward_plan(dtype_code, rows, hidden, sm_count)
    cap = pipe_max_glog(g, vec, optin)
    teams = sm_count * (2048 // g.block) * (g.block >> g.team_log)
    prow = next_pow2(rows)
    glog = 0
    while glog < cap and (1 << (glog + 1)) <= prow:
        r = 1 << (glog + 1)
        if 2 * ((rows + r - 1) // r) < teams:
            break
        glog += 1
    r = 1 << glog
    return BackwardGroups(glog, (rows + r - 1) // r, 1, g.team_log, g.np)


def pipe_backward_plan(dtype_code: int, rows: int, hidden: int, sm_count: int,
                       optin: int) -> tuple[int, int, int, int] | None:
    """``(team_log, NP, glog, groups)`` of the pipelined backward for aligned rows, ``None``
    for rows of more than 1024 vectors."""
    b = backward_plan_aligned(dtype_code, rows, hidden, True, sm_count, optin)
    return (b.team_log, b.np, b.glog, b.groups) if b.pipe else None


def wants_gate_table(op: int, dtype_code: int, rows: int, hidden: int) -> bool:
    """Whether a launch reads act(z) from a gate table: bf16 gated launches of at least
    2**20 elements."""
    return op == OP_GATED and dtype_code == DT_BF16 and rows * hidden >= GATE_TABLE_MIN_ELEMENTS


def gt_form(hf: bool, w_is_input: bool, w_raw: bool) -> int:
    """The global gate table's form of the one-row forward (``GTF``): the vllm
    convention's 1, or 4 with the weight read in the input dtype; the transformers
    convention's 2 (fp32 weight), 3 (a weight of the input dtype) or 5 (read as it is)."""
    if not hf:
        return 4 if w_raw else 1
    if not w_is_input:
        return 2
    return 5 if w_raw else 3


def gated_gc(hf: bool, w_is_input: bool) -> int:
    """The gate-table backward's convention constants ``GC``: 0 the vllm convention, 1
    transformers' with an fp32 weight, 7 with a weight of the input dtype."""
    if not hf:
        return 0
    return 7 if w_is_input else 1


def fills_team(hidden: int, np_: int, vec: int, team_log: int) -> bool:
    """Whether rows fill a team of ``2**team_log`` threads exactly with NP vectors each."""
    return hidden == (np_ * vec) << team_log


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


def offsets_fit_32(rows: int, hidden: int, strides: Sequence[int]) -> bool:
    """Whether a launch of `rows` rows of `hidden` elements with these row `strides` may
    run ``normspec_gated_bwd_pair_kernel``, which does its row and offset arithmetic in 32
    bits: at most ``2**30`` rows and a last element, ``(rows - 1) * max(strides, hidden) +
    hidden - 1``, of at most ``2**31 - 2`` (``offsets_fit_32`` in the launcher)."""
    m = max((hidden, *strides))
    return rows <= 1 << 30 and m <= 0x7FFFFFFF and (rows - 1) * m <= 0x7FFFFFFF - hidden
