"""``megatron``: Megatron-Core's batch-invariant RMSNorm (CUDA only).

``megatron.core.transformer.custom_layers.batch_invariant_kernels.BatchInvariantRMSNormFn
.apply(x, weight, eps, zero_centered_gamma)`` — the autograd function that
Megatron's batch-invariant mode patches into TransformerEngine's ``RMSNorm``
(``_te_rmsnorm_forward_patched``). ``offset=1`` maps to
``zero_centered_gamma=True``, ``offset=0`` to ``False``.

Forward: ``x`` in fp32, the mean of squares by Megatron's Triton ``mean_dim``
kernel, ``torch.rsqrt``, ``(x32 · rsigma) · w32``, one cast. Backward (own
formula, ``full``): ``w_eff = weight + 1`` **in the weight's dtype** when
zero-centred, ``r³`` form of ``dx``, ``dweight`` by ``torch.sum`` over rows.

Known upstream defect, checked against the installed source at run time and
recorded in ``source``: in megatron-core 0.19.2 (and the commit read for the
research notes) the forward computes ``weight_eff = weight + 1.0`` but then
multiplies by the raw ``weight``, so ``zero_centered_gamma`` is **ignored in
the forward pass** (the backward does use ``weight + 1``). The adapter wraps
the real code as it is; the conformance report shows the consequence.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport, installed_version

DIST = "megatron-core"
MODULE = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _version(dist: str = DIST) -> str | None:
    return installed_version(dist)


@functools.lru_cache(maxsize=1)
def zero_centered_ignored_in_forward() -> bool | None:
    """Whether the installed forward drops ``zero_centered_gamma`` (``None``: unknown).

    True when ``BatchInvariantRMSNormFn.forward`` assigns ``weight_eff`` but
    never reads it again.
    """
    try:
        import importlib

        mod = importlib.import_module(MODULE)
        src = inspect.getsource(mod.BatchInvariantRMSNormFn.forward)
    except Exception:
        return None
    if "weight_eff" not in src:
        return None
    return src.count("weight_eff") == 1


class MegatronBackend(Backend):
    """Adapter for Megatron-Core ``BatchInvariantRMSNormFn`` (Triton mean, CUDA)."""

    name = "megatron"
    install = "pip install megatron-core"
    ops = {
        "rms_norm": OpSupport(backward="full", params={"offset": (0.0, 1.0)},
                              devices=("cuda",)),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        text = (f"megatron-core {_version() or '(not installed)'} {MODULE}"
                ".BatchInvariantRMSNormFn(zero_centered_gamma = offset == 1)")
        if _version() is not None and zero_centered_ignored_in_forward():
            text += " [installed forward ignores zero_centered_gamma]"
        return text

    def library_version(self) -> str | None:
        return _version()

    def available(self) -> str | None:
        if _version() is None:
            return f"{DIST} is not installed (pip install {DIST})"
        if _version("triton") is None:
            return "triton is not installed (Megatron's batch-invariant mean is Triton)"
        if not torch.cuda.is_available():
            return ("needs a CUDA GPU (BatchInvariantRMSNormFn raises on CPU tensors); "
                    "torch sees none")
        try:
            import importlib

            mod = importlib.import_module(MODULE)
        except Exception as exc:
            return f"{DIST} {_version()} failed to import {MODULE}: {type(exc).__name__}: {exc}"
        if not getattr(mod, "HAVE_TRITON", True):
            return f"{MODULE} could not import triton"
        return None

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        x, eps = self.check_call(op, rows, weight, eps, params)
        import importlib

        fn = importlib.import_module(MODULE).BatchInvariantRMSNormFn
        zero_centered = float(params.get("offset", 0.0)) == 1.0
        return (fn.apply(x, weight, eps, zero_centered),)


backend = MegatronBackend()
