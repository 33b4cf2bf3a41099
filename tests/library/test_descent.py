"""Every applied step is a descent direction of the damped system it solves (docs/solvers.md, "Numerics";
docs/reliability.md, "Fallbacks").

1. float32 ``sngd`` on exactly duplicated rows (the batch twice, as gradient accumulation of the same
   batch gives) at damping 10⁻⁴: the result agrees with the float64 dense solve (F + λI)⁻¹ vec ∇W built
   from the model's true per-sample gradients (autograd one sample at a time, nothing of hylo), and
   goes downhill. Before M and c = M z were kept in float64 the SMW subtraction sent up to half of
   these steps uphill, up to 100× too long.
2. A result that is uphill or longer than ‖∇W‖/λ (here: a corrupted state) is replaced by the raw
   gradient on device, counted, and reported at the next update with a warning naming the layer.
3. The check's terms are sums over rows, so ranks holding rows of one ∇W (FSDP2) add theirs up and
   judge the same totals; they neither overflow nor underflow for gradients of 10⁻²⁰ or 10¹⁹.
4. ``-m slow``: the measurement over 50 seeds, Linear and Conv2d, λ ∈ {10⁻², 10⁻³, 10⁻⁴}.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.layers.gradmatrix import GradMatrix
from hylo.numerics import check_limits, sound, unit_scales
from hylo.pipeline.apply import result_sums
from hylo.solvers import LayerState
from hylo.solvers.kfac import KFACState
from tests.kit.checks import as_parts, grad_matrix
from tests.kit.internals import replace_state
from tests.kit.reference import dense_natural_gradient, per_sample_matrices

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]


# --------------------------------------------------------------------------- duplicated rows vs the reference
def _net(kind: str, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    if kind == "linear":
        return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 5))
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 5))


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_children() if isinstance(m, (nn.Linear, nn.Conv2d))}


@dataclass(frozen=True)
class Measured:
    """One layer's step against the reference: cos(v, ∇W), ‖v‖/‖v_ref‖ and ‖v − v_ref‖/‖v_ref‖."""

    cos: float
    ratio: float
    error: float


