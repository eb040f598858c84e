"""Shared pytest configuration: CUDA tests are marked and skipped without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker's CPU threads get an even share of
    the cores, and so do the child processes the tests start (``OMP_NUM_THREADS``):
    N workers that each spread torch's CPU work over every core slow one another
    down many times over."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS", "").isdigit():
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern, except that a NaN matches any NaN.

    NaN payloads and signs are not part of the spec: IEEE leaves them open and
    devices differ (x86 produces a negative default NaN for ``inf * 0``, CUDA
    ``0x7fffffff``; torch rounds a NaN to bf16 as ``0x7fc0`` on the CPU and
    ``0x7fff`` on CUDA). Where one tensor has a NaN the other must have one.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    ia, ib = a.view(ints[a.dtype]), b.view(ints[b.dtype])
    return bool(torch.equal(ia[~nan_a], ib[~nan_b]))
