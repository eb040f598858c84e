"""Build and load the normspec torch extension (JIT, through ``torch.utils.cpp_extension``).

The C++ and CUDA sources live in ``normspec/backends/csrc`` (shared with the
CuPy backend). The CPU kernels are always built; the CUDA kernels only when
torch sees a GPU and ``nvcc`` is found. The build is cached under
``$NORMSPEC_BUILD_DIR`` or ``$TORCH_EXTENSIONS_DIR/normspec`` or
``~/.cache/normspec/torch_ext`` (one sub-directory per torch / CUDA / Python version and
Python environment, so that two environments on one machine keep a build each), and only
the first use pays for the compilation.

On POSIX systems, builds into one directory are serialised by an advisory lock
(``normspec.flock``) that the operating system drops when the building process dies.
``torch.utils.cpp_extension``'s own lock (a file named ``lock``) is not dropped so: a build
killed mid-way leaves it, and every later build would wait on it for ever. Holding ours, a
normspec build takes a ``lock`` file it finds for such a leftover, and removes it (saying
so). Two cases where that is wrong: a normspec older than this lock building in the same
directory at the same time, and the compilers of a build whose Python process alone was
killed (``kill -9``, the OOM killer; ``timeout`` and Ctrl-C stop the whole process group),
which go on running, and beside which a second build then runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

# imported here, in the thread that imports this module: the build itself runs in a thread
# of its own beside other backends' imports (registry.statuses), and two threads importing
# the same modules (setuptools, through cpp_extension) can meet one half initialised
from torch.utils import cpp_extension

__all__ = ["AFTER_LOAD", "CSRC", "LAUNCH_UNITS", "available", "build", "build_directory",
           "cuda_build_possible", "loaded"]

#: The directory of the C++/CUDA sources (shipped in the wheel as package data).
CSRC = Path(__file__).resolve().parent.parent / "csrc"

CPU_SOURCES = ("normspec_ops.cpp", "normspec_cpu.cpp")
#: The launch units: one forward or backward of one op and dtype each (21), compiled side
#: by side (the longest, the bf16 gated backward, in about 27 s on one core).
LAUNCH_UNITS = tuple(
    f"launch_units/{dtype}_{op}_{direction}.cu"
    for dtype in ("f32", "bf16", "f16")
    for op, direction in (("rms", "forward"), ("fused", "forward"), ("gated", "forward"),
                          ("rms", "backward"), ("fused", "backward"),
                          ("fused_sum", "backward"), ("gated", "backward"))
)
#: The CUDA build's sources: the torch-facing wrappers, the entry points, the launch units.
CUDA_SOURCES = ("normspec_cuda.cpp", "normspec_launch.cu", *LAUNCH_UNITS)
#: Files that every translation unit depends on (a change forces a rebuild).
HEADERS = ("normspec_arith.h", "normspec_host.h", "normspec_kernels.cuh", "normspec_launch.h",
           "normspec_launch_impl.cuh", "normspec_pipe.cuh", "normspec_gated_bwd.cuh",
           "normspec_plan.h")

CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
CUDA_CFLAGS = [
    "-O3",
    "-fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "-Xcompiler",
    "-ffp-contract=off",
]

#: Called once the library is loaded, before ``build`` returns: the operators' Python
#: parts (fake kernels, autograd) register themselves here when their module is imported.
AFTER_LOAD: list = []

_lock = threading.Lock()
_loaded: str | None = None  # the library path once loaded
_error: str | None = None  # why the last build/load failed


def cuda_build_possible() -> str | None:
    """``None`` when the CUDA kernels can be built here, else why not."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    home = cpp_extension.CUDA_HOME
    if home is None or not (Path(home) / "bin" / "nvcc").exists():
        return "nvcc not found (set CUDA_HOME)"
    return None


def _tag(with_cuda: bool) -> str:
    dev = f"cu{torch.version.cuda}" if with_cuda else "cpu"
    torch_version = torch.__version__.replace("+", "_")
    # the environment: torch's headers and libraries come from it, and a build made in
    # another environment (the same versions) would be rebuilt, evicting that one's
    env = hashlib.sha256(str(Path(sys.prefix).resolve()).encode()).hexdigest()[:8]
    return (f"torch{torch_version}-{dev}-py{sys.version_info.major}{sys.version_info.minor}"
            f"-env{env}")


