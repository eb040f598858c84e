"""``normspec.backends.torch_ext``: first-party C++/CUDA kernels as torch operators.

The operators ``torch.ops.normspec.*`` (schemas declared once in
``csrc/normspec_ops.cpp``; CPU kernels in ``normspec_cpu.cpp``, CUDA kernels in
``normspec_kernels.cuh``, launched by ``normspec_launch.cu`` from
``normspec_cuda.cpp``) are bitwise equal to the spec, forward and backward.
The extension is compiled on first use (or ahead of time by
``normspec build``) and cached.

Python API (validation errors are the spec's):

* [`rms_norm`][normspec.backends.torch_ext.rms_norm]`(x, weight, *, eps, offset=0.0)`
* [`fused_add_rms_norm`][normspec.backends.torch_ext.fused_add_rms_norm]`(x, residual,
  weight, *, eps, offset=0.0, residual_sum="fp32") -> (y, new_residual)`
* [`rms_norm_gated`][normspec.backends.torch_ext.rms_norm_gated]`(x, gate, weight, *,
  eps, convention="vllm", activation="silu")`
* [`build`][normspec.backends.torch_ext.build]`(verbose=True)`,
  [`available`][normspec.backends.torch_ext.available]`() -> str | None`
"""

from __future__ import annotations

from ._build import CSRC, available, build, build_directory, cuda_build_possible, loaded
from ._ops import fused_add_rms_norm, rms_norm, rms_norm_gated
from .backend import backend

__all__ = [
    "CSRC",
    "available",
    "backend",
    "build",
    "build_directory",
    "cuda_build_possible",
    "fused_add_rms_norm",
    "loaded",
    "rms_norm",
    "rms_norm_gated",
]
