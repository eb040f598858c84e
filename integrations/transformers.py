"""Patch a transformers Qwen3-Next model so that its norms run normspec's kernels.

[`patch_model`][normspec.integrations.transformers.patch_model] rebinds the
``forward`` of every norm module instance (``Qwen3NextRMSNorm`` in the
decoder, q/k and final norms; ``Qwen3NextRMSNormGated``, or FLA's
``FusedRMSNormGated`` where transformers swapped it in, for the GDN output)
and returns a [`PatchReport`][normspec.integrations.transformers.PatchReport]
site by site. Instance attributes survive FSDP wrapping, so patch first and
wrap after; [`unpatch`][normspec.integrations.transformers.unpatch] restores
the class methods. [`patch_mapping`][normspec.integrations.transformers.patch_mapping]
is the transformers-native route: replacement classes for
``transformers.monkey_patching.register_patch_mapping``.

transformers' decoder adds the residual in the model dtype before calling the
norm (``hidden_states = residual + hidden_states`` in
``Qwen3NextDecoderLayer.forward``), so its decoder norms always read the
rounded sum: the ``trainer`` alignment. A norm module cannot see the unrounded
sum, so the ``rollout`` alignment (fp32 residual sum) is refused here.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .alignment import Alignment, get_alignment
from .kernels import NormKernels, norm_kernels
from .sites import SITE_KINDS, expected_site_counts, site_kind

__all__ = ["PatchReport", "PatchedSite", "patch_mapping", "patch_model", "patched_alignment",
           "unpatch", "unpatch_sites"]

_NORM = "Qwen3NextRMSNorm"
_GATED = ("Qwen3NextRMSNormGated", "FusedRMSNormGated")
_ATTR = "_normspec_patch"


@dataclass(frozen=True)
class PatchedSite:
    """One rebound norm module."""

    name: str
    kind: str
    module_class: str
    op: str


@dataclass
class PatchReport:
    """What [`patch_model`][normspec.integrations.transformers.patch_model] rebound."""

    alignment: Alignment
    backend: str
    sites: list[PatchedSite] = field(default_factory=list)
    expected: Mapping[str, int] | None = None

    def counts(self) -> dict[str, int]:
        """Patched sites per kind."""
        found = Counter(site.kind for site in self.sites)
        return {kind: found.get(kind, 0) for kind in SITE_KINDS}

    def as_dict(self) -> dict[str, Any]:
        return {"alignment": self.alignment.as_dict(), "backend": self.backend,
                "counts": self.counts(), "expected": dict(self.expected or {}),
                "sites": [vars(site) for site in self.sites]}


def _check_alignment(alignment: Alignment) -> None:
    if alignment.residual_sum != "rounded":
        raise ValueError(
            f"alignment: transformers' Qwen3NextDecoderLayer rounds the residual sum to the "
            f"model dtype before its norms, so residual_sum={alignment.residual_sum!r} "
            f"(alignment {alignment.name!r}) cannot be matched by patching norm modules; "
            f"use alignment='trainer' on both sides")


def _norm_forward(kernels: NormKernels, alignment: Alignment):
    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, eps=self.eps, offset=alignment.offset)

    return forward


def _gated_forward(kernels: NormKernels, alignment: Alignment):
    def forward(self: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        activation = getattr(self, "activation", "silu")
        activation = "silu" if activation in ("silu", "swish") else activation
        return kernels.rms_norm_gated(x, gate, self.weight, eps=eps,
                                      convention=alignment.gated_convention,
                                      activation=activation)

    return forward


def _forward_for(module: torch.nn.Module, kernels: NormKernels, alignment: Alignment):
    cls = type(module).__name__
    if cls == _NORM:
        return "rms_norm", _norm_forward(kernels, alignment)
    if cls in _GATED:
        return "rms_norm_gated", _gated_forward(kernels, alignment)
    return None, None


def patch_model(
    model: torch.nn.Module,
    *,
    alignment: str | Alignment = "trainer",
    backend: str = "torch_ext",
    strict: bool = False,
) -> PatchReport:
    """Rebind every Qwen3-Next norm of ``model`` to normspec's kernels.

    Args:
        model: a transformers Qwen3-Next model (``Qwen3NextForCausalLM``,
            ``Qwen3NextModel``, ...), before any FSDP wrapping.
        alignment: ``"trainer"`` (the only one transformers' decoder can honour;
            see the module text).
        backend: ``"torch_ext"`` (CPU and CUDA) or ``"cupy"`` (CUDA).
        strict: raise if the patched sites per kind differ from what
            ``model.config`` implies.

    Returns:
        The sites patched. A model patched twice is unpatched first.
    """
    align = get_alignment(alignment)
    _check_alignment(align)
    kernels = norm_kernels(backend)
    if getattr(model, _ATTR, None) is not None:
        unpatch(model)
    report = PatchReport(align, backend)
    for name, module in model.named_modules():
        kind = site_kind(name)
        op, forward = _forward_for(module, kernels, align)
        if kind is None or op is None:
            continue
        module.forward = types.MethodType(forward, module)
        report.sites.append(PatchedSite(name, kind, type(module).__name__, op))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "layer_types"):
        report.expected = expected_site_counts(config)
    if strict:
        if report.expected is None:
            raise ValueError("strict: model has no Qwen3-Next config to count its sites from")
        if report.counts() != dict(report.expected):
            unpatch_sites(model, report)
            raise RuntimeError(f"strict: patched sites per kind {report.counts()} differ from "
                               f"the config's {dict(report.expected)}")
    setattr(model, _ATTR, report)
    return report


def unpatch_sites(model: torch.nn.Module, report: PatchReport) -> None:
    """Restore the class ``forward`` of every site in ``report``."""
    modules = dict(model.named_modules())
    for site in report.sites:
        module = modules.get(site.name)
        if module is not None and "forward" in vars(module):
            del module.forward


def unpatch(model: torch.nn.Module) -> PatchReport | None:
    """Undo [`patch_model`][normspec.integrations.transformers.patch_model]; returns its report."""
    report = getattr(model, _ATTR, None)
    if report is None:
        return None
    unpatch_sites(model, report)
    delattr(model, _ATTR)
    return report


def patched_alignment(model: torch.nn.Module) -> Alignment | None:
    """The alignment ``model`` is patched with, or ``None``."""
    report = getattr(model, _ATTR, None)
    return None if report is None else report.alignment


def patch_mapping(
    *, alignment: str | Alignment = "trainer", backend: str = "torch_ext",
) -> dict[str, type[torch.nn.Module]]:
    """Replacement classes for ``transformers.monkey_patching.register_patch_mapping``.

    Models created after ``register_patch_mapping(patch_mapping())`` build
    normspec norms in place of ``Qwen3NextRMSNorm`` and ``Qwen3NextRMSNormGated``.
    """
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    align = get_alignment(alignment)
    _check_alignment(align)
    kernels = norm_kernels(backend)
    norm = type("NormspecQwen3NextRMSNorm", (hf.Qwen3NextRMSNorm,),
                {"forward": _norm_forward(kernels, align), "normspec_alignment": align})
    gated = type("NormspecQwen3NextRMSNormGated", (hf.Qwen3NextRMSNormGated,),
                 {"forward": _gated_forward(kernels, align), "normspec_alignment": align})
    return {_NORM: norm, _GATED[0]: gated}
