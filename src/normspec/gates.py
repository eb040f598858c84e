"""Gates: comparisons of a backend's tensors with the spec and with itself.

Tolerances are data ([`TOLERANCES`][normspec.gates.TOLERANCES]), not
assertions in test bodies. Every failing comparison yields one readable line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from normspec.spec.arithmetic import same_bits, ulp_distance

__all__ = ["LEVELS", "TOLERANCES", "Comparison", "Tolerance", "compare", "identical",
           "level_of"]

#: Conformance levels, best first.
LEVELS = ("exact", "invariant", "accurate", "fails")


@dataclass(frozen=True)
class Tolerance:
    """Contract tolerance: ``|got − ref| <= atol_rms · scale + rtol · |ref|``.

    ``scale`` is the reference tensor's root mean square (for gradients at
    least the incoming gradient's), so that gradients, whose size depends on
    the inputs, are judged fairly.
    """

    rtol: float
    atol_rms: float


#: The contract tolerance per (kind, dtype): kind is ``forward`` or ``gradient``.
TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    ("forward", torch.float32): Tolerance(rtol=1e-5, atol_rms=1e-6),
    ("forward", torch.bfloat16): Tolerance(rtol=1.6e-2, atol_rms=1e-3),
    ("forward", torch.float16): Tolerance(rtol=2e-3, atol_rms=1e-4),
    ("gradient", torch.float32): Tolerance(rtol=1e-4, atol_rms=1e-4),
    ("gradient", torch.bfloat16): Tolerance(rtol=3.2e-2, atol_rms=2e-2),
    ("gradient", torch.float16): Tolerance(rtol=4e-3, atol_rms=4e-3),
}


@dataclass(frozen=True)
class Comparison:
    """Statistics of one tensor against its reference.

    ``bitwise`` and ``equal_fraction`` count equal bit patterns
    ([`same_bits`][normspec.spec.arithmetic.same_bits]: a NaN matches any
    NaN, ``-0.0`` does not match ``+0.0``); ``signed_zeros`` counts the
    elements that differ only in the sign of a zero, which ``max_ulp`` and
    ``max_abs`` (both 0 there) cannot show.
    """

    tensor: str
    bitwise: bool
    within_tolerance: bool
    equal_fraction: float
    max_ulp: int
    max_abs: float
    max_rel: float
    numel: int
    signed_zeros: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def compare(
    name: str, got: torch.Tensor, ref: torch.Tensor, kind: str, *, scale_floor: float = 0.0
) -> Comparison:
    """Compare ``got`` with ``ref`` (same dtype and shape expected).

    ``scale_floor`` is a lower bound for the scale that ``atol_rms`` multiplies:
    the harness passes the RMS of the incoming gradient for gradient
    comparisons, since a gradient that cancels to nearly zero (``dx`` for
    ``H = 1``) has no meaningful scale of its own.
    """
    got, ref = got.detach(), ref.detach()
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return Comparison(name, False, False, 0.0, -1, float("inf"), float("inf"), ref.numel())
    if ref.numel() == 0:
        return Comparison(name, True, True, 1.0, 0, 0.0, 0.0, 0)
    d = ulp_distance(got, ref)
    same = same_bits(got, ref)
    g64, r64 = got.double(), ref.double()
    both_nan = torch.isnan(g64) & torch.isnan(r64)
    same_inf = torch.isinf(r64) & (g64 == r64)
    diff = torch.where(both_nan | same_inf, torch.zeros_like(g64), (g64 - r64).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"))
    finite = torch.isfinite(r64)
    n_finite = finite.sum()
    square_sum = torch.where(finite, r64, torch.zeros_like(r64)).square().sum()
    rms = (square_sum / n_finite.clamp(min=1)).sqrt()
    if scale_floor > 0:  # (a NaN floor is ignored, as max(rms, nan) was)
        rms = rms.clamp(min=scale_floor)
    tol = TOLERANCES[(kind, ref.dtype)]
    bound = tol.atol_rms * rms + tol.rtol * torch.nan_to_num(r64.abs(), posinf=0.0)
    rel = diff / torch.where(r64.abs() > 0, r64.abs(), torch.ones_like(r64))
    # every statistic in one float64 vector, read with one sync: the counts (not means:
    # CUDA's mean multiplies by 1/numel, so an all-equal tensor could read
    # 0.9999999999999999) and ulp distances below 2**32 are exact there
    n_equal, n_zero_ulp, all_within, max_ulp, max_abs, max_rel = torch.stack([
        same.sum().double(), (d == 0).sum().double(), torch.all(diff <= bound).double(),
        d.max().double(), diff.max(), torch.nan_to_num(rel, nan=float("inf")).max(),
    ]).tolist()
    bitwise = n_equal == ref.numel()
    return Comparison(
        tensor=name,
        bitwise=bitwise,
        within_tolerance=bitwise or all_within == 1.0,
        equal_fraction=n_equal / ref.numel(),
        max_ulp=int(max_ulp),
        max_abs=max_abs,
        max_rel=max_rel,
        numel=ref.numel(),
        signed_zeros=int(n_zero_ulp - n_equal),
    )


def identical(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``got`` has ``ref``'s shape, dtype and bits
    ([`same_bits`][normspec.spec.arithmetic.same_bits]): what ``compare`` calls
    ``bitwise``, in a few kernels and one sync, for the many comparisons that only need
    that answer unless it is no."""
    got, ref = got.detach(), ref.detach()
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    return ref.numel() == 0 or bool(same_bits(got, ref).all())


def level_of(*, crashed: bool, within: bool, bitwise: bool, invariant: bool) -> str:
    """The conformance level from the gate outcomes."""
    if crashed or not within:
        return "fails"
    if bitwise and invariant:
        return "exact"
    return "invariant" if invariant else "accurate"
