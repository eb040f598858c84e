"""``scripts/sanitize_small.py``, the work ``compute-sanitizer`` checks on the GPU
(``scripts/gpu_evidence.sh racecheck``): its calls match the operators' schemas (run here
through the CPU kernels, each case's rows cut to a few), and it refuses to run without a
GPU instead of checking nothing."""

from __future__ import annotations

import pytest
import torch
from _scripts import load_script

sanitize = load_script("scripts/sanitize_small.py", "sanitize_small")
te = pytest.importorskip("normspec.backends.torch_ext")


def test_cases_reach_every_op_and_the_shared_memory_forms():
    ops = {op for op, *_ in sanitize.CASES}
    assert ops == {"rms_norm", "fused_add_rms_norm", "rms_norm_gated"}
    shapes = {(rows, hidden) for _, rows, hidden, *_ in sanitize.CASES}
    # one-row teams of a whole block (1 / 64 rows of 2048), the pipelined backward over many
    # rows, and rows that fill no team
    assert {(1, 2048), (64, 2048), (4096, 2048), (4096, 1000)} <= shapes
    conventions = {p.get("convention") for op, *_, p in sanitize.CASES if op == "rms_norm_gated"}
    assert conventions == {"vllm", "hf"}


@pytest.mark.parametrize("case", sanitize.CASES, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}")
def test_each_case_runs_on_the_cpu_kernels(case):
    reason = te.available(build_if_needed=False)
    if reason is not None:
        pytest.skip(f"torch_ext cannot be built here: {reason}")
    te.build(verbose=False)
    op, _, hidden, dtype, params = case
    sanitize.run_case(op, 3, hidden, dtype, params, torch.Generator().manual_seed(0))


def test_refuses_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sanitize.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
