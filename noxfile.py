"""nox sessions: tests, lint, conformance (cpu / cuda / auto), docs, bench.

CPU sessions run in fresh virtualenvs with torch==2.13.0 pinned (a bare torch
requirement would pull a multi-GB CUDA build); GPU sessions run in the
caller's CUDA environment (``venv_backend="none"``).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

TORCH_CPU = "torch==2.13.0"


def _install_cpu(session: nox.Session, extras: str = "test") -> None:
    session.install(TORCH_CPU)
    session.install("setuptools>=69", "wheel")
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite on the CPU (CUDA tests are skipped without a GPU)."""
    _install_cpu(session)
    session.run("pytest", *(session.posargs or ["-q"]))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
