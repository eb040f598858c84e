"""``reference``: the executable spec itself, on any device.

Forward is the spec operator; gradients are the spec's explicit backward
functions, wired into autograd through one ``torch.autograd.Function``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from normspec import __version__
from normspec.ops import OPS
from normspec.registry import Backend, OpSupport


class _SpecFunction(torch.autograd.Function):
    """Autograd bridge: forward = spec op, backward = the spec's declared backward."""

    @staticmethod
    def forward(ctx, op_name: str, eps: float, params: dict, weight, *rows):
        op = OPS[op_name]
        ctx.op_name, ctx.eps, ctx.params = op_name, eps, params
        ctx.save_for_backward(weight, *rows)
        with torch.no_grad():
            out = op.forward(*rows, weight, eps=eps, **params)
        return out if isinstance(out, tuple) else (out,)

    @staticmethod
    def backward(ctx, *grad_outputs):
        op = OPS[ctx.op_name]
        weight, *rows = ctx.saved_tensors
        grads = [
            g if g is not None else torch.zeros_like(rows[0]) for g in grad_outputs
        ]
        *row_grads, dweight = op.backward(*grads, *rows, weight, eps=ctx.eps, **ctx.params)
        return (None, None, None, dweight, *row_grads)


class ReferenceBackend(Backend):
    """The spec as a backend: exact by definition, on the CPU and on CUDA."""

    name = "reference"
    install = "ships with normspec"
    source = f"normspec {__version__} spec (pure torch, declared rounding)"
    ops = {name: OpSupport(backward="full") for name in OPS}

    def library_version(self) -> str:
        return __version__

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        ordered = [rows[name] for name in OPS[op].row_inputs]
        return _SpecFunction.apply(op, eps, dict(params), weight, *ordered)


backend = ReferenceBackend()
