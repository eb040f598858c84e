"""bench/repeat.py (no GPU needed): the child commands, the merge of several processes'
rows into medians, the ranking of ours against the fastest peer, and a whole run with a
stand-in for bench/run.py."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from _scripts import load_script

repeat = load_script("bench/repeat.py", "bench_repeat")


def _row(backend, direction, device_us, shape=(1, 2048), us=None):
    return {"name": "rms_norm", "shape": list(shape), "backend": backend,
            "direction": direction, "us": us if us is not None else 10 * device_us,
            "device_us": device_us}


def test_child_command_sets_its_own_out(tmp_path):
    cmd = repeat.child_command(["--case", "norm:1:2048"], tmp_path)
    assert cmd[0] == sys.executable and cmd[1].endswith("bench/run.py")
    assert cmd[2:] == ["--case", "norm:1:2048", "--out", str(tmp_path)]
    for bad in (["--out", "x"], ["--out=x"]):
        with pytest.raises(ValueError, match="--out"):
            repeat.child_command(bad, tmp_path)


def test_merge_keeps_every_process_and_the_median():
    runs = [({"device_name": "G"}, [_row("ours normspec", "forward", 4.0),
                                    _row("peer", "forward", 5.0)]),
            ({"device_name": "G"}, [_row("ours normspec", "forward", 6.0)]),
            ({"device_name": "G"}, [_row("ours normspec", "forward", 5.0),
                                    _row("peer", "forward", 3.0)])]
    merged = repeat.merge_runs(runs)
    assert merged["environment"] == {"device_name": "G"}
    ours, peer = merged["rows"]
    assert ours["device_us"] == 5.0 and ours["device_us_processes"] == [4.0, 6.0, 5.0]
    # a process that lacks the row: None in its place, the median over the others
    assert peer["device_us_processes"] == [5.0, None, 3.0] and peer["device_us"] == 4.0


def test_merge_falls_back_to_call_time_without_device_time():
    row = _row("x", "backward", 1.0, us=7.0)
    row["device_us"] = None
    merged = repeat.merge_runs([({}, [row]), ({}, [dict(row, us=9.0)])])
    (only,) = merged["rows"]
    assert "device_us" not in only and only["us"] == 8.0 and only["us_processes"] == [7.0, 9.0]


def test_merge_needs_a_process():
    with pytest.raises(ValueError, match="at least one"):
        repeat.merge_runs([])


def test_rank_against_the_fastest_peer_not_the_copy():
    rows = [
        {**_row("normspec torch_ext", "forward", 4.5), "device_us_processes": [4.4, 4.5, 4.7]},
        {**_row("liger", "forward", 4.6), "device_us_processes": [4.2, 4.6, 4.65]},
        {**_row("torch.compile", "forward", 4.8), "device_us_processes": [4.8, 4.8, 4.9]},
        {**_row(repeat.REFERENCE, "forward", 4.0), "device_us_processes": [4.0, 4.0, 4.0]},
        {**_row("normspec torch_ext", "backward", 5.1), "device_us_processes": [5.0, 5.1, 5.2]},
        {**_row("liger", "backward", 4.5), "device_us_processes": [4.4, 4.5, 4.6]},
    ]
    fwd, bwd = repeat.rank(rows)
    assert fwd["peer"] == "liger" and fwd["met"] and fwd["overlap"]
    assert fwd["median"] == 4.5 and fwd["range"] == (4.4, 4.7)
    assert bwd["peer"] == "liger" and not bwd["met"] and not bwd["overlap"]
    # no peer in a case: ours is listed without a verdict
    (alone,) = repeat.rank(rows[:1])
    assert alone["peer"] is None and alone["met"] is None


@pytest.mark.parametrize("argv", [["--processes", "0"], ["--", "--out", "elsewhere"]])
def test_main_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit):
        repeat.main(argv)


FAKE_RUN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    count = Path(sys.argv[0]).with_name("count")
    n = int(count.read_text()) if count.exists() else 0
    count.write_text(str(n + 1))
    out.mkdir(parents=True)
    rows = [{"name": "rms_norm", "shape": [1, 2048], "backend": b, "direction": "forward",
             "us": 50.0, "device_us": t + n} for b, t in (("normspec torch_ext", 4.0),
                                                          ("liger", 4.5))]
    (out / "Fake_GPU.json").write_text(json.dumps(
        {"environment": {"device_name": "Fake GPU", "args": sys.argv[1:]}, "rows": rows}))
""")


def test_a_whole_run_with_a_stand_in_bench(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "run.py"
    fake.write_text(FAKE_RUN)
    monkeypatch.setattr(repeat, "RUN", fake)
    out = tmp_path / "merged"
    assert repeat.main(["--processes", "3", "--out", str(out), "--", "--rounds", "5"]) == 0
    data = json.loads((out / "Fake_GPU.json").read_text())
    env = data["environment"]
    assert env["processes"] == 3 and env["args"][:2] == ["--rounds", "5"]
    assert env["command"].endswith("--processes 3 --out " + str(out) + " -- --rounds 5")
    ours = next(r for r in data["rows"] if r["backend"] == "normspec torch_ext")
    assert ours["device_us_processes"] == [4.0, 5.0, 6.0] and ours["device_us"] == 5.0
    assert "met" in capsys.readouterr().out


def test_a_failing_process_stops_the_run(tmp_path, monkeypatch):
    fake = tmp_path / "run.py"
    fake.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setattr(repeat, "RUN", fake)
    assert repeat.main(["--processes", "2", "--out", str(tmp_path / "m")]) == 3
    assert not (tmp_path / "m").exists()
