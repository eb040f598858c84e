"""The two kinds of input, torch CUDA tensors and CuPy arrays: checks, views, streams.

torch tensors enter zero-copy as pointers and strides; outputs are allocated by torch and
come back as torch tensors; kernels run on torch's current stream. CuPy arrays run on
CuPy's current stream and come back as CuPy arrays. A ``Side`` holds what differs: views
of the rows' bits, allocation, the stream, and the results' kind.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from normspec.spec.validation import (
    TORCH_TENSORS,
    ArrayKind,
    check_input,
    check_like,
    check_weight,
)

from . import nvrtc
from .codes import CUPY_DT, DT_BF16, TORCH_DT

# ---- the two kinds of input -------------------------------------------------------
_RAW_TORCH = {4: torch.int32, 2: torch.int16}


def is_cupy_array(obj: object) -> bool:
    t = type(obj)
    return t.__name__ == "ndarray" and t.__module__.split(".")[0] == "cupy"


def _kind(name: str, obj: object) -> str:
    """``"torch"`` or ``"cupy"``; anything else is refused with the argument's name."""
    if isinstance(obj, torch.Tensor):
        return "torch"
    if is_cupy_array(obj):
        return "cupy"
    t = type(obj)
    if t.__name__ == "ndarray" and t.__module__.split(".")[0] == "numpy":
        raise TypeError(
            f"{name}: expected a CUDA torch.Tensor or a CuPy array, got a numpy.ndarray "
            "(host memory; move it to the GPU with cupy.asarray or torch.as_tensor(..., "
            "device='cuda'))"
        )
    raise TypeError(
        f"{name}: expected a CUDA torch.Tensor or a CuPy array, got {t.__module__}.{t.__name__}"
    )


def check_torch_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        raise ValueError(
            f"x: expected a CUDA tensor or a CuPy array, got a torch.Tensor on {x.device} "
            "(the cupy backend runs on CUDA GPUs only)"
        )


def _cp_dtype_code(a: Any) -> int | None:
    return CUPY_DT.get(a.dtype.name)


#: CuPy arrays, as the shared checks of ``normspec.spec.validation`` read them.
CUPY_ARRAYS = ArrayKind(
    noun="a CuPy array (like x)",
    accepts=is_cupy_array,
    dtype=lambda a: a.dtype.name,
    shown_dtype=lambda a: a.dtype.name,
    device=lambda a: f"cuda:{a.device.id}",
    same_device=lambda a, b: a.device.id == b.device.id,
    contiguous=lambda a: bool(a.flags.c_contiguous),
)
#: The kind of each input kind's arrays.
ARRAY_KINDS = {"torch": TORCH_TENSORS, "cupy": CUPY_ARRAYS}


def validate(rows: Mapping[str, object], weight: object) -> str:
    """Check the row inputs (``x``, or the fused backward's sum ``s``, first) and the
    weight; returns the input kind."""
    names = list(rows)
    x = rows[names[0]]
    kind = _kind(names[0], x)
    arrays = ARRAY_KINDS[kind]
    check_input(names[0], x, arrays)
    for n in names[1:]:
        check_like(n, rows[n], x, kind=arrays)
    check_weight(weight, x, arrays)
    return kind


class Side:
    """What differs between torch and CuPy inputs: views, allocation, stream, results."""

    def __init__(self, cp: Any, dev: int) -> None:
        self.cp, self.dev = cp, dev

    def raw(self, a: Any) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


