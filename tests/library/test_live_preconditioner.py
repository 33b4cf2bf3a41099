"""One live preconditioner per model (docs/usage.md, "One live preconditioner per model").

A second preconditioner (or ``HyLoOptimizer``) on layers a live one holds — a re-run notebook cell, a stack that
rebuilds its optimizer — supersedes it: one warning naming the older one and the shared layers, the older's hooks
removed, its ``step()`` a ``RuntimeError`` naming what superseded it. The newer one then steps exactly as a single
fresh one would, bit for bit: the older captures nothing and changes nothing. A removed or dropped (collected)
preconditioner is not live, and one whose construction raised supersedes nothing.
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hylo
from tests.kit.models import backward, mlp

OPTIONS: dict[str, Any] = dict(solver="kfac", update_freq=2, damping=0.1)
SUPERSEDES = "supersedes the live"


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


class Loop:
    """A model with hylo attached in one of the two forms; :meth:`step` runs one training step."""

    def __init__(self, model: nn.Module, form: str) -> None:
        self.model = model
        self.form = form
        if form == "preconditioner":
            self.pre = hylo.HyLoPreconditioner(model, **OPTIONS)
            self.opt = sgd(model)
        else:
            self.opt = hylo.HyLoOptimizer(model, adamw)
            self.pre = self.opt.preconditioner

    def step(self, step: int) -> None:
        self.opt.zero_grad()
        backward(self.model, step)
        if self.form == "preconditioner":
            self.pre.step()
        self.opt.step()


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def copy_of(model: nn.Module) -> nn.Module:
    """A new mlp holding ``model``'s current weights (no hooks of ``model``'s preconditioners)."""
    fresh = mlp()
    fresh.load_state_dict(model.state_dict())
    return fresh


@pytest.fixture
def no_supersession() -> Iterator[None]:
    """Fails the test if any warning says a preconditioner was superseded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in caught if SUPERSEDES in str(w.message)] == []


FORMS = ["preconditioner", "optimizer"]


@pytest.mark.parametrize("second", FORMS)
@pytest.mark.parametrize("first", FORMS)
def test_a_second_one_supersedes_the_first_and_steps_as_a_fresh_one(first: str, second: str) -> None:
    """Both construction orders and each form twice: the newer one's steps equal those of a single fresh one on a
    copy of the model, bit for bit; the older captures nothing, changes nothing and its step() raises."""
    model = mlp()
    older = Loop(model, first)
    for step in range(3):  # the older has a state and a step count of its own
        older.step(step)
    reference = Loop(copy_of(model), second)
    older_steps = older.pre.progress().steps
    with pytest.warns(UserWarning, match=rf"the new HyLoPreconditioner at 0x[0-9a-f]+ \(2 layers\) {SUPERSEDES} "):
        newer = Loop(model, second)
    for step in range(3, 9):
        newer.step(step)
        reference.step(step)
        assert older.pre.memory_breakdown().captured == {"fc1": 0, "fc2": 0}  # the older's hooks are gone
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(reference.model), strict=True))
    assert newer.pre.progress().steps == reference.pre.progress().steps == 6
    assert older.pre.progress().steps == older_steps
    with pytest.raises(RuntimeError, match=r"was superseded by the newer HyLoPreconditioner at 0x[0-9a-f]+"):
        older.step(9)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(reference.model), strict=True))


def test_the_warning_names_the_older_one_and_the_shared_layers() -> None:
    model = mlp()
    older = hylo.HyLoPreconditioner(model, **OPTIONS)
    older_name = f"HyLoPreconditioner at {id(older):#x} (2 layers)"
    with pytest.warns(UserWarning) as caught:
        newer = hylo.HyLoPreconditioner(model, **OPTIONS)
    (message,) = [str(w.message) for w in caught if SUPERSEDES in str(w.message)]
    assert f"{SUPERSEDES} {older_name} on the layers they share ('fc1', 'fc2')" in message
    assert caught[0].filename == __file__  # points at the line that built the newer one
    with pytest.raises(RuntimeError) as raised:
        older.step()
    assert f"this {older_name} was superseded by the newer HyLoPreconditioner at {id(newer):#x}" in str(raised.value)


@pytest.mark.usefixtures("no_supersession")
def test_a_removed_first_one_is_not_live() -> None:
    model = mlp()
    older = hylo.HyLoPreconditioner(model, **OPTIONS)
    older.remove()
    newer = hylo.HyLoPreconditioner(model, **OPTIONS)
    reference = hylo.HyLoPreconditioner(fresh := mlp(), **OPTIONS)
    for step in range(3):
        for m, pre in ((model, newer), (fresh, reference)):
            m.zero_grad()
            backward(m, step)
            pre.step()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    with pytest.raises(RuntimeError, match="this HyLoPreconditioner was removed; create a new one"):
        older.step()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("collect", [True, False])
