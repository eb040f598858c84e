"""The registry entry: ``available()``, and the ``backend`` object of the entry point.

``cupy = "normspec.backends.cupy:backend"`` in the ``normspec.backends`` entry-point
group. ``available()`` compiles (or finds in the disk cache) and loads every module for
the current device, so that a backend reported available runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from normspec.registry import Backend, OpSupport

from . import device, nvrtc
from .launches import MODULES
from .nvrtc import KERNELS, NVRTCCompileError
from .ops import fused_add_rms_norm, rms_norm, rms_norm_gated


def available(*, compile: bool = True) -> str | None:
    """``None`` when the backend can run here, else why not (CuPy missing, no GPU,
    NVRTC failure with the first lines of its log, a module the driver refuses). With
    ``compile`` (the default) every module is compiled (cached on disk afterwards) and
    loaded now for the current device: device 0 unless the caller chose another
    (``torch.cuda.set_device``, CuPy's ``Device``), so that asking creates no context on a
    device the process does not use."""
    cp, reason = nvrtc.import_cupy()
    if reason is not None:
        return reason
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA GPU usable by CuPy ({type(exc).__name__}: {exc})"
    if count == 0:
        return "no CUDA GPU visible to CuPy"
    if nvrtc.compile_error is not None:
        return nvrtc.compile_error
    if compile:
        try:
            dev = cp.cuda.runtime.getDevice()
            nvrtc.compile_modules(dev)  # those the disk cache lacks, side by side
            for op, dt, part in MODULES:
                _, mapping = device.state(dev).module(op, dt, part)
                with cp.cuda.Device(dev):  # loaded too: a cubin the driver refuses
                    device.state(dev).kernel(op, dt, next(iter(mapping)))
        except (NVRTCCompileError, ValueError) as exc:  # ValueError: the build defines
            return str(exc)
        except Exception as exc:
            return f"loading the NVRTC module failed: {type(exc).__name__}: {exc}"
    return None


# ---- the registry backend -------------------------------------------------------------
def _cupy_version() -> str | None:
    import importlib.metadata

    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_OPS = ("rms_norm", "fused_add_rms_norm", "rms_norm_gated")


class CupyBackend(Backend):
    """The normspec CUDA kernels compiled by NVRTC and launched through CuPy."""

    name = "cupy"
    ops = {op: OpSupport(backward="full", devices=("cuda",), weight_dtypes=("fp32", "same"))
           for op in _OPS}

    @property
    def source(self) -> str:  # type: ignore[override]
        version = _cupy_version() or "(not installed)"
        return f"CuPy {version} NVRTC RawModule of backends/csrc/{KERNELS}"

    def prepare(self) -> None:
        """Compiles the NVRTC modules the disk cache lacks for the current device's target
        (device 0 in registry.statuses' fresh thread), loading none: no context is made.
        ``available()`` then loads them on its caller's device (compiling for that
        device's target too, where it differs)."""
        if available(compile=False) is None:
            nvrtc.compile_modules()

    def available(self) -> str | None:
        return available()

    def build(self, verbose: bool = True) -> str:
        """``normspec build``: compiles the modules the disk cache lacks for the current
        device (side by side, [`compile_modules`][normspec.backends.cupy.compile_modules])
        and loads them. Returns what it did; "skipped" with the reason where CuPy or a GPU
        is missing. Raises ``RuntimeError`` with NVRTC's or the driver's reason."""
        if nvrtc.compile_error is None:  # CuPy or a GPU missing: nothing to build here
            reason = available(compile=False)
            if reason is not None:
                return f"skipped: {reason}"
        start = time.perf_counter()
        reason = available()
        if reason is not None:
            raise RuntimeError(f"normspec cupy: {reason}")
        return (f"{len(MODULES)} NVRTC modules ready in {nvrtc.cache_dir()} "
                f"({time.perf_counter() - start:.0f} s)")

    def library_version(self) -> str | None:
        return _cupy_version()

    def forward(self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
                eps: float, **params: Any) -> tuple[torch.Tensor, ...]:
        if op == "rms_norm":
            return (rms_norm(rows["x"], weight, eps=eps, **params),)
        if op == "fused_add_rms_norm":
            return fused_add_rms_norm(rows["x"], rows["residual"], weight, eps=eps, **params)
        if op == "rms_norm_gated":
            return (rms_norm_gated(rows["x"], rows["gate"], weight, eps=eps, **params),)
        raise ValueError(f"op: unknown operator {op!r}; expected one of {list(_OPS)}")


#: The registry entry point object (``cupy = "normspec.backends.cupy:backend"``).
backend = CupyBackend()
# CuPy (where installed) is imported with this module, in the importing thread: prepare()
# runs in a thread of its own beside other backends' imports (registry.statuses), and two
# threads importing the same modules can meet one half initialised
nvrtc.import_cupy()
