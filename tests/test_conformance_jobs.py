"""``normspec conformance --jobs N``: the checks in spawned worker processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from normspec import conformance, harness, registry
from normspec.backends.reference import ReferenceBackend
from normspec.cli import main
from normspec.conformance import previous_seconds, run_conformance
from normspec.ops import OPS
from normspec.profiles import PROFILES
from normspec.workers import Task, check_in_workers, longest_first, worker_threads

SELECTION = dict(device="cpu", quick=True, ops=["rms_norm", "rms_norm_gated"],
                 profiles=["cpu_bf16"], backends=["reference", "transformers"])


def _without_dates(report: dict) -> dict:
    return {**{k: v for k, v in report.items() if k != "check_seconds"},
            "environment": {k: v for k, v in report["environment"].items() if k != "date"}}


def test_reports_do_not_depend_on_the_number_of_jobs(tmp_path, monkeypatch):
    serial = run_conformance(**SELECTION, out_dir=tmp_path / "serial", jobs=1)

    def not_here(*args, **kwargs):
        raise AssertionError("with --jobs 2 the parent must not run an entry point's check")

    monkeypatch.setattr(harness, "check", not_here)  # the spawned workers do not see this
    side_by_side = run_conformance(**SELECTION, out_dir=tmp_path / "jobs", jobs=2)
    assert [_without_dates(r) for r in side_by_side] == [_without_dates(r) for r in serial]
    assert [(r["profile"], r["op"]) for r in side_by_side] == [
        ("cpu_bf16", "rms_norm"), ("cpu_bf16", "rms_norm_gated")]
    for r in side_by_side + serial:
        assert list(r["check_seconds"]) == ["reference", "transformers"]
        assert all(isinstance(s, float) and s >= 0 for s in r["check_seconds"].values())
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


def _pid(task, quick, seeds):
    time.sleep(0.5)  # so that one worker cannot take every task
    return {"pid": os.getpid()}, 0.5


def test_the_checks_run_in_several_workers():
    tasks = [Task("reference", op, "cpu_fp32") for op in ("a", "b", "c", "d")]
    results = check_in_workers(tasks, jobs=2, worker=_pid)
    pids = {r["pid"] for r in results.values()}
    assert len(pids) == 2 and os.getpid() not in pids


def _threads(task, quick, seeds):
    import torch

    return {"threads": torch.get_num_threads()}, 0.0


def test_worker_threads_come_from_the_environment(monkeypatch):
    """``NORMSPEC_WORKER_THREADS`` sets each worker's torch CPU threads; a bad value is
    named before any worker starts."""
    tasks = [Task("reference", "rms_norm", "cpu_fp32")]
    monkeypatch.setenv("NORMSPEC_WORKER_THREADS", "1")
    assert check_in_workers(tasks, jobs=1, worker=_threads)[tasks[0]] == {"threads": 1}
    monkeypatch.setenv("NORMSPEC_WORKER_THREADS", "3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert worker_threads(8) == 3
    monkeypatch.setenv("NORMSPEC_WORKER_THREADS", "two")
    with pytest.raises(ValueError, match="NORMSPEC_WORKER_THREADS: expected a whole number"):
        check_in_workers(tasks, jobs=1, worker=_threads)


@pytest.mark.parametrize(("cores", "jobs", "expected"),
                         [(16, 8, 2), (16, 3, 5), (2, 8, 1), (64, 8, 8), (16, 1, None)])
def test_worker_threads_default_to_a_share_of_the_cores(monkeypatch, cores, jobs, expected):
    """Unset, each of several workers gets the usable cores shared among them (at least
    one); a single worker keeps torch's default (``None``)."""
    monkeypatch.delenv("NORMSPEC_WORKER_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert worker_threads(jobs) == expected


def test_each_worker_starts_with_its_share_of_the_cores(monkeypatch):
    """The share reaches the workers: two workers on four usable cores run two threads
    each."""
    monkeypatch.delenv("NORMSPEC_WORKER_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    tasks = [Task("reference", op, "cpu_fp32") for op in ("rms_norm", "fused_add_rms_norm")]
    results = check_in_workers(tasks, jobs=2, worker=_threads)
    assert [results[t] for t in tasks] == [{"threads": 2}] * 2


def _fail_fast_or_sleep(task, quick, seeds):
    if task.op == "boom":
        raise ValueError("boom")
    time.sleep(60)
    return {}, 60.0


def test_an_error_stops_the_other_checks_at_once():
    tasks = [Task("reference", op, "cpu_fp32") for op in ("slow1", "boom", "slow2", "slow3")]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="checking reference boom on cpu_fp32 raised in its "
                                           "worker: ValueError: boom"):
        check_in_workers(tasks, jobs=2, worker=_fail_fast_or_sleep)
    assert time.monotonic() - start < 30  # the sleeping checks were not awaited


def _record_pid_and_sleep(task, quick, seeds):
    (Path(task.profile) / str(os.getpid())).touch()
    time.sleep(120)
    return {}, 120.0


ORPHAN_PARENT = """
import os, sys, threading, time
from pathlib import Path
from normspec.workers import Task, check_in_workers
from test_conformance_jobs import _record_pid_and_sleep

if __name__ == "__main__":
    folder = Path(sys.argv[1])
    tasks = [Task("reference", op, str(folder)) for op in ("a", "b")]
    threading.Thread(target=check_in_workers, args=(tasks,),
                     kwargs={"jobs": 2, "worker": _record_pid_and_sleep}, daemon=True).start()
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)  # no cleanup, as after SIGKILL
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not hasattr(os, "getppid") or os.name != "posix", reason="POSIX only")
def test_workers_exit_when_their_parent_dies_without_stopping_them(tmp_path):
    folder = tmp_path / "pids"
    folder.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(script), str(folder)], env=env, check=True,
                   timeout=120)
    pids = [int(p.name) for p in folder.iterdir()]
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers {left} outlived their parent"


INTERRUPTED_PARENT = """
import signal, sys
from pathlib import Path
from normspec.workers import Task, check_in_workers
from test_conformance_jobs import _record_pid_and_sleep

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    folder = Path(sys.argv[1])
    tasks = [Task("reference", op, str(folder)) for op in ("a", "b", "c", "d")]
    check_in_workers(tasks, jobs=2, worker=_record_pid_and_sleep)
"""


@pytest.mark.skipif(os.name != "posix", reason="POSIX process groups")
def test_ctrl_c_stops_the_workers_at_once(tmp_path):
    folder = tmp_path / "pids"
    folder.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(INTERRUPTED_PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script), str(folder)], env=env,
                              start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.name) for p in folder.iterdir()]
    assert len(pids) == 2
    start = time.monotonic()
    os.killpg(parent.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    try:
        _, err = parent.communicate(timeout=30)
    finally:
        parent.kill()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert time.monotonic() - start < 20 and "KeyboardInterrupt" in err
    assert not any(_alive(p) for p in pids)


def test_a_failing_progress_callback_is_raised_after_the_checks_not_a_hang():
    def broken():
        raise OSError("terminal gone")

    with pytest.raises(RuntimeError, match="on_case raised OSError: terminal gone"):
        check_in_workers([Task("reference", "rms_norm", "cpu_fp32")], jobs=1, quick=True,
                         on_case=broken)


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

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert cli._jobs(None, "cuda") == expected
    assert cli._jobs(None, "cpu") == 1
    assert cli._jobs(3, "cpu") == 3


def test_longest_first_puts_checks_without_a_time_first_then_the_longest():
    a, b, c, d, e = (Task("x", op, "cpu_fp32") for op in "abcde")
    seconds = {b: 3.0, c: 40.0, e: 3.0}
    # d and a have no time: first, in their given order; then 40 s; then the 3 s ties as given
    assert longest_first([d, b, a, c, e], seconds) == [d, a, c, b, e]
    assert longest_first([], seconds) == []


def _write(folder: Path, profile: str, op: str, text: str) -> None:
    (folder / profile).mkdir(parents=True, exist_ok=True)
    (folder / profile / f"{op}.json").write_text(text)


def test_previous_seconds_reads_each_reports_check_seconds(tmp_path):
    _write(tmp_path, "cpu_fp32", "rms_norm", json.dumps(
        {"check_seconds": {"reference": 2.5, "liger": 80.0, "odd": "slow"}}))
    _write(tmp_path, "cpu_fp32", "rms_norm_gated", "{not json")
    _write(tmp_path, "cpu_bf16", "rms_norm", json.dumps({"results": {}}))  # an older report
    _write(tmp_path, "cpu_bf16", "rms_norm_gated", json.dumps({"check_seconds": [1, 2]}))
    tasks = [Task(b, op, prof) for prof in ("cpu_fp32", "cpu_bf16", "cpu_none")
             for op in ("rms_norm", "rms_norm_gated", "fused_add_rms_norm")
             for b in ("reference", "liger", "odd")]
    assert previous_seconds(tmp_path, tasks) == {Task("reference", "rms_norm", "cpu_fp32"): 2.5,
                                                 Task("liger", "rms_norm", "cpu_fp32"): 80.0}
    assert previous_seconds(tmp_path / "absent", tasks) == {}


def test_the_workers_get_the_longest_checks_first_by_the_reports_they_replace(tmp_path,
                                                                               monkeypatch):
    _write(tmp_path, "cpu_bf16", "rms_norm", json.dumps(
        {"check_seconds": {"reference": 1.0, "transformers": 50.0}}))
    _write(tmp_path, "cpu_bf16", "rms_norm_gated", json.dumps(
        {"check_seconds": {"reference": 20.0}}))
    handed: list[Task] = []

    def in_order(tasks, *, jobs, quick, seeds, on_case, on_result, fresh_process_per_task):
        assert not fresh_process_per_task  # CPU checks share their workers
        handed.extend(tasks)
        for i, task in enumerate(tasks):  # as the workers would, with made-up times
            result = harness.check(registry.get_backend(task.backend), task.op,
                                   PROFILES[task.profile], quick=quick, seeds=seeds)
            on_result(task, result, 100.0 + i)

    monkeypatch.setattr(conformance, "check_in_workers", in_order)
    reports = run_conformance(**SELECTION, out_dir=tmp_path, jobs=2)
    assert handed == [Task("transformers", "rms_norm_gated", "cpu_bf16"),  # no time yet
                      Task("transformers", "rms_norm", "cpu_bf16"),
                      Task("reference", "rms_norm_gated", "cpu_bf16"),
                      Task("reference", "rms_norm", "cpu_bf16")]
    # the new reports carry this run's times, and the next run orders by them
    assert [r["check_seconds"] for r in reports] == [
        {"reference": 103.0, "transformers": 101.0}, {"reference": 102.0, "transformers": 100.0}]
    written = json.loads((tmp_path / "cpu_bf16" / "rms_norm.json").read_text())
    assert written["check_seconds"] == {"reference": 103.0, "transformers": 101.0}
    assert longest_first(handed, previous_seconds(tmp_path, handed))[0] == Task(
        "reference", "rms_norm", "cpu_bf16")


def test_a_fresh_process_per_task_shares_no_process_between_checks():
    """On CUDA each check gets a process of its own (a kernel's memory fault leaves its
    process's CUDA context unusable): no two tasks report the same process."""
    tasks = [Task("reference", op, "cpu_fp32") for op in ("a", "b", "c", "d")]
    results = check_in_workers(tasks, jobs=2, worker=_pid, fresh_process_per_task=True)
    pids = [r["pid"] for r in results.values()]
    assert len(set(pids)) == 4 and os.getpid() not in pids


@pytest.mark.parametrize(("jobs", "device", "want_here"), [
    (1, "cpu", {"reference", "mine"}),
    (4, "cpu", {"mine"}),
    (1, "cuda", {"mine"}),
    (4, "cuda", {"mine"}),
])
def test_where_each_check_runs(jobs, device, want_here):
    """On the CPU with one job this process checks everything; on CUDA, whatever the jobs,
    only backends registered in this process stay here (the others each get a process)."""
    tasks = [Task("reference", "rms_norm", "p"), Task("mine", "rms_norm", "p")]
    here, elsewhere = conformance.where_to_check(
        tasks, {"reference": False, "mine": True}, jobs=jobs, device=device)
    assert {t.backend for t in here} == want_here
    assert {t.backend for t in elsewhere} == {"reference", "mine"} - want_here
