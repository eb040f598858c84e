"""The docs site: generated pages, a strict build, and every operator page in headless Chromium.

The page generators (``docs_gen``) are checked without MkDocs. The build tests
need the ``docs`` extra (``nox -s docs`` installs it) and are skipped without
it; the browser tests also need Debian's ``chromium`` (``.ci/run`` installs it)
and are skipped without it. The site is built into ``site/`` (or
``$NORMSPEC_DOCS_SITE_DIR``); the screenshots are saved outside it, in
``docs-screenshots/`` (git ignores it), so that they never ship with the site.
"""

from __future__ import annotations

import functools
import html
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from normspec.ops import OPS
from normspec.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[1]
#: The browser tests' screenshots: beside the site, never inside it.
SCREENSHOTS = ROOT / "docs-screenshots"
sys.path.insert(0, str(ROOT))

from docs_gen import bench, conformance, pages  # noqa: E402

DOCS_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python",
                "pymdownx", "matplotlib", "griffe_sphinx")
PLUGIN = ROOT / "tests" / "plugins" / "example_plugin"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars",
    # the site must work offline: no host but this machine resolves
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)


def _missing_docs_modules() -> list[str]:
    missing = []
    for name in DOCS_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


needs_mkdocs = pytest.mark.skipif(
    bool(_missing_docs_modules()),
    reason=f"docs tooling not installed ({', '.join(_missing_docs_modules())}); "
    "nox -s docs installs the docs extra",
)
needs_chromium = pytest.mark.skipif(
    _chromium() is None,
    reason="chromium is not installed (apt-get install -y chromium; .ci/run installs it)",
)


# -- generators, no MkDocs needed --------------------------------------------------------


def _report(op: str, profile: str, results: dict) -> dict:
    from normspec.report import build_report

    return build_report(op, PROFILES[profile], results, quick=True, seeds=1,
                        command="normspec conformance --quick",
                        library_versions={"reference": "0.1.0", "lib": "9.9"})


def _result(forward: str, gradient: str, failed: list[str] | None = None) -> dict:
    stats = {"y": {"min_equal_fraction": 0.5, "max_ulp": 3, "max_abs": 1e-3, "max_rel": 1e-3}}
    return {
        "source": "lib 9.9", "backward": "full",
        "level": {"forward": forward, "gradient": gradient},
        "contract_gates": {
            "forward": {"passed": True, "level": forward, "failed_lines": failed or [],
                        "mismatch_lines": [], "statistics": stats, "comparisons": 4},
            "gradient": {"passed": True, "level": gradient, "failed_lines": [],
                         "mismatch_lines": [], "statistics": {}, "comparisons": 4},
        },
        "skipped_variants": {"offset=0.0": "offset=0.0 not supported (supports [1.0])"},
    }


def test_conformance_table_from_reports(tmp_path):
    data = _report("rms_norm", "cpu_bf16", {
        "reference": _result("exact", "exact"),
        "lib": _result("fails", "accurate", ["forward case=x tensor=y passed=False"]),
    })
    path = tmp_path / "cpu_bf16" / "rms_norm.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "m.json").write_text('{"kind": "normspec.compare"}')
    reports = conformance.load_reports(tmp_path)
    assert [(r.op, r.profile) for r in reports] == [("rms_norm", "cpu_bf16")]
    md = conformance.render_conformance("rms_norm", reports)
    assert 'class="ns-conformance"' in md
    rows = [line for line in md.splitlines() if line.startswith("| <code>")]
    assert any("<code>lib</code>" in r and "ns-fails" in r and "9.9" in r and "3 / —" in r
               for r in rows)
    commit = data["environment"]["git"]["commit"]
    if commit:
        assert commit[:10] in md
    assert data["environment"]["date"][:10] in md
    for profile in PROFILES:
        if profile != "cpu_bf16":
            assert f"| — | `{profile}` |" in md  # a row saying no report is committed
    assert "No report committed" in md
    assert "forward case=x tensor=y passed=False" in md  # failing lines are shown
    assert "skipped <code>offset=0.0</code>" in md
    overview = conformance.render_overview(reports, OPS)
    assert "ns-fails" in overview and "(operators/rms_norm.md)" in overview
    assert "CPU: " in overview and "50.00 % equal" in overview


def test_broken_report_is_an_error(tmp_path):
    (tmp_path / "cpu_fp32").mkdir()
    (tmp_path / "cpu_fp32" / "rms_norm.json").write_text("{not json")
    with pytest.raises(conformance.ReportError, match=r"rms_norm\.json"):
        conformance.load_reports(tmp_path)


