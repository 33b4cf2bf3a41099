"""Several layers held by one module and captured by one hook: what a layer type returns for fused experts.

docs/extending.md, "Fused layers". A registered factory (:func:`hylo.register_layer_type`) returns a
:class:`~hylo.layers.math.LayerMath` for a module that is one layer, or a :class:`FusedLayers` for a module that
holds several (a mixture-of-experts module storing every expert's projections in one 3-D parameter,
:mod:`hylo.layers.experts`). Each of its layers is registered under the module's name and its own suffix, with
its own math, state and solver; the module's :meth:`FusedLayers.tap` hooks the module once and feeds every
layer's capture from what the hook sees.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from torch import nn

from hylo.layers.math import LayerMath

if TYPE_CHECKING:
    from hylo.layers.capture import LayerCapture


class Tap(Protocol):
    """The hooks that feed several layers' captures from one module (an attention module's, fused experts')."""

    def remove(self) -> None:
        """Detach the hooks."""


class FusedLayers(ABC):
    """The layers one module holds, each a :class:`~hylo.layers.math.LayerMath`, and the tap that captures them."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @abstractmethod
    def layers(self) -> list[tuple[str, LayerMath]]:
        """Each layer's name under the module's (``gate_up_proj.3``) and its math, in registration order."""

    @abstractmethod
    def tap(self, captures: Mapping[str, LayerCapture], name: str) -> Tap:
        """Hook the module (named ``name`` in messages) so that the calls of each layer in ``captures`` (by the
        names :meth:`layers` gives; a skipped or tied layer is absent) reach its capture on capture steps."""
