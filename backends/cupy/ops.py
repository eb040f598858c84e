"""The operators: argument checks, autograd for torch inputs, the public functions.

Each public function checks its arguments with ``normspec.spec.validation`` (arrays of
either kind, eps, offset and the choices) and runs ``run.forward``
or ``run.backward``; torch inputs that require grad go through ``_NormFunction``, whose
backward reads the rstd its forward kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from normspec.spec.validation import (
    ACTIVATIONS,
    GATED_CONVENTIONS,
    RESIDUAL_SUMS,
    check_choice,
    check_eps,
    check_like,
    check_offset,
    check_rstd,
)

from . import nvrtc
from .arrays import ARRAY_KINDS, check_torch_device, dtype_code, validate
from .codes import DT_F32, OP_CODES, OP_FUSED, OP_FUSED_SUM, OP_GATED, OP_RMS
from .run import backward, forward


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
        *outs, rstd = forward("torch", op, rows, weight, eps, params, keep_rstd=True)
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
            ds, dweight = backward("torch", OP_FUSED_SUM, grads, rows, weight, ctx.eps,
                                    ctx.params, rstd=rstd)
            return (None, None, None, dweight, ds, ds)
        *row_grads, dweight = backward("torch", ctx.op, grads, rows, weight, ctx.eps,
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
    kind = validate(rows, weight)
    eps = _check_params(eps, params)
    values = list(rows.values())
    if kind == "torch":
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in [*values, weight])
        if grad and with_rstd:
            name = _OP_NAMES[op]
            raise ValueError(
                f"{name}_with_rstd: builds no autograd graph, and an input requires grad; "
                f"call {name} (its autograd keeps rstd itself) or run under torch.no_grad()")
        check_torch_device(values[0])
        nvrtc.require_cupy()
        if grad:
            return _NormFunction.apply(op, eps, params, weight, *values)
    else:
        nvrtc.require_cupy()
    return forward(kind, op, values, weight, eps, params, keep_rstd=with_rstd)


def _run_backward(op: int, grads: Mapping[str, Any], rows: Mapping[str, Any], weight: Any,
                  eps: float, params: dict[str, Any], rstd: Any | None = None
                  ) -> tuple[Any, ...]:
    kind = validate(rows, weight)
    x = next(iter(rows.values()))
    for n, g in grads.items():
        check_like(n, g, x, kind=ARRAY_KINDS[kind])
    eps = _check_params(eps, params)
    if rstd is not None:
        check_rstd(rstd, x, ARRAY_KINDS[kind])
    if op == OP_FUSED_SUM and params["residual_sum"] != "rounded" and (
            dtype_code(kind, x) != DT_F32):
        raise ValueError(
            "residual_sum: the backward from the saved sum needs 'rounded' or float32 rows "
            f"(the norm of 'fp32' reads the unrounded sum), got 'fp32' with s of dtype "
            f"{_dtype_name(kind, x)}")
    if kind == "torch":
        check_torch_device(x)
    nvrtc.require_cupy()
    with torch.no_grad():
        return backward(kind, op, list(grads.values()), list(rows.values()), weight, eps,
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
