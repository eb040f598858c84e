"""Summarise the SASS-level warp-state samples of an Nsight Compute report.

Input: the CSV that ``ncu -i REPORT.ncu-rep --page source --csv --print-source sass``
prints (the report taken with ``--section SourceCounters --warp-sampling-interval 0``).
Per kernel in it: the SASS count, the samples and executed instructions, where the
first global load sits, the samples by stall reason, and the instructions with the
most samples.

    python3 scripts/ncu_sass_summary.py ours_sass.csv --top 12
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path


def _int(text: str) -> int:
    return int((text or "0").replace(",", "") or 0)


def kernels(path: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(kernel name, header, rows)`` of each kernel section of the CSV."""
    lines = path.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    if not starts:
        raise SystemExit(f"{path}: no '\"Kernel Name\"' line; expected the CSV of "
                         "ncu --page source --csv --print-source sass")
    out = []
    for a, b in zip(starts, [*starts[1:], len(lines)], strict=True):
        name = next(csv.reader([lines[a]]))[1]
        rows = list(csv.reader(lines[a + 1:b]))
        out.append((name, rows[0], rows[1:]))
    return out


def summary(name: str, header: list[str], rows: list[list[str]], top: int) -> str:
    """The text block of one kernel."""
    ix = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    by_reason: Counter[str] = Counter()
    first_load = next((k for k, r in enumerate(rows) if "LDG" in r[ix["Source"]]), None)
    for r in rows:
        for h in stalls:
            by_reason[h[len("stall_"):]] += _int(r[ix[h]])
    samples = sum(_int(r[ix["# Samples"]]) for r in rows)
    executed = sum(_int(r[ix["Instructions Executed"]]) for r in rows)
    out = [f"== {name.split('(')[0]}",
           f"   SASS {len(rows)}, samples {samples}, warp instructions executed {executed}, "
           f"first global load at SASS {first_load}",
           "   " + ", ".join(f"{k} {v}" for k, v in by_reason.most_common() if v)]
    ranked = sorted(range(len(rows)), key=lambda k: -_int(rows[k][ix["# Samples"]]))[:top]
    for k in ranked:
        r = rows[k]
        reasons = ", ".join(f"{h[len('stall_'):]} {r[ix[h]]}" for h in stalls if _int(r[ix[h]]))
        out.append(f"   {_int(r[ix['# Samples']]):>5}  #{k:<4} {r[ix['Source']].strip()[:56]:<56} "
                   f"{reasons}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=12, help="instructions to list per kernel")
    args = p.parse_args()
    seen = set()
    for name, header, rows in kernels(args.csv):
        if name in seen:  # ncu repeats a kernel's section per profiled launch
            continue
        seen.add(name)
        print(summary(name, header, rows, args.top))


if __name__ == "__main__":
    main()
