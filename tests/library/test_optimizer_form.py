"""hylo.HyLoOptimizer: the preconditioner and the user's optimizer as one torch.optim.Optimizer.

docs/usage.md, "The optimizer form". Each test holds it to the hand-written loop it stands for (the
preconditioner's ``step()`` between backward and the optimizer's), bit for bit on CPU.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hylo
from hylo.optimizer import NATURAL_UNDER_ADAPTIVE_DEFAULTS, PLAIN_DEFAULTS, adaptive_defaults, default_options
from hylo_scripts.benchmarks.bench_ops import count
from tests.kit.checks import through_torch_save
from tests.kit.models import batch, mlp

STEPS = 6

#: What HyLoOptimizer runs under AdamW when no solver is given (the bundled kfac_adam family declares it).
ADAPTIVE_DEFAULTS = adaptive_defaults() or {}


def net(seed: int = 0) -> nn.Sequential:
    """:func:`mlp`'s layers with a LayerNorm after the first (parameters hylo leaves to the optimizer)."""
    fc1, act, fc2 = mlp(seed)
    return nn.Sequential(fc1, nn.LayerNorm(6, dtype=fc1.weight.dtype), act, fc2)


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step, 16)
    return F.cross_entropy(model(x), y)


@torch.no_grad()
def evaluate(model: nn.Module, step: int) -> float:
    """The loss on batch ``step``, outside training (hylo captures nothing)."""
    return float(loss_at(model, step))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, scheduler: Any = None) -> None:
    """The stacks' loop: zero, backward, ``optimizer.step()`` (and the scheduler's)."""
    for step in steps:
        optimizer.zero_grad()
        loss_at(model, step).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def train_by_hand(model: nn.Module, pre: hylo.HyLoPreconditioner, optimizers: list[torch.optim.Optimizer]) -> None:
    """The hand-written loop of docs/usage.md: backward, ``pre.step()``, every optimizer's step."""
    for step in range(STEPS):
        for opt in optimizers:
            opt.zero_grad()
        loss_at(model, step).backward()
        pre.step()
        for opt in optimizers:
            opt.step()


def same_parameters(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# --------------------------------------------------------------------------- equal to the hand-written loop
def test_under_sgd_it_is_the_preconditioner_then_the_optimizer() -> None:
    """SGD with momentum: the optimizer form = ``pre.step()`` then ``sgd.step()`` with the same options."""
    options = {"solver": "kfac", "update_freq": 2}
    formed = net()
    opt = hylo.HyLoOptimizer(formed, torch.optim.SGD(formed.parameters(), lr=0.1, momentum=0.9), **options)
    train(formed, opt, range(STEPS))

    by_hand = net()
    sgd = torch.optim.SGD(by_hand.parameters(), lr=0.1, momentum=0.9)
    chosen = default_options(sgd, options) | {"lr": lambda _step: sgd.param_groups[0]["lr"]}
    train_by_hand(by_hand, hylo.HyLoPreconditioner(by_hand, **chosen), [sgd])
    assert same_parameters(formed, by_hand)
    assert opt.preconditioner.steps == STEPS


def test_under_adamw_it_makes_the_documented_split() -> None:
    """AdamW: kfac_adam on hylo's layers, stepped by SGD without momentum at the group's lr and decoupled weight
    decay; AdamW on the rest (docs/usage.md, "Adaptive solvers")."""
    formed = net()
    opt = hylo.HyLoOptimizer(formed, functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))
    assert opt.preconditioner.config.solver == "kfac_adam"
    adapted = opt.preconditioner.parameters()
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]  # AdamW: the LayerNorm; SGD: hylo's 4
    assert all(any(p is q for q in adapted) for p in opt.param_groups[1]["params"])
    train(formed, opt, range(STEPS))

    by_hand = net()
    pre = hylo.HyLoPreconditioner(by_hand, **ADAPTIVE_DEFAULTS)
    mine = pre.parameters()
    rest = [p for p in by_hand.parameters() if all(p is not q for q in mine)]
    sgd = torch.optim.SGD(mine, lr=1e-2, momentum=0.0, weight_decay=0.1)
    adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)
    train_by_hand(by_hand, pre, [adamw, sgd])
    assert same_parameters(formed, by_hand)


