"""Differential test: each first-party backend that runs here against the spec, bit for bit,
forward and gradients, on hypothesis-drawn shapes, dtypes, variants, special values (±0,
subnormals, ±inf, NaN) and layouts (strided rows, column-major, a storage offset).

A modest count per op in CI; ``NORMSPEC_DIFFERENTIAL_EXAMPLES`` sets it
(``nox -s differential`` runs 10,000 per op)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normspec import registry
from normspec.gates import identical
from normspec.ops import OPS

EXAMPLES = int(os.environ.get("NORMSPEC_DIFFERENTIAL_EXAMPLES", "25"))
FIRST_PARTY = ("torch_ext", "cupy")
LAYOUTS = ("contiguous", "strided", "column_major", "offset")


def _runs_on_cpu(name: str) -> bool:
    if name not in registry.entries():
        return False
    backend = registry.get_backend(name)
    return backend.available() is None and all(
        "cpu" in support.devices for support in backend.ops.values())


BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(not _runs_on_cpu(name),
                                                        reason=f"{name} does not run here"))
            for name in FIRST_PARTY]


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another memory layout."""
    if layout == "strided":
        wide = torch.empty(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
        wide[:, ::2] = t
        return wide[:, ::2]
    if layout == "column_major":
        return t.t().contiguous().t()
    if layout == "offset":
        flat = torch.empty(t.numel() + 1, dtype=t.dtype)
        view = flat[1:].view(t.shape)
        view.copy_(t)
        return view
    return t


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("op_name", sorted(OPS))
def test_first_party_backend_is_bitwise_the_spec(backend_name, op_name):
    backend = registry.get_backend(backend_name)
    op = OPS[op_name]
    support = backend.ops[op_name]

    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(params=st.sampled_from(op.variants), rows=st.integers(1, 9),
           hidden=st.integers(1, 700),
           dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
           fp32_weight=st.booleans(), specials=st.booleans(),
           layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
    def check(params, rows, hidden, dtype, fp32_weight, specials, layout, seed):
        if backend.supports(op_name, params, "cpu") is not None:
            return
        sample = op.make_sample((rows, hidden), dtype, params=params, seed=seed,
                                weight_dtype=torch.float32 if fp32_weight else dtype,
                                special_values=specials)
        ins = [_laid_out(t, layout).requires_grad_() for t in sample.row_list(op)]
        weight = sample.weight.detach().clone().requires_grad_(support.backward == "full")
        got = backend.forward(op_name, dict(zip(op.row_inputs, ins, strict=True)), weight,
                              eps=sample.eps, **sample.params)
        want = op.spec_forward(sample)
        where = f"{backend_name} {op_name} {params} {rows}x{hidden} {dtype} {layout}"
        for name, g, w in zip(op.outputs, got, want, strict=True):
            assert identical(g.detach(), w), f"{where}: forward {name}"
        if support.backward == "none":
            return
        gen = torch.Generator().manual_seed(seed + 1)
        douts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in op.outputs]
        wrt = [*ins, weight] if support.backward == "full" else ins
        grads = torch.autograd.grad(got, wrt, douts, allow_unused=True)
        names = [*op.row_grads, "dweight"] if support.backward == "full" else op.row_grads
        for name, g, w in zip(names, grads, op.spec_backward(sample, douts), strict=False):
            assert g is not None and identical(g, w), f"{where}: {name}"

    check()
