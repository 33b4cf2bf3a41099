"""The ``state_dict`` of :class:`hylo.HyLoPreconditioner`: its format, the checks before a load, the restore.

docs/reliability.md, "Checkpoints". :func:`save` writes everything needed to continue
identically; :func:`read` validates a whole state against this preconditioner's layers and
config and returns what to apply, changing nothing (``ValueError`` names the first problem);
:func:`agree` makes the load all-or-nothing across ranks. Full layer states load at any world
size; a ``remote`` entry (``strategy="gradient"``) is exact only on the rank that saved it, in a
world of the same size — elsewhere the layer is recomputed at the next step, keeping what it
carries (K-FAC's running factors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.distributed import Communicator
from hylo.planner import Planner
from hylo.rules import is_number
from hylo.solvers import HeldState, RemoteState, family_of, solver_names
from hylo.solvers.registry import HYBRID
from hylo.state import UNSOLVED, RegisteredLayer
from hylo.trend import GradNormTrend
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


def checked_trend(state: object, n: int, device: torch.device) -> GradNormTrend:
    """A trend loaded from ``state`` and checked against ``n`` layers (else ``ValueError``)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict's trend is not a mapping: {type(state).__name__}")
    trend = GradNormTrend(n)
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


#: Options a state_dict restores when they are plain values (a callable of this run is kept).
RESTORABLE = ("update_freq", "damping", "factor_decay", "kl_clip", "lr", "rank_ratio", "rank", "seed")
#: Options a state_dict must have been made with: the saved running factors' scale depends on them.
MATCHING = ("solver", "damping_convention", "kfc_exponent")


