"""Python face of the normspec torch extension: validation, fake kernels, autograd."""

from __future__ import annotations

import torch

from normspec.progress import announced_if_slow
from normspec.spec.validation import (
    ACTIVATIONS,
    GATED_CONVENTIONS,
    RESIDUAL_SUMS,
    check_choice,
    check_eps,
    check_input,
    check_like,
    check_offset,
    check_rstd,
    check_weight,
)

from . import _build

__all__ = ["fused_add_rms_norm", "rms_norm", "rms_norm_gated"]

_registered = False


def _ensure() -> None:
    """Build/load the extension on first use (a no-op afterwards); said only when it takes
    a while (a build, not a load from the cache)."""
    if not _build.loaded():
        announced_if_slow(
            lambda: _build.build(verbose=False),
            f"normspec: building the torch extension in {_build.build_directory()} "
            "(first use; cached afterwards) ...",
            lambda _path, seconds: f"normspec: torch extension ready after {seconds:.0f} s")


def _wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record this call: then the ``*_with_rstd`` forward runs,
    so that the backward reads the forward's rstd instead of recomputing it."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ---- public operators ---------------------------------------------------------
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm, bitwise equal to [`normspec.spec.rms_norm`][normspec.spec.rms_norm.rms_norm].

    Differentiable (the spec's declared backward), usable under ``torch.compile``
    and CUDA graphs.
    """
    check_input("x", x)
    check_weight(weight, x)
    eps = check_eps(eps)
    offset = check_offset(offset)
    _ensure()
    if _wants_grad(x, weight):
        return torch.ops.normspec.rms_norm_with_rstd(x, weight, eps, offset)[0]
    return torch.ops.normspec.rms_norm(x, weight, eps, offset)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    offset: float = 0.0,
    residual_sum: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm, bitwise equal to
    [`normspec.spec.fused_add_rms_norm`][normspec.spec.fused_add.fused_add_rms_norm].

    Returns ``(y, new_residual)``.
    """
    check_input("x", x)
    check_like("residual", residual, x)
    check_weight(weight, x)
    eps = check_eps(eps)
    offset = check_offset(offset)
    residual_sum = check_choice("residual_sum", residual_sum, RESIDUAL_SUMS)
    _ensure()
    if _wants_grad(x, residual, weight):
        y, new_residual, _ = torch.ops.normspec.fused_add_rms_norm_with_rstd(
            x, residual, weight, eps, offset, residual_sum
        )
        return y, new_residual
    return torch.ops.normspec.fused_add_rms_norm(x, residual, weight, eps, offset, residual_sum)


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    convention: str = "vllm",
    activation: str = "silu",
) -> torch.Tensor:
    """Gated RMSNorm, bitwise equal to
    [`normspec.spec.rms_norm_gated`][normspec.spec.gated.rms_norm_gated].
    """
    check_input("x", x)
    check_like("gate", gate, x)
    check_weight(weight, x)
    eps = check_eps(eps)
    convention = check_choice("convention", convention, GATED_CONVENTIONS)
    activation = check_choice("activation", activation, ACTIVATIONS)
    _ensure()
    if _wants_grad(x, gate, weight):
        return torch.ops.normspec.rms_norm_gated_with_rstd(
            x, gate, weight, eps, convention, activation
        )[0]
    return torch.ops.normspec.rms_norm_gated(x, gate, weight, eps, convention, activation)


# ---- fake (meta) kernels: the real kernels' checks, then contiguous outputs ---------
# A call whose tensors include a meta tensor reaches these instead of the C++ kernels, so
# they check what those check: devices, shapes, dtypes, eps/offset and the strings.
def _rows_like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _rstd_like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


def _check_norm(x, weight, eps, offset=0.0, **likes):
    check_input("x", x)
    for name, t in likes.items():
        if t is not None:
            check_like(name, t, x)
    check_weight(weight, x)
    check_eps(eps)
    check_offset(offset)


def _check_rstd(rstd, x):
    if rstd is not None:
        check_rstd(rstd, x)


def _fake_rms_norm(x, weight, eps, offset):
    _check_norm(x, weight, eps, offset)
    return _rows_like(x)


def _fake_rms_norm_with_rstd(x, weight, eps, offset):
    _check_norm(x, weight, eps, offset)
    return _rows_like(x), _rstd_like(x)


def _fake_rms_norm_backward(dy, x, weight, eps, offset, rstd=None):
    _check_norm(x, weight, eps, offset, dy=dy)
    _check_rstd(rstd, x)
    return _rows_like(x), weight.new_empty(weight.shape)


