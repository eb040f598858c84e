"""One call's launches: the forward, the backward and the dweight tree, on checked inputs.

``forward`` and ``backward`` build the kernels' arguments (``Args``, the C++
``normspec::LaunchArgs``: pointers, strides in elements, eps, offset, flags), take the
call's plan (``plans``) and launch it (``driver``); the dweight tree folds the backward's
fp32 workspace rows. Every kernel gives the spec's bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from . import arrays, device, driver
from .arrays import CupySide, TorchSide, dtype_code, numel, ptr
from .codes import (
    DT_F32,
    F_ALIGNED,
    F_DW_FINAL,
    F_GATE_TABLE,
    F_HF,
    F_LET_DEPENDENTS,
    F_OFFSET,
    F_ROUNDED,
    F_SIGMOID,
    F_W_IS_INPUT,
    F_W_RAW,
    OP_FUSED,
    OP_FUSED_SUM,
    OP_GATED,
    OP_RMS,
)
from .driver import BWD_CODES, FWD_CODES, QUAD_CODES, KernelArgs, f32_arg
from .plans import TreePlan, plan_backward, plan_forward, tree_follows


class Args(NamedTuple):
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


def with_alignment(a: Args, esize: int) -> Args:
    """Set ``F_ALIGNED`` when every row pointer allows 16-byte vector access
    (``set_alignment`` of normspec_launch_impl.cuh)."""
    # one test of the pointers' and the present rows' strides' low bits together (each
    # call runs it; the strides are not negative, ``collapsible_stride``)
    pointers = a.x | a.r | a.dy | a.dres | a.y | a.y2 | a.w
    strides = ((a.sx if a.x else 0) | (a.sr if a.r else 0) | (a.sdy if a.dy else 0)
               | (a.sdres if a.dres else 0) | (a.sy if a.y else 0) | (a.sy2 if a.y2 else 0))
    ok = pointers % 16 == 0 and (strides * esize) % 16 == 0
    return with_flags(a, a.flags | F_ALIGNED) if ok else a


_new_tuple = tuple.__new__


def with_flags(a: Args, flags: int) -> Args:
    """``a`` with ``flags`` (its last field), in a third of ``_replace``'s time."""
    return _new_tuple(Args, (*a[:-1], flags))


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


def _pack(a: Args, ptrs: tuple[int, ...], longs: tuple[int, ...]) -> tuple:
    """The values of the arguments most kernels start with: pointers (``Q``), int64 rows
    and strides (``q``), then eps, offset (``f``) and the flags (``i``)."""
    return (*ptrs, *longs, f32_arg(a.eps), f32_arg(a.offset), a.flags)


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
    return weight if ptr(weight) % 16 == 0 else None


def _with_weight(side: TorchSide | CupySide, a: Args, weight: Any, dt: int,
                 as_is: Any | None, keep: list) -> Args:
    """``a`` with the weight the launch reads: ``as_is`` (read in the input dtype,
    ``F_W_RAW``) or an fp32 copy, the alignment flag then set again for its pointer."""
    if as_is is not None:
        keep.append(as_is)
        return with_weight_ptr(a, ptr(as_is), a.flags | F_W_RAW)
    w32 = side.weight_f32(weight, dt)
    keep.append(w32)
    esize = 4 if dt == DT_F32 else 2
    return with_alignment(with_weight_ptr(a, ptr(w32), a.flags & ~F_ALIGNED), esize)


_W_FIELD = Args._fields.index("w")


def with_weight_ptr(a: Args, w: int, flags: int) -> Args:
    """``a`` with the weight pointer ``w`` and ``flags`` (``with_flags``' way)."""
    return _new_tuple(Args, (*a[:_W_FIELD], w, *a[_W_FIELD + 1:-1], flags))