@pytest.mark.usefixtures("no_supersession")
def test_a_dropped_first_one_is_not_live(form: str, collect: bool) -> None:
    """``del`` (with or without ``gc.collect()``): the dropped one is not live, nothing keeps it alive, and the new
    one steps as a fresh one."""
    model = mlp()
    older = Loop(model, form)
    older.step(0)
    gone = weakref.ref(older.pre)
    del older
    if collect:
        gc.collect()
    newer = Loop(model, form)
    assert gone() is None  # no hook of the model holds the dropped one
    reference = Loop(copy_of(model), form)
    for step in range(1, 5):
        newer.step(step)
        reference.step(step)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(reference.model), strict=True))


@pytest.mark.parametrize("order", ["submodule first", "whole model first"])
def test_a_preconditioner_on_a_submodule_or_a_containing_model_supersedes_too(order: str) -> None:
    model = mlp()
    parts: list[nn.Module] = [model.fc2, model] if order == "submodule first" else [model, model.fc2]
    older = hylo.HyLoPreconditioner(parts[0], **OPTIONS)
    with pytest.warns(
        UserWarning, match=rf"{SUPERSEDES} HyLoPreconditioner at 0x[0-9a-f]+ \(\d layers\) on the layers "
    ):
        newer = hylo.HyLoPreconditioner(parts[1], **OPTIONS)
    with pytest.raises(RuntimeError, match="superseded"):
        older.step()
    backward(model, 0)
    newer.step()


@pytest.mark.usefixtures("no_supersession")
def test_preconditioners_on_disjoint_layers_and_on_other_models_are_both_live() -> None:
    """Disjoint layer sets of one model (fc1 and fc2 each its own), and a copy of the model, share no layer: each
    preconditions its own layers as it would alone."""
    model, fresh = mlp(), mlp()
    first = hylo.HyLoPreconditioner(model.fc1, **OPTIONS)
    second = hylo.HyLoPreconditioner(model.fc2, **OPTIONS)
    other = hylo.HyLoPreconditioner(copy_of(model), **OPTIONS)
    alone = hylo.HyLoPreconditioner(fresh.fc2, **OPTIONS)
    backward(model, 0)
    backward(fresh, 0)
    first.step()
    second.step()
    alone.step()
    assert torch.equal(model.fc2.weight.grad, fresh.fc2.weight.grad)
    assert other.progress().steps == 0


@pytest.mark.parametrize(
    "refused",
    [
        lambda model, tmp: hylo.HyLoPreconditioner(model, profile_dir=tmp, **OPTIONS),  # hylo's files are there
        lambda model, tmp: hylo.HyLoPreconditioner(model, kfac_max_state_mb=1e-9, **OPTIONS),  # over the budget
        # the optimizer form's own checks, made after its preconditioner is built: a parameter the optimizer lacks,
        # maximize under a whole-step solver
        lambda model, tmp: hylo.HyLoOptimizer(model, torch.optim.SGD(list(model.parameters())[:1], lr=0.1)),
        lambda model, tmp: hylo.HyLoOptimizer(model, torch.optim.AdamW(model.parameters(), maximize=True)),
    ],
    ids=["profile_dir", "kfac_budget", "form-missing-parameter", "form-maximize"],
)
@pytest.mark.usefixtures("no_supersession")
def test_a_construction_that_raises_supersedes_nothing(
    tmp_path: Path, refused: Callable[[nn.Module, Path], Any]
) -> None:
    model = mlp()
    older = hylo.HyLoPreconditioner(model, profile_dir=tmp_path, **OPTIONS)
    reference = hylo.HyLoPreconditioner(fresh := mlp(), **OPTIONS)
    with pytest.raises(ValueError):
        refused(model, tmp_path)
    for step in range(3):
        for m, pre in ((model, older), (fresh, reference)):
            m.zero_grad()
            backward(m, step)
            pre.step()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    older.close()


def test_a_closed_one_is_still_live_and_is_superseded() -> None:
    """``close()`` only closes the profile files: the hooks still capture and ``step()`` still works, so a newer one
    on its layers supersedes it as any live one."""
    model = mlp()
    older = hylo.HyLoPreconditioner(model, **OPTIONS)
    older.close()
    backward(model, 0)
    older.step()
    with pytest.warns(UserWarning, match=SUPERSEDES):
        hylo.HyLoPreconditioner(model, **OPTIONS)
    with pytest.raises(RuntimeError, match="superseded"):
        older.step()


def test_the_optimizer_form_built_on_a_factory_twice_supersedes_like_a_notebook_cell() -> None:
    """A re-run cell: ``opt = HyLoOptimizer(model, partial(AdamW, lr=...))`` twice, then training with ``opt``."""
    model = mlp()
    reference = mlp()
    cell = functools.partial(hylo.HyLoOptimizer, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    opt = cell(model)
    with pytest.warns(UserWarning, match=SUPERSEDES) as caught:
        opt = cell(model)
    assert [w.filename for w in caught if SUPERSEDES in str(w.message)] == [__file__]  # the cell's line
    ref_opt = cell(reference)
    for step in range(4):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            backward(m, step)
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(weights(model), weights(reference), strict=True))
