"""Per-layer solver choice: fixed, overridden, user-defined, or HyLo's hybrid policy (docs/hybrid-policy.md).

At every update step and per layer, in order of precedence: a ``layer_solvers`` override, a
user ``solver_fn``, a fixed ``solver``, else the hybrid rule — exact ``sngd`` (else ``kfac``, or the
policy's ``kfac_solver``) where that fits the fidelity budget, then that solver where it costs no more
than the low-rank variant the layer's regime calls for (``critical_variant`` while the gradient-norm
trend says the layer is critical, ``stable_variant`` otherwise, or HyLo's fixed epoch windows), else
that variant. Costs come from each solver family's estimate
(:meth:`~hylo.solvers.base.SolverFamily.cost`) per period of ``update_freq`` steps; the formulas are
in docs/hybrid-policy.md, "Cost model".

The policy holds the trend (state) and reads every option from the config passed to each call.
This module, the solvers' registry and the config are the only places that name solvers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from hylo.config import HyLoConfig, PolicyConfig
from hylo.layers.batch import LayerShape
from hylo.records import REASONS, Decision, LayerStats, Reason
from hylo.solvers import HYBRID, SolverFamily, family_of, solver_names
from hylo.trend import GradNormTrend


def encode_decisions(decisions: Sequence[Decision], device: torch.device) -> Tensor:
    """Decisions as a (layers, 5 + solvers) float64 tensor, to broadcast from rank 0."""
    names = solver_names()
    return torch.tensor(
        [
            [
                names.index(d.solver),
                REASONS.index(d.reason),
                float(d.critical),
                float("nan") if d.trend is None else d.trend,
                names.index(d.lowrank),
                *(d.costs[name] for name in names),
            ]
            for d in decisions
        ],
        dtype=torch.float64,
        device=device,
    )


def decode_decisions(encoded: Tensor, step: int, layers: list[str]) -> list[Decision]:
    """Inverse of :func:`encode_decisions` (one host transfer)."""
    names = solver_names()
    decisions = []
    for layer, (solver, reason, critical, trend, lowrank, *costs) in zip(layers, encoded.tolist(), strict=True):
        decisions.append(
            Decision(
                step,
                layer,
                names[int(solver)],
                REASONS[int(reason)],
                bool(critical),
                None if trend != trend else trend,
                dict(zip(names, costs, strict=True)),
                names[int(lowrank)],
            )
        )
    return decisions


def is_dynamic(config: HyLoConfig) -> bool:
    """Whether decisions depend on run-time data (and so are broadcast from rank 0)."""
    return config.solver == HYBRID or config.policy.solver_fn is not None


#: Bytes of a MB in ``kfac_max_state_mb``.
MB = 2**20


def kfac_refusal(d_a: int, d_g: int, itemsize: int, config: HyLoConfig, solver: str = "kfac") -> str | None:
    """Why a (d_g, d_a) layer never gets ``solver`` (a K-FAC-factor state over ``kfac_max_state_mb``), or None."""
    limit = config.kfac.kfac_max_state_mb
    size = family_of(solver).state_bytes(d_a, d_g, itemsize, config.kfac.factor_block)
    if limit is None or size is None or size <= limit * MB:
        return None
    shown = f"{size / MB:,.0f}" if size >= 10 * MB else f"{size / MB:.3g}"
    label = "K-FAC" if solver == "kfac" else solver
    return f"{label} state {shown} MB (A {d_a}×{d_a}, G {d_g}×{d_g}) > kfac_max_state_mb={limit:g}"


def check_kfac_budget(layers: Sequence[tuple[str, str, int, int, torch.dtype]], config: HyLoConfig) -> None:
    """``ValueError`` naming every layer (name, module type, d_a, d_g, working dtype) configured for K-FAC
    (``solver`` or a ``layer_solvers`` entry) whose state would exceed ``kfac_max_state_mb``."""
    refused, names = [], []
    for name, kind, d_a, d_g, dtype in layers:
        solver = config.initial_solver(name)
        why = None if solver == HYBRID else kfac_refusal(d_a, d_g, dtype.itemsize, config, solver)
        if why is not None:
            refused.append(f"{name!r} ({kind}, {str(dtype).removeprefix('torch.')}): {why}")
            names.append(name)
    if refused:
        raise ValueError(
            f"K-FAC would hold more than kfac_max_state_mb per layer for {'; '.join(refused)}. Use solver='hybrid' "
            f"(it gives such layers a low-rank solver), leave them to the optimizer with skip_layers={names}, or opt "
            "in with kfac_max_state_mb=None (or a larger budget) if the device has the memory"
        )


def in_critical_window(step: int, config: PolicyConfig) -> bool:
    """HyLo's ``--adaptive a0 a1 a2`` with I steps per epoch: critical iff step < I·a0 or I·a1 < step ≤ I·a2.

    ``step`` is the 0-based count of ``step()`` calls, as in HyLo's reference optimizer, whose
    update after s steps uses the flag it computed at s (docs/hybrid-policy.md, "Adaptive windows").
    """
    assert config.adaptive is not None and config.iters_per_epoch is not None
    a0, a1, a2 = (config.iters_per_epoch * a for a in config.adaptive)
    return step < a0 or a1 < step <= a2


def regime_variant(step: int, critical: bool, config: PolicyConfig) -> tuple[str, Reason]:
    """The low-rank variant a layer's regime calls for: by the epoch windows when ``adaptive`` is set,
    else by its critical flag."""
    if config.adaptive is not None:
        return (config.critical_variant if in_critical_window(step, config) else config.stable_variant), "epoch window"
    return (config.critical_variant, "critical") if critical else (config.stable_variant, "stable")


class SolverPolicy:
    """Chooses each layer's solver at update steps; holds the layers' gradient-norm trend."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.trend = GradNormTrend(len(names))

    def decide(
        self,
        step: int,
        shapes: Sequence[LayerShape],
        update_freq: int,
        world_size: int,
        config: HyLoConfig,
        sample: bool = True,
    ) -> list[Decision]:
        """Decisions for all layers, from their shapes at this update (see the module docstring).

        ``sample=False`` leaves the trend as it is and decides on its current critical flags: the
        forecast that tells the backward what to reduce each layer's calls to (docs/design.md, "Memory").
        """
        n = len(self.names)
        if not sample:
            ema, trends, critical = [0.0] * n, list(self.trend.last_trend), list(self.trend.critical)
        elif (is_dynamic(config) or "grad_norm" in config.telemetry.studies) and self.trend.ema is not None:
            ema, trends, critical = self.trend.sample(step, config.policy)
        else:
            ema, trends, critical = [0.0] * n, [None] * n, [True] * n
        flops_per_byte = config.policy.comm_flops_per_byte if world_size > 1 else 0.0
        average_work = update_freq * sum(shape.step_work for shape in shapes) / max(len(shapes), 1)
        budget = config.policy.fidelity_budget * average_work
        options = config.family_options()
        decisions = []
        for i, name in enumerate(self.names):
            shape = shapes[i]
            costs = {
                solver: family_of(solver).cost(shape, solver, options).per_period(update_freq, flops_per_byte)
                for solver in solver_names()
            }
            lowrank, _ = regime_variant(step, critical[i], config.policy)
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
                costs,
                lowrank,
                budget,
            )
            refused = kfac_refusal(shape.d_a, shape.d_g, shape.itemsize, config, config.policy.kfac_solver)
            solver, reason = self._choose(stats, config, refused, shape.itemsize)
            decisions.append(Decision(step, name, solver, reason, critical[i], trends[i], costs, lowrank))
        return decisions

    def forecast(
        self, step: int, shapes: Sequence[LayerShape], update_freq: int, world_size: int, config: HyLoConfig
    ) -> list[SolverFamily]:
        """The family each layer is expected to take at this update, on its current critical flags (the trend
        is not sampled): what the backward reduces the layer's calls for (docs/design.md, "Memory")."""
        decisions = self.decide(step, shapes, update_freq, world_size, config, sample=False)
        return [family_of(decision.solver) for decision in decisions]

    @staticmethod
    def substitute(decision: Decision, family: SolverFamily, config: HyLoConfig) -> Decision:
        """``decision`` moved to ``family``, the one its layer's calls were reduced for (reason ``"planned"``):
        that family's solver for the layer's regime (the regime's low-rank variant, or K-FAC)."""
        variant, _ = regime_variant(decision.step, decision.critical, config.policy)
        solver = variant if variant in family.solvers else family.solvers[0]
        return dataclasses.replace(decision, solver=solver, reason="planned")

    @staticmethod
    def _choose(stats: LayerStats, config: HyLoConfig, refused: str | None, itemsize: int) -> tuple[str, Reason]:
        """The rule of the module docstring; ``refused``: why the layer never gets K-FAC (:func:`kfac_refusal`)."""
        policy = config.policy
        forced = policy.override_for(stats.name)
        if forced is not None:
            return forced, "override"
        if policy.solver_fn is not None:
            chosen = policy.solver_fn(stats.name, stats.step, stats)
            if chosen not in solver_names():
                raise ValueError(
                    f"solver_fn returned {chosen!r} for layer {stats.name!r}; expected one of {solver_names()}"
                )
            over = kfac_refusal(stats.d_a, stats.d_g, itemsize, config, chosen)
            if over is not None:
                raise ValueError(
                    f"solver_fn returned {chosen!r} for layer {stats.name!r}: {over}; return a low-rank solver "
                    "for it, or raise kfac_max_state_mb"
                )
            return chosen, "solver_fn"
        if config.solver != HYBRID:
            return config.solver, "fixed"
        if stats.cost_sngd <= stats.budget:
            return "sngd", "fidelity"
        if refused is not None:  # vocabulary-sized: the cheaper variant (docs/hybrid-policy.md, "Memory budget")
            return min((policy.critical_variant, policy.stable_variant), key=lambda v: stats.costs[v]), "memory"
        kfac, cost = policy.kfac_solver, stats.costs[policy.kfac_solver]
        if cost <= stats.budget:
            return kfac, "fidelity"
        if cost <= stats.cost_lowrank:
            return kfac, "cost"
        return regime_variant(stats.step, stats.critical, policy)
