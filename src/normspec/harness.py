"""The conformance harness: hold one backend's op to the spec on one profile.

For every case (variant × shape × weight dtype × seed) the harness runs

* the **forward gate**: the backend's outputs against the spec's (bits,
  ulps, tolerance) and against itself under every invariance transform;
* the **gradient gate** (when the backend has a backward): row gradients
  and ``dweight`` from torch autograd against the spec's declared backward,
  the row gradients under every transform, and ``dweight`` by singleton
  aggregation (the batch's ``dweight`` against the spec's row tree over the
  singletons' ``dweight``; fp32 weights only, since rounding each
  singleton's ``dweight`` to a narrower weight dtype loses the bits the
  aggregate needs).

Every failing comparison becomes one line in ``failed_lines``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from normspec.spec.arithmetic import tree_sum

from .gates import Comparison, compare, identical, level_of
from .limits import interrupt_after
from .ops import OpDef, Sample, get_op, variant_name
from .profiles import Profile
from .registry import Backend
from .repro import repro_snippet
from .transforms import TRANSFORMS, RowFunction

__all__ = ["BackendOutputError", "Case", "GateResult", "check", "check_outputs", "iter_cases"]

MAX_LINES = 200


@dataclass(frozen=True)
class Case:
    """One input configuration of a check."""

    params: dict[str, Any]
    shape: tuple[int, int]
    weight_dtype: str
    seed: int

    def label(self, profile: Profile) -> str:
        return (f"[{variant_name(self.params)}]/{profile.dtype_name}/"
                f"{self.shape[0]}x{self.shape[1]}/w={self.weight_dtype}/seed={self.seed}")


@dataclass
class GateResult:
    """Outcome of the forward or the gradient gate over every case."""

    crashed: bool = False
    within: bool = True
    bitwise: bool = True
    invariant: bool = True
    failed_lines: list[str] = field(default_factory=list)
    mismatch_lines: list[str] = field(default_factory=list)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    ran: int = 0
    #: The repro snippet of the case being checked, for a failing transform (or ``None``).
    repro_for: Callable[[str | None], str] | None = field(default=None, repr=False)
    #: The repro snippet of the first failure of this gate.
    repro: str | None = None

    @property
    def level(self) -> str:
        if self.ran == 0 and not self.crashed:
            return "none"
        return level_of(crashed=self.crashed, within=self.within, bitwise=self.bitwise,
                        invariant=self.invariant)

    @property
    def passed(self) -> bool:
        return self.level in ("exact", "invariant")

    def fail(self, line: str, transform: str | None = None) -> None:
        if self.repro is None and self.repro_for is not None:
            self.repro = self.repro_for(transform)
        if len(self.failed_lines) < MAX_LINES:
            self.failed_lines.append(line)

    def record(self, c: Comparison, label: str, stage: str) -> None:
        self.ran += 1
        s = self.stats.setdefault(c.tensor, {"min_equal_fraction": 1.0, "max_ulp": 0,
                                             "max_abs": 0.0, "max_rel": 0.0,
                                             "signed_zeros": 0})
        s["min_equal_fraction"] = min(s["min_equal_fraction"], c.equal_fraction)
        s["max_ulp"] = max(s["max_ulp"], c.max_ulp)
        s["max_abs"] = max(s["max_abs"], c.max_abs)
        s["max_rel"] = max(s["max_rel"], c.max_rel)
        s["signed_zeros"] += c.signed_zeros
        line = (f"{stage} case={label} tensor={c.tensor} vs=spec {_differences(c)} "
                f"equal={100 * c.equal_fraction:.2f}% passed={c.within_tolerance}")
        if not c.bitwise:
            self.bitwise = False
            if len(self.mismatch_lines) < MAX_LINES:
                self.mismatch_lines.append(line)
        if not c.within_tolerance:
            self.within = False
            self.fail(line)

    def crash(self, label: str, stage: str, exc: BaseException,
              transform: str | None = None) -> None:
        self.crashed = True
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        self.fail(f"crash case={label} stage={stage} error={last}", transform)

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "level": self.level, "failed_lines": self.failed_lines,
                "mismatch_lines": self.mismatch_lines, "statistics": self.stats,
                "comparisons": self.ran, "repro": self.repro}


def _differences(c: Comparison) -> str:
    """A line's measure of how far apart: ulps, the largest absolute difference, and the
    elements that differ only in a zero's sign (where the other two read 0)."""
    zeros = f" signed_zeros={c.signed_zeros}" if c.signed_zeros else ""
    return f"max_ulp={c.max_ulp} max_abs={c.max_abs:.8e}{zeros}"


def iter_cases(
    op: OpDef, profile: Profile, *, quick: bool = False, seeds: int | None = None
) -> Iterator[Case]:
    """Every case of ``op`` on ``profile``."""
    for params in op.variants:
        for shape in profile.shapes(op.name, quick):
            for wdt in profile.weight_dtypes():
                for seed in profile.seeds(quick, seeds):
                    yield Case(dict(params), shape, wdt, seed)


