"""Mixture-of-experts test helpers: the experts' gradients and layer names of a fused model and its ``nn.Linear``
twin, in one naming (docs/moe.md)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def expert_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every expert's projection gradient by hylo's layer name (fused: a slice of the 3-D ``.grad``; twin: its
    Linear's, a halves twin's gate and up joined as the fused gate_up's), and every other matrix gradient by
    parameter name."""
    found: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if p.dim() == 3:
            found.update({f"{name}.{e}": p.grad[e].clone() for e in range(p.shape[0])})
        else:
            found[name.removesuffix(".weight")] = p.grad.clone()
    for name in [name for name in found if name.endswith(".gate") and f"{name[:-5]}.up" in found]:
        found[name[:-5]] = torch.cat([found.pop(name), found.pop(f"{name[:-5]}.up")])
    return found


def joined_names(names: list[str]) -> list[str]:
    """Layer names with a halves twin's ``<gate_up>.<e>.gate`` and ``.up`` as the fused ``<gate_up>.<e>``."""
    halves = {name[:-3] for name in names if name.endswith(".up") and f"{name[:-3]}.gate" in names}
    joined = [n[:-5] if n.endswith(".gate") and n[:-5] in halves else n for n in names]
    return [n for n in joined if not (n.endswith(".up") and n[:-3] in halves)]
