"""Cross-device exactness of the spec: identical bits on the CPU and on CUDA."""

from __future__ import annotations

import pytest
import torch

from conftest import bits_equal
from normspec.ops import OPS, variant_name

pytestmark = pytest.mark.cuda

CASES = [(op, p) for op in OPS.values() for p in op.variants]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}[{variant_name(c[1])}]")
def test_spec_gives_the_same_bits_on_cpu_and_cuda(case, dtype):
    op, params = case
    cpu = op.make_sample((4096, 2048), dtype, params=params, seed=13, special_values=True)
    gpu = op.make_sample((4096, 2048), dtype, params=params, seed=13, special_values=True,
                         device="cuda")
    grads = [torch.randn(4096, 2048, generator=torch.Generator().manual_seed(i)).to(dtype)
             for i, _ in enumerate(op.outputs)]
    for a, b in zip(op.spec_forward(cpu), op.spec_forward(gpu), strict=True):
        assert bits_equal(a, b)
    back_cpu = op.spec_backward(cpu, grads)
    back_gpu = op.spec_backward(gpu, [g.cuda() for g in grads])
    for a, b in zip(back_cpu, back_gpu, strict=True):
        assert bits_equal(a, b)
