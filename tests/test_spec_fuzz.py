"""Hypothesis-drawn shapes, dtypes, variants and special values: the spec stays bitwise
invariant under every transform (forward and row gradients)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import bits_equal
from normspec.ops import OPS, Sample
from normspec.transforms import TRANSFORMS

CASES = [(op, params) for op in OPS.values() for params in op.variants]


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(CASES),
    rows=st.integers(1, 9),
    hidden=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fp32_weight=st.booleans(),
    specials=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_spec_is_invariant_on_drawn_inputs(case, rows, hidden, dtype, fp32_weight, specials,
                                           seed):
    op, params = case
    sample = op.make_sample((rows, hidden), dtype, params=params, seed=seed,
                            weight_dtype=torch.float32 if fp32_weight else dtype,
                            special_values=specials)
    k = len(op.row_inputs)

    def with_rows(rs):
        return Sample(dict(zip(op.row_inputs, rs, strict=True)), sample.weight, sample.params,
                      sample.eps)

    def forward(rs):
        return list(op.spec_forward(with_rows(rs)))

    def backward(rs):
        return list(op.spec_backward(with_rows(rs[:k]), rs[k:])[:-1])

    inputs = sample.row_list(op)
    grads = [torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed + i))
             .to(dtype) for i in range(len(op.outputs))]
    for fn, args in ((forward, inputs), (backward, inputs + grads)):
        full = fn(args)
        for t in TRANSFORMS:
            idx, outs = t.apply(fn, args, torch.Generator().manual_seed(1))
            for ref, out in zip(full, outs, strict=True):
                assert bits_equal(ref[idx], out), f"{op.name} {params} transform={t.name}"
