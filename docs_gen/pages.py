"""Markdown for the generated pages: operators, backends, CLI, conformance overview."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from normspec import registry
from normspec.gates import LEVELS, TOLERANCES
from normspec.ops import OPS, OpDef, variant_name
from normspec.spec import PRESETS
from normspec.transforms import TRANSFORMS

from .conformance import Report, answer_table, level_badge, render_conformance, render_overview

__all__ = [
    "backends_page",
    "cli_page",
    "conformance_page",
    "invariance_table",
    "operator_page",
    "readme_quickstart",
    "tolerance_table",
]

#: What each conformance level means (the report's ``level`` values).
LEVEL_MEANING = {
    "exact": "bits equal to the spec for every input tried, under every transform",
    "invariant": "not bitwise equal to the spec, but bitwise invariant under every transform",
    "accurate": "within the per-dtype tolerance of the spec (below), but not invariant",
    "fails": "outside the tolerance, or a crash (the failing lines are listed)",
    "unavailable": "the backend could not run here (the reason is in the report)",
    "none": "not run (no backward, or no report)",
}
SINGLETON_AGGREGATION = (
    "`dweight` of the whole batch equals the pairwise-tree sum "
    "([`tree_sum`][normspec.spec.arithmetic.tree_sum], the spec's order over rows) of the "
    "`dweight`s of one-row calls (fp32 weights; gradients only)"
)


def _spec_module(op: OpDef) -> str:
    return op.forward.__module__


def tolerance_table() -> str:
    """[`TOLERANCES`][normspec.gates.TOLERANCES] as a Markdown table."""
    rows = ["| kind | dtype | `rtol` | `atol_rms` |", "| --- | --- | --- | --- |"]
    for (kind, dtype), tol in TOLERANCES.items():
        rows.append(f"| {kind} | `{str(dtype).removeprefix('torch.')}` | {tol.rtol:g} "
                    f"| {tol.atol_rms:g} |")
    return "\n".join(rows) + "\n"


def invariance_table() -> str:
    """[`TRANSFORMS`][normspec.transforms.TRANSFORMS] (and singleton aggregation) as a table."""
    rows = ["| check | what the backend is called on |", "| --- | --- |"]
    for t in TRANSFORMS:
        rows.append(f"| `{t.name}` | {t.description} |")
    rows.append(f"| `singleton_aggregation` | {SINGLETON_AGGREGATION} |")
    return "\n".join(rows) + "\n"


def levels_table() -> str:
    rows = ["| level | meaning |", "| --- | --- |"]
    for level in (*LEVELS, "unavailable", "none"):
        rows.append(f"| {level_badge(level)} | {LEVEL_MEANING.get(level, '')} |")
    return "\n".join(rows) + "\n"


def _presets_for(op: OpDef) -> list[str]:
    out = []
    for p in PRESETS.values():
        if p.op is op.forward:
            kwargs = ", ".join(f"`{k}={v!r}`" for k, v in p.kwargs.items())
            widths = ", ".join(f"{k} {v}" for k, v in p.widths.items())
            out.append(f"[`{p.name}`][normspec.spec.presets.{p.name}]: {kwargs}"
                       + (f"; row widths: {widths}" if widths else ""))
    return out


#: A runnable example per operator; the docs build runs it and shows what it printed.
EXAMPLES: dict[str, str] = {
    "rms_norm": """\
import torch
from normspec import spec

x = torch.tensor([[1.0, -2.0, 3.0, 0.5]], dtype=torch.bfloat16)
w = torch.zeros(4)                                # zero-centred: the scale is 1 + w
y = spec.rms_norm(x, w, eps=1e-6, offset=1.0)
dx, dw = spec.rms_norm_backward(torch.ones_like(x), x, w, eps=1e-6, offset=1.0)
print("y      ", y.tolist())
print("dx     ", dx.tolist())
print("dweight", dw.tolist())
""",
    "fused_add_rms_norm": """\
import torch
from normspec import spec

x = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.bfloat16)   # sublayer output
r = torch.tensor([[7.0, -5.0, 3.0, 2.0]], dtype=torch.bfloat16)   # running residual
for residual_sum in ("fp32", "rounded"):   # vLLM's and transformers' conventions
    y, new_r = spec.fused_add_rms_norm(x, r, torch.zeros(4), eps=1e-6, offset=1.0,
                                       residual_sum=residual_sum)
    print(f"{residual_sum:8}", y.tolist(), new_r.tolist())
""",
    "rms_norm_gated": """\
import torch
from normspec import spec

x = torch.tensor([[0.3, -1.1, 2.2, 0.7]], dtype=torch.bfloat16)
z = torch.tensor([[1.0, -1.0, 0.5, 3.0]], dtype=torch.bfloat16)      # the gate
w = torch.ones(4, dtype=torch.bfloat16)
for convention in ("vllm", "hf"):
    y = spec.rms_norm_gated(x, z, w, eps=1e-6, convention=convention)
    print(f"{convention:5}", y.tolist())
""",
}


#: Changes to what the spec means (not to how it is computed), newest first; each with the
#: normspec version it came in. Reports written before a change may disagree with it.
SPEC_CHANGES: tuple[tuple[str, str], ...] = (
    ("0.1.0", "`eps` and `offset` are checked as the fp32 values the arithmetic uses: an "
              "`eps` that rounds to 0 or to inf, or an `offset` that rounds to inf, is an "
              "error (before, a zero row gave NaN, or every output was 0 or ±inf)."),
    ("0.1.0", "Bitwise equality tells `-0.0` from `+0.0` (a kernel must produce the spec's "
              "sign of zero). The committed CPU reports predate this rule and may count "
              "such elements as equal."),
)


def changes_section() -> list[str]:
    lines = ["## Changes", "", "| since | change |", "| --- | --- |"]
    lines += [f"| {version} | {text} |" for version, text in SPEC_CHANGES]
    return [*lines, ""]


def example_section(name: str) -> list[str]:
    """The operator's example and the output it printed when the docs were built."""
    import contextlib as _contextlib
    import io

    code = EXAMPLES[name]
    out = io.StringIO()
    with _contextlib.redirect_stdout(out):
        exec(compile(code, f"<example {name}>", "exec"), {"__name__": "example"})
    return ["## Example", "", "```python", code.rstrip(), "```", "", "prints", "",
            "```text", out.getvalue().rstrip(), "```", ""]


def operator_page(
    name: str, reports: Sequence[Report], heatmaps: Sequence[str] = ()
) -> str:
    """The page of one operator: spec (math, order, conventions, backward), gates, conformance.

    ``heatmaps`` are site paths (relative to the page's directory) of divergence
    heatmap PNGs for this operator.
    """
    op = OPS[name]
    module = _spec_module(op)
    fwd = f"{module}.{op.forward.__name__}"
    bwd = f"{module}.{op.backward.__name__}"
    presets = _presets_for(op)
    lines = [
        f"# `{name}`",
        "",
        f"Which libraries compute `{name}` as the spec does (the committed reports):",
        "",
        answer_table(name, reports),
        *example_section(name),
        f"The spec below is [`{module}`][{module}].",
        "",
        "| | |",
        "| --- | --- |",
        f"| spec forward | [`{fwd}`][{fwd}] |",
        f"| spec backward | [`{bwd}`][{bwd}] |",
        f"| row inputs | {', '.join(f'`{n}`' for n in op.row_inputs)} (then `weight`) |",
        f"| outputs | {', '.join(f'`{n}`' for n in op.outputs)} |",
        f"| gradients | {', '.join(f'`{n}`' for n in (*op.row_grads, 'dweight'))} |",
        f"| variants checked | {', '.join(f'`{variant_name(v)}`' for v in op.variants)} |",
    ]
    if presets:
        lines.append(f"| Qwen3-Next preset | {'<br>'.join(presets)} |")
    lines += [
        "",
        f"[](){{#{module}}}",
        "## Specification",
        "",
        f"The normative text of [`{module}`][{module}]: the math, the declared rounding "
        "order, which upstream library follows which convention, and the backward.",
        "",
        f"::: {module}",
        "    options:",
        "      show_root_heading: false",
        "      show_root_toc_entry: false",
        "      heading_level: 3",
        f"      members: [{op.forward.__name__}, {op.backward.__name__}]",
        "",
        "## Tolerances",
        "",
        "A backend that is not bitwise equal to the spec is still *accurate* when every "
        "element satisfies $|\\mathrm{got} - \\mathrm{ref}| \\le \\mathrm{atol\\_rms} "
        "\\cdot s + \\mathrm{rtol} \\cdot |\\mathrm{ref}|$, where $s$ is the root mean square "
        "of the reference (for gradients at least that of the incoming gradient); see "
        "[`Tolerance`][normspec.gates.Tolerance].",
        "",
        tolerance_table(),
        "## Invariance checks",
        "",
        "Each transform calls the backend on the same rows presented differently; an "
        "*invariant* backend returns bitwise the rows of the plain full-batch call "
        "(forward outputs and row gradients). See [`normspec.transforms`][normspec.transforms].",
        "",
        invariance_table(),
        "## Conformance",
        "",
        "Rendered from the reports committed under `reports/`. Levels:",
        "",
        levels_table(),
        render_conformance(name, reports),
    ]
    lines += changes_section()
    if heatmaps:
        lines += ["## Divergence between backends", ""]
        for src in heatmaps:
            lines += [f"![divergence matrix {Path(src).stem}]({src})", ""]
    return "\n".join(lines)


