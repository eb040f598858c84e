"""Conformance tables rendered from the committed reports (``reports/<profile>/<op>.json``)."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from normspec.conformance import percent_floor
from normspec.profiles import PROFILES
from normspec.report import KIND, ReportError, read_report

__all__ = [
    "Report",
    "answer_table",
    "level_badge",
    "load_reports",
    "render_conformance",
    "render_overview",
    "system_name",
]

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
    """Text from a report, safe anywhere in the page: HTML-escaped (a report can carry any
    string), with no pipe to split a table cell and no line break."""
    return html.escape(str(text)).replace("|", "&#124;").replace("\n", " ")


def _code(text: object) -> str:
    """Text from a report as inline code (``<code>``: a Markdown code span would show the
    escapes literally)."""
    return f"<code>{_cell(text)}</code>"


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


#: The profiles the answer table of an operator page shows, GPU first.
ANSWER_PROFILES = (("cuda_bf16", "GPU, bf16"), ("cpu_bf16", "CPU, bf16"))


def _forward_distance(result: Mapping[str, Any]) -> str:
    """The least % of bitwise-equal forward elements and the largest relative difference."""
    stats = (result.get("contract_gates", {}).get("forward") or {}).get("statistics") or {}
    if not stats:
        return ""
    equal = min(s.get("min_equal_fraction", 0.0) for s in stats.values())
    rel = max(s.get("max_rel", 0.0) or 0.0 for s in stats.values())
    shown = "100" if equal == 1.0 else percent_floor(equal)
    return f"{shown} % equal, max rel {rel:.2g}"


def _ran(result: Mapping[str, Any] | None) -> bool:
    return result is not None and _levels(result)[0] not in ("unavailable", "none")


def answer_table(op: str, reports: Sequence[Report]) -> str:
    """The operator page's first table: per backend that ran anywhere, its library version,
    the variants it implements, and on a GPU and on the CPU its levels (forward / gradient)
    with the forward's % bitwise equal and max relative difference; "not measured" where it
    did not run, with the run's date and device below."""
    mine = {r.profile: r for r in reports if r.op == op}
    results = {name for r in mine.values() for name, res in r.data["results"].items()
               if _ran(res)}
    if not results:
        return ""
    head = " | ".join(title for _, title in ANSWER_PROFILES)
    lines = ['<div class="ns-answer" markdown>', "",
             f"| backend | variants | {head} |",
             "| --- | --- |" + " --- |" * len(ANSWER_PROFILES)]
    for name in sorted(results):
        variants, cells = "", []
        for profile, _title in ANSWER_PROFILES:
            report = mine.get(profile)
            result = report.data["results"].get(name) if report else None
            if not _ran(result):
                cells.append("not measured on a GPU" if profile.startswith("cuda")
                             else "not measured on the CPU")
                continue
            version = (report.env.get("backends") or {}).get(name)
            skipped = set(result.get("skipped_variants") or {})
            variants = ("all" if not skipped else
                        ", ".join(_code(v) for v in report.data["checks"]["variants"]
                                  if v not in skipped))
            fwd, grad = _levels(result)
            cells.append(f"{level_badge(fwd)} / {level_badge(grad)}<br>"
                         f"{_forward_distance(result)}"
                         + (f" · {_cell(version)}" if version else ""))
        lines.append(f"| {_code(name)} | {variants} | " + " | ".join(cells) + " |")
    failing = sorted({(name, str(res.get("source", ""))) for r in mine.values()
                      for name, res in r.data["results"].items()
                      if name in results and "fails" in _levels(res)})
    unimplemented = {name for r in mine.values() for name, res in r.data["results"].items()
                     if "not implemented" in str(res.get("unavailable") or "")}
    never = sorted({name for r in mine.values() for name in r.data["results"]}
                   - results - unimplemented)
    runs = []
    for profile, title in ANSWER_PROFILES:
        report = mine.get(profile)
        if report is not None:
            runs.append(f"{title}: {_cell(_device(report.env))}, "
                        f"{str(report.env.get('date', '?'))[:10]}, {_versions(report.env)}")
    lines += ["", "</div>", "", "Runs: " + "; ".join(runs) + ". Levels (forward / gradient), "
              "best first: exact, invariant, accurate, fails (defined under "
              "[Conformance](#conformance)); % equal and max rel: the forward's least "
              "fraction of bitwise-equal elements and largest relative difference; then the "
              "library version.", ""]
    lines += [f"- {_code(name)} fails: it ran {_cell(source)}." for name, source in failing]
    if never:
        lines.append("- Not measured anywhere yet: " + ", ".join(f"`{n}`" for n in never)
                     + " (why, per profile, under [Conformance](#conformance)).")
    return "\n".join(lines) + "\n"