def test_a_closure_is_evaluated_before_the_preconditioner() -> None:
    """Lightning passes forward and backward as a closure: evaluated first, its loss returned."""
    formed, plain = net(), net()
    opt = hylo.HyLoOptimizer(formed, torch.optim.SGD(formed.parameters(), lr=0.1), solver="kfac")
    other = hylo.HyLoOptimizer(plain, torch.optim.SGD(plain.parameters(), lr=0.1), solver="kfac")
    for step in range(3):
        opt.zero_grad()

        def closure(step: int = step) -> torch.Tensor:
            loss = loss_at(formed, step)
            loss.backward()
            return loss

        returned = opt.step(closure)
        assert returned.item() == evaluate(plain, step)
        train(plain, other, range(step, step + 1))
    assert same_parameters(formed, plain)


# --------------------------------------------------------------------------- groups, schedulers, state
def test_param_groups_are_the_wrapped_optimizers_and_a_scheduler_scales_them() -> None:
    """The groups are the wrapped optimizer's own dicts; a LambdaLR on the form sets their lr, and kl_clip's lr is
    read from them at every step."""
    model = net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hylo.HyLoOptimizer(model, sgd)
    assert opt.param_groups[0] is sgd.param_groups[0] and opt.state is sgd.state
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    train(model, opt, range(3), scheduler)
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    lr = opt.preconditioner.config.lr
    assert callable(lr) and lr(0) == sgd.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), id="sgd"),
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), id="adamw-split"),
    ],
)
def test_a_resumed_run_equals_the_uninterrupted_one(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> None:
    """``state_dict`` carries the wrapped optimizers' state and hylo's: a run saved after 3 steps (through
    ``torch.load(weights_only=True)``) and resumed by new objects ends where the uninterrupted run does."""
    straight = net()
    opt = hylo.HyLoOptimizer(straight, make, update_freq=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    train(straight, opt, range(STEPS), scheduler)

    first = net()
    opt = hylo.HyLoOptimizer(first, make, update_freq=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    train(first, opt, range(3), scheduler)
    saved = through_torch_save({"model": first.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()})
    assert {"state", "param_groups", "hylo"} <= set(saved["opt"])

    resumed = net(seed=1)
    resumed.load_state_dict(saved["model"])
    opt = hylo.HyLoOptimizer(resumed, make, update_freq=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    opt.load_state_dict(saved["opt"])
    scheduler.load_state_dict(saved["sched"])
    assert opt.preconditioner.steps == 3
    train(resumed, opt, range(3, STEPS), scheduler)
    assert same_parameters(straight, resumed)


def test_a_state_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    """``load_state_dict`` checks every part before it changes any: a plain optimizer's state (no ``"hylo"``) and
    groups of other sizes raise ``ValueError``; hylo's state and the optimizer's stay as they were."""
    model = net()
    opt = hylo.HyLoOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), update_freq=1)
    train(model, opt, range(2))
    before = opt.state_dict()
    with pytest.raises(ValueError, match="'hylo'"):
        opt.load_state_dict(torch.optim.SGD(net().parameters(), lr=0.1).state_dict())
    wrong = dict(before)
    wrong["param_groups"] = [{**before["param_groups"][0], "params": before["param_groups"][0]["params"][:-1]}]
    with pytest.raises(ValueError, match="groups hold"):
        opt.load_state_dict(wrong)
    after = opt.state_dict()
    assert after["hylo"]["checksum"] == before["hylo"]["checksum"] and opt.preconditioner.steps == 2
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key]["momentum_buffer"], value["momentum_buffer"])


