"""``scripts/gpu_evidence.sh``'s stages wired to the commands they should run: the script
and ``ncu_profile.sh`` run in a scratch copy of ``scripts/``, with ``nvidia-smi``,
``normspec``, ``python3``, ``ncu`` and ``compute-sanitizer`` replaced by stubs that log
their arguments (no GPU, nothing of the repository written)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
{extra}
"""
# bench/repeat.py and launch_overhead.py write their JSON under --out; the latter's
# NORMSPEC_BUILD_DEFINES (the build it loads) is logged
PYTHON_EXTRA = """json=
[ "$1" = bench/repeat.py ] && json=repeat.json
if [ "$1" = bench/micro/launch_overhead.py ]; then
  json=launch_overhead.json
  echo "  defines=${NORMSPEC_BUILD_DEFINES:-} quad=${NORMSPEC_ROW_QUAD:-}" >> "$STUB_LOG"
fi
if [ -n "$json" ]; then
  prev=
  for a in "$@"; do
    [ "$prev" = --out ] && mkdir -p "$a" && echo '{}' > "$a/$json"
    prev=$a
  done
fi"""
# variables the stages read, which the caller's environment must not set
STAGE_VARIABLES = ("REPEAT_AFTER_FLUSH", "REPEAT_TAG", "RACECHECK_PLANTED",
                   "NORMSPEC_BUILD_DEFINES", "PEERS", "LIGER", "SMALL", "GATED", "FLA",
                   "BACKWARD", "CACHE", "CONFORMANCE_ARGS", "SWEEP_ARGS", "TESTS_PATHS",
                   "TESTS_WORKERS", "OFF32_ROUNDS", "DEPTH2_ROUNDS", "SKIP_BUILD",
                   "NORMSPEC_ROW_QUAD", "CONF_JOBS")


def _clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in STAGE_VARIABLES and not k.endswith("_LIMIT")}


