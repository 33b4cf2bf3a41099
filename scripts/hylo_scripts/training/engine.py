"""The scripts' one training engine, by concern, with its public names gathered here.

- :mod:`hylo_scripts.training.runconfig`: :class:`RunConfig`, one run, checked when it is made;
  :mod:`hylo_scripts.training.hylo_options`: which of hylo's options the engine sets and the scripts'
  defaults of the others (their flags: :mod:`hylo_scripts.training.hylo_flags`);
- :mod:`hylo_scripts.training.tasks`: the tasks as objects (classification, segmentation, language
  model), each with its loss, evaluation, metric and input dtype;
- :mod:`hylo_scripts.training.loop`: :func:`train`, the loop (one process or DDP), its building blocks
  (optimizer, lr schedule, preconditioner) and its result;
- :mod:`hylo_scripts.training.process`: torchrun's process group and this process's device;
- :mod:`hylo_scripts.training.rundir`: the run directory's files (``config.json``, ``metrics.csv``,
  ``dataset.json``, ``model-summary.txt``); :mod:`hylo_scripts.training.checkpoint`: checkpoints and resume.
"""

from hylo_scripts.training.hylo_options import ENGINE_OPTIONS, SCRIPT_DEFAULTS, solver_choices
from hylo_scripts.training.loop import (
    EpochLog,
    RunResult,
    evaluate,
    make_optimizer,
    make_preconditioner,
    make_scheduler,
    resume_schedule,
    train,
)
from hylo_scripts.training.process import BACKENDS, distributed, rank_and_world
from hylo_scripts.training.runconfig import OPTIMIZERS, RunConfig
from hylo_scripts.training.rundir import METRIC_COLUMNS, metrics_header, model_summary, write_rows
from hylo_scripts.training.tasks import TASKS, Task

__all__ = [
    "BACKENDS",
    "ENGINE_OPTIONS",
    "METRIC_COLUMNS",
    "OPTIMIZERS",
    "SCRIPT_DEFAULTS",
    "TASKS",
    "EpochLog",
    "RunConfig",
    "RunResult",
    "Task",
    "distributed",
    "evaluate",
    "make_optimizer",
    "make_preconditioner",
    "make_scheduler",
    "metrics_header",
    "model_summary",
    "rank_and_world",
    "resume_schedule",
    "solver_choices",
    "train",
    "write_rows",
]
