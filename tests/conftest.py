"""Shared pytest configuration: CUDA tests are marked and skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors have the same dtype, shape and bit pattern (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}
    ia = a.detach().cpu().contiguous().view(ints[a.dtype])
    ib = b.detach().cpu().contiguous().view(ints[b.dtype])
    return bool(torch.equal(ia, ib))
