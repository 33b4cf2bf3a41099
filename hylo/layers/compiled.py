"""hylo's hooks and ``torch.compile`` (docs/wrappers.md, "torch.compile").

Dynamo does not guard on a module's hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``),
and a graph break inside a hook splits the compiled frame that called the module, on every later
call. So hylo keeps compiled code away from its capture: on the steps a layer captures, compiled
code runs eagerly (:func:`run_eagerly`, the public ``torch.compiler.set_stance("force_eager")``,
the user's stance restored after), and on the other steps the hooks read a plain flag that is
false and trace to nothing, so the compiled graph is the graph without hylo. Code compiled before
hylo was attached (for this model or another instance of its classes) is then right as it is:
it runs only on steps where the hooks would do nothing.

If compiled code runs a capture anyway (the user's own stance), :func:`eager` keeps the capture
out of the trace (one graph break per call), and a capture step on which hooks never fired is
reported by ``step()`` (docs/reliability.md, "Layers without rows").
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn``; while dynamo traces, ``fn`` excluded from tracing (run eagerly at a graph break)."""
    if torch.compiler.is_compiling():
        dynamo = sys.modules["torch._dynamo"]  # imported: it is tracing this call
        return dynamo.disable(fn)
    return fn


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside ``torch.compile(module)``'s wrapper (an ``OptimizedModule``), or ``model``."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) or type(model).__name__ != "OptimizedModule":
            return model
        model = inner


def _dynamo() -> types.ModuleType | None:
    return sys.modules.get("torch._dynamo")


class _EagerStance:
    """``torch.compiler.set_stance("force_eager")`` held while any capture wants it, the prior stance restored after.

    Keyed by the captures' ids; a capture that is garbage-collected while it wants eager gives it up. Its
    finalizer can run inside ``set_stance`` itself (a collection during the first import of torch._dynamo):
    such a nested call only marks the stance stale, and the outer call settles it once ``set_stance`` returns.
    """

    def __init__(self) -> None:
        self.wanting: set[int] = set()
        self.holder: Any = None
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self._applying = False
        self._stale = False

    def want(self, key: object, wanted: bool) -> None:
        ident = id(key)
        if wanted and ident not in self.wanting:
            self.wanting.add(ident)
            self._finalizers[ident] = weakref.finalize(key, self._forget, ident)
        elif not wanted and ident in self.wanting:
            self._finalizers.pop(ident).detach()
            self._forget(ident)
            return
        self._apply()

    def _forget(self, ident: int) -> None:
        self.wanting.discard(ident)
        self._finalizers.pop(ident, None)
        self._apply()

    def _apply(self) -> None:
        if self._applying:  # nested (a finalizer inside set_stance): the running call settles it
            self._stale = True
            return
        self._applying = True
        try:
            self._stale = True
            while self._stale:
                self._stale = False
                self._settle()
        finally:
            self._applying = False

    def _settle(self) -> None:
        if self.wanting and self.holder is None:
            try:
                self.holder = torch.compiler.set_stance("force_eager")
            except RuntimeError:  # called from inside compiled code: captures there are traced (split graphs)
                self.holder = None
        elif not self.wanting and self.holder is not None:
            holder, self.holder = self.holder, None
            frame = sys.modules["torch._dynamo.eval_frame"]
            if getattr(frame, "_stance", holder.stance) is holder.stance:  # unless the user set a stance since
                try:
                    holder.__exit__(None, None, None)
                except RuntimeError:
                    pass


_EAGER = _EagerStance()


def run_eagerly(key: object, wanted: bool) -> None:
    """Whether ``key`` (a layer's capture) wants compiled code to run eagerly: while any does, it does.

    Set between steps, for the steps that capture (docs/wrappers.md, "torch.compile").
    """
    _EAGER.want(key, wanted)


def compiled_code_ran() -> bool:
    """Whether dynamo has compiled any frame in this process (the likely cause of hooks that never fire)."""
    dynamo = _dynamo()
    if dynamo is None:
        return False
    tracker = getattr(getattr(dynamo, "convert_frame", None), "input_codes", None)
    return bool(getattr(tracker, "seen", True))
