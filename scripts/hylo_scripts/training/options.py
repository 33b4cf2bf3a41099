"""Command-line flags of the training scripts (HyLo's names and meanings where they exist) -> :class:`RunConfig`.

:func:`build_parser` gives ``train.py``, ``train_segmentation.py`` and ``train_lm.py`` the same
flags, with their own defaults and their task's data and model flags (:mod:`hylo_scripts.training.tasks`);
hylo's flags are generated from hylo's configuration (:mod:`hylo_scripts.training.hylo_flags`), so a new
hylo option is a flag of every trainer. :func:`config_from_args` checks what argparse cannot
(a flag that would be ignored in the company it keeps is an error, not a silent no-op) and
returns the run's :class:`~hylo_scripts.training.runconfig.RunConfig`. The demo uses
:func:`add_run_arguments` and the generated hylo flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hylo_scripts.data.registry import DATASETS, DatasetLayoutError
from hylo_scripts.models.registry import MODELS
from hylo_scripts.training.argtypes import positive_int
from hylo_scripts.training.checkpoint import RunError
from hylo_scripts.training.hylo_flags import (
    add_hylo_arguments,
    add_sngd_flag,
    add_study_flags,
    flag,
    given_options,
    policy_misuse,
    solver_of,
    study_misuse,
    study_options,
)
from hylo_scripts.training.hylo_options import TRAINER_LRS
from hylo_scripts.training.loop import train
from hylo_scripts.training.process import BACKENDS, distributed
from hylo_scripts.training.runconfig import OPTIMIZERS, RunConfig
from hylo_scripts.training.schedules import LR_SCHEDULES
from hylo_scripts.training.tasks import TASKS

#: The scripts' own hylo flags (argparse dests): the damping schedule; errors with ``--solver none``.
SCHEDULE_FLAGS = ("target_damping", "damping_decay_epochs")


def run_default(field: str) -> Any:
    """The default of a :class:`RunConfig` field (the one source of the scripts' defaults)."""
    return RunConfig.__dataclass_fields__[field].default


def add_run_arguments(parser: argparse.ArgumentParser, *, epochs: int, models: list[str] | None = None) -> None:
    """The options every training entry point shares (the demo's whole set): model, length, SGD, hylo basics, seeds."""
    parser.add_argument("--model", default="cnn", choices=models or sorted(MODELS), help="model of the registry")
    parser.add_argument("--epochs", type=positive_int, default=epochs, help="epochs to train (default: %(default)s)")
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=run_default("batch_size"),
        help="GLOBAL batch size, split over the ranks",
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=run_default("warmup_epochs"),
        help="linear lr warm-up (epochs, fractions allowed; default %(default)s)",
    )
    parser.add_argument("--momentum", type=float, default=run_default("momentum"), help="SGD momentum (default 0.9)")
    parser.add_argument(
        "--rest-lr",
        type=float,
        default=run_default("rest_lr"),
        help="with --solver kfac_adam: lr of the parameters hylo leaves to the optimizer (default: --lr)",
    )
    parser.add_argument(
        "--weight-decay", type=float, default=run_default("weight_decay"), help="weight decay (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the train/test split and the augmentation")


def run_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields of :func:`add_run_arguments`'s flags."""
    return {
        "model": args.model,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "warmup_epochs": args.warmup_epochs,
        "momentum": args.momentum,
        "rest_lr": args.rest_lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "data_seed": args.data_seed,
    }


