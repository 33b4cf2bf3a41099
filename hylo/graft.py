"""Grafting for the optimizer form: each parameter hylo steps moves as far as AdamW would have moved it.

docs/usage.md, "Grafting". Under a whole-step solver (Adam in K-FAC's eigenbasis) the form steps hylo's parameters
by SGD without momentum along hylo's result V̂. With ``graft=True`` that SGD is :class:`GraftedSGD`: it keeps
AdamW's moments of each parameter's raw gradient g (m, v: the wrapped optimizer's β₁, β₂, ε and bias corrections),
and steps along V̂ scaled to the norm of AdamW's step, ‖m̂ / (√v̂ + ε)‖ · V̂ / ‖V̂‖ (Distributed Shampoo's layer-wise
grafting, one parameter a block), with decoupled weight decay. hylo picks the direction, AdamW the length.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import log
from typing import Any

import torch
from torch import Tensor

#: The keys an Adam-like group holds that grafting reads.
ADAM_KEYS = ("betas", "eps")


class GraftedSGD(torch.optim.Optimizer):
    """SGD without momentum whose step on each parameter has the norm of AdamW's step on its raw gradient.

    :meth:`observe` reads the raw gradients (before hylo rewrites them) into AdamW's moments and records the norm of
    AdamW's step; :meth:`step` scales each parameter's gradient (hylo's result) to that norm and takes the step
    ``p ← (1 − lr·weight_decay)·p − lr·scaled``. A step with no observation since the last first observes the
    gradients it is given (their own direction at AdamW's length). A zero gradient stays zero. Each group needs ``lr``, ``betas``, ``eps``
    and ``weight_decay``; the state of a parameter is AdamW's: ``step``, ``exp_avg``, ``exp_avg_sq``. Every
    operation runs over a group's list of tensors (``torch._foreach_*``): its cost does not grow with the layers."""

    def __init__(self, params: Iterable[dict[str, Any]]) -> None:
        groups = list(params)
        for g, group in enumerate(groups):
            missing = [key for key in ("lr", *ADAM_KEYS, "weight_decay") if key not in group]
            if missing:
                raise ValueError(f"GraftedSGD: group {g} lacks {missing}")
        first = groups[0] if groups else {}
        defaults = {key: first.get(key) for key in ("lr", *ADAM_KEYS)}  # the keys a loaded group must hold
        super().__init__(groups, {**defaults, "weight_decay": 0.0})
        #: Per parameter (by ``id``) observed since the last step: the norm of AdamW's step.
        self._targets: dict[int, Tensor] = {}

    @torch.no_grad()
    def observe(self) -> None:
        """Advance AdamW's moments by each parameter's gradient (the raw one) and record its step's norm."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            states = [self._state_of(p) for p in params]
            grads = [p.grad for p in params]
            exp_avg = [s["exp_avg"] for s in states]
            exp_avg_sq = [s["exp_avg_sq"] for s in states]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1.0)
            torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1.0 - beta2)
            # m̂ / (√v̂ + ε) = (m / c₁) / (√v / √c₂ + ε), cᵢ = 1 − βᵢ^step = −expm1(step · ln βᵢ) (no cancellation in
            # the step's float32, and no host sync)
            root_c2 = torch._foreach_sqrt(
                torch._foreach_neg(torch._foreach_expm1(torch._foreach_mul(steps, log(beta2))))
            )
            denominator = torch._foreach_div(torch._foreach_sqrt(exp_avg_sq), root_c2)
            torch._foreach_add_(denominator, group["eps"])
            c1 = torch._foreach_neg(torch._foreach_expm1(torch._foreach_mul(steps, log(beta1))))
            lengths = torch._foreach_div(torch._foreach_norm(torch._foreach_div(exp_avg, denominator)), c1)
            self._targets.update(zip(map(id, params), lengths, strict=True))

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, with nothing observed yet."""
        super().__setstate__(state)
        self._targets = {}

    def _state_of(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Scale each gradient to its recorded length (observing first where nothing was recorded) and step."""
        if not self._targets:
            self.observe()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            lengths = torch.stack([self._targets[id(p)] for p in params])
            norms = torch.stack(torch._foreach_norm(grads))
            scales = torch.where(norms > 0, lengths / norms, torch.zeros_like(norms))
            scaled = torch._foreach_mul(grads, list(scales.unbind()))
            if group["weight_decay"] != 0:
                torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, scaled, alpha=-group["lr"])
        self._targets.clear()

    def forget(self, p: Tensor) -> None:
        """Drop ``p``'s moments (it left this optimizer's groups)."""
        self.state.pop(p, None)
        self._targets.pop(id(p), None)
