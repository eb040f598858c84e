"""The CuPy backend without a GPU: availability reasons, argument validation, the Python
launch plan against the C++ launcher (compiled on the host with nvcc), and the NVRTC
compile of every kernel the backend launches (CuPy + NVRTC wheels, no GPU needed).

GPU behaviour is tested in tests/test_cupy_backend.py, on a GPU only.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import subprocess
import sys
import threading
import types
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import compile_ahead
from normspec.backends import cupy as cb
from normspec.backends.cupy.codes import (
    DT_BF16,
    DT_F16,
    DT_F32,
    F_ALIGNED,
    F_DW_FINAL,
    F_GATE_TABLE,
    F_HF,
    F_LET_DEPENDENTS,
    F_OFFSET,
    F_ROUNDED,
    F_SIGMOID,
    F_W_IS_INPUT,
    F_W_RAW,
    OP_FUSED,
    OP_FUSED_SUM,
    OP_GATED,
    OP_RMS,
)

EPS = 1e-6


# ---- availability -------------------------------------------------------------------
def test_available_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    reason = cb.available()
    assert reason is not None and reason.startswith("CuPy is not installed")
    assert "cupy-cuda12x" in reason
    assert cb.backend.available() == reason
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        cb.nvrtc.require_cupy()


def test_available_without_gpu_gives_a_reason():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    reason = cb.available()
    assert reason is not None
    assert "CuPy" in reason or "GPU" in reason


def test_registry_object():
    b = cb.backend
    assert b.name == "cupy"
    assert f"NVRTC RawModule of backends/csrc/{cb.nvrtc.KERNELS}" in b.source
    assert cb.nvrtc.KERNELS == "normspec_pipe.cuh"
    assert b.source.startswith("CuPy ")
    assert set(b.ops) == {"rms_norm", "fused_add_rms_norm", "rms_norm_gated"}
    for op in b.ops.values():
        assert op.backward == "full"
        assert op.devices == ("cuda",)
        assert set(op.weight_dtypes) == {"fp32", "same"}
    assert b.supports("rms_norm", {"offset": 1.0}, "cpu").startswith("device 'cpu'")
    assert b.supports("rms_norm_gated", {"convention": "hf"}, "cuda") is None


# ---- validation before any GPU work ---------------------------------------------------
def _t(*shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda: cb.rms_norm(np.ones((2, 8), np.float32), _t(8), eps=EPS), TypeError,
         r"x: expected a CUDA torch.Tensor or a CuPy array, got a numpy.ndarray"),
        (lambda: cb.rms_norm([1.0, 2.0], _t(2), eps=EPS), TypeError,
         r"x: expected a CUDA torch.Tensor or a CuPy array, got builtins.list"),
        (lambda: cb.rms_norm(_t(2, 8), _t(8), eps=EPS), ValueError,
         r"x: expected a CUDA tensor or a CuPy array, got a torch.Tensor on cpu"),
        (lambda: cb.rms_norm(_t(2, 8, dtype=torch.int32), _t(8), eps=EPS), TypeError,
         r"x: expected dtype in \(float32, bfloat16, float16\), got torch.int32"),
        (lambda: cb.rms_norm(_t(2, 0), _t(0), eps=EPS), ValueError,
         r"x: expected shape \(\.\.\., H\) with H >= 1"),
        (lambda: cb.rms_norm(_t(2, 8), _t(7), eps=EPS), ValueError,
         r"weight: expected shape \(8,\) to match x's last dimension, got \(7,\)"),
        (lambda: cb.rms_norm(_t(2, 8, dtype=torch.bfloat16), _t(8, dtype=torch.float16),
                             eps=EPS), TypeError,
         r"weight: expected dtype float32 or x's dtype \(torch.bfloat16\), got torch.float16"),
        (lambda: cb.rms_norm(_t(2, 8), _t(8), eps=0.0), ValueError,
         r"eps: expected a finite value > 0"),
        (lambda: cb.rms_norm(_t(2, 8), _t(8), eps=EPS, offset=float("nan")), ValueError,
         r"offset: expected a finite value"),
        (lambda: cb.fused_add_rms_norm(_t(2, 8), _t(2, 8, dtype=torch.float16), _t(8),
                                       eps=EPS), TypeError,
         r"residual: expected the dtype of x, torch.float32, got torch.float16"),
        (lambda: cb.fused_add_rms_norm(_t(2, 8), _t(3, 8), _t(8), eps=EPS), ValueError,
         r"residual: expected the shape of x, \(2, 8\), got \(3, 8\)"),
        (lambda: cb.fused_add_rms_norm(_t(2, 8), _t(2, 8), _t(8), eps=EPS,
                                       residual_sum="bf16"), ValueError,
         r"residual_sum: expected one of \('fp32', 'rounded'\)"),
        (lambda: cb.rms_norm_gated(_t(2, 8), np.ones((2, 8), np.float32), _t(8), eps=EPS),
         TypeError, r"gate: expected a torch.Tensor, got ndarray"),
        (lambda: cb.rms_norm_gated(_t(2, 8), _t(2, 8), _t(8), eps=EPS, convention="x"),
         ValueError, r"convention: expected one of \('vllm', 'hf'\)"),
        (lambda: cb.rms_norm_gated(_t(2, 8), _t(2, 8), _t(8), eps=EPS, activation="gelu"),
         ValueError, r"activation: expected one of \('silu', 'sigmoid'\)"),
        (lambda: cb.rms_norm_backward(_t(2, 9), _t(2, 8), _t(8), eps=EPS), ValueError,
         r"dy: expected the shape of x"),
        (lambda: cb.fused_add_rms_norm_backward(_t(2, 8), _t(2, 8, dtype=torch.float16),
                                                _t(2, 8), _t(2, 8), _t(8), eps=EPS), TypeError,
         r"dresidual_out: expected the dtype of x"),
        (lambda: cb.rms_norm_gated_backward(_t(2, 8), _t(2, 8), _t(2, 8), _t(8), eps=EPS),
         ValueError, r"x: expected a CUDA tensor or a CuPy array, got a torch.Tensor on cpu"),
        # the forward's rstd given to a backward, and the forwards that return it
        (lambda: cb.rms_norm_backward(_t(2, 8), _t(2, 8), _t(8), eps=EPS, rstd=_t(2, 8)),
         ValueError,
         r"rstd: expected the shape of x without its last dimension, \(2,\), got \(2, 8\)"),
        (lambda: cb.rms_norm_backward(_t(2, 8), _t(2, 8), _t(8), eps=EPS,
                                      rstd=_t(2, dtype=torch.float16)), TypeError,
         r"rstd: expected dtype float32, got float16"),
        (lambda: cb.rms_norm_backward(_t(2, 8), _t(2, 8), _t(8), eps=EPS, rstd=_t(4)[::2]),
         ValueError, r"rstd: expected a contiguous array"),
        (lambda: cb.rms_norm_gated_backward(_t(2, 8), _t(2, 8), _t(2, 8), _t(8), eps=EPS,
                                            rstd=np.ones(2, np.float32)), TypeError,
         r"rstd: expected a torch.Tensor, got ndarray"),
        (lambda: cb.rms_norm_backward(_t(2, 8), _t(2, 8), _t(8), eps=EPS, rstd=_t(2)),
         ValueError, r"x: expected a CUDA tensor or a CuPy array, got a torch.Tensor on cpu"),
        (lambda: cb.rms_norm_with_rstd(_t(2, 8).requires_grad_(), _t(8), eps=EPS), ValueError,
         r"rms_norm_with_rstd: builds no autograd graph, and an input requires grad; call "
         r"rms_norm"),
        (lambda: cb.rms_norm_gated_with_rstd(_t(2, 8), _t(2, 8), _t(8).requires_grad_(),
                                             eps=EPS), ValueError,
         r"rms_norm_gated_with_rstd: builds no autograd graph"),
        (lambda: cb.fused_add_rms_norm_with_rstd(_t(2, 8), _t(2, 8), _t(8), eps=EPS),
         ValueError, r"x: expected a CUDA tensor or a CuPy array, got a torch.Tensor on cpu"),
        (lambda: cb.fused_add_rms_norm_backward_from_sum(
            _t(2, 8, dtype=torch.bfloat16), _t(2, 8, dtype=torch.bfloat16),
            _t(2, 8, dtype=torch.bfloat16), _t(8), eps=EPS, residual_sum="fp32"), ValueError,
         r"residual_sum: the backward from the saved sum needs 'rounded' or float32 rows"),
        (lambda: cb.fused_add_rms_norm_backward_from_sum(
            _t(2, 8), _t(2, 8), np.ones((2, 8), np.float32), _t(8), eps=EPS), TypeError,
         r"s: expected a CUDA torch.Tensor or a CuPy array, got a numpy.ndarray"),
        (lambda: cb.fused_add_rms_norm_backward_from_sum(_t(2, 8), _t(2, 8), _t(2, 8), _t(8),
                                                         eps=EPS, residual_sum="fp32"),
         ValueError, r"x: expected a CUDA tensor"),  # float32 rows: either convention
    ],
)
def test_validation_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ---- the Python launch plan ---------------------------------------------------------------
def test_row_stride_of_layouts():
    def stride(t):
        return cb.arrays.collapsible_stride(tuple(t.shape), tuple(t.stride()))

    x = torch.zeros(4, 3, 10)
    assert stride(x) == 10
    assert stride(torch.zeros(4, 3, 15)[..., :10]) == 15
    assert stride(x.transpose(-1, 0)) is None
    assert stride(torch.zeros(4, 4, 10)[:, :3]) is None  # leading dims do not collapse
    assert stride(torch.zeros(1, 1, 10)) == 10
    assert stride(torch.zeros(5, 1)[:, :1].expand(5, 1)) == 1
    assert stride(torch.zeros(10).expand(6, 10)) == 0  # broadcast rows read one row
    assert stride(torch.zeros(6, 1, 10)[:, :, :]) == 10
    assert cb.arrays.collapsible_stride((3, 4), (-4, 1)) is None  # negative: copied


def test_torch_rows_enter_as_pointers():
    """Torch rows reach the kernels as a pointer and a row stride, without a CuPy view:
    the integer view of their bits, and a bitwise contiguous copy only when the leading
    dims do not collapse. The rows the kernels address from (pointer, stride) hold the
    input's bits, NaN payloads included."""
    side = object.__new__(cb.arrays.TorchSide)  # raw() and rows() need no device
    side.cp = None
    nan = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    base = torch.randn(6, 4, 24).to(torch.bfloat16)
    base[0, 0, 0] = nan[0]
    layouts = {
        "contiguous": (base, False),
        "sliced columns": (base[..., :16], False),
        "rows of a bigger batch": (base[1:5], False),
        "non-collapsing": (base[:, :3], True),
        "transposed": (base.transpose(0, 1), True),
    }
    for name, (t, copied) in layouts.items():
        raw = side.raw(t)
        assert raw.dtype == torch.int16 and raw.data_ptr() == t.data_ptr(), name
        view, rs = cb.arrays.row_view(None, raw)
        assert (view.data_ptr() != t.data_ptr()) == copied, name
        read, read_rs = side.rows(t)  # the backend's path: no integer view unless copied
        assert read_rs == rs and (read is t) != copied, name
        assert torch.equal(read.view(torch.int16), view) if copied else read.data_ptr() == (
            view.data_ptr()), name
        assert cb.arrays.ptr(view) == view.data_ptr()
        hidden = t.shape[-1]
        rows = t.numel() // hidden
        seen = torch.as_strided(view, (rows, hidden), (rs, 1))
        want = t.reshape(rows, hidden).view(torch.int16)
        assert torch.equal(seen, want), name