def _add_hylo_arguments(parser: argparse.ArgumentParser) -> None:
    """hylo's flags, generated from its configuration, with HyLo's ``--sngd`` and the scripts' damping schedule.

    Their argparse defaults are None, so that a flag given with ``--solver none`` is seen.
    """
    groups = add_hylo_arguments(parser)
    top = groups[None]
    add_sngd_flag(top)
    top.add_argument(
        "--target-damping",
        type=float,
        help="decay λ log-linearly from --damping to this value after the warm-up (default: constant λ)",
    )
    top.add_argument(
        "--damping-decay-epochs",
        type=float,
        help="epochs over which λ reaches --target-damping (default: the rest of the run)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Log directory, checkpoints, resume, profiling and the studies (HyLo's flag names)."""
    group = parser.add_argument_group(
        "outputs, checkpoints, profiling and studies",
        "Any of --profiling, --grad-norm, --rank-analysis, --grad-error (or --studies) writes hylo's profile files "
        "into --log-dir (which it needs) and needs a hylo solver (not --solver none); a study implies --profiling. "
        "--grad-error-ratios and hylo's other telemetry options are flags of their own (see above).",
    )
    group.add_argument(
        "--log-dir",
        help="directory of the run (created): config.json, model-summary.txt, metrics.csv, checkpoints, profile "
        "files; a directory holding another run is refused unless --resume",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --log-dir from its latest checkpoint up to --epochs (a run that stopped "
        "before its first checkpoint starts again)",
    )
    group.add_argument(
        "--checkpoint-freq",
        type=int,
        help="write a checkpoint every N epochs and after the last (default 5 with --log-dir; 0: never)",
    )
    group.add_argument(
        "--profiling", action="store_true", help="time every step: timing-r{rank}.csv, steps-r{rank}.csv, run.json"
    )
    add_study_flags(group)


def build_parser(
    description: str, *, task: str, defaults: Mapping[str, Any], epilog: str | None = None
) -> argparse.ArgumentParser:
    """The flags of a training script for ``task`` (datasets and models of that task); ``defaults`` override."""
    parser = argparse.ArgumentParser(
        description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    datasets = sorted(name for name, spec in DATASETS.items() if spec.task == task)
    models = sorted(name for name, spec in MODELS.items() if spec.task == task)
    data = parser.add_argument_group("data and model")
    data.add_argument(
        "--dataset",
        choices=datasets,
        help="(default: %(default)s) " + "; ".join(f"{name}: {DATASETS[name].layout}" for name in datasets),
    )
    shipped = ", ".join(name for name in datasets if not DATASETS[name].needs_data_dir)
    data.add_argument(
        "--data-dir", help="where the dataset lives" + (f" (every dataset but {shipped})" if shipped else "")
    )
    TASKS[task].add_data_arguments(data)
    data.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank (default 0)")
    add_run_arguments(parser, epochs=5, models=models)
    opt = parser.add_argument_group("optimizer and schedules")
    opt.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="sgd", help="momentum SGD or AdamW (default %(default)s)"
    )
    opt.add_argument("--max-steps", type=positive_int, help="stop every epoch after N steps (smoke runs)")
    opt.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak learning rate, after the warm-up (default: {TRAINER_LRS[task].describe()})",
    )
    opt.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default="step",
        help="after the warm-up: 'step' (× --lr-decay at each --milestone) or 'cosine' to 0 (default %(default)s)",
    )
    opt.add_argument("--lr-decay", type=float, help="lr factor at each --milestone (default 0.1; step schedule)")
    opt.add_argument("--milestone", type=positive_int, nargs="+", help="epochs at which the lr decays (step schedule)")
    opt.add_argument(
        "--label-smoothing", type=float, default=0.0, help="label smoothing of the training loss (classification)"
    )
    _add_hylo_arguments(parser)
    system = parser.add_argument_group("distribution")
    system.add_argument(
        "--backend", choices=BACKENDS, default="auto", help="torch.distributed backend (auto: NCCL on GPU, gloo on CPU)"
    )
    _add_output_arguments(parser)
    parser.set_defaults(momentum=None)  # 0.9 for SGD; an error with AdamW (see config_from_args)
    parser.set_defaults(**defaults)
    return parser


def hylo_fields(args: argparse.Namespace, parser: argparse.ArgumentParser, solver: str) -> dict[str, Any]:
    """The RunConfig fields of hylo's flags: ``hylo`` (the options given, with those HyLo's study flags set),
    ``profiling``, ``target_damping`` and ``damping_decay_epochs``; misuse is a ``parser.error``.

    Errors: a profiling or study flag without ``--log-dir`` or with ``--solver none`` (see
    :func:`hylo_scripts.training.hylo_flags.study_misuse`); any hylo flag with ``--solver none``; the hybrid
    policy's options with a fixed solver; ``--damping-decay-epochs`` without ``--target-damping``.
    """
    given = given_options(args)
    study = study_options(args, given)
    problem = study_misuse(args, given, args.log_dir, solver)
    if problem:
        parser.error(problem)
    named = [flag(name) for name in given] + [flag(name) for name in SCHEDULE_FLAGS if getattr(args, name) is not None]
    if solver == "none" and named:
        parser.error(f"{', '.join(named)}: hylo options, not used by --solver none")
    options = {**given, **study}
    problem = policy_misuse(options, solver, set(options.get("studies", ())))
    if problem:
        parser.error(problem)
    if args.damping_decay_epochs is not None and args.target_damping is None:
        parser.error("--damping-decay-epochs: needs --target-damping (the value to decay to)")
    return {
        "hylo": options,
        "profiling": bool(args.profiling or options.get("studies")),
        "target_damping": args.target_damping,
        "damping_decay_epochs": args.damping_decay_epochs,
    }