def test_operator_page_has_spec_gates_and_conformance():
    md = pages.operator_page("rms_norm_gated", [])
    assert "::: normspec.spec.gated" in md
    assert "members: [rms_norm_gated, rms_norm_gated_backward]" in md
    for t in ("batch", "chunk", "misaligned", "singleton_aggregation"):
        assert f"| `{t}` |" in md
    assert "| gradient | `bfloat16` |" in md
    assert 'class="ns-conformance"' in md
    assert "qwen3_next_rms_norm_gated" in md


def test_benchmarks_page_without_and_with_results(tmp_path):
    md, files = bench.benchmarks_page([])
    assert "No benchmark results committed yet" in md and not files
    pytest.importorskip("matplotlib")
    rows = [{"name": "rms_norm", "shape": [4096, 2048], "backend": b, "direction": d,
             "us": 10.0 + i, "tbps": 3.0, "copy_fraction": 0.8}
            for i, b in enumerate(("reference", "torch_ext")) for d in ("forward", "backward")]
    (tmp_path / "h200.json").write_text(json.dumps({"environment": {"gpu": "H200"},
                                                     "rows": rows}))
    md, files = bench.benchmarks_page(bench.load_results(tmp_path))
    assert ("| <code>rms_norm</code> | 4096×2048 | <code>torch_ext</code>"
            " | 11.00 | 3.000 | 0.80 |") in md
    assert "## Summary" not in md  # no backend here is normspec's
    assert set(files) == {"assets/bench/h200-forward-large.png",
                          "assets/bench/h200-backward-large.png"}
    assert all(data.startswith(b"\x89PNG") for data in files.values())
    assert "spread" not in md
    rows[0].update(us_rounds=[9.0, 10.0, 10.5], spread=0.15)
    (tmp_path / "h200.json").write_text(json.dumps({"environment": {}, "rows": rows}))
    md, _ = bench.benchmarks_page(bench.load_results(tmp_path))
    assert "| copy fraction | spread |" in md
    assert ("| <code>rms_norm</code> | 4096×2048 | <code>reference</code>"
            " | 10.00 | 3.000 | 0.80 | 15% |") in md
    assert ("| <code>rms_norm</code> | 4096×2048 | <code>torch_ext</code>"
            " | 11.00 | 3.000 | 0.80 | — |") in md
    # rows with the device timing: call, device and host times, bandwidth from the device
    rows[1].update(device_us=8.0, host_us=120.0, device_tbps=4.0, device_copy_fraction=0.95)
    (tmp_path / "h200.json").write_text(json.dumps({"environment": {}, "rows": rows}))
    md, files = bench.benchmarks_page(bench.load_results(tmp_path))
    # (rows[1] is the reference's backward; the forward table keeps its layout)
    assert "| call µs | device µs | host µs | TB/s | copy fraction |" in md
    assert ("| <code>rms_norm</code> | 4096×2048 | <code>reference</code>"
            " | 10.00 | 8.00 | 120 | 4.000 | 0.95 |") in md
    assert ("| <code>rms_norm</code> | 4096×2048 | <code>torch_ext</code>"
            " | 11.00 | — | — | — | — |") in md
    assert ("| <code>rms_norm</code> | 4096×2048 | <code>reference</code>"
            " | 10.00 | 3.000 | 0.80 | 15% |") in md


