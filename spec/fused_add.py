r"""Fused residual add + RMSNorm, in both residual-rounding conventions.

$$
s = \begin{cases} R_{32}(x_{32} + r_{32}) & \text{residual\_sum = fp32} \\
R(x_{32} + r_{32}) & \text{residual\_sum = rounded} \end{cases}, \qquad
y = \mathrm{rms\_norm}(s), \qquad \text{new\_residual} = R(s)
$$

The decoder layer adds the sublayer output `x` to the running residual `r`
and normalises the sum. Upstream libraries disagree on *where the sum is
rounded*, and that single rounding makes trainer and rollout logprobs differ.
The spec names both conventions with `residual_sum`:

`"fp32"`
:   `s = x32 + r32` (one fp32 rounding); the norm reads the **unrounded**
    fp32 `s`; `new_residual = R(s)`.

`"rounded"`
:   `s = R(x32 + r32)`: the sum is formed in fp32 and rounded to the input
    dtype (this is what a framework's bf16/fp16 `x + r` computes); the norm
    reads that rounded `s`; `new_residual = s`.

The norm is then exactly [`rms_norm`][normspec.spec.rms_norm.rms_norm] on
the fp32 value of `s` (same tree, same `rstd`, same `offset` rule).

| convention | followed by (file) |
| --- | --- |
| `"fp32"` | vLLM 0.33 `vllm/ir/ops` `fused_add_rms_norm` and `RMSNorm.forward_static`; FlashInfer `gemma_fused_add_rmsnorm` (kernel `norm.cuh`); FLA `fla/modules/layernorm.py` with a residual; Quack |
| `"rounded"` | transformers `Qwen3NextDecoderLayer.forward` (`hidden_states = residual + hidden_states` in the model dtype); Liger `LigerFusedAddRMSNormFunction`; vLLM `GemmaRMSNorm` at older versions |

For float32 inputs the two conventions coincide.

Special values: those of [`rms_norm`][normspec.spec.rms_norm.rms_norm], on the sum `s`;
`x + r` that overflows the input dtype is `±inf` in `new_residual` (and, under
`"rounded"`, in what the norm reads), and `(+inf) + (-inf)` is NaN.

Backward, given `dy` (gradient of `y`) and `dres` (gradient of
`new_residual`):

1. `dsn = rstd · (g·dy32 − shat · m)` in fp32, exactly as in
   [`rms_norm_backward`][normspec.spec.rms_norm.rms_norm_backward];
2. `"fp32"`: `ds = dsn + dres32` (fp32), `dx = dresidual = R(ds)`;
   `"rounded"`: the norm's input gradient is first rounded to the input dtype
   (the autograd of a cast), `ds = R(R(dsn)32 + dres32)`,
   `dx = dresidual = ds`;
3. `dweight` = row tree of `dy32 · shat`, cast to the weight's dtype.
"""

from __future__ import annotations

import torch

from .blocks import by_row_blocks
from .rms_norm import normalize_backward, normalize_rows, weight_scale
from .validation import (
    RESIDUAL_SUMS,
    check_choice,
    check_eps,
    check_input,
    check_like,
    check_offset,
    check_weight,
)

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_backward"]

F32 = torch.float32


def _residual_sum(x: torch.Tensor, residual: torch.Tensor, residual_sum: str) -> torch.Tensor:
    """The fp32 value the norm reads."""
    s = x.to(F32) + residual.to(F32)
    if residual_sum == "rounded":
        s = s.to(x.dtype).to(F32)
    return s


def _check(x, residual, weight, eps, offset, residual_sum):
    check_input("x", x)
    check_like("residual", residual, x)
    check_weight(weight, x)
    return (
        check_eps(eps),
        check_offset(offset),
        check_choice("residual_sum", residual_sum, RESIDUAL_SUMS),
    )


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    offset: float = 0.0,
    residual_sum: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by RMSNorm, with the sum's rounding declared.

    Args:
        x: sublayer output ``(..., H)``: float32, bfloat16 or float16.
        residual: running residual, same shape, dtype and device as ``x``.
        weight: ``(H,)``, float32 or ``x``'s dtype.
        eps: finite, ``> 0``, taken as fp32.
        offset: added to the weight in fp32 (``1.0`` for Qwen3-Next).
        residual_sum: ``"fp32"`` or ``"rounded"`` (see the module text).

    Returns:
        y: the normalised output, in ``x``'s dtype.
        new_residual: the sum ``x + residual`` as the next layer's residual, in
            ``x``'s dtype.
    """
    eps, offset, residual_sum = _check(x, residual, weight, eps, offset, residual_sum)
    scale = weight_scale(weight, offset)

    def rows(xb: torch.Tensor, rb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = _residual_sum(xb, rb, residual_sum)
        shat, _ = normalize_rows(s, eps)
        return (shat * scale).to(x.dtype), s.to(x.dtype)

    y, new_residual = by_row_blocks(rows, [x, residual])
    return y, new_residual


def fused_add_rms_norm_backward(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    offset: float = 0.0,
    residual_sum: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Declared backward of [`fused_add_rms_norm`][normspec.spec.fused_add.fused_add_rms_norm].

    Args:
        dy: gradient of ``y``.
        dresidual_out: gradient of ``new_residual``.
        x, residual, weight, eps, offset, residual_sum: as in the forward.

    Returns:
        dx: gradient of ``x``, in ``x``'s dtype.
        dresidual: gradient of ``residual``: the same bits as ``dx`` (both inputs
            enter through the same sum).
        dweight: gradient of ``weight``, in the weight's dtype.
    """
    eps, offset, residual_sum = _check(x, residual, weight, eps, offset, residual_sum)
    check_like("dy", dy, x)
    check_like("dresidual_out", dresidual_out, x)
    scale = weight_scale(weight, offset)

    def rows(dyb, drb, xb, rb):
        s = _residual_sum(xb, rb, residual_sum)
        shat, rstd = normalize_rows(s, eps)
        dy32 = dyb.to(F32)
        dsn = normalize_backward(dy32 * scale, shat, rstd)
        if residual_sum == "rounded":
            dsn = dsn.to(x.dtype).to(F32)
        return (dsn + drb.to(F32)).to(x.dtype), dy32 * shat

    ds, dweight = by_row_blocks(rows, [dy, dresidual_out, x, residual], row_tree=True)
    return ds, ds.clone(), dweight.to(weight.dtype)
