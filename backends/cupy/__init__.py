"""``normspec.backends.cupy``: the first-party CUDA kernels through CuPy and NVRTC.

The kernels are the torch extension's own (``backends/csrc``), compiled by NVRTC with its
IEEE flags into one module per (operator, dtype, direction), cached on disk, and launched
with the C++ launcher's grids, blocks and shared memory. Inputs are CUDA torch tensors
(differentiable; torch's current stream) or CuPy arrays (CuPy's current stream); the
result has the input's kind. Every kernel gives the spec's bits.

| Setting | What it does |
|---|---|
| ``NORMSPEC_CUPY_CACHE_DIR`` | the compiled modules' folder |

Without it the modules are cached in ``$CUPY_CACHE_DIR/normspec``, else in
``~/.cupy/kernel_cache/normspec``. ``$MAX_JOBS`` caps the NVRTC compiles run at once.

Modules, one job each: ``codes`` (the kernels' operator, dtype and flag codes),
``geometry`` and ``planner`` (the launch plan, the Python twin of ``normspec_plan.h``),
``launches`` (each plan's kernel by name, each module's kernels), ``nvrtc``
(compile and disk cache), ``device`` (per-device state: modules, properties, kept plans),
``driver`` (argument packing, ``cuLaunchKernelEx``), ``arrays`` (torch and CuPy inputs),
``plans`` (a call's launches, kept per shape), ``run`` (one call's launches), ``ops``
(checks, autograd, the public functions) and ``entry`` (``available()``, ``backend``).
"""

from __future__ import annotations

from .device import clear_launch_plans
from .entry import CupyBackend, available, backend
from .launches import MODULES, PARTS, name_expressions
from .nvrtc import CSRC, NVRTC_OPTIONS, NVRTCCompileError, compile_kernels, compile_modules
from .ops import (
    fused_add_rms_norm,
    fused_add_rms_norm_backward,
    fused_add_rms_norm_backward_from_sum,
    fused_add_rms_norm_with_rstd,
    rms_norm,
    rms_norm_backward,
    rms_norm_gated,
    rms_norm_gated_backward,
    rms_norm_gated_with_rstd,
    rms_norm_with_rstd,
)

__all__ = [
    "CSRC",
    "MODULES",
    "NVRTC_OPTIONS",
    "PARTS",
    "CupyBackend",
    "NVRTCCompileError",
    "available",
    "backend",
    "clear_launch_plans",
    "compile_kernels",
    "compile_modules",
    "fused_add_rms_norm",
    "fused_add_rms_norm_backward",
    "fused_add_rms_norm_backward_from_sum",
    "fused_add_rms_norm_with_rstd",
    "name_expressions",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_gated",
    "rms_norm_gated_backward",
    "rms_norm_gated_with_rstd",
    "rms_norm_with_rstd",
]