#: The report field reference, shown under the overview.
REPORT_FIELDS = Path(__file__).resolve().parent / "report_fields.md"


def conformance_page(reports: Sequence[Report]) -> str:
    """All operators × profiles × backends on one page."""
    return "\n".join([
        "# Conformance overview",
        "",
        "Every backend that ran against the spec, per operator, on a GPU and on the CPU, "
        "from the reports committed under `reports/`: `forward / gradient` levels and the "
        "forward's least % of bitwise-equal elements. Each operator page has the rest: "
        "every profile, versions, dates, commits and the lines of the failed checks.",
        "",
        render_overview(reports, OPS),
        levels_table(),
        "",
        REPORT_FIELDS.read_text(),
    ])


def _builtin_entry_points() -> list[importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)
    own = {ep.name: ep for ep in eps if ep.dist is not None and ep.dist.name == "normspec"}
    return [own[n] for n in sorted(own)]


def backends_page() -> str:
    """Every built-in backend of the registry: what it wraps, ops, backward, install. Nothing
    is imported beyond the adapters' modules and nothing is built: whether a backend runs
    depends on the reader's machine (``normspec list`` says)."""
    lines = [
        "# Backends",
        "",
        "The built-in backends, registered through the same `normspec.backends` entry-point "
        "group a third-party plugin uses (see [Writing your own backend](writing-a-backend.md)). "
        "`normspec list` prints the same information for the environment you run it in. "
        "A backend's `available()` returns `None` when it can run and otherwise the reason it "
        "cannot (library missing, no GPU, …); a conformance run then records it as "
        "*unavailable* with that reason, and never fails on it.",
        "",
        "| backend | module | ops |",
        "| --- | --- | --- |",
    ]
    sections: list[str] = []
    entries = registry.entries()
    documented: dict[str, str] = {}  # module -> the first backend whose section shows it
    for ep in _builtin_entry_points():
        entry = entries.get(ep.name)
        backend = entry.load() if entry else None
        ops = ", ".join(f"`{o}`" for o in (backend.ops if backend else {}))
        lines.append(f"| [`{ep.name}`](#{ep.name}) | `{ep.module}` "
                     f"| {ops or '—'} |")
        sections += _backend_section(ep, entry, backend, documented.get(ep.module))
        documented.setdefault(ep.module, ep.name)
    return "\n".join([*lines, "", *sections])


