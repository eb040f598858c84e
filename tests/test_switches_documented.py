"""Every environment variable the backends read is a user setting, documented where users
look.

The CUDA launcher (``backends/csrc``) reads no variable: there is one shipped path per
case, no speed switch. What a backend's Python code reads (its build or cache folder) is
listed in the table of user settings of that backend's module docstring, which the docs
site renders as its reference page; a variable read without a row there, or a row for a
variable no longer read, fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "backends"
CSRC = BACKENDS / "csrc"

#: A variable's name as a string literal: how the code asks for it.
READ_BY_NAME = re.compile(r"""["'](NORMSPEC_[A-Z0-9_]+)["']""")
#: A row of a settings table: ``| ``NAME`` | what it does |``.
TABLE_ROW = re.compile(r"^\|\s*``(NORMSPEC_[A-Z0-9_]+)``\s*\|", re.MULTILINE)

#: backend -> (the module whose docstring holds its settings table, the files it reads in)
BACKEND_FILES = {
    "torch_ext": (BACKENDS / "torch_ext" / "__init__.py",
                  sorted((BACKENDS / "torch_ext").glob("*.py"))),
    "cupy": (BACKENDS / "cupy" / "__init__.py", sorted((BACKENDS / "cupy").glob("*.py"))),
}


def launcher_variables() -> set[str]:
    """The names of the variables the CUDA sources ask for by name."""
    names: set[str] = set()
    for source in sorted(CSRC.rglob("*")):
        if source.suffix in {".cu", ".cuh", ".cpp", ".h"}:
            names.update(READ_BY_NAME.findall(source.read_text()))
    return names


def read_variables(files: list[Path]) -> set[str]:
    """The ``NORMSPEC_*`` names the code of ``files`` holds as string literals (docstrings
    left out)."""
    names: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings):
                names.update(re.findall(r"\bNORMSPEC_[A-Z0-9_]+\b", node.value))
    return names


def settings_table(module: Path) -> set[str]:
    """The variables in the settings table of ``module``'s docstring (read, not imported)."""
    doc = ast.get_docstring(ast.parse(module.read_text()))
    assert doc, f"{module} has no module docstring"
    return set(TABLE_ROW.findall(doc))


def test_the_cuda_launcher_reads_no_variable():
    """No speed switch or tuning override: the launcher has one path per case."""
    assert launcher_variables() == set()
    for source in sorted(CSRC.rglob("*")):
        if source.suffix in {".cu", ".cuh", ".cpp", ".h"}:
            assert "getenv" not in source.read_text(), source


@pytest.mark.parametrize("backend", BACKEND_FILES)
def test_every_variable_a_backend_reads_is_in_its_settings_table(backend):
    module, files = BACKEND_FILES[backend]
    read, table = read_variables(files), settings_table(module)
    assert read, f"the scan of {backend} found no variable (a renamed file?)"
    assert read == table, (
        f"read by {backend} but not in {module.relative_to(ROOT)}'s settings table: "
        f"{sorted(read - table)}; in the table but not read: {sorted(table - read)}")


def test_environment_lookups_go_through_os_environ():
    """No backend reads CPython's private ``os.environ._data``."""
    for path in sorted(BACKENDS.rglob("*.py")):
        assert "environ._data" not in path.read_text(), path
        assert not re.search(r"getattr\(os\.environ,\s*[\"']_data", path.read_text()), path
