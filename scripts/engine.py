"""The scripts' one training engine: run configuration, schedule, loop, evaluation, DDP setup, CSV log.

Every run (plain SGD or SGD + hylo, one process or P ranks) uses the model of the registry
built from the seed's initial weights, the same batches in the same order, momentum SGD with
weight decay and the same learning-rate schedule (linear warm-up, then cosine decay to zero,
set per step), so the only difference between runs is whether ``HyLoPreconditioner.step()``
rewrites the gradients before ``optimizer.step()``.

Seeds: ``seed`` draws the initial weights (and hylo's KIS rows), ``seed + 1`` the batch order,
``data_seed`` the train/test split. ``batch_size`` is the global batch: under DDP each of the P
ranks takes its 1/P slice of every batch, so P ranks see the same data in the same order as one
process.

Outputs of a run with ``log_dir`` (rank 0 unless said otherwise): ``config.json`` (the
:class:`RunConfig`), ``metrics.csv`` (the per-epoch log, unless :func:`train` is given another
``csv_path``) and, with ``profiling`` or any of ``studies``, hylo's profile files (its
``profile_dir`` is ``log_dir``): ``timing-r{rank}.csv`` and ``steps-r{rank}.csv`` on every rank,
``decisions.csv``, ``run.json`` and one CSV per study (``grad-norm.csv``, ``rank-analysis.csv``,
``grad-error.csv``). hylo refuses a ``log_dir`` that already holds its files of another run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import hylo
from scripts.data import DATASETS, Split, load_dataset
from scripts.models import build_model, models_for

#: The solvers of ``hylo.HyLoPreconditioner``; ``RunConfig.solver`` may also be ``None``/``"none"``.
HYLO_SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")
#: hylo's studies (``HyLoConfig.studies``), in the order of the flags that turn them on.
STUDIES = ("grad_norm", "rank", "grad_error")
#: hylo's gradient-error methods (``HyLoConfig.grad_error_methods``).
GRAD_ERROR_METHODS = ("kid", "kis", "kfac", "sngd")
#: The gradient-error methods of a run that names none (``--grad-error`` alone): KID and KIS, as in HyLo.
DEFAULT_GRAD_ERROR_METHODS = ("kid", "kis")
#: Study flag -> the hylo study it turns on.
STUDY_FLAGS = {"--grad-norm": "grad_norm", "--rank-analysis": "rank", "--grad-error": "grad_error"}
#: Method flag of ``--grad-error`` -> the gradient-error method it selects.
METHOD_FLAGS = {"--enable-id": "kid", "--enable-is": "kis", "--enable-kfac": "kfac"}


@dataclass(frozen=True)
class RunConfig:
    """One training run; ``solver=None`` (or ``"none"``) trains with the plain optimizer.

    ``kl_clip=0`` is stored as ``None`` (disabled). ``max_steps`` stops a run early without
    changing its schedule (smoke runs). ``damping`` … ``factor_update_freq`` are hylo's options.

    ``log_dir`` is the directory of the run's outputs (see the module docstring). ``profiling``
    has hylo time every step into ``log_dir``; ``studies`` (any of :data:`STUDIES`) adds hylo's
    studies there and implies ``profiling``. Both need ``log_dir`` and a solver. ``study_every``
    runs the rank and gradient-error studies at every ``study_every``-th update (hylo's
    ``rank_every`` and ``grad_error_every``); ``grad_error_methods`` (any of
    :data:`GRAD_ERROR_METHODS`) and ``grad_error_ratios`` (ρ in (0, 1]; None: ``rank_ratio``)
    are what the gradient-error study measures.
    """

    model: str = "cnn"
    dataset: str = "mnist5k"
    solver: str | None = None
    epochs: int = 15
    max_steps: int | None = None
    batch_size: int = 500
    lr: float = 0.1
    warmup_epochs: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    damping: float = 0.3
    update_freq: int = 10
    factor_decay: float = 0.95
    kl_clip: float | None = 1e-3
    rank_ratio: float = 0.1
    strategy: str = "inverse"
    adaptive: tuple[int, int, int] | None = None
    conv_rows: str = "sum"
    kis_estimator: str = "unbiased"
    factor_update_freq: int | None = None
    seed: int = 0
    data_seed: int = 0
    log_dir: str | None = None
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
        if self.solver is not None and self.solver not in HYLO_SOLVERS:
            raise ValueError(f"solver must be None, 'none' or one of {HYLO_SOLVERS}, got {self.solver!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r} (expected one of {sorted(DATASETS)})")
        dataset = DATASETS[self.dataset]
        usable = models_for(dataset.input_shape, dataset.num_classes)
        if self.model not in usable:
            raise ValueError(f"model {self.model!r} does not fit dataset {self.dataset!r} (usable: {usable})")
        if self.epochs < 1 or self.batch_size < 1 or (self.max_steps is not None and self.max_steps < 1):
            raise ValueError("epochs, batch_size and max_steps must be at least 1")
        self._check_profiling()

    def _check_profiling(self) -> None:
        """Normalise and check the profiling and study options (``studies`` imply ``profiling``)."""
        for name in ("studies", "grad_error_methods"):
            if isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a sequence of names, not a single string")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.log_dir is not None:
            object.__setattr__(self, "log_dir", os.fspath(self.log_dir))
        unknown = [s for s in self.studies if s not in STUDIES]
        if unknown:
            raise ValueError(f"studies must be drawn from {STUDIES}, got {unknown}")
        if self.studies:
            object.__setattr__(self, "profiling", True)
        if self.profiling and self.log_dir is None:
            raise ValueError("profiling and studies write their files into log_dir: set log_dir")
        if self.profiling and self.solver is None:
            raise ValueError("profiling and studies measure hylo: they need a solver, not the plain optimizer")
        bad = [m for m in self.grad_error_methods if m not in GRAD_ERROR_METHODS]
        if bad or not self.grad_error_methods:
            raise ValueError(f"grad_error_methods must be a non-empty selection of {GRAD_ERROR_METHODS}, got {bad}")
        if isinstance(self.study_every, bool) or not (isinstance(self.study_every, int) and self.study_every >= 1):
            raise ValueError(f"study_every must be an int >= 1, got {self.study_every!r}")
        if self.grad_error_ratios is not None:
            ratios = tuple(self.grad_error_ratios)
            if not ratios or not all(0.0 < r <= 1.0 for r in ratios):
                raise ValueError(f"grad_error_ratios must be ratios in (0, 1], got {self.grad_error_ratios!r}")
            object.__setattr__(self, "grad_error_ratios", ratios)

    @property
    def name(self) -> str:
        """``"sgd"`` or ``"hylo-<solver>"``."""
        return "sgd" if self.solver is None else f"hylo-{self.solver}"


@dataclass(frozen=True)
class EpochLog:
    """One epoch as the CSV log has it: steps so far, epoch-mean training loss, test metrics, time."""

    epoch: int
    step: int
    train_loss: float
    test_loss: float
    test_acc: float
    seconds: float
    ranks: int


@dataclass
class RunResult:
    """Outcome of one run: its config, one :class:`EpochLog` per epoch and the training wall time."""

    config: RunConfig
    log: list[EpochLog]
    seconds: float

    @property
    def name(self) -> str:
        """``"sgd"`` or ``"hylo-<solver>"``."""
        return self.config.name

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self.log[-1].step

    @property
    def test_accuracy(self) -> float:
        """Test accuracy after the last epoch."""
        return self.log[-1].test_acc

    @property
    def test_loss(self) -> float:
        """Mean test cross-entropy after the last epoch."""
        return self.log[-1].test_loss

    @property
    def train_loss(self) -> float:
        """Mean training loss over the last epoch's batches."""
        return self.log[-1].train_loss