class _CpuSide(cb.arrays.TorchSide):
    """The torch side on CPU tensors, for the launch plumbing alone (nothing runs)."""

    def __init__(self) -> None:
        self.cp, self.dev, self.device = None, 0, torch.device("cpu")

    @contextlib.contextmanager
    def context(self):
        yield


class Recorded(list):
    """The recorded launches; ``chained[i]``: whether launch ``i`` was a chained one."""

    def __init__(self) -> None:
        super().__init__()
        self.chained: list[bool] = []


def _record_launches(monkeypatch, *, pdl: bool = False, plans: dict | None = None
                     ) -> Recorded:
    """Runs the backend's launch plumbing on CPU tensors: every launch is recorded as
    ``(kernel name, grid, block, args, shared memory)`` instead of run. ``pdl``: as on a
    device whose kernels may be chained (sm_90, outside a capture), else as on one where
    they may not. ``plans``: the backend's kept launch
    plans (``DeviceState.plans``) meanwhile, a new empty one by default (the stand-ins
    below answer for the device)."""
    launches = Recorded()
    monkeypatch.setattr(cb.device, "_states", {})
    if plans is not None:
        cb.device.state(0).plans = plans

    def launch(fn, grid, block, args, shared_mem=0, *, chained=False):
        launches.append((fn, grid, block, args.numpy(), shared_mem))
        launches.chained.append(chained)

    monkeypatch.setattr(cb.arrays, "side", lambda kind, x: _CpuSide())
    state = cb.device.DeviceState
    monkeypatch.setattr(state, "sm_count", lambda self, cp: 132)
    monkeypatch.setattr(state, "smem_optin", lambda self, cp: 232448)
    monkeypatch.setattr(state, "prepare_pipe_kernel",
                        lambda self, fn, key, block, smem, optin: 2)
    monkeypatch.setattr(state, "kernel", lambda self, op, dt, name: name)
    monkeypatch.setattr(cb.driver, "launch", launch)
    monkeypatch.setattr(state, "pdl_capable", lambda self, cp: pdl)
    monkeypatch.setattr(cb.device, "current_stream_capturing", lambda cp: False)
    return launches


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_forward_passes_the_gate_table_to_its_kernels(activation, monkeypatch):
    """A large aligned bf16 gated forward launches the GT row form with the address of its
    activation's half of the global table as the last argument (``gtab``); while no table
    can be had (a capture), the persistent forward, which builds the table in each block's
    shared memory (``F_GATE_TABLE``), as the torch extension."""
    launches, asked = _record_launches(monkeypatch), []
    tables = {False: 0x100000, True: 0x100000 + 4 * 8192}

    def table(self, cp, sig):
        asked.append(sig)
        return tables[sig]

    monkeypatch.setattr(cb.device.DeviceState, "global_gate_table", table)
    x = torch.zeros(2**15, 64, dtype=torch.bfloat16)
    params = {"convention": "vllm", "activation": activation}
    cb.run.forward("torch", OP_GATED, [x, x.clone()], torch.ones(64), 1e-6, params)
    ((name, grid, block, args, smem),) = launches
    # the vllm convention's own GT form (an fp32 weight: 1)
    assert (grid, block) == ((512, 1, 1), (256, 1, 1))  # teams of 4 lanes, 64 a block
    assert len(args) == 17 and args[-2] == np.uint64(0)  # rstd_out: none here
    assert name == "normspec_fwd_row_kernel<2, __nv_bfloat16, 2, 2, true, 1>"
    assert asked == [activation == "sigmoid"] and args[-1] == tables[asked[0]]
    # no table to be had (a capture before the first fill): the persistent forward
    launches.clear()
    monkeypatch.setattr(cb.device.DeviceState, "global_gate_table", lambda self, cp, sig: None)
    cb.run.forward("torch", OP_GATED, [x, x.clone()], torch.ones(64), 1e-6, params)
    ((name, grid, block, args, smem),) = launches
    check_persistent_table_forward(name, grid, block, args, smem)


