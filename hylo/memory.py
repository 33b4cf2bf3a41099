"""What a preconditioner holds, in bytes, by distinct storage (docs/design.md, "Memory")."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import Tensor

from hylo.state import RegisteredLayer


@dataclasses.dataclass(frozen=True)
class MemoryUsage:
    """Bytes a preconditioner holds (:meth:`HyLoPreconditioner.memory_breakdown`), by distinct storage."""

    #: Curvature state per layer (solved states, K-FAC's running factors).
    state: dict[str, int]
    #: Calls captured for the next ``step()`` per layer: 0 between steps.
    captured: dict[str, int]
    #: The apply plan's stacked copies of the states (docs/design.md, "The apply plan"), the hybrid policy's
    #: gradient-norm EMAs and the per-layer fallback counters.
    bookkeeping: int
    #: Number of distinct tensor storages held.
    tensors: int

    @property
    def total(self) -> int:
        """Everything held, in bytes."""
        return sum(self.state.values()) + sum(self.captured.values()) + self.bookkeeping


class _Storages:
    """Distinct storages seen so far and their bytes (a tensor's whole storage is what it keeps alive)."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def bytes(self, tensors: Sequence[Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key not in self.seen:
                self.seen.add(key)
                total += storage.nbytes()
        return total


def state_bytes(layers: Sequence[RegisteredLayer]) -> dict[str, int]:
    """Bytes of curvature state held per layer (views of one batched solve counted in each layer)."""
    return {layer.name: layer.state.nbytes() if layer.state else 0 for layer in layers}


def breakdown(layers: Sequence[RegisteredLayer], bookkeeping: Sequence[Tensor]) -> MemoryUsage:
    """Every state, captured call and ``bookkeeping`` tensor of ``layers``, each storage counted once."""
    seen = _Storages()
    state = {
        layer.name: seen.bytes(list(layer.state.tensors().values())) if layer.state is not None else 0
        for layer in layers
    }
    captured = {}
    for layer in layers:
        held: list[Tensor] = []
        for record in layer.capture.records:
            held += [t for t in (record.inputs, record.grad_output) if t is not None]
            if record.call is not None:
                held += record.call.tensors()
        captured[layer.name] = seen.bytes(held)
    return MemoryUsage(state, captured, seen.bytes(bookkeeping), len(seen.seen))
