"""Parameters sharded by FSDP2's ``fully_shard``: which rows of ∇W a rank holds (docs/distributed.md, "FSDP2").

``fully_shard`` turns every parameter into a DTensor sharded on dim 0 over a 1-D device mesh,
torch.chunk-style: with n rows and P ranks, rank p holds rows [p·c, min((p + 1)·c, n)) with
c = ⌈n/P⌉ (empty on the last ranks when n < P·c). A Linear's or Conv2d's weight has ∇W's rows
on dim 0 and its bias is sharded the same way, so a rank's weight and bias shards are the rows
``start:stop`` of ∇W = [weight | bias] (:class:`~hylo.layers.gradmatrix.RowShard`).

:func:`local` reads a parameter or gradient as this rank's tensor (the identity on a plain
tensor); :func:`unsupported_layout` says why a layer's layout cannot be preconditioned by rows.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor

from hylo.layers.gradmatrix import RowShard

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


def row_shard(param: Tensor, rows: int) -> RowShard | None:
    """The rows of a ``rows``-row matrix this rank holds when ``param`` is sharded on dim 0, else None."""
    if not is_sharded(param):
        return None
    mesh: Any = param.device_mesh  # type: ignore[attr-defined]
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_coordinate()[0] * chunk, rows)
    return RowShard(start, min(start + chunk, rows), rows)


def unsupported_layout(weight: Tensor, bias: Tensor | None, d_g: int, own_grads: bool) -> str | None:
    """Why a layer whose ``weight`` or ``bias`` is a DTensor cannot be preconditioned by rows (None: it can).

    ``own_grads``: the layer's math reads ∇W from the weight's and bias's own ``.grad`` as a Linear's
    (the :class:`~hylo.layers.math.LayerMath` defaults), so that W's rows are the weight's dim 0.
    """
    if not is_sharded(weight):
        return "its bias is a DTensor but its weight is not"
    mesh: Any = weight.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1:
        return f"its weight is on a {mesh.ndim}-D device mesh (HSDP or FSDP with tensor parallel); only 1-D meshes"
    placements = tuple(weight.placements)  # type: ignore[attr-defined]
    if placements != (Shard(0),):
        return f"its weight is placed {placements} (tensor parallel?); only fully_shard's (Shard(dim=0),)"
    if bias is not None and (
        not is_sharded(bias)
        or bias.device_mesh != mesh  # type: ignore[attr-defined]
        or tuple(bias.placements) != (Shard(0),)  # type: ignore[attr-defined]
    ):
        return "its bias is not sharded like its weight (Shard(dim=0) on the same mesh)"
    if not own_grads or int(weight.shape[0]) != d_g:
        return "its ∇W's rows are not its weight's dim 0 (hylo shards Linear-like and Conv2d layers by rows)"
    return None
