"""The tensor operations a step dispatches: hylo's step between updates and its update step, per solver, beside
the model's forward and backward and KAISA's step (docs/benchmarks.md, "Operations per step").

Example:
    python scripts/bench_ops.py --model transformer --layers 2 --width 128 --image-size 64 --batch-size 32 \
        --solvers kfac kfac_adam hybrid sngd kaisa --set kfac_method=inverse
    python scripts/bench_ops.py --model resnet32 --batch-size 8 --image-size 32

Every aten operation dispatched inside ``step()`` is counted with a
:class:`torch.utils._python_dispatch.TorchDispatchMode` (views and metadata-only operations excluded: they launch
no kernel): a deterministic count, the number of kernels a GPU would launch at most, which does not depend on the
machine or its load. The model runs ``--warmup`` iterations first (a step after the first update, so that every
layer holds a state), then one update step and one step between updates are counted, ``--update-freq`` apart;
``fwd+bwd`` is the model's forward, loss and backward, counted the same way. ``kaisa`` among ``--solvers`` counts
KAISA's (kfac-pytorch's ``KFACPreconditioner``, when installed) step between its updates. ``--model stack
--layers N`` counts N equal Linear(64, 64) layers: how the cost grows with the layers. ``--by-op`` also prints
the operations of each step between updates by name, most frequent first. ``--device cuda`` counts on a GPU: the
same operations, each a kernel launch there. Under ``torchrun`` every rank counts its own step on the same batch
under DDP, or with ``--shard`` each block and the model ``fully_shard``-ed (FSDP2); rank 0 prints its counts.
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hylo
from hylo_scripts.benchmarks.bench_overhead import KAISA, placed, workload
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.benchmarks.flags import add_device, hylo_option
from hylo_scripts.benchmarks.peers import kaisa_preconditioner
from hylo_scripts.models.registry import model_names
from hylo_scripts.training.process import distributed, rank_and_world

#: ``--model``'s name for a stack of ``--layers`` equal Linear(64, 64) layers (the shape of the cost in layers).
STACK = "stack"


def stack(layers: int, batch: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, bool]:
    """``layers`` equal Linear(64, 64) layers with tanh between (seed 0), a random batch and class targets."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())])
    return model, torch.randn(batch, 64), torch.randint(0, 64, (batch,)), False


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active, by name; views and metadata-only operations
    (``aten.view``, ``aten.t``, ``aten.detach``, ...: tagged ``view_copy``-able or ``pointwise``-free) excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not _is_view(func):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Operations counted."""
        return sum(self.counts.values())


def _is_view(func: Any) -> bool:
    """Whether ``func`` only makes a view or reads metadata (no kernel)."""
    schema = func._schema
    returns_alias = bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )
    return returns_alias or func.overloadpacket.__name__ in ("detach", "lift_fresh", "_unsafe_view")


def count(run: Callable[[], Any]) -> OpCounter:
    """The operations ``run()`` dispatches."""
    with OpCounter() as counter:
        run()
    return counter


def step_counts(
    model_name: str,
    solver: str,
    batch: int,
    update_freq: int,
    image: int | None,
    *,
    classes: int | None = None,
    model_options: Mapping[str, int] | None = None,
    options: Mapping[str, Any] | None = None,
    warmup: int = 2,
    device: torch.device | None = None,
    shard: bool = False,
) -> tuple[OpCounter, OpCounter, OpCounter]:
    """(forward+backward, update step, step between updates) operation counts of ``solver`` (or :data:`KAISA`) on
    the workload of :func:`hylo_scripts.benchmarks.bench_overhead.workload` on ``device`` (default CPU), after ``warmup``
    iterations. In a process group of P > 1 ranks (every rank fed the same batch) the model is wrapped in DDP, or
    with ``shard`` each block and then the model is ``fully_shard``-ed (FSDP2):
    :func:`hylo_scripts.benchmarks.bench_overhead.placed`."""
    if model_name == STACK:
        model, x, y, lm = stack((model_options or {}).get("layers", 4), batch)
    else:
        model, x, y, lm = workload(model_name, batch, image, classes, model_options)
    device = device or torch.device("cpu")
    model, x, y = model.to(device), x.to(device), y.to(device)
    model = placed(model, shard)

    def loss() -> None:
        out = model(x)
        target = (out.flatten(0, 1), y.flatten()) if lm else (out, y)
        torch.nn.functional.cross_entropy(*target).backward()

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if solver == KAISA:
        pre: Any = kaisa_preconditioner(model, opt, update_freq)
    else:
        pre = hylo.HyLoPreconditioner(
            model, **{"solver": solver, "update_freq": update_freq, "damping": 0.03, **(options or {})}
        )
    try:
        iteration = 0
        fwd_bwd = update = between = OpCounter()
        # iterations until the next update, then the update step, then the step after it (between updates)
        while True:
            opt.zero_grad()
            is_update = iteration % update_freq == 0 and iteration >= warmup
            counted = is_update or (iteration % update_freq == 1 and iteration > warmup)
            if counted and not is_update:
                fwd_bwd = count(loss)
            else:
                loss()
            if is_update:
                update = count(pre.step)
            elif counted:
                between = count(pre.step)
                return fwd_bwd, update, between
            else:
                pre.step()
            opt.step()
            iteration += 1
    finally:
        if isinstance(pre, hylo.HyLoPreconditioner):
            pre.remove()


def main() -> None:
    """Print each solver's operations per step between updates and per update step."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=[*model_names(), *model_names("lm"), "llama", STACK])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=None, help="input side, a language model's T")
    parser.add_argument("--vocab", type=int, default=None, help="a language model's vocabulary")
    for size in ("layers", "width", "heads"):
        parser.add_argument(f"--{size}", type=int, default=None, help=f"the model's {size} (models that take it)")
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="iterations before the counted update step")
    parser.add_argument(
        "--solvers", nargs="+", default=["kfac", "kfac_adam", "hybrid", "sngd", "kaisa"], help="hylo solvers, kaisa"
    )
    parser.add_argument("--set", nargs="+", type=hylo_option, default=[], metavar="KEY=VALUE", help="hylo options")
    parser.add_argument("--by-op", action="store_true", help="list each step's operations by name")
    parser.add_argument(
        "--shard", action="store_true", help="under torchrun: fully_shard each layer and the model (FSDP2), not DDP"
    )
    add_device(parser, "cpu or cuda[:N] (default: cuda if any); the counts are the same on either")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="hylo leaves")
    torch.set_num_threads(1)
    sizes = {k: getattr(args, k) for k in ("layers", "width", "heads") if getattr(args, k) is not None}
    with distributed("gloo" if args.device.type == "cpu" else "auto") as device:
        if rank_and_world()[1] > 1:  # under torchrun: this rank's device
            args.device = device if args.device.type != "cpu" else args.device
        _report(args, sizes)


def _report(args: argparse.Namespace, sizes: Mapping[str, int]) -> None:
    """Count and print every solver's steps (rank 0 prints, under torchrun: its own counts)."""
    rank, world = rank_and_world()
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"device: {describe(args.device)}")
    ranks = "" if world == 1 else f"; rank 0 of {world} ({'FSDP2' if args.shard else 'DDP'})"
    say(f"model {args.model}, batch {args.batch_size}, update_freq {args.update_freq}; aten operations per step{ranks}")
    say(f"{'solver':<12} {'between':>8} {'update':>8} {'fwd+bwd':>8}")
    for solver in args.solvers:
        try:
            fwd_bwd, update, between = step_counts(
                args.model,
                solver,
                args.batch_size,
                args.update_freq,
                args.image_size,
                classes=args.vocab,
                model_options=sizes,
                options=dict(args.set),
                warmup=args.warmup,
                device=args.device,
                shard=args.shard,
            )
        except ImportError as err:
            say(f"{solver:<12} not installed: {err}")
            continue
        say(f"{solver:<12} {between.total:>8} {update.total:>8} {fwd_bwd.total:>8}", flush=True)
        if args.by_op:
            say("    " + ", ".join(f"{name} {n}" for name, n in between.counts.most_common()))
