"""The torch_ext backend's CUDA kernels are bitwise equal to the spec (computed on the CPU)."""

from __future__ import annotations

import pytest
import torch
from _torch_ext_cases import (
    DTYPE_PAIRS,
    LAYOUTS,
    VARIANTS,
    assert_bits,
    check_backward_from_sum,
    check_saved_rstd,
    cuda_kernel_names,
    ext_backward,
    ext_forward,
    ext_forward_with_rstd,
    grad_names,
    layout,
    make_case,
    spec_backward,
    spec_forward,
)

pytestmark = pytest.mark.cuda

te = pytest.importorskip("normspec.backends.torch_ext")

EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    reason = te.cuda_build_possible()
    if reason is not None:
        pytest.skip(reason)
    te.build(verbose=True)


def _cuda(t: torch.Tensor, kind: str = "contiguous") -> torch.Tensor:
    return layout(t, kind).cuda() if kind == "contiguous" else _on_cuda_layout(t, kind)


def _on_cuda_layout(t, kind):
    # build the layout on the GPU so that strides and storage offsets survive the copy
    base = layout(t, kind)
    storage = torch.empty(base.untyped_storage().size() // base.element_size(), dtype=t.dtype,
                          device="cuda")
    out = storage.as_strided(base.shape, base.stride(), base.storage_offset())
    out.copy_(base)
    return out


def check_case(op, params, shape, dtype, wdtype, seed, *, specials=True, layouts=None,
               grad_specials=False, eps=EPS, backward=True):
    rows, weight, grads = make_case(op, params, shape, dtype, wdtype, seed, specials=specials,
                                    grad_specials=grad_specials)
    want = spec_forward(op, rows, weight, eps, params)
    layouts = layouts or {}
    crows = {k: _cuda(v, layouts.get(k, "contiguous")) for k, v in rows.items()}
    cw = weight.cuda()
    got = ext_forward(op, crows, cw, eps, params)
    ctx = f"{op} {params} shape={tuple(shape)} {dtype}/{wdtype} seed={seed} layouts={layouts}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.device.type == "cuda"
        assert_bits(g, w, f"CUDA forward output {i} of {ctx}")
    if not backward:
        return
    want_g = spec_backward(op, grads, rows, weight, eps, params)
    cgrads = [_cuda(g, layouts.get("grad", "contiguous")) for g in grads]
    got_g = ext_backward(op, cgrads, crows, cw, eps, params)
    for name, g, w in zip(grad_names(op), got_g, want_g, strict=True):
        assert_bits(g, w, f"CUDA {name} of {ctx}")
    check_saved_rstd(op, crows, cw, cgrads, eps, params, want, want_g, f"CUDA {ctx}")


SHAPES = [(5, 1), (3, 7), (2, 3, 64), (9, 1003), (3, 2048), (33, 130), (4, 8192), (2, 12000),
          (2, 40000), (70, 256), (1, 5000), (40, 128), (17, 4096)]


@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op,params", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_every_variant_bitwise(op, params, dtype, wdtype):
    for seed, shape in enumerate(SHAPES):
        check_case(op, params, shape, dtype, wdtype, seed, specials=seed % 2 == 1)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("op,params", VARIANTS[::3])
def test_layouts(op, params, kind):
    for seed, shape in enumerate([(4, 3, 1003), (2, 5, 2048), (3, 2, 8)]):
        for dtype, wdtype in DTYPE_PAIRS[:3]:
            layouts = {"x": kind, "residual": kind, "gate": kind, "grad": kind}
            check_case(op, params, shape, dtype, wdtype, seed, layouts=layouts)


@pytest.mark.parametrize("shape", [(4096, 2048), (2**16, 128), (64, 8192), (1000, 1),
                                   (513, 1003), (300, 33000), (3, 70000)])
@pytest.mark.parametrize("op,params", [VARIANTS[1], VARIANTS[4], VARIANTS[9]])
def test_large_shapes(op, params, shape):
    check_case(op, params, shape, torch.bfloat16, torch.float32, 1, specials=True)


WEIGHT_BINDINGS = ["as_is", "strided", "unaligned"]


