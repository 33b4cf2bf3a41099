"""What the training-stack tests share (tests/library/test_trainer.py, test_lightning.py, test_accelerate.py): the record a
run leaves and the one step of the hand-written loops each stack is held to (docs/training-stacks.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def ended(model: nn.Module, pre: hylo.HyLoPreconditioner | None, **counts: int) -> Run:
    """The :class:`Run` of ``model`` and ``pre`` as they are now (``pre`` None: a run without hylo)."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    if pre is None:
        return Run(params, {}, 0, **counts)
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


# The stacks' own accumulation against one batch (docs/training-stacks.md, "Accumulation equals one batch"): the
# same samples in the same order, as one batch of WINDOW or ACCUMULATION micro-batches of WINDOW // ACCUMULATION, in
# float64, compared on the parameters after WINDOWS optimizer steps.
ACCUMULATION = 4
WINDOW = 32  # wider than every layer of tiny_mlp (17 inputs with the bias): no degenerate eigenspace
WINDOWS = 6


@dataclass(frozen=True)
class Case:
    """A hylo setup of a stack: the form (``"optimizer"``: :class:`hylo.HyLoOptimizer`, ``"preconditioner"``:
    :class:`hylo.HyLoPreconditioner` with the stack's callback or recipe), the torch optimizer and hylo's options
    (none: the optimizer form's defaults for that optimizer)."""

    form: str
    optimizer: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        """The test id: form, optimizer and solver."""
        solver = dict(self.options).get("solver", "default")
        return f"{self.form}-{self.optimizer}-{solver}"


#: kfac and kfac_adam in both forms: the optimizer form's defaults (kfac under SGD, kfac_adam under AdamW) and the
#: preconditioner form's two (kfac under SGD with momentum, kfac_adam under SGD without, which applies its step).
CASES = (
    Case("optimizer", "sgd"),
    Case("optimizer", "adamw"),
    Case("preconditioner", "sgd", (("solver", "kfac"), ("damping", 1e-2), ("update_freq", 2))),
    Case("preconditioner", "plain_sgd", (("solver", "kfac_adam"), ("update_freq", 2))),
)


def torch_optimizer(kind: str) -> Callable[..., torch.optim.Optimizer]:
    """The case's torch optimizer, to be called on parameters: SGD with momentum, SGD alone, or AdamW."""
    if kind == "sgd":
        return functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    if kind == "plain_sgd":
        return functools.partial(torch.optim.SGD, lr=0.01)
    return functools.partial(torch.optim.AdamW, lr=1e-2)


def hylo_of(
    model: nn.Module, case: Case, *, plain: bool = False
) -> tuple[hylo.HyLoPreconditioner | None, torch.optim.Optimizer]:
    """The preconditioner and the optimizer the stack steps for ``case`` on ``model``; ``plain``: no hylo, the
    case's torch optimizer alone (the stack's own rounding)."""
    make = torch_optimizer(case.optimizer)
    if plain:
        return None, make(model.parameters())
    if case.form == "optimizer":
        optimizer = hylo.HyLoOptimizer(model, make, **dict(case.options))
        return optimizer.preconditioner, optimizer
    return hylo.HyLoPreconditioner(model, **dict(case.options)), make(model.parameters())


def windows(*, reorder: bool = False) -> TensorDataset:
    """WINDOWS × WINDOW float64 examples for :func:`tiny_mlp`; ``reorder``: each window's samples in another order
    (the same batches, other rounding)."""
    x, y = dataset(WINDOWS * WINDOW, seed=3).tensors
    x = x.to(torch.float64)
    if reorder:
        generator = torch.Generator().manual_seed(4)
        order = torch.cat([w * WINDOW + torch.randperm(WINDOW, generator=generator) for w in range(WINDOWS)])
        x, y = x[order], y[order]
    return TensorDataset(x, y)


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A run's parameters as one vector."""
    return torch.cat([p.detach().flatten() for p in params.values()])


def distance(run: Run, reference: Run) -> float:
    """‖run − reference‖ over how far the reference moved the parameters from :func:`tiny_mlp`'s (float64)."""
    start = torch.cat([p.detach().flatten() for p in tiny_mlp().to(torch.float64).parameters()])
    return float((flat(run.params) - flat(reference.params)).norm() / (flat(reference.params) - start).norm())


def assert_one_batch(run: Callable[..., Run]) -> float:
    """``run(ACCUMULATION)`` (a stack's run accumulating micro-batches) has the parameters of ``run(1)`` (one batch a
    step) to rounding, and returns how far it is. Rounding is measured on the stack itself
    (tests/library/test_accumulation.py's rule): 100 × the plain optimizer's own accumulation difference
    (``plain=True``), or, where larger, 10 × hylo's difference between the one batch and its samples reordered
    (``reorder=True``) — itself under 1e-8, or the case is not one of rounding."""
    accumulated, one, reordered = run(ACCUMULATION), run(1), run(1, reorder=True)
    plain = distance(run(ACCUMULATION, plain=True), run(1, plain=True))
    own = distance(reordered, one)
    assert own < 1e-8, f"hylo's own rounding on this case is {own:.1e}: not a rounding test"
    difference = distance(accumulated, one)
    assert accumulated.hylo_steps == one.hylo_steps == WINDOWS
    assert difference <= max(100 * max(plain, 1e-16), 10 * own), (difference, plain, own)
    return difference