def check_persistent_table_forward(name, grid, block, args, smem):
    """2**15 rows of 64 bf16 on the persistent forward: teams of 8 lanes x 1 pass, the
    constant form, two resident blocks a SM (the recording launcher's), the weight factors
    and the gate table in shared memory, F_GATE_TABLE, no rstd."""
    assert name == "normspec_fwd_pipe_kernel<2, __nv_bfloat16, 1, 3>"
    assert (grid, block) == ((2 * 132, 1, 1), (256, 1, 1))
    assert smem == 8 * 8 * 4 + 8192 * 4
    assert len(args) == 16 and int(args[13]) & F_GATE_TABLE  # 5 pointers, 6 sizes, 2 floats
    assert int(args[14]) == 3 and args[15] == np.uint64(0)  # team_log, rstd_out


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_autograd_saves_rstd_and_the_backward_reads_it(wdtype, monkeypatch):
    """Through autograd the forward passes an rstd buffer (one fp32 per row) to its kernel
    and the backward passes that very buffer to the pipelined kernel that reads it. A
    contiguous bf16 weight is read as it is (its own pointer, F_W_RAW) by both; an fp32
    weight as it is too (it is fp32), without the flag."""
    launches = _record_launches(monkeypatch)
    x = torch.zeros(4096, 2048, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(2048, dtype=wdtype, requires_grad=True)
    (y,) = cb.ops._NormFunction.apply(OP_RMS, 1e-6, {"offset": 1.0}, w, x)
    (fwd, _, _, fargs, _), = launches
    assert fwd == "normspec_fwd_row_kernel<0, __nv_bfloat16, 4, 6>"
    rstd = fargs[-2]
    assert rstd != 0 and fargs[2] == np.uint64(w.data_ptr())
    raw = wdtype == torch.bfloat16
    assert bool(int(fargs[13]) & F_W_RAW) == raw  # flags follow 5 pointers, 6 sizes, 2 floats
    y.backward(torch.zeros_like(y))
    bwd = launches[1]
    assert bwd[0] == "normspec_bwd_pipe_kernel<0, __nv_bfloat16, 2, 7, true, -1>"
    assert bwd[3][-1] == rstd and bwd[3][2] == np.uint64(w.data_ptr())
    assert bool(int(bwd[3][18]) & F_W_RAW) == raw  # 8 pointers, 8 sizes, 2 floats
    # 2048 groups of 2 rows: a tree level of 16, then the last launch (and the cast)
    assert [n for n, *_ in launches[2:]] == [
        "normspec_col_tree_kernel",
        f"normspec_col_tree_last_kernel<{'__nv_bfloat16' if raw else 'float'}>"]
    # the explicit backward recomputes rstd: the recomputing form, a null pointer
    launches.clear()
    cb.run.backward("torch", OP_RMS, [y.detach()], [x.detach()], w.detach(), 1e-6,
                 {"offset": 1.0})
    assert launches[0][0].endswith("2, 7, false, -1>") and launches[0][3][-1] == 0


#: (dtype, rows, hidden, weight dtype) -> (tree kernels that follow the backward kernel)
CHAIN_CASES = {
    (torch.bfloat16, 4096, 2048, torch.bfloat16): 2,  # pipelined: a level and the last
    (torch.bfloat16, 64, 2048, torch.float32): 1,  # the one-row kernel, the last launch
    (torch.bfloat16, 1000, 100, torch.float32): 2,  # the register kernels (rows off 16 B)
    (torch.bfloat16, 1, 2048, torch.float32): 0,  # one fp32 row is dweight: no tree
    (torch.bfloat16, 1, 2048, torch.bfloat16): 0,  # one group: the kernel stores dweight
}


@pytest.mark.parametrize("case", CHAIN_CASES, ids=str)
def test_tree_launches_are_chained_after_the_backward_kernel(case, monkeypatch):
    """Where tree kernels follow, on a device that allows it (sm_90, outside a capture)
    they are chained launches and the backward kernel is given F_LET_DEPENDENTS (its only
    argument that differs); on a device that does not allow it every launch is plain and
    the flag is absent; no tree, no flag."""
    dtype, rows, hidden, wdtype = case
    x = torch.zeros(rows, hidden, dtype=dtype)
    w = torch.zeros(hidden, dtype=wdtype)

    def backward(pdl: bool) -> list:
        with monkeypatch.context() as m:
            launches = _record_launches(m, pdl=pdl)
            cb.run.backward("torch", OP_RMS, [x], [x], w, 1e-6, {"offset": 1.0})
        known = {x.data_ptr(): "x", w.data_ptr(): "w", 0: "0"}
        out = Recorded()  # buffers the call allocates: "new" (their addresses vary)
        out.chained = launches.chained
        out.extend((n, g, b, tuple(known.get(int(a), "new") if isinstance(a, np.uint64)
                                   else a for a in args), sm)
                   for n, g, b, args, sm in launches)
        return out

    chained, plain = backward(True), backward(False)
    assert not any(plain.chained)
    assert [n for n, *_ in chained] == [n for n, *_ in plain]
    trees = CHAIN_CASES[case]
    assert len(plain) == 1 + trees
    assert chained.chained == [False] + [True] * trees
    assert chained[1:] == plain[1:]
    (_, grid, block, args, smem), (_, grid0, block0, args0, smem0) = chained[0], plain[0]
    assert (grid, block, smem) == (grid0, block0, smem0)
    differ = [(a, b) for a, b in zip(args, args0, strict=True) if a != b]
    if trees:
        assert differ == [(args0[i] | F_LET_DEPENDENTS, args0[i])
                          for i in range(len(args0)) if args[i] != args0[i]]
        assert len(differ) == 1 and isinstance(differ[0][1], np.int32)
        assert not int(differ[0][1]) & F_LET_DEPENDENTS
    else:
        assert differ == []


LAUNCH_LAYOUT_C = r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu\n", sizeof(CUlaunchAttribute),
         offsetof(CUlaunchAttribute, id), offsetof(CUlaunchAttribute, value),
         offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed),
         sizeof(((CUlaunchAttributeValue*)0)->programmaticStreamSerializationAllowed),
         sizeof(CUlaunchAttributeID));
  printf("%zu %zu %zu %zu %zu %zu %zu\n", sizeof(CUlaunchConfig),
         offsetof(CUlaunchConfig, gridDimX), offsetof(CUlaunchConfig, blockDimX),
         offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
         offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs));
  printf("%d\n", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
"""


def test_chained_launch_structures_match_cuda_h(tmp_path):
    """The ctypes mirrors of cuda.h's CUlaunchAttribute and CUlaunchConfig (the CuPy
    backend's chained launches through cuLaunchKernelEx) have the header's sizes and
    offsets, and the attribute id is the header's, as a C compiler sees them."""
    import ctypes
    import shutil

    include, compiler = cb.nvrtc.cuda_include_dir(), shutil.which("cc")
    if include is None or compiler is None or not (Path(include) / "cuda.h").exists():
        pytest.skip("needs a C compiler and the CUDA toolkit's cuda.h")
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text(LAUNCH_LAYOUT_C)
    subprocess.run([compiler, f"-I{include}", str(src), "-o", str(exe)], check=True)
    attr_line, config_line, attr_id = subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")[:3]
    A, C = cb.driver._CuLaunchAttribute, cb.driver._CuLaunchConfig
    assert [int(v) for v in attr_line.split()] == [
        ctypes.sizeof(A), A.id.offset, A.value.offset, 0, 4, ctypes.sizeof(ctypes.c_int)]
    assert [int(v) for v in config_line.split()] == [
        ctypes.sizeof(C), C.grid.offset, C.block.offset, C.shared_mem_bytes.offset,
        C.stream.offset, C.attrs.offset, C.num_attrs.offset]
    assert int(attr_id) == cb.driver._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@pytest.mark.parametrize("arch,driver,want", [("sm_90", True, True), ("sm_100", True, True),
                                               ("compute_90", True, True),
                                               ("sm_89", True, False), ("compute_80", True, False),
                                               ("sm_90", False, False)])
def test_chained_launches_need_sm90_code_and_the_driver_entry(arch, driver, want, monkeypatch):
    """Chained launches only where the kernels were compiled for sm_90 or later (their
    ``griddepcontrol.wait`` is real) and the driver has cuLaunchKernelEx; cached per
    device; a capture says no whatever the device."""
    monkeypatch.setattr(cb.device, "_states", {})
    monkeypatch.setattr(cb.nvrtc, "device_arch", lambda cp, dev: arch)
    monkeypatch.setattr(cb.driver, "cu_launch_kernel_ex",
                        lambda: (lambda *a: 0) if driver else None)
    monkeypatch.setattr(cb.device, "current_stream_capturing", lambda cp: False)
    assert cb.device.chained_launches(None, 3) is want
    assert cb.device.state(3).pdl_capable(None) is want
    monkeypatch.setattr(cb.nvrtc, "device_arch", lambda cp, dev: pytest.fail("not cached"))
    assert cb.device.chained_launches(None, 3) is want
    monkeypatch.setattr(cb.device, "current_stream_capturing", lambda cp: True)
    assert cb.device.chained_launches(None, 3) is False


def test_chained_launch_passes_what_it_was_given(monkeypatch):
    """``_launch_chained`` hands the driver the grid and block (padded to three
    dimensions), the shared memory, the current stream, one attribute (programmatic stream
    serialization, allowed), the kernel handle and a pointer to each argument's value in
    its C type; a failing status is raised as the driver's error."""
    import ctypes

    seen = []

    def driver_call(config, function, params, extra):
        c = config.contents
        types = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float)
        seen.append((tuple(c.grid), tuple(c.block), c.shared_mem_bytes, c.stream, c.num_attrs,
                     c.attrs[0].id, c.attrs[0].value[0], function, extra,
                     [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value
                      for i, t in enumerate(types)]))
        return status

    stream = types.SimpleNamespace(ptr=0x5000)
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setattr(cb.nvrtc, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(cb.driver, "_cu_launch_kernel_ex_fn", [driver_call])
    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0x99))
    args = cb.driver.KernelArgs("Qqif", (2**63 + 1, -16, -4, 1.5))
    status = 0
    cb.driver.launch(fn, (7, 2), (16, 16, 1), args, 12, chained=True)
    assert seen == [((7, 2, 1), (16, 16, 1), 12, 0x5000, 1,
                     cb.driver._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1, 0x99,
                     None,
                     [2**63 + 1, -16, -4, 1.5])]
    status = 1  # CUDA_ERROR_INVALID_VALUE: CuPy's CUDADriverError (a RuntimeError), or
    # where no driver library can name it (CPU machines) a RuntimeError naming the status
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_INVALID_VALUE|CUresult 1$"):
        cb.driver.launch(fn, (1, 1, 1), (32, 1, 1), args, 0, chained=True)


@pytest.mark.parametrize("chained", [False, True])
def test_a_launch_without_a_current_context_binds_one_and_retries(chained, monkeypatch):
    """Where the driver finds no current context (CUDA_ERROR_INVALID_CONTEXT, a thread no
    runtime call has touched), the launch makes the current device's primary context
    current through ``cudaSetDevice`` and is tried once more; a second failure is raised.
    Other failures are raised at once, with nothing bound."""
    statuses, seen, set_device = [], [], []

    def driver_call(config, function, params, extra):
        seen.append((config.contents.num_attrs, function))
        return statuses.pop(0)

    runtime = types.SimpleNamespace(getDevice=lambda: 3, setDevice=set_device.append)
    stream = types.SimpleNamespace(ptr=0x5000)
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: stream, runtime=runtime))
    monkeypatch.setattr(cb.nvrtc, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(cb.driver, "_cu_launch_kernel_ex_fn", [driver_call])
    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0x99))
    args = cb.driver.KernelArgs("Qi", (0x1000, 5))
    launch = lambda: cb.driver.launch(fn, (1, 1, 1), (32, 1, 1), args, 0, chained=chained)  # noqa: E731
    attrs = 1 if chained else 0
    statuses[:] = [cb.driver.CUDA_ERROR_INVALID_CONTEXT, 0]
    launch()
    assert seen == [(attrs, 0x99)] * 2 and set_device == [3] and not statuses
    seen.clear(), set_device.clear()
    statuses[:] = [cb.driver.CUDA_ERROR_INVALID_CONTEXT] * 2
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_INVALID_CONTEXT|CUresult 201$"):
        launch()
    assert len(seen) == 2 and set_device == [3]
    seen.clear(), set_device.clear()
    statuses[:] = [1]  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_INVALID_VALUE|CUresult 1$"):
        launch()
    assert len(seen) == 1 and not set_device


class _DriverError(RuntimeError):
    """As CuPy's ``CUDADriverError``: the driver's status in ``status``."""

    def __init__(self, status):
        super().__init__(f"CUresult {status}")
        self.status = status


def test_a_rawkernel_launch_without_a_current_context_binds_one_and_retries(monkeypatch):
    """Where the driver lacks ``cuLaunchKernelEx`` the launch is CuPy's ``RawKernel``; its
    ``CUDA_ERROR_INVALID_CONTEXT`` binds the context and launches once more, a second
    failure and other failures are raised."""
    statuses, calls, binds = [], [], []

    def kernel(grid, block, values, shared_mem=0):
        calls.append((grid, block, tuple(int(v) for v in values), shared_mem))
        status = statuses.pop(0)
        if status:
            raise _DriverError(status)

    monkeypatch.setattr(cb.driver, "_cu_launch_kernel_ex_fn", [None])
    monkeypatch.setattr(cb.driver, "bind_primary_context", lambda: binds.append(1))
    args = cb.driver.KernelArgs("Qi", (0x1000, 5))
    statuses[:] = [cb.driver.CUDA_ERROR_INVALID_CONTEXT, 0]
    cb.driver.launch(kernel, (2, 1, 1), (64, 1, 1), args, 128)
    assert calls == [((2, 1, 1), (64, 1, 1), (0x1000, 5), 128)] * 2 and binds == [1]
    calls.clear(), binds.clear()
    statuses[:] = [cb.driver.CUDA_ERROR_INVALID_CONTEXT] * 2
    with pytest.raises(_DriverError, match="CUresult 201"):
        cb.driver.launch(kernel, (2, 1, 1), (64, 1, 1), args, 128)
    assert len(calls) == 2 and binds == [1]
    calls.clear(), binds.clear()
    statuses[:] = [1]
    with pytest.raises(_DriverError, match=r"CUresult 1$"):
        cb.driver.launch(kernel, (2, 1, 1), (64, 1, 1), args, 128)
    assert len(calls) == 1 and not binds


