"""NVRTC: the kernel sources compiled into modules, and the on-disk compile cache.

Why not ``cupy.RawModule(code=...)``: CuPy's compile path appends ``-ftz=true`` after the
caller's options, and NVRTC lets the last ``-ftz`` win: the kernels would flush subnormals
and the results would no longer be the spec's bits. So this module drives NVRTC itself
(``cupy.cuda.nvrtc``, with the torch extension's IEEE flags); the images are cached on
disk by a digest of the sources, options, target and NVRTC version, and loaded with
``cupy.RawModule(path=...)`` (``device.DeviceState.module``). It also imports CuPy for
the package (``import_cupy``), so that a missing CuPy is one message everywhere.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normspec.environ import positive_int
from normspec.progress import say

from .codes import DT_NAMES, MODULE_LABELS
from .launches import MODULES, name_expressions

#: The directory of the CUDA sources (package data shared with the torch extension).
CSRC = Path(__file__).resolve().parent.parent / "csrc"
KERNELS = "normspec_pipe.cuh"
#: The headers the NVRTC program includes: the kernels, and the gated backward's pair
#: kernel (``normspec_gated_bwd.cuh``, which the torch extension's launcher includes too).
_INCLUDES = (KERNELS, "normspec_gated_bwd.cuh")
#: Files whose contents key the compile cache.
_SOURCES = ("normspec_pipe.cuh", "normspec_gated_bwd.cuh", "normspec_kernels.cuh",
            "normspec_arith.h")

#: NVRTC options: the IEEE settings of the torch extension's nvcc build
#: (``backends/torch_ext/_build.py``: -fmad=false --ftz=false --prec-div=true
#: --prec-sqrt=true, no fast math). The include paths and ``-arch`` are added per call.
NVRTC_OPTIONS = (
    "-std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
)

#: NVRTC's failure, once one happened (``available()`` then says it without compiling)
compile_error: str | None = None
_lock = threading.Lock()
#: one lock per module image (its digest): one thread compiles it, the others wait
_compile_locks: dict[str, threading.Lock] = {}


class NVRTCCompileError(RuntimeError):
    """NVRTC rejected the kernel sources; the message holds the first lines of its log."""


def import_cupy() -> tuple[Any, str | None]:
    """``(cupy, None)``, or ``(None, why not)`` where CuPy is missing or fails to import."""
    try:
        import cupy
    except ImportError as exc:
        return None, (f"CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x): "
                      f"{exc}")
    except Exception as exc:  # a broken CUDA install can fail at import
        return None, f"CuPy failed to import: {type(exc).__name__}: {exc}"
    return cupy, None


def require_cupy() -> Any:
    """CuPy, or a ``RuntimeError`` saying why it cannot be had."""
    cp, reason = import_cupy()
    if reason is not None:
        raise RuntimeError(f"normspec cupy backend: {reason}")
    return cp


def sources_digest() -> str:
    """sha256 over the kernel sources: part of the cache key (NVRTC's own includes are
    not hashed by anyone else)."""
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()


def source_text() -> str:
    """The NVRTC program: the shared header as it is (the digest line keys caches)."""
    includes = "".join(f'#include "{name}"\n' for name in _INCLUDES)
    return f"// normspec sources sha256 {sources_digest()}\n{includes}"


def cuda_include_dir() -> str | None:
    """A directory holding ``cuda_bf16.h`` / ``cuda_fp16.h`` for NVRTC, or ``None``."""
    candidates = []
    cp, _ = import_cupy()
    if cp is not None:
        try:
            path = cp.cuda.get_cuda_path()
        except Exception:
            path = None
        if path:
            candidates.append(Path(path) / "include")
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_bf16.h").exists():
            return str(c)
    return None


def compile_options(arch_flag: str) -> tuple[str, ...]:
    """Full NVRTC options for ``arch_flag`` (``-arch=sm_90`` or ``-arch=compute_90``);
    part of the compile cache's key."""
    inc = [f"-I{CSRC}"]
    cuda_inc = cuda_include_dir()
    if cuda_inc:
        inc.append(f"-I{cuda_inc}")
    return (*NVRTC_OPTIONS, *inc, arch_flag)


