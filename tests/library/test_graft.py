"""Grafting (``HyLoOptimizer(..., graft=True)``): hylo's direction at the length of AdamW's step.

docs/usage.md, "Grafting". The length is held to ``torch.optim.AdamW`` itself, stepping stand-in tensors on the same
raw gradients; the direction to hylo's own result, read from the gradients after ``preconditioner.step()``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hylo
from hylo.graft import GraftedSGD
from hylo_scripts.benchmarks.bench_ops import count
from tests.kit.checks import through_torch_save
from tests.kit.harness import run_distributed
from tests.kit.models import mlp
from tests.library.test_fsdp import full, make_data, make_model, options, shard
from tests.library.test_optimizer_form import loss_at, train

LR, DECAY, STEPS = 1e-2, 0.1, 6


def net(seed: int = 0, layers: int = 1) -> nn.Sequential:
    """:func:`mlp`'s layers, with ``layers`` − 1 more 6-wide Linear layers between them, and a LayerNorm (which
    AdamW trains)."""
    fc1, act, fc2 = mlp(seed)
    torch.manual_seed(seed)
    middle = [nn.Linear(6, 6, dtype=fc1.weight.dtype) for _ in range(layers - 1)]
    return nn.Sequential(fc1, nn.LayerNorm(6, dtype=fc1.weight.dtype), act, *middle, fc2)


def grafted(model: nn.Module, **options: Any) -> hylo.HyLoOptimizer:
    adamw = functools.partial(torch.optim.AdamW, lr=LR, weight_decay=DECAY, foreach=True)
    return hylo.HyLoOptimizer(model, adamw, graft=True, update_freq=2, **options)


def test_each_step_is_hylos_direction_at_adamws_length() -> None:
    """Every step of every parameter hylo preconditions is p ← (1 − lr·wd)·p − lr·‖a‖·V̂/‖V̂‖, with V̂ hylo's
    result and a the step ``torch.optim.AdamW`` takes on the same raw gradients (its moments since the first
    step; to 1e-6, the float32 step count of its bias corrections); the form's ``step()`` is this hand loop, bit
    for bit."""
    model, twin = net(), net()
    opt, form = grafted(model), grafted(twin)
    sgd = opt.optimizers[1]
    assert isinstance(sgd, GraftedSGD)
    mine = [p for group in sgd.param_groups for p in group["params"]]
    assert len(mine) == 4  # both Linear layers' weights and biases
    standins = [nn.Parameter(torch.zeros_like(p)) for p in mine]
    adamw = torch.optim.AdamW(standins, lr=1.0, weight_decay=0.0)
    for step in range(STEPS):
        opt.zero_grad()
        loss_at(model, step).backward()
        for standin, p in zip(standins, mine, strict=True):
            standin.grad = p.grad.clone()
        before = [standin.detach().clone() for standin in standins]
        adamw.step()
        lengths = [torch.linalg.vector_norm(s.detach() - b) for s, b in zip(standins, before, strict=True)]
        start = [p.detach().clone() for p in mine]
        sgd.observe()
        opt.preconditioner.step()
        directions = [p.grad.clone() for p in mine]
        for part in opt.optimizers:
            part.step()
        for p, p0, v, length in zip(mine, start, directions, lengths, strict=True):
            expected = (1 - LR * DECAY) * p0 - LR * length * v / torch.linalg.vector_norm(v)
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-9)
        train(twin, form, range(step, step + 1))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_it_differs_from_the_ungrafted_form_only_in_length_at_the_first_step() -> None:
    """From the same weights, the first grafted step of a preconditioned parameter is the ungrafted one rescaled
    (hylo's result is the same; only its length changes): cosine 1, length ratio ≠ 1."""
    plain_model, model = net(), net()
    adamw = functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.0)
    plain = hylo.HyLoOptimizer(plain_model, adamw, update_freq=2)
    opt = hylo.HyLoOptimizer(model, adamw, graft=True, update_freq=2)
    start = [p.detach().clone() for p in model.parameters()]
    train(plain_model, plain, range(1))
    train(model, opt, range(1))
    mine = {id(p) for group in opt.optimizers[1].param_groups for p in group["params"]}
    ratios = []
    for p, q, p0 in zip(model.parameters(), plain_model.parameters(), start, strict=True):
        a, b = (p.detach() - p0).flatten(), (q.detach() - p0).flatten()
        if id(p) in mine:
            assert float(F.cosine_similarity(a, b, dim=0)) == pytest.approx(1.0, abs=1e-12)
            ratios.append(float(a.norm() / b.norm()))
        else:  # AdamW's own parameters (the LayerNorm): the same step
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(ratios) == 4 and all(abs(r - 1.0) > 1e-3 for r in ratios)


def test_a_resumed_grafted_run_equals_the_uninterrupted_one() -> None:
    """The grafted SGD's moments (AdamW's keys) travel in ``state_dict``: a run saved after 3 steps and resumed by
    new objects ends bit for bit where the uninterrupted run does."""
    straight = net()
    train(straight, grafted(straight), range(STEPS))
    first = net()
    opt = grafted(first)
    train(first, opt, range(3))
    saved = through_torch_save({"model": first.state_dict(), "opt": opt.state_dict()})
    assert {"step", "exp_avg", "exp_avg_sq"} == set(saved["opt"]["state"][2])  # the first grafted parameter
    resumed = net(seed=1)
    resumed.load_state_dict(saved["model"])
    opt = grafted(resumed)
    opt.load_state_dict(saved["opt"])
    train(resumed, opt, range(3, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))