def add_run_arguments(parser: argparse.ArgumentParser, *, epochs: int) -> None:
    """Add the command-line options every training entry point shares (see :func:`config_from_args`)."""
    mnist = DATASETS["mnist5k"]
    parser.add_argument("--model", default="cnn", choices=models_for(mnist.input_shape, mnist.num_classes))
    parser.add_argument("--epochs", type=int, default=epochs, help="epochs per run (8 steps each at batch 500)")
    parser.add_argument("--batch-size", type=int, default=500, help="global batch size")
    parser.add_argument("--warmup-epochs", type=float, default=1.0, help="linear lr warm-up before the cosine decay")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--damping", type=float, default=0.3, help="hylo damping λ")
    parser.add_argument(
        "--kl-clip", type=float, default=1e-3, help="hylo kl_clip (0 disables it); uses the scheduled lr"
    )
    parser.add_argument(
        "--conv-rows",
        default="sum",
        choices=["sum", "exact", "mean"],
        help="hylo conv_rows (low-rank rows of a Conv2d)",
    )
    parser.add_argument("--kis-estimator", default="unbiased", choices=["unbiased", "hylo"], help="hylo kis_estimator")
    parser.add_argument(
        "--factor-update-freq", type=int, default=None, help="hylo factor_update_freq (K-FAC factors between updates)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batch order")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the train/test split")