class BackendOutputError(ValueError):
    """A backend returned the wrong number of outputs, or one of the wrong kind, shape,
    dtype or device, or wrote to its inputs."""


def check_outputs(backend_name: str, op: OpDef, out: object, x: torch.Tensor) -> list:
    """``out`` as a list, or ``BackendOutputError`` naming the backend, the op, the output
    and what was expected: a tuple of ``len(op.outputs)`` tensors of ``x``'s shape, dtype
    and device (a 1-tuple for one output)."""
    where = f"backend {backend_name!r}, op {op.name}"
    if not isinstance(out, tuple | list):
        raise BackendOutputError(f"{where}: expected a tuple of {len(op.outputs)} tensor(s) "
                                 f"{op.outputs}, got {type(out).__name__}")
    if len(out) != len(op.outputs):
        raise BackendOutputError(f"{where}: expected {len(op.outputs)} output(s) "
                                 f"{op.outputs}, got {len(out)}")
    for name, t in zip(op.outputs, out, strict=True):
        if not isinstance(t, torch.Tensor):
            raise BackendOutputError(f"{where}: output {name}: expected a tensor, "
                                     f"got {type(t).__name__}")
        for what, got, want in (("shape", tuple(t.shape), tuple(x.shape)),
                                ("dtype", t.dtype, x.dtype), ("device", t.device, x.device)):
            if got != want:
                raise BackendOutputError(f"{where}: output {name}: expected {what} {want} "
                                         f"(the input x's), got {got}")
    return list(out)


def _unchanged(backend_name: str, op: OpDef, before: dict[str, torch.Tensor],
               after: dict[str, torch.Tensor]) -> None:
    for name, copy in before.items():
        if not identical(after[name], copy):
            raise BackendOutputError(f"backend {backend_name!r}, op {op.name}: input {name} "
                                     "was modified (a backend must not write to its inputs)")


def _sample(op: OpDef, profile: Profile, case: Case) -> Sample:
    wdtype = torch.float32 if case.weight_dtype == "fp32" else profile.dtype
    return op.make_sample(case.shape, profile.dtype, params=case.params, seed=case.seed,
                          weight_dtype=wdtype, device=profile.device)


def _forward_fn(backend: Backend, op: OpDef, sample: Sample) -> RowFunction:
    def f(rows: list[torch.Tensor]) -> list[torch.Tensor]:
        inputs = {**dict(zip(op.row_inputs, rows, strict=True)), "weight": sample.weight}
        before = {name: t.clone() for name, t in inputs.items()}
        with torch.no_grad():
            out = backend.forward(op.name, dict(zip(op.row_inputs, rows, strict=True)),
                                  sample.weight, eps=sample.eps, **sample.params)
        out = check_outputs(backend.name, op, out, rows[0])
        _unchanged(backend.name, op, before, inputs)
        return [o.detach() for o in out]
    return f


