"""Provider divergence matrix: every backend against every other on the same inputs.

[`divergence_matrix`][normspec.divergence.divergence_matrix] runs each available backend that
supports an operator (and the requested parameters) on identical inputs —
every shape of the profile, every weight dtype, several seeds — and builds,
for each output tensor, the pairwise matrix of

* **% bitwise equal**: elements with the same bit pattern, over all cases
  ([`same_bits`][normspec.spec.arithmetic.same_bits]: a NaN equals any NaN,
  ``-0.0`` does not equal ``+0.0``);
* **differing seeds**: how many seeds had at least one differing element;
* **max |diff|**: over finite pairs (a NaN or ±inf against a number counts as
  ``inf``);
* **max ulp**: [`ulp_distance`][normspec.spec.arithmetic.ulp_distance] in the
  input dtype.

Parameters a library chooses for itself (``residual_sum`` of the fused add,
``convention`` of the gated norm) are *not* fixed by default: every backend
runs under each value it supports, so the spec appears once per convention
(``reference[residual_sum=fp32]``, ``reference[residual_sum=rounded]``) and
the matrix shows which convention each library follows. Parameters that
change the function itself are fixed by default to the Qwen3-Next choice
([`SEMANTIC_DEFAULTS`][normspec.divergence.SEMANTIC_DEFAULTS]) and can be set
with ``params``.

The result is a JSON-ready dictionary; [`write_heatmap`][normspec.divergence.write_heatmap]
draws the % bitwise-equal matrix as a PNG (matplotlib, imported lazily).
The command line is ``normspec compare --op O --profile P``.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from normspec.spec.arithmetic import same_bits, ulp_distance

from . import registry
from .ops import OpDef, get_op, variant_name
from .profiles import Profile, get_profile
from .report import environment

__all__ = [
    "KIND",
    "SEMANTIC_DEFAULTS",
    "PairStats",
    "accumulate_pair",
    "divergence_matrix",
    "format_matrix",
    "parse_params",
    "write_heatmap",
]

KIND = "normspec.divergence"
SCHEMA_VERSION = 1

#: Parameters that define *which function* is computed, fixed unless overridden:
#: the Qwen3-Next choices (zero-centred ``1 + w`` norms, SiLU gate).
SEMANTIC_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "rms_norm": {"offset": 1.0},
    "fused_add_rms_norm": {"offset": 1.0},
    "rms_norm_gated": {"activation": "silu"},
}


@dataclass
class _Participant:
    label: str
    backend: registry.Backend
    params: dict[str, Any]
    weight_dtypes: tuple[str, ...]
    outputs: list[list[torch.Tensor] | None] = field(default_factory=list)
    error: str | None = None


@dataclass
class PairStats:
    numel: int = 0
    equal: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0
    seeds: set[int] = field(default_factory=set)
    cases: int = 0
    cases_differ: int = 0
    mismatch: bool = False  # shapes or dtypes differ: not comparable


def _variants(op: OpDef, fixed: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The op's variants that agree with ``fixed`` (keys outside the op are an error)."""
    keys = {k for v in op.variants for k in v}
    unknown = sorted(set(fixed) - keys)
    if unknown:
        raise ValueError(f"params: {op.name} has no parameter {unknown[0]!r}; "
                         f"expected some of {sorted(keys)}")
    found = [dict(v) for v in op.variants if all(v.get(k) == val for k, val in fixed.items())]
    if not found:
        raise ValueError(f"params: no {op.name} variant has {variant_name(fixed)}; variants: "
                         f"{[variant_name(v) for v in op.variants]}")
    return found


