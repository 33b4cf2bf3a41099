"""The ``state_dict`` of :class:`hylo.HyLoPreconditioner`: its format, the checks before a load, the restore.

docs/reliability.md, "Checkpoints". :func:`save` writes everything needed to continue
identically, sealed with a checksum (:mod:`hylo.integrity`); :func:`read` verifies it, validates a
whole state against this preconditioner's layers and config and returns what to apply, changing
nothing (``ValueError`` names the first problem); :func:`agree` makes the load all-or-nothing
across ranks and :func:`restore` puts it in place. Full layer states load at any world size; a
``remote`` entry (``strategy="gradient"``) is exact only on the rank that saved it, in a
world of the same size — elsewhere the layer is recomputed at the next step, keeping what it
carries (K-FAC's running factors). :func:`save_checkpoint` and :func:`load_checkpoint` (exported as
``hylo.save_checkpoint``/``hylo.load_checkpoint``) do the same through a file, whose path every error names.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from hylo import integrity
from hylo.config import HyLoConfig, options
from hylo.distributed import Communicator
from hylo.integrity import CHECKSUM_KEY
from hylo.layers.blocks import side_numbers
from hylo.layers.math import LayerMath
from hylo.pipeline.planner import Planner
from hylo.policy import SolverPolicy
from hylo.rules import is_index
from hylo.solvers import HeldState, RemoteState, family_of, solver_names
from hylo.solvers.registry import HYBRID
from hylo.state import UNSOLVED, RegisteredLayer
from hylo.trend import GradNormTrend, checked_trend
from hylo.version import __version__

#: Format of the ``state_dict`` written now (2: adds ``hylo_version``; 3: adds the ``checksum``).
STATE_FORMAT = 3
#: Formats ``load_state_dict`` reads.
READ_FORMATS = (1, 2, 3)
#: The first format whose states are sealed (:func:`hylo.integrity.seal`): a checksum is required from it on.
SEALED_FORMAT = 3
#: Keys every ``state_dict`` holds (``format`` aside); the others have defaults.
REQUIRED_KEYS = ("steps", "needs_update", "generator", "layers")
#: Every key a ``state_dict`` may hold (an unknown one is refused: it would be ignored).
KNOWN_KEYS = frozenset(
    (*REQUIRED_KEYS, "format", "hylo_version", "updates", "trend", "config", "rank", "world_size", CHECKSUM_KEY)
)
#: Every key a layer entry may hold.
ENTRY_KEYS = frozenset(("solver", "d_a", "d_g", "owner", "kept", "remote", "carried", "damping", "divisor", "tensors"))
#: What ``load_state_dict`` does with the saved options (docs/usage.md, "Checkpoints"): restore them (with a
#: warning listing those that differ), keep this preconditioner's, or refuse a state saved with others.
OptionsOnLoad = Literal["restore", "keep", "refuse"]
OPTION_MODES: tuple[OptionsOnLoad, ...] = ("restore", "keep", "refuse")


class Checkpointable(Protocol):
    """What :func:`save_checkpoint` and :func:`load_checkpoint` use of :class:`hylo.HyLoPreconditioner`: its
    ``state_dict`` and ``load_state_dict``. The preconditioner imports this module, never the other way round."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(
        self, state_dict: Mapping[str, Any], *, options: OptionsOnLoad = "restore", where: str | None = None
    ) -> None: ...


def check_finite(where: str, tensors: Mapping[str, Tensor]) -> None:
    """``ValueError`` naming the first non-finite tensor (a solved state is always finite)."""
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: state_dict tensor {key!r} is not finite")


def check_layout(where: str, tensors: Mapping[str, Tensor], math: LayerMath) -> None:
    """``ValueError`` where a saved running factor is held otherwise than this layer holds it (dense, or packed in
    blocks of ``math.factor_blocks``: a checkpoint made with another ``factor_block`` or ``split_gate_up``)."""
    for side, width, block in (("a", math.d_a, math.factor_blocks[0]), ("g", math.d_g, math.factor_blocks[1])):
        factor, numbers = tensors.get(f"factor_{side}"), side_numbers(width, block)
        if isinstance(factor, Tensor) and factor.numel() != numbers:
            raise ValueError(
                f"{where}: state_dict holds its {side.upper()} factor as {factor.numel()} numbers, this preconditioner "
                f"holds it as {numbers} (made with another factor_block or split_gate_up)"
            )


