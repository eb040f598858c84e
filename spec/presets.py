"""Named Qwen3-Next presets used by reports and docs.

Values from transformers `Qwen3NextConfig` defaults: `hidden_size=2048`,
`rms_norm_eps=1e-6`, `head_dim=256` (q/k norm width), `linear_value_head_dim=128`
(the GDN output norm's width, one row per value head).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .fused_add import fused_add_rms_norm, fused_add_rms_norm_backward
from .gated import rms_norm_gated, rms_norm_gated_backward
from .rms_norm import rms_norm, rms_norm_backward

__all__ = [
    "PRESETS",
    "NormPreset",
    "qwen3_next_fused_add_rms_norm",
    "qwen3_next_rms_norm",
    "qwen3_next_rms_norm_gated",
]


@dataclass(frozen=True)
class NormPreset:
    """A spec operator bound to a model's keyword arguments and row widths.

    Calling the preset calls ``op`` with ``kwargs`` merged under the caller's
    own keyword arguments.
    """

    name: str
    op: Callable[..., Any]
    backward: Callable[..., Any]
    kwargs: Mapping[str, Any]
    widths: Mapping[str, int] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **{**self.kwargs, **kwargs})

    def grad(self, *args: Any, **kwargs: Any) -> Any:
        """The declared backward with the preset's keyword arguments."""
        return self.backward(*args, **{**self.kwargs, **kwargs})


qwen3_next_rms_norm = NormPreset(
    name="qwen3_next_rms_norm",
    op=rms_norm,
    backward=rms_norm_backward,
    kwargs=MappingProxyType({"eps": 1e-6, "offset": 1.0}),
    widths=MappingProxyType({"hidden": 2048, "qk_head": 256}),
)
qwen3_next_fused_add_rms_norm = NormPreset(
    name="qwen3_next_fused_add_rms_norm",
    op=fused_add_rms_norm,
    backward=fused_add_rms_norm_backward,
    kwargs=MappingProxyType({"eps": 1e-6, "offset": 1.0, "residual_sum": "rounded"}),
    widths=MappingProxyType({"hidden": 2048}),
)
qwen3_next_rms_norm_gated = NormPreset(
    name="qwen3_next_rms_norm_gated",
    op=rms_norm_gated,
    backward=rms_norm_gated_backward,
    kwargs=MappingProxyType({"eps": 1e-6, "convention": "hf", "activation": "silu"}),
    widths=MappingProxyType({"head_v": 128}),
)

#: Every preset by name.
PRESETS: Mapping[str, NormPreset] = MappingProxyType(
    {p.name: p for p in (qwen3_next_rms_norm, qwen3_next_fused_add_rms_norm,
                         qwen3_next_rms_norm_gated)}
)
