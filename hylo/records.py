"""Plain records hylo hands to user code: the policy's view of a layer and its logged decisions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from hylo.solvers import LayerSolver

#: Why a solver was chosen (see :class:`Decision`).
#: ``"planned"``: the backward reduced the layer's calls for the other family than the update's decision
#: (docs/design.md, "Memory"), so the update keeps the family the data was reduced for.
Reason = Literal["override", "solver_fn", "fixed", "fidelity", "cost", "epoch window", "critical", "stable", "planned"]
REASONS: tuple[Reason, ...] = get_args(Reason)


@dataclass(frozen=True)
class LayerStats:
    """What a policy knows of one layer at an update step (the argument of ``solver_fn``).

    Costs are the hybrid cost model's multiply-adds per update period (traffic included when
    P > 1): ``cost_lowrank`` is that of the low-rank variant the regime calls for (``kid``
    when critical, else ``kis``), and ``budget`` what a solver may cost to be taken for fidelity.
    """

    name: str
    step: int
    d_a: int
    d_g: int
    rows: int
    kfac_rows: int
    kept: int
    update_freq: int
    world_size: int
    grad_norm: float
    trend: float | None
    critical: bool
    cost_kfac: float
    cost_lowrank: float
    cost_sngd: float
    budget: float


@dataclass(frozen=True)
class Decision:
    """One layer's solver at one update step and why (an entry of ``decision_log``)."""

    step: int
    layer: str
    solver: LayerSolver
    reason: Reason
    critical: bool
    trend: float | None
    cost_kfac: float
    cost_lowrank: float
    cost_sngd: float
