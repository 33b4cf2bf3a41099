"""Per-layer solver choice: fixed, overridden, user-defined, or HyLo's hybrid policy.

The hybrid policy (docs/design.md, "Hybrid policy"), at every update step and per layer:

1. **Cost model.** Each family's :meth:`~hylo.solvers.base.SolverFamily.cost` per period of
   ``update_freq`` = f steps, from the layer's shape (d_a, d_g), its local rows n (K-FAC: n_k
   rows incl. conv positions), the rows m of the gathered solve (P·n for ``sngd``, P·r for
   ``kid``/``kis``) and the numbers per row w (d_a + d_g; d_a·d_g for exact conv rows):

   - ``kfac``: n_k (d_a² + d_g²)  +  4 (d_a³ + d_g³)  +  f · 2 d_a d_g (d_a + d_g)
   - ``sngd``: rows  +  m² w  +  m³  +  f · 2 m d_a d_g
   - ``kid``:  rows  +  n² w + n r²  +  m² w  +  m³  +  f · 2 m d_a d_g  (local kernel, skeleton)
   - ``kis``:  rows  +  n w  +  m² w  +  m³  +  f · 2 m d_a d_g  (row norms only)

   plus, when P > 1, the bytes a rank exchanges per update times ``comm_flops_per_byte``.
   The same estimates' solve parts balance the owners of the distributed stage.
2. **Fidelity where it is free.** A layer takes exact ``sngd`` (else ``kfac``) when that costs
   at most ``fidelity_budget`` × the forward+backward work of an average registered layer
   over the period (3·n_k·d_a·d_g a step): a small classifier never gets a ρ = 0.1
   approximation, and all such upgrades together cost at most that share of the model's work.
3. **Cheapest adequate.** Otherwise ``kfac`` where it costs less than the low-rank variant the
   regime calls for, else that variant:
4. **Critical regime.** ``kid`` while the layer is critical and ``kis`` elsewhere.
   Per layer, EMAs of ‖∇W‖ and ‖∇W‖² with decay β = ``trend_decay`` (default 1 − 2/(W + 1),
   a memory of W = ``trend_window`` steps); the trend t = |EMA − EMA_ref| / |EMA_ref| against
   the newest sample at least W steps old, its noise s = sqrt(2 max(v, v_ref) (1 − β)/(1 + β))
   / |EMA_ref| with v = EMA(‖∇W‖²) − EMA(‖∇W‖)² now and v_ref at the reference. A layer turns
   critical when t > max(``critical_enter``, z·s) and stable when t < max(``critical_exit``,
   z·s/2) (hysteresis; z = ``critical_noise``).
   Until a full window of history exists a layer is critical (early training). Alternatively
   HyLo's fixed windows ``adaptive=(a0, a1, a2)`` with I = ``iters_per_epoch``: KID iff
   step < I·a0 or I·a1 < step ≤ I·a2 (0-based step), KIS otherwise.

Per-layer overrides (``layer_solvers``) beat a user ``solver_fn``, which beats the built-in rule.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.layers import LayerShape
from hylo.records import REASONS, Decision, LayerStats, Reason
from hylo.solvers import LAYER_SOLVERS, LayerSolver, family_of


def encode_decisions(decisions: Sequence[Decision], device: torch.device) -> Tensor:
    """Decisions as a (layers, 7) float64 tensor, to broadcast from rank 0."""
    return torch.tensor(
        [
            [
                LAYER_SOLVERS.index(d.solver),
                REASONS.index(d.reason),
                float(d.critical),
                float("nan") if d.trend is None else d.trend,
                d.cost_kfac,
                d.cost_lowrank,
                d.cost_sngd,
            ]
            for d in decisions
        ],
        dtype=torch.float64,
        device=device,
    )


def decode_decisions(encoded: Tensor, step: int, names: list[str]) -> list[Decision]:
    """Inverse of :func:`encode_decisions` (one host transfer)."""
    decisions = []
    for name, (solver, reason, critical, trend, c_kfac, c_low, c_sngd) in zip(names, encoded.tolist(), strict=True):
        decisions.append(
            Decision(
                step,
                name,
                LAYER_SOLVERS[int(solver)],
                REASONS[int(reason)],
                bool(critical),
                None if trend != trend else trend,
                c_kfac,
                c_low,
                c_sngd,
            )
        )
    return decisions


def window_decay(window: int) -> float:
    """EMA decay whose effective memory is ``window`` steps: 1 − 2/(window + 1)."""
    return 1.0 - 2.0 / (window + 1)


class GradNormTrend:
    """EMAs of each layer's gradient norm and squared norm, kept on device; sampled at update steps.

    ``observe`` costs one fused update of a (2, layers) tensor per step and never syncs;
    ``sample`` does one host transfer for all layers and updates the critical flags with
    hysteresis, against thresholds raised to ``z`` times the measured noise of the trend
    (docs/design.md, "Hybrid policy").
    """

    def __init__(self, n_layers: int, decay: float | None, window: int, enter: float, exit_: float, z: float) -> None:
        self.decay = window_decay(window) if decay is None else decay
        self.window, self.enter, self.exit, self.z = window, enter, exit_, z
        self.moments: Tensor | None = None  # rows: EMA of ‖∇W‖, EMA of ‖∇W‖²
        self.history: deque[tuple[int, list[float], list[float]]] = deque()  # (step, EMA, variance)
        self.critical = [True] * n_layers
        self.last_trend: list[float | None] = [None] * n_layers
        self.last_noise: list[float | None] = [None] * n_layers

    @property
    def ema(self) -> Tensor | None:
        """EMA of each layer's gradient norm (on device); None before the first ``observe``."""
        return None if self.moments is None else self.moments[0]

    @property
    def ema_sq(self) -> Tensor | None:
        """EMA of each layer's squared gradient norm (on device); None before the first ``observe``."""
        return None if self.moments is None else self.moments[1]

    def observe(self, norms: Tensor, present: Tensor | None = None) -> None:
        """Fold this step's per-layer gradient norms into the EMAs (on device).

        Layers not ``present`` (no gradient this step) keep their EMAs as they were.
        """
        norms = norms.detach().to(torch.float64)
        moments = torch.stack((norms, norms * norms))
        if self.moments is None:
            self.moments = moments
            return
        blended = torch.lerp(self.moments, moments, 1.0 - self.decay)
        self.moments = blended if present is None else torch.where(present, blended, self.moments)

    def snapshot(self) -> tuple[Any, ...]:
        """Everything ``observe`` and ``sample`` change (cheap: no tensor copies), for :meth:`restore`."""
        return (self.moments, deque(self.history), list(self.critical), list(self.last_trend), list(self.last_noise))

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Go back to a :meth:`snapshot` (a step that failed leaves the trend as it was)."""
        moments, history, critical, last_trend, last_noise = snapshot
        self.moments, self.history = moments, deque(history)
        self.critical, self.last_trend, self.last_noise = list(critical), list(last_trend), list(last_noise)

    def sample(self, step: int) -> tuple[list[float], list[float | None], list[bool]]:
        """EMA values, relative change over the window, and critical flags at ``step``."""
        assert self.moments is not None, "observe() must run before sample()"
        ema, ema_sq = self.moments.tolist()
        variance = [max(sq - m * m, 0.0) for m, sq in zip(ema, ema_sq, strict=True)]
        past = None
        while self.history and self.history[0][0] <= step - self.window:
            past = self.history.popleft()
        if past is not None:
            self.history.appendleft(past)  # keep the newest value at least a window old
        self.history.append((step, ema, variance))
        # std of the difference of two EMAs of i.i.d. values a window apart, per unit of the values' std
        spread = math.sqrt(2.0 * (1.0 - self.decay) / (1.0 + self.decay))
        for i, value in enumerate(ema):
            if past is None:
                self.last_trend[i] = self.last_noise[i] = None
                continue
            reference, scale = past[1][i], max(abs(past[1][i]), 1e-30)
            trend = abs(value - reference) / scale
            # the larger variance of the window's two ends: a dip of the EMA (and with it of the
            # variance, for noise that scales with the norm) cannot lower the bar by itself
            noise = spread * math.sqrt(max(variance[i], past[2][i])) / scale
            self.last_trend[i], self.last_noise[i] = trend, noise
            if self.critical[i] and trend < max(self.exit, 0.5 * self.z * noise):
                self.critical[i] = False
            elif not self.critical[i] and trend > max(self.enter, self.z * noise):
                self.critical[i] = True
        return ema, list(self.last_trend), list(self.critical)

    def state_dict(self) -> dict[str, Any]:
        """Serializable state."""
        return {
            "ema": None if self.ema is None else self.ema.cpu().clone(),
            "ema_sq": None if self.ema_sq is None else self.ema_sq.cpu().clone(),
            "history": list(self.history),
            "critical": list(self.critical),
            "last_trend": list(self.last_trend),
            "last_noise": list(self.last_noise),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore ``state_dict``; a state without ``ema_sq`` (older format) starts it at ema² (noise unknown)."""
        ema = state["ema"]
        if ema is None:
            self.moments = None
        else:
            ema = ema.to(device=device, dtype=torch.float64)
            ema_sq = state.get("ema_sq")
            ema_sq = ema * ema if ema_sq is None else ema_sq.to(device=device, dtype=torch.float64)
            self.moments = torch.stack((ema, ema_sq))
        # older states keep no variance per sample: 0 (unknown) leaves the current one to judge
        self.history = deque(
            (int(entry[0]), list(entry[1]), list(entry[2]) if len(entry) > 2 else [0.0] * len(entry[1]))
            for entry in state["history"]
        )
        self.critical = list(state["critical"])
        self.last_trend = list(state["last_trend"])
        self.last_noise = list(state.get("last_noise", [None] * len(self.critical)))


