"""Input validation shared by the spec operators and the backends.

Every error names the argument, what was seen and what was expected, so that
a failing call in a trainer or a rollout engine explains itself. The array checks read
torch tensors by default; a backend taking another kind of array (the cupy backend's CuPy
arrays) passes an [`ArrayKind`][normspec.spec.validation.ArrayKind] that says how to
read it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: The input dtypes every operator accepts, as every kind of array spells them.
INPUT_DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: The gated norm's two upstream conventions.
GATED_CONVENTIONS = ("vllm", "hf")
#: Activations of the gated norm.
ACTIVATIONS = ("silu", "sigmoid")
#: Rounding conventions of the fused residual add.
RESIDUAL_SUMS = ("fp32", "rounded")


@dataclass(frozen=True)
class ArrayKind:
    """How the checks read one kind of array.

    ``noun`` names the kind in errors ("a torch.Tensor"); ``accepts`` tells whether an
    object is of the kind; ``dtype`` gives an array's dtype as a plain name ("bfloat16"),
    ``shown_dtype`` as errors print it; ``device`` gives its device as a string
    ("cuda:0"), ``same_device`` whether two arrays share one; ``contiguous`` whether its
    elements are dense in row-major order.
    """

    noun: str
    accepts: Callable[[object], bool]
    dtype: Callable[[Any], str]
    shown_dtype: Callable[[Any], str]
    device: Callable[[Any], str]
    same_device: Callable[[Any, Any], bool]
    contiguous: Callable[[Any], bool]


_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                      torch.float16: "float16"}
#: torch tensors, the kind every spec operator takes.
TORCH_TENSORS = ArrayKind(
    noun="a torch.Tensor",
    accepts=lambda obj: isinstance(obj, torch.Tensor),
    dtype=lambda t: _TORCH_DTYPE_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch."),
    shown_dtype=lambda t: str(t.dtype),
    device=lambda t: str(t.device),
    same_device=lambda a, b: a.device == b.device,
    contiguous=lambda t: t.is_contiguous(),
)


def _type_name(obj: object) -> str:
    return type(obj).__name__


def _expect_kind(name: str, obj: object, kind: ArrayKind) -> None:
    if not kind.accepts(obj):
        raise TypeError(f"{name}: expected {kind.noun}, got {_type_name(obj)}")


def check_input(name: str, x: Any, kind: ArrayKind = TORCH_TENSORS) -> Any:
    """``x`` must be a floating array of at least one dimension and ``H >= 1``."""
    _expect_kind(name, x, kind)
    if kind.dtype(x) not in INPUT_DTYPE_NAMES:
        raise TypeError(f"{name}: expected dtype in ({', '.join(INPUT_DTYPE_NAMES)}), "
                        f"got {kind.shown_dtype(x)}")
    if len(x.shape) < 1 or x.shape[-1] < 1:
        raise ValueError(
            f"{name}: expected shape (..., H) with H >= 1, got {tuple(x.shape)}"
        )
    return x


def check_like(name: str, t: Any, x: Any, x_name: str = "x",
               kind: ArrayKind = TORCH_TENSORS) -> Any:
    """``t`` must have ``x``'s kind, shape, dtype and device."""
    _expect_kind(name, t, kind)
    if tuple(t.shape) != tuple(x.shape):
        raise ValueError(
            f"{name}: expected the shape of {x_name}, {tuple(x.shape)}, got {tuple(t.shape)}"
        )
    if kind.dtype(t) != kind.dtype(x):
        raise TypeError(f"{name}: expected the dtype of {x_name}, {kind.shown_dtype(x)}, "
                        f"got {kind.shown_dtype(t)}")
    _expect_device(name, t, x, x_name, kind)
    return t


def check_weight(weight: Any, x: Any, kind: ArrayKind = TORCH_TENSORS) -> Any:
    """``weight`` must be 1-D of length ``H``, fp32 or ``x``'s dtype, on ``x``'s device."""
    _expect_kind("weight", weight, kind)
    hidden = x.shape[-1]
    if len(weight.shape) != 1 or weight.shape[0] != hidden:
        raise ValueError(
            f"weight: expected shape ({hidden},) to match x's last dimension, "
            f"got {tuple(weight.shape)}"
        )
    if kind.dtype(weight) not in ("float32", kind.dtype(x)):
        raise TypeError(f"weight: expected dtype float32 or x's dtype ({kind.shown_dtype(x)}), "
                        f"got {kind.shown_dtype(weight)}")
    _expect_device("weight", weight, x, "x", kind)
    return weight


def check_rstd(rstd: Any, x: Any, kind: ArrayKind = TORCH_TENSORS) -> Any:
    """A forward's ``rstd`` handed to a backward: float32, ``x``'s shape without its last
    dimension, contiguous, on ``x``'s device."""
    _expect_kind("rstd", rstd, kind)
    if kind.dtype(rstd) != "float32":
        raise TypeError(f"rstd: expected dtype float32, got {kind.dtype(rstd)}")
    want = tuple(x.shape[:-1])
    if tuple(rstd.shape) != want:
        raise ValueError("rstd: expected the shape of x without its last dimension, "
                         f"{want}, got {tuple(rstd.shape)}")
    if not kind.contiguous(rstd):
        raise ValueError("rstd: expected a contiguous array")
    _expect_device("rstd", rstd, x, "x", kind)
    return rstd


def _expect_device(name: str, t: Any, x: Any, x_name: str, kind: ArrayKind) -> None:
    if not kind.same_device(t, x):
        raise ValueError(
            f"{name}: expected the device of {x_name}, {kind.device(x)}, got {kind.device(t)}"
        )


def as_fp32(value: float) -> float:
    """``value`` rounded to fp32 (round to nearest, ties to even), as the kernels use it;
    ±inf where it overflows. (``struct``'s fp32 packing is C's ``(float)`` conversion:
    a fraction of the cost of a torch scalar, on every operator call.)"""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_eps(eps: object) -> float:
    """``eps`` must be a real number that is finite and ``> 0`` in fp32, where it is used
    (``1e-50`` rounds to 0 and ``1e300`` to inf there)."""
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        raise TypeError(f"eps: expected a positive float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a finite value > 0, got {eps!r}")
    rounded = as_fp32(eps)
    if not math.isfinite(rounded) or rounded <= 0:
        raise ValueError(f"eps: expected a value that is finite and > 0 in fp32, got {eps!r} "
                         f"(it rounds to {rounded!r} in fp32)")
    return float(eps)


def check_offset(offset: object) -> float:
    """``offset`` must be a real number that is finite in fp32 (0.0 or 1.0 in practice)."""
    if isinstance(offset, bool) or not isinstance(offset, int | float):
        raise TypeError(f"offset: expected a float, got {type(offset).__name__}")
    if not math.isfinite(offset):
        raise ValueError(f"offset: expected a finite value, got {offset!r}")
    if not math.isfinite(as_fp32(offset)):
        raise ValueError(f"offset: expected a value that is finite in fp32, got {offset!r} "
                         "(it rounds to inf in fp32)")
    return float(offset)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return str(value)
