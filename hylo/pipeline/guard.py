"""What every rank agrees on before a step changes anything (docs/reliability.md, "Transactional steps").

The guard finds each layer's gradient (new since the previous step, or absent), measures its
norm, and agrees across ranks, in one small all-reduce per step, on whether every gradient is
finite, which layers have a gradient, which have captured rows and which statistics each layer's
calls can give (docs/design.md, "Memory"). It also keeps the per-layer count of steps whose
preconditioned gradient overflowed or was not a bounded descent direction (they use the raw
gradient) and reports them at updates.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from hylo.distributed import Communicator
from hylo.layers.batch import LayerBatch
from hylo.layers.compiled import compiled_code_ran
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.statistics import CallStatistic, CapturedCall
from hylo.payload import Payload
from hylo.pipeline.placement import Placement
from hylo.state import RegisteredLayer

#: Steps taken by any torch optimizer in this process (:func:`optimizer_steps`).
_OPTIMIZER_STEPS = [0]
#: The payload key of the routed layers' row counts (:meth:`Guard.routed_scales`).
_ROUTED = ("", "routed_rows")
_STEP_HOOK: list[Any] = []


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _OPTIMIZER_STEPS[0] += 1


def agreement_flags(layers: int, statistics: int = 0) -> int:
    """How many flags :meth:`Guard.agree`'s all-reduce carries for ``layers`` registered layers: all norms finite,
    this rank has some gradient, per layer "has a gradient" and "captured no rows", per layer and statistic "its
    calls can give it" (``statistics``: at a capture step, the statistics the families capture; 0 otherwise), "no
    backward added onto the last step's gradients" and "my options are those the ranks last compared"
    (docs/reliability.md, "Agreement across ranks")."""
    return 4 + (2 + statistics) * layers


def optimizer_steps() -> int:
    """How many ``step()``s torch optimizers have taken in this process, counted by a global optimizer step hook
    registered at the first call (docs/reliability.md, "Gradient accumulation")."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_count_optimizer_step))
    return _OPTIMIZER_STEPS[0]


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on at a step: all gradients finite, layers with a gradient, layers with rows."""

    finite: bool
    present: list[bool]
    rows: list[bool]
    #: Per statistic, whether every rank's calls of each layer can give it (docs/design.md, "Memory").
    gives: dict[CallStatistic[Any], list[bool]]
    #: Each layer's ‖∇W‖ in float64 (0 where absent), re-measured without overflow where needed.
    norms: Tensor
    #: Whether some rank's options changed since the ranks last compared them (:mod:`hylo.fingerprint`).
    recheck: bool = False


class Guard:
    """Gradients, norms, finiteness and agreement of one preconditioner's layers."""

    def __init__(self, layers: Sequence[RegisteredLayer], comm: Communicator, placement: Placement) -> None:
        self.layers = list(layers)
        self.comm = comm
        #: Where the ranks' parts of every ∇W make its norm (docs/design.md, "Placements").
        self.placement = placement
        # per layer: the gradient tensor a step last saw and its version (a new backward changes either)
        self._seen: list[tuple[weakref.ref[Tensor], int] | None] = [None] * len(self.layers)
        # optimizer steps when this guard was made, and at the last step that wrote preconditioned gradients
        self._steps_at_start = optimizer_steps()
        self._steps_at_write: int | None = None
        #: Layers whose ``.grad`` holds the last step's preconditioned gradient plus another backward's, with no
        #: optimizer step between (set by :meth:`gradients`, raised on every rank by :meth:`agree`).
        self.accumulated: list[str] = []
        self._warned_no_rows: set[str] = set()
        #: Per layer, steps whose preconditioned gradient fell back to the raw gradient since the last report
        #: (not finite, or not a descent direction within its damping: docs/reliability.md, "Fallbacks").
        self.fallbacks = torch.zeros(len(self.layers), dtype=torch.long)
        self._indices: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}
        self._empty: dict[torch.device, Tensor] = {}

    @property
    def device(self) -> torch.device:
        """Where the layers' tensors live."""
        return self.layers[0].math.weight.device

    def gradients(self) -> list[GradMatrix | None]:
        """Each layer's ∇W, or None when it has no gradient since the previous ``step()``.

        A gradient is new when backward created or modified it after the previous step wrote
        (or left) it: the same tensor at the same version counter means no backward reached the
        layer (conditional computation), or that ``step()`` is being called twice.
        """
        grads: list[GradMatrix | None] = []
        # a backward that added onto the gradients the last step wrote, with no optimizer step since (a step
        # called on every micro-batch of gradient accumulation) — from the second optimizer step on, so that a
        # loop without a torch optimizer (and zero_grad(set_to_none=False)) is never taken for one
        unstepped = (
            self._steps_at_write is not None and self._steps_at_start < self._steps_at_write == optimizer_steps()
        )
        self.accumulated = []
        for layer, seen in zip(self.layers, self._seen, strict=True):
            weight_grad = layer.math.grad_tensor()
            same = weight_grad is not None and seen is not None and seen[0]() is weight_grad
            if weight_grad is None or (same and seen is not None and seen[1] == weight_grad._version):
                grads.append(None)
            else:
                if same and unstepped:
                    self.accumulated.append(layer.name)
                grads.append(parts := layer.math.grad_parts())
                if parts is not None:
                    self.placement.check_gradient(layer.name, parts)
        return grads

    def mark_seen(self, wrote: bool) -> None:
        """Remember every layer's gradient tensor and version after a step wrote them back (``wrote``: whether it
        wrote any preconditioned gradient)."""
        self._steps_at_write = optimizer_steps() if wrote else None
        for i, layer in enumerate(self.layers):  # after every write: attention's q, k and v share one .grad
            weight_grad = layer.math.grad_tensor()
            self._seen[i] = None if weight_grad is None else (weakref.ref(weight_grad), weight_grad._version)

    def norms(self, grads: Sequence[GradMatrix | None]) -> tuple[Tensor, Tensor]:
        """Per-layer ‖∇W‖ in float64 (0 where absent) and whether every one can be trusted.

        One norm per layer in the layer's working dtype, no host synchronisation. Such a norm can
        overflow for a huge finite gradient, or lose its precision when the squares of a tiny one fall
        among the dtype's subnormals (a norm below √tiny·10⁴, 10⁻¹⁵ in float32, which the applied-result
        check needs exact: docs/reliability.md, "Fallbacks"): when one is not finite or that small (but
        not 0), :meth:`_safe_norms` re-measures them all in a form that cannot.
        """
        norms = self.placement.norms(self._measured(grads))
        small = max(math.sqrt(torch.finfo(layer.math.dtype).tiny) * 1e4 for layer in self.layers)
        # finite (NaN fails every comparison) and exact: three comparisons instead of isfinite's four operations
        return norms, (((norms >= small) & (norms < math.inf)) | (norms == 0)).all()

    def _measured(self, grads: Sequence[GradMatrix | None]) -> Tensor:
        """Per-layer ‖∇W‖ in the layer's working dtype, as float64 (0 where absent): per working dtype one
        ``torch._foreach_norm`` over every weight part and every bias part (an empty tensor for a layer without a
        bias), the two norms of a layer folded by one ``vector_norm`` over the (2, layers) stack: four operations
        whatever the number of layers (docs/design.md, "The apply plan")."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (layer, grad) in enumerate(zip(self.layers, grads, strict=True)):
            if grad is not None:
                by_dtype.setdefault(layer.math.dtype, []).append(i)
        pieces: list[tuple[list[int], Tensor]] = []
        for dtype, members in by_dtype.items():
            parts = [grad for i in members if (grad := grads[i]) is not None]
            weights = [part.weight for part in parts]
            if any(part.bias is not None for part in parts):
                nothing = self._nothing(weights[0].device)
                biases = [nothing if part.bias is None else part.bias for part in parts]
                stacked = torch.stack(torch._foreach_norm(weights + biases, 2, dtype=dtype)).view(2, len(parts))
                values = torch.linalg.vector_norm(stacked, dim=0)
            else:
                values = torch.stack(torch._foreach_norm(weights, 2, dtype=dtype))
            pieces.append((members, values.to(torch.float64)))
        if len(pieces) == 1 and len(pieces[0][0]) == len(self.layers):
            return pieces[0][1]
        norms = torch.zeros(len(self.layers), dtype=torch.float64, device=self.device)
        for members, values in pieces:
            norms.index_copy_(0, self._index(members, norms.device), values)
        return norms

    def _nothing(self, device: torch.device) -> Tensor:
        """An empty tensor on ``device`` (the bias part of a layer without one: its norm is 0), made once."""
        empty = self._empty.get(device)
        if empty is None:
            empty = self._empty[device] = torch.empty(0, device=device)
        return empty

    def tensors(self) -> list[Tensor]:
        """What the guard keeps between steps: the fallback counters and its index tensors."""
        return [self.fallbacks, *self._indices.values(), *self._empty.values()]

    def _index(self, positions: list[int], device: torch.device) -> Tensor:
        """``positions`` as a long tensor on ``device``, made once per distinct list (no copy at every step)."""
        key = (tuple(positions), device)
        index = self._indices.get(key)
        if index is None:
            index = self._indices[key] = torch.tensor(positions, dtype=torch.long).to(device)
        return index

    def agree(
        self,
        step: int,
        grads: Sequence[GradMatrix | None],
        capturing: Sequence[bool],
        statistics: Sequence[CallStatistic[Any]],
        compared: bool = True,
    ) -> Agreement:
        """This step's finiteness, layers present, layers with captured rows and the ``statistics`` their
        calls can give, identical on every rank.

        One host synchronisation; with P > 1 ranks, one all-reduce of a few flags, every step: the
        decision to skip or to update is then the same on every rank (docs/reliability.md,
        "Agreement across ranks"). Usage errors (no gradient at all, ``step()`` twice without a
        backward) raise on every rank. ``compared``: whether this rank's options are those the ranks last
        compared (:mod:`hylo.fingerprint`); one flag more says whether every rank's are.
        """
        norms, finite = self.norms(grads)
        n = len(self.layers)
        present = [g is not None for g in grads]
        calls = [
            [CapturedCall.of(layer.math, call) for call in layer.capture.calls()] if c and p else []
            for layer, c, p in zip(self.layers, capturing, present, strict=True)
        ]
        rows = [any(call.rows for call in mine) for mine in calls]
        gives = {statistic: [all(call.gives(statistic) for call in mine) for mine in calls] for statistic in statistics}
        usable = any(present)
        if self.comm.world_size > 1:
            paths = [flag for statistic in statistics for flag in gives[statistic]] if any(capturing) else []
            local = torch.tensor(
                [usable, *present, *(not r for r in rows), *paths, not self.accumulated, compared],
                dtype=torch.bool,
                device=self.device,
            )
            sent = torch.cat([finite.reshape(1), local])
            assert len(sent) == agreement_flags(n, len(statistics) if paths else 0)
            flags = self.comm.all_true(sent).tolist()
            recheck, accumulated = not flags[-1], not flags[-2]
            all_finite, all_usable = flags[0], flags[1]
            present = flags[2 : 2 + n]
            rows = [not none for none in flags[2 + n : 2 + 2 * n]]
            if paths:
                gives = {s: flags[2 + (2 + k) * n : 2 + (3 + k) * n] for k, s in enumerate(statistics)}
        else:
            all_finite, all_usable = bool(finite.item()) if usable else True, usable
            recheck, accumulated = False, bool(self.accumulated)
        if not all_usable:
            raise RuntimeError(self._no_gradient_message(step, usable))
        if accumulated:
            raise RuntimeError(self._accumulated_message(step))
        if not all_finite:  # rare: re-measure in a form that cannot over- or underflow, then agree again
            norms, all_finite = self._safe_norms(grads)
        return Agreement(bool(all_finite), present, rows, gives, norms, recheck)

    def routed_scales(self, batches: Sequence[LayerBatch]) -> list[LayerBatch]:
        """``batches`` with each routed layer's row scale: its rows summed over ranks over the world size, so that
        P ranks scale its output gradients as one process on the whole batch (docs/moe.md, "P ranks"); one
        all-reduce when some layer is routed and the job has several ranks."""
        routed = [i for i, batch in enumerate(batches) if batch.math.routed_rows]
        if not routed or self.comm.world_size == 1:
            return list(batches)
        local = torch.tensor([float(batches[i].rows) for i in routed], dtype=torch.float64, device=self.device)
        total = self.comm.all_reduce(Payload({_ROUTED: local}), "sum").wait()[_ROUTED].tolist()
        scaled = list(batches)
        for i, rows in zip(routed, total, strict=True):
            scaled[i] = replace(batches[i], row_scale=rows / self.comm.world_size)
        return scaled

    def _accumulated_message(self, step: int) -> str:
        where = f"layers {self.accumulated[:4]}" if self.accumulated else "another rank's layers"
        return (
            f"step {step}: the gradients of {where} hold the previous step()'s preconditioned gradient plus another "
            "backward's, and no optimizer step ran in between: step() was called on a micro-batch of gradient "
            "accumulation. Call step() once per optimizer step, after the last micro-batch's backward (with "
            "Accelerate: `if accelerator.sync_gradients: pre.step()`; in a Trainer, where the optimizer steps); "
            'nothing was changed (docs/reliability.md, "Gradient accumulation")'
        )

    def _no_gradient_message(self, step: int, usable: bool) -> str:
        if usable:
            return f"step {step}: another rank has no gradient for any registered layer; every rank stops here"
        stale = [layer.name for layer in self.layers if layer.math.grad_tensor() is not None]
        if stale:
            return (
                f"step {step}: no gradient has changed since the previous step() (layers {stale[:4]}): "
                "step() was called twice without a loss.backward() in between"
            )
        names = [layer.name for layer in self.layers]
        return f"step {step}: no registered layer has a gradient ({names[:4]}): call step() after loss.backward()"

    def _safe_norms(self, grads: Sequence[GradMatrix | None]) -> tuple[Tensor, bool]:
        """Norms (float64) and finiteness of every gradient from its largest entry m and ‖∇W/m‖·m, which
        cannot overflow before the final product; agreed over ranks (one more collective, on this path only)."""
        norms = self.placement.safe_norms(grads, self.device)
        true = torch.ones((), dtype=torch.bool, device=self.device)
        finite = [true if g is None else g.all_finite() for g in grads]
        agreed = torch.stack(finite).all()
        if self.comm.world_size > 1:
            agreed = self.comm.all_true(agreed.reshape(1))[0]
        return torch.stack(norms), bool(agreed.item())

    def warn_non_finite(self, step: int, grads: Sequence[GradMatrix | None]) -> None:
        """Say which local layers hold non-finite gradients."""
        bad = [
            layer.name
            for layer, g in zip(self.layers, grads, strict=True)
            if g is not None and not bool(g.all_finite())
        ]
        where = f"in {bad}" if bad else "on another rank"
        if bad and self.comm.world_size > 1:
            where += f" on rank {self.comm.rank}"
        warnings.warn(
            f"step {step}: non-finite gradients {where}; gradients left unpreconditioned and stored state untouched",
            stacklevel=4,
        )

    def warn_no_rows(self, step: int, layers: Sequence[RegisteredLayer], worked: bool) -> None:
        """Layers with a gradient whose hooks captured nothing at a capture step (docs/reliability.md, "Layers
        without rows"): ``RuntimeError`` when no layer captured anything (the step would be plain SGD),
        else one warning per layer, naming the layers and the likely cause."""
        if not layers:
            return
        names = [layer.name for layer in layers]
        listed = f"{names[:8]}" + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        evaluating = [layer.name for layer in layers if not layer.math.module.training]
        causes = [f"modules in eval mode ({evaluating[:4]}): call model.train()"] if evaluating else []
        if compiled_code_ran():
            causes.append(
                "torch.compile: compiled code ran the model without hylo's hooks (a compiled function that calls "
                "the model while a torch.compiler stance other than hylo's is set?); compile the model itself, "
                "attach hylo before or after, and leave the stance to hylo on capture steps (docs/wrappers.md)"
            )
        causes.append("the module called under torch.no_grad(), or its weight used without its own forward")
        why = "; ".join(causes)
        if not worked:
            raise RuntimeError(
                f"step {step}: a capture step, and no registered layer captured anything although {listed} have "
                f"gradients: this step would be plain SGD. Likely causes: {why}"
            )
        new = [name for name in names if name not in self._warned_no_rows]
        if not new:
            return
        self._warned_no_rows.update(new)
        warnings.warn(
            f"step {step}: layers {new} have gradients but their hooks captured no rows ({why}); they keep "
            "their previous state (unpreconditioned until they have one). Warned once per layer.",
            stacklevel=4,
        )

    def count_fallbacks(self, indices: list[int] | Tensor | None, counts: Tensor) -> None:
        """Add a step's fallbacks (1 or True per layer whose result was not applied) at ``indices`` (a list, a device
        tensor, or None for every layer in order), without a host sync."""
        self.fallbacks = self.fallbacks.to(counts.device)
        if isinstance(indices, list):
            if indices == list(range(len(self.layers))):  # every layer, in order (the usual step): no index
                indices = None
            else:  # copied from the host without a stream synchronisation (docs/design.md, "Host synchronisation")
                indices = torch.tensor(indices, dtype=torch.long).to(counts.device, non_blocking=True)
        counts = counts.to(self.fallbacks.dtype)
        if indices is None:
            self.fallbacks += counts
        else:
            self.fallbacks.index_add_(0, indices, counts)

    def report_fallbacks(self, step: int) -> None:
        """Warn (at an update, where the host syncs anyway) about layers that fell back to their raw gradient."""
        counts = self.fallbacks.tolist()
        if any(counts):
            self.fallbacks.zero_()
            listed = {layer.name: c for layer, c in zip(self.layers, counts, strict=True) if c}
            warnings.warn(
                f"step {step}: the preconditioned gradient V̂ of {listed} (layer: steps) was not finite, or not a "
                "descent direction within its damping λ (⟨∇W, V̂⟩ ≤ 0 or ‖V̂‖ > ‖∇W‖/λ), although the gradient was "
                "finite; those steps used the raw gradient. Raise damping, or use float64?",
                stacklevel=4,
            )
