"""The CuPy backend launches what the torch extension launches.

The CuPy backend mirrors the C++ launcher (``normspec_launch_impl.cuh``) in Python. The
spec tests cannot see the two drift apart: every kernel form gives the spec's bits, so a
form that lands in the launcher alone costs the CuPy backend speed and fails nothing.
Here the launcher itself runs on the host (``tests/launch_probe``: its translation units
linked against a recording stand-in for the CUDA runtime), and for the same calls (row
pointers, strides, dtypes, conventions, rstd given or not) both must make
the same launches: kernel (template arguments included), grid, block, dynamic shared
memory and arguments (sizes, strides, eps, offset, flags, team and group sizes; pointers by
what they point to: an input, null, or a buffer the call allocates), and both must read a
16-bit weight as it is or both copy it to fp32, and both must chain the same launches
(programmatic dependent launch: the dweight tree's, after a backward kernel given
F_LET_DEPENDENTS), the recording stand-in being an sm_90 device outside any capture.

Launches left out of the comparison are listed in ``KNOWN_GAPS`` with the reason; a call
that makes one is held to the rest of its launches. On a GPU, one more test compares what
the two backends' calls ran, as the profiler saw it: there the extension's own host code
runs, not the probe's copy of it.
"""

from __future__ import annotations

import itertools
import re
import subprocess
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_cupy_nvrtc import _CpuSide, _record_launches

from normspec.backends import cupy as cb
from normspec.backends.cupy.codes import (
    DT_BF16,
    DT_F16,
    DT_F32,
    F_HF,
    F_OFFSET,
    F_ROUNDED,
    F_SIGMOID,
    F_W_IS_INPUT,
    OP_FUSED,
    OP_FUSED_SUM,
    OP_GATED,
    OP_RMS,
)

TORCH_DTYPES = {DT_F32: torch.float32, DT_BF16: torch.bfloat16, DT_F16: torch.float16}
EPS = 1e-6

#: op name -> (op code, params, whether it has a forward)
OPS = {
    "rms": (OP_RMS, {"offset": 1.0}, True),
    "fused-fp32": (OP_FUSED, {"offset": 1.0, "residual_sum": "fp32"}, True),
    "fused-rounded": (OP_FUSED, {"offset": 0.0, "residual_sum": "rounded"}, True),
    "fused-sum": (OP_FUSED_SUM, {"offset": 1.0, "residual_sum": "rounded"}, False),
    "gated-vllm-silu": (OP_GATED, {"convention": "vllm", "activation": "silu"}, True),
    "gated-hf-sigmoid": (OP_GATED, {"convention": "hf", "activation": "sigmoid"}, True),
}


#: launches left out of the comparison: why
KNOWN_GAPS = {
    "normspec_fill_gate_table_kernel": "the global gate table's fill, once a process and "
    "device in either backend (the CPU side's table is a stand-in address)",
}


@dataclass(frozen=True)
class Call:
    """One operator call as both backends receive it."""

    op: str
    dt: int
    wdt: int
    rows: int
    hidden: int
    backward: bool
    rstd: bool = False  # forward: write rstd; backward: read the forward's
    x_shift: int = 0  # elements between the buffer's start and x's first element
    row_pad: int = 0  # elements between x's rows
    w_shift: int = 0  # elements between the weight buffer's start and the weight

    def __str__(self) -> str:
        kind = "bwd" if self.backward else "fwd"
        return (f"{self.op} {kind} dt={self.dt} wdt={self.wdt} {self.rows}x{self.hidden}"
                f" rstd={int(self.rstd)} x+{self.x_shift} pad={self.row_pad}"
                f" w+{self.w_shift}")


@dataclass
class Tensors:
    rows: list[torch.Tensor]
    grads: list[torch.Tensor]
    weight: torch.Tensor
    stride: int


def _row_tensor(call: Call, shift: int, device: str = "cpu") -> tuple[torch.Tensor, int]:
    stride = call.hidden + call.row_pad
    buf = torch.empty(shift + call.rows * stride, dtype=TORCH_DTYPES[call.dt], device=device)
    t = buf.as_strided((call.rows, call.hidden), (stride, 1), shift)
    return t, (call.hidden if call.rows == 1 else stride)  # collapsible_rows' stride


def _roles(t: Tensors) -> dict[int, str]:
    """What each input's address is, for reading the launches' pointer arguments."""
    named = {"x": t.rows[0], "r": t.rows[1] if len(t.rows) > 1 else None,
             "dy": t.grads[0] if t.grads else None,
             "dres": t.grads[1] if len(t.grads) > 1 else None, "w": t.weight}
    return {a.data_ptr(): role for role, a in named.items() if a is not None}