class SolverPolicy:
    """Chooses each layer's solver at update steps from the configuration."""

    def __init__(self, config: HyLoConfig, names: list[str]) -> None:
        self.config = config
        self.names = names
        self.trend = GradNormTrend(
            len(names),
            config.trend_decay,
            config.trend_window,
            config.critical_enter,
            config.critical_exit,
            config.critical_noise,
        )

    @property
    def dynamic(self) -> bool:
        """Whether decisions depend on run-time data (and so are broadcast from rank 0)."""
        return self.config.solver == "hybrid" or self.config.solver_fn is not None

    def epoch_window_kid(self, step: int) -> bool:
        """HyLo's ``--adaptive a0 a1 a2`` with I steps per epoch: KID iff step < I·a0 or I·a1 < step ≤ I·a2.

        ``step`` is the 0-based count of ``step()`` calls, as in HyLo's reference optimizer, whose
        update after s steps uses the flag it computed at s (docs/design.md, "Hybrid policy").
        """
        assert self.config.adaptive is not None and self.config.iters_per_epoch is not None
        a0, a1, a2 = (self.config.iters_per_epoch * a for a in self.config.adaptive)
        return step < a0 or a1 < step <= a2

    def decide(
        self, step: int, shapes: Sequence[LayerShape], update_freq: int, world_size: int, sample: bool = True
    ) -> list[Decision]:
        """Decisions for all layers, from their shapes at this update (see the module docstring).

        ``sample=False`` leaves the trend as it is and decides on its current critical flags: the
        forecast that tells the backward what to reduce each layer's calls to (docs/design.md, "Memory").
        """
        if not sample:
            ema, trends, critical = [0.0] * len(self.names), list(self.trend.last_trend), list(self.trend.critical)
        elif (self.dynamic or "grad_norm" in self.config.studies) and self.trend.ema is not None:
            ema, trends, critical = self.trend.sample(step)
        else:
            ema, trends, critical = [0.0] * len(self.names), [None] * len(self.names), [True] * len(self.names)
        flops_per_byte = self.config.comm_flops_per_byte if world_size > 1 else 0.0
        average_work = update_freq * sum(shape.step_work for shape in shapes) / max(len(shapes), 1)
        budget = self.config.fidelity_budget * average_work
        decisions = []
        for i, name in enumerate(self.names):
            shape = shapes[i]
            costs = {
                solver: family_of(solver).cost(shape, solver).per_period(update_freq, flops_per_byte)
                for solver in LAYER_SOLVERS
            }
            stats = LayerStats(
                name,
                step,
                shape.d_a,
                shape.d_g,
                shape.rows,
                shape.kfac_rows,
                shape.kept,
                update_freq,
                world_size,
                ema[i],
                trends[i],
                critical[i],
                costs["kfac"],
                costs[self.lowrank_variant(step, critical[i])[0]],
                costs["sngd"],
                budget,
            )
            solver, reason = self._choose(stats)
            decisions.append(
                Decision(
                    step,
                    name,
                    solver,
                    reason,
                    critical[i],
                    trends[i],
                    stats.cost_kfac,
                    stats.cost_lowrank,
                    stats.cost_sngd,
                )
            )
        return decisions

    def lowrank_variant(self, step: int, critical: bool) -> tuple[LayerSolver, Reason]:
        """KID or KIS: by the epoch windows when ``adaptive`` is set, else by the critical regime."""
        if self.config.adaptive is not None:
            return ("kid", "epoch window") if self.epoch_window_kid(step) else ("kis", "epoch window")
        return ("kid", "critical") if critical else ("kis", "stable")

    def _choose(self, stats: LayerStats) -> tuple[LayerSolver, Reason]:
        cfg = self.config
        forced = cfg.override_for(stats.name)
        if forced is not None:
            return forced, "override"
        if cfg.solver_fn is not None:
            chosen = cfg.solver_fn(stats.name, stats.step, stats)
            if chosen not in LAYER_SOLVERS:
                raise ValueError(
                    f"solver_fn returned {chosen!r} for layer {stats.name!r}; expected one of {LAYER_SOLVERS}"
                )
            return chosen, "solver_fn"
        if cfg.solver != "hybrid":
            return cfg.solver, "fixed"
        if stats.cost_sngd <= stats.budget:
            return "sngd", "fidelity"
        if stats.cost_kfac <= stats.budget:
            return "kfac", "fidelity"
        if stats.cost_kfac <= stats.cost_lowrank:
            return "kfac", "cost"
        return self.lowrank_variant(stats.step, stats.critical)
