"""Finding the layers of a model that hylo preconditions, and their per-layer state."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from hylo.capture import LayerCapture
from hylo.layers import LayerMath, supported_math, unsupported_reason

if TYPE_CHECKING:
    from hylo.stage import LayerState


@dataclass
class RegisteredLayer:
    """One preconditioned layer: its math helper, its hooks and its current curvature state."""

    name: str
    math: LayerMath
    capture: LayerCapture
    state: LayerState | None = None
    solver: str = "sngd"
    owner: int = 0


@dataclass
class Registration:
    """Result of walking a model: registered layers and the modules left alone, with reasons."""

    layers: list[RegisteredLayer] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)


def _matcher(patterns: tuple[str, ...]) -> Callable[[str, nn.Module], bool]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append((pattern.lower(), re.compile(pattern)))
        except re.error as err:
            raise ValueError(f"skip_layers entry {pattern!r} is not a valid regular expression: {err}") from err

    def matches(name: str, module: nn.Module) -> bool:
        cls = type(module).__name__.lower()
        return any(lower == cls or rx.fullmatch(name) for lower, rx in compiled)

    return matches


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel/DataParallel, or ``model`` itself."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return inner
    return model


def register_layers(model: nn.Module, skip_layers: tuple[str, ...], should_capture: Callable[[], bool]) -> Registration:
    """Hook every supported, trainable, non-skipped layer of ``model``; list the rest."""
    skip = _matcher(skip_layers)
    result = Registration()
    functional_prefixes: list[str] = []
    for name, module in unwrap(model).named_modules():
        if any(name.startswith(prefix) for prefix in functional_prefixes):
            continue
        if isinstance(module, nn.MultiheadAttention):
            functional_prefixes.append(name + ".")
            result.unsupported.append((name, "MultiheadAttention uses its projections functionally"))
            continue
        own_params = list(module.parameters(recurse=False))
        if not own_params:
            continue
        if skip(name, module):
            result.skipped.append((name, "skip_layers"))
            continue
        math = supported_math(module)
        if math is None:
            result.unsupported.append((name, unsupported_reason(module)))
            continue
        if not math.weight.requires_grad:
            result.skipped.append((name, "weight does not require grad"))
            continue
        result.layers.append(RegisteredLayer(name, math, LayerCapture(module, should_capture)))
    return result
