"""Hugging Face ``Trainer`` integration: :class:`HyLoCallback` (docs/training-stacks.md, "Trainer").

The callback runs ``pre.step()`` in ``on_pre_optimizer_step`` — once per optimizer step, after the last
micro-batch's backward and the Trainer's gradient clipping, before ``optimizer.step()`` — writes hylo's state into
each checkpoint folder the Trainer saves, and loads it back when ``trainer.train(resume_from_checkpoint=...)``
resumes. Importing this module imports ``transformers``; ``import hylo`` does not.

No callback event names the checkpoint a run resumes from: ``Trainer.train`` hands the path to its own loaders
only. ``on_train_begin`` sees the ``TrainerState`` read from it, whose ``global_step`` is the checkpoint's step,
so the callback looks where the Trainer writes that step's checkpoint (docs/training-stacks.md, "Resuming a
Trainer run") and checks that the state it finds was saved with the very weights the Trainer just loaded.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hylo import integrity
from hylo.integrations.checks import check_attached, preconditioner_of
from hylo.preconditioner import HyLoPreconditioner

#: hylo's file in a checkpoint folder (one process); with several, each writes ``hylo_state_<process_index>.pt``.
STATE_FILE = "hylo_state.pt"
#: Values of each parameter the weights' mark reads (evenly spaced).
MARK_SAMPLES = 16


def state_file(args: TrainingArguments) -> str:
    """This process's hylo file name in a checkpoint folder, named as the Trainer names its RNG files."""
    return STATE_FILE if args.world_size <= 1 else f"hylo_state_{args.process_index}.pt"


def checkpoint_folder(args: TrainingArguments, step: int) -> str:
    """Where the Trainer writes the checkpoint of ``step``: ``<output_dir>/checkpoint-<step>``."""
    return os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{step}")


def weights_mark(model: nn.Module) -> str:
    """A digest of up to :data:`MARK_SAMPLES` evenly spaced values of every parameter (this process's shard of a
    sharded one): tells the weights a checkpoint holds from any other run's at the cost of a few reads."""
    sample = {}
    for name, parameter in model.named_parameters():
        data = parameter.detach()
        to_local = getattr(data, "to_local", None)  # a DTensor's shard
        flat = (to_local() if callable(to_local) else data).reshape(-1)
        count = min(MARK_SAMPLES, flat.numel())
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        sample[name] = flat[index]
    return integrity.checksum(sample)


class HyLoCallback(TrainerCallback):
    """Runs a :class:`HyLoPreconditioner` inside ``transformers.Trainer`` and keeps its state with the Trainer's
    checkpoints (docs/training-stacks.md, "Trainer").

    Args:
        preconditioner: built on the model given to the ``Trainer``, before the ``Trainer``.
        resume_from: the checkpoint folder a resumed run continues from, when it is not
            ``<output_dir>/checkpoint-<step>`` or ``args.resume_from_checkpoint`` (a checkpoint copied elsewhere);
            also settable as an attribute before ``train()``.

    Resuming loads hylo's state from the first of ``resume_from`` (if given, only it), ``args.resume_from_checkpoint``
    and ``<output_dir>/checkpoint-<global_step>`` holding a state saved at the resumed step with the weights the
    Trainer loaded; if none does, ``train()`` raises ``ValueError`` naming each place and why, before any step.
    Hyperparameter search (``model_init``) is refused: the preconditioner is attached to one model.
    """

    def __init__(
        self, preconditioner: HyLoPreconditioner, *, resume_from: str | os.PathLike[str] | None = None
    ) -> None:
        self.preconditioner = preconditioner_of(preconditioner, "HyLoCallback")
        self.resume_from = resume_from

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Check the preconditioner belongs to the model being trained; on a resumed run, load hylo's state."""
        if state.is_hyper_param_search:
            raise ValueError(
                "HyLoCallback: hyperparameter search rebuilds the model; the preconditioner is built on one"
            )
        model = kwargs.get("model")
        check_attached(self.preconditioner, model, "HyLoCallback")
        if state.global_step > 0:
            self._resume(args, state, model)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Precondition the gradients the optimizer is about to take (after clipping, if ``max_grad_norm``)."""
        self.preconditioner.step()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Write hylo's state, the step and the weights' mark into the checkpoint folder the Trainer just saved."""
        folder = checkpoint_folder(args, state.global_step)
        os.makedirs(folder, exist_ok=True)  # as the Trainer's own per-process files are written
        model = kwargs.get("model")
        contents = {
            "preconditioner": self.preconditioner.state_dict(),
            "global_step": state.global_step,
            "weights": weights_mark(model) if model is not None else None,
        }
        integrity.save_atomic(contents, os.path.join(folder, state_file(args)))

    def _resume(self, args: TrainingArguments, state: TrainerState, model: nn.Module | None) -> None:
        """Load the state saved with the checkpoint this run resumed from, or ``ValueError`` saying where it looked."""
        if self.resume_from is not None:
            folders = [os.fspath(self.resume_from)]
        else:
            named = args.resume_from_checkpoint
            folders = [named] if isinstance(named, str) else []
            folders.append(checkpoint_folder(args, state.global_step))
        mark, problems = (weights_mark(model) if model is not None else None), []
        for folder in dict.fromkeys(folders):
            path = os.path.join(folder, state_file(args))
            if not os.path.isfile(path):
                problems.append(f"{path}: no such file")
                continue
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 - a damaged file fails to unpickle in many ways
                raise ValueError(f"{path} is not a readable hylo state ({type(err).__name__}: {err})") from err
            if not isinstance(saved, dict) or saved.get("global_step") != state.global_step:
                step = saved.get("global_step") if isinstance(saved, dict) else None
                problems.append(f"{path}: saved at step {step}, not at the resumed step {state.global_step}")
            elif saved.get("weights") != mark:
                problems.append(f"{path}: saved with other weights than those the Trainer resumed with")
            else:
                self.preconditioner.load_state_dict(saved["preconditioner"], where=path)
                return
        raise ValueError(
            f"HyLoCallback: the run resumes at step {state.global_step} but no hylo state fits it ("
            + "; ".join(problems)
            + "): pass the checkpoint folder it resumes from as HyLoCallback(pre, resume_from=...)"
        )
