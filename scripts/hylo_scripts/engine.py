"""The scripts' one training engine: run configuration, the loop (one process or DDP), evaluation, checkpoints.

Every run — plain optimizer or optimizer + hylo, classification, segmentation or a byte-level
language model (task ``"lm"``), one process or P ranks — goes through :func:`train`: the model
of the registry built from the seed's initial weights, the dataset of the registry, a
``DistributedSampler`` over the training set (also on one process, so the batch order depends
on the seed alone), the optimizer, the
learning-rate and damping schedules of :mod:`hylo_scripts.schedules`, and, with a solver, hylo's
``step()`` between ``loss.backward()`` and ``optimizer.step()``.

Seeds: ``seed`` draws the initial weights (and hylo's KIS rows); ``seed + 1`` the batch order
of every epoch (``DistributedSampler(seed=seed + 1).set_epoch(epoch)``); ``data_seed`` the
train/test split of the sets that have none and every sample's augmentation (a function of
data seed, epoch and index). ``batch_size`` is the global batch: each of the P ranks takes
B/P samples of every batch, and the union is the same B samples one process would take, so P
ranks see the same data in the same order as one process.

Outputs of a run with ``log_dir`` (rank 0 unless said otherwise):

- ``config.json``: the :class:`RunConfig`;
- ``model-summary.txt``: torchinfo's summary of the model;
- ``dataset.json``: what the dataset reports about itself (``DataSplits.info``; the text
  corpora: Python version, files, bytes and windows of each split), if it reports anything;
- ``metrics.csv``: one row per epoch (:data:`METRIC_COLUMNS`), appended as epochs finish;
- ``checkpoint-{N:04d}.pt`` (+ ``checkpoint-{N:04d}-hylo-r{rank}.pt`` on every rank) every
  ``checkpoint_freq`` epochs and after the last one (see :mod:`hylo_scripts.checkpoint`);
- with ``profiling`` or ``studies``, hylo's profile files (its ``profile_dir`` is ``log_dir``).

A ``log_dir`` that holds another run (a ``config.json``, ``metrics.csv`` or checkpoint) is
refused unless ``resume``: then the run continues from its latest checkpoint up to
``epochs`` — model, optimizer, lr scheduler, hylo's state (its step, so its damping
schedule, and its generator), the sampler epoch and the RNG — and appends to ``metrics.csv``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

import hylo
from hylo_scripts import checkpoint
from hylo_scripts.data import DATASETS, DataOptions, DataSplits, load_dataset
from hylo_scripts.datasets import SliceDataset
from hylo_scripts.models import MODELS, build_model
from hylo_scripts.schedules import LR_SCHEDULES, damping_schedule, lr_factor
from hylo_scripts.segmentation import dice_loss, mean_volume_dsc

#: The solvers of ``hylo.HyLoPreconditioner``; ``RunConfig.solver`` may also be ``None``/``"none"``.
HYLO_SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")
#: The optimizers a run can use.
OPTIMIZERS = ("sgd", "adamw")
#: torch.distributed backends (``auto``: NCCL on GPU, gloo on CPU).
BACKENDS = ("auto", "gloo", "nccl")
#: hylo's studies (``HyLoConfig.studies``), in the order of the flags that turn them on.
STUDIES = ("grad_norm", "rank", "grad_error")
#: hylo's gradient-error methods (``HyLoConfig.grad_error_methods``).
GRAD_ERROR_METHODS = ("kid", "kis", "kfac", "sngd")
#: The gradient-error methods of a run that names none (``--grad-error`` alone): KID and KIS, as in HyLo.
DEFAULT_GRAD_ERROR_METHODS = ("kid", "kis")
#: Columns of ``metrics.csv``; ``test_metric`` is written as ``test_acc`` (classification), ``test_dsc``
#: (segmentation) or ``test_bpb`` (language models: bits per byte; ``test_loss`` is then in nats per token).
METRIC_COLUMNS = (
    "epoch",
    "step",
    "lr",
    "train_loss",
    "test_loss",
    "test_metric",
    "epoch_time_s",
    "total_time_s",
    "precondition_time_s",
)
#: The name of the test metric in ``metrics.csv``, per task.
METRIC_NAMES = {"classification": "test_acc", "segmentation": "test_dsc", "lm": "test_bpb"}
#: The size options of a model (RunConfig fields of the same names; see ``ModelSpec.options``).
MODEL_OPTIONS = ("layers", "width", "heads")
#: Windows of a language model's evaluation batches (a multiple of them in tokens: 16,384 / seq_len).
EVAL_TOKENS = 16384


@dataclass(frozen=True)
class RunConfig:
    """One training run (the scripts' flags, one field each); ``solver=None`` trains with the plain optimizer.

    Data and model: ``dataset`` and ``model`` name entries of :data:`hylo_scripts.data.DATASETS`
    and :data:`hylo_scripts.models.MODELS`; ``data_dir`` is where datasets that are not shipped
    live; ``image_size`` the ImageNet crop / LGG slice side (None: 224 / 256); ``image_backend``
    decodes ImageNet with Pillow or (optional extra) torchvision. Language models only (None
    elsewhere): ``seq_len`` is the window and context length in tokens, ``layers``, ``width``
    and ``heads`` the transformer's size (None: the model's defaults, filled in), and
    ``max_bytes`` caps the training bytes read (validation: a tenth; None: no cap).

    Optimization: ``max_steps`` stops every epoch after that many steps (smoke runs; the
    schedules count the shortened epochs). The lr warms up linearly over ``warmup_epochs``,
    then follows ``lr_schedule``: ``"step"`` (× ``lr_decay`` at each epoch of ``milestones``)
    or ``"cosine"`` (to 0 at the end of ``epochs``). ``label_smoothing`` applies to the
    training loss of classification runs.

    hylo: with ``target_damping``, ``damping`` decays log-linearly to it over
    ``damping_decay_epochs`` after the warm-up (None: the rest of the run); without, it is constant; ``kl_clip=0`` is stored as ``None`` (disabled);
    ``update_freq`` … ``factor_update_freq`` are hylo's options of the same names.

    Outputs: see the module docstring. ``profiling`` has hylo time every step into
    ``log_dir``; ``studies`` (any of :data:`STUDIES`) adds hylo's studies there and implies
    ``profiling``; ``study_every``, ``grad_error_methods`` and ``grad_error_ratios`` are hylo's
    ``rank_every``/``grad_error_every``, ``grad_error_methods`` and ``grad_error_ratios``.
    ``checkpoint_freq`` (0: never) needs ``log_dir``.
    """

    dataset: str = "mnist5k"
    model: str = "cnn"
    data_dir: str | None = None
    image_size: int | None = None
    image_backend: str = "pillow"
    seq_len: int | None = None
    layers: int | None = None
    width: int | None = None
    heads: int | None = None
    max_bytes: int | None = None
    workers: int = 0
    optimizer: str = "sgd"
    solver: str | None = None
    epochs: int = 15
    max_steps: int | None = None
    batch_size: int = 500
    lr: float = 0.1
    lr_schedule: str = "step"
    lr_decay: float = 0.1
    milestones: tuple[int, ...] = ()
    warmup_epochs: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    damping: float = 0.3
    target_damping: float | None = None
    damping_decay_epochs: float | None = None
    update_freq: int = 10
    factor_decay: float = 0.95
    kl_clip: float | None = 1e-3
    rank_ratio: float = 0.1
    strategy: str = "inverse"
    adaptive: tuple[int, int, int] | None = None
    trend_window: int = 100
    conv_rows: str = "sum"
    kfc_exponent: float = hylo.KFACConfig.kfc_exponent
    damping_convention: str = "hylo"
    kis_estimator: str = "unbiased"
    factor_update_freq: int | None = None
    seed: int = 0
    data_seed: int = 0
    backend: str = "auto"
    log_dir: str | None = None
    checkpoint_freq: int = 0
    profiling: bool = False
    studies: tuple[str, ...] = ()
    study_every: int = 1
    grad_error_methods: tuple[str, ...] = DEFAULT_GRAD_ERROR_METHODS
    grad_error_ratios: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.solver == "none":
            object.__setattr__(self, "solver", None)
        if not self.kl_clip:
            object.__setattr__(self, "kl_clip", None)
        for name in ("milestones", "adaptive", "studies", "grad_error_methods", "grad_error_ratios"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"{name} must be a sequence, not a single string")
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        for name in ("log_dir", "data_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        self._check_choices()
        self._check_sequence_options()
        self._check_numbers()
        self._check_outputs()

    def _check_choices(self) -> None:
        """Names: solver, optimizer, backend, schedule, dataset and a model of the dataset's task."""
        if self.solver is not None and self.solver not in HYLO_SOLVERS:
            raise ValueError(f"solver must be None, 'none' or one of {HYLO_SOLVERS}, got {self.solver!r}")
        for name, allowed in (("optimizer", OPTIMIZERS), ("backend", BACKENDS), ("lr_schedule", LR_SCHEDULES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r} (expected one of {sorted(DATASETS)})")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r} (expected one of {sorted(MODELS)})")
        task = DATASETS[self.dataset].task
        if MODELS[self.model].task != task:
            usable = sorted(name for name, spec in MODELS.items() if spec.task == task)
            raise ValueError(
                f"model {self.model!r} does not fit the {task} dataset {self.dataset!r} (usable: {usable})"
            )
        if DATASETS[self.dataset].needs_data_dir and self.data_dir is None:
            raise ValueError(f"dataset {self.dataset!r} needs data_dir: {DATASETS[self.dataset].layout}")

    def _check_sequence_options(self) -> None:
        """The language-model fields: refused for other tasks, filled in with the model's defaults, >= 1."""
        lm_fields = ("seq_len", "max_bytes", *MODEL_OPTIONS)
        if self.task != "lm":
            given = [name for name in lm_fields if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: options of language models, not of the {self.task} task")
            return
        spec = MODELS[self.model]
        defaults = {"seq_len": spec.input_shape[0], **spec.options}
        for name in ("seq_len", *MODEL_OPTIONS):
            if name not in defaults and getattr(self, name) is not None:
                raise ValueError(f"{name}: model {self.model!r} has no such option")
            if getattr(self, name) is None and name in defaults:
                object.__setattr__(self, name, defaults[name])
        for name in lm_fields:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.width is not None and self.heads is not None and self.width % self.heads:
            raise ValueError(f"width {self.width} must be divisible by heads {self.heads}")

    def model_options(self) -> dict[str, int]:
        """The size options of the run's model (``layers``, ``width``, ``heads`` of a transformer), as set."""
        return {name: getattr(self, name) for name in MODEL_OPTIONS if getattr(self, name) is not None}

    def _check_numbers(self) -> None:
        """Counts >= 1, rates in range, the schedule's options where they apply."""
        if self.epochs < 1 or self.batch_size < 1 or (self.max_steps is not None and self.max_steps < 1):
            raise ValueError("epochs, batch_size and max_steps must be at least 1")
        if self.workers < 0 or self.checkpoint_freq < 0 or self.warmup_epochs < 0:
            raise ValueError("workers, checkpoint_freq and warmup_epochs must be >= 0")
        if not self.lr > 0 or not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"need lr > 0 and 0 <= label_smoothing < 1, got {self.lr} and {self.label_smoothing}")
        if self.lr_schedule == "cosine" and self.milestones:
            raise ValueError("milestones apply to the 'step' lr schedule, not 'cosine'")
        if any(m < 1 for m in self.milestones) or not self.lr_decay > 0:
            raise ValueError(f"milestones must be epochs >= 1 and lr_decay > 0, got {self.milestones}, {self.lr_decay}")
        if self.damping_decay_epochs is not None and self.target_damping is None:
            raise ValueError("damping_decay_epochs needs a target_damping to decay to")
        if self.target_damping is not None and not self.target_damping > 0:
            raise ValueError(f"target_damping must be > 0, got {self.target_damping}")
        if self.damping_decay_epochs is not None and not self.damping_decay_epochs > 0:
            raise ValueError(f"damping_decay_epochs must be > 0, got {self.damping_decay_epochs}")

    def _check_outputs(self) -> None:
        """Profiling, studies and checkpoints (``studies`` imply ``profiling``; all need ``log_dir``)."""
        unknown = [s for s in self.studies if s not in STUDIES]
        if unknown:
            raise ValueError(f"studies must be drawn from {STUDIES}, got {unknown}")
        if self.studies:
            object.__setattr__(self, "profiling", True)
        if self.profiling and self.log_dir is None:
            raise ValueError("profiling and studies write their files into log_dir: set log_dir")
        if self.profiling and self.solver is None:
            raise ValueError("profiling and studies measure hylo: they need a solver, not the plain optimizer")
        if self.checkpoint_freq and self.log_dir is None:
            raise ValueError("checkpoints are written into log_dir: set log_dir")
        bad = [m for m in self.grad_error_methods if m not in GRAD_ERROR_METHODS]
        if bad or not self.grad_error_methods:
            raise ValueError(f"grad_error_methods must be a non-empty selection of {GRAD_ERROR_METHODS}, got {bad}")
        if isinstance(self.study_every, bool) or not (isinstance(self.study_every, int) and self.study_every >= 1):
            raise ValueError(f"study_every must be an int >= 1, got {self.study_every!r}")
        if self.grad_error_ratios is not None:
            ratios = self.grad_error_ratios
            if not ratios or not all(0.0 < r <= 1.0 for r in ratios):
                raise ValueError(f"grad_error_ratios must be ratios in (0, 1], got {ratios!r}")

    @property
    def name(self) -> str:
        """``"<optimizer>"`` or ``"hylo-<solver>"``."""
        return self.optimizer if self.solver is None else f"hylo-{self.solver}"

    @property
    def task(self) -> str:
        """``"classification"``, ``"segmentation"`` or ``"lm"`` (the dataset's)."""
        return DATASETS[self.dataset].task

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (tuples as lists); ``RunConfig(**cfg.to_json())`` gives ``cfg`` back."""
        return json.loads(json.dumps(asdict(self)))


@dataclass(frozen=True)
class EpochLog:
    """One row of ``metrics.csv``: epochs and steps so far, the lr, losses, the test metric, times in seconds."""

    epoch: int
    step: int
    lr: float
    train_loss: float
    test_loss: float
    test_metric: float
    epoch_time_s: float
    total_time_s: float
    precondition_time_s: float


@dataclass
class RunResult:
    """Outcome of one :func:`train` call: its config, the epochs it ran and its wall time."""

    config: RunConfig
    log: list[EpochLog] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        """The config's name (``"sgd"``, ``"hylo-kfac"``, …)."""
        return self.config.name

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self.log[-1].step

    @property
    def test_accuracy(self) -> float:
        """The test metric after the last epoch (accuracy, mean per-volume DSC or bits per byte)."""
        return self.log[-1].test_metric

    @property
    def test_loss(self) -> float:
        """The test loss after the last epoch."""
        return self.log[-1].test_loss

    @property
    def train_loss(self) -> float:
        """Mean training loss over the last epoch's batches."""
        return self.log[-1].train_loss


