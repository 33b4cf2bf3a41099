"""The files of ``profile_dir``: append-only CSVs written as whole lines, and ``run.json`` (docs/profiling.md, "Recording").

Every CSV has one header line and one row per record. Rows are buffered in memory and written
with one ``os.write`` of whole lines per flush (after every update step and at ``close()``),
so a killed run leaves files that end on a complete line. An existing file is only ever
appended to, and only when the run was told to append; its header must match.
:meth:`ProfileFiles.flush` with ``sync`` also forces the rows to disk and returns each file's
size: what a checkpoint written then covers; :func:`rewind_profile` cuts the files back to those
sizes when the run resumes from that checkpoint (docs/profiling.md, "Checkpoints and kills").
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

#: The files hylo writes into a ``profile_dir`` (``{rank}`` is the writing rank).
FILE_PATTERNS = (
    "timing-r{rank}.csv",
    "steps-r{rank}.csv",
    "grad-norm.csv",
    "rank-analysis.csv",
    "grad-error.csv",
    "decisions.csv",
    "run.json",
)
_OURS = re.compile(
    "|".join(re.escape(p).replace(re.escape("{rank}"), r"\d+") for p in FILE_PATTERNS),
)


def format_row(values: Iterable[Any]) -> str:
    """One CSV line: None → empty (NaN for pandas), floats in full precision, strings quoted as needed."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(
        "" if v is None else (repr(float(v)) if isinstance(v, float) else v) for v in values
    )
    return buffer.getvalue()


class CsvLog:
    """An append-only CSV file with a fixed header, created at its first flush.

    Raises ``ValueError`` at construction if the file exists and ``append`` is false, or if its
    header differs from ``columns``.
    """

    def __init__(self, path: Path, columns: Sequence[str], append: bool) -> None:
        self.path = path
        self.columns = tuple(columns)
        self._header = format_row(self.columns)
        self._pending: list[str] = []
        self._fd: int | None = None
        if path.exists() and path.stat().st_size > 0:
            if not append:
                raise ValueError(f"{path} already exists; hylo never overwrites study files (pass profile_append=True)")
            with path.open() as handle:
                header = handle.readline()
            if header != self._header:
                raise ValueError(
                    f"cannot append to {path}: its columns {header.strip()!r} differ from {self._header.strip()!r}"
                )

    def add(self, values: Sequence[Any]) -> None:
        """Queue one row (written at the next flush)."""
        if len(values) != len(self.columns):
            raise ValueError(f"{self.path.name}: a row of {len(values)} values for {len(self.columns)} columns")
        self._pending.append(format_row(values))

    def flush(self, sync: bool = False) -> None:
        """Write the queued rows as whole lines (one system call), creating the file with its header if new;
        with ``sync``, force them to disk (``os.fsync``)."""
        if self._fd is None:
            if not self._pending:
                return
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if os.fstat(self._fd).st_size == 0:
                self._pending.insert(0, self._header)
        if self._pending:
            data = "".join(self._pending).encode()
            self._pending = []
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        if sync:
            os.fsync(self._fd)

    def size(self) -> int:
        """The file's size in bytes (0 while it does not exist)."""
        if self._fd is not None:
            return os.fstat(self._fd).st_size
        return self.path.stat().st_size if self.path.exists() else 0

    def close(self) -> None:
        """Flush and close the file."""
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Sink:
    """Something holding rows not yet written: flushed after every update and on close."""

    def __init__(self, log: CsvLog, prepare: Callable[[CsvLog], None] | None = None) -> None:
        self.log = log
        self._prepare = prepare

    def flush(self, sync: bool = False) -> None:
        """Turn buffered records into rows (``prepare``) and write them (``sync``: to disk)."""
        if self._prepare is not None:
            self._prepare(self.log)
        self.log.flush(sync)

    def close(self) -> None:
        """Flush and close."""
        self.flush()
        self.log.close()


def _close_all(sinks: list[Sink]) -> None:
    for sink in sinks:
        sink.close()


