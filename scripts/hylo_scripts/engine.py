"""The scripts' one training engine, by concern, with its public names gathered here.

- :mod:`hylo_scripts.runconfig`: :class:`RunConfig`, one run, checked when it is made;
  :mod:`hylo_scripts.hylo_options`: which of hylo's options the engine sets and the scripts'
  defaults of the others (their flags: :mod:`hylo_scripts.hylo_flags`);
- :mod:`hylo_scripts.tasks`: the tasks as objects (classification, segmentation, language
  model), each with its loss, evaluation, metric and input dtype;
- :mod:`hylo_scripts.loop`: :func:`train`, the loop (one process or DDP), its building blocks
  (optimizer, lr schedule, preconditioner) and its result;
- :mod:`hylo_scripts.process`: torchrun's process group and this process's device;
- :mod:`hylo_scripts.rundir`: the run directory's files (``config.json``, ``metrics.csv``,
  ``dataset.json``, ``model-summary.txt``); :mod:`hylo_scripts.checkpoint`: checkpoints and resume.
"""

from hylo_scripts.hylo_options import ENGINE_OPTIONS, SCRIPT_DEFAULTS, solver_choices
from hylo_scripts.loop import (
    EpochLog,
    RunResult,
    evaluate,
    make_optimizer,
    make_preconditioner,
    make_scheduler,
    resume_schedule,
    train,
)
from hylo_scripts.process import BACKENDS, distributed, rank_and_world
from hylo_scripts.runconfig import OPTIMIZERS, RunConfig
from hylo_scripts.rundir import METRIC_COLUMNS, metrics_header, model_summary, write_rows
from hylo_scripts.tasks import TASKS, Task

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