def _backend_section(ep, entry, backend, shown_with: str | None = None) -> list[str]:
    """A backend's section; its module's text once per module (``shown_with``: the backend
    whose section already has it)."""
    out = [f"## `{ep.name}`", ""]
    if shown_with is not None:
        out += [f"The module `{ep.module}` is described under [`{shown_with}`](#{shown_with}).",
                ""]
        doc = None
    else:
        try:
            module = importlib.import_module(ep.module)
            doc = inspect.getdoc(module)
        except Exception as exc:  # a broken backend is shown, never breaks the docs
            doc = None
            out += [f'!!! failure "broken"\n\n    importing `{ep.module}` failed: `{exc}`', ""]
    if doc:
        out += [_demote_headings(doc), ""]
    if backend is None:
        reason = entry.broken if entry else "not registered"
        out += [f"Not loadable: `{reason}`", ""]
        return out
    source = _safe(lambda: backend.source)
    out += ["| | |", "| --- | --- |",
            f"| entry point | `{ep.name} = \"{ep.value}\"` |",
            f"| wraps | {_cellify(source)} |"]
    install = getattr(backend, "install", None) or "see `normspec list`"
    out.append(f"| install | `{_cellify(install)}` |")
    out += ["", "| op | backward | parameters | devices | weight dtypes |",
            "| --- | --- | --- | --- | --- |"]
    for op_name, support in backend.ops.items():
        params = "; ".join(f"`{k}` ∈ {list(v)}" for k, v in support.params.items()) or "all"
        out.append(f"| `{op_name}` | {support.backward} | {_cellify(params)} "
                   f"| {', '.join(support.devices)} | {', '.join(support.weight_dtypes)} |")
    out.append("")
    return out


def _safe(fn):
    try:
        return fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _cellify(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _demote_headings(doc: str) -> str:
    """Module docstrings are shown under an h2: their own headings go one level down."""
    return re.sub(r"^(#{1,5}) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", doc, flags=re.M)


@contextlib.contextmanager
def _columns(n: int) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def cli_page() -> str:
    """The ``normspec`` command: each command's synopsis, options and examples, from the
    parser itself (what ``normspec COMMAND --help`` prints)."""
    from normspec import cli

    with _columns(96):
        parser, commands = cli.command_parsers()
        lines = ["[](){#normspec.cli}", "# Command line", "",
                 "`normspec` (also `python -m normspec`); `normspec COMMAND --help` prints "
                 "each section below.", "",
                 "```text", parser.format_help().rstrip(), "```", ""]
        for name, command in commands.items():
            lines += [f"## `normspec {name}`", "", "```text", command.format_help().rstrip(),
                      "```", ""]
    return "\n".join(lines)


def op_contract_table() -> str:
    """What ``forward`` receives and returns for each operator, from ``OPS`` itself."""
    lines = ["| op | `rows` keys | returns (a tuple, in this order) | gradients compared "
             "| parameters (`**params`) |", "| --- | --- | --- | --- | --- |"]
    for op in OPS.values():
        params: dict[str, list] = {}
        for variant in op.variants:
            for key, value in variant.items():
                params.setdefault(key, [])
                if value not in params[key]:
                    params[key].append(value)
        shown = "; ".join(f"`{k}` ∈ {{{', '.join(f'`{v!r}`' for v in vs)}}}"
                          for k, vs in params.items())
        lines.append(f"| `{op.name}` | {', '.join(f'`{r}`' for r in op.row_inputs)} "
                     f"| ({', '.join(f'`{o}`' for o in op.outputs)}"
                     f"{',' if len(op.outputs) == 1 else ''}) "
                     f"| {', '.join(f'`{g}`' for g in (*op.row_grads, 'dweight'))} "
                     f"| {shown} |")
    return "\n".join(lines)


def readme_quickstart(readme: str) -> str:
    """The first fenced code block under the README's ``## Quickstart`` heading."""
    m = re.search(r"^## Quickstart\s*$(.*?)^(```\w*\n.*?^```)\s*$", readme, flags=re.M | re.S)
    if not m:
        raise ValueError("README.md: no fenced code block under '## Quickstart'")
    return m.group(2)
