"""Checkpoints of the training scripts: atomic, sealed writes, checked loads, the latest of a run directory.

It also keeps a run directory honest: :func:`open_run_dir` refuses a directory that holds
another run unless resuming, and, resuming, checks every file of the latest checkpoint before
anything is written (docs/training-scripts.md, "Checkpoints and resume").

A checkpoint after epoch N of a run in ``LOG_DIR`` is two kinds of file:

- ``checkpoint-{N:04d}.pt`` (rank 0): model, optimizer, lr scheduler, step and epoch counters,
  the global RNG state, the run's configuration, the training time so far, the size of
  ``metrics.csv`` at that point and the run's id;
- ``checkpoint-{N:04d}-hylo-r{rank}.pt`` (every rank, with a preconditioner): hylo's
  ``state_dict()`` as it is (under ``"hylo"``), the run's id and the sizes of this rank's
  profile files at that point (hylo's ``flush_profile()``). Each rank saves its own, because
  under ``strategy="gradient"`` a layer's inverse lives only on the rank that solved it.

Every file is sealed with a checksum of its contents (:func:`hylo.integrity.seal`) and
written to a temporary name in the same directory, flushed to disk and moved into place with
``os.replace``; rank 0 writes its file only after every rank has written its part, so a
``checkpoint-{N}.pt`` that exists is complete. Files are read with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts only) and their
checksum verified. The run's id, drawn at a fresh start, ties the files of one run together: a
hylo file of another run (another seed, say) is refused.
"""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hylo
from hylo import integrity

_NAME = re.compile(r"checkpoint-(\d+)\.pt")
_HYLO_NAME = re.compile(r"checkpoint-(\d+)-hylo-r\d+\.pt")
#: Format of the files written now (2: sealed with a checksum, the run's id, hylo's state wrapped).
FORMAT = 2
#: Files whose presence marks a directory as holding a run (besides checkpoints and hylo's profile files).
RUN_FILES = ("config.json", "metrics.csv")
#: The other files of a run (:mod:`hylo_scripts.training.rundir`), removed with it when a run that stopped before its first
#: checkpoint restarts.
OTHER_RUN_FILES = ("model-summary.txt", "dataset.json")
#: Temporaries left by a process killed while writing: :func:`hylo.integrity.save_atomic`'s, ``rundir.write_json``'s and hylo's
#: ``run.json``'s; removed when a run starts or resumes.
TEMPORARIES = re.compile(r"\.checkpoint-\d+(-hylo-r\d+)?\.pt\..+\.tmp|\.(config|dataset)\.json\.tmp|run\.json\.tmp")
#: Options a resumed run may change; any other difference from the checkpoint's configuration is refused.
RESUMABLE_CHANGES = ("epochs", "log_dir", "data_dir", "workers", "checkpoint_freq", "image_backend")


class RunError(ValueError):
    """A run that cannot start as asked: its ``log_dir`` holds another run, or what it holds cannot be resumed.

    The message names the file and what to do.
    """


@dataclass
class Start:
    """Where a run starts, everything checked and nothing written yet (see :func:`open_run_dir`).

    Epoch and step counters and training time so far; the rank-0 checkpoint (``state``) and this
    rank's hylo state (``hylo``, from ``hylo_path``) and profile file sizes when resuming; the run's
    id (None: a fresh run, which draws one); ``restart``: the files of a run that stopped before its
    first checkpoint, removed by :func:`prepare` before it starts again.
    """

    epoch: int = 0
    step: int = 0
    total_time_s: float = 0.0
    state: dict[str, Any] | None = None
    run_id: str | None = None
    hylo: dict[str, Any] | None = None
    hylo_path: Path | None = None
    profile_bytes: dict[str, int] = field(default_factory=dict)
    restart: list[str] = field(default_factory=list)


def new_run_id() -> str:
    """A fresh run's id: 32 random hex digits (from the system, not torch's generator: seeds are untouched)."""
    return uuid.uuid4().hex


def checkpoint_path(log_dir: str | Path, epoch: int) -> Path:
    """The rank-0 checkpoint file after ``epoch`` epochs."""
    return Path(log_dir) / f"checkpoint-{epoch:04d}.pt"


def hylo_state_path(log_dir: str | Path, epoch: int, rank: int) -> Path:
    """The file of rank ``rank``'s preconditioner state after ``epoch`` epochs."""
    return Path(log_dir) / f"checkpoint-{epoch:04d}-hylo-r{rank}.pt"


