"""``transformer_engine``: NVIDIA TransformerEngine's ``RMSNorm`` module (CUDA only).

``transformer_engine.pytorch.RMSNorm(H, eps=eps, zero_centered_gamma=offset == 1,
params_dtype=weight.dtype, device=...)``: TE's fused CUDA normalisation kernels
(``rmsnorm_fwd`` / ``rmsnorm_bwd``), which form ``1 + γ`` inside the kernel when
``zero_centered_gamma`` is set. Backward is TE's own (``full``).

The module owns its weight, so the adapter builds a fresh module per call,
copies the caller's weight into it and routes gradients back through a small
autograd bridge (``torch.autograd.grad`` on the module's own graph). This
avoids ``torch.func.functional_call``, whose parameter swap TE's fused-op
machinery does not promise to honour.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport, installed_version

DISTS = ("transformer_engine", "transformer-engine", "transformer_engine_torch",
         "transformer-engine-torch")


def _version() -> str | None:
    return installed_version(*DISTS)


def _module(hidden: int, eps: float, zero_centered: bool, weight: torch.Tensor):
    import transformer_engine.pytorch as te

    module = te.RMSNorm(hidden, eps=eps, zero_centered_gamma=zero_centered,
                        params_dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        module.weight.copy_(weight.detach())
    return module


class _Bridge(torch.autograd.Function):
    """Run a fresh TE module on ``x``; send its gradients to ``(x, weight)``."""

    @staticmethod
    def forward(ctx, hidden: int, eps: float, zero_centered: bool, x, weight):
        module = _module(hidden, eps, zero_centered, weight)
        with torch.enable_grad():
            xl = x.detach().requires_grad_()
            y = module(xl)
        ctx.graph = (xl, module.weight, y)
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        xl, w, y = ctx.graph
        dx, dw = torch.autograd.grad(y, [xl, w], dy)
        del ctx.graph
        return None, None, None, dx, dw


class TransformerEngineBackend(Backend):
    """Adapter for ``transformer_engine.pytorch.RMSNorm`` (CUDA kernels)."""

    name = "transformer_engine"
    install = "pip install 'transformer_engine[pytorch]' (builds against the local torch and CUDA)"
    ops = {
        "rms_norm": OpSupport(backward="full", params={"offset": (0.0, 1.0)},
                              devices=("cuda",)),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        return (f"transformer-engine {_version() or '(not installed)'} "
                "transformer_engine.pytorch.RMSNorm(zero_centered_gamma = offset == 1)")

    def library_version(self) -> str | None:
        return _version()

    def available(self) -> str | None:
        if _version() is None:
            return ("transformer-engine is not installed "
                    "(pip install 'transformer_engine[pytorch]'; needs CUDA to build/load)")
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (TransformerEngine's kernels are CUDA); torch sees none"
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as exc:
            return (f"transformer-engine {_version()} failed to import: "
                    f"{type(exc).__name__}: {exc}")
        return None

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        x, eps = self.check_call(op, rows, weight, eps, params)
        zero_centered = float(params.get("offset", 0.0)) == 1.0
        if not (x.requires_grad or weight.requires_grad) or not torch.is_grad_enabled():
            with torch.no_grad():
                return (_module(x.shape[-1], eps, zero_centered, weight)(x),)
        return (_Bridge.apply(x.shape[-1], eps, zero_centered, x, weight),)


backend = TransformerEngineBackend()
