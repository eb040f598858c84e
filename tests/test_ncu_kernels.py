"""``scripts/ncu_kernels.py``'s choice of kernels (no GPU: only what it refuses and picks)."""

from __future__ import annotations

import pytest
from _scripts import load_script

nk = load_script("scripts/ncu_kernels.py", "ncu_kernels")


@pytest.mark.parametrize("argv", [["--liger"], ["--liger", "--gated"],
                                  ["--liger", "--peers", "--small"]])
def test_liger_is_for_the_small_work_alone(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        nk.main(argv)
    assert exc.value.code == 2
    assert "--liger" in capsys.readouterr().err


def test_liger_small_profiles_liger_s_rounds(monkeypatch):
    """``--liger --small`` runs Liger's round twice (warm-up, then the profiled one) between
    the profiler's start and stop, and neither ours nor torch.compile's."""
    calls = []
    monkeypatch.setattr(nk, "liger_small", lambda: lambda: calls.append("liger"))
    monkeypatch.setattr(nk, "ours_small", lambda: pytest.fail("ours built"))
    monkeypatch.setattr(nk, "peers_small", lambda: pytest.fail("torch.compile built"))
    monkeypatch.setattr(nk.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(nk.torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(nk.torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    assert nk.main(["--liger", "--small"]) == 0
    assert calls == ["liger", "start", "liger", "stop"]


def test_small_work_covers_the_latency_bound_cases():
    """The small work holds the bench's small rms cases that latency sets, q/k included
    (the notes compare the CSVs of ours, torch.compile's and Liger's case by case)."""
    assert set(nk.SMALL_CASES) >= {(1, 2048), (64, 2048), (4096, 2048), (64, 256)}
    hidden = {h for _, h in nk.SMALL_CASES}
    assert hidden == {2048, 256}
