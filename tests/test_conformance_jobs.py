"""``normspec conformance --jobs N``: the checks in spawned worker processes."""

from __future__ import annotations

import json
import os
import re

import pytest

from normspec import harness, registry
from normspec.backends.reference import ReferenceBackend
from normspec.cli import main
from normspec.conformance import run_conformance
from normspec.ops import OPS
from normspec.profiles import PROFILES
from normspec.workers import Task, check_in_workers

SELECTION = dict(device="cpu", quick=True, ops=["rms_norm", "rms_norm_gated"],
                 profiles=["cpu_bf16"], backends=["reference", "transformers"])


def _without_dates(report: dict) -> dict:
    return {**report, "environment": {k: v for k, v in report["environment"].items()
                                      if k != "date"}}


def test_reports_do_not_depend_on_the_number_of_jobs(tmp_path, monkeypatch):
    serial = run_conformance(**SELECTION, out_dir=tmp_path / "serial", jobs=1)

    def not_here(*args, **kwargs):
        raise AssertionError("with --jobs 2 the parent must not run an entry point's check")

    monkeypatch.setattr(harness, "check", not_here)  # the spawned workers do not see this
    side_by_side = run_conformance(**SELECTION, out_dir=tmp_path / "jobs", jobs=2)
    assert [_without_dates(r) for r in side_by_side] == [_without_dates(r) for r in serial]
    assert [(r["profile"], r["op"]) for r in side_by_side] == [
        ("cpu_bf16", "rms_norm"), ("cpu_bf16", "rms_norm_gated")]
    for r in side_by_side:
        assert list(r["results"]) == ["reference", "transformers"]
        assert r["results"]["reference"]["level"] == {"forward": "exact", "gradient": "exact"}
        written = json.loads((tmp_path / "jobs" / r["profile"] / f"{r['op']}.json").read_text())
        assert written == r


def test_workers_report_every_case_and_every_result():
    tasks = [Task("reference", "rms_norm", "cpu_fp32"), Task("reference", "rms_norm_gated",
                                                             "cpu_fp32")]
    cases, arrived = [], []
    results = check_in_workers(tasks, jobs=2, quick=True, on_case=lambda: cases.append(1),
                               on_result=lambda task, result, seconds: arrived.append(task))
    expected = sum(1 for t in tasks for _ in harness.iter_cases(OPS[t.op], PROFILES[t.profile],
                                                                quick=True))
    assert len(cases) == expected
    assert sorted(arrived) == sorted(tasks) and set(results) == set(tasks)
    assert all(r["level"]["forward"] == "exact" for r in results.values())


def test_a_backend_registered_in_this_process_is_checked_here(tmp_path):
    mine = ReferenceBackend()
    mine.name = "mine"
    registry.register(mine)
    try:
        (report,) = run_conformance(device="cpu", quick=True, ops=["rms_norm"],
                                    profiles=["cpu_fp32"], backends=["mine", "reference"],
                                    out_dir=None, jobs=2)
    finally:
        registry.unregister("mine")
    assert report["results"]["mine"]["level"] == {"forward": "exact", "gradient": "exact"}
    assert report["results"]["reference"]["level"] == {"forward": "exact", "gradient": "exact"}


def test_a_check_that_raises_in_its_worker_is_named():
    with pytest.raises(RuntimeError, match=r"checking nope rms_norm on cpu_fp32 raised in its "
                                           r"worker: UnknownBackendError: .*unknown backend"):
        check_in_workers([Task("nope", "rms_norm", "cpu_fp32")], jobs=1, quick=True)


def _die(task, quick, seeds):
    os._exit(3)  # a native crash, as a worker sees it


def test_a_worker_that_dies_is_reported():
    with pytest.raises(RuntimeError, match=r"a conformance worker process died .* while 2 "
                                           r"checks were unfinished; rerun with --jobs 1"):
        check_in_workers([Task("reference", "rms_norm", "cpu_fp32"),
                          Task("reference", "rms_norm_gated", "cpu_fp32")],
                         jobs=2, quick=True, worker=_die)


def test_each_check_is_logged_with_its_time(tmp_path, capsys):
    assert main(["conformance", "--device", "cpu", "--quick", "--backend", "reference",
                 "--op", "rms_norm", "--profile", "cpu_fp32", "--out", str(tmp_path),
                 "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"cpu_fp32 rms_norm reference: forward=exact gradient=exact "
                     r"\(\d+\.\d s\)", out)


@pytest.mark.parametrize("jobs", ["0", "-3"])
def test_jobs_below_one_is_refused(tmp_path, capsys, jobs):
    assert main(["conformance", "--device", "cpu", "--quick", "--backend", "reference",
                 "--out", str(tmp_path), "--jobs", jobs]) == 2
    assert f"jobs: expected a whole number >= 1, got {jobs}" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_the_cli_passes_jobs(tmp_path, capsys):
    assert main(["conformance", "--device", "cpu", "--quick", "--backend", "reference",
                 "--op", "rms_norm", "--out", str(tmp_path), "--jobs", "2"]) == 0
    assert "2 checks in 2 processes" in capsys.readouterr().out
    for profile in ("cpu_fp32", "cpu_bf16"):
        report = json.loads((tmp_path / profile / "rms_norm.json").read_text())
        assert report["results"]["reference"]["level"]["forward"] == "exact"


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (4, 2), (16, 8), (64, 8)])
def test_the_default_jobs_on_cuda_is_one_per_two_cores_at_most_8(monkeypatch, cores, expected):
    from normspec import cli

    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    assert cli._jobs(None, "cuda") == expected
    assert cli._jobs(None, "cpu") == 1
    assert cli._jobs(3, "cpu") == 3
