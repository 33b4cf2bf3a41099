"""The run configuration: :class:`RunConfig`, one training run, checked when it is made, :func:`run_defaults`, and
:func:`preconditioner_options`, the run's keyword arguments of ``hylo.HyLoPreconditioner`` (its hylo options with
the engine's)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import hylo
from hylo_scripts.data.registry import DATASETS
from hylo_scripts.models.registry import MODELS
from hylo_scripts.training.hylo_options import RUN_OPTION, default_options, run_options, solver_choices
from hylo_scripts.training.process import BACKENDS
from hylo_scripts.training.schedules import LR_SCHEDULES, damping_schedule
from hylo_scripts.training.tasks import MODEL_OPTIONS, TASKS

#: The optimizers a run can use.
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class RunConfig:
    """One training run (the scripts' flags, one field each); ``solver=None`` trains with the plain optimizer.

    Data and model: ``dataset`` and ``model`` name entries of :data:`hylo_scripts.data.registry.DATASETS`
    and :data:`hylo_scripts.models.registry.MODELS`; ``data_dir`` is where datasets that are not shipped
    live; ``image_size`` the ImageNet crop / LGG slice side (None: 224 / 256); ``image_backend``
    decodes ImageNet with Pillow or (optional extra) torchvision. Language models only (None
    elsewhere): ``seq_len`` is the window and context length in tokens, ``layers``, ``width``
    and ``heads`` the transformer's size (None: the model's defaults, filled in), and
    ``max_bytes`` caps the training bytes read (validation: a tenth; None: no cap).

    Optimization: ``max_steps`` stops every epoch after that many steps (smoke runs; the
    schedules count the shortened epochs). The lr warms up linearly over ``warmup_epochs``,
    then follows ``lr_schedule``: ``"step"`` (× ``lr_decay`` at each epoch of ``milestones``)
    or ``"cosine"`` (to 0 at the end of ``epochs``). ``label_smoothing`` applies to the
    training loss of classification runs. With a hylo solver whose result is the whole update
    direction (``kfac_adam``), the parameters hylo preconditions are trained by SGD without momentum
    at ``lr`` and the others by ``optimizer`` at ``rest_lr`` (None: ``lr``; :func:`hylo_scripts.training.loop.make_optimizer`).

    hylo: ``solver`` is hylo's (None or ``"none"``: the plain optimizer). ``hylo`` holds the
    preconditioner's other options by their flat names (:func:`hylo.config.options`), those the
    engine does not set itself (:data:`hylo_scripts.training.hylo_options.ENGINE_OPTIONS`): given as any
    subset, it is filled in with the defaults (hylo's, or the scripts' of
    :data:`~hylo_scripts.training.hylo_options.SCRIPT_DEFAULTS`: ``damping`` 0.3, ``kl_clip`` 1e-3, where
    0 stands for None, off), in hylo's order, and checked by building the run's
    ``hylo.HyLoConfig``; it is empty for a plain run, and options given to one are an error.
    With ``target_damping``, ``damping`` decays log-linearly to it over ``damping_decay_epochs``
    after the warm-up (None: the rest of the run); without, it is constant.

    Outputs: see :mod:`hylo_scripts.training.loop`. ``profiling`` has hylo time every step into
    ``log_dir`` (hylo's ``profile_dir``); hylo's ``studies`` imply it. ``checkpoint_freq``
    (0: never) needs ``log_dir``.
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
    rest_lr: float | None = None
    lr_schedule: str = "step"
    lr_decay: float = 0.1
    milestones: tuple[int, ...] = ()
    warmup_epochs: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    target_damping: float | None = None
    damping_decay_epochs: float | None = None
    hylo: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    data_seed: int = 0
    backend: str = "auto"
    log_dir: str | None = None
    checkpoint_freq: int = 0
    profiling: bool = False

    def __post_init__(self) -> None:
        if self.solver == "none":
            object.__setattr__(self, "solver", None)
        if isinstance(self.milestones, str):
            raise ValueError("milestones must be a sequence, not a single string")
        object.__setattr__(self, "milestones", tuple(self.milestones))
        object.__setattr__(self, "hylo", run_options(self.hylo, self.solver))
        for name in ("log_dir", "data_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        self._check_choices()
        self._check_task_fields()
        self._check_numbers()
        self._check_outputs()
        check(self)

    def _check_choices(self) -> None:
        """Names: solver, optimizer, backend, schedule, dataset and a model of the dataset's task."""
        if self.solver is not None and self.solver not in solver_choices():
            raise ValueError(f"solver must be None, 'none' or one of {solver_choices()}, got {self.solver!r}")
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
        if self.rest_lr is not None and not self.rest_lr > 0:
            raise ValueError(f"rest_lr must be > 0 (or None: lr), got {self.rest_lr}")
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
        """Profiling and checkpoints need ``log_dir``; hylo's studies imply profiling, which needs a solver."""
        if self.hylo.get("studies"):
            object.__setattr__(self, "profiling", True)
        if self.profiling and self.log_dir is None:
            raise ValueError("profiling and studies write their files into log_dir: set log_dir")
        if self.profiling and self.solver is None:
            raise ValueError("profiling and studies measure hylo: they need a solver, not the plain optimizer")
        if self.checkpoint_freq and self.log_dir is None:
            raise ValueError("checkpoints are written into log_dir: set log_dir")

    @property
    def name(self) -> str:
        """``"<optimizer>"`` or ``"hylo-<solver>"``."""
        return self.optimizer if self.solver is None else f"hylo-{self.solver}"

    @property
    def task(self) -> str:
        """``"classification"``, ``"segmentation"`` or ``"lm"`` (the dataset's)."""
        return DATASETS[self.dataset].task

    def value(self, name: str) -> Any:
        """Field ``name`` of the run, or hylo's option ``name`` as the run has it (KeyError for a plain run's)."""
        if name in self.__dataclass_fields__:
            return getattr(self, name)
        return self.hylo[name]

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (tuples as lists; ``hylo`` an object); ``RunConfig(**cfg.to_json())`` gives
        ``cfg`` back."""
        return json.loads(json.dumps(asdict(self)))


def preconditioner_options(
    cfg: RunConfig, *, lr: float | Callable[[int], float], steps_per_epoch: int, profile_append: bool
) -> dict[str, Any]:
    """The keyword arguments of ``hylo.HyLoPreconditioner`` for run ``cfg`` (which has a solver).

    The run's options, with ``damping`` as the schedule to ``target_damping`` if it has one,
    and the engine's: ``lr`` (the optimizer's, for ``kl_clip``), ``iters_per_epoch`` (for
    ``adaptive``), ``profile_dir`` (``log_dir`` when profiling), ``profile_append`` and ``seed``.
    """
    options = dict(cfg.hylo)
    if cfg.target_damping is not None:
        warmup = round(cfg.warmup_epochs * steps_per_epoch)
        decay_epochs = cfg.damping_decay_epochs
        decay_steps = round(decay_epochs * steps_per_epoch) if decay_epochs else cfg.epochs * steps_per_epoch - warmup
        options["damping"] = damping_schedule(
            options["damping"], cfg.target_damping, warmup_steps=warmup, decay_steps=max(1, decay_steps)
        )
    return {
        RUN_OPTION: cfg.solver,
        **options,
        "lr": lr if options["kl_clip"] is not None else None,
        "iters_per_epoch": steps_per_epoch if options["adaptive"] is not None else None,
        "profile_dir": cfg.log_dir if cfg.profiling else None,
        "profile_append": profile_append,
        "seed": cfg.seed,
    }


def check(cfg: RunConfig) -> None:
    """Check run ``cfg``'s hylo options by building its ``hylo.HyLoConfig`` (a ``ValueError`` names the option)."""
    if cfg.solver is None:
        return
    try:
        hylo.HyLoConfig(**preconditioner_options(cfg, lr=cfg.lr, steps_per_epoch=1, profile_append=False))
    except TypeError as err:  # an option this hylo does not know
        raise ValueError(str(err)) from err


def run_defaults() -> dict[str, Any]:
    """A run's configuration at its defaults, as JSON values, with every option of ``hylo`` at its default:
    what a checkpoint written before a field or an option existed is compared as."""
    return {**RunConfig().to_json(), "hylo": default_options()}
