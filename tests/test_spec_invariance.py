"""The spec is bitwise invariant under every transform, on the CPU, forward and backward."""

from __future__ import annotations

import pytest
import torch

from conftest import bits_equal
from normspec.ops import OPS, variant_name
from normspec.spec import arithmetic as A
from normspec.transforms import TRANSFORMS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = [
    (op, params) for op in OPS.values() for params in op.variants
]


def _ids(case):
    op, params = case
    return f"{op.name}[{variant_name(params)}]"


def _forward_rows(op, sample):
    def f(rows):
        s = type(sample)(dict(zip(op.row_inputs, rows, strict=True)), sample.weight,
                         sample.params, sample.eps)
        return list(op.spec_forward(s))
    return f


def _backward_rows(op, sample, grads):
    """Row gradients as a row function of [*inputs, *grad_outputs]."""
    k = len(op.row_inputs)

    def f(rows):
        s = type(sample)(dict(zip(op.row_inputs, rows[:k], strict=True)), sample.weight,
                         sample.params, sample.eps)
        return list(op.spec_backward(s, rows[k:])[:-1])
    return f


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_and_backward_invariance(case, dtype):
    op, params = case
    sample = op.make_sample((23, 200), dtype, params=params, seed=7)
    gen = torch.Generator().manual_seed(3)
    fwd = _forward_rows(op, sample)
    rows = sample.row_list(op)
    full = fwd(rows)
    grads = [torch.randn(o.shape, generator=gen).to(dtype) for o in full]
    bwd = _backward_rows(op, sample, grads)
    full_grad = bwd(rows + grads)
    for t in TRANSFORMS:
        for label, f, inputs, reference in (("forward", fwd, rows, full),
                                            ("backward", bwd, rows + grads, full_grad)):
            idx, outs = t.apply(f, inputs, torch.Generator().manual_seed(5))
            for ref, out in zip(reference, outs, strict=True):
                assert bits_equal(ref[idx], out), f"{label} transform={t.name}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_dweight_equals_row_tree_over_singletons(case):
    op, params = case
    sample = op.make_sample((19, 96), torch.bfloat16, params=params, seed=11,
                            weight_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(19, 96, generator=gen).to(torch.bfloat16) for _ in op.outputs]
    batch_dw = op.spec_backward(sample, grads)[-1]
    singles = []
    for i in range(19):
        s = type(sample)({k: v[i : i + 1] for k, v in sample.rows.items()}, sample.weight,
                         sample.params, sample.eps)
        singles.append(op.spec_backward(s, [g[i : i + 1] for g in grads])[-1])
    assert bits_equal(batch_dw, A.tree_sum(torch.stack(singles), dim=0))


def test_same_bits_with_one_and_two_threads():
    op = OPS["rms_norm_gated"]
    sample = op.make_sample((512, 2048), torch.bfloat16, params={"convention": "hf",
                            "activation": "silu"}, seed=2)
    dy = torch.randn(512, 2048).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((op.spec_forward(sample), op.spec_backward(sample, [dy])))
    finally:
        torch.set_num_threads(before)
    (f1, b1), (f2, b2) = results
    assert all(bits_equal(a, b) for a, b in zip(f1 + b1, f2 + b2, strict=True))


def test_leading_shapes_are_rows():
    """(B, S, H) gives the same bits as the flattened (B*S, H) call."""
    op = OPS["fused_add_rms_norm"]
    params = {"offset": 1.0, "residual_sum": "fp32"}
    s3 = op.make_sample((3, 5, 64), torch.float16, params=params, seed=4)
    flat = type(s3)({k: v.reshape(15, 64) for k, v in s3.rows.items()}, s3.weight,
                    s3.params, s3.eps)
    for a, b in zip(op.spec_forward(s3), op.spec_forward(flat), strict=True):
        assert bits_equal(a.reshape(15, 64), b)
