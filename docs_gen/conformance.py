"""Conformance tables rendered from the committed reports (``reports/<profile>/<op>.json``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normspec.profiles import PROFILES
from normspec.report import KIND, ReportError, read_report

__all__ = ["Report", "level_badge", "load_reports", "render_conformance", "render_overview"]

LEVELS = ("exact", "invariant", "accurate", "fails", "unavailable", "none")
#: Failed lines shown per (backend, profile, gate) on the site; the JSON has them all.
MAX_LINES = 12


@dataclass(frozen=True)
class Report:
    """One committed report and where it was read from."""

    path: Path
    data: Mapping[str, Any]

    @property
    def op(self) -> str:
        return str(self.data["op"])

    @property
    def profile(self) -> str:
        return str(self.data["profile"])

    @property
    def env(self) -> Mapping[str, Any]:
        return self.data.get("environment", {})


def load_reports(directory: Path) -> list[Report]:
    """Every conformance report under ``directory/<profile>/*.json``, sorted by (op, profile).

    JSON files of another ``kind`` (e.g. divergence matrices) are ignored; a file that
    does not parse, a conformance report that does not follow the schema, or one filed
    under another profile or op raises [`ReportError`][normspec.report.ReportError]
    naming the file ([`read_report`][normspec.report.read_report]).
    """
    found: list[Report] = []
    if not directory.is_dir():
        return found
    order = {name: i for i, name in enumerate(PROFILES)}
    for path in sorted(directory.glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ReportError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("kind") != KIND:
            continue
        found.append(Report(path, read_report(path)))
    found.sort(key=lambda r: (r.op, order.get(r.profile, len(order)), r.profile))
    return found


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def level_badge(level: str) -> str:
    """An inline HTML badge for a conformance level (styled by ``docs/stylesheets``)."""
    cls = level if level in LEVELS else "none"
    return f'<span class="ns-level ns-{cls}">{_cell(level)}</span>'


def _commit(env: Mapping[str, Any]) -> str:
    git = env.get("git") or {}
    commit = git.get("commit")
    if not commit:
        return "—"
    return f"`{commit[:10]}`" + (" (dirty)" if git.get("dirty") else "")


def _device(env: Mapping[str, Any]) -> str:
    name = env.get("device_name") or env.get("device") or "?"
    cap = env.get("capability")
    return f"{name} (sm {cap})" if cap else str(name)


def _versions(env: Mapping[str, Any]) -> str:
    torch = env.get("torch") or "?"
    cuda = env.get("cuda")
    return f"torch {torch}" + (f", CUDA {cuda}" if cuda else "")


def _max_ulp(result: Mapping[str, Any], gate: str) -> str:
    stats = (result.get("contract_gates", {}).get(gate) or {}).get("statistics") or {}
    ulps = [s.get("max_ulp", 0) for s in stats.values()]
    return str(max(ulps)) if ulps else "—"


def _levels(result: Mapping[str, Any]) -> tuple[str, str]:
    level = result.get("level") or {}
    return str(level.get("forward", "none")), str(level.get("gradient", "none"))


def render_conformance(
    op: str, reports: Sequence[Report], profiles: Iterable[str] = PROFILES
) -> str:
    """The conformance section of an operator page (Markdown).

    A table backend × profile with both levels, the device, the versions, the
    date and the commit of the run; a row per profile that has no committed
    report; then the runs' commands and the failing gate lines.
    """
    mine = {r.profile: r for r in reports if r.op == op}
    lines = [
        '<div class="ns-conformance" markdown>',
        "",
        "| backend | profile | forward | gradient | max ulp (fwd / grad) | backward "
        "| library | device | versions | date | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    missing = []
    for profile in profiles:
        report = mine.get(profile)
        if report is None:
            missing.append(profile)
            lines.append(f"| — | `{profile}` | *no report committed* | | | | | | | | |")
            continue
        env = report.env
        libs = env.get("backends") or {}
        date = str(env.get("date", "?"))[:10]
        for backend, result in sorted(report.data["results"].items()):
            fwd, grad = _levels(result)
            ulp = (f"{_max_ulp(result, 'forward')} / {_max_ulp(result, 'gradient')}"
                   if "contract_gates" in result else "—")
            lines.append(
                f"| `{_cell(backend)}` | `{profile}` | {level_badge(fwd)} | {level_badge(grad)} "
                f"| {ulp} | {_cell(result.get('backward', '?'))} "
                f"| {_cell(libs.get(backend) or '—')} | {_cell(_device(env))} "
                f"| {_cell(_versions(env))} | {date} | {_commit(env)} |"
            )
    lines += ["", "</div>", ""]
    if missing:
        shown = ", ".join(f"`{p}`" for p in missing)
        lines += [
            '!!! note "No report committed"',
            "",
            f"    `reports/` holds no `{op}` report for {shown}. Reports are produced by "
            "`nox -s conformance` (CUDA profiles on a GPU machine) and committed under "
            "`reports/<profile>/<op>.json`.",
            "",
        ]
    if mine:
        lines += ["### Runs", "", "| profile | command | quick | platform | python | normspec "
                  "| file |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for profile, report in mine.items():
            env = report.env
            lines.append(
                f"| `{profile}` | `{_cell(report.data.get('command', '?'))}` "
                f"| {'yes' if report.data.get('quick') else 'no'} "
                f"| {_cell(env.get('platform', '?'))} | {_cell(env.get('python', '?'))} "
                f"| {_cell(env.get('normspec', '?'))} "
                f"| `reports/{profile}/{report.path.name}` |"
            )
        lines.append("")
        lines += _details(mine)
    return "\n".join(lines) + "\n"


def _details(mine: Mapping[str, Report]) -> list[str]:
    out: list[str] = []
    for profile, report in mine.items():
        for backend, result in sorted(report.data["results"].items()):
            fwd, grad = _levels(result)
            notes: list[str] = []
            if result.get("unavailable"):
                notes.append(f"unavailable: {result['unavailable']}")
            for variant, why in sorted((result.get("skipped_variants") or {}).items()):
                notes.append(f"skipped `{variant}`: {why}")
            gate_lines: list[str] = []
            for gate, g in (result.get("contract_gates") or {}).items():
                failed = g.get("failed_lines") or []
                gate_lines += [f"{gate}: {line}" for line in failed[:MAX_LINES]]
                if len(failed) > MAX_LINES:
                    gate_lines.append(f"{gate}: … {len(failed) - MAX_LINES} more in the JSON")
            if not notes and not gate_lines:
                continue
            kind = "failure" if "fails" in (fwd, grad) else (
                "warning" if gate_lines else "info")
            title = f"{backend} on {profile}: forward {fwd}, gradient {grad}"
            out += [f'??? {kind} "{_cell(title)}"', ""]
            out += [f"    - {_cell(n)}" for n in notes]
            if gate_lines:
                out += ["", "    ```text"] + [f"    {line}" for line in gate_lines] + ["    ```"]
            out.append("")
    return out


def render_overview(reports: Sequence[Report], ops: Iterable[str]) -> str:
    """Backend × (op, profile) matrix of ``forward / gradient`` levels, all ops on one page."""
    ops = list(ops)
    columns = [(op, p) for op in ops for p in PROFILES
               if any(r.op == op and r.profile == p for r in reports)]
    if not columns:
        return ('<div class="ns-conformance" markdown>\n\n!!! note "No report committed"\n\n'
                "    `reports/` holds no conformance report yet.\n\n</div>\n")
    by_key = {(r.op, r.profile): r for r in reports}
    backends = sorted({b for r in reports for b in r.data["results"]})
    head = "| backend | " + " | ".join(f"[`{op}`](operators/{op}.md#conformance)<br>`{p}`"
                                        for op, p in columns) + " |"
    lines = ['<div class="ns-conformance" markdown>', "", head,
             "| --- |" + " --- |" * len(columns)]
    for b in backends:
        cells = []
        for key in columns:
            res = by_key[key].data["results"].get(b)
            if res is None:
                cells.append("")
                continue
            fwd, grad = _levels(res)
            cells.append(level_badge(fwd) if fwd == "unavailable"
                         else f"{level_badge(fwd)} / {level_badge(grad)}")
        lines.append(f"| `{_cell(b)}` | " + " | ".join(cells) + " |")
    lines += ["", "</div>", ""]
    return "\n".join(lines)
