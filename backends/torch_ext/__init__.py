"""``normspec.backends.torch_ext``: first-party C++/CUDA kernels as torch operators.

The operators ``torch.ops.normspec.*`` are bitwise equal to the spec, forward and
backward. Their schemas are declared once in ``csrc/normspec_ops.cpp``; the CPU kernels
live in ``normspec_cpu.cpp``, the CUDA kernels in ``normspec_kernels.cuh`` (register and
streaming kernels), ``normspec_pipe.cuh`` (the pipelined kernels for 16-byte aligned
rows) and ``normspec_gated_bwd.cuh``, launched by ``normspec_launch.cu`` from
``normspec_cuda.cpp``. The CuPy backend compiles the same kernel sources with NVRTC and
makes the same launches.

The extension is compiled on first use, or ahead of time by ``normspec build``
(``torch.utils.cpp_extension``; each op, direction and dtype is a translation unit of its
own, ``csrc/launch_units/*.cu``, compiled side by side), and cached. The CPU kernels are
always built, the CUDA kernels where torch sees a GPU and ``nvcc`` is found.

When autograd records a call, the forward also returns rstd (fp32, one value per row)
and the backward reads it instead of recomputing it (the same bits). A fused add whose
new residual is the very sum the norm read (``residual_sum="rounded"``, or float32 rows)
saves that one tensor, and its backward writes one gradient row for both ``dx`` and
``dresidual``.

| Setting | What it does |
|---|---|
| ``NORMSPEC_BUILD_DIR`` | the build cache's folder |

Without it the build is cached in ``$TORCH_EXTENSIONS_DIR/normspec``, else in
``~/.cache/normspec/torch_ext``, one sub-directory per torch, CUDA and Python version.

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
