"""hylo on mixture-of-experts models: what it preconditions, what its step costs, and how it trains beside AdamW,
Muon and SOAP.

Example:
    python scripts/bench_moe.py
    python scripts/bench_moe.py --parts coverage cost --cost-steps 12
    python scripts/bench_moe.py --parts race --steps 300 --out runs/moe

The models are :mod:`hylo_scripts.models.moe`'s, Hugging Face's Mixtral and Qwen2-MoE built from their configs, whose
experts are fused 3-D parameters (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), and the Mixtral's linear
twin (one ``nn.Linear`` per expert and projection: the same weights, the same function). hylo runs as
``hylo.HyLoOptimizer(model, AdamW)`` at its defaults; parameters it does not precondition stay with AdamW, and the
tables report what it did, whether or not it preconditions the fused experts.

- **coverage**: the tiny Mixtral and Qwen2-MoE (the builders' defaults: width 32, 2 blocks, 4 experts, top-2) and
  the Mixtral's linear twin, as registered: the layers hylo registers; ``pre.coverage().share``, and the same with
  the documented exclusions out of the total; the trainable matrix parameters (two or more dimensions: a 3-D stack
  of experts is one) whose gradients it rewrites (``pre.parameters()``) of all of them, and of the 3-D ones; what
  it leaves alone, by reason, as shares of the matrix elements.
- **cost**: a small Mixtral (``--width``, ``--layers``, ``--experts``, ``--expert-width``; top-2), fused and as its
  linear twin, each under plain ``torch.optim.AdamW`` and under hylo, from the same weights on the same random
  batches of ``--batch-size`` × ``--seq-len`` byte ids, the four runs interleaved (after ``--warmup`` steps of each,
  ``--cost-rounds`` rounds in which each takes its next ``--cost-steps`` / ``--cost-rounds`` steps in turn, so that a
  drift in the machine's speed reaches all alike): the median ms of a step (zero_grad, forward, backward, step) over
  the ``--cost-steps`` timed steps and their mean (hylo's updates amortised: a multiple of ``update_freq``, 3 at
  hylo's AdamW defaults, gives whole cycles), each against AdamW's on the same form of the model; the median of the steps between hylo's updates and of its update steps (``pre.steps % update_freq ==
  0``, where it captures and solves); and the MB the optimizers' state and hylo (``memory_breakdown()``: states and
  bookkeeping) hold after the last step.
- **race**: the same Mixtral, byte-level, trained ``--steps`` steps on the Python standard library's source
  (:mod:`hylo_scripts.data.text`: its training split cut at 4 MB, its validation split at 0.4 MB) from the same weights on the same batches, under
  each of ``--methods`` at one lr (``--lr-*``; weight decay 0.01): AdamW; Muon
  (:class:`~hylo_scripts.benchmarks.peers.Float32Muon`) on the hidden 2-D matrices (attention, routers) and, through
  :class:`ExpertMuon`, on every expert's matrix of the 3-D stacks (each orthogonalised on its own, as a matrix of
  its own: ``torch.optim.Muon`` refuses 3-D parameters), AdamW at ``--lr-adamw`` on the rest (embedding, head,
  norms); SOAP (``pytorch_optimizer.SOAP``, its preconditioner every 10 steps) on every parameter, the 3-D stacks
  as they are (it takes them: one eigenbasis per dimension, the expert dimension included, so its basis mixes the
  experts' coordinates); hylo (``hylo.HyLoOptimizer(model, AdamW)``, with ``--set``'s options here and in the cost
  part). Reported: the held-out loss (nats per byte, the mean over ``--eval-windows`` fixed
  validation windows) at step 0, every ``--eval-every`` steps and at the end, and each method's training seconds
  (evaluations excluded).

``--device cuda`` runs every part on a GPU (default: cuda when available), the models, batches and optimizer states
there, each timed step between two device synchronisations; the first line names the device. Tables are markdown;
``--out DIR`` also writes ``coverage.csv``, ``cost.csv`` and ``race.csv`` (the curves: one row per method and
evaluation) there, each with a ``device`` column. Warnings given during the runs, other than hylo's list of what it
leaves alone (the coverage table has it), are listed under the tables.
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo_scripts.benchmarks import peers, timing
from hylo_scripts.benchmarks.bench_models import excluding, left_alone, matrices
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.benchmarks.flags import add_device, hylo_option
from hylo_scripts.benchmarks.peers import Float32Muon, muon_matrices
from hylo_scripts.data.text import VOCAB, TokenWindows, read_corpus, stdlib_files, stdlib_root
from hylo_scripts.models.moe import TOP_K, fused_experts, linear_twin, mixtral, qwen2_moe
from hylo_scripts.training.optimizers import combine
from hylo_scripts.training.rundir import write_rows

PARTS = ("coverage", "cost", "race")
#: The race's methods.
METHODS = ("AdamW", "Muon", "SOAP", "hylo")
#: The weight decay of every optimizer of the race (AdamW's default).
WEIGHT_DECAY = 0.01
#: The cap on the race's training bytes (the validation split's: a tenth of it).
MAX_BYTES = 4_000_000
#: Where the runs go unless told (random draws and the race's window indices stay on it whatever the device).
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Size:
    """The Mixtral of the cost and race parts, and its batches."""

    width: int
    layers: int
    experts: int
    expert_width: int
    batch: int
    seq: int

    def model(self) -> nn.Module:
        """The Mixtral at this size, from seed 0."""
        torch.manual_seed(0)
        return mixtral(self.width, self.layers, self.experts, self.expert_width, self.seq)

    def line(self) -> str:
        """The size in words."""
        return (
            f"Mixtral of width {self.width}, {self.layers} blocks, {self.experts} experts (top-{TOP_K}) of width "
            f"{self.expert_width}; batches of {self.batch} × {self.seq} tokens"
        )


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The mean cross-entropy of ``model``'s next-token logits on ``x`` against ``y``."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Notes:
    """Warnings given during the runs, as "where: message": each kind once (its first message; a kind is the message
    without its numbers and bracketed lists, such as the step and the layers), with how often it came."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}
        self.count: Counter[str] = Counter()

    def add(self, line: str) -> None:
        """Note ``line``."""
        kind = re.sub(r"\[[^]]*\]|\{[^}]*\}|\d+", "#", line)
        self.first.setdefault(kind, line)
        self.count[kind] += 1

    @contextmanager
    def noted(self, where: str) -> Iterator[None]:
        """Note the UserWarnings given inside, hylo's "hylo leaves" aside (the coverage table has what it leaves)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught:
            message = str(w.message).split(". Warned")[0]
            if issubclass(w.category, UserWarning) and "hylo leaves" not in message:
                self.add(f"{where}: {message}")

    def lines(self) -> list[str]:
        """Each kind's first message, and how many more of its kind came."""
        more = {kind: f" ({self.count[kind] - 1} more like it)" if self.count[kind] > 1 else "" for kind in self.first}
        return [line + more[kind] for kind, line in self.first.items()]


