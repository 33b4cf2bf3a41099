"""Gradient accumulation equals one batch (docs/usage.md, "Gradient accumulation").

A window of k micro-batches of B/k samples, each loss divided by k, then one ``step()``, must give the parameters
of one batch of B after several steps, for every solver and both forms (``HyLoPreconditioner`` + a torch
optimizer, ``hylo.HyLoOptimizer``). "To rounding" is measured, never assumed: in float64, the plain optimizer's
own accumulation difference (the same loop without hylo) times 100, or, where larger, 10 times hylo's difference
between the one batch and the same batch in another order (rounding changed, nothing else): a damped solve
amplifies rounding by up to its condition number, and ``kfac_adam`` divides it by Adam's ε wherever a rotated
gradient is near zero. Batches are wider than every layer (no degenerate eigenspace, whose basis is rounding's
choice). ``kis`` draws its rows from the window's rows in call order: the same draw as the one batch's (a
reordered batch is another draw, so kis is held to the plain bound alone).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64
SOLVERS = ("kfac", "sngd", "kid", "kis", "kfac_adam", "hybrid")
STEPS = 4
BATCH = 128  # wider than every layer below: full-rank factors
MICRO = 4


def mlp() -> nn.Module:
    """Linear(10, 32) → Tanh → Linear(32, 32) → Tanh → Linear(32, 5)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5)).to(DT)


def cnn(channels: int = 8) -> nn.Module:
    """Conv2d(3, c, 3, pad 1) → ReLU → Conv2d(c, c, 3, stride 2) → ReLU → Linear(9c, 5), on 8×8 images."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, stride=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * 9, 5),
    ).to(DT)  # fmt: skip


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "cnn": cnn}


def window(kind: str, step: int, batch: int, reorder: bool = False) -> tuple[Tensor, Tensor]:
    """Step ``step``'s batch for ``kind``; ``reorder``: the same samples in another order."""
    generator = torch.Generator().manual_seed(100 + step)
    shape = (batch, 10) if kind == "mlp" else (batch, 3, 8, 8)
    x, y = torch.randn(*shape, generator=generator, dtype=DT), torch.randint(0, 5, (batch,), generator=generator)
    if reorder:
        order = torch.randperm(batch, generator=torch.Generator().manual_seed(step))
        x, y = x[order], y[order]
    return x, y


def trained(
    model: nn.Module,
    kind: str,
    micro: int,
    form: str,
    options: dict[str, object] | None,
    *,
    batch: int = BATCH,
    steps: int = STEPS,
    reorder: bool = False,
) -> tuple[Tensor, list[tuple[str, str]]]:
    """The parameters (flat) after ``steps`` windows of ``micro`` micro-batches, and hylo's decisions; ``options``
    None: the plain optimizer (SGD for the preconditioner form, AdamW for the optimizer form)."""
    pre: hylo.HyLoPreconditioner | None = None
    optimizer: torch.optim.Optimizer
    if form == "preconditioner":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if options is not None:
            pre = hylo.HyLoPreconditioner(model, **options)  # type: ignore[arg-type]
    elif options is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2), **options)  # type: ignore[arg-type]
        pre = optimizer.preconditioner
    for step in range(steps):
        x, y = window(kind, step, batch, reorder)
        for part in range(micro):
            rows = slice(part * batch // micro, (part + 1) * batch // micro)
            (F.cross_entropy(model(x[rows]), y[rows]) / micro).backward()
        if form == "preconditioner" and pre is not None:
            pre.step()
        optimizer.step()
        optimizer.zero_grad()
    decisions = [(d.solver, str(d.reason)) for d in pre.decision_log] if pre is not None else []
    return torch.cat([p.detach().flatten() for p in model.parameters()]), decisions


def moved(kind: str, after: Tensor, reference: Tensor) -> float:
    """‖after − reference‖ over how far the one-batch run moved the parameters."""
    start = torch.cat([p.detach().flatten() for p in MODELS[kind]().parameters()])
    return float((after - reference).norm() / (reference - start).norm())


def options_of(solver: str, form: str) -> dict[str, object]:
    """The form's options: damping 1e-2 under SGD; the optimizer form's own damping under AdamW."""
    options: dict[str, object] = {"solver": solver, "update_freq": 2}
    if form == "preconditioner":
        options["damping"] = 1e-2
    return options


@pytest.mark.parametrize("form", ["preconditioner", "optimizer"])
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("solver", SOLVERS)
def test_accumulated_windows_give_the_one_batch_parameters(solver: str, kind: str, form: str) -> None:
    """4 windows of 4 × 32 samples against 4 batches of 128: the parameters agree to rounding, the rounding the
    plain optimizer shows on the same loop (×100), or hylo on the same batches reordered (×10); every
    update takes the same solvers (hybrid: no "planned" fallback from a forecast on one micro-batch)."""
    plain = moved(
        kind, trained(MODELS[kind](), kind, MICRO, form, None)[0], trained(MODELS[kind](), kind, 1, form, None)[0]
    )
    options = options_of(solver, form)
    one, decided = trained(MODELS[kind](), kind, 1, form, options)
    accumulated, decided_accumulated = trained(MODELS[kind](), kind, MICRO, form, options)
    assert decided_accumulated == decided
    difference = moved(kind, accumulated, one)
    bound = 100 * max(plain, 1e-16)
    if solver != "kis":  # reordered, kis draws other rows
        reordered = moved(kind, trained(MODELS[kind](), kind, 1, form, options, reorder=True)[0], one)
        assert reordered < 1e-8, f"{solver}'s own rounding on this case is {reordered:.1e}: not a rounding test"
        bound = max(bound, 10 * reordered)
    assert difference <= bound, (difference, plain)


def test_hybrid_decides_on_the_window_not_its_first_micro_batch() -> None:
    """A convolution the hybrid policy gives K-FAC at 512 rows and KID at 128: accumulated as 4 × 128 it is given
    K-FAC too (its calls keep K-FAC's factors), at the first update and after, and the parameters agree."""
    options: dict[str, object] = {"solver": "hybrid", "update_freq": 1, "damping": 1e-2}
    model = functools.partial(cnn, 4)
    start = torch.cat([p.detach().flatten() for p in model().parameters()])
    plain_one = trained(model(), "cnn", 1, "preconditioner", None, batch=512, steps=2)[0]
    plain_accumulated = trained(model(), "cnn", MICRO, "preconditioner", None, batch=512, steps=2)[0]
    plain = float((plain_accumulated - plain_one).norm() / (plain_one - start).norm())
    one, decided = trained(model(), "cnn", 1, "preconditioner", options, batch=512, steps=2)
    accumulated, decided_accumulated = trained(model(), "cnn", MICRO, "preconditioner", options, batch=512, steps=2)
    assert ("kfac", "cost") in decided  # the case crosses the boundary
    assert decided_accumulated == decided
    assert float((accumulated - one).norm() / (one - start).norm()) <= 100 * max(plain, 1e-16)
