"""Fused mixture-of-experts layers: each expert's projections preconditioned from the tokens routed to it.

docs/moe.md. Hugging Face's transformers 5.x stores a block's E experts fused: ``gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``down_proj`` [E, H, I], applied by the experts module to the tokens
each expert is routed to, ``y_t = Σ_p w_tp · down[e](gate(gate_up[e] x_t))`` over the slots p of token t with
e = index[t, p]. Every expert's two projections are layers of their own (``gate_up_proj.<e>``,
``down_proj.<e>``), Linear layers whose rows are the expert's routed tokens, in the order the module takes them:

- ``gate_up_proj.<e>``: inputs x_t, output gradients the gradient of ``gate_up[e] x_t``, through the gate;
- ``down_proj.<e>``: inputs h_t = gate(gate_up[e] x_t), output gradients w_tp · ∂L/∂y_t.

K-FAC holds ``gate_up_proj.<e>``'s G as its gate and up halves, as it holds the two projections of an unfused expert
(``output_parts`` 2, ``split_gate_up``; docs/moe.md, "Gate and up").

The module's hooks see its inputs (the hidden states, the routing index and weights) and its output's gradient;
on capture steps the tap recomputes each routed expert's h_t (and keeps the gate's graph for the backward), so
the rows are those of the same model written with one ``nn.Linear`` per expert. Tokens routed past the last
expert (an expert-parallel sentinel, a dropped token) are no expert's rows. An expert that no token reached at a
capture step is idle: it keeps its state, and its layer counts the step (docs/moe.md, "Idle experts").

The router is a Linear of the hidden states whose module returns (logits, weights, index): :class:`RouterMath`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from hylo.layers.capture import Record, watch_gradient
from hylo.layers.compiled import eager
from hylo.layers.fused import FusedLayers
from hylo.layers.gradmatrix import GradShard
from hylo.layers.linear import LinearMath
from hylo.layers.math import LayerMath
from hylo.layers.sharded import dim0_chunk, is_sharded, local, placement_problem

if TYPE_CHECKING:
    from collections.abc import Callable

    from hylo.config import HyLoConfig
    from hylo.layers.capture import LayerCapture


@dataclass(frozen=True)
class ExpertsLayout:
    """Where a fused experts module keeps its experts and what its ``forward`` is called with (docs/moe.md, "Your own
    experts module").

    ``gate_up`` and ``down`` name its [E, 2I, H] and [E, H, I] parameters; ``arguments`` the ``forward`` parameters
    holding the hidden states (T, H), the routing index (T, k) and the routing weights (T, k), by position or name.
    The gate is the module's ``_apply_gate`` when it has one, else ``act_fn`` of the gate half times the up half.
    """

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    arguments: tuple[str, str, str] = ("hidden_states", "top_k_index", "top_k_weights")


#: The layout of transformers' fused experts (Mixtral, Qwen2-MoE).
TRANSFORMERS_LAYOUT = ExpertsLayout()
#: transformers' declared variants of its experts modules (``@use_experts_implementation``), and the value hylo
#: supports for each: the attribute, that value, and what another value means.
_DECLARED = (
    ("has_gate", True, "no gate projection (up_proj only)"),
    ("is_concatenated", True, "gate and up rows interleaved"),
    ("is_transposed", False, "weights stored transposed"),
    ("has_bias", False, "expert biases"),
    ("has_post_expert_norm", False, "a norm after each expert"),
    ("_is_expert_parallel", False, "experts sharded by expert parallelism"),
)


def _parameter(module: nn.Module, attr: str) -> Tensor | None:
    value = getattr(module, attr, None)
    return value if isinstance(value, Tensor) else None


def stored(module: nn.Module, attr: str) -> Tensor:
    """The module's parameter ``attr``, one that :func:`layout_problem` found (read on every access: replacing the
    Parameter is followed)."""
    parameter = _parameter(module, attr)
    assert parameter is not None
    return parameter


def layout_problem(module: nn.Module, layout: ExpertsLayout = TRANSFORMERS_LAYOUT) -> str | None:
    """Why ``module`` is not fused experts of ``layout`` that hylo can precondition, or None when it is."""
    kind = type(module).__name__
    for attr, supported, other in _DECLARED:
        if getattr(module, attr, supported) != supported:
            return f"{kind} declares {attr}={not supported} ({other}), a layout hylo's fused experts do not model"
    gate_up, down = _parameter(module, layout.gate_up), _parameter(module, layout.down)
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return f"{kind} holds no 3-D {layout.gate_up} and {layout.down} parameters (fused experts)"
    experts, double, hidden = gate_up.shape
    if tuple(down.shape) != (experts, hidden, double // 2) or double % 2:
        return (
            f"{kind}: {layout.gate_up} {tuple(gate_up.shape)} and {layout.down} {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        )
    if getattr(module, "_apply_gate", None) is None and not callable(getattr(module, "act_fn", None)):
        return f"{kind} has neither _apply_gate nor act_fn: hylo cannot recompute its gate"
    return None


class ExpertMath(LinearMath):
    """One projection of one expert: ``module.<attr>[expert]``, a Linear's weight (d_out, d_in) without a bias.

    Its gradient is read from and written to that expert's slice of the parameter's ``.grad`` in place. Under
    FSDP2 the parameter is sharded over its experts (dim 0): a rank holds all of an expert's rows or none.
    """

    routed_rows = True

    def __init__(self, module: nn.Module, attr: str, expert: int, output_parts: int = 1) -> None:
        self.attr = attr
        self.expert = expert
        self.output_parts = output_parts
        super().__init__(module)

    def _parameter(self) -> Tensor:
        return stored(self.module, self.attr)

    def _current_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(d_out, d_in) from the parameter's shape (no slice: under FSDP2 slicing would gather it), no bias."""
        return tuple(self._parameter().shape[1:]), None

    @property
    def module_type(self) -> str:
        """``<experts class>.<parameter>``, e.g. ``MixtralExperts.down_proj``."""
        return f"{type(self.module).__name__}.{self.attr}"

    @property
    def weight(self) -> Tensor:
        """The expert's (d_out, d_in) slice of the parameter; under FSDP2 the parameter itself (:meth:`grad_shard`
        says whether this rank holds the expert)."""
        parameter = self._parameter()
        return parameter if is_sharded(parameter) else parameter[self.expert]

    @property
    def bias(self) -> Tensor | None:
        """None: the experts hylo models have no biases."""
        return None

    def _held(self) -> int | None:
        """Under FSDP2, the expert's index in this rank's local experts (``-1``: another rank holds it); else None."""
        held = dim0_chunk(self._parameter())
        if held is None:
            return None
        return self.expert - held[0] if held[0] <= self.expert < held[1] else -1

    def grad_shard(self) -> GradShard | None:
        """All of ∇W's rows when this rank holds the expert, none when another does; None when unsharded."""
        held = self._held()
        if held is None:
            return None
        return GradShard(0, self.d_g if held >= 0 else 0, self.d_g)

    def sharding_problem(self) -> str | None:
        """None for a parameter sharded on its experts by ``fully_shard`` (dim 0 over a 1-D mesh)."""
        parameter = self._parameter()
        return placement_problem(parameter) if is_sharded(parameter) else None

    def grad_tensor(self) -> Tensor | None:
        """The parameter's ``.grad``, which every expert shares (this rank's part under FSDP2)."""
        return local(self._parameter().grad)

    def weight_grad(self) -> Tensor | None:
        """The expert's slice of the parameter's gradient (written in place); an empty one when another rank holds
        it under FSDP2."""
        grad = self.grad_tensor()
        if grad is None:
            return None
        held = self._held()
        if held is None:
            return grad[self.expert]
        return grad[held] if held >= 0 else grad[:0]

    def bias_grad(self) -> Tensor | None:
        return None