def test_cold_driver_calls_bind_the_context_first(monkeypatch):
    """The driver calls that come before a thread's first launch bind the device's primary
    context first: a module's load (``get_function`` in ``DeviceState.kernel``) and a pipelined
    kernel's attributes and occupancy (``DeviceState.prepare_pipe_kernel``); cache hits bind
    nothing."""
    events = []
    monkeypatch.setattr(cb.driver, "bind_primary_context", lambda: events.append("bind"))

    class Module:
        def get_function(self, lowered):
            events.append(f"load {lowered}")
            return f"fn {lowered}"

    monkeypatch.setattr(cb.device.DeviceState, "module", lambda self, op, dt, part: (
        events.append(part) or Module(), {"k": "_Zk"}))
    st = cb.device.DeviceState(0)
    assert st.kernel(OP_RMS, DT_BF16, "k") == "fn _Zk"
    assert st.kernel(OP_RMS, DT_BF16, "k") == "fn _Zk"  # kept
    assert events == ["forward", "bind", "load _Zk"]

    class Function:
        shared_size_bytes = 1024
        kernel = types.SimpleNamespace(ptr=0x99)

        def __setattr__(self, name, value):
            events.append(f"set {name}={value}")

    driver = types.SimpleNamespace(
        occupancyMaxActiveBlocksPerMultiprocessor=lambda ptr, block, smem:
            events.append(f"occupancy {block} {smem}") or 3)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api.driver", driver)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api",
                        types.SimpleNamespace(driver=driver))
    events.clear()
    assert st.prepare_pipe_kernel(Function(), ("key",), 256, 64 * 1024, 227 * 1024) == 3
    assert st.prepare_pipe_kernel(Function(), ("key",), 256, 64 * 1024, 227 * 1024) == 3
    assert events == ["bind", f"set max_dynamic_shared_size_bytes={227 * 1024 - 1024}",
                      f"occupancy 256 {64 * 1024}"]


def test_available_loads_every_module(monkeypatch):
    """``available()`` compiles and loads each module for the current device (one function
    of each, the context bound first), so a module the driver refuses makes the backend
    unavailable with the driver's reason instead of failing at a first call."""
    events = []
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 3, getDevice=lambda: 2),
        Device=lambda dev: contextlib.nullcontext()))
    monkeypatch.setattr(cb.nvrtc, "import_cupy", lambda: (fake_cp, None))
    monkeypatch.setattr(cb.nvrtc, "compile_error", None)
    monkeypatch.setattr(cb.driver, "bind_primary_context", lambda: events.append("bind"))

    class Module:
        def __init__(self, key):
            self.key = key

        def get_function(self, lowered):
            events.append((self.key, lowered))
            if self.key == refused:
                raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")

    monkeypatch.setattr(cb.device.DeviceState, "module", lambda self, op, dt, part: (
        Module((self.dev, op, dt, part)),
        {f"normspec_{'fwd' if part == 'forward' else 'bwd'}_k": f"_Z{op}{dt}"}))
    monkeypatch.setattr(cb.nvrtc, "compile_modules", lambda dev: events.append(("compile", dev)))
    monkeypatch.setattr(cb.device, "_states", {})
    refused = None
    assert cb.available() is None
    assert events[0] == ("compile", 2)  # side by side first, on the current device
    events.pop(0)
    loads = [e for e in events if e != "bind"]
    assert len(loads) == 21 and events.count("bind") == 21
    assert {key for key, _ in loads} == {(2, *module) for module in cb.MODULES}
    refused = (2, OP_GATED, DT_F16, "backward")
    monkeypatch.setattr(cb.device, "_states", {})  # a new process: nothing loaded yet
    reason = cb.available()
    assert reason is not None and "CUDA_ERROR_NO_BINARY_FOR_GPU" in reason


def test_available_reports_a_bad_max_jobs(monkeypatch):
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0)))
    monkeypatch.setattr(cb.nvrtc, "import_cupy", lambda: (fake_cp, None))
    monkeypatch.setattr(cb.nvrtc, "compile_error", None)
    monkeypatch.setenv("MAX_JOBS", "many")
    assert cb.available() == ("MAX_JOBS: expected a positive integer (how many NVRTC "
                              "compiles run at once), got 'many'")
    monkeypatch.setenv("MAX_JOBS", " 3 ")
    assert cb.nvrtc._max_jobs() == 3


@pytest.mark.parametrize("driver", [True, False])
def test_plain_launches_through_the_driver(driver, monkeypatch):
    """Plain launches call the driver's ``cuLaunchKernelEx`` without launch attributes,
    the arguments packed as the chained launches' (each value read back through its
    parameter pointer), or CuPy's RawKernel where the driver lacks the function."""
    import ctypes

    seen, raw = [], []

    def driver_call(config, function, params, extra):
        c = config.contents
        types_ = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float,
                  ctypes.c_int64)
        seen.append((tuple(c.grid), tuple(c.block), c.shared_mem_bytes, c.stream,
                     c.num_attrs, function,
                     [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value
                      for i, t in enumerate(types_)]))
        return 0

    stream = types.SimpleNamespace(ptr=0x5000)
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setattr(cb.nvrtc, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(cb.driver, "_cu_launch_kernel_ex_fn", [driver_call if driver else None])

    class Kernel:  # RawKernel's call, recorded
        kernel = types.SimpleNamespace(ptr=0x77)

        def __call__(self, grid, block, args, shared_mem=0):
            raw.append((grid, block, args, shared_mem))

    args = cb.driver.KernelArgs("Qqifq", (0x1000, -3, 7, 0.1, 0))
    for _ in range(2):  # the second launch reuses the packed layout and the configuration
        cb.driver.launch(Kernel(), (3, 1, 1), (256, 1, 1), args, 64)
    stream.ptr = 0x6000  # another stream: a configuration of its own
    cb.driver.launch(Kernel(), (3, 1, 1), (256, 1, 1), args, 64)
    if driver:
        values = [0x1000, -3, 7, float(np.float32(0.1)), 0]
        assert not raw and seen == [((3, 1, 1), (256, 1, 1), 64, 0x5000, 0, 0x77, values)] * 2 + [
            ((3, 1, 1), (256, 1, 1), 64, 0x6000, 0, 0x77, values)]
    else:
        assert not seen and len(raw) == 3
        for grid, block, numpy_args, smem in raw:  # NumPy scalars of the codes' C types
            assert (grid, block, smem) == ((3, 1, 1), (256, 1, 1), 64)
            assert [type(v) for v in numpy_args] == [np.uint64, np.int64, np.int32,
                                                     np.float32, np.int64]
            assert numpy_args == (0x1000, -3, 7, np.float32(0.1), 0)


@pytest.mark.parametrize("value", [0.1, 1e-6, -2.5, 3.4028234663852886e38,
                                   2.0**128 - 2.0**104, 2.0**128 - 2.0**103 - 2.0**70,
                                   2.0**128 - 2.0**103, 1e39, -1e39, 5e-324, -0.0])
def test_float32_arguments_round_as_numpy_does(value):
    """A float32 argument packs to the bits NumPy's ``float32`` gives (the C cast the
    RawKernel path and the torch extension apply), infinity included where the value
    rounds past the largest float32 (``struct`` alone would refuse it)."""
    import struct
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's overflow warning
        want = np.float32(value).tobytes()
    assert struct.pack("<f", cb.driver.f32_arg(value)) == want
    assert cb.driver.KernelArgs("f", (cb.driver.f32_arg(value),)).numpy()[0].tobytes() == want


def test_launch_configurations_are_kept_per_thread_and_bounded(monkeypatch):
    """A launch configuration is built once per grid, block, shared memory, stream and
    attribute count in each thread, and the kept ones start again past ``_CONFIGS_MAX``."""
    import threading

    configs = []
    monkeypatch.setattr(cb.driver, "_cu_launch_kernel_ex_fn",
                        [lambda config, *rest: configs.append(config) or 0])
    stream = types.SimpleNamespace(ptr=0)
    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setattr(cb.nvrtc, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(cb.driver, "_CONFIGS_MAX", 3)
    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0x99))
    args = cb.driver.KernelArgs("Q", (1,))

    def launches():
        cb.driver.launch(fn, (1, 1, 1), (32, 1, 1), args)
        cb.driver.launch(fn, (1, 1, 1), (32, 1, 1), args)
        cb.driver.launch(fn, (2, 1, 1), (32, 1, 1), args)
        cb.driver.launch(fn, (1, 1, 1), (32, 1, 1), args, chained=True)

    cb.driver._launch_configs.__dict__.clear()
    launches()
    assert configs[0] is configs[1] and len({id(c) for c in configs}) == 3
    assert configs[3].contents.num_attrs == 1 and configs[0].contents.num_attrs == 0
    assert configs[0].contents.stream is None  # the null stream
    mine = dict(cb.driver._launch_configs.__dict__)
    worker = threading.Thread(target=launches)
    worker.start()
    worker.join()
    assert not {id(c) for c in configs[4:]} & {id(c) for c in configs[:4]}
    assert cb.driver._launch_configs.__dict__ == mine  # the worker's are its own
    cb.driver.launch(fn, (3, 1, 1), (32, 1, 1), args)  # a fourth: the kept ones start again
    assert len(cb.driver._launch_configs.__dict__) == 1
    cb.driver._launch_configs.__dict__.clear()


def test_packed_arguments_are_per_thread():
    """Each thread packs into buffers of its own (the autograd engine's device thread runs
    backward launches while the caller's thread may launch forwards)."""
    import threading

    args = cb.driver.KernelArgs("Qi", (1, 2))
    here = cb.driver._packed_params(args)
    there = []
    worker = threading.Thread(target=lambda: there.append(cb.driver._packed_params(args)))
    worker.start()
    worker.join()
    assert cb.driver._packed_params(args) is here and there[0] is not here
    assert there[0][0] != here[0]  # different buffers


