"""Command-line flags of the training scripts (HyLo's names and meanings where they exist) -> :class:`RunConfig`.

:func:`build_parser` gives ``train.py``, ``train_segmentation.py`` and ``train_lm.py`` the same
flags, with their own defaults and their task's data and model flags (image sizes for the
image tasks; sequence length, byte cap and transformer size for language models);
:func:`config_from_args` checks what argparse cannot (a flag that would be ignored in the
company it keeps is an error, not a silent no-op) and returns the run's
:class:`~hylo_scripts.engine.RunConfig`. The demo uses :func:`add_run_arguments` alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hylo_scripts.argtypes import positive_int, ratio
from hylo_scripts.checkpoint import RunError
from hylo_scripts.data import DATASETS, DatasetLayoutError
from hylo_scripts.loop import train
from hylo_scripts.models import MODELS
from hylo_scripts.process import BACKENDS, distributed
from hylo_scripts.runconfig import DEFAULT_GRAD_ERROR_METHODS, HYLO_SOLVERS, OPTIMIZERS, RunConfig
from hylo_scripts.schedules import LR_SCHEDULES
from hylo_scripts.tasks import TASKS

#: Study flag -> the hylo study it turns on.
STUDY_FLAGS = {"--grad-norm": "grad_norm", "--rank-analysis": "rank", "--grad-error": "grad_error"}
#: Method flag of ``--grad-error`` -> the gradient-error method it selects.
METHOD_FLAGS = {"--enable-id": "kid", "--enable-is": "kis", "--enable-kfac": "kfac"}
#: hylo's flags (argparse names) -> the RunConfig fields they set; each is an error with ``--solver none``.
HYLO_FLAGS = {
    "damping": "damping",
    "target_damping": "target_damping",
    "damping_decay_epochs": "damping_decay_epochs",
    "freq": "update_freq",
    "factor_decay": "factor_decay",
    "compression_ratio": "rank_ratio",
    "kl_clip": "kl_clip",
    "strategy": "strategy",
    "adaptive": "adaptive",
    "trend_window": "trend_window",
    "conv_rows": "conv_rows",
    "kfc_exponent": "kfc_exponent",
    "damping_convention": "damping_convention",
    "kis_estimator": "kis_estimator",
    "factor_update_freq": "factor_update_freq",
}


def run_default(field: str) -> Any:
    """The default of a :class:`RunConfig` field (the one source of the scripts' defaults)."""
    return RunConfig.__dataclass_fields__[field].default


def _dest(flag: str) -> str:
    """argparse's attribute name of a ``--long-flag``."""
    return flag.removeprefix("--").replace("-", "_")


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
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "data_seed": args.data_seed,
    }


