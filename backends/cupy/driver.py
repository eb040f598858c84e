"""Driver launches: kernel arguments packed into one buffer, ``cuLaunchKernelEx`` by ctypes.

Every launch goes through the driver's ``cuLaunchKernelEx`` (CUDA 12.0+), which also
chains the dweight tree's launches after the backward kernel (programmatic dependent
launch, as ``normspec_launch.cu``'s ``launch_chained``); CuPy's ``RawKernel`` launches
only where the driver lacks it. Argument buffers and launch configurations are built once
per thread and reused: the CuPy backend's calls are host-bound.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
from typing import Any, NamedTuple

from . import nvrtc


class KernelArgs(NamedTuple):
    """A launch's kernel arguments: ``codes``, one letter for each (``Q`` a pointer or
    other uint64, ``q`` int64, ``i`` int32, ``f`` float32, as ``struct`` spells them),
    and ``values``, Python numbers (a float32's already rounded where it overflows,
    ``f32_arg``). The driver launch packs the values by the codes into one buffer
    (``_packed_params``), far quicker than a NumPy scalar for each argument."""

    codes: str
    values: tuple

    def numpy(self) -> tuple:
        """The arguments as NumPy scalars of their C types (what CuPy's ``RawKernel``
        takes)."""
        import numpy as np

        types = {"Q": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32}
        return tuple(types[c](v) for c, v in zip(self.codes, self.values, strict=True))


#: the codes of ``_pack``'s arguments: the forward's five pointers and six longs, the
#: backward's eight and eight
FWD_CODES = "QQQQQ" "qqqqqq" "ffi"
BWD_CODES = "QQQQQQQQ" "qqqqqqqq" "ffi"
#: normspec_fwd_quad_kernel's: the five pointers, the rows (int32), four strides, eps,
#: offset, the flags and rstd_out
QUAD_CODES = "QQQQQ" "i" "qqqq" "ffi" "Q"


def launch(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: KernelArgs,
            shared_mem: int = 0, *, chained: bool = False) -> None:
    """Launches ``fn`` on the current stream through the driver's ``cuLaunchKernelEx``
    (``_launch_driver``); ``chained``: as a programmatic dependent launch
    (``_launch_chained``; the caller has asked ``chained_launches``). Where the driver
    lacks ``cuLaunchKernelEx`` (before CUDA 12.0), through CuPy's ``RawKernel``. The
    driver launch with a configuration built once is the quickest of the three."""
    if chained:
        _launch_chained(fn, grid, block, args, shared_mem)
    elif cu_launch_kernel_ex() is not None:
        _launch_driver(fn, grid, block, args, shared_mem, None, 0)
    else:
        _launch_rawkernel(fn, grid, block, args, shared_mem)


def _launch_rawkernel(fn: Any, grid: tuple[int, ...], block: tuple[int, ...],
                      args: KernelArgs, shared_mem: int) -> None:
    """Launches ``fn`` through CuPy's ``RawKernel`` (drivers before CUDA 12.0): CuPy's
    launch is the driver's ``cuLaunchKernel``, which needs a current context as
    ``cuLaunchKernelEx`` does, so a ``CUDA_ERROR_INVALID_CONTEXT`` (CuPy's
    ``CUDADriverError``, its ``status``) binds the primary context and launches again
    once, as ``_launch_driver`` does."""
    values = args.numpy()
    try:
        fn(grid, block, values, shared_mem=shared_mem)
    except Exception as exc:
        if getattr(exc, "status", None) != CUDA_ERROR_INVALID_CONTEXT:
            raise
        bind_primary_context()
        fn(grid, block, values, shared_mem=shared_mem)


# ---- chained launches: programmatic dependent launch through the driver API ----------
# CuPy's RawKernel takes no launch attributes, so the chained tree launches go through
# cuLaunchKernelEx (CUDA 12.0+), as normspec_launch.cu's launch_chained does through
# cudaLaunchKernelEx. cuda.h (13.0): CUlaunchConfig, CUlaunchAttribute (an id, padding to
# 8 bytes, a 64-byte value union) and CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# = 6, whose value is an int at the union's start.
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _CuLaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint64 * 8)]


class _CuLaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_CuLaunchAttribute)), ("num_attrs", ctypes.c_uint)]


#: each argument code's ``struct`` format, each value in an 8-byte slot of one buffer: the
#: driver reads each parameter through its own pointer, an int32 or float32 from its
#: slot's first four bytes (little-endian)
_SLOT_CODES = {"Q": "Q", "q": "q", "i": "i4x", "f": "f4x"}
#: this thread's argument buffers: (packer, buffer, the pointers into it) by argument codes
_arg_layouts = threading.local()
#: this thread's launch configurations (pointers to them, which the driver reads) by
#: (grid, block, shared memory, stream, number of attributes): building one per launch
#: costs host time
_launch_configs = threading.local()
_CONFIGS_MAX = 1024
_cu_launch_kernel_ex_fn: list[Any] = []  # [] until looked up, then [function or None]
#: the one launch attribute of every chained launch (built once; launches point at it)
_CHAINED_ATTRS = (_CuLaunchAttribute * 1)()
_CHAINED_ATTRS[0].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CHAINED_ATTRS[0].value[0] = 1  # programmaticStreamSerializationAllowed


def cu_launch_kernel_ex() -> Any | None:
    """The driver's ``cuLaunchKernelEx`` (ctypes), or ``None`` where the driver library
    cannot be loaded or lacks it (a driver older than CUDA 12.0)."""
    if not _cu_launch_kernel_ex_fn:
        fn = None
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError):
            pass
        if fn is not None:
            fn.argtypes = [ctypes.POINTER(_CuLaunchConfig), ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
            fn.restype = ctypes.c_int
        _cu_launch_kernel_ex_fn.append(fn)
    return _cu_launch_kernel_ex_fn[0]


def _launch_chained(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: KernelArgs,
                    shared_mem: int) -> None:
    """``fn`` on the current stream with programmatic stream serialization: its blocks may
    be scheduled while the kernel before it runs (which calls
    ``griddepcontrol.launch_dependents``); they wait for it in ``griddepcontrol.wait``."""
    _launch_driver(fn, grid, block, args, shared_mem, _CHAINED_ATTRS, 1)


def _launch_driver(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: KernelArgs,
                   shared_mem: int, attrs: Any, num_attrs: int) -> None:
    """``fn`` on the current stream through the driver's ``cuLaunchKernelEx`` with
    ``num_attrs`` launch attributes ``attrs`` (``None`` and 0, or ``_CHAINED_ATTRS`` and
    1: the kept configurations are told apart by the number); ``args`` packed by
    ``_packed_params``. The driver call goes through ctypes' ``CDLL``, which lets other
    Python threads run while it waits (a launch can wait for room in the launch queue);
    ``PyDLL``, which holds the GIL, would be slightly quicker."""
    launch = cu_launch_kernel_ex()
    if launch is None:  # chained_launches said no; a caller that did not ask
        raise RuntimeError("a driver launch needs the driver's cuLaunchKernelEx")
    # (host time matters here: the CuPy backend's calls are host-bound)
    stream = nvrtc.require_cupy().cuda.get_current_stream().ptr
    configs = _launch_configs.__dict__
    key = (grid, block, shared_mem, stream, num_attrs)
    config = configs.get(key)
    if config is None:
        if len(configs) >= _CONFIGS_MAX:
            configs.clear()
        config = configs[key] = ctypes.pointer(_CuLaunchConfig(
            _pad_dims(grid), _pad_dims(block), shared_mem, stream or None, attrs, num_attrs))
    params = _packed_params(args)
    status = launch(config, fn.kernel.ptr, params, None)
    if status == CUDA_ERROR_INVALID_CONTEXT:  # rare: a thread's first CUDA work
        bind_primary_context()
        status = launch(config, fn.kernel.ptr, params, None)
    if status != 0:
        raise _driver_error(status, "cuLaunchKernelEx")


#: cuda.h's CUDA_ERROR_INVALID_CONTEXT: no context is current in the calling thread
CUDA_ERROR_INVALID_CONTEXT = 201


def bind_primary_context() -> None:
    """Makes the current device's primary context current in the calling thread.

    A thread that no CUDA runtime call has touched has no current context: the runtime
    binds one lazily at its first call, the driver's launch does not and fails with
    ``CUDA_ERROR_INVALID_CONTEXT``. Autograd's device thread can reach the CuPy backward
    before any runtime call there.
    ``cudaSetDevice`` binds the device's primary context and makes it current at once
    (CUDA 12.0+, ``cuda_runtime_api.h``). The launch calls this after that failure; the
    cold paths whose driver calls come before any launch (a module's load in
    ``DeviceState.kernel``, a kernel's attributes and occupancy in
    ``DeviceState.prepare_pipe_kernel``) call it first."""
    runtime = nvrtc.require_cupy().cuda.runtime
    runtime.setDevice(runtime.getDevice())


def _packed_params(args: KernelArgs) -> Any:
    """The driver's ``kernelParams`` for ``args``: their values packed into this thread's
    buffer for their codes, whose parameter pointers are built once with it (the driver
    copies the values at the launch)."""
    codes, values = args
    layouts = _arg_layouts.__dict__
    layout = layouts.get(codes)
    if layout is None:
        packer = struct.Struct("<" + "".join(_SLOT_CODES[c] for c in codes))
        buffer = ctypes.create_string_buffer(max(packer.size, 8))
        base = ctypes.addressof(buffer)
        params = (ctypes.c_void_p * max(len(codes), 1))(*range(base, base + 8 * len(codes), 8))
        layout = layouts[codes] = (packer, buffer, params)
    packer, buffer, params = layout
    packer.pack_into(buffer, 0, *values)
    return params


def _driver_error(status: int, what: str) -> RuntimeError:
    """CuPy's error for a driver status (named by the driver), or a plain one naming the
    status where the driver library cannot name it."""
    try:
        from cupy_backends.cuda.api import driver

        return driver.CUDADriverError(status)
    except Exception:  # no libcuda to name it
        return RuntimeError(f"{what} failed: CUresult {status}")


def _pad_dims(dims: tuple[int, ...]) -> tuple[int, ...]:
    return dims if len(dims) == 3 else (*dims, *(1,) * (3 - len(dims)))


def f32_arg(v: float) -> float:
    """``v`` as a float32 kernel argument will hold it: ``struct`` rounds as the C cast
    does (NumPy's ``float32``) but refuses what rounds to infinity, which is given here
    (from 2**128 - 2**103 up, the midpoint past the largest float32, rounded to even)."""
    return v if -_F32_ROUNDS_TO_INF < v < _F32_ROUNDS_TO_INF else math.copysign(math.inf, v)


_F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103
