"""Capture the norm calls of a model, and replay them through another side's modules.

[`capture`][normspec.integrations.capture.capture] records, for every norm
site of a transformers or vLLM Qwen3-Next model, each call's inputs and
outputs (prefill and decode steps alike).
[`replay_on_transformers`][normspec.integrations.capture.replay_on_transformers]
and [`replay_on_vllm`][normspec.integrations.capture.replay_on_vllm] feed
one side's recorded inputs through the other side's module as that side
would call it, and [`equality_table`][normspec.integrations.capture.equality_table]
gives, per site kind, the fraction of output elements that are bitwise equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from normspec.spec import same_bits

from .sites import SITE_KINDS, site_kind

__all__ = ["NormCall", "capture", "equality_table", "fused_sites", "replay_on_transformers",
           "replay_on_vllm"]


@dataclass
class NormCall:
    """One call of a norm site: its inputs and outputs, detached copies on the CPU."""

    site: str
    kind: str
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


def _tensors(value) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value.detach().cpu().clone(),)
    return tuple(v.detach().cpu().clone() for v in value if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def capture(model: torch.nn.Module) -> Iterator[list[NormCall]]:
    """Record every norm-site call of ``model`` while the block runs."""
    calls: list[NormCall] = []
    handles = []
    for name, module in model.named_modules():
        kind = site_kind(name)
        if kind is None:
            continue
        pending: list[tuple[torch.Tensor, ...]] = []

        # inputs are copied before the call: a kernel may update them in place
        def before(module, args, kwargs, pending=pending):
            pending.append(_tensors([*args, *kwargs.values()]))

        def after(module, args, kwargs, output, name=name, kind=kind, pending=pending):
            calls.append(NormCall(name, kind, pending.pop(), _tensors(output)))

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if site_kind(name) is not None}


def _to(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


@torch.no_grad()
def replay_on_transformers(model: torch.nn.Module, calls: Sequence[NormCall]) -> list[NormCall]:
    """Each call through the transformers module of its site, called as transformers calls it.

    A fused-add call ``(x, residual)`` becomes transformers' decoder step:
    ``s = residual + x`` in the model dtype, then the norm of ``s``; its
    outputs are ``(norm(s), s)``. A gated call's rows are flattened to
    ``[tokens·heads, head_v]`` as ``Qwen3NextGatedDeltaNet`` does.
    """
    modules = _modules(model)
    device = next(model.parameters()).device
    out = []
    for call in calls:
        module = modules[call.site]
        args = _to(call.inputs, device)
        if call.kind == "gated_norm":
            x, z = args
            y = module(x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1])).reshape(x.shape)
            result: tuple[torch.Tensor, ...] = (y,)
        elif len(args) == 2:
            s = args[1] + args[0]
            result = (module(s), s)
        else:
            result = (module(args[0]),)
        out.append(NormCall(call.site, call.kind, call.inputs, _tensors(result)))
    return out


@torch.no_grad()
def replay_on_vllm(model: torch.nn.Module, calls: Sequence[NormCall],
                   fused_sites: Collection[str] = ()) -> list[NormCall]:
    """Each call through the vLLM module of its site, called as vLLM calls it.

    At ``fused_sites`` (where vLLM passes a residual) a transformers call's
    input, already the sum, is passed as ``x`` with a zero residual: adding
    zero leaves it unchanged in either convention, and both outputs
    ``(y, new_residual)`` are compared.
    """
    modules = _modules(model)
    device = next(model.parameters()).device
    out = []
    for call in calls:
        module = modules[call.site]
        args = _to(call.inputs, device)
        if call.site in fused_sites and len(args) == 1:
            args.append(torch.zeros_like(args[0]))
        out.append(NormCall(call.site, call.kind, call.inputs, _tensors(module(*args))))
    return out


def fused_sites(calls: Sequence[NormCall]) -> set[str]:
    """The sites whose recorded calls passed a residual (vLLM's fused-add form)."""
    return {c.site for c in calls if c.kind != "gated_norm" and len(c.inputs) == 2}


def _expected_outputs(call: NormCall, other: NormCall) -> tuple[torch.Tensor, ...]:
    if len(call.outputs) == len(other.outputs):
        return call.outputs
    if len(call.outputs) == 1 and len(other.outputs) == 2:
        return (call.outputs[0], call.inputs[0])  # a plain call: new residual = its input
    raise ValueError(f"{call.site}: {len(call.outputs)} outputs recorded, "
                     f"{len(other.outputs)} replayed")


def equality_table(recorded: Sequence[NormCall], replayed: Sequence[NormCall]
                   ) -> dict[str, dict[str, float | int]]:
    """Per site kind: calls, output elements, and the fraction bitwise equal."""
    table: dict[str, dict[str, float | int]] = {}
    for kind in SITE_KINDS:
        calls = equal = total = residual_equal = residual_total = 0
        for a, b in zip(recorded, replayed, strict=True):
            if a.kind != kind:
                continue
            calls += 1
            expected = _expected_outputs(a, b)
            same = same_bits(expected[0], b.outputs[0].reshape(expected[0].shape))
            equal += int(same.sum())
            total += same.numel()
            if len(b.outputs) == 2:
                same_r = same_bits(expected[1], b.outputs[1].reshape(expected[1].shape))
                residual_equal += int(same_r.sum())
                residual_total += same_r.numel()
        if calls:
            row: dict[str, float | int] = {"calls": calls, "elements": total,
                                           "equal": equal / total if total else 1.0}
            if residual_total:
                row["residual_equal"] = residual_equal / residual_total
            table[kind] = row
    return table

