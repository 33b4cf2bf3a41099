"""Several torch optimizers over disjoint parameters, stepped as one (:class:`CombinedOptimizer`).

The peer benchmark combines Muon or SINGD with the baseline optimizer for the parameters they do not
train (:mod:`hylo_scripts.benchmarks.peers`); a run with hylo's ``kfac_adam`` combines SGD without momentum for
the parameters hylo adapts with the run's optimizer for the rest (:func:`hylo_scripts.training.loop.make_optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped as one.

    ``param_groups`` is the list of every optimizer's own group dicts (the same objects), so an lr
    scheduler built on the combination (``LambdaLR``) records each group's own base lr and sets
    each group's lr in the optimizer that owns it. ``step()`` and ``zero_grad()`` call every
    optimizer's once, in order; the state dict is the list of theirs.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        seen: set[int] = set()
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) in seen:
                        raise ValueError("CombinedOptimizer: a parameter is in two of the optimizers")
                    seen.add(id(param))
        self.optimizers = list(optimizers)
        # The base class checks and registers the groups as given (the dicts themselves, with no defaults added).
        super().__init__([group for optimizer in self.optimizers for group in optimizer.param_groups], {})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step every optimizer once (no closure: the loss is computed once, by the caller)."""
        if closure is not None:
            raise ValueError("CombinedOptimizer.step takes no closure")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) every optimizer's gradients."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Every optimizer's state dict, in order."""
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of the same optimizers."""
        states = state_dict.get("optimizers")
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ValueError(f"expected the state dicts of {len(self.optimizers)} optimizers")
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)


def combine(parts: Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """One optimizer, or a :class:`CombinedOptimizer` of several."""
    return parts[0] if len(parts) == 1 else CombinedOptimizer(parts)


def adapted_optimizer(
    model: nn.Module,
    adapted: Sequence[nn.Parameter],
    lr: float,
    weight_decay: float,
    rest: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    """SGD without momentum at ``lr`` (weight decay decoupled, as AdamW's) on the parameters whose preconditioned
    gradient is the whole update direction (hylo's ``kfac_adam``: ``pre.parameters()``), and ``rest(params)`` on
    the model's other parameters, if any (docs/usage.md, "Adaptive solvers")."""
    taken = {id(p) for p in adapted}
    others = [p for p in model.parameters() if id(p) not in taken]
    sgd = torch.optim.SGD(list(adapted), lr=lr, momentum=0.0, weight_decay=weight_decay)
    return combine([sgd, rest(others)] if others else [sgd])
