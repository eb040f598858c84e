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
    backward_plan_aligned,
    col_tree_last_launch,
    col_tree_launch,
    offsets_fit_32,
)
from .launches import kernel_name
from .planner import (
    K_BWD_PAIR,
    K_BWD_PIPE,
    K_BWD_REGISTER,
    K_BWD_ROW,
    K_FWD_PIPE,
    K_FWD_QUAD,
    K_FWD_ROW,
    LaunchPlan,
    PlanQuery,
    launch_plan,
    persistent_grid,
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
    sms, optin = st.sm_count(cp), st.smem_optin(cp)
    p = launch_plan(PlanQuery(op, dt, False, rows, hidden, aligned=bool(flags & F_ALIGNED),
                              w_raw=as_is, hf=bool(flags & F_HF),
                              w_is_input=bool(flags & F_W_IS_INPUT), global_table=gtab,
                              sms=sms, smem_optin=optin))
    fn, grid = _kernel_and_grid(st, op, dt, p, sms, optin)
    form = {K_FWD_ROW: "gt" if p.gt_form else "row", K_FWD_QUAD: "quad",
            K_FWD_PIPE: "pipe"}.get(p.kernel, "reg")
    return st.keep_plan(key, FwdPlan(form, fn, grid, (p.block_x, p.block_y, 1), p.smem,
                                     p.team_log, p.table))


def _kernel_and_grid(st: Any, op: int, dt: int, p: LaunchPlan, sms: int, optin: int
                     ) -> tuple[Any, tuple[int, int, int]]:
    """The plan's kernel, loaded, and its grid: a persistent plan's after the kernel's
    occupancy query (``persistent_grid``)."""
    name = kernel_name(op, dt, p)
    fn = st.kernel(op, dt, name)
    if not p.persistent:
        return fn, (p.grid, 1, 1)
    per_sm = st.prepare_pipe_kernel(fn, (op, dt, name, p.smem), p.block_x, p.smem, optin)
    return fn, (persistent_grid(p, per_sm, sms), 1, 1)


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
    sms, optin = st.sm_count(cp), st.smem_optin(cp)
    aligned = bool(flags & F_ALIGNED)
    groups = backward_plan_aligned(dt, rows, hidden, aligned, sms, optin)
    p = launch_plan(PlanQuery(op, dt, True, rows, hidden, aligned=aligned,
                              hf=bool(flags & F_HF), w_is_input=bool(flags & F_W_IS_INPUT),
                              saved_rstd=saved,
                              offsets_fit_32=offsets_fit_32(rows, hidden, strides), sms=sms,
                              smem_optin=optin, groups=groups))
    fn, grid = _kernel_and_grid(st, op, dt, p, sms, optin)
    form = {K_BWD_ROW: "row", K_BWD_PAIR: "pair", K_BWD_PIPE: "pipe"}.get(p.kernel, "reg")
    final = bool(groups.pipe) and p.groups == 1 and dt != DT_F32 and wdt == dt
    tree = None if final else plan_tree(dev, op, dt, wdt, p.groups, hidden)
    return st.keep_plan(key, BwdPlan(form, fn, grid, (p.block_x, p.block_y, 1), p.smem,
                                     p.team_log, p.glog, p.groups, p.table,
                                     p.kernel == K_BWD_REGISTER, final, tree))


def tree_follows(groups: int, weight_dtype_code: int) -> bool:
    """Whether tree kernels follow a backward of ``groups`` dweight groups (not when its
    one fp32 row is an fp32 weight's dweight)."""
    return not (groups == 1 and weight_dtype_code == DT_F32)
