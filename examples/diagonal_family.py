"""A solver family from user code, with an option and a statistic of its own, and no edit to hylo.

docs/extending.md, "Family options and statistics" walks through it. ``"diagonal"`` preconditions a layer by
the diagonal of its empirical Fisher: V̂ = ∇W / (diag F + λ)^p, with diag F = (1/n) Σ_i U_i ∘ U_i over the
per-sample gradients U_i. It brings:

- **its statistic**, :class:`SquaredGradients`: what each call's gradient hook reduces the call to, Σ_i U_i ∘ U_i
  (d_g × d_a numbers however many samples), computed from the layer's rows (:meth:`LayerMath.lowrank_rows`);
  hylo captures it only for runs whose config can give a layer this family;
- **its options**, :class:`DiagonalConfig` (``diag_exponent``, the p above): a section of
  :class:`hylo.HyLoConfig` (``HyLoConfig(diag_exponent=0.5)``, ``config.section("diagonal")``) that the family
  reads at an update as ``context.options(DiagonalConfig)``;
- **its state**, :class:`DiagonalState`: the scale (diag F + λ)^-p, saved in checkpoints with its exponent.

Everything it needs comes from :mod:`hylo.solvers`; registered with :func:`hylo.solvers.register_family`, it
takes part in everything the built-in families do: ``summary()``, ``decisions.csv``, the hybrid policy's cost
model, checkpoints and P ranks.

Run it: ``python examples/diagonal_family.py --out runs/diagonal`` trains a small MLP for a few steps with the
family on its hidden layers and K-FAC on its head, resumes the run from a checkpoint halfway, and prints the
summary and the decisions by solver read back from ``decisions.csv``.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.solvers import (
    CallStatistic,
    Contribution,
    CostEstimate,
    DenseRows,
    Exchange,
    FactoredRows,
    FamilyHandle,
    FamilyOptions,
    GradMatrix,
    LayerMath,
    LayerShape,
    LayerState,
    Payload,
    Rule,
    Section,
    SolverFamily,
    UpdateContext,
    UpdateJob,
    checked_tensors,
    option,
    positive_number,
    register_family,
)


class SquaredGradients(CallStatistic[Tensor]):
    """Σ_i U_i ∘ U_i over a call's per-sample gradients U_i (d_g × d_a); merged, divided by the samples: diag F."""

    name = "squared_gradients"

    def numbers(self, math: LayerMath, rows: int, kfac_rows: int) -> int:
        """d_g·d_a, whatever the call's size."""
        return math.d_a * math.d_g

    def of_call(self, math: LayerMath, x: Tensor, grad_out: Tensor, scale: float) -> Tensor:
        """The call's rows, squared and summed: (g²)ᵀ(a²) for factored rows g_i a_iᵀ, Σ U_i² for dense ones."""
        rows = math.lowrank_rows(x, grad_out, scale)
        if isinstance(rows, FactoredRows):
            return rows.g.square().mT @ rows.a.square()
        if isinstance(rows, DenseRows):
            return rows.u.square().sum(0)
        raise ValueError(f"the diagonal family needs factored or dense rows, got {type(rows).__name__}")

    def rescaled(self, math: LayerMath, value: Tensor, factor: float) -> Tensor:
        """Squares scale by ``factor``²."""
        return value * factor**2

    def merged(self, math: LayerMath, values: Sequence[Tensor], rows: int, kfac_rows: int) -> Tensor:
        """The calls' sums added, divided by the samples."""
        return torch.stack(list(values)).sum(0) / rows

    def empty(self, math: LayerMath) -> Tensor:
        """Zeros: a rank without rows adds nothing."""
        return torch.zeros(math.d_g, math.d_a, dtype=math.dtype, device=math.weight.device)

    def tensors(self, value: Tensor) -> list[Tensor]:
        """The one sum."""
        return [value]


#: The family's statistic (one instance: the hooks key captured calls by it).
SQUARED_GRADIENTS = SquaredGradients()


@dataclass(frozen=True)
class DiagonalConfig(Section):
    """The diagonal family's options: a section of :class:`hylo.HyLoConfig` once the family is registered."""

    section_name: ClassVar[str | None] = "diagonal"

    diag_exponent: float = option(
        1.0,
        doc="p of ∇W / (diag F + λ)^p: 1 is the diagonal natural gradient, 0.5 Adam's square root",
        rule=Rule(lambda p: isinstance(p, int | float) and 0 < p <= 1, "a number in (0, 1]"),
    )


