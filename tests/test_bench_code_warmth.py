"""bench/micro/code_warmth_small.py's CPU-side parts: the saved tensors it warms and its
``--modes`` check (the timing itself needs a GPU)."""

from __future__ import annotations

import sys

import pytest
import torch
from _scripts import load_script

cw = load_script("bench/micro/code_warmth_small.py", "bench_code_warmth_small")


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


def test_saved_tensors_returns_a_tensor_saved_twice_once():
    x = torch.randn(3, 8, requires_grad=True)
    y = _SavesRstd.apply(x)
    saved = cw.saved_tensors(y * y)  # MulBackward0 saves y as both factors
    assert sorted(tuple(t.shape) for t in saved) == [(3, 1), (3, 8), (3, 8)]  # x, rstd, y


class _Log:
    """Stands in for the GPU work device_us launches, writing each step to ``log``."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def zero_(self):
        self.log.append(f"{self.name}.zero_")

    def sum(self):
        self.log.append(f"{self.name}.sum")

    def view(self, *shape):
        self.log.append(f"{self.name}.view")
        return self

    def __getitem__(self, index):
        return self


class _Event:
    def __init__(self, log: list):
        self.log = log

    def record(self):
        self.log.append("event")

    def elapsed_time(self, other):
        return 0.001


def _fake_gpu(monkeypatch, log: list):
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _Event(log))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(f"sleep {cycles}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cw.dt, "sleep_cycles_per_ms", lambda: 1000.0)


@pytest.mark.parametrize(("mode", "prelude"), [
    ("cold", ["flush.zero_"]),
    ("warm", []),
    ("read flush", ["flush.sum"]),
    ("code warm", ["flush.zero_", "other"]),
    ("warm after other", ["other"]),
    ("pages warm", ["flush.zero_", "x.view", "x.sum", "dy.view", "dy.sum"]),
    ("data warm", ["flush.zero_", "x.sum", "dy.sum"]),
    ("saved warm", ["flush.zero_", "x.sum", "dy.sum", "rstd.sum"]),
    ("saved only", ["flush.zero_", "rstd.sum"]),
    ("tiny kernel", ["flush.zero_", "sleep 1"]),
    ("alloc only", ["flush.zero_", "alloc"]),
])
def test_each_mode_runs_its_prelude_before_the_sleep_and_the_call(monkeypatch, mode, prelude):
    assert mode in cw.MODES
    log: list = []
    _fake_gpu(monkeypatch, log)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: log.append("alloc"))
    inputs = (_Log(log, "x"), _Log(log, "dy"))
    us = cw.device_us(lambda: log.append("call"), mode, 5, _Log(log, "flush"),
                      lambda: log.append("other"), inputs, (_Log(log, "rstd"),))
    assert us == 1.0
    sleep = f"sleep {int(cw.dt.HIDE_HOST_MS * 1000)}"
    assert log[:len(prelude) + 4] == [*prelude, sleep, "event", "call", "event"]
    assert len(log) == 5 * (len(prelude) + 4)
    assert (mode in cw.FLUSHED) == ("flush.zero_" in prelude)


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
