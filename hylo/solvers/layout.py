"""The one layout of every held state's tensors (docs/reliability.md, "One layout"): dense row-major, at offset 0
of a storage that holds exactly its bytes, so that a state's products round alike however it was made and a resumed
run continues bit for bit."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` gives (row-major; a dimension of size 0 or 1 counted as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def is_canonical(tensor: Tensor) -> bool:
    """Whether ``tensor`` is laid out as every held state's tensors are (docs/reliability.md, "One layout"): dense
    row-major strides, at offset 0 of a storage that holds exactly its bytes (no other tensor's data beside them).
    A sparse tensor counts as canonical (a state never holds one: ``from_dict`` refuses it)."""
    if tensor.layout != torch.strided:
        return True
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and (1 not in tensor.shape or tensor.stride() == _row_major(tensor.shape))
    )


def canonical(tensor: Tensor) -> Tensor:
    """``tensor`` itself when :func:`is_canonical`, else a copy in that layout (a fresh allocation, detached)."""
    if is_canonical(tensor):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor.detach())


#: Values that hold no tensor (a tuple: ``isinstance`` with a ``|`` union would build the union at every call).
_PLAIN = (int, float, str, bool, type(None))
#: Init fields of each dataclass type :func:`canonical_held` has walked (a state that advances is rebuilt at every step).
_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


def _init_fields(kind: type) -> tuple[str, ...]:
    names = _INIT_FIELDS.get(kind)
    if names is None:
        names = _INIT_FIELDS[kind] = tuple(spec.name for spec in dataclasses.fields(kind) if spec.init)
    return names


def _changed_fields(value: Any) -> dict[str, Any]:
    """The init fields of the dataclass instance ``value`` whose :func:`canonical_held` is a new object."""
    changed = {}
    for name in _init_fields(type(value)):
        item = getattr(value, name)
        if (held := canonical_held(item)) is not item:
            changed[name] = held
    return changed


def canonical_held(value: Any) -> Any:
    """``value`` with every tensor it holds :func:`canonical`: a tensor, a mapping's values (a new dict where one
    changed), a dataclass instance's init fields (``dataclasses.replace`` where one changed, e.g. a state's
    :class:`~hylo.layers.rows.SampleRows`); anything else as it is. The same object where nothing changed."""
    if isinstance(value, Tensor):
        return canonical(value)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        held = {key: canonical_held(item) for key, item in value.items()}
        return held if any(held[key] is not item for key, item in value.items()) else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = _changed_fields(value)
        return dataclasses.replace(value, **changed) if changed else value
    return value


def canonicalize(state: object) -> None:
    """Put every tensor the dataclass instance ``state`` holds in the canonical layout, in place
    (:func:`canonical_held` of each init field; no copy of a tensor already canonical)."""
    for name, held in _changed_fields(state).items():
        object.__setattr__(state, name, held)
