"""``flashinfer``: FlashInfer's Gemma RMSNorm kernels (CUDA only, forward only).

* ``rms_norm`` (``offset=1``): ``flashinfer.norm.gemma_rmsnorm(x, w, eps)``;
  ``offset=0``: ``flashinfer.norm.rmsnorm(x, w, eps)``.
* ``fused_add_rms_norm`` (``residual_sum="fp32"``):
  ``flashinfer.norm.gemma_fused_add_rmsnorm(x, residual, w, eps)`` (``offset=1``)
  or ``fused_add_rmsnorm`` (``offset=0``). These work **in place** — ``residual``
  becomes ``x + residual`` and ``x`` becomes the normalised output — so the
  adapter clones both inputs first and returns the clones; the caller's
  tensors are never written.

In the flashinfer releases this adapter targets (``scripts/flashinfer_offline.sh``
pins one) the default path is the CuTe-DSL kernels
(``flashinfer/norm/kernels``; ``FLASHINFER_USE_CUDA_NORM=1`` or an
architecture the DSL cannot target selects the JIT-compiled ``norm.cuh``
kernels instead). Both add in fp32, store the rounded sum as the residual and
normalise the unrounded fp32 sum; ``rstd`` is a fast-math ``rsqrt``;
``y = h · rstd · (w + weight_bias)`` in fp32, one cast. The weight must have
the input's dtype (the kernels are compiled for one element type).
FlashInfer has no backward.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport, installed_version

DISTS = ("flashinfer-python", "flashinfer")


def _version() -> str | None:
    return installed_version(*DISTS)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """2-D ``(rows, H)`` with unit last stride, as FlashInfer's kernels require."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class FlashInferBackend(Backend):
    """Adapter for FlashInfer's (gemma_)rmsnorm and (gemma_)fused_add_rmsnorm."""

    name = "flashinfer"
    install = ("pip install flashinfer-python (offline GPU machine: "
               "scripts/flashinfer_offline.sh)")
    ops = {
        "rms_norm": OpSupport(backward="none", params={"offset": (0.0, 1.0)},
                              devices=("cuda",), weight_dtypes=("same",)),
        "fused_add_rms_norm": OpSupport(
            backward="none", params={"offset": (0.0, 1.0), "residual_sum": ("fp32",)},
            devices=("cuda",), weight_dtypes=("same",),
        ),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        path = "CUDA JIT norm.cuh" if os.environ.get("FLASHINFER_USE_CUDA_NORM") == "1" \
            else "CuTe DSL kernels by default"
        return (f"flashinfer {_version() or '(not installed)'} flashinfer.norm.gemma_rmsnorm / "
                f"gemma_fused_add_rmsnorm (in place, inputs cloned; offset=0: rmsnorm / "
                f"fused_add_rmsnorm; {path})")

    def library_version(self) -> str | None:
        return _version()

    def available(self) -> str | None:
        if _version() is None:
            return "flashinfer is not installed (pip install flashinfer-python)"
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (FlashInfer's kernels are CUDA / CuTe DSL); torch sees none"
        try:
            import flashinfer.norm  # noqa: F401
        except Exception as exc:
            return f"flashinfer {_version()} failed to import: {type(exc).__name__}: {exc}"
        return None

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        x, eps = self.check_call(op, rows, weight, eps, params)
        if weight.dtype != x.dtype:
            raise TypeError(f"weight: flashinfer needs the dtype of x, {x.dtype}, "
                            f"got {weight.dtype}")
        gemma = float(params.get("offset", 0.0)) == 1.0
        import flashinfer.norm as fi

        w = weight.contiguous()
        if op == "rms_norm":
            fn = fi.gemma_rmsnorm if gemma else fi.rmsnorm
            return (fn(_rows(x), w, eps).reshape(x.shape),)
        residual = rows["residual"]
        # in place on both: work on clones, never on the caller's tensors
        out = x.reshape(-1, x.shape[-1]).clone(memory_format=torch.contiguous_format)
        res = residual.reshape(-1, x.shape[-1]).clone(memory_format=torch.contiguous_format)
        fn = fi.gemma_fused_add_rmsnorm if gemma else fi.fused_add_rmsnorm
        fn(out, res, w, eps)
        return out.reshape(x.shape), res.reshape(x.shape)


backend = FlashInferBackend()
