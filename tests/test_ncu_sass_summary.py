"""scripts/ncu_sass_summary.py (no GPU needed): a stand-in for ncu's source-page CSV with
two kernels, one of them repeated as ncu repeats a kernel per profiled launch."""

from __future__ import annotations

import csv
import io

import pytest
from _scripts import load_script

summary = load_script("scripts/ncu_sass_summary.py", "ncu_sass_summary")

HEADER = ["Address", "Source", "# Samples", "Instructions Executed", "stall_long_sb",
          "stall_no_inst", "stall_long_sb (Not Issued)"]


def _section(name, rows):
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(["Kernel Name", name])
    w.writerow(HEADER)
    w.writerows(rows)
    return out.getvalue()


@pytest.fixture
def report(tmp_path):
    a = _section("void k_a<1>(int)", [
        ["0", "LDC R1, c[0x0][0x28]", "5", "4", "0", "5", "0"],
        ["1", "IMAD R2, R3, R4, RZ", "0", "4", "0", "0", "0"],
        ["2", "LDG.E.128 R8, desc[UR4][R2.64]", "1", "4", "0", "1", "0"],
        ["3", "SHF.L.U32 R4, R8, 0x10, RZ", "20", "1,024", "20", "0", "20"],
    ])
    b = _section("void k_b(float)", [["0", "EXIT", "2", "4", "0", "2", "0"]])
    path = tmp_path / "sass.csv"
    path.write_text(a + a + b)
    return path


def test_kernels_splits_the_sections(report):
    found = summary.kernels(report)
    assert [name for name, _, _ in found] == ["void k_a<1>(int)", "void k_a<1>(int)",
                                              "void k_b(float)"]
    assert len(found[0][2]) == 4 and found[0][1] == HEADER


def test_summary_counts_and_ranks(report):
    name, header, rows = summary.kernels(report)[0]
    text = summary.summary(name, header, rows, top=2)
    lines = text.splitlines()
    assert lines[0] == "== void k_a<1>"
    assert lines[1].strip() == ("SASS 4, samples 26, warp instructions executed 1036, "
                                "first global load at SASS 2")
    # the not-issued column is not counted twice
    assert lines[2].strip() == "long_sb 20, no_inst 6"
    assert "#3" in lines[3] and "long_sb 20" in lines[3]
    assert "#0" in lines[4] and "no_inst 5" in lines[4]
    assert len(lines) == 5


def test_main_prints_each_kernel_once(report, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["ncu_sass_summary.py", str(report), "--top", "1"])
    summary.main()
    out = capsys.readouterr().out
    assert out.count("== void k_a<1>") == 1 and out.count("== void k_b") == 1


def test_not_a_source_page(tmp_path):
    path = tmp_path / "details.txt"
    path.write_text("  Duration   ns   2,912\n")
    with pytest.raises(SystemExit, match="no '\"Kernel Name\"' line"):
        summary.kernels(path)
