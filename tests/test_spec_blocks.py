"""The spec works on blocks of rows: the same bits whatever the block size, and memory
bounded beyond the inputs and outputs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from normspec.ops import OPS
from normspec.spec import blocks
from normspec.spec.arithmetic import same_bits

SHAPES = [(37, 100), (64, 8), (5, 1), (1, 7), (0, 16), (33, 64)]


def _all_outputs() -> list[torch.Tensor]:
    out = []
    for op in OPS.values():
        for params in op.variants:
            for shape in SHAPES:
                for dtype in (torch.float32, torch.bfloat16):
                    s = op.make_sample(shape, dtype, params=params, seed=3,
                                       special_values=True)
                    y = op.spec_forward(s)
                    gen = torch.Generator().manual_seed(4)
                    dys = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in y]
                    out += [*y, *op.spec_backward(s, dys)]
    return out


def test_block_size_never_changes_a_bit(monkeypatch):
    """Blocks of one row up to whole tensors: forward, row gradients and the dweight row
    tree (split into block trees and a tree over the blocks) keep their bits."""
    whole = _all_outputs()
    for elements in (1, 64, 1000):
        monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", elements)
        for a, b in zip(whole, _all_outputs(), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert bool(same_bits(a, b).all()), elements


@pytest.mark.parametrize(("rows", "hidden", "elements", "want"), [
    (1000, 100, 1 << 20, 1024), (5000, 2048, 1 << 20, 512), (3, 2048, 1 << 20, 4),
    (10, 1 << 21, 1 << 20, 1),
])
def test_block_rows_are_a_power_of_two_within_the_budget(rows, hidden, elements, want):
    assert blocks.block_rows(rows, hidden, elements) == want


MEASURE = textwrap.dedent("""
    import resource, sys, torch
    from normspec import spec
    torch.set_num_threads(1)
    rows, hidden = 1 << 14, 2048
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(rows, hidden, generator=g).to(torch.bfloat16) for _ in range(3))
    w = torch.randn(hidden, generator=g)
    calls = {
        "rms_norm": lambda: spec.rms_norm(a, w, eps=1e-6, offset=1.0),
        "rms_norm_backward": lambda: spec.rms_norm_backward(b, a, w, eps=1e-6),
        "fused_add_rms_norm": lambda: spec.fused_add_rms_norm(a, b, w, eps=1e-6),
        "fused_add_rms_norm_backward": lambda: spec.fused_add_rms_norm_backward(
            b, c, a, b, w, eps=1e-6),
        "rms_norm_gated": lambda: spec.rms_norm_gated(a, b, w, eps=1e-6),
        "rms_norm_gated_backward": lambda: spec.rms_norm_gated_backward(c, a, b, w, eps=1e-6),
    }
    spec.rms_norm(a[:8], w, eps=1e-6)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = calls[sys.argv[1]]()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows_out = sum(t.numel() * t.element_size() for t in (out if isinstance(out, tuple)
                                                          else (out,)) if t.dim() == 2)
    print((after - before) * 1024 - rows_out)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB on Linux")
@pytest.mark.parametrize("function", ["rms_norm", "rms_norm_backward", "fused_add_rms_norm",
                                      "fused_add_rms_norm_backward", "rms_norm_gated",
                                      "rms_norm_gated_backward"])
def test_memory_beyond_inputs_and_outputs_is_bounded(function):
    """64 MiB row tensors; before the blocks the gated backward took 2 GiB beyond them."""
    done = subprocess.run([sys.executable, "-c", MEASURE, function], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    extra = int(done.stdout.strip())
    assert extra <= 48 * blocks.BLOCK_ELEMENTS * 4, f"{function}: {extra / 2**20:.0f} MiB"
