"""Tied parameters: a Parameter that two modules use, whose gradient sums both uses (docs/reliability.md,
"Registration").

:func:`find_holders` lists every use of each Parameter of a model by a module; :func:`tied_reason` says
why a layer whose weight or bias another module holds too stays with the optimizer: no one
layer's curvature describes the summed gradient, and preconditioning it once per user would
precondition one gradient twice. Ties are found by Parameter identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class Holder:
    """One use of a Parameter: the module that uses it (reached under ``name``) and its path there, ``attr``.

    A MultiheadAttention uses its ``out_proj``'s parameters itself, so they are held by the attention
    module at ``out_proj.weight``/``out_proj.bias``.
    """

    module: nn.Module
    name: str
    attr: str

    def label(self, role: str) -> str:
        """This holder in a message about another holder's ``role`` (``weight``, ``in_proj_weight``): the
        parameter's path without a trailing ``role`` (``head``, ``attn.out_proj``, ``attn.in_proj_weight``)."""
        path = f"{self.name}.{self.attr}" if self.name else self.attr
        return "<root>" if path == role else path.removesuffix(f".{role}")


def find_holders(model: nn.Module) -> dict[int, list[Holder]]:
    """Every use of each Parameter of ``model`` by a module, by the Parameter's id.

    A module's own parameters are its uses; a MultiheadAttention's are all those of its submodules
    (it applies ``out_proj`` functionally), which are not counted again when reached under another
    name. A module reached under several names counts once. So a Parameter with two holders is
    tied: its gradient sums the uses of two modules (docs/reliability.md, "Registration").
    """
    inside = {
        id(sub)
        for module in model.modules()
        if isinstance(module, nn.MultiheadAttention)
        for sub in module.modules()
        if sub is not module
    }
    holders: dict[int, list[Holder]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            used = list(module.named_parameters(remove_duplicate=False))
        elif id(module) in inside:
            continue
        else:
            used = [(attr, parameter) for attr, parameter in module._parameters.items() if parameter is not None]
        for attr, parameter in used:
            holders.setdefault(id(parameter), []).append(Holder(module, name, attr))
    return holders


def parameter_of(tensor: Tensor) -> Tensor:
    """The Parameter a layer's weight or bias is, or is a view of (a slice of ``in_proj_weight``, a transpose)."""
    return tensor if tensor._base is None else tensor._base


def own_attr(module: nn.Module, tensor: Tensor, role: str) -> str:
    """The attribute of ``module`` holding the Parameter behind ``tensor`` (``role`` when none does)."""
    parameter = parameter_of(tensor)
    return next((attr for attr, held in module._parameters.items() if held is parameter), role)


def tied_reason(
    holders: dict[int, list[Holder]], module: nn.Module, parts: Sequence[tuple[str, Tensor | None]]
) -> str | None:
    """Why a layer whose W is made of ``parts`` (its weight and bias with their paths in ``module``, the module
    holding them) stays with the optimizer because one of them is tied (held elsewhere too: its gradient sums
    every use), or None."""
    tied: list[str] = []
    for attr, tensor in parts:
        if tensor is None:
            continue
        role = attr.rpartition(".")[2]
        others = [
            holder.label(role)
            for holder in holders.get(id(parameter_of(tensor)), [])
            if not (holder.module is module and holder.attr == attr)
        ]
        if others:
            tied.append(f"{role} tied to {', '.join(others)}")
    if not tied:
        return None
    if len(tied) == 1:
        return f"{tied[0]}: its gradient sums every use, so it stays with the optimizer"
    return f"{' and '.join(tied)}: their gradients sum every use, so the layer stays with the optimizer"