@dataclass
class DiagonalState(LayerState):
    """The scale (diag F + λ)^-p of one layer, applied to its gradient entry by entry."""

    family: ClassVar[str] = "diagonal"
    entry_keys: ClassVar[frozenset[str]] = frozenset({"exponent"})

    scale: Tensor
    damping: float
    exponent: float

    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """∇W ∘ scale."""
        parts = GradMatrix.of(grad)
        return (parts.full().to(self.scale.dtype) * self.scale).to(parts.dtype)

    @property
    def bound(self) -> float:
        """λ^p: the result is no longer than ‖∇W‖ / λ^p (every entry of the scale is at most λ^-p)."""
        return self.damping**self.exponent

    def tensors(self) -> dict[str, Tensor]:
        """The scale."""
        return {"scale": self.scale}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``state_dict``, with the exponent."""
        return {**super().to_dict(), "exponent": self.exponent}

    @classmethod
    def from_dict(
        cls, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> DiagonalState:
        """A saved state, ``ValueError`` naming the field unless it fits a (d_g, d_a) layer computing in ``dtype``."""
        damping, exponent = positive_number(entry, "damping"), positive_number(entry, "exponent")
        tensors = checked_tensors(entry.get("tensors"), {"scale": (d_g, d_a)}, {"scale": dtype}, device)
        return cls(tensors["scale"], damping, exponent)


class DiagonalFamily(SolverFamily[Tensor]):
    """The diagonal empirical Fisher: each rank's diag F averaged over ranks, raised to -p by the layer's owner.

    It defines the members every family does (the three class attributes, :meth:`contribute`, :meth:`prepare`,
    :meth:`cost`, :meth:`solve`, :meth:`assemble`) and takes every capability's default: its one solver is its
    name, owners balance by layer count, a rank receiving a broadcast solves the layer to shape its buffers, and
    nothing is carried between updates (docs/extending.md, "Solver families")."""

    name = "diagonal"
    state_type = DiagonalState
    statistic = SQUARED_GRADIENTS
    section = DiagonalConfig

    def contribute(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> Contribution:
        """Each layer's diag F on this rank, weighted by its samples in the mean over ranks."""
        share = Contribution(Exchange.MEAN, Payload())
        for job in jobs:
            share.payload.add(job.name, {"diagonal": job.batch.collect(SQUARED_GRADIENTS)})
            share.weights[(job.name, "diagonal")] = float(job.batch.rows)
            context.watch.lap("capture", job.name)
        return share

    def prepare(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[Tensor]:
        """The batch's diag F of each layer."""
        return [received[(job.name, "diagonal")] for job in jobs]

    def cost(self, shape: LayerShape, solver: str, options: FamilyOptions) -> CostEstimate:
        """The squares of every row, one power per entry, one product per entry a step."""
        entries = float(shape.d_a * shape.d_g)
        exchanged = 2.0 * entries if shape.world_size > 1 else 0.0
        return CostEstimate(shape.rows * entries, entries, entries, exchanged * shape.itemsize)

    def solve(self, prepared: Sequence[Tensor], context: UpdateContext) -> list[dict[str, Tensor]]:
        """(diag F + λ)^-p of each layer, p read from this family's section."""
        exponent = context.options(DiagonalConfig).diag_exponent
        return [{"scale": (diagonal + context.damping).pow(-exponent)} for diagonal in prepared]

    def assemble(self, prepared: Tensor, solution: Mapping[str, Tensor], context: UpdateContext) -> DiagonalState:
        """The state: the solved scale, with the λ and p it was solved with."""
        return DiagonalState(solution["scale"], context.damping, context.options(DiagonalConfig).diag_exponent)


def register() -> FamilyHandle:
    """Register the family (its section and statistic with it); ``remove()`` on the handle undoes it."""
    return register_family(DiagonalFamily())


def model(seed: int = 0) -> nn.Module:
    """A small MLP: two hidden Linear layers and a Linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def options(out: Path | None) -> dict[str, Any]:
    """The run's hylo options: the family on the hidden layers (p = 0.5), K-FAC on the head."""
    return dict(
        solver="diagonal",
        diag_exponent=0.5,
        layer_solvers={"4": "kfac"},
        update_freq=2,
        damping=0.1,
        profile_dir=out,
        profile_append=out is not None and (out / "decisions.csv").exists(),
    )


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The step's random classification batch (the same for every run)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(64, 16, generator=generator), torch.randint(0, 4, (64,), generator=generator)


def train(net: nn.Module, pre: hylo.HyLoPreconditioner, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """SGD + hylo over ``steps``; the losses."""
    losses = []
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        pre.step()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run(out: Path | None, steps: int = 8, resume_at: int | None = None) -> tuple[list[float], dict[str, Any]]:
    """Train for ``steps``; with ``resume_at``, save hylo's and SGD's state there and continue in a fresh model,
    preconditioner and optimizer loaded from it. The losses and the final preconditioner's ``state_dict``."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = hylo.HyLoPreconditioner(net, **options(out))
    split = steps if resume_at is None else resume_at
    losses = train(net, pre, optimizer, range(split))
    if split < steps:
        saved = {"model": net.state_dict(), "hylo": pre.state_dict(), "sgd": optimizer.state_dict()}
        pre.close()
        pre.remove()
        net = model(seed=1)  # other weights: everything comes from the checkpoint
        net.load_state_dict(saved["model"])
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        optimizer.load_state_dict(saved["sgd"])
        pre = hylo.HyLoPreconditioner(net, **options(out))
        pre.load_state_dict(saved["hylo"])
        losses += train(net, pre, optimizer, range(split, steps))
    print(pre.summary())
    state = pre.state_dict()
    pre.close()
    pre.remove()
    return losses, state


def decisions(out: Path) -> Counter[str]:
    """The decisions by solver, read back from ``decisions.csv``."""
    with (out / "decisions.csv").open() as handle:
        return Counter(row["solver"] for row in csv.DictReader(handle))


def main(argv: list[str] | None = None) -> int:
    """``--out DIR``: train with the family, resume halfway, print the summary and the decisions by solver."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the profile CSVs")
    args = parser.parse_args(argv)
    handle = register()
    try:
        losses, _ = run(args.out, resume_at=4)
        print("losses:", " ".join(f"{loss:.4f}" for loss in losses))
        print("decisions by solver:", dict(decisions(args.out)))
    finally:
        handle.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