@pytest.fixture
def run_stage(tmp_path):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and timeout")
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("gpu_evidence.sh", "ncu_profile.sh"):
        shutil.copy(ROOT / "scripts" / name, tree / "scripts" / name)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    extra = {"nvidia-smi": 'echo "NVIDIA H200"', "python3": PYTHON_EXTRA,
             "normspec": '[ -n "${NORMSPEC_BUILD_DEFINES:-}" ] && '
                         'echo "  defines=$NORMSPEC_BUILD_DEFINES" >> "$STUB_LOG"',
             "compute-sanitizer": 'echo "  defines=${NORMSPEC_BUILD_DEFINES:-}" >> "$STUB_LOG"'}
    for name in ("nvidia-smi", "normspec", "python3", "ncu", "compute-sanitizer"):
        path = stubs / name
        path.write_text(STUB.format(extra=extra.get(name, "")))
        path.chmod(0o755)
    log = tmp_path / "stub.log"
    log.touch()

    def run(*stages: str, **env: str) -> list[str]:
        out = tmp_path / "out"
        full = {**_clean_environment(), "PATH": f"{stubs}:{os.environ['PATH']}",
                "STUB_LOG": str(log), "OUT": str(out), "NORMSPEC_GIT_COMMIT": "abc1234", **env}
        done = subprocess.run(["bash", "scripts/gpu_evidence.sh", *stages], cwd=tree,
                              env=full, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return log.read_text().splitlines()

    run.tree = tree
    return run


def test_small_repeat_runs_the_protocols_it_is_asked_for(run_stage):
    lines = [ln for ln in run_stage("small-repeat", REPEAT_AFTER_FLUSH="w 1")
             if "bench/repeat.py" in ln]
    assert len(lines) == 2
    warm, one = lines
    assert warm.endswith("--flush-mib 1") and "--after-flush-kernels" not in warm
    assert one.endswith("--after-flush-kernels 1") and "--flush-mib" not in one
    for line in lines:
        assert "--processes 3" in line and "--backend liger" in line
    saved = sorted(p.name for p in (run_stage.tree / "bench/results/repeat").iterdir())
    assert saved == ["small_after_flush_1_abc1234.json", "small_warm_flush_1mib_abc1234.json"]


def test_conformance_checks_every_cuda_profile_in_worker_processes(run_stage):
    lines = [ln for ln in run_stage("conformance") if "conformance-cuda" in ln]
    assert lines == ["python3 -m nox -s conformance-cuda -- --jobs 8"]
    lines = [ln for ln in run_stage("conformance", CONF_JOBS="3", CONFORMANCE_ARGS="--quick")
             if "conformance-cuda" in ln]
    assert lines[-1] == "python3 -m nox -s conformance-cuda -- --jobs 3 --quick"


def test_small_repeat_defaults_to_the_bench_protocol_and_one_no_op_kernel(run_stage):
    lines = [ln for ln in run_stage("small-repeat") if "bench/repeat.py" in ln]
    assert [ln.rsplit(" ", 1)[1] for ln in lines] == ["0", "1"]
    assert all("--after-flush-kernels" in ln for ln in lines)


def test_small_repeat_tag_names_the_files_of_a_run_under_switches(run_stage):
    run_stage("small-repeat", REPEAT_AFTER_FLUSH="0 w", REPEAT_TAG="spread")
    saved = sorted(p.name for p in (run_stage.tree / "bench/results/repeat").iterdir())
    assert saved == ["small_after_flush_0_spread_abc1234.json",
                     "small_warm_flush_1mib_spread_abc1234.json"]


def test_ncu_small_liger_profiles_liger_without_ncu_s_flush(run_stage):
    lines = run_stage("ncu-small-liger", CACHE="none")
    ncu = [ln for ln in lines if ln.startswith("ncu ")]
    assert len(ncu) == 1
    assert "--cache-control none" in ncu[0] and "regex:_rms_norm_" in ncu[0]
    assert ncu[0].endswith("scripts/ncu_kernels.py --liger --small")
    # ncu's CSV (here the stub's empty output) is kept under the name the docs expect
    assert (run_stage.tree / "bench/results/ncu/small_liger_warm_H200.csv").exists()
    # the build stage runs first, as for every stage
    assert next(ln for ln in lines if not ln.startswith("nvidia-smi")) == "normspec build"


@pytest.mark.parametrize(("stage", "fragments"), [
    ("weight-early", ["--build=-DNORMSPEC_ROW_WEIGHT_EARLY=0",
                      "--out bench/results/sweeps/row_weight_early_abc1234.json"]),
    ("block-fold", ["bench/micro/small_backward_ab.cu",
                    "--build=-DNORMSPEC_BLOCK_FOLD_LOCAL=0 -DNORMSPEC_FWD_ROW_PER_BLOCK=0",
                    "--env NORMSPEC_AB_FLUSH_MIB=1",
                    "--out bench/results/sweeps/block_fold_abc1234.json"]),
    ("warp-team", ["bench/micro/small_backward_ab.cu", "--build=-DNORMSPEC_FWD_ROW_SLOT32=0",
                   "--build=-DNORMSPEC_TEAM_SKIP_BROADCAST=1", "--env NORMSPEC_AB_FLUSH_MIB=1",
                   "--out bench/results/sweeps/warp_team_abc1234.json"]),
])
def test_ab_stages_time_the_default_against_the_other_forms(run_stage, stage, fragments):
    """Each A/B stage runs ab.py once, with its harness, builds, settings and output file."""
    ab = [ln for ln in run_stage(stage) if "ab.py" in ln]
    assert len(ab) == 1
    for fragment in fragments:
        assert fragment in ab[0], (stage, fragment)


def test_raw_weight_times_both_builds_alternately_and_keeps_each_run(run_stage):
    """The raw-weight stage: launch_overhead.py over the q/k forwards, the default build and
    the NORMSPEC_ROW_W_RAW_ONE=0 one in turn, twice, each run's JSON kept by form and pass."""
    lines = run_stage("raw-weight")
    runs = [i for i, ln in enumerate(lines) if "bench/micro/launch_overhead.py" in ln]
    assert [lines[i + 1].strip() for i in runs] == [
        "defines= quad=", "defines=NORMSPEC_ROW_W_RAW_ONE=0 quad="] * 2
    for i in runs:
        assert "--case norm:64:256" in lines[i] and "--backend torch_ext" in lines[i]
        assert "--flush-mib 1 --flush-mib 256" in lines[i]
    saved = sorted(p.name for p in (run_stage.tree / "bench/results/probes").iterdir())
    assert saved == [f"raw_weight_{form}_{n}_abc1234.json"
                     for form in ("default", "old") for n in (1, 2)]


def test_quad_times_the_switch_both_ways_alternately_and_keeps_each_run(run_stage):
    """The quad stage: launch_overhead.py over few q/k rows on both sides of the quad
    form's bound, NORMSPEC_ROW_QUAD=1 and =0 in turn (a run-time switch: the one default
    build), twice, both CUDA backends, each run's JSON kept by form and pass."""
    lines = run_stage("quad")
    runs = [i for i, ln in enumerate(lines) if "bench/micro/launch_overhead.py" in ln]
    assert [lines[i + 1].strip() for i in runs] == ["defines= quad=1", "defines= quad=0"] * 2
    for i in runs:
        assert "--case norm:256:256 --case norm:512:256" in lines[i]
        assert "--backend torch_ext --backend cupy" in lines[i]
        assert "--flush-mib 1 --flush-mib 256" in lines[i]
    assert sum(ln == "normspec build" for ln in lines) == 1
    saved = sorted(p.name for p in (run_stage.tree / "bench/results/probes").iterdir())
    assert saved == [f"row_quad_{form}_{n}_abc1234.json"
                     for form in ("default", "off") for n in (1, 2)]


def test_racecheck_runs_both_sanitizer_tools_on_our_kernels_and_keeps_their_logs(run_stage):
    runs = [ln for ln in run_stage("racecheck") if ln.startswith("compute-sanitizer ")]
    assert [ln.split()[2] for ln in runs] == ["racecheck", "synccheck"]
    for line in runs:
        assert "--kernel-name kns=normspec" in line and "--error-exitcode 1" in line
        assert line.endswith("python3 scripts/sanitize_small.py")
    saved = sorted(p.name for p in (run_stage.tree / "bench/results/probes").iterdir())
    assert saved == ["racecheck_abc1234.txt", "synccheck_abc1234.txt"]


def test_racecheck_planted_checks_a_build_with_the_old_race(run_stage):
    lines = run_stage("racecheck", RACECHECK_PLANTED="1")
    runs = [i for i, ln in enumerate(lines) if ln.startswith("compute-sanitizer ")]
    assert len(runs) == 3
    # the first two run the default build, the third the planted one
    assert [lines[i + 1].strip() for i in runs] == [
        "defines=", "defines=", "defines=NORMSPEC_BWD_SAVED_SAME_HALF=1"]
    assert "--tool racecheck" in lines[runs[2]]
    assert (run_stage.tree / "bench/results/probes/racecheck_planted_abc1234.txt").exists()


@pytest.mark.parametrize("env", [{"LIGER": "1"}, {"LIGER": "1", "SMALL": "1", "PEERS": "1"},
                                 {"LIGER": "1", "SMALL": "1", "FLA": "1"}])
def test_ncu_profile_refuses_liger_with_another_choice(run_stage, env):
    """``LIGER=1`` is for the small work alone, and one set of kernels at a time."""
    done = subprocess.run(["bash", "scripts/ncu_profile.sh"], cwd=run_stage.tree,
                          env={**_clean_environment(), "OUT": str(run_stage.tree), **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "LIGER=1" in done.stderr


@pytest.mark.parametrize(("stage", "setting", "rounds"), [
    ("bwd-off32", "NORMSPEC_BWD_OFF32=1", "OFF32_ROUNDS"),
    # two rows ahead is the default since 438c41d's A/B: the stage times one row ahead
    ("bwd-depth2", "NORMSPEC_BWD_DEPTH2=0", "DEPTH2_ROUNDS"),
])
def test_backward_switch_times_both_builds_then_tests_the_switched_build(
        run_stage, stage, setting, rounds):
    lines = run_stage(stage, **{rounds: "2"})
    ab = [ln for ln in lines if "bench/micro/ab.py" in ln]
    assert len(ab) == 1
    assert f"--build=-D{setting}" in ab[0] and "--env NORMSPEC_AB_GATED=1" in ab[0]
    assert "--rounds 2 " in ab[0]
    name = stage.removeprefix("bwd-")
    assert ab[0].endswith(f"--out bench/results/sweeps/bwd_{name}_abc1234.json")
    # the default build first (stage "build"), then the switched one, whose tests follow
    builds = [i for i, ln in enumerate(lines) if ln == "normspec build"]
    assert len(builds) == 2 and lines[builds[1] + 1] == f"  defines={setting}"
    tests = [ln for ln in lines if "pytest" in ln]
    assert len(tests) == 1 and "-m cuda" in tests[0]
    assert tests[0].endswith("tests/test_torch_ext_cuda.py")


def test_out_holds_few_files_and_the_logs_in_one_tarball(run_stage, tmp_path):
    """The device tool brings back at most 8 files from $OUT: a run of many stages leaves
    summary.log, evidence.tgz and logs.tgz there, the tarball holding each stage's log."""
    run_stage("bwd-off32", "bwd-depth2", "racecheck", RACECHECK_PLANTED="1")
    out = tmp_path / "out"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["evidence.tgz", "logs.tgz", "summary.log"]
    with tarfile.open(out / "logs.tgz") as tar:
        logs = {Path(n).name for n in tar.getnames()}
    assert {"build.log", "bwd-off32.log", "bwd-depth2.log", "pytest-cuda-depth2.log",
            "racecheck.log", "racecheck-planted.log"} <= logs
    # the sanitizer's logs still reach bench/results/probes
    assert (run_stage.tree / "bench/results/probes/racecheck_abc1234.txt").exists()


def test_skip_build_drops_only_the_first_default_build(run_stage):
    lines = run_stage("bwd-off32", SKIP_BUILD="1")
    builds = [i for i, ln in enumerate(lines) if ln == "normspec build"]
    assert len(builds) == 1 and lines[builds[0] + 1] == "  defines=NORMSPEC_BWD_OFF32=1"


def test_ncu_source_bwd_samples_our_gated_backward_then_fla_s(run_stage):
    lines = run_stage("ncu-source-bwd")
    profiles = [ln for ln in lines if ln.startswith("ncu ") and " -k " in ln]
    assert len(profiles) == 2
    ours, fla = profiles
    for line in profiles:
        assert "--set full" in line and "--kernel-name-base demangled" in line
        assert " -c 1 " in line and "--profile-from-start off" in line
    # the gated backward's own kernel (two rows a team), by name as ncu's demangled names
    # give it, and not the pipelined backward's (which also ran the gated op before it)
    assert "-k regex:normspec_gated_bwd_pair_kernel< " in ours
    pattern = re.compile(ours.split("-k regex:")[1].split(" ")[0])
    seen = "void normspec::normspec_gated_bwd_pair_kernel<__nv_bfloat16, (int)4, (int)0>"
    old = "void normspec_bwd_pipe_kernel<(int)2, __nv_bfloat16, (int)1, (int)4, (bool)1, (int)0>"
    assert pattern.search(seen) and not pattern.search(old)
    assert ours.endswith("scripts/ncu_kernels.py --backward")
    assert "-k regex:layer_norm_gated_bwd " in fla
    assert fla.endswith("scripts/ncu_kernels.py --fla --backward")
    pages = [ln for ln in lines if ln.startswith("ncu -i ")]
    assert len(pages) == 2 and all("--page source --csv --print-source sass" in ln
                                   for ln in pages)
    for who in ("ours", "fla"):
        assert (run_stage.tree / f"bench/results/ncu/gated_bwd_sass_{who}_H200.csv").exists()
