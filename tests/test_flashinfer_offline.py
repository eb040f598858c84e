"""``scripts/flashinfer_offline.sh``: its install step, on a stand-in tarball (the fetch
step downloads FlashInfer's wheels and is run by hand on a machine with network)."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path):
    if shutil.which("bash") is None or shutil.which("xz") is None:
        pytest.skip("needs bash and xz")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "flashinfer_offline.sh", tmp_path / "scripts")
    site = tmp_path / "src" / "site" / "flashinfer"
    (site / "norm").mkdir(parents=True)
    (site / "__init__.py").write_text('__version__ = "0.0.test"\n')
    (site / "norm" / "__init__.py").write_text("")
    (tmp_path / ".flashinfer").mkdir()
    with tarfile.open(tmp_path / ".flashinfer" / "site.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "src" / "site", arcname="site")
    return tmp_path


def _bash(tree: Path, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=tree, capture_output=True, text=True,
                          timeout=120)


def test_install_puts_flashinfer_on_the_path_with_its_cuda_norm_path(tree):
    done = _bash(tree, "source scripts/flashinfer_offline.sh install && "
                       'echo "use_cuda_norm=$FLASHINFER_USE_CUDA_NORM" && '
                       "python3 -c 'import flashinfer; print(flashinfer.__file__)'")
    assert done.returncode == 0, done.stderr
    assert "flashinfer 0.0.test" in done.stdout
    assert "use_cuda_norm=1" in done.stdout
    assert "/tmp/flashinfer-site/flashinfer/__init__.py" in done.stdout


def test_an_unknown_step_is_a_usage_error(tree):
    done = _bash(tree, "bash scripts/flashinfer_offline.sh nonsense")
    assert done.returncode == 2 and "usage:" in done.stderr
