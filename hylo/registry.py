"""Finding the layers of a model that hylo preconditions, and their per-layer state."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from hylo.capture import LayerCapture
from hylo.config import SolverName
from hylo.layers import ConvRows, LayerMath, supported_math, unsupported_reason
from hylo.solvers import HeldState


@dataclass
class RegisteredLayer:
    """One preconditioned layer: its math, its hooks, its solver and what it holds.

    ``solver`` is the configured solver until the first update, then the one the latest
    update used; ``owner`` is the rank that solved ``state`` (the one place it is kept).
    """

    name: str
    math: LayerMath
    capture: LayerCapture
    solver: SolverName
    state: HeldState | None = None
    owner: int = 0


@dataclass
class Registration:
    """Result of walking a model: registered layers and the modules left alone, with reasons."""

    layers: list[RegisteredLayer] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)


def _matcher(patterns: tuple[str, ...]) -> Callable[[str, nn.Module], bool]:
    """Whether a module's name or its class name fully matches one of ``patterns``."""
    try:
        compiled = [re.compile(pattern) for pattern in patterns]
    except re.error as err:
        raise ValueError(f"skip_layers holds an invalid regular expression: {err}") from err

    def matches(name: str, module: nn.Module) -> bool:
        cls = type(module).__name__
        return any(rx.fullmatch(name) or rx.fullmatch(cls) for rx in compiled)

    return matches


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel/DataParallel, or ``model`` itself."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return inner
    return model


def register_layers(
    model: nn.Module,
    skip_layers: tuple[str, ...],
    should_capture: Callable[[str], bool],
    initial_solver: Callable[[str], SolverName],
    conv_rows: ConvRows = "sum",
) -> Registration:
    """Hook every supported, trainable, non-skipped layer of ``model``; list the rest.

    ``should_capture(name)`` says whether layer ``name`` captures at the current step.
    """
    skip = _matcher(skip_layers)
    result = Registration()
    functional_prefixes: list[str] = []
    for name, module in _unwrap(model).named_modules():
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
        math = supported_math(module, conv_rows)
        if math is None:
            result.unsupported.append((name, unsupported_reason(module)))
            continue
        if not math.weight.requires_grad:
            result.skipped.append((name, "weight does not require grad"))
            continue
        capture = LayerCapture(module, functools.partial(should_capture, name))
        result.layers.append(RegisteredLayer(name, math, capture, initial_solver(name)))
    return result
