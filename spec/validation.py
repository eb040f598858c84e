"""Input validation shared by the spec operators.

Every error names the argument, what was seen and what was expected, so that
a failing call in a trainer or a rollout engine explains itself.
"""

from __future__ import annotations

import math

import torch

#: Input dtypes every operator accepts.
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The gated norm's two upstream conventions.
GATED_CONVENTIONS = ("vllm", "hf")
#: Activations of the gated norm.
ACTIVATIONS = ("silu", "sigmoid")
#: Rounding conventions of the fused residual add.
RESIDUAL_SUMS = ("fp32", "rounded")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_input(name: str, x: object) -> torch.Tensor:
    """``x`` must be a floating tensor of at least one dimension and ``H >= 1``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: expected dtype in ({_names(INPUT_DTYPES)}), got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(
            f"{name}: expected shape (..., H) with H >= 1, got {tuple(x.shape)}"
        )
    return x


def check_like(name: str, t: object, x: torch.Tensor, x_name: str = "x") -> torch.Tensor:
    """``t`` must have ``x``'s shape, dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(x.shape):
        raise ValueError(
            f"{name}: expected the shape of {x_name}, {tuple(x.shape)}, got {tuple(t.shape)}"
        )
    if t.dtype != x.dtype:
        raise TypeError(f"{name}: expected the dtype of {x_name}, {x.dtype}, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(
            f"{name}: expected the device of {x_name}, {x.device}, got {t.device}"
        )
    return t


def check_weight(weight: object, x: torch.Tensor) -> torch.Tensor:
    """``weight`` must be 1-D of length ``H``, fp32 or ``x``'s dtype, on ``x``'s device."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(
            f"weight: expected shape ({hidden},) to match x's last dimension, "
            f"got {tuple(weight.shape)}"
        )
    allowed = (torch.float32, x.dtype)
    if weight.dtype not in allowed:
        raise TypeError(
            f"weight: expected dtype float32 or x's dtype ({x.dtype}), got {weight.dtype}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight: expected the device of x, {x.device}, got {weight.device}")
    return weight


def as_fp32(value: float) -> float:
    """``value`` rounded to fp32 (round to nearest, ties to even), as the kernels use it."""
    return float(torch.tensor(value, dtype=torch.float32))


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
