"""The gradient-norm trend and HyLo's adaptive windows (docs/design.md, "Hybrid policy"; hylo/policy.py).

1. Gradient-norm trend: stable → jump → stable drives KIS → KID → KIS with hysteresis; early
   training (before a full window) is critical; no host sync per layer.
2. ``adaptive=(a0, a1, a2)``: KID iff step < I·a0 or I·a1 < step ≤ I·a2, as HyLo's code counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from hylo import HyLoConfig, HyLoPreconditioner
from hylo.policy import GradNormTrend, SolverPolicy
from hylo.solvers import LayerShape
from tests.kit.checks import DT, grad_matrix
from tests.kit.models import regression_data, sequential, wide_model

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- helpers
def regression_step(model: nn.Module, x: Tensor, direction: Tensor, scale: float = 1.0) -> None:
    """Backward of ``scale · <model(x), direction>`` (grads zeroed first)."""
    model.zero_grad(set_to_none=False)
    (scale * (model(x) * direction).sum()).backward()


# ============================================================================ 1. gradient-norm trend
def test_grad_norm_trend_window_and_hysteresis_unit() -> None:
    """Sampling every 3 steps, window 5: reference = newest sample at least 5 steps old."""
    trend = GradNormTrend(2, decay=0.0, window=5, enter=0.2, exit_=0.1)  # decay 0: EMA = last norm
    # layer 0: 1, 1, 1, 1.15, 1.3225 (15 %/sample: hovers), 10 (jump), 10, 10
    # layer 1: constant 2 (stable once a window of history exists)
    norms0 = [1.0, 1.0, 1.0, 1.15, 1.15**2, 10.0, 10.0, 10.0, 10.0]
    results = []
    for k, value in enumerate(norms0):
        trend.observe(torch.tensor([value, 2.0], dtype=DT))
        results.append(trend.sample(3 * k))
    # steps 0 and 3: no sample 5 steps old → trend None, critical (early training)
    for k in (0, 1):
        _, trends, critical = results[k]
        assert trends == [None, None] and critical == [True, True]
    # step 6 compares with step 0, step 9 with step 3 (not step 0), ...
    _, trends, critical = results[2]
    assert trends == [0.0, 0.0] and critical == [False, False]
    _, trends, critical = results[3]  # 1.15 vs step 3's 1.0: 0.15 in (exit, enter) → stays KIS
    assert trends[0] == pytest.approx(0.15) and critical[0] is False
    _, trends, critical = results[4]  # 1.3225 vs 1.0 (step 6): 0.3225 > enter → critical
    assert trends[0] == pytest.approx(0.3225) and critical[0] is True
    _, trends, critical = results[5]  # 10 vs 1.15
    assert trends[0] == pytest.approx(10 / 1.15 - 1) and critical[0] is True
    _, trends, critical = results[6]  # 10 vs 1.3225: still critical
    assert critical[0] is True
    _, trends, critical = results[7]  # 10 vs 10 → back to KIS
    assert trends[0] == 0.0 and critical == [False, False]
    # hover while critical: a critical layer stays critical at 0.15
    t2 = GradNormTrend(1, decay=0.0, window=1, enter=0.2, exit_=0.1)
    for step, value in enumerate([1.0, 1.15, 1.15**2, 1.15**3, 1.0, 1.0]):
        t2.observe(torch.tensor([value], dtype=DT))
        _, trends, critical = t2.sample(step)
        expected = {0: True, 1: True, 2: True, 3: True, 4: True, 5: False}[step]
        assert critical == [expected], (step, trends)


def _reference_trend(norms: list[float], window: int, decay: float, enter: float, exit_: float) -> list[tuple]:
    """Independent trend/hysteresis model for update_freq=1: (ema, trend, critical) per step."""
    emas: list[float] = []
    critical = True
    out = []
    for t, norm in enumerate(norms):
        emas.append(norm if t == 0 else decay * emas[-1] + (1.0 - decay) * norm)
        trend = None
        if t >= window:
            trend = abs(emas[t] - emas[t - window]) / abs(emas[t - window])
            if critical and trend < exit_:
                critical = False
            elif not critical and trend > enter:
                critical = True
        out.append((emas[t], trend, critical))
    return out


def test_trend_stable_jump_stable_kis_kid_kis_with_hysteresis() -> None:
    """Gradient norm: stable, slow ramp (15 %/window), ×10 jump then ramp, stable.

    The wide layer goes KID (early) → KIS → stays KIS through the ramp (0.1 < change < 0.2)
    → KID at the jump → stays KID through the ramp → KIS once stable.
    """
    window, decay, enter, exit_ = 4, 0.5, 0.2, 0.1
    q = 1.15 ** (1.0 / window)
    scales = []
    for t in range(56):
        if t < 12:
            scales.append(1.0)
        elif t < 24:
            scales.append(q ** (t - 11))
        elif t < 40:
            scales.append(10.0 * q ** (t - 11))
        else:
            scales.append(10.0 * q**30)
    model = sequential(0, wide=nn.Linear(32, 48))
    x, direction = regression_data(0, 8, 32, 48)
    pre = HyLoPreconditioner(
        model,
        solver="hybrid",
        update_freq=1,
        trend_window=window,
        trend_decay=decay,
        critical_enter=enter,
        critical_exit=exit_,
    )
    norms = []
    for scale in scales:
        regression_step(model, x, direction, scale)
        norms.append(float(torch.linalg.vector_norm(grad_matrix(model.wide))))
        pre.step()
    log = list(pre.decision_log)
    assert [d.step for d in log] == list(range(56))
    assert all(d.cost_lowrank < d.cost_kfac for d in log)  # the cost model says low-rank throughout
    solvers = [d.solver for d in log]

    reference = _reference_trend(norms, window, decay, enter, exit_)
    for d, (_ema, trend, critical) in zip(log, reference, strict=True):
        if trend is None:
            assert d.trend is None
        else:
            assert d.trend == pytest.approx(trend, rel=1e-9, abs=1e-12)
            # the schedule stays clear of the thresholds: rounding cannot flip a decision
            assert min(abs(trend - enter), abs(trend - exit_)) > 1e-4
        assert d.critical is critical
        assert d.solver == ("kid" if critical else "kis")
        assert d.reason == ("critical" if critical else "stable")

    # early training (no full window of history): KID
    assert solvers[:window] == ["kid"] * window and all(d.trend is None for d in log[:window])
    assert solvers[window:24] == ["kis"] * (24 - window)
    assert solvers[24:40] == ["kid"] * 16
    assert solvers[-8:] == ["kis"] * 8
    flips = sum(a != b for a, b in itertools.pairwise(solvers))
    assert flips == 3, solvers  # KID→KIS, KIS→KID, KID→KIS: no flapping
    # hysteresis was exercised in both states: the change hovered between exit and enter
    hover_kis = [d.step for d in log[12:24] if exit_ < d.trend < enter and d.solver == "kis"]
    hover_kid = [d.step for d in log[24:40] if exit_ < d.trend < enter and d.solver == "kid"]
    assert len(hover_kis) >= 5 and len(hover_kid) >= 5, (hover_kis, hover_kid)
    # LayerStats.grad_norm semantics: the EMA (checked via the trend above); final value
    assert pre._policy.trend.ema is not None
    assert float(pre._policy.trend.ema[0]) == pytest.approx(reference[-1][0], rel=1e-12)


def test_trend_windows_count_steps_not_updates() -> None:
    """update_freq=3, window 6: the first comparison is at step 6 (against step 0)."""
    model = sequential(0, wide=nn.Linear(32, 48))
    x, direction = regression_data(0, 8, 32, 48)
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=3, trend_window=6, trend_decay=0.0)
    for step in range(13):
        regression_step(model, x, direction, 1.0 if step < 12 else 2.0)
        pre.step()
    log = list(pre.decision_log)
    assert [(d.step, d.solver) for d in log] == [(0, "kid"), (3, "kid"), (6, "kis"), (9, "kis"), (12, "kid")]
    assert [d.trend for d in log][:3] == [None, None, 0.0]
    assert log[-1].trend == pytest.approx(1.0)  # 2 vs step 6's 1


def test_trend_observe_and_sample_do_not_sync_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """observe: no host transfer at all; sample: one for all layers; a non-update step: one sync."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host sync inside GradNormTrend.observe")

    trend = GradNormTrend(5, decay=0.9, window=2, enter=0.2, exit_=0.1)
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
            m.setattr(torch.Tensor, name, forbidden)
        for step in range(4):
            trend.observe(torch.arange(1.0, 6.0) * (step + 1))
    assert trend.ema is not None and trend.ema.dtype == DT

    calls = {"item": 0, "tolist": 0}

    def counting(name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)

        def wrapper(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in calls:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    trend.sample(3)
    assert calls == {"item": 0, "tolist": 1}

    def syncs_per_step(n_layers: int) -> tuple[int, int]:
        """(syncs of a non-update step, syncs inside policy.decide at an update step)."""
        layers = {f"fc{i}": nn.Linear(6, 6) for i in range(n_layers)}
        model = sequential(0, **layers)
        pre = HyLoPreconditioner(model, solver="hybrid", update_freq=2, trend_window=1)
        x, direction = regression_data(0, 4, 6, 6)
        decide = pre._policy.decide
        in_decide = []

        def counted_decide(*args: Any, **kwargs: Any) -> Any:
            before = sum(calls.values())
            try:
                return decide(*args, **kwargs)
            finally:
                in_decide.append(sum(calls.values()) - before)

        pre._policy.decide = counted_decide  # type: ignore[method-assign]
        for step in range(3):
            regression_step(model, x, direction)
            before = sum(calls.values())
            pre.step()
            if step == 1:
                non_update = sum(calls.values()) - before
        return non_update, in_decide[-1]

    assert syncs_per_step(2) == syncs_per_step(6) == (1, 1)


# ============================================================================ 2. adaptive windows
def hylo_reference_flags(a0: int, a1: int, a2: int, iters_per_epoch: int, steps: int) -> list[str]:
    """HyLo's ngd.py loop: after each optimizer step ``steps += 1; randk = not (steps < I·a0 or
    (steps > I·a1 and steps <= I·a2))``; the update after s steps uses the flag computed at s."""
    i = iters_per_epoch
    count = 0
    randk = not (count < i * a0 or (count > i * a1 and count <= i * a2))
    flags = []
    for _ in range(steps):
        flags.append("kis" if randk else "kid")
        count += 1
        randk = not (count < i * a0 or (count > i * a1 and count <= i * a2))
    return flags


BOUNDARIES = {0: "kid", 19: "kid", 20: "kis", 50: "kis", 51: "kid", 70: "kid", 71: "kis", 90: "kis"}


def test_adaptive_windows_count_steps_as_hylo_does() -> None:
    """I = 10, (a0, a1, a2) = (2, 5, 7): KID iff step < 20 or 50 < step ≤ 70, through SolverPolicy."""
    config = HyLoConfig(adaptive=(2, 5, 7), iters_per_epoch=10)
    policy = SolverPolicy(config, ["wide"])
    expected = hylo_reference_flags(2, 5, 7, 10, 100)
    assert {s: expected[s] for s in BOUNDARIES} == BOUNDARIES
    wide = LayerShape(512, 512, rows=32, kfac_rows=32, kept=3)
    for step in range(100):
        assert ("kid" if policy.epoch_window_kid(step) else "kis") == expected[step], step
        (decision,) = policy.decide(step, [wide], 1, 1)
        assert decision.cost_lowrank < decision.cost_kfac
        assert (decision.solver, decision.reason) == (expected[step], "epoch window"), step
    # not the epoch (step // I) compared with a1, a2: those differ at the window edges
    by_epoch = ["kid" if s // 10 < 2 or 5 < s // 10 <= 7 else "kis" for s in range(100)]
    assert [s for s in range(100) if by_epoch[s] != expected[s]] == [*range(51, 60), *range(71, 80)]


def test_adaptive_windows_end_to_end() -> None:
    """HyLoPreconditioner(adaptive=(2, 5, 7), iters_per_epoch=10, update_freq=1) on a wide model."""
    a0, a1, a2, ipe, steps = 2, 5, 7, 10, 80
    model = wide_model()
    # trend_window=2 with a constant gradient would say "stable" from step 2 on: adaptive replaces it
    pre = HyLoPreconditioner(
        model, solver="hybrid", update_freq=1, adaptive=(a0, a1, a2), iters_per_epoch=ipe, trend_window=2
    )
    x, direction = regression_data(0, 32, 2, 64)
    for _ in range(steps):
        regression_step(model, x, direction)
        pre.step()
    expected = hylo_reference_flags(a0, a1, a2, ipe, steps)
    log = list(pre.decision_log)
    assert sorted({d.step for d in log}) == list(range(steps)) and len(log) == 3 * steps
    for d in log:
        if d.layer == "tiny":
            assert d.cost_kfac <= d.cost_lowrank
            assert (d.solver, d.reason) == ("kfac", "cost")
            continue
        assert d.cost_lowrank < d.cost_kfac, d
        assert (d.solver, d.reason) == (expected[d.step], "epoch window"), d
    wide2 = {d.step: d.solver for d in log if d.layer == "wide2"}
    assert {s: wide2[s] for s in BOUNDARIES if s < steps} == {s: v for s, v in BOUNDARIES.items() if s < steps}
    assert pre.solver_of("wide1") == "kis" and pre.solver_of("tiny") == "kfac"