def test_ours_against_the_fastest_peer():
    """Each of our backends per case and direction against the fastest peer (not ours,
    not the device copy), by device time where every row has one."""
    def row(backend, direction, us, device_us=None, shape=(64, 2048)):
        r = {"name": "rms_norm", "shape": list(shape), "backend": backend,
             "direction": direction, "us": us}
        return r if device_us is None else {**r, "device_us": device_us}

    rows = [row("torch.compile (transformers)", "forward", 5.0, 4.0),
            row("liger", "forward", 4.0, 4.4),
            row("device copy (same bytes)", "forward", 1.0, 1.0),
            row("normspec torch_ext", "forward", 6.0, 3.6),
            row("normspec cupy", "forward", 9.0, 5.0),
            row("normspec torch_ext", "backward", 7.0, 7.0),  # no peer: no line
            row("fla", "forward", 30.0, 30.0, shape=(4096, 2048))]  # no ours: no line
    lines = bench.against_fastest_peer(rows)
    assert lines[0].startswith("| case | shape | direction | ours | device µs |")
    assert lines[2] == ("| <code>rms_norm</code> | 64×2048 | forward "
                        "| <code>normspec torch_ext</code> | 3.60 "
                        "| <code>torch.compile (transformers)</code> | 4.00 | -10.0% | met |")
    assert lines[3] == ("| <code>rms_norm</code> | 64×2048 | forward "
                        "| <code>normspec cupy</code> | 5.00 "
                        "| <code>torch.compile (transformers)</code> | 4.00 | +25.0% "
                        "| **missed** |")
    assert lines[4] == ""
    # slower by less than the larger run-to-run spread: within the noise, met
    rows[4]["device_spread"] = 0.3
    assert bench.against_fastest_peer(rows)[3].endswith("| +25.0% | met |")
    del rows[4]["device_spread"]
    # without a device time on every row, the call times decide (liger is then fastest)
    del rows[0]["device_us"]
    lines = bench.against_fastest_peer(rows)
    assert "| µs | fastest peer | µs |" in lines[0]
    assert lines[2].endswith("| <code>liger</code> | 4.00 | +50.0% | **missed** |")
    assert bench.against_fastest_peer([row("liger", "forward", 4.0)]) == []


def test_benchmarks_page_ranks_multi_process_files(tmp_path):
    """Files of ``bench/repeat.py`` (every process's time per row) are ranked as that
    script ranks them: median [range] of ours and of the fastest peer, and the verdict."""
    def row(backend, direction, times):
        return {"name": "rms_norm", "shape": [1, 2048], "backend": backend,
                "direction": direction, "device_us": sorted(times)[1],
                "device_us_processes": times}

    rows = [row("torch.compile (transformers)", "backward", [4.35, 4.27, 4.38]),
            row("normspec torch_ext", "backward", [4.42, 4.45, 4.50]),
            row("liger", "forward", [4.45, 4.45, 4.42]),
            row("normspec torch_ext", "forward", [4.35, 4.50, 4.35]),
            row("device copy (same bytes)", "forward", [1.0, 1.0, 1.0])]
    env = {"processes": 3, "git": {"commit": "abc1234"}, "command": "bench/repeat.py x|y",
           "device_timing": {"flush_mib": 1, "hide_host_ms": 2.0, "after_flush_kernels": 1}}
    (tmp_path / "small.json").write_text(json.dumps({"environment": env, "rows": rows}))
    repeats = bench.load_repeats(tmp_path)
    md = "\n".join(bench.repeats_section(repeats))
    assert "## Rankings over several processes" in md
    assert "processes: <code>3</code>; git.commit: <code>abc1234</code>" in md
    assert "Command: <code>bench/repeat.py x&#124;y</code>" in md
    assert ("Before each timed call: an L2 flush of 1 MiB, then 1 no-op kernel(s), then a "
            "2 ms sleep kernel that hides the host.") in md
    assert bench._timing_protocol({"flush_mib": 256, "hide_host_ms": 2.0}) == (
        "Before each timed call: an L2 flush of 256 MiB, then a 2 ms sleep kernel that hides "
        "the host.")
    assert ("| <code>rms_norm</code> | 1×2048 | backward"
            " | <code>normspec torch_ext</code> | 4.45 [4.42–4.50] "
            "| <code>torch.compile (transformers)</code> | 4.35 [4.27–4.38] | **missed** |") in md
    assert ("| <code>rms_norm</code> | 1×2048 | forward"
            " | <code>normspec torch_ext</code> | 4.35 [4.35–4.50] "
            "| <code>liger</code> | 4.45 [4.42–4.45] | met (ranges overlap) |") in md
    page, _ = bench.benchmarks_page([], repeats=repeats)
    assert md in page
    assert bench.repeats_section([]) == [] and bench.load_repeats(tmp_path / "none") == []
    # a results file of one process is not a ranking: the loader names what it lacks
    del rows[0]["device_us_processes"]
    (tmp_path / "small.json").write_text(json.dumps({"environment": env, "rows": rows}))
    with pytest.raises(bench.BenchResultError, match=r"rows\[0\] has neither"):
        bench.load_repeats(tmp_path)


def test_readme_quickstart_is_the_readme_block():
    block = pages.readme_quickstart((ROOT / "README.md").read_text())
    assert block.startswith("```") and "nox -s conformance" in block


