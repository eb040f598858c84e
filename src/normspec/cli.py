"""The ``normspec`` command line: ``list``, ``check``, ``conformance``, ``compare``, ``build``,
``train-rollout`` (``python -m normspec`` is the same)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__, divergence, harness, registry
from .conformance import (
    default_device,
    distance_table,
    not_run,
    parse_requirements,
    percent_floor,
    reports_it_would_shrink,
    requirement_failures,
    run_conformance,
    summary_table,
)
from .ops import OPS
from .profiles import PROFILES, get_profile
from .report import build_report, validate_report
from .workers import usable_cores, validate_jobs

__all__ = ["EXAMPLES", "build_parser", "command_parsers", "main"]

DESCRIPTION = """\
Hold normalization kernels to normspec's declared-rounding specification.

commands:
  list           the backends found, whether each runs here (and why not), their ops
  check          one backend, one op, one profile: levels, failing lines, a repro
  conformance    every backend x op x profile; reports under --out (default: results/)
  compare        divergence matrix: every backend against every other on the same inputs
  build          compile the backends that compile code (torch extension, CuPy NVRTC)
  train-rollout  transformers vs vLLM on one Qwen3-Next model, norms unpatched and patched

levels, best first: exact (bits equal to the spec under every transform), invariant
(not exact, but batch/chunk/padding/permutation/slice/layout/repeat invariant),
accurate (within the contract tolerance), fails (outside it, or it raised)."""

EPILOG = """\
examples:
  normspec list
  normspec check --backend torch_ext --op rms_norm --profile cpu_bf16
  normspec conformance --device cpu --quick --out /tmp/reports
  normspec conformance --require torch_ext=exact          # a CI gate
  normspec compare --op rms_norm --profile cpu_bf16 --png matrix.png

exit status: 0 done (and every --require met); 1 a check failed, a --require was not
met or a build failed; 2 a usage error, or nothing could be checked."""


def _backends_table(names: Sequence[str] | None = None) -> Table:
    """``normspec list``'s table: every backend (or those named), its status, source, ops."""
    table = Table(title="normspec backends")
    for col in ("backend", "status", "source", "ops (backward)"):
        table.add_column(col)
    entries = registry.entries()
    # only those in the table: --backend X imports X alone; first-use builds overlap
    found = registry.statuses(names or None)
    for name, status in found.items():
        entry = entries[name]
        backend = entry.load()
        ops = ", ".join(f"{k} ({v.backward})" for k, v in backend.ops.items()) if backend \
            else ""
        table.add_row(escape(entry.name), "[green]available[/]" if status is None else
                      f"[yellow]{escape(status)}[/]",
                      escape(backend.source if backend else entry.origin), escape(ops))
    return table


def _cmd_list(args: argparse.Namespace, console: Console) -> int:
    console.print(_backends_table())
    return 0


def _failed_lines(result: dict) -> list[str]:
    gates = result.get("contract_gates", {})
    return [line for g in gates.values() for line in g.get("failed_lines", [])]


def _cmd_check(args: argparse.Namespace, console: Console) -> int:
    profile = get_profile(args.profile)
    _require_device(profile.device, "--profile")
    json_path = _output_file(args.json, "--json")
    backend = registry.get_backend(args.backend)
    reason = backend.available()
    if reason:
        console.print(f"error: {args.backend} is unavailable here: {reason}", markup=False,
                      highlight=False, soft_wrap=True)
        return 2
    result = harness.check(backend, args.op, profile, quick=args.quick, seeds=args.seeds)
    report = build_report(args.op, profile, {backend.name: result}, quick=args.quick,
                          seeds=args.seeds, command=_command(),
                          library_versions={backend.name: backend.library_version()})
    level = result["level"]
    console.print(f"{backend.name} {args.op} {profile.name}: forward={level['forward']} "
                  f"gradient={level['gradient']}")
    for line in distance_lines(result):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for variant, why in (result.get("skipped_variants") or {}).items():
        console.print(f"  skipped {variant}: {why}", markup=False, highlight=False,
                      soft_wrap=True)
    for line in _failed_lines(result):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for gate, outcome in result.get("contract_gates", {}).items():
        if outcome.get("repro"):
            console.print(f"# repro of the first failing {gate} case:", highlight=False)
            console.print(outcome["repro"], markup=False, highlight=False, soft_wrap=True)
    if json_path is not None:
        _write_json(json_path, validate_report(report, "report to write"))
    if level["forward"] == "unavailable":
        console.print(f"error: nothing was checked: {result.get('unavailable')}",
                      markup=False, highlight=False, soft_wrap=True)
        return 2
    return 1 if "fails" in level.values() else 0