@pytest.mark.parametrize("residual_sum,dtype,from_sum", [
    ("rounded", torch.bfloat16, True), ("fp32", torch.float32, True),
    ("fp32", torch.bfloat16, False)])
def test_fused_backward_from_the_sum(residual_sum, dtype, from_sum, monkeypatch):
    """Where the fused op's new residual is the sum its norm read, autograd's backward runs
    OP_FUSED_SUM on that tensor (no residual row) and gives its one gradient row to x and
    the residual alike; otherwise OP_FUSED on x and the residual, two gradient rows."""
    launches = _record_launches(monkeypatch)
    x = torch.zeros(64, 2048, dtype=dtype, requires_grad=True)
    r = torch.zeros(64, 2048, dtype=dtype, requires_grad=True)
    w = torch.zeros(2048, dtype=dtype, requires_grad=True)
    params = {"offset": 1.0, "residual_sum": residual_sum}
    y, res = cb.ops._NormFunction.apply(OP_FUSED, 1e-6, params, w, x, r)
    rstd = launches[0][3][-2]
    launches.clear()
    dx, dr, _ = torch.autograd.grad((y, res), (x, r, w), (torch.zeros_like(y),) * 2)
    name, _, _, args, _ = launches[0]
    assert name.startswith(f"normspec_bwd_pipe_kernel<{3 if from_sum else 1}, ")
    assert args[-1] == rstd
    if from_sum:  # x = s, r = 0, d2 = 0
        assert args[0] == np.uint64(res.data_ptr()) and args[1] == 0 and args[6] == 0
        assert dx.data_ptr() == dr.data_ptr()
        assert int(args[18]) & F_ROUNDED == (F_ROUNDED if residual_sum == "rounded" else 0)
    else:
        assert args[0] == np.uint64(x.data_ptr()) and args[1] == np.uint64(r.data_ptr())
        assert dx.data_ptr() != dr.data_ptr()


@pytest.mark.parametrize("convention,wdtype,gc", [
    ("vllm", torch.bfloat16, 0), ("hf", torch.float32, 1), ("hf", torch.bfloat16, 7)])
def test_gated_backward_pair_kernel_arguments(convention, wdtype, gc, monkeypatch):
    """The bench's GDN shape with the saved rstd launches the pair kernel: 32-bit rows and
    strides, no eps, the table's and the stacks' shared memory, the persistent grid."""
    launches = _record_launches(monkeypatch)
    x = torch.empty(2**17, 256, dtype=torch.bfloat16)
    rstd = torch.empty(2**17)
    w = torch.empty(256, dtype=wdtype)
    cb.run.backward("torch", OP_GATED, [x], [x, x], w, 1e-6, {"convention": convention},
                 rstd=rstd)
    name, grid, block, args, smem = launches[0]
    assert name == f"normspec::normspec_gated_bwd_pair_kernel<__nv_bfloat16, 5, {gc}>"
    assert len(args) == 18 and [type(v) for v in args[7:13]] == [np.int32] * 6
    assert [int(v) for v in args[7:13]] == [2**17, 256, 256, 256, 256, 256]
    assert isinstance(args[13], np.float32) and args[-1] == np.uint64(rstd.data_ptr())
    assert (int(args[15]), int(args[16])) == (4, 2**13)  # glog, groups
    assert smem == 8192 * 8 + 3 * 8 * 4 * 256 and block == (256, 1, 1)
    assert grid == (264, 1, 1)  # two blocks a SM (the stub's occupancy)
    assert bool(int(args[14]) & F_W_RAW) == (wdtype == torch.bfloat16)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_one_group_backward_stores_dweight_itself(wdtype, monkeypatch):
    """One row of 2048 bf16: the one-row backward (256 x 1) and one dweight group, which
    the kernel stores in the weight's dtype itself (F_DW_FINAL, no tree launch) for a
    weight of the input dtype; an fp32 weight's one fp32 row is its dweight."""
    launches = _record_launches(monkeypatch)
    x = torch.empty(1, 2048, dtype=torch.bfloat16)
    w = torch.empty(2048, dtype=wdtype)
    _, dweight = cb.run.backward("torch", OP_RMS, [x], [x], w, 1e-6, {"offset": 1.0})
    ((name, grid, block, args, _),) = launches
    assert name == "normspec_bwd_row_kernel<__nv_bfloat16, 1, 8, false>"
    assert (grid, block) == ((1, 1, 1), (256, 1, 1))
    assert len(args) == 13 and args[4] == np.uint64(dweight.data_ptr())
    assert dweight.dtype == wdtype and dweight.shape == (2048,)
    assert bool(int(args[11]) & F_DW_FINAL) == (wdtype == torch.bfloat16)


class _FakeStream:
    def __init__(self, capturing: bool) -> None:
        self.ptr, self.capturing, self.waits = 7, capturing, 0

    def synchronize(self) -> None:
        self.waits += 1


class _FakeCupy:
    """What ``DeviceState.global_gate_table`` asks of CuPy: the current stream, its capture status,
    and ``empty``."""

    def __init__(self, stream: _FakeStream) -> None:
        self.float32 = "float32"
        self.allocated = []
        runtime = types.SimpleNamespace(
            streamCaptureStatusNone=0,
            streamIsCapturing=lambda ptr: 1 if stream.capturing else 0)
        self.cuda = types.SimpleNamespace(get_current_stream=lambda: stream, runtime=runtime)

    def empty(self, n, dtype):
        self.allocated.append((n, dtype))
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=0x200000))


def test_global_gate_table_is_filled_once_per_activation_and_never_in_a_capture(monkeypatch):
    """The first ask per device and activation allocates the table (both halves), launches
    the fill kernel on the current stream with that half's address and the activation,
    and waits; later asks only return the address. While the stream is captured, before
    the first fill, nothing is allocated, launched or waited for, and the answer is None."""
    monkeypatch.setattr(cb.device.DeviceState, "kernel", lambda self, op, dt, name: name)
    st = cb.device.DeviceState(0)
    launches = []
    monkeypatch.setattr(cb.driver, "launch", lambda fn, grid, block, args, shared_mem=0:
                        launches.append((fn, grid, block, args.numpy())))
    stream = _FakeStream(capturing=True)
    fake = _FakeCupy(stream)
    assert st.global_gate_table(fake, True) is None
    assert fake.allocated == [] and launches == [] and stream.waits == 0
    stream.capturing = False
    half = 0x200000 + 4 * 8192
    assert st.global_gate_table(fake, True) == half
    assert fake.allocated == [(2 * 8192, "float32")] and stream.waits == 1
    assert launches == [(cb.launches.FILL_GATE_TABLE_KERNEL, (32, 1, 1), (256, 1, 1),
                         (np.uint64(half), np.int32(1)))]
    stream.capturing = True  # filled: a capture may use it
    assert st.global_gate_table(fake, True) == half and len(launches) == 1
    stream.capturing = False
    assert st.global_gate_table(fake, False) == 0x200000  # the other half: one fill
    assert len(fake.allocated) == 1 and len(launches) == 2 and stream.waits == 2
    assert launches[1][3] == (np.uint64(0x200000), np.int32(0))

def test_alignment_flag():
    a = cb.run.Args(x=4096, w=8192, y=16384, rows=3, H=8, sx=8, sy=8)
    assert cb.run.with_alignment(a, 4).flags & F_ALIGNED
    assert cb.run.with_alignment(a, 2).flags & F_ALIGNED  # 16 bytes a row
    assert not cb.run.with_alignment(cb.run.Args(x=4096, w=8192, y=16384, sx=9, sy=8), 4).flags
    assert not cb.run.with_alignment(cb.run.Args(x=4098, w=8192, y=16384, sx=8, sy=8), 2).flags
    assert not cb.run.with_alignment(cb.run.Args(x=4096, w=8196, y=16384, sx=8, sy=8), 4).flags
    # unused (null) pointers do not count
    assert cb.run.with_alignment(cb.run.Args(x=4096, w=8192, y=16384, sx=8, sy=8, sr=3), 4).flags


def test_quick_argument_edits_equal_replace():
    """``_with_flags`` and ``_with_weight_ptr`` (tuple edits by position) give what
    ``_replace`` gives, and ``Args`` still ends with its flags."""
    a = cb.run.Args(*range(1, len(cb.run.Args._fields) + 1))
    assert cb.run.Args._fields[-1] == "flags"
    assert cb.run.with_flags(a, 99) == a._replace(flags=99)
    assert type(cb.run.with_flags(a, 99)) is cb.run.Args
    assert cb.run.with_weight_ptr(a, 0x800, 5) == a._replace(w=0x800, flags=5)


def test_modules_split_each_op_and_dtype_by_direction():
    """An (op, dtype)'s forward and backward modules hold apart, together, every kernel its
    launchers can pick; ``kernel_part`` names the module that holds each one, which is the
    module ``DeviceState.kernel`` loads it from."""
    assert len(cb.MODULES) == len(set(cb.MODULES)) == 21
    for op, dt in itertools.product(range(4), range(3)):
        forward, backward = (cb.name_expressions(op, dt, part) for part in cb.PARTS)
        assert sorted(forward + backward) == sorted(cb.name_expressions(op, dt))
        assert not set(forward) & set(backward)
        assert bool(forward) == (op != OP_FUSED_SUM) == ((op, dt, "forward") in cb.MODULES)
        assert backward and (op, dt, "backward") in cb.MODULES
        assert {cb.launches.kernel_part(n) for n in forward} <= {"forward"}
        assert {cb.launches.kernel_part(n) for n in backward} == {"backward"}
    with pytest.raises(ValueError, match=r"part: expected one of .* got 'both'"):
        cb.name_expressions(OP_RMS, DT_F32, "both")