def _checkpoints(log_dir: Path) -> list[tuple[int, Path]]:
    """The (complete) rank-0 checkpoints in ``log_dir``, by epoch."""
    return sorted(
        (int(match.group(1)), path) for path in log_dir.glob("checkpoint-*.pt") if (match := _NAME.fullmatch(path.name))
    )


def latest_checkpoint(log_dir: str | Path) -> tuple[int, Path] | None:
    """The highest epoch with a (complete) rank-0 checkpoint in ``log_dir`` and its path, or None."""
    found = _checkpoints(Path(log_dir))
    return found[-1] if found else None


def load(path: str | Path, map_location: torch.device | str | None = None) -> dict[str, Any]:
    """A sealed checkpoint file, read with ``weights_only=True`` and its checksum verified; ``ValueError`` naming
    the file if it is not one (unreadable, not a dict, or corrupted)."""
    try:
        loaded = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # unpickling errors come in many types
        raise ValueError(integrity.unreadable(path, err)) from err
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} is not a checkpoint (holds a {type(loaded).__name__}, not a dict)")
    if loaded.get("format") != FORMAT:
        raise ValueError(
            f"{path} has format {loaded.get('format')!r}, not {FORMAT} (files of format 1 were written by an "
            "older trainer, without checksums; this version does not resume them)"
        )
    integrity.verify(loaded, where=str(path))
    return loaded


def _holds_a_run(log_dir: Path) -> list[str]:
    """The run files in ``log_dir``: config, metrics, hylo's profile files, the first checkpoint."""
    found = [name for name in RUN_FILES if (log_dir / name).exists()]
    found += hylo.HyLoPreconditioner.profile_files(log_dir)
    return found + sorted(path.name for path in log_dir.glob("checkpoint-*.pt"))[:1]


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run's configuration with its hylo options as entries ``hylo.NAME``."""
    flat = {name: value for name, value in config.items() if name != "hylo"}
    flat.update({f"hylo.{name}": value for name, value in (config.get("hylo") or {}).items()})
    return flat


def _check_resumable(
    saved: Mapping[str, Any], config: Mapping[str, Any], path: Path, defaults: Mapping[str, Any]
) -> None:
    """Refuse a checkpoint made with other options than ``config`` (beyond :data:`RESUMABLE_CHANGES`).

    The run's fields and its hylo options (``config["hylo"]``, named ``hylo.NAME``) are compared
    one by one; one the checkpoint does not have (added after it was written) counts as its default.
    """
    if "hylo" in config and "hylo" not in saved:
        raise RunError(
            f"{path} was written before a run's hylo options were one 'hylo' entry of its configuration; "
            "this version does not resume it"
        )
    saved, config, defaults = _flat(saved), _flat(config), _flat(defaults)
    changed = [
        f"{name} {saved.get(name, defaults.get(name))!r} -> {config[name]!r}"
        for name in config
        if name not in RESUMABLE_CHANGES and saved.get(name, defaults.get(name)) != config[name]
    ]
    if changed:
        raise RunError(
            f"{path} was made with a different configuration ({'; '.join(changed)}); "
            f"a resumed run may change only {', '.join(RESUMABLE_CHANGES)}"
        )


def _fix(log_dir: Path, epoch: int) -> str:
    """What to do about a checkpoint after ``epoch`` that cannot be resumed: fall back to the one before it."""
    earlier = [path.name for found, path in _checkpoints(log_dir) if found < epoch]
    drop = f"checkpoint-{epoch:04d}.pt and checkpoint-{epoch:04d}-hylo-r*.pt"
    if earlier:
        return f"to resume from {earlier[-1]} instead, delete {drop}"
    return f"to restart the run from scratch, delete {drop} and run with --resume again"


def _saved_checkpoint_freq(log_dir: Path) -> Any:
    """``checkpoint_freq`` as the run's ``config.json`` has it (None if there is no readable one)."""
    try:
        return json.loads((log_dir / "config.json").read_text()).get("checkpoint_freq")
    except (OSError, ValueError, AttributeError):
        return None


def _restart(directory: Path) -> Start:
    """``--resume`` in a directory without a checkpoint: a run that stopped before its first restarts."""
    found = _holds_a_run(directory)
    if not found:
        raise RunError(f"nothing to resume: {directory} holds no run (no checkpoint, config.json or metrics.csv)")
    if _saved_checkpoint_freq(directory) == 0:
        raise RunError(
            f"nothing to resume: the run in {directory} wrote no checkpoints (its config.json has checkpoint_freq 0); "
            "start a new run in another log_dir"
        )
    extra = [name for name in OTHER_RUN_FILES if (directory / name).exists()]
    return Start(restart=[name for name in found if name not in _orphans(directory, 0)] + extra)


