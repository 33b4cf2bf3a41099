"""Read run directories into tidy pandas DataFrames with checked columns.

A run directory is what a training script writes into ``--log-dir`` (``config.json``,
``metrics.csv``) and what hylo writes into ``profile_dir`` (``run.json``, ``timing-r{rank}.csv``,
``steps-r{rank}.csv``, ``decisions.csv`` and the studies' CSVs). Every table is long format, one
row per observation, with the run's identity added as columns (``run``, ``label``, ``solver``,
``optimizer``, ``seed``, ``world_size``, and ``rank`` for per-rank files); layer names are
strings. A missing file or column raises :class:`RunDataError` naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

#: Columns every loaded table gains (``rank`` too, for the per-rank files).
RUN_COLUMNS = ("run", "label", "solver", "optimizer", "seed", "world_size")

_OPTIMIZER_NAMES = {"sgd": "SGD", "adamw": "AdamW"}


class RunDataError(ValueError):
    """A run directory lacks a file, a column or rows that a figure needs."""


@dataclass(frozen=True)
class Table:
    """One kind of CSV in a run directory: where it comes from and the columns it must have."""

    name: str
    filename: str
    written_by: str
    columns: tuple[str, ...]

    @property
    def per_rank(self) -> bool:
        """Whether every rank writes its own file (``…-r{rank}.csv``)."""
        return "{rank}" in self.filename

    @property
    def shown_name(self) -> str:
        """The file name as messages show it (``timing-r*.csv`` for per-rank files)."""
        return self.filename.format(rank="*")


_PHASE_MS = ("capture_ms", "reduce_ms", "gather_ms", "solve_ms", "broadcast_ms", "precondition_ms")

#: The tables a run directory can hold, by name.
TABLES: dict[str, Table] = {
    table.name: table
    for table in (
        Table("metrics", "metrics.csv", "the training scripts with --log-dir", ("epoch", "step", "total_time_s")),
        Table(
            "timing",
            "timing-r{rank}.csv",
            "hylo's profiling (--profiling, or profile_dir=)",
            ("step", "layer", "solver", "rows", "rows_kept", "d_a", "d_g", *_PHASE_MS, "bytes_sent", "bytes_held"),
        ),
        Table(
            "steps",
            "steps-r{rank}.csv",
            "hylo's profiling (--profiling, or profile_dir=)",
            ("step", "kind", "step_ms", "check_ms", "decide_ms", "study_ms", *_PHASE_MS, "bytes_sent"),
        ),
        Table(
            "decisions",
            "decisions.csv",
            "hylo's profiling (--profiling, or profile_dir=)",
            ("step", "layer", "solver", "reason", "trend", "critical"),
        ),
        Table(
            "grad_norm",
            "grad-norm.csv",
            "the gradient-norm study (--grad-norm, or studies=('grad_norm',))",
            ("step", "layer", "norm", "ema", "trend", "critical", "norm_after"),
        ),
        Table(
            "rank",
            "rank-analysis.csv",
            "the rank study (--rank-analysis, or studies=('rank',))",
            ("step", "layer", "batch_rows", "reference", "rank_90", "rank_99", "rank_999"),
        ),
        Table(
            "grad_error",
            "grad-error.csv",
            "the gradient-error study (--grad-error, or studies=('grad_error',))",
            ("step", "layer", "method", "rank_ratio", "rel_error", "reference"),
        ),
    )
}


@dataclass(frozen=True)
class Run:
    """A run directory and what its ``config.json`` (trainer) and ``run.json`` (hylo) say about it.

    ``config`` is flat: the trainer's fields with its hylo options (``config.json``'s ``hylo``
    object) beside them by their names, or hylo's options from ``run.json`` alone.
    ``hylo_config`` is every hylo option as ``run.json`` records it, defaults included (empty
    without ``run.json``): what the run actually used, e.g. ``rank_ratio`` and ``rank_cap``.
    """

    path: Path
    solver: str
    optimizer: str
    seed: int | None
    world_size: int
    config: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""
    hylo_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The directory's name."""
        return self.path.name


def default_label(solver: str, optimizer: str) -> str:
    """``"SGD + hybrid"``, ``"AdamW"`` (no solver) or ``"kfac"`` (no trainer config): seeds share it."""
    shown = _OPTIMIZER_NAMES.get(optimizer, optimizer)
    if solver == "none":
        return shown
    return f"{shown} + {solver}" if shown else solver


