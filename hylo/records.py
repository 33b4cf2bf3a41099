"""Plain records hylo hands to user code: the policy's view of a layer, its logged decisions, each layer as it stands
(:class:`LayerInfo`, its state a :class:`StateView`) and the run's :class:`Progress`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from torch import Tensor, nn

    from hylo.layers.gradmatrix import GradMatrix
    from hylo.layers.math import LayerMath
    from hylo.layers.statistics import Call

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
    #: What the update decided beyond the solver, once it ran, by decisions.csv column (a family's ``note_columns``:
    #: the adaptive refresh of Adam in the K-FAC eigenbasis, docs/solvers.md, "Adaptive refresh"); empty: nothing.
    notes: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class StateView:
    """A layer's held state, read-only, as :meth:`HyLoPreconditioner.layer_info` reports it (``LayerInfo.state``).

    ``tensors`` are the state's own tensors by name (what ``state_dict`` saves; the same objects, not copies:
    do not write to them), ``fields`` its other fields by name (a low-rank state's ``divisor``, ``damping``, an
    adaptive state's ``steps``) with ``rows``, the rows a low-rank state keeps (m), as their count. A view taken
    before an update holds the state of that time, and two views are equal when they show the very same state:
    ``==`` says whether an update, a refresh or a load replaced it (or a step, for a state whose apply advances
    it, as Adam's moments do; docs/usage.md, "Inspecting layers").
    """

    #: The solver family that built it (``"kfac"``, ``"lowrank"``, ...; a registered family's name).
    family: str
    #: Its class's name (e.g. ``"KFACState"``, or ``"KFACInverseState"`` under ``kfac_method="inverse"``).
    kind: str
    #: λ of its latest update (None while only the carried statistics of a layer another rank solves are held).
    damping: float | None
    tensors: Mapping[str, Tensor] = field(repr=False)
    fields: Mapping[str, object]
    #: Whether it is only what the next update builds on, of a layer another rank solves (``strategy="gradient"``).
    remote: bool
    _held: object = field(repr=False)

    def __eq__(self, other: object) -> bool:
        """Whether ``other`` is a view of the very state this one shows (no update, refresh or load replaced it)."""
        return isinstance(other, StateView) and other._held is self._held

    def __hash__(self) -> int:
        """The held state's identity (views of one state hash alike)."""
        return id(self._held)

    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """The state applied to a (d_g, d_a) gradient ∇W (bias last; or its :class:`hylo.layers.GradMatrix`) as
        ``step()`` applies it, changing nothing; ``ValueError`` for a :attr:`remote` state (it solves nothing here)."""
        precondition = getattr(self._held, "precondition", None)
        if self.remote or precondition is None:
            raise ValueError(f"a remote {self.family} state solves nothing on this rank")
        result: Tensor = precondition(grad)
        return result


@dataclass(frozen=True)
class LayerInfo:
    """A registered layer as :meth:`HyLoPreconditioner.layer_info` reports it, at the moment it was asked: its
    shapes, solver and owner, its held state (read-only), its captured calls and the policy's view of it. Two
    records are equal when every fact but the math and the captured calls is (their states: the same object)."""

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
    #: Its math (:class:`hylo.layers.LayerMath`): the module, its weight and bias, the working dtype.
    math: LayerMath = field(kw_only=True, repr=False, compare=False)
    #: Its held state (None before its first update).
    state: StateView | None = field(default=None, kw_only=True)
    #: Bytes of state it holds (what :meth:`HyLoPreconditioner.memory_usage` counts).
    memory: int = field(default=0, kw_only=True)
    #: The forward calls captured for the next ``step()`` whose backward ran: each reduced in its gradient hook
    #: (its ``rows`` and statistics) or kept raw, as (input, output gradient) (docs/design.md, "Memory").
    calls: tuple[Call, ...] = field(default=(), kw_only=True, repr=False, compare=False)
    #: Forward calls captured that still await their backward.
    pending: int = field(default=0, kw_only=True)
    #: The hybrid policy's EMA of ‖∇W‖ (None before the first step), its latest trend (None until a window of
    #: history) and whether the layer is in its critical regime (docs/hybrid-policy.md, "Critical regime").
    grad_norm: float | None = field(default=None, kw_only=True)
    trend: float | None = field(default=None, kw_only=True)
    critical: bool = field(default=True, kw_only=True)
    #: Whether its latest update's state was rejected (non-finite): it keeps its previous one (docs/reliability.md,
    #: "Non-finite values").
    rejected: bool = field(default=False, kw_only=True)
    #: Steps since the latest update whose result fell back to the raw gradient (reported at the next update).
    fallbacks: int = field(default=0, kw_only=True)
    #: Capture steps at which its module ran and routed it no row (an idle expert; docs/moe.md, "Idle experts").
    idle: int = field(default=0, kw_only=True)

    @property
    def module(self) -> nn.Module:
        """The registered module."""
        return self.math.module


@dataclass(frozen=True)
class Progress:
    """Where a preconditioner's run stands, as :meth:`HyLoPreconditioner.progress` reports it."""

    #: ``step()`` calls that succeeded (the next step's index).
    steps: int
    #: Update steps so far.
    updates: int
    #: Whether the next step updates whatever the cadence (a skipped update step, or a state a load lacks).
    update_owed: bool
    #: Whether it records to its ``profile_dir`` (False without one, and after ``close()``).
    profiling: bool
    #: Whether it times each step's phases (only while profiling).
    timing: bool
    #: Whether it runs the ``rank`` or ``grad_error`` studies at sampled updates (docs/profiling.md).
    studies: bool


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


@dataclass(frozen=True)
class RankRecord:
    """One layer's row of rank-analysis.csv."""

    layer: str
    batch_rows: int
    reference: str
    ranks: list[int]
    eigenvalues: list[float]


@dataclass(frozen=True)
class ErrorRecord:
    """One (layer, method, ratio) row of grad-error.csv."""

    layer: str
    method: str
    #: The ρ measured at, ``"auto"`` (``rank_ratio="auto"``'s choice) or None (a method that keeps every row).
    rank_ratio: float | str | None
    rel_error: float
    reference: str


@dataclass
class StudyResult:
    """The studies' records of one update and the bytes they sent, by tag."""

    rank: list[RankRecord]
    errors: list[ErrorRecord]
    traffic: dict[str, int]
