"""Extending hylo from user code: a new layer type and a new low-rank variant, with no edit to hylo.

docs/extending.md walks through it. Two extensions, each registered with one call:

- **A layer type.** ``TransposedLinear`` computes y = x W + b with W stored as (d_in, d_out), the
  layout of GPT-2's ``Conv1D``: a module class hylo does not know. hylo's matrix is its transpose,
  which hylo's own :class:`hylo.layers.TransposedLinearMath` (the math hylo registers for
  ``Conv1D``) describes: it says which tensors form hylo's W and where its gradient is read and
  written (views of ``weight.grad``), and takes a Linear's rows and K-FAC factors.
  :func:`hylo.register_layer_type` maps the module class to it; a layer type with math of its own
  subclasses :class:`hylo.LayerMath` the same way (docs/extending.md, "Layer types").
- **A low-rank variant.** :class:`UniformRows` keeps r of a rank's n per-sample gradients drawn
  uniformly, each scaled by √(n/r), with divisor B: an unbiased estimate of the Fisher that ignores
  the row norms KIS samples by. :func:`hylo.register_variant` makes ``"uniform"`` a solver like
  ``"kis"``: the hybrid policy takes it in the stable regime (``stable_variant="uniform"``), and the
  gradient-error study measures it beside KID and KIS.

Run it: ``python examples/extend_hylo.py --out runs/extend`` trains a small model on random
data for a few steps and prints the layers, the decisions and the gradient-error study's mean
relative error per method, read back from ``decisions.csv`` and ``grad-error.csv``.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.layers import LayerTypeHandle, TransposedLinearMath
from hylo.solvers import LowRankUpdate, UpdateContext, VariantHandle


class TransposedLinear(nn.Module):
    """y = x W + b with ``weight`` of shape (d_in, d_out): a Linear stored transposed (GPT-2's ``Conv1D``)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: Tensor) -> Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class UniformRows(hylo.RowReduction):
    """Keep r of a rank's n rows uniformly without replacement, each scaled by √(n/r); divisor B.

    Each row is kept with probability r/n, so E[Σ_kept (n/r) U_i U_iᵀ] = Σ_i U_i U_iᵀ on every
    rank: the gathered rows estimate the batch Fisher without bias, like KIS, but blind to the
    row norms KIS samples by.
    """

    def reduce(
        self, rows: hylo.layers.SampleRows, r: int, seed: int, context: UpdateContext
    ) -> tuple[hylo.layers.SampleRows, Tensor | None]:
        """r uniformly drawn rows, rescaled (all rows, unscaled, when r = n)."""
        n = rows.count
        if r >= n:
            return rows, None
        generator = torch.Generator().manual_seed(seed)
        keep = torch.randperm(n, generator=generator)[:r].to(rows.device)
        scale = torch.full((r,), math.sqrt(n / r), dtype=rows.dtype, device=rows.device)
        return rows.select(keep).scaled(scale), None

    def update(
        self, rows: hylo.layers.SampleRows, counts: list[list[float]], weights: Tensor | None, context: UpdateContext
    ) -> LowRankUpdate:
        """The gathered rows with divisor B, every rank's n."""
        return LowRankUpdate(rows, sum(n for n, _ in counts))


def register() -> tuple[LayerTypeHandle, VariantHandle]:
    """Register both extensions; each handle's ``remove()`` undoes its registration."""
    layer_type = hylo.register_layer_type(TransposedLinear, lambda module, config: TransposedLinearMath(module))
    variant = hylo.register_variant("uniform", UniformRows())
    return layer_type, variant


def model(seed: int = 0) -> nn.Module:
    """A small MLP whose hidden layers are TransposedLinear and whose head is an nn.Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(TransposedLinear(32, 64), nn.Tanh(), TransposedLinear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def train(out: Path, steps: int = 12, seed: int = 0) -> hylo.HyLoPreconditioner:
    """A few steps of SGD + hylo on random classification data, writing ``out``'s profile files."""
    net = model(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    pre = hylo.HyLoPreconditioner(
        net,
        solver="hybrid",
        update_freq=2,
        damping=0.3,
        rank_ratio=0.25,
        fidelity_budget=0.0,  # let the cost model, not the fidelity rule, choose
        trend_window=2,  # a short window: the stable regime (and so "uniform") is reached within the run
        stable_variant="uniform",
        layer_solvers={"4": "uniform"},  # the head always takes it
        profile_dir=out,
        studies=("grad_error",),
        grad_error_methods=("kid", "kis", "uniform", "sngd"),
    )
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(256, 32, generator=generator)
    y = torch.randint(0, 10, (256,), generator=generator)
    for step in range(steps):
        rows = slice(64 * (step % 4), 64 * (step % 4) + 64)
        optimizer.zero_grad()
        F.cross_entropy(net(x[rows]), y[rows]).backward()
        pre.step()
        optimizer.step()
    pre.close()
    return pre


def report(out: Path) -> dict[str, float]:
    """The decisions by solver and the mean relative error per method, read back from the CSVs."""
    with (out / "decisions.csv").open() as handle:
        decisions = list(csv.DictReader(handle))
    chosen: dict[str, int] = defaultdict(int)
    for row in decisions:
        chosen[row["solver"]] += 1
    print("decisions by solver:", dict(chosen))
    with (out / "grad-error.csv").open() as handle:
        errors: dict[str, list[float]] = defaultdict(list)
        for row in csv.DictReader(handle):
            errors[row["method"]].append(float(row["rel_error"]))
    means = {method: sum(values) / len(values) for method, values in errors.items()}
    for method, mean in means.items():
        print(f"grad-error {method:>8}: mean relative error {mean:.3f} over {len(errors[method])} rows")
    return means


def main(argv: list[str] | None = None) -> int:
    """Register the extensions, train, print what hylo made of them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="an empty directory for hylo's profile files")
    parser.add_argument("--steps", type=int, default=12, help="training steps (default %(default)s)")
    args = parser.parse_args(argv)
    handles = register()
    try:
        pre = train(args.out, args.steps)
        print(pre.summary())
        report(args.out)
    finally:
        for handle in handles:
            handle.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
