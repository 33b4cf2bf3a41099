"""Mixed precision: ``torch.autocast`` (bf16 on the device tier's device) and ``torch.amp.GradScaler`` with hylo.

Under autocast the captured inputs and output gradients are bf16; every factor, kernel and
solve must run in float32 (the working dtype of a float32 or bf16 weight), and the rewritten
``.grad`` keeps its dtype. The oracle is the same model run in float32: the preconditioned
gradients of the bf16 run must be as close to it as bf16 allows, i.e. preconditioning must not
amplify the bf16 error of the raw gradient. KID and KIS keep every row here (``rank_ratio=1``):
which rows they select is a discrete choice that bf16's rounding of the row norms may change,
so with fewer rows the two runs may precondition with different rows. A GradScaler on top of autocast must not change
the result (its scale is divided out of the captured output gradients).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from tests.kit.checks import rel_err
from tests.kit.devices import chosen

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")


class TinyTransformer(nn.Module):
    """Linear in, one post-norm encoder layer (attention + MLP), a 3×3 conv over (tokens × features), Linear out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.head = nn.Linear(32, 5)

    def forward(self, x: Tensor) -> Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.block(self.embed(x), src_mask=mask)
        c = self.conv(h.unsqueeze(1))  # (N, 2, T, 16)
        return self.head(c.permute(0, 2, 1, 3).flatten(2))


def _data(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(6, 7, 8, generator=gen), torch.randint(0, 5, (6, 7), generator=gen)


def run_precision(
    solver: str, autocast: bool, scaler: torch.amp.GradScaler | None = None, steps: int = 2, **options: Any
) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]], HyLoPreconditioner]:
    """Raw and preconditioned gradients of each step (no optimizer step: the weights stay put)."""
    model = TinyTransformer()
    pre = HyLoPreconditioner(
        model, solver=solver, damping=0.1, update_freq=1, rank_ratio=1.0, grad_scaler=scaler, **options
    )
    raws, results = [], []
    for step in range(steps):
        model.zero_grad()
        x, y = _data(step)
        with torch.autocast(chosen().type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
        raws.append({n: p.grad.clone() for n, p in model.named_parameters()})
        pre.step()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if scaler is not None:
            scaler.update()
    return raws, results, pre


@pytest.mark.parametrize("solver", SOLVERS)
def test_bf16_autocast_matches_float32_within_bf16_tolerance(solver: str) -> None:
    raw32, pre32, _ = run_precision(solver, autocast=False)
    raw16, pre16, pre = run_precision(solver, autocast=True)
    preconditioned = [info.name for info in pre.layer_info()]
    assert {"block.self_attn.q_proj", "block.self_attn.out_proj", "conv", "block.linear1"} <= set(preconditioned)
    for step in range(len(raw32)):
        for name, exact in pre32[step].items():
            got = pre16[step][name]
            assert got.dtype == torch.float32
            assert torch.isfinite(got).all()
            raw_error = rel_err(raw16[step][name], raw32[step][name])
            assert raw_error < 0.05, name  # the bf16 forward itself
            # preconditioning does not amplify bf16's error (a bf16 factor or solve would)
            assert rel_err(got, exact) <= 4 * raw_error + 0.02, f"{name} at step {step}"
            if "norm" not in name:
                assert rel_err(got, raw16[step][name]) > 0.1, f"{name} was not preconditioned"


def test_bf16_autocast_keeps_factors_in_float32() -> None:
    _, _, pre = run_precision("kfac", autocast=True, steps=1)
    for info in pre.layer_info():
        state = info.state
        assert state is not None
        assert state.tensors["factor_a"].dtype == torch.float32 and state.tensors["factor_g"].dtype == torch.float32


@pytest.mark.parametrize("solver", ("kfac", "sngd", "kid"))
def test_bf16_weights_keep_bf16_gradients_and_float32_state(solver: str) -> None:
    """A model whose parameters are bf16: rows and solves in float32, ``.grad`` written back as bf16."""
    model = TinyTransformer()
    reference = TinyTransformer()
    model.to(torch.bfloat16)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    results = []
    for net in (model, reference):
        pre = HyLoPreconditioner(net, solver=solver, damping=0.01, update_freq=1)
        x, y = _data(0)
        dtype = next(net.parameters()).dtype
        F.cross_entropy(net(x.to(dtype)).float().flatten(0, 1), y.flatten()).backward()
        pre.step()
        results.append({n: p.grad for n, p in net.named_parameters()})
        for info in pre.layer_info():
            assert info.math.dtype == torch.float32
    for name, exact in results[1].items():
        got = results[0][name]
        assert got.dtype == torch.bfloat16
        assert rel_err(got.float(), exact) < 0.15, name


@pytest.mark.parametrize("solver", ("kfac", "sngd"))
def test_grad_scaler_under_bf16_autocast_changes_nothing(solver: str) -> None:
    """``scaler.scale(loss).backward()`` → ``unscale_`` → ``pre.step()``: the result of the unscaled run."""
    _, plain, _ = run_precision(solver, autocast=True, steps=3)
    scaler = torch.amp.GradScaler(chosen().type, init_scale=2.0**12, growth_interval=1)
    _, scaled, _ = run_precision(solver, autocast=True, scaler=scaler, steps=3)
    for a, b in zip(plain, scaled, strict=True):
        for name, exact in a.items():
            assert rel_err(b[name], exact) < 1e-4, name
