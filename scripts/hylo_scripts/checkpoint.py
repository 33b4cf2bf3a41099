"""Checkpoints of the training scripts: atomic writes, ``weights_only`` loads, the latest of a run directory.

It also keeps a run directory honest: :func:`open_run_dir` refuses a directory that holds
another run unless resuming, and, resuming, loads the latest checkpoint after checking that it
was made by as many ranks with the same options (:data:`RESUMABLE_CHANGES` aside).

A checkpoint after epoch N of a run in ``LOG_DIR`` is two kinds of file:

- ``checkpoint-{N:04d}.pt`` (rank 0): model, optimizer, lr scheduler, step and epoch counters,
  the global RNG state, the run's configuration, the training time so far and the size of
  ``metrics.csv`` at that point;
- ``checkpoint-{N:04d}-hylo-r{rank}.pt`` (every rank, with a preconditioner): hylo's
  ``state_dict()``. Each rank saves its own, because under ``strategy="gradient"`` a layer's
  inverse lives only on the rank that solved it.

Every file is written to a temporary name in the same directory and moved into place with
``os.replace``, and rank 0 writes its file only after every rank has written its part, so a
``checkpoint-{N}.pt`` that exists is complete. Files are read with
``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts only.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hylo

_NAME = re.compile(r"checkpoint-(\d+)\.pt")
#: Files whose presence marks a directory as holding a run (besides checkpoints).
RUN_FILES = ("config.json", "metrics.csv")
#: Options a resumed run may change; any other difference from the checkpoint's configuration is refused.
RESUMABLE_CHANGES = ("epochs", "log_dir", "data_dir", "workers", "checkpoint_freq", "image_backend")


class RunError(ValueError):
    """A run that cannot start as asked: its ``log_dir`` holds another run, or there is nothing to resume."""


@dataclass
class Start:
    """Where a run starts: epoch and step counters, training time so far, the checkpoint (if resuming)."""

    epoch: int = 0
    step: int = 0
    total_time_s: float = 0.0
    state: dict[str, Any] | None = None


def checkpoint_path(log_dir: str | Path, epoch: int) -> Path:
    """The rank-0 checkpoint file after ``epoch`` epochs."""
    return Path(log_dir) / f"checkpoint-{epoch:04d}.pt"


def hylo_state_path(log_dir: str | Path, epoch: int, rank: int) -> Path:
    """The file of rank ``rank``'s preconditioner state after ``epoch`` epochs."""
    return Path(log_dir) / f"checkpoint-{epoch:04d}-hylo-r{rank}.pt"


def latest_checkpoint(log_dir: str | Path) -> tuple[int, Path] | None:
    """The highest epoch with a (complete) rank-0 checkpoint in ``log_dir`` and its path, or None."""
    found = [
        (int(match.group(1)), path)
        for path in Path(log_dir).glob("checkpoint-*.pt")
        if (match := _NAME.fullmatch(path.name))
    ]
    return max(found) if found else None


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, flushed to disk, then ``os.replace`` onto it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | Path, map_location: torch.device | str | None = None) -> dict[str, Any]:
    """A checkpoint file, read with ``weights_only=True``; a clear error if it is not one."""
    try:
        loaded = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # unpickling errors come in many types
        raise ValueError(f"{path} is not a readable checkpoint: {err}") from err
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} is not a checkpoint (holds a {type(loaded).__name__}, not a dict)")
    return loaded


def _holds_a_run(log_dir: Path) -> list[str]:
    """The run files in ``log_dir`` (config, metrics, the first checkpoint)."""
    found = [name for name in RUN_FILES if (log_dir / name).exists()]
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


def open_run_dir(
    log_dir: str | None,
    config: Mapping[str, Any],
    *,
    resume: bool,
    world: int,
    device: torch.device,
    defaults: Mapping[str, Any] | None = None,
) -> Start:
    """Create ``log_dir``, refuse another run in it unless ``resume``; resuming, load its latest checkpoint.

    ``config`` is the run's configuration as JSON values (``epochs`` included); ``defaults`` the
    values of options an older checkpoint may lack. Nothing is
    written besides the directory itself; every refusal is a :class:`RunError`.
    """
    if log_dir is None:
        if resume:
            raise RunError("resume continues the run in log_dir: set log_dir")
        return Start()
    directory = Path(log_dir)
    directory.mkdir(parents=True, exist_ok=True)
    if not resume:
        found = _holds_a_run(directory)
        if found:
            raise RunError(
                f"log_dir {directory} holds another run ({', '.join(found)}); resume it (--resume) or choose another"
            )
        return Start()
    latest = latest_checkpoint(directory)
    if latest is None:
        raise RunError(f"nothing to resume: no checkpoint-NNNN.pt in {directory}")
    epoch, path = latest
    state = load(path, map_location=device)
    if state.get("world") != world:
        raise RunError(f"{path} was written by {state.get('world')} ranks; resume it on as many, not {world}")
    _check_resumable(state["config"], config, path, defaults or {})
    if epoch >= config["epochs"]:
        raise RunError(f"{path}: the run has finished {epoch} epochs; ask for more (--epochs > {epoch}) to resume")
    return Start(epoch=state["epoch"], step=state["step"], total_time_s=state["total_time_s"], state=state)


def truncate_metrics(path: Path, size: int) -> None:
    """Cut ``metrics.csv`` back to its size at the checkpoint (rows of epochs after it are dropped)."""
    actual = path.stat().st_size if path.exists() else 0
    if actual < size:
        raise RunError(f"{path} is shorter ({actual} bytes) than when the checkpoint was written ({size} bytes)")
    if actual > size:
        print(f"resume: dropping rows of {path} written after the checkpoint", file=sys.stderr, flush=True)
        os.truncate(path, size)


def save_checkpoint(
    log_dir: Path,
    config: Mapping[str, Any],
    *,
    epoch: int,
    step: int,
    rank: int,
    world: int,
    total_time_s: float,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    pre: hylo.HyLoPreconditioner | None,
    metrics_path: Path,
) -> None:
    """Write the checkpoint after ``epoch`` epochs: hylo's state on every rank, then (after a barrier) rank 0's file."""
    if pre is not None:
        save_atomic(pre.state_dict(), hylo_state_path(log_dir, epoch, rank))
    if world > 1:
        dist.barrier()
    if rank == 0:
        state = {
            "format": 1,
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
        save_atomic(state, checkpoint_path(log_dir, epoch))
    if world > 1:
        dist.barrier()
