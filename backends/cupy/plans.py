"""Launch plans: what one call launches, decided once per shape and kept per device.

A call's launches depend on its shape, dtypes, flags, alignment and row strides, not on
its pointers: the choices of ``launches`` (with the device's SM count, opt-in shared
memory and occupancy) are kept per such key in the device's ``DeviceState``, so that a
repeated shape costs a dictionary lookup instead of the planners (most of a small call's
host time).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import device
from .codes import CUDA_TYPES, DT_F32, F_ALIGNED, F_HF, F_SIGMOID, F_W_IS_INPUT
from .geometry import (
    COL_TREE_LAST_MAX,
    backward_plan,
    col_tree_last_launch,
    col_tree_launch,
    grid_for,
    persistent_grid,
    wants_gate_table,
)
from .launches import (
    backward_launch,
    forward_launch,
    gated_row_table_launch,
    pipe_backward_launch,
    pipe_forward_launch,
    quad_forward_launch,
    row_forward_launch,
)

#: the flags a plan depends on (the others only travel to the kernels)
_PLAN_FLAGS = F_ALIGNED | F_HF | F_SIGMOID | F_W_IS_INPUT


class FwdPlan(NamedTuple):
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


def plan_forward(cp: Any, dev: int, op: int, dt: int, rows: int, hidden: int, flags: int,
                  as_is: bool, gtab: bool) -> FwdPlan:
    """The forward's launch (kept per key): `flags` the call's (F_ALIGNED: every row and
    the weight it reads allow 16-byte vectors), `as_is` whether the weight may be read in
    the input dtype, `gtab` whether the global gate table may be had (not in a capture
    before its first fill)."""
    key = ("fwd", op, dt, rows, hidden, flags & _PLAN_FLAGS, as_is, gtab)
    st = device.state(dev)
    plan = st.plans.get(key)
    if plan is not None:
        return plan
    if flags & F_ALIGNED:
        # forward_t: the global gate table's forms, else the one-row forward where no
        # gate table is wanted, else the persistent forward (its per-block table)
        sm_count = st.sm_count(cp)
        row = None
        if gtab:
            row = gated_row_table_launch(op, dt, rows, hidden, sm_count,
                                         hf=bool(flags & F_HF),
                                         w_is_input=bool(flags & F_W_IS_INPUT), w_raw=as_is)
            if row is not None:
                name, grid, block, team_log = row
                return st.keep_plan(key, FwdPlan("gt", st.kernel(op, dt, name), grid, block,
                                                team_log=team_log))
        if not wants_gate_table(op, dt, rows, hidden):
            quad = quad_forward_launch(op, dt, rows, hidden, sm_count, as_is)
            if quad is not None:
                name, grid, block = quad
                return st.keep_plan(key, FwdPlan("quad", st.kernel(op, dt, name), grid,
                                                block))
            row = row_forward_launch(op, dt, rows, hidden, sm_count)
        if row is not None:
            name, grid, block, team_log = row
            return st.keep_plan(key, FwdPlan("row", st.kernel(op, dt, name), grid, block,
                                            team_log=team_log))
        optin = st.smem_optin(cp)
        pipe = pipe_forward_launch(op, dt, rows, hidden, optin)
        if pipe is not None:
            fn = st.kernel(op, dt, pipe.name)
            per_sm = st.prepare_pipe_kernel(fn, (op, dt, pipe.name, pipe.smem), pipe.block,
                                          pipe.smem, optin)
            grid = (persistent_grid(rows, pipe.team_log, per_sm, sm_count), 1, 1)
            return st.keep_plan(key, FwdPlan("pipe", fn, grid, (pipe.block, 1, 1), pipe.smem,
                                            pipe.team_log, pipe.table))
    name, grid, block = forward_launch(op, dt, rows, hidden)
    return st.keep_plan(key, FwdPlan("reg", st.kernel(op, dt, name), grid, block))


class TreePlan(NamedTuple):
    """dweight from a backward's fp32 workspace rows (``_fold_dweight``): the tree levels
    of 16 rows ``(rows out, clog, grid)`` while more than ``COL_TREE_LAST_MAX`` are left,
    then ``last``, the one launch for the rest and the cast to the weight's dtype
    ``(kernel, clog1, slog, grid)``, ``None`` where one fp32 row is left of an fp32
    weight (already its dweight)."""

    tree_fn: Any
    levels: tuple[tuple[int, int, tuple[int, int, int]], ...]
    last: tuple[Any, int, int, tuple[int, int, int]] | None


def plan_tree(dev: int, op: int, dt: int, wdt: int, groups: int, hidden: int) -> TreePlan:
    st = device.state(dev)
    levels = []
    g = groups
    while g > COL_TREE_LAST_MAX:
        level = col_tree_launch(g, hidden)
        levels.append(level)
        g = level[0]
    last = None
    if tree_follows(g, wdt):
        clog1, slog, lgrid = col_tree_last_launch(g, hidden)
        last = (st.kernel(op, dt, f"normspec_col_tree_last_kernel<{CUDA_TYPES[wdt]}>"),
                clog1, slog, lgrid)
    tree_fn = st.kernel(op, dt, "normspec_col_tree_kernel") if levels else None
    return TreePlan(tree_fn, tuple(levels), last)


class BwdPlan(NamedTuple):
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
    tree: TreePlan | None


def plan_backward(cp: Any, dev: int, op: int, dt: int, wdt: int, rows: int, hidden: int,
                   flags: int, strides: tuple[int, ...], saved: bool) -> BwdPlan:
    """The backward's launches (kept per key): `flags` the call's (F_ALIGNED: every row
    and the weight it reads allow 16-byte vectors), `strides` the rows' ``(sx, sr, sdy,
    sdres, sy, sy2)``, `saved` whether the forward's rstd is read."""
    key = ("bwd", op, dt, wdt, rows, hidden, flags & _PLAN_FLAGS, strides, saved)
    st = device.state(dev)
    plan = st.plans.get(key)
    if plan is not None:
        return plan
    sms = st.sm_count(cp)
    pipe = None
    if flags & F_ALIGNED:
        optin = st.smem_optin(cp)
        pipe = pipe_backward_launch(op, dt, rows, hidden, sms, optin, strides, saved=saved,
                                    hf=bool(flags & F_HF),
                                    w_is_input=bool(flags & F_W_IS_INPUT))
    if pipe is not None:
        name, glog, groups, table, (block, smem, team_log) = pipe
        fn = st.kernel(op, dt, name)
        if pipe.kind == "row":  # a team per row: no persistent grid, no stacks
            grid = (grid_for(rows, block >> team_log), 1, 1)
        else:  # the persistent kernels: their resident blocks per SM
            per_sm = st.prepare_pipe_kernel(fn, (op, dt, name, smem), block, smem, optin)
            grid = (persistent_grid(groups, team_log, per_sm, sms), 1, 1)
        final = groups == 1 and dt != DT_F32 and wdt == dt
        tree = None if final else plan_tree(dev, op, dt, wdt, groups, hidden)
        return st.keep_plan(key, BwdPlan(pipe.kind, fn, grid, (block, 1, 1), smem, team_log,
                                        glog, groups, table, False, final, tree))
    glog, groups = backward_plan(dt, rows, hidden, sms)
    name, grid, block3, takes_glog = backward_launch(op, dt, rows, hidden, groups)
    return st.keep_plan(key, BwdPlan("reg", st.kernel(op, dt, name), grid, block3, 0, 0,
                                    glog, groups, False, takes_glog, False,
                                    plan_tree(dev, op, dt, wdt, groups, hidden)))


def tree_follows(groups: int, weight_dtype_code: int) -> bool:
    """Whether tree kernels follow a backward of ``groups`` dweight groups (not when its
    one fp32 row is an fp32 weight's dweight)."""
    return not (groups == 1 and weight_dtype_code == DT_F32)
