"""Each gate can fail: deliberately wrong backends, one per gate and per transform."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from normspec.harness import check
from normspec.profiles import Profile
from normspec.registry import Backend, OpSupport
from normspec.transforms import TRANSFORMS

N, H = 12, 64


@dataclass(frozen=True)
class TinyProfile(Profile):
    """One small fp32 shape, one seed: fast and predictable for the wrong backends."""

    def shapes(self, op, quick=False):
        return ((N, H),)

    def seeds(self, quick=False, count=None):
        return (0,)


PROFILE = TinyProfile("tiny_fp32", "cpu", torch.float32)


class _Nudge(torch.autograd.Function):
    """Move every element one ulp up (forward) and its gradient one ulp up (backward)."""

    @staticmethod
    def forward(ctx, t):
        return t.nextafter(torch.full_like(t, float("inf")))

    @staticmethod
    def backward(ctx, g):
        return g.nextafter(torch.full_like(g, float("inf")))


class Wrong(Backend):
    """The reference, made wrong in one declared way."""

    ops = {"rms_norm": OpSupport(backward="full", devices=("cpu",))}

    def __init__(self, name, when=None, scale=1.0, dweight=None, crash=False):
        self.name, self.source = name, f"deliberately wrong: {name}"
        self.when, self.scale, self.dweight_fn, self.crash = when, scale, dweight, crash
        self.seen = set()

    def forward(self, op, rows, weight, *, eps, **params):
        from normspec.backends.reference import backend as ref

        if self.crash:
            raise RuntimeError("kernel launch failed")
        x = rows["x"]
        nudge = self.when is not None and self.when(x, self)
        if nudge:
            x = _Nudge.apply(x)
        (y,) = ref.forward(op, {"x": x}, weight, eps=eps, **params)
        if nudge:
            y = _Nudge.apply(y)
        return (y * self.scale,)


WHEN = {
    "batch": lambda x, b: x.shape[0] == 1,
    "chunk": lambda x, b: x.shape[0] == 3,
    "pad_rows": lambda x, b: x.shape[0] == N + 5,
    "pad_sequence": lambda x, b: x.dim() == 3,
    "permute": lambda x, b: x.shape[0] == N and bool(x[0, 0] != b.first),
    "prefix_slice": lambda x, b: x.shape[0] == (N + 1) // 2,
    "inner_slice": lambda x, b: x.storage_offset() >= H,
    "misaligned": lambda x, b: x.data_ptr() % 8 != 0,
    "strided": lambda x, b: x.stride(0) != x.shape[-1],
    "column_major": lambda x, b: x.stride(-1) != 1,
    "repeat": lambda x, b: _seen_before(x, b),
}


def _seen_before(x, backend):
    """True from the second call on the very same tensor (a stateful, drifting kernel)."""
    key = (x.data_ptr(), tuple(x.shape), x.stride(), x.requires_grad)
    seen = key in backend.seen
    backend.seen.add(key)
    return seen


def test_every_transform_has_a_wrong_backend():
    assert set(WHEN) == {t.name for t in TRANSFORMS}


@pytest.mark.parametrize("transform", sorted(WHEN))
def test_invariance_gate_fails_for_each_transform(transform):
    backend = Wrong(f"wrong-{transform}", when=WHEN[transform])
    backend.first = _first_value()
    result = check(backend, "rms_norm", PROFILE)
    fwd = result["contract_gates"]["forward"]
    assert any(f"transform={transform} " in line for line in fwd["failed_lines"]), fwd
    assert result["level"]["forward"] == "accurate"
    grad = result["contract_gates"]["gradient"]
    assert any(f"transform={transform} " in line and "tensor=dx" in line
               for line in grad["failed_lines"])


def _first_value():
    from normspec.ops import OPS

    s = OPS["rms_norm"].make_sample((N, H), torch.float32, params={"offset": 0.0}, seed=0)
    return s.rows["x"][0, 0]


def test_forward_tolerance_gate_fails():
    result = check(Wrong("scaled", scale=1.01), "rms_norm", PROFILE)
    assert result["level"]["forward"] == "fails"
    assert any(line.startswith("forward case=") and "passed=False" in line
               for line in result["contract_gates"]["forward"]["failed_lines"])


def test_exactness_is_checked_bit_for_bit():
    result = check(Wrong("one-ulp", when=lambda x, b: True), "rms_norm", PROFILE)
    fwd = result["contract_gates"]["forward"]
    assert result["level"]["forward"] == "invariant"   # within tolerance, invariant, not exact
    assert fwd["mismatch_lines"] and not fwd["failed_lines"]


def test_a_signed_zero_is_not_bitwise_equal():
    from normspec.gates import compare
    from normspec.harness import GateResult

    ref = torch.tensor([[-0.0, 1.5], [0.0, -2.0]], dtype=torch.bfloat16)
    got = ref + 0.0  # -0.0 + 0.0 is +0.0; every other element keeps its bits
    c = compare("y", got, ref, "forward")
    assert (c.bitwise, c.within_tolerance, c.max_ulp, c.max_abs) == (False, True, 0, 0.0)
    assert (c.equal_fraction, c.signed_zeros) == (0.75, 1)
    gate = GateResult()
    gate.record(c, "rms_norm[offset=1.0]/bfloat16/2x2/w=fp32/seed=0", "forward")
    assert gate.level == "invariant"  # within tolerance, but not the spec's bits
    assert "max_ulp=0 max_abs=0.00000000e+00 signed_zeros=1 equal=75.00% passed=True" in \
        gate.mismatch_lines[0]
    assert gate.stats["y"]["signed_zeros"] == 1
    same = compare("y", ref.clone(), ref, "forward")
    assert same.bitwise and same.signed_zeros == 0 and same.equal_fraction == 1.0


def test_an_invariance_break_in_a_zeros_sign_alone_is_named():
    class ZeroSign(Wrong):
        """Its first column is +0.0, but -0.0 when the batch is one row: 0 ulp, 0 apart."""

        def forward(self, op, rows, weight, *, eps, **params):
            (y,) = super().forward(op, rows, weight, eps=eps, **params)
            zero = -0.0 if rows["x"].shape[0] == 1 else 0.0
            return (torch.cat([torch.full_like(y[:, :1], zero), y[:, 1:]], dim=1),)

    result = check(ZeroSign("zero-sign"), "rms_norm", PROFILE)
    fwd = result["contract_gates"]["forward"]
    assert result["level"]["forward"] != "exact"
    batch = [line for line in fwd["failed_lines"] if "transform=batch " in line]
    assert batch and all(re.search(r"max_ulp=0 max_abs=0\.00000000e\+00 signed_zeros=12 "
                                   r"passed=False$", line) for line in batch)  # N rows


def test_gradient_tolerance_gate_fails():
    class BadGrad(Wrong):
        def forward(self, op, rows, weight, *, eps, **params):
            (y,) = super().forward(op, rows, weight, eps=eps, **params)
            x = rows["x"]
            return (y + 0.5 * (x - x.detach()),)   # same values, gradient off by 0.5·dy

    result = check(BadGrad("bad-grad"), "rms_norm", PROFILE)
    assert result["level"] == {"forward": "exact", "gradient": "fails"}
    assert any("tensor=dx" in line for line in result["contract_gates"]["gradient"][
        "failed_lines"])


def test_dweight_singleton_aggregation_gate_fails():
    class Seq(Wrong):
        def forward(self, op, rows, weight, *, eps, **params):
            from normspec import spec
            from normspec.spec.rms_norm import normalize_rows

            x = rows["x"]
            w = weight.detach()
            with torch.no_grad():
                y = spec.rms_norm(x, w, eps=eps, **params)

            class F(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x_, w_):
                    return y.clone()

                @staticmethod
                def backward(ctx, dy):
                    dx, _ = spec.rms_norm_backward(dy, x, w, eps=eps, **params)
                    xhat, _ = normalize_rows(x.float(), eps)
                    # a sequential sum over rows instead of the declared row tree
                    dw = torch.zeros(x.shape[-1])
                    for row in dy.float() * xhat:
                        dw = dw + row
                    return dx, dw.to(w.dtype)

            return (F.apply(x, weight),)

    result = check(Seq("sequential-dweight"), "rms_norm", PROFILE)
    lines = result["contract_gates"]["gradient"]["failed_lines"]
    assert any("transform=singleton_aggregation" in line for line in lines), lines


def test_crash_is_reported_not_hidden():
    result = check(Wrong("crashes", crash=True), "rms_norm", PROFILE)
    assert result["level"]["forward"] == "fails"
    assert any("crash" in line and "kernel launch failed" in line
               for line in result["contract_gates"]["forward"]["failed_lines"])


def test_reference_is_exact_on_the_tiny_profile():
    from normspec.backends.reference import backend

    for op in ("rms_norm", "fused_add_rms_norm", "rms_norm_gated"):
        result = check(backend, op, PROFILE)
        assert result["level"] == {"forward": "exact", "gradient": "exact"}, op


def test_x_only_backward_is_judged_on_row_gradients_alone():
    from normspec.backends.reference import backend as ref

    class XOnly(Backend):
        name, source = "x-only", "reference with backward declared x-only"
        ops = {"rms_norm": OpSupport(backward="x-only", devices=("cpu",))}

        def forward(self, op, rows, weight, *, eps, **params):
            # the weight's gradient is cut: only dx is promised
            return ref.forward(op, rows, weight.detach(), eps=eps, **params)

    result = check(XOnly(), "rms_norm", PROFILE)
    assert result["backward"] == "x-only"
    assert result["level"] == {"forward": "exact", "gradient": "exact"}
    assert set(result["contract_gates"]["gradient"]["statistics"]) == {"dx"}


def test_no_backward_gives_gradient_level_none():
    from normspec.backends.reference import backend as ref

    class ForwardOnly(Backend):
        name, source = "forward-only", "reference with no backward"
        ops = {"rms_norm": OpSupport(backward="none", devices=("cpu",))}

        def forward(self, op, rows, weight, *, eps, **params):
            with torch.no_grad():
                return ref.forward(op, rows, weight, eps=eps, **params)

    result = check(ForwardOnly(), "rms_norm", PROFILE)
    assert result["level"] == {"forward": "exact", "gradient": "none"}


def test_a_failing_gate_carries_a_runnable_repro(monkeypatch):
    from normspec import registry

    backend = Wrong("scaled-repro", scale=1.01)
    registry.register(backend)
    try:
        result = check(backend, "rms_norm", PROFILE)
        repro = result["contract_gates"]["forward"]["repro"]
        # the snippet rebuilds the failing case, runs both sides and fails their comparison
        with pytest.raises(AssertionError, match="outside the tolerance"):
            exec(repro, {"__name__": "repro"})
        assert result["contract_gates"]["forward"]["failed_lines"]
    finally:
        registry.unregister("scaled-repro")
    ok = check(Wrong("fine"), "rms_norm", PROFILE)
    assert ok["contract_gates"]["forward"]["repro"] is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_equal_fraction_is_exactly_one_when_all_equal(device):
    """The fraction is a count over numel, so an all-equal tensor reads 1.0 exactly.

    (A CUDA mean multiplies by 1/numel; before the count, all-equal CUDA tensors
    could read 0.9999999999999999 in the committed reports.)
    """
    from normspec.gates import compare

    for n in (3, 7, 48, 1000, 12345, 24 * 2048):
        t = torch.linspace(-1, 1, n, device=device)
        assert compare("y", t.clone(), t, "forward").equal_fraction == 1.0
    t = torch.zeros(10, device=device)
    got = t.clone()
    got[:3] = 1.0
    assert compare("y", got, t, "forward").equal_fraction == 0.7


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_identical_answers_what_compare_calls_bitwise(device):
    """The invariance gates ask ``identical`` first and compare in full only where it says
    no: both must agree on signed zeros, NaN payloads, infinities, shapes and dtypes."""
    from normspec.gates import compare, identical

    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    base = torch.tensor([0.0, 1.5, float("inf"), float("nan"), -2.0]).to(device)
    pairs = [
        (base.clone(), base),
        (torch.tensor([-0.0, 1.5, float("inf"), float("nan"), -2.0]).to(device), base),
        (torch.cat([base[:3], nan2.to(device), base[4:]]), base),  # another NaN payload
        (torch.tensor([0.0, 1.5, float("-inf"), float("nan"), -2.0]).to(device), base),
        (base.nextafter(torch.full_like(base, 9.0)), base),
        (base[:4], base),
        (base.double(), base.double().float().double()),
        (base.to(torch.bfloat16), base),
        (base[:0], base[:0]),
    ]
    answers = [identical(got, ref) for got, ref in pairs]
    assert answers == [True, False, True, False, False, False, True, False, True]
    for (got, ref), same in zip(pairs, answers, strict=True):
        if got.dtype == ref.dtype and got.dtype != torch.float64:
            assert compare("y", got, ref, "forward").bitwise == same


def test_compare_statistics_of_a_known_pair():
    """Every statistic the one sync reads: counts, ulps, differences, the tolerance."""
    from normspec.gates import compare

    ref = torch.tensor([1.0, -0.0, 2.0, float("inf"), float("nan"), 4.0])
    got = torch.tensor([1.0, 0.0, 2.0, float("inf"), float("nan"), 4.0]).clone()
    got[5] = torch.tensor(4.0).nextafter(torch.tensor(5.0))
    c = compare("y", got, ref, "forward")
    assert (c.bitwise, c.equal_fraction, c.max_ulp, c.signed_zeros) == (False, 4 / 6, 1, 1)
    assert c.max_abs == 2.0 ** -21 and c.max_rel == 2.0 ** -23 and c.within_tolerance
    far = ref.clone()
    far[0] = 1.5
    c = compare("y", far, ref, "forward")
    assert not c.within_tolerance and c.max_abs == 0.5 and c.max_ulp == 2 ** 22
