"""Row blocks: the spec's operators work on a bounded number of rows at a time.

Rows are independent except through the dweight row tree, so the forward and the row
gradients are computed block by block with the same bits. The row tree is split where
it splits by itself: blocks of ``B`` rows, ``B`` a power of two that divides the padded
row count ``P``, each block's ``B`` contributions summed by the tree (the last block
zero-padded to ``B`` rows), then the block sums by the tree over ``P / B``: the same
additions in the same order as one tree over ``P`` rows.

The fp32 temporaries of a block hold at most
[`BLOCK_ELEMENTS`][normspec.spec.blocks.BLOCK_ELEMENTS] elements each, so the memory an
operator needs beyond its inputs and outputs is a fixed number of such blocks (plus one
copy of an input whose rows cannot be viewed as a ``(rows, H)`` matrix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .arithmetic import next_power_of_two, tree_sum

__all__ = ["BLOCK_ELEMENTS", "block_rows", "by_row_blocks"]

#: Elements of one block's ``(rows, H)`` temporaries: 4 MiB in fp32.
BLOCK_ELEMENTS = 1 << 20


def block_rows(rows: int, hidden: int, elements: int | None = None) -> int:
    """Rows per block: a power of two, at most ``elements // hidden`` (at least 1;
    ``elements`` defaults to [`BLOCK_ELEMENTS`][normspec.spec.blocks.BLOCK_ELEMENTS]) and
    at most the padded row count."""
    elements = BLOCK_ELEMENTS if elements is None else elements
    limit = max(1, elements // max(1, hidden))
    return min(1 << (limit.bit_length() - 1), next_power_of_two(rows))


def by_row_blocks(
    fn: Callable[..., tuple[torch.Tensor, ...]], rows: Sequence[torch.Tensor], *,
    row_tree: bool = False, elements: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """``fn`` over blocks of the ``(..., H)`` tensors ``rows`` (same shapes), its row
    outputs put together in the shape of ``rows[0]``.

    With ``row_tree``, ``fn``'s last output is the block's per-row fp32 contributions,
    and the last result is their row tree over all rows (``(H,)``, fp32).
    """
    shape = rows[0].shape
    hidden = shape[-1]
    flat = [t.reshape(-1, hidden) for t in rows]
    total = flat[0].shape[0]
    step = block_rows(total, hidden, elements)
    if total <= step:  # one block: no copies
        outs = fn(*flat)
        row_outs = outs[:-1] if row_tree else outs
        shaped = tuple(o.reshape(shape) for o in row_outs)
        return (*shaped, tree_sum(outs[-1], dim=0)) if row_tree else shaped
    results: list[torch.Tensor] = []
    partials: list[torch.Tensor] = []
    for start in range(0, total, step):
        outs = fn(*(t[start:start + step] for t in flat))
        row_outs = outs[:-1] if row_tree else outs
        if not results:
            results = [o.new_empty((total, hidden)) for o in row_outs]
        for result, out in zip(results, row_outs, strict=True):
            result[start:start + step] = out
        if row_tree:
            contributions = outs[-1]
            if contributions.shape[0] < step:  # the last block, zero-padded to the block
                pad = contributions.new_zeros(step - contributions.shape[0], hidden)
                contributions = torch.cat([contributions, pad])
            partials.append(tree_sum(contributions, dim=0))
    shaped = tuple(r.reshape(shape) for r in results)
    if row_tree:
        return (*shaped, tree_sum(torch.stack(partials), dim=0))
    return shaped