# --------------------------------------------------------------------------- process group, files
@contextmanager
def distributed(backend: str = "auto") -> Iterator[torch.device]:
    """Join torchrun's process group if launched by torchrun; yield this process's device.

    Without torchrun (no ``RANK`` in the environment) nothing is joined and the device is the
    GPU if there is one, else the CPU. ``backend="auto"`` is NCCL on GPU and gloo on CPU; the
    process group is destroyed on exit.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        yield torch.device("cuda" if cuda else "cpu")
        return
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if backend == "nccl" and not cuda:
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' (or 'auto') on CPU")
    dist.init_process_group(("nccl" if cuda else "gloo") if backend == "auto" else backend)
    try:
        yield device
        # every rank finishes before any tears the group down: gloo can abort a rank ("terminate
        # called without an active exception") whose peer destroys the group under it
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size P (0 and 1 unless torch.distributed is initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write ``rows`` (header from the first row's keys) as a CSV file, creating parent folders."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def metrics_header(task: str) -> list[str]:
    """The header of ``metrics.csv`` for a task."""
    return [METRIC_NAMES[task] if column == "test_metric" else column for column in METRIC_COLUMNS]


def _append_metrics(path: Path, task: str, entry: EpochLog) -> None:
    """Append one epoch to ``metrics.csv`` (header first if the file is new), flushed to disk."""
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as handle:
        writer = csv.writer(handle)
        if new:
            writer.writerow(metrics_header(task))
        writer.writerow([repr(value) if isinstance(value, float) else value for value in asdict(entry).values()])
        handle.flush()
        os.fsync(handle.fileno())


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write a JSON file atomically (temporary file + ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- building blocks
def make_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The run's optimizer: momentum SGD or AdamW, with weight decay (its lr is set by the schedule)."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: RunConfig, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step ``LambdaLR`` of :func:`hylo_scripts.schedules.lr_factor` (stepped after every ``optimizer.step()``)."""
    factor = lr_factor(
        cfg.lr_schedule,
        total_steps=steps_per_epoch * cfg.epochs,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        milestones=[m * steps_per_epoch for m in cfg.milestones],
        decay=cfg.lr_decay,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, state: Mapping[str, Any]) -> None:
    """Load a checkpoint's scheduler state and set each group's lr from this run's schedule at the saved step.

    The checkpoint's optimizer holds the lr of the schedule it was made with; a resumed run with
    more ``epochs`` has another cosine, so its lr is recomputed (the same value, bit for bit,
    when the schedule is unchanged: ``LambdaLR`` computes it the same way).
    """
    scheduler.load_state_dict(dict(state))
    for group, base, factor in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)


