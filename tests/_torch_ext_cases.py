"""Shared helpers of the torch_ext tests: variants, inputs with special values and layouts,
bitwise comparison against the spec."""

from __future__ import annotations

import torch

from normspec import spec
from normspec.ops import OPS

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

#: (x dtype, weight dtype) pairs every operator accepts.
DTYPE_PAIRS = ((F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32))

#: Every operator variant: (op, params).
VARIANTS = (
    ("rms_norm", {"offset": 0.0}),
    ("rms_norm", {"offset": 1.0}),
    ("rms_norm", {"offset": 0.3}),
    ("fused_add_rms_norm", {"offset": 0.0, "residual_sum": "fp32"}),
    ("fused_add_rms_norm", {"offset": 1.0, "residual_sum": "rounded"}),
    ("fused_add_rms_norm", {"offset": 0.0, "residual_sum": "rounded"}),
    ("fused_add_rms_norm", {"offset": 1.0, "residual_sum": "fp32"}),
    ("rms_norm_gated", {"convention": "vllm", "activation": "silu"}),
    ("rms_norm_gated", {"convention": "vllm", "activation": "sigmoid"}),
    ("rms_norm_gated", {"convention": "hf", "activation": "silu"}),
    ("rms_norm_gated", {"convention": "hf", "activation": "sigmoid"}),
)

ROW_INPUTS = {name: op.row_inputs for name, op in OPS.items()}
N_OUT = {name: len(op.outputs) for name, op in OPS.items()}

SPECIALS = {
    F32: [0.0, -0.0, 1e-40, -3e-39, 1e-45, 3e38, float("inf"), float("-inf"), float("nan")],
    BF16: [0.0, -0.0, 1e-39, -5e-40, 9e-41, 3e38, float("inf"), float("-inf"), float("nan")],
    F16: [0.0, -0.0, 1e-6, -3e-7, 6e-8, 6e4, float("inf"), float("-inf"), float("nan")],
}

INTS = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality; NaNs are compared by position only (payloads may differ)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().cpu(), want.detach().cpu()
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        idx = (nan_g != nan_w).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: NaN positions differ at {idx}")
    ig = torch.where(nan_g, torch.zeros_like(got), got).contiguous().view(INTS[got.dtype])
    iw = torch.where(nan_w, torch.zeros_like(want), want).contiguous().view(INTS[want.dtype])
    if not torch.equal(ig, iw):
        bad = (ig != iw).nonzero()
        first = bad[0].tolist()
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {got.numel()} elements differ; first at {first}: "
            f"got {got[tuple(first)].item()!r}, spec {want[tuple(first)].item()!r}"
        )