def test_launch_shapes():
    """The dweight tree's launches; each module's kernels are listed once (that every one
    a plan can pick is among them, tests/test_launch_plan.py checks)."""
    assert cb.geometry.col_tree_launch(100003, 64) == (6251, 4, (1, 6251, 1))
    assert cb.geometry.col_tree_launch(3, 5000) == (1, 2, (20, 1, 1))
    assert cb.geometry.col_tree_last_launch(1, 2048) == (0, 0, (128, 1, 1))
    assert cb.geometry.col_tree_last_launch(12, 100) == (4, 0, (7, 1, 1))
    assert cb.geometry.col_tree_last_launch(256, 2048) == (4, 4, (128, 1, 1))
    assert cb.geometry.col_tree_last_launch(129, 1) == (4, 4, (1, 1, 1))
    for op in (0, 1, 2, 3):
        for dt in (0, 1, 2):
            names = cb.name_expressions(op, dt)
            assert len(names) == len(set(names))
            assert "normspec_col_tree_kernel" in names
            if op == OP_FUSED_SUM:
                assert not any(n.startswith("normspec_fwd") for n in names)


def test_a_module_compile_is_announced_and_cached(monkeypatch, tmp_path, capsys):
    """A module's first compile says on stderr what it compiles, for which target, where
    it is cached and how long it took; a later load from the disk cache says nothing and
    compiles nothing."""
    compiled, loaded = [], []

    def fake_compile(names, arch):
        compiled.append(arch)
        return b"\x7fELF image", {n: f"_Z{i}" for i, n in enumerate(names)}, ""

    fake_cp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext(),
                                   nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 0))),
        RawModule=lambda path: loaded.append(Path(path).read_bytes()) or "module")
    monkeypatch.setenv("NORMSPEC_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cb.nvrtc, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(cb.nvrtc, "device_arch", lambda cp, dev: "sm_90")
    monkeypatch.setattr(cb.nvrtc, "compile_kernels", fake_compile)
    monkeypatch.setattr(cb.device, "_states", {})
    module, mapping = cb.device.state(0).module(OP_GATED, DT_BF16, "forward")
    err = capsys.readouterr().err
    assert compiled == ["sm_90"] and module == "module"
    assert set(mapping) == set(cb.name_expressions(OP_GATED, DT_BF16, "forward"))
    assert ("compiling the rms_norm_gated forward kernels (bfloat16, sm_90) with NVRTC" in err
            and str(tmp_path / "cache") in err)
    assert re.search(r"compiled the rms_norm_gated forward kernels \(bfloat16, sm_90\) in \d+ s",
                     err)
    monkeypatch.setattr(cb.device, "_states", {})  # a new process: from the disk cache
    assert cb.device.state(0).module(OP_GATED, DT_BF16, "forward")[1] == mapping
    assert compiled == ["sm_90"] and capsys.readouterr().err == ""
    assert loaded == [b"\x7fELF image"] * 2


def _fake_nvrtc_world(monkeypatch, tmp_path, compile_kernels):
    """A CuPy whose NVRTC compiles with ``compile_kernels`` into a temporary disk cache."""
    fake_cp = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext(),
                                   runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                   nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 0))),
        RawModule=lambda path: Path(path).read_bytes())
    monkeypatch.setenv("NORMSPEC_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cb.nvrtc, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(cb.nvrtc, "device_arch", lambda cp, dev: "sm_90")
    monkeypatch.setattr(cb.nvrtc, "compile_kernels", compile_kernels)
    monkeypatch.setattr(cb.device, "_states", {})
    monkeypatch.setattr(cb.nvrtc, "_compile_locks", {})
    monkeypatch.setattr(cb.nvrtc, "compile_error", None)
    return fake_cp


def _image(names, tag):
    return tag.encode(), {n: f"_Z{i}" for i, n in enumerate(names)}, ""


def test_modules_compile_side_by_side(monkeypatch, tmp_path, capsys):
    """``compile_modules`` runs ``jobs`` NVRTC compiles at once: here the first three
    compiles wait until all three run (a barrier that times out one after another), and
    meanwhile a module found in the disk cache still loads (no process-wide lock is held
    through a compile). A second call finds everything cached and compiles nothing."""
    barrier, order = threading.Barrier(3, timeout=20), itertools.count(1)
    compiled, loaded_meanwhile = [], []

    def fake_compile(names, arch):
        compiled.append(tuple(names))
        nth = next(order)
        if nth <= 3:
            barrier.wait()
        if nth == 3:
            loaded_meanwhile.append(cb.device.state(0).module(OP_RMS, DT_F32, "forward")[0])
        return _image(names, f"{names[0]} image")

    _fake_nvrtc_world(monkeypatch, tmp_path, lambda names, arch: _image(
        names, f"{names[0]} image"))
    cb.nvrtc.module_image(cb.nvrtc.require_cupy(), 0, *cb.MODULES[0])  # on disk, not loaded
    capsys.readouterr()
    monkeypatch.setattr(cb.nvrtc, "compile_kernels", fake_compile)
    cb.compile_modules(0, jobs=3)
    assert cb.MODULES[0] == (OP_RMS, DT_F32, "forward")
    assert sorted(compiled) == sorted(tuple(cb.name_expressions(*module))
                                      for module in cb.MODULES[1:])
    assert loaded_meanwhile == [f"{cb.name_expressions(*cb.MODULES[0])[0]} image".encode()]
    assert capsys.readouterr().err.count("normspec cupy: compiled the ") == 20
    cb.compile_modules(0, jobs=3)
    assert len(compiled) == 20 and capsys.readouterr().err == ""


def test_one_module_is_compiled_once_by_threads_that_race_for_it(monkeypatch, tmp_path):
    """Threads asking for the same missing module at once: one compiles, the others wait
    for its image and load that."""
    started, release, compiled = threading.Event(), threading.Event(), []

    def fake_compile(names, arch):
        compiled.append(arch)
        started.set()
        assert release.wait(20)
        return _image(names, "the image")

    _fake_nvrtc_world(monkeypatch, tmp_path, fake_compile)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        cb.nvrtc.module_image(cb.nvrtc.require_cupy(), 0, OP_FUSED, DT_BF16, "backward")))
        for _ in range(3)]
    for t in threads:
        t.start()
    assert started.wait(20)
    release.set()
    for t in threads:
        t.join(20)
    assert compiled == ["sm_90"] and len(results) == 3
    assert len({(path, tuple(m.items())) for path, m in results}) == 1


def test_a_failed_compile_is_raised_after_the_others_finish(monkeypatch, tmp_path):
    """One module NVRTC refuses: ``compile_modules`` raises its error once the others
    finished, their images are cached, and ``available()`` reports the failure since."""
    bad = cb.name_expressions(OP_GATED, DT_F16, "backward")

    def fake_compile(names, arch):
        if names == bad:
            raise cb.NVRTCCompileError("NVRTC compile failed (6):\nerror: planted")
        return _image(names, "fine")

    _fake_nvrtc_world(monkeypatch, tmp_path, fake_compile)
    with pytest.raises(cb.NVRTCCompileError, match="planted"):
        cb.compile_modules(0, jobs=4)
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 20
    assert "planted" in cb.nvrtc.compile_error


# ---- NVRTC, without a GPU ---------------------------------------------------------------
def _nvrtc_or_skip():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.nvrtc.getVersion()
    except Exception as exc:  # libnvrtc not found
        pytest.skip(f"NVRTC not loadable: {exc}")
    if cb.nvrtc.cuda_include_dir() is None:
        pytest.skip("no CUDA headers (cuda_bf16.h) for NVRTC: pip install nvidia-cuda-runtime")
    return cp


@pytest.fixture(scope="module")
def sm90_modules(request) -> dict[tuple[int, int, str], Future]:
    """The modules ``test_every_kernel_compiles_to_sm90_cubin`` runs for, compiled side
    by side before the first of those tests (NVRTC releases the GIL): 92 s on CI's two
    cores, 192 s one after another."""
    _nvrtc_or_skip()
    # the longest first (backward, gated, 16-bit), so the pool does not end on a long one
    def longest_first(modules):
        return sorted(modules, key=lambda m: (m[2] != "backward", m[0] != OP_GATED,
                                              m[1] == DT_F32))

    return compile_ahead(request, "test_every_kernel_compiles_to_sm90_cubin", "module",
                         lambda m: cb.compile_kernels(cb.name_expressions(*m), "sm_90"),
                         longest_first)


