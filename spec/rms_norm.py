r"""RMSNorm and its zero-centred `(1 + w)` form.

$$
y = R\big((\hat x) \cdot g\big), \qquad \hat x = R_{32}(x_{32} \cdot \mathrm{rstd}),
\qquad g = \begin{cases} w_{32} & \text{offset} = 0 \\ R_{32}(\text{offset} + w_{32}) & \text{otherwise} \end{cases}
$$

where $R$ rounds to the input dtype and $R_{32}$ to fp32.

Declared order (every step a correctly rounded operation):

1. `x32 = fp32(x)`, `w32 = fp32(weight)` (exact);
2. `sq = x32 · x32` in fp32;
3. `ss = tree_sum(sq)` (pairwise tree over the row, see
   [`tree_sum`][normspec.spec.arithmetic.tree_sum]);
4. `rstd = 1 / sqrt(ss / H + eps32)`
   ([`rstd_from_sum_of_squares`][normspec.spec.arithmetic.rstd_from_sum_of_squares]);
5. `xhat = x32 · rstd` (fp32);
6. `g = offset + w32` (fp32; skipped when `offset == 0`, so that a `-0.0`
   weight stays `-0.0`);
7. `y = R(xhat · g)` (fp32 product, then one rounding to the input dtype).

The zero-centred form (`offset = 1.0`, weight initialised to zeros) is the
Qwen3-Next decoder norm and q/k norm. Upstream conventions:

| library | where | `1 + w` | order | differs from the spec in |
| --- | --- | --- | --- | --- |
| transformers | `models/qwen3_next/modeling_qwen3_next.py`, `Qwen3NextRMSNorm.forward` | fp32 | `(x32 · rsqrt(mean + eps)) · (1 + w32)`, then cast | the mean (torch's reduction order) and `rsqrt` |
| vLLM 0.33 | `model_executor/layers/layernorm.py`, `GemmaRMSNorm` | fp32 | as transformers | the same |

Backward (explicit, not autograd of the forward), with `dy32 = fp32(dy)`:

1. `gdy = dy32 · g`;
2. `c = tree_sum(gdy · xhat)`; `m = c / H` (correctly rounded);
3. `dx = R(rstd · (gdy − xhat · m))` (each step fp32);
4. per-row `dweight` contributions `dy32 · xhat`, summed over rows by
   the row tree (rows in flattened order, zero-padded to a power of two),
   then cast to the weight's dtype.

Special values (IEEE arithmetic through the declared steps):

- a NaN anywhere in a row makes that row's `rstd` and every output of the row NaN;
- `±inf` in a row gives `ss = +inf` and `rstd = +0`: `±inf · 0 = NaN` at the infinite
  element and a signed zero elsewhere;
- finite values whose squares overflow fp32 (`|x| > 1.8e19`) do the same: `ss = +inf`,
  `rstd = +0`, every output a signed zero;
- `±0` inputs give signed-zero outputs; `-0.0` and `+0.0` are different bits, and a
  conforming kernel must produce the spec's sign (a zero weight with `offset = 0` stays
  `-0.0` or `+0.0` as given);
- an all-zero row gives `rstd = 1 / sqrt(eps32)` and zero outputs;
- `eps` must be finite and `> 0` *as fp32* (`1e-50` rounds to 0 and is refused, as is
  `1e300`, which rounds to inf); `offset` must be finite as fp32.
"""

from __future__ import annotations

import torch

from . import arithmetic as A
from .blocks import by_row_blocks
from .validation import check_eps, check_input, check_like, check_offset, check_weight

__all__ = ["rms_norm", "rms_norm_backward"]

F32 = torch.float32


def weight_scale(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """``offset + w`` in fp32 (``w`` alone for ``offset == 0``): the per-channel factor."""
    w32 = weight.to(F32)
    if offset == 0.0:
        return w32
    return A.f32(offset, w32) + w32


def normalize_rows(x32: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xhat, rstd)`` for fp32 rows: steps 2–5 of the declared order.

    ``rstd`` keeps a trailing dimension of size 1 so it broadcasts over ``H``.
    """
    ss = A.tree_sum(x32 * x32)
    rstd = A.rstd_from_sum_of_squares(ss, x32.shape[-1], eps).unsqueeze(-1)
    return x32 * rstd, rstd


def normalize_backward(
    dxhat: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """fp32 gradient through ``xhat = x · rstd(x)`` given ``dL/dxhat``.

    ``dx = rstd · (dxhat − xhat · m)`` with ``m = tree_sum(dxhat · xhat) / H``.
    """
    c = A.tree_sum(dxhat * xhat).unsqueeze(-1)
    m = A.div(c, float(xhat.shape[-1]))
    return rstd * (dxhat - xhat * m)


def row_tree(contributions: torch.Tensor) -> torch.Tensor:
    """Sum per-row fp32 contributions ``(..., H)`` over all rows by the row tree."""
    flat = contributions.reshape(-1, contributions.shape[-1])
    return A.tree_sum(flat, dim=0)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm with declared rounding; ``offset=1.0`` is the zero-centred form.

    Args:
        x: input ``(..., H)``, float32, bfloat16 or float16, any strides.
        weight: ``(H,)``, float32 or ``x``'s dtype.
        eps: added to the mean square, as fp32; finite and ``> 0``.
        offset: added to the weight in fp32 (``1.0`` for Qwen3-Next).

    Returns:
        ``y`` with ``x``'s shape and dtype.
    """
    check_input("x", x)
    check_weight(weight, x)
    eps = check_eps(eps)
    offset = check_offset(offset)
    scale = weight_scale(weight, offset)

    def rows(xb: torch.Tensor) -> tuple[torch.Tensor]:
        xhat, _ = normalize_rows(xb.to(F32), eps)
        return ((xhat * scale).to(x.dtype),)

    (y,) = by_row_blocks(rows, [x])
    return y


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Declared backward of [`rms_norm`][normspec.spec.rms_norm.rms_norm].

    Returns:
        dx: gradient of ``x``, in ``x``'s dtype.
        dweight: gradient of ``weight``, in the weight's dtype.
    """
    check_input("x", x)
    check_like("dy", dy, x)
    check_weight(weight, x)
    eps = check_eps(eps)
    offset = check_offset(offset)
    scale = weight_scale(weight, offset)

    def rows(dyb: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xhat, rstd = normalize_rows(xb.to(F32), eps)
        dy32 = dyb.to(F32)
        dx = normalize_backward(dy32 * scale, xhat, rstd)
        return dx.to(x.dtype), dy32 * xhat

    dx, dweight = by_row_blocks(rows, [dy, x], row_tree=True)
    return dx, dweight.to(weight.dtype)

