"""The wheel holds every module of spec/, src/normspec/, backends/ and integrations/ (none
silently left out)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = {"src/normspec": "normspec", "spec": "normspec/spec", "backends": "normspec/backends",
          "integrations": "normspec/integrations"}
PACKAGE_DATA = ("*.py", "*.cu", "*.cuh", "*.cpp", "*.h")


def _expected() -> set[str]:
    files = set()
    for src, dest in LAYOUT.items():
        for pattern in PACKAGE_DATA:
            for path in (ROOT / src).rglob(pattern):
                if "__pycache__" in path.parts:
                    continue
                rel = path.relative_to(ROOT / src).as_posix()
                # a nested mapping (spec/ inside normspec) is checked under its own entry
                files.add(f"{dest}/{rel}")
    return files


@pytest.mark.slow
def test_wheel_contains_every_module(tmp_path):
    pytest.importorskip("setuptools")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("normspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_expected() - names)
    assert not missing, f"left out of the wheel: {missing}"
    assert any(n.endswith("entry_points.txt") for n in names)
