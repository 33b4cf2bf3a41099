"""The gradient-norm trend and HyLo's adaptive windows (docs/hybrid-policy.md, "Critical regime", "Adaptive windows"; hylo/policy.py).

1. Bookkeeping: the reference is the newest sample at least a window old; hysteresis; early
   training is critical; the default decay's memory is the window.
2. Noise: on a stationary but noisy norm sequence (i.i.d. exponential: mean 1, mean
   |x_t − x_{t−1}| = 1) the default detector flips at most 3 times per 300 updates, updating
   every step or every 10th; the old setting (decay 0.9, no noise floor) flips far more.
3. A 10× drop of the level turns the layer critical within one window, stable again once the
   level is steady.
4. Through the preconditioner: stable → ramp → jump → stable against an independent model of
   the rule; windows count steps, not updates.
5. No host sync per layer; ``state_dict`` round trip, older states without the squared EMA.
6. ``adaptive=(a0, a1, a2)``: KID iff step < I·a0 or I·a1 < step ≤ I·a2, as HyLo's code counts.
"""

from __future__ import annotations

import io
import itertools
import math
import random
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from hylo import HyLoConfig, HyLoPreconditioner
from hylo.config import PolicyConfig
from hylo.layers import LayerShape
from hylo.policy import SolverPolicy, in_critical_window
from hylo.trend import NORM_CAP, GradNormTrend
from tests.kit.checks import DT, HOST_SYNCS, counting_host_syncs, grad_matrix
from tests.kit.models import regression_data, sequential, wide_model

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- helpers
def regression_step(model: nn.Module, x: Tensor, direction: Tensor, scale: float = 1.0) -> None:
    """Backward of ``scale · <model(x), direction>`` (grads zeroed first)."""
    model.zero_grad(set_to_none=False)
    (scale * (model(x) * direction).sum()).backward()


def noisy_norms(steps: int, seed: int = 0) -> list[float]:
    """I.i.d. exponential values (mean 1, std 1, mean |x_t − x_{t−1}| = 1), independent of torch's RNG."""
    rng = random.Random(seed)
    return [-math.log(1.0 - rng.random()) for _ in range(steps)]


class BoundTrend:
    """A :class:`GradNormTrend` of ``n`` layers called with the policy options a preconditioner would pass."""

    def __init__(self, n: int, **options: Any) -> None:
        self.trend = GradNormTrend(n)
        self.config = PolicyConfig(**options)

    @property
    def decay(self) -> float:
        return self.config.decay

    def observe(self, norms: torch.Tensor, present: torch.Tensor | None = None) -> None:
        self.trend.observe(norms, self.config.decay, present)

    def sample(self, step: int) -> tuple[list[float], list[float | None], list[bool]]:
        return self.trend.sample(step, self.config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trend, name)


def config_trend(**options: Any) -> BoundTrend:
    """A one-layer trend with the hybrid policy's ``options`` (defaults otherwise)."""
    return BoundTrend(1, **options)


def run_trend(trend: BoundTrend, norms: list[float], update_freq: int) -> list[tuple[int, float | None, bool]]:
    """Observe every step, sample every ``update_freq``-th: (step, trend, critical) per sample."""
    out = []
    for step, norm in enumerate(norms):
        trend.observe(torch.tensor([norm], dtype=DT))
        if step % update_freq == 0:
            _, trends, critical = trend.sample(step)
            out.append((step, trends[0], critical[0]))
    return out


def flips(flags: list[bool]) -> int:
    return sum(a != b for a, b in itertools.pairwise(flags))


