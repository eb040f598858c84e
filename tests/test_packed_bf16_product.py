"""The packed bf16 product of the hf gated kernels gives the spec's bits.

The spec's transformers convention rounds ``u = rt(t * w)`` for a bf16 weight: the fp32
product of two bf16 values, then rounded to bf16. GT form 5
(``forward_gated_hf_packed_w`` in ``backends/csrc/normspec_pipe.cuh``) takes the product
with ``mul.rn.bf16x2`` (``fma.rn.bf16x2`` with a -0 addend on sm_80 / 89) instead: the
exact product rounded once to bf16. The two agree when the fp32 rounding never changes
the bf16 one; this test checks that on the CPU, against a single rounding of the exact
product (exact in float64), for every bf16 weight against a spread of rounded normalized
inputs, subnormal products, underflow and overflow included. The backward's GC 7
(``gated_backward_vec_hf_packed_w``) rests on the same fact for its two products of bf16
values, ``u = rt(t * w)`` and ``dxhat = rt(rt(du) * w)``. (The GPU's instruction itself
is checked by the CUDA every-gate tests, which run form 5 and GC 7.)
"""

from __future__ import annotations

import torch

BF16 = torch.bfloat16


def _every_finite_bf16() -> torch.Tensor:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16)
    return every[torch.isfinite(every)]


def _round_once_to_bf16(p: torch.Tensor) -> torch.Tensor:
    """Exact float64 values rounded once to bf16 (nearest, ties to even), as float64."""
    mag = p.abs()
    # bf16's unit in the last place at p: 2**(exponent - 7), at least the subnormal step
    exponent = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag))))
    ulp_exp = torch.clamp(exponent - 7, min=-133.0)
    scale = torch.exp2(ulp_exp)
    rounded = torch.round(p / scale) * scale  # torch.round: ties to even; /scale is exact
    # a carry into the next binade keeps the value exact (a power of two); past the
    # largest finite bf16 (2**128 after rounding) is inf
    return torch.where(rounded.abs() >= 2.0**128, torch.sign(p) * torch.inf, rounded)


def _inputs() -> torch.Tensor:
    """Rounded normalized inputs t: random ones in the range |xhat| <= sqrt(H) takes,
    and the extremes (signed zeros, subnormals, the smallest and largest normals)."""
    gen = torch.Generator().manual_seed(7)
    spread = (torch.randn(384, generator=gen) * 2.0).to(BF16)
    bits = torch.tensor([0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x00FF, 0x3F80,
                         0x3F81, 0x7F7F, 0xFF7F, 0x4130, 0xC130], dtype=torch.int32)
    extremes = bits.to(torch.int16).view(BF16)
    return torch.cat([spread, extremes])


def test_fp32_product_then_bf16_is_the_exact_product_rounded_once():
    w = _every_finite_bf16()
    t = _inputs()
    tw, ww = torch.meshgrid(t, w, indexing="ij")
    spec = (tw.float() * ww.float()).to(BF16)  # the spec's rt(fp32(t * w))
    once = _round_once_to_bf16(tw.double() * ww.double()).to(BF16)  # exact: no rounding
    assert not torch.isnan(spec).any()
    # the cases that matter are present: bf16 subnormal products, products that round to
    # a zero of either sign, and overflow
    assert ((spec != 0) & (spec.abs() < 2.0**-126)).any()
    assert ((spec == 0) & (tw != 0) & (ww != 0)).any()
    assert torch.isinf(spec).any()
    same = spec.view(torch.int16) == once.view(torch.int16)
    bad = (~same).nonzero()[:5].tolist()
    assert same.all(), f"{(~same).sum().item()} products differ, first at {bad}"


def test_the_check_sees_a_double_rounding():
    """The reference rounds once: a value just above a bf16 midpoint rounds up, while a
    first rounding to fp16 (which drops the part above the midpoint) makes it a tie that
    then rounds to even, down: the check above would see such a difference."""
    exact = torch.tensor([1.0 + 2.0**-8 + 2.0**-14], dtype=torch.float64)
    assert _round_once_to_bf16(exact).item() == 1.0 + 2.0**-7
    through_fp16 = exact.to(torch.float16).double()
    assert through_fp16.item() == 1.0 + 2.0**-8
    assert _round_once_to_bf16(through_fp16).item() == 1.0
    # and it agrees with torch's own float -> bf16 rounding where fp32 holds the value
    assert exact.float().to(BF16).double().item() == 1.0 + 2.0**-7
