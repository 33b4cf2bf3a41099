"""The GradScaler whose loss scale divides the captured output gradients (docs/transformers.md, "Mixed precision").

A preconditioner holds one :class:`LossScale`: given at construction (``grad_scaler=``) or set later through
``HyLoPreconditioner.grad_scaler`` — a training stack creates its scaler after the optimizer. Not an option of the
config: a live object, neither compared across ranks nor saved.
"""

from __future__ import annotations

import torch


class LossScale:
    """The scaler, if any, and what a step reads of it: whether it scales the loss and by how much."""

    def __init__(self, scaler: torch.amp.GradScaler | None = None) -> None:
        self._scaler: torch.amp.GradScaler | None = None
        self.scaler = scaler

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler, or None."""
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Set it: None or an object with a callable ``get_scale`` (a ``torch.amp.GradScaler`` or one of its kind),
        else ``ValueError`` naming its type, the scaler held unchanged."""
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self._scaler = scaler

    def enabled(self) -> bool:
        """Whether a GradScaler scales the loss (its scale divides the captured output gradients)."""
        return self.scaler is not None and self.scaler.is_enabled()

    def value(self) -> float:
        """The loss scale (1 without an enabled scaler): one host sync on CUDA."""
        return float(self.scaler.get_scale()) if self.scaler is not None and self.enabled() else 1.0