def duplicated_step(kind: str, damping: float, seed: int, n: int = 6) -> list[Measured]:
    """One float32 ``sngd`` step on a batch of n samples taken twice (cross-entropy, mean), each layer's result
    measured against the float64 dense solve from the true per-sample gradients of a float64 twin."""
    gen = torch.Generator().manual_seed(1000 + seed)
    x = 3.0 * torch.randn((n, 10) if kind == "linear" else (n, 2, 6, 6), generator=gen)
    y = torch.randint(0, 5, (n,), generator=gen)
    x, y = torch.cat([x, x]), torch.cat([y, y])
    reference = _net(kind, seed).double()
    per_sample = per_sample_matrices(reference, _layers(reference), x.double(), lambda out: F.cross_entropy(out, y))
    reference.zero_grad()
    F.cross_entropy(reference(x.double()), y).backward()
    model = _net(kind, seed)
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=damping, conv_rows="exact")
    F.cross_entropy(model(x), y).backward()
    raw = {name: grad_matrix(layer).double() for name, layer in _layers(model).items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre.step()
    assert not caught, [str(w.message) for w in caught]  # no fallback: the solve itself is sound
    measured = []
    for name, layer in _layers(model).items():
        expected = dense_natural_gradient(per_sample[name], grad_matrix(_layers(reference)[name]), damping)
        v = grad_matrix(layer).double()
        cos = float((v * raw[name]).sum() / (v.norm() * raw[name].norm()))
        measured.append(
            Measured(cos, float(v.norm() / expected.norm()), float((v - expected).norm() / expected.norm()))
        )
    return measured


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_float32_sngd_on_duplicated_rows_follows_the_float64_reference(kind: str) -> None:
    """λ = 10⁻⁴, seeds where the float32 M and c went uphill (cos down to −0.9, 30–120× too long): now
    within 2% of the float64 dense solve, downhill, the right length."""
    for seed in range(4):
        for m in duplicated_step(kind, 1e-4, seed):
            assert m.cos > 0 and abs(m.ratio - 1) < 0.02 and m.error < 0.02, (seed, m)


@pytest.mark.slow
def test_duplicated_rows_measurement() -> None:
    """50 seeds × Linear/Conv2d × λ ∈ {10⁻², 10⁻³, 10⁻⁴}: no uphill step, no step over 2% too long (printed:
    ``python -m pytest -q -s -m slow tests/library/test_descent.py``)."""
    for kind in ("linear", "conv"):
        for damping in (1e-2, 1e-3, 1e-4):
            steps = [m for seed in range(50) for m in duplicated_step(kind, damping, seed)]
            uphill = sum(m.cos < 0 for m in steps) / len(steps)
            ratio, error = max(m.ratio for m in steps), max(m.error for m in steps)
            print(
                f"{kind} λ={damping:g}: {len(steps)} layer-steps, uphill {uphill:.0%}, max ‖v‖/‖v_ref‖ {ratio:.3g}, "
                f"max relative error {error:.3g}"
            )
            assert uphill == 0 and ratio < 1.02, (kind, damping, uphill, ratio)


# --------------------------------------------------------------------------- the check and its fallback
def _corrupt(state: KFACState, how: str) -> KFACState:
    """The state with eigenvalues that make (A ⊗ G + λI) indefinite (uphill) or nearly singular (longer than
    ‖∇W‖/λ); a new state, as an update or a load makes one (a held state is never changed in place)."""
    if how == "uphill":  # e_g e_a + λ = −10 + λ: V̂ ≈ −∇W/10
        evals_a, evals_g = torch.full_like(state.evals_a, -1.0), torch.full_like(state.evals_g, 10.0)
    else:  # e_g e_a + λ = λ/100: V̂ = 100 ∇W/λ
        evals_a, evals_g = torch.ones_like(state.evals_a), torch.full_like(state.evals_g, -0.99 * state.damping)
    return dataclasses.replace(state, evals_a=evals_a, evals_g=evals_g)


@pytest.mark.parametrize("how", ["uphill", "too long"])
def test_an_unsound_result_falls_back_to_the_raw_gradient_with_a_warning(how: str) -> None:
    """A layer whose V̂ is uphill or longer than ‖∇W‖/λ keeps its raw gradient that step; the other layer is
    preconditioned as usual; the next update's warning names the layer and the count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=2, damping=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    pre.step()  # update: states built
    assert pre.layer_info()[0].state is not None and pre.layer_info()[0].state.kind == KFACState.__name__

    def corrupted(state: LayerState) -> LayerState:
        assert isinstance(state, KFACState)
        return _corrupt(state, how)

    replace_state(pre, 0, corrupted)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = [grad_matrix(model[0]), grad_matrix(model[2])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre.step()  # no update: the fallback is counted, not yet reported
    assert not caught
    assert torch.equal(grad_matrix(model[0]), raw[0])
    assert not torch.equal(grad_matrix(model[2]), raw[1])
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match=r"\{'0': 1\}.*not a descent direction"):
        pre.step()


def _norm(grad: GradMatrix) -> Tensor:
    """‖∇W‖ in float64 (what the guard measures)."""
    return torch.linalg.vector_norm(grad.full().to(torch.float64))


def _terms(grad: GradMatrix, vs: list[Tensor], dampings: list[float | None], norm: Tensor | None = None) -> Tensor:
    """The check's float64 terms [⟨∇W, V̂⟩, ‖V̂‖²] of each of ``vs`` against ``grad`` as a step computes them
    (``unit_scales``, ``result_sums``, divided by s and s²); ``norm``: the whole ‖∇W‖ where ``grad`` is some rows
    of it (measured here by default)."""
    whole = grad.full()
    k = len(vs)
    norms = (_norm(grad) if norm is None else norm).expand(k)
    limits = check_limits(dampings, [whole.dtype] * k, whole.device)
    (scales,), scale64 = unit_scales(norms, limits, [(0, k, whole.dtype)])
    stack = torch.stack([whole.expand(k, -1, -1), torch.zeros(k, *whole.shape, dtype=whole.dtype)], dim=1)
    sums = result_sums(stack, torch.stack(vs).to(whole.dtype), scales)
    return sums.to(torch.float64) / scale64.unsqueeze(1).pow(torch.tensor([1.0, 2.0], dtype=torch.float64))


def _sound(terms: Tensor, norm: Tensor, dampings: list[float | None]) -> list[bool]:
    """The check's verdict on ``terms`` of results of one ∇W (of norm ``norm``), float32."""
    limits = check_limits(dampings, [torch.float32] * len(dampings), terms.device)
    return sound(terms, norm.expand(len(dampings)), limits).tolist()


def _judge(grad: GradMatrix, vs: list[Tensor], dampings: list[float | None]) -> list[bool]:
    return _sound(_terms(grad, vs, dampings), _norm(grad), dampings)


def test_the_check_judges_each_condition() -> None:
    """Finite, ⟨∇W, V̂⟩ > 0 (or ∇W = 0), ‖V̂‖ ≤ ‖∇W‖/λ (1 + slack): each failing alone fails; λ = 0 skips
    the length bound; None checks finiteness only."""
    g = GradMatrix(torch.tensor([[3.0, 4.0]]), None)  # ‖∇W‖ = 5
    cases = {
        "sound": (torch.tensor([[30.0, 40.0]]), 0.1, True),  # exactly ‖∇W‖/λ
        "uphill": (torch.tensor([[-3.0, -4.0]]), 0.1, False),
        "orthogonal": (torch.tensor([[4.0, -3.0]]), 0.1, False),
        "too long": (torch.tensor([[30.1, 40.0]]), 0.1, False),
        "too long, no bound": (torch.tensor([[300.0, 400.0]]), 0.0, True),
        "uphill, finiteness only": (torch.tensor([[-3.0, -4.0]]), None, True),
        "not finite, finiteness only": (torch.tensor([[float("inf"), 4.0]]), None, False),
        "not finite, no bound": (torch.tensor([[float("inf"), 4.0]]), 0.0, False),
        "not finite": (torch.tensor([[float("inf"), 4.0]]), 0.1, False),
        "nan": (torch.tensor([[float("nan"), 4.0]]), 0.1, False),
        "nan, finiteness only": (torch.tensor([[float("nan"), 4.0]]), None, False),
    }
    ok = _judge(g, [v for v, _, _ in cases.values()], [lam for _, lam, _ in cases.values()])
    assert dict(zip(cases, ok, strict=True)) == {name: want for name, (_, _, want) in cases.items()}
    zero = GradMatrix(torch.zeros(1, 2), None)
    assert _judge(zero, [torch.zeros(1, 2), torch.tensor([[1e-30, 0.0]])], [0.1, 0.1]) == [True, False]
    # ∇W = 0 without a bound (kfac_adam's momentum step for an expert no token reached): any finite step
    steps = [torch.tensor([[10.0, -3.0]]), torch.tensor([[1e13, 0.0]]), torch.tensor([[float("inf"), 0.0]])]
    assert _judge(zero, steps, [None, None, None]) == [True, True, False]
    assert _judge(zero, [torch.tensor([[10.0, -3.0]])], [0.1]) == [False]


@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e19])
def test_the_check_terms_add_up_over_rows_without_overflow(scale: float) -> None:
    """Rows of one ∇W split between ranks (FSDP2): the terms of the parts, each scaled by the global ‖∇W‖, add
    up to those of the whole (so every rank judges the same sums), in float64 from float32 entries of 10⁻²⁰ or
    10¹⁹ (whose products under- or overflow float32)."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = scale * torch.randn(6, 4, generator=gen), scale * torch.randn(6, generator=gen)
    v = 7.0 * torch.cat([weight, bias[:, None]], dim=1) + scale * torch.randn(6, 5, generator=gen)
    norm = _norm(GradMatrix(weight, bias))
    whole = _terms(GradMatrix(weight, bias), [v], [0.1])[0]
    parts = (
        _terms(GradMatrix(weight[:2], bias[:2]), [v[:2]], [0.1], norm)[0]
        + _terms(GradMatrix(weight[2:], bias[2:]), [v[2:]], [0.1], norm)[0]
    )
    g64, v64 = torch.cat([weight, bias[:, None]], dim=1).double(), v.double()
    expected = torch.stack([(g64 * v64).sum(), v64.square().sum()])
    torch.testing.assert_close(whole, expected, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(parts, expected, rtol=1e-6, atol=0.0)
    assert all(_sound(torch.stack([whole, parts]), norm, [0.1, 0.1]))


# --------------------------------------------------------------------------- the terms against float64
def _reference(grad: GradMatrix, v: Tensor) -> Tensor:
    """[⟨∇W, V̂⟩, ‖V̂‖²] in float64 from float64 copies (nothing of the check)."""
    g64, v64 = grad.to(torch.float64).full(), v.to(torch.float64)
    return torch.stack([(g64 * v64).sum(), v64.square().sum()])


def _layouts(d_g: int, d_w: int, gen: torch.Generator) -> dict[str, GradMatrix]:
    """One ∇W in each layout hylo's layers give: contiguous weight with a bias, a transposed weight (an
    embedding's), and a column block of a wider weight with a strided bias (neither dense nor contiguous)."""
    wide = torch.randn(d_g, d_w + 3, generator=gen)
    return {
        "contiguous": GradMatrix(torch.randn(d_g, d_w, generator=gen), torch.randn(d_g, generator=gen)),
        "transposed": GradMatrix(torch.randn(d_w, d_g, generator=gen).mT),
        "strided": GradMatrix(wide[:, 1 : d_w + 1], wide[:, 0]),
    }


