"""The few internals tests reach: what neither hylo's public view nor torch's or argparse's API shows.

Each read here is allow-listed with its reason in tests/repository/test_private_reads.py; every other test reads
hylo through its public API (``layer_info()``, ``progress()``, ``state_dict()``, ``summary()``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from typing import Any

import pytest
from torch import nn

from hylo import HyLoPreconditioner
from hylo.layers import registry
from hylo.solvers import HeldState, LayerState
from hylo.state import RegisteredLayer


def hooks(module: nn.Module) -> tuple[dict[int, Any], dict[int, Any], dict[int, Any], dict[int, Any]]:
    """Copies of ``module``'s forward-pre, forward, backward-pre and backward hooks, by handle id."""
    return (
        dict(module._forward_pre_hooks),
        dict(module._forward_hooks),
        dict(module._backward_pre_hooks),
        dict(module._backward_hooks),
    )


def hooked(module: nn.Module) -> bool:
    """Whether any hook is attached to ``module`` itself."""
    return any(hooks(module))


def option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """``parser``'s actions, in order."""
    return list(parser._actions)


def apply_plan(pre: HyLoPreconditioner) -> Any:
    """The grouped apply plan ``pre`` holds (docs/design.md, "The apply plan"), or None: its groups, their
    kernels and its identity (rebuilt or reused) are an internal cache, no fact of the public view."""
    return pre._placement.grouped.plan


def _registered(pre: HyLoPreconditioner) -> list[RegisteredLayer]:
    """What ``pre`` holds per layer: the one way to its held state objects themselves."""
    return list(pre._layers)


def held_states(pre: HyLoPreconditioner) -> list[HeldState]:
    """The state objects ``pre``'s layers hold (those that hold one), for white-box checks of their representation
    (the one layout of docs/reliability.md, "One layout"); ``layer_info()`` shows them read-only."""
    return [layer.state for layer in _registered(pre) if layer.state is not None]


def replace_state(pre: HyLoPreconditioner, index: int, how: Callable[[LayerState], LayerState]) -> None:
    """Fault injection: layer ``index``'s held state replaced by ``how(state)``."""
    layer = _registered(pre)[index]
    assert isinstance(layer.state, LayerState), layer.state
    layer.state = how(layer.state)


def restore_layer_types(monkeypatch: pytest.MonkeyPatch, without: Collection[type[nn.Module]] = ()) -> None:
    """The layer-type registry as it is, less ``without``, for one test: restored by ``monkeypatch`` after it."""
    current = registry._LAYER_TYPES
    monkeypatch.setattr(registry, "_LAYER_TYPES", {k: v for k, v in current.items() if k not in without})