def _bind_weight(weight: torch.Tensor, how: str) -> torch.Tensor:
    """The weight on the GPU: contiguous and 16-byte aligned (the kernels read it in the
    input dtype), a strided view, or at an odd storage offset (both: an fp32 copy)."""
    n = weight.numel()
    if how == "as_is":
        return weight.cuda()
    if how == "strided":
        buf = torch.zeros(2 * n, dtype=weight.dtype, device="cuda")
        buf[::2] = weight.cuda()
        return buf[::2]
    buf = torch.zeros(n + 1, dtype=weight.dtype, device="cuda")
    buf[1:] = weight.cuda()
    return buf[1:]


@pytest.mark.parametrize("how", WEIGHT_BINDINGS)
@pytest.mark.parametrize("op,params", [VARIANTS[1], VARIANTS[4], VARIANTS[9]])
def test_weight_in_the_input_dtype(op, params, how):
    """A bf16 weight of bf16 inputs is read as it is where it is contiguous and aligned,
    else through an fp32 copy: the same bits either way, on the one-row forward, the
    persistent forward with the gate table (2**16 x 128 gated) and the backward."""
    for seed, shape in enumerate([(4096, 2048), (2**16, 128), (37, 1003), (5, 8), (1, 2048)]):
        rows, weight, grads = make_case(op, params, shape, torch.bfloat16, torch.bfloat16, seed,
                                        specials=True)
        cw = _bind_weight(weight, how)
        assert cw.is_contiguous() == (how != "strided")
        crows = {k: v.cuda() for k, v in rows.items()}
        ctx = f"{op} {params} {shape} weight {how}"
        for i, (g, w) in enumerate(zip(ext_forward(op, crows, cw, EPS, params),
                                       spec_forward(op, rows, weight, EPS, params), strict=True)):
            assert_bits(g, w, f"forward output {i} of {ctx}")
        got_g = ext_backward(op, [g.cuda() for g in grads], crows, cw, EPS, params)
        want_g = spec_backward(op, grads, rows, weight, EPS, params)
        for name, g, w in zip(grad_names(op), got_g, want_g, strict=True):
            assert_bits(g, w, f"{name} of {ctx}")


@pytest.mark.parametrize("op,params,shape", [
    ("rms_norm", {"offset": 1.0}, (300, 2048)),
    ("fused_add_rms_norm", {"offset": 1.0, "residual_sum": "rounded"}, (300, 2048)),
    ("rms_norm_gated", {"convention": "vllm", "activation": "silu"}, (20000, 128)),
    ("rms_norm", {"offset": 0.0}, (70, 1000)),
])
def test_pipelined_backward_reads_the_saved_rstd(op, params, shape):
    """The pipelined backward reads the rstd it is given: the forward's gives the spec's
    gradients (checked in check_case), a wrong one (twice the forward's) changes dx."""
    rows, weight, grads = make_case(op, params, shape, torch.bfloat16, torch.bfloat16, 9,
                                    specials=False)
    crows = {k: v.cuda() for k, v in rows.items()}
    cgrads = [g.cuda() for g in grads]
    cw = weight.cuda()
    rstd = ext_forward_with_rstd(op, crows, cw, EPS, params)[-1]
    right = ext_backward(op, cgrads, crows, cw, EPS, params, rstd=rstd)
    again = ext_backward(op, cgrads, crows, cw, EPS, params)
    wrong = ext_backward(op, cgrads, crows, cw, EPS, params, rstd=rstd * 2)
    for name, g, w in zip(grad_names(op), right, again, strict=True):
        assert_bits(g, w, f"{name}: given rstd vs recomputed")
    assert not torch.equal(right[0], wrong[0])


@pytest.mark.parametrize("shape,dtype,residual_sum", [
    ((3000, 2048), torch.bfloat16, "rounded"),   # constant form, 128 lanes x 2
    ((3000, 4096), torch.bfloat16, "rounded"),   # constant form, 256 lanes x 2
    ((20000, 256), torch.bfloat16, "rounded"),   # constant form, 32 lanes x 1
    ((20000, 128), torch.float16, "rounded"),    # constant form, 16 lanes x 1
    ((700, 1000), torch.bfloat16, "rounded"),    # general form
    ((3000, 2048), torch.float32, "fp32"),       # float32: both conventions coincide
    ((50, 9000), torch.bfloat16, "rounded"),     # too long for the pipelined kernels
])
def test_fused_backward_from_the_sum_on_every_kernel_form(shape, dtype, residual_sum):
    """The fused backward from the saved sum (OP_FUSED_SUM) on the pipelined kernels'
    forms (rows beyond the persistent grid's teams) and the streaming kernel: its one
    gradient row is the spec's dx and dresidual, computed on the CPU."""
    params = {"offset": 1.0, "residual_sum": residual_sum}
    rows, weight, grads = make_case("fused_add_rms_norm", params, shape, dtype, torch.float32,
                                    11, specials=False)
    want = spec_forward("fused_add_rms_norm", rows, weight, EPS, params)
    want_g = spec_backward("fused_add_rms_norm", grads, rows, weight, EPS, params)
    crows = {k: v.cuda() for k, v in rows.items()}
    cw = weight.cuda()
    out = ext_forward_with_rstd("fused_add_rms_norm", crows, cw, EPS, params)
    assert_bits(out[1], want[1], f"new residual {shape} {dtype}")
    check_backward_from_sum([g.cuda() for g in grads], out[1], cw, EPS, params, out[-1],
                            want_g, f"CUDA {shape} {dtype} {residual_sum}")


