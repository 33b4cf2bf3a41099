"""Blocked Kronecker factors: a factor wider than ``factor_block`` held as its diagonal blocks (docs/solvers.md,
"Blocked factors").

A side of width d with block size b is cut into k = ⌈d/b⌉ contiguous blocks of balanced sizes: the first d mod k of
size ⌊d/k⌋ + 1, the rest of size ⌊d/k⌋ (no padding: a padded coordinate would be a null direction of its block).
A block-diagonal (d × d) matrix is held *packed*: its blocks' entries, block after block, row-major, as one 1-D
tensor of Σ sᵢ² numbers (:attr:`BlockLayout.packed`); the blocks of one size are one (c, s, s) view of it
(:meth:`BlockLayout.classes`). A side that is not blocked (b None or b ≥ d) keeps its dense (d × d) matrix.

This module forms the blocked statistic Σ a aᵀ restricted to the diagonal blocks from a call's rows — a batched
product of n·Σ sᵢ² multiply-adds instead of n·d² — and packs or unpacks dense matrices (the references, and layer
types whose factors are not formed from rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hylo.layers.rows import FactoredRows

if TYPE_CHECKING:
    from hylo.layers.math import LayerMath


@dataclass(frozen=True)
class BlockClass:
    """The blocks of one size: ``count`` blocks of ``size`` at column ``start`` and packed offset ``offset``."""

    count: int
    size: int
    start: int
    offset: int

    @property
    def width(self) -> int:
        """Columns the class spans (count · size)."""
        return self.count * self.size

    @property
    def numbers(self) -> int:
        """Packed numbers of the class (count · size²)."""
        return self.count * self.size * self.size


@dataclass(frozen=True)
class BlockLayout:
    """How a side of width ``width`` is cut into ``count`` ≥ 2 balanced diagonal blocks."""

    width: int
    count: int

    @functools.cached_property
    def classes(self) -> tuple[BlockClass, ...]:
        """The blocks grouped by size, the larger first (one class where k divides d)."""
        small, extra = divmod(self.width, self.count)
        out, start, offset = [], 0, 0
        for count, size in ((extra, small + 1), (self.count - extra, small)):
            if count:
                out.append(BlockClass(count, size, start, offset))
                start += count * size
                offset += count * size * size
        return tuple(out)

    @property
    def packed(self) -> int:
        """Numbers of a packed block-diagonal matrix: Σ sᵢ²."""
        return sum(c.numbers for c in self.classes)

    @property
    def largest(self) -> int:
        """The largest block's size, ⌈d/k⌉."""
        return self.classes[0].size

    def cubes(self) -> float:
        """Σ sᵢ³ (a decomposition's work per d³ of one dense factor)."""
        return float(sum(c.count * c.size**3 for c in self.classes))

    def sizes(self) -> list[int]:
        """Every block's size, in order."""
        return [c.size for c in self.classes for _ in range(c.count)]