def reference_trend(
    norms: list[float], window: int, decay: float | None, enter: float, exit_: float, z: float, update_freq: int = 1
) -> list[tuple[int, float | None, float | None, bool]]:
    """Independent model of the rule: (step, trend, noise, critical) per sample.

    EMAs m of x and q of x² (decay 1 − 2/(W + 1) by default); at samples t = |m − m_ref| / |m_ref|
    against the newest sample at least W steps old, noise s = sqrt(2 (1 − β)/(1 + β) · max(v, v_ref))
    / |m_ref| with v = q − m²; critical above max(enter, z·s), stable below max(exit, z·s/2).
    """
    beta = 1.0 - 2.0 / (window + 1) if decay is None else decay
    m = q = 0.0
    samples: list[tuple[int, float, float]] = []
    critical = True
    out: list[tuple[int, float | None, float | None, bool]] = []
    for step, x in enumerate(norms):
        m, q = (x, x * x) if step == 0 else (beta * m + (1 - beta) * x, beta * q + (1 - beta) * x * x)
        if step % update_freq:
            continue
        v = max(q - m * m, 0.0)
        old = [s for s in samples if s[0] <= step - window]
        samples.append((step, m, v))
        if not old:
            out.append((step, None, None, critical))
            continue
        _, m_ref, v_ref = old[-1]
        trend = abs(m - m_ref) / abs(m_ref)
        noise = math.sqrt(2 * (1 - beta) / (1 + beta) * max(v, v_ref)) / abs(m_ref)
        if critical and trend < max(exit_, z * noise / 2):
            critical = False
        elif not critical and trend > max(enter, z * noise):
            critical = True
        out.append((step, trend, noise, critical))
    return out


# ============================================================================ 1. bookkeeping
def test_default_decay_memory_is_the_window() -> None:
    assert HyLoConfig().policy.trend_decay is None and HyLoConfig().policy.critical_noise == 3.0
    assert config_trend().decay == pytest.approx(1 - 2 / 101)
    assert config_trend(trend_window=9).decay == pytest.approx(0.8)
    assert config_trend(trend_window=9, trend_decay=0.5).decay == 0.5
    assert config_trend(trend_window=1).decay == 0.0
    # the EMA's effective memory (1 + β)/(1 − β) is the window
    beta = config_trend(trend_window=40).decay
    assert (1 + beta) / (1 - beta) == pytest.approx(40)


def test_grad_norm_trend_window_and_hysteresis_unit() -> None:
    """Sampling every 3 steps, window 5: reference = newest sample at least 5 steps old."""
    trend = BoundTrend(2, trend_decay=0.0, trend_window=5)  # decay 0: EMA = last norm, no noise
    # layer 0: 1, 1, 1, 1.15, 1.3225 (15 %/sample: hovers), 10 (jump), 10, 10
    # layer 1: constant 2 (stable once a window of history exists)
    norms0 = [1.0, 1.0, 1.0, 1.15, 1.15**2, 10.0, 10.0, 10.0, 10.0]
    results = []
    for k, value in enumerate(norms0):
        trend.observe(torch.tensor([value, 2.0], dtype=DT))
        results.append(trend.sample(3 * k))
        if k >= 2:
            assert trend.last_noise == [0.0, 0.0]  # one value per window: nothing measured as noise
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
    t2 = BoundTrend(1, trend_decay=0.0, trend_window=1)
    for step, value in enumerate([1.0, 1.15, 1.15**2, 1.15**3, 1.0, 1.0]):
        t2.observe(torch.tensor([value], dtype=DT))
        _, trends, critical = t2.sample(step)
        expected = {0: True, 1: True, 2: True, 3: True, 4: True, 5: False}[step]
        assert critical == [expected], (step, trends)


def test_noise_floor_raises_both_thresholds() -> None:
    """Same trend, different noise: z·s > enter keeps a layer stable, z·s/2 > exit lets it leave."""
    # two layers whose EMAs move by the same 30 % over the window; layer 1 alternates ±0.9 around it
    trend = BoundTrend(2, trend_decay=0.5, trend_window=4)
    critical = []
    for step in range(12):
        level = 1.0 if step < 8 else 1.3
        wiggle = 0.9 * (-1) ** step
        trend.observe(torch.tensor([level, level + wiggle], dtype=DT))
        critical.append(trend.sample(step)[2])
    noise = trend.last_noise
    assert noise[0] is not None and noise[1] is not None
    assert 3.0 * noise[1] > 0.2 > 3.0 * noise[0]
    # both left early training; only the quiet layer sees the 30 % step as critical
    assert critical[7] == [False, False]
    assert critical[-1] == [True, False]