def stacks_of(model: nn.Module) -> list[nn.Parameter]:
    """The 3-D expert parameters of ``model``'s fused experts."""
    return [p for _, experts in fused_experts(model) for p in experts.parameters() if p.dim() == 3]


# ---------------------------------------------------------------------------------------------------- coverage


@dataclass(frozen=True)
class CoverageRow:
    """What hylo preconditions in one model."""

    model: str
    layers: int
    coverage: hylo.Coverage
    matrices: int
    preconditioned: int
    stacks: int
    stacks_preconditioned: int

    def csv(self) -> dict[str, Any]:
        """The row as a CSV record."""
        return {
            "model": self.model,
            "layers": self.layers,
            "coverage": self.coverage.share,
            "excluding_exclusions": excluding(self.coverage),
            "matrices_preconditioned": self.preconditioned,
            "matrices": self.matrices,
            "stacks_preconditioned": self.stacks_preconditioned,
            "stacks": self.stacks,
            "left_alone": left_alone(self.coverage),
        }


def coverage_row(name: str, model: nn.Module, notes: Notes) -> CoverageRow:
    """``hylo.HyLoOptimizer(model, AdamW)`` at its defaults, as registered: its layers, its coverage and the matrix
    parameters whose gradients it rewrites."""
    with notes.noted(f"coverage, {name}"):
        pre = hylo.HyLoOptimizer(model, torch.optim.AdamW).preconditioner
    taken = {id(p) for p in pre.parameters()}
    weights = list(matrices(model).values())
    stacks = [p for p in weights if p.dim() == 3]
    row = CoverageRow(
        name,
        len(pre.layer_info()),
        pre.coverage(),
        len(weights),
        sum(id(p) in taken for p in weights),
        len(stacks),
        sum(id(p) in taken for p in stacks),
    )
    pre.remove()
    return row