def test_plugin_page_includes_every_plugin_file():
    """The 'writing your own backend' page shows the tested plugin, file by file."""
    page = (ROOT / "docs" / "backends" / "writing-a-backend.md").read_text()
    included = set(re.findall(r'^--8<-- "([^"]+)"$', page, flags=re.M))
    files = {p.relative_to(ROOT).as_posix() for p in PLUGIN.rglob("*")
             if p.is_file() and p.suffix in (".py", ".toml", ".cfg")
             and not any(part.endswith(("egg-info", "__pycache__", "build")) for part in p.parts)}
    assert files and files <= included, f"not shown on the page: {sorted(files - included)}"


# -- the built site ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def site() -> Path:
    out = Path(os.environ.get("NORMSPEC_DOCS_SITE_DIR") or ROOT / "site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
    return out


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@needs_mkdocs
def test_strict_build_has_every_page(site):
    for rel in ("index.html", "arithmetic/index.html", "backends/index.html",
                "backends/writing-a-backend/index.html", "backends/gpu-providers/index.html",
                "benchmarks/index.html",
                "design/kernels/index.html", "conformance/index.html", "reference/cli/index.html",
                "train-rollout/index.html", "assets/train_rollout/logprob_delta.png",
                "reference/integrations/index.html",
                "assets/katex/katex.min.js", "assets/katex/katex.min.css"):
        assert (site / rel).is_file(), rel
    for op in OPS:
        assert (site / "operators" / op / "index.html").is_file(), op
    assert list((site / "assets" / "katex" / "fonts").glob("*.woff2"))
    plugin_page = (site / "backends" / "writing-a-backend" / "index.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", "", plugin_page))
    assert 'textbook = "normspec_example_plugin:backend"' in text
    assert "class TextbookBackend(Backend):" in text
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "normspec conformance" in cli and "--device" in cli


@needs_mkdocs
def test_site_loads_nothing_from_other_hosts(site):
    external = re.compile(
        r"<(?:script|img|iframe)\b[^>]*\bsrc=\"(?:https?:)?//|"
        r"<link\b(?=[^>]*\brel=\"(?:stylesheet|preconnect|preload|icon)\")[^>]*\bhref=\"(?:https?:)?//"
    )
    offenders = []
    for page in site.rglob("*.html"):
        text = page.read_text()
        if external.search(text) or "fonts.googleapis" in text or "fonts.gstatic" in text:
            offenders.append(page.relative_to(site).as_posix())
    css = (site / "assets" / "katex" / "katex.min.css").read_text()
    assert "http" not in re.sub(r"/\*.*?\*/", "", css, flags=re.S)  # fonts are local
    assert not offenders, f"pages loading from another host: {offenders}"


def _chromium_run(url: str, *args: str, tmp: Path, size: str = "1280,2200") -> str:
    proc = subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp}", f"--window-size={size}",
         "--virtual-time-budget=15000", *args, url],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert proc.returncode == 0, f"chromium failed on {url}:\n{proc.stderr[-3000:]}"
    return proc.stdout


@needs_mkdocs
@needs_chromium
@pytest.mark.parametrize("op", sorted(OPS))
def test_operator_page_in_chromium(op, site, server, tmp_path):
    url = f"{server}/operators/{op}/"
    dom = _chromium_run(url, "--dump-dom", tmp=tmp_path / "profile")
    # the math was rendered by KaTeX, served from this site
    math = dom.count('class="arithmatex"')
    assert math >= 1 and dom.count('class="katex"') >= math, "math not rendered by KaTeX"
    assert dom.count('data-ns-rendered="1"') == math, "some math was left unrendered"
    assert "katex-error" not in dom, re.findall(r'katex-error"[^>]*title="([^"]*)', dom)[:5]
    # the conformance table, rendered from reports/
    section = dom.split('class="ns-conformance"', 1)
    assert len(section) == 2 and "<table" in section[1].split("</div>", 1)[0], \
        "no conformance table in the page"
    assert "<th>profile</th>" in section[1] or ">profile<" in section[1]
    # the spec's normative text and its cross-references
    assert "Declared" in dom or "declared" in dom
    assert re.search(r'href="[^"]*#normspec\.spec\.\w+', dom), \
        "the spec's cross-references did not resolve to links"
    shots = SCREENSHOTS
    shots.mkdir(exist_ok=True)
    png = shots / f"{op}.png"
    _chromium_run(url, f"--screenshot={png}", tmp=tmp_path / "profile")
    assert png.is_file() and png.read_bytes().startswith(b"\x89PNG")


