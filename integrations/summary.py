"""The train = rollout report in short: the site table and the logprob figures."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .sites import SITE_KINDS

__all__ = ["PHASES", "logprob_rows", "site_rows"]

#: Report sections with a site table, in order, and how they are titled.
PHASES = {"unpatched": "unpatched", "patched": "patched", "after_sync": "after train + sync",
          "fresh_load": "trained, fresh engine"}


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f} %"


def _worst(phase: Mapping[str, Any], kind: str, key: str) -> float | None:
    values = [table[kind][key] for table in phase["sites"].values()
              if kind in table and key in table[kind]]
    return min(values) if values else None


def site_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """One row per site kind: the bitwise-equal fraction in each phase, both directions' worst.

    A kind with a residual output gets a second row for the new residual.
    """
    phases = [name for name in PHASES if name in report]
    rows = []
    for kind in SITE_KINDS:
        for key, label in (("equal", kind), ("residual_equal", f"{kind} (residual)")):
            cells = [_worst(report[name], kind, key) for name in phases]
            if any(c is not None for c in cells):
                rows.append([label, *(_percent(c) for c in cells)])
    return rows


def logprob_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """One row per phase: max and mean |Δ logprob| and the tokens with Δ = 0."""
    rows = []
    for name, title in PHASES.items():
        if name in report:
            d = report[name]["logprobs"]
            rows.append([title, f"{d['max_abs']:.3g}", f"{d['mean_abs']:.3g}",
                         _percent(d["zero_fraction"])])
    return rows
