"""Conformance reports (JSON).

One report per (op, profile), written to ``reports/<profile>/<op>.json``::

    {
      "kind": "normspec.conformance",
      "schema_version": 1,
      "op": "rms_norm",
      "profile": "cuda_bf16",
      "quick": false,
      "command": "normspec conformance --device cuda",
      "environment": {...},         # device, capability, torch, CUDA, git commit/dirty, backends
      "checks": {...},              # what was run: variants, shapes, seeds, transforms
      "results": {
        "<backend>": {
          "source": "...", "backward": "full",
          "level": {"forward": "exact", "gradient": "exact"},
          "contract_gates": {
            "forward":  {"passed": true, "failed_lines": [], "level": "exact", "statistics": {...}},
            "gradient": {...}
          }
        }
      },
      "check_seconds": {"<backend>": 12.3}   # each check's wall time in its process
    }

The JSON schema is ``normspec/schemas/conformance_report.schema.json``
([`SCHEMA_PATH`][normspec.report.SCHEMA_PATH]); reports are validated against it when
written and when read ([`read_report`][normspec.report.read_report]).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .ops import get_op, variant_name
from .profiles import Profile
from .transforms import TRANSFORMS

__all__ = ["SCHEMA_PATH", "ReportError", "build_report", "environment", "git_state",
           "read_report", "validate_report", "write_report"]

KIND = "normspec.conformance"
SCHEMA_VERSION = 1
#: The conformance report's JSON schema (draft 2020-12), shipped with the package.
SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "conformance_report.schema.json"


class ReportError(ValueError):
    """A conformance report that does not follow the schema (the message names the file
    or the writer, the JSON path and what is wrong)."""


@functools.cache
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def validate_report(data: object, where: str = "report") -> dict[str, Any]:
    """``data`` if it is a valid conformance report, else ``ReportError`` naming ``where``
    and the first problem (schema errors first, then names normspec does not know)."""
    from .profiles import PROFILES

    error = next(iter(sorted(_validator().iter_errors(data), key=lambda e: e.json_path)),
                 None)
    if error is not None:
        raise ReportError(f"{where}: {error.json_path}: {error.message}")
    assert isinstance(data, dict)
    if data["profile"] not in PROFILES:
        raise ReportError(f"{where}: $.profile: unknown profile {data['profile']!r}; "
                          f"expected one of {sorted(PROFILES)}")
    return data


def read_report(path: Path) -> dict[str, Any]:
    """The conformance report in ``path``, validated; ``ReportError`` naming the file when
    it does not parse, does not follow the schema, or lies outside ``<profile>/<op>.json``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: not valid JSON: {exc}") from None
    validate_report(data, str(path))
    if (path.parent.name, path.stem) != (data["profile"], data["op"]):
        raise ReportError(f"{path}: misfiled: a report of {data['op']} on {data['profile']} "
                          f"belongs in {data['profile']}/{data['op']}.json")
    return data


def git_state(root: Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the checkout normspec runs from (``None`` outside git).

    A copy of the tree without ``.git`` (a lent GPU machine) can be told its
    commit through ``NORMSPEC_GIT_COMMIT`` (and ``NORMSPEC_GIT_DIRTY=1``).
    """
    if os.environ.get("NORMSPEC_GIT_COMMIT"):
        return {"commit": os.environ["NORMSPEC_GIT_COMMIT"],
                "dirty": os.environ.get("NORMSPEC_GIT_DIRTY", "0") == "1",
                "recorded": "from NORMSPEC_GIT_COMMIT"}
    root = root or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        # reports/ is this command's output, not an input: rewriting it is not "dirty"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no",
                                     "--", ".", ":(exclude)reports"],
                                    cwd=root, capture_output=True, text=True, check=True,
                                    timeout=10).stdout.strip())
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment(device: str, backends: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The environment a report was produced in."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "normspec": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "git": git_state(),
        "backends": backends or {},
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device_name"] = props.name
        env["capability"] = f"{props.major}.{props.minor}"
        env["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") \
            else None
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["capability"] = None
    return env


def build_report(
    op_name: str, profile: Profile, results: dict[str, Any], *, quick: bool,
    seeds: int | None, command: str, library_versions: dict[str, str | None],
    check_seconds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Assemble a report dictionary.

    ``check_seconds`` holds, for each backend that ran, the wall time of its
    check in the process that ran it (first-use compiles and autotuning
    included). It says what the checks cost, not how fast a backend is; a
    later ``normspec conformance --jobs N`` starts the longest checks first
    by it.
    """
    op = get_op(op_name)
    report = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "op": op_name,
        "profile": profile.name,
        "quick": quick,
        "command": command,
        "environment": environment(profile.device, library_versions),
        "checks": {
            "variants": [variant_name(v) for v in op.variants],
            "shapes": [list(s) for s in profile.shapes(op_name, quick)],
            "dtype": profile.dtype_name,
            "weight_dtypes": list(profile.weight_dtypes()),
            "seeds": list(profile.seeds(quick, seeds)),
            "transforms": [t.name for t in TRANSFORMS] + ["singleton_aggregation"],
        },
        "results": results,
    }
    if check_seconds is not None:
        report["check_seconds"] = {name: round(float(sec), 1)
                                   for name, sec in check_seconds.items()}
    return report


def write_report(report: dict[str, Any], directory: Path) -> Path:
    """Validate ``report`` and write it to ``directory/<profile>/<op>.json``; return the
    path."""
    validate_report(report, "report to write")
    path = Path(directory) / report["profile"] / f"{report['op']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    return path