# ============================================================================ 2. noise
@pytest.mark.parametrize("update_freq", [1, 10])
def test_stationary_noise_flips_at_most_three_times_per_300_updates(update_freq: int) -> None:
    """Defaults (window 100, matched decay, z = 3) on a stationary noisy norm: ≤ 3 flips in 300 updates."""
    norms = noisy_norms(300 * update_freq)
    mean = sum(norms) / len(norms)
    spread = sum(abs(b - a) for a, b in itertools.pairwise(norms)) / (len(norms) - 1) / mean
    assert 0.9 < mean < 1.1 and 0.9 < spread < 1.1  # relative step-to-step spread ≈ 1

    out = run_trend(config_trend(), norms, update_freq)
    flags = [c for _, _, c in out]
    assert len(flags) == 300
    assert flips(flags) <= 3, [s for (s, _, a), (_, _, b) in itertools.pairwise(out) if a != b]
    assert flags[0] and not flags[-1]  # critical in early training only
    # the independent model agrees, and its noise floor is what holds the layer: z·s > enter
    reference = reference_trend(norms, 100, None, 0.2, 0.1, 3.0, update_freq)
    assert [c for *_, c in reference] == flags
    for (_, t, _), (_, t_ref, _, _) in zip(out, reference, strict=True):
        assert (t is None and t_ref is None) or t == pytest.approx(t_ref, rel=1e-9, abs=1e-12)
    noisy = [s for _, _, s, _ in reference if s is not None]
    assert sum(3.0 * s > 0.2 for s in noisy) > 0.9 * len(noisy)


@pytest.mark.parametrize("update_freq", [1, 10])
def test_old_setting_flaps_on_the_same_noise(update_freq: int) -> None:
    """Negative control: decay 0.9 (≈10-step memory) and no noise floor flip far more often."""
    norms = noisy_norms(300 * update_freq)
    old = [c for _, _, c in run_trend(config_trend(trend_decay=0.9, critical_noise=0.0), norms, update_freq)]
    new = [c for _, _, c in run_trend(config_trend(), norms, update_freq)]
    assert flips(old) >= 20 and flips(old) >= 10 * flips(new), (flips(old), flips(new))


# ============================================================================ 3. a 10× drop
@pytest.mark.parametrize("update_freq", [1, 10])
def test_tenfold_drop_turns_critical_within_a_window_then_stable(update_freq: int) -> None:
    """Level 10 for 800 steps, then 1 (same relative noise): critical within a window, then stable."""
    window, drop, steps = 100, 800, 1600
    noise = noisy_norms(steps, seed=1)
    norms = [10.0 * x for x in noise[:drop]] + noise[drop:]
    out = [(s, c) for s, _, c in run_trend(config_trend(), norms, update_freq)]
    assert not any(c for s, c in out if drop - window <= s < drop)  # stable before the drop
    deadline = min(s for s, _ in out if s >= drop + window)  # first sample a full window after the drop
    turned = min(s for s, c in out if s >= drop and c)
    assert turned <= deadline, (turned, deadline)
    settled = min(s for s, c in out if s > turned and not c)
    assert settled - drop <= 4 * window, settled
    assert not any(c for s, c in out if s >= steps - 2 * window)  # stable at the end


