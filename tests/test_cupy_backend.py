"""The CuPy backend on a GPU: bitwise equal to the spec (computed on the CPU) and to the
torch extension, forward and backward, for torch tensors and CuPy arrays, on the
caller's current stream. Skipped without a GPU or without CuPy."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import textwrap
import threading
from typing import Any, NamedTuple

import pytest
import torch
from _torch_ext_cases import (
    DTYPE_PAIRS,
    LAYOUTS,
    N_OUT,
    ROW_INPUTS,
    VARIANTS,
    assert_bits,
    cuda_kernel_names,
    ext_backward,
    ext_forward,
    grad_names,
    layout,
    make_case,
    spec_backward,
    spec_forward,
    spec_rstd,
)

pytestmark = pytest.mark.cuda

cp = pytest.importorskip("cupy")

from normspec import spec  # noqa: E402
from normspec.backends import cupy as cb  # noqa: E402
from normspec.backends.cupy.codes import (  # noqa: E402
    DT_BF16,
    OP_RMS,
)
from normspec.backends.cupy.planner import (  # noqa: E402
    K_BWD_PAIR,
    K_BWD_PIPE,
    K_BWD_ROW,
    K_FWD_PIPE,
    K_FWD_QUAD,
    K_FWD_ROW,
)

EPS = 1e-6
SHAPES = [(5, 1), (3, 7), (2, 3, 64), (9, 1003), (3, 2048), (33, 130), (4, 8192), (2, 12000),
          (2, 40000), (1, 5000)]


@pytest.fixture(scope="module", autouse=True)
def _ready():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    reason = cb.available()
    if reason is not None:
        pytest.fail(f"cupy backend unavailable on a GPU machine: {reason}")


@pytest.fixture(scope="module")
def ext():
    """The torch extension, when it can be built here (else None)."""
    from normspec.backends import torch_ext as te

    if te.cuda_build_possible() is not None:
        return None
    te.build(verbose=True)
    return te


def _on_cuda(t: torch.Tensor, kind: str = "contiguous") -> torch.Tensor:
    """``t`` on the GPU in the memory layout ``kind`` (strides and offset preserved)."""
    base = layout(t, kind)
    storage = torch.empty(base.untyped_storage().size() // base.element_size(), dtype=t.dtype,
                          device="cuda")
    out = storage.as_strided(base.shape, base.stride(), base.storage_offset())
    out.copy_(base)
    return out


def _cupy_supports(dtype: torch.dtype) -> bool:
    try:
        cp.from_dlpack(torch.zeros(2, dtype=dtype, device="cuda"))
    except Exception:
        return False
    return True


def _to_cupy(t: torch.Tensor):
    return cp.from_dlpack(t.detach())


def _to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


def _call(op, rows, weight, eps, params):
    fn = getattr(cb, op)
    out = fn(*rows.values(), weight, eps=eps, **params)
    return out if isinstance(out, tuple) else (out,)


def _call_backward(op, grads, rows, weight, eps, params):
    fn = getattr(cb, f"{op}_backward")
    return fn(*grads, *rows.values(), weight, eps=eps, **params)


def check_with_rstd(op, params, rows, weight, grads, eps, want, want_g, ctx,
                    to_torch=lambda t: t):
    """The ``*_with_rstd`` forward gives the spec's outputs and rstd (computed on the CPU),
    the explicit backward given that rstd the spec's gradients, and for a fused add whose
    new residual is the sum its norm read, the backward from that sum too."""
    out = getattr(cb, f"{op}_with_rstd")(*rows.values(), weight, eps=eps, **params)
    for i, (g, w) in enumerate(zip(out[:-1], want, strict=True)):
        assert_bits(to_torch(g), w, f"with_rstd forward output {i} of {ctx}")
    cpu_rows = {k: to_torch(v).cpu() for k, v in rows.items()}
    assert_bits(to_torch(out[-1]), spec_rstd(op, cpu_rows, eps, params), f"rstd of {ctx}")
    got_g = getattr(cb, f"{op}_backward")(*grads, *rows.values(), weight, eps=eps, **params,
                                          rstd=out[-1])
    for name, g, w in zip(grad_names(op), got_g, want_g, strict=True):
        assert_bits(to_torch(g), w, f"{name} with the saved rstd, {ctx}")
    if op == "fused_add_rms_norm" and (params["residual_sum"] == "rounded"
                                       or cpu_rows["x"].dtype == torch.float32):
        ds, dw = cb.fused_add_rms_norm_backward_from_sum(*grads, out[1], weight, eps=eps,
                                                         **params, rstd=out[-1])
        assert_bits(to_torch(ds), want_g[0], f"ds (dx) from the sum, {ctx}")
        assert_bits(to_torch(ds), want_g[1], f"ds (dresidual) from the sum, {ctx}")
        assert_bits(to_torch(dw), want_g[2], f"dweight from the sum, {ctx}")


def check_torch(op, params, shape, dtype, wdtype, seed, *, ext=None, layouts=None,
                specials=True, eps=EPS):
    """Forward and autograd gradients on torch CUDA tensors vs the spec (and the extension)."""
    rows, weight, grads = make_case(op, params, shape, dtype, wdtype, seed, specials=specials)
    ctx = f"{op} {params} shape={tuple(shape)} {dtype}/{wdtype} seed={seed} layouts={layouts}"
    layouts = layouts or {}
    want = spec_forward(op, rows, weight, eps, params)
    want_g = spec_backward(op, grads, rows, weight, eps, params)
    crows = {k: _on_cuda(v, layouts.get(k, "contiguous")).requires_grad_(True)
             for k, v in rows.items()}
    cw = weight.cuda().requires_grad_(True)
    got = _call(op, crows, cw, eps, params)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert isinstance(g, torch.Tensor) and g.device.type == "cuda"
        assert_bits(g, w, f"cupy forward output {i} of {ctx}")
    cgrads = [_on_cuda(g, layouts.get("grad", "contiguous")) for g in grads]
    got_g = torch.autograd.grad(got, [*crows.values(), cw], cgrads)
    for name, g, w in zip(grad_names(op), got_g, want_g, strict=True):
        assert_bits(g, w, f"cupy autograd {name} of {ctx}")
    # the explicit backward functions give the same bits
    plain = {k: v.detach() for k, v in crows.items()}
    for name, g, w in zip(grad_names(op), _call_backward(op, cgrads, plain, cw.detach(), eps,
                                                          params), want_g, strict=True):
        assert_bits(g, w, f"cupy {op}_backward {name} of {ctx}")
    check_with_rstd(op, params, plain, cw.detach(), cgrads, eps, want, want_g, ctx)
    if ext is not None:
        from _torch_ext_cases import ext_backward, ext_forward

        for i, (g, e) in enumerate(zip(got, ext_forward(op, plain, cw.detach(), eps, params),
                                       strict=True)):
            assert_bits(g, e, f"cupy vs torch_ext forward output {i} of {ctx}")
        for name, g, e in zip(grad_names(op), got_g,
                              ext_backward(op, cgrads, plain, cw.detach(), eps, params),
                              strict=True):
            assert_bits(g, e, f"cupy vs torch_ext {name} of {ctx}")


def check_cupy(op, params, shape, dtype, wdtype, seed, *, layouts=None, specials=True,
               eps=EPS):
    """Forward and the explicit backward on CuPy arrays vs the spec; results are CuPy."""
    rows, weight, grads = make_case(op, params, shape, dtype, wdtype, seed, specials=specials)
    ctx = f"cupy arrays {op} {params} shape={tuple(shape)} {dtype}/{wdtype} seed={seed}"
    layouts = layouts or {}
    want = spec_forward(op, rows, weight, eps, params)
    want_g = spec_backward(op, grads, rows, weight, eps, params)
    arows = {k: _to_cupy(_on_cuda(v, layouts.get(k, "contiguous"))) for k, v in rows.items()}
    aw = _to_cupy(weight.cuda())
    got = _call(op, arows, aw, eps, params)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert isinstance(g, cp.ndarray), type(g)
        assert_bits(_to_torch(g), w, f"forward output {i} of {ctx}")
    agrads = [_to_cupy(_on_cuda(g, layouts.get("grad", "contiguous"))) for g in grads]
    got_g = _call_backward(op, agrads, arows, aw, eps, params)
    for name, g, w in zip(grad_names(op), got_g, want_g, strict=True):
        assert isinstance(g, cp.ndarray), type(g)
        assert_bits(_to_torch(g), w, f"{name} of {ctx}")
    check_with_rstd(op, params, arows, aw, agrads, eps, want, want_g, ctx, to_torch=_to_torch)


_ids = dict(ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))


@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op,params", VARIANTS, **_ids)
def test_torch_inputs_every_variant(op, params, dtype, wdtype, ext):
    for seed, shape in enumerate(SHAPES):
        check_torch(op, params, shape, dtype, wdtype, seed, ext=ext, specials=seed % 2 == 1)


@pytest.mark.parametrize("dtype,wdtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op,params", VARIANTS, **_ids)
def test_cupy_inputs_every_variant(op, params, dtype, wdtype):
    if not _cupy_supports(dtype):
        pytest.skip(f"this CuPy has no {dtype} arrays (bfloat16 needs ml_dtypes)")
    for seed, shape in enumerate([(5, 1), (9, 1003), (3, 2048), (4, 8192), (2, 12000)]):
        check_cupy(op, params, shape, dtype, wdtype, seed, specials=seed % 2 == 1)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("op,params", VARIANTS[::3], **_ids)
def test_layouts(op, params, kind, ext):
    layouts = {"x": kind, "residual": kind, "gate": kind, "grad": kind}
    for seed, shape in enumerate([(4, 3, 1003), (2, 5, 2048), (3, 2, 8)]):
        for dtype, wdtype in DTYPE_PAIRS[:3]:
            check_torch(op, params, shape, dtype, wdtype, seed, ext=ext, layouts=layouts)
            if _cupy_supports(dtype):
                check_cupy(op, params, shape, dtype, wdtype, seed, layouts=layouts)


@pytest.mark.parametrize("shape", [(2**16, 128), (4096, 2048), (64, 8192), (1000, 1),
                                   (513, 1003), (300, 33000)])
@pytest.mark.parametrize("op,params", [VARIANTS[1], VARIANTS[4], VARIANTS[9]], **_ids)
def test_large_shapes(op, params, shape, ext):
    check_torch(op, params, shape, torch.bfloat16, torch.float32, 1, ext=ext)
    check_cupy(op, params, shape, torch.float16, torch.float16, 2)


class Picked(NamedTuple):
    """A launch plan the backend asked for, with its kernel's name expression."""

    name: str
    plan: Any

    @property
    def kind(self) -> str:
        """``"row"``, ``"pair"`` or ``"pipe"``: which backward kernel of the pipelined family."""
        return {K_BWD_ROW: "row", K_BWD_PAIR: "pair"}.get(self.plan.kernel, "pipe")


