"""Compare two benchmark results row by row: GPU time and host time, before and after.

Each argument is a JSON file that ``bench/run.py`` wrote (``{"environment", "rows"}``).
Rows match on op, shape, backend and direction; a row's time is its device time
(``device_us``, host gaps hidden) where both runs have one, else do_bench's ``us``. Where
both rows have ``host_us`` (the time the host took to enqueue one call), its change is
shown too: a change on the host side leaves the GPU time alone but moves the call time
of small shapes.

Usage: ``python bench/compare.py OLD NEW [--backend SUBSTRING ...] [--threshold 0.02]``

Prints one line per shared row, old and new microseconds and the change, marked
``faster`` or ``slower`` beyond the threshold (a fraction of the old time), the host
times and theirs marked the same way, then the rows only one side has.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

Key = tuple[str, tuple[int, ...], str, str]


class CompareError(ValueError):
    """A result file that cannot be read as bench rows."""


def load_rows(path: str) -> tuple[dict, list[dict]]:
    """``(environment, rows)`` of a ``bench/run.py`` result file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CompareError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise CompareError(f"{path}: expected a 'rows' list (bench/run.py's output), got "
                           f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    return data.get("environment", {}), data["rows"]


def row_key(row: dict) -> Key:
    return (row["name"], tuple(row["shape"]), row["backend"], row["direction"])


def row_time(old: dict, new: dict) -> tuple[float, float] | None:
    """Both rows' microseconds, by the same measure: device time where both have it."""
    if old.get("device_us") is not None and new.get("device_us") is not None:
        return old["device_us"], new["device_us"]
    if old.get("us") is not None and new.get("us") is not None:
        return old["us"], new["us"]
    return None


def compare(old_rows: Sequence[dict], new_rows: Sequence[dict], backends: Sequence[str] = (),
            threshold: float = 0.02) -> tuple[list[dict], list[Key], list[Key]]:
    """The shared rows as ``{"key", "old_us", "new_us", "change", "verdict"}`` (change =
    new / old - 1) and, where both rows have ``host_us``, ``"old_host_us"``,
    ``"new_host_us"``, ``"host_change"`` and ``"host_verdict"``; then the keys only the old
    side has, then those only the new has."""
    def keep(rows: Sequence[dict]) -> dict[Key, dict]:
        return {row_key(r): r for r in rows
                if not backends or any(b in r["backend"] for b in backends)}

    old, new = keep(old_rows), keep(new_rows)
    shared = []
    for key in [k for k in old if k in new]:
        times = row_time(old[key], new[key])
        if times is None:
            continue
        before, after = times
        change = after / before - 1.0 if before > 0 else 0.0
        row = {"key": key, "old_us": before, "new_us": after, "change": change,
               "verdict": _verdict(change, threshold)}
        host_before, host_after = old[key].get("host_us"), new[key].get("host_us")
        if host_before and host_after is not None:
            host_change = host_after / host_before - 1.0
            row.update(old_host_us=host_before, new_host_us=host_after,
                       host_change=host_change, host_verdict=_verdict(host_change, threshold))
        shared.append(row)
    return shared, [k for k in old if k not in new], [k for k in new if k not in old]


def _verdict(change: float, threshold: float) -> str:
    return "faster" if change < -threshold else "slower" if change > threshold else ""


def _describe(label: str, spec: str, env: dict) -> str:
    commit = env.get("git", {}).get("commit", "?")
    return f"{label}: {spec} (commit {commit}; {env.get('command', 'command not recorded')})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", help="a bench/run.py result (JSON)")
    p.add_argument("new", help="the same, for the run to compare with OLD")
    p.add_argument("--backend", action="append", default=[], metavar="SUBSTRING",
                   help="only rows whose backend contains this (repeatable)")
    p.add_argument("--threshold", type=float, default=0.02,
                   help="a change beyond this fraction of the old time is marked (default 0.02)")
    args = p.parse_args(argv)
    if args.threshold < 0:
        p.error(f"--threshold must be at least 0, got {args.threshold}")
    try:
        old_env, old_rows = load_rows(args.old)
        new_env, new_rows = load_rows(args.new)
    except CompareError as exc:
        print(f"bench/compare.py: {exc}", file=sys.stderr)
        return 2
    shared, only_old, only_new = compare(old_rows, new_rows, args.backend, args.threshold)
    print(_describe("old", args.old, old_env))
    print(_describe("new", args.new, new_env))
    print(f"\n{'case':<34}{'backend':<31}{'dir':<9}{'old us':>9}{'new us':>9}{'change':>9}"
          f"{'':<8}{'old host':>9}{'new host':>9}{'change':>9}")
    for r in shared:
        name, shape, backend, direction = r["key"]
        case = f"{name} {'x'.join(map(str, shape))}"
        host = ""
        if "host_change" in r:
            host = (f"{r['old_host_us']:>9.1f}{r['new_host_us']:>9.1f}"
                    f"{100 * r['host_change']:>8.1f}% {r['host_verdict']}")
        print(f"{case:<34}{backend[:30]:<31}{direction:<9}{r['old_us']:>9.1f}{r['new_us']:>9.1f}"
              f"{100 * r['change']:>8.1f}% {r['verdict']:<7}{host}".rstrip())
    for label, keys in (("only in old", only_old), ("only in new", only_new)):
        for name, shape, backend, direction in keys:
            print(f"{label}: {name} {'x'.join(map(str, shape))} {backend} {direction}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
