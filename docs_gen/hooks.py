"""MkDocs hooks (``mkdocs.yml`` → ``hooks:``) that generate normspec's pages at build time.

* ``on_config``: lays out ``build/docs-griffe/normspec`` — links to
  ``src/normspec``'s files plus ``spec/`` and ``backends/`` as the
  ``normspec.spec`` and ``normspec.backends`` sub-packages — so that
  mkdocstrings (griffe, which reads sources statically) sees the package as it
  is installed; an editable install maps those sub-packages in a way griffe does
  not follow.
* ``on_files``: adds the generated pages (one per operator, the conformance
  overview, backends, CLI, train = rollout, benchmarks with the multi-process rankings of
  ``bench/results/repeat/``), the benchmark plots, the divergence
  matrices and the KaTeX files (see `docs_gen.katex`).
* ``on_page_markdown``: puts the README's quickstart commands into the home page.
* ``on_serve``: ``mkdocs serve`` also rebuilds when the sources of the
  generated pages change.

Environment overrides (used by the tests): ``NORMSPEC_DOCS_REPORTS`` (default
``reports/``), ``NORMSPEC_DOCS_BENCH`` (default ``bench/results/``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from docs_gen import bench, conformance, katex, pages, train_rollout  # noqa: E402

log = logging.getLogger("mkdocs.plugins.normspec")

GRIFFE_DIR = ROOT / "build" / "docs-griffe"
QUICKSTART_MARKER = "<!-- normspec:readme-quickstart -->"
WATCHED = ("spec", "src/normspec", "backends", "integrations", "reports", "bench/results",
           "docs_gen", "tests/plugins/example_plugin", "README.md")


def _reports_dir() -> Path:
    return Path(os.environ.get("NORMSPEC_DOCS_REPORTS") or ROOT / "reports")


def _bench_dir() -> Path:
    return Path(os.environ.get("NORMSPEC_DOCS_BENCH") or ROOT / "bench" / "results")


def _griffe_layout() -> None:
    pkg = GRIFFE_DIR / "normspec"
    if GRIFFE_DIR.exists():
        shutil.rmtree(GRIFFE_DIR)
    pkg.mkdir(parents=True)
    for child in (ROOT / "src" / "normspec").iterdir():
        if child.name != "__pycache__":
            (pkg / child.name).symlink_to(child)
    for sub in ("spec", "backends", "integrations"):
        (pkg / sub).symlink_to(ROOT / sub, target_is_directory=True)


@event_priority(100)
def on_config(config):
    _griffe_layout()
    return config


def _add(files: Files, config, path: str, content: str | bytes) -> None:
    existing = files.get_file_from_path(path)
    if existing is not None:
        files.remove(existing)
    files.append(File.generated(config, path, content=content))


def _heatmaps(compare: list[Path]) -> dict[str, list[str]]:
    """Divergence PNGs per operator: the longest operator name that prefixes the file name."""
    by_op: dict[str, list[str]] = {}
    names = sorted(pages.OPS, key=len, reverse=True)
    for path in compare:
        if path.suffix != ".png":
            continue
        op = next((n for n in names if path.stem == n or path.stem.startswith(n + "_")
                   or path.stem.startswith(n + "-")), None)
        if op:
            by_op.setdefault(op, []).append(f"../assets/compare/{path.name}")
    return by_op


def _draw_heatmaps(matrices: list[Path]) -> list[Path]:
    """The heatmap of each committed divergence matrix, drawn now (``write_heatmap``'s
    scale and caption), into a scratch folder; a file that is not a matrix is an error
    naming it."""
    from normspec.divergence import KIND, write_heatmap

    folder = Path(tempfile.mkdtemp(prefix="normspec-heatmaps-"))
    drawn = []
    for path in matrices:
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise PluginError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise PluginError(f"{path}: not a divergence matrix (kind {KIND!r})")
        drawn.append(write_heatmap(data, folder / f"{path.stem}.png"))
    return drawn


def on_files(files: Files, config) -> Files:
    try:
        reports = conformance.load_reports(_reports_dir())
        results = bench.load_results(_bench_dir())
        repeats = bench.load_repeats(_bench_dir() / "repeat")
        assets = katex.katex_assets()
        train_rollout_report = train_rollout.load_report(_reports_dir())
    except (conformance.ReportError, bench.BenchResultError, katex.KatexUnavailableError,
            train_rollout.TrainRolloutReportError) as exc:
        raise PluginError(str(exc)) from None
    compare_dir = _reports_dir() / "compare"
    matrices = sorted(compare_dir.glob("*.json")) if compare_dir.is_dir() else []
    compare = sorted([*matrices, *_draw_heatmaps(matrices)], key=lambda p: p.name)
    log.info("normspec docs: %d conformance report(s), %d benchmark file(s), %d "
             "multi-process ranking(s), %d divergence file(s)", len(reports), len(results),
             len(repeats), len(compare))
    heatmaps = _heatmaps(compare)
    for name in pages.OPS:
        _add(files, config, f"operators/{name}.md",
             pages.operator_page(name, reports, heatmaps.get(name, [])))
    _add(files, config, "conformance.md", pages.conformance_page(reports))
    _add(files, config, "backends/index.md", pages.backends_page())
    _add(files, config, "reference/cli.md", pages.cli_page())
    page, generated = bench.benchmarks_page(results, compare, repeats=repeats)
    _add(files, config, "benchmarks.md", page)
    for path, data in generated.items():
        _add(files, config, path, data)
    page, generated = train_rollout.train_rollout_page(train_rollout_report)
    _add(files, config, "train-rollout.md", page)
    for path, data in generated.items():
        _add(files, config, path, data)
    for name, data in assets.items():
        _add(files, config, f"assets/katex/{name}", data)
    return files


#: Where the writing-a-backend page shows each operator's inputs, outputs and parameters.
OP_CONTRACT_MARKER = "<!-- normspec:op-contract -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if QUICKSTART_MARKER in markdown:
        try:
            block = pages.readme_quickstart((ROOT / "README.md").read_text())
        except ValueError as exc:
            raise PluginError(str(exc)) from None
        markdown = markdown.replace(QUICKSTART_MARKER, block)
    if OP_CONTRACT_MARKER in markdown:
        markdown = markdown.replace(OP_CONTRACT_MARKER, pages.op_contract_table())
    return markdown


def on_serve(server, config, builder):
    for rel in WATCHED:
        path = ROOT / rel
        if path.exists():
            server.watch(str(path))
    return server
