"""Option validation of HyLoConfig (hylo/config.py), directly and through HyLoPreconditioner.

Invalid options raise a ValueError naming the option (kl_clip needs lr, skip_layers must be
valid regular expressions); rank/rank_ratio and ``rows_kept``; the hybrid policy's options
(adaptive windows, trend, ``layer_solvers``, ``solver_fn``).
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hylo import HyLoConfig, HyLoPreconditioner
from hylo.config import options, resolve
from hylo.integrity import seal
from tests.kit.checks import assert_same_tensors, grads, state_snapshot
from tests.kit.models import backward, classifier_inputs, classifier_mlp, mlp, override_model, run

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- errors name the option
@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"damping": 0}, "damping"),
        ({"damping": -1.0}, "damping"),
        ({"damping": float("nan")}, "damping"),
        ({"damping": float("inf")}, "damping"),
        ({"update_freq": 0}, "update_freq"),
        ({"update_freq": 1.5}, "update_freq"),
        ({"update_freq": -3}, "update_freq"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"factor_decay": -0.1}, "factor_decay"),
        ({"kl_clip": 1e-3}, "lr"),
        ({"kl_clip": 0.0, "lr": 0.1}, "kl_clip"),
        ({"kl_clip": 1.0, "lr": -0.1}, "lr"),
        ({"rank_ratio": 0}, "rank_ratio"),
        ({"rank_ratio": 1.5}, "rank_ratio"),
        ({"rank": 0}, "rank"),
        ({"solver": "adam"}, "solver"),
        ({"solver": "KFAC"}, "solver"),
        ({"skip_layers": "fc1"}, "skip_layers"),
        ({"trend_decay": 1.0}, "trend_decay"),
        ({"trend_decay": -0.1}, "trend_decay"),
        ({"trend_decay": float("nan")}, "trend_decay"),
        ({"trend_decay": "0.9"}, "trend_decay"),
        ({"critical_noise": -1.0}, "critical_noise"),
        ({"critical_noise": float("nan")}, "critical_noise"),
        ({"critical_noise": float("inf")}, "critical_noise"),
        ({"critical_noise": None}, "critical_noise"),
        ({"critical_noise": True}, "critical_noise"),
        ({"conv_rows": "median"}, "conv_rows"),
        ({"conv_rows": None}, "conv_rows"),
        ({"kis_estimator": "biased"}, "kis_estimator"),
        ({"kfc_exponent": -0.5}, "kfc_exponent"),
        ({"kfc_exponent": 4.5}, "kfc_exponent"),
        ({"kfc_exponent": float("nan")}, "kfc_exponent"),
        ({"kfc_exponent": True}, "kfc_exponent"),
        ({"kfc_exponent": "1"}, "kfc_exponent"),
        ({"damping_convention": "kfac-pytorch"}, "damping_convention"),
        ({"damping_convention": None}, "damping_convention"),
        ({"factor_update_freq": 0}, "factor_update_freq"),
        ({"factor_update_freq": 2.5}, "factor_update_freq"),
        ({"fidelity_budget": -0.1}, "fidelity_budget"),
        ({"fidelity_budget": float("inf")}, "fidelity_budget"),
        ({"fidelity_budget": True}, "fidelity_budget"),
        ({"comm_flops_per_byte": -1.0}, "comm_flops_per_byte"),
        ({"comm_flops_per_byte": float("nan")}, "comm_flops_per_byte"),
        ({"studies": ("rank",)}, "profile_dir"),
        ({"studies": "rank", "profile_dir": "x"}, "studies"),
        ({"studies": ("spectrum",), "profile_dir": "x"}, "studies"),
        ({"profile_dir": 3}, "profile_dir"),
        ({"rank_every": 0}, "rank_every"),
        ({"rank_top_k": 1.5}, "rank_top_k"),
        ({"rank_top_k": 4097}, "rank_top_k"),  # one CSV column each: 2**62 would build them at construction
        ({"grad_error_every": True}, "grad_error_every"),
        ({"grad_error_methods": ("kid", "svd")}, "grad_error_methods"),
        ({"grad_error_methods": ()}, "grad_error_methods"),
        ({"grad_error_methods": "kid"}, "grad_error_methods"),
        ({"grad_error_ratios": (0.1, 0.0)}, "grad_error_ratios"),
        ({"grad_error_ratios": 0.5}, "grad_error_ratios"),
        ({"grad_error_ratios": ()}, "grad_error_ratios"),
        ({"study_exact_rows_mb": -1}, "study_exact_rows_mb"),
    ],
)
def test_invalid_option_raises_value_error_naming_it(options: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoPreconditioner(mlp(), **options)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoConfig(**options)


def test_invalid_skip_layers_regex_raises_in_preconditioner() -> None:
    with pytest.raises(ValueError, match="skip_layers"):
        HyLoPreconditioner(mlp(), skip_layers=("fc[",))


def test_invalid_skip_layers_regex_raises_in_config() -> None:
    with pytest.raises(ValueError, match="skip_layers"):
        HyLoConfig(skip_layers=("fc[",))


def test_kl_clip_without_lr_message_names_both() -> None:
    with pytest.raises(ValueError, match=r"\blr\b") as info:
        HyLoPreconditioner(mlp(), kl_clip=1e-3)
    assert "kl_clip" in str(info.value)


# --------------------------------------------------------------------------- rank and rank_ratio
@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, float("nan")])
def test_invalid_rank_ratio(value: float) -> None:
    with pytest.raises(ValueError, match="rank_ratio"):
        HyLoConfig(solver="kid", rank_ratio=value)
    with pytest.raises(ValueError, match="rank_ratio"):
        HyLoPreconditioner(classifier_mlp(), solver="kis", rank_ratio=value)


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_invalid_rank(value: float) -> None:
    with pytest.raises(ValueError, match=r"\brank\b"):
        HyLoConfig(solver="kis", rank=value)
    with pytest.raises(ValueError, match=r"\brank\b"):
        HyLoPreconditioner(classifier_mlp(), solver="kid", rank=value)


def test_rows_kept() -> None:
    assert HyLoConfig(rank_ratio=0.1).lowrank.rows_kept(64) == 6
    assert HyLoConfig(rank_ratio=1e-9).lowrank.rows_kept(64) == 1
    assert HyLoConfig(rank_ratio=1.0).lowrank.rows_kept(64) == 64
    assert HyLoConfig(rank_ratio=0.1, rank=9).lowrank.rows_kept(64) == 9  # rank overrides rank_ratio
    assert HyLoConfig(rank=100).lowrank.rows_kept(64) == 64


# --------------------------------------------------------------------------- policy options
@pytest.mark.parametrize(
    "options",
    [
        {"adaptive": (1, 2, 3)},  # no iters_per_epoch
        {"adaptive": (1, 3, 2), "iters_per_epoch": 5},  # a1 > a2
        {"adaptive": (1, 2), "iters_per_epoch": 5},
        {"adaptive": (1, 2, 3), "iters_per_epoch": 0},
        {"trend_decay": 1.0},
        {"trend_decay": -0.5},
        {"critical_noise": -0.1},
        {"trend_window": 0},
        {"critical_enter": 0.1, "critical_exit": 0.2},
        {"critical_exit": 0.0},
    ],
)
def test_policy_options_are_validated(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        HyLoConfig(**options)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"trend_decay": None},
        {"trend_decay": 0.0},
        {"trend_decay": 0.99},
        {"critical_noise": 0.0},
        {"critical_noise": 0},
        {"critical_noise": 10.0},
    ],
)
def test_trend_options_accept_valid_values(options: dict[str, Any]) -> None:
    config = HyLoConfig(**options)
    assert config.policy.trend_decay == options.get("trend_decay")  # None by default: matched to the window
    assert config.policy.critical_noise == options.get("critical_noise", 3.0)
    HyLoPreconditioner(mlp(), **options)


@pytest.mark.parametrize(
    "layer_solvers",
    [{"fc1": "hybrid"}, {"fc1": "adam"}, {"fc1": "KFAC"}, {"fc[": "kfac"}, {"(": "kid"}, {"fc1": None}],
)
def test_invalid_layer_solvers_raise_at_construction(layer_solvers: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="layer_solvers"):
        HyLoPreconditioner(override_model(), solver="kfac", layer_solvers=layer_solvers)
    with pytest.raises(ValueError, match="layer_solvers"):
        HyLoConfig(layer_solvers=layer_solvers)


def test_non_string_layer_solvers_key_raises_value_error() -> None:
    with pytest.raises(ValueError, match="layer_solvers"):
        HyLoConfig(layer_solvers={1: "kfac"})


def test_non_callable_solver_fn_raises() -> None:
    with pytest.raises(ValueError, match="solver_fn"):
        HyLoConfig(solver_fn="kfac")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- one holder, changed between steps
def test_the_config_is_read_only_and_reconfigure_reaches_every_component(tmp_path: Path) -> None:
    """reconfigure() between steps: the next steps run exactly as a preconditioner made with those options
    from the start would from the same state (the policy, the stage, KIS's draws and the studies all read
    the new config); fixed options are refused and change nothing; ``pre.config`` cannot be assigned."""
    study = {"studies": ("grad_error",), "grad_error_methods": ("kis",)}
    model, twin = classifier_mlp(), classifier_mlp()
    pre = HyLoPreconditioner(model, solver="kis", update_freq=2, rank_ratio=0.1, profile_dir=tmp_path / "a", **study)
    reference = HyLoPreconditioner(
        twin, solver="kis", update_freq=2, rank_ratio=0.5, damping=0.3, seed=7, profile_dir=tmp_path / "b", **study
    )
    with pytest.raises(AttributeError):
        pre.config = reference.config  # type: ignore[misc]
    before = pre.config
    with pytest.raises(ValueError, match="strategy"):
        pre.reconfigure(strategy="gradient", damping=0.3)
    assert pre.config is before
    pre.reconfigure(rank_ratio=0.5, damping=0.3, seed=7)
    assert (pre.config.lowrank.rank_ratio, pre.config.damping, pre.config.lowrank.seed) == (0.5, 0.3, 7)
    x, y = classifier_inputs("linear", 32, 0)
    for module, hylo_pre in ((model, pre), (twin, reference)):
        for _ in range(3):
            module.zero_grad()
            F.cross_entropy(module(x), y).backward()
            hylo_pre.step()
        hylo_pre.close()
    assert_same_tensors(state_snapshot(pre), state_snapshot(reference))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    errors = [(tmp_path / run / "grad-error.csv").read_text() for run in ("a", "b")]
    assert errors[0] == errors[1] and ",0.5," in errors[0]


# --------------------------------------------------------------------------- every option's type, at construction
_WRONG_TYPES: list[tuple[str, object]] = [
    (spec.name, value)
    for spec in options()
    for value in ([] if spec.optional else [None]) + [object(), iter(()), {"key": 1.0}]
]


@pytest.mark.parametrize(("name", "value"), _WRONG_TYPES, ids=[f"{n}={type(v).__name__}" for n, v in _WRONG_TYPES])
def test_every_option_refuses_a_value_of_the_wrong_type_at_construction(name: str, value: object) -> None:
    """None (where the option is not optional), an arbitrary object, a one-shot iterator (which a check would
    consume, leaving an empty option) and a mapping: a ValueError naming the option, from the constructor."""
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoConfig(**{name: value})
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoPreconditioner(mlp(), **{name: value})


def test_layer_solvers_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="layer_solvers must be a mapping"):
        HyLoConfig(layer_solvers=[("fc1", "kfac")])


@pytest.mark.parametrize("config", [{"damping": 0.1}, "kfac", 3])
def test_config_argument_must_be_a_hylo_config(config: object) -> None:
    with pytest.raises(ValueError, match="config must be a hylo.HyLoConfig"):
        HyLoPreconditioner(mlp(), config=config)  # type: ignore[arg-type]
    pre = HyLoPreconditioner(mlp())
    with pytest.raises(ValueError, match="config must be a hylo.HyLoConfig"):
        pre.reconfigure(config)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- numbers torch and floats cannot take
def _takes_numbers(kind: Any) -> bool:
    """Whether an option's type holds an int or a float (alone, in a union or in a tuple)."""
    return kind in (int, float) or any(_takes_numbers(arg) for arg in typing.get_args(kind))


