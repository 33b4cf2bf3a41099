"""The run configuration: :class:`RunConfig`, one training run, checked when it is made."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import hylo
from hylo_scripts.data import DATASETS
from hylo_scripts.models import MODELS
from hylo_scripts.process import BACKENDS
from hylo_scripts.schedules import LR_SCHEDULES
from hylo_scripts.tasks import MODEL_OPTIONS, TASKS

#: The solvers of ``hylo.HyLoPreconditioner``; ``RunConfig.solver`` may also be ``None``/``"none"``.
HYLO_SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")
#: The optimizers a run can use.
OPTIMIZERS = ("sgd", "adamw")
#: hylo's studies (``HyLoConfig.studies``), in the order of the flags that turn them on.
STUDIES = ("grad_norm", "rank", "grad_error")
#: hylo's gradient-error methods (``HyLoConfig.grad_error_methods``).
GRAD_ERROR_METHODS = ("kid", "kis", "kfac", "sngd")
#: The gradient-error methods of a run that names none (``--grad-error`` alone): KID and KIS, as in HyLo.
DEFAULT_GRAD_ERROR_METHODS = ("kid", "kis")


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
        self._check_task_fields()
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

    def _check_task_fields(self) -> None:
        """The fields of one task alone (a language model's): refused elsewhere, filled in and checked by the task."""
        for name, value in TASKS[self.task].fill(self).items():
            object.__setattr__(self, name, value)

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
