"""The training tasks as objects: classification, segmentation and a byte-level language model.

A task owns everything the engine and the flags do differently for it: the training loss, the
evaluation (and how it shards the test set over the ranks), the name of its test metric in
``metrics.csv``, the dtype of the model's input, the :class:`~hylo_scripts.training.runconfig.RunConfig`
fields that are its alone, its data flags and the flags that mean nothing for it. A dataset's
``spec.task`` (:data:`hylo_scripts.data.registry.DATASETS`) is the key of its task in :data:`TASKS`; what the
task's models take and predict (the input shapes that fit, random batches) is the model registry's,
under the same key (:data:`hylo_scripts.models.registry.INPUTS`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader

from hylo_scripts.data.datasets import SliceDataset
from hylo_scripts.data.registry import DATASETS, DataSplits
from hylo_scripts.data.text import DEFAULT_SEQ_LEN
from hylo_scripts.models.registry import MODELS
from hylo_scripts.training.argtypes import byte_cap, positive_int
from hylo_scripts.training.process import rank_and_world
from hylo_scripts.training.segmentation import dice_loss, mean_volume_dsc

#: Images (or slices) per evaluation forward of the image tasks.
EVAL_IMAGES = 500
#: Windows of a language model's evaluation batches (a multiple of them in tokens: 16,384 / seq_len).
EVAL_TOKENS = 16384
#: The size options of a model (RunConfig fields of the same names; see ``ModelSpec.options``).
MODEL_OPTIONS = ("layers", "width", "heads")


class RunFields(Protocol):
    """What a task reads of a run: its model, its label smoothing and, by name, the task's own fields
    (:attr:`Task.fields`); a :class:`~hylo_scripts.training.runconfig.RunConfig` is one."""

    @property
    def model(self) -> str: ...

    @property
    def label_smoothing(self) -> float: ...


def _loader(data: DataSplits, indices: Sequence[int], batch_size: int, workers: int) -> DataLoader[Any]:
    """The test items ``indices`` in batches of ``batch_size``."""
    return DataLoader(data.test, batch_size=batch_size, sampler=list(indices), num_workers=workers)


def _summed(values: Sequence[Tensor], world: int) -> Tensor:
    """``values`` stacked and summed over the ranks."""
    totals = torch.stack(list(values))
    if world > 1:
        dist.all_reduce(totals)
    return totals


class Task:
    """What a task does its own way; subclasses set the class attributes and the loss and evaluation."""

    #: The key of the task (a dataset's ``spec.task``).
    name: ClassVar[str]
    #: What the task's models are, for messages ("language models").
    models: ClassVar[str]
    #: The test metric's column in ``metrics.csv``.
    metric: ClassVar[str]
    #: The dtype of the model's input.
    input_dtype: ClassVar[torch.dtype] = torch.float32
    #: RunConfig fields of this task alone (None in every other task's runs).
    fields: ClassVar[tuple[str, ...]] = ()
    #: Whether ``--label-smoothing`` applies.
    label_smoothing: ClassVar[bool] = False
    #: Why ``--data-dir`` is an error for a dataset of this task that ships with a package.
    no_data_dir: ClassVar[str] = "ships with a package and reads no directory"
    #: hylo options with nothing to act on in this task's models -> why (errors as flags).
    unused_hylo_options: ClassVar[Mapping[str, str]] = {}

    # ------------------------------------------------------------------ training and evaluation
    def loss(self, cfg: RunFields, output: Tensor, target: Tensor) -> Tensor:
        """The training loss of a batch."""
        raise NotImplementedError

    def evaluate(
        self, net: nn.Module, data: DataSplits, device: torch.device, *, workers: int, batch_size: int | None = None
    ) -> tuple[float, float]:
        """Test loss and metric of ``net`` (in eval mode, without gradients) on ``data.test``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ configuration
    def fill(self, cfg: RunFields) -> dict[str, Any]:
        """Check the task's fields of ``cfg``; returns the values of those left None that the task fills in.

        Another task's field set here is a ``ValueError``.
        """
        for task in TASKS.values():
            given = [name for name in task.fields if task is not self and getattr(cfg, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: options of {task.models}, not of the {self.name} task")
        return {}

    # ------------------------------------------------------------------ flags
    def add_data_arguments(self, group: argparse._ArgumentGroup) -> None:
        """The task's data and size flags."""

    def data_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        """The RunConfig fields of :meth:`add_data_arguments`'s flags."""
        return {}

    def misused_flag(self, args: argparse.Namespace, given_hylo: Mapping[str, Any]) -> str | None:
        """The message for a flag that nothing in this task's run would read, or None."""
        for name, why in self.unused_hylo_options.items():
            if name in given_hylo:
                return f"--{name.replace('_', '-')}: {why}"
        return None


class ImageTask(Task):
    """The image tasks' flags: ImageNet's crop and pixel backend, LGG's slice size."""

    def add_data_arguments(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--image-size", type=positive_int, help="ImageNet crop / LGG slice side (default 224 / 256)")
        group.add_argument(
            "--image-backend",
            choices=["pillow", "torchvision"],
            help="ImageNet pixel operations: Pillow (default) or torchvision (optional extra: pip install torchvision)",
        )

    def data_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"image_size": args.image_size, "image_backend": args.image_backend or "pillow"}

    def misused_flag(self, args: argparse.Namespace, given_hylo: Mapping[str, Any]) -> str | None:
        if args.image_backend is not None and args.dataset != "imagenet":
            return f"--image-backend: only for imagenet, not {args.dataset}"
        if args.image_size is not None and args.dataset not in ("imagenet", "lgg"):
            return f"--image-size: only for imagenet and lgg, not {args.dataset}"
        return super().misused_flag(args, given_hylo)


class Classification(ImageTask):
    """Cross-entropy (with label smoothing in training); test loss and accuracy, the test set split over the ranks."""

    name = "classification"
    models = "classifiers"
    metric = "test_acc"
    label_smoothing = True

    def loss(self, cfg: RunFields, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, target, label_smoothing=cfg.label_smoothing)

    @torch.no_grad()
    def evaluate(
        self, net: nn.Module, data: DataSplits, device: torch.device, *, workers: int, batch_size: int | None = None
    ) -> tuple[float, float]:
        """(cross-entropy, accuracy); rank r of P evaluates every P-th item and the sums are all-reduced."""
        rank, world = rank_and_world()
        loader = _loader(data, range(rank, len(data.test), world), batch_size or EVAL_IMAGES, workers)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        hits = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            output = net(x)
            loss_sum += nn.functional.cross_entropy(output, y, reduction="sum").double()
            hits += (output.argmax(dim=1) == y).sum()
        totals = _summed([loss_sum, hits], world)
        n = len(data.test)
        return float(totals[0]) / n, float(totals[1]) / n


class Segmentation(ImageTask):
    """Soft Dice loss; test Dice loss and mean per-volume DSC, every rank on the whole validation set."""

    name = "segmentation"
    models = "segmentation models"
    metric = "test_dsc"

    def loss(self, cfg: RunFields, output: Tensor, target: Tensor) -> Tensor:
        return dice_loss(output, target)

    @torch.no_grad()
    def evaluate(
        self, net: nn.Module, data: DataSplits, device: torch.device, *, workers: int, batch_size: int | None = None
    ) -> tuple[float, float]:
        """(Dice loss, mean volume DSC): whole volumes, so every rank evaluates every slice (no sharding)."""
        if not isinstance(data.test, SliceDataset):
            raise TypeError(f"segmentation needs a dataset of volumes, got {type(data.test).__name__}")
        loader = _loader(data, range(len(data.test)), batch_size or EVAL_IMAGES, workers)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        probs: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            output = net(x)
            loss_sum += dice_loss(output, y).double() * y.shape[0]
            probs.extend(torch.sigmoid(output).squeeze(1).cpu().numpy())
            masks.extend(y.squeeze(1).cpu().numpy())
        return float(loss_sum) / len(masks), mean_volume_dsc(probs, masks, data.test.volumes)


class LanguageModel(Task):
    """Cross-entropy over every token; validation loss in nats per token and bits per byte, split over the ranks."""

    name = "lm"
    models = "language models"
    metric = "test_bpb"
    input_dtype = torch.int64
    fields = ("seq_len", "max_bytes", *MODEL_OPTIONS)
    no_data_dir = "reads no directory (a folder of text files: --dataset text)"
    unused_hylo_options = {
        "conv_rows": "the low-rank rows of Conv2d layers; a language model has none",
        "kfc_exponent": "the K-FAC factors of Conv2d layers; a language model has none",
    }

    def loss(self, cfg: RunFields, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    @torch.no_grad()
    def evaluate(
        self, net: nn.Module, data: DataSplits, device: torch.device, *, workers: int, batch_size: int | None = None
    ) -> tuple[float, float]:
        """(nats per token, bits per byte); rank r of P evaluates every P-th window, batches of 16,384 tokens."""
        rank, world = rank_and_world()
        tokens = data.input_shape[0]
        loader = _loader(data, range(rank, len(data.test), world), batch_size or max(1, EVAL_TOKENS // tokens), workers)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            output = net(x)
            loss_sum += nn.functional.cross_entropy(output.flatten(0, 1), y.flatten(), reduction="sum").double()
        totals = _summed([loss_sum, torch.zeros_like(loss_sum)], world)
        loss = float(totals[0]) / (len(data.test) * tokens)
        return loss, loss / math.log(2)

    def fill(self, cfg: RunFields) -> dict[str, Any]:
        """The sequence length and the model's size default to the model's; each an int >= 1."""
        super().fill(cfg)
        spec = MODELS[cfg.model]
        defaults = {"seq_len": spec.input_shape[0], **spec.options}
        filled: dict[str, Any] = {}
        for name in ("seq_len", *MODEL_OPTIONS):
            if name not in defaults and getattr(cfg, name) is not None:
                raise ValueError(f"{name}: model {cfg.model!r} has no such option")
            if getattr(cfg, name) is None and name in defaults:
                filled[name] = defaults[name]
        values = {name: filled.get(name, getattr(cfg, name)) for name in self.fields}
        for name, value in values.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        width, heads = values["width"], values["heads"]
        if width is not None and heads is not None and width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        return filled

    def add_data_arguments(self, group: argparse._ArgumentGroup) -> None:
        """A language model's data and size flags (defaults None: the model's, filled in by RunConfig)."""
        spec = MODELS["transformer"]
        group.add_argument(
            "--seq-len",
            type=positive_int,
            help=f"tokens (bytes) per training window and the model's context (default {DEFAULT_SEQ_LEN})",
        )
        group.add_argument(
            "--max-bytes",
            type=byte_cap,
            help="read at most this many training bytes (validation: a tenth; 0: the whole corpus; "
            "default %(default)s); an epoch is one pass over their non-overlapping windows",
        )
        group.add_argument("--layers", type=positive_int, help=f"transformer blocks (default {spec.options['layers']})")
        group.add_argument("--width", type=positive_int, help=f"model width (default {spec.options['width']})")
        group.add_argument(
            "--heads", type=positive_int, help=f"attention heads, dividing --width (default {spec.options['heads']})"
        )

    def data_fields(self, args: argparse.Namespace) -> dict[str, Any]:
        return {name: getattr(args, name) for name in self.fields}


#: The tasks by name (a dataset's ``spec.task``).
TASKS: dict[str, Task] = {task.name: task for task in (Classification(), Segmentation(), LanguageModel())}


def task_of(dataset: str) -> Task:
    """The task of a dataset of the registry."""
    return TASKS[DATASETS[dataset].task]