def distance_lines(result: dict) -> list[str]:
    """One line per gate and output tensor: how far the backend is from the spec."""
    lines = []
    for gate, outcome in result.get("contract_gates", {}).items():
        for tensor, st in outcome.get("statistics", {}).items():
            equal = st.get("min_equal_fraction")
            lines.append(
                f"  {gate} {tensor}: "
                + ("" if equal is None else f"{percent_floor(equal)} % bitwise equal, ")
                + f"max ulp {st.get('max_ulp')}, max abs {_num(st.get('max_abs'))}, "
                f"max rel {_num(st.get('max_rel'))}")
    return lines


def _num(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _require_device(device: str, what: str) -> None:
    """A usage error, before any work, where ``device`` is CUDA and torch sees no GPU."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        built = "built without CUDA" if torch.version.cuda is None else \
            f"built with CUDA {torch.version.cuda}, but it sees no GPU"
        raise ValueError(f"{what}: needs a CUDA GPU; torch {torch.__version__} here is {built}")


def _output_file(value: str | None, what: str) -> Path | None:
    """``value`` as a file path to write at the end, checked now: not a directory, and no
    part of its folder a file (missing folders are created when written)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{what}: expected a file path, got the directory {value!r}")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{what}: {str(parent)!r} is a file, not a directory")
    return path


def _output_dir(value: str, what: str) -> Path:
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what}: expected a directory, got the file {value!r}")
    _output_file(str(path / "x"), what)
    return path


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _cmd_conformance(args: argparse.Namespace, console: Console) -> int:
    device = args.device or default_device()
    _require_device(device, "--device")
    required = parse_requirements(args.require or [])
    out_dir = _output_dir(args.out, "--out")
    if args.backend:
        lost = reports_it_would_shrink(out_dir, device, args.backend, args.op, args.profile)
        if lost:
            path, dropped = next(iter(lost.items()))
            raise ValueError(
                f"--out: {path} holds {', '.join(dropped)}, which a run of only "
                f"{', '.join(args.backend)} would drop ({len(lost)} report(s) so); run "
                "every backend into it, or write this run elsewhere (e.g. --out results)")
    # what will run and why the others cannot (the statuses are kept: run_conformance's are
    # free); an unknown --backend raises here, before the table, naming the installed ones
    console.print(_backends_table(args.backend))
    reports = run_conformance(device=device, quick=args.quick, backends=args.backend,
                              ops=args.op, profiles=args.profile, seeds=args.seeds,
                              out_dir=out_dir, command=_command(), console=console,
                              jobs=_jobs(args.jobs, device))
    # failing lines first (up to 5 per report and backend), the summary table last
    failing = [(r["profile"], name, line) for r in reports
               for name, res in r["results"].items() for line in _failed_lines(res)[:5]]
    if failing:
        console.print(FAILED_LINES_LEGEND, markup=False, highlight=False, soft_wrap=True)
    for profile, name, line in failing:
        console.print(f"{profile} {name}: {line}", markup=False, highlight=False,
                      soft_wrap=True)
    console.print(summary_table(reports))
    distances = distance_table(reports)
    if distances.row_count:
        console.print(distances)
    console.print(f"reports written under {args.out}/")
    problems = requirement_failures(reports, required)
    for line in problems:
        console.print(f"[red]FAILED[/] {escape(line)}", highlight=False, soft_wrap=True)
    if not any(res["level"]["forward"] != "unavailable"
               for r in reports for res in r["results"].values()):
        reasons = "; ".join(f"{n}: {why}" for n, why in not_run(reports).items())
        console.print(f"error: nothing was checked ({reasons or 'no backend selected'})",
                      markup=False, highlight=False, soft_wrap=True)
        return 1 if problems else 2
    return 1 if problems else 0


