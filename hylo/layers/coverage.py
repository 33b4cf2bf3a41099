"""How much of a model hylo preconditions: its share of the trainable matrix parameters, by element count.

``summary()`` ends with it and :meth:`hylo.HyLoPreconditioner.coverage` returns it (docs/usage.md, "Coverage").
A matrix parameter is one with two or more dimensions (a Linear's or an Embedding's weight, a convolution's
kernel), counted once however many modules hold it; frozen parameters (``requires_grad=False``, e.g. a LoRA
model's base weights) and a skipped lazy layer's uninitialized ones are not counted. Each matrix hylo leaves
alone is counted under one reason: ``tied`` (held by two modules, e.g. an LM head tied to the token embedding),
``skip_layers``, or else the type of the module that holds it (an unsupported type, a parametrized weight, a
subclass with a ``forward`` of its own).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from hylo.layers.ties import Holder, parameter_of

#: The reason a matrix held by two or more modules is counted under.
TIED = "tied"
#: The reason a matrix of a module ``skip_layers`` names is counted under.
SKIPPED = "skip_layers"


@dataclass(frozen=True)
class Coverage:
    """Elements of the model's trainable matrix parameters: ``preconditioned`` of ``total``, and those left alone by
    reason (``left_alone``: reason → elements, largest first)."""

    preconditioned: int
    total: int
    left_alone: tuple[tuple[str, int], ...]

    @property
    def share(self) -> float:
        """The preconditioned share of the trainable matrix elements (1.0 for a model without any)."""
        return self.preconditioned / self.total if self.total else 1.0

    def line(self) -> str:
        """One line for ``summary()``: the share, the counts and what is left alone, by reason."""
        text = (
            f"coverage: {100 * self.share:.1f}% of the trainable matrix parameters preconditioned "
            f"({self.preconditioned:,} of {self.total:,} elements)"
        )
        if self.left_alone:
            text += "; left alone: " + ", ".join(f"{count:,} {why}" for why, count in self.left_alone)
        return text


def measure(
    model: nn.Module, preconditioned: Iterable[Tensor], skipped: Iterable[str], holders: dict[int, list[Holder]]
) -> Coverage:
    """The :class:`Coverage` of ``model`` when the tensors ``preconditioned`` are the registered layers' weights (or
    views of them), the modules named in ``skipped`` were left alone by ``skip_layers`` and ``holders`` are the
    model's :func:`~hylo.layers.ties.find_holders`."""
    taken = {id(parameter_of(t)) for t in preconditioned}
    skip = set(skipped)
    done = 0
    left: dict[str, int] = {}
    for parameter in model.parameters():
        if is_lazy(parameter) or not parameter.requires_grad or parameter.dim() < 2:
            continue
        count = parameter.numel()
        if id(parameter) in taken:
            done += count
            continue
        held = holders[id(parameter)]  # every parameter is some module's own
        if len(held) > 1:
            why = TIED
        else:
            why = SKIPPED if held[0].name in skip else type(held[0].module).__name__
        left[why] = left.get(why, 0) + count
    reasons = tuple(sorted(left.items(), key=lambda item: (-item[1], item[0])))
    return Coverage(done, done + sum(left.values()), reasons)