#: How a number becomes each numeric option's value, and the options it needs beside it (every other numeric
#: option takes the number itself).
_AS_VALUE: dict[str, tuple[Callable[[object], object], dict[str, object]]] = {
    "adam_betas": (lambda v: (v, 0.999), {}),
    "adaptive": (lambda v: (0, 1, v), {"iters_per_epoch": 2}),
    "grad_error_ratios": (lambda v: (v,), {}),
    "iters_per_epoch": (lambda v: v, {"adaptive": (0, 1, 2)}),
    "kl_clip": (lambda v: v, {"lr": 0.1}),
    "lr": (lambda v: v, {"kl_clip": 1e-3}),
}
_NUMERIC = [spec.name for spec in options() if _takes_numbers(spec.type)]
#: Beyond int64 (what torch makes of a Python int) or beyond a float: each passed the old comparisons
#: (``0 < 2**70 < inf``) and failed at step() with OverflowError; 10**5000 has no repr (over 4300 digits).
_HUGE: dict[str, object] = {
    "2**63": 2**63,
    "2**70": 2**70,
    "-2**70": -(2**70),
    "10**400": 10**400,
    "-10**400": -(10**400),
    "10**5000": 10**5000,
    "Fraction(10**400)": Fraction(10**400),
}
_HUGE_CASES = [(name, value) for name in _NUMERIC for value in _HUGE.values()]
_HUGE_IDS = [f"{name}={label}" for name in _NUMERIC for label in _HUGE]


