"""Operator descriptions: each spec operator as a declarative record.

An [`OpDef`][normspec.ops.OpDef] says which row tensors an operator takes
and returns, which gradients it has, which parameter variants exist and how
sample inputs are drawn — the data the registry, the gates, the harness and
the tests share (in the spirit of PyTorch's OpInfo).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from normspec import spec

__all__ = ["OPS", "OpDef", "Sample", "get_op", "variant_name"]

Params = Mapping[str, Any]


def variant_name(params: Params) -> str:
    """A short stable name for a parameter set, e.g. ``convention=hf,activation=silu``."""
    return ",".join(f"{k}={v}" for k, v in params.items()) or "default"


@dataclass(frozen=True)
class Sample:
    """One set of inputs for an operator."""

    rows: dict[str, torch.Tensor]
    weight: torch.Tensor
    params: dict[str, Any]
    eps: float

    def row_list(self, op: OpDef) -> list[torch.Tensor]:
        return [self.rows[name] for name in op.row_inputs]


@dataclass(frozen=True)
class OpDef:
    """A spec operator described as data.

    Attributes:
        name: the operator's name (``rms_norm``, ``fused_add_rms_norm``, ``rms_norm_gated``).
        row_inputs: names of the ``(..., H)`` inputs, in call order, before ``weight``.
        outputs: names of the forward outputs.
        row_grads: names of the row-shaped gradients (one per row input).
        variants: the parameter sets a conformance run covers.
        forward: the spec forward, ``forward(*rows, weight, eps=, **params)``.
        backward: the spec backward,
            ``backward(*grad_outputs, *rows, weight, eps=, **params)`` returning
            ``(*row_grads, dweight)``.
    """

    name: str
    row_inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    row_grads: tuple[str, ...]
    variants: tuple[Params, ...]
    forward: Callable[..., Any]
    backward: Callable[..., Any]

    def spec_forward(self, sample: Sample) -> tuple[torch.Tensor, ...]:
        out = self.forward(
            *sample.row_list(self), sample.weight, eps=sample.eps, **sample.params
        )
        return out if isinstance(out, tuple) else (out,)

    def spec_backward(
        self, sample: Sample, grad_outputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        return self.backward(
            *grad_outputs, *sample.row_list(self), sample.weight, eps=sample.eps,
            **sample.params,
        )

    def make_sample(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        params: Params,
        seed: int,
        weight_dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        eps: float = 1e-6,
        special_values: bool = False,
    ) -> Sample:
        """Draw inputs of ``shape`` (``(..., H)``) deterministically from ``seed``.

        Values are drawn in fp32 on the CPU and then cast, so a seed gives the
        same inputs on every device. ``special_values`` sprinkles zeros,
        subnormals, huge values, ±inf and NaN into ``x``.
        """
        gen = torch.Generator().manual_seed(seed)
        hidden = shape[-1]
        rows: dict[str, torch.Tensor] = {}
        scales = {"x": 1.0, "residual": 1.0, "gate": 2.0}
        for name in self.row_inputs:
            rows[name] = torch.randn(*shape, generator=gen) * scales[name]
        if special_values and rows["x"].numel():
            x = rows["x"].reshape(-1)
            idx = torch.randint(0, x.numel(), (8,), generator=gen)
            specials = torch.tensor(
                [0.0, -0.0, 1e-40, -3e-39, 3e38, float("inf"), float("-inf"), float("nan")]
            )
            x[idx] = specials
        centred = params.get("offset", 0.0) == 1.0
        w = torch.randn(hidden, generator=gen) * 0.1
        weight = w if centred else 1.0 + w
        wdtype = weight_dtype or dtype
        return Sample(
            rows={k: v.to(dtype).to(device) for k, v in rows.items()},
            weight=weight.to(wdtype).to(device),
            params=dict(params),
            eps=eps,
        )


def _grid(**choices: Sequence[Any]) -> tuple[Params, ...]:
    keys = list(choices)
    return tuple(dict(zip(keys, combo, strict=True)) for combo in itertools.product(
        *(choices[k] for k in keys)
    ))


#: Every operator of the spec.
OPS: Mapping[str, OpDef] = {
    op.name: op
    for op in (
        OpDef(
            name="rms_norm",
            row_inputs=("x",),
            outputs=("y",),
            row_grads=("dx",),
            variants=_grid(offset=(0.0, 1.0)),
            forward=spec.rms_norm,
            backward=spec.rms_norm_backward,
        ),
        OpDef(
            name="fused_add_rms_norm",
            row_inputs=("x", "residual"),
            outputs=("y", "residual_out"),
            row_grads=("dx", "dresidual"),
            variants=_grid(offset=(0.0, 1.0), residual_sum=("fp32", "rounded")),
            forward=spec.fused_add_rms_norm,
            backward=spec.fused_add_rms_norm_backward,
        ),
        OpDef(
            name="rms_norm_gated",
            row_inputs=("x", "gate"),
            outputs=("y",),
            row_grads=("dx", "dgate"),
            variants=_grid(convention=("vllm", "hf"), activation=("silu", "sigmoid")),
            forward=spec.rms_norm_gated,
            backward=spec.rms_norm_gated_backward,
        ),
    )
}


def get_op(name: str) -> OpDef:
    """The [`OpDef`][normspec.ops.OpDef] called ``name``; a clear error lists the known ones."""
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"op: unknown operator {name!r}; expected one of {sorted(OPS)}") from None