# --------------------------------------------------------------------------- defaults per base optimizer
def test_the_defaults_follow_the_wrapped_optimizer() -> None:
    """Adam-type → kfac_adam (the LM bench's settings); Adam-type with a natural-gradient solver named → a damping
    that turns the gradient; anything else → damping 0.3 and kl_clip at the optimizer's lr. Given options win."""
    params = list(net().parameters())
    adamw, sgd = torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1)
    assert default_options(adamw, {}) == ADAPTIVE_DEFAULTS | {"adam_betas": (0.9, 0.999), "adam_eps": 1e-8}
    assert default_options(adamw, {"solver": "kfac"}) == {"solver": "kfac", **NATURAL_UNDER_ADAPTIVE_DEFAULTS}
    assert default_options(sgd, {}) == PLAIN_DEFAULTS
    assert default_options(sgd, {"solver": "kfac_adam"}) == {"solver": "kfac_adam"}
    assert default_options(sgd, {"damping": 1.0})["damping"] == 1.0
    model = net()
    opt = hylo.HyLoOptimizer(model, torch.optim.RMSprop(model.parameters()), solver="sngd")
    assert (opt.preconditioner.config.solver, opt.preconditioner.config.damping) == ("sngd", 1e-3)
    tuned = torch.optim.AdamW(params, betas=(0.9, 0.95), eps=1e-6)  # kfac_adam takes Adam's constants from it
    assert default_options(tuned, {})["adam_betas"] == (0.9, 0.95) and default_options(tuned, {})["adam_eps"] == 1e-6
    assert default_options(tuned, {"adam_eps": 1e-3})["adam_eps"] == 1e-3
    given = hylo.HyLoConfig(solver="kfac")  # a config is taken as it is
    opt = hylo.HyLoOptimizer(net(), torch.optim.AdamW, config=given)
    assert opt.preconditioner.config.damping == given.damping


def test_under_adamw_the_defaults_do_something() -> None:
    """The optimizer form's defaults under AdamW move the loss away from plain AdamW's: after 12 steps by more than 4
    times what hylo's own defaults (K-FAC at damping 1, which AdamW rescales back) do (measured: 8 times)."""
    losses = []
    for options in ({}, {"solver": "kfac", "damping": 1.0}):
        model = net()
        train(model, hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2), **options), range(12))
        losses.append(evaluate(model, 99))
    plain = net()
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), range(12))
    formed, damped = (abs(loss - evaluate(plain, 99)) for loss in losses)
    assert formed > 4 * damped


# --------------------------------------------------------------------------- what it refuses
def test_what_it_refuses_at_construction() -> None:
    """Each with a ValueError naming the problem, and no hooks left on the model."""
    model = net()
    with pytest.raises(ValueError, match="does not hold"):
        hylo.HyLoOptimizer(model, torch.optim.SGD(list(model[0].parameters()), lr=0.1))
    with pytest.raises(ValueError, match="splits the parameters once"):
        hylo.HyLoOptimizer(model, torch.optim.AdamW, solver="hybrid", kfac_solver="kfac_adam")
    with pytest.raises(ValueError, match="maximize"):
        hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, maximize=True))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, stepped, range(1))
    with pytest.raises(ValueError, match="taken steps"):
        hylo.HyLoOptimizer(model, stepped)
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer"):
        hylo.HyLoOptimizer(model, lambda params: "adam")  # type: ignore[arg-type,return-value]
    wrapped = hylo.HyLoOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped.preconditioner.remove()
    with pytest.raises(ValueError, match="HyLoOptimizer already"):
        hylo.HyLoOptimizer(model, wrapped)
    # the refused constructions left no hooks: a plain step trains the model as without hylo
    fresh = hylo.HyLoOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), solver="kfac")
    train(model, fresh, range(2))
    assert fresh.preconditioner.steps == 2


