"""Train a patched transformers model a few steps and hold every norm's gradients to the spec."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from normspec import spec

from .alignment import Alignment
from .sites import SITE_KINDS, site_kind

__all__ = ["gradient_capture", "train_steps"]


@contextlib.contextmanager
def gradient_capture(model: torch.nn.Module) -> Iterator[list[dict[str, Any]]]:
    """Record each norm call's inputs, output gradient and input gradients during backward."""
    records: list[dict[str, Any]] = []
    handles = []
    for name, module in model.named_modules():
        kind = site_kind(name)
        if kind is None:
            continue
        pending: list[dict[str, Any]] = []

        def before(module, args, name=name, kind=kind, pending=pending):
            record = {"site": name, "kind": kind, "module": module,
                      "inputs": tuple(a.detach().clone() for a in args)}
            pending.append(record)
            records.append(record)

        def backward(module, grad_input, grad_output, pending=pending):
            record = pending.pop()
            record["dy"] = grad_output[0].detach().clone()
            record["grad_inputs"] = tuple(None if g is None else g.detach().clone()
                                          for g in grad_input)

        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_full_backward_hook(backward))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def _spec_grads(record: dict[str, Any], alignment: Alignment) -> tuple[torch.Tensor, ...]:
    module = record["module"]
    weight = module.weight.detach()
    if record["kind"] == "gated_norm":
        x, gate = record["inputs"]
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        activation = getattr(module, "activation", "silu")
        return spec.rms_norm_gated_backward(
            record["dy"], x, gate, weight, eps=eps, convention=alignment.gated_convention,
            activation="silu" if activation == "swish" else activation)
    (x,) = record["inputs"]
    return spec.rms_norm_backward(record["dy"], x, weight, eps=module.eps,
                                  offset=alignment.offset)


def _compare(records: Sequence[dict[str, Any]], alignment: Alignment) -> dict[str, dict]:
    """Per site kind: gradient elements checked and the fraction bitwise equal to the spec."""
    table = {kind: {"calls": 0, "elements": 0, "equal": 0} for kind in SITE_KINDS}
    for record in records:
        *row_grads, dweight = _spec_grads(record, alignment)
        got = [*record["grad_inputs"][: len(row_grads)], record["module"].weight.grad]
        row = table[record["kind"]]
        row["calls"] += 1
        for want, have in zip([*row_grads, dweight], got, strict=True):
            same = spec.same_bits(want, have.reshape(want.shape))
            row["elements"] += same.numel()
            row["equal"] += int(same.sum())
    return {kind: {**row, "equal": row["equal"] / row["elements"]}
            for kind, row in table.items() if row["calls"]}


def train_steps(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, steps: int,
                alignment: Alignment, lr: float = 1e-3) -> dict[str, Any]:
    """``steps`` AdamW steps of causal-LM loss on ``sequences``.

    Returns the loss before each step and, per step, the gradient table of
    every norm site against the spec's declared backward.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(s) for s in sequences], device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses, tables = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with gradient_capture(model) as records:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        losses.append(float(loss.detach()))
        tables.append(_compare(records, alignment))
        optimizer.step()
    model.eval()
    return {"losses": losses, "gradients": tables}
