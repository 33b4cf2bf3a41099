"""hylo's coverage of each model family and the loss of its optimizer form against plain AdamW
(docs/models.md, "Model families").

Example:
    python scripts/bench_models.py
    python scripts/bench_models.py --families GPT-2 Mamba --steps 20
    python scripts/bench_models.py --vision
    python scripts/bench_models.py --grid grid.csv                 # real data, every lr and seed
    python scripts/bench_models.py --grid grid.csv --quick         # one family, lr and seed, 5 steps
    python scripts/bench_models.py --tables grid-*.csv             # the grid's tables from its rows
    python scripts/bench_models.py --grid grafted.csv --graft      # the same with the form grafted
    python scripts/bench_models.py --tables grafted.csv --against grid.csv   # grafted against the plain form

``--vision`` runs the vision families of :mod:`hylo_scripts.models.vision_families` instead (docs/models.md, "Vision
families"): those of torchvision only where it imports, the reason it does not printed otherwise.
With ``--grid`` the benchmark answers "better than AdamW at my learning rate?" on real data
(:mod:`hylo_scripts.benchmarks.model_grid`): every family real data here can feed, at every lr of ``--lrs`` and seed of
``--seeds``, AdamW against the optimizer form, steps interleaved, rows appended to the CSV as each run ends.
``--device cuda`` trains on a GPU (default: cuda when available): the tables' runs and the grid's, its steps timed
between two device synchronisations; the device heads the output (the grid's: under its tables) and the grid's rows.

For every family of :mod:`hylo_scripts.models.model_families` (tiny models built from their ``transformers`` configs),
the first table gives the layers hylo registers; its coverage (``pre.coverage()``: the share of the trainable
matrix elements it preconditions) and the same with the documented exclusions (tied matrices and Hugging Face's
position tables) taken out of the total; the share whose gradient its step actually rewrote, at one step or more
(observed by comparing ``.grad`` before and after each step); what it leaves alone, by reason, as shares of the total; and the mean
held-out loss at the start and after ``--steps`` steps of ``torch.optim.AdamW(lr)`` and of
``hylo.HyLoOptimizer(model, AdamW(lr))`` at its defaults, from the same weights on the same batches. The second
table puts what hylo leaves alone in each tiny model beside the same in its full-size model (built on the meta
device: the shares without the memory). Warnings hylo gives while training are listed under the tables.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import hylo
from hylo_scripts.benchmarks import model_grid
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.benchmarks.flags import add_device
from hylo_scripts.models.model_families import EXCLUDED, FAMILIES, HELD_OUT, Family, batch_on
from hylo_scripts.models.vision_families import TORCHVISION, VISION_FAMILIES, torchvision_missing

#: Every family by name: the language, speech and ViT families, then the vision ones.
ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **VISION_FAMILIES}
#: Where the runs train unless told.
CPU = torch.device("cpu")


def excluding(coverage: hylo.Coverage) -> float:
    """The preconditioned share of the trainable matrix elements once the documented exclusions (:data:`EXCLUDED`)
    are out of the total."""
    excluded = sum(count for why, count in coverage.left_alone if why in EXCLUDED)
    rest = coverage.total - excluded
    return coverage.preconditioned / rest if rest else 1.0


def left_alone(coverage: hylo.Coverage) -> str:
    """What ``coverage`` leaves alone, by reason, as percentages of its total ("-" for nothing)."""
    return ", ".join(f"{why} {100 * count / coverage.total:.1f}%" for why, count in coverage.left_alone) or "-"


def matrices(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's trainable matrix parameters (two or more dimensions), each once, by name."""
    found: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.requires_grad and p.dim() >= 2 and id(p) not in seen:
            seen.add(id(p))
            found[name] = p
    return found


def held_out_loss(model: nn.Module, family: Family, device: torch.device = CPU) -> float:
    """The mean loss over the held-out batches (:data:`HELD_OUT`, on ``device``), without gradients (hylo captures
    nothing)."""
    with torch.no_grad():
        losses = (float(family.loss(model, batch_on(family.batch(step), device))) for step in HELD_OUT)
        return sum(losses) / len(HELD_OUT)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    family: Family,
    steps: int,
    device: torch.device = CPU,
) -> None:
    """``steps`` steps on the family's batches 0, 1, … on ``device``."""
    for step in range(steps):
        optimizer.zero_grad()
        family.loss(model, batch_on(family.batch(step), device)).backward()
        optimizer.step()


@dataclass(frozen=True)
class Row:
    """One family's measurements."""

    family: str
    layers: int
    coverage: hylo.Coverage
    #: The share of the trainable matrix elements whose gradient hylo's step rewrote at one step or more.
    rewritten: float
    start: float
    adamw: float
    hylo: float
    warned: tuple[str, ...]