def record_plans(monkeypatch, *kernels: int, gt: bool | None = None) -> list[Picked]:
    """Wraps the backend's launch plan; returns the plans it gave of the kernel families
    ``kernels`` (with ``gt``, only the one-row forwards that do or do not read the global
    gate table)."""
    picked: list[Picked] = []
    real = cb.plans.launch_plan

    def spy(q):
        p = real(q)
        if p.kernel in kernels and (gt is None or bool(p.gt_form) == gt):
            picked.append(Picked(cb.launches.kernel_name(q.op, q.dtype, p), p))
        return p

    monkeypatch.setattr(cb.plans, "launch_plan", spy)
    return picked


def test_aligned_rows_pick_the_forward_kernel(monkeypatch, ext):
    """Aligned rows of at most 1024 vectors run the one-row forward (as in the torch
    extension), large gated ones the persistent forward with its gate table: the spec's
    bits, at few rows (wider teams), at full launches (the constant forms) and on ragged
    rows; both weights' dtypes."""
    picked = record_plans(monkeypatch, K_FWD_ROW, gt=False)
    persistent = record_plans(monkeypatch, K_FWD_PIPE)
    for seed, shape in enumerate([(1, 2048), (64, 2048), (4096, 2048), (20000, 256),
                                  (333, 1003), (7, 8)]):
        for op, params in (VARIANTS[1], VARIANTS[4], VARIANTS[9]):
            wdtype = (torch.float32, torch.bfloat16)[seed % 2]
            check_torch(op, params, shape, torch.bfloat16, wdtype, seed, ext=ext)
    assert picked
    # the persistent forward for the large gated launches alone (the gate table)
    assert persistent and all(p.plan.table for p in persistent)
    assert any(p.name.endswith(", -1>") for p in picked)  # the general form
    assert any(not p.name.endswith(", -1>") for p in picked)  # the constant forms


