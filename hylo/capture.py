"""Hooks that record a layer's input and output gradient on update steps only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


@dataclass
class Record:
    """One forward call of a layer: its input and (after backward) its output gradient."""

    inputs: Tensor
    grad_output: Tensor | None = None


class LayerCapture:
    """Forward hook on one module; on capture steps it also hooks the output tensor.

    The tensor hook is registered inside the forward hook, before any in-place op that
    follows the layer (e.g. ``ReLU(inplace=True)``) modifies the output, so it receives
    the gradient with respect to the layer's own output. Nothing is stored unless
    ``should_capture()`` is true, the module is training and autograd is recording.
    """

    def __init__(self, module: nn.Module, should_capture: Callable[[], bool]) -> None:
        self.records: list[Record] = []
        self._should_capture = should_capture
        self._handle: RemovableHandle | None = module.register_forward_hook(self._forward_hook, with_kwargs=True)

    def _forward_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Tensor) -> None:
        if not (module.training and torch.is_grad_enabled() and self._should_capture()):
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        x = args[0] if args else kwargs["input"]
        record = Record(x.detach())
        self.records.append(record)

        def grad_hook(grad: Tensor) -> None:
            record.grad_output = grad.detach()

        output.register_hook(grad_hook)

    def calls(self) -> list[tuple[Tensor, Tensor]]:
        """(input, output gradient) of each forward call whose backward has run."""
        return [(r.inputs, r.grad_output) for r in self.records if r.grad_output is not None]

    def clear(self) -> None:
        """Drop everything captured."""
        self.records = []

    def remove(self) -> None:
        """Detach the forward hook and drop captured data."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.clear()
