"""Shared pytest configuration: CUDA tests are marked and skipped without a GPU."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from normspec.spec.arithmetic import same_bits
from normspec.workers import usable_cores

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


@pytest.fixture(autouse=True)
def _no_kept_cupy_launch_plans():
    """Each test starts with none of the CuPy backend's kept launch plans: a test that
    stands in for its device queries or watches its planners must see them asked."""
    backend = sys.modules.get("normspec.backends.cupy")
    if backend is not None:
        backend.clear_launch_plans()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def compile_ahead(request: pytest.FixtureRequest, test: str, param: str,
                  compile_one: Callable[[Any], Any],
                  order: Callable[[set], list] = sorted) -> dict[Any, Future]:
    """For a module-scoped fixture: each value of ``param`` that this session runs
    ``test`` (of the fixture's module) with, given to ``compile_one`` in a thread a core,
    all finished before it returns, as ``{value: future}`` (each future holds its result
    or its error, for its own test to report). Compiles of several parametrized tests
    run side by side this way rather than one after another, as the tests run. Under
    pytest-xdist, whose workers each run a share of the tests, it returns ``{}``: each
    test compiles its own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return {}
    wanted = {item.callspec.params[param] for item in request.session.items
              if getattr(item, "originalname", None) == test
              and getattr(item, "module", None) is request.module}
    with ThreadPoolExecutor(max_workers=usable_cores()) as pool:
        return {value: pool.submit(compile_one, value) for value in order(wanted)}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern, except that a NaN matches any NaN.

    NaN payloads and signs are not part of the spec: IEEE leaves them open and
    devices differ (x86 produces a negative default NaN for ``inf * 0``, CUDA
    ``0x7fffffff``; torch rounds a NaN to bf16 as ``0x7fc0`` on the CPU and
    ``0x7fff`` on CUDA). Where one tensor has a NaN the other must have one.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(same_bits(a.detach().cpu(), b.detach().cpu()).all())
