"""The upstream-library adapters: declarations, availability reasons, input handling.

The libraries mostly need CUDA (Triton / CUDA kernels) or are too large for CI
(vLLM): what does not depend on them — declared support, availability
reasons, argument checks, how each adapter calls the library (through small
stand-in modules that record the call), that no adapter writes the caller's
tensors — runs everywhere. Tests of the real libraries are skipped when the
library is missing and marked ``cuda`` where they need a GPU.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from normspec.backends import (
    fla_adapter,
    flashinfer_adapter,
    liger_adapter,
    megatron_adapter,
    transformer_engine_adapter,
    vllm_adapter,
)
from normspec.gates import compare as gate_compare
from normspec.ops import OPS
from normspec.registry import Backend, OpSupport

BACKENDS = {
    b.name: (module, b)
    for module, b in [
        (vllm_adapter, vllm_adapter.backend),
        (vllm_adapter, vllm_adapter.backend_cuda),
        (fla_adapter, fla_adapter.backend),
        (fla_adapter, fla_adapter.backend_gated),
        (liger_adapter, liger_adapter.backend),
        (flashinfer_adapter, flashinfer_adapter.backend),
        (transformer_engine_adapter, transformer_engine_adapter.backend),
        (megatron_adapter, megatron_adapter.backend),
    ]
}
CUDA_ONLY = {"vllm-cuda", "fla", "fla-gated", "liger", "flashinfer", "transformer_engine",
             "megatron"}


def _cpu_twin(b: Backend) -> Backend:
    """A copy of ``b`` that also accepts CPU tensors (for stand-in library tests)."""
    twin = type(b)()
    twin.ops = {k: OpSupport(backward=v.backward, params=v.params, devices=("cpu", "cuda"),
                             weight_dtypes=v.weight_dtypes) for k, v in b.ops.items()}
    return twin


def _fake_modules(monkeypatch, **modules: dict) -> None:
    """Install stand-in modules (and their parents) in ``sys.modules``."""
    for dotted, attrs in modules.items():
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if not isinstance(sys.modules.get(parent), types.ModuleType) or \
                    getattr(sys.modules[parent], "__normspec_fake__", False) is False:
                mod = types.ModuleType(parent)
                mod.__normspec_fake__ = True
                mod.__path__ = []
                monkeypatch.setitem(sys.modules, parent, mod)
        mod = types.ModuleType(dotted)
        mod.__normspec_fake__ = True
        for k, v in attrs.items():
            setattr(mod, k, v)
        monkeypatch.setitem(sys.modules, dotted, mod)


def _sample(op: str, dtype=torch.float32, shape=(4, 16), wdtype=None, **params):
    return OPS[op].make_sample(shape, dtype, params=params, seed=0,
                               weight_dtype=wdtype or dtype)


# --------------------------------------------------------------------- declarations


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_declared_support_is_well_formed(name):
    _module, b = BACKENDS[name]
    assert isinstance(b, Backend) and b.name == name
    assert b.ops, "declares at least one op"
    for op, support in b.ops.items():
        assert op in OPS
        assert support.backward in ("full", "x-only", "none")
        keys = {k for v in OPS[op].variants for k in v}
        for key, values in support.params.items():
            assert key in keys
            assert set(values) <= {v[key] for v in OPS[op].variants}
        assert set(support.devices) <= {"cpu", "cuda"}
        assert set(support.weight_dtypes) <= {"fp32", "same"}
        if name in CUDA_ONLY:
            assert support.devices == ("cuda",)


def test_entry_point_names_are_unique_and_backward_is_honest():
    assert len(BACKENDS) == 8
    assert all(s.backward == "none" for s in vllm_adapter.backend.ops.values())  # inference
    assert all(s.backward == "none" for s in flashinfer_adapter.backend.ops.values())
    assert flashinfer_adapter.backend.ops["rms_norm"].weight_dtypes == ("same",)
    assert vllm_adapter.backend.ops["fused_add_rms_norm"].params["residual_sum"] == ("fp32",)
    assert fla_adapter.backend.ops["fused_add_rms_norm"].params["residual_sum"] == ("fp32",)
    assert liger_adapter.backend.ops["fused_add_rms_norm"].params["residual_sum"] == ("rounded",)


# --------------------------------------------------------------------- availability


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_missing_library_is_a_clear_reason(name, monkeypatch):
    module, b = BACKENDS[name]
    monkeypatch.setattr(module, "_version", lambda *a, **k: None)
    reason = b.available()
    assert reason and "not installed" in reason and "pip install" in reason
    assert "(not installed)" in b.source
    assert b.library_version() is None


@pytest.mark.parametrize("name", sorted(CUDA_ONLY))
def test_no_gpu_is_a_clear_reason(name, monkeypatch):
    module, b = BACKENDS[name]
    monkeypatch.setattr(module, "_version", lambda *a, **k: "9.9.9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = b.available()
    assert reason and "CUDA" in reason
    assert "9.9.9" in b.source and b.library_version() == "9.9.9"


def test_import_failure_is_reported_with_its_error(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "_version", lambda *a, **k: "0.33.0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    reason = vllm_adapter.backend.available()
    assert reason.startswith("vllm 0.33.0 failed to import: ") and "Error" in reason


# --------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("name", sorted(CUDA_ONLY))
def test_cpu_tensors_are_refused_before_touching_the_library(name):
    _module, b = BACKENDS[name]
    op = next(iter(b.ops))
    s = _sample(op)
    params = {k: v[0] for k, v in b.ops[op].params.items()}
    with pytest.raises(ValueError, match="device 'cpu' not supported"):
        b.forward(op, s.rows, s.weight, eps=s.eps, **params)


def test_unsupported_params_and_bad_inputs_are_refused():
    b = vllm_adapter.backend
    s = _sample("rms_norm", offset=0.0)
    with pytest.raises(ValueError, match=r"offset=0.0 not supported \(supports \[1.0\]\)"):
        b.forward("rms_norm", s.rows, s.weight, eps=s.eps, offset=0.0)
    with pytest.raises(ValueError, match="op 'nope' not implemented"):
        b.forward("nope", s.rows, s.weight, eps=s.eps)
    with pytest.raises(ValueError, match="weight"):
        b.forward("rms_norm", s.rows, s.weight[:3], eps=s.eps, offset=1.0)
    with pytest.raises(ValueError, match="eps"):
        b.forward("rms_norm", s.rows, s.weight, eps=-1.0, offset=1.0)
    g = _sample("rms_norm_gated", convention="vllm", activation="silu")
    with pytest.raises((TypeError, ValueError), match="gate"):
        b.forward("rms_norm_gated", {"x": g.rows["x"], "gate": g.rows["gate"][:2]}, g.weight,
                  eps=g.eps, convention="vllm", activation="silu")


# --------------------------------------------------------------------- how each library is called
# Stand-in modules record the call: signatures follow the installed sources
# (fla-core 0.6.0, liger-kernel 0.8.5, flashinfer 0.7.2, megatron-core 0.19.2).


def test_fla_forms_one_plus_w_in_fp32(monkeypatch):
    calls = []

    def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False,
                 residual_in_fp32=False):
        calls.append(dict(weight=weight, bias=bias, residual=residual, eps=eps,
                          prenorm=prenorm))
        y = x * weight
        return (y, x if residual is None else x + residual) if prenorm else y

    def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                       residual_in_fp32=False, eps=1e-6):
        calls.append(dict(activation=activation, eps=eps, bias=bias))
        return x

    _fake_modules(monkeypatch, **{"fla.modules.layernorm": {"rms_norm": rms_norm},
                                  "fla.modules.fused_norm_gate": {"rms_norm_gated":
                                                                  rms_norm_gated}})
    b = _cpu_twin(fla_adapter.backend)
    s = _sample("rms_norm", torch.bfloat16, wdtype=torch.bfloat16, offset=1.0)
    b.forward("rms_norm", s.rows, s.weight, eps=1e-6, offset=1.0)
    w = calls[-1]["weight"]
    assert w.dtype == torch.float32 and torch.equal(w, 1.0 + s.weight.float())
    assert calls[-1]["bias"] is None and calls[-1]["eps"] == 1e-6
    b.forward("rms_norm", s.rows, s.weight, eps=1e-6, offset=0.0)
    assert calls[-1]["weight"] is s.weight
    f = _sample("fused_add_rms_norm", offset=1.0, residual_sum="fp32")
    out = b.forward("fused_add_rms_norm", f.rows, f.weight, eps=1e-6, offset=1.0,
                    residual_sum="fp32")
    assert len(out) == 2 and calls[-1]["prenorm"] is True
    assert calls[-1]["residual"] is f.rows["residual"]
    g = _sample("rms_norm_gated", convention="vllm", activation="sigmoid")
    b.forward("rms_norm_gated", g.rows, g.weight, eps=1e-6, convention="vllm",
              activation="sigmoid")
    assert calls[-1]["activation"] == "sigmoid"
    b.forward("rms_norm_gated", g.rows, g.weight, eps=1e-6, convention="vllm",
              activation="silu")
    assert calls[-1]["activation"] == "swish"


def test_fla_gated_calls_rmsnorm_fn_norm_before_gate(monkeypatch):
    seen = {}

    def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        seen.update(z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate,
                    bias=bias)
        return x

    _fake_modules(monkeypatch, **{"fla.modules.layernorm_gated": {"rmsnorm_fn": rmsnorm_fn}})
    g = _sample("rms_norm_gated", convention="vllm", activation="silu")
    _cpu_twin(fla_adapter.backend_gated).forward(
        "rms_norm_gated", g.rows, g.weight, eps=1e-5, convention="vllm", activation="silu")
    assert seen == {"z": g.rows["gate"], "eps": 1e-5, "group_size": None,
                    "norm_before_gate": True, "bias": None}


def test_liger_uses_gemma_casting_and_never_in_place(monkeypatch):
    calls = []

    class RMS:
        @staticmethod
        def apply(*args):
            calls.append(args)
            return args[0]

    class Fused:
        @staticmethod
        def apply(*args):
            calls.append(args)
            return args[0], args[0] + args[1]

    _fake_modules(monkeypatch, **{"liger_kernel.ops.rms_norm": {"LigerRMSNormFunction": RMS},
                                  "liger_kernel.ops.fused_add_rms_norm":
                                      {"LigerFusedAddRMSNormFunction": Fused}})
    b = _cpu_twin(liger_adapter.backend)
    s = _sample("rms_norm", offset=1.0)
    b.forward("rms_norm", s.rows, s.weight, eps=1e-6, offset=1.0)
    # (X, W, eps, offset, casting_mode, in_place, row_mode)
    assert calls[-1][1:] == (s.weight, 1e-6, 1.0, "gemma", False, None)
    f = _sample("fused_add_rms_norm", offset=1.0, residual_sum="rounded")
    b.forward("fused_add_rms_norm", f.rows, f.weight, eps=1e-6, offset=1.0,
              residual_sum="rounded")
    # (X, R, W, eps, offset, casting_mode, in_place)
    assert calls[-1][2:] == (f.weight, 1e-6, 1.0, "gemma", False)


def test_flashinfer_never_writes_the_callers_tensors(monkeypatch):
    def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        residual += input  # in place, like the real kernel
        s = residual.float()
        y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * (1 + weight.float())
        input.copy_(y)

    def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        s = input.float()
        return (s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
                * (1 + weight.float())).to(input.dtype)

    _fake_modules(monkeypatch, **{"flashinfer.norm": {
        "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm, "gemma_rmsnorm": gemma_rmsnorm,
        "fused_add_rmsnorm": None, "rmsnorm": None}})
    b = _cpu_twin(flashinfer_adapter.backend)
    f = _sample("fused_add_rms_norm", offset=1.0, residual_sum="fp32")
    before = {k: v.clone() for k, v in f.rows.items()}
    y, r = b.forward("fused_add_rms_norm", f.rows, f.weight, eps=1e-6, offset=1.0,
                     residual_sum="fp32")
    for k in before:
        assert torch.equal(before[k], f.rows[k]), f"{k} was written"
    assert torch.equal(r, f.rows["x"] + f.rows["residual"])
    assert y.data_ptr() not in (f.rows["x"].data_ptr(), f.rows["residual"].data_ptr())
    with pytest.raises(TypeError, match="dtype of x"):
        s = _sample("rms_norm", torch.bfloat16, wdtype=torch.float32, offset=1.0)
        b.forward("rms_norm", s.rows, s.weight, eps=1e-6, offset=1.0)


def test_transformer_engine_bridge_routes_gradients(monkeypatch):
    made = []

    class RMSNorm(torch.nn.Module):  # stand-in with TE's constructor
        def __init__(self, hidden, *, eps=1e-5, zero_centered_gamma=False, params_dtype=None,
                     device=None):
            super().__init__()
            made.append(zero_centered_gamma)
            self.eps, self.zc = eps, zero_centered_gamma
            self.weight = torch.nn.Parameter(torch.zeros(hidden, dtype=params_dtype,
                                                         device=device))

        def forward(self, x):
            x32 = x.float()
            g = self.weight.float() + 1 if self.zc else self.weight.float()
            return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
                    * g).to(x.dtype)

    _fake_modules(monkeypatch, **{"transformer_engine.pytorch": {"RMSNorm": RMSNorm}})
    b = _cpu_twin(transformer_engine_adapter.backend)
    s = _sample("rms_norm", offset=1.0)
    x = s.rows["x"].clone().requires_grad_()
    w = s.weight.clone().requires_grad_()
    (y,) = b.forward("rms_norm", {"x": x}, w, eps=1e-6, offset=1.0)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = RMSNorm(16, eps=1e-6, zero_centered_gamma=True, params_dtype=torch.float32)
    y2 = torch.func.functional_call(y2, {"weight": w2}, (x2,))
    dx2, dw2 = torch.autograd.grad(y2, [x2, w2], dy)
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)
    assert made[0] is True
    with torch.no_grad():
        (y3,) = b.forward("rms_norm", {"x": x}, w, eps=1e-6, offset=0.0)
    assert made[-1] is False and not y3.requires_grad


_BUGGY = '''
class BatchInvariantRMSNormFn:
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma):
        weight_eff = weight + 1.0 if zero_centered_gamma else weight
        w_fp32 = weight.float()
        return x * w_fp32
'''
_FIXED = _BUGGY.replace("weight.float()", "weight_eff.float()")


@pytest.mark.parametrize(("text", "ignored"), [(_BUGGY, True), (_FIXED, False)])
def test_megatron_zero_centred_defect_is_detected(text, ignored, monkeypatch, tmp_path):
    path = tmp_path / "fake_bik.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(megatron_adapter.MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, megatron_adapter.MODULE, mod)
    megatron_adapter.zero_centered_ignored_in_forward.cache_clear()
    try:
        assert megatron_adapter.zero_centered_ignored_in_forward() is ignored
        monkeypatch.setattr(megatron_adapter, "_version", lambda *a, **k: "0.19.2")
        assert ("ignores zero_centered_gamma" in megatron_adapter.backend.source) is ignored
    finally:
        megatron_adapter.zero_centered_ignored_in_forward.cache_clear()


# --------------------------------------------------------------------- the real libraries


@pytest.fixture(scope="module")
def vllm_backend():
    pytest.importorskip("vllm", reason="vllm is not installed (nox -s adapters-vllm)")
    b = vllm_adapter.backend
    if b.available():
        pytest.skip(b.available())
    return b


@pytest.mark.parametrize(("op", "params"), [
    ("rms_norm", {"offset": 1.0}),
    ("fused_add_rms_norm", {"offset": 1.0, "residual_sum": "fp32"}),
    ("rms_norm_gated", {"convention": "vllm", "activation": "silu"}),
    ("rms_norm_gated", {"convention": "vllm", "activation": "sigmoid"}),
])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_vllm_native_on_cpu_is_accurate_and_leaves_inputs_alone(vllm_backend, op, params,
                                                                   wdtype):
    s = OPS[op].make_sample((6, 256), torch.bfloat16, params=params, seed=3,
                            weight_dtype=wdtype)
    before = {k: v.clone() for k, v in s.rows.items()}
    w_before = s.weight.clone()
    got = vllm_backend.forward(op, s.rows, s.weight, eps=s.eps, **params)
    for name, g, ref in zip(OPS[op].outputs, got, OPS[op].spec_forward(s), strict=True):
        assert gate_compare(name, g, ref, "forward").within_tolerance
    assert all(torch.equal(before[k], s.rows[k]) for k in before)
    assert torch.equal(w_before, s.weight)


def _cuda_backend(b: Backend) -> Backend:
    if b.available():
        pytest.skip(b.available())
    return b


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["fla", "fla-gated", "liger", "flashinfer", "megatron",
                                  "transformer_engine", "vllm-cuda"])
def test_real_library_forward_on_cuda(name):
    _module, b = BACKENDS[name]
    b = _cuda_backend(b)
    for op, support in b.ops.items():
        params = {k: v[-1] for k, v in support.params.items()}
        wd = torch.float32 if "fp32" in support.weight_dtypes else torch.bfloat16
        s = OPS[op].make_sample((8, 512), torch.bfloat16, params=params, seed=0,
                                weight_dtype=wd, device="cuda")
        before = {k: v.clone() for k, v in s.rows.items()}
        got = b.forward(op, s.rows, s.weight, eps=s.eps, **params)
        assert all(torch.equal(before[k], s.rows[k]) for k in before)
        assert [g.shape for g in got] == [r.shape for r in OPS[op].spec_forward(s)]
        if name != "megatron":
            for n, g, ref in zip(OPS[op].outputs, got, OPS[op].spec_forward(s), strict=True):
                assert gate_compare(n, g, ref, "forward").within_tolerance, (op, n)


@pytest.mark.cuda
def test_megatron_installed_forward_matches_its_zero_centred_flag():
    b = _cuda_backend(megatron_adapter.backend)
    s = OPS["rms_norm"].make_sample((4, 256), torch.bfloat16, params={"offset": 1.0}, seed=0,
                                    device="cuda")
    (y1,) = b.forward("rms_norm", s.rows, s.weight, eps=s.eps, offset=1.0)
    (y0,) = b.forward("rms_norm", s.rows, s.weight, eps=s.eps, offset=0.0)
    # the defect in megatron-core 0.19.2: zero_centered_gamma changes nothing in forward
    assert torch.equal(y0, y1) is bool(megatron_adapter.zero_centered_ignored_in_forward())
