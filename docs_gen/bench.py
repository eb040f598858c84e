"""The benchmarks page: tables and matplotlib plots from ``bench/results/*.json``.

Expected schema of a results file (one file per run; see ``notes/docs.md``)::

    {
      "environment": {"device_name": "NVIDIA H200", "torch": "2.13.0", ...},
      "rows": [
        {"name": "rms_norm", "shape": [4096, 2048], "backend": "torch_ext",
         "direction": "forward", "us": 12.3, "tbps": 3.1, "copy_fraction": 0.82},
        ...
      ]
    }

``environment`` is shown as given (nested values flattened); each row is one
timing: ``us`` the median time in microseconds, ``tbps`` the achieved memory
bandwidth in TB/s, ``copy_fraction`` that bandwidth as a fraction of a plain
device copy of the same bytes; optional ``us_rounds`` (each timing round's
median) and ``spread`` ((max - min) / median over the rounds, shown as a
column when present). Rows of runs that also timed the GPU alone (host launch
gaps hidden, see ``bench/run.py``) carry ``device_us``, ``device_tbps``,
``device_copy_fraction`` and ``host_us``; their tables show the call time,
the device time and the host time, with TB/s and copy fraction from the
device time. Divergence matrices written by
``normspec compare`` under ``reports/compare/`` (PNG heatmaps, JSON) are shown
on the same page and on the operator pages.

Multi-process rankings (``bench/results/repeat/*.json``, written by
``bench/repeat.py``) have the same rows with the median over the processes under
``device_us`` (or ``us``) and every process's time under ``device_us_processes``
(or ``us_processes``). The page ranks them with ``bench/repeat.py``'s own ``rank``:
ours against the fastest peer, median and range over the processes. A case of a few
microseconds moves between processes by as much as the gaps between backends, so the
small-batch verdicts come from these files, not from one process.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BenchResult", "against_fastest_peer", "benchmarks_page", "load_repeats",
           "load_results", "plot_png", "repeats_section"]

DIRECTIONS = ("forward", "backward")
#: ``bench/repeat.py``, whose ``rank`` the page uses for multi-process files.
REPEAT_SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "repeat.py"
ROW_KEYS = ("name", "shape", "backend", "direction", "us", "tbps", "copy_fraction")


class BenchResultError(ValueError):
    """A results file that does not follow the schema."""


@dataclass(frozen=True)
class BenchResult:
    """One results file."""

    path: Path
    environment: Mapping[str, Any]
    rows: Sequence[Mapping[str, Any]]

    @property
    def stem(self) -> str:
        return self.path.stem


def _load_files(directory: Path, required: Sequence[str],
                processes: bool = False) -> list[BenchResult]:
    """Every ``*.json`` under ``directory``, sorted by name: an object with a ``rows``
    list whose rows have the ``required`` keys (and, with ``processes``, every process's
    time). A file that is not raises `BenchResultError` naming it and what it lacks."""
    out = []
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BenchResultError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise BenchResultError(f"{path}: expected an object with a 'rows' list")
        for i, row in enumerate(data["rows"]):
            missing = [k for k in required if k not in row]
            if missing:
                raise BenchResultError(f"{path}: rows[{i}] lacks {missing}")
            if processes and not any(isinstance(row.get(f"{f}_processes"), list)
                                     for f in ("device_us", "us")):
                raise BenchResultError(
                    f"{path}: rows[{i}] has neither 'device_us_processes' nor "
                    "'us_processes' (a file of bench/repeat.py has one per row)")
        out.append(BenchResult(path, data.get("environment") or {}, data["rows"]))
    return out


def load_results(directory: Path) -> list[BenchResult]:
    """Every ``*.json`` under ``directory``, checked against the schema, sorted by name."""
    return _load_files(directory, ("name", "backend", "direction", "us"))


def load_repeats(directory: Path) -> list[BenchResult]:
    """Every ``*.json`` under ``directory`` written by ``bench/repeat.py``, checked (each
    row names its case and carries every process's time), sorted by name."""
    return _load_files(directory, ("name", "shape", "backend", "direction"), processes=True)


@functools.cache
def _repeat_module() -> Any:
    """``bench/repeat.py`` as a module (that script is not in a package), loaded once."""
    spec = importlib.util.spec_from_file_location("normspec_bench_repeat", REPEAT_SCRIPT)
    if spec is None or spec.loader is None:
        raise BenchResultError(f"cannot load {REPEAT_SCRIPT} to rank multi-process results")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timing_protocol(timing: dict) -> str:
    """One line on what ran before each timed call (``bench/device_timing.py``): the
    rankings of small cases depend on it (docs/design/kernels.md, "Current measurements")."""
    parts = [f"an L2 flush of {timing['flush_mib']} MiB"] if "flush_mib" in timing else []
    if timing.get("after_flush_kernels"):
        parts.append(f"{timing['after_flush_kernels']} no-op kernel(s)")
    if timing.get("hide_host_ms"):
        parts.append(f"a {timing['hide_host_ms']:g} ms sleep kernel that hides the host")
    return ("Before each timed call: " + ", then ".join(parts) + "."
            if parts else "Timed without a flush or a sleep before the call.")


def repeats_section(repeats: Sequence[BenchResult]) -> list[str]:
    """Markdown lines: per multi-process file, each of our backends per case and direction
    against the fastest peer, median [min-max] over the processes and the verdict
    (``met`` when ours is no slower; ``ranges overlap`` when the gap is within what
    the processes moved). Empty without files."""
    if not repeats:
        return []
    lines = ["## Rankings over several processes", "",
             "Each case timed in several fresh processes (`bench/repeat.py`); medians over "
             "the processes with their range. These, not one process's times, decide the "
             "small-batch comparisons.", ""]
    for res in repeats:
        env = res.environment
        lines += [f"### {res.stem}", "", f"From `bench/results/repeat/{res.path.name}`"
                  + "".join(f"; {k}: {_code(v)}" for k, v in _flatten(env)
                            if k in ("processes", "git.commit", "date", "device_name"))
                  + ".", ""]
        if env.get("command"):
            lines += [f"Command: {_code(env['command'])}", ""]
        if env.get("device_timing"):
            lines += [_timing_protocol(env["device_timing"]), ""]
        lines += ["| case | shape | direction | ours | µs [range] | fastest peer "
                  "| µs [range] | verdict |",
                  "| --- | --- | --- | --- | ---: | --- | ---: | --- |"]
        for e in _repeat_module().rank([dict(r) for r in res.rows]):
            mine = f"{e['median']:.2f} [{e['range'][0]:.2f}–{e['range'][1]:.2f}]"
            if e["peer"] is None:
                theirs, verdict, peer = "—", "—", "—"
            else:
                theirs = (f"{e['peer_median']:.2f} "
                          f"[{e['peer_range'][0]:.2f}–{e['peer_range'][1]:.2f}]")
                verdict = ("met" if e["met"] else "**missed**") + (
                    " (ranges overlap)" if e["overlap"] else "")
                peer = f"{_code(e['peer'])}"
            lines.append(f"| {_code(e['name'])} | {_shape(e['shape'])} | {e['direction']} "
                         f"| {_code(e['backend'])} | {mine} | {peer} | {theirs} | {verdict} |")
        lines.append("")
    return lines


def _flatten(env: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for key, value in env.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out += _flatten(value, name + ".")
        else:
            out.append((name, json.dumps(value) if not isinstance(value, str) else value))
    return out


def _shape(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "×".join(str(v) for v in value)
    return "—" if value is None else str(value)


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "—"


def _cell(text: object) -> str:
    """Text from a results file, safe anywhere in the page (HTML-escaped, no pipe, no line
    break)."""
    return html.escape(str(text)).replace("|", "&#124;").replace("\n", " ")


def _code(text: object) -> str:
    """Text from a results file as inline code."""
    return f"<code>{_cell(text)}</code>"


def plot_png(rows: Sequence[Mapping[str, Any]], title: str,
             metric: str | None = None) -> bytes:
    """A grouped bar chart (one group per case, one bar per backend) as PNG bytes.

    Bars show ``metric`` where given (e.g. ``device_us`` for small cases, where a fraction
    of copy bandwidth is near zero for every backend), else ``copy_fraction`` when every row
    has it, else ``tbps``, else ``us``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("device_copy_fraction", "fraction of device copy bandwidth (GPU time)"),
               ("copy_fraction", "fraction of device copy bandwidth"), ("tbps", "TB/s"),
               ("us", "µs (lower is better)"))
    labels = dict(metrics) | {"device_us": "µs of GPU time per call (lower is better)"}
    if metric is not None:
        label = labels.get(metric, metric)
    else:
        metric, label = next(((m, lab) for m, lab in metrics
                              if all(isinstance(r.get(m), int | float) for r in rows)),
                             metrics[-1])
    cases = list(dict.fromkeys(f"{r['name']} {_shape(r.get('shape'))}" for r in rows))
    backends = list(dict.fromkeys(str(r["backend"]) for r in rows))
    values = {(f"{r['name']} {_shape(r.get('shape'))}", str(r["backend"])): r.get(metric)
              for r in rows}
    height = 0.8 / max(1, len(backends))
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.45 * len(cases) * max(1, len(backends)) ** 0.5))
    # one distinct colour per backend (tab10 repeats after ten series)
    colours = plt.get_cmap("tab20").colors
    for j, backend in enumerate(backends):
        ys = [i + j * height for i in range(len(cases))]
        xs = [values.get((c, backend)) or 0.0 for c in cases]
        ax.barh(ys, xs, height=height, label=backend, color=colours[(2 * j) % 20 + (j // 10)])
    ax.set_yticks([i + height * (len(backends) - 1) / 2 for i in range(len(cases))])
    ax.set_yticklabels(cases)
    ax.invert_yaxis()
    ax.set_xlabel(label)
    if metric.endswith("copy_fraction"):
        ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_title(title)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


#: The device copy's row in ``bench/run.py``'s results: a reference, not a peer.
REFERENCE_BACKEND = "device copy (same bytes)"


# ours and peers as ``bench/repeat.py``'s ``rank`` tells them apart, so that the page and
# the multi-process ranking compare the same backends
def _is_ours(backend: str) -> bool:
    return "normspec" in backend


def _is_peer(backend: str) -> bool:
    return not _is_ours(backend) and backend != REFERENCE_BACKEND


def against_fastest_peer(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines of a table: each of our backends (``normspec ...``) per case and
    direction against the fastest peer of that case (neither ours nor the device copy),
    by device time where every row has one, else by call time, with a verdict: **met**
    when ours is no slower than the fastest peer, or slower by less than the larger
    run-to-run spread of the two rows (then the gap is noise); else **missed**. Empty
    without both."""
    key = "device_us" if all(isinstance(r.get("device_us"), int | float) for r in rows) else "us"
    spread_key = "device_spread" if key == "device_us" else "spread"
    cases: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        if isinstance(r.get(key), int | float):
            cases.setdefault((str(r["name"]), _shape(r.get("shape")), str(r["direction"])),
                             []).append(r)
    table = []
    for (name, shape, direction), group in cases.items():
        peers = [r for r in group if _is_peer(str(r["backend"]))]
        if not peers:
            continue
        best = min(peers, key=lambda r: r[key])
        for r in group:
            if _is_ours(str(r["backend"])):
                change = r[key] / best[key] - 1.0
                noise = max(float(r.get(spread_key) or 0.0), float(best.get(spread_key) or 0.0))
                verdict = "met" if change <= noise else "**missed**"
                table.append(f"| {_code(name)} | {shape} | {direction} | {_code(r['backend'])} "
                             f"| {r[key]:.2f} | {_code(best['backend'])} | {best[key]:.2f} "
                             f"| {change:+.1%} | {verdict} |")
    if not table:
        return []
    unit = "device µs" if key == "device_us" else "µs"
    return ["| case | shape | direction | ours | " + unit + " | fastest peer | " + unit
            + " | ours against it | target |",
            "| --- | --- | --- | --- | ---: | --- | ---: | ---: | --- |", *table, "",
            "The target: ours no slower than the fastest other backend of the case. *met*: "
            "faster, or slower by less than the larger run-to-run spread of the two rows "
            "(a gap within the noise); negative percentages: ours is faster.", ""]


#: Cases of fewer rows than this are plotted in µs: their bytes are too few for a fraction
#: of copy bandwidth to tell backends apart (a decode step's norms are such cases).
SMALL_ROWS = 4096


def _is_small(row: Mapping[str, Any]) -> bool:
    shape = row.get("shape")
    return isinstance(shape, list | tuple) and bool(shape) and shape[0] < SMALL_ROWS


def _run_line(res: BenchResult) -> str:
    env = res.environment
    git = env.get("git") or {}
    parts = [str(env.get("device_name") or "?"), str(env.get("date", "?"))[:10],
             f"torch {env.get('torch', '?')}"]
    if git.get("commit"):
        parts.append(f"commit `{git['commit']}`")
    return (f"From `bench/results/{res.path.name}`: " + ", ".join(_cell(p) for p in parts)
            + ". Each of our backends against the fastest other backend of the same case "
            "(torch eager, torch.compile, Liger, FLA, FlashInfer where installed), by GPU "
            "time; the tables and plots below have every backend.")


def benchmarks_page(
    results: Sequence[BenchResult], compare_files: Sequence[Path] = (),
    image_dir: str = "assets/bench", compare_dir: str = "assets/compare",
    repeats: Sequence[BenchResult] = (),
) -> tuple[str, dict[str, bytes]]:
    """The page's Markdown and the generated files (site path -> bytes): the
    multi-process rankings (``repeats``) first, then each results file's tables and
    plots, then the divergence matrices."""
    files: dict[str, bytes] = {}
    lines = [
        "# Benchmarks",
        "",
        "Timings of each backend, from the JSON results committed under `bench/results/`, "
        "tabulated and plotted when the site is built. `bench/run.py` (`nox -s bench`) "
        "prints the same tables; tests never assert on time.",
        "",
    ]
    if not results:
        lines += ['!!! note "No benchmark results committed yet"', "",
                  "    `bench/results/` holds no `*.json` file yet. Once a run's results "
                  "are committed there, this page shows their tables and plots.", ""]
    for res in results:
        leaders = against_fastest_peer(res.rows)
        if leaders:
            lines += [f"## Summary: {res.stem}", "", _run_line(res), "", *leaders]
    lines += repeats_section(repeats)
    for res in results:
        lines += [f"## {res.stem}", "", f"From `bench/results/{res.path.name}`.", ""]
        # how the commit was found (from git or a variable) says nothing to a reader
        env = [(k, v) for k, v in _flatten(res.environment) if k != "git.recorded"]
        if env:
            lines += ['??? info "Environment"', "", "    | environment | |",
                      "    | --- | --- |"]
            lines += [f"    | {_cell(k)} | {_cell(v)} |" for k, v in env]
            lines.append("")
        directions = [d for d in DIRECTIONS if any(r["direction"] == d for r in res.rows)]
        directions += sorted({str(r["direction"]) for r in res.rows} - set(directions))
        for direction in directions:
            rows = [r for r in res.rows if r["direction"] == direction]
            spread = any(isinstance(r.get("spread"), int | float) for r in rows)
            device = any(isinstance(r.get("device_us"), int | float) for r in rows)
            lines += [f"### {res.stem}: {direction}", ""]
            if device:
                lines += ["Call µs: the median of `triton.testing.do_bench` (host launch gaps "
                          "included); device µs: the GPU "
                          "alone; host µs: enqueueing one call. TB/s and copy fraction are "
                          "from the device time.", ""]
            times = "| call µs | device µs | host µs |" if device else "| µs |"
            lines += ["| case | shape | backend " + times + " TB/s | copy fraction |"
                      + (" spread |" if spread else ""),
                      "| --- | --- | --- " + "| ---: " * (3 if device else 1)
                      + "| ---: | ---: |" + (" ---: |" if spread else "")]
            for r in rows:
                if device:
                    cells = (f"| {_num(r.get('us'), '.2f')} | {_num(r.get('device_us'), '.2f')} "
                             f"| {_num(r.get('host_us'), '.0f')} "
                             f"| {_num(r.get('device_tbps'), '.3f')} "
                             f"| {_num(r.get('device_copy_fraction'), '.2f')} |")
                else:
                    cells = (f"| {_num(r.get('us'), '.2f')} | {_num(r.get('tbps'), '.3f')} "
                             f"| {_num(r.get('copy_fraction'), '.2f')} |")
                lines.append(
                    f"| {_code(r['name'])} | {_shape(r.get('shape'))} | {_code(r['backend'])} "
                    + cells + (f" {_num(r.get('spread'), '.0%')} |" if spread else ""))
            lines.append("")
            small = [r for r in rows if _is_small(r)]
            large = [r for r in rows if not _is_small(r)]
            for part, group, metric in (("large", large, None),
                                        ("small", small, "device_us" if device else "us")):
                if not group:
                    continue
                png = f"{image_dir}/{res.stem}-{direction}-{part}.png"
                files[png] = plot_png(group, f"{res.stem}: {direction}, {part} cases", metric)
                lines += [f"![{res.stem} {direction} {part} cases]({png})", ""]
    lines += compare_section(compare_files, compare_dir, files)
    return "\n".join(lines) + "\n", files


def compare_section(
    compare_files: Sequence[Path], compare_dir: str, files: dict[str, bytes]
) -> list[str]:
    """Divergence matrices from ``reports/compare/`` (PNGs shown, JSON linked)."""
    lines = ["## Divergence between backends", ""]
    if not compare_files:
        return [*lines, "No divergence matrix committed yet (`normspec compare` writes them "
                "under `reports/compare/`).", ""]
    lines += ["Pairwise agreement of the backends on the same inputs, from "
              "`reports/compare/`.", ""]
    for path in compare_files:
        target = f"{compare_dir}/{path.name}"
        files[target] = path.read_bytes()
        if path.suffix == ".png":
            lines += [f"![{path.stem}]({target})", ""]
        else:
            lines += [f"- [`{path.name}`]({target})"]
    return [*lines, ""]