def checked_header(state_dict: object) -> Mapping[str, Any]:
    """``state_dict`` if its format, checksum and top-level entries are valid, else ``ValueError``.

    From format 3 on the checksum is required and verified first; an older state carries none (one that
    carries a checksum anyway is verified, so a flipped format number cannot skip the check).
    """
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
    if fmt >= SEALED_FORMAT or CHECKSUM_KEY in state_dict:
        integrity.verify(state_dict, "state_dict")
    unknown = sorted(set(state_dict) - KNOWN_KEYS, key=repr)
    if unknown:
        raise ValueError(f"state_dict holds unknown keys {unknown}")
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
    saved_options = state_dict.get("config", {})
    if not isinstance(saved_options, Mapping) or not all(isinstance(name, str) for name in saved_options):
        raise ValueError("state_dict's config must be a mapping from option names to values")
    rank, world = state_dict.get("rank", 0), state_dict.get("world_size", 1)
    if not (is_index(rank) and is_index(world) and rank < world):
        raise ValueError(f"state_dict's rank {rank!r} and world_size {world!r} are not a rank of a world")
    return state_dict


def checked_options(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The saved options this hylo knows, each checked by its option's rule (``ValueError`` naming the first
    that breaks it); options it does not know (an older hylo's) are left out."""
    specs = {spec.name: spec for spec in options()}
    known = {}
    for name, value in saved.items():
        spec = specs.get(name)
        if spec is None:
            continue
        if value is None and not spec.optional:
            raise ValueError(f"state_dict's config: {name} must not be None")
        if value is not None and spec.rule is not None:
            try:
                spec.rule.check(name, value)
            except ValueError as err:
                raise ValueError(f"state_dict's config: {err}") from err
        known[name] = value
    return known


#: Options a state_dict restores when they are plain values (a callable of this run is kept).
RESTORABLE = (
    "update_freq",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
    "rank_ratio",
    "rank",
    "rank_energy",
    "rank_cap",
    "seed",
)
#: Options a state_dict must have been made with: the saved running factors' scale depends on them.
MATCHING = ("solver", "damping_convention", "kfc_exponent", "factor_block")


def save(
    layers: Sequence[RegisteredLayer],
    planner: Planner,
    generator: torch.Generator,
    trend: GradNormTrend,
    config: HyLoConfig,
    comm: Communicator,
) -> dict[str, Any]:
    """Everything needed to continue identically: step, constant options, per-layer states, sealed with the
    checksum of all of it (:func:`hylo.integrity.seal`)."""
    entries: dict[str, Any] = {}
    for layer in layers:
        entry: dict[str, Any] = {
            "solver": layer.solver,
            "d_a": layer.math.d_a,
            "d_g": layer.math.d_g,
            "owner": layer.owner,
        }
        if layer.kept is not None:  # what the cost model expects under rank_ratio="auto"
            entry["kept"] = list(layer.kept)
        if isinstance(layer.state, RemoteState):
            entry["remote"] = True  # solved on layer.owner: only what the next update builds on is here
            entry["carried"] = {k: v.detach().clone() for k, v in layer.state.carried().items()}
        elif layer.state is not None:
            entry.update(layer.state.to_dict())
        entries[layer.name] = entry
    return integrity.seal(
        {
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
    )


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checked state_dict, ready to apply: the config with the restored options, per layer (solver,
    state, owner, rows kept), the counters, the KIS generator, the trend, and the options that differ from this
    preconditioner's (what the warning of ``options="restore"`` lists; empty under ``"keep"``)."""

    config: HyLoConfig
    layers: dict[str, tuple[str, HeldState | None, int, tuple[int, int] | None]]
    steps: int
    updates: int
    needs_update: bool
    generator: torch.Generator
    trend: GradNormTrend | None
    differences: str = ""


def check_mode(mode: object) -> OptionsOnLoad:
    """``mode`` if it is one of :data:`OPTION_MODES`, else ``ValueError``."""
    for known in OPTION_MODES:
        if mode == known and isinstance(mode, str):
            return known
    raise ValueError(f"options must be one of {', '.join(map(repr, OPTION_MODES))}, got {mode!r}")


def read(
    state_dict: object,
    layers: Sequence[RegisteredLayer],
    config: HyLoConfig,
    comm: Communicator,
    keeps_remote: bool,
    mode: str = "restore",
    where: str | None = None,
) -> Restored:
    """``state_dict`` checked against ``layers`` and ``config``: what to apply, or ``ValueError`` (its
    message starts with ``where``, the file the state came from, when given).

    ``keeps_remote``: whether this rank's own file restores the layers other ranks solved as theirs (the placement's
    :attr:`~hylo.pipeline.placement.Placement.keeps_remote`). ``mode`` (:data:`OPTION_MODES`) says what becomes of
    the saved options that differ from ``config``'s.
    """
    try:
        return _read(state_dict, layers, config, comm, keeps_remote, mode)
    except ValueError as err:
        if where is None:
            raise
        raise ValueError(f"{where}: {err}") from err


def _read(
    state_dict: object,
    layers: Sequence[RegisteredLayer],
    config: HyLoConfig,
    comm: Communicator,
    keeps_remote: bool,
    mode: str,
) -> Restored:
    sd = checked_header(state_dict)
    saved = sd["layers"]
    names = [layer.name for layer in layers]
    missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names), key=str)
    if missing or unexpected:
        raise ValueError(f"state_dict is for a different layer set: missing {missing}, unexpected {unexpected}")
    own_file = keeps_remote and (sd.get("rank"), sd.get("world_size")) == (comm.rank, comm.world_size)
    restored, recompute = {}, False
    for layer in layers:
        solver, state, owner, missing_state = _layer(layer, saved[layer.name], own_file, comm)
        restored[layer.name] = (solver, state, owner, _kept(layer.name, saved[layer.name]))
        recompute = recompute or missing_state
    new_config, differences = _options(checked_options(sd.get("config", {})), config, mode)
    generator = torch.Generator()
    try:
        generator.set_state(sd["generator"].cpu())  # a state moved to the device (Accelerate's prepare, map_location)
    except (TypeError, RuntimeError, ValueError) as err:
        raise ValueError(f"state_dict has no valid KIS generator state: {err}") from err
    if mode == "keep" and sd.get("config", {}).get("seed", config.lowrank.seed) != config.lowrank.seed:
        generator = torch.Generator().manual_seed(config.lowrank.seed)  # as reconfigure(seed=...) reseeds
    device = layers[0].math.weight.device
    trend = checked_trend(sd["trend"], len(layers), device) if "trend" in sd else None
    needs = bool(sd["needs_update"]) or recompute
    return Restored(new_config, restored, sd["steps"], sd.get("updates", 0), needs, generator, trend, differences)


