"""Plain records hylo hands to user code: the policy's view of a layer and its logged decisions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

#: Why a solver was chosen (see :class:`Decision`).
#: ``"planned"``: the backward reduced the layer's calls for another family than the update's decision
#: (docs/design.md, "Memory"), so the update keeps the family the data was reduced for.
#: ``"memory"``: the layer's K-FAC state is over ``kfac_max_state_mb``: it takes the cheaper of the critical
#: and stable low-rank variants (docs/hybrid-policy.md, "Memory budget").
Reason = Literal[
    "override", "solver_fn", "fixed", "fidelity", "cost", "epoch window", "critical", "stable", "planned", "memory"
]
REASONS: tuple[Reason, ...] = get_args(Reason)


class _Costs:
    """The named costs of the built-in columns, read from a ``costs`` mapping."""

    __slots__ = ()

    costs: Mapping[str, float]
    #: The low-rank variant the layer's regime calls for (the policy's critical or stable variant).
    lowrank: str

    @property
    def cost_kfac(self) -> float:
        """K-FAC's cost."""
        return self.costs["kfac"]

    @property
    def cost_lowrank(self) -> float:
        """The cost of the low-rank variant the regime calls for (``lowrank``)."""
        return self.costs[self.lowrank]

    @property
    def cost_sngd(self) -> float:
        """Exact SNGD's cost."""
        return self.costs["sngd"]


@dataclass(frozen=True, slots=True)
class LayerStats(_Costs):
    """What a policy knows of one layer at an update step (the argument of ``solver_fn``).

    ``costs`` are the hybrid cost model's multiply-adds per update period of every registered
    solver (traffic included when P > 1; docs/hybrid-policy.md, "Cost model"); ``lowrank`` names
    the variant the regime calls for (``cost_lowrank`` is its cost), and ``budget`` is what a
    solver may cost to be taken for fidelity.
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
    costs: Mapping[str, float]
    lowrank: str
    budget: float


@dataclass(frozen=True, slots=True)
class Decision(_Costs):
    """One layer's solver at one update step and why (an entry of ``decision_log``), with the costs it
    weighed by solver and the low-rank variant its regime called for."""

    step: int
    layer: str
    solver: str
    reason: Reason
    critical: bool
    trend: float | None
    costs: Mapping[str, float]
    lowrank: str
    #: Rows the layer's low-rank solve kept over all ranks (m = Σ_p r_p), once the update ran; None for K-FAC.
    rows_kept: int | None = None


@dataclass(frozen=True)
class LayerInfo:
    """A registered layer as :meth:`HyLoPreconditioner.layer_info` reports it."""

    name: str
    module_type: str
    d_a: int
    d_g: int
    bias: bool
    solver: str
    #: The rank that solved the layer's current state (0 before the first update; -1 while only its
    #: carried statistics are held, after a checkpoint from another world size, until the next update).
    owner: int
    #: Why the layer is kept from a solver, e.g. its K-FAC state over ``kfac_max_state_mb`` (empty: nothing).
    note: str = ""
    #: (rows kept, rows) over all ranks at the layer's latest low-rank update (None: none yet).
    rows_kept: tuple[int, int] | None = None


def format_summary(head: str, layers: Sequence[LayerInfo], left_alone: Sequence[tuple[str, str]]) -> str:
    """``summary()``'s table: ``head``, one line per registered layer (``kept``: rows kept / rows over all ranks at
    its latest low-rank update), one per module left alone and why.

    Every column is as wide as its longest entry (Hugging Face module names run past 60 characters), so
    the columns stay aligned; a layer's note, if any, ends its line."""
    rows = [("layer", "type", "d_a", "d_g", "bias", "solver", "kept", "")]
    rows += [
        (
            i.name,
            i.module_type,
            str(i.d_a),
            str(i.d_g),
            str(i.bias),
            i.solver,
            "-" if i.rows_kept is None else f"{i.rows_kept[0]}/{i.rows_kept[1]}",
            i.note and f"({i.note})",
        )
        for i in layers
    ]
    widths = [max(len(row[k]) for row in rows) for k in range(7)]
    lines = [head]
    for name, kind, d_a, d_g, bias, solver, kept, note in rows:
        numbers = " ".join(cell.rjust(w) for cell, w in zip((d_a, d_g, bias), widths[2:5], strict=True))
        line = f"  {name.ljust(widths[0])} {kind.ljust(widths[1])} {numbers}  {solver.ljust(widths[5])}"
        line += f"  {kept.rjust(widths[6])}  {note}"
        lines.append(line.rstrip())
    for name, why in left_alone:
        lines.append(f"  not preconditioned: {name or '<root>'} ({why})")
    return "\n".join(lines)