def forward(kind: str, op: int, rows: Sequence[Any], weight: Any, eps: float,
             params: Mapping[str, Any], *, keep_rstd: bool = False) -> tuple[Any, ...]:
    """The forward kernel on validated inputs; returns the outputs (input's kind) and,
    with ``keep_rstd``, last, each row's rstd (fp32, ``x.shape[:-1]``) as the kernels
    write it for the backward to read."""
    x = rows[0]
    n_out = 2 if op == OP_FUSED else 1
    side = arrays.side(kind, x)
    offset = float(params.get("offset", 0.0)) if op != OP_GATED else 0.0
    with side.context():
        outs = [side.empty_rows(x) for _ in range(n_out)]
        rstd = side.empty_f32(tuple(x.shape[:-1])) if keep_rstd else None
        results = (*(o for o, _ in outs), *((rstd[0],) if rstd is not None else ()))
        if numel(x) == 0:
            return results
        cp = side.cp
        dt = dtype_code(kind, x)
        xv, sx = side.rows(x)
        hidden = int(x.shape[-1])
        nrows = numel(x) // hidden
        r, sr = (0, 0)
        keep = [xv]
        if op != OP_RMS:
            rv, sr = side.rows(rows[1])
            keep.append(rv)
            r = ptr(rv)
        a = Args(x=ptr(xv), r=r, y=ptr(outs[0][1]),
                  y2=ptr(outs[1][1]) if op == OP_FUSED else 0,
                  rows=nrows, H=hidden, sx=sx, sr=sr, sy=hidden,
                  sy2=hidden if op == OP_FUSED else 0,
                  eps=eps, offset=offset, flags=_base_flags(op, x, weight, offset, params))
        a = with_alignment(a, 4 if dt == DT_F32 else 2)  # the rows' (the weight's below)
        as_is = _weight_as_is(weight, x, dt) if a.flags & F_ALIGNED else None
        plan = plan_forward(cp, side.dev, op, dt, nrows, hidden, a.flags, as_is is not None,
                             True)
        gtab = None
        if plan.form == "gt":
            gtab = device.state(side.dev).global_gate_table(cp, bool(a.flags & F_SIGMOID))
            if gtab is None:  # a capture before the table's first fill
                plan = plan_forward(cp, side.dev, op, dt, nrows, hidden, a.flags,
                                     as_is is not None, False)
        # the one-row and persistent kernels read a 16-bit weight as it is; the register
        # kernels fp32
        a = _with_weight(side, a, weight, dt, as_is if plan.form != "reg" else None, keep)
        if plan.form != "reg" and not a.flags & F_ALIGNED:  # an fp32 weight off 16 bytes
            plan = plan_forward(cp, side.dev, op, dt, nrows, hidden, a.flags, False, False)
        rstd_ptr = ptr(rstd[1]) if rstd is not None else 0
        if plan.table:
            a = with_flags(a, a.flags | F_GATE_TABLE)
        args = _pack(a, (a.x, a.r, a.w, a.y, a.y2), (a.rows, a.H, a.sx, a.sr, a.sy, a.sy2))
        if plan.form == "pipe":
            driver.launch(plan.fn, plan.grid, plan.block,
                    KernelArgs(FWD_CODES + "iQ", (*args, plan.team_log, rstd_ptr)), plan.smem)
        elif plan.form == "reg":
            driver.launch(plan.fn, plan.grid, plan.block,
                          KernelArgs(FWD_CODES + "Q", (*args, rstd_ptr)))
        elif plan.form == "quad":
            # the pointers, the rows as int32, four strides (no H), eps, offset, flags, rstd
            driver.launch(plan.fn, plan.grid, plan.block,
                    KernelArgs(QUAD_CODES, (*args[:5], a.rows, *args[7:], rstd_ptr)))
        else:
            # the one-row kernel also takes the team size (log2), then rstd_out and the
            # global gate table of the GT forms (else none)
            driver.launch(plan.fn, plan.grid, plan.block,
                    KernelArgs(FWD_CODES + "iQQ", (*args, plan.team_log, rstd_ptr, gtab or 0)))
        del keep
        return results


