"""The torch extension's build: its directory, flags and lock (no compilation here)."""

from __future__ import annotations

import sys

import pytest

_build = pytest.importorskip("normspec.backends.torch_ext._build")


def test_build_directory_follows_normspec_build_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NORMSPEC_BUILD_DIR", str(tmp_path))
    cpu, cuda = _build.build_directory(with_cuda=False), _build.build_directory(with_cuda=True)
    assert cpu.parent == tmp_path == cuda.parent and cpu != cuda
    assert cpu.name.startswith("torch")
    assert f"-cpu-py{sys.version_info.major}{sys.version_info.minor}-env" in cpu.name


def test_two_environments_keep_a_build_each(monkeypatch, tmp_path):
    """The same torch and Python in two virtualenvs would rebuild each other's cache."""
    monkeypatch.setenv("NORMSPEC_BUILD_DIR", str(tmp_path))
    here = _build.build_directory(with_cuda=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert _build.build_directory(with_cuda=False) != here


def _fake_compiler(monkeypatch, tmp_path, load):
    """``build`` with the compiler replaced by ``load`` (called with ``cpp_extension.load``'s
    keywords), into ``tmp_path``; the CUDA build directory, created."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("NORMSPEC_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_loaded", None)
    monkeypatch.setattr(_build, "_error", None)
    monkeypatch.setattr(_build, "_prerequisites", lambda: None)
    monkeypatch.setattr(_build, "cuda_build_possible", lambda: None)
    monkeypatch.setattr(_build, "AFTER_LOAD", [])
    monkeypatch.setattr(cpp_extension, "load", load)
    directory = _build.build_directory(with_cuda=True)
    directory.mkdir(parents=True)
    return directory


def test_build_passes_the_ieee_flags_to_both_compilers(monkeypatch, tmp_path):
    """``build`` hands the C++ and the CUDA compiler their IEEE flags, no definitions, and
    builds in ``build_directory`` (the compiler itself faked)."""
    seen = {}
    directory = _fake_compiler(monkeypatch, tmp_path, lambda **kw: seen.update(kw))
    path = _build.build(verbose=False)
    assert seen["extra_cflags"] == _build.CFLAGS
    assert seen["extra_cuda_cflags"] == _build.CUDA_CFLAGS
    assert {"-fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"} <= set(
        seen["extra_cuda_cflags"])
    assert seen["build_directory"] == str(directory) and path.startswith(str(directory))


def test_build_removes_the_lock_file_of_a_killed_build(monkeypatch, tmp_path, capsys):
    """A ``lock`` file that ``cpp_extension`` left when its build was killed would make
    ``load`` wait for ever; ``build`` removes it, says so, and holds its own lock while
    loading (the compiler itself faked)."""
    fcntl = pytest.importorskip("fcntl")
    seen = {}

    def load(**kw):
        seen["stale_lock_left"] = (directory / "lock").exists()
        with open(directory / "normspec.flock") as other:  # another process's attempt
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["held"] = False
            except BlockingIOError:
                seen["held"] = True

    directory = _fake_compiler(monkeypatch, tmp_path, load)
    (directory / "lock").write_text("")
    _build.build(verbose=True)
    assert seen == {"stale_lock_left": False, "held": True}
    assert f"removing {directory / 'lock'}" in capsys.readouterr().err
    with open(directory / "normspec.flock") as after:  # released once loaded
        fcntl.flock(after, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_build_waits_for_the_lock_before_it_touches_the_lock_file(monkeypatch, tmp_path,
                                                                  capsys):
    """While another normspec build holds the lock, its ``lock`` file is live: ``build``
    waits, saying so, and neither removes the file nor loads until the lock is free."""
    import threading

    fcntl = pytest.importorskip("fcntl")
    loaded = threading.Event()
    directory = _fake_compiler(monkeypatch, tmp_path, lambda **kw: loaded.set())
    (directory / "lock").write_text("")  # the other build's, live
    with open(directory / "normspec.flock", "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        worker = threading.Thread(target=_build.build, kwargs={"verbose": True})
        worker.start()
        worker.join(timeout=0.5)
        assert worker.is_alive() and not loaded.is_set()
        assert (directory / "lock").exists()
        fcntl.flock(other, fcntl.LOCK_UN)
    worker.join(timeout=10)
    assert not worker.is_alive() and loaded.is_set()
    assert "waiting for another normspec build" in capsys.readouterr().err


def test_build_goes_on_where_the_file_system_refuses_the_lock(monkeypatch, tmp_path, capsys):
    """A file system without ``flock`` (ENOLCK) does not make the backend unavailable: the
    build goes on, says why, and leaves a ``lock`` file alone (it may be live)."""
    import errno

    fcntl = pytest.importorskip("fcntl")
    calls = []
    directory = _fake_compiler(monkeypatch, tmp_path, lambda **kw: calls.append(kw))

    def refuse(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    (directory / "lock").write_text("")
    _build.build(verbose=True)
    assert len(calls) == 1 and (directory / "lock").exists()
    assert "no build lock" in capsys.readouterr().err


@pytest.mark.parametrize("seconds", [0.0, 0.3])
def test_first_use_is_announced_only_when_it_builds(monkeypatch, tmp_path, capsys, seconds):
    """``available()`` says "building ..." and "ready after" only for a load that takes a
    while (a build); a process that finds the build cached (each conformance worker) says
    nothing. The compiler is faked: it takes ``seconds``."""
    import importlib
    import time

    from normspec import progress

    module = importlib.import_module("normspec.backends.torch_ext.backend")

    def load(**kw):
        time.sleep(seconds)

    _fake_compiler(monkeypatch, tmp_path, load)
    real = progress.announced_if_slow
    monkeypatch.setattr(module, "announced_if_slow",
                        lambda *a, **kw: real(*a, **{**kw, "after": 0.1}))
    assert module.backend.available() is None
    lines = capsys.readouterr().err.splitlines()
    if seconds == 0.0:
        assert lines == []
    else:
        assert lines[0].startswith("normspec: building the torch extension in ")
        assert lines[1].startswith("normspec: torch extension ready after ")
