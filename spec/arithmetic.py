"""Declared arithmetic shared by every normspec operator.

Every function here is a sequence of correctly rounded IEEE-754 operations in
a stated dtype, so that each input has exactly one correct output bit pattern
on any device. A conforming kernel must perform the *same* operations in the
*same* order; it is free to choose block sizes, vector widths and thread
counts because the orders below are fixed by index, not by schedule.

Rules
-----
* **Casts** round to nearest, ties to even, to the named dtype.
* **fp32 `+`, `−`, `×`** are single correctly rounded operations. A kernel must
  not contract `a·b + c` into a fused multiply-add where the spec has two
  roundings.
* **fp32 division and square root** must be correctly rounded. The reference
  forms them in float64 and rounds once to fp32: double rounding is innocuous
  for `÷` and `√` because 53 ≥ 2·24 + 2. (torch's fp32 `sqrt` on the CPU is
  *not* correctly rounded on every build, which is why the spec never calls
  it.) CUDA kernels use `__fdiv_rn` / `__fsqrt_rn`; C++ kernels use plain `/`
  and `std::sqrt` on `float` without `-ffast-math`.
* **Row reductions** are a pairwise tree ([`tree_sum`][normspec.spec.arithmetic.tree_sum]):
  the row is zero-padded to the next power of two and folded
  `v = v[0::2] + v[1::2]` until one value is left.
* **`rstd`** is `1 / sqrt(ss / H + eps)` with `eps` taken as fp32: four
  correctly rounded fp32 operations, never an approximate `rsqrt`.
* **`exp`** is [`exp_fp32`][normspec.spec.arithmetic.exp_fp32], a declared
  algorithm built only from correctly rounded operations; `sigmoid` and
  `silu` are defined on top of it.
* **NaN**: where a step yields NaN the result is NaN, but its sign and payload
  are not specified — IEEE leaves them open and devices differ (x86 gives a
  negative default NaN for `inf · 0`, CUDA `0x7fffffff`; torch rounds a NaN to
  bf16 as `0x7fc0` on the CPU and `0x7fff` on CUDA). "Bitwise equal" means
  equal bits everywhere else and NaN in the same places.
"""

from __future__ import annotations

import torch

__all__ = [
    "EXP_MAX_ULP_ERROR",
    "LN2_HI",
    "LN2_LO",
    "LOG2E",
    "cast",
    "div",
    "exp_fp32",
    "f32",
    "next_power_of_two",
    "rstd_from_sum_of_squares",
    "sigmoid_fp32",
    "sigmoid_grad_fp32",
    "silu_fp32",
    "silu_grad_fp32",
    "sqrt",
    "tree_sum",
]

F32 = torch.float32
F64 = torch.float64

#: ``log2(e)`` rounded to fp32 (0x3FB8AA3B).
LOG2E = 1.44269502162933349609375
#: High part of ``ln 2`` with 15 significant bits (0x3F317200): ``n * LN2_HI`` is
#: exact for every ``|n| <= 255``.
LN2_HI = 0.693145751953125
#: ``ln 2 - LN2_HI`` rounded to fp32 (0x35BFBE8E).
LN2_LO = 1.428606765330187045037746429443359375e-06
#: Taylor coefficients ``1/k!`` for k = 7 … 2, rounded to fp32 (Horner order).
EXP_COEFFICIENTS = (
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
)
#: Maximum error of [`exp_fp32`][normspec.spec.arithmetic.exp_fp32] against the
#: correctly rounded float64 ``exp``, in fp32 ulps, measured by
#: ``tests/test_arithmetic.py::test_exp_error_bound`` (a sweep of the whole
#: finite fp32 range plus edge cases). Measured with torch 2.13 on the CPU over
#: every 37th fp32 bit pattern (115,626,760 finite values): 1.197 ulp, and the
#: result differs from the correctly rounded fp32 ``exp`` by at most 1 ulp in
#: 0.43% of them. The contract is "at most 2 ulp"; the test holds it to this
#: tighter constant so that any regression shows.
EXP_MAX_ULP_ERROR = 1.2