def _check_fused(x, residual, weight, eps, offset, residual_sum, **likes):
    _check_norm(x, weight, eps, offset, residual=residual, **likes)
    check_choice("residual_sum", residual_sum, RESIDUAL_SUMS)


def _fake_fused(x, residual, weight, eps, offset, residual_sum):
    _check_fused(x, residual, weight, eps, offset, residual_sum)
    return _rows_like(x), _rows_like(x)


def _fake_fused_with_rstd(x, residual, weight, eps, offset, residual_sum):
    _check_fused(x, residual, weight, eps, offset, residual_sum)
    return _rows_like(x), _rows_like(x), _rstd_like(x)


def _fake_fused_backward(dy, dresidual_out, x, residual, weight, eps, offset, residual_sum,
                         rstd=None):
    _check_fused(x, residual, weight, eps, offset, residual_sum, dy=dy,
                 dresidual_out=dresidual_out)
    _check_rstd(rstd, x)
    return _rows_like(x), _rows_like(x), weight.new_empty(weight.shape)


def _fake_fused_backward_from_sum(dy, dresidual_out, s, weight, eps, offset, residual_sum,
                                  rstd=None):
    _check_norm(s, weight, eps, offset, dy=dy, dresidual_out=dresidual_out)
    check_choice("residual_sum", residual_sum, RESIDUAL_SUMS)
    _check_rstd(rstd, s)
    return _rows_like(s), weight.new_empty(weight.shape)


def _check_gated(x, gate, weight, eps, convention, activation, **likes):
    _check_norm(x, weight, eps, gate=gate, **likes)
    check_choice("convention", convention, GATED_CONVENTIONS)
    check_choice("activation", activation, ACTIVATIONS)


def _fake_gated(x, gate, weight, eps, convention, activation):
    _check_gated(x, gate, weight, eps, convention, activation)
    return _rows_like(x)


def _fake_gated_with_rstd(x, gate, weight, eps, convention, activation):
    _check_gated(x, gate, weight, eps, convention, activation)
    return _rows_like(x), _rstd_like(x)


def _fake_gated_backward(dy, x, gate, weight, eps, convention, activation, rstd=None):
    _check_gated(x, gate, weight, eps, convention, activation, dy=dy)
    _check_rstd(rstd, x)
    return _rows_like(x), _rows_like(x), weight.new_empty(weight.shape)


