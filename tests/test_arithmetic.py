"""The declared arithmetic: tree sum, correctly rounded sqrt/div, the declared exp."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from normspec.spec import arithmetic as A


def _recursive_tree(m: torch.Tensor) -> torch.Tensor:
    """The normative definition, top-down: tree(v) = tree(left half) + tree(right half)."""
    if m.shape[1] == 1:
        return m[:, 0]
    half = m.shape[1] // 2
    return _recursive_tree(m[:, :half]) + _recursive_tree(m[:, half:])


def test_tree_sum_matches_recursive_definition_for_every_length_up_to_4096():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.arange(1, 4097)
    padded = torch.tensor([A.next_power_of_two(int(n)) for n in lengths])
    for p in padded.unique().tolist():
        group = lengths[padded == p].tolist()
        m = torch.zeros(len(group), p)
        for i, n in enumerate(group):
            # wide dynamic range so that the order of additions matters
            m[i, :n] = torch.randn(n, generator=gen) * torch.exp2(
                torch.randint(-20, 20, (n,), generator=gen).float()
            )
        want = _recursive_tree(m)
        got = torch.stack([A.tree_sum(m[i, :n]) for i, n in enumerate(group)])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"P={p}"


@pytest.mark.parametrize("n", [5000, 8191, 8192, 12289, 65537])
def test_tree_sum_random_larger_lengths(n):
    gen = torch.Generator().manual_seed(n)
    v = torch.randn(3, n, generator=gen) * 1e3
    p = A.next_power_of_two(n)
    m = torch.zeros(3, p)
    m[:, :n] = v
    assert torch.equal(A.tree_sum(v), _recursive_tree(m))
    # order matters: the tree differs from a sequential sum on some rows
    assert A.tree_sum(v, dim=0).shape == (n,)


def test_tree_sum_of_nothing_is_positive_zero():
    out = A.tree_sum(torch.empty(2, 0))
    assert out.shape == (2,) and torch.all(out == 0) and not torch.signbit(out).any()


def test_tree_sum_is_not_a_sequential_sum():
    """The declared order is observable: a left-to-right sum differs for these values."""
    v = torch.tensor([1.0, 2.0**-24, 2.0**-24, 2.0**-24])
    assert A.tree_sum(v).item() != (((v[0] + v[1]) + v[2]) + v[3]).item()


def _all_finite_sample(step: int) -> torch.Tensor:
    bits = torch.arange(0, 2**32, step, dtype=torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    x = bits.view(torch.float32)
    return x[torch.isfinite(x)]


def _ulp_error(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in ulps of the fp32 value nearest ``exact`` (float64 arithmetic)."""
    nearest = exact.float().abs()
    ulp = (torch.nextafter(nearest, torch.tensor(math.inf)) - nearest).double()
    return (got.double() - exact).abs() / ulp


def test_exp_error_bound():
    """The declared exp is within EXP_MAX_ULP_ERROR (<= 2) ulp of float64 exp."""
    edges = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1e-7, -1e-7, 0.34657359, -0.34657359,
         88.72283, 88.7228317, -87.33654, -87.3365479, -103.9720764, -103.278929, -100.0,
         -110.0, 100.0, 1.0, -1.0, 10.0, -10.0]
    )
    x = torch.cat([_all_finite_sample(1009), edges])
    got = A.exp_fp32(x)
    exact = torch.exp(x.double())
    representable = exact.float()
    finite = torch.isfinite(representable)
    err = _ulp_error(got[finite], exact[finite])
    assert err.max().item() <= A.EXP_MAX_ULP_ERROR <= 2.0
    # where the true result overflows fp32, the declared exp gives +inf as well
    assert torch.all(torch.isinf(got[~finite]))


def test_exp_special_values():
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 89.0, -104.0])
    got = A.exp_fp32(x)
    assert got[0] == math.inf and got[1] == 0 and not torch.signbit(got[1])
    assert torch.isnan(got[2]) and got[3] == 1 and got[4] == 1
    assert got[5] == math.inf and got[6] == 0


def test_silu_and_sigmoid_special_values_are_as_documented():
    z = torch.tensor([math.inf, -math.inf, math.nan, -100.0, 0.0])
    s = A.sigmoid_fp32(z)
    assert s[0] == 1 and s[1] == 0 and torch.isnan(s[2]) and s[4] == 0.5
    u = A.silu_fp32(z)
    assert u[0] == math.inf and torch.isnan(u[1]) and torch.isnan(u[2])
    assert u[3] == 0 and torch.signbit(u[3]) and u[4] == 0


