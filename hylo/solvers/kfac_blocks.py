"""The K-FAC family's blocked factors: shapes, layouts, costs and the assembly of a side solved block by block
(docs/solvers.md, "Blocked factors")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hylo.layers.blocks import BlockLayout, block_layout, packed_layout
from hylo.solvers.base import UpdateJob
from hylo.solvers.blockdiag import joined, layout_for

if TYPE_CHECKING:
    from hylo.solvers.kfac import KFACFactors


def square_shape(width: int, block: int | None) -> tuple[int, ...]:
    """The shape of a side's (d × d) matrix as held: dense, or packed blocks (docs/solvers.md, "Blocked factors")."""
    layout = block_layout(width, block)
    return (width, width) if layout is None else (layout.packed,)


#: The (d × d) matrices of each side a K-FAC state may hold (dense or packed alike).
SQUARE = {"a": ("factor_a", "evecs_a", "inverse_a"), "g": ("factor_g", "evecs_g", "inverse_g")}


def held_shapes(
    tensors: object, d_a: int, d_g: int, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """``shapes`` (dense) with a side's matrices packed where the saved running factor of that side is packed in a
    layout of its width (the block size itself is checked by the load: ``factor_block`` must match)."""
    out = dict(shapes)
    for side, width in (("a", d_a), ("g", d_g)):
        factor = tensors.get(f"factor_{side}") if isinstance(tensors, Mapping) else None
        layout = packed_layout(width, factor.numel()) if isinstance(factor, Tensor) and factor.dim() == 1 else None
        if layout is not None:
            out.update({key: (layout.packed,) for key in SQUARE[side] if key in out})
    return out


def state_layouts(evecs_g: Tensor, evecs_a: Tensor, d_g: int, d_a: int, batched: bool = False) -> tuple[Any, Any]:
    """(G's, A's) block layouts of a state's (or a group's) bases: None for a dense side."""
    return layout_for(evecs_g, d_g, batched), layout_for(evecs_a, d_a, batched)


def cubes(width: int, block: int | None) -> float:
    """Σ sᵢ³ of a side's blocks (d³ whole)."""
    layout = block_layout(width, block)
    return float(width) ** 3 if layout is None else layout.cubes()


def block_width(width: int, block: int | None) -> int:
    """The widest block of a side (d whole): what a product with its matrix costs per row."""
    layout = block_layout(width, block)
    return width if layout is None else layout.largest


def side_width(factor: Tensor, layout: BlockLayout | None) -> int:
    """A side's width from its factor and layout."""
    return factor.shape[0] if layout is None else layout.width


def factor_layouts(job: UpdateJob) -> tuple[BlockLayout | None, BlockLayout | None]:
    """A job's (A's, G's) block layouts: its layer's ``factor_blocks``."""
    math = job.batch.math
    return block_layout(math.d_a, math.factor_blocks[0]), block_layout(math.d_g, math.factor_blocks[1])


def decomposed(
    units: Sequence[Tensor], layout: BlockLayout | None, results: Sequence[tuple[Tensor, Tensor]]
) -> tuple[Tensor, Tensor]:
    """A side's (eigenvalues, eigenbasis) from its blocks' results (one result: the dense side's own)."""
    if len(units) == 1 and layout is None:
        return results[0]
    return torch.cat([r[0] for r in results]), joined([r[1] for r in results], layout)


def factors_of(prepared: KFACFactors) -> tuple[Tensor, Tensor]:
    """(A, G) of a layer's prepared factors."""
    return prepared.factor_a, prepared.factor_g


def inverse_layouts(prepared: Sequence[KFACFactors], inverse: Sequence[int]) -> list[BlockLayout | None]:
    """The layouts of the inverse-method layers' sides, A's then G's of each."""
    return [layout for i in inverse for layout in prepared[i].layouts]
