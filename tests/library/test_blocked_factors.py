"""``factor_block``: K-FAC factors wider than b held as balanced diagonal blocks (docs/solvers.md, "Blocked factors").

Specified against independent references built from the layer's own inputs and output gradients (plain autograd):

- kfac (eigen and inverse): V̂ = (A_blk ⊗ G_blk + λI)⁻¹ vec ∇W solved densely, A_blk and G_blk the dense factors
  with their off-diagonal blocks zeroed (the inverse method with its factored damping, one π of the whole layer);
- kfac_adam between updates: Adam on Q_gᵀ ∇W Q_a with Q the block-diagonal eigenbasis of the blocked factors;
- b ≥ d is bit-identical to None; a resumed run continues bit for bit; a bad value is refused at construction;
- the state and the memory estimate hold Σ sᵢ² numbers per blocked factor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.solvers.bundled.kfac_adam import KFACAdamFamily
from hylo.solvers.kfac import kfac_state_bytes
from tests.kit.checks import DT, assert_rel_close, rel_err
from tests.kit.harness import run_distributed
from tests.kit.models import fixed_target, one_step
from tests.kit.reference import dense_kfac, linear_rows
from tests.library.test_distributed import CASES, make_data, train

pytestmark = [pytest.mark.usefixtures("single_thread")]

D_IN, D_OUT, BLOCK = 10, 13, 4  # d_a = 11 -> 3 blocks (4, 4, 3); d_g = 13 -> 4 blocks (4, 3, 3, 3)


def _sizes(d: int, b: int) -> list[int]:
    """Balanced block sizes, written out independently of hylo."""
    k = -(-d // b)
    return [d // k + (1 if i < d % k else 0) for i in range(k)]


def _blocked(full: Tensor, b: int) -> Tensor:
    """``full`` with its off-diagonal blocks zeroed."""
    mask = torch.block_diag(*[torch.ones(s, s, dtype=full.dtype) for s in _sizes(full.shape[0], b)])
    return full * mask


def _layer(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(D_IN, D_OUT, dtype=DT)


def _loss(out: Tensor) -> Tensor:
    return F.mse_loss(out, fixed_target(out.shape))


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kfac_is_the_block_diagonal_dense_solve(method: str) -> None:
    damping = 1e-2
    layer = _layer()
    x = torch.randn(40, D_IN, dtype=DT, generator=torch.Generator().manual_seed(5))
    _, dout, grad, got = one_step(
        layer, x, _loss, solver="kfac", damping=damping, factor_block=BLOCK, kfac_method=method
    )
    a, g = linear_rows(layer, x, dout)
    rows = a.shape[0]
    factor_a, factor_g = _blocked(a.mT @ a / rows, BLOCK), _blocked(g.mT @ g / rows, BLOCK)
    if method == "eigen":
        expected = dense_kfac(factor_a, factor_g, grad, damping)
    else:  # (A_blk + δ_a I)⁻¹ ⊗ (G_blk + δ_g I)⁻¹, δ_a = π√λ, δ_g = √λ/π, π² = (tr A/d_a)/(tr G/d_g)
        pi = ((torch.trace(factor_a) / factor_a.shape[0]) / (torch.trace(factor_g) / factor_g.shape[0])).sqrt()
        eye_a, eye_g = torch.eye(factor_a.shape[0], dtype=DT), torch.eye(factor_g.shape[0], dtype=DT)
        inv_a = torch.linalg.inv(factor_a + pi * damping**0.5 * eye_a)
        inv_g = torch.linalg.inv(factor_g + damping**0.5 / pi * eye_g)
        expected = inv_g @ grad @ inv_a
    full = dense_kfac(a.mT @ a / rows, g.mT @ g / rows, grad, damping)
    assert rel_err(expected, full) > 1e-2  # the blocks differ from the whole factors
    assert_rel_close(got, expected)


def test_kfac_adam_between_updates_is_adam_in_the_block_eigenbasis() -> None:
    """Step 0 fixes Q_a, Q_g from the blocked factors of that step; every step is V̂ = Q_g u Q_aᵀ with u
    torch.optim.Adam's step on Q_gᵀ ∇W Q_a (eigenvector signs and order within a block do not matter)."""
    layer = _layer(3)
    pre = hylo.HyLoPreconditioner(layer, solver="kfac_adam", update_freq=100, factor_block=BLOCK)
    rotated = torch.zeros(D_OUT, D_IN + 1, dtype=DT, requires_grad=True)
    adam = torch.optim.Adam([rotated], lr=1.0)
    basis: tuple[Tensor, Tensor] | None = None
    for step in range(4):
        x = torch.randn(20, D_IN, dtype=DT)
        layer.zero_grad()
        out = layer(x)
        out.retain_grad()
        F.mse_loss(out, fixed_target(out.shape) * (step + 1)).backward()
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        if basis is None:
            a, g = linear_rows(layer, x, out.grad)
            fa, fg = _blocked(a.mT @ a / 20, BLOCK), _blocked(g.mT @ g / 20, BLOCK)
            basis = (torch.linalg.eigh(fa)[1], torch.linalg.eigh(fg)[1])
            assert rel_err(basis[0] @ basis[0].mT @ fa, fa) < 1e-12
        q_a, q_g = basis
        pre.step()
        got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        adam.zero_grad()
        rotated.grad = q_g.mT @ grad @ q_a
        before = rotated.detach().clone()
        adam.step()
        expected = q_g @ (before - rotated.detach()) @ q_a.mT
        assert_rel_close(got, expected, 1e-8)