@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e19])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_the_check_terms_match_float64_at_extreme_scales(scale: float, layout: str) -> None:
    """⟨∇W, V̂⟩ and ‖V̂‖² of a float32 ∇W of 10⁻²⁰, 1 or 10¹⁹ against its V̂ = (F̃ + λI)⁻¹∇W-like result
    (at the bound, or 10⁶ times shorter), in every layout, agree with float64 sums, with a bound and without one
    (a state that bounds nothing: its scale's denominator floored)."""
    gen = torch.Generator().manual_seed(11)
    grad = _layouts(24, 256, gen)[layout]
    grad = GradMatrix(grad.weight * scale, None if grad.bias is None else grad.bias * scale)
    norm = _norm(grad)
    for damping, shrink in [(1e-12, 1.0), (1e6, 1.0), (1e-3, 1e-6)]:
        noise = torch.randn(grad.shape, generator=gen) * (0.1 * float(norm) / grad.shape[1])
        v = ((grad.full() + noise) * (shrink / damping)).contiguous()
        want = _reference(grad, v)
        bounded, unbounded = _terms(grad, [v, v], [damping, None])
        torch.testing.assert_close(bounded, want, rtol=1e-5, atol=0.0)
        torch.testing.assert_close(unbounded[0], want[0], rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("scale", [1e-20, 1e-7, 1.0, 1e19])
@pytest.mark.parametrize("damping", [1e-12, 1e-3, 1e6])
def test_a_result_at_the_bound_is_accepted_and_one_percent_beyond_refused(scale: float, damping: float) -> None:
    """V̂ = ∇W/λ (F̃ = 0: exactly at ‖∇W‖/λ) is sound at every scale of ∇W and λ; 1.01 times it is not, nor
    is it reversed (uphill); V̂ = ∇W/(10⁶ + λ) (a large F̃: far shorter, its products far smaller) still
    counts as a descent direction."""
    gen = torch.Generator().manual_seed(5)
    grad = _layouts(32, 300, gen)["contiguous"]
    grad = GradMatrix(grad.weight * scale, grad.bias * scale)
    full = grad.full().to(torch.float64)
    vs = [(full / damping).float(), (1.01 * full / damping).float(), (-full / damping).float()]
    vs.append((full / (1e6 + damping)).float())
    assert _judge(grad, vs, [damping] * 4) == [True, False, False, True]


def test_a_tiny_gradient_keeps_its_preconditioned_step() -> None:
    """A float32 ∇W of about 10⁻²³ (its squares below float32's subnormals: its float32 norm is 0) is measured
    exactly by the guard, so its sound result is applied, not refused as longer than ‖∇W‖/λ = 0."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    pre = HyLoPreconditioner(model, solver="sngd", damping=0.1)
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    (1e-22 * F.mse_loss(model(x), y)).backward()
    raw = grad_matrix(model)
    assert float(raw.abs().max()) < 1e-21 and float(torch.linalg.vector_norm(raw)) < 1e-20
    pre.step()
    assert sum(info.fallbacks for info in pre.layer_info()) == 0
    state = pre.layer_info()[0].state
    assert state is not None
    torch.testing.assert_close(grad_matrix(model), state.precondition(as_parts(raw, True)), rtol=1e-6, atol=0.0)