# ============================================================================ 4. through the preconditioner
def test_trend_stable_ramp_jump_stable_kis_kid_kis_with_hysteresis() -> None:
    """Gradient norm: stable, slow ramp (15 %/window), ×10 jump then ramp, stable; window 8.

    The wide layer goes KID (early) → KIS → stays KIS through the ramp (0.1 < change < 0.2)
    → KID within the window after the jump → stays KID through the ramp → KIS once stable.
    """
    window, enter, exit_ = 8, 0.2, 0.1
    q = 1.15 ** (1.0 / window)
    ramp, jump, steady, end = 3 * window, 6 * window, 10 * window, 13 * window
    scales = []
    for t in range(end):
        if t < ramp:
            scales.append(1.0)
        elif t < jump:
            scales.append(q ** (t - ramp + 1))
        elif t < steady:
            scales.append(10.0 * q ** (t - ramp + 1))
        else:
            scales.append(10.0 * q ** (steady - ramp))
    model = sequential(0, wide=nn.Linear(32, 48))
    x, direction = regression_data(0, 8, 32, 48)
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=1, trend_window=window)
    norms = []
    for scale in scales:
        regression_step(model, x, direction, scale)
        norms.append(float(torch.linalg.vector_norm(grad_matrix(model.wide))))
        pre.step()
    log = list(pre.decision_log)
    assert [d.step for d in log] == list(range(end))
    assert all(d.cost_lowrank < d.cost_kfac for d in log)  # the cost model says low-rank throughout
    solvers = [d.solver for d in log]

    reference = reference_trend(norms, window, None, enter, exit_, 3.0)
    for d, (_step, trend, noise, critical) in zip(log, reference, strict=True):
        if trend is None or noise is None:
            assert d.trend is None
        else:
            assert d.trend == pytest.approx(trend, rel=1e-9, abs=1e-12)
            # the schedule stays clear of the thresholds: rounding cannot flip a decision
            bars = (max(enter, 3 * noise), max(exit_, 1.5 * noise))
            assert min(abs(trend - bar) for bar in bars) > 1e-4, (d.step, trend, bars)
        assert d.critical is critical
        assert d.solver == ("kid" if critical else "kis")
        assert d.reason == ("critical" if critical else "stable")

    # early training (no full window of history): KID
    assert solvers[:window] == ["kid"] * window and all(d.trend is None for d in log[:window])
    assert solvers[window:jump] == ["kis"] * (jump - window)
    turned = solvers.index("kid", jump)
    assert turned - jump < window
    assert solvers[turned:steady] == ["kid"] * (steady - turned)
    assert solvers[-2 * window :] == ["kis"] * (2 * window)
    assert flips(solvers) == 3, solvers  # KID→KIS, KIS→KID, KID→KIS: no flapping
    # hysteresis was exercised in both states: the change hovered between exit and enter
    hover_kis = [d.step for d in log[ramp:jump] if exit_ < d.trend < enter and d.solver == "kis"]
    hover_kid = [d.step for d in log[turned:steady] if exit_ < d.trend < enter and d.solver == "kid"]
    assert len(hover_kis) >= 5 and len(hover_kid) >= 5, (hover_kis, hover_kid)
    # LayerStats.grad_norm semantics: the EMA (checked via the trend above); final value
    grad_norm = pre.layer_info()[0].grad_norm  # the trend's EMA of ‖∇W‖
    assert grad_norm is not None
    beta = 1 - 2 / (window + 1)
    ema = norms[0]
    for norm in norms[1:]:
        ema = beta * ema + (1 - beta) * norm
    assert grad_norm == pytest.approx(ema, rel=1e-12)


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


