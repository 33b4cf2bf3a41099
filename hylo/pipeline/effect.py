"""A step that changes nothing: the warning, once, when every layer's preconditioned gradient is its raw gradient.

docs/reliability.md, "A step that changes nothing": when the damping λ dominates every layer's curvature,
(F̃ + λI)⁻¹∇W is ∇W/λ, which an optimizer that sets the step's length itself (Adam's per-coordinate scaling, or
``kl_clip``'s bound) turns back into its plain step: hylo then costs its time and changes nothing. At each
update (until it has warned once) the preconditioner reads the angle between each layer's result V̂ and its
gradient ∇W off the sums its check of the results computed already (:class:`~hylo.pipeline.apply.Checked`, in the step's
:class:`~hylo.pipeline.step.Outcome`:
⟨∇W, V̂⟩ and ‖V̂‖², over every rank's rows) and the guard's ‖∇W‖: a few operations on one vector and one host read.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from hylo.pipeline.step import Outcome
from hylo.solvers import LayerState, solver_names, whole_step
from hylo.state import RegisteredLayer

#: A layer's step counts as its raw gradient (up to scale) when its direction differs by less than this share.
UNCHANGED = 0.01


def _such_as() -> str:
    """`` such as solver='<name>'`` for the first registered solver whose result is the whole step, if any."""
    names = [name for name in solver_names() if whole_step(name)]
    return f" such as solver={names[0]!r}" if names else ""


class EffectWatch:
    """Warns once when an update's preconditioned gradients all point where their raw gradients do."""

    def __init__(self, layers: Sequence[RegisteredLayer]) -> None:
        self.by_name = {layer.name: layer for layer in layers}
        self.warned = False

    def check(self, step: int, outcome: Outcome, damping: float) -> None:
        """Warn if no layer of an update step's checked results (``outcome.checked``) turned by more than
        :data:`UNCHANGED`, from every registered layer's ‖∇W‖ (``outcome.norms``, float64, the guard's). A layer
        whose state gives no length bound (a whole-step solver's: its result is its own step, not (F̃ + λI)⁻¹∇W)
        counts as turned, whichever path measured its length."""
        checked, norms = outcome.checked, outcome.norms
        if self.warned or checked is None or norms is None:
            return
        states = [outcome.state_of(self.by_name[name]) for name in outcome.grads]  # the layers the step checked
        if any(isinstance(state, LayerState) and state.bound is None for state in states):
            return
        indices = checked.indices
        if indices is not None:
            indices = torch.as_tensor(indices, dtype=torch.long).to(norms.device, non_blocking=True)
            norms = norms.index_select(0, indices)
        if bool(unchanged(checked.terms, norms, checked.flags).all()):
            self.warned = True
            warnings.warn(
                f"hylo: at step {step} every layer's preconditioned gradient pointed where its raw gradient does "
                f"(within {UNCHANGED:.0%}): the damping ({damping:g}) dominates the curvature, so hylo costs time and "
                "changes no direction. Lower the damping (under an Adam-type optimizer damping=1e-3, or use a solver "
                f"whose result is the whole step{_such_as()}), or build hylo.HyLoOptimizer, which chooses them "
                '(docs/reliability.md, "A step that changes nothing").',
                stacklevel=4,
            )


def unchanged(terms: Tensor, norms: Tensor, flags: Tensor) -> Tensor:
    """Per layer, whether what it writes points where its raw gradient ∇W does: its result fell back to ∇W
    (``flags``), or sin²∠(V̂, ∇W) = 1 − ⟨∇W, V̂⟩² / (‖V̂‖²‖∇W‖²) ≤ :data:`UNCHANGED`² with ⟨∇W, V̂⟩ > 0, from the
    float64 ``terms`` [⟨∇W, V̂⟩, ‖V̂‖²] and ``norms`` ‖∇W‖. A length the check did not measure (0: a result without
    a length bound) counts as turned: nothing is claimed of it."""
    dot, square = terms[:, 0], terms[:, 1]
    lengths = square * norms.square()
    sine = 1 - dot.square() / lengths.clamp_min(torch.finfo(torch.float64).tiny)
    return flags.bool() | ((lengths > 0) & (dot > 0) & (sine <= UNCHANGED**2))
