"""A step that changes nothing: the warning, once, when every layer's preconditioned gradient is its raw gradient.

docs/reliability.md, "A step that changes nothing": when the damping λ dominates every layer's curvature,
(F̃ + λI)⁻¹∇W is ∇W/λ, which an optimizer that sets the step's length itself (Adam's per-coordinate scaling, or
``kl_clip``'s bound) turns back into its plain step: hylo then costs its time and changes nothing. At each
update (until it has warned once) the preconditioner measures every written layer's ‖V̂ − c∇W‖ against ‖c∇W‖
for the best scale c = ⟨V̂, ∇W⟩ / ‖∇W‖² of each layer, in float32: one ``torch._foreach_sub`` and two
``torch._foreach_norm`` per dtype over the weight and bias parts, and one host read.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import Tensor

from hylo.layers.gradmatrix import GradMatrix

#: A layer's step counts as its raw gradient (up to scale) when its direction differs by less than this share.
UNCHANGED = 0.01


class EffectWatch:
    """Warns once when an update's preconditioned gradients all point where their raw gradients do."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, step: int, written: Mapping[str, Tensor], grads: Mapping[str, GradMatrix], damping: float) -> None:
        """Compare the results of an update step (``written``, not yet written back) with the gradients they
        replace (``grads``); warn if no layer's direction changed by more than :data:`UNCHANGED`."""
        if self.warned or not written:
            return
        results: list[Tensor] = []
        raws: list[Tensor] = []
        layer_of: list[int] = []
        for index, (name, result) in enumerate(written.items()):
            parts = grads[name]
            if tuple(result.shape) != parts.shape:  # a shard, or a type writing its own way: not compared
                return
            d_w = parts.weight.shape[1]
            pieces = [(result[:, :d_w], parts.weight)]
            if parts.bias is not None:
                pieces.append((result[:, d_w], parts.bias))
            for mine, raw in pieces:
                results.append(mine)
                raws.append(raw.to(mine.dtype))
                layer_of.append(index)
        if bool(unchanged(results, raws, layer_of, len(written)).all()):
            self.warned = True
            warnings.warn(
                f"hylo: at step {step} every layer's preconditioned gradient pointed where its raw gradient does "
                f"(within {UNCHANGED:.0%}): the damping ({damping:g}) dominates the curvature, so hylo costs time and "
                "changes no direction. Lower the damping (under an Adam-type optimizer damping=1e-3, or use "
                "solver='kfac_adam'), or build hylo.HyLoOptimizer, which chooses them "
                '(docs/reliability.md, "A step that changes nothing").',
                stacklevel=4,
            )


def unchanged(results: list[Tensor], raws: list[Tensor], layer_of: list[int], layers: int) -> Tensor:
    """Per layer, whether its result V̂ points where its raw gradient ∇W does: sin²∠(V̂, ∇W) ≤ :data:`UNCHANGED`²
    with ⟨V̂, ∇W⟩ > 0, over the parts (``results[i]``, ``raws[i]``) of layer ``layer_of[i]``, in float64. A layer
    whose gradient or result is zero counts as unchanged (it gives nothing to turn)."""
    device = results[0].device
    plus = torch._foreach_add(results, raws)
    minus = torch._foreach_sub(results, raws)
    norms = torch.stack(torch._foreach_norm([*plus, *minus, *results, *raws], 2, dtype=torch.float64))
    squares = norms.square().view(4, len(results))
    owner = torch.tensor(layer_of, device=device)
    sums = torch.zeros(4, layers, dtype=torch.float64, device=device).index_add_(1, owner, squares)
    inner = (sums[0] - sums[1]) / 4  # ⟨V̂, ∇W⟩ by polarisation
    lengths = sums[2] * sums[3]
    sine = torch.where(lengths > 0, 1 - inner.square() / lengths.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return (sine <= UNCHANGED**2) & ((inner > 0) | (lengths == 0))