@needs_mkdocs
@needs_chromium
def test_home_page_in_chromium(site, server, tmp_path):
    dom = _chromium_run(f"{server}/", "--dump-dom", tmp=tmp_path / "profile")
    assert 'class="katex"' in dom and "katex-error" not in dom
    assert "nox -s conformance" in dom
    shots = SCREENSHOTS
    shots.mkdir(exist_ok=True)
    _chromium_run(f"{server}/", f"--screenshot={shots / 'index.png'}", tmp=tmp_path / "profile")
    assert (shots / "index.png").is_file()


def test_no_docstring_lets_markdown_eat_a_power_of_two():
    """``2**20`` outside a code span renders as a bold "220": every module docstring the
    site renders writes such numbers in code spans."""
    import importlib
    import inspect
    import pkgutil

    import normspec
    import normspec.backends
    import normspec.spec

    pattern = re.compile(r"\d\*\*-?\d")
    bad = []
    for package in (normspec, normspec.spec, normspec.backends):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            try:
                module = importlib.import_module(info.name)
            except Exception:  # an optional dependency missing: not rendered either
                continue
            for text in (inspect.getdoc(module) or "").split("`")[::2]:
                if pattern.search(text):
                    bad.append(info.name)
    assert not bad, bad


def test_the_cli_page_has_every_command_with_examples_and_no_rst():
    md = pages.cli_page()
    from normspec.cli import EXAMPLES

    for name, examples in EXAMPLES.items():
        assert f"## `normspec {name}`" in md
        for command, _ in examples:
            assert command in md
    assert not re.search(r"(?<!`)``(?!`)", md)  # RST literals, not Markdown fences
    assert "examples:" in md and "exit status:" in md


def test_the_op_contract_table_lists_every_op_s_outputs():
    table = pages.op_contract_table()
    for op in OPS.values():
        assert f"| `{op.name}` |" in table
        for name in op.outputs:
            assert f"`{name}`" in table
    assert "(`y`,)" in table  # a one-output op returns a 1-tuple


def test_operator_pages_lead_with_the_answer_table(tmp_path):
    """The first table of an operator page: per backend, levels with % bitwise equal and
    max rel on the GPU and on the CPU, 'not measured on a GPU' where it never ran there."""
    reports = conformance.load_reports(ROOT / "reports")
    md = pages.operator_page("rms_norm", reports)
    answer = md.index('<div class="ns-answer"')
    assert answer < md.index("## Specification")
    table = md[answer:md.index("</div>", answer)]
    assert "| <code>torch_ext</code> | all |" in table and "100 % equal, max rel 0" in table
    assert "| <code>vllm</code> | <code>offset=1.0</code> | not measured on a GPU |" in table
    # backends that ran nowhere are not rows of it
    assert "`transformer_engine`" not in table


#: How prose names each library with a version (its distribution, or vLLM), and the
#: backends whose reports record that version. (Capitalised project names are also used
#: beside timings, "Liger 4.47 µs", so they are not read as versions.)
_LIBRARIES = {
    "transformers": ("transformers",), "vLLM": ("vllm", "vllm-cuda"),
    "fla-core": ("fla", "fla-gated"), "liger-kernel": ("liger",),
    "megatron-core": ("megatron",), "flashinfer": ("flashinfer",),
    "flashinfer-python": ("flashinfer",), "TransformerEngine": ("transformer_engine",),
}


def test_library_versions_in_prose_are_the_reports_versions():
    """A library version in the rendered prose (spec and backend docstrings, the docs
    pages, the README) is one the committed reports measured: the site never puts a
    version beside results that another version produced."""
    import importlib
    import inspect

    measured: dict[str, set[str]] = {}
    for report in conformance.load_reports(ROOT / "reports"):
        for backend, version in (report.env.get("backends") or {}).items():
            if version:
                measured.setdefault(backend, set()).add(str(version))
    texts = {path.name: path.read_text() for path in [
        ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]}
    for name in ("normspec.spec.rms_norm", "normspec.spec.fused_add", "normspec.spec.gated",
                 "normspec.spec.presets", *(f"normspec.backends.{m}_adapter" for m in (
                     "transformers", "vllm", "fla", "liger", "flashinfer", "megatron",
                     "transformer_engine"))):
        texts[name] = inspect.getdoc(importlib.import_module(name)) or ""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, _LIBRARIES)) +
                         r") v?(\d+\.\d+(?:\.\d+)?)\b")
    wrong = []
    for where, text in texts.items():
        for library, version in pattern.findall(text):
            known = set().union(*(measured.get(b, set()) for b in _LIBRARIES[library]))
            if not any(v == version or v.startswith(version + ".") for v in known):
                wrong.append(f"{where}: {library} {version} (reports: {sorted(known)})")
    assert not wrong, wrong


