"""Bad inputs raise errors that name the argument, what was seen and what was expected."""

from __future__ import annotations

import math

import pytest
import torch

from normspec import spec
from normspec.spec import validation

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


class _Rows:
    """A stand-in for another library's arrays: a shape, a dtype name, a device number."""

    def __init__(self, shape, dtype="float32", device=0, dense=True):
        self.shape, self.dtype, self.device, self.dense = tuple(shape), dtype, device, dense


_ROWS = validation.ArrayKind(
    noun="a _Rows", accepts=lambda o: isinstance(o, _Rows), dtype=lambda a: a.dtype,
    shown_dtype=lambda a: a.dtype, device=lambda a: f"cuda:{a.device}",
    same_device=lambda a, b: a.device == b.device,
    contiguous=lambda a: a.dense)


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda x: validation.check_input("x", torch.ones(2, 4), _ROWS), TypeError,
     "x: expected a _Rows, got Tensor"),
    (lambda x: validation.check_input("x", _Rows((2, 4), "int8"), _ROWS), TypeError,
     "x: expected dtype in (float32, bfloat16, float16), got int8"),
    (lambda x: validation.check_input("x", _Rows((2, 0)), _ROWS), ValueError,
     "x: expected shape (..., H) with H >= 1, got (2, 0)"),
    (lambda x: validation.check_like("gate", _Rows((2, 4), device=1), x, kind=_ROWS),
     ValueError, "gate: expected the device of x, cuda:0, got cuda:1"),
    (lambda x: validation.check_like("dy", _Rows((2, 4), "float16"), x, kind=_ROWS),
     TypeError, "dy: expected the dtype of x, float32, got float16"),
    (lambda x: validation.check_weight(_Rows((5,)), x, _ROWS), ValueError,
     "weight: expected shape (4,) to match x's last dimension, got (5,)"),
    (lambda x: validation.check_weight(_Rows((4,), "float16"), x, _ROWS), TypeError,
     "weight: expected dtype float32 or x's dtype (float32), got float16"),
    (lambda x: validation.check_rstd(_Rows((2,), dense=False), x, _ROWS), ValueError,
     "rstd: expected a contiguous array"),
    (lambda x: validation.check_rstd(_Rows((4,)), x, _ROWS), ValueError,
     "rstd: expected the shape of x without its last dimension, (2,), got (4,)"),
])
def test_other_array_kinds_get_the_same_checks(call, error, words):
    """A backend's own kind of array (the cupy backend's CuPy arrays) is checked by the
    same code and messages as torch tensors, through an ArrayKind."""
    x = _Rows((2, 4))
    with pytest.raises(error) as info:
        call(x)
    assert str(info.value) == words
    assert validation.check_rstd(_Rows((2,)), x, _ROWS).shape == (2,)


@pytest.mark.parametrize("value", [
    1e-6, 1e-5, 0.1, 1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24,  # ties to even, both ways
    3.4028235677973366e38, 3.4028235677973366e38 * (1 + 2.0**-25), 3.5e38, -1e300,  # overflow
    1e-46, 2.0**-150, 2.0**-149 * 1.5, 1e-50, -0.0,  # subnormals and underflow
])
def test_as_fp32_rounds_as_torch_does(value):
    """eps and offset are checked as the kernels read them: rounded to fp32 as torch rounds."""
    got, want = validation.as_fp32(value), float(torch.tensor(value, dtype=torch.float32))
    assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)