def _huge(name: str, value: object) -> tuple[object, dict[str, object]]:
    as_value, extra = _AS_VALUE.get(name, (lambda v: v, {}))
    return as_value(value), extra


def test_every_numeric_option_is_covered() -> None:
    assert {"damping", "kl_clip", "lr", "update_freq", "rank", "adam_betas", "trend_window"} <= set(_NUMERIC)
    assert set(_AS_VALUE) <= set(_NUMERIC)


def _everything(pre: HyLoPreconditioner) -> dict[str, Any]:
    """What a refused call must leave as it was: the state_dict (states, counters, options), the config."""
    return {"state_dict": copy.deepcopy(pre.state_dict()), "states": state_snapshot(pre), "steps": pre.steps}


def _stepped(steps: int = 2, **options: Any) -> tuple[torch.nn.Module, HyLoPreconditioner]:
    model = mlp(0)
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=1, damping=0.3, **options)
    run(model, pre, range(steps))
    return model, pre


@pytest.mark.parametrize(("name", "number"), _HUGE_CASES, ids=_HUGE_IDS)
def test_a_number_torch_cannot_take_is_refused_naming_the_option(name: str, number: object) -> None:
    """2**70, 10**400 and the like: a ValueError naming the option from the constructor and from reconfigure()
    (which changes nothing), not an OverflowError from the next step()."""
    value, extra = _huge(name, number)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoConfig(**{name: value, **extra})
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoPreconditioner(mlp(), **{name: value, **extra})
    model, pre = _stepped()
    before, config = _everything(pre), pre.config
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        pre.reconfigure(**{name: value, **extra})
    assert pre.config is config
    assert_same_tensors(_everything(pre), before)
    run(model, pre, range(2, 3))  # still usable