def test_aligned_rows_pick_the_pipelined_backward(monkeypatch, ext):
    """Aligned rows of at most 1024 vectors run the torch extension's pipelined backward
    (persistent teams, dweight stacks in shared memory): the spec's bits (and the
    extension's) for one-pass and two-pass teams, the constant forms, ragged rows, groups
    that outnumber the resident teams, and a bf16 gated launch large enough for the gate
    table (which needs the shared-memory opt-in)."""
    picked = record_plans(monkeypatch, K_BWD_ROW, K_BWD_PIPE, K_BWD_PAIR)
    for seed, shape in enumerate([(1, 2048), (4096, 2048), (20000, 256), (333, 1003),
                                  (7, 8)]):
        for op, params in (VARIANTS[1], VARIANTS[4], VARIANTS[9]):
            check_torch(op, params, shape, torch.bfloat16, torch.float32, seed, ext=ext)
    for op, params in (VARIANTS[7], VARIANTS[10]):  # 2**20 elements: the gate table
        check_torch(op, params, (8192, 128), torch.bfloat16, torch.bfloat16, 11, ext=ext)
    assert picked
    pipes = [p for p in picked if p.kind == "pipe"]  # (the others: one-row, pair)
    assert any(p.name.split(", ")[3] == "-1" for p in pipes)  # the general form
    assert any(p.name.split(", ")[3] != "-1" for p in pipes)  # the constant forms
    assert {p.kind for p in picked} == {"pipe", "row", "pair"}
    assert any(p.plan.table for p in picked)  # the gate table
    assert any(p.plan.smem + 2048 > 48 * 1024 for p in picked)  # the opt-in



@pytest.mark.parametrize("op,params", [v for v in VARIANTS if v[0] == "rms_norm_gated"],
                         **_ids)
def test_gated_backward_with_the_saved_rstd(op, params, monkeypatch, ext):
    """Large bf16 gated launches through autograd (the forward's rstd saved) run the
    extension's gate-table forms with the convention as constants: the pair kernel where
    the dweight groups hold two rows or more (2**16 x 128: groups of 4), the pipelined
    kernel's constant form for one-row groups (8192 x 256); the explicit backward
    recomputes rstd (the run-time form). Every one gives the spec's bits (and the
    extension's), bf16 and fp32 weights, and the hf convention's packed-weight form
    (GC 7)."""
    picked = record_plans(monkeypatch, K_BWD_ROW, K_BWD_PIPE, K_BWD_PAIR)
    for seed, (shape, wdtype) in enumerate([((2**16, 128), torch.bfloat16),
                                            ((2**16, 128), torch.float32),
                                            ((8192, 256), torch.bfloat16)]):
        check_torch(op, params, shape, torch.bfloat16, wdtype, seed, ext=ext)
    kinds = {(p.kind, p.name.split(", ")[-1].rstrip(">")) for p in picked}
    hf = params["convention"] == "hf"
    assert ("pair", "7" if hf else "0") in kinds and ("pipe", "-1") in kinds
    assert ("pair", "1") in kinds if hf else ("pair", "1") not in kinds
    assert any(p.kind == "pipe" and p.name.endswith(", true, 7>" if hf else ", true, 0>")
               for p in picked)


def test_one_row_backward_and_dweight_stored_by_its_kernel(monkeypatch, ext):
    """Few rows of the rms norm run the one-row backward (256 x 1 for 2048 elements of 16
    bits), with and without the saved rstd; one dweight group of a weight of the input
    dtype is stored by the kernel itself (F_DW_FINAL): the spec's bits."""
    picked = record_plans(monkeypatch, K_BWD_ROW, K_BWD_PIPE, K_BWD_PAIR)
    for seed, shape in enumerate([(1, 2048), (64, 2048), (1, 256), (7, 128), (1, 1024)]):
        for dtype, wdtype in DTYPE_PAIRS:
            for op, params in (VARIANTS[1], VARIANTS[4]):
                check_torch(op, params, shape, dtype, wdtype, seed, ext=ext)
    names = {p.name for p in picked}
    assert {"normspec_bwd_row_kernel<__nv_bfloat16, 1, 8, true>",
            "normspec_bwd_row_kernel<__half, 1, 8, false>",
            "normspec_bwd_row_kernel<float, 1, 5, true>"} <= names
    assert any(n.startswith("normspec_bwd_pipe_kernel<3, ") for n in names)  # from the sum