def test_a_state_of_the_other_kind_is_refused_and_changes_nothing() -> None:
    """A grafted form's state does not load into an ungrafted form, nor the other way: ``ValueError``, and the
    loading optimizer's states stay as they were."""
    models = [net(), net()]
    adamw = functools.partial(torch.optim.AdamW, lr=LR)
    opts = [hylo.HyLoOptimizer(models[0], adamw, graft=True), hylo.HyLoOptimizer(models[1], adamw)]
    for model, opt in zip(models, opts, strict=True):
        train(model, opt, range(2))
    for loading, saving in ((opts[0], opts[1]), (opts[1], opts[0])):
        before = loading.state_dict()
        with pytest.raises(ValueError, match="group 1"):
            loading.load_state_dict(saving.state_dict())
        after = loading.state_dict()
        assert after["hylo"]["checksum"] == before["hylo"]["checksum"]
        assert after["state"].keys() == before["state"].keys()
        for key, value in before["state"].items():
            assert all(torch.equal(after["state"][key][k], v) for k, v in value.items())


def test_what_grafting_refuses_at_construction() -> None:
    """``graft`` must be a bool; it needs a whole-step solver (a natural-gradient solver's result is scaled by the
    wrapped optimizer itself) and an optimizer whose groups hold AdamW's ``betas`` and ``eps``."""
    adamw = functools.partial(torch.optim.AdamW, lr=LR)
    with pytest.raises(ValueError, match="graft must be a bool"):
        hylo.HyLoOptimizer(net(), adamw, graft="adamw")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="solver 'kfac'"):
        hylo.HyLoOptimizer(net(), adamw, graft=True, solver="kfac")
    sgd = functools.partial(torch.optim.SGD, lr=LR)
    with pytest.raises(ValueError, match=r"holds no \['betas', 'eps'\]"):
        hylo.HyLoOptimizer(net(), sgd, graft=True, solver="kfac_adam")


class Bypassed(nn.Module):
    """``a``'s weight is used without its forward (as Mamba's ``dt_proj``): its hooks never capture rows."""

    def __init__(self) -> None:
        super().__init__()
        layers = net()
        self.a, self.b = cast(nn.Linear, layers[0]), cast(nn.Linear, layers[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(x @ self.a.weight.T + self.a.bias))


def test_a_parameter_handed_back_leaves_its_moments_behind() -> None:
    """A layer hylo captures no rows of goes back to AdamW at the first update; the grafted SGD drops its moments
    (AdamW keeps its own), and the state saves and loads."""
    model = Bypassed()
    opt = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=LR), graft=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, opt, range(3))
    sgd = opt.optimizers[1]
    assert [p for group in sgd.param_groups for p in group["params"]] == list(model.b.parameters())
    assert set(sgd.state) == set(model.b.parameters())
    assert set(opt.optimizers[0].state) == set(model.a.parameters())
    resumed = Bypassed()
    again = hylo.HyLoOptimizer(resumed, functools.partial(torch.optim.AdamW, lr=LR), graft=True)
    again.load_state_dict(through_torch_save(opt.state_dict()))
    assert set(again.optimizers[1].state) == set(resumed.b.parameters())


def test_grafting_costs_the_same_operations_for_4_or_16_equal_layers() -> None:
    """Grafting runs over lists: the 25 operations it adds to a step between updates do not grow with the layers
    (counted, not timed)."""
    added = []
    for layers in (4, 16):
        totals = []
        for graft in (True, False):
            model = net(layers=layers)
            opt = hylo.HyLoOptimizer(
                model, functools.partial(torch.optim.AdamW, lr=LR, foreach=True), graft=graft, update_freq=4
            )
            train(model, opt, range(2))
            opt.zero_grad()
            loss_at(model, 2).backward()
            totals.append(sum(count(opt.step).counts.values()))
        added.append(totals[0] - totals[1])
    assert added == [25, 25]  # docs/usage.md, "Grafting": 93 → 118 operations a step for 4 and for 16 layers


def _fsdp2_run(rank: int, world_size: int, xs: torch.Tensor, ys: torch.Tensor) -> dict[str, torch.Tensor]:
    """The grafted form on test_fsdp's model, each layer ``fully_shard``-ed over ``world_size`` ranks (none on
    one), rank p on its slice of each batch: the final whole parameters."""
    model = make_model(xs.dtype)
    sharded = shard(model, "layers") if world_size > 1 else model
    opt = hylo.HyLoOptimizer(sharded, functools.partial(torch.optim.AdamW, lr=LR), graft=True, **options("kfac_adam"))
    size = xs.shape[1] // world_size
    local = slice(rank * size, (rank + 1) * size)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        F.cross_entropy(sharded(x[local]), y[local]).backward()
        opt.step()
    return {name: full(p.detach()).clone() for name, p in model.named_parameters()}


def test_under_fsdp2_two_ranks_graft_as_one_process() -> None:
    """docs/distributed.md, "FSDP2": with sharded parameters each length is the norm over the whole parameter, so
    2 ranks end where one process does (float64, to 1e-10)."""
    xs, ys = make_data(4, 8, torch.float64)
    reference = _fsdp2_run(0, 1, xs, ys)
    for result in run_distributed(_fsdp2_run, 2, xs, ys, timeout=120):
        for name, want in reference.items():
            torch.testing.assert_close(result[name], want, rtol=1e-10, atol=1e-12, msg=name)
