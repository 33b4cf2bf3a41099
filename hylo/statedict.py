"""The ``state_dict`` format of :class:`hylo.HyLoPreconditioner`: its version and the checks run before a load.

``load_state_dict`` validates a whole state with these functions before it changes anything
(docs/design.md, "Checkpoints").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from hylo.config import is_number
from hylo.policy import GradNormTrend
from hylo.version import __version__

#: Format of the ``state_dict`` written now (2: adds ``hylo_version``).
STATE_FORMAT = 2
#: Formats ``load_state_dict`` reads.
READ_FORMATS = (1, 2)
#: Keys every ``state_dict`` holds (``format`` aside); the others have defaults.
REQUIRED_KEYS = ("steps", "needs_update", "generator", "layers")


def is_index(value: object) -> bool:
    """An int ≥ 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_finite(where: str, tensors: Mapping[str, Tensor]) -> None:
    """``ValueError`` naming the first non-finite tensor (a solved state is always finite)."""
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: state_dict tensor {key!r} is not finite")


def checked_header(state_dict: object) -> Mapping[str, Any]:
    """``state_dict`` if its format and top-level entries are valid, else ``ValueError``."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"a hylo state_dict is a mapping, got {type(state_dict).__name__}")
    if "format" not in state_dict:
        raise ValueError("not a hylo state_dict: it lacks the key 'format'")
    fmt, version = state_dict["format"], state_dict.get("hylo_version")
    if not is_index(fmt) or fmt not in READ_FORMATS:
        saved_by = f" (saved by hylo {version})" if isinstance(version, str) else ""
        raise ValueError(
            f"state_dict has format {fmt!r}{saved_by}; hylo {__version__} reads formats "
            f"{', '.join(map(str, READ_FORMATS))}: the file may come from a newer hylo"
        )
    required = (*REQUIRED_KEYS, "hylo_version") if fmt >= 2 else REQUIRED_KEYS
    for key in required:
        if key not in state_dict:
            raise ValueError(f"state_dict (format {fmt}) lacks the key {key!r}")
    if "hylo_version" in state_dict and not isinstance(version, str):
        raise ValueError(f"state_dict's hylo_version is not a string: {version!r}")
    if not is_index(state_dict["steps"]):
        raise ValueError(f"state_dict's steps must be an int >= 0, got {state_dict['steps']!r}")
    if not is_index(state_dict.get("updates", 0)):
        raise ValueError(f"state_dict's updates must be an int >= 0, got {state_dict['updates']!r}")
    if not isinstance(state_dict["needs_update"], bool):
        raise ValueError(f"state_dict's needs_update must be a bool, got {state_dict['needs_update']!r}")
    if not isinstance(state_dict["generator"], Tensor):
        raise ValueError(f"state_dict's generator must be a tensor, got {type(state_dict['generator']).__name__}")
    layers = state_dict["layers"]
    if not isinstance(layers, Mapping) or not all(isinstance(name, str) for name in layers):
        raise ValueError("state_dict's layers must be a mapping from layer names to entries")
    if not isinstance(state_dict.get("config", {}), Mapping):
        raise ValueError("state_dict's config must be a mapping")
    rank, world = state_dict.get("rank", 0), state_dict.get("world_size", 1)
    if not (is_index(rank) and is_index(world) and rank < world):
        raise ValueError(f"state_dict's rank {rank!r} and world_size {world!r} are not a rank of a world")
    return state_dict


def checked_trend(state: object, current: GradNormTrend, n: int, device: torch.device) -> GradNormTrend:
    """A new trend like ``current`` loaded from ``state`` and checked against ``n`` layers (else ``ValueError``)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict's trend is not a mapping: {type(state).__name__}")
    trend = type(current)(n, current.decay, current.window, current.enter, current.exit, current.z)
    try:
        trend.load_state_dict(dict(state), device)
    except Exception as err:  # noqa: BLE001 - any failure to read it means the entry is invalid
        raise ValueError(f"state_dict's trend is invalid: {type(err).__name__}: {err}") from err
    problems = []
    if trend.moments is not None and (tuple(trend.moments.shape) != (2, n) or not trend.moments.isfinite().all()):
        problems.append(f"EMAs of shape {tuple(trend.moments.shape)} (expected {n} finite values each)")
    if len(trend.critical) != n or not all(isinstance(c, bool) for c in trend.critical):
        problems.append(f"critical flags {trend.critical!r}")
    for key, values in (("last_trend", trend.last_trend), ("last_noise", trend.last_noise)):
        if len(values) != n or not all(v is None or is_number(v) for v in values):
            problems.append(f"{key} {values!r}")
    for entry in trend.history:
        if any(len(values) != n or not all(is_number(v) for v in values) for values in entry[1:]):
            problems.append(f"history entry of step {entry[0]}")
            break
    if problems:
        raise ValueError(f"state_dict's trend does not fit {n} layers: {'; '.join(problems)}")
    return trend