def test_added_groups_go_to_the_wrapped_optimizer() -> None:
    """``add_param_group`` (Lightning's fine-tuning callbacks unfreeze this way) reaches the wrapped optimizer."""
    model = net()
    extra = nn.Parameter(torch.zeros(3, dtype=model[0].weight.dtype))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hylo.HyLoOptimizer(model, sgd)
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert sgd.param_groups[-1]["params"] == [extra] and opt.param_groups[-1] is sgd.param_groups[-1]


def test_a_grad_scaler_skipping_the_step_skips_hylo_too() -> None:
    """``scaler.step(optimizer)`` does not call the form's ``step()`` when it found infs: hylo's step is not taken
    either, and the next step runs as usual."""
    model = net()
    scaler = torch.amp.GradScaler("cpu")
    opt = hylo.HyLoOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=scaler, update_freq=1)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(loss_at(model, step)).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the skip is silent: the scaler reports it
            scaler.step(opt)
        scaler.update()
    assert opt.preconditioner.steps == 2


# --------------------------------------------------------------------------- layers hylo cannot precondition
class Bypassed(nn.Module):
    """``a``'s weight is used without its forward (as Mamba's ``dt_proj``): its hooks never capture rows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = net()[0], nn.LayerNorm(6, dtype=torch.float64), net()[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.norm(x @ self.a.weight.T + self.a.bias)))


def test_a_layer_without_rows_goes_back_to_the_wrapped_optimizer() -> None:
    """Under kfac_adam, a registered layer that captures no rows at the first update keeps its raw gradient: the
    form hands it back to AdamW (its own group) with a warning, so the run equals the hand loop that trains it with
    AdamW; a run resumed from a later ``state_dict`` keeps it there."""
    formed = Bypassed()
    opt = hylo.HyLoOptimizer(formed, functools.partial(torch.optim.AdamW, lr=1e-2))
    with pytest.warns(UserWarning, match=r"could not precondition \['a.weight', 'a.bias'\]"):
        train(formed, opt, range(1))
    assert [len(g["params"]) for g in opt.param_groups] == [4, 2]  # AdamW: the norm and a; SGD: b
    train(formed, opt, range(1, STEPS))

    by_hand = Bypassed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hylo's own warning about a's missing rows
        pre = hylo.HyLoPreconditioner(by_hand, **ADAPTIVE_DEFAULTS)
        mine = list(by_hand.b.parameters())
        adamw = torch.optim.AdamW([*by_hand.norm.parameters(), *by_hand.a.parameters()], lr=1e-2)
        train_by_hand(by_hand, pre, [adamw, torch.optim.SGD(mine, lr=1e-2, momentum=0.0, weight_decay=0.01)])
    assert same_parameters(formed, by_hand)

    first = Bypassed()
    opt = hylo.HyLoOptimizer(first, functools.partial(torch.optim.AdamW, lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(first, opt, range(3))
    saved = through_torch_save({"model": first.state_dict(), "opt": opt.state_dict()})
    assert saved["opt"]["returned"] == [0, 1]
    resumed = Bypassed()
    resumed.load_state_dict(saved["model"])
    opt = hylo.HyLoOptimizer(resumed, functools.partial(torch.optim.AdamW, lr=1e-2))
    opt.load_state_dict(saved["opt"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # handed back at the load: no second warning
        warnings.filterwarnings("ignore", message=".*captured")
        train(resumed, opt, range(3, STEPS))
    assert same_parameters(formed, resumed)


# --------------------------------------------------------------------------- what a step costs
@pytest.mark.parametrize("update", [True, False], ids=["update-step", "between-updates"])
def test_a_step_dispatches_exactly_the_hand_loops_operations(update: bool) -> None:
    """Under AdamW (the kfac_adam split), the form's ``step()`` dispatches the operations of ``pre.step()``, AdamW's
    and the SGD's steps of the hand-written loop and no others (counted, not timed), at an update and between."""
    counts = []
    for form in (True, False):
        model = net()
        if form:
            opt: Any = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2, foreach=True))
            pre, parts = opt.preconditioner, [opt]
        else:
            pre = hylo.HyLoPreconditioner(model, **ADAPTIVE_DEFAULTS)
            mine = pre.parameters()
            rest = [p for p in model.parameters() if all(p is not q for q in mine)]
            sgd = torch.optim.SGD(mine, lr=1e-2, momentum=0.0, weight_decay=0.01, foreach=True)
            parts = [torch.optim.AdamW(rest, lr=1e-2, foreach=True), sgd]

        def stepped(form: bool = form, parts: list[Any] = parts, pre: hylo.HyLoPreconditioner = pre) -> None:
            if not form:
                pre.step()
            for part in parts:
                part.step()

        steps = ADAPTIVE_DEFAULTS["update_freq"] + (0 if update else 1)
        for step in range(steps + 1):  # past the first update, to the next update or the step after it
            for part in parts:
                part.zero_grad()
            loss_at(model, step).backward()
            if step < steps:
                stepped()

        counted = count(stepped).counts
        for marker in ("_record_function_enter_new", "_record_function_exit"):  # the form's own profiler range
            counted[marker] -= 1 if form else 0
        counts.append(counted)
    assert counts[0] == counts[1] and sum(counts[0].values()) > 0