def coverage_table(rows: Sequence[CoverageRow]) -> str:
    """The markdown table of :func:`coverage_row`'s rows."""
    lines = [
        "| model | layers | coverage | excl. exclusions | matrices preconditioned | 3-D experts preconditioned "
        "| left alone (share of matrix elements) |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.model} | {row.layers} | {100 * row.coverage.share:.1f}% | {100 * excluding(row.coverage):.1f}% "
            f"| {row.preconditioned} of {row.matrices} | {row.stacks_preconditioned} of {row.stacks} "
            f"| {left_alone(row.coverage)} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- cost


@dataclass(frozen=True)
class CostRow:
    """One configuration's timed steps and what its optimizers hold."""

    form: str
    optimizer: str
    times: tuple[float, ...]
    #: Whether each timed step was one of hylo's update steps (all False under AdamW).
    updates: tuple[bool, ...]
    optimizer_mb: float
    hylo_mb: float | None

    def median(self, update: bool | None = None) -> float:
        """The median seconds of the timed steps: all (None), the update steps (True) or the others (False)."""
        times = [t for t, u in zip(self.times, self.updates, strict=True) if update is None or u is update]
        return statistics.median(times) if times else float("nan")

    def mean(self) -> float:
        """The mean seconds of the timed steps (hylo's updates amortised over the steps between them)."""
        return statistics.fmean(self.times)


def is_update(pre: hylo.HyLoPreconditioner) -> bool:
    """Whether ``pre``'s next step is an update step (its step count a multiple of ``update_freq``)."""
    freq = pre.config.update_freq
    return pre.steps % (freq(pre.steps) if callable(freq) else freq) == 0


def state_mb(optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """MB of the tensors in the optimizers' state."""
    held = (v for o in optimizers for state in o.state.values() for v in state.values())
    return sum(v.numel() * v.element_size() for v in held if isinstance(v, Tensor)) / 2**20


def timed_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Sequence[Tensor]], device: torch.device = CPU
) -> Callable[[int], tuple[list[float], list[bool]]]:
    """A function stepping ``optimizer`` on the next ``k`` batches (cycling) and returning each step's seconds
    (between two synchronisations of ``device``) and whether it was one of hylo's update steps."""
    pre = optimizer.preconditioner if isinstance(optimizer, hylo.HyLoOptimizer) else None
    position = 0

    def steps(k: int) -> tuple[list[float], list[bool]]:
        nonlocal position
        times: list[float] = []
        updates: list[bool] = []
        for _ in range(k):
            x, y = batches[position % len(batches)]
            position += 1
            updates.append(pre is not None and is_update(pre))
            start = timing.now(device)
            optimizer.zero_grad()
            lm_loss(model, x, y).backward()
            optimizer.step()
            times.append(timing.now(device) - start)
        return times, updates

    return steps


