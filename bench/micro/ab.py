"""Build a micro harness in several variants, run them interleaved, compare.

The harnesses under ``bench/micro/`` that take a label as their first argument
(``row_forward_ab.cu``, ``small_backward_ab.cu``) print one line per case: the label,
the case, one or more times ``[fwd|bwd] N.NN us`` and an FNV-1a hash of the outputs.
This script builds one binary per ``--build`` flag set (in parallel), runs every binary
under every ``--env`` setting, round after round (so that a drift of the GPU's clocks
hits every variant alike), and prints per case and variant the median of the rounds.
A variant changes how a kernel is built or launched, never its arithmetic, so every
variant's hash of a case must be equal; the script says where they differ and then
exits with 1.

    python3 bench/micro/ab.py bench/micro/row_forward_ab.cu \\
        --build "" --build=-DNORMSPEC_STREAMING_HINTS=1 --rounds 2 --out ab.json
    python3 bench/micro/ab.py bench/micro/small_backward_ab.cu \\
        --env "" --env "NORMSPEC_BWD_TEAM=256"

Stopped by SIGTERM (``timeout``) or Ctrl-C while running, it still prints (and writes)
the medians of the runs that ended, marked as stopped early, and exits with 3.

Flags that start with ``-`` need the ``--build=FLAGS`` spelling. The launcher's
translation units (``backends/csrc/normspec_launch.cu`` and ``launch_units/*.cu``) are
linked where the harness calls the shipped launcher's entry points (it includes
``normspec_launch.h``) and not where it compiles the launcher itself (it includes
``normspec_launch_impl.cuh``: linking both defines every kernel twice);
``--launch-units`` / ``--no-launch-units`` say it explicitly. Needs ``nvcc``
(``$CUDA_HOME/bin`` or ``PATH``) and, to run, a CUDA GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "backends" / "csrc"
#: The flags of the extension's CUDA build that matter to the kernels' code (IEEE
#: arithmetic, no fused multiply-add), for sm_90a as on the H200.
NVCC_FLAGS = ["-O3", "-std=c++17", "-arch=sm_90a", "-fmad=false", "--ftz=false",
              "--prec-div=true", "--prec-sqrt=true"]
#: The torch-free units of the extension's CUDA build: the entry points, then the launch
#: units (one forward or backward of one op and dtype each).
LAUNCH_UNITS = ("normspec_launch.cu",
                *sorted(f"launch_units/{p.name}" for p in (CSRC / "launch_units").glob("*.cu")))

_TIME = re.compile(r"(?:\b(fwd|bwd)\s+)?(-?\d+(?:\.\d+)?)\s+us\b")
_HASH = re.compile(r"\s([0-9a-f]{16})\s*$")


@dataclass
class Line:
    """One line of a harness: its label, case and times (``us``, or ``fwd`` / ``bwd``)."""

    label: str
    case: str
    times: dict[str, float]
    digest: str | None = None


@dataclass
class Variant:
    """One build flag set under one environment setting."""

    name: str
    build: str
    env: dict[str, str] = field(default_factory=dict)


def parse_line(text: str) -> Line | None:
    """A harness line as a :class:`Line`, or ``None`` for lines without a time."""
    label, _, rest = text.strip().partition(" ")
    first = _TIME.search(rest)
    if first is None:
        return None
    case = " ".join(rest[:first.start()].split())
    times = {(m.group(1) or "us"): float(m.group(2)) for m in _TIME.finditer(rest)}
    digest = _HASH.search(rest)
    return Line(label, case, times, digest.group(1) if digest else None)


def parse_env(text: str) -> dict[str, str]:
    """``"A=1 B=2"`` -> ``{"A": "1", "B": "2"}`` (``""``: no variables)."""
    env = {}
    for item in shlex.split(text):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--env: expected NAME=VALUE items, got {item!r} in {text!r}")
        env[name] = value
    return env


def variants(builds: list[str], envs: list[str]) -> list[Variant]:
    """Every build flag set under every environment setting, named ``v0``, ``v1``, ..."""
    out = []
    for build in builds:
        for env_text in envs:
            out.append(Variant(f"v{len(out)}", build, parse_env(env_text)))
    return out


def describe(v: Variant) -> str:
    """A variant as its flags and variables (``default`` for neither)."""
    parts = [v.build] if v.build else []
    parts += [f"{k}={val}" for k, val in v.env.items()]
    return " ".join(parts) or "default"


def find_nvcc() -> str:
    """The nvcc to build with (``$CUDA_HOME/bin``, then ``PATH``)."""
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found is None:
        raise FileNotFoundError("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    return found


def _includes(harness: Path, header: str) -> bool:
    return re.search(rf'^\s*#\s*include\s+"{re.escape(header)}"', harness.read_text(),
                     re.MULTILINE) is not None


def launch_units_for(harness: Path, asked: bool | None) -> bool:
    """Whether to link the launcher's units with ``harness``: ``asked`` (``None``: from
    what it includes). Raises ``ValueError`` where the harness compiles the launcher
    itself and the units are asked for."""
    own = _includes(harness, "normspec_launch_impl.cuh")
    if asked and own:
        raise ValueError(f"--launch-units: {harness.name} includes normspec_launch_impl.cuh, "
                         "so it compiles the launcher itself and linking its units would "
                         "define every kernel twice; leave --launch-units out")
    if asked is not None:
        return asked
    return not own and _includes(harness, "normspec_launch.h")


def build_all(harness: Path, builds: list[str], launch_units: bool, workdir: Path,
              console: Console) -> dict[str, Path]:
    """One binary per flag set, compiled in parallel; raises with nvcc's output on failure.

    With ``launch_units`` every source of every variant is compiled to an object, one
    compile per core at a time (nvcc compiles the files of one command one after
    another, and the units take a minute and a half together on one core), then each
    variant's objects are linked."""
    nvcc = find_nvcc()
    sources = [harness, *(CSRC / u for u in LAUNCH_UNITS)] if launch_units else [harness]

    def start(cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def finish(proc: subprocess.Popen, flags: str) -> None:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for build flags {flags!r}:\n{out[-4000:]}")

    binaries = {}
    with console.status(f"building {len(builds)} variant(s) of {harness.name} ..."):
        if not launch_units:
            procs = {}
            for i, flags in enumerate(builds):
                exe = workdir / f"build{i}"
                procs[flags] = (exe, start([nvcc, *NVCC_FLAGS, f"-I{CSRC}", *shlex.split(flags),
                                            str(harness), "-o", str(exe)]))
            for flags, (exe, proc) in procs.items():
                finish(proc, flags)
                binaries[flags] = exe
                console.log(f"built {flags or '(no flags)'}")
            return binaries
        compiles = {}
        # every object of every variant, at most one compile per core at a time (22
        # units a variant: all at once would only thrash)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for i, flags in enumerate(builds):
                objs = [workdir / f"build{i}_{k}.o" for k in range(len(sources))]
                compiles[flags] = (i, objs, [
                    pool.submit(lambda cmd, flags=flags: finish(start(cmd), flags),
                                [nvcc, *NVCC_FLAGS, f"-I{CSRC}", *shlex.split(flags), "-c",
                                 str(src), "-o", str(obj)])
                    for src, obj in zip(sources, objs, strict=True)])
        for flags, (i, objs, futures) in compiles.items():
            for future in futures:
                future.result()  # raises with nvcc's output
            exe = workdir / f"build{i}"
            link = start([nvcc, "-arch=sm_90a", *map(str, objs), "-o", str(exe)])
            finish(link, flags)
            binaries[flags] = exe
            console.log(f"built {flags or '(no flags)'}")
    return binaries


class Stopped(Exception):
    """SIGTERM (``timeout`` stopping the script): the rounds end, what ran is reported."""


def _stop(signum, frame):
    raise Stopped(f"stopped by signal {signum}")


def run_rounds(binaries: dict[str, Path], vs: list[Variant], rounds: int, timeout: float,
               console: Console, rows: list[dict] | None = None) -> list[dict]:
    """Every variant once per round, in order; one row per harness line, appended to
    ``rows`` as each run ends (so that a caller keeps the runs before an interruption)."""
    rows = [] if rows is None else rows
    for r in range(1, rounds + 1):
        for v in vs:
            env = {**os.environ, **v.env}
            done = subprocess.run([str(binaries[v.build]), v.name], env=env, capture_output=True,
                                  text=True, timeout=timeout)
            if done.returncode != 0:
                raise RuntimeError(f"{describe(v)} (round {r}) exited with {done.returncode}:\n"
                                   f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
            for text in done.stdout.splitlines():
                line = parse_line(text)
                if line is not None and line.label == v.name:
                    rows.append({"variant": v.name, "round": r, "case": line.case,
                                 "times_us": line.times, "hash": line.digest})
            console.log(f"round {r}/{rounds}: {describe(v)}")
    return rows


def summarize(rows: list[dict], vs: list[Variant]) -> tuple[list[dict], list[str]]:
    """Median per case, variant and time; and the cases whose hashes differ."""
    cases = list(dict.fromkeys(row["case"] for row in rows))
    summary, differ = [], []
    for case in cases:
        mine = [row for row in rows if row["case"] == case]
        if len({row["hash"] for row in mine}) > 1:
            differ.append(case)
        for v in vs:
            got = [row["times_us"] for row in mine if row["variant"] == v.name]
            if got:
                keys = list(dict.fromkeys(k for t in got for k in t))
                summary.append({"case": case, "variant": v.name,
                                "median_us": {k: statistics.median(t[k] for t in got if k in t)
                                              for k in keys}})
    return summary, differ


def git_state() -> dict:
    """The commit the harness is built from (``normspec.report.git_state``: on a copy
    of the tree without ``.git``, ``NORMSPEC_GIT_COMMIT``)."""
    try:
        from normspec.report import git_state as state
    except ImportError:
        return {"commit": os.environ.get("NORMSPEC_GIT_COMMIT")}
    return state()


def gpu_name() -> str | None:
    """The first GPU's name by ``nvidia-smi`` (``None`` where it cannot tell)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("harness", type=Path, help="a bench/micro/*.cu that takes a label")
    p.add_argument("--build", action="append", default=None, metavar="FLAGS",
                   help="extra nvcc flags of one variant, as --build=-DNAME=1 (repeatable; "
                        "default: one build without extra flags)")
    p.add_argument("--env", action="append", default=None, metavar="'NAME=VALUE ...'",
                   help="run-time variables of one setting (repeatable; default: none)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--launch-units", action=argparse.BooleanOptionalAction, default=None,
                   help="link the launcher's units, backends/csrc/normspec_launch.cu and "
                        "launch_units/*.cu (default: where the harness "
                        "includes normspec_launch.h and not normspec_launch_impl.cuh)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    p.add_argument("--out", type=Path, help="write the rows and medians as JSON here")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    if not args.harness.is_file():
        p.error(f"harness: no such file {str(args.harness)!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    builds = args.build if args.build is not None else [""]
    try:
        vs = variants(builds, args.env if args.env is not None else [""])
        launch_units = launch_units_for(args.harness, args.launch_units)
    except ValueError as exc:
        p.error(str(exc))
    rows: list[dict] = []
    stopped = None
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        with tempfile.TemporaryDirectory(prefix="normspec_ab_") as tmp:
            binaries = build_all(args.harness, list(dict.fromkeys(builds)),
                                 launch_units, Path(tmp), console)
            run_rounds(binaries, vs, args.rounds, args.timeout, console, rows)
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as exc:
        console.print(f"[red]ab: {exc}")
        return 2
    except (Stopped, KeyboardInterrupt) as exc:
        stopped = str(exc) or "interrupted"
        if not rows:
            console.print(f"[red]ab: {stopped} before any run ended")
            return 3
        console.print(f"[yellow]ab: {stopped}; reporting the {len(rows)} line(s) of the runs "
                      "that ended")
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary, differ = summarize(rows, vs)
    names = {v.name: describe(v) for v in vs}
    done = "" if stopped is None else " (stopped early: rounds incomplete)"
    table = Table(title=f"{args.harness.name}: median of {args.rounds} round(s), us{done}")
    for col in ("case", "variant", "times"):
        table.add_column(col)
    for s in summary:
        times = "  ".join(f"{k} {x:.2f}" for k, x in s["median_us"].items())
        table.add_row(s["case"], names[s["variant"]], times)
    Console().print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": "python3 bench/micro/ab.py " + " ".join(
                shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "git": git_state(), "device": gpu_name(),
            "harness": str(args.harness), "rounds": args.rounds, "stopped": stopped,
            "variants": [{"name": v.name, "build": v.build, "env": v.env} for v in vs],
            "hashes_differ": differ, "medians": summary, "rows": rows}, indent=1) + "\n")
    if differ:
        Console(stderr=True).print(f"[red]output hashes differ across variants: {differ}")
        return 1
    return 0 if stopped is None else 3


if __name__ == "__main__":
    sys.exit(main())
