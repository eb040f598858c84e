"""``vllm`` and ``vllm-cuda``: vLLM's own norm layers (the rollout side).

Layers are created the way vLLM's model code creates them for Qwen3-Next
(``vllm/model_executor/models/qwen3_next.py`` imports ``GemmaRMSNorm as
Qwen3NextRMSNorm``; ``layers/mamba/gdn/qwen_gdn_linear_attn.py`` builds
``RMSNormGated(head_v_dim, eps=..., group_size=None, norm_before_gate=True,
activation=output_gate_type)``), inside
``set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=...)))``
(the config is only needed at creation). The caller's weight is installed as
the layer's parameter (no copy, never written).

``vllm`` — the PyTorch-native paths (CPU and CUDA):

* ``rms_norm`` (``offset=1``): ``GemmaRMSNorm.forward_native(x)``, i.e.
  ``ir.ops.rms_norm(x, self.weight.float() + 1.0, eps)``: ``1 + w`` in fp32,
  ``x32 · rsqrt(mean(x32²) + eps)``, times the fp32 weight, one cast.
* ``fused_add_rms_norm`` (``offset=1``, ``residual_sum="fp32"``):
  ``GemmaRMSNorm.forward_native(x, residual)`` → ``ir.ops.fused_add_rms_norm``:
  the sum is formed in fp32, returned rounded as the new residual, and the
  **unrounded fp32 sum** is normalised (vLLM 0.33; older vLLM rounded first).
* ``rms_norm_gated`` (``convention="vllm"``, silu or sigmoid):
  ``RMSNormGated.forward_native(x, z)`` → ``forward_static``: ``x``, ``w``, ``z``
  upcast to fp32, norm, weight, gate, one cast at the end.

Outside a serving engine no IR-op priority is set, so ``vllm.ir.ops`` dispatch
to their ``native`` implementation (the bodies above).

``vllm-cuda`` — the ``forward_cuda`` paths (CUDA only):

* ``rms_norm`` / ``fused_add_rms_norm``: ``GemmaRMSNorm.forward_cuda`` (which
  calls ``forward_native``) under the IR priority vLLM installs for an eager
  CUDA engine, ``["vllm_c", "native"]``; the ``vllm_c`` kernels require the
  weight dtype to equal ``x``'s and GemmaRMSNorm's weight is the fp32
  ``1 + w``, so the ``native`` torch code runs, on the GPU. (A compiled engine
  lowers the same code through Inductor, which this adapter does not do.)
* ``rms_norm_gated``: ``RMSNormGated.forward_cuda`` →
  ``torch.ops.vllm.fla_rms_norm_gated`` → the vendored FLA Triton kernel
  ``vllm.third_party.flash_linear_attention.ops.layernorm_guard.rmsnorm_fn``.

vLLM is inference-only: backward is ``none`` for both backends.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport, installed_version

DIST = "vllm"
#: The IR-op priority vLLM's CUDA platform installs for an engine without
#: Inductor (``CudaPlatform.get_default_ir_op_priority``).
CUDA_EAGER_PRIORITY = ("vllm_c", "native")
_ACTIVATION = {"silu": "silu", "sigmoid": "sigmoid"}


def _version() -> str | None:
    return installed_version(DIST)


@functools.lru_cache(maxsize=4)
def _config(device: str):
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device=device))


@functools.lru_cache(maxsize=64)
def _layer(kind: str, hidden: int, eps: float, activation: str, device: str):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNormGated

    with set_current_vllm_config(_config(device)):
        if kind == "gemma":
            return GemmaRMSNorm(hidden, eps=eps)
        return RMSNormGated(hidden, eps=eps, group_size=None, norm_before_gate=True,
                            activation=activation, device=device)


def _with_weight(layer: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Module:
    # the layer reads self.weight only; share the caller's storage, never write it
    layer.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    return layer


class _VllmBase(Backend):
    path = "native"

    def library_version(self) -> str | None:
        return _version()

    def _import_reason(self) -> str | None:
        try:
            import vllm.model_executor.layers.layernorm  # noqa: F401
        except Exception as exc:
            return f"vllm {_version()} failed to import: {type(exc).__name__}: {exc}"
        return None

    def _run(self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor,
             eps: float, params: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        x, eps = self.check_call(op, rows, weight, eps, params)
        device = x.device.type
        if op == "rms_norm_gated":
            act = _ACTIVATION[params.get("activation", "silu")]
            layer = _with_weight(_layer("gated", x.shape[-1], eps, act, device), weight)
            fn = layer.forward_native if self.path == "native" else layer.forward_cuda
            return (fn(x, rows["gate"]),)
        layer = _with_weight(_layer("gemma", x.shape[-1], eps, "", device), weight)
        fn = layer.forward_native if self.path == "native" else layer.forward_cuda
        if op == "rms_norm":
            return (fn(x),)
        y, res = fn(x, rows["residual"])
        return y, res


class VllmBackend(_VllmBase):
    """vLLM's ``forward_native`` paths (GemmaRMSNorm, RMSNormGated); CPU and CUDA."""

    name = "vllm"
    install = "pip install vllm==0.33.0 (the CPU paths: nox -s adapters-vllm)"
    path = "native"
    ops = {
        "rms_norm": OpSupport(backward="none", params={"offset": (1.0,)}),
        "fused_add_rms_norm": OpSupport(
            backward="none", params={"offset": (1.0,), "residual_sum": ("fp32",)}
        ),
        "rms_norm_gated": OpSupport(
            backward="none", params={"convention": ("vllm",), "activation": ("silu", "sigmoid")}
        ),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        return (f"vllm {_version() or '(not installed)'} GemmaRMSNorm.forward_native "
                "(ir.ops native; residual: fp32 sum) / RMSNormGated.forward_native "
                "(norm_before_gate=True)")

    def available(self) -> str | None:
        if _version() is None:
            return f"{DIST} is not installed (pip install vllm==0.33.0; see nox -s adapters-vllm)"
        return self._import_reason()

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        return self._run(op, rows, weight, eps, params)


class VllmCudaBackend(_VllmBase):
    """vLLM's ``forward_cuda`` paths: eager IR dispatch and the vendored FLA gated kernel."""

    name = "vllm-cuda"
    install = "pip install vllm==0.33.0 (needs a CUDA GPU)"
    path = "cuda"
    ops = {
        "rms_norm": OpSupport(backward="none", params={"offset": (1.0,)}, devices=("cuda",)),
        "fused_add_rms_norm": OpSupport(
            backward="none", params={"offset": (1.0,), "residual_sum": ("fp32",)},
            devices=("cuda",),
        ),
        "rms_norm_gated": OpSupport(
            backward="none", params={"convention": ("vllm",), "activation": ("silu", "sigmoid")},
            devices=("cuda",),
        ),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        return (f"vllm {_version() or '(not installed)'} GemmaRMSNorm.forward_cuda "
                f"(ir priority {list(CUDA_EAGER_PRIORITY)}) / RMSNormGated.forward_cuda "
                "(vendored FLA layernorm_guard.rmsnorm_fn, Triton)")

    def available(self) -> str | None:
        if _version() is None:
            return f"{DIST} is not installed (pip install vllm==0.33.0)"
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (forward_cuda runs Triton / CUDA kernels); torch sees none"
        return self._import_reason()

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        self.check_call(op, rows, weight, eps, params)  # before importing vllm
        if op == "rms_norm_gated":
            return self._run(op, rows, weight, eps, params)
        from vllm import ir

        prio = list(CUDA_EAGER_PRIORITY)
        with ir.ops.rms_norm.set_priority(prio), \
                ir.ops.fused_add_rms_norm.set_priority(prio):
            return self._run(op, rows, weight, eps, params)


backend = VllmBackend()
backend_cuda = VllmCudaBackend()