class ExpertsLayers(FusedLayers):
    """A fused experts module's layers: every expert's ``gate_up`` projection, then every expert's ``down``."""

    def __init__(self, module: nn.Module, layout: ExpertsLayout = TRANSFORMERS_LAYOUT) -> None:
        super().__init__(module)
        problem = layout_problem(module, layout)
        if problem is not None:
            raise ValueError(problem)
        self.layout = layout
        self.experts = int(stored(module, layout.gate_up).shape[0])

    def layers(self) -> list[tuple[str, LayerMath]]:
        """``<gate_up>.<e>`` for every expert e, then ``<down>.<e>``."""
        return [
            (f"{attr}.{e}", ExpertMath(self.module, attr, e, parts))
            for attr, parts in ((self.layout.gate_up, 2), (self.layout.down, 1))
            for e in range(self.experts)
        ]

    def gate(self, pre: Tensor) -> Tensor:
        """The experts' gate on gate_up's output (S, 2I): the module's ``_apply_gate``, else ``act_fn(gate) * up``."""
        apply_gate = getattr(self.module, "_apply_gate", None)
        if apply_gate is not None:
            hidden: Tensor = apply_gate(pre)
            return hidden
        gate, up = pre.chunk(2, dim=-1)
        act: Callable[[Tensor], Tensor] = self.module.act_fn  # type: ignore[assignment]
        return act(gate) * up

    def tap(self, captures: Mapping[str, LayerCapture], name: str) -> ExpertsTap:
        """The module's forward hook, feeding its experts' captures (docs/moe.md, "How the rows are made")."""
        return ExpertsTap(self, captures, name)


