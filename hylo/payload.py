"""Named payloads: the unit every collective moves (docs/design.md, "Named payloads").

A payload maps ``(layer, field)`` to a tensor, in insertion order. Solver families build
payloads from their layers' tensors; the communicator flattens and buckets them and hands
back a payload with the same keys. No caller indexes tensors by position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

#: ``(layer name, field name)``.
PayloadKey = tuple[str, str]
#: Key prefix of traffic that belongs to no layer (row counts, weights, flags, policy decisions).
CONTROL = "<control>"
#: Key prefix of the preconditioned gradients ``strategy="gradient"`` shares at every step (one buffer per dtype for
#: all layers: docs/distributed.md, "Strategies").
RESULTS = "<results>"


class Payload(dict[PayloadKey, Tensor]):
    """Tensors keyed by ``(layer, field)``; iteration follows insertion order.

    ``shared``: keys whose tensor holds equal parts of several layers' data (a group's stacked partial products),
    with those layers: the bytes a collective sends for such a key are counted to each of them in equal parts
    (``Communicator.bytes_by_tag``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared: dict[PayloadKey, tuple[str, ...]] = {}

    def add_shared(self, key: PayloadKey, tensor: Tensor, layers: Sequence[str]) -> None:
        """Insert ``tensor`` at ``key``, its bytes counted to ``layers`` in equal parts."""
        self[key] = tensor
        self.shared[key] = tuple(layers)

    def owners(self, key: PayloadKey) -> tuple[str, ...]:
        """The layers ``key``'s bytes are counted to."""
        return self.shared.get(key, (key[0],))

    def add(self, layer: str, fields: Mapping[str, Tensor]) -> None:
        """Insert every ``field → tensor`` of ``layer``."""
        for field, tensor in fields.items():
            self[(layer, field)] = tensor

    def fields(self, layer: str) -> dict[str, Tensor]:
        """The ``field → tensor`` entries of ``layer``, in insertion order."""
        return {field: tensor for (name, field), tensor in self.items() if name == layer}

    def bytes_of(self, layers: Sequence[str]) -> list[int]:
        """Bytes of each of ``layers``' tensors here (one pass)."""
        sizes = dict.fromkeys(layers, 0)
        for (layer, _), tensor in self.items():
            if layer in sizes:
                sizes[layer] += tensor.numel() * tensor.element_size()
        return list(sizes.values())