# ============================================================================ 5. syncs and state
def test_trend_observe_and_sample_do_not_sync_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """observe: no host transfer at all; sample: one for all layers; a non-update step: one sync."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host sync inside GradNormTrend.observe")

    trend = BoundTrend(5, trend_decay=None, trend_window=2)
    with monkeypatch.context() as m:
        for name in HOST_SYNCS:
            m.setattr(torch.Tensor, name, forbidden)
        for step in range(4):
            trend.observe(torch.arange(1.0, 6.0) * (step + 1))
    assert trend.ema is not None and trend.ema.dtype == DT
    assert trend.ema_sq is not None and trend.ema_sq.dtype == DT
    trend.sample(0)

    with counting_host_syncs(monkeypatch, ("item", "tolist")) as calls:
        trend.sample(3)
        assert calls == {"item": 0, "tolist": 1}
        assert all(noise is not None for noise in trend.last_noise)  # the noise came with that one transfer
        assert _syncs_per_step(2, calls) == _syncs_per_step(6, calls) == (1, 1)


def _syncs_per_step(n_layers: int, calls: dict[str, int]) -> tuple[int, int]:
    """(syncs of a non-update step, syncs inside policy.decide at an update step)."""
    layers = {f"fc{i}": nn.Linear(6, 6) for i in range(n_layers)}
    model = sequential(0, **layers)
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=2, trend_window=1)
    x, direction = regression_data(0, 4, 6, 6)
    decide = SolverPolicy.decide
    in_decide = []

    def counted_decide(policy: SolverPolicy, *args: Any, **kwargs: Any) -> Any:
        before = sum(calls.values())
        try:
            return decide(policy, *args, **kwargs)
        finally:
            in_decide.append(sum(calls.values()) - before)

    with pytest.MonkeyPatch.context() as patched:  # this preconditioner's policy is the only one deciding here
        patched.setattr(SolverPolicy, "decide", counted_decide)
        for step in range(3):
            regression_step(model, x, direction)
            before = sum(calls.values())
            pre.step()
            if step == 1:
                non_update = sum(calls.values()) - before
    return non_update, in_decide[-1]


def _moments(pre: HyLoPreconditioner) -> Tensor | None:
    """The trend's EMAs of ‖∇W‖ and ‖∇W‖², one row each, as ``pre`` saves them (None before the first step)."""
    trend = pre.state_dict()["trend"]
    return None if trend["ema"] is None else torch.stack((trend["ema"], trend["ema_sq"]))


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through torch.save / torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_trend_state_dict_round_trip() -> None:
    """Save mid-run, load into a fresh trend: the continuation is identical, noise included."""
    norms = [3.0 * x for x in noisy_norms(120, seed=2)] + noisy_norms(80, seed=3)
    reference = config_trend(trend_window=20)
    expected = run_trend(reference, norms, 5)
    first = config_trend(trend_window=20)
    before = run_trend(first, norms[:100], 5)
    resumed = config_trend(trend_window=20)
    resumed.load_state_dict(_saved(first.state_dict()), torch.device("cpu"))
    assert resumed.moments is not None and first.moments is not None
    assert torch.equal(resumed.moments, first.moments)
    after = []
    for step in range(100, 200):
        resumed.observe(torch.tensor([norms[step]], dtype=DT))
        if step % 5 == 0:
            _, trends, critical = resumed.sample(step)
            after.append((step, trends[0], critical[0]))
    assert before + after == expected
    assert {c for *_, c in expected} == {True, False}  # the flags matter here
    assert resumed.last_noise == reference.last_noise and list(resumed.history) == list(reference.history)
    assert reference.moments is not None and torch.equal(resumed.moments, reference.moments)