def _pointer(value: int, roles: dict[int, str]) -> str:
    return "0" if value == 0 else roles.get(value, "new")


def _tensors(call: Call, device: str = "cpu") -> Tensors:
    """The call's tensors (uninitialised: nothing here reads their values)."""
    x, stride = _row_tensor(call, call.x_shift, device)
    op = OPS[call.op][0]
    rows = [x] if op in (OP_FUSED_SUM, OP_RMS) else [x, _row_tensor(call, 0, device)[0]]
    grads = []
    if call.backward:
        grads = [_row_tensor(call, 0, device)[0]]
        if op in (OP_FUSED, OP_FUSED_SUM):
            grads.append(_row_tensor(call, 0, device)[0])
    wbuf = torch.empty(call.w_shift + call.hidden, dtype=TORCH_DTYPES[call.wdt], device=device)
    return Tensors(rows, grads, wbuf[call.w_shift:], stride)


def _flags(call: Call) -> int:
    """The flags normspec_cuda.cpp gives the launcher (base_flags, gated_flags)."""
    params = OPS[call.op][1]
    flags = F_OFFSET if params.get("offset", 0.0) != 0.0 else 0
    if call.wdt == call.dt:
        flags |= F_W_IS_INPUT
    if params.get("residual_sum") == "rounded":
        flags |= F_ROUNDED
    if params.get("convention") == "hf":
        flags |= F_HF
    if params.get("activation") == "sigmoid":
        flags |= F_SIGMOID
    return flags


def _probe_line(call: Call, t: Tensors) -> str:
    """The call in launch_probe's input format (launch_probe.cu, run_call)."""
    op, params, _ = OPS[call.op]
    x = t.rows[0]
    r = t.rows[1] if len(t.rows) > 1 else None
    dy = t.grads[0] if t.grads else None
    dres = t.grads[1] if len(t.grads) > 1 else None

    def ptr(a):
        return a.data_ptr() if a is not None else 0

    def stride(a):
        return t.stride if a is not None else 0

    fields = (op, call.dt, call.wdt, call.rows, call.hidden, ptr(x), ptr(r), ptr(dy),
              ptr(dres), ptr(t.weight), int(t.weight.is_contiguous()), t.stride, stride(r),
              stride(dy), stride(dres), _flags(call), EPS, params.get("offset", 0.0),
              int(call.rstd), int(call.backward))
    return " ".join(map(str, fields))


#: template arguments a kernel's declaration gives defaults (normspec_pipe.cuh): the CuPy
#: backend's names leave them out, the demangled names spell them
DEFAULT_TAILS = {
    "normspec_fwd_pipe_kernel": ("-1",),
    "normspec_fwd_row_kernel": ("-1", "false", "0"),
    "normspec_bwd_pipe_kernel": ("-1", "false", "-1"),
}


def canonical(name: str) -> str:
    """A kernel name without return type, parameters or namespace, its template arguments
    all spelt (``normspec_bwd_row_kernel<__nv_bfloat16, 1, 8, true>``)."""
    name = re.sub(r"^void ", "", name.strip())
    name = re.sub(r"\(.*\)$", "", name).replace("normspec::", "")
    base, _, rest = name.partition("<")
    if not rest:
        return base
    args = [a.strip() for a in rest.rstrip(">").split(",")]
    tail = DEFAULT_TAILS.get(base, ())
    if tail and len(args) >= 3:  # the defaults start at the fourth argument
        args += tail[len(args) - 3:]
    return f"{base}<{', '.join(args)}>"


#: (kernel, grid, block, dynamic shared memory, arguments, chained)
Launch = tuple[str, tuple[int, int, int], tuple[int, int, int], int, tuple[str, ...], bool]


def _pad3(v) -> tuple[int, int, int]:
    v = tuple(int(i) for i in v)
    return (*v, *(1,) * (3 - len(v)))


