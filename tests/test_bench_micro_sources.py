"""The micro harnesses under ``bench/micro/`` compile against today's launcher.

They run only on a GPU, through ``bench/micro/ab.py`` or by hand, so an API change in
``backends/csrc`` (a renamed entry point, a new required argument) would otherwise first show
on the lent machine, where device time is scarce. Each is compiled here to an object file with the
flags ``ab.py`` builds it with; the launch units it links against are compiled by
``tests/test_cuda_sources.py``.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import Future
from pathlib import Path

import pytest
from _scripts import load_script
from test_cuda_sources import CSRC, NVCC, needs_nvcc

from conftest import compile_ahead

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = sorted((ROOT / "bench" / "micro").glob("*.cu"))
ab = load_script("bench/micro/ab.py", "bench_micro_ab_for_sources", register=True)


def test_there_are_harnesses():
    assert {p.name for p in HARNESSES} >= {"small_backward_ab.cu", "row_forward_ab.cu"}


def _compile(harness: Path, obj: Path) -> subprocess.CompletedProcess:
    return subprocess.run([NVCC, *ab.NVCC_FLAGS, f"-I{CSRC}", "-c", str(harness), "-o",
                           str(obj)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def compiled_harnesses(request, tmp_path_factory) -> dict[Path, Future]:
    """The harnesses ``test_micro_harness_compiles`` runs for, compiled side by side (one
    nvcc a core) before the first of those tests: 58 s on CI's two cores, 80 s one after
    another (row_forward_ab.cu alone 44 s)."""
    if NVCC is None:
        return {}
    out = tmp_path_factory.mktemp("micro")
    return compile_ahead(request, "test_micro_harness_compiles", "harness",
                         lambda h: _compile(h, out / f"{h.stem}.o"))


@needs_nvcc
@pytest.mark.parametrize("harness", HARNESSES, ids=lambda p: p.name)
def test_micro_harness_compiles(tmp_path, harness, compiled_harnesses):
    compiled = compiled_harnesses.get(harness)
    done = compiled.result() if compiled is not None else _compile(harness, tmp_path / "h.o")
    assert done.returncode == 0, done.stderr[-6000:]
