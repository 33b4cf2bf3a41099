"""The solver-family interface (docs/design.md, "Solver families").

A family is the math of one kind of curvature estimate, split into the phases of an update
step so that the stage can run any family without knowing its name:

1. :meth:`SolverFamily.contribute` — on every rank, reduce the layers' captured batches to
   the tensors this family shares with the other ranks (a :class:`Contribution`), charging
   each layer's ``"capture"`` and ``"reduce"`` time to ``context.watch``;
2. :meth:`SolverFamily.prepare` — from what every rank contributed, the inputs of each
   layer's solve, known identically on every rank;
3. :meth:`SolverFamily.solve` — on a layer's owner, the solved tensors, batched across layers;
4. :meth:`SolverFamily.assemble` — a :class:`LayerState` from a layer's inputs and its solved
   tensors (on the owner, or on every rank after a broadcast).

A family also owns its cost estimate (:meth:`SolverFamily.cost`, used by the hybrid policy
and by owner assignment), its state type and that state's ``to_dict``/``from_dict``.
Nothing here talks to other ranks: a :class:`Contribution` only says which collective its
payload needs.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from hylo.layers.batch import LayerBatch, LayerShape
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.statistics import CallStatistic
from hylo.payload import Payload, PayloadKey
from hylo.rules import Section
from hylo.solvers.kernel import Exchange, GroupKernel, LoopKernel
from hylo.solvers.layout import canonicalize


def _nbytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class LayerState(ABC):
    """A layer's solved curvature: applied to its gradient at every step until the next update."""

    #: Name of the family that builds this state.
    family: ClassVar[str]
    #: Whether applying the state changes it (Adam's moments): :meth:`advance` then returns its successor, which
    #: the step stores only once it succeeds (docs/reliability.md, "Transactional steps").
    advances: ClassVar[bool] = False
    #: Keys :meth:`to_dict` adds to a checkpoint entry beyond ``damping`` and ``tensors``.
    entry_keys: ClassVar[frozenset[str]] = frozenset()
    damping: float

    def __post_init__(self) -> None:
        """Every tensor of the state in the one layout whichever way it was built — an update's ``assemble``, a
        refresh or a step that advances it (``dataclasses.replace``), ``from_dict`` — so that its products round
        alike and a resumed run continues bit for bit (docs/reliability.md, "One layout"); ``copy.deepcopy`` keeps
        that layout. Run by a dataclass state's ``__init__``; a subclass that defines its own calls this one."""
        if dataclasses.is_dataclass(self):
            canonicalize(self)

    @abstractmethod
    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """The preconditioned (d_g, d_a) gradient, from ∇W whole or as its weight and bias parts, in the state's
        working dtype: the step checks it there and casts it into ∇W's dtype once, when it writes it, as the
        grouped step does (docs/reliability.md, "Fallbacks")."""

    def advance(self, grad: Tensor | GradMatrix) -> tuple[Tensor, LayerState]:
        """The preconditioned gradient and the state the next step applies (this one, unless it :attr:`advances`)."""
        return self.precondition(grad), self

    @property
    def bound(self) -> float | None:
        """λ of the guarantee a result is checked against, a descent direction no longer than ‖∇W‖/λ (what
        (F̃ + λI)⁻¹ with F̃ PSD gives); None where the state gives none and only finiteness is checked
        (docs/reliability.md, "Fallbacks")."""
        return self.damping

    @abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the state, by name (what ``state_dict`` saves)."""

    def plan_parts(self) -> tuple[object, ...]:
        """The objects whose identity says that a group kernel built on this state (its stacked copies) still
        holds: the state itself, which an update, a refresh or a load replaces; a state that :attr:`advances`
        names the parts its successors keep (docs/design.md, "The apply plan")."""
        return (self,)

    def carried(self) -> dict[str, Tensor]:
        """Tensors the next update of the same family builds on (K-FAC's running factors)."""
        return {}

    def nbytes(self) -> int:
        """Bytes held by this state."""
        return _nbytes(self.tensors())

    @classmethod
    def carried_from_dict(
        cls, carried: object, d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, Tensor]:
        """Saved :meth:`carried` tensors of a (d_g, d_a) layer computing in ``dtype``, else ``ValueError``
        (by default a state carries nothing)."""
        return checked_tensors(carried, {}, {}, device)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``state_dict`` (tensors cloned)."""
        return {"damping": self.damping, "tensors": {k: v.detach().clone() for k, v in self.tensors().items()}}

    @classmethod
    @abstractmethod
    def from_dict(
        cls, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> LayerState:
        """A state saved by :meth:`to_dict`; ``ValueError`` naming the field unless it fits a (d_g, d_a) layer
        whose math runs in ``dtype`` (every tensor's name, shape and dtype; a finite damping > 0)."""


@dataclass
class RemoteState:
    """A layer another rank owns (``strategy="gradient"``): only what the next update builds on."""

    family: str
    carried_tensors: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """The carried tensors in the one layout, as a solved state's (docs/reliability.md, "One layout")."""
        canonicalize(self)

    def carried(self) -> dict[str, Tensor]:
        """What the owner's state would carry to the next update."""
        return self.carried_tensors

    def tensors(self) -> dict[str, Tensor]:
        """The carried tensors (all this rank holds of the layer)."""
        return self.carried_tensors

    def nbytes(self) -> int:
        """Bytes held on this rank."""
        return _nbytes(self.carried_tensors)


#: What a layer holds between updates: a solved state, another rank's layer, or nothing yet.
HeldState = LayerState | RemoteState


def carried_from(previous: HeldState | None, family: str) -> dict[str, Tensor]:
    """The tensors ``previous`` carries for ``family`` (empty if it belongs to another family)."""
    if previous is None or previous.family != family:
        return {}
    return previous.carried()


def check_shapes(tensors: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming the first tensor that is missing or has an unexpected shape."""
    for key, shape in expected.items():
        if key not in tensors:
            raise ValueError(f"state_dict entry lacks tensor {key!r}")
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{key} has shape {tuple(tensors[key].shape)}, expected {shape}")


def checked_tensors(
    tensors: object,
    expected: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, torch.dtype],
    device: torch.device,
) -> dict[str, Tensor]:
    """``tensors`` moved to ``device`` if they are exactly the ``expected`` names, shapes and ``dtypes`` (dense
    tensors), else ``ValueError`` naming the first that is not (docs/reliability.md, "Validation")."""
    if not isinstance(tensors, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items()
    ):
        raise ValueError("state_dict entry's tensors are not a mapping from names to tensors")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"state_dict entry holds unexpected tensors {unexpected}")
    check_shapes(tensors, expected)
    for key, tensor in tensors.items():
        if tensor.layout != torch.strided or tensor.dtype != dtypes[key]:
            raise ValueError(f"{key} is a {tensor.layout} tensor of dtype {tensor.dtype}, expected {dtypes[key]}")
    return {key: tensor.to(device) for key, tensor in tensors.items()}


def positive_number(entry: Mapping[str, Any], key: str) -> float:
    """``entry[key]`` as a float if it is a finite number > 0 (not a bool), else ``ValueError`` naming ``key``."""
    if key not in entry:
        raise ValueError(f"state_dict entry lacks {key!r}")
    value = entry[key]
    if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf):
        raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CostEstimate:
    """Estimated work of one layer: multiply-adds per update (build, solve) and per step (apply),
    and the bytes a rank sends and receives per update (0 with one rank)."""

    build: float
    solve: float
    apply: float
    bytes: float = 0.0

    def per_period(self, update_freq: int, flops_per_byte: float = 0.0) -> float:
        """One update period: the update, ``update_freq`` applications and the traffic as multiply-adds."""
        return self.build + self.solve + update_freq * self.apply + flops_per_byte * self.bytes


@dataclass
class Contribution:
    """What a family's layers put into one collective at an update step."""

    exchange: Exchange
    payload: Payload
    #: Per key, this rank's weight in a :attr:`Exchange.MEAN` (e.g. its sample count).
    weights: dict[PayloadKey, float] = field(default_factory=dict)


class Clock(Protocol):
    """Where an update's phases charge their time: :class:`hylo.telemetry.profiling.Stopwatch`, enabled
    while profiling (``profile_dir``) and disabled otherwise (``hylo.telemetry.profiling.DISABLED``)."""

    @property
    def enabled(self) -> bool:
        """Whether laps are recorded (a caller may skip work that only feeds them)."""

    def lap(self, phase: str, layers: Sequence[str] | str = (), weights: Sequence[float] | None = None) -> None:
        """Charge the time since the previous lap to ``phase`` of ``layers`` (split by ``weights``)."""


@dataclass(frozen=True)
class UpdateJob:
    """One layer's work at an update step: its captured batch, its solver and what it held."""

    name: str
    solver: str
    batch: LayerBatch
    previous: HeldState | None


SectionT = TypeVar("SectionT", bound=Section)


class FamilyOptions:
    """Every solver family's options section of one configuration, looked up by the section's type
    (docs/extending.md, "Family options and statistics"): ``options(KFACConfig).kfac_method``. A section the
    configuration does not hold (a family registered after it was made) reads as its defaults."""

    def __init__(self, sections: Iterable[Section] = ()) -> None:
        self._by_type: dict[type[Section], Section] = {type(section): section for section in sections}

    def __call__(self, section: type[SectionT]) -> SectionT:
        """The configuration's ``section``, or ``section()`` (its defaults) where it holds none."""
        found = self._by_type.get(section)
        return found if isinstance(found, section) else section()

    def replaced(self, section: Section) -> FamilyOptions:
        """These options with ``section`` in place of the one of its type."""
        return FamilyOptions({**self._by_type, type(section): section}.values())


@dataclass(frozen=True)
class UpdateContext:
    """Per-update values every family phase may need."""

    rank: int
    damping: float
    factor_decay: float
    #: Seed of this update's random draws (KIS); each layer and rank derives its own from it.
    seed: int
    #: Where the phases charge their time.
    watch: Clock
    #: The families' options: ``context.options(MySection)`` is the configuration's section of that type.
    options: FamilyOptions = field(default_factory=FamilyOptions)


PreparedT = TypeVar("PreparedT")


class SolverFamily(ABC, Generic[PreparedT]):
    """The math of one family of solvers, phase by phase (see the module docstring).

    A family defines :attr:`name`, :attr:`state_type`, :attr:`statistic` and the phases :meth:`contribute`,
    :meth:`prepare`, :meth:`solve`, :meth:`assemble` and :meth:`cost`; every other member is a capability with a
    default (docs/extending.md, "Solver families")."""

    #: The family's name (states carry it).
    name: ClassVar[str]
    #: The type of this family's solved states.
    state_type: ClassVar[type[LayerState]]
    #: The statistic of every captured call this family's updates read (docs/design.md, "Memory"): a built-in one
    #: (:data:`~hylo.layers.FACTORS`, :data:`~hylo.layers.ROWS`) or the family's own :class:`CallStatistic`.
    statistic: ClassVar[CallStatistic[Any]]
    #: The family's options, a frozen dataclass :class:`~hylo.rules.Section` with a ``section_name`` (None: it has
    #: none): :class:`hylo.HyLoConfig` holds it, its options are flat keywords, and the phases read it as
    #: ``context.options(section)`` (docs/extending.md, "Family options and statistics").
    section: ClassVar[type[Section] | None] = None
    #: The options :class:`hylo.HyLoOptimizer` gives when it picks this family for an adaptive optimizer (AdamW, …)
    #: and no ``solver`` is given, ``solver`` among them; the first registered family that has them is picked
    #: (None: never picked; docs/usage.md, "The optimizer form").
    adaptive_defaults: ClassVar[Mapping[str, Any] | None] = None
    #: This family's options taken from the wrapped optimizer's ``defaults`` (ours → theirs) when its solver runs
    #: under :class:`hylo.HyLoOptimizer` and they are not given.
    inherited_options: ClassVar[Mapping[str, str]] = {}

    @property
    def solvers(self) -> tuple[str, ...]:
        """The solver names this family runs, in registration order: by default its :attr:`name` alone."""
        return (self.name,)

    def reduces_rows(self, solver: str) -> bool:
        """Whether ``solver`` keeps r of a rank's n rows (``rank_ratio``/``rank``), as KID and KIS do."""
        return False

    def solves_rows(self, solver: str) -> bool:
        """Whether ``solver`` solves on the layer's per-sample rows (the low-rank family's solvers)."""
        return False

    @abstractmethod
    def contribute(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> Contribution:
        """Local reduction of every job's batch on this rank: what it shares with the others."""

    @abstractmethod
    def prepare(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[PreparedT]:
        """Each job's solve inputs from the collective's result; identical on every rank."""

    @abstractmethod
    def cost(self, shape: LayerShape, solver: str, options: FamilyOptions) -> CostEstimate:
        """Estimated multiply-adds of a layer of ``shape`` on this family's path, run with ``options``."""

    def solve_cost(self, prepared: PreparedT) -> float:
        """The solve part of :meth:`cost` for prepared inputs (balances owners); by default 1, every layer alike
        (owners then get equal numbers of layers)."""
        return 1.0

    @abstractmethod
    def solve(self, prepared: Sequence[PreparedT], context: UpdateContext) -> list[dict[str, Tensor]]:
        """Solved tensors of each layer, batched across layers (run by the owners)."""

    def solution_template(self, prepared: PreparedT) -> dict[str, Tensor] | None:
        """Uninitialised tensors shaped like :meth:`solve`'s output, into which a rank receives an owner's broadcast
        (P > 1); by default None: such a rank then solves the layer itself to shape them, a solve it can spare by
        defining this."""
        return None

    @abstractmethod
    def assemble(self, prepared: PreparedT, solution: Mapping[str, Tensor], context: UpdateContext) -> LayerState:
        """The layer's state from its inputs and its solved tensors."""

    def assemble_all(
        self, prepared: Sequence[PreparedT], solutions: Sequence[Mapping[str, Tensor]], context: UpdateContext
    ) -> list[LayerState]:
        """:meth:`assemble` of several layers, in order (a family may batch it across them)."""
        return [self.assemble(p, s, context) for p, s in zip(prepared, solutions, strict=True)]

    def carried(self, prepared: PreparedT) -> dict[str, Tensor]:
        """What a rank that does not own the layer keeps for the next update (``strategy="gradient"``); by default
        nothing: every update starts from its own batch."""
        return {}

    def state_bytes(self, d_a: int, d_g: int, itemsize: int, block: int | None = None) -> int | None:
        """Bytes of a (d_g, d_a) layer's state held on every rank, known before any update, when
        ``kfac_max_state_mb`` bounds it (K-FAC factors in blocks of at most ``block``, ``factor_block``); None: not
        bounded (the low-rank states grow with the batch)."""
        return None

    def rows_kept(self, batch: LayerBatch, solver: str) -> int:
        """Rows of ``batch`` this rank keeps for ``solver``'s update (all of them unless the family reduces; under
        ``rank_ratio="auto"`` the most it may keep)."""
        return batch.rows

    #: The decisions.csv columns :meth:`update_notes` fills (docs/profiling.md, "Files"); none by default.
    note_columns: ClassVar[tuple[str, ...]] = ()

    def update_notes(self, prepared: PreparedT) -> Mapping[str, object] | None:
        """What a prepared update decided for its layer beyond the solver, by :attr:`note_columns` name, the same on
        every rank (:attr:`hylo.Decision.notes`); None: nothing."""
        return None

    def rows_chosen(self, prepared: PreparedT) -> tuple[tuple[int, int], ...] | None:
        """Each rank's (rows, rows kept) of a prepared update, the same on every rank; None: the family keeps no
        rows (K-FAC)."""
        return None

    def state_from_dict(
        self, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> LayerState:
        """A state saved by ``to_dict``; ``ValueError`` unless it fits a (d_g, d_a) layer computing in ``dtype``."""
        return self.state_type.from_dict(entry, d_a, d_g, dtype, device)

    def group_key(self, state: LayerState) -> Hashable:
        """What states must share, beyond their gradients' shape, dtype and device, for one :meth:`group_kernel` to
        apply them together (docs/design.md, "The apply plan"); by default their type."""
        return type(state)

    def group_kernel(self, states: Sequence[LayerState], dtype: torch.dtype) -> GroupKernel:
        """The batched apply of ``states`` (equal :meth:`group_key`, gradients of one shape) on gradients stacked
        in ``dtype``; by default :class:`LoopKernel`, each state's own ``advance``, so that a family needs none."""
        return LoopKernel()

    #: Whether the family keeps running statistics that steps between updates refresh
    #: (``factor_update_freq``): such steps run :meth:`contribute`, the collective and :meth:`refresh`.
    refreshes: ClassVar[bool] = False

    def refresh(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[HeldState]:
        """Each job's held state with this step's contribution folded in and its solve kept as it was."""
        raise NotImplementedError(f"the {self.name} family keeps no running statistics")
