"""What the training-stack tests share (tests/test_trainer.py, test_lightning.py, test_accelerate.py): the record a
run leaves and the one step of the hand-written loops each stack is held to (docs/training-stacks.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import hylo


@dataclass
class Run:
    """What a run leaves: the parameters, hylo's state and step count, the optimizer steps, evaluation batches."""

    params: dict[str, torch.Tensor]
    hylo_state: dict[str, Any]
    hylo_steps: int
    optimizer_steps: int = -1
    evaluations: int = 0


def ended(model: nn.Module, pre: hylo.HyLoPreconditioner, **counts: int) -> Run:
    """The :class:`Run` of ``model`` and ``pre`` as they are now."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Run(params, pre.state_dict(), pre.steps, **counts)


def clip(model: nn.Module, max_norm: float) -> None:
    """The stacks' clipping: the gradients' global norm to ``max_norm``."""
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)


def step_by_hand(
    model: nn.Module,
    pre: hylo.HyLoPreconditioner,
    optimizer: torch.optim.Optimizer,
    *,
    optimizer_form: bool,
    clipping: str,
    max_norm: float,
) -> None:
    """One optimizer step of a hand loop after the window's backward: clipping ``"before"`` or ``"after"`` hylo's step
    (or ``"none"``), then the optimizer's. ``optimizer_form``: ``optimizer`` is a :class:`hylo.HyLoOptimizer`, whose
    ``step()`` runs ``pre.step()`` itself (so clipping after it steps the optimizers it wraps)."""
    if clipping == "before":
        clip(model, max_norm)
    if not optimizer_form or clipping == "after":
        pre.step()
    if clipping == "after":
        clip(model, max_norm)
    if optimizer_form and clipping == "after":
        assert isinstance(optimizer, hylo.HyLoOptimizer)
        for part in optimizer.optimizers:
            part.step()
    else:
        optimizer.step()