def save(
    layers: Sequence[RegisteredLayer],
    planner: Planner,
    generator: torch.Generator,
    trend: GradNormTrend,
    config: HyLoConfig,
    comm: Communicator,
) -> dict[str, Any]:
    """Everything needed to continue identically: step, constant options, per-layer states."""
    entries: dict[str, Any] = {}
    for layer in layers:
        entry: dict[str, Any] = {
            "solver": layer.solver,
            "d_a": layer.math.d_a,
            "d_g": layer.math.d_g,
            "owner": layer.owner,
        }
        if isinstance(layer.state, RemoteState):
            entry["remote"] = True  # solved on layer.owner: only what the next update builds on is here
            entry["carried"] = {k: v.detach().clone() for k, v in layer.state.carried().items()}
        elif layer.state is not None:
            entry.update(layer.state.to_dict())
        entries[layer.name] = entry
    return {
        "format": STATE_FORMAT,
        "hylo_version": __version__,
        "steps": planner.step,
        "needs_update": planner.needs_update,
        "generator": generator.get_state(),
        "updates": planner.updates,
        "trend": trend.state_dict(),
        "config": config.constants(),
        "rank": comm.rank,
        "world_size": comm.world_size,
        "layers": entries,
    }


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checked state_dict, ready to apply: the config with the restored options, per layer (solver,
    state, owner), the counters, the KIS generator and the trend."""

    config: HyLoConfig
    layers: dict[str, tuple[str, HeldState | None, int]]
    steps: int
    updates: int
    needs_update: bool
    generator: torch.Generator
    trend: GradNormTrend | None


def read(state_dict: object, layers: Sequence[RegisteredLayer], config: HyLoConfig, comm: Communicator) -> Restored:
    """``state_dict`` checked against ``layers`` and ``config``: what to apply, or ``ValueError``."""
    sd = checked_header(state_dict)
    saved = sd["layers"]
    names = [layer.name for layer in layers]
    missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names), key=str)
    if missing or unexpected:
        raise ValueError(f"state_dict is for a different layer set: missing {missing}, unexpected {unexpected}")
    own_file = (sd.get("rank"), sd.get("world_size")) == (comm.rank, comm.world_size)
    own_file = own_file and config.distributed.strategy == "gradient"
    restored, recompute = {}, False
    for layer in layers:
        solver, state, owner, missing_state = _layer(layer, saved[layer.name], own_file, comm)
        restored[layer.name] = (solver, state, owner)
        recompute = recompute or missing_state
    options = sd.get("config", {})
    for option in MATCHING:
        mine = config.value(option)
        if options.get(option, mine) != mine:
            raise ValueError(
                f"state_dict was made with {option}={options[option]!r}, this preconditioner uses {mine!r}"
            )
    overrides = {k: options[k] for k in RESTORABLE if k in options and not callable(config.value(k))}
    try:
        new_config = config.replace(**overrides)
    except (TypeError, ValueError) as err:
        raise ValueError(f"state_dict's config does not apply: {err}") from err
    generator = torch.Generator()
    try:
        generator.set_state(sd["generator"])
    except (TypeError, RuntimeError, ValueError) as err:
        raise ValueError(f"state_dict has no valid KIS generator state: {err}") from err
    device = layers[0].math.weight.device
    trend = checked_trend(sd["trend"], len(layers), device) if "trend" in sd else None
    needs = bool(sd["needs_update"]) or recompute
    return Restored(new_config, restored, sd["steps"], sd.get("updates", 0), needs, generator, trend)


def agree(restored: Restored | None, error: ValueError | None, comm: Communicator, device: torch.device) -> Restored:
    """A load all ranks take or none does (one all-reduce with P > 1 ranks): ``restored``, owing an update
    if any rank owes one, or ``ValueError`` on every rank if any rank refused its state_dict."""
    if comm.world_size > 1:
        local = torch.tensor([error is None, restored is None or not restored.needs_update], device=device)
        ok, none_owe = comm.all_true(local).tolist()
        if error is None and not ok:
            error = ValueError("another rank refused its state_dict; no rank loaded one")
        if error is None and restored is not None and not none_owe:
            restored = dataclasses.replace(restored, needs_update=True)
    if error is not None:
        raise error
    assert restored is not None
    return restored


def _layer(
    layer: RegisteredLayer, entry: Any, own_file: bool, comm: Communicator
) -> tuple[str, HeldState | None, int, bool]:
    """A saved layer entry checked against ``layer``: (solver, state, owner, must recompute).

    ``own_file``: saved by this rank in a world of this size under ``"gradient"``, so a
    remote entry is exactly what this rank held. ``ValueError`` if the entry does not fit.
    """
    m, where = layer.math, f"layer {layer.name!r}"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: state_dict entry is not a mapping but {type(entry).__name__}")
    for key in ("d_a", "d_g", "solver"):
        if key not in entry:
            raise ValueError(f"{where}: state_dict entry lacks {key!r}")
    if not (is_index(entry["d_a"]) and is_index(entry["d_g"])):
        raise ValueError(f"{where}: state_dict has non-integer shape (d_g={entry['d_g']!r}, d_a={entry['d_a']!r})")
    if (entry["d_a"], entry["d_g"]) != (m.d_a, m.d_g):
        raise ValueError(
            f"{where}: state_dict has shape (d_g={entry['d_g']}, d_a={entry['d_a']}), "
            f"model has (d_g={m.d_g}, d_a={m.d_a})"
        )
    solver = entry["solver"]
    if not isinstance(solver, str) or solver not in (*solver_names(), HYBRID):
        raise ValueError(f"{where}: state_dict names an unknown solver {solver!r}")
    owner = entry.get("owner", 0)
    if not (is_index(owner) or owner == UNSOLVED):
        raise ValueError(f"{where}: state_dict's owner {owner!r} is not a rank")
    remote = entry.get("remote", False)
    if not isinstance(remote, bool):
        raise ValueError(f"{where}: state_dict's remote mark {remote!r} is not a bool")
    in_world = 0 <= owner < comm.world_size
    if remote:
        carried = entry.get("carried")
        if carried is not None and not (
            isinstance(carried, Mapping) and all(isinstance(t, Tensor) for t in carried.values())
        ):
            raise ValueError(f"{where}: state_dict's carried tensors are not a dict of tensors")
        moved = {str(k): t.to(m.weight.device) for k, t in (carried or {}).items()}
        check_finite(where, moved)
        if solver == HYBRID:  # nothing was solved for it
            return solver, None, owner if in_world else 0, True
        state = RemoteState(family_of(solver).name, moved)
        if own_file and carried is not None and in_world and owner != comm.rank:
            return solver, state, owner, False
        # elsewhere the owner's state is not on its rank: recompute, building on what the layer carries
        return solver, state if moved else None, UNSOLVED, True
    if "tensors" not in entry:
        return solver, None, owner if in_world else 0, False
    if solver == HYBRID:
        raise ValueError(f"{where}: state_dict holds tensors for solver {HYBRID!r}, which solves nothing itself")
    try:
        full = family_of(solver).state_from_dict(entry, m.d_a, m.d_g, m.weight.device)
    except KeyError as err:
        raise ValueError(f"{where}: state_dict entry lacks {err}") from err
    except (ValueError, TypeError, AttributeError, RuntimeError) as err:
        raise ValueError(f"{where}: {err}") from err
    check_finite(where, full.tensors())
    return solver, full, owner if in_world else 0, False