def build_directory(with_cuda: bool | None = None) -> Path:
    """Where the extension is built and cached."""
    if with_cuda is None:
        with_cuda = cuda_build_possible() is None
    if os.environ.get("NORMSPEC_BUILD_DIR"):
        base = Path(os.environ["NORMSPEC_BUILD_DIR"])
    elif os.environ.get("TORCH_EXTENSIONS_DIR"):
        base = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "normspec"
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        base = Path(cache) / "normspec" / "torch_ext"
    return base / _tag(with_cuda)


def _prerequisites() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH)"
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None


@contextlib.contextmanager
def _directory_lock(directory: Path, verbose: bool):
    """Hold ``directory``'s advisory build lock and, holding it, remove the ``lock`` file of
    a killed ``cpp_extension`` build (module docstring). Says so when it has to wait for
    another build. Without ``fcntl`` (not POSIX), or on a file system that refuses
    ``flock``, the build goes on without the lock and a leftover ``lock`` file stays."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(directory / "normspec.flock", "a+") as handle:
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if verbose:
                    print(f"normspec: waiting for another normspec build in {directory}",
                          file=sys.stderr, flush=True)
                fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:  # e.g. ENOLCK on some network file systems
            if verbose:
                print(f"normspec: no build lock in {directory} ({exc}); building without it",
                      file=sys.stderr, flush=True)
            yield
            return
        try:
            stale = directory / "lock"
            if stale.exists():
                if verbose:
                    print(f"normspec: removing {stale}, left by a build that was stopped "
                          "(no normspec build holds it)", file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(verbose: bool = True) -> str:
    """Build (or load from the cache) the extension and register its operators.

    Returns the path of the loaded library. Raises ``RuntimeError`` with the
    reason when the build fails. Thread-safe; later calls are free.
    """
    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded
        reason = _prerequisites()
        if reason is not None:
            _error = reason
            raise RuntimeError(f"normspec torch_ext: {reason}")
        with_cuda = cuda_build_possible() is None
        sources = [str(CSRC / s) for s in CPU_SOURCES]
        if with_cuda:
            sources += [str(CSRC / s) for s in CUDA_SOURCES]
        directory = build_directory(with_cuda)
        directory.mkdir(parents=True, exist_ok=True)
        name = "normspec_torch_ext_cuda" if with_cuda else "normspec_torch_ext_cpu"
        if verbose:
            print(
                f"normspec: building {name} ({'CPU + CUDA' if with_cuda else 'CPU only'}) "
                f"in {directory}",
                file=sys.stderr,
                flush=True,
            )
        try:
            with _directory_lock(directory, verbose):
                cpp_extension.load(
                    name=name,
                    sources=sources,
                    extra_cflags=CFLAGS,
                    extra_cuda_cflags=CUDA_CFLAGS,
                    extra_include_paths=[str(CSRC)],
                    build_directory=str(directory),
                    verbose=verbose,
                    with_cuda=with_cuda,
                    is_python_module=False,
                )
        except Exception as exc:
            _error = f"build failed: {type(exc).__name__}: {exc}"
            raise RuntimeError(f"normspec torch_ext: {_error}") from exc
        for hook in AFTER_LOAD:
            hook()
        path = str(directory / f"{name}.so")
        _loaded = path
        _error = None
        return path


def loaded() -> bool:
    """Whether the extension is loaded in this process."""
    return _loaded is not None


def available(*, build_if_needed: bool = True) -> str | None:
    """``None`` when the extension is usable here, else the reason why not.

    With ``build_if_needed`` (the default) a missing build is compiled now
    (quietly); otherwise only the prerequisites and an earlier failure are
    checked.
    """
    if _loaded is not None:
        return None
    if _error is not None:
        return _error
    reason = _prerequisites()
    if reason is not None or not build_if_needed:
        return reason
    try:
        build(verbose=False)
    except RuntimeError as exc:
        return str(exc)
    return None
