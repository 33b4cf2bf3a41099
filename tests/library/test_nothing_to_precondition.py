"""A model with no layer hylo can precondition (docs/usage.md, "The optimizer form").

The specification: ``HyLoPreconditioner`` refuses it with a ``ValueError`` (``NoLayerError``) after warning what it
leaves alone and why; ``HyLoOptimizer`` never raises where the optimizer it wraps would train: it warns, names the
modules and the reason, and its steps, state and checkpoints are the wrapped optimizer's alone, bit for bit; a
checkpoint of a form that preconditions layers is refused by one that preconditions nothing, and the reverse.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.layers.walk import NoLayerError

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


class ScaledLinear(nn.Linear):
    """A Linear subclass with a forward of its own (its output scaled): not a Linear's operation as far as hylo
    knows, so it stays with the optimizer until registered."""

    def forward(self, x: Tensor) -> Tensor:
        return 2.0 * F.linear(x, self.weight, self.bias)


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(ScaledLinear(6, 8), nn.Tanh(), ScaledLinear(8, 3))


def loss_at(net: nn.Module, step: int) -> Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    return F.cross_entropy(net(x), y)


def train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_at(net, step).backward()
        optimizer.step()


def test_the_preconditioner_refuses_it_after_warning_what_it_leaves_alone() -> None:
    with (
        pytest.warns(UserWarning, match=r"ScaledLinear subclasses Linear with a forward of its own.*: 0, 2"),
        pytest.raises(NoLayerError, match="model has no layer hylo can precondition"),
    ):
        hylo.HyLoPreconditioner(model())
    assert issubclass(NoLayerError, ValueError)


def test_the_optimizer_form_warns_and_is_the_wrapped_optimizer_alone() -> None:
    plain = model()
    train(plain, ADAMW(plain.parameters()), range(5))
    net = model()
    with pytest.warns(UserWarning) as caught:
        opt = hylo.HyLoOptimizer(net, ADAMW)
    messages = [str(w.message) for w in caught]
    assert any("hylo leaves 2 modules unpreconditioned (ScaledLinear subclasses Linear" in m for m in messages)
    assert any(
        m.startswith("HyLoOptimizer: model has no layer hylo can precondition") and "AdamW trains Sequential alone" in m
        for m in messages
    ), messages
    assert not opt.preconditions
    with pytest.raises(ValueError, match="HyLoOptimizer preconditions nothing"):
        _ = opt.preconditioner
    assert opt.optimizers[0].param_groups is not None and len(opt.optimizers) == 1
    train(net, opt, range(5))
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)  # AdamW's steps, bit for bit


def test_its_checkpoint_is_the_wrapped_optimizers_and_resumes_bit_exactly() -> None:
    straight = model()
    with pytest.warns(UserWarning):
        opt = hylo.HyLoOptimizer(straight, ADAMW)
    train(straight, opt, range(6))
    resumed = model()
    with pytest.warns(UserWarning):
        first = hylo.HyLoOptimizer(resumed, ADAMW)
    train(resumed, first, range(3))
    saved = first.state_dict()
    assert saved["hylo"] is None and set(saved["state"]) == {0, 1, 2, 3}
    with pytest.warns(UserWarning):
        second = hylo.HyLoOptimizer(resumed, ADAMW)
    second.load_state_dict(saved)
    train(resumed, second, range(3, 6))
    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_checkpoint_of_the_other_kind_is_refused_and_changes_nothing() -> None:
    with pytest.warns(UserWarning):
        alone = hylo.HyLoOptimizer(model(), ADAMW)
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    preconditioning = hylo.HyLoOptimizer(linear, ADAMW)
    train(linear, preconditioning, range(2))
    before = preconditioning.state_dict()
    with pytest.raises(
        ValueError, match="saved by a HyLoOptimizer that preconditions layers, this one preconditions nothing"
    ):
        alone.load_state_dict(before)
    assert alone.state_dict()["state"] == {}
    with pytest.raises(ValueError, match="preconditions nothing, this one preconditions layers"):
        preconditioning.load_state_dict({**before, "hylo": None})
    assert preconditioning.state_dict()["hylo"]["checksum"] == before["hylo"]["checksum"]