# ---- autograd: the spec's declared backward through the backward operators ------
# The plain forwards save their inputs and the backward recomputes rstd; the
# *_with_rstd forwards also save rstd (fp32, one value per row, the spec's bits),
# which the backward operators then read instead. rstd itself gets no gradient.
def _grad(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def _saved_rstd(ctx, output) -> torch.Tensor | None:
    """rstd, the last output of a ``*_with_rstd`` forward (None for the plain forwards)."""
    if not ctx.with_rstd:
        return None
    rstd = output[-1]
    ctx.mark_non_differentiable(rstd)
    return rstd


def _setup_rms(ctx, inputs, output, with_rstd=False):
    x, weight, eps, offset = inputs
    ctx.with_rstd = with_rstd
    ctx.set_materialize_grads(False)  # no zeros kernel for the unused rstd gradient
    ctx.save_for_backward(x, weight, _saved_rstd(ctx, output))
    ctx.eps, ctx.offset = eps, offset


def _backward_rms(ctx, dy, _drstd=None):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.normspec.rms_norm_backward(
        _grad(dy, x), x, weight, ctx.eps, ctx.offset, rstd
    )
    return dx, dweight, None, None


def _norm_reads_new_residual(x: torch.Tensor, residual_sum: str) -> bool:
    """Whether the forward's new residual is the very sum its norm read: the "rounded"
    convention, or float32 rows (where both conventions coincide)."""
    return residual_sum == "rounded" or x.dtype == torch.float32


def _setup_fused(ctx, inputs, output, with_rstd=False):
    x, residual, weight, eps, offset, residual_sum = inputs
    ctx.with_rstd = with_rstd
    ctx.set_materialize_grads(False)  # no zeros kernel for the unused rstd gradient
    ctx.from_sum = _norm_reads_new_residual(x, residual_sum)
    rstd = _saved_rstd(ctx, output)
    if ctx.from_sum:
        # one saved row tensor instead of two, and a backward that reads one instead of
        # two and writes ds once (dx and dresidual are the same bits by the spec)
        ctx.save_for_backward(output[1], weight, rstd)
    else:
        ctx.save_for_backward(x, residual, weight, rstd)
    ctx.eps, ctx.offset, ctx.residual_sum = eps, offset, residual_sum


def _backward_fused(ctx, dy, dresidual_out, _drstd=None):
    if ctx.from_sum:
        s, weight, rstd = ctx.saved_tensors
        ds, dweight = torch.ops.normspec.fused_add_rms_norm_backward_from_sum(
            _grad(dy, s), _grad(dresidual_out, s), s, weight,
            ctx.eps, ctx.offset, ctx.residual_sum, rstd,
        )
        return ds, ds, dweight, None, None, None
    x, residual, weight, rstd = ctx.saved_tensors
    dx, dresidual, dweight = torch.ops.normspec.fused_add_rms_norm_backward(
        _grad(dy, x), _grad(dresidual_out, x), x, residual, weight,
        ctx.eps, ctx.offset, ctx.residual_sum, rstd,
    )
    return dx, dresidual, dweight, None, None, None


def _setup_gated(ctx, inputs, output, with_rstd=False):
    x, gate, weight, eps, convention, activation = inputs
    ctx.with_rstd = with_rstd
    ctx.set_materialize_grads(False)  # no zeros kernel for the unused rstd gradient
    ctx.save_for_backward(x, gate, weight, _saved_rstd(ctx, output))
    ctx.eps, ctx.convention, ctx.activation = eps, convention, activation


def _backward_gated(ctx, dy, _drstd=None):
    x, gate, weight, rstd = ctx.saved_tensors
    dx, dgate, dweight = torch.ops.normspec.rms_norm_gated_backward(
        _grad(dy, x), x, gate, weight, ctx.eps, ctx.convention, ctx.activation, rstd
    )
    return dx, dgate, dweight, None, None, None


def _no_double_backward(op: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"normspec torch_ext: {op} has no double backward (a gradient of its gradient, "
            "as create_graph=True asks for); the spec declares first derivatives only")

    return backward


def _with_rstd(setup):
    def setup_with_rstd(ctx, inputs, output):
        setup(ctx, inputs, output, with_rstd=True)

    return setup_with_rstd


def _register_python_parts() -> None:
    """Fake kernels and autograd for the loaded operators (once per process)."""
    global _registered
    if _registered:
        return
    lib = torch.library
    lib.register_fake("normspec::rms_norm", _fake_rms_norm)
    lib.register_fake("normspec::rms_norm_backward", _fake_rms_norm_backward)
    lib.register_fake("normspec::fused_add_rms_norm", _fake_fused)
    lib.register_fake("normspec::fused_add_rms_norm_backward", _fake_fused_backward)
    lib.register_fake(
        "normspec::fused_add_rms_norm_backward_from_sum", _fake_fused_backward_from_sum
    )
    lib.register_fake("normspec::rms_norm_gated", _fake_gated)
    lib.register_fake("normspec::rms_norm_gated_backward", _fake_gated_backward)
    lib.register_fake("normspec::rms_norm_with_rstd", _fake_rms_norm_with_rstd)
    lib.register_fake("normspec::fused_add_rms_norm_with_rstd", _fake_fused_with_rstd)
    lib.register_fake("normspec::rms_norm_gated_with_rstd", _fake_gated_with_rstd)
    lib.register_autograd("normspec::rms_norm", _backward_rms, setup_context=_setup_rms)
    lib.register_autograd(
        "normspec::fused_add_rms_norm", _backward_fused, setup_context=_setup_fused
    )
    lib.register_autograd("normspec::rms_norm_gated", _backward_gated, setup_context=_setup_gated)
    lib.register_autograd(
        "normspec::rms_norm_with_rstd", _backward_rms, setup_context=_with_rstd(_setup_rms)
    )
    lib.register_autograd(
        "normspec::fused_add_rms_norm_with_rstd", _backward_fused,
        setup_context=_with_rstd(_setup_fused),
    )
    lib.register_autograd(
        "normspec::rms_norm_gated_with_rstd", _backward_gated,
        setup_context=_with_rstd(_setup_gated),
    )
    for op in ("rms_norm_backward", "fused_add_rms_norm_backward",
               "fused_add_rms_norm_backward_from_sum", "rms_norm_gated_backward"):
        lib.register_autograd(f"normspec::{op}", _no_double_backward(op))
    _registered = True


_build.AFTER_LOAD.append(_register_python_parts)