@pytest.mark.parametrize("module", cb.MODULES, ids=lambda m: "-".join(map(str, m)))
def test_every_kernel_compiles_to_sm90_cubin(module, sm90_modules):
    """Each module as ``compile_modules`` compiles it."""
    names = cb.name_expressions(*module)
    compiled = sm90_modules.get(module)
    image, mapping, _log = (compiled.result() if compiled is not None
                            else cb.compile_kernels(names, "sm_90"))
    assert image[:4] == b"\x7fELF"
    assert set(mapping) == set(names)
    # the lowered names carry the argument types the launcher packs
    # 5 pointers, 6 long long, 2 float, int, rstd_out (the launcher packs a null pointer)
    fwd = "PKT0_S[0-9]_PKfPS[0-9]_S[0-9]_xxxxxxffiPf$"
    # the one-row forward: + the weight as void*, team_log, and after rstd_out the global
    # gate table (a null pointer but for the GT forms of large bf16 gated forwards)
    row = "PKT0_S[0-9]_PKvPS[0-9]_S[0-9]_xxxxxxffiiPfPKf$"
    bwd = "Pfxxxxxxxxffii$"  # ws, 8 long long, eps, offset, flags, glog
    # the pipelined backward: x, r, the weight as void*, dy, dres, dx, d2, ws, 8 long long,
    # eps, offset, flags, team_log, glog, the saved rstd (the launcher packs a null pointer)
    pipe = "PKT0_S[0-9]_PKvS[0-9]_S[0-9]_PS[0-9]_S[0-9]_PfxxxxxxxxffiiiPKf$"
    # the one-row rms backward: x, the weight as void*, dy, dx, ws, rows, 3 strides, eps,
    # offset, flags, the saved rstd
    bwd_row = "PKT_PKvS[0-9]_PS[0-9]_PfxxxxffiPKf$"
    # the gated pair kernel: x, z, the weight, dy, dx, dz, ws, rows and 5 strides in 32
    # bits, offset, flags, glog, groups, the saved rstd
    pair = "PKT_S[0-9]_PKvS[0-9]_PS[0-9]_S[0-9]_PfiiiiiifiiiPKf$"
    # the persistent forward: the one-row forward's arguments but the global gate table
    fwd_pipe = "PKT0_S[0-9]_PKvPS[0-9]_S[0-9]_xxxxxxffiiPf$"
    # the quad forward: x, r and the weight (T), y, y2, the rows in 32 bits, 4 strides,
    # eps, offset, flags, rstd_out
    quad = "PKT0_S[0-9]_S[0-9]_PS[0-9]_S[0-9]_ixxxxffiPf$"
    for name, low in mapping.items():
        if name.startswith("normspec_fwd_quad"):
            assert re.search(quad, low), (name, low)
        elif name.startswith("normspec_fwd_row"):
            assert re.search(row, low), (name, low)
        elif name.startswith("normspec_fwd_pipe"):
            assert re.search(fwd_pipe, low), (name, low)
        elif name.startswith("normspec_fill_gate_table"):  # the table, the activation
            assert re.search("^_Z31normspec_fill_gate_table_kernelI.*EvPfi$", low), low
        elif name.startswith("normspec_fwd"):
            assert re.search(fwd, low), (name, low)
        elif name.startswith("normspec_bwd_kernel"):
            assert re.search(bwd, low), (name, low)
        elif name.startswith("normspec_bwd_stream"):
            assert re.search("Pfxxxxxxxxffi$", low), (name, low)
        elif name.startswith("normspec_bwd_pipe"):
            assert re.search(pipe, low), (name, low)
        elif name.startswith("normspec_bwd_row"):
            assert re.search(bwd_row, low), (name, low)
        elif name.startswith("normspec::normspec_gated_bwd_pair"):
            assert re.search(pair, low), (name, low)
        elif name.startswith("normspec_col_tree_last"):  # in, out (weight dtype), G, H, logs
            assert re.search("^_Z29normspec_col_tree_last_kernelI.*EvPKfPT_xxii$", low), low
        else:
            assert low == "_Z24normspec_col_tree_kernelPKfPfxxi"


def test_compile_options():
    """NVRTC's options: the IEEE flags, the sources' and CUDA's includes, the target last,
    and no definitions."""
    opts = cb.nvrtc.compile_options("-arch=sm_90")
    assert opts[-1] == "-arch=sm_90" and opts[:len(cb.NVRTC_OPTIONS)] == cb.NVRTC_OPTIONS
    assert f"-I{cb.CSRC}" in opts and not any(o.startswith("-D") for o in opts)


def _registers(names, monkeypatch) -> dict[str, int]:
    """Registers per thread of each kernel, from ptxas's report through NVRTC (sm_90)."""
    real = cb.nvrtc.compile_options
    monkeypatch.setattr(cb.nvrtc, "compile_options", lambda a: (*real(a), "--ptxas-options=-v"))
    _image, mapping, log = cb.compile_kernels(names, "sm_90")
    regs, current = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            current = m.group(1)
        elif (m := re.search(r"Used (\d+) registers", line)) and current:
            regs[current] = int(m.group(1))
    return {n: regs[mapping[n]] for n in names}


def test_pinned_occupancy_caps_the_registers(monkeypatch):
    """The forms whose NVRTC binaries would take one resident block per SM less than
    nvcc's have at most 80 registers (three 256-thread blocks a SM)."""
    _nvrtc_or_skip()
    names = ["normspec_bwd_pipe_kernel<0, __nv_bfloat16, 2, 7, false, -1>",
             "normspec_bwd_pipe_kernel<3, __nv_bfloat16, 1, 5, true, -1>",
             "normspec_bwd_pipe_kernel<1, __half, 1, 5, true, -1>"]
    pinned = _registers(names, monkeypatch)
    assert all(r <= 80 for r in pinned.values()), pinned


def test_ptx_has_ieee_arithmetic_only():
    """No flush-to-zero, no contraction into fma, no approximate division or sqrt."""
    _nvrtc_or_skip()
    image, _, _ = cb.compile_kernels(cb.name_expressions(OP_GATED, DT_BF16), "compute_90")
    ptx = image.decode()
    assert ".entry" in ptx
    assert ".ftz" not in ptx
    assert not re.search(r"\bfma\.", ptx)
    assert "approx" not in ptx