def test_silu_and_sigmoid_accuracy():
    """Measured bound (documented in the gated page): a few ulp against float64."""
    z = torch.linspace(-80, 80, 2_000_001)
    for fn, ref in ((A.sigmoid_fp32, torch.sigmoid), (A.silu_fp32, torch.nn.functional.silu)):
        exact = ref(z.double())
        keep = exact.abs() > 1e-30
        err = _ulp_error(fn(z)[keep], exact[keep])
        assert err.max().item() <= 4.0, fn.__name__


def test_sqrt_is_correctly_rounded():
    """Checked with exact float64 arithmetic: (r ± ulp/2)² brackets v."""
    gen = torch.Generator().manual_seed(1)
    v = torch.exp2(torch.rand(2_000_000, generator=gen) * 200 - 100).float()
    r = A.sqrt(v).double()
    up = torch.nextafter(r.float(), torch.tensor(math.inf)).double()
    down = torch.nextafter(r.float(), torch.tensor(0.0)).double()
    lo, hi = (r + down) / 2, (r + up) / 2  # midpoints: 25 significant bits, squares exact
    assert torch.all(lo * lo < v.double()) and torch.all(v.double() < hi * hi)


def test_div_is_correctly_rounded():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(2_000_000, generator=gen)
    b = torch.randn(2_000_000, generator=gen) + 3.0
    q = A.div(a, b).double()
    up = torch.nextafter(q.float(), torch.tensor(math.inf)).double()
    down = torch.nextafter(q.float(), torch.tensor(-math.inf)).double()
    lo, hi = (q + down) / 2, (q + up) / 2
    bd, ad = b.double(), a.double()
    # lo*b and hi*b are exact in float64 (25 + 24 bits); a lies strictly between them
    between = torch.where(bd > 0, (lo * bd < ad) & (ad < hi * bd), (lo * bd > ad) & (ad > hi * bd))
    assert torch.all(between)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_same_bits_tells_signed_zeros_apart_and_matches_any_nan(dtype):
    a = torch.tensor([1.0, -0.0, 0.0, math.nan, math.nan, 2.0], dtype=dtype)
    b = torch.tensor([1.0, 0.0, 0.0, -math.nan, 3.0, 2.0], dtype=dtype)
    assert A.same_bits(a, b).tolist() == [True, False, True, True, False, True]
    assert A.ulp_distance(a, b)[1] == 0  # what the ulp distance cannot tell
    with pytest.raises(TypeError, match="same_bits: dtypes differ"):
        A.same_bits(a, b.float() if dtype != torch.float32 else b.double())
    with pytest.raises(ValueError, match=r"same_bits: shapes differ, got \(6,\) and \(1, 6\)"):
        A.same_bits(a, b[None])


def test_ulp_distance():
    a = torch.tensor([1.0, -0.0, 0.0, math.nan, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0078125, 0.0, -0.0, math.nan, math.nan], dtype=torch.bfloat16)
    d = A.ulp_distance(a, b)
    assert d[:4].tolist() == [1, 0, 0, 0] and d[4] == 2**16 - 1
    x = np.float32(1.5)
    y = np.nextafter(np.nextafter(x, np.float32(2)), np.float32(2))
    assert A.ulp_distance(torch.tensor([x]), torch.tensor([y])).item() == 2


def test_constants_are_fp32_once_rounded_with_their_sign():
    like = torch.zeros(3)
    a = A.f32(0.3, like)
    assert a.dtype == torch.float32 and a.shape == () and a.device == like.device
    assert a.item() == float(np.float32(0.3))
    neg, pos = A.f32(-0.0, like), A.f32(0.0, like)
    assert math.copysign(1.0, neg.item()) == -1.0 and math.copysign(1.0, pos.item()) == 1.0


def test_the_gate_traces_under_fake_tensors_and_stays_the_same_eagerly():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.linspace(-3.0, 3.0, 7)
    want = A.silu_fp32(x)
    with FakeTensorMode() as mode:
        traced = A.silu_fp32(mode.from_tensor(x))
    assert traced.shape == want.shape and traced.dtype == want.dtype
    assert torch.equal(A.silu_fp32(x), want)