def _options(saved: Mapping[str, Any], config: HyLoConfig, mode: str) -> tuple[HyLoConfig, str]:
    """The config to continue with under ``mode`` and, for ``"restore"``'s warning, the options that differ.

    The :data:`MATCHING` options must be equal whatever ``mode``. Of the :data:`RESTORABLE` ones (the
    options a load can change; every other option is this preconditioner's in any case), those the state
    holds with another value: ``"restore"`` puts them in place of this config's (not a callable of this
    run, which is kept), ``"keep"`` keeps this config, ``"refuse"`` raises ``ValueError`` listing them.
    """
    for option in MATCHING:
        if option in saved and saved[option] != config.value(option):
            raise ValueError(
                f"state_dict was made with {option}={saved[option]!r}, this preconditioner uses "
                f"{config.value(option)!r}"
            )
    differ = [name for name in RESTORABLE if name in saved and saved[name] != config.value(name)]
    if not differ or mode == "keep":
        return config, ""

    def listed(names: Sequence[str]) -> str:
        return ", ".join(f"{name}={saved[name]!r} (this preconditioner: {config.value(name)!r})" for name in names)

    if mode == "refuse":
        raise ValueError(
            f"state_dict was saved with other options: {listed(differ)}; "
            "load it with options='restore' or options='keep'"
        )
    restore = [name for name in differ if not callable(config.value(name))]
    kept = [name for name in differ if name not in restore]
    try:
        new_config = config.replace(**{name: saved[name] for name in restore})
    except (TypeError, ValueError) as err:
        raise ValueError(f"state_dict's config does not apply: {err}") from err
    parts = [f"restored the checkpoint's {listed(restore)}"] if restore else []
    if kept:
        parts.append(f"kept this run's callable {', '.join(kept)} (the checkpoint has {listed(kept)})")
    return new_config, "; ".join(parts)


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


def restore(
    restored: Restored, layers: Sequence[RegisteredLayer], planner: Planner, policy: SolverPolicy, where: str | None
) -> None:
    """Put a state every rank agreed to load (:func:`agree`) in place: each layer's solver, state and owner, the
    planner's counters (its hooks armed anew for ``restored.config``) and the trend. Nothing here raises; one
    warning lists the options that ``options="restore"`` replaced."""
    for layer in layers:
        layer.solver, layer.state, layer.owner, layer.kept = restored.layers[layer.name]
    planner.step, planner.updates, planner.needs_update = restored.steps, restored.updates, restored.needs_update
    planner.reset(restored.config)
    if restored.trend is not None:
        policy.trend = restored.trend
    if restored.differences:
        warnings.warn(
            f"load_state_dict{'' if where is None else f' ({where})'}: {restored.differences}; pass "
            "options='keep' to keep this preconditioner's options or options='refuse' to refuse them",
            stacklevel=3,
        )


def _kept(name: str, entry: Mapping[str, Any]) -> tuple[int, int] | None:
    """A layer entry's (rows kept, rows) of its latest low-rank update (None when it holds none), else ``ValueError``."""
    kept = entry.get("kept")
    if kept is None:
        return None
    if not (isinstance(kept, (list, tuple)) and len(kept) == 2 and all(is_index(k) for k in kept)):
        raise ValueError(f"layer {name!r}: state_dict's kept {kept!r} is not [rows kept, rows]")
    if not 1 <= kept[0] <= kept[1]:
        raise ValueError(f"layer {name!r}: state_dict's kept {kept!r} does not have 1 <= rows kept <= rows")
    return int(kept[0]), int(kept[1])