def test_compile_error_reports_the_log(monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setattr(cb.nvrtc, "source_text",
                        lambda: "#include \"normspec_kernels.cuh\"\nint x = ;\n")
    with pytest.raises(cb.NVRTCCompileError, match="NVRTC compile failed") as info:
        cb.compile_kernels(["normspec_col_tree_kernel"], "sm_90")
    assert "expected an expression" in str(info.value)


def _fold_pairs(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Adjacent pairs along ``dim`` until one is left (``fold_rows``; fp32, no FMA)."""
    while t.shape[dim] > 1:
        left, right = t.unflatten(dim, (-1, 2)).unbind(dim + 1)
        t = left + right
    return t.squeeze(dim)


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 16, 17, 31, 100, 255, 256, 257, 4097, 70001])
def test_tree_tail_folds_like_the_spec(groups):
    """The workspace tree as the kernels run it (levels of 16 rows while more than
    COL_TREE_LAST_MAX are left, then the last kernel's 2**slog segments of 2**clog1 rows
    and its fold over them, +0.0 padding throughout), emulated on the CPU with the
    planner's numbers, gives the spec's row tree bit for bit."""
    from normspec.spec.rms_norm import row_tree

    gen = torch.Generator().manual_seed(groups)
    hidden = 8
    ws = torch.randn(groups, hidden, generator=gen) * torch.logspace(-20, 20, hidden)
    ws[::7, 0] = -0.0  # -0.0 + +0.0 padding is +0.0: the padding must be where the spec's is
    ws[::11, 1] = float("inf")
    ws[3::13, 2] = float("nan")
    want = row_tree(ws)
    g, t = groups, ws
    while g > cb.geometry.COL_TREE_LAST_MAX:
        gout, clog, _grid = cb.geometry.col_tree_launch(g, hidden)
        pad = torch.zeros(gout * (1 << clog) - g, hidden)
        t = _fold_pairs(torch.cat([t, pad]).view(gout, 1 << clog, hidden), 1)
        g = gout
    clog1, slog, grid = cb.geometry.col_tree_last_launch(g, hidden)
    assert grid[0] * 16 >= hidden
    pad = torch.zeros((1 << (clog1 + slog)) - g, hidden)
    segments = _fold_pairs(torch.cat([t, pad]).view(1 << slog, 1 << clog1, hidden), 1)
    got = _fold_pairs(segments.view(1 << slog, hidden), 0)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


# ---- kept launch plans ---------------------------------------------------------------
def _count_calls(monkeypatch, *names: str) -> list[str]:
    """Counts the calls of the backend's planners ``names`` (each call appends its name)."""
    asked: list[str] = []
    for name in names:
        real = getattr(cb.plans, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            asked.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(cb.plans, name, spy)
    return asked


def test_a_repeated_call_reuses_its_plan(monkeypatch):
    """The second call of a shape launches what the first did without asking the planners
    again."""
    launches = _record_launches(monkeypatch)
    asked = _count_calls(monkeypatch, "launch_plan", "col_tree_last_launch")
    x = torch.zeros(64, 2048, dtype=torch.bfloat16)
    w = torch.zeros(2048, dtype=torch.bfloat16)

    def forward() -> tuple:
        cb.run.forward("torch", OP_RMS, [x], w, 1e-6, {"offset": 1.0})
        name, grid, block, args, smem = launches[-1]
        return name, grid, block, len(args), smem

    first = forward()
    assert first[0].startswith("normspec_fwd_row_kernel<0, __nv_bfloat16")
    assert asked == ["launch_plan"]
    assert forward() == first and len(asked) == 1
    del launches[:]
    for _ in range(2):  # the backward with its dweight tree: planned once
        cb.run.backward("torch", OP_RMS, [x], [x], w, 1e-6, {"offset": 1.0})
    assert asked[1:] == ["launch_plan", "col_tree_last_launch"]
    assert len(launches) == 4 and launches[:2] != [] and [
        (n, g, b, s) for n, g, b, _, s in launches[:2]] == [
        (n, g, b, s) for n, g, b, _, s in launches[2:]]


def test_a_plan_is_kept_per_row_stride(monkeypatch):
    """The gated backward's pair kernel needs the offsets to fit 32 bits
    (``offsets_fit_32``), so rows of one shape but another stride may take another
    kernel: the row strides are part of the backward plan's key."""
    _record_launches(monkeypatch)
    rows, hidden = 1 << 21, 128

    def plan(stride: int):
        return cb.plans.plan_backward(None, 0, OP_GATED, DT_BF16, DT_BF16, rows, hidden,
                                 F_ALIGNED | F_W_IS_INPUT,
                                 (stride, stride, stride, 0, hidden, hidden), True)

    dense, wide = plan(hidden), plan(16 * hidden)  # the wide rows end past 2**31 elements
    assert dense.form == "pair" and wide.form == "pipe"
    assert plan(hidden) is dense and plan(16 * hidden) is wide


def test_the_backend_reads_only_its_cache_folder():
    """The only variable of its own the backend reads is the compile cache's folder,
    through ``os.environ``."""
    source = "".join(p.read_text() for p in Path(cb.__file__).parent.glob("*.py"))
    assert set(re.findall(r'"(NORMSPEC_[A-Z0-9_]+)"', source)) == {"NORMSPEC_CUPY_CACHE_DIR"}
    assert "_data" not in re.findall(r"environ\.(\w+)", source)


def test_the_kept_plans_stay_bounded(monkeypatch):
    """Shapes that vary without end (the tokens of prefills) do not grow the kept plans
    past ``_PLANS_MAX``."""
    launches = _record_launches(monkeypatch)
    monkeypatch.setattr(cb.device, "_PLANS_MAX", 8)
    w = torch.zeros(64)
    for rows in range(1, 30):
        cb.run.forward("torch", OP_RMS, [torch.zeros(rows, 64)], w, 1e-6, {})
        assert 1 <= len(cb.device.state(0).plans) <= 8
    assert len(launches) == 29


def test_torch_streams_reach_cupy_as_their_raw_handles(monkeypatch):
    """Torch's current stream reaches CuPy as its raw handle through the CUDA stream
    protocol (CuPy 14's ``Stream.from_external``), one CuPy stream object kept per device
    and handle, without building a torch Stream."""
    import cupy

    handles = {0: 0x1000, 1: 0x2000}
    monkeypatch.setattr(cb.arrays, "_torch_raw_stream", lambda dev: handles[dev])
    monkeypatch.setattr(cb.arrays, "_cupy_streams", {})
    first = cb.arrays._torch_stream_for_cupy(cupy, 0)
    assert first.ptr == 0x1000 and cb.arrays._torch_stream_for_cupy(cupy, 0) is first
    other = cb.arrays._torch_stream_for_cupy(cupy, 1)
    assert other.ptr == 0x2000 and other is not first
    handles[0] = 0x3000  # another stream made current on device 0
    assert cb.arrays._torch_stream_for_cupy(cupy, 0).ptr == 0x3000


def _kernel_parameters() -> dict[str, list[tuple[str, str]]]:
    """Each kernel defined in the CUDA sources: its parameters as ``(code, name)``, the
    code as ``KernelArgs`` spells the C type (``Q`` a pointer, ``q`` long long, ``i`` int,
    ``f`` float)."""
    csrc = Path(cb.__file__).resolve().parents[1] / "csrc"
    text = "".join((csrc / n).read_text() for n in ("normspec_kernels.cuh", "normspec_pipe.cuh",
                                                    "normspec_gated_bwd.cuh"))
    kernels = {}
    for m in re.finditer(r"(normspec_\w+_kernel)\s*\(([^(){};]*)\)\s*\{", text):
        params = []
        for p in m.group(2).split(","):
            words = [w for w in re.findall(r"\w+", p.split("=")[0])
                     if w not in ("const", "__restrict__")]
            code = "Q" if "*" in p else {"long long": "q", "int": "i", "float": "f"}[
                " ".join(words[:-1])]
            params.append((code, words[-1]))
        kernels[m.group(1)] = params
    return kernels


#: arguments of the same C type, told apart by their values: (op, dt, wdt, rows, H,
#: backward, rstd, params); x, the residual or gate, dy and dresidual have row strides of
#: H + 8, + 16, + 24 and + 32
_ARG_CALLS = [
    (OP_RMS, DT_BF16, DT_BF16, 64, 2048, False, True, {"offset": 1.0}),  # row, constant
    (OP_RMS, DT_F16, DT_F32, 100, 1000, False, False, {"offset": 1.0}),  # row, general
    (OP_RMS, DT_BF16, DT_BF16, 3, 256, False, False, {"offset": 1.0}),  # quad
    (OP_GATED, DT_BF16, DT_F32, 2**15, 64, False, False,
     {"convention": "vllm", "activation": "silu"}),  # the global table's form
    (OP_GATED, DT_BF16, DT_BF16, 8192, 128, False, True,
     {"convention": "hf", "activation": "sigmoid"}),  # persistent
    (OP_FUSED, DT_F32, DT_F32, 5, 7, False, False, {"offset": 1.0, "residual_sum": "fp32"}),
    (OP_FUSED, DT_F32, DT_F32, 3, 40000, False, True, {"offset": 0.0, "residual_sum": "fp32"}),
    (OP_RMS, DT_BF16, DT_BF16, 1, 2048, True, True, {"offset": 1.0}),  # one-row backward
    (OP_RMS, DT_BF16, DT_F32, 4096, 2048, True, False, {"offset": 1.0}),  # pipelined
    (OP_GATED, DT_BF16, DT_BF16, 2**16, 128, True, True,
     {"convention": "hf", "activation": "sigmoid"}),  # pair
    (OP_GATED, DT_BF16, DT_F32, 8192, 128, True, True,
     {"convention": "vllm", "activation": "silu"}),  # convention constants, one-row groups
    (OP_FUSED, DT_BF16, DT_BF16, 2000, 1000, True, False,
     {"offset": 1.0, "residual_sum": "rounded"}),
    (OP_FUSED_SUM, DT_F16, DT_F16, 64, 2048, True, True,
     {"offset": 1.0, "residual_sum": "rounded"}),
    (OP_RMS, DT_F32, DT_F32, 100003, 7, True, False, {"offset": 0.0}),  # register, tree
    (OP_GATED, DT_F32, DT_F32, 3, 40000, True, False,
     {"convention": "vllm", "activation": "silu"}),  # streaming
]


def _strided_rows(rows: int, hidden: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(rows * (hidden + pad), dtype=dtype).as_strided(
        (rows, hidden), (hidden + pad, 1))


def test_launches_fill_kernel_arguments_in_order(monkeypatch):
    """Every kernel the backend launches gets the arguments its definition lists, in
    that order and of those C types: each pointer the tensor it names, each size and
    stride its own value, eps, offset, the flags' convention bits, team and group sizes."""
    kernels = _kernel_parameters()
    launches = _record_launches(monkeypatch)
    monkeypatch.setattr(cb.device.DeviceState, "global_gate_table",
                        lambda self, cp, sig: 0x100000 + 32768 * sig)
    torch_dt = {DT_F32: torch.float32, DT_BF16: torch.bfloat16, DT_F16: torch.float16}
    codes = {np.uint64: "Q", np.int64: "q", np.int32: "i", np.float32: "f"}
    seen = set()
    for op, dt, wdt, rows, hidden, backward, with_rstd, params in _ARG_CALLS:
        t = torch_dt[dt]
        x, r, dy, dres = (_strided_rows(rows, hidden, pad, t) for pad in (8, 16, 24, 32))
        w = torch.ones(hidden, dtype=torch_dt[wdt])
        rstd = torch.zeros(rows) if with_rstd else None
        two_rows = op in (OP_FUSED, OP_GATED)
        launches.clear()
        if backward:
            grads = [dy, dres] if op in (OP_FUSED, OP_FUSED_SUM) else [dy]
            cb.run.backward("torch", op, grads, [x, r] if two_rows else [x], w, 1e-6, params,
                            rstd=rstd)
        else:
            cb.run.forward("torch", op, [x, r] if two_rows else [x], w, 1e-6, params,
                           keep_rstd=with_rstd)
        offset = params.get("offset", 0.0) if op != OP_GATED else 0.0
        second = two_rows if backward else op == OP_FUSED
        pad = 1 if rows > 1 else 0  # one row's stride is its length
        want = {"x": x.data_ptr(), "r": r.data_ptr() if two_rows else 0,
                "z": r.data_ptr(), "dy": dy.data_ptr(),
                "dres": dres.data_ptr() if op in (OP_FUSED, OP_FUSED_SUM) else 0,
                "rows": rows, "H": hidden, "H_arg": hidden, "sx": hidden + 8 * pad,
                "sr": hidden + 16 * pad if two_rows else 0, "sz": hidden + 16 * pad,
                "sdy": hidden + 24 * pad,
                "sdres": hidden + 32 * pad if op in (OP_FUSED, OP_FUSED_SUM) else 0,
                "sy": hidden, "sdx": hidden, "sy2": hidden if second else 0,
                "sd2": hidden if second else 0, "sdz": hidden,
                "eps": np.float32(1e-6), "offset": np.float32(offset)}
        conventions = _flags_of(op, params) & (F_OFFSET | F_HF | F_SIGMOID)
        for name, _grid, block, args, _smem in launches:
            base = name.rpartition("::")[2].partition("<")[0]
            seen.add(base)
            params_ = kernels[base]
            what = f"{name} for {op, dt, rows, hidden, backward}"
            assert "".join(codes[type(a)] for a in args) == "".join(
                c for c, _ in params_), what
            got = {n: a for (_, n), a in zip(params_, args, strict=True)}
            for n, value in want.items():
                if n in got and base not in ("normspec_col_tree_kernel",
                                             "normspec_col_tree_last_kernel"):
                    assert got[n] == value, (what, n, got[n], value)
            for n in ("w", "y", "dx", "ws", "in", "out"):
                assert n not in got or got[n] != 0, (what, n)
            for n in ("y2", "d2", "dz"):
                assert n not in got or (got[n] != 0) == second, (what, n)
            if "flags" in got:
                assert int(got["flags"]) & (F_OFFSET | F_HF | F_SIGMOID) == conventions, what
            if "team_log_arg" in got:
                assert block[0] >> int(got["team_log_arg"]) >= 1, what
            if "groups" in got:
                assert int(got["groups"]) == -(-rows // (1 << int(got["glog"]))), what
            if "rstd_out" in got:
                assert (got["rstd_out"] != 0) == with_rstd, what
            if "rstd_in" in got:
                assert got["rstd_in"] == (rstd.data_ptr() if rstd is not None else 0), what
            if "gtab" in got:
                assert got["gtab"] in (0, 0x100000), what
    assert seen == set(kernels) - {"normspec_fill_gate_table_kernel"}, sorted(seen)


def _flags_of(op: int, params: dict) -> int:
    """The convention bits of a call's flags (F_OFFSET, F_HF, F_SIGMOID)."""
    flags = F_OFFSET if op != OP_GATED and params.get("offset", 0.0) != 0.0 else 0
    if params.get("convention") == "hf":
        flags |= F_HF
    if params.get("activation") == "sigmoid":
        flags |= F_SIGMOID
    return flags
