"""``$NORMSPEC_BUILD_DEFINES``: preprocessor definitions for every build of the CUDA sources.

Both CUDA backends compile ``normspec/backends/csrc``: the torch extension with nvcc, the
CuPy backend with NVRTC. The kernels' build-time experiments (``#ifndef NORMSPEC_...`` knobs
in ``normspec_pipe.cuh``, such as ``NORMSPEC_ROW_WEIGHT_EARLY=0`` or
``NORMSPEC_BWD_PIN_OCCUPANCY=0``) reach both through this one variable: space-separated
``NAME`` or ``NAME=VALUE`` entries. Each backend keys its build cache by them, so a build
with definitions and the default one stay cached side by side.
"""

from __future__ import annotations

import os
import re

__all__ = ["build_defines"]

_DEFINE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]+)?")


def build_defines() -> list[str]:
    """The ``-D`` flags of ``$NORMSPEC_BUILD_DEFINES`` (empty when unset).

    Raises ``ValueError`` naming the variable and the entry that is not ``NAME`` or
    ``NAME=VALUE`` (a C identifier, and a non-empty value of letters, digits and
    ``_.+-``)."""
    defines = os.environ.get("NORMSPEC_BUILD_DEFINES", "").split()
    for d in defines:
        if not _DEFINE.fullmatch(d):
            raise ValueError(f"NORMSPEC_BUILD_DEFINES: expected space-separated NAME or "
                             f"NAME=VALUE entries, got {d!r}")
    return [f"-D{d}" for d in defines]