def _add_hylo_arguments(parser: argparse.ArgumentParser) -> None:
    """hylo's flags (defaults None here, so that a flag given with ``--solver none`` is seen; RunConfig's apply)."""
    group = parser.add_argument_group("hylo (errors with --solver none)")
    group.add_argument(
        "--damping", type=float, help=f"damping λ of (F + λI), the initial one (default {run_default('damping')})"
    )
    group.add_argument(
        "--target-damping",
        type=float,
        help="decay λ log-linearly to this value after the warm-up (default: constant λ)",
    )
    group.add_argument(
        "--damping-decay-epochs",
        type=float,
        help="epochs over which λ reaches --target-damping (default: the rest of the run)",
    )
    group.add_argument(
        "--freq",
        type=positive_int,
        help=f"steps between curvature/inverse updates (default {run_default('update_freq')})",
    )
    group.add_argument(
        "--factor-decay",
        type=float,
        help=f"K-FAC running-average decay of the factors (default {run_default('factor_decay')})",
    )
    group.add_argument(
        "--compression-ratio",
        "--rank-ratio",
        dest="compression_ratio",
        type=ratio,
        help=f"ρ: the low-rank solvers keep max(1, ⌊ρ·n⌋) of a layer's n batch rows (default {run_default('rank_ratio')})",
    )
    group.add_argument(
        "--kl-clip",
        type=float,
        help=f"clip the preconditioned step's KL size, with the scheduled lr (0: off; {run_default('kl_clip')})",
    )
    group.add_argument(
        "--strategy",
        choices=["inverse", "gradient"],
        help=f"broadcast the inverses or the gradients (default {run_default('strategy')})",
    )
    group.add_argument(
        "--adaptive",
        type=int,
        nargs=3,
        metavar=("A0", "A1", "A2"),
        help="HyLo's fixed windows: KID while epoch < A0 or A1 < epoch <= A2, KIS otherwise (needs --solver hybrid)",
    )
    group.add_argument(
        "--trend-window",
        type=positive_int,
        help="steps over which the gradient-norm trend is measured (hybrid policy and --grad-norm; "
        f"default {run_default('trend_window')})",
    )
    group.add_argument(
        "--conv-rows",
        choices=["sum", "exact", "mean"],
        help=f"low-rank rows of a Conv2d (default {run_default('conv_rows')})",
    )
    group.add_argument(
        "--kfc-exponent",
        type=float,
        help=f"e of a Conv2d's K-FAC factors L^e·E[aaᵀ]⊗E[ggᵀ] (default {run_default('kfc_exponent')})",
    )
    group.add_argument(
        "--damping-convention",
        choices=["hylo", "kaisa"],
        help="what --damping damps: hylo's batch-size-free Fisher, or KAISA's (its damping carries over; "
        f"default {run_default('damping_convention')})",
    )
    group.add_argument(
        "--kis-estimator", choices=["unbiased", "hylo"], help=f"KIS estimator (default {run_default('kis_estimator')})"
    )
    group.add_argument("--factor-update-freq", type=positive_int, help="K-FAC factor updates between inverse updates")


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Log directory, checkpoints, resume, profiling and the studies (HyLo's flag names)."""
    group = parser.add_argument_group(
        "outputs, checkpoints, profiling and studies",
        "Any of --profiling, --grad-norm, --rank-analysis, --grad-error writes hylo's profile files into "
        "--log-dir (which it needs) and needs a hylo solver (not --solver none); a study flag implies --profiling.",
    )
    group.add_argument(
        "--log-dir",
        help="directory of the run (created): config.json, model-summary.txt, metrics.csv, checkpoints, profile "
        "files; a directory holding another run is refused unless --resume",
    )
    group.add_argument(
        "--resume", action="store_true", help="continue the run in --log-dir from its latest checkpoint up to --epochs"
    )
    group.add_argument(
        "--checkpoint-freq",
        type=int,
        help="write a checkpoint every N epochs and after the last (default 5 with --log-dir; 0: never)",
    )
    group.add_argument(
        "--profiling", action="store_true", help="time every step: timing-r{rank}.csv, steps-r{rank}.csv, run.json"
    )
    group.add_argument(
        "--grad-norm", action="store_true", help="gradient-norm study, every step and layer: grad-norm.csv"
    )
    group.add_argument(
        "--rank-analysis",
        action="store_true",
        help="rank study (eigenvalues of the exact SNGD kernel, numerical rank) at sampled updates: rank-analysis.csv",
    )
    group.add_argument(
        "--grad-error",
        action="store_true",
        help="gradient-error study against exact SNGD at sampled updates: grad-error.csv "
        "(methods from --enable-id/--enable-is/--enable-kfac; none given: KID and KIS)",
    )
    group.add_argument(
        "--enable-id", action="store_true", help="--grad-error measures KID (train with it: --solver kid)"
    )
    group.add_argument(
        "--enable-is", action="store_true", help="--grad-error measures KIS (train with it: --solver kis)"
    )
    group.add_argument("--enable-kfac", action="store_true", help="--grad-error measures K-FAC")
    group.add_argument(
        "--study-every",
        type=positive_int,
        default=1,
        metavar="N",
        help="run --rank-analysis and --grad-error at every N-th update (default: every update)",
    )
    group.add_argument(
        "--grad-error-ratios",
        type=ratio,
        nargs="+",
        metavar="R",
        help="rank ratios ρ at which --grad-error measures KID and KIS (default: --compression-ratio)",
    )


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
    opt.add_argument(
        "--solver",
        choices=["none", *HYLO_SOLVERS],
        help="hylo's solver; 'none' trains with the plain optimizer (default hybrid)",
    )
    opt.add_argument("--sngd", action="store_true", help="HyLo's flag: train with exact SNGD (= --solver sngd)")
    opt.add_argument("--max-steps", type=positive_int, help="stop every epoch after N steps (smoke runs)")
    opt.add_argument(
        "--lr",
        type=float,
        default=run_default("lr"),
        help="peak learning rate, after the warm-up (default %(default)s)",
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


def _solver(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """``--solver`` with ``--sngd`` folded in (a conflict is an error); the default is hybrid."""
    if args.sngd:
        if args.solver not in (None, "sngd"):
            parser.error(f"--sngd trains with SNGD; it contradicts --solver {args.solver}")
        return "sngd"
    return args.solver or "hybrid"


def _hylo_fields(args: argparse.Namespace, parser: argparse.ArgumentParser, solver: str) -> dict[str, Any]:
    """hylo's flags as RunConfig fields; given with ``--solver none`` they are an error."""
    given = [name for name in HYLO_FLAGS if getattr(args, name) is not None]
    if solver == "none" and given:
        parser.error(f"{', '.join('--' + n.replace('_', '-') for n in given)}: hylo options, not used by --solver none")
    fields = {
        field: run_default(field) if getattr(args, name) is None else getattr(args, name)
        for name, field in HYLO_FLAGS.items()
    }
    if fields["adaptive"] is not None and solver != "hybrid":
        parser.error(f"--adaptive sets the hybrid policy's windows; it needs --solver hybrid, not {solver}")
    if args.trend_window is not None and solver != "hybrid" and not args.grad_norm:
        parser.error(f"--trend-window: the gradient-norm trend is read by --solver hybrid or --grad-norm, not {solver}")
    if fields["damping_decay_epochs"] is not None and fields["target_damping"] is None:
        parser.error("--damping-decay-epochs: needs --target-damping (the value to decay to)")
    return fields


def profile_fields(args: argparse.Namespace, parser: argparse.ArgumentParser, solver: str) -> dict[str, Any]:
    """The RunConfig fields of the profiling and study flags; misuse is a ``parser.error``.

    Errors: a profiling or study flag without ``--log-dir`` or with ``--solver none``;
    ``--enable-*``, ``--grad-error-ratios`` without ``--grad-error``; ``--study-every``
    without ``--rank-analysis`` or ``--grad-error``.
    """
    studies = tuple(study for flag, study in STUDY_FLAGS.items() if getattr(args, _dest(flag)))
    methods = tuple(method for flag, method in METHOD_FLAGS.items() if getattr(args, _dest(flag)))
    asked = [flag for flag in ("--profiling", *STUDY_FLAGS) if getattr(args, _dest(flag))]
    if asked and args.log_dir is None:
        parser.error(f"{' '.join(asked)}: needs --log-dir DIR, where hylo writes its profile and study files")
    if asked and solver == "none":
        parser.error(f"{' '.join(asked)}: not available with --solver none (profiling and studies measure hylo)")
    if "grad_error" not in studies:
        given = [flag for flag in METHOD_FLAGS if getattr(args, _dest(flag))]
        if args.grad_error_ratios is not None:
            given.append("--grad-error-ratios")
        if given:
            parser.error(f"{' '.join(given)}: only with --grad-error (to train with KID or KIS: --solver kid/kis)")
    if args.study_every != 1 and not {"rank", "grad_error"} & set(studies):
        parser.error("--study-every: only with --rank-analysis or --grad-error")
    return {
        "profiling": bool(asked),
        "studies": studies,
        "study_every": args.study_every,
        "grad_error_methods": methods or DEFAULT_GRAD_ERROR_METHODS,
        "grad_error_ratios": tuple(args.grad_error_ratios) if args.grad_error_ratios else None,
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
    solver = _solver(args, parser)
    if args.lr_schedule == "cosine" and (args.milestone or args.lr_decay is not None):
        parser.error("--milestone/--lr-decay belong to --lr-schedule step; cosine decays to 0 by itself")
    if args.checkpoint_freq and args.log_dir is None:
        parser.error("--checkpoint-freq: needs --log-dir, where checkpoints are written")
    if args.resume and args.log_dir is None:
        parser.error("--resume: needs --log-dir, the run to continue")
    given_hylo = {field: getattr(args, name) for name, field in HYLO_FLAGS.items() if getattr(args, name) is not None}
    ignored = _ignored_flags(args, given_hylo)
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
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        lr_decay=run_default("lr_decay") if args.lr_decay is None else args.lr_decay,
        milestones=tuple(args.milestone or ()),
        label_smoothing=args.label_smoothing,
        backend=args.backend,
        log_dir=args.log_dir,
        checkpoint_freq=checkpoint_freq,
        **_hylo_fields(args, parser, solver),
        **profile_fields(args, parser, solver),
    )
    try:
        return RunConfig(**fields)
    except ValueError as err:
        parser.error(str(err))


def run_script(doc: str, argv: list[str] | None, *, task: str, defaults: Mapping[str, Any]) -> int:
    """A training script's ``main``: parse, join torchrun's group if any, train; exit status 0, 1 or 2.

    ``doc`` (the script's docstring) is the ``--help`` text. Flag misuse exits with argparse's
    status 2; a dataset that is not where ``--data-dir`` says or a ``--log-dir`` that cannot be
    used (another run, nothing to resume, a different configuration) prints its message and
    returns 1.
    """
    parser = build_parser(doc.split("\n\n")[0], task=task, defaults=defaults, epilog=doc)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, parser)
    try:
        with distributed(cfg.backend) as device:
            train(cfg, device=device, resume=args.resume, verbose=True)
    except (RunError, DatasetLayoutError) as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        return 1
    return 0
