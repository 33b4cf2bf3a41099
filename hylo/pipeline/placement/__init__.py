"""Where a step's apply runs: chosen once at construction from the layout and the strategy, both fixed
(docs/design.md, "Placements").

A placement preconditions the ready layers' gradients, checks every result and scales them by ``kl_clip``, and
makes every other decision that depends on the distribution (:class:`Placement`); the preconditioner and the
pipeline call it without knowing which one it holds:

- :class:`Local`: every rank holds every state and whole gradients (one process, or DDP with
  ``strategy="inverse"``): the grouped step (:mod:`hylo.pipeline.apply`), or layer by layer with
  ``grouped=False``, the reference;
- :class:`Owners`: ``strategy="gradient"`` with P > 1: the owners apply and check their layers per group, and one
  all-gather per dtype shares the results and their checks (:mod:`hylo.pipeline.placement.owners`);
- :class:`Sharded`: FSDP2, each rank holding rows of every ∇W: the partial products exchanged in one fused
  all-reduce and one all-gather, the check's sums in one all-reduce (:mod:`hylo.pipeline.placement.sharded`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hylo.config import HyLoConfig
from hylo.pipeline.placement.base import Applied, Placement, Ready
from hylo.pipeline.placement.local import Local
from hylo.pipeline.placement.owners import Owners
from hylo.pipeline.placement.sharded import Sharded, fsdp2_sharded
from hylo.pipeline.stage import UpdateStage
from hylo.state import RegisteredLayer

__all__ = ["Applied", "Local", "Owners", "Placement", "Ready", "Sharded", "placement_for"]


def placement_for(stage: UpdateStage, layers: Sequence[RegisteredLayer], config: HyLoConfig) -> Placement:
    """The placement of a preconditioner of ``layers`` (sharded by FSDP2 or not: ``ValueError`` naming what hylo
    does not support, before any step; docs/distributed.md, "FSDP2") with ``config``'s strategy, both fixed at
    construction. The only place that asks which distribution is in force."""
    if fsdp2_sharded(layers, config, stage.comm):
        return Sharded(stage)
    if config.distributed.strategy == "gradient" and stage.comm.world_size > 1:
        return Owners(stage)
    return Local(stage)