def cpp_launches(probe, calls: list[Call]) -> list[tuple[list[Launch], bool]]:
    """(launches, weight copied to fp32) of each call, by the C++ launcher. The tensors
    are made one call at a time, for their addresses (CPU allocations are 64-byte aligned,
    so the CuPy side's own tensors of the call have the same alignment)."""
    lines, roles = [], []
    for c in calls:
        t = _tensors(c)
        lines.append(_probe_line(c, t) + "\n")
        roles.append(_roles(t))
    done = subprocess.run([str(probe), "launch"], input="".join(lines), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    out: list[tuple[list[Launch], bool]] = []
    launches: list[Launch] = []
    copied = False
    for line in done.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "L":
            gx, gy, gz, bx, by, bz, smem, chained, nargs, *more = rest.split(" ")
            args, name = more[:int(nargs)], canonical(" ".join(more[int(nargs):]))
            assert chained in ("0", "1"), line
            if name.partition("<")[0] in KNOWN_GAPS:
                continue
            where = roles[len(out)]
            args = tuple(_pointer(int(a[1:], 16), where) if a[0] == "p" else a for a in args)
            launches.append((name, _pad3((gx, gy, gz)), _pad3((bx, by, bz)), int(smem), args,
                             chained == "1"))
        elif kind == "W":
            copied = True
        elif kind == "E":
            out.append((launches, copied))
            launches, copied = [], False
        else:
            raise AssertionError(f"launch_probe printed {line!r}")
    assert len(out) == len(calls)
    return out


def cupy_launches(call: Call, monkeypatch, plans: dict | None = None
                  ) -> tuple[list[Launch], bool]:
    """(launches, weight copied to fp32) of the call, by the CuPy backend's plumbing on
    CPU tensors (nothing runs); ``plans``: the backend's kept launch plans meanwhile
    (shared by the calls of one check, so that a call whose plan's key missed something it
    depends on takes another call's plan and fails)."""
    recorded = _record_launches(monkeypatch, pdl=True, plans=plans)
    t = _tensors(call)
    copies = []

    class Side(_CpuSide):
        def weight_f32(self, w, dt):
            w32 = super().weight_f32(w, dt)
            if w32.data_ptr() != w.data_ptr():  # a contiguous fp32 weight stays itself
                copies.append(dt)
            return w32

    monkeypatch.setattr(cb.arrays, "side", lambda kind, x: Side())
    monkeypatch.setattr(cb.device.DeviceState, "global_gate_table",
                        lambda self, cp, sig: 0x100000 + 32768 * sig)
    op, params, _ = OPS[call.op]
    w = t.weight
    if call.backward:
        rstd = torch.empty(call.rows, dtype=torch.float32) if call.rstd else None
        cb.run.backward("torch", op, t.grads, t.rows, w, EPS, params, rstd=rstd)
    else:
        cb.run.forward("torch", op, t.rows, w, EPS, params, keep_rstd=call.rstd)
    roles = _roles(t)

    def token(v) -> str:
        if isinstance(v, np.uint64):
            return _pointer(int(v), roles)
        if isinstance(v, np.float32):
            return f"f{int(v.view(np.uint32)):08x}"
        return f"i{int(v)}"

    launches = [(canonical(n), _pad3(g), _pad3(b), int(s), tuple(map(token, a)), chained)
                for (n, g, b, a, s), chained in zip(recorded, recorded.chained, strict=True)]
    return launches, bool(copies)


def _calls(ops, dts, hiddens, rows_list, *, shapes=((0, 0, 0),), max_elements=1 << 26):
    out = []
    for name, dt, hidden, rows, (x_shift, pad, w_shift) in itertools.product(
            ops, dts, hiddens, rows_list, shapes):
        if rows * hidden > max_elements:
            continue
        for wdt in sorted({dt, DT_F32}):
            for backward, rstd in itertools.product((False, True), (False, True)):
                if not backward and not OPS[name][2]:
                    continue
                out.append(Call(name, dt, wdt, rows, hidden, backward, rstd, x_shift, pad,
                                w_shift))
    return out


def _check(probe, calls: list[Call], monkeypatch) -> int:
    expected = cpp_launches(probe, calls)
    mismatches, plans = [], {}
    for call, want in zip(calls, expected, strict=True):
        with monkeypatch.context() as m:
            got = cupy_launches(call, m, plans)
        if got != want:
            mismatches.append(f"{call}\n  C++:  {want}\n  CuPy: {got}")
    assert not mismatches, (f"{len(mismatches)} of {len(calls)} calls launch "
                            f"differently:\n" + "\n".join(mismatches[:12]))
    return len(calls)


def test_canonical_names():
    assert canonical("normspec_fwd_row_kernel<0, __nv_bfloat16, 4, 6>") == (
        "normspec_fwd_row_kernel<0, __nv_bfloat16, 4, 6, false, 0>")
    assert canonical("void normspec_fwd_row_kernel<0, __nv_bfloat16, 4, 6, false, 0>(__nv_"
                     "bfloat16 const*, long long)") == (
        "normspec_fwd_row_kernel<0, __nv_bfloat16, 4, 6, false, 0>")
    assert canonical("normspec_bwd_pipe_kernel<2, __nv_bfloat16, 1, 4, true>") == (
        "normspec_bwd_pipe_kernel<2, __nv_bfloat16, 1, 4, true, -1>")
    assert canonical("void normspec::normspec_gated_bwd_pair_kernel<__nv_bfloat16, 4, 7>(int)"
                     ) == "normspec_gated_bwd_pair_kernel<__nv_bfloat16, 4, 7>"
    assert canonical("normspec_col_tree_kernel(float const*, float*)") == (
        "normspec_col_tree_kernel")


DTS = (DT_F32, DT_BF16, DT_F16)
HIDDENS = (1, 7, 64, 100, 128, 256, 512, 1000, 2048, 4096, 8192, 12000)
ROWS = (1, 3, 64, 1000, 8192, 65536)


def test_default_launches_match_the_torch_extension(launch_probe, monkeypatch):
    """Every op, dtype, weight dtype, row length and count (the GDN norm's gate table and
    pair kernel, the decoder norm's one-row backward and its wide form, one dweight group
    and many), forward and backward, rstd given or not: the same launches."""
    n = _check(launch_probe, _calls(OPS, DTS, HIDDENS, ROWS), monkeypatch)
    assert n > 2000


#: misaligned x, padded rows, a weight off 16 bytes
SHAPES = ((1, 0, 0), (0, 3, 0), (0, 8, 0), (0, 0, 1))


def test_unaligned_rows_and_weights_launch_as_in_the_torch_extension(launch_probe,
                                                                     monkeypatch):
    """Rows off 16 bytes (the register kernels), padded rows that stay aligned, and a
    16-bit weight off 16 bytes (copied to fp32, or the register kernels): the same
    launches."""
    calls = _calls(OPS, DTS, (64, 100, 256, 2048), (3, 1000, 8192), shapes=SHAPES)
    assert _check(launch_probe, calls, monkeypatch) > 500




def test_quad_forward_bound_matches_the_torch_extension(launch_probe, monkeypatch):
    """The q/k forward in vectors of four up to ``132 * 128`` lanes (264 rows of 256, 528
    of 128 on the probe's 132 SMs) and the warp teams past it: the same launches, and the
    C++ launcher's own choice on both sides of the bound."""
    calls = _calls(("rms", "fused-rounded"), (DT_BF16, DT_F16), (128, 256),
                   (264, 265, 528, 529))
    assert _check(launch_probe, calls, monkeypatch) > 50
    quad = {(c.op, c.hidden, c.rows, c.wdt == c.dt)
            for c, (launches, _) in zip(calls, cpp_launches(launch_probe, calls),
                                        strict=True)
            if any(name.startswith("normspec_fwd_quad_kernel<") for name, *_ in launches)}
    # a weight of the input dtype only (read as it is), forward only
    assert quad == {(op, hidden, rows, True) for op in ("rms", "fused-rounded")
                    for hidden, rows in ((256, 264), (128, 264), (128, 265), (128, 528))}




# ---- on the GPU: what the two backends' calls ran, as the profiler saw it ----------------
def _ext_call(call: Call, t: Tensors, rstd: torch.Tensor | None) -> None:
    """The call through the torch extension's operators."""
    ops = torch.ops.normspec
    op, p, _ = OPS[call.op]
    x, w = t.rows[0], t.weight
    if not call.backward:
        if op == OP_RMS:
            f = ops.rms_norm_with_rstd if call.rstd else ops.rms_norm
            f(x, w, EPS, p["offset"])
        elif op == OP_FUSED:
            f = ops.fused_add_rms_norm_with_rstd if call.rstd else ops.fused_add_rms_norm
            f(x, t.rows[1], w, EPS, p["offset"], p["residual_sum"])
        else:
            f = ops.rms_norm_gated_with_rstd if call.rstd else ops.rms_norm_gated
            f(x, t.rows[1], w, EPS, p["convention"], p["activation"])
        return
    dy = t.grads[0]
    if op == OP_RMS:
        ops.rms_norm_backward(dy, x, w, EPS, p["offset"], rstd)
    elif op == OP_FUSED:
        ops.fused_add_rms_norm_backward(dy, t.grads[1], x, t.rows[1], w, EPS, p["offset"],
                                        p["residual_sum"], rstd)
    elif op == OP_FUSED_SUM:
        ops.fused_add_rms_norm_backward_from_sum(dy, t.grads[1], x, w, EPS, p["offset"],
                                                 p["residual_sum"], rstd)
    else:
        ops.rms_norm_gated_backward(dy, x, t.rows[1], w, EPS, p["convention"], p["activation"],
                                    rstd)


def _cupy_call(call: Call, t: Tensors, rstd: torch.Tensor | None) -> None:
    """The call through the CuPy backend (torch CUDA tensors, its internal entry points)."""
    op, params, _ = OPS[call.op]
    if call.backward:
        cb.run.backward("torch", op, t.grads, t.rows, t.weight, EPS, params, rstd=rstd)
    else:
        cb.run.forward("torch", op, t.rows, t.weight, EPS, params, keep_rstd=call.rstd)


def _profiled_kernels(run, calls: list[Call]) -> list[list[tuple]]:
    """Each call's normspec kernels as the profiler (CUPTI) saw them run: (name, grid,
    block, shared memory, registers per thread). A spin kernel (``torch.cuda._sleep``)
    before each call separates them; other kernels (torch's fp32 weight copies) and the
    gate tables' fills are left out."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in calls:  # (allocations launch no kernels)
            t = _tensors(call, "cuda")
            rstd = (torch.empty(call.rows, dtype=torch.float32, device="cuda")
                    if call.backward and call.rstd else None)
            torch.cuda._sleep(1)
            run(call, t, rstd)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = f"{tmp}/trace.json"
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    out: list[list[tuple]] = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if "spin_kernel" in e["name"]:
            out.append([])
            continue
        name = canonical(e["name"])
        if not name.startswith("normspec") or name.partition("<")[0] in KNOWN_GAPS:
            continue
        a = e.get("args", {})
        out[-1].append((name, tuple(a.get("grid", ())), tuple(a.get("block", ())),
                        a.get("shared memory"), a.get("registers per thread")))
    assert len(out) == len(calls)
    return out


def _same_launches(want: list[tuple], got: list[tuple]) -> bool:
    """Whether two calls' kernels agree: names, blocks and shared memory always, grids
    where the two binaries of a kernel have the same registers per thread. A persistent
    kernel's grid is its resident blocks on the device, which follow the registers of the
    binary that runs: nvcc's for the extension, NVRTC's for the CuPy backend (two compiler
    builds, whose register allocation may differ for the same source and flags)."""
    if len(want) != len(got):
        return False
    for (wn, wg, wb, ws, wr), (gn, gg, gb, gs, gr) in zip(want, got, strict=True):
        if (wn, wb, ws) != (gn, gb, gs) or (wr == gr and wg != gg):
            return False
    return True


@pytest.mark.cuda
def test_the_gpu_runs_the_same_kernels_for_both_backends():
    """On the GPU, without the probe: the CuPy backend and the torch extension run the same
    normspec kernels with the same grids, blocks and shared memory for the same calls (the
    profiler's record of what ran, through the extension's own host code), every op,
    dtype, weight dtype, a range of row lengths and counts, rstd given or not. Kernels
    whose two binaries differ in registers (nvcc against NVRTC) may differ in a persistent
    grid (``_same_launches``); such grids are reported as a warning."""
    from normspec.backends import torch_ext as te

    if te.cuda_build_possible() is not None or cb.available() is not None:
        pytest.skip(f"torch_ext: {te.cuda_build_possible()}; cupy: {cb.available()}")
    te.build(verbose=True)
    calls = _calls(OPS, DTS, (64, 100, 128, 256, 1000, 2048, 8192), (1, 64, 1000, 8192),
                   max_elements=1 << 24)
    want = _profiled_kernels(_ext_call, calls)
    got = _profiled_kernels(_cupy_call, calls)
    assert sum(map(len, want)) >= len(calls)  # at least a kernel a call
    assert all(len(k[1]) == 3 and len(k[2]) == 3 for launches in want for k in launches)
    mismatches = [f"{c}\n  torch_ext: {w}\n  cupy:      {g}"
                  for c, w, g in zip(calls, want, got, strict=True)
                  if not _same_launches(w, g)]
    assert not mismatches, (f"{len(mismatches)} of {len(calls)} calls ran differently:\n"
                            + "\n".join(mismatches[:12]))
    pairs = [(w, g) for ws, gs in zip(want, got, strict=True)
             for w, g in zip(ws, gs, strict=True)]
    grids = sorted({(w[0], w[4], g[4], w[1], g[1]) for w, g in pairs if w[1] != g[1]})
    if grids:
        import warnings

        registers = len({w[0] for w, g in pairs if w[4] != g[4]})
        warnings.warn(f"{len(grids)} persistent grids differ where the kernel's nvcc and "
                      "NVRTC binaries differ in registers per thread (name, registers "
                      f"torch_ext / cupy, grids torch_ext / cupy): {grids}; {registers} "
                      "kernels differ in registers in all", stacklevel=1)
