"""The vLLM layer classes the plugin installs (imported only once vLLM is)."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNormGated
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from .vllm import layer_settings, warn_fallback

__all__ = ["NormspecGemmaRMSNorm", "NormspecQwen3NextForCausalLM", "NormspecRMSNormGated",
           "disable_fused_norm_paths"]

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}


class NormspecGemmaRMSNorm(GemmaRMSNorm):
    """``GemmaRMSNorm`` computing ``(1 + w)`` RMSNorm with normspec's ops."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.normspec_alignment, self._kernels = layer_settings()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        align, k = self.normspec_alignment, self._kernels
        if residual is None:
            return k.rms_norm(x, self.weight, eps=self.variance_epsilon, offset=align.offset)
        return k.fused_add_rms_norm(x, residual, self.weight, eps=self.variance_epsilon,
                                    offset=align.offset, residual_sum=align.residual_sum)


class NormspecRMSNormGated(RMSNormGated):
    """``RMSNormGated`` (norm before gate, one group) computed with normspec's ops."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.normspec_alignment, self._kernels = layer_settings()
        self._unsupported = self._why_unsupported()
        if self._unsupported:
            warn_fallback("RMSNormGated", self._unsupported)

    def _why_unsupported(self) -> str | None:
        if not self.norm_before_gate:
            return "norm_before_gate=False"
        if self.group_size is not None and self.group_size != self.weight.shape[-1]:
            return f"group_size={self.group_size}"
        if self.activation not in _ACTIVATIONS:
            return f"activation={self.activation!r}"
        return None

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if self._unsupported or z is None:
            return super().forward(x, z)
        return self._kernels.rms_norm_gated(
            x, z, self.weight, eps=self.eps,
            convention=self.normspec_alignment.gated_convention,
            activation=_ACTIVATIONS[self.activation])


def disable_fused_norm_paths(model: torch.nn.Module) -> list[str]:
    """Turn off the fused CUDA paths that compute a norm outside its module.

    Returns the names of the modules changed.
    """
    changed = []
    for name, module in model.named_modules():
        if getattr(module, "use_fused_qk_norm_rope_gate", False):
            module.use_fused_qk_norm_rope_gate = False
            changed.append(name)
        if getattr(module, "enable_fused_gdn_spec_decode", False):
            module.enable_fused_gdn_spec_decode = False
            changed.append(name)
        if getattr(module, "gdn_decode_kernel", None) == "cuda":
            module.gdn_decode_kernel = "triton"
            changed.append(name)
    return changed


class NormspecQwen3NextForCausalLM(Qwen3NextForCausalLM):
    """vLLM's Qwen3-Next with every norm computed in its module by normspec."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.normspec_fused_paths_disabled = disable_fused_norm_paths(self)