def backward(kind: str, op: int, grads: Sequence[Any], rows: Sequence[Any], weight: Any,
              eps: float, params: Mapping[str, Any], *, rstd: Any | None = None
              ) -> tuple[Any, ...]:
    """The backward kernels and the dweight row tree; returns ``(*row grads, dweight)``.
    ``rstd``: the forward's (``forward(..., keep_rstd=True)``), which the pipelined
    kernels then read instead of recomputing it. ``OP_FUSED_SUM``: ``rows`` is the sum
    s alone, ``grads`` (dy, dresidual_out), one row gradient ds."""
    x = rows[0]
    n_rowgrads = 2 if op in (OP_FUSED, OP_GATED) else 1
    side = arrays.side(kind, x)
    offset = float(params.get("offset", 0.0)) if op != OP_GATED else 0.0
    with side.context():
        outs = [side.empty_rows(x) for _ in range(n_rowgrads)]
        if numel(x) == 0:
            return (*(o for o, _ in outs), side.zeros_like(weight))
        cp = side.cp
        dt = dtype_code(kind, x)
        esize = 4 if dt == DT_F32 else 2
        hidden = int(x.shape[-1])
        nrows = numel(x) // hidden
        xv, sx = side.rows(x)
        dyv, sdy = side.rows(grads[0])
        keep = [xv, dyv]
        r = sr = dres = sdres = 0
        if op in (OP_FUSED, OP_GATED):
            rv, sr = side.rows(rows[1])
            keep.append(rv)
            r = ptr(rv)
        if op in (OP_FUSED, OP_FUSED_SUM):
            drv, sdres = side.rows(grads[1])
            keep.append(drv)
            dres = ptr(drv)
        a = Args(x=ptr(xv), r=r, dy=ptr(dyv), dres=dres, y=ptr(outs[0][1]),
                  y2=ptr(outs[1][1]) if n_rowgrads == 2 else 0,
                  rows=nrows, H=hidden, sx=sx, sr=sr, sdy=sdy, sdres=sdres, sy=hidden,
                  sy2=hidden if n_rowgrads == 2 else 0,
                  eps=eps, offset=offset, flags=_base_flags(op, x, weight, offset, params))
        a = with_alignment(a, esize)  # the rows' (the weight's below)
        reads_rstd = rstd is not None
        as_is = _weight_as_is(weight, x, dt) if a.flags & F_ALIGNED else None
        wdt = dtype_code(kind, weight)
        strides = (a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2)
        plan = plan_backward(cp, side.dev, op, dt, wdt, nrows, hidden, a.flags, strides,
                              reads_rstd)
        # the pipelined family reads a 16-bit weight as it is; the register kernels fp32
        a = _with_weight(side, a, weight, dt, as_is if plan.form != "reg" else None, keep)
        if plan.form != "reg" and not a.flags & F_ALIGNED:  # an fp32 weight off 16 bytes
            plan = plan_backward(cp, side.dev, op, dt, wdt, nrows, hidden, a.flags, strides,
                                  reads_rstd)
        rstd_ptr = ptr(rstd) if reads_rstd else 0
        chained = False  # the dweight tree's launches chained after the backward kernel
        groups = plan.groups
        if plan.final:  # one group: the kernel stores dweight itself in the weight's dtype
            dweight, wsv = side.empty_rows(weight)
            a = with_flags(a, a.flags | F_DW_FINAL)
        else:
            ws, wsv = side.empty_f32((groups, hidden))
            a, chained = _chain_the_tree(a, groups, wdt, cp, side.dev)
        if plan.form == "row":  # a team per row
            args = _pack(a, (a.x, a.w, a.dy, a.y, ptr(wsv)), (a.rows, a.sx, a.sdy, a.sy))
            driver.launch(plan.fn, plan.grid, plan.block,
                    KernelArgs("QQQQQqqqqffiQ", (*args, rstd_ptr)))
        elif plan.form == "pair":  # 32-bit rows and strides, the saved rstd, no eps
            driver.launch(plan.fn, plan.grid, plan.block, KernelArgs(
                "QQQQQQQiiiiiifiiiQ",
                (a.x, a.r, a.w, a.dy, a.y, a.y2, ptr(wsv), a.rows, a.sx, a.sr, a.sdy, a.sy,
                 a.sy2, f32_arg(a.offset), a.flags, plan.glog, groups, rstd_ptr)), plan.smem)
        else:  # the pipelined backward (persistent teams, dweight stacks in shared
            # memory) or the register kernels
            if plan.table:
                a = with_flags(a, a.flags | F_GATE_TABLE)
            args = _pack(a, (a.x, a.r, a.w, a.dy, a.dres, a.y, a.y2, ptr(wsv)),
                         (a.rows, a.H, a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2))
            if plan.form == "pipe":
                args = KernelArgs(BWD_CODES + "iiQ", (*args, plan.team_log, plan.glog, rstd_ptr))
            elif plan.takes_glog:
                args = KernelArgs(BWD_CODES + "i", (*args, plan.glog))
            else:
                args = KernelArgs(BWD_CODES, args)
            driver.launch(plan.fn, plan.grid, plan.block, args, plan.smem)
        if not plan.final:
            dweight = _fold_dweight(side, plan.tree, ws, wsv, hidden, weight, chained=chained)
        del keep
        return (*(o for o, _ in outs), dweight)


def _chain_the_tree(a: Args, groups: int, weight_dtype_code: int, cp: Any, dev: int
                    ) -> tuple[Args, bool]:
    """``(a, chained)``: where tree kernels follow and ``chained_launches`` allows it, the
    backward kernel's arguments with F_LET_DEPENDENTS and ``True`` (the tree's launches
    are then chained after it); else ``a`` as it is and ``False``."""
    if tree_follows(groups, weight_dtype_code) and device.chained_launches(cp, dev):
        return with_flags(a, a.flags | F_LET_DEPENDENTS), True
    return a, False


def _fold_dweight(side: TorchSide | CupySide, tree: TreePlan, ws: Any, wsv: Any,
                  hidden: int, weight: Any, *, chained: bool = False) -> Any:
    """dweight from the backward's fp32 workspace rows ``ws`` (``wsv`` the view the
    kernels read) by ``tree`` (``plan_tree``). ``chained``: each launch a programmatic
    dependent one (the backward kernel had F_LET_DEPENDENTS)."""
    g = ws.shape[0]
    for gout, clog, tgrid in tree.levels:
        out, outv = side.empty_f32((gout, hidden))
        driver.launch(tree.tree_fn, tgrid, (256, 1, 1),
                KernelArgs("QQqqi", (ptr(wsv), ptr(outv), g, hidden, clog)), chained=chained)
        ws, wsv, g = out, outv, gout
    if tree.last is None:  # one fp32 row already is an fp32 weight's dweight
        return ws.reshape(hidden)
    dweight, dwv = side.empty_rows(weight)
    last, clog1, slog, lgrid = tree.last
    driver.launch(last, lgrid, (16, 16, 1),
            KernelArgs("QQqqii", (ptr(wsv), ptr(dwv), g, hidden, clog1, slog)),
            chained=chained)
    return dweight