def _layer(
    layer: RegisteredLayer, entry: Any, own_file: bool, comm: Communicator
) -> tuple[str, HeldState | None, int, bool]:
    """A saved layer entry checked against ``layer``: (solver, state, owner, must recompute).

    ``own_file``: saved by this rank in a world of this size under ``"gradient"``, so a
    remote entry is exactly what this rank held. ``ValueError`` naming the layer and the field if the
    entry does not fit.
    """
    m, where = layer.math, f"layer {layer.name!r}"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: state_dict entry is not a mapping but {type(entry).__name__}")
    solver_name = entry.get("solver")
    extra = family_of(solver_name).state_type.entry_keys if solver_name in solver_names() else frozenset()
    unknown = sorted(set(entry) - ENTRY_KEYS - extra, key=repr)
    if unknown:
        raise ValueError(f"{where}: state_dict entry holds unknown keys {unknown}")
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
    if not (is_index(owner) or (type(owner) is int and owner == UNSOLVED)):
        raise ValueError(f"{where}: state_dict's owner {owner!r} is not a rank")
    remote = entry.get("remote", False)
    if not isinstance(remote, bool):
        raise ValueError(f"{where}: state_dict's remote mark {remote!r} is not a bool")
    in_world = 0 <= owner < comm.world_size
    if remote:
        stray = sorted({"damping", "divisor", "tensors"} & set(entry))
        if stray:
            raise ValueError(f"{where}: state_dict's remote entry also holds {stray}")
        if solver == HYBRID:  # nothing was solved for it
            if entry.get("carried"):
                raise ValueError(f"{where}: state_dict holds carried tensors for solver {HYBRID!r}")
            return solver, None, owner if in_world else 0, True
        family = family_of(solver)
        carried = entry.get("carried")
        try:
            moved = (
                {}
                if carried is None
                else family.state_type.carried_from_dict(carried, m.d_a, m.d_g, m.dtype, m.weight.device)
            )
        except ValueError as err:
            raise ValueError(f"{where}: state_dict's carried tensors: {err}") from err
        check_finite(where, moved)
        check_layout(where, moved, m)
        state = RemoteState(family.name, moved)
        if own_file and carried is not None and in_world and owner != comm.rank:
            return solver, state, owner, False
        # elsewhere the owner's state is not on its rank: recompute, building on what the layer carries
        return solver, state if moved else None, UNSOLVED, True
    if "carried" in entry:
        raise ValueError(f"{where}: state_dict entry holds carried tensors without the remote mark")
    if "tensors" not in entry:
        stray = sorted({"damping", "divisor"} & set(entry))
        if stray:
            raise ValueError(f"{where}: state_dict entry holds {stray} without tensors")
        return solver, None, owner if in_world else 0, False
    if solver == HYBRID:
        raise ValueError(f"{where}: state_dict holds tensors for solver {HYBRID!r}, which solves nothing itself")
    try:
        full = family_of(solver).state_from_dict(entry, m.d_a, m.d_g, m.dtype, m.weight.device)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    check_finite(where, full.tensors())
    check_layout(where, full.tensors(), m)
    return solver, full, owner if in_world else 0, False


def save_checkpoint(pre: Checkpointable, path: str | os.PathLike[str]) -> None:
    """Write ``pre.state_dict()`` (sealed with its checksum) to ``path`` with ``torch.save``, atomically
    (:func:`hylo.integrity.save_atomic`; docs/usage.md, "Checkpoints")."""
    integrity.save_atomic(pre.state_dict(), path)


def load_checkpoint(
    pre: Checkpointable,
    path: str | os.PathLike[str],
    *,
    options: OptionsOnLoad = "restore",
) -> None:
    """Load the state in ``path`` (written by :func:`save_checkpoint` or ``torch.save(pre.state_dict(), path)``)
    into ``pre``: ``pre.load_state_dict(state, options=options, where=path)``.

    A file ``torch.load`` cannot read (``weights_only=True``) and a state ``load_state_dict`` refuses — a
    checksum that does not match, an entry that does not fit — raise ``ValueError`` naming ``path``, and
    ``pre`` is unchanged; a missing file raises ``FileNotFoundError``.
    """
    where = os.fspath(path)
    checkpoint_mode = check_mode(options)
    try:
        state = torch.load(where, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file fails to unpickle in many ways
        raise ValueError(integrity.unreadable(where, err, "hylo checkpoint")) from err
    pre.load_state_dict(state, options=checkpoint_mode, where=where)