def _grad_fn(
    backend: Backend, op: OpDef, sample: Sample, with_weight: bool
) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """[*rows, *grad_outputs] -> [*row_grads, (dweight)] through torch autograd."""
    k = len(op.row_inputs)

    def g(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        # detach() keeps the views (strides, storage offsets) the transform made
        rows = [t.detach().requires_grad_() for t in inputs[:k]]
        weight = sample.weight.detach().clone().requires_grad_(with_weight)
        outs = backend.forward(op.name, dict(zip(op.row_inputs, rows, strict=True)), weight,
                               eps=sample.eps, **sample.params)
        outs = check_outputs(backend.name, op, outs, rows[0])
        wrt = [*rows, weight] if with_weight else rows
        grads = torch.autograd.grad(outs, wrt, inputs[k:], allow_unused=True)
        return [torch.zeros_like(w) if gr is None else gr for gr, w in zip(grads, wrt,
                                                                          strict=True)]
    return g


def _invariance(
    gate: GateResult, fn: RowFunction, inputs: list[torch.Tensor], reference: list[torch.Tensor],
    names: tuple[str, ...], label: str, backend_name: str,
) -> None:
    for t in TRANSFORMS:
        try:
            idx, outs = t.apply(fn, inputs, torch.Generator().manual_seed(17))
        except (Exception, SystemExit) as exc:
            gate.crash(label, f"invariance/{t.name}", exc, t.name)
            continue
        for name, ref, out in zip(names, reference, outs, strict=True):
            want = ref[idx]
            if identical(out, want):  # the usual answer, without the statistics
                continue
            c = compare(name, out, want, "forward" if name in ("y", "residual_out")
                        else "gradient")
            if not c.bitwise:
                gate.invariant = False
                gate.fail(f"invariance pair=('{backend_name}/full', '{backend_name}/{t.name}') "
                          f"tensor={name} transform={t.name} case={label} "
                          f"{_differences(c)} passed=False", t.name)


def _check_case(backend: Backend, op: OpDef, profile: Profile, case: Case, fwd: GateResult,
                grad: GateResult, backward: str) -> None:
    label = op.name + case.label(profile)
    with_weight = backward == "full"
    fwd.repro_for = lambda t: repro_snippet(backend.name, op, profile, case, "forward", t)
    grad.repro_for = lambda t: repro_snippet(backend.name, op, profile, case, "gradient", t,
                                             with_weight)
    sample = _sample(op, profile, case)
    rows = sample.row_list(op)
    f = _forward_fn(backend, op, sample)
    try:
        full = f(rows)
    except (Exception, SystemExit) as exc:
        fwd.crash(label, "forward", exc)
        return
    for name, got, ref in zip(op.outputs, full, op.spec_forward(sample), strict=True):
        fwd.record(compare(name, got, ref, "forward"), label, "forward")
    _invariance(fwd, f, rows, full, op.outputs, label, backend.name)
    if backward == "none":
        return
    gen = torch.Generator().manual_seed(case.seed + 1000)
    douts = [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) for o in full]
    g = _grad_fn(backend, op, sample, with_weight)
    try:
        got = g(rows + douts)
    except (Exception, SystemExit) as exc:
        grad.crash(label, "backward", exc)
        return
    want = op.spec_backward(sample, douts)
    names = (*op.row_grads, "dweight") if with_weight else op.row_grads
    floor = max(d.double().square().mean().sqrt().item() for d in douts) if douts[0].numel() \
        else 0.0
    for name, a, b in zip(names, got, want, strict=False):
        grad.record(compare(name, a, b, "gradient", scale_floor=floor), label, "gradient")
    k = len(op.row_inputs)

    def row_grads(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return g(inputs)[:k]

    _invariance(grad, row_grads, rows + douts, got[:k], op.row_grads, label, backend.name)
    if with_weight and case.weight_dtype == "fp32":
        singles = [g([t[i : i + 1] for t in rows + douts])[-1] for i in range(case.shape[0])]
        agg = tree_sum(torch.stack(singles), dim=0)
        c = compare("dweight", got[-1], agg, "gradient")
        if not c.bitwise:
            grad.invariant = False
            grad.fail(f"invariance pair=('{backend.name}/batch', 'spec/row_tree(singletons)') "
                      f"tensor=dweight transform=singleton_aggregation case={label} "
                      f"{_differences(c)} passed=False", "singleton_aggregation")


#: Seconds one case (forward, transforms, backward) may take before the backend's case is
#: a crash; enforced where the check runs in the main thread (the CLI and its workers).
CASE_LIMIT_S = 600.0


def check(
    backend: Backend,
    op_name: str,
    profile: Profile,
    *,
    quick: bool = False,
    seeds: int | None = None,
    on_case: Callable[[Case], None] | None = None,
) -> dict[str, Any]:
    """Run every gate for ``backend``'s ``op_name`` on ``profile``.

    Returns the backend's entry of a report's ``results`` (see
    [`normspec.report`][normspec.report]).
    """
    op = get_op(op_name)
    support = backend.ops.get(op_name)
    entry: dict[str, Any] = {"source": backend.source,
                             "backward": support.backward if support else "none"}
    if support is None:
        return {**entry, "level": {"forward": "unavailable", "gradient": "unavailable"},
                "unavailable": f"op {op_name!r} not implemented"}
    reason = backend.available()
    if reason:
        return {**entry, "level": {"forward": "unavailable", "gradient": "unavailable"},
                "unavailable": reason}
    fwd, grad = GateResult(), GateResult()
    skipped: dict[str, str] = {}
    for case in iter_cases(op, profile, quick=quick, seeds=seeds):
        why = backend.supports(op_name, case.params, profile.device)
        if why is None and case.weight_dtype not in support.weight_dtypes:
            why = f"weight dtype {case.weight_dtype} not supported"
        if why:
            skipped[variant_name(case.params)] = why
        else:
            try:
                with interrupt_after(CASE_LIMIT_S) as timed_out:
                    _check_case(backend, op, profile, case, fwd, grad, support.backward)
            # whatever a backend did, sys.exit() included, the others still run
            except (Exception, SystemExit) as exc:
                fwd.crash(op.name + case.label(profile), "harness", exc)
            except KeyboardInterrupt:
                if not timed_out():
                    raise  # the user's Ctrl-C
                fwd.crash(op.name + case.label(profile), "harness", TimeoutError(
                    f"the case did not finish within {CASE_LIMIT_S:g} s"))
        if on_case:
            on_case(case)
    if fwd.ran == 0 and not fwd.crashed:
        return {**entry, "level": {"forward": "unavailable", "gradient": "unavailable"},
                "unavailable": "; ".join(sorted(set(skipped.values()))) or "no case ran",
                "skipped_variants": skipped}
    return {
        **entry,
        "level": {"forward": fwd.level, "gradient": grad.level},
        "contract_gates": {"forward": fwd.as_dict(), "gradient": grad.as_dict()},
        "skipped_variants": skipped,
    }
