"""Checkpoints: ``state_dict``/``load_state_dict`` of HyLoPreconditioner (hylo/preconditioner.py).

Round trips continue bit for bit (exact solvers, KIS/KID with their generator, the hybrid policy
with its gradient-norm trend); a state_dict that does not fit the model raises and changes nothing.
"""

from __future__ import annotations

import copy
import io
from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.integrity import seal
from tests.kit.checks import DT, assert_same_tensors, state_snapshot
from tests.kit.models import (
    classifier_convnet,
    classifier_inputs,
    classifier_mlp,
    mlp,
    regression_data,
    run,
    wide_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- exact solvers
@pytest.mark.parametrize("save_at", [3, 4], ids=["before-update-step", "between-updates"])
@pytest.mark.parametrize("solver", ["kfac", "sngd", "kfac_adam"])
def test_state_dict_round_trip_is_bit_exact(solver: str, save_at: int) -> None:
    options = {"solver": solver, "update_freq": 3, "damping": 0.1, "factor_decay": 0.8}

    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, HyLoPreconditioner]:
        model = mlp(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optimizer, HyLoPreconditioner(model, **options)

    model, optimizer, pre = make(0)
    run(model, pre, range(save_at), optimizer)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "pre": pre.state_dict()}, buffer)
    run(model, pre, range(save_at, 7), optimizer)

    buffer.seek(0)
    checkpoint = torch.load(buffer)  # weights_only=True: the state_dict holds plain data only
    model2, optimizer2, pre2 = make(1)
    model2.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["opt"])
    pre2.load_state_dict(checkpoint["pre"])
    run(model2, pre2, range(save_at, 7), optimizer2)

    for (name, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert_same_tensors(state_snapshot(pre), state_snapshot(pre2))


# --------------------------------------------------------------------------- low-rank solvers
def _training_run(
    solver: str, steps: int, save_at: int | None, resume: bytes | None = None
) -> tuple[list[Tensor], bytes | None]:
    """SGD + hylo (update_freq=2) on a fixed data stream; optionally checkpoint or resume."""
    data = [classifier_inputs("linear", 24, seed=50 + i) for i in range(steps)]
    model = classifier_mlp(seed=0 if resume is None else 123)  # the resumed run starts from other weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = HyLoPreconditioner(
        model, solver=solver, update_freq=2, rank_ratio=0.25, damping=0.1, seed=11 if resume is None else 0
    )
    start = 0
    if resume is not None:
        ckpt = torch.load(io.BytesIO(resume), weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        pre.load_state_dict(ckpt["hylo"])
        start = pre.steps
    saved = None
    for step in range(start, steps):
        if step == save_at:
            buffer = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hylo": pre.state_dict()},
                buffer,
            )
            saved = buffer.getvalue()
        x, y = data[step]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], saved


@pytest.mark.parametrize("save_at", [2, 3], ids=["before_update_step", "before_reuse_step"])
@pytest.mark.parametrize("solver", ["kis", "kid"])
def test_state_dict_round_trip_continues_bit_for_bit(solver: str, save_at: int) -> None:
    straight, checkpoint = _training_run(solver, 6, save_at)
    assert checkpoint is not None
    resumed, _ = _training_run(solver, 6, None, resume=checkpoint)
    assert all(torch.equal(s, r) for s, r in zip(straight, resumed, strict=True))
    again, _ = _training_run(solver, 6, None)  # the uninterrupted run itself is deterministic
    assert all(torch.equal(s, r) for s, r in zip(straight, again, strict=True))


@pytest.mark.parametrize("solver", ["sngd", "kid"])
def test_state_dict_round_trip_with_exact_conv_rows(solver: str) -> None:
    """Dense per-sample rows (``conv_rows="exact"``) are saved whole and resume bit for bit."""
    data = [classifier_inputs("conv", 12, seed=70 + i) for i in range(5)]

    def train(model: nn.Module, pre: HyLoPreconditioner, steps: range) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in steps:
            x, y = data[step]
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            optimizer.step()

    options = {"solver": solver, "update_freq": 2, "rank_ratio": 0.5, "damping": 0.1, "conv_rows": "exact"}
    model = classifier_convnet(seed=0)
    pre = HyLoPreconditioner(model, **options)
    train(model, pre, range(3))
    saved = pre.state_dict()
    assert any("u" in entry.get("tensors", {}) for entry in saved["layers"].values())
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "pre": saved}, buffer)
    train(model, pre, range(3, 5))
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model2 = classifier_convnet(seed=1)
    model2.load_state_dict(checkpoint["model"])
    pre2 = HyLoPreconditioner(model2, **options)
    pre2.load_state_dict(checkpoint["pre"])
    train(model2, pre2, range(3, 5))
    for (name, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q), name


# --------------------------------------------------------------------------- load_state_dict mismatches
def _renamed() -> nn.Module:
    return nn.Sequential(OrderedDict(l1=nn.Linear(4, 6, dtype=DT), act=nn.Tanh(), l2=nn.Linear(6, 3, dtype=DT)))


def _reshaped() -> nn.Module:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 5, dtype=DT), act=nn.Tanh(), fc2=nn.Linear(5, 3, dtype=DT)))


def _no_bias() -> nn.Module:
    return nn.Sequential(
        OrderedDict(fc1=nn.Linear(4, 6, bias=False, dtype=DT), act=nn.Tanh(), fc2=nn.Linear(6, 3, dtype=DT))
    )