def _participants(
    op: OpDef, profile: Profile, names: Sequence[str], variants: list[dict[str, Any]],
    fixed: Mapping[str, Any],
) -> tuple[list[_Participant], dict[str, str]]:
    parts: list[_Participant] = []
    skipped: dict[str, str] = {}
    free = [k for k in (variants[0] if variants else {}) if k not in fixed]
    for name in names:
        entry = registry.entries()[name]
        status = entry.status()
        if status is not None:
            skipped[name] = status
            continue
        backend = entry.load()
        assert backend is not None
        support = backend.ops.get(op.name)
        if support is None:
            skipped[name] = f"op {op.name!r} not implemented"
            continue
        wdts = tuple(w for w in profile.weight_dtypes() if w in support.weight_dtypes)
        if not wdts:
            skipped[name] = (f"weight dtypes {list(support.weight_dtypes)} none of "
                             f"{list(profile.weight_dtypes())}")
            continue
        mine, why = [], []
        for v in variants:
            reason = backend.supports(op.name, v, profile.device)
            (why if reason else mine).append(reason or v)
        if not mine:
            skipped[name] = "; ".join(sorted(set(why)))
            continue
        for v in mine:
            tag = variant_name({k: v[k] for k in free}) if len(mine) > 1 else ""
            parts.append(_Participant(f"{name}[{tag}]" if tag else name, backend, v, wdts))
    return parts, skipped


def accumulate_pair(st: PairStats, a: torch.Tensor, b: torch.Tensor, seed: int) -> None:
    a, b = a.detach().cpu(), b.detach().cpu()
    st.cases += 1
    if a.shape != b.shape or a.dtype != b.dtype:
        st.numel += b.numel()
        st.max_abs = math.inf
        st.mismatch = True
        st.seeds.add(seed)
        st.cases_differ += 1
        return
    n = b.numel()
    st.numel += n
    if n == 0:
        return
    d = ulp_distance(a, b)
    eq = int(same_bits(a, b).sum())  # -0.0 against +0.0 is not equal, though 0 ulp apart
    st.equal += eq
    st.max_ulp = max(st.max_ulp, int(d.max()))
    a64, b64 = a.double(), b.double()
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    same_inf = torch.isinf(a64) & (a64 == b64)
    diff = (a64 - b64).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    st.max_abs = max(st.max_abs, float(diff.max()))
    if eq != n:
        st.seeds.add(seed)
        st.cases_differ += 1


