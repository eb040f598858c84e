"""Repro snippets: Python that rebuilds a failing case and fails the same way.

A snippet rebuilds the case's inputs, runs the backend as the harness did (through the
invariance transform that failed, if one did, or through autograd for a gradient), and
ends in the comparison that failed, as an ``assert``: run as it is, it raises where the
backend still fails and passes once it is fixed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["repro_snippet"]

_HEAD = """\
import torch
import normspec
from normspec.gates import compare, identical
from normspec.spec.arithmetic import tree_sum
from normspec.transforms import TRANSFORMS

op = normspec.get_op({op!r})
s = op.make_sample({shape!r}, torch.{dtype}, params={params!r}, seed={seed},
                   weight_dtype={wdtype}, device={device!r})
backend = normspec.get_backend({backend!r})
rows = s.row_list(op)


def forward(rows):
    with torch.no_grad():
        return list(backend.forward(op.name, dict(zip(op.row_inputs, rows)), s.weight,
                                    eps=s.eps, **s.params))
"""

_FORWARD = """
for name, got, want in zip(op.outputs, forward(rows), op.spec_forward(s), strict=True):
    c = compare(name, got, want, "forward")
    print(name, "max_ulp", c.max_ulp, "max_abs", c.max_abs)
    assert c.within_tolerance, f"{name} is outside the tolerance"
"""

_TRANSFORM = """
full = forward(rows)
t = next(t for t in TRANSFORMS if t.name == {transform!r})
idx, outs = t.apply({fn}, {inputs}, torch.Generator().manual_seed(17))
for name, out, ref in zip({names}, outs, {reference}, strict=True):
    assert identical(out, ref[idx]), f"{{name}} changes under the {transform} transform"
"""

_GRADIENT = """
K = len(op.row_inputs)
WITH_WEIGHT = {with_weight}
gen = torch.Generator().manual_seed({grad_seed})
douts = [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) for o in forward(rows)]


def grads(inputs):
    r = [t.detach().requires_grad_() for t in inputs[:K]]
    w = s.weight.detach().clone().requires_grad_(WITH_WEIGHT)
    outs = backend.forward(op.name, dict(zip(op.row_inputs, r)), w, eps=s.eps, **s.params)
    wrt = [*r, w] if WITH_WEIGHT else r
    got = torch.autograd.grad(outs, wrt, inputs[K:], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, wrt)]


names = (*op.row_grads, "dweight") if WITH_WEIGHT else op.row_grads
got = grads(rows + douts)
"""

_GRADIENT_SPEC = """floor = max(d.double().square().mean().sqrt().item() for d in douts)
for name, g, want in zip(names, got, op.spec_backward(s, douts)):
    c = compare(name, g, want, "gradient", scale_floor=floor)
    print(name, "max_ulp", c.max_ulp, "max_abs", c.max_abs)
    assert c.within_tolerance, f"{name} is outside the tolerance"
"""

_ROW_TREE = """singles = [grads([t[i : i + 1] for t in rows + douts])[-1]
           for i in range(rows[0].shape[0])]
assert identical(got[-1], tree_sum(torch.stack(singles), dim=0)), \\
    "dweight is not the row tree of the single rows' dweights"
"""


def repro_snippet(backend: str, op: Any, profile: Any, case: Any, stage: str,
                  transform: str | None = None, with_weight: bool = False) -> str:
    """The snippet for ``backend``'s ``op`` on ``case`` of ``profile``.

    ``stage`` is ``"forward"`` or ``"gradient"``; ``transform`` names the invariance
    transform that failed (``"singleton_aggregation"``: dweight against the row tree of
    single rows), ``None`` for a comparison with the spec or a crash.
    """
    if stage not in ("forward", "gradient"):
        raise ValueError(f"stage: expected 'forward' or 'gradient', got {stage!r}")
    wdtype = "torch.float32" if case.weight_dtype == "fp32" else f"torch.{profile.dtype_name}"
    text = _HEAD.format(op=op.name, shape=tuple(case.shape), dtype=profile.dtype_name,
                        params=case.params, seed=case.seed, wdtype=wdtype,
                        device=profile.device, backend=backend)
    if stage == "forward":
        if transform is None:
            return text + _FORWARD
        return text + _TRANSFORM.format(transform=transform, fn="forward", inputs="rows",
                                        names="op.outputs", reference="full")
    text += _GRADIENT.format(with_weight=with_weight, grad_seed=case.seed + 1000)
    if transform is None:
        return text + _GRADIENT_SPEC
    if transform == "singleton_aggregation":
        return text + _ROW_TREE
    return text + _TRANSFORM.format(
        transform=transform, fn="lambda inputs: grads(inputs)[:K]", inputs="rows + douts",
        names="op.row_grads", reference="got[:K]")
