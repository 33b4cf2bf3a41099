"""Text corpora of the language-model workload: the files, their fixed train/validation split, byte windows.

:mod:`hylo_scripts.data.registry` registers the two corpora (``stdlib`` and ``text``); this module knows the files.

- **stdlib**: the ``.py`` source files of the running Python's standard library, found with
  ``sysconfig.get_paths()["stdlib"]``, without the trees that are not the library's own code
  (:data:`STDLIB_EXCLUDED`: ``site-packages``, the ``test``/``tests`` suites, ``idlelib``,
  ``turtledemo`` and the generated ``pydoc_data``). The standard library differs between
  Python versions (files come and go, modules change), so the corpus does too: a run records
  the Python version and the byte counts it read (``dataset.json`` in its log directory).
- **text**: every regular file under a directory, recursively (hidden names skipped), read as
  raw bytes.

The text is modelled at the byte level: a token is one byte (vocabulary 256), so a loss in
nats per token divided by ln 2 is in bits per byte.

Split, by file, fixed: the files are ordered by the CRC-32 (``zlib.crc32``) of their path
relative to the corpus root in POSIX form (ties by the path), a shuffle that depends on the
paths alone; the first ``max(1, n // 10)`` files of that order are the validation files and
the rest the training files. A file is never in both, and neither seed nor byte cap changes
the split.

Bytes: each split is the concatenation of its files in that order; ``max_bytes`` caps the
training split at ``max_bytes`` bytes and the validation split at ``max_bytes // 10`` (the
last file read is cut), so a small cap still samples the whole corpus. An item is a window
of ``seq_len`` bytes and the ``seq_len`` bytes that follow each of them: windows do not
overlap, so an epoch is one pass over ``(bytes - 1) // seq_len`` windows.
"""

from __future__ import annotations

import platform
import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hylo_scripts.data.datasets import DatasetLayoutError, Item, SizedDataset

#: The vocabulary of a byte-level language model.
VOCAB = 256
#: The default window (and model context) length in tokens.
DEFAULT_SEQ_LEN = 128
#: Directories of the standard library whose files are not part of the corpus.
STDLIB_EXCLUDED = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "pydoc_data", "__pycache__"}
)


def stdlib_root() -> Path:
    """The running Python's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """The sorted relative (POSIX) paths of the standard library's ``.py`` files outside :data:`STDLIB_EXCLUDED`."""
    root = stdlib_root() if root is None else root
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if path.is_file() and not STDLIB_EXCLUDED.intersection(relative.parts[:-1]):
            found.append(relative.as_posix())
    return sorted(found)


def directory_files(root: Path, dataset: str = "text") -> list[str]:
    """The sorted relative (POSIX) paths of every regular file under ``root`` (hidden files and folders skipped)."""
    if not root.is_dir():
        raise DatasetLayoutError(dataset, root)
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            found.append(relative.as_posix())
    return sorted(found)


def file_order(files: Sequence[str]) -> list[str]:
    """``files`` in the corpus order: by the CRC-32 of the relative path, then by the path."""
    return sorted(files, key=lambda name: (zlib.crc32(name.encode()), name))


def split_files(files: Sequence[str]) -> tuple[list[str], list[str]]:
    """(training, validation) files, each in corpus order: the first ``max(1, n // 10)`` are validation."""
    if len(set(files)) != len(files):
        raise ValueError("the file list holds a path twice")
    if len(files) < 2:
        raise ValueError(f"a corpus needs at least two files (one for validation), got {len(files)}")
    ordered = file_order(files)
    n_val = max(1, len(ordered) // 10)
    return ordered[n_val:], ordered[:n_val]


def read_bytes(root: Path, files: Sequence[str], limit: int | None) -> Tensor:
    """The concatenated bytes of ``files`` under ``root`` as a uint8 tensor, cut at ``limit`` bytes (None: all)."""
    chunks: list[bytes] = []
    total = 0
    for name in files:
        if limit is not None and total >= limit:
            break
        data = (root / name).read_bytes()
        if limit is not None:
            data = data[: limit - total]
        chunks.append(data)
        total += len(data)
    joined = b"".join(chunks)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class Corpus:
    """The bytes of both splits (uint8 tensors), the files that went into each and where they were read."""

    train: Tensor
    validation: Tensor
    train_files: int
    validation_files: int
    root: Path

    def info(self, name: str, seq_len: int) -> dict[str, Any]:
        """What a run records about its data (``dataset.json``): Python version, root, files, bytes, windows."""
        return {
            "dataset": name,
            "python": platform.python_version(),
            "root": str(self.root),
            "files": {"train": self.train_files, "validation": self.validation_files},
            "bytes": {"train": len(self.train), "validation": len(self.validation)},
            "windows": {
                "train": window_count(len(self.train), seq_len),
                "validation": window_count(len(self.validation), seq_len),
            },
            "seq_len": seq_len,
        }


def read_corpus(root: Path, files: Sequence[str], max_bytes: int | None = None) -> Corpus:
    """Split ``files`` (relative to ``root``) and read both splits, with ``max_bytes`` capping them (module docstring)."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 (or None: no cap), got {max_bytes}")
    train, validation = split_files(files)
    return Corpus(
        read_bytes(root, train, max_bytes),
        read_bytes(root, validation, None if max_bytes is None else max(1, max_bytes // 10)),
        len(train),
        len(validation),
        root,
    )


def window_count(n_bytes: int, seq_len: int) -> int:
    """How many non-overlapping windows of ``seq_len`` inputs (and their next bytes) ``n_bytes`` bytes hold."""
    return max(0, n_bytes - 1) // seq_len


class TokenWindows(SizedDataset):
    """Non-overlapping windows of a byte stream: item ``i`` is (``x``, ``y``), int64 tensors of ``seq_len`` tokens,
    ``x`` the bytes from ``starts[i]`` on and ``y`` the same window shifted by one (the next byte of each)."""

    def __init__(self, tokens: Tensor, seq_len: int, starts: Tensor | None = None) -> None:
        if tokens.ndim != 1 or tokens.dtype != torch.uint8:
            raise ValueError(f"need a 1-D uint8 byte stream, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.starts = torch.arange(window_count(len(tokens), seq_len)) * seq_len if starts is None else starts
        super().__init__()

    def spread(self, count: int) -> TokenWindows:
        """``count`` of these windows, evenly spaced over the stream (all of them if there are no more)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if count >= len(self):
            return self
        index = torch.linspace(0, len(self) - 1, count).round().long()
        return TokenWindows(self.tokens, self.seq_len, self.starts[index])

    def __len__(self) -> int:
        return len(self.starts)

    def __getitems__(self, indices: Sequence[int]) -> list[Item]:
        """The windows at ``indices`` (one gather for the whole batch)."""
        offsets = self.starts[torch.as_tensor(indices, dtype=torch.int64)][:, None] + torch.arange(self.seq_len + 1)
        rows = self.tokens[offsets].long()
        return list(zip(rows[:, :-1].unbind(0), rows[:, 1:].unbind(0), strict=True))

    def __getitem__(self, index: int) -> Item:
        return self.__getitems__([index])[0]