def _train(model: nn.Module, pre: hylo.HyLoPreconditioner, steps: range) -> None:
    """SGD with ``pre`` over ``steps``, step k on its own seeded batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, D_IN, generator=gen, dtype=DT), torch.randint(0, 3, (24,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()


def _run(steps: int, solver: str, **options: object) -> tuple[nn.Module, hylo.HyLoPreconditioner]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_OUT, dtype=DT), nn.Tanh(), nn.Linear(D_OUT, 3, dtype=DT))
    pre = hylo.HyLoPreconditioner(model, solver=solver, update_freq=2, **options)
    _train(model, pre, range(steps))
    return model, pre


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam"])
def test_a_block_at_least_the_width_is_the_whole_factor(solver: str) -> None:
    extra = {"basis_refresh": "power"} if solver == "kfac_adam" else {}
    whole, _ = _run(5, solver, **extra)
    wide, _ = _run(5, solver, factor_block=64, **extra)
    for p, q in zip(whole.parameters(), wide.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam"])
def test_blocks_change_the_run_and_resume_bit_exactly(solver: str) -> None:
    extra = {"basis_refresh": "power"} if solver == "kfac_adam" else {}
    whole, _ = _run(5, solver, **extra)
    model, pre = _run(5, solver, factor_block=BLOCK, **extra)
    assert not all(torch.equal(p, q) for p, q in zip(whole.parameters(), model.parameters(), strict=True))
    saved = copy.deepcopy(pre.state_dict())
    straight, _ = _run(9, solver, factor_block=BLOCK, **extra)
    torch.manual_seed(0)
    resumed = nn.Sequential(nn.Linear(D_IN, D_OUT, dtype=DT), nn.Tanh(), nn.Linear(D_OUT, 3, dtype=DT))
    resumed.load_state_dict(model.state_dict())
    pre2 = hylo.HyLoPreconditioner(resumed, solver=solver, update_freq=2, factor_block=BLOCK, **extra)
    pre2.load_state_dict(saved)
    _train(resumed, pre2, range(5, 9))
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="factor_block"):
        hylo.HyLoPreconditioner(copy.deepcopy(model), solver=solver, update_freq=2, **extra).load_state_dict(saved)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_block_is_refused_at_construction(bad: object) -> None:
    with pytest.raises(ValueError, match="factor_block"):
        hylo.HyLoPreconditioner(_layer(), solver="kfac", factor_block=bad)


def test_state_bytes_and_memory_hold_the_blocks() -> None:
    _, pre = _run(3, "kfac_adam", factor_block=BLOCK)
    held = pre.memory_breakdown().state
    squares_a = sum(s * s for s in _sizes(D_IN + 1, BLOCK))
    squares_g = sum(s * s for s in _sizes(D_OUT, BLOCK))
    moments = 2 * D_OUT * (D_IN + 1)
    expected = (2 * (squares_a + squares_g) + D_IN + 1 + D_OUT + moments) * 8
    assert held["0"] == expected
    assert KFACAdamFamily().state_bytes(D_IN + 1, D_OUT, 8, BLOCK) == expected
    assert kfac_state_bytes(D_IN + 1, D_OUT, 8, BLOCK) < kfac_state_bytes(D_IN + 1, D_OUT, 8)


@pytest.mark.parametrize("solver", ["kfac", "kfac-inverse", "kfac_adam-power"])
def test_two_ranks_match_one_process(solver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/distributed.md, "Distribution invariant", with blocked factors (a convolution's A in 3 blocks, fc1's in
    4): the ranks all-reduce the packed blocks and the owners broadcast the blocked bases (or inverses)."""
    name, options = CASES[solver] if solver in CASES else (solver, {})
    case = f"{solver}-blocked"
    monkeypatch.setitem(CASES, case, (name, {**options, "factor_block": 8}))
    steps, batch = 3, 8
    xs, ys = make_data(steps, batch, torch.float64)
    reference = train(0, 1, case, xs, ys, [batch], 1)
    plain = train(0, 1, solver, xs, ys, [batch], 1)
    assert rel_err(reference["pre"][-1]["fc1.weight"], plain["pre"][-1]["fc1.weight"]) > 1e-3  # blocks matter
    out = run_distributed(train, 2, case, xs, ys, [batch // 2] * 2, 1, "inverse", backend="gloo")
    for step in range(steps):
        for result in out:
            for key, value in reference["pre"][step].items():
                assert_rel_close(result["pre"][step][key], value, 1e-5)