def _small_row_boundaries(per_team_lanes: int) -> list[int]:
    """Row counts on both sides of where the one-row forward's team doubles (the teams'
    threads within half the device's resident threads: SMs x 1024)."""
    half = torch.cuda.get_device_properties(0).multi_processor_count * 1024
    edges = [half // (per_team_lanes * 2), half // (per_team_lanes * 4)]
    return sorted({1, 2, 64} | {e + d for e in edges for d in (0, 1)})


@pytest.mark.parametrize("op,params,hidden,lanes", [
    ("rms_norm", {"offset": 1.0}, 2048, 64),          # teams of 64 -> 128 -> 256 lanes
    ("rms_norm", {"offset": 1.0}, 256, 8),            # q/k: 8 -> 16 -> 32
    ("fused_add_rms_norm", {"offset": 1.0, "residual_sum": "rounded"}, 2048, 128),
    ("rms_norm_gated", {"convention": "vllm", "activation": "silu"}, 128, 8),
], ids=["rms2048", "qk256", "fused2048", "gated128"])
def test_small_row_geometry_is_bitwise(op, params, hidden, lanes):
    """Few rows run the one-row forward with wider teams (one vector per thread at
    most, the weight loaded with the row): the rows around each doubling give the
    spec's bits, forward and backward."""
    for seed, rows in enumerate(_small_row_boundaries(lanes)):
        check_case(op, params, (rows, hidden), torch.bfloat16, torch.float32, seed,
                   specials=seed % 2 == 0)


@pytest.mark.parametrize("hidden", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_quad_forward_by_rows(dtype, hidden):
    """Few rows of 256 or 128 16-bit values with a weight of their dtype run the forward in
    vectors of four (``normspec_fwd_quad_kernel``: two warps a row of 256, one a row of
    128) while its lanes number at most SMs x 128, the warp teams past that: the spec's
    bits either way (rms, fused in both residual conventions, padded rows, the saved rstd
    and the backward after it), and the forward's kernel by rows."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bound = sms * 128 // (64 if hidden == 256 else 32)
    for rows in (1, 3, 64, bound, bound + 1):
        for op, params in (VARIANTS[1], VARIANTS[3], VARIANTS[5]):
            layouts = {"x": "row_stride", "residual": "row_stride"} if rows == 3 else None
            check_case(op, params, (rows, hidden), dtype, dtype, rows, specials=rows != 64,
                       layouts=layouts)
        op, params = VARIANTS[1]
        inputs, weight, _ = make_case(op, params, (rows, hidden), dtype, dtype, 0,
                                      specials=False)
        call = (op, {k: v.cuda() for k, v in inputs.items()}, weight.cuda(), EPS, params)
        names = cuda_kernel_names(lambda a=call: ext_forward(*a))
        want = "normspec_fwd_quad_kernel" if rows <= bound else "normspec_fwd_row_kernel"
        assert len(names) == 1 and want in names[0], (rows, names)


def test_many_rows_dweight_tree():
    # many groups in the workspace tree, a non-power-of-two row count
    check_case("rms_norm", {"offset": 0.0}, (100003, 64), torch.float32, torch.float32, 3,
               specials=False)


def test_negative_zero_padding():
    # rows a power of two: the spec's tree has no padding, so the -0.0 sums stay -0.0
    # (and no dweight group may be deeper than the rows); bf16 with a bf16 weight also
    # where the backward kernel stores dweight itself (one group)
    from normspec import spec

    shapes = [(3, 3), (5, 6), (1, 3), (1003, 37), (8, 4), (64, 2), (64, 16), (64, 1),
              (256, 1)]
    for dtype in (torch.float32, torch.bfloat16):
        for hidden, rows in shapes:
            x = torch.ones(rows, hidden, dtype=dtype)
            w = torch.ones(hidden, dtype=dtype)
            dy = torch.full((rows, hidden), -0.0, dtype=dtype)
            want = spec.rms_norm_backward(dy, x, w, eps=EPS)
            got = torch.ops.normspec.rms_norm_backward(dy.cuda(), x.cuda(), w.cuda(), EPS, 0.0)
            for name, g, ww in zip(("dx", "dweight"), got, want, strict=True):
                assert_bits(g, ww, f"{name} {dtype} {rows}x{hidden}")


def test_batch_invariance():
    x = torch.randn(1024, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2048, device="cuda")
    full = te.rms_norm(x, w, eps=EPS)
    for n in (1, 3, 17, 500):
        assert_bits(te.rms_norm(x[:n], w, eps=EPS), full[:n], f"prefix {n}")


def test_compile_and_cuda_graph():
    torch._dynamo.reset()
    x = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda")
    r = torch.randn_like(x)
    z = torch.randn_like(x)
    w = torch.randn(2048, device="cuda")

    def block(x, r, z, w):
        y, res = te.fused_add_rms_norm(x, r, w, eps=1e-6, offset=1.0)
        return te.rms_norm_gated(y, z, w, eps=1e-6), res

    eager = block(x, r, z, w)
    compiled = torch.compile(block, fullgraph=True)
    for g, e in zip(compiled(x, r, z, w), eager, strict=True):
        assert_bits(g, e, "compiled")
    reduce = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        outs = reduce(x, r, z, w)
    for g, e in zip(outs, eager, strict=True):
        assert_bits(g, e, "reduce-overhead")

    # explicit CUDA graph capture, forward and backward
    xs = x.clone().requires_grad_(True)
    ws = w.clone().requires_grad_(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            te.rms_norm(xs, ws, eps=EPS).float().sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    xs.grad = ws.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = te.rms_norm(xs, ws, eps=EPS)
        y.float().sum().backward()
    graph.replay()
    torch.cuda.synchronize()
    assert_bits(y, te.rms_norm(x, w, eps=EPS), "graph forward")
    from normspec import spec

    want = spec.rms_norm_backward(torch.ones_like(x).cpu(), x.cpu(), w.cpu(), eps=EPS)
    assert_bits(xs.grad, want[0], "graph dx")
    assert_bits(ws.grad, want[1], "graph dweight")


def test_opcheck_cuda():
    ops = torch.ops.normspec
    x = torch.randn(3, 40, device="cuda", requires_grad=True)
    w = torch.randn(40, device="cuda", requires_grad=True)
    torch.library.opcheck(ops.rms_norm, (x, w, 1e-6, 1.0))
    torch.library.opcheck(ops.fused_add_rms_norm, (x, x.detach().clone().requires_grad_(), w,
                                                   1e-6, 0.0, "rounded"))
    torch.library.opcheck(ops.rms_norm_gated, (x, x.detach().clone().requires_grad_(), w, 1e-6,
                                               "hf", "sigmoid"))
    sb = torch.randn(3, 40, device="cuda").bfloat16()
    torch.library.opcheck(ops.fused_add_rms_norm_backward_from_sum,
                          (sb, sb.clone(), sb.clone(), w.detach(), 1e-6, 1.0, "rounded"))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
@pytest.mark.parametrize("hidden", [128, 256])
@pytest.mark.parametrize("params", [v[1] for v in VARIANTS if v[0] == "rms_norm_gated"],
                         ids=lambda p: f"{p['convention']},{p['activation']}")
@pytest.mark.parametrize("reps", [1, 4], ids=lambda n: f"x{n}")
def test_every_bf16_gate_through_the_gate_table(params, hidden, wdtype, reps):
    """Large bf16 gated launches read act(z) and act'(z) from a table in shared memory
    for |z| in [2**-24, 2**8) and evaluate the rest directly: every one of the 2**16 bf16
    gates (zeros, subnormals, both table edges, inf and NaN included), in a launch big
    enough to use the table, gives the spec's bits forward and backward. The backward
    runs with the saved rstd too: rows of 128 and 256 then take the kernels with the
    convention as constants (one per convention and weight dtype). The transformers
    convention with a bf16 weight also runs with that weight scaled by 2**-126, 2**-133
    and 2**127, so that its products with the weight (packed bf16 ones in the forward's
    GT form 5 and the backward's GC 7) are
    subnormal, zero or overflow. Four times as many rows (``x4``) give the backward's plan
    dweight groups of two rows on an H200, and so the two-rows-a-team kernel
    (``normspec_gated_bwd_pair_kernel``, whose table lookups take two gates at once); at
    2**20 elements the groups have one row and the pipelined kernel runs."""
    gen = torch.Generator().manual_seed(11)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gates = every.view(torch.bfloat16)
    rows_n = reps * 2**20 // hidden
    gate = gates[torch.randperm(gates.numel(), generator=gen)].repeat(16 * reps)
    gate = gate.view(rows_n, hidden)
    x = torch.randn(rows_n, hidden, generator=gen).to(torch.bfloat16)
    base = torch.randn(hidden, generator=gen) * 0.1 + 1.0
    dy = torch.randn(rows_n, hidden, generator=gen).to(torch.bfloat16)
    rows = {"x": x, "gate": gate}
    crows = {k: v.cuda() for k, v in rows.items()}
    packed = params["convention"] == "hf" and wdtype == torch.bfloat16
    for scale in (1.0, 2.0**-126, 2.0**-133, 2.0**127) if packed else (1.0,):
        weight = (base * scale).to(wdtype)
        what = f"{params} weight x {scale}"
        want = spec_forward("rms_norm_gated", rows, weight, EPS, params)
        got = ext_forward("rms_norm_gated", crows, weight.cuda(), EPS, params)
        assert_bits(got[0], want[0], f"forward {what}")
        want_g = spec_backward("rms_norm_gated", [dy], rows, weight, EPS, params)
        *_, rstd = ext_forward_with_rstd("rms_norm_gated", crows, weight.cuda(), EPS, params)
        for saved in (None, rstd):
            got_g = ext_backward("rms_norm_gated", [dy.cuda()], crows, weight.cuda(), EPS,
                                 params, rstd=saved)
            for name, g, w in zip(grad_names("rms_norm_gated"), got_g, want_g, strict=True):
                assert_bits(g, w, f"{name} {what} saved rstd: {saved is not None}")


@pytest.mark.parametrize("wdtype,extra", [(torch.float32, 1), (torch.bfloat16, 13)],
                         ids=["w32", "w16"])
@pytest.mark.parametrize("hidden", [128, 256])
@pytest.mark.parametrize("params", [v[1] for v in VARIANTS if v[0] == "rms_norm_gated"],
                         ids=lambda p: f"{p['convention']},{p['activation']}")
@pytest.mark.parametrize("per_team", [1, 2, 8], ids=lambda n: f"rows{n}xteams")
def test_gate_table_backward_over_dweight_groups(params, hidden, wdtype, extra, per_team):
    """The gate-table backward with the saved rstd runs the kernels with the convention
    as constants, the two-rows-a-team kernel (``normspec_gated_bwd_pair_kernel``). With as
    many rows as the device holds teams, twice and eight times
    as many, the plan's dweight groups have two, four and sixteen rows (glog 1: every
    pair is a group; 2 and 4: the stack's levels), and the last group is part full (odd,
    too): its inactive rows must neither be stored nor reach dweight. The spec's bits,
    and the profiler shows that kernel ran (for the transformers convention with a bf16
    weight GC 7). (2**20 elements, the other tests' size, plan glog 0 on an H200: groups of
    one row, the pipelined kernel.)"""
    import re

    if per_team == 8 and (params["convention"] != "vllm" or wdtype != torch.float32):
        pytest.skip("the largest shape (17 M elements) once: the stack's deeper levels")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    team_log = (hidden // 8).bit_length() - 1  # one vector of 8 bf16 per lane
    teams = sms * (2048 // 256) * (256 >> team_log)
    shape = (per_team * teams + extra, hidden)
    check_case("rms_norm_gated", params, shape, torch.bfloat16, wdtype, extra, specials=True)

    rows, weight, grads = make_case("rms_norm_gated", params, shape, torch.bfloat16, wdtype,
                                    extra, specials=True)
    crows = {k: v.cuda() for k, v in rows.items()}
    cw, cdy = weight.cuda(), grads[0].cuda()
    *_, rstd = ext_forward_with_rstd("rms_norm_gated", crows, cw, EPS, params)
    names = cuda_kernel_names(lambda: ext_backward("rms_norm_gated", [cdy], crows, cw, EPS,
                                                   params, rstd=rstd))
    gc = 0 if params["convention"] == "vllm" else 1 if wdtype == torch.float32 else 7
    gc_kernel = re.compile(rf"normspec_gated_bwd_pair_kernel<__nv_bfloat16, {team_log}, {gc}>")
    assert any(gc_kernel.search(n) for n in names), names




@pytest.mark.parametrize("hidden", [24, 128, 2048, 5000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("op,params", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_one_row_backward_is_one_launch(op, params, dtype, hidden):
    """One row with a weight of the input's 16-bit dtype: the backward's one dweight
    group is dweight, which the kernel stores rounded to that dtype itself (no
    workspace tree, no cast launch). The bits equal the spec's (specials included,
    with and without the saved rstd) and the backward is a single kernel: the one-row
    rms kernel where the row fills a constant geometry (H = 128 and 2048), else the
    pipelined kernel."""
    import re

    check_case(op, params, (1, hidden), dtype, dtype, hidden, specials=True)
    check_case(op, params, (1, hidden), dtype, dtype, hidden + 1, specials=False)
    rows, weight, grads = make_case(op, params, (1, hidden), dtype, dtype, 0, specials=False)
    crows = {k: v.cuda() for k, v in rows.items()}
    cw, cgrads = weight.cuda(), [g.cuda() for g in grads]
    *_, rstd = ext_forward_with_rstd(op, crows, cw, EPS, params)
    row_kernel = op == "rms_norm" and hidden in (128, 2048)
    kernel = "normspec_bwd_row_kernel" if row_kernel else "normspec_bwd_pipe_kernel"
    # the 2048-wide row in 256 threads of one pass
    wide = row_kernel and hidden == 2048
    form = re.compile(r"normspec_bwd_row_kernel<[^,]+, 1, 8," if wide else kernel)
    for saved in (None, rstd):
        names = cuda_kernel_names(lambda saved=saved: ext_backward(op, cgrads, crows, cw, EPS,
                                                                   params, rstd=saved))
        assert len(names) == 1 and form.search(names[0]), names




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_one_row_backward_form_by_rows(dtype):
    """One-row dweight groups of rows of 2048: 256 threads of one pass while the blocks fit
    the device at once (at most 8 per SM), 128 threads of two passes past that; the
    spec's bits either way, with and without the saved rstd."""
    import re

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    op, params = VARIANTS[1]  # rms_norm, offset 1
    # 15 x SMs rows: still one row a dweight group (the plan's first level comes at
    # about 16 x SMs), past the default bound
    for rows in (1, 64, 8 * sms, 8 * sms + 1, 15 * sms):
        check_case(op, params, (rows, 2048), dtype, dtype, rows, specials=False)
        inputs, weight, grads = make_case(op, params, (rows, 2048), dtype, dtype, 1,
                                          specials=False)
        crows = {k: v.cuda() for k, v in inputs.items()}
        cw, cgrads = weight.cuda(), [g.cuda() for g in grads]
        *_, rstd = ext_forward_with_rstd(op, crows, cw, EPS, params)
        form = r", 1, 8," if rows <= 8 * sms else r", 2, 7,"
        for saved in (None, rstd):
            names = cuda_kernel_names(lambda c=(cgrads, crows, cw), saved=saved: ext_backward(
                op, *c, EPS, params, rstd=saved))
            kernels = [n for n in names if "normspec_bwd" in n]
            assert len(kernels) == 1 and re.search(
                r"normspec_bwd_row_kernel<[^,]+" + form, kernels[0]), (rows, names)




# ---- the gated forward's gate table in global memory --------------------------------------
ROW_TABLE_CHILD = r"""
import os
import re
import sys
sys.path.insert(0, sys.argv[1])
import torch
import test_torch_ext_cuda as t
from _torch_ext_cases import VARIANTS
t.te.build()
gen = torch.Generator().manual_seed(5)
every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
rows_n, hidden = 32768, 128  # rows enough for the two-pass row geometry (teams of 8)
gate = every[torch.randperm(every.numel(), generator=gen)].repeat(64).view(rows_n, hidden)
x = torch.randn(rows_n, hidden, generator=gen).to(torch.bfloat16)
w = torch.randn(hidden, generator=gen) * 0.1 + 1.0
rows = {"x": x, "gate": gate}
crows = {k: v.cuda() for k, v in rows.items()}
cw = w.cuda()
for _, params in [v for v in VARIANTS if v[0] == "rms_norm_gated"]:
    want = t.spec_forward("rms_norm_gated", rows, w, t.EPS, params)
    if params["activation"] == "silu" and params["convention"] == "vllm":
        # the first use of the table inside a CUDA graph capture: not filled there, so
        # the capture holds the persistent kernel, and the replay gives the spec's bits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = t.ext_forward("rms_norm_gated", crows, cw, t.EPS, params)
        graph.replay()
        torch.cuda.synchronize()
        t.assert_bits(out[0], want[0], f"graph {params}")
    names = t.cuda_kernel_names(lambda: t.ext_forward("rms_norm_gated", crows, cw, t.EPS,
                                                      params))
    # the vllm convention's own form (1); the transformers convention's with its constants
    # (2: this fp32 weight)
    form = "(true|1)" if params["convention"] == "vllm" else "2"
    kernel = re.compile(rf"normspec_fwd_row_kernel<2, __nv_bfloat16, 2, 3, (true|1), {form}>")
    assert any(kernel.search(n) for n in names), names
    got = t.ext_forward("rms_norm_gated", crows, cw, t.EPS, params)
    t.assert_bits(got[0], want[0], f"every gate {params}")
    # a bf16 weight, which the kernels read as it is (F_W_RAW: a launch that set its flags
    # apart from the weight's pointer could read it as fp32)
    got = t.ext_forward("rms_norm_gated", crows, cw.to(torch.bfloat16), t.EPS, params)
    t.assert_bits(got[0], t.spec_forward("rms_norm_gated", rows, w.to(torch.bfloat16), t.EPS,
                                         params)[0], f"bf16 weight {params}")
    # a weight of the input dtype: the hf form with its product in packed bf16 (5); the
    # vllm form with F_W_RAW as a constant (4)
    w16_form = "5" if params["convention"] == "hf" else "4"
    names = t.cuda_kernel_names(lambda: t.ext_forward("rms_norm_gated", crows,
                                                      cw.to(torch.bfloat16), t.EPS, params))
    w16 = re.compile(rf"normspec_fwd_row_kernel<2, __nv_bfloat16, 2, 3, (true|1), {w16_form}>")
    assert any(w16.search(n) for n in names), names
    if params["convention"] == "hf":
        # bf16 weights whose products with the rounded xhat leave the normal range: bf16
        # subnormals, zeros of either sign, overflow (form 5's packed product, and every
        # form's rounding of them)
        for scale in (2.0**-126, 2.0**-133, 2.0**127):
            wx = (w * scale).to(torch.bfloat16)
            got = t.ext_forward("rms_norm_gated", crows, wx.cuda(), t.EPS, params)
            t.assert_bits(got[0], t.spec_forward("rms_norm_gated", rows, wx, t.EPS, params)[0],
                          f"bf16 weight x {scale} {params}")
    # fewer rows than a multiple of a warp's teams, and rows apart in memory (x and the
    # gate as halves of wider rows, as a projection's split gives them)
    tail = {k: v[: rows_n - 3] for k, v in rows.items()}
    got = t.ext_forward("rms_norm_gated", {k: v.cuda() for k, v in tail.items()}, cw, t.EPS,
                        params)
    t.assert_bits(got[0], t.spec_forward("rms_norm_gated", tail, w, t.EPS, params)[0],
                  f"tail {params}")
    wide = torch.cat([crows["x"], crows["gate"]], dim=1)
    split = {"x": wide[:, :hidden], "gate": wide[:, hidden:]}
    got = t.ext_forward("rms_norm_gated", split, cw, t.EPS, params)
    t.assert_bits(got[0], want[0], f"strided rows {params}")
    # the rstd the forward saves: the backward reading it gives the recomputing one's bits
    *out, rstd = t.ext_forward_with_rstd("rms_norm_gated", crows, cw, t.EPS, params)
    t.assert_bits(out[0], want[0], f"with rstd {params}")
    dy = (torch.randn(rows_n, hidden, generator=gen).to(torch.bfloat16).cuda(),)
    saved = t.ext_backward("rms_norm_gated", dy, crows, cw, t.EPS, params, rstd=rstd)
    for g, r in zip(saved, t.ext_backward("rms_norm_gated", dy, crows, cw, t.EPS, params)):
        t.assert_bits(g, r, f"backward from the saved rstd {params}")
print("ok")
"""


def test_gated_forward_every_gate_per_table():
    """Every one of the 2**16 bf16 gates, both conventions and activations, gives the
    spec's bits through the large gated forward: the one-row kernel with the gate table in
    global memory (each convention in a form of its own, the transformers convention's
    weight product in packed bf16 for a bf16 weight, also for weights whose products are
    subnormal, zero or overflow; the profiler shows which kernel ran); the same holds for a
    bf16 weight, for a tail of fewer rows than a warp's teams, for rows apart in memory
    and for the forward that saves rstd; and a first use inside a CUDA graph capture
    (where the global table is not filled, so the capture holds the persistent kernel with
    a table per block) gives them too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    # eager module loading: no kernel is first loaded inside the capture
    env = {**os.environ, "CUDA_MODULE_LOADING": "EAGER"}
    done = subprocess.run([sys.executable, "-c", ROW_TABLE_CHILD, tests], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"rc={done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


# ---- the dweight tree's tail ------------------------------------------------------------
def _levels_before_the_last(g: int) -> int:
    """The 16-row tree levels that take ``g`` workspace rows down to at most 256."""
    n = 0
    while g > 256:
        c = min(1 << (g - 1).bit_length(), 16)
        g, n = -(-g // c), n + 1
    return n


def test_backward_ends_with_one_tree_kernel():
    """dweight's last tree levels and its cast to the weight's dtype are one launch:
    after the backward kernel come only the 16-row levels that take the groups down to
    at most 256 rows, then one ``normspec_col_tree_last_kernel`` (none for one group with
    an fp32 weight, whose workspace row is the answer, or with a weight of the 16-bit
    input's dtype, which the backward kernel stores itself); the bits equal the spec's at
    every tree width. The tree's width is the plan's dweight groups (the CuPy backend's
    mirror of the launcher's plan, which tests/test_cupy_nvrtc.py holds to the C++ one);
    bf16 rows of 256 with one-row groups run the one-row rms kernel."""
    from normspec import spec
    from normspec.backends.cupy import codes as cb_codes
    from normspec.backends.cupy import geometry as cb_geometry

    props = torch.cuda.get_device_properties(0)
    sms, optin = props.multi_processor_count, props.shared_memory_per_block_optin
    codes = {torch.float32: cb_codes.DT_F32, torch.bfloat16: cb_codes.DT_BF16,
             torch.float16: cb_codes.DT_F16}
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 2, 3, 15, 16, 17, 100, 255, 256, 257, 4096, 4097, 70000):
        for dtype, wdtype, hidden in ((torch.bfloat16, torch.bfloat16, 256),
                                      (torch.bfloat16, torch.float32, 256),
                                      (torch.float16, torch.float16, 24),
                                      (torch.float32, torch.float32, 64)):
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            dy = torch.randn(rows, hidden, generator=gen).to(dtype)
            w = torch.randn(hidden, generator=gen).to(wdtype)
            want = spec.rms_norm_backward(dy, x, w, eps=1e-6)
            xc, dyc, wc = x.cuda(), dy.cuda(), w.cuda()
            got = torch.ops.normspec.rms_norm_backward(dyc, xc, wc, 1e-6, 0.0)
            what = f"rows={rows} {dtype}/{wdtype} H={hidden}"
            for name, g, ww in zip(("dx", "dweight"), got, want, strict=True):
                assert_bits(g, ww, f"{name} {what}")
            names = cuda_kernel_names(
                lambda xc=xc, dyc=dyc, wc=wc: torch.ops.normspec.rms_norm_backward(
                    dyc, xc, wc, 1e-6, 0.0))
            main = [i for i, n in enumerate(names) if "normspec_bwd" in n]
            assert len(main) == 1, (what, names)
            _tl, _np, glog, groups = cb_geometry.pipe_backward_plan(codes[dtype], rows, hidden,
                                                                    sms, optin)
            if dtype == torch.bfloat16 and hidden == 256:
                assert ("bwd_row" in names[main[0]]) == (glog == 0), (what, names)
            tail = names[main[0] + 1:]
            # one group: an fp32 weight's dweight is the workspace row; a 16-bit weight of
            # the input's dtype is stored by the backward kernel
            one_launch = wdtype == torch.float32 or wdtype == dtype
            last = [] if groups == 1 and one_launch else ["col_tree_last"]
            want_tail = ["normspec_col_tree_kernel"] * _levels_before_the_last(groups) + last
            assert len(tail) == len(want_tail) and all(
                k in n for k, n in zip(want_tail, tail, strict=True)), (what, names)