# --------------------------------------------------------------------------- GradScaler, maximize, added groups
def test_a_wired_grad_scaler_gives_the_unscaled_run() -> None:
    """``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()`` with the scaler given as
    ``grad_scaler=``: the unscaled run, bit for bit (a power-of-two scale is exact), under SGD and the split."""
    for make, options in (
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"solver": "kfac", "update_freq": 1}),
        (functools.partial(torch.optim.AdamW, lr=1e-2), {"update_freq": 1}),
    ):
        plain, scaled = net(), net()
        train(plain, hylo.HyLoOptimizer(plain, make, **options), range(STEPS))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        opt = hylo.HyLoOptimizer(scaled, make, grad_scaler=scaler, **options)
        for step in range(STEPS):
            opt.zero_grad()
            scaler.scale(loss_at(scaled, step)).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == 2.0**13  # it grew: the run saw three scales
        assert same_parameters(scaled, plain)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, maximize=True), id="sgd"),
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True), id="adamw-kfac"),
    ],
)
def test_maximize_is_the_hand_loop_with_maximize(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
    """``maximize=True`` in the wrapped optimizer (a natural-gradient solver): the preconditioner, then the
    optimizer ascending, as the hand loop does; and the run ascends (the loss grows)."""
    options = {"solver": "kfac", "update_freq": 2, "damping": 0.3}
    formed = net()
    train(formed, hylo.HyLoOptimizer(formed, make, **options), range(STEPS))
    by_hand = net()
    opt = make(list(by_hand.parameters()))
    chosen = default_options(opt, options) | {"lr": lambda _step: opt.param_groups[0]["lr"]}
    train_by_hand(by_hand, hylo.HyLoPreconditioner(by_hand, **chosen), [opt])
    assert same_parameters(formed, by_hand)
    assert evaluate(formed, 0) > evaluate(net(), 0)


def test_maximize_in_a_group_under_the_split_is_refused() -> None:
    """Adam in K-FAC's eigenbasis descends: ``maximize=True`` is refused under the split wherever it is set — the
    defaults, one group, a group added later, a loaded state."""
    model = net()
    groups = [{"params": list(model[0].parameters()), "maximize": True}, {"params": list(model[1:].parameters())}]
    with pytest.raises(ValueError, match="maximize"):
        hylo.HyLoOptimizer(model, torch.optim.AdamW(groups, lr=1e-2))
    opt = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2))
    with pytest.raises(ValueError, match="maximize"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=model[0].weight.dtype))], "maximize": True})
    train(model, opt, range(2))
    saved = opt.state_dict()
    saved["param_groups"][0]["maximize"] = True
    with pytest.raises(ValueError, match=r"groups \[0\] hold maximize=True"):
        opt.load_state_dict(saved)