def make_preconditioner(
    model: nn.Module,
    cfg: RunConfig,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    *,
    profile_append: bool = False,
) -> hylo.HyLoPreconditioner | None:
    """hylo with the run's options (``None`` for plain runs); ``kl_clip`` reads the optimizer's scheduled lr."""
    if cfg.solver is None:
        return None
    damping: float | Any = cfg.damping
    if cfg.target_damping is not None:
        warmup = round(cfg.warmup_epochs * steps_per_epoch)
        decay_epochs = cfg.damping_decay_epochs
        decay_steps = round(decay_epochs * steps_per_epoch) if decay_epochs else cfg.epochs * steps_per_epoch - warmup
        damping = damping_schedule(
            cfg.damping, cfg.target_damping, warmup_steps=warmup, decay_steps=max(1, decay_steps)
        )
    return hylo.HyLoPreconditioner(
        model,
        solver=cfg.solver,
        update_freq=cfg.update_freq,
        damping=damping,
        factor_decay=cfg.factor_decay,
        kl_clip=cfg.kl_clip,
        lr=(lambda _step: optimizer.param_groups[0]["lr"]) if cfg.kl_clip is not None else None,
        rank_ratio=cfg.rank_ratio,
        strategy=cfg.strategy,
        adaptive=cfg.adaptive,
        iters_per_epoch=steps_per_epoch if cfg.adaptive is not None else None,
        trend_window=cfg.trend_window,
        conv_rows=cfg.conv_rows,
        kfc_exponent=cfg.kfc_exponent,
        damping_convention=cfg.damping_convention,
        kis_estimator=cfg.kis_estimator,
        factor_update_freq=cfg.factor_update_freq,
        seed=cfg.seed,
        profile_dir=cfg.log_dir if cfg.profiling else None,
        profile_append=profile_append,
        studies=cfg.studies,
        rank_every=cfg.study_every,
        grad_error_every=cfg.study_every,
        grad_error_methods=cfg.grad_error_methods,
        grad_error_ratios=cfg.grad_error_ratios,
    )


