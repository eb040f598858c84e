"""Progress lines of the first-use builds: whole lines from threads, and quiet when quick."""

from __future__ import annotations

import threading
import time

import pytest

from normspec import progress


def test_lines_from_threads_never_run_into_each_other(capsys):
    """Eight threads saying 200 lines each (the NVRTC pool beside the extension build):
    every line comes out whole. ``print`` writes the text and the newline apart, which on
    the H200 gave ``...afterwards...normspec cupy: compiling ...`` on one line."""
    start = threading.Barrier(8)

    def talk(k: int) -> None:
        start.wait()
        for i in range(200):
            progress.say(f"thread {k} line {i} " + "x" * 50)

    threads = [threading.Thread(target=talk, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = capsys.readouterr().err.splitlines()
    expected = {f"thread {k} line {i} " + "x" * 50 for k in range(8) for i in range(200)}
    assert len(lines) == len(expected) and set(lines) == expected


def test_quick_work_says_nothing(capsys):
    result = progress.announced_if_slow(lambda: 42, "starting", lambda r, s: f"done {r}",
                                        after=0.5)
    assert result == 42
    assert capsys.readouterr().err == ""


def test_slow_work_says_start_then_finish_with_its_result(capsys):
    def slow() -> str:
        time.sleep(0.3)
        return "built"

    result = progress.announced_if_slow(slow, "building ...",
                                        lambda r, s: f"{r} after {s:.1f} s", after=0.05)
    assert result == "built"
    start, finish = capsys.readouterr().err.splitlines()
    assert start == "building ..."
    assert finish.startswith("built after ") and float(finish.split()[2]) >= 0.3


def test_a_failing_slow_work_raises_after_its_start_line(capsys):
    def broken() -> None:
        time.sleep(0.2)
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        progress.announced_if_slow(broken, "building ...", lambda r, s: "never", after=0.05)
    assert capsys.readouterr().err.splitlines() == ["building ..."]
