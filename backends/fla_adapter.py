"""``fla`` and ``fla-gated``: flash-linear-attention's Triton norms (CUDA only).

Two backends, because FLA has two gated-norm kernels:

``fla`` (``fla-core``; modules under ``fla.modules``)

* ``rms_norm``: ``fla.modules.layernorm.rms_norm(x, g, None, eps=eps)``.
  FLA has no zero-centred option, so for ``offset=1`` the adapter passes
  ``g = 1.0 + weight.float()``: **``1 + w`` is formed in fp32 and passed as an
  fp32 weight** (one fp32 rounding, exactly the spec's ``g``; the kernel
  loads the weight and upcasts it to fp32 anyway, so nothing is rounded to the
  weight dtype). ``dweight`` reaches the caller's weight through the autograd
  of that expression.
* ``fused_add_rms_norm`` (``residual_sum="fp32"``): the same call with
  ``residual=residual, prenorm=True``, returning ``(y, residual_out)``. The
  kernel adds in fp32, stores the sum rounded to the residual dtype and
  normalises the unrounded fp32 sum. Its backward recomputes from the stored
  (rounded) residual.
* ``rms_norm_gated`` (``convention="vllm"``, silu or sigmoid):
  ``fla.modules.fused_norm_gate.rms_norm_gated(x, gate, w, None,
  activation=..., eps=eps)``, the function behind ``FusedRMSNormGated`` (what
  transformers' Qwen3-Next uses when FLA is importable): normalise, weight,
  then gate, all fp32, one cast.

``fla-gated`` (``fla.modules.layernorm_gated``)

* ``rms_norm_gated`` (``convention="vllm"``, silu only):
  ``rmsnorm_fn(x, w, None, z=gate, eps=eps, norm_before_gate=True)`` — the
  Tri Dao / mamba kernel that vLLM vendors for ``RMSNormGated.forward_cuda``.

Every path has FLA's own Triton backward (``full``).

FLA's kernels are autotuned (``triton.autotune`` over ``num_warps`` and rows per
program, e.g. ``fla/modules/norm/layernorm.py`` lines 38-45 in fla-core 0.6.0),
and the configs round differently: on an H200, a 4096 x 2048 bf16 ``rms_norm``
gave four different outputs under its four forward configs and the gated norm at
4096 x 128 two.
Which config runs is decided by timing at first use and cached per machine
(``FLA_CACHE_RESULTS=1``), so this adapter's bits, and its reports' mismatch
lines, can differ between processes and machines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport, installed_version

DIST = "fla-core"


def _version(dist: str = DIST) -> str | None:
    return installed_version(dist)


def _fla_version() -> str | None:
    # fla-core is the kernels-only distribution; older installs ship it as
    # flash-linear-attention
    return _version(DIST) or _version("flash-linear-attention")


def _available(modules: tuple[str, ...]) -> str | None:
    if _fla_version() is None:
        return f"{DIST} is not installed (pip install {DIST})"
    if _version("triton") is None:
        return "triton is not installed (FLA's kernels are Triton)"
    if _version("einops") is None:
        return "einops is not installed (an FLA dependency)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (FLA's kernels are Triton); torch sees none"
    try:
        import importlib

        for m in modules:
            importlib.import_module(m)
    except Exception as exc:
        return f"{DIST} {_fla_version()} failed to import: {type(exc).__name__}: {exc}"
    return None


def _activation(params: Mapping[str, Any]) -> str:
    act = params.get("activation", "silu")
    return {"silu": "swish", "sigmoid": "sigmoid"}[act]


class FlaBackend(Backend):
    """Adapter for FLA's ``rms_norm`` (with residual) and ``rms_norm_gated``."""

    name = "fla"
    install = "pip install fla-core"
    ops = {
        "rms_norm": OpSupport(backward="full", params={"offset": (0.0, 1.0)},
                              devices=("cuda",)),
        "fused_add_rms_norm": OpSupport(
            backward="full", params={"offset": (0.0, 1.0), "residual_sum": ("fp32",)},
            devices=("cuda",),
        ),
        "rms_norm_gated": OpSupport(
            backward="full", params={"convention": ("vllm",), "activation": ("silu", "sigmoid")},
            devices=("cuda",),
        ),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        return (f"fla-core {_fla_version() or '(not installed)'} "
                "fla.modules.layernorm.rms_norm (weight = 1 + w formed in fp32; residual, "
                "prenorm=True) / fla.modules.fused_norm_gate.rms_norm_gated")

    def library_version(self) -> str | None:
        return _fla_version()

    def available(self) -> str | None:
        return _available(("fla.modules.layernorm", "fla.modules.fused_norm_gate"))

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        x, eps = self.check_call(op, rows, weight, eps, params)
        if op == "rms_norm_gated":
            gate = rows["gate"]
            from fla.modules.fused_norm_gate import rms_norm_gated

            return (rms_norm_gated(x, gate, weight, None, activation=_activation(params),
                                   eps=eps),)
        from fla.modules.layernorm import rms_norm

        offset = float(params.get("offset", 0.0))
        # FLA has no zero-centred option: 1 + w in fp32, passed as an fp32 weight
        g = weight if offset == 0.0 else offset + weight.float()
        if op == "rms_norm":
            return (rms_norm(x, g, None, eps=eps),)
        residual = rows["residual"]
        y, res_out = rms_norm(x, g, None, residual=residual, eps=eps, prenorm=True)
        return y, res_out


class FlaGatedBackend(Backend):
    """Adapter for FLA's ``layernorm_gated.rmsnorm_fn`` (the kernel vLLM vendors)."""

    name = "fla-gated"
    install = "pip install fla-core"
    ops = {
        "rms_norm_gated": OpSupport(
            backward="full", params={"convention": ("vllm",), "activation": ("silu",)},
            devices=("cuda",),
        ),
    }

    @property
    def source(self) -> str:  # type: ignore[override]
        return (f"fla-core {_fla_version() or '(not installed)'} "
                "fla.modules.layernorm_gated.rmsnorm_fn(norm_before_gate=True)")

    def library_version(self) -> str | None:
        return _fla_version()

    def available(self) -> str | None:
        return _available(("fla.modules.layernorm_gated",))

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        x, eps = self.check_call(op, rows, weight, eps, params)
        gate = rows["gate"]
        from fla.modules.layernorm_gated import rmsnorm_fn

        return (rmsnorm_fn(x, weight, None, z=gate, eps=eps, group_size=None,
                           norm_before_gate=True),)


backend = FlaBackend()
backend_gated = FlaGatedBackend()