def _extra_layer() -> nn.Module:
    model = mlp()
    model.add_module("fc3", nn.Linear(3, 3, dtype=DT))
    return model


@pytest.mark.parametrize("other", [_renamed, _reshaped, _no_bias, _extra_layer])
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_load_state_dict_from_other_model_raises_and_changes_nothing(
    solver: str, other: Callable[[], nn.Module]
) -> None:
    source_model = other()
    source = HyLoPreconditioner(source_model, solver=solver, update_freq=1)
    run(source_model, source, [0])
    saved = source.state_dict()

    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=2, damping=0.3)
    run(model, pre, range(3))
    before = copy.deepcopy(pre.state_dict())
    states_before = [info.state for info in pre.layer_info()]
    with pytest.raises(ValueError, match=r"layer|shape|d_a|d_g"):
        pre.load_state_dict(saved)
    assert_same_tensors(pre.state_dict(), before)
    assert all(info.state == old for info, old in zip(pre.layer_info(), states_before, strict=True))
    run(model, pre, [3])  # still usable


@pytest.mark.parametrize(("saved_solver", "solver"), [("sngd", "kfac"), ("kfac", "sngd")])
def test_load_state_dict_solver_mismatch_raises(saved_solver: str, solver: str) -> None:
    source_model = mlp()
    source = HyLoPreconditioner(source_model, solver=saved_solver, update_freq=1)
    run(source_model, source, [0])
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1)
    run(model, pre, [0])
    before = copy.deepcopy(pre.state_dict())
    with pytest.raises(ValueError, match="solver"):
        pre.load_state_dict(source.state_dict())
    assert_same_tensors(pre.state_dict(), before)


def test_load_state_dict_with_corrupt_tensor_shape_raises() -> None:
    source_model = mlp()
    source = HyLoPreconditioner(source_model, solver="sngd", update_freq=1)
    run(source_model, source, [0])
    saved = source.state_dict()
    saved["layers"]["fc1"]["tensors"]["a"] = saved["layers"]["fc1"]["tensors"]["a"][:, :-1]
    saved = seal(saved)  # the checksum matches: the shape check itself refuses
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    with pytest.raises(ValueError, match="fc1"):
        pre.load_state_dict(saved)
    assert all(info.state is None for info in pre.layer_info())


# --------------------------------------------------------------------------- hybrid policy with its trend
def _checkpoint_run(model: nn.Module, opt: torch.optim.Optimizer, pre: HyLoPreconditioner, steps: range) -> None:
    for step in steps:
        x, direction = regression_data(0, 32, 2, 64, seed=3)
        scale = 10.0 if step >= 6 else 1.0
        opt.zero_grad()
        (scale * (model(x) * direction).sum() + (model(x) ** 2).sum() * 0.01).backward()
        pre.step()
        opt.step()


def _checkpoint_parts(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, HyLoPreconditioner]:
    model = wide_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    # a 2-step window is too short for the noise floor to let the ×10 jump through (docs/hybrid-policy.md,
    # "Critical regime"): without it the jump at step 6 makes the layer critical
    pre = HyLoPreconditioner(
        model, solver="hybrid", update_freq=2, trend_window=2, trend_decay=0.5, critical_noise=0.0, rank_ratio=0.5
    )
    return model, opt, pre


@pytest.mark.parametrize("drop_trend", [False, True], ids=["full", "negative-control-without-trend"])
def test_state_dict_round_trip_with_hybrid(drop_trend: bool) -> None:
    """8 steps, update_freq=2; save after 4 steps, resume in fresh objects: identical continuation."""
    model_ref, opt_ref, pre_ref = _checkpoint_parts(0)
    _checkpoint_run(model_ref, opt_ref, pre_ref, range(8))
    reference = [(d.step, d.layer, d.solver) for d in pre_ref.decision_log]
    wide_solvers = {s: solver for s, layer, solver in reference if layer == "wide2"}
    assert wide_solvers == {0: "kid", 2: "kis", 4: "kis", 6: "kid"}  # the trend matters here

    model, opt, pre = _checkpoint_parts(0)
    _checkpoint_run(model, opt, pre, range(4))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "pre": pre.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    if drop_trend:
        del saved["pre"]["trend"]
        saved["pre"] = seal(saved["pre"])

    model2, opt2, pre2 = _checkpoint_parts(1)  # different initial parameters, all overwritten
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    pre2.load_state_dict(saved["pre"])
    assert pre2.steps == 4
    _checkpoint_run(model2, opt2, pre2, range(4, 8))
    resumed = [(d.step, d.layer, d.solver) for d in pre2.decision_log]
    if drop_trend:
        # not vacuous: without the trend state the layer looks like early training again (KID at step 4)
        assert (4, "wide2", "kid") in resumed and (4, "wide2", "kis") in reference
        return
    assert resumed == [r for r in reference if r[0] >= 4]
    for (key, p), p_ref in zip(model2.named_parameters(), model_ref.parameters(), strict=True):
        assert torch.equal(p, p_ref), key
    trend, trend_ref = pre2.state_dict()["trend"], pre_ref.state_dict()["trend"]
    assert torch.equal(trend["ema"], trend_ref["ema"]) and torch.equal(trend["ema_sq"], trend_ref["ema_sq"])
    assert trend["last_noise"] == trend_ref["last_noise"]
    assert trend["critical"] == trend_ref["critical"] and trend["history"] == trend_ref["history"]
