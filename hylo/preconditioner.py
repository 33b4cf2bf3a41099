"""HyLoPreconditioner: orchestration only (capture → communicate → solve → precondition)."""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hylo.config import HyLoConfig, resolve
from hylo.distributed import Communicator, default_communicator
from hylo.policy import Decision, SolverPolicy, decode_decisions, encode_decisions
from hylo.registry import RegisteredLayer, register_layers
from hylo.solvers import KFACState, LowRankState
from hylo.stage import LayerState, RemoteState, UpdateStage

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
    solver: str


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
        **options: any :class:`HyLoConfig` field, e.g. ``solver="kfac"``, ``damping=1e-3``.
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
        self.stage = UpdateStage(self.config, self.comm)
        self.steps = 0
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self._needs_update = False
        self._capture_cache: tuple[int, bool] = (-1, False)
        self._removed = False
        found = register_layers(model, self.config.skip_layers, self._capturing)
        self.layers: list[RegisteredLayer] = found.layers
        self.skipped = found.skipped
        self.unsupported = found.unsupported
        self.policy = SolverPolicy(self.config, [layer.name for layer in self.layers])
        self.decision_log: deque[Decision] = deque(maxlen=DECISION_LOG_SIZE)
        for layer in self.layers:
            layer.solver = self.policy.override(layer.name) or self.config.solver
        if self.unsupported:
            by_reason: dict[str, list[str]] = {}
            for name, why in self.unsupported:
                by_reason.setdefault(why, []).append(name or "<root>")
            listed = "; ".join(
                f"{why}: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
                for why, names in by_reason.items()
            )
            warnings.warn(
                f"hylo leaves {len(self.unsupported)} modules unpreconditioned ({listed}); see summary()",
                stacklevel=2,
            )
        if not self.layers:
            raise ValueError("model has no layer hylo can precondition (nn.Linear or nn.Conv2d with groups=1)")

    # ------------------------------------------------------------------ cadence
    def _capturing(self) -> bool:
        """Whether the current step captures inputs and output gradients (cached per step)."""
        step, flag = self._capture_cache
        if step != self.steps:
            freq = resolve("update_freq", self.config.update_freq, self.steps)
            flag = self._needs_update or self.steps % freq == 0
            self._capture_cache = (self.steps, flag)
        return flag

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of all registered layers in place."""
        if self._removed:
            raise RuntimeError("this HyLoPreconditioner was removed; create a new one")
        step = self.steps
        grads = self._gradients()
        is_update = self._capturing()
        norms = torch.stack(
            [torch.linalg.vector_norm(g.to(layer.math.dtype)) for layer, g in zip(self.layers, grads, strict=True)]
        ).to(torch.float64)
        try:
            if not self._finite(norms, is_update):
                bad = [layer.name for layer, g in zip(self.layers, grads, strict=True) if not torch.isfinite(g).all()]
                warnings.warn(
                    f"step {step}: non-finite gradients in {bad or 'another rank'}; gradients left "
                    "unpreconditioned and stored factors untouched",
                    stacklevel=2,
                )
                self._needs_update = self._needs_update or is_update
                return
            self.policy.trend.observe(norms)
            if is_update:
                self._decide(step)
                self._update(step)
            self._precondition(grads, step)
        finally:
            for layer in self.layers:
                layer.capture.clear()
            self.steps += 1

    def _gradients(self) -> list[Tensor]:
        grads = []
        for layer in self.layers:
            grad = layer.math.grad_matrix()
            if grad is None:
                raise RuntimeError(
                    f"layer {layer.name!r} has no gradient: call step() after loss.backward() "
                    "(and do not pass hylo layers that take no part in the loss)"
                )
            grads.append(grad)
        return grads

    def _finite(self, norms: Tensor, is_update: bool) -> bool:
        """One host sync: are all gradients finite (on every rank, on update steps)?"""
        flag = torch.isfinite(norms).all().to(norms.dtype)
        if is_update and self.comm.world_size > 1:
            (flag,) = self.comm.all_reduce_weighted_mean([flag.reshape(1)], [1.0]).wait()
            return bool(flag.item() == 1.0)
        return bool(flag.item())

    def _decide(self, step: int) -> None:
        """Choose every layer's solver for this update; identical on all ranks."""
        missing = [layer.name for layer in self.layers if not layer.capture.complete()]
        if missing:
            raise RuntimeError(
                f"step {step} is an update step but the hooks of {missing} never fired: run the "
                "forward in train mode with autograd enabled, through the module itself, before step()"
            )
        shapes = []
        for layer in self.layers:
            counts = [
                layer.math.row_counts(r.inputs, r.grad_output)
                for r in layer.capture.complete()
                if r.grad_output is not None
            ]
            rows, kfac_rows = sum(c[0] for c in counts), sum(c[1] for c in counts)
            kept = self.comm.world_size * self.config.rows_kept(rows)
            shapes.append((layer.math.d_a, layer.math.d_g, rows, kfac_rows, kept))
        freq = resolve("update_freq", self.config.update_freq, step)
        decisions = self.policy.decide(step, shapes, freq, self.comm.world_size)
        if self.comm.world_size > 1 and self.policy.dynamic:
            device = self.layers[0].math.weight.device
            (encoded,) = self.comm.broadcast([encode_decisions(decisions, device)], src=0)
            decisions = decode_decisions(encoded, step, [layer.name for layer in self.layers])
        for layer, decision in zip(self.layers, decisions, strict=True):
            layer.solver = decision.solver
        self.decision_log.extend(decisions)

    def solver_of(self, name: str) -> str:
        """The solver layer ``name`` used at the latest update (its configured one before any)."""
        for layer in self.layers:
            if layer.name == name:
                return layer.solver
        raise KeyError(f"no registered layer named {name!r}")

    def _update(self, step: int) -> None:
        """Run the distributed update stage and store the new states (non-finite ones rejected)."""
        damping = resolve("damping", self.config.damping, step)
        decay = resolve("factor_decay", self.config.factor_decay, step)
        base_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        states, rejected = self.stage.update(self.layers, step, damping, decay, base_seed)
        if rejected:
            warnings.warn(
                f"step {step}: non-finite curvature for {rejected}; keeping their previous state", stacklevel=3
            )
        self._needs_update = bool(rejected)
        for layer in self.layers:
            if layer.name not in rejected:
                layer.state = states[layer.name]
                layer.owner = self.stage.owners[layer.name]

    def _precondition(self, grads: list[Tensor], step: int) -> None:
        """Apply every layer's state (with kl_clip scaling) and write the gradients back."""
        triples = self.stage.precondition(self.layers, grads)
        if not triples:
            return
        scale: Tensor | None = None
        if self.config.kl_clip is not None:
            kl_clip = resolve("kl_clip", self.config.kl_clip, step)
            assert self.config.lr is not None
            lr = resolve("lr", self.config.lr, step)
            vg = torch.stack([(v * g).sum().to(torch.float64) for _, g, v in triples]).sum().abs() * lr**2
            scale = torch.where(vg > 0, torch.sqrt(kl_clip / vg), torch.ones_like(vg)).clamp(max=1.0)
        for layer, _, v in triples:
            layer.math.set_grad_matrix(v if scale is None else v * scale.to(v.dtype))

    # ------------------------------------------------------------------ introspection
    def layer_info(self) -> list[LayerInfo]:
        """One record per registered layer: name, module type, d_a, d_g, bias and current solver."""
        return [
            LayerInfo(
                layer.name,
                type(layer.math.module).__name__,
                layer.math.d_a,
                layer.math.d_g,
                layer.math.bias is not None,
                layer.solver,
            )
            for layer in self.layers
        ]

    def memory_usage(self) -> dict[str, int]:
        """Bytes of curvature state held per layer."""
        return {layer.name: layer.state.nbytes() if layer.state else 0 for layer in self.layers}

    def summary(self) -> str:
        """A printable table of registered layers and of the modules left alone."""
        lines = [
            f"HyLoPreconditioner(solver={self.config.solver!r}, layers={len(self.layers)}, world_size={self.comm.world_size})"
        ]
        lines.append(f"  {'layer':<32} {'type':<8} {'d_a':>7} {'d_g':>7} {'bias':>5}  solver")
        for layer in self.layers:
            m = layer.math
            lines.append(
                f"  {layer.name:<32} {type(m.module).__name__:<8} {m.d_a:>7} {m.d_g:>7} {str(m.bias is not None):>5}  {layer.solver}"
            )
        for name, why in [*self.skipped, *self.unsupported]:
            lines.append(f"  not preconditioned: {name or '<root>'} ({why})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    # ------------------------------------------------------------------ lifecycle
    def remove(self) -> None:
        """Detach every hook; the model trains as if hylo had never been attached."""
        for layer in self.layers:
            layer.capture.remove()
        self._removed = True

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: step, constant options, per-layer states."""
        layers: dict[str, Any] = {}
        for layer in self.layers:
            entry: dict[str, Any] = {
                "solver": layer.solver,
                "d_a": layer.math.d_a,
                "d_g": layer.math.d_g,
                "owner": layer.owner,
            }
            if isinstance(layer.state, RemoteState):
                entry["remote"] = True  # solved on another rank: recomputed after loading
            elif layer.state is not None:
                entry["damping"] = layer.state.damping
                entry["tensors"] = {k: v.detach().clone() for k, v in layer.state.tensors().items()}
                if isinstance(layer.state, LowRankState):
                    entry["divisor"] = layer.state.divisor
            layers[layer.name] = entry
        return {
            "format": STATE_FORMAT,
            "steps": self.steps,
            "needs_update": self._needs_update,
            "generator": self.generator.get_state(),
            "trend": self.policy.trend.state_dict(),
            "config": self.config.constants(),
            "layers": layers,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a ``state_dict``; raises ``ValueError`` (changing nothing) if it does not fit this model."""
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a hylo state_dict of format {STATE_FORMAT} (got format {state_dict.get('format')!r})"
            )
        saved = state_dict["layers"]
        names = [layer.name for layer in self.layers]
        missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        if missing or unexpected:
            raise ValueError(f"state_dict is for a different layer set: missing {missing}, unexpected {unexpected}")
        restored: dict[str, tuple[str, LayerState | None]] = {}
        for layer in self.layers:
            entry = saved[layer.name]
            m = layer.math
            if (entry["d_a"], entry["d_g"]) != (m.d_a, m.d_g):
                raise ValueError(
                    f"layer {layer.name!r}: state_dict has shape (d_g={entry['d_g']}, d_a={entry['d_a']}), "
                    f"model has (d_g={m.d_g}, d_a={m.d_a})"
                )
            restored[layer.name] = (entry["solver"], self._state_from(layer, entry))
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
        self.stage.config = self.policy.config = self.config
        for layer in self.layers:
            layer.solver, layer.state = restored[layer.name]
            layer.owner = int(saved[layer.name].get("owner", 0))
        self.steps = int(state_dict["steps"])
        remote = any(saved[name].get("remote") for name in names)
        self._needs_update = bool(state_dict["needs_update"]) or remote
        self._capture_cache = (-1, False)
        self.generator = generator
        if "trend" in state_dict:
            self.policy.trend.load_state_dict(state_dict["trend"], self.layers[0].math.weight.device)

    def _state_from(self, layer: RegisteredLayer, entry: Mapping[str, Any]) -> LayerState | None:
        if "tensors" not in entry:
            return None
        device = layer.math.weight.device
        t = {k: v.to(device) for k, v in entry["tensors"].items()}
        m = layer.math
        try:
            if entry["solver"] == "kfac":
                expected = {"factor_a": (m.d_a, m.d_a), "factor_g": (m.d_g, m.d_g)}
                state: LayerState = KFACState(
                    t["factor_a"],
                    t["factor_g"],
                    t["evals_a"],
                    t["evecs_a"],
                    t["evals_g"],
                    t["evecs_g"],
                    float(entry["damping"]),
                )
            else:
                rows = t["a"].shape[0]
                expected = {"a": (rows, m.d_a), "g": (rows, m.d_g), "inner": (rows, rows)}
                state = LowRankState(
                    t["a"], t["g"], t["inner"], float(entry["divisor"]), float(entry["damping"]), entry["solver"]
                )
        except KeyError as err:
            raise ValueError(f"layer {layer.name!r}: state_dict entry lacks tensor {err}") from err
        for key, shape in expected.items():
            if tuple(t[key].shape) != shape:
                raise ValueError(f"layer {layer.name!r}: {key} has shape {tuple(t[key].shape)}, expected {shape}")
        return state