def measure(family: Family, steps: int, lr: float, device: torch.device = CPU) -> Row:
    """Build the family's tiny model on ``device``, attach ``HyLoOptimizer`` at its defaults and train it and a copy
    under AdamW for ``steps`` steps at ``lr``."""
    base = family.model().to(device)
    start = held_out_loss(base, family, device)
    plain = copy.deepcopy(base)
    adamw = functools.partial(torch.optim.AdamW, lr=lr)
    train(plain, adamw([p for p in plain.parameters() if p.requires_grad]), family, steps, device)
    model = copy.deepcopy(base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hylo.HyLoOptimizer(model, adamw)
        pre = opt.preconditioner
        weights = matrices(model)
        rewritten: set[str] = set()
        inner = pre.step

        def observed() -> None:
            """hylo's step, noting the matrices whose gradient it rewrote."""
            before = {name: p.grad.clone() for name, p in weights.items() if p.grad is not None}
            inner()
            after = {name: p.grad for name, p in weights.items() if p.grad is not None}
            rewritten.update(name for name, grad in before.items() if not grad.equal(after[name]))

        pre.step = observed  # type: ignore[method-assign]
        train(model, opt, family, steps, device)
    coverage = pre.coverage()
    warned = tuple(
        dict.fromkeys(
            str(w.message).split(". Warned")[0]
            for w in caught
            if issubclass(w.category, UserWarning) and "hylo leaves" not in str(w.message)
        )
    )
    return Row(
        family.name,
        len(pre.layer_info()),
        coverage,
        sum(weights[name].numel() for name in rewritten) / coverage.total if coverage.total else 1.0,
        start,
        held_out_loss(plain, family, device),
        held_out_loss(model, family, device),
        warned,
    )


def table(rows: Sequence[Row]) -> str:
    """The markdown table of :func:`measure`'s rows."""
    lines = [
        "| family | layers | coverage | excl. exclusions | rewritten | left alone (share of matrix elements) "
        "| loss at start | AdamW | HyLoOptimizer |",
        "|---|--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.family} | {row.layers} | {100 * row.coverage.share:.1f}% | {100 * excluding(row.coverage):.1f}% "
            f"| {100 * row.rewritten:.1f}% | {left_alone(row.coverage)} | {row.start:.3f} | {row.adamw:.3f} "
            f"| {row.hylo:.3f} |"
        )
    return "\n".join(lines)


def proportions(families: Sequence[Family]) -> str:
    """The markdown table of what hylo leaves alone in each tiny model and in its full-size model."""
    lines = [
        "| family | full size | left alone (tiny) | left alone (full size) | excl. exclusions (tiny) "
        "| excl. exclusions (full size) |",
        "|---|---|---|---|--:|--:|",
    ]
    for family in families:
        tiny = _coverage(family.model())
        full = _coverage(family.full())
        lines.append(
            f"| {family.name} | {family.full_name} | {left_alone(tiny)} | {left_alone(full)} "
            f"| {100 * excluding(tiny):.1f}% | {100 * excluding(full):.1f}% |"
        )
    return "\n".join(lines)


def _coverage(model: nn.Module) -> hylo.Coverage:
    """hylo's coverage of ``model`` as registered (no step: a meta-device model works; no memory budget)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = hylo.HyLoPreconditioner(model, kfac_max_state_mb=None)
    coverage = pre.coverage()
    pre.remove()
    return coverage


def main(argv: list[str] | None = None, *, out: Callable[[str], None] = print) -> None:
    """Print the two tables and the warnings."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(ALL_FAMILIES), metavar="FAMILY")
    parser.add_argument("--vision", action="store_true", help="the vision families (torchvision's where it imports)")
    parser.add_argument("--steps", type=int, help="training steps of each run (100; the grid's 150)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (both runs)")
    parser.add_argument("--threads", type=int, default=2)
    add_device(parser, "cpu or cuda[:N] (default: cuda if any): where the runs train (not --tables)")
    parser.add_argument("--grid", type=Path, metavar="CSV", help="run the real-data grid, appending its rows here")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(model_grid.LRS), help="the grid's lrs")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(model_grid.SEEDS), help="the grid's seeds")
    parser.add_argument("--quick", action="store_true", help="the grid on GPT-2 at lr 3e-3, seed 0, 5 steps")
    parser.add_argument("--graft", action="store_true", help="the grid's form with graft=True (docs/usage.md)")
    parser.add_argument("--against", type=Path, nargs="+", metavar="CSV", help="with --tables: the plain grid's rows")
    parser.add_argument("--tables", type=Path, nargs="+", metavar="CSV", help="print the grid's tables of these rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tables:
        grid_rows = model_grid.read_rows(args.tables)
        against = args.against and model_grid.read_rows(args.against)
        out(model_grid.grafting_tables(against, grid_rows) if against else model_grid.tables(grid_rows))
        return
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft calls a deprecated transformers method
    logging.getLogger("peft").setLevel(logging.ERROR)
    names = list(VISION_FAMILIES) if args.vision else args.families
    missing = torchvision_missing() if TORCHVISION & set(names) else None
    if missing is not None and args.vision:
        names = [name for name in names if name not in TORCHVISION]
    families = [ALL_FAMILIES[name] for name in names]
    if args.grid is not None:
        quick = args.quick
        model_grid.measure(
            [FAMILIES["GPT-2"]] if quick else families,
            [3e-3] if quick else args.lrs,
            [0] if quick else args.seeds,
            5 if quick else args.steps or model_grid.STEPS,
            args.grid,
            args.graft,
            args.device,
        )
        out(model_grid.tables(model_grid.read_rows([args.grid])))
        out(f"device: {describe(args.device)} (this run's rows)")
        return
    steps = args.steps or 100
    rows = [measure(family, steps, args.lr, args.device) for family in families]
    out(
        f"device: {describe(args.device)}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} threads; {steps} steps at lr {args.lr:g}; losses: mean over {len(HELD_OUT)} held-out batches"
    )
    if missing is not None and args.vision:
        out(f"torchvision does not import here ({missing}): its families were not run")
    out("")
    out(table(rows))
    out("")
    out(proportions(families))
    for row in rows:
        for message in row.warned:
            out(f"\n{row.family}: {message}")
