"""HyLoOptimizer.load_state_dict checks the wrapped optimizers' part before anything changes.

docs/usage.md, "The optimizer form". ``torch.optim`` loads whatever it is given: a group without its ``lr`` (a
``KeyError`` at the next step), a NaN ``lr`` or moment (NaN parameters steps later), a moment of another shape or
parameters permuted between groups (a size error at the next step), a state for a parameter that does not exist,
missing states (moments silently restarted). Each corruption here is refused with a ``ValueError`` naming the
group, the parameter and the problem; the optimizer, hylo and the parameters are then as they were, and the run
continues exactly as an untouched twin's. Legitimate states — a parameter that never had a gradient, a step count
saved as a number, an optimizer whose state is not shaped as its parameters (Adafactor) — load.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hylo
from tests.kit.checks import assert_same_tensors
from tests.kit.models import DT, batch

Corrupt = Callable[[dict[str, Any]], None]


def net(seed: int = 0, unused: bool = False) -> nn.Module:
    """Linear(4, 6) → LayerNorm → Tanh → Linear(6, 3); with ``unused``, a Linear(6, 6) the forward never calls."""
    torch.manual_seed(seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        fc1=nn.Linear(4, 6, dtype=DT), norm=nn.LayerNorm(6, dtype=DT), act=nn.Tanh(), fc2=nn.Linear(6, 3, dtype=DT)
    )
    model = nn.Sequential(layers)
    if unused:
        model.spare = nn.Linear(6, 6, dtype=DT)  # registered by hylo, never called: no gradient, no state
        model.forward = lambda x: model.fc2(model.act(model.norm(model.fc1(x))))  # type: ignore[method-assign]
    return model


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        x, y = batch(step, 16)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
#: How each optimizer is wrapped: SGD with momentum under K-FAC; AdamW under K-FAC (AdamW holds every parameter);
#: AdamW under the form's default (the kfac_adam split: AdamW holds the norm, SGD hylo's layers).
FORMS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (SGD, {"solver": "kfac", "update_freq": 2}),
    "adamw": (ADAMW, {"solver": "kfac", "update_freq": 2}),
    "split": (ADAMW, {"update_freq": 2}),
}


def started(form: str, unused: bool = False, make: Any = None) -> tuple[nn.Module, hylo.HyLoOptimizer]:
    """The model after 3 steps of the optimizer form ``form``."""
    base, options = FORMS[form]
    model = net(unused=unused)
    optimizer = hylo.HyLoOptimizer(model, make or base, **options)
    train(model, optimizer, range(3))
    return model, optimizer


def snapshot(model: nn.Module, optimizer: hylo.HyLoOptimizer) -> dict[str, Any]:
    """Everything a load could change: the parameters, the optimizers' state and groups, hylo's state."""
    return copy.deepcopy(
        {
            "params": [p.detach() for p in model.parameters()],
            "state": optimizer.state_dict(),
            "progress": optimizer.preconditioner.progress(),
        }
    )


def assert_refused_and_unchanged(form: str, corrupt: Corrupt, match: str, unused: bool = False) -> None:
    """The corrupted ``state_dict`` of the form's own run is refused with ``match``; nothing changed, and the
    next 3 steps equal an untouched twin's."""
    model, optimizer = started(form, unused)
    before = snapshot(model, optimizer)
    bad = copy.deepcopy(optimizer.state_dict())
    corrupt(bad)
    with pytest.raises(ValueError, match=match):
        optimizer.load_state_dict(bad)
    assert_same_tensors(snapshot(model, optimizer), before)
    twin, twin_optimizer = started(form, unused)
    train(model, optimizer, range(3, 6))
    train(twin, twin_optimizer, range(3, 6))
    assert_same_tensors(list(model.parameters()), list(twin.parameters()))


# --------------------------------------------------------------------------- group keys and options
def _set(key: str, value: object, group: int = 0) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        state["param_groups"][group][key] = value

    return corrupt


def _delete(key: str, group: int = 0) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        del state["param_groups"][group][key]

    return corrupt


@pytest.mark.parametrize(
    ("form", "corrupt", "match"),
    [
        pytest.param("sgd", _delete("lr"), r"group 0 lacks \['lr'\]", id="lr-deleted"),
        pytest.param("split", _delete("weight_decay", 1), r"group 1 lacks \['weight_decay'\]", id="split-sgd-key"),
        pytest.param("adamw", _delete("betas"), r"group 0 lacks \['betas'\]", id="betas-deleted"),
        pytest.param("sgd", _set("lr", float("nan")), r"group 0, option 'lr' is nan, not finite", id="lr-nan"),
        pytest.param("split", _set("lr", float("inf"), 1), r"group 1, option 'lr' is inf", id="split-lr-inf"),
        pytest.param("sgd", _set("lr", "0.1"), r"option 'lr' must be a number", id="lr-string"),
        pytest.param("sgd", _set("momentum", None), r"option 'momentum' must be a number", id="momentum-none"),
        pytest.param("adamw", _set("betas", (0.9, float("nan"))), r"option 'betas' is .*not finite", id="betas-nan"),
        pytest.param("adamw", _set("betas", (0.9,)), r"option 'betas' must be 2 numbers", id="betas-short"),
        pytest.param("adamw", _set("eps", float("-inf")), r"option 'eps' is -inf", id="eps-inf"),
        pytest.param("sgd", _set("nesterov", 1), r"option 'nesterov' must be a bool", id="nesterov-int"),
        pytest.param("sgd", _set("initial_lr", float("nan")), r"option 'initial_lr' is nan", id="extra-key-nan"),
    ],
)
def test_a_bad_group_is_refused_and_changes_nothing(form: str, corrupt: Corrupt, match: str) -> None:
    assert_refused_and_unchanged(form, corrupt, match)