def divergence_matrix(
    op: str,
    profile: str | Profile,
    backends: Sequence[str] | None = None,
    seeds: int = 3,
    params: Mapping[str, Any] | None = None,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    quick: bool = False,
) -> dict[str, Any]:
    """Pairwise divergence of every available backend on ``op`` and ``profile``.

    Args:
        op: operator name (``rms_norm``, ``fused_add_rms_norm``, ``rms_norm_gated``).
        profile: a profile name (``cpu_bf16``, ``cuda_bf16``, ...) or object.
        backends: backend names to include (default: every installed one).
            Unavailable ones, and those that support none of the variants,
            are listed under ``skipped`` with the reason.
        seeds: number of seeds (``0 .. seeds-1``).
        params: variant parameters to fix; merged over
            [`SEMANTIC_DEFAULTS`][normspec.divergence.SEMANTIC_DEFAULTS]. Parameters
            left free give one participant per supported value.
        shapes: ``(rows, H)`` shapes (default: the profile's shapes for ``op``).
        quick: use the profile's quick shapes when ``shapes`` is not given.

    Returns:
        A JSON-ready dict: ``participants`` (label, backend, params, source,
        library version), ``skipped`` (name -> reason), ``failed`` (label ->
        error of a participant that crashed, left out of the matrices), and
        ``matrices``: for each output tensor, square lists indexed like
        ``labels`` holding ``equal_percent``, ``differing_seeds``,
        ``differing_cases``, ``max_abs`` and ``max_ulp``.
    """
    opdef = get_op(op)
    prof = get_profile(profile) if isinstance(profile, str) else profile
    if seeds < 1:
        raise ValueError(f"seeds: expected >= 1, got {seeds}")
    fixed = {**SEMANTIC_DEFAULTS.get(op, {}), **(params or {})}
    variants = _variants(opdef, fixed)
    known = registry.entries()
    names = list(backends) if backends else sorted(known)
    for name in names:
        if name not in known:
            registry.get_backend(name)  # raises, listing the installed names
    parts, skipped = _participants(opdef, prof, names, variants, fixed)
    shape_list = [tuple(s) for s in (shapes or prof.shapes(op, quick))]
    wdts = [w for w in prof.weight_dtypes() if any(w in p.weight_dtypes for p in parts)]

    cases = [(shape, wdt, seed) for shape in shape_list for wdt in wdts for seed in range(seeds)]
    for p in parts:
        for shape, wdt, seed in cases:
            if p.error or wdt not in p.weight_dtypes:
                p.outputs.append(None)
                continue
            sample = opdef.make_sample(
                shape, prof.dtype, params=p.params, seed=seed,
                weight_dtype=torch.float32 if wdt == "fp32" else prof.dtype,
                device=prof.device,
            )
            try:
                with torch.no_grad():
                    out = p.backend.forward(op, sample.rows, sample.weight, eps=sample.eps,
                                            **sample.params)
                p.outputs.append([o.detach().cpu() for o in out])
            except Exception as exc:
                last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                p.error = (f"case {shape[0]}x{shape[1]}/w={wdt}/seed={seed}: {last}")
                p.outputs.append(None)
    failed = {p.label: p.error for p in parts if p.error}
    parts = [p for p in parts if not p.error]
    labels = [p.label for p in parts]

    matrices: dict[str, dict[str, list[list[Any]]]] = {}
    n = len(parts)
    for t, tensor in enumerate(opdef.outputs):
        stats = [[PairStats() for _ in range(n)] for _ in range(n)]
        for i in range(n):
            for j in range(n):
                for c, (_shape, _wdt, seed) in enumerate(cases):
                    a, b = parts[i].outputs[c], parts[j].outputs[c]
                    if a is not None and b is not None:
                        accumulate_pair(stats[i][j], a[t], b[t], seed)
        matrices[tensor] = {
            "equal_percent": [[(100.0 * s.equal / s.numel if s.numel else None) for s in row]
                              for row in stats],
            "differing_seeds": [[len(s.seeds) for s in row] for row in stats],
            "differing_cases": [[s.cases_differ for s in row] for row in stats],
            "compared_cases": [[s.cases for s in row] for row in stats],
            "max_abs": [[(s.max_abs if math.isfinite(s.max_abs) else "inf") for s in row]
                        for row in stats],
            # -1: shapes or dtypes differ, so ulps are meaningless
            "max_ulp": [[-1 if s.mismatch else s.max_ulp for s in row] for row in stats],
        }
    versions = {p.backend.name: p.backend.library_version() for p in parts}
    return {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "op": op,
        "profile": prof.name,
        "params": {k: fixed[k] for k in fixed},
        "shapes": [list(s) for s in shape_list],
        "weight_dtypes": wdts,
        "seeds": list(range(seeds)),
        "environment": environment(prof.device, versions),
        "labels": labels,
        "participants": [
            {"label": p.label, "backend": p.backend.name, "params": p.params,
             "weight_dtypes": list(p.weight_dtypes), "source": p.backend.source,
             "library_version": p.backend.library_version()}
            for p in parts
        ],
        "skipped": skipped,
        "failed": failed,
        "matrices": matrices,
    }


def _pct(v: float | None) -> str:
    """A percentage that never shows 100 unless every element was equal."""
    if v is None:
        return "-"
    return "100" if v == 100.0 else f"{math.floor(v * 100) / 100:.2f}"


