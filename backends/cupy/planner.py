"""The launch plan of ``backends/csrc/normspec_plan.h``, function for function.

``launch_plan(query)`` says which kernel family (with its template arguments), block,
dynamic shared memory and grid a call runs; the torch extension's launcher asks the C++
plan, the CuPy backend this one. tests/test_launch_plan.py prints the C++ plan for a grid
of queries (tests/plan_table.cpp) and compares it with this one, query by query.
"""

from __future__ import annotations

from typing import NamedTuple

from .codes import DT_BF16, DT_F32, GATE_TABLE_SLOTS, OP_GATED, OP_RMS
from .geometry import (
    BackwardGroups,
    PipeGeometry,
    backward_geometry,
    fills_team,
    fits_smem,
    forward_geometry,
    gated_gc,
    grid_for,
    gt_form,
    pipe_geometry,
    pipe_stack_bytes,
    pipe_weight_bytes,
    row_block,
    row_geometry,
    row_index_fits_32,
    vec_of,
    wants_gate_table,
)

#: ``KernelFamily`` of normspec_plan.h
(K_FWD_REGISTER, K_FWD_STREAM, K_FWD_ROW, K_FWD_QUAD, K_FWD_PIPE, K_BWD_REGISTER,
 K_BWD_STREAM, K_BWD_ROW, K_BWD_PIPE, K_BWD_PAIR) = range(10)


class PlanQuery(NamedTuple):
    """What a plan depends on (``PlanQuery``); ``groups``: the backward's dweight groups."""

    op: int
    dtype: int
    backward: bool
    rows: int
    H: int
    aligned: bool = False
    w_raw: bool = False
    hf: bool = False
    w_is_input: bool = False
    saved_rstd: bool = False
    global_table: bool = True
    offsets_fit_32: bool = True
    sms: int = 132
    smem_optin: int = 232448
    groups: BackwardGroups = BackwardGroups()


class LaunchPlan(NamedTuple):
    """A launch (``LaunchPlan``): the kernel family and template arguments, block, shared
    memory, and a fixed grid or, ``persistent``, ``persistent_grid`` over ``units`` teams."""

    kernel: int = K_FWD_REGISTER
    np: int = 0
    full_tl: int = -1
    gt_form: int = 0
    gc: int = -1
    saved: bool = False
    block_x: int = 1
    block_y: int = 1
    smem: int = 0
    team_log: int = 0
    glog: int = 0
    groups: int = 0
    table: bool = False
    persistent: bool = False
    grid: int = 1
    units: int = 0


def forward_kind(q: PlanQuery) -> str:
    """``"register"``, ``"row"`` or ``"pipe"`` (``forward_kind``)."""
    if not q.aligned:
        return "register"
    vec = vec_of(q.dtype)
    if (not wants_gate_table(q.op, q.dtype, q.rows, q.H)
            and row_geometry(q.H, vec, q.op != OP_RMS, q.rows, q.sms).np > 0):
        return "row"
    if pipe_geometry(q.H, vec, False).np > 0:
        return "pipe"
    return "register"


def row_plan(q: PlanQuery, g: PipeGeometry, full_tl: int) -> LaunchPlan:
    block = row_block(g, q.rows, q.sms)
    return LaunchPlan(K_FWD_ROW, g.np, full_tl, team_log=g.team_log, block_x=block,
                      grid=grid_for(q.rows, block >> g.team_log))


def global_table_plan(q: PlanQuery) -> LaunchPlan | None:
    """The one-row forward reading act(z) from the global gate table, or ``None``."""
    if (q.op != OP_GATED or q.dtype != DT_BF16 or not q.aligned or not q.global_table
            or not wants_gate_table(q.op, q.dtype, q.rows, q.H)
            or not row_index_fits_32(q.rows)):
        return None
    g = row_geometry(q.H, 8, True, q.rows, q.sms)
    if g.np != 2 or not fills_team(q.H, 2, 8, g.team_log) or not 2 <= g.team_log <= 6:
        return None
    return row_plan(q, g, g.team_log)._replace(gt_form=gt_form(q.hf, q.w_is_input, q.w_raw))


def quad_lanes_log(q: PlanQuery, g: PipeGeometry) -> int:
    """Lanes a row (log2) of the q/k forward in vectors of four, 0 where it does not apply."""
    if q.dtype == DT_F32 or q.op == OP_GATED or not q.w_raw or not q.aligned:
        return 0
    ll = 6 if q.H == 256 and g.team_log == 5 else (5 if q.H == 128 and g.team_log == 4 else 0)
    if ll == 0 or q.rows << ll > q.sms * 128:
        return 0
    return ll


def one_row_plan(q: PlanQuery) -> LaunchPlan:
    vec = vec_of(q.dtype)
    g = row_geometry(q.H, vec, q.op != OP_RMS, q.rows, q.sms)
    default_np = 4 if q.op == OP_RMS else 2
    fits = row_index_fits_32(q.rows) and fills_team(q.H, g.np, vec, g.team_log)
    if g.np == default_np and fits and 1 <= g.team_log <= 8:
        return row_plan(q, g, g.team_log)
    if g.np == 1:
        ll = quad_lanes_log(q, g)
        if ll:
            return LaunchPlan(K_FWD_QUAD, ll, block_x=256, grid=grid_for(q.rows, 256 >> ll))
        if fits and 4 <= g.team_log <= 8:
            return row_plan(q, g, g.team_log)
    return row_plan(q, g, -1)


