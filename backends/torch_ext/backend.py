"""The registry entry of the torch extension: backend name ``torch_ext``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from normspec import __version__
from normspec.ops import OPS
from normspec.progress import announced_if_slow
from normspec.registry import Backend, OpSupport

from . import _build, _ops


class TorchExtBackend(Backend):
    """normspec's C++ (CPU) and CUDA kernels as ``torch.ops.normspec`` operators."""

    name = "torch_ext"
    ops = {name: OpSupport(backward="full") for name in OPS}
    install = "pip install normspec ninja  (and a C++ compiler; nvcc for the CUDA kernels)"

    @property
    def source(self) -> str:  # type: ignore[override]
        kernels = "C++ + CUDA" if _build.cuda_build_possible() is None else "C++"
        return (f"normspec {__version__} torch extension ({kernels} kernels, "
                f"torch {torch.__version__})")

    def library_version(self) -> str:
        return __version__

    def prepare(self) -> None:
        """Builds the extension where its cache lacks it (a minute or so; registry.statuses
        runs it beside the other backends' checks). Needs no current CUDA device."""
        self.available()

    def available(self) -> str | None:
        if _build.loaded():
            return None
        reason = _build.available(build_if_needed=False)
        if reason is not None:
            return reason
        # said only when it takes a while: a process that finds the build cached (a
        # conformance worker, a second run) loads it in about a second, quietly
        return announced_if_slow(
            lambda: _build.available(build_if_needed=True),
            f"normspec: building the torch extension in {_build.build_directory()} "
            "(first use; cached afterwards) ...",
            lambda reason, seconds: (f"normspec: torch extension "
                                     f"{'ready' if reason is None else 'failed'} "
                                     f"after {seconds:.0f} s"))

    def supports(self, op: str, params: Mapping[str, Any], device: str) -> str | None:
        if device == "cuda" and _build.cuda_build_possible() is not None:
            return f"CUDA kernels not built: {_build.cuda_build_possible()}"
        return super().supports(op, params, device)

    def build(self, verbose: bool = True) -> str:
        """``normspec build``: compile (or load from the cache) now."""
        return _build.build(verbose=verbose)

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        if op == "rms_norm":
            return (_ops.rms_norm(rows["x"], weight, eps=eps, **params),)
        if op == "fused_add_rms_norm":
            return _ops.fused_add_rms_norm(rows["x"], rows["residual"], weight, eps=eps, **params)
        return (_ops.rms_norm_gated(rows["x"], rows["gate"], weight, eps=eps, **params),)


backend = TorchExtBackend()
