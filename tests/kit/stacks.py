"""What the training-stack tests share (tests/library/test_trainer.py, test_lightning.py, test_accelerate.py): the record a
run leaves and the one step of the hand-written loops each stack is held to (docs/training-stacks.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

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


def tiny_mlp() -> nn.Module:
    """Linear(8, 16) → Tanh → Linear(16, 16) → Tanh → Linear(16, 4), the same weights at every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def dataset(count: int, seed: int) -> TensorDataset:
    """``count`` examples for :func:`tiny_mlp`: inputs of width 8 and 4-class labels drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(count, 8, generator=generator), torch.randint(0, 4, (count,), generator=generator))


def backward_window(model: nn.Module, data: TensorDataset, step: int, accumulation: int, batch: int) -> None:
    """The backward of optimizer step ``step``'s window: ``accumulation`` micro-batches of ``batch`` examples of
    ``data`` in order, each loss divided by ``accumulation`` (as the stacks scale it)."""
    x, y = data.tensors
    for micro in range(accumulation):
        rows = slice((step * accumulation + micro) * batch, (step * accumulation + micro + 1) * batch)
        (F.cross_entropy(model(x[rows]), y[rows]) / accumulation).backward()