def read_run(path: str | Path, label: str | None = None) -> Run:
    """Read a run directory's identity; ``label`` overrides the default (runs sharing one are seeds)."""
    path = Path(path)
    if not path.is_dir():
        raise RunDataError(f"{path}: no such run directory")
    trainer = _read_json(path / "config.json")
    profile = _read_json(path / "run.json")
    if trainer is None and profile is None:
        raise RunDataError(
            f"{path}: not a run directory (neither config.json from a training script's --log-dir "
            "nor run.json from hylo's profile_dir)"
        )
    hylo_config: Mapping[str, Any] = (profile or {}).get("config", {})
    # A trainer's plain-optimizer run has solver null (--solver none).
    solver = str((trainer or {}).get("solver", hylo_config.get("solver")) or "none")
    optimizer = str((trainer or {}).get("optimizer", ""))
    seed = (trainer or {}).get("seed", hylo_config.get("seed"))
    world_size = int((profile or {}).get("world_size", 1))
    config = _flat(trainer) if trainer is not None else dict(hylo_config)
    return Run(
        path=path,
        solver=solver,
        optimizer=optimizer,
        seed=None if seed is None else int(seed),
        world_size=world_size,
        config=config,
        label=label if label is not None else default_label(solver, optimizer),
        hylo_config=dict(hylo_config),
    )