def config_from_args(args: argparse.Namespace, **fields: Any) -> RunConfig:
    """A :class:`RunConfig` from the options of :func:`add_run_arguments`, plus ``fields``."""
    return RunConfig(
        model=args.model,
        epochs=args.epochs,
        batch_size=args.batch_size,
        warmup_epochs=args.warmup_epochs,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        damping=args.damping,
        kl_clip=args.kl_clip,
        conv_rows=args.conv_rows,
        kis_estimator=args.kis_estimator,
        factor_update_freq=args.factor_update_freq,
        seed=args.seed,
        data_seed=args.data_seed,
        **fields,
    )


def _ratio(text: str) -> float:
    """argparse type of a rank ratio ρ in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a ratio must be in (0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    """argparse type of an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the output, profiling and study options (HyLo's flag names); see :func:`profile_fields`."""
    group = parser.add_argument_group(
        "outputs, profiling and studies",
        "Any of --profiling, --grad-norm, --rank-analysis, --grad-error writes hylo's profile files into "
        "--log-dir (which it needs) and needs a hylo solver (not --solver none); a study flag implies --profiling.",
    )
    group.add_argument(
        "--log-dir",
        default=None,
        help="directory of the run's outputs (created): config.json, metrics.csv (unless --out) and the profile files",
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
    group.add_argument("--enable-id", action="store_true", help="--grad-error measures KID (method kid)")
    group.add_argument("--enable-is", action="store_true", help="--grad-error measures KIS (method kis)")
    group.add_argument("--enable-kfac", action="store_true", help="--grad-error measures K-FAC (method kfac)")
    group.add_argument(
        "--study-every",
        type=_positive_int,
        default=1,
        metavar="N",
        help="run --rank-analysis and --grad-error at every N-th update (default: every update)",
    )
    group.add_argument(
        "--grad-error-ratios",
        type=_ratio,
        nargs="+",
        default=None,
        metavar="R",
        help="rank ratios ρ at which --grad-error measures KID and KIS (default: --rank-ratio)",
    )


def profile_fields(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The :class:`RunConfig` fields of :func:`add_profile_arguments`'s options; misuse is a ``parser.error``.

    Errors (argparse's exit status 2 with the message): a profiling or study flag without
    ``--log-dir`` or with ``--solver none``; ``--enable-*``, ``--grad-error-ratios`` without
    ``--grad-error``; ``--study-every`` without ``--rank-analysis`` or ``--grad-error``.
    """
    studies = tuple(study for flag, study in STUDY_FLAGS.items() if getattr(args, _dest(flag)))
    methods = tuple(method for flag, method in METHOD_FLAGS.items() if getattr(args, _dest(flag)))
    asked = [flag for flag in ("--profiling", *STUDY_FLAGS) if getattr(args, _dest(flag))]
    if asked and args.log_dir is None:
        parser.error(f"{' '.join(asked)}: needs --log-dir DIR, where hylo writes its profile and study files")
    if asked and getattr(args, "solver", None) == "none":
        parser.error(f"{' '.join(asked)}: not available with --solver none (profiling and studies measure hylo)")
    if "grad_error" not in studies:
        given = [flag for flag in METHOD_FLAGS if getattr(args, _dest(flag))]
        if args.grad_error_ratios is not None:
            given.append("--grad-error-ratios")
        if given:
            parser.error(f"{' '.join(given)}: only with --grad-error")
    if args.study_every != 1 and not {"rank", "grad_error"} & set(studies):
        parser.error("--study-every: only with --rank-analysis or --grad-error")
    return {
        "log_dir": args.log_dir,
        "profiling": bool(asked),
        "studies": studies,
        "study_every": args.study_every,
        "grad_error_methods": methods or DEFAULT_GRAD_ERROR_METHODS,
        "grad_error_ratios": tuple(args.grad_error_ratios) if args.grad_error_ratios else None,
    }


def _dest(flag: str) -> str:
    """argparse's attribute name of a ``--long-flag``."""
    return flag.removeprefix("--").replace("-", "_")


def lr_schedule(base_lr: float, total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """Learning rate at a 0-based step: linear warm-up to ``base_lr``, then cosine decay to 0."""

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return base_lr * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * base_lr * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return lr_at


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1000) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on (x, y), in eval mode."""
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        loss += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    model.train()
    return correct / x.shape[0], loss / x.shape[0]


@contextmanager
def distributed() -> Iterator[torch.device]:
    """Join torchrun's process group if launched by torchrun (NCCL on GPU, gloo on CPU); yield the device.

    Without torchrun (no ``RANK`` in the environment) nothing is joined and the device is the
    GPU if there is one, else the CPU. The process group is destroyed on exit.
    """
    if "RANK" not in os.environ:
        yield torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        yield device
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


def write_config(path: str | Path, cfg: RunConfig) -> None:
    """Write ``cfg``'s fields as a JSON object (tuples as lists)."""
    Path(path).write_text(json.dumps(asdict(cfg), indent=2) + "\n")


def make_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The run's optimizer: momentum SGD with weight decay (its lr is set every step by the schedule)."""
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_preconditioner(
    model: nn.Module, cfg: RunConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int
) -> hylo.HyLoPreconditioner | None:
    """hylo with the run's options (``None`` for plain runs); ``kl_clip`` reads the optimizer's scheduled lr."""
    if cfg.solver is None:
        return None
    return hylo.HyLoPreconditioner(
        model,
        solver=cfg.solver,
        update_freq=cfg.update_freq,
        damping=cfg.damping,
        factor_decay=cfg.factor_decay,
        kl_clip=cfg.kl_clip,
        lr=(lambda _step: optimizer.param_groups[0]["lr"]) if cfg.kl_clip is not None else None,
        rank_ratio=cfg.rank_ratio,
        strategy=cfg.strategy,
        adaptive=cfg.adaptive,
        iters_per_epoch=steps_per_epoch if cfg.adaptive is not None else None,
        conv_rows=cfg.conv_rows,
        kis_estimator=cfg.kis_estimator,
        factor_update_freq=cfg.factor_update_freq,
        seed=cfg.seed,
        profile_dir=cfg.log_dir if cfg.profiling else None,
        studies=cfg.studies,
        rank_every=cfg.study_every,
        grad_error_every=cfg.study_every,
        grad_error_methods=cfg.grad_error_methods,
        grad_error_ratios=cfg.grad_error_ratios,
    )


def _global_mean(total: float, count: int, world: int, device: torch.device) -> float:
    """``total / count`` summed over all ranks."""
    if world == 1:
        return total / count
    both = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(both)
    return float(both[0] / both[1])


def train(
    cfg: RunConfig,
    data: Split | None = None,
    *,
    device: torch.device | None = None,
    csv_path: str | Path | None = None,
    verbose: bool = False,
) -> RunResult:
    """Train ``cfg`` on ``data`` (default: its dataset, split with ``cfg.data_seed``), evaluating every epoch.

    Runs on one process, or under DDP on every rank of an initialised process group. Rank 0
    alone prints (with ``verbose``: hylo's summary and one line per epoch) and rewrites
    ``csv_path`` with one row per finished epoch. With ``cfg.log_dir`` the directory is created,
    rank 0 writes ``config.json`` there (once hylo has accepted the directory) and ``csv_path``
    defaults to ``<log_dir>/metrics.csv``; hylo's profile files go there too (``cfg.profiling``).
    """
    rank, world = rank_and_world()
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} must be divisible by the number of ranks {world}")
    device = device or torch.device("cpu")
    data = data if data is not None else load_dataset(cfg.dataset, cfg.data_seed)
    x_train, y_train = data.x_train.to(device), data.y_train.to(device)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)
    n_train = x_train.shape[0]
    steps_per_epoch = n_train // cfg.batch_size  # drop the last partial batch
    if steps_per_epoch < 1:
        raise ValueError(f"batch size {cfg.batch_size} exceeds the {n_train} training images")
    lr_at = lr_schedule(cfg.lr, steps_per_epoch * cfg.epochs, round(cfg.warmup_epochs * steps_per_epoch))

    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model).to(device)
    model = net
    if world > 1:
        model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(model, cfg)
    if cfg.log_dir is not None:
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        if csv_path is None:
            csv_path = Path(cfg.log_dir) / "metrics.csv"
    pre = make_preconditioner(model, cfg, optimizer, steps_per_epoch)
    if cfg.log_dir is not None and rank == 0:
        write_config(Path(cfg.log_dir) / "config.json", cfg)
    if pre is not None and verbose and rank == 0:
        print(pre.summary(), flush=True)

    local = cfg.batch_size // world
    order_gen = torch.Generator().manual_seed(cfg.seed + 1)
    log: list[EpochLog] = []
    step = 0
    done = False
    start = time.perf_counter()
    try:
        for epoch in range(cfg.epochs):
            perm = torch.randperm(n_train, generator=order_gen)
            running, seen = 0.0, 0
            for i in range(steps_per_epoch):
                idx = perm[i * cfg.batch_size : (i + 1) * cfg.batch_size][rank * local : (rank + 1) * local]
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
                loss.backward()
                if pre is not None:
                    pre.step()
                optimizer.step()
                running += float(loss.detach()) * idx.numel()
                seen += idx.numel()
                step += 1
                done = cfg.max_steps is not None and step >= cfg.max_steps
                if done:
                    break
            train_loss = _global_mean(running, seen, world, device)
            test_acc, test_loss = evaluate(net, x_test, y_test)
            entry = EpochLog(epoch, step, train_loss, test_loss, test_acc, time.perf_counter() - start, world)
            log.append(entry)
            if rank == 0:
                if verbose:
                    print(
                        f"epoch {epoch} step {step} loss {train_loss:.4f} test_acc {test_acc:.4f} "
                        f"time {entry.seconds:.1f}s ranks {world}",
                        flush=True,
                    )
                if csv_path is not None:
                    write_rows(csv_path, [asdict(e) for e in log])
            if done:
                break
    finally:
        if pre is not None:
            pre.remove()
    return RunResult(cfg, log, time.perf_counter() - start)