# --------------------------------------------------------------------------- numbering
def _swap_between_groups(state: dict[str, Any]) -> None:
    first, second = state["param_groups"][0]["params"], state["param_groups"][1]["params"]
    first[0], second[0] = second[0], first[0]


def _state_for(number: int) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        state["state"][number] = copy.deepcopy(state["state"][0])

    return corrupt


def _permute_in_group(state: dict[str, Any]) -> None:
    params = state["param_groups"][0]["params"]
    params[0], params[1] = params[1], params[0]


@pytest.mark.parametrize(
    ("form", "corrupt", "match"),
    [
        pytest.param(
            "split",
            _swap_between_groups,
            r"group 0 numbers its parameters \[2, 1\], expected \[0, 1\]",
            id="between-groups",
        ),
        pytest.param("sgd", _permute_in_group, r"group 0 numbers its parameters \[1, 0, 2", id="within-a-group"),
        pytest.param("sgd", _state_for(6), r"a state for parameter 6, which does not exist", id="index-past-end"),
        pytest.param("sgd", _state_for(-1), r"a state for parameter -1, which does not exist", id="negative-index"),
    ],
)
def test_a_bad_numbering_is_refused_and_changes_nothing(form: str, corrupt: Corrupt, match: str) -> None:
    assert_refused_and_unchanged(form, corrupt, match)


# --------------------------------------------------------------------------- each parameter's state
def _state(number: int, key: str, change: Callable[[Any], Any]) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        state["state"][number][key] = change(state["state"][number][key])

    return corrupt


def _poke(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def poke(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return poke


def _drop_key(number: int, key: str) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        del state["state"][number][key]

    return corrupt


def _replace(number: int, value: object) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        state["state"][number] = value

    return corrupt


# fc1.weight is parameter 0 (6×4), fc1.bias 1, norm 2 and 3, fc2.weight 4 (3×6), fc2.bias 5; under the split AdamW
# holds the norm's (0 and 1) and the SGD hylo's.
@pytest.mark.parametrize(
    ("form", "corrupt", "match"),
    [
        pytest.param("adamw", _state(0, "exp_avg", _poke(float("nan"))), r"parameter 0 \(fc1.weight.*'exp_avg' holds 1 non-finite", id="nan-moment"),
        pytest.param("split", _state(1, "exp_avg_sq", _poke(float("inf"))), r"parameter 1 \(norm.bias.*'exp_avg_sq' holds 1 non-finite", id="split-inf-moment"),
        pytest.param("sgd", _state(4, "momentum_buffer", _poke(float("nan"))), r"parameter 4 \(fc2.weight.*non-finite", id="nan-momentum"),
        pytest.param("adamw", _state(0, "exp_avg", lambda t: t.T.contiguous()), r"parameter 0 .*'exp_avg' has shape \(4, 6\), expected \(6, 4\)", id="transposed-moment"),
        pytest.param("sgd", _state(1, "momentum_buffer", lambda t: t[:3]), r"parameter 1 .*'momentum_buffer' has shape \(3,\), expected \(6,\)", id="short-momentum"),
        pytest.param("adamw", _state(4, "exp_avg_sq", lambda t: t[0]), r"parameter 4 .*has shape \(6,\), expected \(3, 6\)", id="moment-of-a-row"),
        pytest.param("adamw", _state(5, "exp_avg", lambda t: t.to(torch.int64)), r"'exp_avg' is torch.int64, expected a floating-point", id="integer-moment"),
        pytest.param("adamw", _state(0, "step", lambda t: torch.tensor(float("nan"))), r"'step' holds 1 non-finite", id="step-nan"),
        pytest.param("adamw", _state(0, "step", lambda t: t + 10), r"'step' is 13.0, expected a whole number of steps from 0 to 3", id="step-past-hylo"),
        pytest.param("adamw", _state(0, "step", lambda t: t - 0.5), r"'step' is 2.5, expected a whole number", id="step-fraction"),
        pytest.param("adamw", _drop_key(2, "exp_avg_sq"), r"parameter 2 \(norm.weight.*lacks \['exp_avg_sq'\]", id="moment-deleted"),
        pytest.param("sgd", _replace(0, [1.0]), r"parameter 0 .*must be a mapping", id="state-not-a-mapping"),
    ],
)  # fmt: skip
def test_a_bad_parameter_state_is_refused_and_changes_nothing(form: str, corrupt: Corrupt, match: str) -> None:
    assert_refused_and_unchanged(form, corrupt, match)


def _drop(*numbers: int) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        for number in numbers:
            state["state"].pop(number)

    return corrupt


def _empty(number: int) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        state["state"][number] = {}

    return corrupt


@pytest.mark.parametrize(
    ("form", "corrupt", "match"),
    [
        pytest.param("adamw", _drop(0, 1, 4), r"parameter 0 \(fc1.weight.*no state, though its layer holds", id="adamw-half"),
        pytest.param("sgd", _drop(5), r"parameter 5 \(fc2.bias.*no state.*\['momentum_buffer'\]", id="sgd-bias"),
        pytest.param("adamw", _empty(4), r"parameter 4 \(fc2.weight.*no state", id="emptied"),
    ],
)  # fmt: skip
def test_a_missing_state_of_a_stepped_parameter_is_refused(form: str, corrupt: Corrupt, match: str) -> None:
    """A parameter whose layer holds hylo's saved state had gradients at an update, which the optimizer stepped:
    its state cannot be missing (a load would restart its moments silently)."""
    assert_refused_and_unchanged(form, corrupt, match)


# --------------------------------------------------------------------------- what loads
def assert_resumes(form: str, unused: bool = False, make: Any = None, change: Corrupt | None = None) -> None:
    """A state saved after 3 steps (changed by ``change``) loads into a new form, which then ends where the
    uninterrupted run does."""
    straight, optimizer = started(form, unused, make)
    train(straight, optimizer, range(3, 6))
    first, optimizer = started(form, unused, make)
    saved = copy.deepcopy({"model": first.state_dict(), "opt": optimizer.state_dict()})
    if change is not None:
        change(saved["opt"])
    base, options = FORMS[form]
    resumed = net(seed=1, unused=unused)
    resumed.load_state_dict(saved["model"])
    optimizer = hylo.HyLoOptimizer(resumed, make or base, **options)
    optimizer.load_state_dict(saved["opt"])
    train(resumed, optimizer, range(3, 6))
    assert_same_tensors(list(resumed.parameters()), list(straight.parameters()))


@pytest.mark.parametrize("form", FORMS)
def test_a_parameter_that_never_had_a_gradient_has_no_state_and_loads(form: str) -> None:
    """``spare`` is registered by hylo but never called: no gradient, no optimizer state, no hylo state — a
    legitimate state that loads."""
    _, optimizer = started(form, unused=True)
    saved = optimizer.state_dict()
    spare = [i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]) if p.grad is None]
    assert spare and not any(i in saved["state"] for i in spare)
    assert_resumes(form, unused=True)


