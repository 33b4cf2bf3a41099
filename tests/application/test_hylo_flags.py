"""The trainers' hylo flags come from hylo's configuration: every option is a flag of every trainer or set by the
engine, with the option's doc as its help and its type, choices and optionality as its parsing."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

import hylo
from hylo_scripts.models.registry import build_model
from hylo_scripts.training import train, train_lm, train_segmentation
from hylo_scripts.training.hylo_flags import HYLO_NAMES, flag, help_text
from hylo_scripts.training.hylo_options import ENGINE_OPTIONS, SCRIPT_DEFAULTS, default, user_options
from hylo_scripts.training.loop import make_preconditioner
from hylo_scripts.training.options import build_parser, config_from_args
from hylo_scripts.training.runconfig import RunConfig
from tests.kit.internals import option_actions

TRAINERS = {"classification": train, "segmentation": train_segmentation, "lm": train_lm}


def _parser(task: str) -> argparse.ArgumentParser:
    return build_parser(task, task=task, defaults=TRAINERS[task].DEFAULTS)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in option_actions(parser) if action.option_strings}


@pytest.mark.parametrize("task", list(TRAINERS))
def test_every_hylo_option_is_a_flag_of_every_trainer_or_set_by_the_engine(task: str) -> None:
    actions = _actions(_parser(task))
    for spec in hylo.config.options():
        if spec.name in ENGINE_OPTIONS:  # no hylo flag (--lr and --seed are the run's, which the engine passes on)
            assert spec.name not in actions or not (actions[spec.name].help or "").startswith(spec.doc), spec.name
            continue
        action = actions[spec.name]
        assert flag(spec.name) in action.option_strings
        assert action.help is not None and action.help.replace("%%", "%").startswith(spec.doc), spec.name
        assert action.default is None  # given or not is told apart; the run's defaults fill in the rest
        if spec.choices is not None:
            assert tuple(action.choices or ()) == spec.choices or spec.name == "solver"
        if get_origin(spec.type) is tuple:
            items = get_args(spec.type)
            assert action.nargs == ("+" if items[-1] is Ellipsis else len(items)), spec.name
            if items[-1] is Ellipsis and get_origin(items[0]) is Literal:
                assert tuple(action.choices or ()) == get_args(items[0])
    assert set(ENGINE_OPTIONS) <= {spec.name for spec in hylo.config.options()}  # no stale entry


def test_the_help_text_is_the_options_doc_and_default() -> None:
    actions = _actions(_parser("classification"))
    for spec in user_options():
        assert actions[spec.name].help == help_text(spec, default(spec))
    assert actions["damping"].help.endswith("(default: 0.3)")
    assert actions["kl_clip"].help.endswith("(default: 0.001; 0: off)")
    assert actions["solver"].choices == ("none", *hylo.solvers.solver_names(), hylo.solvers.HYBRID)


def test_the_exceptions_are_few_and_true() -> None:
    specs = {spec.name: spec for spec in hylo.config.options()}
    for name, script_default in SCRIPT_DEFAULTS.items():
        assert script_default.value != specs[name].default, f"{name}: the scripts' default is hylo's"
    assert set(HYLO_NAMES) <= set(specs)
    actions = _actions(_parser("classification"))
    assert {"--freq", "--update-freq"} <= set(actions["update_freq"].option_strings)
    assert {"--compression-ratio", "--rank-ratio"} <= set(actions["rank_ratio"].option_strings)


def test_a_new_hylo_option_is_a_flag_with_no_script_edit(monkeypatch: pytest.MonkeyPatch) -> None:
    options = hylo.config.options()
    new = dataclasses.replace(
        options[-1], name="new_option", section="policy", type=Literal["a", "b"], default="a", doc="a new option"
    )
    new = dataclasses.replace(new, choices=("a", "b"), optional=False, schedule=False, fixed=False)
    monkeypatch.setattr(hylo.config, "options", lambda: [*options, new])
    for task in TRAINERS:
        parser = _parser(task)
        action = _actions(parser)["new_option"]
        assert action.option_strings == ["--new-option"] and tuple(action.choices or ()) == ("a", "b")
        assert parser.parse_args(["--new-option", "b"]).new_option == "b"


def _run(*argv: str) -> RunConfig:
    parser = _parser("classification")
    return config_from_args(parser.parse_args(list(argv)), parser)


OPTION_FLAGS: list[tuple[list[str], dict[str, Any]]] = [
    (["--rank", "3"], {"rank": 3}),
    (["--rank-ratio", "0.3"], {"rank_ratio": 0.3}),
    (["--compression-ratio", "auto", "--rank-energy", "0.9", "--rank-cap", "0.5"], {"rank_ratio": "auto"}),
    (["--grad-error", "--grad-error-ratios", "0.5", "auto"], {"grad_error_ratios": (0.5, "auto")}),
    (["--skip-layers", "0", "Conv2d"], {"skip_layers": ("0", "Conv2d")}),
    (["--layer-solvers", "0=kfac", "fc.*=sngd"], {"layer_solvers": {"0": "kfac", "fc.*": "sngd"}}),
    (["--fidelity-budget", "0"], {"fidelity_budget": 0.0}),
    (["--critical-variant", "kis", "--stable-variant", "kid"], {"critical_variant": "kis", "stable_variant": "kid"}),
    (["--trend-decay", "0.5", "--critical-noise", "0"], {"trend_decay": 0.5, "critical_noise": 0.0}),
    (["--max-unfold-mb", "8", "--bucket-cap-mb", "5"], {"max_unfold_mb": 8.0, "bucket_cap_mb": 5.0}),
    (["--comm-flops-per-byte", "10", "--factor-update-freq", "2"], {"comm_flops_per_byte": 10.0}),
    (["--studies", "rank", "grad_norm", "--rank-every", "2", "--rank-top-k", "4"], {"studies": ("grad_norm", "rank")}),
    (["--grad-error", "--grad-error-methods", "sngd", "--grad-error-every", "3"], {"grad_error_methods": ("sngd",)}),
]


@pytest.mark.parametrize(("argv", "expected"), OPTION_FLAGS)
def test_each_generated_flag_reaches_the_preconditioner(
    argv: list[str], expected: dict[str, Any], tmp_path: Path
) -> None:
    cfg = _run(*argv, "--log-dir", str(tmp_path))
    assert {name: cfg.hylo[name] for name in expected} == expected
    pre = make_preconditioner(build_model("cnn"), cfg, lambda _step: 0.1, 8)
    assert pre is not None
    try:
        for name, value in cfg.hylo.items():
            assert pre.config.value(name) == value, name
    finally:
        pre.remove()


def test_the_engine_sets_its_options(tmp_path: Path) -> None:
    cfg = RunConfig(solver="hybrid", seed=7, log_dir=str(tmp_path), profiling=True, hylo={"adaptive": (1, 2, 3)})
    pre = make_preconditioner(build_model("cnn"), cfg, lambda _step: 0.25, 8, profile_append=True)
    assert pre is not None
    try:
        c = pre.config
        assert (c.value("seed"), c.value("iters_per_epoch"), c.value("profile_append")) == (7, 8, True)
        assert str(c.value("profile_dir")) == str(tmp_path) and c.value("lr")(0) == 0.25  # the scheduled lr
        assert c.value("solver_fn") is None
    finally:
        pre.remove()


@pytest.mark.parametrize(
    ("hylo_options", "message"),
    [
        ({"lr": 0.1}, "not a run's to give"),
        ({"seed": 1}, "not a run's to give"),
        ({"solver": "kfac"}, "not a run's to give"),
        ({"no_such_option": 1}, "unknown hylo option 'no_such_option'"),
        ({"rank_ratio": 2.0}, "rank_ratio must be in (0, 1]"),
        ({"studies": "rank"}, "studies must be a sequence, not a single string"),
    ],
)
def test_a_runs_hylo_options_are_checked(hylo_options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(solver="kfac", hylo=hylo_options)


def test_the_run_keeps_every_option_and_a_plain_run_none() -> None:
    cfg = RunConfig(solver="kfac", hylo={"kl_clip": 0, "adaptive": [0, 1, 2]})
    assert list(cfg.hylo) == [spec.name for spec in user_options()]  # hylo's order, every option
    assert cfg.hylo["kl_clip"] is None and cfg.hylo["adaptive"] == (0, 1, 2) and cfg.hylo["damping"] == 0.3
    assert RunConfig(**cfg.to_json()) == cfg
    assert RunConfig(solver=None).hylo == {}
    with pytest.raises(ValueError, match="need a solver"):
        RunConfig(solver=None, hylo={"damping": 1.0})
