"""``transformers``: the real Qwen3-Next norm modules of HF transformers.

* ``rms_norm`` (``offset=1`` only): ``Qwen3NextRMSNorm``.
* ``fused_add_rms_norm`` (``residual_sum="rounded"``, ``offset=1``): the decoder
  layer's residual add, ``residual + hidden_states`` in the model dtype
  (``Qwen3NextDecoderLayer.forward``), then ``Qwen3NextRMSNorm`` on the sum.
* ``rms_norm_gated`` (``convention="hf"``, ``activation="silu"``):
  ``Qwen3NextRMSNormGated``.

The modules are created once per (H, eps, dtype) and called through
``torch.func.functional_call`` with the caller's weight, so gradients reach
that weight through ordinary autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport, installed_version


def _version() -> str | None:
    return installed_version("transformers")


@functools.lru_cache(maxsize=64)
def _module(kind: str, hidden: int, eps: float, dtype: torch.dtype, device: str):
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    cls = m.Qwen3NextRMSNorm if kind == "norm" else m.Qwen3NextRMSNormGated
    return cls(hidden, eps=eps).to(dtype=dtype, device=device)


class TransformersBackend(Backend):
    """Adapter for HF transformers' Qwen3-Next norms (autograd backward)."""

    name = "transformers"
    install = "pip install transformers"
    ops = {
        "rms_norm": OpSupport(backward="full", params={"offset": (1.0,)}),
        "fused_add_rms_norm": OpSupport(
            backward="full", params={"offset": (1.0,), "residual_sum": ("rounded",)}
        ),
        "rms_norm_gated": OpSupport(
            backward="full", params={"convention": ("hf",), "activation": ("silu",)}
        ),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        v = _version() or "(not installed)"
        return f"transformers {v} Qwen3NextRMSNorm / Qwen3NextRMSNormGated / decoder residual add"

    def library_version(self) -> str | None:
        return _version()

    def available(self) -> str | None:
        if _version() is None:
            return "transformers is not installed (pip install transformers)"
        try:
            from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: F401
        except Exception as exc:
            return f"transformers {_version()} has no usable qwen3_next module: {exc}"
        return None

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        self.check_call(op, rows, weight, eps, params)
        hidden = rows["x"].shape[-1]
        kind = "gated" if op == "rms_norm_gated" else "norm"
        module = _module(kind, hidden, eps, weight.dtype, str(weight.device))
        call = functools.partial(torch.func.functional_call, module, {"weight": weight})
        if op == "rms_norm":
            return (call((rows["x"],)),)
        if op == "fused_add_rms_norm":
            s = rows["residual"] + rows["x"]
            return call((s,)), s
        return (call((rows["x"], rows["gate"])),)


backend = TransformersBackend()