#: What a sealed state_dict can carry (its checksum takes plain ints; 10**5000 has no repr to checksum).
_SAVABLE = {label: value for label, value in _HUGE.items() if type(value) is int and label != "10**5000"}
_SAVED_CASES = [(name, value) for name in _NUMERIC for value in _SAVABLE.values()]
_SAVED_IDS = [f"{name}={label}" for name in _NUMERIC for label in _SAVABLE]


@pytest.mark.parametrize(("name", "number"), _SAVED_CASES, ids=_SAVED_IDS)
def test_a_saved_option_torch_cannot_take_is_refused_at_load(name: str, number: object) -> None:
    """A state_dict whose config was edited to hold such a number and sealed again: load_state_dict refuses it
    naming the option, and nothing changes."""
    value, extra = _huge(name, number)
    _, source = _stepped(3)
    saved = source.state_dict()
    saved["config"].update({**extra, name: value})
    saved = seal(saved)
    model, pre = _stepped()
    before, config = _everything(pre), pre.config
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        pre.load_state_dict(saved)
    assert pre.config is config
    assert_same_tensors(_everything(pre), before)
    run(model, pre, range(2, 3))


_SCHEDULES = [spec.name for spec in options() if spec.schedule]
_SCHEDULE_CASES = [(name, value) for name in _SCHEDULES for value in _HUGE.values()]
_SCHEDULE_IDS = [f"{name}={label}" for name in _SCHEDULES for label in _HUGE]