def compile_kernels(names: Sequence[str], arch: str) -> tuple[bytes, dict[str, str], str]:
    """Compile the sources with NVRTC for ``arch`` (``"sm_90"`` gives a cubin,
    ``"compute_90"`` PTX); returns ``(image, {name expression: lowered name}, log)``.

    Needs CuPy and NVRTC only, no GPU. Raises
    [`NVRTCCompileError`][normspec.backends.cupy.NVRTCCompileError].
    """
    cp = require_cupy()
    nvrtc = cp.cuda.nvrtc
    options = compile_options(f"-arch={arch}")
    prog = nvrtc.createProgram(source_text(), "normspec_cupy.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            head = "\n".join(log.strip().splitlines()[:12])
            raise NVRTCCompileError(f"NVRTC compile failed ({exc}):\n{head}") from exc
        log = nvrtc.getProgramLog(prog)
        image = nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
        if isinstance(image, str):
            image = image.encode()
        mapping = {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    return image, mapping, log


def cache_dir() -> Path:
    if os.environ.get("NORMSPEC_CUPY_CACHE_DIR"):
        return Path(os.environ["NORMSPEC_CUPY_CACHE_DIR"])
    base = os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache"
    return Path(base) / "normspec"


def device_arch(cp: Any, dev: int) -> str:
    """``sm_XX`` when NVRTC targets the device directly, else PTX of the nearest lower arch."""
    cc = int(cp.cuda.Device(dev).compute_capability)
    supported = sorted(int(a) for a in cp.cuda.nvrtc.getSupportedArchs())
    if cc in supported:
        return f"sm_{cc}"
    lower = [a for a in supported if a <= cc] or supported[:1]
    return f"compute_{lower[-1]}"


def module_image(cp: Any, dev: int, op: int, dt: int, part: str
                  ) -> tuple[Path, dict[str, str]]:
    """The disk-cached image of (op, dtype)'s ``part`` module for device ``dev``'s target
    and its name mapping, compiled by NVRTC first when the cache lacks it (the compile announced on
    stderr, with its time: tens of seconds a module). Loads nothing: needs no context.
    One thread compiles a given module at a time (others wait for its image); different
    modules compile side by side (NVRTC's compile releases the GIL)."""
    global compile_error
    arch = device_arch(cp, dev)
    names = name_expressions(op, dt, part)
    ident = json.dumps([source_text(), compile_options(f"-arch={arch}"), arch,
                        list(cp.cuda.nvrtc.getVersion()), names])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:32]
    cache = cache_dir()
    image_path = cache / f"{digest}.{'cubin' if arch.startswith('sm_') else 'ptx'}"
    map_path = cache / f"{digest}.json"
    with _lock:
        compile_lock = _compile_locks.setdefault(digest, threading.Lock())
    with compile_lock:
        mapping = None
        if image_path.exists() and map_path.exists():
            try:
                mapping = json.loads(map_path.read_text())
            except (OSError, ValueError):
                mapping = None
        if mapping is None or set(mapping) != set(names):
            what = f"the {MODULE_LABELS[op]} {part} kernels ({DT_NAMES[dt]}, {arch})"
            say(f"normspec cupy: compiling {what} with NVRTC: their first use here, "
                f"cached in {cache} afterwards...")
            start = time.perf_counter()
            try:
                image, mapping, _ = compile_kernels(names, arch)
            except NVRTCCompileError as exc:
                compile_error = str(exc)
                raise
            say(f"normspec cupy: compiled {what} in {time.perf_counter() - start:.0f} s")
            cache.mkdir(parents=True, exist_ok=True)
            _atomic_write(image_path, image)
            _atomic_write(map_path, json.dumps(mapping).encode())
    return image_path, mapping


def compile_modules(dev: int | None = None, *, jobs: int | None = None) -> float:
    """Compiles every module the disk cache lacks for device ``dev``'s target (the
    current device by default), ``jobs`` at a time in threads: by default ``$MAX_JOBS``
    (the torch extension builds' variable) or else one per CPU core. Returns the seconds
    it took. On a machine's first use this is the 21 NVRTC compiles, each up to tens of
    seconds on one core, which one after another would take minutes.
    Raises [`NVRTCCompileError`][normspec.backends.cupy.NVRTCCompileError] (the
    first module's failure, after the others finished)."""
    cp = require_cupy()
    if dev is None:
        dev = cp.cuda.runtime.getDevice()
    if jobs is None:
        jobs = _max_jobs()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(jobs, len(MODULES))),
                                               thread_name_prefix="normspec-nvrtc") as pool:
        futures = [pool.submit(module_image, cp, dev, *module) for module in MODULES]
    for future in futures:
        if future.exception() is not None:
            raise future.exception()
    return time.perf_counter() - start


def _max_jobs() -> int:
    """``$MAX_JOBS`` when it is a positive integer (else a ``ValueError`` naming it), or
    the number of CPU cores this process may use."""
    jobs = positive_int("MAX_JOBS", "a positive integer (how many NVRTC compiles run at once)")
    if jobs is not None:
        return jobs
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