def existing_files(directory: str | os.PathLike[str], rank: int) -> list[str]:
    """hylo's files already in ``directory`` that this rank would write (rank 0: any of hylo's files)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    if rank == 0:
        return sorted(p.name for p in directory.iterdir() if _OURS.fullmatch(p.name))
    own = {p.format(rank=rank) for p in FILE_PATTERNS if "{rank}" in p}
    return sorted(p.name for p in directory.iterdir() if p.name in own)


class ProfileFiles:
    """The open files of one preconditioner's ``profile_dir`` on one rank; closed at exit if not before."""

    def __init__(self, directory: str | os.PathLike[str], rank: int, append: bool) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.append = append
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"profile_dir {self.directory} exists and is not a directory")
        found = existing_files(self.directory, rank)
        if found and not append:
            raise ValueError(
                f"profile_dir {self.directory} already holds hylo's files {found}; choose an empty directory, "
                "or pass profile_append=True to continue a resumed run"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sinks: list[Sink] = []
        self._finalizer = weakref.finalize(self, _close_all, self._sinks)

    def open(self, name: str, columns: Sequence[str], prepare: Callable[[CsvLog], None] | None = None) -> CsvLog:
        """A CSV of this directory, flushed with the others."""
        log = CsvLog(self.directory / name, columns, self.append)
        self._sinks.append(Sink(log, prepare))
        return log

    def write_run(self, info: dict[str, Any]) -> None:
        """``run.json``: the run's description; on append, the new start is added under ``"resumed"``."""
        path = self.directory / "run.json"
        if path.exists():
            try:
                previous = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot append to {path}: {err}") from err
            previous.setdefault("resumed", []).append(info)
            info = previous
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(info, indent=2, default=str) + "\n")
        temporary.replace(path)

    def flush(self, sync: bool = False) -> dict[str, int]:
        """Write every file's queued rows (``sync``: to disk); each file's size by name (0: not created yet)."""
        for sink in self._sinks:
            sink.flush(sync)
        if sync and self._sinks:
            _sync_directory(self.directory)  # the entries of files created by this flush
        return {sink.log.path.name: sink.log.size() for sink in self._sinks}

    def close(self) -> None:
        """Flush and close every file (idempotent)."""
        self._finalizer()


def _sync_directory(directory: Path) -> None:
    """Force ``directory``'s entries to disk (where the system allows opening a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some systems refuse to sync a directory: the files' own data is synced
    finally:
        os.close(fd)


def check_rewind(directory: str | os.PathLike[str], sizes: Mapping[str, int]) -> None:
    """``ValueError`` unless :func:`rewind_profile` can cut ``directory``'s files back to ``sizes``.

    ``sizes`` maps hylo's CSV file names (:data:`FILE_PATTERNS`, ``run.json`` aside) to byte
    counts; a file must be at least that long: rows a checkpoint covers cannot be rebuilt.
    """
    for name, size in sizes.items():
        if name == "run.json" or not _OURS.fullmatch(name):
            raise ValueError(f"{name!r} is not one of hylo's CSV files {FILE_PATTERNS[:-1]}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"the size of {name} must be an int >= 0, got {size!r}")
        path = Path(directory) / name
        actual = path.stat().st_size if path.exists() else 0
        if actual < size:
            raise ValueError(f"{path} is shorter ({actual} bytes) than the checkpoint covers ({size} bytes)")


def rewind_profile(directory: str | os.PathLike[str], sizes: Mapping[str, int]) -> list[str]:
    """Cut hylo's files in ``directory`` back to ``sizes`` (what :meth:`ProfileFiles.flush` returned at a
    checkpoint): rows written after it are dropped, a file it did not cover (size 0) is removed.

    Everything is checked first (:func:`check_rewind`), so a refusal changes nothing. Returns the
    names of the files that were cut or removed.
    """
    check_rewind(directory, sizes)
    changed = []
    for name, size in sizes.items():
        path = Path(directory) / name
        if not path.exists() or path.stat().st_size == size:
            continue
        if size == 0:
            path.unlink()
        else:
            os.truncate(path, size)
        changed.append(name)
    return changed


def run_info(config: dict[str, Any], world_size: int, device: torch.device, version: str) -> dict[str, Any]:
    """What ``run.json`` records about a run."""
    return {
        "hylo_version": version,
        "torch_version": torch.__version__,
        "world_size": world_size,
        "device": str(device),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "config": config,
    }