@functools.lru_cache(maxsize=1024)
def block_layout(width: int, block: int | None) -> BlockLayout | None:
    """The layout of a side of ``width`` with maximum block size ``block``; None where it is not blocked (``block``
    None, or ≥ ``width``)."""
    if block is None or block >= width:
        return None
    return BlockLayout(width, -(-width // block))


@functools.lru_cache(maxsize=1024)
def packed_layout(width: int, numbers: int) -> BlockLayout | None:
    """The layout whose packed matrices of a side of ``width`` hold ``numbers`` numbers (Σ sᵢ² decreases strictly
    with the count, so at most one does), or None."""
    for count in range(2, width + 1):
        layout = BlockLayout(width, count)
        if layout.packed == numbers:
            return layout
        if layout.packed < numbers:
            return None
    return None


def layer_blocks(math: LayerMath, block: int | None, split_gate_up: bool) -> tuple[int | None, int | None]:
    """A layer's (A's, G's) maximum block sizes: ``factor_block`` on both sides, and with ``split_gate_up`` G's at
    most one output part's width where the layer concatenates ``math.output_parts`` > 1 maps (docs/moe.md, "Gate
    and up")."""
    if not split_gate_up or math.output_parts == 1:
        return block, block
    part = math.d_g // math.output_parts
    return block, part if block is None else min(block, part)


def side_numbers(width: int, block: int | None) -> int:
    """Numbers of one (d × d) factor of a side as held: d², or Σ sᵢ² blocked."""
    layout = block_layout(width, block)
    return width * width if layout is None else layout.packed


def block_stacks(packed: Tensor, layout: BlockLayout) -> list[Tensor]:
    """Views of a packed matrix (``(..., packed)``) as one (..., c, s, s) stack per block size."""
    lead = packed.shape[:-1]
    return [packed[..., c.offset : c.offset + c.numbers].view(*lead, c.count, c.size, c.size) for c in layout.classes]


def block_list(packed: Tensor, layout: BlockLayout) -> list[Tensor]:
    """Every block of a packed (1-D) matrix as a (s, s) view, in order."""
    return [block for stack in block_stacks(packed, layout) for block in stack.unbind(0)]


def packed_of(blocks: list[Tensor]) -> Tensor:
    """The packed matrix of ``blocks`` (each (s, s) or a (c, s, s) stack), in order: a new tensor."""
    return torch.cat([block.reshape(-1) for block in blocks])


def packed_from_dense(full: Tensor, layout: BlockLayout) -> Tensor:
    """The diagonal blocks of a dense (d × d) matrix, packed (the blocks of the full statistic)."""
    parts = []
    for c in layout.classes:
        region = full[c.start : c.start + c.width, c.start : c.start + c.width]
        diagonal = region.unflatten(0, (c.count, c.size)).unflatten(2, (c.count, c.size)).diagonal(dim1=0, dim2=2)
        parts.append(diagonal.permute(2, 0, 1).reshape(-1))
    return torch.cat(parts)


def dense_of(packed: Tensor, layout: BlockLayout) -> Tensor:
    """The dense (d × d) block-diagonal matrix of a packed one (references and checks)."""
    return torch.block_diag(*block_list(packed, layout))


def row_blocks(rows: Tensor, layout: BlockLayout) -> Tensor:
    """Σ over ``rows`` (n, d) of r rᵀ restricted to the diagonal blocks, packed: one batched product per block size,
    n·Σ sᵢ² multiply-adds."""
    parts = []
    for c in layout.classes:
        part = rows[:, c.start : c.start + c.width].unflatten(1, (c.count, c.size)).transpose(0, 1)  # (c, n, s)
        parts.append(torch.bmm(part.mT, part).reshape(-1))
    return torch.cat(parts)


def blocked_factor(full_or_rows: Tensor, layout: BlockLayout | None, *, rows: bool) -> Tensor:
    """A side's statistic as held: from rows (n, d), Σ r rᵀ dense or blocked; from the dense Σ, itself or its
    diagonal blocks."""
    if rows:
        return full_or_rows.mT @ full_or_rows if layout is None else row_blocks(full_or_rows, layout)
    return full_or_rows if layout is None else packed_from_dense(full_or_rows, layout)


def zero_factor(width: int, block: int | None, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A side's zero statistic as held: (d × d), or packed where ``block`` cuts it."""
    layout = block_layout(width, block)
    shape = (width, width) if layout is None else (layout.packed,)
    return torch.zeros(shape, dtype=dtype, device=device)


def _factors_from_rows(math: LayerMath) -> bool:
    """Whether ``math``'s factors are Σ a aᵀ, Σ g gᵀ of its low-rank rows (a Linear's and its kinds' that keep
    its rows and factors): the blocks are then formed from the rows, never from the dense Σ."""
    from hylo.layers.linear import LinearMath

    kind = type(math)
    return (
        isinstance(math, LinearMath)
        and kind.kfac_factors is LinearMath.kfac_factors
        and kind.lowrank_rows is LinearMath.lowrank_rows
    )


def call_factors(math: LayerMath, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One call's unnormalised factors with ``math.factor_blocks``: a blocked side's diagonal blocks of Σ r rᵀ
    packed, formed from the rows (n·Σ sᵢ²) where the layer's factors are its rows' (:func:`_factors_from_rows`),
    else cut from the layer's dense factor; a side that is not blocked as :meth:`LayerMath.kfac_factors` forms it."""
    layout_a = block_layout(math.d_a, math.factor_blocks[0])
    layout_g = block_layout(math.d_g, math.factor_blocks[1])
    if layout_a is None and layout_g is None:
        return math.kfac_factors(x, grad_out, scale)
    if _factors_from_rows(math):
        rows = math.lowrank_rows(x, grad_out, scale)
        assert isinstance(rows, FactoredRows)
        low = math.factor_dtype or rows.a.dtype  # the products' dtype (docs/solvers.md, "Low-precision statistics")
        return (
            blocked_factor(rows.a.to(low), layout_a, rows=True).to(rows.a.dtype),
            blocked_factor(rows.g.to(low), layout_g, rows=True).to(rows.g.dtype),
        )
    factor_a, factor_g = math.kfac_factors(x, grad_out, scale)
    return blocked_factor(factor_a, layout_a, rows=False), blocked_factor(factor_g, layout_g, rows=False)