class TorchSide(Side):
    def __init__(self, cp: Any, dev: int) -> None:
        super().__init__(cp, dev)
        self.device = torch.device("cuda", dev)

    @contextmanager
    def context(self) -> Iterator[None]:
        with self.cp.cuda.Device(self.dev), _torch_stream_for_cupy(self.cp, self.dev):
            yield

    def raw(self, t: torch.Tensor) -> Any:
        """``t``'s bits as a torch view of the integer dtype of the same width: the
        kernels take pointers and strides, which torch gives without a CuPy view."""
        return t.detach().view(_RAW_TORCH[t.element_size()])

    def rows(self, t: torch.Tensor) -> tuple[Any, int]:
        """``(tensor read, row stride in elements)`` (``row_view``): ``t`` itself where
        its rows collapse into one stride, else a bitwise contiguous copy."""
        rs = collapsible_stride(t.shape, t.stride())
        return (t, rs) if rs is not None else row_view(self.cp, self.raw(t))

    def empty_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (empty_like: quicker than torch.empty with x's shape and dtype)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, out

    def empty_f32(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        return out, out

    def weight_f32(self, w: torch.Tensor, dt: int) -> torch.Tensor:
        return w.detach().to(torch.float32).contiguous()

    def zeros_like(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(weight)


class CupySide(Side):
    @contextmanager
    def context(self) -> Iterator[None]:
        with self.cp.cuda.Device(self.dev):
            yield

    def raw(self, a: Any) -> Any:
        return a.view(self.cp.uint32 if a.itemsize == 4 else self.cp.uint16)

    def rows(self, a: Any) -> tuple[Any, int]:
        """``(array read, row stride in elements)`` (``row_view`` of its bits)."""
        return row_view(self.cp, self.raw(a))

    def empty_rows(self, x: Any) -> tuple[Any, Any]:
        out = self.cp.empty(x.shape, dtype=x.dtype)
        return out, self.raw(out)

    def empty_f32(self, shape: tuple[int, ...]) -> tuple[Any, Any]:
        out = self.cp.empty(shape, dtype=self.cp.float32)
        return out, out

    def weight_f32(self, w: Any, dt: int) -> Any:
        cp = self.cp
        code = _cp_dtype_code(w)
        if code == DT_BF16:  # exact: bf16 bits are the top half of the fp32 bits
            bits = cp.ascontiguousarray(w.view(cp.uint16)).astype(cp.uint32)
            return (bits << 16).view(cp.float32)
        return cp.ascontiguousarray(w.astype(cp.float32, copy=False))

    def zeros_like(self, weight: Any) -> Any:
        return self.cp.zeros_like(weight)


def cupy_stream_of(cp: Any, stream: torch.cuda.Stream, dev: int) -> Any:
    """A CuPy stream object for a torch CUDA stream (the same CUDA stream, not a new one)."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cp.cuda.ExternalStream(stream.cuda_stream, dev)


#: torch's current stream of a device as a raw handle, without building a torch Stream
#: (``torch.cuda.current_stream`` took about half a call's host time); torch's own
#: generated code calls it so. ``None`` where this torch lacks it.
_torch_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: CuPy stream objects for torch's streams, by (device, handle): wrappers that own nothing
_cupy_streams: dict[tuple[int, int], Any] = {}


def _torch_stream_for_cupy(cp: Any, dev: int) -> Any:
    """A CuPy stream object for torch's current stream on ``dev`` (kept per handle)."""
    if _torch_raw_stream is None:  # pragma: no cover - a torch without the raw handle
        return cupy_stream_of(cp, torch.cuda.current_stream(dev), dev)
    handle = _torch_raw_stream(dev)
    stream = _cupy_streams.get((dev, handle))
    if stream is None:
        if len(_cupy_streams) >= 256:
            _cupy_streams.clear()
        from_external = getattr(cp.cuda.Stream, "from_external", None)  # CuPy 14+
        stream = (from_external(_StreamHandle(handle)) if from_external is not None
                  else cp.cuda.ExternalStream(handle, dev))
        _cupy_streams[dev, handle] = stream
    return stream


class _StreamHandle:
    """A raw CUDA stream handle offered through the CUDA stream protocol (what CuPy 14's
    ``Stream.from_external`` takes; its ``ExternalStream`` is deprecated)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def side(kind: str, x: Any) -> TorchSide | CupySide:
    """The side of ``x``'s kind and device (kept: building one per call costs host
    time)."""
    cp = nvrtc.require_cupy()
    dev = x.get_device() if kind == "torch" else x.device.id
    side = _sides.get((kind, dev))
    if side is None or side.cp is not cp:  # (the tests stand in for CuPy)
        side = _sides[kind, dev] = (TorchSide if kind == "torch" else CupySide)(cp, dev)
    return side


_sides: dict[tuple[str, int], TorchSide | CupySide] = {}


def dtype_code(kind: str, x: Any) -> int:
    return TORCH_DT[x.dtype] if kind == "torch" else CUPY_DT[x.dtype.name]


def row_view(cp: Any, a: Any) -> tuple[Any, int]:
    """``(array read, row stride in elements)``; a contiguous (bitwise) copy when the
    rows do not collapse into one stride. ``a`` is a CuPy array or a torch tensor (an
    integer view of the rows' bits, so that the copy is bitwise too)."""
    if isinstance(a, torch.Tensor):
        rs = collapsible_stride(a.shape, a.stride())
        if rs is None:
            a = a.contiguous()
            rs = a.shape[-1]
        return a, rs
    item = a.itemsize
    rs = None
    if all(s % item == 0 for s in a.strides):
        rs = collapsible_stride(a.shape, [s // item for s in a.strides])
    if rs is None:
        a = cp.ascontiguousarray(a)
        rs = a.shape[-1]
    return a, rs


def ptr(a: Any) -> int:
    """The device address of a torch tensor's or a CuPy array's first element."""
    return a.data_ptr() if isinstance(a, torch.Tensor) else int(a.data.ptr)


def numel(x: Any) -> int:
    return int(x.numel()) if isinstance(x, torch.Tensor) else int(x.size)


def collapsible_stride(shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """Row stride (elements) when the leading dims collapse into one (``collapsible_rows``
    of normspec_host.h); ``None`` otherwise. Negative strides are refused (a copy is taken)."""
    hidden = shape[-1]
    if hidden != 1 and strides[-1] != 1:
        return None
    rs: int | None = None
    expect = 0
    for d in range(len(shape) - 2, -1, -1):
        if shape[d] == 1:
            continue
        if strides[d] < 0:
            return None
        if rs is None:
            rs = strides[d]
        elif strides[d] != expect:
            return None
        expect = strides[d] * shape[d]
    return hidden if rs is None else rs