class _Routed:
    """One expert's tokens in one call: turns the module's output gradient into its two projections' (once per
    gradient, whichever projection asks first)."""

    def __init__(self, token: Tensor, weight: Tensor, down: Tensor, pre: Tensor, hidden: Tensor) -> None:
        self.token = token
        self.weight = weight.unsqueeze(-1)
        self.down = down
        self.pre = pre
        self.hidden = hidden
        self._of: Tensor | None = None
        self._down_grad: Tensor | None = None

    def down_grad(self, grad: Tensor) -> Tensor:
        """w_tp · ∂L/∂y_t for the expert's tokens: the output gradient of its down projection."""
        if self._of is not grad or self._down_grad is None:
            self._of, self._down_grad = grad, grad[self.token] * self.weight
        return self._down_grad

    def gate_up_grad(self, grad: Tensor) -> Tensor:
        """The gradient of gate_up's output: the down projection's output gradient back through it and the gate."""
        through_down = self.down_grad(grad).to(self.down.dtype) @ self.down
        (result,) = torch.autograd.grad(self.hidden, self.pre, through_down.to(self.hidden.dtype), retain_graph=True)
        return result


class ExpertsTap:
    """The forward hook of one fused experts module: on capture steps, each routed expert's rows for its captures."""

    def __init__(self, layers: ExpertsLayers, captures: Mapping[str, LayerCapture], name: str) -> None:
        self.layers = layers
        self.captures = dict(captures)
        self.name = name
        self._handle: RemovableHandle | None = layers.module.register_forward_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        """Detach the hook."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if not any(capture.wants() for capture in self.captures.values()):
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        x, index, weights = (
            args[i] if i < len(args) else kwargs[key] for i, key in enumerate(self.layers.layout.arguments)
        )
        eager(self._watch)(x, index, weights, output)

    def _routing(self, x: Tensor, index: Tensor, weights: Tensor) -> tuple[Tensor, list[int]]:
        """Positions into the (slot, token) grid, grouped by expert in ``torch.where`` order, and each expert's
        count; ``ValueError`` when the call is not the experts' operation on (hidden states, index, weights)."""
        experts = self.layers.experts
        if x.dim() != 2 or index.dim() != 2 or index.shape != weights.shape or index.shape[0] != x.shape[0]:
            raise ValueError(
                f"layer {self.name!r}: fused experts called with hidden states {tuple(x.shape)}, index "
                f"{tuple(index.shape)} and weights {tuple(weights.shape)}: not (T, H), (T, k), (T, k)"
            )
        if index.is_floating_point():
            raise ValueError(f"layer {self.name!r}: the routing index is {index.dtype}, not an integer tensor")
        flat = index.mT.reshape(-1)  # slot-major: the (slot, token) order torch.where gives per expert
        flat = torch.where((flat >= 0) & (flat < experts), flat, experts)
        counts = torch.bincount(flat, minlength=experts + 1)[:experts].tolist()
        return torch.argsort(flat, stable=True), counts

    def _watch(self, x: Tensor, index: Tensor, weights: Tensor, output: Tensor) -> None:
        layers, layout = self.layers, self.layers.layout
        order, counts = self._routing(x, index, weights)
        x, weights, tokens = x.detach(), weights.detach(), x.shape[0]
        gate_up = stored(layers.module, layout.gate_up).detach()
        down = stored(layers.module, layout.down).detach()
        records: list[tuple[Record, Callable[[Tensor], Tensor]]] = []
        start = 0
        for expert, count in enumerate(counts):
            positions, start = order[start : start + count], start + count
            wanted = [
                (attr, capture)
                for attr in (layout.gate_up, layout.down)
                if (capture := self.captures.get(f"{attr}.{expert}")) is not None and capture.wants()
            ]
            if not wanted:
                continue
            if count == 0:
                for _, capture in wanted:
                    capture.idle += 1
                continue
            token = positions % tokens
            routed_x = x[token]
            with torch.enable_grad():
                pre = F.linear(routed_x, gate_up[expert]).detach().requires_grad_()
                hidden = layers.gate(pre)
            routed = _Routed(token, weights[token, positions // tokens], down[expert], pre, hidden)
            for attr, capture in wanted:
                if attr == layout.gate_up:
                    records.append((capture.open(routed_x), routed.gate_up_grad))
                else:
                    records.append((capture.open(hidden.detach()), routed.down_grad))
        if records:
            watch_gradient(output, records)


class RouterMath(LinearMath):
    """A router: a Linear (``weight`` (E, H), a bias or none) of the hidden states whose module returns its logits
    with the routing (``(logits, weights, index)``; the logits at ``logits_at``); its output s is the logits, whose
    gradient sums every path from them (the routing weights, an auxiliary loss)."""

    def __init__(self, module: nn.Module, logits_at: int = 0) -> None:
        self.logits_at = logits_at
        super().__init__(module)

    def layer_output(self, output: Any) -> Tensor | None:
        """The logits: the element ``logits_at`` of the module's output, or the output itself when it is a tensor."""
        if isinstance(output, Tensor):
            return output
        found = output[self.logits_at] if isinstance(output, tuple) and len(output) > self.logits_at else None
        return found if isinstance(found, Tensor) else None


def fused_experts(module: nn.Module, config: HyLoConfig) -> ExpertsLayers | None:
    """The factory of transformers' fused experts modules: their layers, or None for a layout hylo does not model
    (:func:`layout_problem` says why)."""
    return None if layout_problem(module) is not None else ExpertsLayers(module)


def experts_refused(module: nn.Module) -> str:
    """Why a fused experts module stays with the optimizer."""
    return layout_problem(module) or f"{type(module).__name__}: not fused experts"


def router(logits_at: int = 0) -> Callable[[nn.Module, HyLoConfig], RouterMath | None]:
    """The factory of transformers' routers whose module returns the logits at ``logits_at``: a Linear of the hidden
    states (a 2-D ``weight``)."""

    def factory(module: nn.Module, config: HyLoConfig) -> RouterMath | None:
        weight = _parameter(module, "weight")
        return RouterMath(module, logits_at) if weight is not None and weight.dim() == 2 else None

    return factory
