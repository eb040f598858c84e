"""The conformance report's JSON schema: shipped, valid, met by every committed report and
by every report written; malformed, unknown and misfiled reports are named errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from normspec.report import SCHEMA_PATH, ReportError, read_report, validate_report, write_report

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted(p for p in (ROOT / "reports").glob("*/*.json")
                   if json.loads(p.read_text()).get("kind") == "normspec.conformance")


def test_the_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA_PATH.read_text()))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_report_follows_the_schema(path):
    assert read_report(path)["op"] == path.stem


@pytest.fixture
def report():
    return json.loads(COMMITTED[0].read_text())


@pytest.mark.parametrize(("change", "words"), [
    (lambda r: r.update(surprise=1), ["$", "surprise"]),
    (lambda r: r.update(op="layer_norm"), ["$.op", "layer_norm"]),
    (lambda r: r.update(profile="cpu_fp8"), ["$.profile", "cpu_fp8"]),
    (lambda r: r["results"]["reference"]["level"].update(forward="great"),
     ["$.results.reference.level.forward", "great"]),
    (lambda r: r["results"]["reference"].pop("source"), ["$.results.reference", "source"]),
])
def test_a_malformed_report_is_refused_when_written(report, tmp_path, change, words):
    bad = copy.deepcopy(report)
    change(bad)
    with pytest.raises(ReportError) as info:
        write_report(bad, tmp_path)
    for word in words:
        assert word in str(info.value)
    assert not list(tmp_path.rglob("*.json"))


def test_a_misfiled_report_is_refused_when_read(report, tmp_path):
    path = tmp_path / "cuda_fp16" / "rms_norm_gated.json"
    path.parent.mkdir()
    path.write_text(json.dumps(report))
    with pytest.raises(ReportError, match=r"rms_norm_gated\.json: misfiled"):
        read_report(path)


def test_a_valid_report_round_trips(report, tmp_path):
    path = write_report(report, tmp_path)
    assert read_report(path) == validate_report(report)
