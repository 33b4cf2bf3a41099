"""Products with a side's matrix held dense or as packed diagonal blocks (docs/solvers.md, "Blocked factors").

A K-FAC side (A's or G's) whose factor is blocked (:mod:`hylo.layers.blocks`) holds its factor, eigenbasis or inverse
packed: a 1-D tensor (one layer) or a (B, Σ sᵢ²) stack (a group of B layers), where a dense side holds (d, d) or
(B, d, d). Every function here takes either and does the dense product for a dense side, so one code path serves
both; for a blocked side the product is one batched matmul per block size on the matching columns: X·Q costs
n·d·s instead of n·d².
"""

from __future__ import annotations

import torch
from torch import Tensor

from hylo.layers.blocks import BlockLayout, block_list, block_stacks, packed_layout, packed_of


def layout_for(matrix: Tensor, width: int, batched: bool = False) -> BlockLayout | None:
    """The blocks of a side of ``width`` that ``matrix`` holds packed (one dimension fewer than a dense one), or
    None for a dense matrix."""
    if matrix.dim() != (2 if batched else 1):
        return None
    layout = packed_layout(width, matrix.shape[-1])
    if layout is None:
        raise ValueError(f"a packed matrix of {matrix.shape[-1]} numbers fits no blocks of a side of {width}")
    return layout


def times(x: Tensor, matrix: Tensor, layout: BlockLayout | None, transpose: bool = False) -> Tensor:
    """x·Q (x·Qᵀ with ``transpose``) for x (..., n, d) and Q dense (..., d, d) or packed (..., Σ sᵢ²)."""
    if layout is None:
        return x @ (matrix.mT if transpose else matrix)
    parts = []
    for c, stack in zip(layout.classes, block_stacks(matrix, layout), strict=True):
        cols = x[..., c.start : c.start + c.width].unflatten(-1, (c.count, c.size)).transpose(-2, -3)
        product = cols @ (stack.mT if transpose else stack)  # (..., c, n, s)
        parts.append(product.transpose(-2, -3).flatten(-2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def left(matrix: Tensor, x: Tensor, layout: BlockLayout | None, transpose: bool = False) -> Tensor:
    """Q·x (Qᵀ·x with ``transpose``) for x (..., d, m)."""
    if layout is None:
        return (matrix.mT if transpose else matrix) @ x
    return times(x.mT, matrix, layout, not transpose).mT


def rotated_in(grad: Tensor, evecs_g: Tensor, evecs_a: Tensor, widths: tuple[BlockLayout | None, ...]) -> Tensor:
    """Q_gᵀ ∇W Q_a (``widths``: the layouts of G's and A's side)."""
    layout_g, layout_a = widths
    return left(evecs_g, times(grad, evecs_a, layout_a), layout_g, transpose=True)


def rotated_out(inner: Tensor, evecs_g: Tensor, evecs_a: Tensor, widths: tuple[BlockLayout | None, ...]) -> Tensor:
    """Q_g X Q_aᵀ."""
    layout_g, layout_a = widths
    return left(evecs_g, times(inner, evecs_a, layout_a, transpose=True), layout_g)


def product(first: Tensor, second: Tensor, layout: BlockLayout | None, transpose: bool = False) -> Tensor:
    """first·second (firstᵀ·second with ``transpose``) of two matrices of one side in one form (block by block)."""
    if layout is None:
        return (first.mT if transpose else first) @ second
    stacks = zip(block_stacks(first, layout), block_stacks(second, layout), strict=True)
    return packed_of([(f.mT if transpose else f) @ s for f, s in stacks])


def blocks(matrix: Tensor, layout: BlockLayout | None) -> list[Tensor]:
    """The (s, s) blocks of a packed matrix, or the dense matrix alone."""
    return [matrix] if layout is None else block_list(matrix, layout)


def joined(parts: list[Tensor], layout: BlockLayout | None) -> Tensor:
    """The matrix of :func:`blocks`' parts (solved block by block), in the side's form."""
    return parts[0] if layout is None else packed_of(parts)


def diagonal(matrix: Tensor, layout: BlockLayout | None) -> Tensor:
    """The diagonal (d numbers) of a dense or packed matrix."""
    return torch.cat([torch.diagonal(block) for block in blocks(matrix, layout)])


def identity(like: Tensor, width: int, layout: BlockLayout | None) -> Tensor:
    """The identity of a side of ``width`` in the form of ``like`` (its dtype and device)."""
    if layout is None:
        return torch.eye(width, dtype=like.dtype, device=like.device)
    return packed_of([torch.eye(s, dtype=like.dtype, device=like.device) for s in layout.sizes()])


def shifted(matrix: Tensor, layout: BlockLayout | None, shift: Tensor) -> Tensor:
    """matrix + shift·I (a new tensor)."""
    out = matrix.clone()
    for block in blocks(out, layout):
        block.diagonal().add_(shift.to(matrix.dtype))
    return out


def column_argmax(weights: Tensor, layout: BlockLayout | None) -> Tensor:
    """For each column j, the row i of the largest entry (within column j's block for a packed matrix): d indices."""
    if layout is None:
        return weights.argmax(dim=0)
    out = []
    for c, stack in zip(layout.classes, block_stacks(weights, layout), strict=True):
        starts = c.start + c.size * torch.arange(c.count, device=weights.device).unsqueeze(1)
        out.append((stack.argmax(dim=-2) + starts).flatten())
    return torch.cat(out)
