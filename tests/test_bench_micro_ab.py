"""bench/micro/ab.py: parsing the harnesses' lines, variants, medians and hash checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
ab = load_script("bench/micro/ab.py", "bench_micro_ab", register=True)

# lines as the harnesses print them (row_forward_ab.cu, small_backward_ab.cu)
ROW_LINE = ("v1                                 q/k rms       524288 x 256      132.45 us  "
            "0123456789abcdef")
BWD_LINE = "v0           norm  32768 x 2048  fwd   68.80 us  bwd  118.50 us  7fafe622dae0dd54"
FLOOR_LINE = "v2           floor                          8192 B smem      2.81 us"


def test_parse_line_reads_case_times_and_hash():
    row = ab.parse_line(ROW_LINE)
    assert (row.label, row.case, row.times, row.digest) == (
        "v1", "q/k rms 524288 x 256", {"us": 132.45}, "0123456789abcdef")
    bwd = ab.parse_line(BWD_LINE)
    assert (bwd.label, bwd.case, bwd.times, bwd.digest) == (
        "v0", "norm 32768 x 2048", {"fwd": 68.8, "bwd": 118.5}, "7fafe622dae0dd54")
    floor = ab.parse_line(FLOOR_LINE)
    assert (floor.case, floor.times, floor.digest) == ("floor 8192 B smem", {"us": 2.81}, None)
    assert ab.parse_line("") is None
    assert ab.parse_line("v0 building the tables") is None


def test_variants_cross_builds_and_envs_and_reject_bad_env():
    vs = ab.variants(["", "-DX=1"], ["", "A=0 B=2"])
    assert [(v.name, v.build, v.env) for v in vs] == [
        ("v0", "", {}), ("v1", "", {"A": "0", "B": "2"}),
        ("v2", "-DX=1", {}), ("v3", "-DX=1", {"A": "0", "B": "2"})]
    assert [ab.describe(v) for v in vs] == ["default", "A=0 B=2", "-DX=1", "-DX=1 A=0 B=2"]
    with pytest.raises(ValueError, match="NAME=VALUE"):
        ab.variants([""], ["A"])


def test_summarize_takes_medians_and_flags_differing_hashes():
    vs = ab.variants(["", "-DX=1"], [""])
    rows = [{"variant": v, "round": r, "case": c, "times_us": {"us": t}, "hash": h}
            for v, r, c, t, h in [("v0", 1, "a", 10.0, "1"), ("v1", 1, "a", 8.0, "1"),
                                  ("v0", 2, "a", 12.0, "1"), ("v1", 2, "a", 9.0, "1"),
                                  ("v0", 1, "b", 5.0, "2"), ("v1", 1, "b", 5.0, "3")]]
    summary, differ = ab.summarize(rows, vs)
    assert summary[:2] == [{"case": "a", "variant": "v0", "median_us": {"us": 11.0}},
                           {"case": "a", "variant": "v1", "median_us": {"us": 8.5}}]
    assert differ == ["b"]


def test_main_names_the_missing_harness(capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(["bench/micro/no_such_harness.cu"])
    assert exc.value.code == 2
    assert "no_such_harness.cu" in capsys.readouterr().err


def _fake_nvcc(tmp_path: Path, monkeypatch, script: str) -> Path:
    """A shell script as ``$CUDA_HOME/bin/nvcc`` (skips without ``sh``); returns a
    harness source to pass it."""
    if shutil.which("sh") is None:
        pytest.skip("needs sh")
    fake = tmp_path / "bin"
    fake.mkdir()
    nvcc = fake / "nvcc"
    nvcc.write_text("#!/bin/sh\n" + script)
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    harness = tmp_path / "h.cu"
    harness.write_text("// fake\n")
    return harness


def test_main_runs_fake_harness_builds(tmp_path, monkeypatch):
    """With nvcc replaced by a script that writes a shell 'harness', the whole loop runs:
    two builds, two settings, two rounds, the medians and the JSON."""
    # the fake compiler writes an executable that prints one line per case; the time
    # depends on the -D flag and the X variable, the hash on nothing
    harness = _fake_nvcc(tmp_path, monkeypatch,
                         'out=""; d=0\nwhile [ $# -gt 0 ]; do case "$1" in -o) out=$2; '
                         'shift;; -DFAST=1) d=1;; esac; shift; done\n'
                         'printf \'#!/bin/sh\\nt=$((10 - %s - ${X:-0}))\\n'
                         'echo "$1 rms 4096 x 2048 $t.00 us 00000000000000aa"\\n\' "$d" '
                         '> "$out"\nchmod +x "$out"\n')
    out = tmp_path / "ab.json"
    monkeypatch.setenv("NORMSPEC_GIT_COMMIT", "abc1234")
    rc = ab.main([str(harness), "--build", "", "--build=-DFAST=1", "--env", "",
                  "--env", "X=2", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    medians = {(m["variant"], m["case"]): m["median_us"]["us"] for m in doc["medians"]}
    assert medians == {("v0", "rms 4096 x 2048"): 10.0, ("v1", "rms 4096 x 2048"): 8.0,
                       ("v2", "rms 4096 x 2048"): 9.0, ("v3", "rms 4096 x 2048"): 7.0}
    assert len(doc["rows"]) == 8 and doc["hashes_differ"] == []
    assert doc["git"]["commit"] == "abc1234" and "device" in doc


def test_launch_unit_builds_compile_every_source_apart_then_link(tmp_path, monkeypatch):
    """``--launch-units``: each variant's harness and launcher units are compiled to
    objects by separate nvcc processes (all at once), with the variant's flags, and then
    linked into one binary per variant."""
    log = tmp_path / "calls"
    harness = _fake_nvcc(tmp_path, monkeypatch,
                         f'echo "$*" >> {log}\nout=""\n'
                         'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
                         ': > "$out"\n')
    work = tmp_path / "work"
    work.mkdir()
    binaries = ab.build_all(harness, ["", "-DFAST=1"], True, work, ab.Console(quiet=True))
    assert binaries == {"": work / "build0", "-DFAST=1": work / "build1"}
    calls = log.read_text().splitlines()
    compiles = [c for c in calls if " -c " in c]
    links = [c for c in calls if " -c " not in c]
    assert len(compiles) == 2 * (1 + len(ab.LAUNCH_UNITS)) and len(links) == 2
    for unit in [str(harness), *(str(ab.CSRC / u) for u in ab.LAUNCH_UNITS)]:
        fast = [c for c in compiles if unit in c.split()]
        assert len(fast) == 2 and sum("-DFAST=1" in c.split() for c in fast) == 1
    for i, link in enumerate(sorted(links, key=lambda c: c.split()[-1])):
        objs = [a for a in link.split() if a.endswith(".o")]
        assert link.split()[-1] == str(work / f"build{i}")
        assert objs == [str(work / f"build{i}_{k}.o") for k in range(1 + len(ab.LAUNCH_UNITS))]


def test_a_stopped_run_reports_the_runs_that_ended(tmp_path, monkeypatch):
    """SIGTERM in the middle of the rounds (as ``timeout`` sends it): the runs that ended
    are summarized and written, the JSON says it stopped, and the exit code is 3."""
    # the harness of the second variant stops the script that runs it
    harness = _fake_nvcc(tmp_path, monkeypatch,
                         'out=""\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
                         'printf \'#!/bin/sh\\n[ "$1" = v1 ] && kill -TERM $PPID && sleep 5\\n'
                         'echo "$1 rms 4096 x 2048 7.00 us 00000000000000aa"\\n\' > "$out"\n'
                         'chmod +x "$out"\n')
    out = tmp_path / "ab.json"
    rc = ab.main([str(harness), "--env", "", "--env", "X=1", "--rounds", "2",
                  "--out", str(out)])
    assert rc == 3
    doc = json.loads(out.read_text())
    assert doc["stopped"] and [r["variant"] for r in doc["rows"]] == ["v0"]
    assert [(m["variant"], m["median_us"]) for m in doc["medians"]] == [("v0", {"us": 7.0})]


@pytest.mark.parametrize("harness, linked", [("small_backward_ab.cu", True),
                                             ("row_forward_ab.cu", False),
                                             ("bwd_variants.cu", False),
                                             ("fwd_variants.cu", False)])
def test_launch_units_follow_what_the_harness_includes(harness, linked):
    """Unasked, the launcher's units are linked to the harnesses that call its entry
    points (normspec_launch.h), not to those that compile it (normspec_launch_impl.cuh)
    or use the kernels alone; asked, the answer is kept where it can link."""
    path = ROOT / "bench" / "micro" / harness
    assert ab.launch_units_for(path, None) is linked
    assert ab.launch_units_for(path, False) is False
    if linked:
        assert ab.launch_units_for(path, True) is True


def test_launch_units_refused_for_a_harness_with_the_launcher(tmp_path, capsys):
    harness = tmp_path / "own.cu"
    harness.write_text('#include "micro_util.cuh"\n  #  include "normspec_launch_impl.cuh"\n')
    with pytest.raises(ValueError, match=r"own\.cu includes normspec_launch_impl\.cuh"):
        ab.launch_units_for(harness, True)
    with pytest.raises(SystemExit):
        ab.main([str(harness), "--launch-units"])
    assert "leave --launch-units out" in capsys.readouterr().err
    # a commented-out include does not count
    harness.write_text('// #include "normspec_launch.h"\nint main() {}\n')
    assert ab.launch_units_for(harness, None) is False