def format_matrix(result: Mapping[str, Any], tensor: str | None = None) -> str:
    """Plain-text matrices: % bitwise equal, then differing seeds / max ulp / max |diff|."""
    labels = result["labels"]
    lines: list[str] = []
    tensors = [tensor] if tensor else list(result["matrices"])
    width = max([len(lb) for lb in labels] + [8])
    short = [f"#{i}" for i in range(len(labels))]
    for t in tensors:
        m = result["matrices"][t]
        lines.append(f"{result['op']} {result['profile']} {variant_name(result['params'])} "
                     f"tensor={t}: % bitwise equal  [differing seeds / max ulp / max |diff|]")
        lines.append(" " * (width + 5) + "".join(f"{s:>10}" for s in short))
        for i, lb in enumerate(labels):
            cells = []
            for j in range(len(labels)):
                cells.append(f"{_pct(m['equal_percent'][i][j]):>10}")
            lines.append(f"#{i:<3} {lb:<{width}}" + "".join(cells))
        for i, lb in enumerate(labels):
            for j in range(i + 1, len(labels)):
                if m["differing_cases"][i][j]:
                    lines.append(
                        f"  {lb} vs {labels[j]}: {m['differing_seeds'][i][j]} seed(s) differ, "
                        f"max ulp {m['max_ulp'][i][j]}, max |diff| {m['max_abs'][i][j]}")
        lines.append("")
    if result.get("skipped"):
        lines.append("skipped: " + "; ".join(f"{k} ({v})" for k, v in result["skipped"].items()))
    if result.get("failed"):
        lines.append("failed: " + "; ".join(f"{k} ({v})" for k, v in result["failed"].items()))
    return "\n".join(lines)


def write_heatmap(result: Mapping[str, Any], path: str | Path) -> Path:
    """Draw the % bitwise-equal matrices (one panel per output tensor) to a PNG.

    The colour is the share of elements that *differ*, on a log scale from 0.00001 % to
    100 %, so that 99.999 % and 100 % equal look different; exactly equal cells get the
    lightest colour and the label "100". The caption names the run (device, date, the
    libraries' versions). The background is transparent and the text grey, for light and
    dark pages alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    ink = "#808080"
    labels = result["labels"]
    tensors = list(result["matrices"])
    n = max(len(labels), 1)
    size = 1.6 + 0.75 * n
    fig, axes = plt.subplots(1, len(tensors), figsize=(size * len(tensors) + 1.5, size + 1.6),
                             squeeze=False)
    floor = 1e-5
    norm = LogNorm(vmin=floor, vmax=100.0)
    image = None
    for k, (ax, t) in enumerate(zip(axes[0], tensors, strict=True)):
        data = [[float("nan") if v is None else v for v in row]
                for row in result["matrices"][t]["equal_percent"]]
        differ = [[max(100.0 - v, floor) if not math.isnan(v) else float("nan") for v in row]
                  for row in data]
        image = ax.imshow(differ or [[float("nan")]], norm=norm, cmap="viridis_r")
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8,
                      color=ink)
        ax.set_yticks(range(len(labels)), labels if k == 0 else [], fontsize=8, color=ink)
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    light = norm(max(100.0 - v, floor)) < 0.6  # viridis_r: light at the low end
                    ax.text(j, i, _pct(v), ha="center", va="center", fontsize=7,
                            color="black" if light else "white")
        ax.set_title(f"{t}", fontsize=9, color=ink)
    env = result.get("environment") or {}
    versions = ", ".join(f"{b} {v}" for b, v in sorted((env.get("backends") or {}).items())
                         if v and b in labels)
    run = ", ".join(str(x) for x in (env.get("device_name") or env.get("device"),
                                     str(env.get("date", ""))[:10]) if x)
    fig.suptitle(f"{result['op']} · {result['profile']} · {variant_name(result['params'])}: "
                 f"% of elements bitwise equal ({len(result['seeds'])} seeds, "
                 f"{len(result['shapes'])} shapes)\n{run}" + (f"; {versions}" if versions
                                                             else ""),
                 fontsize=9, color=ink)
    if image is not None:
        bar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
        bar.set_label("% of elements that differ (log scale)", color=ink)
        bar.ax.tick_params(colors=ink)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight", transparent=True)
    plt.close(fig)
    return path


def parse_params(items: Sequence[str] | None) -> dict[str, Any]:
    """``["offset=1", "residual_sum=fp32"]`` -> ``{"offset": 1.0, "residual_sum": "fp32"}``.

    Numbers become floats (every numeric variant parameter is a float).
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"params: expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            out[key.strip()] = value.strip()
    return out
