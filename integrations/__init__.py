"""normspec.integrations — one declared set of norms in the trainer and the rollout engine.

[`transformers`][normspec.integrations.transformers] rebinds a transformers
Qwen3-Next model's norm modules; [`vllm`][normspec.integrations.vllm] is a
vLLM general plugin that replaces vLLM's norm layers before the model is
built. Both call normspec's kernels under one named
[`alignment`][normspec.integrations.alignment], so equal names give equal
bits; [`sites`][normspec.integrations.sites] captures and replays the norm
calls of either side to prove it.
"""

from .alignment import ALIGNMENTS, Alignment, AlignmentMismatchError, check_same, get_alignment
from .kernels import KERNEL_BACKENDS, NormKernels, norm_kernels

__all__ = [
    "ALIGNMENTS",
    "KERNEL_BACKENDS",
    "Alignment",
    "AlignmentMismatchError",
    "NormKernels",
    "check_same",
    "get_alignment",
    "norm_kernels",
]
