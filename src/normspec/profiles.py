"""Conformance profiles: device × dtype × shapes × seeds, as data.

Shapes are ``(rows, H)``: the Qwen3-Next widths (hidden 2048, q/k head 256,
GDN value head 128) and odd sizes (H = 1, H not a multiple of 8, H = 8192).
``--quick`` keeps CI short: fewer shapes, one seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PROFILES", "Profile", "get_profile"]

# Row counts stay small: the "batch" transform calls the backend once per row,
# and a 2-core CPU must finish the full CPU run in a few minutes.
SHAPES_FULL = {
    "rms_norm": ((24, 2048), (32, 256), (5, 1), (12, 1003), (4, 8192)),
    "fused_add_rms_norm": ((24, 2048), (5, 1), (12, 1003), (4, 8192)),
    "rms_norm_gated": ((40, 128), (5, 1), (12, 1003), (4, 8192)),
}
SHAPES_QUICK = {
    "rms_norm": ((16, 2048), (3, 1), (9, 1003)),
    "fused_add_rms_norm": ((16, 2048), (9, 1003)),
    "rms_norm_gated": ((24, 128), (3, 1), (9, 1003)),
}


@dataclass(frozen=True)
class Profile:
    """One conformance profile."""

    name: str
    device: str
    dtype: torch.dtype

    def shapes(self, op: str, quick: bool = False) -> tuple[tuple[int, int], ...]:
        return (SHAPES_QUICK if quick else SHAPES_FULL)[op]

    def seeds(self, quick: bool = False, count: int | None = None) -> tuple[int, ...]:
        n = count if count is not None else (1 if quick else 2)
        return tuple(range(n))

    def weight_dtypes(self) -> tuple[str, ...]:
        return ("fp32",) if self.dtype == torch.float32 else ("fp32", "same")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


#: Every profile by name.
PROFILES = {
    p.name: p
    for p in (
        Profile("cpu_fp32", "cpu", torch.float32),
        Profile("cpu_bf16", "cpu", torch.bfloat16),
        Profile("cuda_fp32", "cuda", torch.float32),
        Profile("cuda_bf16", "cuda", torch.bfloat16),
        Profile("cuda_fp16", "cuda", torch.float16),
    )
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; the error lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"profile: unknown profile {name!r}; expected one of {sorted(PROFILES)}"
        ) from None