def _unavailable_summary(report: Report) -> list[str]:
    """Backends that did not run on ``report``'s profile, grouped by why: one line."""
    groups: dict[str, list[str]] = {}
    for name, result in sorted(report.data["results"].items()):
        if _ran(result):
            continue
        reason = str(result.get("unavailable") or "")
        kind = ("not implemented" if "not implemented" in reason
                else "not installed" if "not installed" in reason
                else "needs a CUDA GPU" if "CUDA" in reason or "cuda" in reason
                else "other")
        groups.setdefault(kind, []).append(f"{_code(name)}")
    return [f"{kind}: {', '.join(names)}" for kind, names in groups.items()]


def render_conformance(
    op: str, reports: Sequence[Report], profiles: Iterable[str] = PROFILES
) -> str:
    """The conformance section of an operator page (Markdown).

    A table backend × profile with both levels, the device, the versions, the
    date and the commit of the run; a row per profile that has no committed
    report; then the runs' commands and the lines of the failed checks.
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
            if not _ran(result):
                continue
            fwd, grad = _levels(result)
            ulp = (f"{_max_ulp(result, 'forward')} / {_max_ulp(result, 'gradient')}"
                   if "contract_gates" in result else "—")
            lines.append(
                f"| {_code(backend)} | `{profile}` | {level_badge(fwd)} | {level_badge(grad)} "
                f"| {ulp} | {_cell(result.get('backward', '?'))} "
                f"| {_cell(libs.get(backend) or '—')} | {_cell(_device(env))} "
                f"| {_cell(_versions(env))} | {date} | {_commit(env)} |"
            )
    lines += ["", "</div>", "",
              "A large ulp count beside *accurate* comes from elements near zero, where one "
              "ulp is tiny; the tolerance judges the absolute and relative difference.", ""]
    absent = [f"`{profile}`: " + "; ".join(summary) for profile, report in mine.items()
              if (summary := _unavailable_summary(report))]
    if absent:
        lines += ["Did not run (the reason of each is in the report and under the details):",
                  "", *[f"- {line}" for line in absent], ""]
    if missing:
        shown = ", ".join(f"`{p}`" for p in missing)
        lines += [
            '!!! note "No report committed"',
            "",
            f"    `reports/` holds no `{op}` report for {shown}. The committed reports are "
            "written by `nox -s conformance -- --out reports` (CUDA profiles on a GPU "
            "machine) to `reports/<profile>/<op>.json`.",
            "",
        ]
    if mine:
        lines += ["### Runs", "", "| profile | command | quick | system | python | normspec "
                  "| file |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for profile, report in mine.items():
            env = report.env
            lines.append(
                f"| `{profile}` | {_code(report.data.get('command', '?'))} "
                f"| {'yes' if report.data.get('quick') else 'no'} "
                f"| {_cell(system_name(env.get('platform', '?')))} "
                f"| {_cell(env.get('python', '?'))} "
                f"| {_cell(env.get('normspec', '?'))} "
                f"| `reports/{profile}/{report.path.name}` |"
            )
        lines.append("")
        lines += _details(mine)
    return "\n".join(lines) + "\n"


def system_name(platform_string: str) -> str:
    """The operating system and processor of Python's ``platform.platform()`` string:
    ``Linux-6.18.44-fc-…-x86_64-with-glibc2.39`` -> ``Linux x86_64`` (a machine's kernel
    build says nothing to a reader)."""
    parts = platform_string.split("-")
    arch = next((p for p in parts if p in ("x86_64", "aarch64", "arm64", "AMD64", "ppc64le")),
                None)
    return f"{parts[0]} {arch}" if arch else parts[0]


def _details(mine: Mapping[str, Report]) -> list[str]:
    out: list[str] = []
    for profile, report in mine.items():
        for backend, result in sorted(report.data["results"].items()):
            fwd, grad = _levels(result)
            notes: list[str] = []
            if not _ran(result):
                continue
            for variant, why in sorted((result.get("skipped_variants") or {}).items()):
                notes.append(f"skipped {_code(variant)}: {_cell(why)}")
            gate_lines: list[str] = []
            for gate, g in (result.get("contract_gates") or {}).items():
                failed = g.get("failed_lines") or []
                # inside a fenced block: a line may not close the fence
                gate_lines += [f"{gate}: {str(line).replace('`', chr(39))}"
                               for line in failed[:MAX_LINES]]
                if len(failed) > MAX_LINES:
                    gate_lines.append(f"{gate}: … {len(failed) - MAX_LINES} more in the JSON")
            if not notes and not gate_lines:
                continue
            kind = "failure" if "fails" in (fwd, grad) else (
                "warning" if gate_lines else "info")
            title = f"{backend} on {profile}: forward {fwd}, gradient {grad}"
            out += [f'??? {kind} "{_cell(title)}"', ""]
            out += [f"    - {n}" for n in notes]  # escaped when made
            if gate_lines:
                out += ["", "    ```text"] + [f"    {line}" for line in gate_lines] + ["    ```"]
            out.append("")
    return out


def _conventions(results: Sequence[Mapping[str, Any]], checks: Sequence[Sequence[str]]
                 ) -> str:
    """The residual-sum and gated conventions a backend ran (from the variants it did not
    skip), e.g. ``residual_sum=rounded``; empty when it ran every one."""
    found: dict[str, set[str]] = {}
    every: dict[str, set[str]] = {}
    for result, variants in zip(results, checks, strict=True):
        skipped = set(result.get("skipped_variants") or {})
        for variant in variants:
            for part in variant.split(","):
                key, _, value = part.partition("=")
                if key in ("residual_sum", "convention"):
                    every.setdefault(key, set()).add(value)
                    if variant not in skipped:
                        found.setdefault(key, set()).add(value)
    return ", ".join(f"`{k}={'/'.join(sorted(v))}`" for k, v in sorted(found.items())
                     if v != every.get(k))


def render_overview(reports: Sequence[Report], ops: Iterable[str]) -> str:
    """Backend × operator, on a GPU and on the CPU (``cuda_bf16`` and ``cpu_bf16``): levels
    (forward / gradient) and the forward's % bitwise equal; the conventions each backend
    follows. One screen wide."""
    ops = list(ops)
    if not reports:
        return ('<div class="ns-conformance" markdown>\n\n!!! note "No report committed"\n\n'
                "    `reports/` holds no conformance report yet.\n\n</div>\n")
    by_key = {(r.op, r.profile): r for r in reports}
    backends = sorted({b for r in reports for b, res in r.data["results"].items() if _ran(res)})
    head = "| backend | conventions | " + " | ".join(
        f"[`{op}`](operators/{op}.md)" for op in ops) + " |"
    lines = ['<div class="ns-answer" markdown>', "", head,
             "| --- | --- |" + " --- |" * len(ops)]
    for b in backends:
        cells, ran, checks = [], [], []
        for op in ops:
            parts = []
            for profile, title in ANSWER_PROFILES:
                report = by_key.get((op, profile))
                result = report.data["results"].get(b) if report else None
                if not _ran(result):
                    continue
                ran.append(result)
                checks.append(report.data["checks"]["variants"])
                fwd, grad = _levels(result)
                equal = _forward_distance(result).split(",")[0]
                parts.append(f"{title.split(',')[0]}: {level_badge(fwd)} / {level_badge(grad)}"
                             f" {equal}")
            cells.append("<br>".join(parts) or "—")
        lines.append(f"| {_code(b)} | {_conventions(ran, checks)} | " + " | ".join(cells)
                     + " |")
    lines += ["", "</div>", "",
              "GPU: `cuda_bf16`; CPU: `cpu_bf16`; the fp16 and fp32 profiles are on each "
              "operator page. A dash: the backend ran on neither.", ""]
    return "\n".join(lines)
