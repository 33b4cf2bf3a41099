"""One live preconditioner per layer: a newer one on layers a live one holds supersedes it.

docs/usage.md, "One live preconditioner per model". A preconditioner claims (:func:`claim`) the parameters of the
layers it registered when its construction succeeds. If a live one (not removed, not garbage-collected) already
holds any of them — the same model, a submodule of it, or a model that contains it — the older one is removed (its
hooks detached: it captures nothing and changes nothing) with one warning naming it and the layers they share, and
its ``step()`` raises ``RuntimeError`` saying what superseded it (:func:`removed_message`). Re-running a notebook
cell or rebuilding an optimizer keeps working; stepping both, which would precondition the same gradient twice,
cannot happen. The registry holds the preconditioners and their parameters by weak reference only: a dropped
preconditioner is not live.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import Tensor

from hylo.state import RegisteredLayer, layer_parameters

#: hylo's folder: a warning points at the first frame outside it (the user's line that built the newer one).
_HYLO = os.path.join(Path(__file__).resolve().parents[1], "")


class Removable(Protocol):
    """What the registry needs of a preconditioner: that it can be removed (its hooks detached)."""

    def remove(self) -> None: ...


@dataclass(frozen=True)
class Claim:
    """The parameters a live preconditioner's layers hold (by weak reference), each with its layer's name, and how a
    message names the preconditioner."""

    parameters: tuple[tuple[weakref.ref[Tensor], str], ...]
    label: str

    def shared(self, ids: set[int]) -> list[str]:
        """The names of the layers (each once) whose weight or bias is one of ``ids`` (alive)."""
        return list(dict.fromkeys(name for ref, name in self.parameters if (p := ref()) is not None and id(p) in ids))


#: Where the rule is documented, for the messages.
_DOCS = 'docs/usage.md, "One live preconditioner per model"'
#: The live preconditioners and what each holds; an entry goes when its preconditioner is removed or collected.
_LIVE: weakref.WeakKeyDictionary[Removable, Claim] = weakref.WeakKeyDictionary()
#: Why a superseded preconditioner's ``step()`` raises.
_SUPERSEDED: weakref.WeakKeyDictionary[Removable, str] = weakref.WeakKeyDictionary()


def _claim_of(owner: Removable, layers: Sequence[RegisteredLayer]) -> Claim:
    """``owner``'s claim on the parameters of ``layers``: each parameter once, named by the first layer holding it."""
    named: dict[int, tuple[Tensor, str]] = {}
    for layer in layers:
        for parameter in layer_parameters([layer]):
            named.setdefault(id(parameter), (parameter, layer.name))
    label = f"{type(owner).__name__} at {id(owner):#x} ({len(layers)} layers)"
    return Claim(tuple((weakref.ref(p), name) for p, name in named.values()), label)


def _overlapping(ids: set[int], owner: Removable) -> list[tuple[Removable, Claim, list[str]]]:
    """The live preconditioners other than ``owner`` holding a parameter in ``ids``, with the layers they share."""
    return [
        (other, claim, found)
        for other, claim in list(_LIVE.items())
        if other is not owner and (found := claim.shared(ids))
    ]


#: Claims made inside :func:`deferred`, applied when it exits without an error (None: claims apply at once).
_PENDING: list[tuple[Removable, Sequence[RegisteredLayer]]] | None = None


@contextmanager
def deferred() -> Iterator[None]:
    """Hold the claims made inside until the block ends: applied if it ends normally, dropped if it raises — so that
    an object that builds a preconditioner and then checks more (:class:`hylo.HyLoOptimizer`) supersedes nothing when
    a later check refuses it."""
    global _PENDING
    outer, _PENDING = _PENDING, []
    try:
        yield
        pending = _PENDING
    finally:
        _PENDING = outer
    for owner, layers in pending:
        claim(owner, layers)


def claim(owner: Removable, layers: Sequence[RegisteredLayer]) -> None:
    """Register ``owner`` as the live preconditioner of ``layers``' parameters; remove every live one holding any of
    them, with a warning naming it (once ``owner`` is fully built: a construction that raises supersedes nothing)."""
    if _PENDING is not None:
        _PENDING.append((owner, layers))
        return
    mine = _claim_of(owner, layers)
    ids = {id(p) for ref, _ in mine.parameters if (p := ref()) is not None}
    if _overlapping(ids, owner):
        gc.collect()  # a preconditioner the user dropped but a reference cycle still holds is not live
    for older, theirs, shared in _overlapping(ids, owner):
        listed = ", ".join(repr(name) for name in shared[:5]) + (
            f" and {len(shared) - 5} more" if len(shared) > 5 else ""
        )
        _SUPERSEDED[older] = (
            f"this {theirs.label} was superseded by the newer {mine.label}, built on layers it held ({listed}): its "
            f"hooks are removed and it captures nothing; step the newer one ({_DOCS})"
        )
        release(older)
        older.remove()
        warnings.warn(
            f"hylo: the new {mine.label} supersedes the live {theirs.label} on the layers they share ({listed}): the "
            "older one's hooks are removed and its step() now raises (call remove() on a preconditioner before "
            "replacing it to silence this warning)",
            stacklevel=_user_level(),
        )
    _LIVE[owner] = mine


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside hylo, as seen from the function calling this one."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _internal(filename: str) -> bool:
    """Whether a frame of ``filename`` is hylo's own (or :mod:`contextlib`'s, which runs a :func:`deferred` claim)."""
    return str(Path(filename).resolve()).startswith(_HYLO) or filename == contextlib.__file__


def release(owner: Removable) -> None:
    """``owner`` is no longer live (removed): a new preconditioner on its layers supersedes nothing."""
    _LIVE.pop(owner, None)


def removed_message(owner: Removable) -> str:
    """What ``step()`` of a removed ``owner`` raises: that it was superseded, and by what, or that it was removed."""
    return _SUPERSEDED.get(owner, f"this {type(owner).__name__} was removed; create a new one")
