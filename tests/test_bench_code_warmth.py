"""bench/micro/code_warmth_small.py's CPU-side parts: the saved tensors it warms and its
``--modes`` check (the timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the script imports bench/run.py and device_timing
_SPEC = importlib.util.spec_from_file_location(
    "bench_code_warmth_small", ROOT / "bench" / "micro" / "code_warmth_small.py")
cw = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cw)


class _SavesRstd(torch.autograd.Function):
    """y = x * rstd with rstd saved, as our ops' autograd saves the forward's rstd."""

    @staticmethod
    def forward(ctx, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, rstd)
        return x * rstd

    @staticmethod
    def backward(ctx, gy):
        _x, rstd = ctx.saved_tensors
        return gy * rstd


def test_saved_tensors_finds_python_and_builtin_nodes_once():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    out = _SavesRstd.apply(x) * w  # MulBackward0 saves both factors
    saved = cw.saved_tensors(out)
    shapes = sorted(tuple(t.shape) for t in saved)
    # x and rstd from the Function; the Function's output and w from the product
    assert shapes == [(3, 1), (3, 8), (3, 8), (8,)]
    assert len({t.data_ptr() for t in saved}) == len(saved)
    assert not any(t.requires_grad for t in saved)


def test_backward_call_keeps_inputs_out_of_the_extra_tensors(monkeypatch):
    monkeypatch.setattr(cw.br, "_weights", lambda fn: [])
    x = torch.randn(2, 8)
    call, inputs, extra = cw.backward_call(_SavesRstd.apply, x)
    assert [tuple(t.shape) for t in inputs] == [(2, 8), (2, 8)]  # x, dy
    assert [tuple(t.shape) for t in extra] == [(2, 1)]  # the rstd alone
    (dx,) = call()
    assert dx.shape == (2, 8)


def test_flushed_modes_are_modes():
    assert set(cw.FLUSHED) <= set(cw.MODES)


def test_unknown_mode_is_refused_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["code_warmth_small.py", "--modes", "cold,lukewarm"])
    with pytest.raises(SystemExit):
        cw.main()
    assert "lukewarm" in capsys.readouterr().err
