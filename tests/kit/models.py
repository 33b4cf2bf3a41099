"""Small models shared by several test files, their deterministic data and the loops that drive hylo on them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from tests.kit.checks import DT, grad_matrix


# --------------------------------------------------------------------------- fc1 → tanh → fc2 (4 → 6 → 3)
def mlp(seed: int = 0, dtype: torch.dtype = DT) -> nn.Sequential:
    """Linear(4, 6) ``fc1`` → Tanh ``act`` → Linear(6, 3) ``fc2``, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(4, 6, dtype=dtype),
            act=nn.Tanh(),
            fc2=nn.Linear(6, 3, dtype=dtype),
        )
    )


def batch(step: int, n: int = 8) -> tuple[Tensor, Tensor]:
    """Deterministic data of step ``step`` for :func:`mlp`: inputs (n, 4) and 3-class labels."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 4, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)


def backward(model: nn.Module, step: int, n: int = 8) -> None:
    """Cross-entropy backward of ``model`` on ``batch(step, n)``."""
    x, y = batch(step, n)
    F.cross_entropy(model(x), y).backward()


def run(
    model: nn.Module,
    pre: HyLoPreconditioner,
    steps: Iterable[int],
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """For each step: zero the gradients, ``backward``, ``pre.step()`` and the optimizer step (if any)."""
    for step in steps:
        if optimizer is not None:
            optimizer.zero_grad()
        else:
            model.zero_grad()
        backward(model, step)
        pre.step()
        if optimizer is not None:
            optimizer.step()


# --------------------------------------------------------------------------- five-class classifiers
def classifier_mlp(bias: bool = True, dtype: torch.dtype = DT, seed: int = 0) -> nn.Module:
    """Linear(12, 16) → Tanh → Linear(16, 5), initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16, bias=bias), nn.Tanh(), nn.Linear(16, 5, bias=bias)).to(dtype)


def classifier_convnet(bias: bool = True, dtype: torch.dtype = DT, seed: int = 0) -> nn.Module:
    """Two Conv2d (the second with stride 2) and a Linear on 3×6×6 images, 5 classes."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=bias),
        nn.Tanh(),
        nn.Conv2d(4, 6, 3, stride=2, bias=bias),  # 6×6 → 2×2
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 5, bias=bias),
    ).to(dtype)


def classifier_inputs(kind: str, n: int, seed: int, dtype: torch.dtype = DT) -> tuple[Tensor, Tensor]:
    """``n`` inputs for :func:`classifier_mlp` (``kind="linear"``) or :func:`classifier_convnet`, and labels."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 12) if kind == "linear" else (n, 3, 6, 6)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randint(0, 5, (n,), generator=gen)


# --------------------------------------------------------------------------- named float64 stacks
def sequential(seed: int, **layers: nn.Module) -> nn.Sequential:
    """An nn.Sequential of named modules in float64 (the modules are re-initialised from ``seed``)."""
    torch.manual_seed(seed)
    model = nn.Sequential(OrderedDict(layers)).to(DT)
    for module in model.modules():
        if hasattr(module, "reset_parameters") and module is not model:
            module.reset_parameters()
    return model


def wide_model(seed: int = 0) -> nn.Sequential:
    """tiny (K-FAC is cheaper at batch 32) → wide1, wide2 (low-rank is cheaper)."""
    return sequential(
        seed,
        tiny=nn.Linear(2, 2),
        act1=nn.Tanh(),
        wide1=nn.Linear(2, 64),
        act2=nn.Tanh(),
        wide2=nn.Linear(64, 64),
    )


def override_model(seed: int = 0) -> nn.Sequential:
    """fc1 (16 → 64) → fc2 (64 → 64) → head (64 → 3), Tanh in between."""
    return sequential(
        seed,
        fc1=nn.Linear(16, 64),
        act1=nn.Tanh(),
        fc2=nn.Linear(64, 64),
        act2=nn.Tanh(),
        head=nn.Linear(64, 3),
    )


def regression_data(step: int, n: int, d_in: int, d_out: int = 0, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Deterministic float64 inputs (n, d_in) and targets (n, d_out) (empty when ``d_out`` is 0)."""
    gen = torch.Generator().manual_seed(10_000 * seed + step)
    x = torch.randn(n, d_in, generator=gen, dtype=DT)
    y = torch.randn(n, d_out, generator=gen, dtype=DT) if d_out else torch.empty(0)
    return x, y


# --------------------------------------------------------------------------- single layers
def fixed_target(shape: torch.Size, seed: int = 1) -> Tensor:
    """A float64 regression target of ``shape`` drawn from ``seed``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def one_step(
    module: nn.Module, x: Tensor, loss_fn: Callable[[Tensor], Tensor], **options: object
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One forward/backward/precondition of a single-layer model: (out, out.grad, ∇W, V̂)."""
    pre = HyLoPreconditioner(module, update_freq=1, **options)
    out = module(x)
    out.retain_grad()
    loss_fn(out).backward()
    grad = grad_matrix(module)
    pre.step()
    return out, out.grad, grad, grad_matrix(module)
