"""What the preconditioner holds for each registered layer: its math, hooks, solver, state and owner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hylo.config import HyLoConfig
from hylo.layers.blocks import layer_blocks
from hylo.layers.capture import LayerCapture
from hylo.layers.math import FACTOR_DTYPES, LayerMath
from hylo.layers.walk import Registration
from hylo.policy import check_kfac_budget, kfac_refusal
from hylo.records import LayerInfo
from hylo.solvers import HeldState

#: ``owner`` of a layer whose carried statistics no rank has solved yet (recomputed at the next update).
UNSOLVED = -1


@dataclass
class RegisteredLayer:
    """One preconditioned layer: its math, its hooks, its solver and what it holds.

    ``solver`` is the configured solver until the first update, then the one the latest
    update used; ``owner`` is the rank that solved ``state`` (the one place it is kept).
    """

    name: str
    math: LayerMath
    capture: LayerCapture
    solver: str
    state: HeldState | None = None
    owner: int = 0
    #: (rows kept, rows) over all ranks at the layer's latest low-rank update (None: none yet): what the cost
    #: model expects it to keep under ``rank_ratio="auto"`` (:meth:`~hylo.solvers.lowrank.LowRankConfig.expected_rows`).
    kept: tuple[int, int] | None = None
    #: Capture steps at which its module ran and routed it no row: an idle expert (docs/moe.md, "Idle experts").
    idle: int = 0

    def info(self, config: HyLoConfig) -> LayerInfo:
        """The layer's registration as :meth:`hylo.HyLoPreconditioner.layer_info` reports it, with why ``config`` keeps
        it from K-FAC, if it does (:func:`hylo.views.layer_infos` adds its state and the policy's facts)."""
        math = self.math
        why = kfac_refusal(math.d_a, math.d_g, math.dtype.itemsize, config)
        notes = [] if why is None else [f"never K-FAC: {why}"]
        if self.idle:
            notes.append(f"idle at {self.idle} capture steps: no token routed to it")
        note = "; ".join(notes)
        return LayerInfo(
            self.name,
            math.module_type,
            math.d_a,
            math.d_g,
            math.bias is not None,
            self.solver,
            self.owner,
            note,
            self.kept,
            math=math,
        )

    def shape(self) -> tuple[str, str, int, int, torch.dtype]:
        """(name, module type, d_a, d_g, working dtype): what the K-FAC memory budget reads."""
        return self.name, self.math.module_type, self.math.d_a, self.math.d_g, self.math.dtype


def registered_layers(found: Registration, config: HyLoConfig) -> list[RegisteredLayer]:
    """The layers ``register_layers`` found, each with its initial solver; ``ValueError`` from
    :func:`~hylo.policy.check_kfac_budget` if one configured for K-FAC is over ``kfac_max_state_mb``, and
    then every hook ``found`` placed is removed (the model is left as it was)."""
    layers = [RegisteredLayer(f.name, f.math, f.capture, config.initial_solver(f.name)) for f in found.layers]
    for layer in layers:  # the statistic forms blocked factors (docs/solvers.md, "Blocked factors")
        layer.math.factor_blocks = layer_blocks(layer.math, config.kfac.factor_block, config.kfac.split_gate_up)
        layer.math.factor_dtype = FACTOR_DTYPES.get(config.kfac.factor_dtype or "")  # the statistics' products
    try:
        check_kfac_budget([layer.shape() for layer in layers], config)
    except ValueError:
        found.remove()
        raise
    return layers


def layer_parameters(layers: Sequence[RegisteredLayer]) -> list[nn.Parameter]:
    """The parameters holding the layers' weights and biases, each once, in layer order: a weight that is a view
    (MultiheadAttention's projections slice ``in_proj_weight``; a transposed weight) counts as its base."""
    found: dict[int, nn.Parameter] = {}
    for layer in layers:
        for tensor in (layer.math.weight, layer.math.bias):
            if tensor is None:
                continue
            base = tensor if isinstance(tensor, nn.Parameter) else tensor._base
            if not isinstance(base, nn.Parameter):
                raise ValueError(f"layer {layer.name!r}: its weight or bias is not (a view of) a parameter")
            found.setdefault(id(base), base)
    return list(found.values())