MEASURE_SCRIPT = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const table = document.querySelector(".ns-answer table");
  const box = table ? table.getBoundingClientRect() : null;
  const wrap = table ? table.closest(".md-typeset__scrollwrap") || table.parentElement : null;
  document.body.setAttribute("data-ns-measure", JSON.stringify({
    bottom: box ? box.bottom : -1,
    tableScroll: table ? table.scrollWidth - wrap.clientWidth : 0,
    pageScroll: document.documentElement.scrollWidth - window.innerWidth}));
}, 300));
</script>"""


@needs_mkdocs
@needs_chromium
@pytest.mark.parametrize("op", sorted(OPS))
def test_the_answer_table_fits_the_first_screen(op, site, server, tmp_path):
    """At 1280 x 800 the operator page's answer table is on the first screen, whole, and
    neither it nor the page scrolls sideways."""
    page = site / "operators" / op / "index.html"
    probe = page.with_name("measure.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE_SCRIPT + "</body>"))
    try:
        dom = _chromium_run(f"{server}/operators/{op}/measure.html", "--dump-dom",
                            tmp=tmp_path / "profile", size="1280,800")
    finally:
        probe.unlink()
    found = re.search(r'data-ns-measure="([^"]*)"', dom)
    assert found, "the measuring script did not run"
    measure = json.loads(html.unescape(found.group(1)))
    assert 0 < measure["bottom"] <= 800, measure
    assert measure["tableScroll"] <= 0 and measure["pageScroll"] <= 0, measure


PAGE_KINDS = {"home": "", "operator": "operators/rms_norm/", "conformance": "conformance/",
              "benchmarks": "benchmarks/", "backends": "backends/",
              "train-rollout": "train-rollout/"}


@needs_mkdocs
@needs_chromium
@pytest.mark.parametrize("kind", sorted(PAGE_KINDS))
def test_each_page_kind_has_a_screenshot(kind, site, server, tmp_path):
    """A 1280 x 800 screenshot of each kind of page, for review (``docs/screenshots/``
    holds the committed ones)."""
    SCREENSHOTS.mkdir(exist_ok=True)
    png = SCREENSHOTS / f"{kind}.png"
    _chromium_run(f"{server}/{PAGE_KINDS[kind]}", f"--screenshot={png}",
                  tmp=tmp_path / "profile", size="1280,800")
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("op", sorted(OPS))
def test_operator_pages_show_a_runnable_example_with_its_output(op):
    md = pages.operator_page(op, [])
    assert "## Changes" in md and "-0.0" in md[md.index("## Changes"):]
    example = md[md.index("## Example"):]
    printed = example.split("```text", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(printed) >= 2 and all("[" in line for line in printed)
    if op != "rms_norm":  # the two conventions of the op give different bits here
        assert printed[0].split(None, 1)[1] != printed[1].split(None, 1)[1]


def test_report_strings_are_escaped_wherever_they_are_rendered(tmp_path):
    """A report may carry any string (a plugin names itself, its source and its failures):
    the pages show it as text, never as HTML, and a pipe never splits a table cell."""
    evil = "<script>alert(1)</script>|x"
    result = _result("fails", "fails", [f"forward case=x tensor=y {evil} ```"])
    result["source"] = evil
    data = _report("rms_norm", "cuda_bf16", {"reference": _result("exact", "exact"),
                                             "evil": result})
    data["environment"]["backends"]["evil"] = evil
    path = tmp_path / "cuda_bf16" / "rms_norm.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    reports = conformance.load_reports(tmp_path)
    md = pages.operator_page("rms_norm", reports) + pages.conformance_page(reports)
    # fenced blocks show their text as text; a failed line cannot close its fence
    outside = re.sub(r"```text\n.*?```", "", md, flags=re.S)
    assert "<script>" not in outside and "&lt;script&gt;" in outside
    assert "alert(1)</script>|x" not in outside
    fenced = re.findall(r"```text\n(.*?)```", md, flags=re.S)
    assert any("tensor=y <script>alert(1)</script>|x '''" in block for block in fenced)


def test_runs_tables_name_the_system_not_the_machines_kernel_build():
    assert conformance.system_name(
        "Linux-6.18.44-fc-v1252-gpu-x86_64-with-glibc2.39") == "Linux x86_64"
    assert conformance.system_name("macOS-15.1-arm64-arm-64bit") == "macOS arm64"
    assert conformance.system_name("?") == "?"
