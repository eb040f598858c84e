"""Every run-time variable the CUDA launcher reads is documented where users look.

The launcher reads its switches by name (``env_is``, ``switched_off``, ``getenv``) in
``backends/csrc``; the torch extension's module docstring, which the docs site renders
as its reference page, lists what each one does. A switch added to the sources without
a line there fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "backends" / "csrc"
TORCH_EXT = ROOT / "backends" / "torch_ext" / "__init__.py"

#: A variable's name as a C string literal: how the launcher asks for it.
READ_BY_NAME = re.compile(r'"(NORMSPEC_[A-Z0-9_]+)"')


def launcher_variables() -> set[str]:
    """The names of the variables read at run time by the CUDA sources."""
    names: set[str] = set()
    for source in sorted(CSRC.iterdir()):
        if source.suffix in {".cu", ".cuh", ".cpp", ".h"}:
            names.update(READ_BY_NAME.findall(source.read_text()))
    return names


def torch_ext_docstring() -> str:
    """The module docstring of ``normspec.backends.torch_ext``, read without importing it."""
    doc = ast.get_docstring(ast.parse(TORCH_EXT.read_text()))
    assert doc, f"{TORCH_EXT} has no module docstring"
    return doc


def test_the_launcher_reads_variables():
    """The scan finds the switches at all (a renamed folder would make the check empty)."""
    names = launcher_variables()
    assert {"NORMSPEC_PIPE", "NORMSPEC_BWD_ROW", "NORMSPEC_GT_VLLM_FORM"} <= names, names


def test_every_launcher_variable_is_documented():
    doc = torch_ext_docstring()
    missing = sorted(n for n in launcher_variables() if f"``{n}" not in doc)
    assert not missing, (
        f"read by backends/csrc but not described in {TORCH_EXT.relative_to(ROOT)}'s "
        f"docstring: {missing}")