def cost_row(
    form: str, name: str, optimizer: torch.optim.Optimizer, times: list[float], updates: list[bool]
) -> CostRow:
    """The row of one run's timed steps, with its optimizers' and hylo's memory."""
    if isinstance(optimizer, hylo.HyLoOptimizer):
        held = optimizer.preconditioner.memory_breakdown()
        return CostRow(
            form,
            name,
            tuple(times),
            tuple(updates),
            state_mb(optimizer.optimizers),
            (sum(held.state.values()) + held.bookkeeping) / 2**20,
        )
    return CostRow(form, name, tuple(times), tuple(updates), state_mb([optimizer]), None)


def cost_rows(
    size: Size,
    steps: int,
    warmup: int,
    lrs: dict[str, float],
    notes: Notes,
    *,
    rounds: int = 1,
    options: Mapping[str, Any] | None = None,
    device: torch.device = CPU,
) -> list[CostRow]:
    """AdamW and hylo (``hylo.HyLoOptimizer(model, AdamW, **options)``) on the fused Mixtral and on its linear twin,
    from the same weights on the same batches, interleaved: after ``warmup`` steps of each, ``rounds`` rounds in
    which every run takes its next ``steps // rounds`` steps in turn, so that a drift in the machine's speed reaches
    every run alike. Models and batches on ``device`` (the batches drawn on the CPU)."""
    base = size.model()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (warmup + steps, size.batch, size.seq + 1), generator=generator).to(device)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    forms: dict[str, Callable[[nn.Module], nn.Module]] = {"fused": copy.deepcopy, "linear twin": linear_twin}
    runs: dict[tuple[str, str], tuple[torch.optim.Optimizer, Callable[[int], tuple[list[float], list[bool]]]]] = {}
    for form, build in forms.items():
        for name in ("AdamW", "hylo"):
            model = build(base).to(device)
            adamw = functools.partial(torch.optim.AdamW, lr=lrs[name], weight_decay=WEIGHT_DECAY)
            with notes.noted(f"cost, {form}, {name}"):
                optimizer = (
                    adamw(model.parameters())
                    if name == "AdamW"
                    else hylo.HyLoOptimizer(model, adamw, **dict(options or {}))
                )
                runs[form, name] = optimizer, timed_steps(model, optimizer, batches, device)
    timed: dict[tuple[str, str], tuple[list[float], list[bool]]] = {key: ([], []) for key in runs}
    for _, step in runs.values():
        step(warmup)
    for _ in range(rounds):
        for key, (_, step) in runs.items():
            times, updates = step(steps // rounds)
            timed[key][0].extend(times)
            timed[key][1].extend(updates)
    rows = []
    for (form, name), (built, _) in runs.items():
        rows.append(cost_row(form, name, built, *timed[form, name]))
        if isinstance(built, hylo.HyLoOptimizer):
            built.preconditioner.remove()
    return rows


def cost_table(rows: Sequence[CostRow]) -> str:
    """The markdown table of :func:`cost_rows`'s rows (ms; "vs AdamW": against AdamW's median or mean on the same
    form of the model)."""
    plain = {row.form: row for row in rows if row.optimizer == "AdamW"}
    lines = [
        "| model | optimizer | median ms | vs AdamW | mean ms | vs AdamW | between updates ms | update steps ms "
        "| optimizer state MB | hylo MB |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        hylo_cells = "- | -" if row.hylo_mb is None else f"{1e3 * row.median(False):.1f} | {1e3 * row.median(True):.1f}"
        lines.append(
            f"| {row.form} | {row.optimizer} | {1e3 * row.median():.1f} | {row.median() / plain[row.form].median():.2f} "
            f"| {1e3 * row.mean():.1f} | {row.mean() / plain[row.form].mean():.2f} | {hylo_cells} | {row.optimizer_mb:.2f} | {'-' if row.hylo_mb is None else f'{row.hylo_mb:.2f}'} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- race


class ExpertMuon(Float32Muon):
    """:class:`~hylo_scripts.benchmarks.peers.Float32Muon` over 2-D ``matrices`` and over 3-D ``stacks`` of them (fused experts,
    [E, out, in]): each expert's matrix is a parameter of its own aliasing its slice of the stack, handed its slice
    of the stack's gradient before each step, so that Muon steps every expert as a matrix of its own (its own
    momentum, Newton–Schulz iteration and shape's lr adjustment)."""

    def __init__(
        self, matrices: Sequence[nn.Parameter], stacks: Sequence[nn.Parameter], lr: float, weight_decay: float
    ) -> None:
        self.stacks = [(stack, [nn.Parameter(piece) for piece in stack.detach().unbind(0)]) for stack in stacks]
        experts = [piece for _, pieces in self.stacks for piece in pieces]
        super().__init__([*matrices, *experts], lr=lr, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Hand each expert its slice of its stack's gradient, then Muon's step."""
        for stack, pieces in self.stacks:
            for e, piece in enumerate(pieces):
                piece.grad = None if stack.grad is None else stack.grad[e]
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the stacks' gradients with the matrices'."""
        super().zero_grad(set_to_none)
        for stack, _ in self.stacks:
            if set_to_none:
                stack.grad = None
            elif stack.grad is not None:
                stack.grad.zero_()


def race_optimizer(
    method: str, model: nn.Module, lrs: dict[str, float], options: Mapping[str, Any] | None = None
) -> torch.optim.Optimizer:
    """``method``'s optimizer over ``model`` (the module docstring says which parameters each one trains; hylo's
    with ``options``)."""
    adamw = functools.partial(torch.optim.AdamW, weight_decay=WEIGHT_DECAY)
    if method == "AdamW":
        return adamw(model.parameters(), lr=lrs["AdamW"])
    if method == "Muon":
        hidden, stacks = muon_matrices(model), stacks_of(model)
        taken = {id(p) for p in [*hidden, *stacks]}
        rest = [p for p in model.parameters() if id(p) not in taken]
        muon = ExpertMuon(hidden, stacks, lr=lrs["Muon"], weight_decay=WEIGHT_DECAY)
        return combine([muon, adamw(rest, lr=lrs["AdamW"])])
    if method == "SOAP":
        from pytorch_optimizer import SOAP

        soap: torch.optim.Optimizer = SOAP(
            model.parameters(), lr=lrs["SOAP"], weight_decay=WEIGHT_DECAY, precondition_frequency=10
        )
        return soap
    return hylo.HyLoOptimizer(model, functools.partial(adamw, lr=lrs["hylo"]), **dict(options or {}))


def experts_trained_by(method: str, optimizer: torch.optim.Optimizer, model: nn.Module) -> str:
    """What steps ``model``'s 3-D expert parameters under ``method`` (hylo: those it holds a state for at the end)."""
    if isinstance(optimizer, hylo.HyLoOptimizer):
        taken = {id(p) for p in optimizer.preconditioner.parameters(solved=True)}
        done = sum(id(p) in taken for p in stacks_of(model))
        return "hylo" if done == len(stacks_of(model)) else f"hylo on {done} of {len(stacks_of(model))}, AdamW"
    return {"AdamW": "AdamW", "Muon": "Muon, per expert", "SOAP": "SOAP, as 3-D tensors"}[method]


@dataclass(frozen=True)
class RaceRun:
    """One method's curve: (step, training seconds so far, held-out loss) at each evaluation."""

    method: str
    lr: float
    experts: str
    curve: tuple[tuple[int, float, float], ...]


def batch_of(data: TokenWindows, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The windows at ``indices`` as one batch: inputs and their next bytes."""
    xs, ys = zip(*data.__getitems__(list(indices)), strict=True)
    return torch.stack(xs), torch.stack(ys)


def race_run(
    method: str,
    base: nn.Module,
    train: TokenWindows,
    order: Tensor,
    held: tuple[Tensor, Tensor],
    every: int,
    lrs: dict[str, float],
    notes: Notes,
    options: Mapping[str, Any] | None = None,
    device: torch.device = CPU,
) -> RaceRun:
    """Train a copy of ``base`` under ``method`` on the windows of ``order`` (one row per step; batches moved to
    ``device``, where ``base`` and ``held`` are), evaluating on ``held`` at step 0, every ``every`` steps and at the
    end."""
    model = copy.deepcopy(base)

    def held_out() -> float:
        with torch.no_grad():  # hylo captures nothing without gradients
            return float(lm_loss(model, *held))

    curve = [(0, 0.0, held_out())]
    seconds = 0.0
    with notes.noted(f"race, {method}"):
        optimizer = race_optimizer(method, model, lrs, options)
        for step, indices in enumerate(order.tolist(), start=1):
            x, y = (t.to(device) for t in batch_of(train, indices))
            start = timing.now(device)
            optimizer.zero_grad()
            lm_loss(model, x, y).backward()
            optimizer.step()
            seconds += timing.now(device) - start
            if step % every == 0 or step == len(order):
                curve.append((step, seconds, held_out()))
    experts = experts_trained_by(method, optimizer, model)
    if isinstance(optimizer, hylo.HyLoOptimizer):
        optimizer.preconditioner.remove()
    return RaceRun(method, lrs[method], experts, tuple(curve))


def race(
    size: Size,
    methods: Sequence[str],
    steps: int,
    every: int,
    windows: int,
    lrs: dict[str, float],
    notes: Notes,
    options: Mapping[str, Any] | None = None,
    order_seed: int = 0,
    device: torch.device = CPU,
) -> list[RaceRun]:
    """Every method that can run here, from the same weights on the same batches of the stdlib corpus (hylo with
    ``options``), the training windows drawn in an order of seed ``order_seed`` (on the CPU), on ``device``."""
    root = stdlib_root()
    corpus = read_corpus(root, stdlib_files(root), MAX_BYTES)
    train = TokenWindows(corpus.train, size.seq)
    validation = TokenWindows(corpus.validation, size.seq).spread(windows)
    x, y = batch_of(validation, range(len(validation)))
    held = x.to(device), y.to(device)
    order = torch.randint(len(train), (steps, size.batch), generator=torch.Generator().manual_seed(order_seed))
    base = size.model().to(device)
    runs = []
    for method in methods:
        reason = peers.missing(peers.METHODS["soap"]) if method == "SOAP" else None
        if reason is not None:
            notes.add(f"race, {method}: skipped, {reason}")
            continue
        runs.append(race_run(method, base, train, order, held, every, lrs, notes, options, device))
    return runs


def race_table(runs: Sequence[RaceRun]) -> str:
    """The markdown table of the runs' held-out losses at each evaluation and their training seconds."""
    if not runs:
        return "(no method ran)"
    steps = [step for step, _, _ in runs[0].curve]
    lines = [
        "| method | lr | 3-D experts trained by | " + " | ".join(f"step {s}" for s in steps) + " | seconds |",
        "|---|--:|---|" + "--:|" * len(steps) + "--:|",
    ]
    for run in runs:
        losses = " | ".join(f"{loss:.3f}" for _, _, loss in run.curve)
        lines.append(f"| {run.method} | {run.lr:g} | {run.experts} | {losses} | {run.curve[-1][1]:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Print the tables of the chosen parts (module docstring) and, with ``--out``, write their CSV files."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="what to measure")
    parser.add_argument("--width", type=int, default=128, help="the cost and race Mixtral's width")
    parser.add_argument("--layers", type=int, default=2, help="its blocks")
    parser.add_argument("--experts", type=int, default=8, help="its experts per block (top-2)")
    parser.add_argument("--expert-width", type=int, default=256, help="its experts' MLP width")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (the model's context)")
    parser.add_argument("--cost-steps", type=int, default=36, help="timed steps of each cost run")
    parser.add_argument(
        "--cost-rounds", type=int, default=4, help="rounds the cost runs take their timed steps in, in turn"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each race run")
    parser.add_argument("--order-seed", type=int, default=0, help="the seed of the race's order of windows")
    parser.add_argument("--eval-every", type=int, default=50, help="race steps between evaluations")
    parser.add_argument("--eval-windows", type=int, default=32, help="held-out windows of the race's loss")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="the race's methods")
    for method, lr in zip(METHODS, (3e-3, 0.02, 3e-3, 3e-3), strict=True):
        parser.add_argument(f"--lr-{method.lower()}", type=float, default=lr, help=f"{method}'s lr (default {lr:g})")
    parser.add_argument(
        "--set", nargs="+", type=hylo_option, default=[], metavar="KEY=VALUE", help="hylo's options (cost and race)"
    )
    parser.add_argument("--threads", type=int, default=2)
    add_device(parser)
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="write the CSV files here")
    args = parser.parse_args(argv)
    if min(args.cost_rounds, args.steps, args.eval_every, args.eval_windows, args.batch_size, args.seq_len) < 1:
        parser.error("--cost-rounds, --steps, --eval-every, --eval-windows, --batch-size and --seq-len must be >= 1")
    if args.cost_steps < args.cost_rounds or args.cost_steps % args.cost_rounds:
        parser.error("--cost-steps must be a positive multiple of --cost-rounds")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    size = Size(args.width, args.layers, args.experts, args.expert_width, args.batch_size, args.seq_len)
    lrs = {method: getattr(args, f"lr_{method.lower()}") for method in METHODS}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    notes = Notes()
    device: torch.device = args.device
    where = describe(device)
    print(
        f"device: {where}, torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads"
    )
    if "coverage" in args.parts:
        torch.manual_seed(0)
        models = {"Mixtral": mixtral(), "Qwen2-MoE": qwen2_moe()}
        models["Mixtral, linear twin"] = linear_twin(models["Mixtral"])
        rows = [coverage_row(name, model.to(device), notes) for name, model in models.items()]
        print("\ncoverage: the tiny models, hylo.HyLoOptimizer(model, AdamW) at its defaults, as registered\n")
        print(coverage_table(rows))
        if args.out is not None:
            write_rows(args.out / "coverage.csv", [{**row.csv(), "device": where} for row in rows])
    if "cost" in args.parts:
        costs = cost_rows(
            size,
            args.cost_steps,
            args.warmup,
            lrs,
            notes,
            rounds=args.cost_rounds,
            options=dict(args.set),
            device=device,
        )
        print(
            f"\ncost: {size.line()}; {args.cost_steps} timed steps after {args.warmup}, in {args.cost_rounds} "
            f"interleaved rounds; hylo's options {dict(args.set)}\n"
        )
        print(cost_table(costs))
        if args.out is not None:
            write_rows(
                args.out / "cost.csv",
                [
                    {
                        "model": row.form,
                        "optimizer": row.optimizer,
                        "median_ms": 1e3 * row.median(),
                        "mean_ms": 1e3 * row.mean(),
                        "between_updates_ms": 1e3 * row.median(False),
                        "update_ms": 1e3 * row.median(True),
                        "update_steps": sum(row.updates),
                        "optimizer_state_mb": row.optimizer_mb,
                        "hylo_mb": "" if row.hylo_mb is None else row.hylo_mb,
                        "device": where,
                    }
                    for row in costs
                ],
            )
    if "race" in args.parts:
        runs = race(
            size,
            args.methods,
            args.steps,
            args.eval_every,
            args.eval_windows,
            lrs,
            notes,
            dict(args.set),
            args.order_seed,
            device,
        )
        print(
            f"\nrace: {size.line()}; {args.steps} steps on the stdlib's source, held-out loss (nats per byte) over "
            f"{args.eval_windows} windows\n"
        )
        print(race_table(runs))
        if args.out is not None:
            write_rows(
                args.out / "race.csv",
                [
                    {
                        "method": run.method,
                        "lr": run.lr,
                        "step": step,
                        "seconds": seconds,
                        "loss": loss,
                        "device": where,
                    }
                    for run in runs
                    for step, seconds, loss in run.curve
                ],
            )
    for note in notes.lines():
        print(f"\n{note}")
    return 0