def _ignored_flags(args: argparse.Namespace, given_hylo: Mapping[str, Any]) -> str | None:
    """The message for a flag that nothing in this run would read, or None (``given_hylo``: the hylo options given)."""
    spec = DATASETS[args.dataset]
    task = TASKS[spec.task]
    if args.optimizer == "adamw" and args.momentum is not None:
        return "--momentum: SGD's; AdamW has betas (leave --momentum out with --optimizer adamw)"
    if not task.label_smoothing and args.label_smoothing:
        return f"--label-smoothing: only for {' and '.join(t.name for t in TASKS.values() if t.label_smoothing)}"
    if not spec.needs_data_dir and args.data_dir is not None:
        return f"--data-dir: dataset {args.dataset} {task.no_data_dir}"
    return task.misused_flag(args, given_hylo)


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RunConfig:
    """The :class:`RunConfig` of :func:`build_parser`'s flags; contradictions and bad values are ``parser.error``."""
    solver = solver_of(args, parser)
    if args.lr_schedule == "cosine" and (args.milestone or args.lr_decay is not None):
        parser.error("--milestone/--lr-decay belong to --lr-schedule step; cosine decays to 0 by itself")
    if args.checkpoint_freq and args.log_dir is None:
        parser.error("--checkpoint-freq: needs --log-dir, where checkpoints are written")
    if args.resume and args.log_dir is None:
        parser.error("--resume: needs --log-dir, the run to continue")
    ignored = _ignored_flags(args, given_options(args))
    if ignored:
        parser.error(ignored)
    checkpoint_freq = args.checkpoint_freq if args.checkpoint_freq is not None else (5 if args.log_dir else 0)
    task_fields = TASKS[DATASETS[args.dataset].task].data_fields(args)
    fields = dict(
        run_fields(args),
        **task_fields,
        momentum=run_default("momentum") if args.momentum is None else args.momentum,
        dataset=args.dataset,
        data_dir=args.data_dir,
        workers=args.workers,
        optimizer=args.optimizer,
        solver=None if solver == "none" else solver,
        max_steps=args.max_steps,
        lr=TRAINER_LRS[DATASETS[args.dataset].task].of(solver) if args.lr is None else args.lr,
        lr_schedule=args.lr_schedule,
        lr_decay=run_default("lr_decay") if args.lr_decay is None else args.lr_decay,
        milestones=tuple(args.milestone or ()),
        label_smoothing=args.label_smoothing,
        backend=args.backend,
        log_dir=args.log_dir,
        checkpoint_freq=checkpoint_freq,
        **hylo_fields(args, parser, solver),
    )
    try:
        return RunConfig(**fields)
    except ValueError as err:
        parser.error(str(err))


def run_script(doc: str, argv: list[str] | None, *, task: str, defaults: Mapping[str, Any]) -> int:
    """A training script's ``main``: parse, join torchrun's group if any, train; exit status 0, 1 or 2.

    ``doc`` (the script's docstring) is the ``--help`` text. Flag misuse and a ``--log-dir`` that
    cannot be used (another run, nothing to resume, a checkpoint that is corrupted, of another
    run or of a different configuration) exit like argparse's errors: ``PROG: error: MESSAGE``
    naming the file and what to do, status 2, no traceback. A dataset that is not where
    ``--data-dir`` says prints its message and returns 1.
    """
    parser = build_parser(doc.split("\n\n")[0], task=task, defaults=defaults, epilog=doc)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, parser)
    try:
        with distributed(cfg.backend) as device:
            train(cfg, device=device, resume=args.resume, verbose=True)
    except RunError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except DatasetLayoutError as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        return 1
    return 0
