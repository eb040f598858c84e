"""Alignments: the declared conventions a trainer and a rollout engine agree on.

An alignment names the two choices on which transformers and vLLM round
differently: where the residual sum is rounded before the decoder norms
(``residual_sum`` of [`fused_add_rms_norm`][normspec.spec.fused_add.fused_add_rms_norm])
and how the GDN gated norm rounds (``convention`` of
[`rms_norm_gated`][normspec.spec.gated.rms_norm_gated]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

__all__ = ["ALIGNMENTS", "Alignment", "AlignmentMismatchError", "check_same", "get_alignment"]


@dataclass(frozen=True)
class Alignment:
    """The conventions both sides use.

    Attributes:
        name: ``"trainer"`` or ``"rollout"``.
        residual_sum: ``"rounded"`` (the norm reads the sum rounded to the model
            dtype, as transformers' decoder computes it) or ``"fp32"`` (the
            unrounded fp32 sum, as vLLM's fused add computes it).
        gated_convention: ``"hf"`` or ``"vllm"`` (see the spec's gated norm).
        offset: the weight offset of the zero-centred decoder norms, ``1 + w``.
    """

    name: str
    residual_sum: str
    gated_convention: str
    offset: float = 1.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


#: The named alignments. ``trainer`` (the default) keeps transformers'
#: semantics, so that a checkpoint trained there rolls out as trained;
#: ``rollout`` keeps vLLM's.
ALIGNMENTS: Mapping[str, Alignment] = MappingProxyType({
    "trainer": Alignment("trainer", residual_sum="rounded", gated_convention="hf"),
    "rollout": Alignment("rollout", residual_sum="fp32", gated_convention="vllm"),
})


class AlignmentMismatchError(RuntimeError):
    """Trainer and rollout were set up with different alignments."""


def get_alignment(alignment: str | Alignment) -> Alignment:
    """The alignment named ``alignment`` (an `Alignment` is returned as is)."""
    if isinstance(alignment, Alignment):
        return alignment
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment: expected one of {sorted(ALIGNMENTS)}, got {alignment!r}")
    return ALIGNMENTS[alignment]


def check_same(trainer: str | Alignment | None, rollout: str | Alignment | None) -> Alignment:
    """The common alignment of both sides; raises `AlignmentMismatchError` if they differ.

    ``None`` stands for a side that is not patched at all, which is a mismatch too.
    """
    if trainer is None or rollout is None:
        side = "trainer" if trainer is None else "rollout"
        raise AlignmentMismatchError(
            f"the {side} side is not patched by normspec; both sides need the same alignment")
    a, b = get_alignment(trainer), get_alignment(rollout)
    if a != b:
        raise AlignmentMismatchError(
            f"trainer alignment {a.as_dict()} differs from rollout alignment {b.as_dict()}")
    return a