def test_quad_forward_for_few_rows_of_256_and_128(monkeypatch, ext):
    """Few rows of 256 or 128 16-bit values with a weight of their dtype run the forward in
    vectors of four (``K_FWD_QUAD``) as in the torch extension, up to SMs x 128
    lanes; past that, and with an fp32 weight, the warp teams: the spec's bits either way,
    padded rows and the backward included."""
    picked = record_plans(monkeypatch, K_FWD_QUAD)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for seed, hidden in enumerate((128, 256)):
        bound = sms * 128 // (64 if hidden == 256 else 32)
        for rows in (1, 3, bound, bound + 1):
            for dtype, wdtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                  (torch.bfloat16, torch.float32)):
                for op, params in (VARIANTS[1], VARIANTS[4]):
                    layouts = {"x": "row_stride"} if rows == 3 else None
                    check_torch(op, params, (rows, hidden), dtype, wdtype, seed, ext=ext,
                                layouts=layouts)
    quads = set(picked)
    assert {p.name for p in quads} == {f"normspec_fwd_quad_kernel<{op}, {t}, {ll}>"
                                     for op in (0, 1) for t in ("__nv_bfloat16", "__half")
                                     for ll in (5, 6)}
    # four rows of 256 or eight of 128 a block: one block for 1 and 3 rows, SMs / 2 at the
    # bound
    assert {p.plan.grid for p in quads} == {1, -(-sms // 2)}
    assert {p.plan.block_x for p in quads} == {256}


def _every_bf16_gate(rows_n: int, hidden: int) -> dict[str, torch.Tensor]:
    """x (randn) and a gate holding every one of the 2**16 bf16 values, shuffled, as
    rows_n x hidden bf16 rows (rows_n * hidden a multiple of 2**16)."""
    gen = torch.Generator().manual_seed(5)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    reps = rows_n * hidden // every.numel()
    gate = every[torch.randperm(every.numel(), generator=gen)].repeat(reps).view(rows_n, hidden)
    return {"x": torch.randn(rows_n, hidden, generator=gen).to(torch.bfloat16), "gate": gate}


GATED = [v for v in VARIANTS if v[0] == "rms_norm_gated"]


@pytest.mark.parametrize("shape", [(8192, 128), (1000, 2048), (12000, 104)])
def test_gated_forward_on_the_persistent_kernel(shape, monkeypatch, ext):
    """Large bf16 gated forwards that the global table's forms do not take run the
    persistent forward with the gate table in each block's shared memory, as in the torch
    extension: 8192 x 128 (few rows: the one-row teams widen to one pass, the constant
    form of 16 lanes), 1000 x 2048 (past the global table's rows) and 12000 x 104 (rows
    that fill no team, 16-byte aligned: the general form). The spec's bits and the
    extension's, both conventions and activations, both weights' dtypes, forward and
    backward."""
    persistent = record_plans(monkeypatch, K_FWD_PIPE)
    for seed, (op, params) in enumerate(GATED):
        wdtype = (torch.float32, torch.bfloat16)[seed % 2]
        check_torch(op, params, shape, torch.bfloat16, wdtype, seed, ext=ext)
    assert persistent and all(p.plan.table for p in persistent)
    constant = shape == (8192, 128)
    assert all(p.name.endswith(", 4>" if constant else ", -1>") for p in persistent)


def test_gated_forward_every_gate_per_table(monkeypatch):
    """Every one of the 2**16 bf16 gates, both conventions and activations, gives the
    spec's bits through the large gated forward: the one-row forms that read act(z) from
    the gate table in global memory (``global_table_plan``), as in the torch
    extension. (The persistent forward, whose blocks build the table in shared memory,
    runs every gate in the graph-capture test below.)"""
    picked = record_plans(monkeypatch, K_FWD_ROW, gt=True)
    rows = _every_bf16_gate(32768, 128)
    w32 = torch.randn(128, generator=torch.Generator().manual_seed(6)) * 0.1 + 1.0
    crows = {k: v.cuda() for k, v in rows.items()}
    for w in (w32, w32.to(torch.bfloat16)):
        for op, params in GATED:
            want = spec_forward(op, rows, w, EPS, params)
            got = cb.rms_norm_gated(crows["x"], crows["gate"], w.cuda(), eps=EPS, **params)
            assert_bits(got, want[0], f"every gate {params} weight {w.dtype}")
    # the GT forms (gt_form): vllm 1, hf 2 (fp32 weight); 4, 5 (bf16 weight as it is)
    forms = [1, 1, 2, 2, 4, 4, 5, 5]
    assert [c["convention"] for _, c in GATED] == ["vllm", "vllm", "hf", "hf"]
    assert [p.name for p in picked] == [
        f"normspec_fwd_row_kernel<2, __nv_bfloat16, 2, 3, true, {f}>" for f in forms]
    filled = cb.device.state(torch.cuda.current_device()).gate_tables_filled
    assert filled == {False, True}  # both activations


def test_gated_row_table_first_use_inside_a_graph_capture(monkeypatch):
    """A first large bf16 gated forward inside a CUDA graph capture (torch tensors, the
    caller's capturing stream) fills no table there, which needs a launch and a wait: the
    capture holds the persistent forward, whose blocks build the table in shared memory
    (as the torch extension's does), and its replay gives the spec's bits. The next call
    outside the capture fills the table and uses it. Every one of the 2**16 bf16 gates
    gives the spec's bits through that persistent forward."""
    monkeypatch.setattr(cb.device, "_states", {})
    picked = record_plans(monkeypatch, K_FWD_PIPE)
    rows = _every_bf16_gate(32768, 128)
    w = torch.randn(128, generator=torch.Generator().manual_seed(7)) * 0.1 + 1.0
    crows = {k: v.cuda() for k, v in rows.items()}
    cw = w.cuda()
    op, params = GATED[0]
    want = spec_forward(op, rows, w, EPS, params)
    # the kernel the capture will hold, loaded (and its plan kept) outside it, as where no
    # table can be had: the persistent forward
    with monkeypatch.context() as m:
        m.setattr(cb.device.DeviceState, "global_gate_table", lambda self, cp, sig: None)
        first = cb.rms_norm_gated(crows["x"], crows["gate"], cw, eps=EPS, **params)
    torch.cuda.synchronize()
    assert_bits(first, want[0], f"persistent forward {params}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cb.rms_norm_gated(crows["x"], crows["gate"], cw, eps=EPS, **params)
    graph.replay()
    torch.cuda.synchronize()
    assert_bits(out, want[0], f"graph {params}")
    # the capture took the plan kept outside it
    filled = cb.device.state(torch.cuda.current_device()).gate_tables_filled
    assert filled == set() and len(picked) == 1
    assert all(p.plan.table for p in picked)
    got = cb.rms_norm_gated(crows["x"], crows["gate"], cw, eps=EPS, **params)
    assert_bits(got, want[0], f"after the graph {params}")
    assert len(filled) == 1 and len(picked) == 1


CHAINED_CASES = [(VARIANTS[1], (4096, 2048), torch.bfloat16, torch.bfloat16),  # pipelined
                 (VARIANTS[1], (64, 2048), torch.bfloat16, torch.float32),  # one-row kernel
                 (VARIANTS[0], (1000, 100), torch.bfloat16, torch.float32),  # register kernels
                 (VARIANTS[4], (1000, 2048), torch.float16, torch.float16),
                 (VARIANTS[10], (8192, 128), torch.bfloat16, torch.bfloat16)]


def test_tree_launches_chained_after_the_backward(monkeypatch, ext):
    """On sm_90 and later the dweight tree's launches are programmatic dependent launches
    through the driver's cuLaunchKernelEx: the driver takes them and every output and
    gradient is the spec's bits, torch tensors and CuPy arrays. Inside a CUDA graph
    capture they are plain, and the replay gives the same bits."""
    chained = []
    real = cb.driver._launch_chained

    def spy(fn, grid, block, args, shared_mem):
        chained.append(grid)
        real(fn, grid, block, args, shared_mem)

    monkeypatch.setattr(cb.driver, "_launch_chained", spy)
    for seed, ((op, params), shape, dtype, wdtype) in enumerate(CHAINED_CASES):
        check_torch(op, params, shape, dtype, wdtype, seed, ext=ext)
        check_cupy(op, params, shape, dtype, wdtype, seed)
    sm90 = torch.cuda.get_device_capability() >= (9, 0)
    assert bool(chained) == sm90, len(chained)
    # a capture: plain launches (cudaStreamBeginCapture's stream), the same bits
    (op, params), shape, dtype, wdtype = CHAINED_CASES[0]
    rows, weight, grads = make_case(op, params, shape, dtype, wdtype, 9, specials=True)
    x, w, dy = rows["x"].cuda(), weight.cuda(), grads[0].cuda()
    want = cb.rms_norm_backward(dy, x, w, eps=EPS, **params)  # also loads the kernels
    torch.cuda.synchronize()
    before = len(chained)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = cb.rms_norm_backward(dy, x, w, eps=EPS, **params)
    graph.replay()
    torch.cuda.synchronize()
    assert len(chained) == before
    for name, g, e in zip(("dx", "dweight"), got, want, strict=True):
        assert_bits(g, e.cpu(), f"{name} replayed from a capture")


def test_pipelined_backward_occupancy():
    """The occupancy query the persistent grid depends on answers (a failure would fall
    back to one block per SM: the same bits, a slow launch)."""
    cb.available()
    groups = cb.geometry.backward_plan_aligned(DT_BF16, 32768, 2048, True, 132, 232448)
    plan = cb.planner.launch_plan(cb.planner.PlanQuery(OP_RMS, DT_BF16, True, 32768, 2048,
                                                       aligned=True, groups=groups))
    name, block, smem = cb.launches.kernel_name(OP_RMS, DT_BF16, plan), plan.block_x, plan.smem
    st = cb.device.state(torch.cuda.current_device())
    fn = st.kernel(OP_RMS, DT_BF16, name)
    per_sm = st.prepare_pipe_kernel(fn, ("occupancy test", name, smem), block, smem,
                                    st.smem_optin(cp))
    assert per_sm >= 2


def test_many_rows_dweight_tree(ext):
    # many groups in the workspace, several col-tree levels, a non-power-of-two row count
    check_torch("rms_norm", {"offset": 0.0}, (100003, 64), torch.float32, torch.float32, 3,
                ext=ext, specials=False)


def test_negative_zero_padding():
    for hidden, rows in [(3, 3), (5, 6), (1, 3), (1003, 37)]:
        x = torch.ones(rows, hidden)
        w = torch.ones(hidden)
        dy = torch.full((rows, hidden), -0.0)
        want = spec.rms_norm_backward(dy, x, w, eps=EPS)
        got = cb.rms_norm_backward(dy.cuda(), x.cuda(), w.cuda(), eps=EPS)
        for name, g, ww in zip(("dx", "dweight"), got, want, strict=True):
            assert_bits(g, ww, name)


def test_empty_rows():
    x = torch.empty(0, 8, device="cuda")
    w = torch.ones(8, device="cuda")
    assert cb.rms_norm(x, w, eps=EPS).shape == (0, 8)
    y, res = cb.fused_add_rms_norm(x, x, w, eps=EPS)
    assert y.shape == res.shape == (0, 8)
    dx, dw = cb.rms_norm_backward(x, x, w, eps=EPS)
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros_like(w))


def test_sum_backward_with_expanded_grad():
    x = torch.randn(7, 300, dtype=torch.bfloat16)
    w = torch.randn(300)
    xs, ws = x.cuda().requires_grad_(True), w.cuda().requires_grad_(True)
    cb.rms_norm(xs, ws, eps=EPS, offset=1.0).float().sum().backward()
    want = spec.rms_norm_backward(torch.ones_like(x), x, w, eps=EPS, offset=1.0)
    assert_bits(xs.grad, want[0], "dx")
    assert_bits(ws.grad, want[1], "dweight")


def test_only_one_output_used():
    # the unused output of the fused op gets a zero gradient, as in the extension
    x, r = torch.randn(5, 64), torch.randn(5, 64)
    w = torch.randn(64)
    xs, rs, ws = (t.cuda().requires_grad_(True) for t in (x, r, w))
    y, _res = cb.fused_add_rms_norm(xs, rs, ws, eps=EPS)
    dy = torch.randn(5, 64)
    got = torch.autograd.grad(y, [xs, rs, ws], dy.cuda())
    want = spec.fused_add_rms_norm_backward(dy, torch.zeros_like(dy), x, r, w, eps=EPS)
    for name, g, ww in zip(("dx", "dresidual", "dweight"), got, want, strict=True):
        assert_bits(g, ww, name)


def test_torch_current_stream_is_used():
    """Inputs written late on a side stream: the kernel must queue behind them there."""
    x = torch.randn(256, 4096, dtype=torch.bfloat16)
    w = torch.randn(4096)
    want = spec.rms_norm(x, w, eps=EPS)
    src, cw = x.cuda(), w.cuda()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        late = torch.full_like(src, float("nan"))
        torch.cuda._sleep(200_000_000)  # keep the side stream busy
        late.copy_(src)
        y = cb.rms_norm(late, cw, eps=EPS)
        dx, dw = cb.rms_norm_backward(torch.ones_like(late), late, cw, eps=EPS)
    s.synchronize()
    assert_bits(y, want, "forward on a side stream")
    want_g = spec.rms_norm_backward(torch.ones_like(x), x, w, eps=EPS)
    assert_bits(dx, want_g[0], "dx on a side stream")
    assert_bits(dw, want_g[1], "dweight on a side stream")


def test_cupy_current_stream_is_used():
    x = torch.randn(256, 4096, dtype=torch.float16)
    w = torch.randn(4096, dtype=torch.float16)
    want = spec.rms_norm(x, w, eps=EPS)
    src, aw = _to_cupy(x.cuda()), _to_cupy(w.cuda())
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with cb.arrays.cupy_stream_of(cp, s, 0):
        late = cp.full(src.shape, cp.nan, dtype=src.dtype)
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)
        late[...] = src
        y = cb.rms_norm(late, aw, eps=EPS)
    s.synchronize()
    assert_bits(_to_torch(y), want, "forward on CuPy's current stream")


def _current_context() -> int | None:
    """The driver's current context in the calling thread (``None``: none)."""
    ctx = ctypes.c_void_p()
    assert ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value


@pytest.mark.parametrize("path", ["driver", "rawkernel"])
def test_a_thread_without_a_current_context(path, monkeypatch):
    """A thread that no CUDA runtime call has touched yet has no current context, which a
    driver launch needs: the backend binds the primary context and launches (else
    autograd's first backward can fail so). Forward and backward there
    give the spec's bits; the thread's first launch met no context. ``rawkernel``: as
    where the driver lacks ``cuLaunchKernelEx`` (before CUDA 12.0), every launch through
    CuPy's ``RawKernel`` and nothing chained."""
    x = torch.randn(64, 2048, dtype=torch.bfloat16)
    w = torch.randn(2048, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    want = spec.rms_norm(x, w, eps=EPS, offset=1.0)
    want_g = spec.rms_norm_backward(dy, x, w, eps=EPS, offset=1.0)
    cx, cw, cdy = x.cuda(), w.cuda(), dy.cuda()
    # the same calls here first: compiled, and their outputs' blocks in torch's cache
    cb.rms_norm_backward(cdy, cx, cw, eps=EPS, offset=1.0)
    cb.rms_norm(cx, cw, eps=EPS, offset=1.0)
    torch.cuda.synchronize()
    seen = []  # the context current at each launch in the thread
    launch = cb.driver.cu_launch_kernel_ex() if path == "driver" else cb.driver._launch_rawkernel

    def recording_launch(*args):
        seen.append(_current_context())
        return launch(*args)

    if path == "driver":
        monkeypatch.setattr(cb.driver, "cu_launch_kernel_ex", lambda: recording_launch)
    else:
        monkeypatch.setattr(cb.driver, "_cu_launch_kernel_ex_fn", [None])
        monkeypatch.setattr(cb.device, "_states", {})
        # the device's state made afresh for RawKernel launches, here, before the thread:
        # making it asks the runtime, which makes a context current
        cb.rms_norm_backward(cdy, cx, cw, eps=EPS, offset=1.0)
        cb.rms_norm(cx, cw, eps=EPS, offset=1.0)
        torch.cuda.synchronize()
        monkeypatch.setattr(cb.driver, "_launch_rawkernel", recording_launch)
    result = {}

    def fresh_thread():
        try:
            result["before"] = _current_context()
            result["y"] = cb.rms_norm(cx, cw, eps=EPS, offset=1.0)
            result["g"] = cb.rms_norm_backward(cdy, cx, cw, eps=EPS, offset=1.0)
            torch.cuda.synchronize()
        except BaseException as e:  # handed to the test's thread
            result["error"] = e

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    assert result["before"] is None, "a new thread began with a current context"
    assert seen and seen[0] is None, f"the thread's first launch met a context: {seen}"
    assert_bits(result["y"], want, "forward in a fresh thread")
    for name, g, wg in zip(("dx", "dweight"), result["g"], want_g, strict=True):
        assert_bits(g, wg, f"{name} in a fresh thread")


_FRESH_BACKWARDS = {
    # the one-row backward's plan (no tree, no runtime call before the launch)
    "rms 1x2048": """
        x = torch.randn(1, 2048, generator=g).bfloat16().cuda().requires_grad_(True)
        w = torch.randn(2048, generator=g).bfloat16().cuda().requires_grad_(True)
        dy = torch.randn(1, 2048, generator=g).bfloat16().cuda()
        y = cb.rms_norm(x, w, eps=1e-6, offset=1.0)
        got = torch.autograd.grad(y, [x, w], dy)
        want = cb.rms_norm_backward(dy, x.detach(), w.detach(), eps=1e-6, offset=1.0)
    """,
    # the backward from the sum: a module (OP_FUSED_SUM) the forward never loaded, so its
    # first load is in autograd's thread
    "fused rounded 64x2048": """
        x = torch.randn(64, 2048, generator=g).bfloat16().cuda().requires_grad_(True)
        r = torch.randn(64, 2048, generator=g).bfloat16().cuda().requires_grad_(True)
        w = torch.randn(2048, generator=g).bfloat16().cuda().requires_grad_(True)
        dy, dr = (torch.randn(64, 2048, generator=g).bfloat16().cuda() for _ in range(2))
        kw = dict(eps=1e-6, offset=1.0, residual_sum="rounded")
        y, s = cb.fused_add_rms_norm(x, r, w, **kw)
        got = torch.autograd.grad([y, s], [x, r, w], [dy, dr])
        want = cb.fused_add_rms_norm_backward(dy, dr, x.detach(), r.detach(), w.detach(), **kw)
    """,
}


@pytest.mark.parametrize("case", list(_FRESH_BACKWARDS))
def test_autograd_backward_first_in_a_fresh_process(case):
    """A new process whose first backward is the CuPy norm's: autograd's device thread
    reaches our module loads and launches first, with no current context bound yet.
    Its gradients equal the explicit backward's bits."""
    script = textwrap.dedent("""
        import faulthandler
        import torch
        from normspec.backends import cupy as cb
        faulthandler.dump_traceback_later(240, exit=True)  # a hang shows every thread
        g = torch.Generator().manual_seed(5)
    """) + textwrap.dedent(_FRESH_BACKWARDS[case]) + textwrap.dedent("""
        same = [torch.equal(a.view(torch.int16), b.view(torch.int16))
                for a, b in zip(got, want, strict=True)]
        print("SAME", all(same), same)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "SAME True" in done.stdout, done.stdout + done.stderr[-3000:]


def test_first_call_of_a_fresh_process_in_a_fresh_thread():
    """A new process whose first CuPy norm runs in a new thread: the thread loads the
    module and launches with no context of its own (the main thread's allocations bound
    one only there). Forward and backward equal the main thread's bits after it."""
    script = textwrap.dedent("""
        import faulthandler
        import threading
        import torch
        from normspec.backends import cupy as cb
        faulthandler.dump_traceback_later(240, exit=True)  # a hang shows every thread
        g = torch.Generator().manual_seed(6)
        x = torch.randn(64, 2048, generator=g).bfloat16().cuda()
        w = torch.randn(2048, generator=g).bfloat16().cuda()
        dy = torch.randn(64, 2048, generator=g).bfloat16().cuda()
        def run():
            return [cb.rms_norm(x, w, eps=1e-6, offset=1.0),
                    *cb.rms_norm_backward(dy, x, w, eps=1e-6, offset=1.0)]
        got = {}
        def in_thread():
            try:
                got["out"] = run()
                torch.cuda.synchronize()
            except BaseException as e:
                got["error"] = repr(e)
        t = threading.Thread(target=in_thread)
        t.start()
        t.join()
        print("ERROR", got.get("error"))
        same = [torch.equal(a.view(torch.int16), b.view(torch.int16))
                for a, b in zip(got["out"], run())]
        print("SAME", same)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "ERROR None" in done.stdout and "SAME [True, True, True]" in done.stdout, (
        done.stdout + done.stderr[-3000:])


def test_repeated_calls_and_disk_cache(monkeypatch, tmp_path):
    x = torch.randn(3, 1003, device="cuda")
    w = torch.randn(1003, device="cuda")
    first = cb.rms_norm(x, w, eps=EPS)
    monkeypatch.setenv("NORMSPEC_CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cb.device, "_states", {})  # modules, kernels and the plans holding them
    fresh = cb.rms_norm(x, w, eps=EPS)  # compiled into an empty cache
    assert any(tmp_path.glob("*.cubin")) or any(tmp_path.glob("*.ptx"))
    monkeypatch.setattr(cb.device, "_states", {})  # modules, kernels and the plans holding them
    loaded = cb.rms_norm(x, w, eps=EPS)  # loaded from the disk cache
    assert_bits(fresh, first, "fresh compile")
    assert_bits(loaded, first, "from the disk cache")


def test_registry_backend_forward():
    b = cb.backend
    assert b.available() is None
    rows, weight, _ = make_case("fused_add_rms_norm", VARIANTS[4][1], (6, 200), torch.bfloat16,
                                torch.float32, 5, specials=True)
    want = spec_forward("fused_add_rms_norm", rows, weight, EPS, VARIANTS[4][1])
    got = b.forward("fused_add_rms_norm", {k: v.cuda() for k, v in rows.items()},
                    weight.cuda(), eps=EPS, **VARIANTS[4][1])
    assert isinstance(got, tuple) and len(got) == N_OUT["fused_add_rms_norm"]
    for g, w in zip(got, want, strict=True):
        assert_bits(g, w, "registry forward")
    assert set(ROW_INPUTS) == set(b.ops)


def test_error_messages_on_the_gpu():
    x = torch.randn(2, 8, device="cuda")
    w = torch.ones(8, device="cuda")
    with pytest.raises(ValueError, match=r"weight: expected the device of x, cuda:0, got cpu"):
        cb.rms_norm(x, torch.ones(8), eps=EPS)
    with pytest.raises(TypeError, match=r"weight: expected a torch.Tensor, got ndarray"):
        cb.rms_norm(x, cp.ones(8, dtype=cp.float32), eps=EPS)
    ax, aw = cp.ones((2, 8), dtype=cp.float32), cp.ones(8, dtype=cp.float32)
    with pytest.raises(TypeError, match=r"residual: expected a CuPy array \(like x\)"):
        cb.fused_add_rms_norm(ax, torch.ones(2, 8, device="cuda"), aw, eps=EPS)
    with pytest.raises(TypeError, match=r"gate: expected the dtype of x, float32, got float16"):
        cb.rms_norm_gated(ax, cp.ones((2, 8), dtype=cp.float16), aw, eps=EPS)
    with pytest.raises(ValueError, match=r"gate: expected the shape of x, \(2, 8\), got \(8,\)"):
        cb.rms_norm_gated(ax, aw, aw, eps=EPS)
    with pytest.raises(TypeError, match=r"x: expected dtype in \(float32, bfloat16, float16\), "
                                        r"got float64"):
        cb.rms_norm(cp.ones((2, 8)), aw, eps=EPS)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
        cb.rms_norm(ax, cp.ones(9, dtype=cp.float32), eps=EPS)
    with pytest.raises(TypeError, match=r"weight: expected dtype float32 or x's dtype"):
        cb.rms_norm(ax.astype(cp.float16), cp.ones(8, dtype=cp.float64), eps=EPS)
    with pytest.raises(ValueError, match=r"eps: expected a finite value > 0"):
        cb.rms_norm(ax, aw, eps=-1.0)
    with pytest.raises(ValueError, match=r"dy: expected the shape of x"):
        cb.rms_norm_backward(cp.ones((3, 8), dtype=cp.float32), ax, aw, eps=EPS)
    assert cb.rms_norm(x, w, eps=EPS).shape == (2, 8)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    x = torch.randn(4, 1003, device="cuda:1")
    w = torch.randn(1003, device="cuda:1")
    y = cb.rms_norm(x, w, eps=EPS)
    assert y.device == x.device
    assert_bits(y, spec.rms_norm(x.cpu(), w.cpu(), eps=EPS), "cuda:1")
    with pytest.raises(ValueError, match=r"weight: expected the device of x"):
        cb.rms_norm(x, w.to("cuda:0"), eps=EPS)


def _kernel_families(names: list[str]) -> list[str]:
    """Each launch's kernel template, without its arguments: ``normspec_fwd_row_kernel``."""
    return [re.search(r"normspec_\w+", n).group(0) if "normspec_" in n else n for n in names]


_PLAN_SHAPES = [(1, 2048), (64, 2048), (4096, 2048), (65536, 2048), (7, 1003), (64, 8192),
                (2048, 256), (4096, 128), (3, 40000)]


def _launches(op: str, params: dict, shape: tuple[int, int], dtype: torch.dtype) -> dict:
    """The kernels each backend launches for one call, forward and backward."""
    inputs, weight, grads = make_case(op, params, shape, dtype, torch.float32, 0,
                                      specials=False)
    rows = {k: v.cuda() for k, v in inputs.items()}
    w, dys = weight.cuda(), [g.cuda() for g in grads]
    forward, backward = getattr(cb, op), getattr(cb, op + "_backward")
    calls = {
        ("torch_ext", "forward"): lambda: ext_forward(op, rows, w, EPS, params),
        ("cupy", "forward"): lambda: forward(*rows.values(), w, eps=EPS, **params),
        ("torch_ext", "backward"): lambda: ext_backward(op, dys, rows, w, EPS, params),
        ("cupy", "backward"): lambda: backward(*dys, *rows.values(), w, eps=EPS, **params),
    }
    for call in calls.values():
        call()  # compiled and planned before the profiled call
    return {key: cuda_kernel_names(call) for key, call in calls.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("op", "params"), [VARIANTS[1], VARIANTS[4], VARIANTS[7]],
                         ids=["rms", "fused", "gated"])
def test_both_backends_launch_the_same_kernels(op, params, dtype):
    """The torch extension and the CuPy backend read one launch plan: for the same call
    they launch the same kernel families in the same order, forward and backward."""
    te = pytest.importorskip("normspec.backends.torch_ext")
    if (reason := te.available()) is not None:
        pytest.skip(reason)
    for shape in _PLAN_SHAPES:
        seen = _launches(op, params, shape, dtype)
        for direction in ("forward", "backward"):
            ours, theirs = seen["torch_ext", direction], seen["cupy", direction]
            assert ours and _kernel_families(ours) == _kernel_families(theirs), (
                shape, direction, ours, theirs)
