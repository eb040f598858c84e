"""The "Train = rollout" page: rendered from the committed report, strict about bad ones."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # docs_gen is a folder of the repository, not a package

from docs_gen import train_rollout  # noqa: E402

REPORTS = ROOT / "reports"


def test_committed_report_renders_the_site_table_and_the_plot():
    report = train_rollout.load_report(REPORTS)
    page, files = train_rollout.train_rollout_page(report)
    assert "| gated_norm |" in page and "100.00 %" in page
    assert "patch_model(model" in page and "NORMSPEC_VLLM_ALIGNMENT=trainer" in page
    assert files[train_rollout.PLOT].startswith(b"\x89PNG")
    for kind, row in report["patched"]["sites"]["rollout_calls_on_trainer"].items():
        assert row["equal"] == 1.0, kind


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(kind="conformance"), "expected kind 'train_rollout'"),
    (lambda r: r.update(schema_version=7), "schema_version 1"),
    (lambda r: r.pop("patched"), "no 'patched' section"),
])
def test_a_malformed_report_names_the_file(tmp_path, change, message):
    (tmp_path / "train_rollout").mkdir()
    shutil.copy(REPORTS / train_rollout.REPORT, tmp_path / train_rollout.REPORT)
    path = tmp_path / train_rollout.REPORT
    report = json.loads(path.read_text())
    change(report)
    path.write_text(json.dumps(report))
    with pytest.raises(train_rollout.TrainRolloutReportError, match=message) as info:
        train_rollout.load_report(tmp_path)
    assert str(path) in str(info.value)


def test_a_missing_report_names_the_file(tmp_path):
    with pytest.raises(train_rollout.TrainRolloutReportError, match=r"cpu_tiny\.json"):
        train_rollout.load_report(tmp_path)