def _flat(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """A trainer's ``config.json`` with the options of its ``hylo`` object beside its fields (a field wins)."""
    hylo = trainer.get("hylo") or {}
    return {**hylo, **{name: value for name, value in trainer.items() if name != "hylo"}}


def read_runs(paths: Iterable[str | Path | Run], labels: Sequence[str] | None = None) -> list[Run]:
    """:func:`read_run` over several directories (``labels``, if given, one per directory).

    Without ``labels``, runs that share a default label but not a configuration get the options
    that differ appended (see :func:`_distinguish`); a :class:`Run` passed in is kept as it is.
    """
    items = list(paths)
    if labels is not None and len(labels) != len(items):
        raise ValueError(f"{len(labels)} labels for {len(items)} run directories")
    runs = []
    fresh = []  # runs read here with default labels (a Run passed in keeps its label)
    for k, item in enumerate(items):
        if isinstance(item, Run):
            runs.append(item)
        else:
            runs.append(read_run(item, None if labels is None else labels[k]))
            if labels is None:
                fresh.append(k)
    if not runs:
        raise RunDataError("no run directories given")
    for k, run in zip(fresh, _distinguish([runs[k] for k in fresh]), strict=True):
        runs[k] = run
    return runs


#: Options that do not make two runs different configurations (seeds, paths, what is recorded).
SAME_CONFIGURATION = frozenset(
    {
        "seed", "data_seed", "log_dir", "data_dir", "workers", "checkpoint_freq", "backend", "image_backend",
        "profiling", "studies", "study_every", "grad_error_methods", "grad_error_ratios", "profile_dir",
        "profile_append", "rank_every", "grad_error_every", "rank_top_k", "study_exact_rows_mb",
    }
)  # fmt: skip


def _distinguish(runs: list[Run]) -> list[Run]:
    """Append the options that differ to default labels shared by runs of different configurations.

    Runs whose configurations differ only in :data:`SAME_CONFIGURATION` keep one label (they are
    seeds of one configuration); otherwise e.g. ``"SGD + hybrid, batch_size=1000, P=2"``.
    """
    groups: dict[str, list[int]] = {}
    for k, run in enumerate(runs):
        groups.setdefault(run.label, []).append(k)
    labelled = list(runs)
    for members in groups.values():
        settings = [_setting(runs[k]) for k in members]
        differing = sorted({key for s in settings for key in s if len({repr(t.get(key)) for t in settings}) > 1})
        if not differing:
            continue
        for k, setting in zip(members, settings, strict=True):
            extra = ", ".join(f"{key}={_shown(setting.get(key))}" for key in differing)
            labelled[k] = replace(runs[k], label=f"{runs[k].label}, {extra}")
    return labelled


def _setting(run: Run) -> dict[str, Any]:
    setting = {key: value for key, value in run.config.items() if key not in SAME_CONFIGURATION}
    setting["P"] = run.world_size
    return setting


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(map(str, value))
    return str(value)


def load_table(
    runs: Iterable[str | Path | Run] | str | Path | Run,
    name: str,
    columns: Sequence[str] | None = None,
    purpose: str = "",
) -> pd.DataFrame:
    """Table ``name`` (a key of :data:`TABLES`) of every run, concatenated, with the run columns.

    ``columns`` are the columns that must be present (default: all of the table's); ``purpose``
    (e.g. ``"the 'timing' figure"``) is named in the error when a file or column is missing.
    """
    table = TABLES.get(name)
    if table is None:
        raise ValueError(f"unknown table {name!r}; the tables are {', '.join(TABLES)}")
    if isinstance(runs, (str, Path, Run)):
        runs = [runs]
    needed = tuple(table.columns if columns is None else columns)
    # The run columns are added below unless the file has its own (a layer's solver).
    added = (*RUN_COLUMNS, "rank")
    frames = []
    for run in read_runs(runs):
        for rank, path in _files(run, table, purpose):
            frame = _read_csv(path)
            missing = [c for c in needed if c not in frame.columns and (c not in added or c in table.columns)]
            if missing:
                raise RunDataError(
                    f"{path}: no column {', '.join(repr(c) for c in missing)}"
                    f"{_needs(purpose)}; the file has {', '.join(frame.columns)}"
                )
            frames.append(_with_run_columns(frame, run, rank, table.per_rank))
    return pd.concat(frames, ignore_index=True)


def check_columns(frame: pd.DataFrame, columns: Iterable[str], purpose: str = "") -> None:
    """Raise :class:`RunDataError` naming the ``columns`` that ``frame`` lacks."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise RunDataError(
            f"the DataFrame has no column {', '.join(repr(c) for c in missing)}{_needs(purpose)}; "
            f"it has {', '.join(map(str, frame.columns))}"
        )


def require_rows(frame: pd.DataFrame, what: str, purpose: str = "") -> None:
    """Raise :class:`RunDataError` when ``frame`` (described by ``what``) is empty."""
    if frame.empty:
        raise RunDataError(f"{what} has no rows{_needs(purpose)}")


def layer_order(frame: pd.DataFrame) -> list[str]:
    """Layer names in the order they first appear (hylo writes layers in registration order)."""
    return list(dict.fromkeys(frame["layer"].tolist()))


def _needs(purpose: str) -> str:
    return f" ({purpose} needs it)" if purpose else ""


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RunDataError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise RunDataError(f"{path}: expected a JSON object")
    return data


def table_files(run: Run, name: str) -> list[tuple[int | None, Path]]:
    """The files of table ``name`` in ``run``'s directory, as (rank or None, path); empty if none."""
    table = TABLES[name]
    if not table.per_rank:
        path = run.path / table.filename
        return [(None, path)] if path.exists() else []
    pattern = re.compile(re.escape(table.filename).replace(re.escape("{rank}"), r"(\d+)") + "$")
    return sorted(
        (int(match.group(1)), path) for path in run.path.iterdir() if (match := pattern.match(path.name)) is not None
    )


def _files(run: Run, table: Table, purpose: str) -> list[tuple[int | None, Path]]:
    found = table_files(run, table.name)
    if not found:
        raise RunDataError(f"{run.path}: no {table.shown_name} (written by {table.written_by}){_needs(purpose)}")
    return found


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path, dtype={"layer": str, "solver": str, "method": str, "kind": str})
    except pd.errors.EmptyDataError as err:
        raise RunDataError(f"{path}: empty file (no header)") from err
    for column in ("critical",):
        if column in frame.columns:
            # hylo writes True/False, or nothing while the trend window fills.
            frame[column] = frame[column].map({True: True, False: False, "True": True, "False": False})
            frame[column] = frame[column].astype("boolean")
    return frame


def _with_run_columns(frame: pd.DataFrame, run: Run, rank: int | None, per_rank: bool) -> pd.DataFrame:
    frame = frame.copy()
    values: dict[str, Any] = {
        "run": str(run.path),
        "label": run.label,
        "solver": run.solver,
        "optimizer": run.optimizer,
        "seed": pd.NA if run.seed is None else run.seed,
        "world_size": run.world_size,
    }
    if per_rank:
        values["rank"] = rank
    for column, value in values.items():
        # A table's own column of the same name (the layer's solver in timing/decisions) wins;
        # the run's configured solver is then ``run_solver``.
        target = column if column not in frame.columns else f"run_{column}"
        frame[target] = value
    return frame
