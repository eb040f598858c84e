"""Run ``bench/run.py`` in several processes and rank the backends on the medians.

A bench process times each call many times, so its rounds agree closely; yet on the
H200 the small cases moved from one process to the next by about 0.2 µs (forwards) and
up to 0.6 µs (two-kernel backwards), as much as the gaps between the backends on
those cases. This script runs the same bench ``--processes`` times, one
fresh process after another, keeps every process's time of every row, and ranks on the
median over the processes: ours against the fastest peer per case and direction, with
each side's range over the processes, so that a gap inside the ranges reads as what it is.

    python3 bench/repeat.py --processes 3 --out bench/results/repeat -- \\
        --case norm:1:2048 --case norm:64:2048 --rounds 5 --backend torch_ext \\
        --backend compile --backend liger

The arguments after ``--`` go to ``bench/run.py`` (all but ``--out``, which this script
sets per process). Writes ``<out>/<gpu>.json``: the first process's environment with the
command and the process count, and per row the median ``device_us`` (or ``us`` where
device timing is off) with every process's value. Needs what ``bench/run.py`` needs.
Files committed under ``bench/results/repeat/`` are ranked on the docs' benchmarks page.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import load_rows, row_key  # bench/ is not a package: its folder on the path

RUN = Path(__file__).resolve().parent / "run.py"
#: Rows that are references, not peers.
REFERENCE = "device copy (same bytes)"


def child_command(run_args: Sequence[str], out_dir: Path) -> list[str]:
    """The command of one bench process: ``bench/run.py`` with ``run_args`` and its own
    ``--out``."""
    for a in run_args:
        if a == "--out" or a.startswith("--out="):
            raise ValueError("bench/run.py's --out is set by repeat.py per process; "
                             f"leave it out of the arguments after '--' (got {a!r})")
    return [sys.executable, str(RUN), *run_args, "--out", str(out_dir)]


def _time_of(row: dict) -> float | None:
    t = row.get("device_us")
    return t if t is not None else row.get("us")


def merge_runs(runs: Sequence[tuple[dict, list[dict]]]) -> dict:
    """``{"environment", "rows"}`` of several processes' ``(environment, rows)``: one row
    per key of the first process. Its time, under ``device_us`` where the rows have
    device times and ``us`` where not, is the median over the processes that timed it;
    every process's time is under ``<that field>_processes`` (None where a process lacks
    the row). The environment is the first process's."""
    if not runs:
        raise ValueError("merge_runs: expected at least one process's rows, got none")
    env = dict(runs[0][0])
    by_key = [{row_key(r): r for r in rows} for _, rows in runs]
    merged = []
    for key, first in by_key[0].items():
        times = [_time_of(k[key]) if key in k else None for k in by_key]
        field = "device_us" if first.get("device_us") is not None else "us"
        row = {n: first[n] for n in ("name", "shape", "backend", "direction")}
        timed = [t for t in times if t is not None]
        row[field] = statistics.median(timed) if timed else None
        row[f"{field}_processes"] = times
        merged.append(row)
    return {"environment": env, "rows": merged}


def _summary(row: dict) -> tuple[float, float, float] | None:
    """(median, min, max) of a merged row's time over the processes that timed it."""
    field = "device_us" if "device_us" in row else "us"
    times = [t for t in row.get(f"{field}_processes", []) if t is not None]
    return (row[field], min(times), max(times)) if times else None


def rank(rows: Sequence[dict], ours: str = "normspec") -> list[dict]:
    """Per case and direction: our backends' median and range over the processes against
    the fastest peer's (the reference copy left out), and whether ours is no slower
    (``met``) and whether the two ranges overlap (``overlap``: the gap is within what the
    processes moved)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["name"], tuple(r["shape"]), r["direction"]), []).append(r)
    out = []
    for (name, shape, direction), members in groups.items():
        peers = [(_summary(r), r["backend"]) for r in members
                 if ours not in r["backend"] and r["backend"] != REFERENCE]
        peers = [p for p in peers if p[0] is not None]
        best = min(peers, key=lambda p: p[0][0]) if peers else None
        for r in members:
            mine = _summary(r)
            if ours not in r["backend"] or mine is None:
                continue
            entry = {"name": name, "shape": list(shape), "direction": direction,
                     "backend": r["backend"], "median": mine[0], "range": mine[1:],
                     "peer": None, "met": None, "overlap": None}
            if best is not None:
                (pm, plo, phi), peer = best
                entry.update(peer=peer, peer_median=pm, peer_range=(plo, phi),
                             met=mine[0] <= pm, overlap=mine[1] <= phi and plo <= mine[2])
            out.append(entry)
    return out


def print_ranking(entries: Sequence[dict], processes: int) -> None:
    """One table line per our backend, case and direction: medians and ranges."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"device µs, median over {processes} processes [min-max]")
    for col in ("case", "ours", "µs", "fastest peer", "µs ", "verdict"):
        table.add_column(col)
    for e in entries:
        case = f"{e['name']} {e['shape'][0]}x{e['shape'][1]} {e['direction']}"
        mine = f"{e['median']:.2f} [{e['range'][0]:.2f}-{e['range'][1]:.2f}]"
        if e["peer"] is None:
            table.add_row(case, e["backend"], mine, "-", "-", "-")
            continue
        theirs = f"{e['peer_median']:.2f} [{e['peer_range'][0]:.2f}-{e['peer_range'][1]:.2f}]"
        verdict = ("met" if e["met"] else "missed") + (" (ranges overlap)" if e["overlap"]
                                                       else "")
        table.add_row(case, e["backend"], mine, e["peer"], theirs, verdict)
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    ours_args, run_args = given, []
    if "--" in given:
        i = given.index("--")
        ours_args, run_args = given[:i], given[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=3,
                   help="bench processes to run, one after another (default 3)")
    p.add_argument("--out", default="bench/results/repeat",
                   help="folder of the merged JSON (default bench/results/repeat)")
    args = p.parse_args(ours_args)
    if args.processes < 1:
        p.error(f"--processes must be at least 1, got {args.processes}")
    try:
        child_command(run_args, Path("unused"))
    except ValueError as exc:
        p.error(str(exc))
    runs = []
    with tempfile.TemporaryDirectory(prefix="normspec-repeat-") as tmp:
        for i in range(args.processes):
            cmd = child_command(run_args, Path(tmp) / str(i))
            print(f"[repeat] process {i + 1} of {args.processes}: {' '.join(cmd[1:])}",
                  file=sys.stderr, flush=True)
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
            files = sorted((Path(tmp) / str(i)).glob("*.json"))
            if done.returncode != 0 or not files:
                print(f"[repeat] process {i + 1} failed (exit {done.returncode}, "
                      f"{len(files)} result file(s)); stopping", file=sys.stderr)
                return done.returncode or 1
            runs.append(load_rows(str(files[0])))
    merged = merge_runs(runs)
    merged["environment"]["command"] = "python bench/repeat.py " + " ".join(given)
    merged["environment"]["processes"] = args.processes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = str(merged["environment"].get("device_name", "gpu")).replace(" ", "_")
    path = out / f"{name}.json"
    path.write_text(json.dumps(merged, indent=1) + "\n")
    print_ranking(rank(merged["rows"]), args.processes)
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
