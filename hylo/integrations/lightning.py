"""Lightning integration: :class:`HyLoCallback` (docs/training-stacks.md, "Lightning").

The callback runs ``pre.step()`` in ``on_before_optimizer_step`` — once per optimizer step, after the closure's
backward of the last accumulated batch and before Lightning's gradient clipping — and carries hylo's state in
Lightning's checkpoints through ``state_dict``/``load_state_dict``, so that ``trainer.fit(..., ckpt_path=...)``
continues the run bit for bit. Importing this module imports ``lightning``; ``import hylo`` does not.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer

from hylo.integrations.checks import check_attached, preconditioner_of
from hylo.preconditioner import HyLoPreconditioner


class HyLoCallback(pl.Callback):
    """Runs a :class:`HyLoPreconditioner` inside a Lightning ``Trainer`` and keeps its state in the checkpoints.

    Args:
        preconditioner: built on the LightningModule's model (or the module itself) before ``fit``.

    One ``step()`` per optimizer step: a LightningModule with several optimizers (manual optimization) steps
    hylo at each of their steps, so give it one optimizer (or use :class:`hylo.HyLoOptimizer` as the one that
    holds hylo's layers).
    """

    def __init__(self, preconditioner: HyLoPreconditioner) -> None:
        self.preconditioner = preconditioner_of(preconditioner, "HyLoCallback")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that the preconditioner belongs to the module being trained."""
        check_attached(self.preconditioner, pl_module, "HyLoCallback")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        """Precondition the gradients the optimizer is about to take (before ``gradient_clip_val`` clips them)."""
        self.preconditioner.step()

    def state_dict(self) -> dict[str, Any]:
        """hylo's state, saved in the checkpoint's ``callbacks`` entry."""
        return {"preconditioner": self.preconditioner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` saved (Lightning calls it when ``fit`` resumes from ``ckpt_path``)."""
        self.preconditioner.load_state_dict(state_dict["preconditioner"], where="the checkpoint's HyLoCallback state")