def persistent_forward_plan(q: PlanQuery) -> LaunchPlan:
    vec = vec_of(q.dtype)
    g = pipe_geometry(q.H, vec, False)
    weights = pipe_weight_bytes(g, vec)
    table = (wants_gate_table(q.op, q.dtype, q.rows, q.H)
             and fits_smem(weights + GATE_TABLE_SLOTS * 4, q.smem_optin))
    full = (table and g.np <= 2 and fills_team(q.H, g.np, vec, g.team_log)
            and 2 <= g.team_log <= 5)
    return LaunchPlan(K_FWD_PIPE, g.np, g.team_log if full else -1, block_x=g.block,
                      smem=weights + (GATE_TABLE_SLOTS * 4 if table else 0),
                      team_log=g.team_log, table=table, persistent=True, units=q.rows)


def register_plan(q: PlanQuery, threads: int, np_: int, units: int, kernel: int,
                  stream_kernel: int) -> LaunchPlan:
    if np_ == 0:
        return LaunchPlan(stream_kernel, block_x=1024, grid=grid_for(q.rows, 1))
    tpb = 4 if threads == 32 else 1
    return LaunchPlan(kernel, np_, block_x=threads, block_y=tpb, grid=grid_for(units, tpb))


def forward_launch_plan(q: PlanQuery) -> LaunchPlan:
    gt = global_table_plan(q)
    if gt is not None:
        return gt
    kind = forward_kind(q)
    if kind == "row":
        return one_row_plan(q)
    if kind == "pipe":
        return persistent_forward_plan(q)
    return register_plan(q, *forward_geometry(q.H, vec_of(q.dtype)), q.rows, K_FWD_REGISTER,
                         K_FWD_STREAM)


def backward_gate_table(q: PlanQuery, b: BackwardGroups) -> bool:
    g = PipeGeometry(b.team_log, b.np)
    vec = vec_of(q.dtype)
    return wants_gate_table(q.op, q.dtype, q.rows, q.H) and fits_smem(
        pipe_stack_bytes(g, vec, b.glog) + pipe_weight_bytes(g, vec) + GATE_TABLE_SLOTS * 8,
        q.smem_optin)


def pipelined_backward_plan(q: PlanQuery) -> LaunchPlan:
    b = q.groups
    vec = vec_of(q.dtype)
    lo = 4 if b.np == 1 else 7
    full = (b.np <= 2 and fills_team(q.H, b.np, vec, b.team_log)
            and b.team_log in (lo, lo + 1))
    full_tl = b.team_log if full else -1
    base = LaunchPlan(np=b.np, full_tl=full_tl, team_log=b.team_log, glog=b.glog,
                      groups=b.groups, saved=q.saved_rstd)
    g = PipeGeometry(b.team_log, b.np)
    if q.op == OP_RMS and full and b.glog == 0:
        if b.np == 2 and full_tl == 7 and q.rows <= 8 * q.sms:
            g = PipeGeometry(8, 1)
            base = base._replace(np=1, full_tl=8, team_log=8)
        return base._replace(kernel=K_BWD_ROW, block_x=g.block,
                             grid=grid_for(q.rows, g.block >> g.team_log))
    table = backward_gate_table(q, b)
    smem = (pipe_stack_bytes(g, vec, b.glog) + pipe_weight_bytes(g, vec)
            + (GATE_TABLE_SLOTS * 8 if table else 0))
    p = base._replace(kernel=K_BWD_PIPE, block_x=g.block, persistent=True, units=b.groups,
                      table=table, smem=smem)
    if (q.op == OP_GATED and q.dtype == DT_BF16 and b.np == 1 and full and q.saved_rstd
            and table):
        p = p._replace(gc=gated_gc(q.hf, q.w_is_input))
        if b.glog >= 1 and q.offsets_fit_32:
            p = p._replace(kernel=K_BWD_PAIR,
                           smem=(b.glog - 1) * vec * 4 * 256 + GATE_TABLE_SLOTS * 8)
    return p


def backward_launch_plan(q: PlanQuery) -> LaunchPlan:
    if q.groups.pipe:
        return pipelined_backward_plan(q)
    p = register_plan(q, *backward_geometry(q.H, vec_of(q.dtype)), q.groups.groups,
                      K_BWD_REGISTER, K_BWD_STREAM)
    return p._replace(glog=q.groups.glog, groups=q.groups.groups)


def launch_plan(q: PlanQuery) -> LaunchPlan:
    """The launch of ``q`` (``launch_plan``)."""
    return backward_launch_plan(q) if q.backward else forward_launch_plan(q)


def persistent_grid(p: LaunchPlan, per_sm: int, sms: int) -> int:
    """Blocks of a persistent plan: a team for every unit, at most the resident blocks."""
    per_block = p.block_x >> p.team_log
    return grid_for(min((p.units + per_block - 1) // per_block, per_sm * sms), 1)
