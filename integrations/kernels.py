"""The differentiable norm kernels the integrations call, chosen by backend name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["KERNEL_BACKENDS", "NormKernels", "norm_kernels"]

#: Backend name -> module exposing ``rms_norm``, ``fused_add_rms_norm`` and
#: ``rms_norm_gated`` with the spec's signatures and autograd.
KERNEL_BACKENDS = {
    "torch_ext": "normspec.backends.torch_ext",
    "cupy": "normspec.backends.cupy",
}


class NormKernels(NamedTuple):
    """One backend's three operators (each bitwise equal to the spec)."""

    backend: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rms_norm_gated: Callable


def norm_kernels(backend: str = "torch_ext") -> NormKernels:
    """The operators of ``backend`` (``"torch_ext"``: CPU and CUDA; ``"cupy"``: CUDA)."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(KERNEL_BACKENDS)}, got {backend!r}")
    module = importlib.import_module(KERNEL_BACKENDS[backend])
    return NormKernels(backend, module.rms_norm, module.fused_add_rms_norm,
                       module.rms_norm_gated)
