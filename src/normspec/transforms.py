"""Invariance transforms: one small function per transform.

Each transform takes a *row function* ``f`` — a callable from a list of
same-shaped ``(N, H)`` row tensors (e.g. ``[x, gate]``) to a list of
``(N, H)`` row outputs (e.g. ``[y]`` or ``[dx, dgate]``) — and the inputs,
and returns what ``f`` gives for the whole batch when the batch is presented
differently: as singletons, in chunks, padded, permuted, sliced, through
misaligned or non-contiguous views, or again. A row-wise operator that is
*invariant* returns bitwise the same rows as the plain full-batch call.

Transforms that look at a subset of rows return ``(rows, outputs)``: the row
indices they cover and the outputs for those rows, so that the gate compares
``full[rows]`` with ``outputs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

RowFunction = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Result = tuple[torch.Tensor, list[torch.Tensor]]

__all__ = ["TRANSFORMS", "RowFunction", "Transform"]


def _all_rows(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


def _cat(
    parts: list[list[torch.Tensor]], f: RowFunction, inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Concatenate per-part outputs; with no parts, the outputs of an empty call."""
    if not parts:
        return f([t[:0] for t in inputs])
    return [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]


def singletons(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Batch size: every row alone (``N`` calls of one row)."""
    n = inputs[0].shape[0]
    parts = [f([t[i : i + 1] for t in inputs]) for i in range(n)]
    return _all_rows(n, inputs[0].device), _cat(parts, f, inputs)


def chunked(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Chunking: the rows in uneven consecutive chunks (sizes 1, 3, 7, … then the rest)."""
    n = inputs[0].shape[0]
    parts, start, size = [], 0, 1
    while start < n:
        stop = min(n, start + size)
        parts.append(f([t[start:stop] for t in inputs]))
        start, size = stop, size * 2 + 1
    return _all_rows(n, inputs[0].device), _cat(parts, f, inputs)


def padded_rows(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Padding: extra random rows appended to the batch (like a padded decode batch)."""
    n, extra = inputs[0].shape[0], 5
    padded = []
    for t in inputs:
        pad = torch.randn(extra, t.shape[1], generator=gen, dtype=torch.float32)
        padded.append(torch.cat([t, pad.to(device=t.device, dtype=t.dtype)]))
    return _all_rows(n, inputs[0].device), [o[:n] for o in f(padded)]


def extended_sequence(
    f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator
) -> Result:
    """Padding along the sequence: rows seen as ``(1, S, H)`` with the sequence extended."""
    n, extra = inputs[0].shape[0], 3

    def f3(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [o.reshape(-1, o.shape[-1]) for o in f([t.reshape(1, -1, t.shape[-1]) for t in ts])]

    ext = []
    for t in inputs:
        pad = torch.randn(extra, t.shape[1], generator=gen).to(device=t.device, dtype=t.dtype)
        ext.append(torch.cat([t, pad]))
    return _all_rows(n, inputs[0].device), [o[:n] for o in f3(ext)]


def permuted(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Permutation: rows in a random order, results put back in place."""
    n = inputs[0].shape[0]
    perm = torch.randperm(n, generator=gen).to(inputs[0].device)
    outs = f([t[perm].contiguous() for t in inputs])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n, device=perm.device)
    return _all_rows(n, perm.device), [o[inverse] for o in outs]


def prefix_slice(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Prefix slice: the first ``ceil(N/2)`` rows as a view of the batch."""
    k = (inputs[0].shape[0] + 1) // 2
    return _all_rows(k, inputs[0].device), f([t[:k] for t in inputs])


def inner_slice(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Non-prefix slice: rows ``[N//3, 2N//3 + 1)`` as a view (nonzero storage offset)."""
    n = inputs[0].shape[0]
    a, b = n // 3, min(n, 2 * n // 3 + 1)
    return torch.arange(a, b, device=inputs[0].device), f([t[a:b] for t in inputs])


def misaligned(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Misaligned views: each tensor copied to storage offset 1 (rows not 16-byte aligned)."""
    views = []
    for t in inputs:
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        views.append(view)
    return _all_rows(inputs[0].shape[0], inputs[0].device), f(views)


def strided_rows(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Non-contiguous rows: a row stride larger than ``H`` (a column slice of a wider tensor)."""
    views = []
    for t in inputs:
        wide = torch.empty(t.shape[0], t.shape[1] + 7, dtype=t.dtype, device=t.device)
        wide[:, 3 : 3 + t.shape[1]] = t
        views.append(wide[:, 3 : 3 + t.shape[1]])
    return _all_rows(inputs[0].shape[0], inputs[0].device), f(views)


def column_major(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Non-contiguous elements: a transposed layout (inner stride ``N``)."""
    views = [t.t().contiguous().t() for t in inputs]
    return _all_rows(inputs[0].shape[0], inputs[0].device), f(views)


def repeated(f: RowFunction, inputs: list[torch.Tensor], gen: torch.Generator) -> Result:
    """Repeated calls: the same call made again."""
    f(inputs)
    return _all_rows(inputs[0].shape[0], inputs[0].device), f(inputs)


@dataclass(frozen=True)
class Transform:
    """A named invariance transform."""

    name: str
    apply: Callable[[RowFunction, list[torch.Tensor], torch.Generator], Result]

    @property
    def description(self) -> str:
        return (self.apply.__doc__ or "").strip().splitlines()[0]


#: Every invariance transform, in report order.
TRANSFORMS: Sequence[Transform] = tuple(
    Transform(name, fn)
    for name, fn in (
        ("batch", singletons),
        ("chunk", chunked),
        ("pad_rows", padded_rows),
        ("pad_sequence", extended_sequence),
        ("permute", permuted),
        ("prefix_slice", prefix_slice),
        ("inner_slice", inner_slice),
        ("misaligned", misaligned),
        ("strided", strided_rows),
        ("column_major", column_major),
        ("repeat", repeated),
    )
)