def f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` rounded once to an fp32 0-d tensor on ``like``'s device (never a Python
    double in the arithmetic); ``-0.0`` keeps its sign."""
    return torch.full((), value, dtype=F32, device=like.device)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``t`` to ``dtype``: round to nearest, ties to even."""
    return t.to(dtype)


def next_power_of_two(n: int) -> int:
    """The smallest power of two that is ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tree_sum(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pairwise-tree sum of ``v`` along ``dim``, in ``v``'s dtype.

    The normative order: zero-pad the ``L`` values along ``dim`` to
    ``P = next_power_of_two(L)`` (appending ``+0.0``, which never changes a
    sum), then fold adjacent pairs, ``v = v[0::2] + v[1::2]``, until one value
    is left. Equivalently, ``tree(v) = tree(first half) + tree(second half)``
    on the padded vector. Any kernel that sums aligned power-of-two blocks of
    the row and combines neighbouring blocks in the same way yields the same
    bits. ``L = 0`` gives ``+0.0``.

    Args:
        v: values to sum (fp32 in every normspec use).
        dim: the dimension to reduce; it is removed from the result.
    """
    v = v.movedim(dim, -1)
    length = v.shape[-1]
    if length == 0:
        return torch.zeros(v.shape[:-1], dtype=v.dtype, device=v.device)
    padded = next_power_of_two(length)
    if padded != length:
        pad = torch.zeros(*v.shape[:-1], padded - length, dtype=v.dtype, device=v.device)
        v = torch.cat([v, pad], dim=-1)
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def div(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded fp32 quotient ``a / b`` (formed in float64, rounded once)."""
    b64 = b.to(F64) if isinstance(b, torch.Tensor) else b
    return (a.to(F64) / b64).to(F32)


def sqrt(a: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (formed in float64, rounded once)."""
    return torch.sqrt(a.to(F64)).to(F32)


def rstd_from_sum_of_squares(ss: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """``rstd = 1 / sqrt(ss / H + eps)`` in four correctly rounded fp32 steps.

    1. ``mean = ss / H`` (``H`` exactly representable in fp32),
    2. ``v = mean + eps32`` where ``eps32 = fp32(eps)``,
    3. ``s = sqrt(v)``,
    4. ``rstd = 1 / s``.
    """
    mean = div(ss, float(hidden))
    v = mean + f32(eps, ss)
    return div(torch.ones_like(v), sqrt(v))


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2**exponent`` for int32 exponents in [-126, 127], built from exponent bits."""
    return ((exponent + 127) << 23).to(torch.int32).view(F32)


def exp_fp32(z: torch.Tensor) -> torch.Tensor:
    """The declared fp32 exponential.

    Built only from correctly rounded fp32 operations (no fused multiply-add),
    so a C++ or CUDA kernel reproduces it bit for bit:

    1. ``zc = clamp(z, -110, 100)`` (NaN handled at the end; the clamp keeps
       the exponent arithmetic in range and does not change any result, since
       ``exp`` already rounds to ``+0`` below -104 and to ``+inf`` above 89);
    2. ``n = rint(zc · LOG2E)`` (product rounded to fp32, then round half to
       even to an integer);
    3. Cody–Waite reduction: ``r = (zc − n·LN2_HI) − n·LN2_LO``, each product
       and difference rounded to fp32 (``n·LN2_HI`` and the first difference
       are exact);
    4. ``p = 1 + r·(1 + r·(c2 + r·(c3 + … + r·c7)))`` by Horner's rule with
       ``ck = fp32(1/k!)``, one rounding per ``×`` and per ``+``;
    5. scaling by ``2**n`` in two exact powers of two,
       ``(p · 2**a) · 2**b`` with ``a = floor(n/2)``, ``b = n − a``: the
       first product is exact, the second rounds once (to a subnormal,
       ``+0`` or ``+inf`` where the true result is one);
    6. NaN in, NaN out; ``exp(+inf) = +inf``; ``exp(-inf) = +0``.

    Its maximum error against the float64 ``exp`` over the whole fp32 range is
    [`EXP_MAX_ULP_ERROR`][normspec.spec.arithmetic.EXP_MAX_ULP_ERROR] ulp or less.
    """
    z = z.to(F32)
    nan = torch.isnan(z)
    zc = torch.where(nan, torch.zeros_like(z), z).clamp(-110.0, 100.0)
    n = torch.round(zc * f32(LOG2E, z))
    r = (zc - n * f32(LN2_HI, z)) - n * f32(LN2_LO, z)
    p = f32(EXP_COEFFICIENTS[0], z).expand_as(r)
    for c in EXP_COEFFICIENTS[1:]:
        p = p * r + f32(c, z)
    one = f32(1.0, z)
    p = p * r + one
    p = p * r + one
    ni = n.to(torch.int32)
    a = torch.div(ni, 2, rounding_mode="floor")
    b = ni - a
    y = (p * _power_of_two(a)) * _power_of_two(b)
    return torch.where(nan, z, y)


def sigmoid_fp32(z: torch.Tensor) -> torch.Tensor:
    """Declared ``sigmoid(z) = 1 / (1 + exp_fp32(−z))`` in fp32.

    ``sigmoid(-inf) = +0``, ``sigmoid(+inf) = 1``, NaN propagates.
    """
    z = z.to(F32)
    e = exp_fp32(-z)
    return div(torch.ones_like(z), f32(1.0, z) + e)


def silu_fp32(z: torch.Tensor) -> torch.Tensor:
    """Declared ``silu(z) = z / (1 + exp_fp32(−z))`` in fp32.

    Special values: ``silu(+inf) = +inf``; for ``z < -88.7`` the
    denominator overflows to ``+inf`` and the result is ``-0.0``; but
    ``silu(-inf) = -inf / +inf = NaN`` (the declared formula, unlike
    ``torch.nn.functional.silu`` which returns ``-0.0``). NaN propagates.
    """
    z = z.to(F32)
    e = exp_fp32(-z)
    return div(z, f32(1.0, z) + e)


def sigmoid_grad_fp32(z: torch.Tensor) -> torch.Tensor:
    """Declared ``sigmoid'(z) = s · (1 − s)`` with ``s = sigmoid_fp32(z)``."""
    s = sigmoid_fp32(z)
    return s * (f32(1.0, s) - s)


def silu_grad_fp32(z: torch.Tensor) -> torch.Tensor:
    """Declared ``silu'(z) = s · (1 + z · (1 − s))`` with ``s = sigmoid_fp32(z)``.

    Steps, each rounded to fp32: ``t = 1 − s``; ``t = z · t``; ``t = 1 + t``;
    ``d = s · t``.
    """
    z = z.to(F32)
    s = sigmoid_fp32(z)
    one = f32(1.0, s)
    return s * (one + z * (one - s))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance between two same-dtype tensors in units in the last place.

    The values are mapped onto a monotonic integer line (so ``-0.0`` and
    ``+0.0`` are 0 apart and the distance across zero is counted properly);
    NaN against NaN is 0, NaN against a number is the dtype's largest
    distance. Returns int64.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance: dtypes differ, got {a.dtype} and {b.dtype}")
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    if a.dtype not in bits:
        raise TypeError(f"ulp_distance: expected float32, float16 or bfloat16, got {a.dtype}")
    int_dtype = bits[a.dtype]
    sign_bit = -(2 ** (torch.iinfo(int_dtype).bits - 1))

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(int_dtype).to(torch.int64)
        return torch.where(i < 0, sign_bit - i, i)

    d = (ordered(a) - ordered(b)).abs()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    d = torch.where(nan_a & nan_b, torch.zeros_like(d), d)
    big = torch.full_like(d, 2 ** (torch.iinfo(int_dtype).bits) - 1)
    return torch.where(nan_a ^ nan_b, big, d)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bit pattern, or NaN in both. Returns bool.

    This is what *bitwise equal* means throughout normspec: ``-0.0`` and
    ``+0.0`` differ (unlike ``ulp_distance(a, b) == 0`` or ``a == b``); NaN
    payloads and signs do not count, since IEEE 754 leaves them open and
    devices differ (x86's default NaN is negative, CUDA's is not; torch
    rounds a NaN to bf16 as ``0x7fc0`` on the CPU and ``0x7fff`` on CUDA).
    """
    if a.dtype != b.dtype:
        raise TypeError(f"same_bits: dtypes differ, got {a.dtype} and {b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"same_bits: shapes differ, got {tuple(a.shape)} and {tuple(b.shape)}")
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}
    if a.dtype not in bits:
        raise TypeError(f"same_bits: expected float32, float16, bfloat16 or float64, "
                        f"got {a.dtype}")
    ia = a.contiguous().view(bits[a.dtype])
    ib = b.contiguous().view(bits[b.dtype])
    return (ia == ib) | (torch.isnan(a) & torch.isnan(b))


__all__ += ["same_bits", "ulp_distance"]
