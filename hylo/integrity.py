"""Checksums of checkpoint contents: a digest of every tensor's bytes and every plain value, verified at load.

docs/reliability.md, "Checksums". :func:`checksum` digests a nested structure (mappings, lists,
tuples, tensors, NumPy arrays, numbers, strings, bytes, ``None``) deterministically: equal
contents give equal digests in any process, on any device, whatever the mapping order.
:func:`seal` stores the digest beside the contents and :func:`verify` recomputes it, raising
``ValueError`` naming where the contents came from when a single bit differs; :func:`save_atomic` writes a
checkpoint file whole or not at all.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: The key under which :func:`seal` stores the digest of a mapping's other entries.
CHECKSUM_KEY = "checksum"


def checksum(contents: Any) -> str:
    """The hex digest (BLAKE2b, 128 bits) of ``contents``; ``TypeError`` for a value it cannot digest."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, contents)
    return digest.hexdigest()


def seal(contents: Mapping[str, Any]) -> dict[str, Any]:
    """``contents`` with its checksum added under :data:`CHECKSUM_KEY` (replacing any there)."""
    body = {key: value for key, value in contents.items() if key != CHECKSUM_KEY}
    return {**body, CHECKSUM_KEY: checksum(body)}


def verify(contents: Mapping[str, Any], where: str) -> None:
    """``ValueError`` naming ``where`` unless the checksum stored in ``contents`` matches the rest of it."""
    stored = contents.get(CHECKSUM_KEY)
    if not isinstance(stored, str):
        raise ValueError(f"{where} has no valid {CHECKSUM_KEY!r} entry: it is corrupted or was not sealed")
    try:
        actual = checksum({key: value for key, value in contents.items() if key != CHECKSUM_KEY})
    except TypeError as err:
        raise ValueError(f"{where} holds a value that was never checksummed: {err}") from err
    if actual != stored:
        raise ValueError(f"{where} is corrupted: its contents do not match the checksum stored with them")


def unreadable(path: str | os.PathLike[str], err: BaseException, what: str = "checkpoint") -> str:
    """Why ``torch.load`` could not read the file ``path`` (it raised ``err``), naming the file (a ``what``) and its
    size: an empty or cut-short file (a copy interrupted, a full disk) is said to be one, with the loader's first
    sentence."""
    try:
        size = f"{os.path.getsize(path)} bytes"
    except OSError:
        size = "size unknown"
    first = (str(err).strip().splitlines() or [""])[0].split(". This is an internal")[0]
    detail = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return f"{os.fspath(path)} is not a readable {what} ({size}; empty, truncated or corrupted: {detail})"


def save_atomic(contents: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` ``contents`` to a temporary file beside ``path`` (``.NAME.XXXX.tmp``), flushed to disk, then
    moved onto ``path`` with ``os.replace``: a reader finds the old file or the whole new one, never a part."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(contents, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _feed(digest: Any, value: Any) -> None:
    """Feed ``value`` to ``digest``, each value tagged with its kind so that different structures never collide."""
    if isinstance(value, Tensor):
        data = value.detach().cpu()
        layout = "" if data.layout == torch.strided else f"{data.layout}"  # a sparse tensor: by its dense values
        data = data if not layout else data.to_dense()
        # a fresh row-major copy: contiguous() keeps a loaded tensor's odd strides where they do not matter (a
        # size-1 dimension), which the byte view refuses
        packed = torch.empty(data.shape, dtype=data.dtype, device="cpu").copy_(data)  # on the host whatever the default
        digest.update(f"T{layout}{data.dtype}{tuple(data.shape)}|".encode())
        digest.update(packed.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        entries = sorted(value.items(), key=lambda item: (type(item[0]).__name__, repr(item[0])))
        digest.update(f"M{len(entries)}|".encode())
        for key, item in entries:
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, list | tuple):
        digest.update(f"{type(value).__name__[0]}{len(value)}|".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, bool | int | float | complex | str):
        digest.update(f"{type(value).__name__}:{value!r}|".encode())
    elif isinstance(value, bytes | bytearray):
        digest.update(f"b{len(value)}|".encode())
        digest.update(bytes(value))
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        digest.update(f"N{value.dtype}{getattr(value, 'shape', ())}|".encode())
        digest.update(value.tobytes())
    else:
        raise TypeError(f"cannot checksum a value of type {type(value).__name__}")
