"""Dense-comparison cases shared by the K-FAC and SNGD tests: one preconditioned step and its reference rows.

Each case runs hylo on a single float64 layer and rebuilds, independently of hylo, what the
dense oracle of either family needs (the layer's rows for a Linear, the unfold reference for a
Conv2d), after checking that those references reproduce autograd's ∇W. The test files apply
their own family's oracle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from tests.kit.checks import DT, REPLAY_RTOL, assert_rel_close, grad_matrix
from tests.kit.models import fixed_target, one_step
from tests.kit.reference import CONV_CASES, conv_reference, linear_rows, per_sample_matrices

#: Leading shapes of the Linear cases: plain rows, and rows with an extra leading dimension.
LINEAR_SHAPES = {"2d": (6, 5), "leading-dims": (4, 3, 5)}


@dataclass
class DenseCase:
    """hylo's preconditioned gradient ``got``, the raw ∇W, and the independent references."""

    got: Tensor
    grad: Tensor
    #: Linear: rows a_i (trailing 1 with a bias) and g_i = n·∂L/∂s_i.
    a: Tensor | None = None
    g: Tensor | None = None
    #: Conv2d: :func:`tests.kit.reference.conv_reference` of the step.
    conv: dict[str, Tensor] | None = None
    #: Conv2d: the true per-sample gradients U_i (B, d_g, d_a) by per-sample autograd.
    per_sample: Tensor | None = None


def linear_case(solver: str, bias: bool, shape: tuple[int, ...], loss: str, damping: float) -> DenseCase:
    """One step of ``nn.Linear(5, 3)`` on inputs of ``shape`` under cross-entropy or MSE."""
    layer = nn.Linear(5, 3, bias=bias, dtype=DT)
    x = torch.randn(shape, dtype=DT)
    labels = torch.randint(0, 3, shape[:-1])
    if loss == "ce":

        def loss_fn(out: Tensor) -> Tensor:
            return F.cross_entropy(out.reshape(-1, 3), labels.reshape(-1))

    else:

        def loss_fn(out: Tensor) -> Tensor:
            return F.mse_loss(out, fixed_target(out.shape))

    _, dout, grad, got = one_step(layer, x, loss_fn, solver=solver, damping=damping)
    a, g = linear_rows(layer, x, dout)
    rows = a.shape[0]
    assert rows == x[..., 0].numel()
    assert_rel_close(g.mT @ a / rows, grad, REPLAY_RTOL)  # the reference rows reproduce ∇W
    return DenseCase(got, grad, a=a, g=g)


def conv_case(solver: str, bias: bool, case: str, damping: float, **options: object) -> DenseCase:
    """One step of ``nn.Conv2d(2, 3, **CONV_CASES[case])`` on a (3, 2, 6, 7) input under MSE."""
    conv = nn.Conv2d(2, 3, bias=bias, dtype=DT, **CONV_CASES[case])
    x = torch.randn(3, 2, 6, 7, dtype=DT)

    def loss_fn(out: Tensor) -> Tensor:
        return F.mse_loss(out, fixed_target(out.shape))

    per_sample = per_sample_matrices(conv, {"conv": conv}, x, loss_fn)["conv"]
    out, dout, grad, got = one_step(conv, x, loss_fn, solver=solver, damping=damping, **options)
    ref = conv_reference(conv, x, out, dout)
    assert_rel_close(ref["grad"], grad, REPLAY_RTOL)  # unfold + padding reproduce autograd's ∇W
    assert_rel_close(per_sample.mean(0), grad, REPLAY_RTOL)  # so do the per-sample gradients
    return DenseCase(got, grad, conv=ref, per_sample=per_sample)


def scheduled_damping_steps(solver: str) -> Iterator[tuple[DenseCase, float]]:
    """Three steps of ``nn.Linear(4, 3)`` with ``damping=0.2 / (step + 1)``: each step's case and its λ.

    ``factor_decay=0`` makes every K-FAC update use the batch factors alone (SNGD ignores it).
    """

    def schedule(step: int) -> float:
        return 0.2 / (step + 1)

    layer = nn.Linear(4, 3, dtype=DT)
    pre = HyLoPreconditioner(layer, solver=solver, update_freq=1, damping=schedule, factor_decay=0.0)
    for step in range(3):
        layer.zero_grad()
        x = torch.randn(6, 4, dtype=DT)
        labels = torch.randint(0, 3, (6,))
        out = layer(x)
        out.retain_grad()
        F.cross_entropy(out, labels).backward()
        grad = grad_matrix(layer)
        pre.step()
        a, g = linear_rows(layer, x, out.grad)
        yield DenseCase(grad_matrix(layer), grad, a=a, g=g), schedule(step)
