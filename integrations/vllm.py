"""vLLM general plugin: every Qwen3-Next norm of vLLM runs normspec's kernels.

Registered through normspec's ``vllm.general_plugins`` entry point
(``normspec = normspec.integrations.vllm:register``), which vLLM loads in
every engine process. It does nothing unless turned on, either by the
environment (``NORMSPEC_VLLM_ALIGNMENT=trainer`` or ``rollout``, and
optionally ``NORMSPEC_VLLM_BACKEND``) or by calling
[`enable`][normspec.integrations.vllm.enable] before the engine is built
(``enable`` sets the same variables, so engine processes started later
follow). Once on:

* ``CustomOp.register_oot`` replaces ``GemmaRMSNorm`` (vLLM's Qwen3-Next
  decoder, q/k and final norms, plain and fused-add) and ``RMSNormGated``
  (the GDN output norm) with subclasses whose ``forward`` calls normspec's
  ops under the alignment; the ops have fake kernels, so they also run under
  vLLM's default compilation;
* ``Qwen3NextForCausalLM`` is registered as a subclass that, once built,
  turns off the fused CUDA paths that bypass the norm modules (the fused
  q/k-norm + RoPE + gate kernel and the fused GDN decode kernels).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from .alignment import Alignment, get_alignment
from .kernels import KERNEL_BACKENDS, norm_kernels

__all__ = ["ALIGNMENT_ENV", "BACKEND_ENV", "current", "enable", "register"]

#: Names the alignment to enable in every engine process; unset: the plugin is off.
ALIGNMENT_ENV = "NORMSPEC_VLLM_ALIGNMENT"
#: The kernel backend (``torch_ext``, the default, or ``cupy``).
BACKEND_ENV = "NORMSPEC_VLLM_BACKEND"
MODEL_ARCH = "Qwen3NextForCausalLM"

_state: dict[str, Any] = {"alignment": None, "backend": None, "registered": False}


def current() -> tuple[Alignment, str] | None:
    """``(alignment, backend)`` of this process, or ``None`` while the plugin is off."""
    if _state["alignment"] is None:
        return None
    return _state["alignment"], _state["backend"]


def register() -> None:
    """The entry point vLLM calls in each process: enables the plugin if the environment asks."""
    name = os.environ.get(ALIGNMENT_ENV)
    if name:
        enable(name, backend=os.environ.get(BACKEND_ENV, "torch_ext"))


def enable(alignment: str | Alignment = "trainer", *, backend: str = "torch_ext") -> None:
    """Turn the plugin on in this process and in engine processes started after it.

    Call before the ``LLM`` (or engine) is created: vLLM picks a layer's class
    when the model is built. Calling again with another alignment affects
    models built afterwards.
    """
    align = get_alignment(alignment)
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(KERNEL_BACKENDS)}, got {backend!r}")
    _state["alignment"], _state["backend"] = align, backend
    os.environ[ALIGNMENT_ENV] = align.name
    os.environ[BACKEND_ENV] = backend
    if not _state["registered"]:
        _register_layers()
        _state["registered"] = True


def _register_layers() -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.models import ModelRegistry

    from . import vllm_layers

    CustomOp.register_oot(vllm_layers.NormspecGemmaRMSNorm, name="GemmaRMSNorm")
    CustomOp.register_oot(vllm_layers.NormspecRMSNormGated, name="RMSNormGated")
    ModelRegistry.register_model(
        MODEL_ARCH, "normspec.integrations.vllm_layers:NormspecQwen3NextForCausalLM")


def layer_settings() -> tuple[Alignment, Any]:
    """The alignment and kernels a layer built now uses (the plugin must be on)."""
    state = current()
    if state is None:
        raise RuntimeError("normspec's vLLM plugin is off: call enable() or set "
                           f"{ALIGNMENT_ENV} before building the engine")
    alignment, backend = state
    return alignment, norm_kernels(backend)


def warn_fallback(layer: str, why: str) -> None:
    warnings.warn(f"normspec: {layer} keeps vLLM's own forward ({why})", stacklevel=3)