@pytest.mark.parametrize(("name", "number"), _SCHEDULE_CASES, ids=_SCHEDULE_IDS)
def test_a_schedule_returning_a_number_torch_cannot_take_fails_its_step_naming_it(name: str, number: object) -> None:
    """A callable returning such a number at step 2 (not an update step: factor_update_freq is read there): that
    step() raises a ValueError naming the option before anything changes; a step with a good value goes on."""
    good = {"update_freq": 4, "factor_update_freq": 1, "damping": 0.3, "factor_decay": 0.9, "kl_clip": 1e-3, "lr": 0.1}
    failed: list[int] = []

    def schedule(step: int) -> object:
        if step == 2 and not failed:
            failed.append(step)
            return number
        return good[name]

    options = {**good, name: schedule}
    model = mlp(0)
    pre = HyLoPreconditioner(model, solver="kfac", **options)
    run(model, pre, range(2))
    model.zero_grad()
    backward(model, 2)
    before, raw = _everything(pre), grads(model)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        pre.step()
    assert_same_tensors(_everything(pre), before)
    assert_same_tensors(grads(model), raw)
    pre.reconfigure(**{name: good[name]})  # an update_freq failure stays until its callable is replaced
    run(model, pre, range(2, 4))
    assert pre.steps == 4


def test_numbers_within_int64_reach_the_step_as_floats() -> None:
    """The largest ints the rules take run: a float option's value reaches torch as a float (lr = 2**62, whose
    int square 2**124 leaves int64, was an OverflowError in kl_clip's lr²)."""
    assert type(resolve("damping", 3, 0)) is float and resolve("update_freq", 3, 0) == 3
    assert type(resolve("lr", lambda step: 2, 0)) is float
    model = mlp(0)
    big = 2**63 - 1
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=1, damping=big, kl_clip=big, lr=2**62, trend_window=big)
    run(model, pre, range(3))
    assert all(torch.isfinite(g).all() for g in grads(model))


@pytest.mark.parametrize(
    ("name", "value", "extra"),
    [
        ("lr", 1e300, {"kl_clip": 1e-3}),  # lr² overflows a float (Python's ** raises OverflowError)
        ("max_unfold_mb", 1e300, {}),  # its bytes overflow: int(inf) blocks
        ("bucket_cap_mb", 2.0**43, {}),
        ("study_exact_rows_mb", 1e300, {}),
    ],
)
def test_a_float_whose_use_overflows_is_refused_naming_the_option(
    name: str, value: float, extra: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoConfig(**{name: value, **extra})
