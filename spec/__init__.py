"""normspec.spec — the executable specification (the source of truth).

Pure-torch fp32 reference operators for the Qwen3-Next normalization layers in
which every rounding step is declared, so each input has exactly one correct
output bit pattern on every device. See [`arithmetic`][normspec.spec.arithmetic]
for the shared rules.
"""

from .arithmetic import exp_fp32, same_bits, sigmoid_fp32, silu_fp32, tree_sum, ulp_distance
from .fused_add import fused_add_rms_norm, fused_add_rms_norm_backward
from .gated import rms_norm_gated, rms_norm_gated_backward
from .presets import (
    PRESETS,
    NormPreset,
    qwen3_next_fused_add_rms_norm,
    qwen3_next_rms_norm,
    qwen3_next_rms_norm_gated,
)
from .rms_norm import rms_norm, rms_norm_backward

__all__ = [
    "PRESETS",
    "NormPreset",
    "exp_fp32",
    "fused_add_rms_norm",
    "fused_add_rms_norm_backward",
    "qwen3_next_fused_add_rms_norm",
    "qwen3_next_rms_norm",
    "qwen3_next_rms_norm_gated",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_gated",
    "rms_norm_gated_backward",
    "same_bits",
    "sigmoid_fp32",
    "silu_fp32",
    "tree_sum",
    "ulp_distance",
]
