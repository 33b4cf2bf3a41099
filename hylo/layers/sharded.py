"""Parameters sharded by FSDP2's ``fully_shard``: which rows of ∇W a rank holds (docs/distributed.md, "FSDP2").

``fully_shard`` turns every parameter into a DTensor sharded on dim 0 over a 1-D device mesh,
torch.chunk-style: with n rows and P ranks, rank p holds rows [p·c, min((p + 1)·c, n)) with
c = ⌈n/P⌉ (empty on the last ranks when n < P·c). A Linear's or Conv2d's weight has ∇W's rows
on dim 0 and its bias is sharded the same way, so a rank's weight and bias shards are the rows
``start:stop`` of ∇W = [weight | bias] (:class:`~hylo.layers.gradmatrix.GradShard`); an embedding's
weight is ∇Wᵀ, so its shards are columns of ∇W, and an attention's packed ``in_proj_weight`` holds
q, k and v as row blocks, so a shard is a (possibly empty) block of rows of each.

:func:`local` reads a parameter or gradient as this rank's tensor (the identity on a plain
tensor); :func:`unsupported_layout` says why a layer's layout cannot be preconditioned by rows or columns.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor

from hylo.layers.gradmatrix import GradShard

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without torch.distributed: nothing can be sharded
    DTensor = None  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment,misc]


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter or gradient of a ``fully_shard``-ed module)."""
    return DTensor is not None and isinstance(tensor, DTensor)


@overload
def local(tensor: Tensor) -> Tensor: ...
@overload
def local(tensor: None) -> None: ...
@overload
def local(tensor: Tensor | None) -> Tensor | None: ...
def local(tensor: Tensor | None) -> Tensor | None:
    """This rank's part of a DTensor (the same tensor object at every call: written in place), else ``tensor``."""
    if DTensor is not None and isinstance(tensor, DTensor):
        with torch.no_grad():  # outside autograd, to_local returns the DTensor's own local tensor
            return tensor.to_local()
    return tensor


def dim0_chunk(param: Tensor) -> tuple[int, int] | None:
    """The indices ``start:stop`` of ``param``'s dim 0 this rank holds when it is sharded on dim 0, else None."""
    if not is_sharded(param):
        return None
    mesh: Any = param.device_mesh  # type: ignore[attr-defined]
    total = int(param.shape[0])
    chunk = -(-total // mesh.size())
    start = min(mesh.get_coordinate()[0] * chunk, total)
    return start, min(start + chunk, total)


def grad_shard(param: Tensor, axis: int = 0) -> GradShard | None:
    """The part of ∇W this rank holds when ``param``'s dim 0 is ∇W's rows (``axis`` 0) or columns (``axis`` 1)."""
    held = dim0_chunk(param)
    return None if held is None else GradShard(*held, int(param.shape[0]), axis)


def placement_problem(param: Tensor, what: str = "its weight") -> str | None:
    """Why ``param`` (a DTensor) is not placed as ``fully_shard`` places it (dim 0 over a 1-D mesh), or None."""
    mesh: Any = param.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1:
        return f"{what} is on a {mesh.ndim}-D device mesh (HSDP or FSDP with tensor parallel); only 1-D meshes"
    placements = tuple(param.placements)  # type: ignore[attr-defined]
    if placements != (Shard(0),):
        return f"{what} is placed {placements} (tensor parallel?); only fully_shard's (Shard(dim=0),)"
    return None


def unsupported_layout(weight: Tensor, bias: Tensor | None, d_g: int, own_grads: bool) -> str | None:
    """Why a layer whose ``weight`` or ``bias`` is a DTensor cannot be preconditioned by rows (None: it can).

    ``own_grads``: the layer's math reads ∇W from the weight's and bias's own ``.grad`` as a Linear's
    (the :class:`~hylo.layers.math.LayerMath` defaults), so that W's rows are the weight's dim 0.
    """
    if not is_sharded(weight):
        return "its bias is a DTensor but its weight is not"
    if (problem := placement_problem(weight)) is not None:
        return problem
    if bias is not None and (
        not is_sharded(bias)
        or bias.device_mesh != weight.device_mesh  # type: ignore[attr-defined]
        or tuple(bias.placements) != (Shard(0),)  # type: ignore[attr-defined]
    ):
        return "its bias is not sharded like its weight (Shard(dim=0) on the same mesh)"
    if not own_grads or int(weight.shape[0]) != d_g:
        return (
            "its layer type does not say which rows or columns of ∇W its weight's dim-0 shards are (hylo knows "
            "Linear-like, Conv2d, nn.Embedding and nn.MultiheadAttention's packed projections)"
        )
    return None
