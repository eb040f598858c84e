"""normspec: declared-rounding specs, a backend registry and a conformance harness
for the normalization layers of RL training and rollout stacks.

The public Python API (the ``normspec`` command is built on it):

* [`get_backend`][normspec.registry.get_backend], [`iter_backends`][normspec.registry.iter_backends]
  and [`register`][normspec.registry.register]: look backends up;
* [`get_op`][normspec.ops.get_op] and [`OPS`][normspec.ops.OPS]: the operators as data;
* [`get_profile`][normspec.profiles.get_profile]: the conformance profiles;
* [`check`][normspec.harness.check]: hold one backend's op to the spec on one profile;
* [`run_conformance`][normspec.conformance.run_conformance]: every backend × op × profile.

They are imported on first use, so ``import normspec`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "get_backend": "normspec.registry",
    "iter_backends": "normspec.registry",
    "register": "normspec.registry",
    "get_op": "normspec.ops",
    "OPS": "normspec.ops",
    "get_profile": "normspec.profiles",
    "check": "normspec.harness",
    "run_conformance": "normspec.conformance",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'normspec' has no attribute {name!r}")
