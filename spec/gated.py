r"""Gated RMSNorm: the output norm of Qwen3-Next's Gated DeltaNet layers.

Norm before gate, one row per value head (`head_v_dim = 128` in
Qwen3-Next), weight initialised to ones:

$$
y = \hat x \cdot w \cdot \mathrm{act}(z), \qquad \hat x = x \cdot \mathrm{rstd}(x),
\qquad \mathrm{act} \in \{\mathrm{silu}, \sigma\}
$$

with the roundings of the two conventions below. The two upstream conventions round at different
points; the spec names them with `convention`.

`"vllm"` (all fp32, one rounding at the end)
:   `y = R(((xhat · w32) · act(z32)))` with `xhat = x32 · rstd`.

`"hf"` (three roundings)
:   `t = R(xhat)` to the input dtype;
    `u = t · w` in the promoted dtype `p` of `x` and `weight` (a bf16 weight
    rounds `u` to bf16; an fp32 weight keeps `u` in fp32);
    `y = R(u32 · act(z32))`.

`act` is the declared [`silu_fp32`][normspec.spec.arithmetic.silu_fp32] or
[`sigmoid_fp32`][normspec.spec.arithmetic.sigmoid_fp32]; `rstd` and `xhat`
are exactly those of [`rms_norm`][normspec.spec.rms_norm.rms_norm].

| convention | followed by (file) |
| --- | --- |
| `"vllm"` | vLLM 0.33 `model_executor/layers/layernorm.py` `RMSNormGated.forward_native` (fp32 throughout, `activation` selects silu/sigmoid); FLA `fla/modules/fused_norm_gate.py` `FusedRMSNormGated` and `layernorm_gated.rmsnorm_fn` (fp32 in-kernel, one cast) |
| `"hf"` | transformers `models/qwen3_next/modeling_qwen3_next.py` `Qwen3NextRMSNormGated.forward` (cast to the input dtype before the weight, `silu(gate.float())`, cast again) |

For float32 inputs and weights the two conventions coincide.

Special values: `xhat` and `rstd` are those of [`rms_norm`][normspec.spec.rms_norm.rms_norm]
(NaN rows, infinite and overflowing rows, signed zeros); the gate's `act` follows its
declared algorithm: `sigmoid(+inf) = 1`, `sigmoid(-inf) = +0`, `silu(+inf) = +inf`,
`silu(-inf) = NaN` (`-inf · 0`), NaN in, NaN out; a zero gate gives `silu(±0) = ±0` and so
a signed-zero output.

Backward, with `dy32 = fp32(dy)`, `a = act(z32)`, `a' = act'(z32)`
([`silu_grad_fp32`][normspec.spec.arithmetic.silu_grad_fp32],
[`sigmoid_grad_fp32`][normspec.spec.arithmetic.sigmoid_grad_fp32]):

`"vllm"`
:   `u = xhat · w32`; `dgate = R((dy32 · u) · a')`; `du = dy32 · a`;
    `dweight` rows `du · xhat`; `dxhat = du · w32`; then
    `dx = R(rstd · (dxhat − xhat · m))`, `m = tree_sum(dxhat · xhat) / H`.

`"hf"` (the autograd of the hf forward, with its casts)
:   `dgate = R((dy32 · u32) · a')`; `du = R_p(dy32 · a)`;
    `dweight` rows `du32 · t32`; `dxhat = R(R_p(du32 · w32))` (the gradient
    through the cast to the input dtype); `dx` as above.
"""

from __future__ import annotations

import torch

from . import arithmetic as A
from .blocks import by_row_blocks
from .rms_norm import normalize_backward, normalize_rows
from .validation import (
    ACTIVATIONS,
    GATED_CONVENTIONS,
    check_choice,
    check_eps,
    check_input,
    check_like,
    check_weight,
)

__all__ = ["rms_norm_gated", "rms_norm_gated_backward"]

F32 = torch.float32

_ACT = {"silu": A.silu_fp32, "sigmoid": A.sigmoid_fp32}
_ACT_GRAD = {"silu": A.silu_grad_fp32, "sigmoid": A.sigmoid_grad_fp32}


def _check(x, gate, weight, eps, convention, activation):
    check_input("x", x)
    check_like("gate", gate, x)
    check_weight(weight, x)
    return (
        check_eps(eps),
        check_choice("convention", convention, GATED_CONVENTIONS),
        check_choice("activation", activation, ACTIVATIONS),
    )


def _promoted(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


def _forward_parts(x, weight, eps, convention):
    """``(xhat, rstd, t32, u32)``: the normalised row, before and after the weight."""
    xhat, rstd = normalize_rows(x.to(F32), eps)
    w32 = weight.to(F32)
    if convention == "vllm":
        return xhat, rstd, xhat, xhat * w32
    t32 = xhat.to(x.dtype).to(F32)
    u32 = (t32 * w32).to(_promoted(x, weight)).to(F32)
    return xhat, rstd, t32, u32


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    convention: str = "vllm",
    activation: str = "silu",
) -> torch.Tensor:
    """Gated RMSNorm (norm before gate) with declared rounding.

    Args:
        x: ``(..., H)``, float32, bfloat16 or float16.
        gate: ``z``, same shape, dtype and device as ``x``.
        weight: ``(H,)``, float32 or ``x``'s dtype.
        eps: finite, ``> 0``, taken as fp32.
        convention: ``"vllm"`` or ``"hf"`` (see the module text).
        activation: ``"silu"`` or ``"sigmoid"``.

    Returns:
        ``y`` with ``x``'s shape and dtype.
    """
    eps, convention, activation = _check(x, gate, weight, eps, convention, activation)

    def rows(xb: torch.Tensor, gb: torch.Tensor) -> tuple[torch.Tensor]:
        _, _, _, u32 = _forward_parts(xb, weight, eps, convention)
        return ((u32 * _ACT[activation](gb)).to(x.dtype),)

    (y,) = by_row_blocks(rows, [x, gate])
    return y


def rms_norm_gated_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    convention: str = "vllm",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Declared backward of [`rms_norm_gated`][normspec.spec.gated.rms_norm_gated].

    Returns:
        dx: gradient of ``x``, in ``x``'s dtype.
        dgate: gradient of ``gate``, in ``x``'s dtype.
        dweight: gradient of ``weight``, in the weight's dtype.
    """
    eps, convention, activation = _check(x, gate, weight, eps, convention, activation)
    check_like("dy", dy, x)
    w32 = weight.to(F32)
    promoted = _promoted(x, weight)

    def rows(dyb, xb, gb):
        xhat, rstd, t32, u32 = _forward_parts(xb, weight, eps, convention)
        dy32 = dyb.to(F32)
        dgate = ((dy32 * u32) * _ACT_GRAD[activation](gb)).to(x.dtype)
        du = dy32 * _ACT[activation](gb)
        if convention == "vllm":
            dxhat = du * w32
        else:
            du = du.to(promoted).to(F32)
            dxhat = (du * w32).to(promoted).to(x.dtype).to(F32)
        dx = normalize_backward(dxhat, xhat, rstd).to(x.dtype)
        return dx, dgate, du * t32

    dx, dgate, dweight = by_row_blocks(rows, [dy, x, gate], row_tree=True)
    return dx, dgate, dweight.to(weight.dtype)
