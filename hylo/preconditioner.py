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

from hylo.config import SOLVER_NAMES, HyLoConfig, SolverName, resolve
from hylo.distributed import Communicator, default_communicator
from hylo.layers import LayerBatch
from hylo.payload import CONTROL, Payload
from hylo.policy import SolverPolicy, decode_decisions, encode_decisions
from hylo.profiling import DISABLED, Stopwatch
from hylo.recorder import LayerTiming, Recorder
from hylo.recording import run_info
from hylo.records import Decision
from hylo.registry import RegisteredLayer, register_layers
from hylo.solvers import HeldState, LayerSolver, RemoteState, family_of
from hylo.solvers.base import UpdateContext, UpdateJob
from hylo.stage import UpdateStage
from hylo.studies import StudyRunner
from hylo.version import __version__

STATE_FORMAT = 1
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
    #: The rank that solved the layer's current state (0 before the first update).
    owner: int


class HyLoPreconditioner:
    """Drop-in natural-gradient preconditioner: call ``step()`` between backward and ``optimizer.step()``.

    ``step()`` rewrites ``.grad`` of every registered ``nn.Linear``/``nn.Conv2d`` in place with
    (F̃ + λI)⁻¹ ∇W for the layer's curvature estimate F̃ (see :class:`hylo.HyLoConfig` for the
    options). Layer inputs and output gradients are captured only on update steps
    (``step % update_freq == 0``; step 0 is one); in between the stored state is reused.

    Args:
        model: the model, optionally wrapped in ``DistributedDataParallel``.
        config: a :class:`HyLoConfig`; keyword options override its fields.
        communicator: collectives between ranks; default: torch.distributed's default group
            when initialised with more than one rank, else a 1-rank stand-in.
        **options: any :class:`HyLoConfig` field, e.g. ``damping=1e-3``, ``update_freq=20``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: HyLoConfig | None = None,
        communicator: Communicator | None = None,
        **options: Any,
    ) -> None:
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
        self._removed = False
        # the model's hooks hold the preconditioner weakly: dropping it closes its files and stops capturing
        capturing = weakref.WeakMethod(self._capturing)

        def should_capture(name: str) -> bool:
            method = capturing()
            return method is not None and method(name)

        found = register_layers(
            model, self.config.skip_layers, should_capture, self.config.initial_solver, self.config.conv_rows
        )
        self._layers: list[RegisteredLayer] = found.layers
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
            raise ValueError("model has no layer hylo can precondition (nn.Linear or nn.Conv2d with groups=1)")
        self._updates = 0
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

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of all registered layers in place."""
        if self._removed:
            raise RuntimeError("this HyLoPreconditioner was removed; create a new one")
        step = self.steps
        watch = self._watch
        watch.start()
        traffic = dict(self.comm.bytes_by_tag) if self._recorder is not None else {}
        grads = self._gradients()
        is_update, refreshing = self._cadence()
        norms = torch.stack(
            [torch.linalg.vector_norm(g.to(layer.math.dtype)) for layer, g in zip(self._layers, grads, strict=True)]
        ).to(torch.float64)
        kind = "apply"
        worked: list[RegisteredLayer] = []
        batches: list[LayerBatch] = []
        study_traffic: dict[str, int] = {}
        try:
            if not self._all_finite(norms, is_update or bool(refreshing)):
                kind = "skipped"
                bad = [layer.name for layer, g in zip(self._layers, grads, strict=True) if not torch.isfinite(g).all()]
                warnings.warn(
                    f"step {step}: non-finite gradients in {bad or 'another rank'}; gradients left "
                    "unpreconditioned and stored factors untouched",
                    stacklevel=2,
                )
                self._needs_update = self._needs_update or is_update
                watch.lap("check")
                return
            self._policy.trend.observe(norms)
            watch.lap("check")
            if is_update:
                kind, worked = "update", self._layers
                batches = self._batches(step, worked)
                watch.lap("capture", [layer.name for layer in worked])
                self._update(step, batches, self._decide(step, batches))
                self._updates += 1
            elif refreshing:
                kind, worked = "refresh", [layer for layer in self._layers if layer.name in refreshing]
                batches = self._batches(step, worked)
                watch.lap("capture", [layer.name for layer in worked])
                self._refresh(step, worked, batches)
            study_traffic = self._run_studies(step, batches, grads) if kind == "update" else {}
            written = self._precondition(grads, step)
            if self._recorder is not None and self._recorder.norms is not None:
                self._record_norms(step, norms, written)
        finally:
            for layer in self._layers:
                layer.capture.clear()
            if self._recorder is not None:
                self._record(step, kind, worked, batches, traffic, study_traffic)
            self.steps += 1

    def _record(
        self,
        step: int,
        kind: str,
        worked: list[RegisteredLayer],
        batches: list[LayerBatch],
        before: dict[str, int],
        study: dict[str, int],
    ) -> None:
        """Write this step's timing rows (flushing every file after an update)."""
        assert self._recorder is not None
        times = self._watch.finish()
        sent = {tag: n - before.get(tag, 0) - study.get(tag, 0) for tag, n in self.comm.bytes_by_tag.items()}
        self._recorder.record_step(step, kind, times, sum(sent.values()))
        if kind in ("update", "refresh"):
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
                    for layer, batch in zip(worked, batches, strict=True)
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

    def _run_studies(self, step: int, batches: list[LayerBatch], grads: list[Tensor]) -> dict[str, int]:
        """The rank and gradient-error studies when this update is sampled; returns their traffic by tag."""
        if self._studies is None or self._recorder is None:
            return {}
        index = self._updates - 1
        rank = "rank" in self.config.studies and index % self.config.rank_every == 0
        grad_error = "grad_error" in self.config.studies and index % self.config.grad_error_every == 0
        if not (rank or grad_error):
            return {}
        before = dict(self.comm.bytes_by_tag)
        names = [layer.name for layer in self._layers]
        context = dataclasses.replace(self._context(step, seed=0), watch=DISABLED)  # timed as one "study" lap
        rank_records, error_records = self._studies.run(step, names, batches, grads, context, rank, grad_error)
        self._recorder.record_rank(step, rank_records)
        self._recorder.record_errors(step, error_records)
        self._watch.lap("study")
        return {tag: n - before.get(tag, 0) for tag, n in self.comm.bytes_by_tag.items()}

    def _gradients(self) -> list[Tensor]:
        grads = []
        for layer in self._layers:
            grad = layer.math.grad_matrix()
            if grad is None:
                raise RuntimeError(
                    f"layer {layer.name!r} has no gradient: call step() after loss.backward() "
                    "(and do not pass hylo layers that take no part in the loss)"
                )
            grads.append(grad)
        return grads

    def _all_finite(self, norms: Tensor, is_update: bool) -> bool:
        """One host sync: are all gradients finite (on every rank, on update steps)?"""
        finite = torch.isfinite(norms).all()
        if is_update and self.comm.world_size > 1:
            finite = self.comm.all_true(finite.reshape(1))[0]
        return bool(finite.item())

    def _batches(self, step: int, layers: list[RegisteredLayer]) -> list[LayerBatch]:
        """The captured calls of ``layers`` at this step, counted once."""
        calls = [layer.capture.calls() for layer in layers]
        missing = [layer.name for layer, c in zip(layers, calls, strict=True) if not c]
        if missing:
            raise RuntimeError(
                f"step {step} captures curvature but the hooks of {missing} never fired: run the "
                "forward in train mode with autograd enabled, through the module itself, before step()"
            )
        return [
            LayerBatch.collect(layer.math, c, self.config.rows_kept) for layer, c in zip(layers, calls, strict=True)
        ]

    def _context(self, step: int, seed: int) -> UpdateContext:
        """The per-update values the solver families read, evaluated at ``step``."""
        return UpdateContext(
            rank=self.comm.rank,
            damping=resolve("damping", self.config.damping, step),
            factor_decay=resolve("factor_decay", self.config.factor_decay, step),
            seed=seed,
            kis_estimator=self.config.kis_estimator,
            watch=self._watch,
        )

    def _refresh(self, step: int, layers: list[RegisteredLayer], batches: list[LayerBatch]) -> None:
        """A ``factor_update_freq`` step: fold the batches into the running statistics (no solve)."""
        context = self._context(step, seed=0)  # no draws: a refresh keeps the KIS generator's sequence
        jobs = [
            UpdateJob(layer.name, layer.solver, batch, layer.state)
            for layer, batch in zip(layers, batches, strict=True)
        ]
        result = self._stage.refresh(jobs, context)
        if result.rejected:
            warnings.warn(
                f"step {step}: non-finite factors for {result.rejected}; keeping their previous ones", stacklevel=3
            )
        for layer in layers:
            if layer.name not in result.rejected:
                layer.state = result.states[layer.name]

    def _decide(self, step: int, batches: list[LayerBatch]) -> list[LayerSolver]:
        """Choose every layer's solver for this update; identical on all ranks."""
        freq = resolve("update_freq", self.config.update_freq, step)
        world = self.comm.world_size
        decisions = self._policy.decide(step, [batch.shape(world) for batch in batches], freq, world)
        if world > 1 and self._policy.dynamic:
            key = (CONTROL, "decisions")
            device = self._layers[0].math.weight.device
            encoded = self.comm.broadcast(Payload({key: encode_decisions(decisions, device)}), src=0)[key]
            decisions = decode_decisions(encoded, step, [layer.name for layer in self._layers])
        for layer, decision in zip(self._layers, decisions, strict=True):
            layer.solver = decision.solver
        self.decision_log.extend(decisions)
        if self._recorder is not None:
            self._recorder.record_decisions(decisions)
        self._watch.lap("decide")
        return [decision.solver for decision in decisions]

    def _update(self, step: int, batches: list[LayerBatch], solvers: list[LayerSolver]) -> None:
        """Run the update stage and store the new states (non-finite ones rejected)."""
        context = self._context(step, seed=int(torch.randint(0, 2**62, (1,), generator=self._generator)))
        jobs = [
            UpdateJob(layer.name, solver, batch, layer.state)
            for layer, batch, solver in zip(self._layers, batches, solvers, strict=True)
        ]
        result = self._stage.update(jobs, context)
        if result.rejected:
            warnings.warn(
                f"step {step}: non-finite curvature for {result.rejected}; keeping their previous state", stacklevel=3
            )
        self._needs_update = bool(result.rejected)
        for layer in self._layers:
            if layer.name not in result.rejected:
                layer.state = result.states[layer.name]
                layer.owner = result.owners[layer.name]

    def _precondition(self, grads: list[Tensor], step: int) -> dict[str, Tensor]:
        """Apply every layer's state (with kl_clip scaling), write the gradients back and return them by layer."""
        watch = self._watch
        triples = self._stage.precondition(self._layers, grads, watch)
        scale: Tensor | None = None
        if triples and self.config.kl_clip is not None:
            kl_clip = resolve("kl_clip", self.config.kl_clip, step)
            assert self.config.lr is not None
            lr = resolve("lr", self.config.lr, step)
            vg = torch.stack([(v * g).sum().to(torch.float64) for _, g, v in triples]).sum().abs() * lr**2
            scale = torch.where(vg > 0, torch.sqrt(kl_clip / vg), torch.ones_like(vg)).clamp(max=1.0)
            watch.lap("precondition", [layer.name for layer, _, _ in triples])
        written: dict[str, Tensor] = {}
        for layer, _, v in triples:
            written[layer.name] = v if scale is None else v * scale.to(v.dtype)
            layer.math.set_grad_matrix(written[layer.name])
            watch.lap("precondition", layer.name)
        return written

    # ------------------------------------------------------------------ introspection
    def layer_info(self) -> list[LayerInfo]:
        """One record per registered layer: name, module type, d_a, d_g, bias, current solver and owner."""
        return [
            LayerInfo(
                layer.name,
                type(layer.math.module).__name__,
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

    def summary(self) -> str:
        """A printable table of registered layers and of the modules left alone."""
        lines = [
            f"HyLoPreconditioner(solver={self.config.solver!r}, layers={len(self._layers)}, "
            f"world_size={self.comm.world_size})",
            f"  {'layer':<32} {'type':<8} {'d_a':>7} {'d_g':>7} {'bias':>5}  solver",
        ]
        for info in self.layer_info():
            lines.append(
                f"  {info.name:<32} {info.module_type:<8} {info.d_a:>7} {info.d_g:>7} {str(info.bias):>5}  {info.solver}"
            )
        for name, why in [*self._skipped, *self._unsupported]:
            lines.append(f"  not preconditioned: {name or '<root>'} ({why})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    # ------------------------------------------------------------------ lifecycle
    def remove(self) -> None:
        """Detach every hook and close the profile files; the model trains as if hylo had never been attached."""
        for layer in self._layers:
            layer.capture.remove()
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
                entry["carried"] = dict(layer.state.carried())
            elif layer.state is not None:
                entry.update(layer.state.to_dict())
            layers[layer.name] = entry
        return {
            "format": STATE_FORMAT,
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
        """Restore a ``state_dict``; raises ``ValueError`` (changing nothing) if it does not fit this model."""
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a hylo state_dict of format {STATE_FORMAT} (got format {state_dict.get('format')!r})"
            )
        saved = state_dict["layers"]
        names = [layer.name for layer in self._layers]
        missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        if missing or unexpected:
            raise ValueError(f"state_dict is for a different layer set: missing {missing}, unexpected {unexpected}")
        restored = {layer.name: self._restore(layer, saved[layer.name]) for layer in self._layers}
        config = dict(state_dict.get("config", {}))
        if config.get("solver", self.config.solver) != self.config.solver:
            raise ValueError(
                f"state_dict was made with solver={config['solver']!r}, this preconditioner uses {self.config.solver!r}"
            )
        generator = torch.Generator()
        try:
            generator.set_state(state_dict["generator"])
        except (KeyError, TypeError, RuntimeError) as err:
            raise ValueError(f"state_dict has no valid KIS generator state: {err}") from err
        overrides = {k: config[k] for k in _RESTORABLE if k in config and not callable(getattr(self.config, k))}
        self.config = dataclasses.replace(self.config, **overrides)
        self._policy.config = self.config
        # A remote layer is exact only in the file its own rank saved, in a world of the same size.
        own_file = (state_dict.get("rank"), state_dict.get("world_size")) == (self.comm.rank, self.comm.world_size)
        missing_state = False
        for layer in self._layers:
            entry = saved[layer.name]
            layer.solver, layer.state = restored[layer.name]
            layer.owner = int(entry.get("owner", 0))
            if entry.get("remote") and not (isinstance(layer.state, RemoteState) and own_file):
                layer.state, missing_state = None, True  # the owner's state is not on its rank: recompute
        self.steps = int(state_dict["steps"])
        self._updates = int(state_dict.get("updates", 0))
        self._needs_update = bool(state_dict["needs_update"]) or missing_state
        self._agree_after_load = self.comm.world_size > 1
        self._capture_cache = (-1, False, frozenset())
        self._generator = generator
        if "trend" in state_dict:
            self._policy.trend.load_state_dict(state_dict["trend"], self._layers[0].math.weight.device)

    def _restore(self, layer: RegisteredLayer, entry: Mapping[str, Any]) -> tuple[SolverName, HeldState | None]:
        """A saved layer entry checked against ``layer``: its solver and state (``ValueError`` if it does not fit)."""
        m = layer.math
        if (entry["d_a"], entry["d_g"]) != (m.d_a, m.d_g):
            raise ValueError(
                f"layer {layer.name!r}: state_dict has shape (d_g={entry['d_g']}, d_a={entry['d_a']}), "
                f"model has (d_g={m.d_g}, d_a={m.d_a})"
            )
        solver = entry["solver"]
        if solver not in SOLVER_NAMES:
            raise ValueError(f"layer {layer.name!r}: state_dict names an unknown solver {solver!r}")
        if entry.get("remote"):
            carried = entry.get("carried")
            if carried is None or int(entry.get("owner", 0)) == self.comm.rank:
                return solver, None
            if not (isinstance(carried, Mapping) and all(isinstance(t, Tensor) for t in carried.values())):
                raise ValueError(f"layer {layer.name!r}: state_dict's carried tensors are not a dict of tensors")
            moved = {str(k): t.to(m.weight.device) for k, t in carried.items()}
            return solver, RemoteState(family_of(solver).name, moved)
        if "tensors" not in entry:
            return solver, None
        try:
            return solver, family_of(solver).state_from_dict(entry, m.d_a, m.d_g, m.weight.device)
        except KeyError as err:
            raise ValueError(f"layer {layer.name!r}: state_dict entry lacks {err}") from err
        except ValueError as err:
            raise ValueError(f"layer {layer.name!r}: {err}") from err
