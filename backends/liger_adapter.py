"""``liger``: LinkedIn Liger-Kernel's Triton RMSNorm kernels (CUDA only).

* ``rms_norm``: ``liger_kernel.ops.rms_norm.LigerRMSNormFunction.apply(x, w, eps,
  offset, "gemma", False, None)``. Casting mode ``"gemma"`` upcasts ``x`` and
  ``w`` to fp32, forms ``offset + w`` in fp32 inside the kernel and casts once
  (the Qwen3-Next / Gemma order); ``rstd`` is Triton's ``rsqrt`` of the mean of
  squares.
* ``fused_add_rms_norm`` (``residual_sum="rounded"``):
  ``liger_kernel.ops.fused_add_rms_norm.LigerFusedAddRMSNormFunction.apply(x,
  residual, w, eps, offset, "gemma", False)``. The kernel adds ``x + residual``
  from the raw loads *in the input dtype*, stores that rounded sum as the new
  residual and normalises the rounded sum.

``in_place`` is passed as ``False`` to both: Liger's default for the plain
norm (``True``) writes ``dx`` into the caller's ``dy`` during backward.
Backward is Liger's own (``dx``, ``dresidual``, ``dweight``; ``dweight`` is a
sum of one fp32 partial per SM, then cast to the weight dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport, installed_version

DIST = "liger-kernel"


def _version(dist: str = DIST) -> str | None:
    return installed_version(dist)


class LigerBackend(Backend):
    """Adapter for Liger-Kernel's RMSNorm / fused add + RMSNorm (Triton, CUDA)."""

    name = "liger"
    install = "pip install liger-kernel"
    ops = {
        "rms_norm": OpSupport(backward="full", params={"offset": (0.0, 1.0)},
                              devices=("cuda",)),
        "fused_add_rms_norm": OpSupport(
            backward="full", params={"offset": (0.0, 1.0), "residual_sum": ("rounded",)},
            devices=("cuda",),
        ),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        return (f"liger-kernel {_version() or '(not installed)'} "
                "LigerRMSNormFunction / LigerFusedAddRMSNormFunction "
                "(casting_mode='gemma', offset, in_place=False)")

    def library_version(self) -> str | None:
        return _version()

    def available(self) -> str | None:
        if _version() is None:
            return f"{DIST} is not installed (pip install {DIST})"
        if _version("triton") is None:
            return "triton is not installed (Liger's kernels are Triton)"
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (Liger's kernels are Triton); torch sees none"
        try:
            import liger_kernel.ops.fused_add_rms_norm
            import liger_kernel.ops.rms_norm  # noqa: F401
        except Exception as exc:
            return f"{DIST} {_version()} failed to import: {type(exc).__name__}: {exc}"
        return None

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        x, eps = self.check_call(op, rows, weight, eps, params)
        offset = float(params.get("offset", 0.0))
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return (LigerRMSNormFunction.apply(x, weight, eps, offset, "gemma", False, None),)
        residual = rows["residual"]
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        y, s = LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, offset, "gemma",
                                                  False)
        return y, s


backend = LigerBackend()