def model_summary(
    net: nn.Module, input_shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
) -> str:
    """torchinfo's summary of ``net`` on a batch of two ``input_shape`` inputs of ``dtype`` (int64: tokens);
    the global RNG is left as it was."""
    import torchinfo

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        stats = torchinfo.summary(
            net, input_size=(2, *input_shape), dtypes=[dtype], device=device, verbose=0, mode="eval"
        )
    return str(stats)


def _loss(cfg: RunConfig, output: Tensor, target: Tensor, *, train: bool) -> Tensor:
    """Training (``train``) or test loss: cross-entropy (label smoothing only in training; a language
    model's is the mean over every token) or soft Dice."""
    if cfg.task == "segmentation":
        return dice_loss(output, target)
    if cfg.task == "lm":
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
    return nn.functional.cross_entropy(output, target, label_smoothing=cfg.label_smoothing if train else 0.0)


@torch.no_grad()
def evaluate(
    net: nn.Module, cfg: RunConfig, data: DataSplits, device: torch.device, *, batch_size: int | None = None
) -> tuple[float, float]:
    """Test loss and metric of ``net`` in eval mode: (cross-entropy, accuracy), (Dice loss, mean volume
    DSC) or, for a language model, (cross-entropy in nats per token, bits per byte).

    Classification and language models shard the test set over the ranks (every P-th item) and
    sum over them; segmentation evaluates whole volumes, so every rank evaluates the whole
    validation set (the per-volume DSC keeps each volume's largest 3-D connected component).
    ``batch_size`` (items per forward) defaults to 500 images or 16,384 tokens of windows.
    """
    rank, world = rank_and_world()
    net.eval()
    segmentation = cfg.task == "segmentation"
    lm = cfg.task == "lm"
    if batch_size is None:
        batch_size = max(1, EVAL_TOKENS // data.input_shape[0]) if lm else 500
    indices = range(len(data.test)) if segmentation else range(rank, len(data.test), world)
    loader = DataLoader(data.test, batch_size=batch_size, sampler=list(indices), num_workers=cfg.workers)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    hits = torch.zeros((), dtype=torch.float64, device=device)
    probs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        output = net(x)
        if segmentation:
            loss_sum += dice_loss(output, y).double() * y.shape[0]
            probs.extend(torch.sigmoid(output).squeeze(1).cpu().numpy())
            masks.extend(y.squeeze(1).cpu().numpy())
        elif lm:
            loss_sum += nn.functional.cross_entropy(output.flatten(0, 1), y.flatten(), reduction="sum").double()
        else:
            loss_sum += nn.functional.cross_entropy(output, y, reduction="sum").double()
            hits += (output.argmax(dim=1) == y).sum()
    net.train()
    if segmentation:
        if not isinstance(data.test, SliceDataset):
            raise TypeError(f"segmentation needs a dataset of volumes, got {type(data.test).__name__}")
        volumes = data.test.volumes
        return float(loss_sum) / len(masks), mean_volume_dsc(probs, masks, volumes)
    totals = torch.stack([loss_sum, hits])
    if world > 1:
        dist.all_reduce(totals)
    if lm:
        loss = float(totals[0]) / (len(data.test) * data.input_shape[0])
        return loss, loss / math.log(2)
    n = len(data.test)
    return float(totals[0]) / n, float(totals[1]) / n


class _Clock:
    """Time spent in a repeated section: ``perf_counter`` on CPU, CUDA events (read once per epoch) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: float | torch.cuda.Event = 0.0

    def start(self) -> None:
        """Mark the start of the section."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._start = event
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        """Mark its end (no host synchronisation on GPU)."""
        if isinstance(self._start, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self.seconds += time.perf_counter() - self._start

    def total(self) -> float:
        """Seconds so far (synchronises once on GPU)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        return self.seconds


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (off when ``enabled`` is false or stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=None if enabled else True, leave=False, dynamic_ncols=True)


# --------------------------------------------------------------------------- the loop
def train(
    cfg: RunConfig,
    data: DataSplits | None = None,
    *,
    device: torch.device | None = None,
    resume: bool = False,
    verbose: bool = False,
) -> RunResult:
    """Train ``cfg`` (on ``data``, default: its dataset), evaluating after every epoch; see the module docstring.

    Runs on one process, or under DDP on every rank of an initialised process group. Rank 0
    alone prints (with ``verbose``: the model and hylo summaries, a progress bar on a
    terminal, one line per epoch) and writes the run's files. ``resume`` continues the run in
    ``cfg.log_dir`` from its latest checkpoint (a ``ValueError`` names what does not fit).
    """
    rank, world = rank_and_world()
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} must be divisible by the number of ranks {world}")
    device = device or torch.device("cpu")
    start = checkpoint.open_run_dir(
        cfg.log_dir, cfg.to_json(), resume=resume, world=world, device=device, defaults=RunConfig().to_json()
    )
    if world > 1:
        dist.barrier()  # every rank has looked at log_dir before rank 0 writes into it
    if data is None:
        options = DataOptions(
            data_dir=cfg.data_dir,
            seed=cfg.data_seed,
            image_size=cfg.image_size,
            image_backend=cfg.image_backend,
            seq_len=cfg.seq_len,
            max_bytes=cfg.max_bytes,
        )
        data = load_dataset(cfg.dataset, options)
    reason = MODELS[cfg.model].fits(data.input_shape)
    if reason is not None:
        raise ValueError(f"model {cfg.model!r} does not take {cfg.dataset!r} inputs {data.input_shape}: {reason}")

    local = cfg.batch_size // world
    sampler: DistributedSampler[Any] = DistributedSampler(
        data.train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed + 1, drop_last=True
    )
    loader = DataLoader(
        data.train,
        batch_size=local,
        sampler=sampler,
        drop_last=True,
        num_workers=cfg.workers,
        pin_memory=device.type == "cuda",
    )
    steps_per_epoch = min(len(loader), cfg.max_steps or len(loader))
    if steps_per_epoch < 1:
        raise ValueError(f"batch size {cfg.batch_size} exceeds the {len(data.train)} training samples")

    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options()).to(device)
    log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else None
    # Before hylo's hooks exist: torchinfo's forward must not be captured as curvature.
    dtype = torch.int64 if cfg.task == "lm" else torch.float32
    summary = model_summary(net, data.input_shape, device, dtype) if rank == 0 and (verbose or log_dir) else None
    if start.state is not None:
        net.load_state_dict(start.state["model"])
    model: nn.Module = net
    if world > 1:
        model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg, steps_per_epoch)
    pre = make_preconditioner(model, cfg, optimizer, steps_per_epoch, profile_append=start.state is not None)
    metrics_path = log_dir / "metrics.csv" if log_dir is not None else None
    if start.state is not None:
        assert log_dir is not None and metrics_path is not None
        optimizer.load_state_dict(start.state["optimizer"])
        resume_schedule(scheduler, start.state["scheduler"])
        torch.set_rng_state(start.state["rng"].cpu())
        if pre is not None:
            hylo_path = checkpoint.hylo_state_path(log_dir, start.epoch, rank)
            pre.load_state_dict(checkpoint.load(hylo_path, map_location=device))
        if rank == 0:
            checkpoint.truncate_metrics(metrics_path, start.state["metrics_bytes"])
    if log_dir is not None and rank == 0:  # hylo has accepted log_dir: the run's files go in
        _write_json(log_dir / "config.json", cfg.to_json())
        (log_dir / "model-summary.txt").write_text(f"{summary}\n")
        if data.info:
            _write_json(log_dir / "dataset.json", data.info)
    if verbose and rank == 0:
        print(summary, flush=True)
        if data.info:
            print(f"dataset: {json.dumps(data.info)}", flush=True)
    if pre is not None and verbose and rank == 0:
        print(pre.summary(), flush=True)

    result = RunResult(cfg)
    step, total_time = start.step, start.total_time_s
    began = time.perf_counter()
    try:
        for epoch in range(start.epoch, cfg.epochs):
            epoch_began = time.perf_counter()
            sampler.set_epoch(epoch)
            data.train.set_epoch(epoch)
            clock = _Clock(device)
            running = torch.zeros((), dtype=torch.float64, device=device)
            lr = optimizer.param_groups[0]["lr"]
            bar = _progress(steps_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}", verbose and rank == 0)
            batches = iter(loader)
            for _ in range(steps_per_epoch):
                x, y = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                lr = optimizer.param_groups[0]["lr"]
                optimizer.zero_grad(set_to_none=True)
                loss = _loss(cfg, model(x), y, train=True)
                loss.backward()
                if pre is not None:
                    clock.start()
                    pre.step()
                    clock.stop()
                optimizer.step()
                scheduler.step()
                running += loss.detach().double()
                step += 1
                bar.update(1)
                if not bar.disable and bar.n % 10 == 0:  # a host sync every 10 steps, on a terminal only
                    rate = (bar.format_dict.get("rate") or 0.0) * cfg.batch_size
                    bar.set_postfix(loss=f"{float(loss):.4f}", samples_s=f"{rate:.0f}")
            bar.close()
            del batches
            if world > 1:
                dist.all_reduce(running)
            train_loss = float(running) / (steps_per_epoch * world)
            epoch_time = time.perf_counter() - epoch_began
            total_time += epoch_time
            test_loss, test_metric = evaluate(net, cfg, data, device)
            entry = EpochLog(
                epoch + 1, step, lr, train_loss, test_loss, test_metric, epoch_time, total_time, clock.total()
            )
            result.log.append(entry)
            if rank == 0:
                if verbose:
                    print(
                        f"epoch {entry.epoch} step {step} lr {lr:.4g} loss {train_loss:.4f} test_loss {test_loss:.4f} "
                        f"{METRIC_NAMES[cfg.task]} {test_metric:.4f} time {epoch_time:.1f}s ranks {world}",
                        flush=True,
                    )
                if metrics_path is not None:
                    _append_metrics(metrics_path, cfg.task, entry)
            last = epoch + 1 == cfg.epochs
            if cfg.checkpoint_freq and ((epoch + 1) % cfg.checkpoint_freq == 0 or last):
                assert log_dir is not None and metrics_path is not None
                checkpoint.save_checkpoint(
                    log_dir,
                    cfg.to_json(),
                    epoch=epoch + 1,
                    step=step,
                    rank=rank,
                    world=world,
                    total_time_s=total_time,
                    net=net,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    pre=pre,
                    metrics_path=metrics_path,
                )
    finally:
        if pre is not None:
            pre.remove()
    result.seconds = time.perf_counter() - began
    return result
