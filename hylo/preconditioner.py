"""HyLoPreconditioner: orchestration only (capture → decide → update stage → precondition).

docs/design.md, "Data path of one step". The preconditioner keeps the cadence, the
all-finite check, the policy's decisions and the per-layer records; the math is in the
solver families, the communication in the stage and the communicator.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hylo.capture import Reducer
from hylo.config import SOLVER_NAMES, HyLoConfig, SolverName, resolve
from hylo.distributed import Communicator, default_communicator
from hylo.gradmatrix import GradMatrix
from hylo.layers import CapturedCall, LayerBatch, LayerMath, LayerShape, Reduction
from hylo.payload import CONTROL, Payload
from hylo.policy import SolverPolicy, decode_decisions, encode_decisions
from hylo.profiling import DISABLED, Stopwatch
from hylo.recorder import LayerTiming, Recorder
from hylo.recording import run_info
from hylo.records import Decision
from hylo.registry import UNSOLVED, RegisteredLayer, register_layers
from hylo.solvers import HeldState, LayerSolver, RemoteState, family_of
from hylo.solvers.base import UpdateContext, UpdateJob
from hylo.stage import UpdateStage
from hylo.statedict import STATE_FORMAT, check_finite, checked_header, checked_trend, is_index
from hylo.studies import ErrorRecord, RankRecord, StudyRunner
from hylo.version import __version__

#: Decisions kept in ``decision_log`` (oldest dropped first).
DECISION_LOG_SIZE = 100_000
_RESTORABLE = ("update_freq", "damping", "factor_decay", "kl_clip", "lr", "rank_ratio", "rank", "seed")


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """A registered layer as :meth:`HyLoPreconditioner.layer_info` reports it."""

    name: str
    module_type: str
    d_a: int
    d_g: int
    bias: bool
    solver: SolverName
    #: The rank that solved the layer's current state (0 before the first update; -1 while only its
    #: carried statistics are held, after a checkpoint from another world size, until the next update).
    owner: int


@dataclasses.dataclass(frozen=True)
class MemoryUsage:
    """Bytes a preconditioner holds (:meth:`HyLoPreconditioner.memory_breakdown`), by distinct storage."""

    #: Curvature state per layer (solved states, K-FAC's running factors).
    state: dict[str, int]
    #: Calls captured for the next ``step()`` per layer: 0 between steps.
    captured: dict[str, int]
    #: The hybrid policy's gradient-norm EMAs and the per-layer fallback counters.
    bookkeeping: int
    #: Number of distinct tensor storages held.
    tensors: int

    @property
    def total(self) -> int:
        """Everything held, in bytes."""
        return sum(self.state.values()) + sum(self.captured.values()) + self.bookkeeping


class _Storages:
    """Distinct storages seen so far and their bytes (a tensor's whole storage is what it keeps alive)."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def bytes(self, tensors: list[Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key not in self.seen:
                self.seen.add(key)
                total += storage.nbytes()
        return total


@dataclasses.dataclass(frozen=True)
class _StepValues:
    """A step's hyperparameters, evaluated and checked before anything changes."""

    damping: float
    factor_decay: float
    kl_clip: float | None
    lr: float | None


@dataclasses.dataclass(frozen=True)
class _Agreement:
    """What every rank agreed on at a step: all gradients finite, layers with a gradient, layers with rows."""

    finite: bool
    present: list[bool]
    rows: list[bool]
    #: Whether every rank's calls of the layer can give K-FAC factors / low-rank rows (docs/design.md, "Memory").
    factors: list[bool]
    lowrank: list[bool]
    #: Each layer's ‖∇W‖ in float64 (0 where absent), re-measured without overflow where needed.
    norms: Tensor


@dataclasses.dataclass
class _Study:
    """The studies' records of one update and the bytes they sent."""

    rank: list[RankRecord]
    errors: list[ErrorRecord]
    traffic: dict[str, int]


@dataclasses.dataclass
class _Outcome:
    """Everything a step computed; stored on the preconditioner only once the whole step succeeded."""

    kind: str
    needs_update: bool
    norms: Tensor | None = None
    worked: list[RegisteredLayer] = dataclasses.field(default_factory=list)
    batches: list[LayerBatch] = dataclasses.field(default_factory=list)
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    states: dict[str, HeldState] = dataclasses.field(default_factory=dict)
    owners: dict[str, int] = dataclasses.field(default_factory=dict)
    written: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    #: Indices of the preconditioned layers and 1 where a result fell back to the raw gradient.
    fallbacks: tuple[list[int], Tensor] | None = None
    study: _Study | None = None

    def state_of(self, layer: RegisteredLayer) -> HeldState | None:
        """The layer's state after this step: the new one if the step made one, else its current one."""
        return self.states.get(layer.name, layer.state)


def _weak_reducer(reduce: weakref.WeakMethod[Any], index: int, math: LayerMath) -> Reducer:
    """Layer ``index``'s gradient-hook reduction through a weak reference (a dropped preconditioner keeps
    the call raw); a closure, so that a deep copy of the model shares it rather than copying the reference."""

    def reduce_call(x: Tensor, grad_out: Tensor) -> CapturedCall:
        method = reduce()
        return CapturedCall.of(math, (x, grad_out)) if method is None else method(index, x, grad_out)

    return reduce_call


class HyLoPreconditioner:
    """Drop-in natural-gradient preconditioner: call ``step()`` between backward and ``optimizer.step()``.

    ``step()`` rewrites ``.grad`` of every registered layer (``nn.Linear``, ``nn.Conv2d``,
    ``nn.Embedding``, ``nn.MultiheadAttention``'s projections) in place with
    (F̃ + λI)⁻¹ ∇W for the layer's curvature estimate F̃ (see :class:`hylo.HyLoConfig` for the
    options). Layer inputs and output gradients are captured only on update steps
    (``step % update_freq == 0``; step 0 is one); in between the stored state is reused.

    Args:
        model: the model, optionally wrapped in ``DistributedDataParallel``.
        config: a :class:`HyLoConfig`; keyword options override its fields.
        communicator: collectives between ranks; default: torch.distributed's default group
            when initialised with more than one rank, else a 1-rank stand-in.
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, if any: captured output
            gradients are divided by its scale, and steps whose gradients it found non-finite
            are skipped without a warning. Call ``step()`` after ``scaler.unscale_(optimizer)``
            and before ``scaler.step(optimizer)``.
        **options: any :class:`HyLoConfig` field, e.g. ``damping=1e-3``, ``update_freq=20``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: HyLoConfig | None = None,
        communicator: Communicator | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        **options: Any,
    ) -> None:
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self._grad_scaler = grad_scaler
        self.config = dataclasses.replace(config or HyLoConfig(), **options)
        self.comm = communicator if communicator is not None else default_communicator(self.config.bucket_cap_mb)
        self.steps = 0
        #: Per-update decisions (bounded; oldest dropped first).
        self.decision_log: deque[Decision] = deque(maxlen=DECISION_LOG_SIZE)
        self._stage = UpdateStage(self.config.strategy, self.comm)
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._needs_update = False
        # after load_state_dict on P > 1 ranks: agree once whether any rank must recompute
        self._agree_after_load = False
        self._capture_cache: tuple[int, bool, frozenset[str]] = (-1, False, frozenset())
        self._plan_cache: tuple[int, list[Reduction | None]] = (-1, [])
        self._removed = False
        # the model's hooks hold the preconditioner weakly: dropping it closes its files and stops capturing
        capturing = weakref.WeakMethod(self._capturing)

        def should_capture(name: str) -> bool:
            method = capturing()
            return method is not None and method(name)

        found = register_layers(
            model,
            self.config.skip_layers,
            should_capture,
            self.config.initial_solver,
            self.config.conv_rows,
            self.config.kfc_exponent,
            self.config.max_unfold_mb,
        )
        self._registration = found
        self._layers: list[RegisteredLayer] = found.layers
        reduce = weakref.WeakMethod(self._reduce_call)
        for index, layer in enumerate(self._layers):
            layer.capture.reducer = _weak_reducer(reduce, index, layer.math)
        self._skipped = found.skipped
        self._unsupported = found.unsupported
        self._policy = SolverPolicy(self.config, [layer.name for layer in self._layers])
        if self._unsupported:
            by_reason: dict[str, list[str]] = {}
            for name, why in self._unsupported:
                by_reason.setdefault(why, []).append(name or "<root>")
            listed = "; ".join(
                f"{why}: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
                for why, names in by_reason.items()
            )
            warnings.warn(
                f"hylo leaves {len(self._unsupported)} modules unpreconditioned ({listed}); see summary()",
                stacklevel=2,
            )
        if not self._layers:
            raise ValueError(
                "model has no layer hylo can precondition (nn.Linear, nn.Conv2d with groups=1, nn.Embedding, "
                "nn.MultiheadAttention)"
            )
        self._updates = 0
        self._index = {layer.name: i for i, layer in enumerate(self._layers)}
        self._layer_named = {layer.name: layer for layer in self._layers}
        # per layer: the gradient tensor a step last saw and its version (a new backward changes either)
        self._seen: list[tuple[weakref.ref[Tensor], int] | None] = [None] * len(self._layers)
        self._warned_no_rows: set[str] = set()
        # per layer: steps whose preconditioned gradient overflowed (reported at the next update)
        self._fallbacks = torch.zeros(len(self._layers), dtype=torch.long)
        self._watch = DISABLED
        self._recorder: Recorder | None = None
        self._studies: StudyRunner | None = None
        if self.config.profile_dir is not None:
            try:
                self._open_profile()
            except Exception:
                self.remove()  # a refused profile_dir leaves the model without hylo's hooks
                raise

    def _open_profile(self) -> None:
        """Open ``profile_dir`` (refusing hylo's files of another run unless appending) and start timing."""
        device = self._layers[0].math.weight.device
        self._recorder = Recorder(
            self.config.profile_dir,  # type: ignore[arg-type]
            rank=self.comm.rank,
            append=self.config.profile_append,
            names=[layer.name for layer in self._layers],
            studies=self.config.studies,
            top_k=self.config.rank_top_k,
            run=run_info(
                {k: v if not callable(v) else repr(v) for k, v in dataclasses.asdict(self.config).items()},
                self.comm.world_size,
                device,
                __version__,
            ),
        )
        self._watch = Stopwatch(device)
        if "rank" in self.config.studies or "grad_error" in self.config.studies:
            self._studies = StudyRunner(self.config, self.comm, self._layers)

    # ------------------------------------------------------------------ cadence
    def _cadence(self) -> tuple[bool, frozenset[str]]:
        """This step's (update?, layers refreshing their running statistics), computed once per step.

        An update step captures every layer. Otherwise, at a ``factor_update_freq`` step, the
        layers whose family keeps running statistics (K-FAC) capture and refresh them.
        """
        step, update, refreshing = self._capture_cache
        if step != self.steps:
            if self._agree_after_load:  # one small collective, on every rank at the same step
                self._agree_after_load = False
                needs = torch.tensor([self._needs_update])
                self._needs_update = bool(self.comm.any_true(needs)[0])
            freq = resolve("update_freq", self.config.update_freq, self.steps)
            update = self._needs_update or self.steps % freq == 0
            refreshing = frozenset()
            if not update and self.config.factor_update_freq is not None:
                factor_freq = resolve("factor_update_freq", self.config.factor_update_freq, self.steps)
                if self.steps % factor_freq == 0:
                    refreshing = frozenset(
                        layer.name
                        for layer in self._layers
                        if layer.state is not None and family_of(layer.solver).refreshes
                    )
            self._capture_cache = (self.steps, update, refreshing)
        return update, refreshing

    def _capturing(self, name: str | None = None) -> bool:
        """Whether the current step captures (layer ``name``'s, or any layer's) inputs and output gradients."""
        update, refreshing = self._cadence()
        return update or (bool(refreshing) if name is None else name in refreshing)

    # ------------------------------------------------------------------ early reduction
    def _reduce_call(self, index: int, x: Tensor, grad_out: Tensor) -> CapturedCall:
        """Layer ``index``'s call reduced in its gradient hook as this step's plan says (docs/design.md, "Memory")."""
        layer, watch = self._layers[index], self._watch
        begin = watch.mark()
        call = layer.math.capture_call(x, grad_out, self._plans()[index])
        watch.hook(layer.name, begin)
        return call

    def _plans(self) -> list[Reduction | None]:
        """What each layer's calls are reduced to at this step (None: kept raw), fixed at the step's first backward."""
        step, plans = self._plan_cache
        if step != self.steps:
            plans = self._make_plans()
            self._plan_cache = (self.steps, plans)
        return plans

    def _make_plans(self) -> list[Reduction | None]:
        """This step's reductions: K-FAC factors on a refresh; on an update, the path of each layer's solver
        (a study update keeps every call raw); for the hybrid policy, low-rank rows always and K-FAC factors
        where its forecast on this step's rows picks K-FAC."""
        is_update, refreshing = self._cadence()
        scale = 1.0
        if self._grad_scaler is not None and self._grad_scaler.is_enabled():
            scale = 1.0 / float(self._grad_scaler.get_scale())
        if not is_update:
            return [Reduction(False, True, scale) if layer.name in refreshing else None for layer in self._layers]
        if self._study_due(self._updates):
            return [None] * len(self._layers)
        config = self.config
        families: list[str | None] = []
        for layer in self._layers:
            forced = config.override_for(layer.name)
            if forced is not None or (config.solver != "hybrid" and config.solver_fn is None):
                families.append(family_of(forced or config.solver).name)
            else:
                families.append(None)
        forecast: list[str] | None = None
        plans: list[Reduction | None] = []
        for i, family in enumerate(families):
            if family is not None:
                plans.append(Reduction(family != "kfac", family == "kfac", scale))
            elif config.solver_fn is not None:
                plans.append(None)  # a user's rule sees the step's stats only at step(): keep the calls raw
            else:
                forecast = forecast or self._forecast()
                plans.append(Reduction(True, forecast[i] == "kfac", scale))
        return plans

    def _forecast(self) -> list[str]:
        """The hybrid policy's family for each layer on the rows captured so far and its current critical flags."""
        world = self.comm.world_size
        shapes = []
        for layer in self._layers:
            counts = [CapturedCall.of(layer.math, call) for call in layer.capture.calls()]
            rows, kfac_rows = sum(c.rows for c in counts), sum(c.kfac_rows for c in counts)
            for record in layer.capture.pending():
                assert record.inputs is not None
                grad_like = record.inputs if record.out_shape is None else torch.empty(record.out_shape, device="meta")
                more = layer.math.row_counts(record.inputs, grad_like)
                rows, kfac_rows = rows + more[0], kfac_rows + more[1]
            kept = self.config.rows_kept(rows) if rows else 0
            shapes.append(LayerShape.of(layer.math, rows, kfac_rows, kept, world))
        freq = resolve("update_freq", self.config.update_freq, self.steps)
        decisions = self._policy.decide(self.steps, shapes, freq, world, sample=False)
        return [family_of(decision.solver).name for decision in decisions]

    def _study_due(self, index: int) -> bool:
        """Whether the ``index``-th update runs a study (whose reference needs every call raw)."""
        if self._studies is None:
            return False
        config = self.config
        return ("rank" in config.studies and index % config.rank_every == 0) or (
            "grad_error" in config.studies and index % config.grad_error_every == 0
        )

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of all registered layers in place.

        A step applies whole or not at all: if it raises, the step count, every layer's state and
        the gradients are as they were (docs/design.md, "Reliability").
        """
        if self._removed:
            raise RuntimeError("this HyLoPreconditioner was removed; create a new one")
        step = self.steps
        watch = self._watch
        watch.start()
        traffic = dict(self.comm.bytes_by_tag) if self._recorder is not None else {}
        try:
            values = self._resolve(step)
            is_update, refreshing = self._cadence()
            grads = self._gradients()
            capturing = [is_update or layer.name in refreshing for layer in self._layers]
            norms, finite = self._norms(grads)
            agreed = self._agree(step, grads, capturing, norms, finite)
            watch.lap("check")
            generator, trend = self._generator.get_state(), self._policy.trend.snapshot()
            try:
                outcome = self._run(step, values, grads, agreed, is_update, capturing)
            except BaseException:
                self._generator.set_state(generator)
                self._policy.trend.restore(trend)
                raise
        except BaseException:
            watch.finish()  # nothing of a failed step is recorded
            raise
        finally:
            for layer in self._layers:
                layer.capture.clear()
        self._commit(step, outcome, grads, traffic)

    def _resolve(self, step: int) -> _StepValues:
        """Every hyperparameter of this step, evaluated (and checked) before anything changes."""
        config = self.config
        return _StepValues(
            damping=resolve("damping", config.damping, step),
            factor_decay=resolve("factor_decay", config.factor_decay, step),
            kl_clip=None if config.kl_clip is None else resolve("kl_clip", config.kl_clip, step),
            lr=None if config.lr is None or config.kl_clip is None else resolve("lr", config.lr, step),
        )

    def _gradients(self) -> list[GradMatrix | None]:
        """Each layer's ∇W, or None when it has no gradient since the previous ``step()``.

        A gradient is new when backward created or modified it after the previous step wrote
        (or left) it: the same tensor at the same version counter means no backward reached the
        layer (conditional computation), or that ``step()`` is being called twice.
        """
        grads: list[GradMatrix | None] = []
        for layer, seen in zip(self._layers, self._seen, strict=True):
            weight_grad = layer.math.grad_tensor()
            if weight_grad is None or (
                seen is not None and seen[0]() is weight_grad and seen[1] == weight_grad._version
            ):
                grads.append(None)
            else:
                grads.append(layer.math.grad_parts())
        return grads

    def _norms(self, grads: list[GradMatrix | None]) -> tuple[Tensor, Tensor]:
        """Per-layer ‖∇W‖ in float64 (0 where absent) and whether every present gradient is finite.

        One norm per layer in the layer's working dtype, no host synchronisation. Such a norm can
        overflow for a huge finite gradient: when one is not finite, :meth:`_safe_norms`
        re-measures them all in a form that cannot.
        """
        device = self._layers[0].math.weight.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        norms = torch.stack(
            [
                zero if g is None else g.norm(layer.math.dtype).to(torch.float64)
                for layer, g in zip(self._layers, grads, strict=True)
            ]
        )
        return norms, torch.isfinite(norms).all()

    def _agree(
        self, step: int, grads: list[GradMatrix | None], capturing: list[bool], norms: Tensor, finite: Tensor
    ) -> _Agreement:
        """This step's finiteness, layers present and layers with captured rows, identical on every rank.

        One host synchronisation; with P > 1 ranks, one all-reduce of a few flags, every step: the
        decision to skip or to update is then the same on every rank (docs/design.md, "Reliability").
        Usage errors (no gradient at all, ``step()`` twice without a backward) raise on every rank.
        """
        layers = self._layers
        present = [g is not None for g in grads]
        calls = [
            [CapturedCall.of(layer.math, call) for call in layer.capture.calls()] if c and p else []
            for layer, c, p in zip(layers, capturing, present, strict=True)
        ]
        rows = [any(call.rows for call in mine) for mine in calls]
        factors = [all(call.raw is not None or call.factors is not None for call in mine) for mine in calls]
        lowrank = [all(call.raw is not None or call.lowrank is not None for call in mine) for mine in calls]
        usable = any(present)
        if self.comm.world_size > 1:
            device = layers[0].math.weight.device
            n = len(layers)
            paths = [*factors, *lowrank] if any(capturing) else []  # the same on every rank: the cadence
            local = torch.tensor([usable, *present, *(not r for r in rows), *paths], dtype=torch.bool, device=device)
            flags = self.comm.all_true(torch.cat([finite.reshape(1), local])).tolist()
            all_finite, all_usable = flags[0], flags[1]
            present = flags[2 : 2 + n]
            rows = [not none for none in flags[2 + n : 2 + 2 * n]]
            if paths:
                factors, lowrank = flags[2 + 2 * n : 2 + 3 * n], flags[2 + 3 * n :]
        else:
            all_finite, all_usable = bool(finite.item()) if usable else True, usable
        if not all_usable:
            raise RuntimeError(self._no_gradient_message(step, usable))
        if not all_finite:  # rare: re-measure in a form that cannot overflow, then agree again
            norms, all_finite = self._safe_norms(grads)
        return _Agreement(bool(all_finite), present, rows, factors, lowrank, norms)

    def _no_gradient_message(self, step: int, usable: bool) -> str:
        if usable:
            return f"step {step}: another rank has no gradient for any registered layer; every rank stops here"
        stale = [layer.name for layer in self._layers if layer.math.grad_tensor() is not None]
        if stale:
            return (
                f"step {step}: no gradient has changed since the previous step() (layers {stale[:4]}): "
                "step() was called twice without a loss.backward() in between"
            )
        names = [layer.name for layer in self._layers]
        return f"step {step}: no registered layer has a gradient ({names[:4]}): call step() after loss.backward()"

    def _safe_norms(self, grads: list[GradMatrix | None]) -> tuple[Tensor, bool]:
        """Norms (float64) and finiteness of every gradient from its largest entry m and ‖∇W/m‖·m, which
        cannot overflow before the final product; agreed over ranks (one more collective, on this path only)."""
        device = self._layers[0].math.weight.device
        norms, finite = [], []
        for parts in grads:
            if parts is None:
                norms.append(torch.zeros((), dtype=torch.float64, device=device))
                finite.append(torch.ones((), dtype=torch.bool, device=device))
                continue
            g = parts.full()
            largest = torch.linalg.vector_norm(g, ord=float("inf")).to(torch.float64)
            ok = torch.isfinite(largest)
            tiny = torch.finfo(torch.float64).tiny
            scaled = torch.linalg.vector_norm(g.to(torch.float64) / largest.clamp_min(tiny))
            norms.append(torch.where(ok, scaled * largest, largest))
            finite.append(ok)
        agreed = torch.stack(finite).all()
        if self.comm.world_size > 1:
            agreed = self.comm.all_true(agreed.reshape(1))[0]
        return torch.stack(norms), bool(agreed.item())

    def _run(
        self,
        step: int,
        values: _StepValues,
        grads: list[GradMatrix | None],
        agreed: _Agreement,
        is_update: bool,
        capturing: list[bool],
    ) -> _Outcome:
        """Everything a step computes, nothing stored on the preconditioner yet (see :meth:`_commit`)."""
        watch = self._watch
        if not agreed.finite:
            self._warn_non_finite(step, grads)
            return _Outcome("skipped", needs_update=self._needs_update or is_update)
        present = agreed.present
        norms = agreed.norms
        self._policy.trend.observe(norms, None if all(present) else torch.tensor(present, device=norms.device))
        outcome = _Outcome("apply", needs_update=self._needs_update, norms=norms)
        if any(capturing):
            taking = [c and p for c, p in zip(capturing, present, strict=True)]
            self._warn_no_rows(
                step, [layer for layer, t, r in zip(self._layers, taking, agreed.rows, strict=True) if t and not r]
            )
            worked = [layer for layer, t, r in zip(self._layers, taking, agreed.rows, strict=True) if t and r]
            outcome.worked, outcome.batches = worked, self._batches(worked)
            watch.lap("capture", [layer.name for layer in worked])
            if is_update:
                outcome.kind = "update"
                self._update(step, values, outcome, agreed)
                outcome.study = self._run_studies(step, values, outcome, grads)
            elif worked:
                outcome.kind = "refresh"
                self._refresh(values, outcome)
        ready = [
            (layer, g)
            for layer, g, p in zip(self._layers, grads, present, strict=True)
            if p and g is not None and self._solved(layer, outcome)
        ]
        outcome.written = self._precondition(ready, outcome, values)
        return outcome

    def _solved(self, layer: RegisteredLayer, outcome: _Outcome) -> bool:
        """Whether the layer's state after this step can precondition: solved here, or by its owner under "gradient"."""
        state = outcome.state_of(layer)
        if isinstance(state, RemoteState):
            owner = outcome.owners.get(layer.name, layer.owner)
            return self.config.strategy == "gradient" and self.comm.world_size > 1 and owner != UNSOLVED
        return state is not None

    def _commit(self, step: int, outcome: _Outcome, grads: list[GradMatrix | None], traffic: dict[str, int]) -> None:
        """Store what a successful step computed, write the gradients back and record the step."""
        for layer in self._layers:
            if layer.name in outcome.states:
                layer.state = outcome.states[layer.name]
                layer.owner = outcome.owners.get(layer.name, layer.owner)
        for decision in outcome.decisions:
            self._layer_named[decision.layer].solver = decision.solver
        self.decision_log.extend(outcome.decisions)
        if outcome.fallbacks is not None:
            indices, counts = outcome.fallbacks
            self._fallbacks = self._fallbacks.to(counts.device)
            self._fallbacks[indices] += counts
        if outcome.kind == "update":
            self._updates += 1
            self._report_fallbacks(step)
        self._needs_update = outcome.needs_update
        for layer in self._layers:
            if layer.name in outcome.written:
                layer.math.set_grad_matrix(outcome.written[layer.name])
        for layer in self._layers:  # after every write: attention's q, k and v share one .grad
            weight_grad = layer.math.grad_tensor()
            self._seen[self._index[layer.name]] = (
                None if weight_grad is None else (weakref.ref(weight_grad), weight_grad._version)
            )
        self._watch.lap("precondition")
        self.steps = step + 1
        if self._recorder is not None:
            self._recorder.record_decisions(outcome.decisions)
            if outcome.study is not None:
                self._recorder.record_rank(step, outcome.study.rank)
                self._recorder.record_errors(step, outcome.study.errors)
            if self._recorder.norms is not None and outcome.norms is not None:
                self._record_norms(step, outcome.norms, outcome.written)
            self._record(step, outcome, traffic)

    def _warn_non_finite(self, step: int, grads: list[GradMatrix | None]) -> None:
        """Say which local layers hold non-finite gradients (silent when a GradScaler expects it)."""
        if self._grad_scaler is not None and self._grad_scaler.is_enabled():
            return  # the scaler found infs too: it skips the optimizer step and backs off
        bad = [
            layer.name
            for layer, g in zip(self._layers, grads, strict=True)
            if g is not None and not bool(g.all_finite())
        ]
        where = f"in {bad}" if bad else "on another rank"
        if bad and self.comm.world_size > 1:
            where += f" on rank {self.comm.rank}"
        warnings.warn(
            f"step {step}: non-finite gradients {where}; gradients left unpreconditioned and stored state untouched",
            stacklevel=5,
        )

    def _warn_no_rows(self, step: int, layers: list[RegisteredLayer]) -> None:
        """Warn once per layer that has a gradient but whose hooks captured nothing at an update."""
        new = [layer.name for layer in layers if layer.name not in self._warned_no_rows]
        if not new:
            return
        self._warned_no_rows.update(new)
        warnings.warn(
            f"step {step}: layers {new} have gradients but their hooks captured no rows (is the module "
            "called in train mode, with autograd enabled, through its own forward?); they keep their "
            "previous state (unpreconditioned until they have one). Warned once per layer.",
            stacklevel=5,
        )

    def _record(self, step: int, outcome: _Outcome, before: dict[str, int]) -> None:
        """Write this step's timing rows (flushing every file after an update)."""
        assert self._recorder is not None
        times = self._watch.finish()
        study = outcome.study.traffic if outcome.study is not None else {}
        sent = {tag: n - before.get(tag, 0) - study.get(tag, 0) for tag, n in self.comm.bytes_by_tag.items()}
        self._recorder.record_step(step, outcome.kind, times, sum(sent.values()))
        if outcome.kind in ("update", "refresh"):
            self._recorder.record_layers(
                step,
                [
                    LayerTiming(
                        layer.name,
                        layer.solver,
                        batch.rows,
                        family_of(layer.solver).rows_kept(batch, layer.solver),
                        layer.math.d_a,
                        layer.math.d_g,
                        sent.get(layer.name, 0),
                        layer.state.nbytes() if layer.state is not None else 0,
                    )
                    for layer, batch in zip(outcome.worked, outcome.batches, strict=True)
                ],
                times,
            )
            self._recorder.flush()

    def _record_norms(self, step: int, norms: Tensor, written: dict[str, Tensor]) -> None:
        """Queue the step's grad-norm rows: norms before, the trend's view, norms of what was written back."""
        assert self._recorder is not None and self._recorder.norms is not None
        after = norms.clone()
        for i, layer in enumerate(self._layers):
            if layer.name in written:
                after[i] = torch.linalg.vector_norm(written[layer.name].to(layer.math.dtype))
        trend = self._policy.trend
        assert trend.ema is not None
        self._recorder.norms.add(step, torch.stack((norms, trend.ema, after)), trend.last_trend, trend.critical)

    def _run_studies(
        self, step: int, values: _StepValues, outcome: _Outcome, grads: list[GradMatrix | None]
    ) -> _Study | None:
        """The rank and gradient-error studies when this update is sampled, with their traffic by tag."""
        if self._studies is None or self._recorder is None or not outcome.worked:
            return None
        index = self._updates
        rank = "rank" in self.config.studies and index % self.config.rank_every == 0
        grad_error = "grad_error" in self.config.studies and index % self.config.grad_error_every == 0
        if not (rank or grad_error):
            return None
        before = dict(self.comm.bytes_by_tag)
        names = [layer.name for layer in outcome.worked]
        worked_grads = [g for name in names if (g := grads[self._index[name]]) is not None]
        context = dataclasses.replace(self._context(values, seed=0), watch=DISABLED)  # timed as one "study" lap
        rank_records, error_records = self._studies.run(
            step, names, outcome.batches, worked_grads, context, rank, grad_error
        )
        self._watch.lap("study")
        traffic = {tag: n - before.get(tag, 0) for tag, n in self.comm.bytes_by_tag.items()}
        return _Study(rank_records, error_records, traffic)

    def _batches(self, layers: list[RegisteredLayer]) -> list[LayerBatch]:
        """The captured calls of ``layers`` at this step, counted once (empty where only other ranks have rows)."""
        grad_scale = 1.0
        if self._grad_scaler is not None and self._grad_scaler.is_enabled():
            grad_scale = float(self._grad_scaler.get_scale())
        return [
            LayerBatch.collect(
                layer.math, layer.capture.calls(), self.config.rows_kept, grad_scale, self.config.damping_convention
            )
            for layer in layers
        ]

    def _context(self, values: _StepValues, seed: int) -> UpdateContext:
        """The per-update values the solver families read."""
        return UpdateContext(
            rank=self.comm.rank,
            damping=values.damping,
            factor_decay=values.factor_decay,
            seed=seed,
            kis_estimator=self.config.kis_estimator,
            watch=self._watch,
        )

    def _refresh(self, values: _StepValues, outcome: _Outcome) -> None:
        """A ``factor_update_freq`` step: fold the batches into the running statistics (no solve)."""
        context = self._context(values, seed=0)  # no draws: a refresh keeps the KIS generator's sequence
        jobs = [
            UpdateJob(layer.name, layer.solver, batch, layer.state)
            for layer, batch in zip(outcome.worked, outcome.batches, strict=True)
        ]
        result = self._stage.refresh(jobs, context)
        if result.rejected:
            warnings.warn(
                f"step {self.steps}: non-finite factors for {result.rejected}; keeping their previous ones",
                stacklevel=5,
            )
        outcome.states.update((k, v) for k, v in result.states.items() if k not in result.rejected)

    def _decide(self, step: int, outcome: _Outcome, agreed: _Agreement) -> list[LayerSolver]:
        """Choose the solver of every layer this update works on; identical on all ranks.

        A layer whose calls every rank reduced for one family only keeps that family when the
        decision is the other one (reason ``"planned"``, docs/design.md, "Memory").
        """
        freq = resolve("update_freq", self.config.update_freq, step)
        world = self.comm.world_size
        batch_of = dict(zip([layer.name for layer in outcome.worked], outcome.batches, strict=True))
        shapes = [
            batch_of[layer.name].shape(world)
            if layer.name in batch_of
            else LayerShape(layer.math.d_a, layer.math.d_g, world_size=world)
            for layer in self._layers
        ]
        decisions = self._policy.decide(step, shapes, freq, world)
        if world > 1 and self._policy.dynamic:
            key = (CONTROL, "decisions")
            device = self._layers[0].math.weight.device
            encoded = self.comm.broadcast(Payload({key: encode_decisions(decisions, device)}), src=0)[key]
            decisions = decode_decisions(encoded, step, [layer.name for layer in self._layers])
        outcome.decisions = [self._feasible(decision, agreed) for decision in decisions if decision.layer in batch_of]
        self._watch.lap("decide")
        return [decision.solver for decision in outcome.decisions]

    def _feasible(self, decision: Decision, agreed: _Agreement) -> Decision:
        """``decision``, or the family its layer's calls were reduced for when they cannot serve it."""
        index = self._index[decision.layer]
        kfac = family_of(decision.solver).name == "kfac"
        if kfac and not agreed.factors[index] and agreed.lowrank[index]:
            variant, _ = self._policy.lowrank_variant(decision.step, decision.critical)
            return dataclasses.replace(decision, solver=variant, reason="planned")
        if not kfac and not agreed.lowrank[index] and agreed.factors[index]:
            return dataclasses.replace(decision, solver="kfac", reason="planned")
        return decision

    def _update(self, step: int, values: _StepValues, outcome: _Outcome, agreed: _Agreement) -> None:
        """Run the update stage on the layers with rows; their new states (non-finite ones rejected) go to ``outcome``."""
        solvers = self._decide(step, outcome, agreed)
        context = self._context(values, seed=int(torch.randint(0, 2**62, (1,), generator=self._generator)))
        jobs = [
            UpdateJob(layer.name, solver, batch, layer.state)
            for layer, batch, solver in zip(outcome.worked, outcome.batches, solvers, strict=True)
        ]
        outcome.needs_update = False
        if not jobs:
            return
        result = self._stage.update(jobs, context)
        if result.rejected:
            warnings.warn(
                f"step {step}: non-finite curvature for {result.rejected}; keeping their previous state",
                stacklevel=5,
            )
        outcome.needs_update = bool(result.rejected)
        for job in jobs:
            if job.name not in result.rejected:
                outcome.states[job.name] = result.states[job.name]
                outcome.owners[job.name] = result.owners[job.name]

    def _precondition(
        self, ready: list[tuple[RegisteredLayer, GradMatrix]], outcome: _Outcome, values: _StepValues
    ) -> dict[str, Tensor]:
        """Every ready layer's preconditioned gradient (with kl_clip scaling), by layer, not yet written back.

        A layer whose result is not finite although its gradient is (an overflow in the solve's
        arithmetic) keeps its raw gradient this step; such fallbacks are counted without a host
        sync and reported at the next update.
        """
        watch = self._watch
        if not ready:
            return {}
        items = [
            (layer.name, state, outcome.owners.get(layer.name, layer.owner), grad)
            for layer, grad in ready
            if (state := outcome.state_of(layer)) is not None
        ]
        results = self._stage.precondition(items, watch)
        sums = torch.stack([results[layer.name].sum().to(torch.float64) for layer, _ in ready])
        ok = torch.isfinite(sums)
        outcome.fallbacks = ([self._index[layer.name] for layer, _ in ready], (~ok).long())
        triples = [
            (layer, grad, grad.fill_where_not(ok[i], results[layer.name])) for i, (layer, grad) in enumerate(ready)
        ]
        if values.kl_clip is not None:
            assert values.lr is not None
            vg = torch.stack([g.dot(v) for _, g, v in triples]).sum().abs() * values.lr**2
            scale = torch.where(vg > 0, torch.sqrt(values.kl_clip / vg), torch.ones_like(vg)).clamp(max=1.0)
            triples = [(layer, g, v * scale.to(v.dtype)) for layer, g, v in triples]
        watch.lap("precondition", [layer.name for layer, _, _ in triples])
        return {layer.name: v for layer, _, v in triples}

    def _report_fallbacks(self, step: int) -> None:
        """Warn (at an update, where the host syncs anyway) about layers that fell back to their raw gradient."""
        counts = self._fallbacks.tolist()
        if any(counts):
            self._fallbacks.zero_()
            listed = {layer.name: c for layer, c in zip(self._layers, counts, strict=True) if c}
            warnings.warn(
                f"step {step}: the preconditioned gradient of {listed} (layer: steps) was not finite although "
                "the gradient was; those steps used the raw gradient. Raise damping?",
                stacklevel=5,
            )

    # ------------------------------------------------------------------ introspection
    def layer_info(self) -> list[LayerInfo]:
        """One record per registered layer: name, module type, d_a, d_g, bias, current solver and owner."""
        return [
            LayerInfo(
                layer.name,
                layer.math.module_type,
                layer.math.d_a,
                layer.math.d_g,
                layer.math.bias is not None,
                layer.solver,
                layer.owner,
            )
            for layer in self._layers
        ]

    def solver_of(self, name: str) -> SolverName:
        """The solver layer ``name`` used at the latest update (its configured one before any)."""
        for layer in self._layers:
            if layer.name == name:
                return layer.solver
        raise KeyError(f"no registered layer named {name!r}")

    def memory_usage(self) -> dict[str, int]:
        """Bytes of curvature state held per layer."""
        return {layer.name: layer.state.nbytes() if layer.state else 0 for layer in self._layers}

    def memory_breakdown(self) -> MemoryUsage:
        """Everything the preconditioner holds, by distinct storage: states, captured calls, bookkeeping.

        Between steps ``captured`` is 0 and the state bytes equal :meth:`memory_usage` (docs/design.md,
        "Memory"); during a step's forward and backward, ``captured`` is what the hooks keep for ``step()``.
        """
        seen = _Storages()
        state = {
            layer.name: seen.bytes(list(layer.state.tensors().values())) if layer.state is not None else 0
            for layer in self._layers
        }
        captured = {}
        for layer in self._layers:
            held: list[Tensor] = []
            for record in layer.capture.records:
                held += [t for t in (record.inputs, record.grad_output) if t is not None]
                if record.call is not None:
                    held += record.call.tensors()
            captured[layer.name] = seen.bytes(held)
        moments = self._policy.trend.moments
        bookkeeping = seen.bytes([self._fallbacks] + ([] if moments is None else [moments]))
        return MemoryUsage(state, captured, bookkeeping, len(seen.seen))

    def summary(self) -> str:
        """A printable table of registered layers and of the modules left alone."""
        lines = [
            f"HyLoPreconditioner(solver={self.config.solver!r}, layers={len(self._layers)}, "
            f"world_size={self.comm.world_size})",
            f"  {'layer':<32} {'type':<9} {'d_a':>7} {'d_g':>7} {'bias':>5}  solver",
        ]
        for info in self.layer_info():
            lines.append(
                f"  {info.name:<32} {info.module_type:<9} {info.d_a:>7} {info.d_g:>7} {str(info.bias):>5}  {info.solver}"
            )
        for name, why in [*self._skipped, *self._unsupported]:
            lines.append(f"  not preconditioned: {name or '<root>'} ({why})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    # ------------------------------------------------------------------ lifecycle
    def remove(self) -> None:
        """Detach every hook and close the profile files; the model trains as if hylo had never been attached."""
        self._registration.remove()
        self._removed = True
        self.close()

    def close(self) -> None:
        """Flush and close the ``profile_dir`` files and stop recording (idempotent; also run at exit)."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
            self._watch = DISABLED

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: step, constant options, per-layer states."""
        layers: dict[str, Any] = {}
        for layer in self._layers:
            entry: dict[str, Any] = {
                "solver": layer.solver,
                "d_a": layer.math.d_a,
                "d_g": layer.math.d_g,
                "owner": layer.owner,
            }
            if isinstance(layer.state, RemoteState):
                entry["remote"] = True  # solved on layer.owner: only what the next update builds on is here
                entry["carried"] = {k: v.detach().clone() for k, v in layer.state.carried().items()}
            elif layer.state is not None:
                entry.update(layer.state.to_dict())
            layers[layer.name] = entry
        return {
            "format": STATE_FORMAT,
            "hylo_version": __version__,
            "steps": self.steps,
            "needs_update": self._needs_update,
            "generator": self._generator.get_state(),
            "updates": self._updates,
            "trend": self._policy.trend.state_dict(),
            "config": self.config.constants(),
            "rank": self.comm.rank,
            "world_size": self.comm.world_size,
            "layers": layers,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a ``state_dict``, possibly saved at another world size or rank.

        Everything is checked before anything changes: a state that does not fit raises
        ``ValueError`` and leaves this preconditioner as it was. Full layer states load
        anywhere; a ``remote`` entry (``strategy="gradient"``) is exact only on the rank that
        saved it, in a world of the same size — elsewhere the layer is recomputed at the next
        step (keeping what it carries, e.g. K-FAC's running factors). An owner outside this
        world is reset to 0 (the next update assigns owners anew).
        """
        sd = checked_header(state_dict)
        world, rank = self.comm.world_size, self.comm.rank
        saved = sd["layers"]
        names = [layer.name for layer in self._layers]
        missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names), key=str)
        if missing or unexpected:
            raise ValueError(f"state_dict is for a different layer set: missing {missing}, unexpected {unexpected}")
        own_file = (sd.get("rank"), sd.get("world_size")) == (rank, world) and self.config.strategy == "gradient"
        restored = {layer.name: self._restore(layer, saved[layer.name], own_file) for layer in self._layers}

        config = sd.get("config", {})
        # the saved running factors' scale depends on the convention and the exponent
        for option in ("solver", "damping_convention", "kfc_exponent"):
            mine = getattr(self.config, option)
            if config.get(option, mine) != mine:
                raise ValueError(
                    f"state_dict was made with {option}={config[option]!r}, this preconditioner uses {mine!r}"
                )
        overrides = {k: config[k] for k in _RESTORABLE if k in config and not callable(getattr(self.config, k))}
        try:
            new_config = dataclasses.replace(self.config, **overrides)
        except (TypeError, ValueError) as err:
            raise ValueError(f"state_dict's config does not apply: {err}") from err
        generator = torch.Generator()
        try:
            generator.set_state(sd["generator"])
        except (TypeError, RuntimeError, ValueError) as err:
            raise ValueError(f"state_dict has no valid KIS generator state: {err}") from err
        trend = None
        if "trend" in sd:
            trend = checked_trend(
                sd["trend"], self._policy.trend, len(self._layers), self._layers[0].math.weight.device
            )

        # ---- everything fits: apply (nothing below raises)
        self.config = new_config
        self._policy.config = new_config
        recompute = False
        for layer in self._layers:
            layer.solver, layer.state, layer.owner, missing_state = restored[layer.name]
            recompute = recompute or missing_state
        self.steps = sd["steps"]
        self._updates = sd.get("updates", 0)
        self._needs_update = sd["needs_update"] or recompute
        self._agree_after_load = world > 1
        self._capture_cache = (-1, False, frozenset())
        self._plan_cache = (-1, [])
        self._generator = generator
        if trend is not None:
            self._policy.trend = trend

    def _restore(
        self, layer: RegisteredLayer, entry: Any, own_file: bool
    ) -> tuple[SolverName, HeldState | None, int, bool]:
        """A saved layer entry checked against ``layer``: (solver, state, owner, must recompute).

        ``own_file``: saved by this rank in a world of this size under ``"gradient"``, so a
        remote entry is exactly what this rank held. ``ValueError`` if the entry does not fit.
        """
        m, where = layer.math, f"layer {layer.name!r}"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: state_dict entry is not a mapping but {type(entry).__name__}")
        for key in ("d_a", "d_g", "solver"):
            if key not in entry:
                raise ValueError(f"{where}: state_dict entry lacks {key!r}")
        if not (is_index(entry["d_a"]) and is_index(entry["d_g"])):
            raise ValueError(f"{where}: state_dict has non-integer shape (d_g={entry['d_g']!r}, d_a={entry['d_a']!r})")
        if (entry["d_a"], entry["d_g"]) != (m.d_a, m.d_g):
            raise ValueError(
                f"{where}: state_dict has shape (d_g={entry['d_g']}, d_a={entry['d_a']}), "
                f"model has (d_g={m.d_g}, d_a={m.d_a})"
            )
        solver = entry["solver"]
        if not isinstance(solver, str) or solver not in SOLVER_NAMES:
            raise ValueError(f"{where}: state_dict names an unknown solver {solver!r}")
        owner = entry.get("owner", 0)
        if not (is_index(owner) or owner == UNSOLVED):
            raise ValueError(f"{where}: state_dict's owner {owner!r} is not a rank")
        remote = entry.get("remote", False)
        if not isinstance(remote, bool):
            raise ValueError(f"{where}: state_dict's remote mark {remote!r} is not a bool")
        in_world = 0 <= owner < self.comm.world_size
        if remote:
            carried = entry.get("carried")
            if carried is not None and not (
                isinstance(carried, Mapping) and all(isinstance(t, Tensor) for t in carried.values())
            ):
                raise ValueError(f"{where}: state_dict's carried tensors are not a dict of tensors")
            moved = {str(k): t.to(m.weight.device) for k, t in (carried or {}).items()}
            check_finite(where, moved)
            try:
                state = RemoteState(family_of(solver).name, moved)
            except ValueError:  # "hybrid": nothing was solved for it
                return solver, None, owner if in_world else 0, True
            exact = own_file and carried is not None and in_world and owner != self.comm.rank
            if exact:
                return solver, state, owner, False
            # elsewhere the owner's state is not on its rank: recompute, building on what the layer carries
            return solver, state if moved else None, UNSOLVED, True
        if "tensors" not in entry:
            return solver, None, owner if in_world else 0, False
        try:
            full = family_of(solver).state_from_dict(entry, m.d_a, m.d_g, m.weight.device)
        except KeyError as err:
            raise ValueError(f"{where}: state_dict entry lacks {err}") from err
        except (ValueError, TypeError, AttributeError, RuntimeError) as err:
            raise ValueError(f"{where}: {err}") from err
        check_finite(where, full.tensors())
        return solver, full, owner if in_world else 0, False
