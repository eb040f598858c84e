"""Bad inputs raise errors that name the argument, what was seen and what was expected."""

from __future__ import annotations

import pytest
import torch

from normspec import spec

X = torch.randn(4, 8)
W = torch.ones(8)


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: spec.rms_norm(X.long(), W, eps=1e-6), TypeError, ["x", "int64"]),
        (lambda: spec.rms_norm([1.0], W, eps=1e-6), TypeError, ["x", "list"]),
        (lambda: spec.rms_norm(torch.randn(4, 0), torch.ones(0), eps=1e-6), ValueError,
         ["x", "H >= 1"]),
        (lambda: spec.rms_norm(X, torch.ones(7), eps=1e-6), ValueError, ["weight", "(8,)", "(7,)"]),
        (lambda: spec.rms_norm(X, torch.ones(8, dtype=torch.float16), eps=1e-6), TypeError,
         ["weight", "float16"]),
        (lambda: spec.rms_norm(X, W, eps=0.0), ValueError, ["eps", "0.0"]),
        (lambda: spec.rms_norm(X, W, eps=float("nan")), ValueError, ["eps", "nan"]),
        (lambda: spec.rms_norm(X, W, eps="1e-6"), TypeError, ["eps", "str"]),
        (lambda: spec.rms_norm(X, W, eps=1e-6, offset=float("inf")), ValueError, ["offset"]),
        # used in fp32: eps must stay > 0 and finite there, offset finite
        (lambda: spec.rms_norm(X, W, eps=1e-50), ValueError, ["eps", "1e-50", "0.0 in fp32"]),
        (lambda: spec.rms_norm(X, W, eps=1e300), ValueError, ["eps", "inf in fp32"]),
        (lambda: spec.rms_norm(X, W, eps=1e-6, offset=1e39), ValueError,
         ["offset", "1e+39", "inf in fp32"]),
        (lambda: spec.fused_add_rms_norm(X, torch.randn(4, 9), torch.ones(9)[:8], eps=1e-6),
         ValueError, ["residual", "(4, 9)"]),
        (lambda: spec.fused_add_rms_norm(X, X.half(), W, eps=1e-6), TypeError,
         ["residual", "float16"]),
        (lambda: spec.fused_add_rms_norm(X, X, W, eps=1e-6, residual_sum="bf16"), ValueError,
         ["residual_sum", "bf16"]),
        (lambda: spec.rms_norm_gated(X, X, W, eps=1e-6, convention="sglang"), ValueError,
         ["convention", "sglang", "vllm", "hf"]),
        (lambda: spec.rms_norm_gated(X, X, W, eps=1e-6, activation="gelu"), ValueError,
         ["activation", "gelu"]),
        (lambda: spec.rms_norm_gated(X, X[:, :4], W, eps=1e-6), ValueError, ["gate"]),
        (lambda: spec.rms_norm_backward(X[:2], X, W, eps=1e-6), ValueError, ["dy"]),
    ],
)
def test_bad_inputs(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value)


@pytest.mark.cuda
def test_mismatched_devices():
    with pytest.raises(ValueError, match="weight: expected the device of x"):
        spec.rms_norm(X, W.cuda(), eps=1e-6)
    with pytest.raises(ValueError, match="gate: expected the device of x"):
        spec.rms_norm_gated(X, X.cuda(), W, eps=1e-6)


def test_zero_rows_are_fine():
    y = spec.rms_norm(torch.empty(0, 8), W, eps=1e-6)
    dx, dw = spec.rms_norm_backward(torch.empty(0, 8), torch.empty(0, 8), W, eps=1e-6)
    assert y.shape == (0, 8) and dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8))


def test_the_smallest_fp32_eps_is_accepted():
    y = spec.rms_norm(torch.zeros(2, 8), W, eps=1.4e-45)
    assert torch.isfinite(y).all()