def test_a_step_count_saved_as_a_number_loads() -> None:
    """Adam's ``step`` as a plain number (as older torch saved it; Adam's ``__setstate__`` makes it a tensor)."""

    def as_numbers(state: dict[str, Any]) -> None:
        for entry in state["state"].values():
            entry["step"] = float(entry["step"])

    assert_resumes("adamw", change=as_numbers)


def test_an_optimizer_whose_state_is_not_shaped_as_its_parameters() -> None:
    """Adafactor keeps a row and a column factor per matrix ((6, 1) and (1, 4) for fc1's 6×4 weight): its own
    layout, found by stepping a copy, so its state loads and a factor of another shape is refused."""
    make = functools.partial(torch.optim.Adafactor, lr=1e-2)
    model, optimizer = started("sgd", make=make)
    assert tuple(optimizer.state_dict()["state"][0]["row_var"].shape) == (6, 1)
    assert_resumes("sgd", make=make)

    def transposed(state: dict[str, Any]) -> None:
        state["state"][0]["row_var"] = state["state"][0]["row_var"].T

    bad = copy.deepcopy(optimizer.state_dict())
    transposed(bad)
    with pytest.raises(ValueError, match=r"parameter 0 .*'row_var' has shape \(1, 6\), expected \(6, 1\)"):
        optimizer.load_state_dict(bad)


class Bespoke(torch.optim.SGD):
    """An optimizer whose step needs an attribute its constructor sets (a copy made to find its layout lacks it)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.scale = 1.0

    def step(self, closure: Any = None) -> Any:
        assert self.scale == 1.0
        return super().step(closure)


def test_an_optimizer_whose_layout_cannot_be_found_is_held_to_the_shape_rule() -> None:
    """Where stepping a copy fails, a state tensor with the parameter's number of elements must have its shape:
    the saved state loads and resumes exactly, a transposed buffer is refused."""
    make = functools.partial(Bespoke, lr=0.1, momentum=0.9)
    assert_resumes("sgd", make=make)
    model, optimizer = started("sgd", make=make)
    bad = copy.deepcopy(optimizer.state_dict())
    bad["state"][0]["momentum_buffer"] = bad["state"][0]["momentum_buffer"].T
    with pytest.raises(ValueError, match=r"'momentum_buffer' has shape \(4, 6\), expected the parameter's \(6, 4\)"):
        optimizer.load_state_dict(bad)