def values(shape, dtype, gen: torch.Generator, *, scale: float = 1.0,
           specials: bool = False) -> torch.Tensor:
    """fp32 draws (cast to ``dtype``), optionally sprinkled with special values."""
    v = torch.randn(*shape, generator=gen) * scale
    if specials and v.numel():
        flat = v.view(-1)
        sp = torch.tensor(SPECIALS[dtype])
        k = min(flat.numel(), 2 + flat.numel() // 50)
        idx = torch.randint(0, flat.numel(), (k,), generator=gen)
        flat[idx] = sp[torch.randint(0, len(sp), (k,), generator=gen)]
    return v.to(dtype)


def layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as ``t`` in another memory layout."""
    if kind == "contiguous" or t.dim() == 0:
        return t
    shape, hidden = t.shape, t.shape[-1]
    if kind == "row_stride":  # rows padded: last dim contiguous, row stride > H
        big = torch.full((*shape[:-1], hidden + 5), float("nan"), dtype=t.dtype)
        big[..., :hidden] = t
        return big[..., :hidden]
    if kind == "offset":  # misaligned storage offset
        flat = torch.full((t.numel() + 3,), float("nan"), dtype=t.dtype)
        out = flat[3:].view(shape)
        out.copy_(t)
        return out
    if kind == "transposed":  # last dim not contiguous
        return t.transpose(-1, 0).contiguous().transpose(-1, 0) if t.dim() > 1 else t
    if kind == "leading":  # leading dims that do not collapse into one row stride
        if t.dim() < 3:
            return layout(t, "row_stride")
        big = torch.full((*shape[:-2], shape[-2] + 1, hidden), float("nan"), dtype=t.dtype)
        out = big[..., : shape[-2], :]
        out.copy_(t)
        return out
    raise ValueError(kind)


LAYOUTS = ("contiguous", "row_stride", "offset", "transposed", "leading")


def make_case(op: str, params: dict, shape, dtype, wdtype, seed: int, *, specials: bool,
              grad_specials: bool = False):
    """Row inputs, weight and output gradients for one case (all contiguous, CPU)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    rows = {}
    for name in ROW_INPUTS[op]:
        scale = 2.0 if name == "gate" else 1.0
        rows[name] = values(shape, dtype, gen, scale=scale, specials=specials)
    w = torch.randn(hidden, generator=gen) * 0.1
    if params.get("offset", 0.0) == 0.0:
        w = w + 1.0
    if specials and hidden > 2:
        w[0] = -0.0
    weight = w.to(wdtype)
    grads = [values(shape, dtype, gen, specials=grad_specials) for _ in range(N_OUT[op])]
    return rows, weight, grads


def spec_forward(op, rows, weight, eps, params):
    fn = {"rms_norm": spec.rms_norm, "fused_add_rms_norm": spec.fused_add_rms_norm,
          "rms_norm_gated": spec.rms_norm_gated}[op]
    out = fn(*rows.values(), weight, eps=eps, **params)
    return out if isinstance(out, tuple) else (out,)


def spec_backward(op, grads, rows, weight, eps, params):
    fn = {"rms_norm": spec.rms_norm_backward,
          "fused_add_rms_norm": spec.fused_add_rms_norm_backward,
          "rms_norm_gated": spec.rms_norm_gated_backward}[op]
    return fn(*grads, *rows.values(), weight, eps=eps, **params)


def ext_forward(op, rows, weight, eps, params):
    from normspec.backends import torch_ext as te

    fn = getattr(te, op)
    out = fn(*rows.values(), weight, eps=eps, **params)
    return out if isinstance(out, tuple) else (out,)


def ext_backward(op, grads, rows, weight, eps, params, rstd=None):
    """The backward operator; ``rstd``: the forward's, read instead of recomputed."""
    ops = torch.ops.normspec
    if op == "rms_norm":
        return ops.rms_norm_backward(grads[0], rows["x"], weight, eps, params["offset"], rstd)
    if op == "fused_add_rms_norm":
        return ops.fused_add_rms_norm_backward(
            grads[0], grads[1], rows["x"], rows["residual"], weight, eps, params["offset"],
            params["residual_sum"], rstd)
    return ops.rms_norm_gated_backward(
        grads[0], rows["x"], rows["gate"], weight, eps, params["convention"],
        params["activation"], rstd)


def ext_forward_with_rstd(op, rows, weight, eps, params):
    """The ``*_with_rstd`` forward operator: ``(*outputs, rstd)``."""
    ops = torch.ops.normspec
    if op == "rms_norm":
        return ops.rms_norm_with_rstd(rows["x"], weight, eps, params["offset"])
    if op == "fused_add_rms_norm":
        return ops.fused_add_rms_norm_with_rstd(rows["x"], rows["residual"], weight, eps,
                                                params["offset"], params["residual_sum"])
    return ops.rms_norm_gated_with_rstd(rows["x"], rows["gate"], weight, eps,
                                        params["convention"], params["activation"])


def spec_rstd(op, rows, eps, params):
    """The spec's rstd of every row (fp32, the shape of x without its last dimension)."""
    from normspec.spec.rms_norm import normalize_rows

    x = rows["x"]
    s = x.to(F32)
    if op == "fused_add_rms_norm":
        s = s + rows["residual"].to(F32)
        if params["residual_sum"] == "rounded":
            s = s.to(x.dtype).to(F32)
    return normalize_rows(s, eps)[1].squeeze(-1)


def check_saved_rstd(op, rows, weight, grads, eps, params, want, want_g, ctx):
    """The ``*_with_rstd`` forward gives the spec's outputs and the spec's rstd (computed on
    the CPU), and the backward given that rstd gives the spec's gradients."""
    out = ext_forward_with_rstd(op, rows, weight, eps, params)
    for i, (g, w) in enumerate(zip(out[:-1], want, strict=True)):
        assert_bits(g, w, f"with_rstd forward output {i} of {ctx}")
    cpu_rows = {name: t.cpu() for name, t in rows.items()}
    assert_bits(out[-1], spec_rstd(op, cpu_rows, eps, params), f"rstd of {ctx}")
    got_g = ext_backward(op, grads, rows, weight, eps, params, rstd=out[-1])
    for name, g, w in zip(grad_names(op), got_g, want_g, strict=True):
        assert_bits(g, w, f"{name} with the saved rstd, {ctx}")
    if op == "fused_add_rms_norm" and (params["residual_sum"] == "rounded"
                                       or rows["x"].dtype == torch.float32):
        check_backward_from_sum(grads, out[1], weight, eps, params, out[-1], want_g, ctx)


def check_backward_from_sum(grads, s, weight, eps, params, rstd, want_g, ctx):
    """The fused backward given the forward's new residual s (the sum its norm read):
    its one gradient row is the spec's dx and dresidual, with the saved rstd or without."""
    dy, dres = grads
    for given in (rstd, None):
        ds, dw = torch.ops.normspec.fused_add_rms_norm_backward_from_sum(
            dy, dres, s, weight, eps, params["offset"], params["residual_sum"], given)
        how = "saved rstd" if given is not None else "recomputed rstd"
        assert_bits(ds, want_g[0], f"ds (dx) from the sum, {how}, {ctx}")
        assert_bits(ds, want_g[1], f"ds (dresidual) from the sum, {how}, {ctx}")
        assert_bits(dw, want_g[2], f"dweight from the sum, {how}, {ctx}")


def grad_names(op):
    return {"rms_norm": ("dx", "dweight"),
            "fused_add_rms_norm": ("dx", "dresidual", "dweight"),
            "rms_norm_gated": ("dx", "dgate", "dweight")}[op]


MARKER_KERNEL = "spin_kernel"  # the kernel torch.cuda._sleep launches


def cuda_kernel_names(fn, attempts: int = 3) -> list[str]:
    """The names of the CUDA kernels ``fn()`` runs (torch.profiler, in start order;
    Memcpy / Memset records left out).

    ``fn()`` runs between two marker kernels, each followed by a synchronize, and only
    the records between the two markers count. CUPTI before CUDA 13.1 can hand a
    session records of kernels that ran before it (with corrupt timestamps) and drop the
    session's first records (pytorch/pytorch#192021; CUPTI 13.1 release notes), both at
    once in a full ``-m cuda`` run on CUDA 13.0. A session whose records lack either marker
    is run again, up to ``attempts`` times; none is read as empty."""
    from torch.profiler import ProfilerActivity, profile

    seen = []
    for _ in range(attempts):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
        events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                         and not e.name.startswith(("Memcpy", "Memset"))),
                        key=lambda e: e.time_range.start)
        names = [e.name for e in events]
        marks = [i for i, n in enumerate(names) if MARKER_KERNEL in n]
        if len(marks) == 2:
            return names[marks[0] + 1:marks[1]]
        seen.append(names)
    raise AssertionError(f"the profiler's records lacked the two {MARKER_KERNEL} markers "
                         f"in {attempts} sessions: {seen}")
