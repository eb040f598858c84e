"""The torch_ext backend's CPU kernels are bitwise equal to the spec, forward and backward."""

from __future__ import annotations

import pytest
import torch
from _torch_ext_cases import (
    DTYPE_PAIRS,
    LAYOUTS,
    VARIANTS,
    assert_bits,
    check_saved_rstd,
    ext_backward,
    ext_forward,
    ext_forward_with_rstd,
    grad_names,
    layout,
    make_case,
    spec_backward,
    spec_forward,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normspec import spec

te = pytest.importorskip("normspec.backends.torch_ext")

EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def _built():
    reason = te.available(build_if_needed=False)
    if reason is not None:
        pytest.skip(f"torch_ext cannot be built here: {reason}")
    te.build(verbose=True)


def check_case(op, params, shape, dtype, wdtype, seed, *, specials=True, layouts=None,
               grad_specials=False, eps=EPS):
    rows, weight, grads = make_case(op, params, shape, dtype, wdtype, seed, specials=specials,
                                    grad_specials=grad_specials)
    want = spec_forward(op, rows, weight, eps, params)
    want_g = spec_backward(op, grads, rows, weight, eps, params)
    layouts = layouts or {name: "contiguous" for name in rows}
    lrows = {name: layout(t, layouts[name]) for name, t in rows.items()}
    lgrads = [layout(g, layouts.get("grad", "contiguous")) for g in grads]
    got = ext_forward(op, lrows, weight, eps, params)
    ctx = f"{op} {params} shape={tuple(shape)} {dtype}/{wdtype} seed={seed} layouts={layouts}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bits(g, w, f"forward output {i} of {ctx}")
        assert g.is_contiguous()
    got_g = ext_backward(op, lgrads, lrows, weight, eps, params)
    for name, g, w in zip(grad_names(op), got_g, want_g, strict=True):
        assert_bits(g, w, f"{name} of {ctx}")
    check_saved_rstd(op, lrows, weight, lgrads, eps, params, want, want_g, ctx)


# ---- a deterministic sweep: every variant x dtype pair ---------------------------------
@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op,params", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_every_variant_bitwise(op, params, dtype, wdtype):
    for seed, shape in enumerate([(5, 1), (3, 7), (2, 3, 64), (9, 1003), (3, 2048), (33, 130)]):
        check_case(op, params, shape, dtype, wdtype, seed, specials=seed % 2 == 1)


# ---- hypothesis: shapes, layouts, values ------------------------------------------------
hidden_sizes = st.one_of(
    st.integers(1, 16), st.integers(17, 300), st.integers(301, 3000),
    st.sampled_from([128, 256, 1024, 2048, 3000, 1023, 1025]),
)


@st.composite
def cases(draw):
    op, params = draw(st.sampled_from(VARIANTS))
    dtype, wdtype = draw(st.sampled_from(DTYPE_PAIRS))
    hidden = draw(hidden_sizes)
    max_rows = max(1, min(40, 20000 // hidden))
    lead = draw(st.one_of(
        st.tuples(st.integers(0, max_rows)),
        st.tuples(st.integers(1, 4), st.integers(0, max(1, max_rows // 4))),
        st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(0, 3)),
        st.just(()),
    ))
    names = ("x", "residual", "gate", "grad")
    layouts = {n: draw(st.sampled_from(LAYOUTS)) for n in names}
    specials = draw(st.booleans())
    grad_specials = draw(st.booleans()) and draw(st.booleans())
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1, 1e-45]))
    seed = draw(st.integers(0, 2**31 - 1))
    return op, params, (*lead, hidden), dtype, wdtype, seed, specials, grad_specials, layouts, eps


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_hypothesis_bitwise(case):
    op, params, shape, dtype, wdtype, seed, specials, grad_specials, layouts, eps = case
    check_case(op, params, shape, dtype, wdtype, seed, specials=specials, layouts=layouts,
               grad_specials=grad_specials, eps=eps)


# ---- signed zeros: the padding of the trees is a literal +0.0 ----------------------------
@pytest.mark.parametrize("hidden,rows", [(3, 3), (5, 6), (1, 3), (7, 1)])
def test_negative_zero_sums_follow_the_padded_tree(hidden, rows):
    x = torch.ones(rows, hidden)
    weight = torch.ones(hidden)
    dy = torch.full((rows, hidden), -0.0)
    want = spec.rms_norm_backward(dy, x, weight, eps=EPS)
    got = torch.ops.normspec.rms_norm_backward(dy, x, weight, EPS, 0.0)
    for name, g, w in zip(("dx", "dweight"), got, want, strict=True):
        assert_bits(g, w, name)


def test_weight_negative_zero_kept_when_offset_is_zero():
    x = torch.randn(2, 4)
    weight = torch.tensor([-0.0, 1.0, -0.0, 2.0])
    assert_bits(te.rms_norm(x, weight, eps=EPS), spec.rms_norm(x, weight, eps=EPS), "y")
    assert_bits(te.rms_norm(x, weight, eps=EPS, offset=-0.0),
                spec.rms_norm(x, weight, eps=EPS, offset=-0.0), "y (offset -0.0)")


def test_empty_rows():
    for dtype, wdtype in DTYPE_PAIRS:
        x = torch.empty(0, 5, dtype=dtype)
        w = torch.ones(5, dtype=wdtype)
        y = te.rms_norm(x, w, eps=EPS)
        assert y.shape == (0, 5) and y.dtype == dtype
        dx, dw = torch.ops.normspec.rms_norm_backward(x, x, w, EPS, 0.0)
        assert dx.shape == (0, 5)
        assert_bits(dw, spec.rms_norm_backward(x, x, w, eps=EPS)[1], "dweight of no rows")


# ---- autograd: the Python functions differentiate through the declared backward ----------
# ---- the saved rstd ------------------------------------------------------------------------
def test_backward_reads_the_given_rstd():
    """The backward uses the rstd it is given (here a wrong one, so dx changes); None
    recomputes it."""
    x, dy = torch.randn(4, 32), torch.randn(4, 32)
    w = torch.randn(32)
    _, rstd = torch.ops.normspec.rms_norm_with_rstd(x, w, EPS, 0.0)
    right = torch.ops.normspec.rms_norm_backward(dy, x, w, EPS, 0.0, rstd)
    again = torch.ops.normspec.rms_norm_backward(dy, x, w, EPS, 0.0, None)
    wrong = torch.ops.normspec.rms_norm_backward(dy, x, w, EPS, 0.0, rstd * 2)
    assert_bits(right[0], again[0], "dx, given rstd vs recomputed")
    assert not torch.equal(right[0], wrong[0])


def test_autograd_passes_the_forward_rstd_to_the_backward():
    """With a gradient to compute, the public functions run the *_with_rstd forward and
    the backward operator receives its rstd; without one, the plain forward runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((str(func.overloadpacket), args))
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 16, requires_grad=True)
    gate = torch.randn(3, 16)
    w = torch.randn(16)
    with Record():
        te.rms_norm_gated(x, gate, w, eps=EPS).sum().backward()
    names = [name for name, _ in calls if name.startswith("normspec.")]
    assert names == ["normspec.rms_norm_gated_with_rstd", "normspec.rms_norm_gated_backward"]
    backward_args = next(a for n, a in calls if n == "normspec.rms_norm_gated_backward")
    assert isinstance(backward_args[-1], torch.Tensor) and backward_args[-1].shape == (3,)
    with Record():
        calls.clear()
        with torch.no_grad():
            te.rms_norm_gated(x, gate, w, eps=EPS)
    assert [n for n, _ in calls if n.startswith("normspec.")] == ["normspec.rms_norm_gated"]


@pytest.mark.parametrize("call", [
    lambda x, other, w: te.rms_norm(x, w, eps=EPS, offset=1.0),
    lambda x, other, w: te.fused_add_rms_norm(x, other, w, eps=EPS),
    lambda x, other, w: te.rms_norm_gated(x, other, w, eps=EPS),
], ids=["rms_norm", "fused_add_rms_norm", "rms_norm_gated"])
def test_backward_fills_no_zeros_for_the_rstd_gradient(call):
    """rstd is an output of the *_with_rstd forwards that never gets a gradient. Autograd
    would fill a zeros tensor for it before every backward (on a GPU, one more kernel
    launch: the 1-row bf16 backward spent about a third of its time on it); the backward
    must run with no zeros or fills at all when every differentiable output has its
    gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    other = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    out = call(x, other, w)
    outs = list(out) if isinstance(out, tuple) else [out]
    grads = [torch.randn_like(o) for o in outs]
    with Record():
        torch.autograd.grad(outs, [x, other, w], grads, allow_unused=True)
    filled = [n for n in calls if any(k in n for k in ("zero", "fill", "full"))]
    assert filled == [], f"the backward filled tensors: {calls}"
    assert any(n.startswith("normspec.") for n in calls), calls


@pytest.mark.parametrize("residual_sum,dtype,backward", [
    ("rounded", torch.bfloat16, "normspec.fused_add_rms_norm_backward_from_sum"),
    ("fp32", torch.float32, "normspec.fused_add_rms_norm_backward_from_sum"),
    ("fp32", torch.bfloat16, "normspec.fused_add_rms_norm_backward"),
])
def test_fused_autograd_saves_the_sum_where_the_norm_read_it(residual_sum, dtype, backward):
    """Where the new residual is the sum the norm read ("rounded", or float32 rows),
    autograd saves it instead of x and residual and runs the backward from the sum, whose
    one gradient is both dx and dresidual; elsewhere the backward from x and residual."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 16).to(dtype).requires_grad_()
    r = torch.randn(3, 16).to(dtype).requires_grad_()
    w = torch.randn(16, requires_grad=True)
    y, new_res = te.fused_add_rms_norm(x, r, w, eps=EPS, residual_sum=residual_sum)
    dy, dres = torch.randn(3, 16).to(dtype), torch.randn(3, 16).to(dtype)
    with Record():
        torch.autograd.backward([y, new_res], [dy, dres])
    assert [n for n in calls if n.startswith("normspec.")] == [backward]
    want = spec.fused_add_rms_norm_backward(dy, dres, x.detach(), r.detach(), w.detach(),
                                            eps=EPS, residual_sum=residual_sum)
    for name, got, ww in zip(("dx", "dresidual", "dweight"), (x.grad, r.grad, w.grad), want,
                             strict=True):
        assert_bits(got, ww, f"{name} ({residual_sum}, {dtype})")


def test_backward_from_the_sum_refuses_an_unrounded_norm_input():
    s, dy = torch.randn(2, 8).bfloat16(), torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="residual_sum: the backward from the saved sum "
                       "needs 'rounded' or float32 rows"):
        torch.ops.normspec.fused_add_rms_norm_backward_from_sum(
            dy, dy, s, torch.ones(8), EPS, 0.0, "fp32")


@pytest.mark.parametrize("bad,match", [
    (lambda r: r.double(), "rstd: expected dtype float32"),
    (lambda r: r[:2], "rstd: expected the shape of x without its last dimension"),
    (lambda r: r.repeat(2)[::2], "rstd: expected a contiguous tensor"),
])
def test_given_rstd_is_checked(bad, match):
    x, dy = torch.randn(4, 8), torch.randn(4, 8)
    w = torch.randn(8)
    _, rstd = torch.ops.normspec.rms_norm_with_rstd(x, w, EPS, 0.0)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.normspec.rms_norm_backward(dy, x, w, EPS, 0.0, bad(rstd))


def test_with_rstd_of_no_rows():
    x = torch.empty(2, 0, 5, dtype=torch.bfloat16)
    out = ext_forward_with_rstd("rms_norm", {"x": x}, torch.ones(5), EPS, {"offset": 0.0})
    assert out[0].shape == (2, 0, 5) and out[1].shape == (2, 0) and out[1].dtype == torch.float32


@pytest.mark.parametrize("op,params", VARIANTS[::2])
def test_autograd_matches_spec_backward(op, params):
    rows, weight, grads = make_case(op, params, (4, 3, 96), torch.bfloat16, torch.float32, 7,
                                    specials=False)
    leaves = {k: v.clone().requires_grad_(True) for k, v in rows.items()}
    w = weight.clone().requires_grad_(True)
    outs = ext_forward(op, leaves, w, EPS, params)
    torch.autograd.backward(outs, grads)
    want = spec_backward(op, grads, rows, weight, EPS, params)
    got = [*(leaves[k].grad for k in leaves), w.grad]
    for name, g, ww in zip(grad_names(op), [*got[:-1], got[-1]], want, strict=True):
        assert_bits(g, ww, f"autograd {name}")


def test_autograd_unused_output_gets_zero_gradient():
    x = torch.randn(3, 16, requires_grad=True)
    r = torch.randn(3, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y, _ = te.fused_add_rms_norm(x, r, w, eps=EPS)
    y.sum().backward()
    dy = torch.ones(3, 16)
    want = spec.fused_add_rms_norm_backward(dy, torch.zeros(3, 16), x.detach(), r.detach(),
                                            w.detach(), eps=EPS)
    assert_bits(x.grad, want[0], "dx")
    assert_bits(r.grad, want[1], "dresidual")
    assert_bits(w.grad, want[2], "dweight")


# ---- errors are the spec's ------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    lambda f, x, w: f.rms_norm(x.int(), w, eps=EPS),
    lambda f, x, w: f.rms_norm(x, w[:-1], eps=EPS),
    lambda f, x, w: f.rms_norm(x, w.half(), eps=EPS),
    lambda f, x, w: f.rms_norm(x, w, eps=0.0),
    lambda f, x, w: f.rms_norm(x, w, eps=EPS, offset=float("nan")),
    lambda f, x, w: f.fused_add_rms_norm(x, x[:1], w, eps=EPS),
    lambda f, x, w: f.fused_add_rms_norm(x, x, w, eps=EPS, residual_sum="bf16"),
    lambda f, x, w: f.rms_norm_gated(x, x, w, eps=EPS, convention="fla"),
    lambda f, x, w: f.rms_norm_gated(x, x, w, eps=EPS, activation="gelu"),
    lambda f, x, w: f.rms_norm_gated(x, x.double(), w, eps=EPS),
])
def test_errors_match_the_spec(bad):
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises((TypeError, ValueError)) as want:
        bad(spec, x, w)
    with pytest.raises(type(want.value)) as got:
        bad(te, x, w)
    assert str(got.value) == str(want.value)


# ---- torch.library.opcheck --------------------------------------------------------------
def _opcheck_samples():
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32, grad=True):
        return (torch.randn(*shape, generator=g).to(dtype)).requires_grad_(grad)

    ops = torch.ops.normspec
    return [
        (ops.rms_norm, (t(3, 40), t(40), 1e-6, 1.0)),
        (ops.rms_norm, (t(2, 3, 24, dtype=torch.bfloat16), t(24), 1e-6, 0.0)),
        (ops.rms_norm_backward, (t(3, 40, grad=False), t(3, 40, grad=False),
                                 t(40, grad=False), 1e-6, 0.0)),
        (ops.fused_add_rms_norm, (t(3, 40), t(3, 40), t(40), 1e-6, 0.0, "fp32")),
        (ops.fused_add_rms_norm, (t(4, 17, dtype=torch.float16), t(4, 17, dtype=torch.float16),
                                  t(17, dtype=torch.float16), 1e-6, 1.0, "rounded")),
        (ops.fused_add_rms_norm_backward,
         (*(t(3, 40, grad=False) for _ in range(4)), t(40, grad=False), 1e-6, 0.0, "fp32")),
        (ops.rms_norm_gated, (t(3, 40), t(3, 40), t(40), 1e-6, "vllm", "silu")),
        (ops.rms_norm_gated, (t(5, 33, dtype=torch.bfloat16), t(5, 33, dtype=torch.bfloat16),
                              t(33), 1e-6, "hf", "sigmoid")),
        (ops.rms_norm_gated_backward,
         (*(t(3, 40, grad=False) for _ in range(3)), t(40, grad=False), 1e-6, "hf", "silu")),
        (ops.rms_norm_with_rstd, (t(3, 40), t(40), 1e-6, 1.0)),
        (ops.fused_add_rms_norm_with_rstd,
         (t(2, 3, 24, dtype=torch.bfloat16), t(2, 3, 24, dtype=torch.bfloat16), t(24), 1e-6,
          0.0, "rounded")),
        (ops.rms_norm_gated_with_rstd, (t(3, 40), t(3, 40), t(40), 1e-6, "vllm", "sigmoid")),
        (ops.rms_norm_backward, (t(3, 40, grad=False), t(3, 40, grad=False),
                                 t(40, grad=False), 1e-6, 1.0, t(3, grad=False).abs())),
        (ops.fused_add_rms_norm_backward,
         (*(t(2, 40, grad=False) for _ in range(4)), t(40, grad=False), 1e-6, 0.0, "fp32",
          t(2, grad=False).abs())),
        (ops.rms_norm_gated_backward,
         (*(t(3, 40, grad=False) for _ in range(3)), t(40, grad=False), 1e-6, "vllm", "silu",
          t(3, grad=False).abs())),
        (ops.fused_add_rms_norm_backward_from_sum,
         (*(t(3, 40, dtype=torch.bfloat16, grad=False) for _ in range(3)), t(40, grad=False),
          1e-6, 1.0, "rounded")),
        (ops.fused_add_rms_norm_backward_from_sum,
         (*(t(2, 40, grad=False) for _ in range(3)), t(40, grad=False), 1e-6, 0.0, "fp32",
          t(2, grad=False).abs())),
    ]


@pytest.mark.parametrize("i", range(17))
def test_opcheck(i):
    op, args = _opcheck_samples()[i]
    torch.library.opcheck(op, args)


# ---- torch.compile ------------------------------------------------------------------------
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    x = torch.randn(6, 100, dtype=torch.bfloat16)
    r = torch.randn(6, 100, dtype=torch.bfloat16)
    z = torch.randn(6, 100, dtype=torch.bfloat16)
    w = torch.randn(100)

    def block(x, r, z, w):
        y, res = te.fused_add_rms_norm(x, r, w, eps=1e-6, offset=1.0, residual_sum="rounded")
        return te.rms_norm_gated(y, z, w, eps=1e-6, convention="hf"), res

    compiled = torch.compile(block, fullgraph=True)
    for got, want in zip(compiled(x, r, z, w), block(x, r, z, w), strict=True):
        assert_bits(got, want, "compiled")


def test_compile_fullgraph_backward_equals_eager():
    torch._dynamo.reset()

    def loss(x, w):
        return te.rms_norm(x, w, eps=1e-6, offset=1.0).float().square().sum()

    x = torch.randn(5, 64, dtype=torch.float16)
    w = torch.randn(64) * 0.1
    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fn(xl, wl).backward()
        grads.append((xl.grad, wl.grad))
    for got, want in zip(grads[1], grads[0], strict=True):
        assert_bits(got, want, "compiled grad")


def test_available_and_build():
    assert te.available() is None
    assert te.loaded()
    assert te.build(verbose=False).endswith(".so")


def _built():
    te.build(verbose=False)
    return torch.ops.normspec


@pytest.mark.parametrize(("call", "words"), [
    (lambda ops, x, w: ops.rms_norm(x, w.to("meta"), 1e-6, 1.0), ["weight", "meta"]),
    (lambda ops, x, w: ops.rms_norm(x.to("meta"), w.to("meta"), -1.0, 1.0), ["eps", "-1.0"]),
    (lambda ops, x, w: ops.rms_norm(x.to("meta"), w.to("meta"), 1e-50, 1.0),
     ["eps", "fp32"]),
    (lambda ops, x, w: ops.fused_add_rms_norm(x.to("meta"), x.to("meta"), w.to("meta"), 1e-6,
                                              1.0, "nonsense"), ["residual_sum", "nonsense"]),
    (lambda ops, x, w: ops.rms_norm_gated(x, x.to("meta"), w, 1e-6, "vllm", "silu"),
     ["gate", "meta"]),
    (lambda ops, x, w: ops.rms_norm_backward(x[:2].to("meta"), x.to("meta"), w.to("meta"),
                                             1e-6, 1.0), ["dy", "shape"]),
])
def test_the_fake_kernels_check_what_the_real_ones_check(call, words):
    """A meta tensor among the arguments sends the call to the fake kernel: it must refuse
    what the C++ kernels refuse instead of returning an uninitialised tensor."""
    ops = _built()
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        call(ops, x, w)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "rms_norm_gated"])
def test_double_backward_raises_a_clear_error(op):
    x = torch.randn(4, 8, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(8).requires_grad_()
    other = torch.randn(4, 8)
    if op == "rms_norm":
        y = te.rms_norm(x, w, eps=1e-6)
    elif op == "fused_add_rms_norm":
        y = te.fused_add_rms_norm(x, other, w, eps=1e-6)[0]
    else:
        y = te.rms_norm_gated(x, other, w, eps=1e-6)
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="has no double backward"):
        torch.autograd.grad(dx.sum(), w)


@pytest.mark.parametrize("shape", [(40_000, 64), (3, 1 << 19), (17, 1 << 16)])
@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "rms_norm_gated"])
def test_blocked_dweight_is_the_row_tree(shape, op):
    """Rows past one block (2^20 contributions) are summed block by block, then over the
    blocks: the bits of the spec's one row tree."""
    from normspec.ops import OPS

    spec_op = OPS[op]
    params = spec_op.variants[-1]
    s = spec_op.make_sample(shape, torch.bfloat16, params=params, seed=5,
                            weight_dtype=torch.float32)
    ins = [t.clone().requires_grad_() for t in s.row_list(spec_op)]
    w = s.weight.clone().requires_grad_()
    got = te.backend.forward(op, dict(zip(spec_op.row_inputs, ins, strict=True)), w,
                             eps=s.eps, **s.params)
    gen = torch.Generator().manual_seed(6)
    douts = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in got]
    grads = torch.autograd.grad(got, [*ins, w], douts)
    want = spec_op.spec_backward(s, douts)
    assert_bits(grads[-1], want[-1], f"{op} {shape} dweight")
