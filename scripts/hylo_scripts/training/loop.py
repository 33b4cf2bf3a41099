"""The training loop: one run of a :class:`~hylo_scripts.training.runconfig.RunConfig`, on one process or under DDP.

Every run — plain optimizer or optimizer + hylo, any task, one process or P ranks — goes through
:func:`train`: the model of the registry built from the seed's initial weights, the dataset of
the registry, a ``DistributedSampler`` over the training set (also on one process, so the batch
order depends on the seed alone), the optimizer, the learning-rate and damping schedules of
:mod:`hylo_scripts.training.schedules`, and, with a solver, hylo's ``step()`` between ``loss.backward()``
and ``optimizer.step()``. The task (:mod:`hylo_scripts.training.tasks`) gives the loss and the evaluation.

Seeds: ``seed`` draws the initial weights (and hylo's KIS rows); ``seed + 1`` the batch order
of every epoch (``DistributedSampler(seed=seed + 1).set_epoch(epoch)``); ``data_seed`` the
train/test split of the sets that have none and every sample's augmentation (a function of
data seed, epoch and index). ``batch_size`` is the global batch: each of the P ranks takes
B/P samples of every batch, and the union is the same B samples one process would take, so P
ranks see the same data in the same order as one process.

Outputs of a run with ``log_dir`` (rank 0 unless said otherwise): the files of
:mod:`hylo_scripts.training.rundir` (``config.json``, ``model-summary.txt``, ``dataset.json``,
``metrics.csv``); ``checkpoint-{N:04d}.pt`` (+ ``checkpoint-{N:04d}-hylo-r{rank}.pt`` on every
rank) every ``checkpoint_freq`` epochs and after the last one (see
:mod:`hylo_scripts.training.checkpoint`); with ``profiling`` or ``studies``, hylo's profile files (its
``profile_dir`` is ``log_dir``).

A ``log_dir`` that holds another run (a ``config.json``, ``metrics.csv``, hylo's files or a
checkpoint) is refused unless ``resume``: then the run continues from its latest checkpoint up
to ``epochs`` — model, optimizer, lr scheduler, hylo's state (its step, so its damping
schedule, and its generator), the sampler epoch and the RNG — and appends to ``metrics.csv``
and the profile files, cut back to what the checkpoint covers. Every file is checked on every
rank (hylo's state in a preconditioner that writes nothing) before anything is written; a run
that stopped before its first checkpoint starts again from scratch (docs/training-scripts.md,
"Checkpoints and resume").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import hylo
from hylo_scripts.data.registry import DataOptions, DataSplits, load_dataset
from hylo_scripts.models.registry import MODELS, build_model
from hylo_scripts.training import checkpoint
from hylo_scripts.training.hylo_options import ADAPTIVE
from hylo_scripts.training.optimizers import adapted_optimizer
from hylo_scripts.training.process import rank_and_world
from hylo_scripts.training.runconfig import RunConfig, preconditioner_options, run_defaults
from hylo_scripts.training.rundir import append_metrics, model_summary, write_run_files
from hylo_scripts.training.schedules import lr_factor
from hylo_scripts.training.tasks import TASKS


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


class Steppable(Protocol):
    """A preconditioner-like object of another library (e.g. KAISA's ``KFACPreconditioner``): ``step()`` rewrites
    the gradients in place between ``loss.backward()`` and ``optimizer.step()``, as hylo's does."""

    def step(self) -> Any:
        """Precondition the current gradients."""
        ...


#: ``train(optimizer_factory=...)``: the run's optimizer, built from the (possibly DDP-wrapped) model and the config.
OptimizerFactory = Callable[[nn.Module, RunConfig], torch.optim.Optimizer]
#: ``train(preconditioner_factory=...)``: a :class:`Steppable` built from the model and the run's optimizer.
PreconditionerFactory = Callable[[nn.Module, torch.optim.Optimizer], Steppable]
#: ``train(on_step=...)``: called on rank 0 after every optimizer step with the steps done, the run's total and the loss.
StepCallback = Callable[[int, int, torch.Tensor], None]


def _base_optimizer(params: Sequence[nn.Parameter], cfg: RunConfig, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_optimizer(model: nn.Module, cfg: RunConfig, adapted: Sequence[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """The run's optimizer: momentum SGD or AdamW, with weight decay (its lr is set by the schedule).

    ``adapted``: parameters whose preconditioned gradient is already the whole update direction (hylo's
    ``kfac_adam``, :func:`adapts`): SGD without momentum applies lr and weight decay to them (decoupled, as
    AdamW's), the run's optimizer at ``cfg.rest_lr`` (None: ``lr``) trains the others (docs/training-scripts.md,
    "Engine"; docs/usage.md, "Adaptive solvers").
    """
    if not adapted:
        return _base_optimizer(list(model.parameters()), cfg, cfg.lr)
    rest_lr = cfg.lr if cfg.rest_lr is None else cfg.rest_lr
    return adapted_optimizer(model, adapted, cfg.lr, cfg.weight_decay, lambda rest: _base_optimizer(rest, cfg, rest_lr))


def adapts(cfg: RunConfig) -> bool:
    """Whether the run's hylo solver gives the whole update direction (:data:`~hylo_scripts.training.hylo_options.ADAPTIVE`)."""
    return cfg.solver in ADAPTIVE


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: RunConfig, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step ``LambdaLR`` of :func:`hylo_scripts.training.schedules.lr_factor` (stepped after every ``optimizer.step()``)."""
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
    lr: Callable[[int], float],
    steps_per_epoch: int,
    *,
    profile_append: bool = False,
    record: bool = True,
) -> hylo.HyLoPreconditioner | None:
    """hylo with the run's options (``None`` for plain runs); ``kl_clip`` reads the scheduled ``lr`` of the step.

    The keyword arguments are :func:`hylo_scripts.training.runconfig.preconditioner_options`: the run's
    ``hylo`` options and the engine's; ``record=False`` leaves ``profile_dir`` and the studies out
    (nothing is written: the check of a checkpoint's state before a resume).
    """
    if cfg.solver is None:
        return None
    options = preconditioner_options(
        cfg,
        lr=lr,
        steps_per_epoch=steps_per_epoch,
        profile_append=profile_append,
    )
    if not record:
        options.update(profile_dir=None, profile_append=False, studies=())
    return hylo.HyLoPreconditioner(model, **options)


def _agree(error: checkpoint.RunError | None, world: int) -> None:
    """Raise ``error`` on its rank and a :class:`~hylo_scripts.training.checkpoint.RunError` naming the failed ranks on the
    others (one ``all_gather_object`` with P > 1 ranks), or return on every rank."""
    if world > 1:
        messages: list[str | None] = [None] * world
        dist.all_gather_object(messages, None if error is None else str(error))
        failed = [f"rank {rank}: {message}" for rank, message in enumerate(messages) if message is not None]
        if failed and error is None:
            raise checkpoint.RunError("; ".join(failed))
    if error is not None:
        raise error


def _shared(value: str, world: int) -> str:
    """Rank 0's ``value`` on every rank."""
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def evaluate(
    net: nn.Module, cfg: RunConfig, data: DataSplits, device: torch.device, *, batch_size: int | None = None
) -> tuple[float, float]:
    """Test loss and metric of ``net`` in eval mode, by the run's task (see :meth:`hylo_scripts.training.tasks.Task.evaluate`);
    ``batch_size`` (items per forward) defaults to the task's."""
    net.eval()
    try:
        return TASKS[cfg.task].evaluate(net, data, device, workers=cfg.workers, batch_size=batch_size)
    finally:
        net.train()


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


def train(
    cfg: RunConfig,
    data: DataSplits | None = None,
    *,
    device: torch.device | None = None,
    resume: bool = False,
    verbose: bool = False,
    optimizer_factory: OptimizerFactory | None = None,
    preconditioner_factory: PreconditionerFactory | None = None,
    on_step: StepCallback | None = None,
) -> RunResult:
    """Train ``cfg`` (on ``data``, default: its dataset), evaluating after every epoch; see the module docstring.

    Runs on one process, or under DDP on every rank of an initialised process group. Rank 0
    alone prints (with ``verbose``: the model and hylo summaries, a progress bar on a
    terminal, one line per epoch; ``on_step``, a :data:`StepCallback`, after every step) and writes the run's files.
    ``resume`` continues the run in ``cfg.log_dir`` from its latest checkpoint (a ``ValueError`` names what does not fit).

    Other optimizers (``scripts/bench_peers.py``; docs/benchmarks.md, "Peers"): ``optimizer_factory``
    builds the optimizer in place of :func:`make_optimizer` (``cfg.optimizer`` is then unused; the
    lr schedule scales every param group's own lr); ``preconditioner_factory`` builds a
    :class:`Steppable` stepped where hylo's ``step()`` is (and timed as its preconditioning time).
    Neither is saved in checkpoints, so both refuse ``checkpoint_freq`` and ``resume``, and the
    second refuses a ``cfg.solver`` (one preconditioner per run).
    """
    if optimizer_factory is not None or preconditioner_factory is not None:
        if resume or cfg.checkpoint_freq:
            raise ValueError("optimizer_factory and preconditioner_factory runs cannot checkpoint or resume")
        if preconditioner_factory is not None and cfg.solver is not None:
            raise ValueError(f"preconditioner_factory and hylo's solver {cfg.solver!r}: one preconditioner per run")
    rank, world = rank_and_world()
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} must be divisible by the number of ranks {world}")
    device = device or torch.device("cpu")
    error: checkpoint.RunError | None = None
    try:
        start = checkpoint.open_run_dir(
            cfg.log_dir,
            cfg.to_json(),
            resume=resume,
            world=world,
            device=device,
            rank=rank,
            hylo=cfg.solver is not None,
            defaults=run_defaults(),
        )
    except checkpoint.RunError as err:
        error, start = err, checkpoint.Start()
    _agree(error, world)  # every rank has looked at log_dir and can start, or none starts
    run_id = start.run_id or _shared(checkpoint.new_run_id(), world)
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
    task = TASKS[cfg.task]
    summary = (
        model_summary(net, data.input_shape, device, task.input_dtype) if rank == 0 and (verbose or log_dir) else None
    )
    if start.state is not None:
        net.load_state_dict(start.state["model"])
    model: nn.Module = net
    if world > 1:
        model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    built: list[torch.optim.Optimizer] = []  # the optimizer, made once hylo says which parameters it adapts

    def scheduled_lr(_step: int) -> float:
        return float(built[0].param_groups[0]["lr"])

    if start.hylo is not None:
        # hylo checks its state in a preconditioner that writes nothing, before anything is written
        probe = make_preconditioner(model, cfg, scheduled_lr, steps_per_epoch, record=False)
        assert probe is not None
        try:
            probe.load_state_dict(start.hylo)
        except ValueError as err:
            raise checkpoint.hylo_refused(start, err) from err
        finally:
            probe.remove()
    checkpoint.prepare(cfg.log_dir, start, rank)
    if world > 1:
        dist.barrier()  # the run directory is ready before hylo opens its files in it
    pre = make_preconditioner(model, cfg, scheduled_lr, steps_per_epoch, profile_append=start.state is not None)
    if optimizer_factory is not None:
        optimizer = optimizer_factory(model, cfg)
    else:
        optimizer = make_optimizer(model, cfg, pre.parameters() if pre is not None and adapts(cfg) else ())
    built.append(optimizer)
    scheduler = make_scheduler(optimizer, cfg, steps_per_epoch)
    other = preconditioner_factory(model, optimizer) if preconditioner_factory is not None else None
    metrics_path = log_dir / "metrics.csv" if log_dir is not None else None
    if start.state is not None:
        optimizer.load_state_dict(start.state["optimizer"])
        resume_schedule(scheduler, start.state["scheduler"])
        torch.set_rng_state(start.state["rng"].cpu())
        if pre is not None:
            assert start.hylo is not None
            pre.load_state_dict(start.hylo)
    if log_dir is not None and rank == 0:  # hylo has accepted log_dir: the run's files go in
        write_run_files(log_dir, cfg.to_json(), summary, data.info)
    if verbose and rank == 0:
        print(summary, flush=True)
        if data.info:
            print(f"dataset: {json.dumps(data.info)}", flush=True)
    if pre is not None and verbose and rank == 0:
        print(pre.summary(), flush=True)

    result = RunResult(cfg)
    stepper: Steppable | None = pre if pre is not None else other
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
                loss = task.loss(cfg, model(x), y)
                loss.backward()
                if stepper is not None:
                    clock.start()
                    stepper.step()
                    clock.stop()
                optimizer.step()
                scheduler.step()
                running += loss.detach().double()
                step += 1
                bar.update(1)
                if on_step is not None and rank == 0:
                    on_step(step, steps_per_epoch * cfg.epochs, loss.detach())
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
                        f"{task.metric} {test_metric:.4f} time {epoch_time:.1f}s ranks {world}",
                        flush=True,
                    )
                if metrics_path is not None:
                    append_metrics(metrics_path, cfg.task, entry)
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
                    run_id=run_id,
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
