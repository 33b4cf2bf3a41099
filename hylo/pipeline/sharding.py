"""Models sharded by FSDP2's ``fully_shard``: what a step does with row-sharded gradients (docs/distributed.md, "FSDP2").

Only the parameters are sharded: the captured inputs and output gradients are whole on every
rank, so factors and rows are exchanged as under DDP and every rank holds every layer's state
(``strategy="inverse"``). Each rank holds rows ``start:stop`` of every ∇W (an embedding's: columns),
already averaged over ranks by FSDP's reduce-scatter, and writes back only those. What a step reduces over a
gradient is made global here, with one collective each and only on this path:

- :func:`check`: at construction, the layouts and options this supports, or a ``ValueError``;
- :func:`global_norms`: the per-layer norms from the ranks' squared partial norms (one all-reduce);
- :func:`global_safe_norms`: the same without overflow (one all-reduce by max, one by sum).

The apply, its exchange and the agreement on each result's check are the ``Sharded`` placement's
(:mod:`hylo.pipeline.placement.sharded`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.distributed import Communicator
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.sharded import is_sharded, local
from hylo.payload import CONTROL, Payload
from hylo.state import RegisteredLayer


def check(layers: Sequence[RegisteredLayer], config: HyLoConfig, comm: Communicator) -> bool:
    """Whether the registered layers are sharded by ``fully_shard``; ``ValueError`` naming what is not supported.

    Every registered layer's weight must be sharded on dim 0 over a 1-D mesh of this communicator's
    ranks, in a layout its layer type maps to rows or columns of ∇W (no HSDP, no tensor parallel, no
    mix with unsharded layers), with ``strategy="inverse"``
    and no studies. Every rank raises alike (the layout is the same on every rank; the mesh's rank
    order is agreed in one collective).
    """
    sharded = [layer for layer in layers if is_sharded(layer.math.weight) or is_sharded(layer.math.bias)]
    if not sharded:
        return False
    problems: dict[str, list[str]] = {}
    for layer in sharded:
        if (problem := layer.math.sharding_problem()) is not None:
            problems.setdefault(problem, []).append(layer.name)
    if problems:
        listed = "; ".join(f"layers {names[:4]}: {problem}" for problem, names in problems.items())
        raise ValueError(
            f"FSDP2: hylo cannot precondition these sharded layers ({listed}); shard them with fully_shard on a "
            "1-D mesh, or leave them out with skip_layers"
        )
    plain = [layer.name for layer in layers if layer not in sharded]
    if plain:
        raise ValueError(
            f"FSDP2: layers {plain[:4]} are not sharded while {[layer.name for layer in sharded][:4]} are; hylo "
            "needs every registered layer sharded by fully_shard (shard the root module too) or none"
        )
    if config.distributed.strategy != "inverse":
        raise ValueError(
            f'FSDP2: strategy={config.distributed.strategy!r} is not supported on sharded models: use "inverse" '
            "(every rank holds every layer's state and preconditions its own rows)"
        )
    if config.telemetry.studies:
        raise ValueError(
            f"FSDP2: the studies {config.telemetry.studies} need whole gradients and are not supported on "
            "sharded models; run them without fully_shard (e.g. under DDP)"
        )
    mesh = sharded[0].math.weight.device_mesh  # type: ignore[attr-defined]
    here = int(mesh.get_coordinate()[0])
    device = local(sharded[0].math.weight).device
    same = comm.all_true(torch.tensor([mesh.size() == comm.world_size and here == comm.rank], device=device))
    if not bool(same.all()):
        raise ValueError(
            f"FSDP2: the parameters' device mesh ({mesh.size()} ranks, this rank at {here}) is not the "
            f"preconditioner's communicator ({comm.world_size} ranks, this rank {comm.rank}) in the same order on "
            "every rank; pass communicator=hylo.distributed.TorchCommunicator(group=the mesh's group)"
        )
    return True


def global_norms(comm: Communicator, norms: Tensor) -> Tensor:
    """Per-layer ‖∇W‖ from each rank's norms of its rows (float64): √(Σ_p ‖∇W_p‖²), one all-reduce."""
    key = (CONTROL, "norms")
    return comm.all_reduce(Payload({key: norms.square()}), "sum").wait()[key].sqrt()


def global_safe_norms(comm: Communicator, grads: Sequence[GradMatrix | None], device: torch.device) -> Tensor:
    """Per-layer ‖∇W‖ (float64, 0 where absent) that cannot overflow: the largest entry m over every rank's
    rows (an all-reduce by max), then m·√(Σ_p ‖∇W_p/m‖²) (an all-reduce by sum)."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    parts = [None if g is None or g.weight.numel() == 0 else g.full().to(torch.float64) for g in grads]
    key = (CONTROL, "norms")
    largest = torch.stack([zero if g is None else torch.linalg.vector_norm(g, ord=float("inf")) for g in parts])
    largest = comm.all_reduce(Payload({key: largest}), "max").wait()[key]
    tiny = torch.finfo(torch.float64).tiny
    squares = torch.stack(
        [zero if g is None else (g / largest[i].clamp_min(tiny)).square().sum() for i, g in enumerate(parts)]
    )
    scaled = comm.all_reduce(Payload({key: squares}), "sum").wait()[key].sqrt()
    return torch.where(torch.isfinite(largest), scaled * largest, largest)