def test_trend_loads_a_state_without_the_squared_ema() -> None:
    """An older state (no ``ema_sq``, no per-sample variance, no ``last_noise``): noise starts unknown."""
    first = config_trend(trend_window=4)
    run_trend(first, [1.0, 1.5, 0.5, 1.2, 0.8, 1.1, 0.9], 2)
    state = first.state_dict()
    old = {
        "ema": state["ema"],
        "history": [(step, ema) for step, ema, _variance in state["history"]],
        "critical": state["critical"],
        "last_trend": state["last_trend"],
    }
    loaded = config_trend(trend_window=4)
    loaded.load_state_dict(_saved(old), torch.device("cpu"))
    assert loaded.ema is not None and loaded.ema_sq is not None
    assert torch.equal(loaded.ema, state["ema"]) and torch.equal(loaded.ema_sq, state["ema"].square())
    assert [entry[2] for entry in loaded.history] == [[0.0]] * len(state["history"])
    assert loaded.last_noise == [None] and loaded.critical == first.critical
    # it runs on: the next sample measures noise again from the new observations
    loaded.observe(torch.tensor([1.3], dtype=DT))
    _, trends, _ = loaded.sample(8)
    assert trends[0] is not None and loaded.last_noise[0] is not None and loaded.last_noise[0] > 0

    # and through the preconditioner: a checkpoint whose trend has the old format loads and steps
    model = sequential(0, wide=nn.Linear(32, 48))
    x, direction = regression_data(0, 8, 32, 48)
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=1, trend_window=2)
    for _ in range(3):
        regression_step(model, x, direction)
        pre.step()
    saved = _saved(pre.state_dict())
    trend_state = saved["trend"]
    saved["trend"] = {
        "ema": trend_state["ema"],
        "history": [(step, ema) for step, ema, _variance in trend_state["history"]],
        "critical": trend_state["critical"],
        "last_trend": trend_state["last_trend"],
    }
    saved["format"] = 2  # a file of that time: format 2, without a checksum
    del saved["checksum"]
    model2 = sequential(1, wide=nn.Linear(32, 48))
    pre2 = HyLoPreconditioner(model2, solver="hybrid", update_freq=1, trend_window=2)
    pre2.load_state_dict(saved)
    trend = pre2.state_dict()["trend"]
    assert trend["ema"] is not None and trend["ema_sq"] is not None
    assert torch.equal(trend["ema_sq"], trend["ema"].square())
    regression_step(model2, x, direction)
    pre2.step()
    assert pre2.decision_log[-1].step == 3 and pre2.decision_log[-1].trend is not None


