"""bench/compare.py: rows of two bench results matched and compared (no GPU needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
bc = load_script("bench/compare.py", "bench_compare")


def _row(backend, direction, us, device_us=None, shape=(4, 8)):
    return {"name": "rms_norm", "shape": list(shape), "backend": backend,
            "direction": direction, "us": us, "device_us": device_us}


def test_shared_rows_compare_device_time_and_mark_beyond_the_threshold():
    old = [_row("ours", "forward", 10.0, 8.0), _row("ours", "backward", 20.0, 16.0),
           _row("peer", "forward", 5.0), _row("gone", "forward", 1.0)]
    new = [_row("ours", "forward", 12.0, 8.1), _row("ours", "backward", 19.0, 12.0),
           _row("peer", "forward", 5.5), _row("added", "forward", 1.0)]
    shared, only_old, only_new = bc.compare(old, new, threshold=0.02)
    got = {r["key"][2:]: (r["old_us"], r["new_us"], r["verdict"]) for r in shared}
    # device time where both rows have it (8.0 -> 8.1 is within 2 %), else do_bench's
    assert got == {("ours", "forward"): (8.0, 8.1, ""),
                   ("ours", "backward"): (16.0, 12.0, "faster"),
                   ("peer", "forward"): (5.0, 5.5, "slower")}
    assert [k[2] for k in only_old] == ["gone"] and [k[2] for k in only_new] == ["added"]
    shared, _, _ = bc.compare(old, new, backends=["our"])
    assert {r["key"][2] for r in shared} == {"ours"}


def test_settings_of_a_sweep_file(tmp_path):
    sweep = {"settings": [{"env": {}, "environment": {"command": "a"},
                           "rows": [_row("ours", "forward", 2.0)]},
                          {"env": {"X": "0"}, "environment": {"command": "b"},
                           "rows": [_row("ours", "forward", 3.0)]}]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    env, rows = bc.load_rows(f"{path}@1")
    assert env == {"command": "b"} and rows[0]["us"] == 3.0
    with pytest.raises(bc.CompareError, match=re.escape("'@2' does not exist; expected 0..1")):
        bc.load_rows(f"{path}@2")
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"environment": {}, "rows": []}))
    with pytest.raises(bc.CompareError, match="needs a file with a 'settings' list"):
        bc.load_rows(f"{plain}@0")
    with pytest.raises(bc.CompareError, match="expected a 'rows' list"):
        bc.load_rows(str(path))


def test_unreadable_file_is_reported(tmp_path, capsys):
    assert bc.main([str(tmp_path / "missing.json"), str(tmp_path / "missing.json")]) == 2
    assert "cannot read it as JSON" in capsys.readouterr().err