FAILED_LINES_LEGEND = (
    "failed checks (up to 5 per report and backend; every one is in the JSON): "
    "'forward'/'gradient ... vs=spec' lines are outside the tolerance; "
    "'invariance pair=(B/full, B/T)' lines mean B's output for the same rows changed under "
    "transform T (another batch, chunking, padding, order or memory layout), so B is not "
    "invariant; 'crash' lines say what the backend raised or returned wrongly.")


def _jobs(jobs: int | None, device: str) -> int:
    """``--jobs``, by default 1 on the CPU (torch's threads use its cores already) and on CUDA
    one per two cores, at most 8 (each worker also compiles and autotunes triton kernels on
    the CPU; on a 16-core host eight keep the GPU busy throughout)."""
    if jobs is not None:
        return validate_jobs(jobs)
    if device == "cpu":
        return 1
    return max(1, min(8, usable_cores() // 2))


def _cmd_build(args: argparse.Namespace, console: Console) -> int:
    """Builds each installed backend that compiles code; a failure is reported with its
    reason and the others still build (exit status 1 if any failed). Their first-use work
    (``prepare``: the torch extension's build, the CuPy backend's NVRTC compiles) runs side
    by side from the start; each ``build`` then finishes and reports in name order (a
    build that failed quietly in ``prepare`` is retried verbosely there)."""
    builders = [(entry, backend) for entry, backend in registry.iter_backends()
                if backend is not None and callable(getattr(backend, "build", None))]
    failed = False
    with registry.preparing({entry.name: backend for entry, backend in builders}) as futures:
        for entry, backend in builders:
            console.print(f"building {entry.name} ...")
            if entry.name in futures:
                futures[entry.name].result()
            try:
                outcome = backend.build(verbose=True)
            except RuntimeError as exc:
                console.print(f"[red]FAILED[/] {entry.name}: {exc}", highlight=False,
                              soft_wrap=True)
                failed = True
            else:
                console.print(f"{entry.name}: {outcome}", highlight=False, soft_wrap=True)
    if not builders:
        console.print("no installed backend needs a build")
    return 1 if failed else 0


def _cmd_train_rollout(args: argparse.Namespace, console: Console) -> int:
    # the integrations need transformers and vLLM; imported only for this command
    from normspec.integrations.summary import PHASES, logprob_rows, site_rows
    from normspec.integrations.train_rollout import run

    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        raise ValueError(f"--checkpoint: expected a model directory, got {args.checkpoint!r}")
    json_path = _output_file(args.json, "--json")
    report = run(args.checkpoint, alignment=args.alignment, backend=args.backend,
                 sequences=args.sequences, length=args.length, max_tokens=args.max_tokens,
                 train=args.train, progress=lambda line: console.print(f"normspec: {line}"))
    report["command"] = _command()
    phases = [title for name, title in PHASES.items() if name in report]
    table = Table(title="norm sites: output elements bitwise equal, transformers vs vLLM")
    for column in ("site kind", *phases):
        table.add_column(column)
    for row in site_rows(report):
        table.add_row(*row)
    console.print(table)
    table = Table(title="per-token logprobs, transformers teacher-forced vs vLLM prompt logprobs")
    for column in ("phase", "max |Δ|", "mean |Δ|", "tokens with Δ = 0"):
        table.add_column(column)
    for row in logprob_rows(report):
        table.add_row(*row)
    console.print(table)
    if json_path is not None:
        _write_json(json_path, report)
        console.print(f"wrote {json_path}")
    return 0


def _cmd_compare(args: argparse.Namespace, console: Console) -> int:
    _require_device(get_profile(args.profile).device, "--profile")
    json_path = _output_file(args.json, "--json")
    png_path = _output_file(args.png, "--png")
    if png_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--png: needs matplotlib (pip install matplotlib)")
    result = divergence.divergence_matrix(
        args.op, args.profile, backends=args.backend, seeds=args.seeds,
        params=divergence.parse_params(args.params), quick=args.quick)
    console.print(divergence.format_matrix(result), markup=False, highlight=False,
                  soft_wrap=True)
    if json_path is not None:
        _write_json(json_path, result)
    if png_path is not None:
        png_path.parent.mkdir(parents=True, exist_ok=True)
        divergence.write_heatmap(result, png_path)
    return 0


def _command() -> str:
    return "normspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _version() -> str:
    import platform

    import torch

    return (f"normspec {__version__} (torch {torch.__version__}, "
            f"python {platform.python_version()})")


class _VersionAction(argparse.Action):
    """``--version``, with torch imported only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        print(_version())
        parser.exit()


BACKEND_HELP = "a backend's entry-point name, as `normspec list` shows it"
OP_HELP = "the operator"
PROFILE_HELP = "device, dtype and shapes of the inputs (cpu_* or cuda_*)"
SEEDS_HELP = "random inputs per shape (default 2, with --quick 1)"
QUICK_HELP = "fewer shapes and one seed"


#: Examples per command, shown by ``normspec COMMAND --help`` and on the docs site.
EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "list": [("normspec list", "every backend found, whether it runs here and why not")],
    "check": [
        ("normspec check --backend torch_ext --op rms_norm --profile cpu_bf16",
         "one backend, one op, one profile: levels, distance from the spec, failing lines"),
        ("normspec check --backend liger --op fused_add_rms_norm --profile cuda_bf16 "
         "--json liger.json", "the same, with the report written"),
    ],
    "conformance": [
        ("normspec conformance", "every backend, op and profile of this machine's device"),
        ("normspec conformance --device cpu --quick --out /tmp/reports", "a quick CPU run"),
        ("normspec conformance --backend torch_ext --require torch_ext=exact",
         "a CI gate: exit 1 unless torch_ext is exact everywhere"),
    ],
    "compare": [
        ("normspec compare --op rms_norm --profile cpu_bf16",
         "every backend against every other, % bitwise equal"),
        ("normspec compare --op fused_add_rms_norm --profile cuda_bf16 "
         "--params residual_sum=fp32 --png m.png", "one convention, with a heatmap"),
    ],
    "build": [("normspec build", "compile the torch extension and CuPy's kernels now")],
    "train-rollout": [
        ("normspec train-rollout", "a tiny random Qwen3-Next, transformers against vLLM"),
        ("normspec train-rollout --checkpoint DIR --train 0 --json r.json",
         "your checkpoint, without training steps"),
    ],
}


def _examples(command: str) -> str:
    return "examples:\n" + "\n".join(f"  {cmd}\n      {what}"
                                      for cmd, what in EXAMPLES[command])


def _command_parser(sub: Any, name: str, summary: str) -> argparse.ArgumentParser:
    command = sub.add_parser(name, help=summary,
                             description=summary[:1].upper() + summary[1:] + ".",
                             epilog=_examples(name),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    _COMMANDS[name] = command
    return command


def command_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``normspec`` parser and each command's parser by name (the docs render their
    help)."""
    parser = build_parser()
    return parser, dict(_COMMANDS)


_COMMANDS: dict[str, argparse.ArgumentParser] = {}


def build_parser() -> argparse.ArgumentParser:
    """The ``normspec`` command's parser."""
    p = argparse.ArgumentParser(prog="normspec", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command_parser(sub, "list", "backends, availability with reason, ops, backward support")
    c = _command_parser(sub, "check", "check one backend's op on one profile")
    c.add_argument("--backend", required=True, help=BACKEND_HELP)
    c.add_argument("--op", required=True, choices=sorted(OPS), help=OP_HELP)
    c.add_argument("--profile", required=True, choices=sorted(PROFILES), help=PROFILE_HELP)
    c.add_argument("--seeds", type=_positive_int, default=None, help=SEEDS_HELP)
    c.add_argument("--quick", action="store_true", help=QUICK_HELP)
    c.add_argument("--json", help="also write the report here")
    k = _command_parser(sub, "conformance", "every available backend × op × profile")
    k.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when torch sees a GPU, else cpu")
    k.add_argument("--quick", action="store_true", help=QUICK_HELP)
    k.add_argument("--backend", action="append",
                   help=BACKEND_HELP + "; restricts the run (repeatable)")
    k.add_argument("--op", action="append", choices=sorted(OPS), help="restrict to these ops")
    k.add_argument("--profile", action="append", choices=sorted(PROFILES),
                   help="restrict to these profiles (default: every profile of the device)")
    k.add_argument("--seeds", type=_positive_int, default=None, help=SEEDS_HELP)
    k.add_argument("--out", default="results",
                   help="report directory (default: results/, which git ignores; the "
                        "repository's published evidence is written with --out reports)")
    k.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="run the checks in N worker processes side by side (default: 1 on "
                        "cpu; on cuda one per two cores, at most 8), the longest first "
                        "by the times in the reports under --out, each with an equal "
                        "share of the cores for its torch threads "
                        "($NORMSPEC_WORKER_THREADS sets them); the verdicts do not "
                        "depend on it. On cuda each check runs in a process of its own, "
                        "so that a kernel's memory fault fails only its own backend")
    k.add_argument("--require", action="append", metavar="BACKEND=LEVEL",
                   help="CI gate: exit 1 unless BACKEND reaches LEVEL (exact, invariant or "
                        "accurate) in every report, forward and gradient (repeatable)")
    d = _command_parser(sub, "compare", "divergence matrix: every backend against every "
                                        "other on the same inputs")
    d.add_argument("--op", required=True, choices=sorted(OPS), help=OP_HELP)
    d.add_argument("--profile", required=True, choices=sorted(PROFILES), help=PROFILE_HELP)
    d.add_argument("--params", nargs="*", default=[], metavar="K=V",
                   help="fix variant parameters, e.g. residual_sum=fp32 offset=1")
    d.add_argument("--backend", action="append", help="restrict to these backends (repeatable)")
    d.add_argument("--seeds", type=_positive_int, default=3,
                   help="random inputs per shape (default 3)")
    d.add_argument("--quick", action="store_true", help="the profile's quick shapes")
    d.add_argument("--json", help="write the matrix JSON here")
    d.add_argument("--png", help="write the %% bitwise-equal heatmap here")
    _command_parser(sub, "build", "build the backends that compile code (torch extension, "
                    "CuPy's NVRTC modules)")
    t = _command_parser(sub, "train-rollout",
                        "transformers vs vLLM on one Qwen3-Next checkpoint, norms unpatched "
                        "and patched (needs transformers and vLLM)")
    t.add_argument("--checkpoint", default=None,
                   help="a Qwen3-Next model directory (default: a tiny random model)")
    t.add_argument("--alignment", default="trainer", choices=("trainer",),
                   help="the declared conventions both sides use (transformers can only "
                        "honour 'trainer')")
    t.add_argument("--backend", default="torch_ext", choices=("torch_ext", "cupy"))
    t.add_argument("--sequences", type=_positive_int, default=4,
                   help="token sequences (default 4)")
    t.add_argument("--length", type=_positive_int, default=32,
                   help="tokens per sequence (default 32)")
    t.add_argument("--max-tokens", type=int, default=4,
                   help="decode steps vLLM generates after each prompt (default 4)")
    t.add_argument("--train", type=int, default=3,
                   help="training steps before the weight sync (0: none; default 3)")
    t.add_argument("--json", help="write the report here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``normspec`` command."""
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # logs (CI, nox): tables need room, nobody resizes a log
        console = Console(width=max(console.width, 160))
    handlers = {"list": _cmd_list, "check": _cmd_check, "conformance": _cmd_conformance,
                "build": _cmd_build, "compare": _cmd_compare,
                "train-rollout": _cmd_train_rollout}
    try:
        return handlers[args.command](args, console)
    except registry.BrokenBackendError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except (registry.UnknownBackendError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
