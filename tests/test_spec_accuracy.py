"""The spec against a float64 evaluation of the same math (same cast points).

Forward: for bf16/fp16 outputs at least 99.9% of elements within 1 ulp of the
float64 truth rounded to the output dtype (documented bound), fp32 outputs
within FP32_FORWARD_MAX_ULP. Backward: against float64 autograd of the same
math, normwise relative error under GRAD_RTOL[dtype].
"""

from __future__ import annotations

import pytest
import torch

from normspec.ops import OPS, variant_name
from normspec.spec.arithmetic import ulp_distance

F64 = torch.float64
FP32_FORWARD_MAX_ULP = 8
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _round(t, dtype):
    """Round a float64 value to ``dtype`` and back (straight-through for autograd)."""
    return t + (t.to(dtype).to(F64) - t).detach()


def _norm64(x, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.tensor(eps, dtype=torch.float32)
                          .to(F64))


def _act64(z, activation):
    return torch.sigmoid(z) if activation == "sigmoid" else torch.nn.functional.silu(z)


def truth64(op, rows, weight, eps, params, dtype):
    """The op evaluated in float64 with the declared cast points (differentiable)."""
    w = weight.to(F64)
    if op.name == "rms_norm":
        g = w + params["offset"] if params["offset"] else w
        return (_norm64(rows["x"], eps) * g,)
    if op.name == "fused_add_rms_norm":
        s = rows["x"] + rows["residual"]
        if params["residual_sum"] == "rounded":
            s = _round(s, dtype)
        g = w + params["offset"] if params["offset"] else w
        return (_norm64(s, eps) * g, s)
    xhat = _norm64(rows["x"], eps)
    a = _act64(rows["gate"], params["activation"])
    if params["convention"] == "vllm":
        return (xhat * w * a,)
    promoted = torch.promote_types(dtype, weight.dtype)
    u = _round(_round(xhat, dtype) * w, promoted)
    return (u * a,)


CASES = [(op, p) for op in OPS.values() for p in op.variants]


@pytest.mark.parametrize("wdtype", ["fp32", "same"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}[{variant_name(c[1])}]")
def test_forward_close_to_float64(case, dtype, wdtype):
    op, params = case
    weight_dtype = torch.float32 if wdtype == "fp32" else dtype
    sample = op.make_sample((64, 2048), dtype, params=params, seed=21, weight_dtype=weight_dtype)
    got = op.spec_forward(sample)
    rows64 = {k: v.to(F64) for k, v in sample.rows.items()}
    want = truth64(op, rows64, sample.weight, sample.eps, params, dtype)
    for g, w in zip(got, want, strict=True):
        d = ulp_distance(g, w.to(dtype))
        if dtype == torch.float32:
            assert d.max().item() <= FP32_FORWARD_MAX_ULP
        else:
            assert (d <= 1).float().mean().item() >= 0.999
            assert d.max().item() <= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}[{variant_name(c[1])}]")
def test_backward_matches_float64_autograd(case, dtype):
    op, params = case
    sample = op.make_sample((48, 512), dtype, params=params, seed=5, weight_dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(48, 512, generator=gen).to(dtype) for _ in op.outputs]
    got = op.spec_backward(sample, grads)
    rows64 = {k: v.to(F64).requires_grad_() for k, v in sample.rows.items()}
    w64 = sample.weight.to(F64).requires_grad_()
    outs = truth64(op, rows64, w64, sample.eps, params, dtype)
    wants = torch.autograd.grad(outs, [*(rows64[k] for k in op.row_inputs), w64],
                                [g.to(F64) for g in grads])
    for name, g, w in zip((*op.row_grads, "dweight"), got, wants, strict=True):
        rel = (g.to(F64) - w).norm() / w.norm()
        assert rel.item() < GRAD_RTOL[dtype], name


def test_special_values_follow_ieee_through_the_declared_steps():
    op = OPS["rms_norm"]
    x = torch.tensor([[1.0, float("inf"), 2.0], [1.0, float("nan"), 2.0], [0.0, 0.0, -0.0]])
    y = op.forward(x, torch.ones(3), eps=1e-6)
    assert torch.isnan(y[0, 1]) and y[0, 0] == 0 and y[0, 2] == 0   # rstd = 0
    assert torch.isnan(y[1]).all()
    assert (y[2] == 0).all() and torch.signbit(y[2, 2])             # zero row stays zero
