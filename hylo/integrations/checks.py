"""What both callbacks check before training: they were given a preconditioner, built on the model being trained.

Imports nothing beyond hylo and torch (docs/training-stacks.md, "Mistakes the callbacks catch").
"""

from __future__ import annotations

from torch import nn

from hylo.optimizer import HyLoOptimizer
from hylo.preconditioner import HyLoPreconditioner


def preconditioner_of(value: object, where: str) -> HyLoPreconditioner:
    """``value`` if it is a :class:`HyLoPreconditioner`, else ``ValueError`` (naming ``where``) saying what to pass."""
    if isinstance(value, HyLoPreconditioner):
        return value
    hint = (
        ": a HyLoOptimizer is the optimizer form, given to the stack as its optimizer, with no callback"
        if isinstance(value, HyLoOptimizer)
        else ""
    )
    raise ValueError(f"{where} takes a hylo.HyLoPreconditioner, got {type(value).__name__}{hint}")


def check_attached(pre: HyLoPreconditioner, model: nn.Module | None, where: str) -> None:
    """``ValueError`` unless every parameter ``pre`` preconditions is a parameter of ``model`` (when it is known):
    a preconditioner built on another model (a copy, a model the stack rebuilt) would never see a gradient."""
    if model is None:
        return
    held = {id(p) for p in model.parameters()}
    if any(id(p) not in held for p in pre.parameters()):
        raise ValueError(
            f"{where}: the preconditioner was built on another model than the one being trained; build it on the "
            "model you give the stack, after any change that replaces its parameters"
        )