def test_a_group_with_a_parameter_it_holds_is_refused() -> None:
    """Under the split hylo's parameters are in the SGD's groups, which AdamW does not see: adding one of them again
    (it would be stepped twice) is a ValueError naming it, and nothing is added."""
    model = net()
    opt = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2))
    sizes = [len(g["params"]) for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"already in a group.*'3.weight', 1"):
        opt.add_param_group({"params": model[3].weight})
    with pytest.raises(ValueError, match=r"already in a group.*'1.bias', 0"):
        opt.add_param_group({"params": iter([model[1].bias])})
    assert [len(g["params"]) for g in opt.param_groups] == sizes


class Grown(nn.Module):
    """:func:`net` and a head added later (unfrozen by a fine-tuning callback): ``extra`` joins after construction."""

    def __init__(self) -> None:
        super().__init__()
        self.body = net()
        torch.manual_seed(5)
        self.extra = nn.Linear(3, 3, dtype=self.body[0].weight.dtype)
        self.extra.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.body(x))


@pytest.mark.parametrize("split", [False, True], ids=["sgd", "adamw-split"])
def test_an_added_group_is_trained_by_the_wrapped_optimizer_and_resumes(split: bool) -> None:
    """A layer frozen at construction (so not registered by hylo) and added with ``add_param_group`` after 2 steps:
    the wrapped optimizer trains it with its raw gradient, as the hand loop's optimizer does; a run saved after 4
    steps and resumed (the group added again before the load) ends where the uninterrupted one does."""

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if split:
            return torch.optim.AdamW(params, lr=1e-2)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    options = {"update_freq": 2} | ({} if split else {"solver": "kfac"})

    def run(model: Grown, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            if step == 2:
                model.extra.requires_grad_(True)
                opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.05})
            opt.zero_grad()
            loss_at(model, step).backward()
            opt.step()

    formed = Grown()
    opt = hylo.HyLoOptimizer(formed, make, **options)
    assert all(info.name.startswith("body") for info in opt.preconditioner.layer_info())
    run(formed, opt, range(STEPS))

    by_hand = Grown()
    chosen = default_options(make([nn.Parameter(torch.zeros(1))]), options)
    pre = hylo.HyLoPreconditioner(by_hand, **chosen | {"lr": lambda _step: base.param_groups[0]["lr"]})
    mine = pre.parameters() if split else []
    rest = [p for p in by_hand.body.parameters() if all(p is not q for q in mine)]
    base = make(rest)
    parts = [base, torch.optim.SGD(mine, lr=1e-2, momentum=0.0, weight_decay=0.01)] if split else [base]
    for step in range(STEPS):
        if step == 2:
            by_hand.extra.requires_grad_(True)
            base.add_param_group({"params": list(by_hand.extra.parameters()), "lr": 0.05})
        for part in parts:
            part.zero_grad()
        loss_at(by_hand, step).backward()
        pre.step()
        for part in parts:
            part.step()
    assert same_parameters(formed, by_hand)

    first = Grown()
    opt = hylo.HyLoOptimizer(first, make, **options)
    run(first, opt, range(4))
    saved = through_torch_save({"model": first.state_dict(), "opt": opt.state_dict()})
    resumed = Grown()
    resumed.load_state_dict(saved["model"])
    opt = hylo.HyLoOptimizer(resumed, make, **options)
    resumed.extra.requires_grad_(True)
    opt.add_param_group({"params": list(resumed.extra.parameters()), "lr": 0.05})
    opt.load_state_dict(saved["opt"])
    run(resumed, opt, range(4, STEPS))
    assert same_parameters(formed, resumed)
