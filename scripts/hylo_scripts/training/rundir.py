"""The run directory's files other than checkpoints (those are :mod:`hylo_scripts.training.checkpoint`'s).

A run with ``log_dir`` writes there, on rank 0: ``config.json`` (the run's configuration),
``model-summary.txt`` (torchinfo's summary of the model), ``dataset.json`` (what the dataset
reports about itself, if anything) and ``metrics.csv`` (one row per epoch, :data:`METRIC_COLUMNS`,
appended as epochs finish). :func:`write_rows` writes the benchmarks' CSV files.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hylo_scripts.training.tasks import TASKS

#: Columns of ``metrics.csv``; ``test_metric`` is written as the task's metric: ``test_acc`` (classification),
#: ``test_dsc`` (segmentation) or ``test_bpb`` (language models: bits per byte; ``test_loss`` is then in nats
#: per token).
METRIC_COLUMNS = (
    "epoch",
    "step",
    "lr",
    "train_loss",
    "test_loss",
    "test_metric",
    "epoch_time_s",
    "total_time_s",
    "precondition_time_s",
)


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write ``rows`` (header from the first row's keys) as a CSV file, creating parent folders."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def metrics_header(task: str) -> list[str]:
    """The header of ``metrics.csv`` for a task."""
    return [TASKS[task].metric if column == "test_metric" else column for column in METRIC_COLUMNS]


def append_metrics(path: Path, task: str, entry: Any) -> None:
    """Append one epoch (a dataclass of :data:`METRIC_COLUMNS`) to ``metrics.csv`` (header first if the file is
    new), flushed to disk."""
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as handle:
        writer = csv.writer(handle)
        if new:
            writer.writerow(metrics_header(task))
        writer.writerow([repr(value) if isinstance(value, float) else value for value in asdict(entry).values()])
        handle.flush()
        os.fsync(handle.fileno())


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write a JSON file atomically (temporary file + ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def write_run_files(log_dir: Path, config: Mapping[str, Any], summary: str | None, info: Mapping[str, Any]) -> None:
    """``config.json``, ``model-summary.txt`` and, if the dataset reports anything, ``dataset.json``."""
    write_json(log_dir / "config.json", config)
    (log_dir / "model-summary.txt").write_text(f"{summary}\n")
    if info:
        write_json(log_dir / "dataset.json", info)


def model_summary(
    net: nn.Module, input_shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
) -> str:
    """torchinfo's summary of ``net`` on a batch of two ``input_shape`` inputs of ``dtype`` (int64: tokens);
    the global RNG is left as it was."""
    import torchinfo

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        stats = torchinfo.summary(
            net, input_size=(2, *input_shape), dtypes=[dtype], device=device, verbose=0, mode="eval"
        )
    return str(stats)