# ============================================================================ 6. adaptive windows
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
    policy = SolverPolicy(["wide"])
    expected = hylo_reference_flags(2, 5, 7, 10, 100)
    assert {s: expected[s] for s in BOUNDARIES} == BOUNDARIES
    wide = LayerShape(512, 512, rows=32, kfac_rows=32, kept_local=3)
    for step in range(100):
        assert ("kid" if in_critical_window(step, config.policy) else "kis") == expected[step], step
        (decision,) = policy.decide(step, [wide], 1, 1, config)
        assert decision.cost_lowrank < decision.cost_kfac
        assert (decision.solver, decision.reason) == (expected[step], "epoch window"), step
    # not the epoch (step // I) compared with a1, a2: those differ at the window edges
    by_epoch = ["kid" if s // 10 < 2 or 5 < s // 10 <= 7 else "kis" for s in range(100)]
    assert [s for s in range(100) if by_epoch[s] != expected[s]] == [*range(51, 60), *range(71, 80)]


def test_adaptive_windows_end_to_end() -> None:
    """HyLoPreconditioner(adaptive=(2, 5, 7), iters_per_epoch=10, update_freq=1) on a wide model."""
    a0, a1, a2, ipe, steps = 2, 5, 7, 10, 80
    model = wide_model()
    # trend_window=2 with a constant gradient would say "stable" from step 2 on: adaptive replaces it;
    # no fidelity budget, so the cost rule (K-FAC for "tiny", low-rank for the wide layers) applies
    pre = HyLoPreconditioner(
        model,
        solver="hybrid",
        update_freq=1,
        adaptive=(a0, a1, a2),
        iters_per_epoch=ipe,
        trend_window=2,
        fidelity_budget=0.0,
    )
    x, direction = regression_data(0, 32, 2, 64)
    for _ in range(steps):
        regression_step(model, x, direction)
        pre.step()
    expected = hylo_reference_flags(a0, a1, a2, ipe, steps)
    log = list(pre.decision_log)
    assert sorted({d.step for d in log}) == list(range(steps)) and len(log) == 3 * steps
    for d in log:
        if d.cost_kfac <= d.cost_lowrank:  # "tiny" against KID's kernel; KIS costs it less than K-FAC
            assert d.layer == "tiny" and expected[d.step] == "kid", d
            assert (d.solver, d.reason) == ("kfac", "cost")
            continue
        assert (d.solver, d.reason) == (expected[d.step], "epoch window"), d
    wide2 = {d.step: d.solver for d in log if d.layer == "wide2"}
    assert {s: wide2[s] for s in BOUNDARIES if s < steps} == {s: v for s, v in BOUNDARIES.items() if s < steps}
    assert pre.solver_of("wide1") == "kis"


# --------------------------------------------------------------------------- finite spikes (issue 30, item 1)
def test_trend_stays_finite_and_exact_below_the_cap() -> None:
    """A norm whose square overflows float64 (or an infinite norm of finite entries) is folded in as NORM_CAP,
    so both EMAs stay finite; any norm below the cap is folded in exactly as before (the plain EMA of x, x²)."""
    trend = config_trend(trend_window=4)
    ordinary = [0.5, 3.0, 1e150, 2.0]
    for value in ordinary:
        trend.observe(torch.tensor([value], dtype=DT))
    decay = trend.config.decay
    ema, ema_sq = torch.tensor(ordinary[0], dtype=DT), torch.tensor(ordinary[0] ** 2, dtype=DT)
    for value in ordinary[1:]:
        sample = torch.tensor(value, dtype=DT)
        ema, ema_sq = torch.lerp(ema, sample, 1.0 - decay), torch.lerp(ema_sq, sample * sample, 1.0 - decay)
    assert trend.moments is not None
    assert torch.equal(trend.moments[:, 0], torch.stack((ema, ema_sq)))
    for spike in (1e160, torch.finfo(DT).max, math.inf, 1.0):
        trend.observe(torch.tensor([spike], dtype=DT))
        assert bool(trend.moments.isfinite().all()), spike
        assert float(trend.moments[0, 0]) <= NORM_CAP and float(trend.moments[1, 0]) <= NORM_CAP**2
        _, trends, _ = trend.sample(10)
        assert all(math.isfinite(v) for v in trends if v is not None)
        assert all(math.isfinite(v) for v in trend.last_noise if v is not None)


@pytest.mark.parametrize("spike", [1e160, "overflow"])
def test_a_finite_gradient_spike_never_poisons_checkpoints(spike: float | str) -> None:
    """float64 model, one step whose finite ∇W has a norm of ~1e160 (its square overflows) or beyond float64's
    max (every entry finite): the trend stays finite, and every checkpoint written from then on (right after the
    spike and later) is accepted by a fresh twin's ``load_state_dict``, trend included."""
    torch.manual_seed(0)
    model = sequential(0, first=nn.Linear(6, 5), second=nn.Linear(5, 4)).to(DT)
    x, direction = regression_data(0, 8, 6, 4)
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=2, trend_window=2)
    with warnings.catch_warnings(record=True):  # beyond float64's max the spike's result overflows: raw gradient
        for step in range(8):
            regression_step(model, x, direction)
            if step == 3:
                with torch.no_grad():
                    for p in model.parameters():
                        assert p.grad is not None
                        if spike == "overflow":
                            p.grad.copy_(torch.full_like(p.grad, torch.finfo(DT).max / 4).copysign(p.grad))
                        else:
                            p.grad.mul_(spike / float(p.grad.norm()))
            pre.step()
            moments = _moments(pre)
            assert moments is not None and bool(moments.isfinite().all()), step
            if step >= 3:
                twin_model = sequential(0, first=nn.Linear(6, 5), second=nn.Linear(5, 4)).to(DT)
                twin = HyLoPreconditioner(twin_model, solver="hybrid", update_freq=2, trend_window=2)
                twin.load_state_dict(_saved(pre.state_dict()))
                assert torch.equal(_moments(twin), moments)
            if step == 3:  # the trend saw the spike
                assert float(moments[0].min()) > 1e100