def open_run_dir(
    log_dir: str | None,
    config: Mapping[str, Any],
    *,
    resume: bool,
    world: int,
    device: torch.device,
    rank: int = 0,
    hylo: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> Start:
    """Create ``log_dir``, refuse another run in it unless ``resume``; resuming, load and check its latest checkpoint.

    ``config`` is the run's configuration as JSON values (``epochs`` included); ``defaults`` the
    values of options an older checkpoint may lack; ``hylo``: the run has a preconditioner, whose
    file of this ``rank`` is loaded too. Every file is checked (checksum, run id, world size,
    configuration, epochs, the sizes of ``metrics.csv`` and the profile files) and nothing is
    written besides the directory itself; every refusal is a :class:`RunError` naming the file
    and what to do. A ``log_dir`` whose run stopped before its first checkpoint restarts from
    scratch with ``resume`` (:func:`prepare` removes its files).
    """
    if log_dir is None:
        if resume:
            raise RunError("resume continues the run in log_dir: set log_dir")
        return Start()
    directory = Path(log_dir)
    directory.mkdir(parents=True, exist_ok=True)
    latest = latest_checkpoint(directory)
    if not resume:
        found = _holds_a_run(directory)
        if found and latest is None and _saved_checkpoint_freq(directory) == 0:
            raise RunError(
                f"log_dir {directory} holds another run ({', '.join(found)}), which wrote no checkpoints "
                "(checkpoint_freq 0); choose another log_dir"
            )
        if found and latest is None:
            raise RunError(
                f"log_dir {directory} holds a run that stopped before its first checkpoint ({', '.join(found)}); "
                "restart it from scratch with --resume, or choose another log_dir"
            )
        if found:
            raise RunError(
                f"log_dir {directory} holds another run ({', '.join(found)}); resume it (--resume) or choose another"
            )
        return Start()
    if latest is None:
        return _restart(directory)
    epoch, path = latest
    try:
        state = load(path, map_location=device)
    except ValueError as err:
        raise RunError(f"{err}; {_fix(directory, epoch)}") from err
    if state.get("world") != world:
        raise RunError(f"{path} was written by {state.get('world')} ranks; resume it on as many, not {world}")
    _check_resumable(state["config"], config, path, defaults or {})
    if epoch >= config["epochs"]:
        raise RunError(f"{path}: the run has finished {epoch} epochs; ask for more (--epochs > {epoch}) to resume")
    start = Start(
        epoch=state["epoch"],
        step=state["step"],
        total_time_s=state["total_time_s"],
        state=state,
        run_id=state["run_id"],
    )
    if rank == 0:
        metrics = directory / "metrics.csv"
        actual = metrics.stat().st_size if metrics.exists() else 0
        if actual < state["metrics_bytes"]:
            raise RunError(
                f"{metrics} is shorter ({actual} bytes) than when {path.name} was written ({state['metrics_bytes']} "
                f"bytes): rows it covers are lost; {_fix(directory, epoch)}"
            )
    if hylo:
        _load_hylo(start, directory, epoch, rank, device)
    return start


def _load_hylo(start: Start, directory: Path, epoch: int, rank: int, device: torch.device) -> None:
    """This rank's hylo file of the checkpoint after ``epoch``, checked (checksum, run id, profile sizes), into
    ``start``."""
    path = hylo_state_path(directory, epoch, rank)
    fix = _fix(directory, epoch)
    if not path.exists():
        raise RunError(f"{path} is missing (every rank's hylo state is part of the checkpoint); {fix}")
    try:
        contents = load(path, map_location=device)
    except ValueError as err:
        raise RunError(f"{err}; {fix}") from err
    if contents.get("run_id") != start.run_id:
        raise RunError(
            f"{path} belongs to another run (run id {contents.get('run_id')!r}, not {start.run_id!r} as in "
            f"checkpoint-{epoch:04d}.pt); put back this run's file, or {fix.replace('to ', '', 1)}"
        )
    if not isinstance(contents.get("hylo"), dict) or not isinstance(contents.get("profile_bytes"), dict):
        raise RunError(f"{path} lacks hylo's state or the profile sizes; {fix}")
    for name, size in contents["profile_bytes"].items():
        actual = (directory / name).stat().st_size if (directory / name).exists() else 0
        if actual < size:
            raise RunError(
                f"{directory / name} is shorter ({actual} bytes) than when {path.name} was written ({size} bytes): "
                f"rows it covers are lost; {fix}"
            )
    start.hylo, start.hylo_path, start.profile_bytes = contents["hylo"], path, contents["profile_bytes"]


def _orphans(log_dir: Path, epoch: int) -> list[str]:
    """hylo files of checkpoints after ``epoch`` that were never completed (a kill before rank 0's file)."""
    return sorted(
        path.name
        for path in log_dir.glob("checkpoint-*-hylo-r*.pt")
        if (match := _HYLO_NAME.fullmatch(path.name)) and int(match.group(1)) > epoch
    )


def hylo_refused(start: Start, err: ValueError) -> RunError:
    """The error of a resume whose hylo state the preconditioner refused (``err``), naming its file."""
    assert start.hylo_path is not None
    return RunError(f"{start.hylo_path}: hylo refuses the state: {err}; {_fix(start.hylo_path.parent, start.epoch)}")


def prepare(log_dir: str | None, start: Start, rank: int) -> None:
    """The side effects of a start that every rank has checked (:func:`open_run_dir`): rank 0 removes stale
    temporaries, the hylo files of an incomplete checkpoint and the files of a run that restarts, and cuts ``metrics.csv`` back to the checkpoint; every
    rank cuts its profile files back to what the checkpoint covers. Each is said on stderr."""
    if log_dir is None:
        return
    directory = Path(log_dir)
    if rank == 0:
        stale = sorted(path.name for path in directory.iterdir() if TEMPORARIES.fullmatch(path.name))
        stale += _orphans(directory, start.epoch)
        for name in stale:
            (directory / name).unlink(missing_ok=True)
        if stale:
            _say(f"removed what a run killed while writing left: {', '.join(stale)}")
        if start.restart:
            _say(
                f"no checkpoint in {directory}: the run stopped before its first; starting from scratch "
                f"(removing {', '.join(start.restart)})"
            )
            for name in start.restart:
                (directory / name).unlink(missing_ok=True)
        if start.state is not None:
            truncate_metrics(directory / "metrics.csv", start.state["metrics_bytes"])
    if start.profile_bytes:
        cut = hylo.HyLoPreconditioner.rewind_profile(directory, start.profile_bytes)
        if cut:
            _say(f"dropping the rows of {', '.join(cut)} written after the checkpoint")


def _say(message: str) -> None:
    print(f"resume: {message}", file=sys.stderr, flush=True)


def truncate_metrics(path: Path, size: int) -> None:
    """Cut ``metrics.csv`` back to its size at the checkpoint (rows of epochs after it are dropped)."""
    actual = path.stat().st_size if path.exists() else 0
    if actual < size:
        raise RunError(f"{path} is shorter ({actual} bytes) than when the checkpoint was written ({size} bytes)")
    if actual > size:
        _say(f"dropping rows of {path} written after the checkpoint")
        os.truncate(path, size)


def save_checkpoint(
    log_dir: Path,
    config: Mapping[str, Any],
    *,
    epoch: int,
    step: int,
    rank: int,
    world: int,
    run_id: str,
    total_time_s: float,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    pre: hylo.HyLoPreconditioner | None,
    metrics_path: Path,
) -> None:
    """Write the checkpoint after ``epoch`` epochs: on every rank, its profile files flushed to disk and hylo's
    state with their sizes; then (after a barrier) rank 0's file. Every file is sealed and carries ``run_id``."""
    if pre is not None:
        profile_bytes = pre.flush_profile()  # the rows up to this step, on disk: what the checkpoint covers
        contents = {"format": FORMAT, "run_id": run_id, "hylo": pre.state_dict(), "profile_bytes": profile_bytes}
        integrity.save_atomic(integrity.seal(contents), hylo_state_path(log_dir, epoch, rank))
    if world > 1:
        dist.barrier()
    if rank == 0:
        state = {
            "format": FORMAT,
            "run_id": run_id,
            "epoch": epoch,
            "step": step,
            "world": world,
            "total_time_s": total_time_s,
            "metrics_bytes": metrics_path.stat().st_size,
            "config": dict(config),
            "model": net.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }
        integrity.save_atomic(integrity.seal(state), checkpoint_path(log_dir, epoch))
    if world > 1:
        dist.barrier()
