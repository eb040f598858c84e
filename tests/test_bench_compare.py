"""bench/compare.py: rows of two bench results matched and compared (no GPU needed)."""

from __future__ import annotations

import json
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


def test_host_time_is_compared_where_both_rows_have_it(tmp_path, capsys):
    """A change on the host side leaves the GPU time alone: it is shown and marked too."""
    old = [{**_row("ours", "forward", 5.0, 4.6), "host_us": 40.0},
           {**_row("peer", "forward", 5.0, 4.6)}]
    new = [{**_row("ours", "forward", 25.0, 4.6), "host_us": 60.0},
           {**_row("peer", "forward", 5.0, 4.6), "host_us": 9.0}]
    shared, _, _ = bc.compare(old, new)
    ours, peer = sorted(shared, key=lambda r: r["key"][2])
    assert (ours["verdict"], ours["host_verdict"]) == ("", "slower")
    assert ours["host_change"] == pytest.approx(0.5)
    assert "host_change" not in peer  # the old row has no host time
    files = []
    for rows in (old, new):
        files.append(tmp_path / f"{len(files)}.json")
        files[-1].write_text(json.dumps({"environment": {}, "rows": rows}))
    assert bc.main([str(f) for f in files]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "ours" in ln)
    assert line.split()[-3:] == ["60.0", "50.0%", "slower"]


def test_a_file_without_rows_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"settings": []}))
    with pytest.raises(bc.CompareError, match="expected a 'rows' list"):
        bc.load_rows(str(path))


def test_unreadable_file_is_reported(tmp_path, capsys):
    assert bc.main([str(tmp_path / "missing.json"), str(tmp_path / "missing.json")]) == 2
    assert "cannot read it as JSON" in capsys.readouterr().err
