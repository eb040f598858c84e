"""Run every available backend × op × profile and summarise the levels."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import harness, registry
from .ops import OPS
from .profiles import PROFILES, Profile
from .report import build_report, write_report
from .workers import Task, check_in_workers, longest_first, validate_jobs

__all__ = [
    "default_device",
    "distance_table",
    "not_run",
    "parse_requirements",
    "percent_floor",
    "previous_seconds",
    "profiles_for",
    "reports_it_would_shrink",
    "requirement_failures",
    "run_conformance",
    "summary_table",
]

LEVEL_STYLE = {"exact": "bold green", "invariant": "green", "accurate": "yellow",
               "fails": "bold red", "unavailable": "dim", "none": "dim"}


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def profiles_for(device: str) -> list[Profile]:
    """The profiles of one device type."""
    found = [p for p in PROFILES.values() if p.device == device]
    if not found:
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    return found


def reports_it_would_shrink(out_dir: Path, device: str, backends: Sequence[str],
                            ops: Sequence[str] | None = None,
                            profiles: Sequence[str] | None = None) -> dict[Path, list[str]]:
    """The reports under ``out_dir`` that a run of only ``backends`` would rewrite without
    some of the backends they hold (a report is one file per op and profile, rewritten
    whole), each with the backends it would lose."""
    names = [p.name for p in profiles_for(device)] if not profiles else list(profiles)
    lost: dict[Path, list[str]] = {}
    for profile in names:
        for op in ops or OPS:
            path = Path(out_dir) / profile / f"{op}.json"
            try:
                held = json.loads(path.read_text()).get("results") or {}
            except (OSError, ValueError, AttributeError):
                continue
            dropped = sorted(set(held) - set(backends))
            if dropped:
                lost[path] = dropped
    return lost


def run_conformance(
    *,
    device: str,
    quick: bool = False,
    backends: Sequence[str] | None = None,
    ops: Sequence[str] | None = None,
    profiles: Sequence[str] | None = None,
    seeds: int | None = None,
    out_dir: Path | None = Path("reports"),
    command: str = "normspec conformance",
    console: Console | None = None,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """Check every selected backend on every selected op and profile.

    Returns the reports (one per op × profile, in profile then op order);
    writes each under ``out_dir`` (unless it is ``None``) as soon as its
    checks are done. With ``jobs`` above 1 the checks (one backend's op on
    one profile each) run side by side in that many worker processes (see
    [`normspec.workers`][normspec.workers]); the verdicts are the same. On CUDA each
    check runs in a spawned process of its own, also with ``jobs`` 1, so that a backend
    whose kernel faults (a misaligned or illegal address leaves a process's CUDA context
    unusable) fails its own check and no other. A script that runs checks in worker
    processes needs an ``if __name__ == "__main__":`` guard around the call (the workers
    are spawned, and re-import the script).
    The workers take the longest checks first, by the times in the reports
    already under ``out_dir`` ([`previous_seconds`][normspec.conformance.previous_seconds]).
    """
    validate_jobs(jobs)
    console = console or Console(stderr=True)
    chosen_profiles = ([PROFILES[p] for p in profiles] if profiles else profiles_for(device))
    wrong = [p.name for p in chosen_profiles if p.device != device]
    if wrong:
        raise ValueError(f"profile: {wrong} do not run on device {device!r}")
    chosen_ops = list(ops or OPS)
    entries = registry.entries()
    names = list(backends) if backends else sorted(entries)
    status = registry.statuses(names)  # raises for an unknown name, naming the installed
    loaded = {n: entries[n].load() for n in names}
    versions = {n: (b.library_version() if b else None) for n, b in loaded.items()}
    runnable = [n for n in names if status[n] is None and loaded[n] is not None]

    tasks = [Task(n, op_name, prof.name) for prof in chosen_profiles for op_name in chosen_ops
             for n in runnable]
    if jobs > 1 and out_dir is not None:
        tasks = longest_first(tasks, previous_seconds(out_dir, tasks))
    total = sum(
        sum(1 for _ in harness.iter_cases(OPS[t.op], PROFILES[t.profile], quick=quick,
                                          seeds=seeds))
        for t in tasks
    )
    results: dict[tuple[str, str], dict[str, Any]] = {}
    pending: dict[tuple[str, str], set[str]] = {}
    for prof in chosen_profiles:
        for op_name in chosen_ops:
            key = (prof.name, op_name)
            pending[key] = set(runnable)
            results[key] = {n: _unavailable(entries[n], loaded[n], status[n])
                            for n in names if n not in runnable}
    seconds: dict[tuple[str, str], dict[str, float]] = {key: {} for key in results}
    finished: dict[tuple[str, str], dict[str, Any]] = {}

    def finish(key: tuple[str, str]) -> None:
        ordered = {n: results[key][n] for n in names}
        report = build_report(key[1], PROFILES[key[0]], ordered, quick=quick, seeds=seeds,
                              command=command, library_versions=versions,
                              check_seconds={n: seconds[key][n] for n in names
                                             if n in seconds[key]})
        if out_dir is not None:
            write_report(report, out_dir)
        finished[key] = report

    def record(task: Task, result: dict[str, Any], elapsed: float) -> None:
        key = (task.profile, task.op)
        results[key][task.backend] = result
        seconds[key][task.backend] = elapsed
        pending[key].discard(task.backend)
        if not console.is_terminal:  # CI logs: one line per check
            lv = result["level"]
            console.print(f"{task.profile} {task.op} {task.backend}: forward={lv['forward']}"
                          f" gradient={lv['gradient']} ({elapsed:.1f} s)", highlight=False)
        if not pending[key]:
            finish(key)

    for key, waiting in pending.items():
        if not waiting:  # nothing runnable: the report holds only unavailable entries
            finish(key)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=False) as progress:
        bar = progress.add_task("conformance", total=total)

        def advance(_case: object = None) -> None:
            progress.advance(bar)

        isolate = device == "cuda"
        here, elsewhere = where_to_check(
            tasks, {n: entries[n].in_process for n in names}, jobs=jobs, device=device)
        for task in here:
            progress.update(bar, description=f"{task.profile} {task.op} {task.backend}")
            start = time.perf_counter()
            result = harness.check(loaded[task.backend], task.op, PROFILES[task.profile],
                                   quick=quick, seeds=seeds, on_case=advance)
            record(task, result, time.perf_counter() - start)
        if elsewhere:
            progress.update(bar, description=f"{len(elsewhere)} checks in {jobs} processes")
            check_in_workers(elsewhere, jobs=jobs, quick=quick, seeds=seeds, on_case=advance,
                             on_result=record, fresh_process_per_task=isolate)
    return [finished[(prof.name, op_name)] for prof in chosen_profiles for op_name in chosen_ops]


def where_to_check(tasks: Sequence[Task], in_process: Mapping[str, bool], *, jobs: int,
                   device: str) -> tuple[list[Task], list[Task]]:
    """``tasks`` split into those this process checks and those for worker processes.

    A backend registered in this process only (``in_process[name]``) does not exist in a
    worker, so this process checks it. On the CPU with ``jobs`` 1 this process checks
    everything. On CUDA every other check goes to a worker (one process per check): a
    memory fault in one backend's kernel leaves its process's CUDA context unusable, and
    would fail every later check there.
    """
    here, elsewhere = [], []
    for task in tasks:
        in_parent = in_process[task.backend] or (jobs == 1 and device != "cuda")
        (here if in_parent else elsewhere).append(task)
    return here, elsewhere


def previous_seconds(out_dir: Path, tasks: Sequence[Task]) -> dict[Task, float]:
    """The seconds each task's check took in the reports under ``out_dir``.

    Reads ``out_dir/<profile>/<op>.json`` (a report written by an earlier
    run) for the tasks' profiles and ops; a task whose report is missing,
    unreadable, or without its backend's ``check_seconds`` has no entry.
    Only the order of the checks depends on it, never a result.
    """
    found: dict[Task, float] = {}
    for profile, op in sorted({(t.profile, t.op) for t in tasks}):
        try:
            report = json.loads((Path(out_dir) / profile / f"{op}.json").read_text())
            times = report.get("check_seconds") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(times, dict):
            continue
        for task in tasks:
            sec = times.get(task.backend)
            if ((task.profile, task.op) == (profile, op) and isinstance(sec, int | float)
                    and not isinstance(sec, bool) and math.isfinite(sec) and sec >= 0):
                found[task] = float(sec)
    return found


def _unavailable(entry: registry.BackendEntry, backend: registry.Backend | None,
                 reason: str | None) -> dict[str, Any]:
    return {
        "source": backend.source if backend else entry.origin,
        "backward": "none",
        "level": {"forward": "unavailable", "gradient": "unavailable"},
        "unavailable": reason,
    }


def not_run(reports: list[dict[str, Any]]) -> dict[str, str]:
    """Backends that ran in no report, with the first reason given."""
    ran = {b for r in reports for b, res in r["results"].items()
           if res["level"]["forward"] != "unavailable"}
    reasons: dict[str, str] = {}
    for r in reports:
        for b, res in r["results"].items():
            if b not in ran:
                reasons.setdefault(b, str(res.get("unavailable") or "unavailable"))
    return dict(sorted(reasons.items()))


def summary_table(reports: list[dict[str, Any]]) -> Table:
    """Backend × (profile, op) table of forward / gradient levels (backends that ran)."""
    table = Table(title="normspec conformance (forward / gradient)")
    table.add_column("backend", style="bold")
    columns = [(r["profile"], r["op"]) for r in reports]
    for prof, op in columns:
        table.add_column(f"{prof}\n{op}")
    backends = sorted({b for r in reports for b, res in r["results"].items()
                       if res["level"]["forward"] != "unavailable"})
    for b in backends:
        cells = []
        for r in reports:
            res = r["results"].get(b)
            if res is None:
                cells.append("")
                continue
            f, g = res["level"]["forward"], res["level"]["gradient"]
            if f == "unavailable":
                cells.append("[dim]unavailable[/dim]")
            else:
                cells.append(f"[{LEVEL_STYLE[f]}]{f}[/] / [{LEVEL_STYLE.get(g, '')}]{g}[/]")
        table.add_row(b, *cells)
    return table


def percent_floor(fraction: float) -> str:
    """``fraction`` as a percentage with two decimals, floored, so that 99.999 % never
    reads as 100.00 % (only an exact 1.0 does)."""
    return "100.00" if fraction == 1.0 else f"{math.floor(10000 * fraction) / 100:.2f}"


def distance_table(reports: list[dict[str, Any]]) -> Table:
    """How far each backend that is not exact is from the spec: per report, gate and output,
    the least fraction of bitwise-equal elements over the cases, the largest ulp distance
    and the largest relative difference (the tolerance judges max abs and max rel; a large
    ulp count next to "accurate" comes from elements near zero)."""
    table = Table(title="distance from the spec (backends not exact)")
    for col in ("backend", "profile", "op", "output", "bitwise equal", "max ulp", "max rel"):
        table.add_column(col)
    for r in reports:
        for name, res in sorted(r["results"].items()):
            if res["level"]["forward"] in ("unavailable", "exact") and \
                    res["level"]["gradient"] in ("unavailable", "exact", "none"):
                continue
            for gate, outcome in res.get("contract_gates", {}).items():
                for tensor, st in outcome.get("statistics", {}).items():
                    equal = st.get("min_equal_fraction")
                    rel = st.get("max_rel")
                    table.add_row(name, r["profile"], r["op"], f"{gate} {tensor}",
                                  "" if equal is None else f"{percent_floor(equal)} %",
                                  str(st.get("max_ulp")),
                                  f"{rel:.3g}" if isinstance(rel, float) else str(rel))
    return table


def parse_requirements(specs: Sequence[str]) -> dict[str, str]:
    """``["torch_ext=exact", "liger=accurate"]`` -> ``{"torch_ext": "exact", ...}``."""
    from .gates import LEVELS

    out: dict[str, str] = {}
    for spec in specs:
        name, sep, level = spec.partition("=")
        if not sep or not name or level not in LEVELS[:3]:
            raise ValueError(
                f"require: expected BACKEND=LEVEL with LEVEL in {LEVELS[:3]}, got {spec!r}"
            )
        out[name] = level
    return out


def requirement_failures(
    reports: list[dict[str, Any]], required: dict[str, str]
) -> list[str]:
    """One line per (report, backend, gate) whose level is worse than required.

    Reports in which the backend did not run (an op it does not implement)
    and gradients of backends without a backward are not judged; a required
    backend that ran in no report at all fails, so that a CI gate cannot pass
    because the thing it guards did not run.
    """
    from .gates import LEVELS

    rank = {level: i for i, level in enumerate(LEVELS)}
    problems: list[str] = []
    for name, want in required.items():
        ran = False
        for r in reports:
            res = r["results"].get(name)
            if res is None or res["level"]["forward"] == "unavailable":
                continue
            ran = True
            for gate, level in res["level"].items():
                if level != "none" and rank[level] > rank[want]:
                    problems.append(f"require {name}={want}: {r['profile']} {r['op']} "
                                    f"{gate}={level}")
        if not ran:
            reasons = {res.get("unavailable") for r in reports
                       if (res := r["results"].get(name)) is not None} - {None}
            problems.append(f"require {name}={want}: it ran in no report"
                            + (f" ({'; '.join(sorted(reasons))})" if reasons else ""))
    return problems
