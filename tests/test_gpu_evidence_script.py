"""``scripts/gpu_evidence.sh``'s stages wired to the commands they should run: the script
runs in a scratch copy of ``scripts/``, with ``nvidia-smi``, ``normspec``, ``python3`` and
``compute-sanitizer`` replaced by stubs that log their arguments (no GPU, nothing of the
repository written)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
"""
# variables the stages read, which the caller's environment must not set
STAGE_VARIABLES = ("CONFORMANCE_ARGS", "TESTS_WORKERS", "CONF_JOBS")


def _clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in STAGE_VARIABLES and not k.endswith("_LIMIT")}


@pytest.fixture
def run_stage(tmp_path):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and timeout")
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_evidence.sh", tree / "scripts" / "gpu_evidence.sh")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("nvidia-smi", "normspec", "python3", "compute-sanitizer"):
        path = stubs / name
        path.write_text(STUB + ('echo "NVIDIA H200"\n' if name == "nvidia-smi" else ""))
        path.chmod(0o755)
    log = tmp_path / "stub.log"
    log.touch()

    def run(*stages: str, **env: str) -> tuple[list[str], str]:
        out = tmp_path / "out"
        full = {**_clean_environment(), "PATH": f"{stubs}:{os.environ['PATH']}",
                "STUB_LOG": str(log), "OUT": str(out), "NORMSPEC_GIT_COMMIT": "abc1234", **env}
        done = subprocess.run(["bash", "scripts/gpu_evidence.sh", *stages], cwd=tree,
                              env=full, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return log.read_text().splitlines(), (out / "summary.log").read_text()

    return run


def test_every_stage_builds_first(run_stage):
    lines, _ = run_stage("compare")
    first = next(ln for ln in lines if not ln.startswith("nvidia-smi") and "find_spec" not in ln)
    assert first == "normspec build"


def test_default_stages_are_tests_conformance_bench_and_compare(run_stage):
    lines, _ = run_stage()
    assert any("-m pytest -q -m cuda" in ln for ln in lines)
    assert any("conformance-cuda" in ln for ln in lines)
    assert "python3 -m nox -s bench -- --quick" in lines
    assert sum(ln.startswith("normspec compare") for ln in lines) == 3
    assert not any(ln.startswith("compute-sanitizer") for ln in lines)


def test_conformance_checks_every_cuda_profile_in_worker_processes(run_stage):
    lines, _ = run_stage("conformance")
    assert [ln for ln in lines if "conformance-cuda" in ln] == [
        "python3 -m nox -s conformance-cuda -- --out reports --jobs 8"]
    lines, _ = run_stage("conformance", CONF_JOBS="3", CONFORMANCE_ARGS="--quick")
    assert [ln for ln in lines if "conformance-cuda" in ln][-1] == \
        "python3 -m nox -s conformance-cuda -- --out reports --jobs 3 --quick"


def test_compare_writes_each_op_s_matrix_where_the_docs_read_it(run_stage):
    lines, _ = run_stage("compare")
    runs = [ln for ln in lines if ln.startswith("normspec compare")]
    for op, line in zip(("rms_norm", "fused_add_rms_norm", "rms_norm_gated"), runs, strict=True):
        assert f"--op {op} --profile cuda_bf16" in line
        assert f"--json reports/compare/{op}-cuda_bf16.json" in line


def test_racecheck_runs_both_sanitizer_tools_on_our_kernels(run_stage):
    lines, _ = run_stage("racecheck")
    runs = [ln for ln in lines if ln.startswith("compute-sanitizer ")]
    assert [ln.split()[2] for ln in runs] == ["racecheck", "synccheck"]
    for line in runs:
        assert "--kernel-name kns=normspec" in line and "--error-exitcode 1" in line
        assert line.endswith("python3 scripts/sanitize_small.py")


def test_an_unknown_stage_is_named_in_the_summary(run_stage):
    _, summary = run_stage("ncu")
    assert "unknown stage 'ncu'" in summary


def test_integration_times_the_patched_model_into_a_result_per_gpu(run_stage):
    lines, _ = run_stage("integration")
    (line,) = [ln for ln in lines if "bench/integration.py" in ln]
    assert line.endswith("--out bench/results/integration_NVIDIA_H200.json"), line


def test_a_missing_requirement_stops_the_script_before_any_stage(tmp_path, run_stage):
    """The GPU machine installs nothing from the network: a package normspec needs that is
    missing there is named up front, before minutes of stages fail on it."""
    stubs = tmp_path / "bin"
    (stubs / "python3").write_text(STUB + 'case "$*" in *find_spec*) echo jsonschema;; esac\n')
    out = tmp_path / "out"
    env = {**_clean_environment(), "PATH": f"{stubs}:{os.environ['PATH']}",
           "STUB_LOG": str(tmp_path / "stub.log"), "OUT": str(out)}
    done = subprocess.run(["bash", "scripts/gpu_evidence.sh", "conformance"],
                          cwd=tmp_path / "tree", env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "missing python packages: jsonschema" in (out / "summary.log").read_text()
    assert not any("normspec" in line for line in (tmp_path / "stub.log").read_text().split("\n"))
