"""Loading the repository's scripts (``bench/``, ``scripts/``: not packages) in tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str, *, register: bool = False) -> ModuleType:
    """The script at ``ROOT / relpath`` as a module called ``name``. ``bench/`` goes on
    ``sys.path`` first, since the bench scripts import ``run`` and ``device_timing`` from
    there; ``register`` also puts the module in ``sys.modules`` before it runs (dataclasses
    look their module up there)."""
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    if spec is None or spec.loader is None:
        raise ImportError(f"relpath: no script at {ROOT / relpath}")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
