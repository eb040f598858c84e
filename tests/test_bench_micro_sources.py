"""The micro harnesses under ``bench/micro/`` compile against today's launcher.

They run only on a GPU, through ``bench/micro/ab.py`` or by hand, so an API change in
``backends/csrc`` (a renamed entry point, a new required argument) would otherwise first show
on the lent machine, where device time is scarce. Each is compiled here to an object file with the
flags ``ab.py`` builds it with; the launch units it links against are compiled by
``tests/test_cuda_sources.py``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _scripts import load_script
from test_cuda_sources import CSRC, NVCC, needs_nvcc

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = sorted((ROOT / "bench" / "micro").glob("*.cu"))
ab = load_script("bench/micro/ab.py", "bench_micro_ab_for_sources", register=True)


def test_there_are_harnesses():
    assert {p.name for p in HARNESSES} >= {"small_backward_ab.cu", "row_forward_ab.cu"}


@needs_nvcc
@pytest.mark.parametrize("harness", HARNESSES, ids=lambda p: p.name)
def test_micro_harness_compiles(tmp_path, harness):
    done = subprocess.run([NVCC, *ab.NVCC_FLAGS, f"-I{CSRC}", "-c", str(harness), "-o",
                           str(tmp_path / "harness.o")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]
