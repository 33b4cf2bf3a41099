"""Checkpoints of the training scripts: atomic writes, ``weights_only`` loads, the latest of a run directory.

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
import tempfile
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"checkpoint-(\d+)\.pt")


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
