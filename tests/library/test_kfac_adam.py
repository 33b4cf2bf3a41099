"""``solver="kfac_adam"``: Adam's moments in the K-FAC eigenbasis (docs/solvers.md, "Adam in the K-FAC eigenbasis").

Specified against independent references:

- with identity bases the family is Adam: hylo + SGD(lr) equals ``torch.optim.Adam(lr)`` step for step;
- with K-FAC's eigenvalues as its second moment, exponent 1, no momentum and ε = λ it is K-FAC: the dense
  (A ⊗ G + λI)⁻¹ vec ∇W with A and G built from the layer's own inputs and output gradients;
- between updates (a fixed basis) it is Adam run on the rotated gradients Q_gᵀ ∇W Q_a, the basis from the
  eigendecomposition of those reference factors;
- at an update the momentum is carried into the new basis exactly, and v by ``moment_carry``;
- a step is transactional: a failed or skipped step leaves the moments as they were.

P ranks = one process (DDP, both strategies; FSDP2), checkpoints and bf16 are in the shared suites
(tests/library/test_distributed.py, tests/library/test_fsdp.py, tests/library/test_checkpoint.py, tests/library/test_mixed_precision.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.integrity import seal
from hylo.solvers import FAMILIES, register_family, solver_names
from hylo.solvers.bundled.adam_rule import AdamRule, carried_moments, carried_moments_many
from hylo.solvers.bundled.kfac_adam import KFACAdamFamily, KFACAdamState
from hylo.solvers.kfac import KFACFamily
from tests.kit.cases import conv_case
from tests.kit.checks import DT, assert_rel_close, rel_err
from tests.kit.models import fixed_target, one_step
from tests.kit.reference import dense_kfac, linear_rows
from tests.library.test_mixed_precision import run_precision

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

#: kfac_adam as K-FAC: K-FAC's eigenvalue products as v̂, exponent 1, no momentum, ε = λ.
AS_KFAC: dict[str, Any] = {"adam_betas": (0.0, 0.999), "adam_exponent": 1.0, "second_moment": "factors"}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, dtype=DT), nn.Tanh(), nn.Linear(7, 3, dtype=DT))


def _data(step: int) -> tuple[Tensor, Tensor, float]:
    """Inputs, labels and a loss multiplier: step 3 flips the loss (a momentum step is then not a descent
    direction of that step's gradient, and must be applied anyway)."""
    gen = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(16, 5, generator=gen, dtype=DT),
        torch.randint(0, 3, (16,), generator=gen),
        -(0.05 ** (step == 3)),
    )


# --------------------------------------------------------------------------- reductions
def test_identity_basis_is_adam() -> None:
    """adam_basis="identity" + SGD(lr) takes torch.optim.Adam's steps, across updates and a sign-flipped step."""
    model, reference = _mlp(), _mlp()
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", adam_basis="identity", update_freq=3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    adam = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(8):
        x, y, sign = _data(step)
        for net, opt in ((model, sgd), (reference, adam)):
            opt.zero_grad()
            (sign * F.cross_entropy(net(x), y)).backward()
        pre.step()
        sgd.step()
        adam.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert_rel_close(p.detach(), q.detach(), 1e-12)
    assert not any(info.fallbacks for info in pre.layer_info())  # the ascent step of step 3 was applied, not ∇W


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_factors_second_moment_with_exponent_one_is_kfac_on_a_linear(bias: bool) -> None:
    damping = 0.05
    layer = nn.Linear(5, 3, bias=bias, dtype=DT)
    x = torch.randn(6, 5, dtype=DT)

    def loss_fn(out: Tensor) -> Tensor:
        return F.mse_loss(out, fixed_target(out.shape))

    options = {**AS_KFAC, "adam_eps": damping}
    _, dout, grad, got = one_step(layer, x, loss_fn, solver="kfac_adam", damping=damping, **options)
    a, g = linear_rows(layer, x, dout)
    rows = a.shape[0]
    expected = dense_kfac(a.mT @ a / rows, g.mT @ g / rows, grad, damping)
    assert rel_err(expected, grad / damping) > 1e-2  # the curvature matters at this damping
    assert_rel_close(got, expected)


@pytest.mark.parametrize("case", ["stride2-pad1", "dilation2"])
def test_factors_second_moment_with_exponent_one_is_kfac_on_a_convolution(case: str) -> None:
    damping = 1e-3
    result = conv_case("kfac_adam", True, case, damping, **AS_KFAC, adam_eps=damping)
    ref = result.conv
    assert ref is not None
    expected = dense_kfac(ref["A"], ref["G"], result.grad, damping)
    assert rel_err(expected, result.grad / damping) > 1e-2
    assert_rel_close(result.got, expected)


def test_between_updates_it_is_adam_on_the_rotated_gradient() -> None:
    """One update (step 0) fixes Q_a, Q_g from A = E[aaᵀ], G = E[ggᵀ] of that step; every later step is
    V̂ = Q_g u Q_aᵀ with u torch.optim.Adam's step on Q_gᵀ ∇W Q_a (eigenvector signs and order do not matter)."""
    torch.manual_seed(3)
    layer = nn.Linear(6, 4, dtype=DT)
    pre = hylo.HyLoPreconditioner(layer, solver="kfac_adam", update_freq=100)
    rotated = torch.zeros(4, 7, dtype=DT, requires_grad=True)
    adam = torch.optim.Adam([rotated], lr=1.0)
    basis: tuple[Tensor, Tensor] | None = None
    for step in range(5):
        x = torch.randn(10, 6, dtype=DT)
        layer.zero_grad()
        out = layer(x)
        out.retain_grad()
        F.mse_loss(out, fixed_target(out.shape) * step).backward()
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        if basis is None:
            a, g = linear_rows(layer, x, out.grad)
            basis = (torch.linalg.eigh(a.mT @ a / 10)[1], torch.linalg.eigh(g.mT @ g / 10)[1])
        q_a, q_g = basis
        pre.step()
        got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        before = rotated.detach().clone()
        rotated.grad = q_g.mT @ grad @ q_a
        adam.step()
        expected = q_g @ (before - rotated.detach()) @ q_a.mT
        assert rel_err(got, grad) > 0.1  # the step is not the gradient
        assert_rel_close(got, expected, 1e-9)


# --------------------------------------------------------------------------- moments across a basis change
def _orthogonal(n: int, seed: int) -> Tensor:
    return torch.linalg.qr(torch.randn(n, n, dtype=DT, generator=torch.Generator().manual_seed(seed)))[0]


def _state(q_a: Tensor, q_g: Tensor, seed: int) -> KFACAdamState:
    gen = torch.Generator().manual_seed(seed)
    d_a, d_g = q_a.shape[0], q_g.shape[0]
    m = torch.randn(d_g, d_a, dtype=DT, generator=gen)
    v = torch.rand(d_g, d_a, dtype=DT, generator=gen)
    eye_a, eye_g = torch.eye(d_a, dtype=DT), torch.eye(d_g, dtype=DT)
    rule = AdamRule(0.9, 0.999, 1e-8, 0.5, "gradient")
    return KFACAdamState(
        eye_a, eye_g, torch.ones(d_a, dtype=DT), q_a, torch.ones(d_g, dtype=DT), q_g, m, v, 7, 1.0, rule
    )


@pytest.mark.parametrize("carry", ["keep", "project"])
def test_the_momentum_is_carried_exactly_into_a_new_basis(carry: str) -> None:
    old = _state(_orthogonal(5, 0), _orthogonal(3, 1), seed=2)
    q_a, q_g = _orthogonal(5, 3), _orthogonal(3, 4)
    m, v, steps = carried_moments(old, q_a, q_g, carry)
    assert steps == 7
    # the momentum in parameter space, Q_g m Q_aᵀ, is the same before and after
    assert_rel_close(q_g @ m @ q_a.mT, old.evecs_g @ old.exp_avg @ old.evecs_a.mT, 1e-12)
    if carry == "keep":  # each entry with the old pair its new vectors lie most along, never below the projection
        w_a, w_g = (old.evecs_a.mT @ q_a).square(), (old.evecs_g.mT @ q_g).square()
        paired = old.exp_avg_sq[w_g.argmax(0)][:, w_a.argmax(0)]
        projected = w_g.mT @ old.exp_avg_sq @ w_a
        assert torch.equal(v, torch.maximum(paired, projected))
        # so however the basis turns, no entry's m²/v exceeds the old Σ m²/v (Cauchy–Schwarz on the projection)
        assert float((m.square() / v).max()) <= float((old.exp_avg.square() / old.exp_avg_sq).sum()) * (1 + 1e-12)
    else:  # (P_g∘P_g)ᵀ v (P_a∘P_a): non-negative, and its sum is v's (the columns of P∘P sum to 1)
        assert bool((v >= 0).all())
        torch.testing.assert_close(v.sum(), old.exp_avg_sq.sum(), rtol=1e-12, atol=0.0)
        assert rel_err(v, old.exp_avg_sq) > 0.1


def test_the_second_moment_follows_permuted_eigenvectors() -> None:
    """A new basis that only reorders the eigenvectors (an eigensolver's order when eigenvalues cross) moves v with
    them exactly under both carries: "keep" keeps each entry with its eigenvector pair."""
    old = _state(_orthogonal(4, 5), _orthogonal(3, 6), seed=7)
    perm_a, perm_g = torch.tensor([2, 0, 3, 1]), torch.tensor([1, 2, 0])
    q_a, q_g = old.evecs_a[:, perm_a], old.evecs_g[:, perm_g]
    _, projected, _ = carried_moments(old, q_a, q_g, "project")
    torch.testing.assert_close(projected, old.exp_avg_sq[perm_g][:, perm_a], rtol=1e-12, atol=1e-14)
    _, kept, _ = carried_moments(old, q_a, q_g, "keep")
    torch.testing.assert_close(kept, old.exp_avg_sq[perm_g][:, perm_a], rtol=1e-12, atol=1e-14)


def test_moments_carried_in_batches_are_each_layers_own_carry() -> None:
    """``carried_moments_many`` (an update's assembly, batched across layers of one shape, rule and refresh flags)
    gives every layer what :func:`carried_moments` gives it alone: dense layers of two shapes, both rules, a side
    kept (P = I), a first state and a basis that only permutes (whose "keep" pairing moves v exactly)."""
    olds: list[KFACAdamState | None] = [
        _state(_orthogonal(5, 10 + i), _orthogonal(3, 20 + i), seed=i) for i in range(5)
    ]
    olds += [_state(_orthogonal(4, 30), _orthogonal(2, 31), seed=9), _state(_orthogonal(4, 32), _orthogonal(2, 33), 8)]
    olds.append(None)
    bases = [(_orthogonal(5, 40 + i), _orthogonal(3, 50 + i)) for i in range(5)]
    bases += [(_orthogonal(4, 60), _orthogonal(2, 61)), (_orthogonal(4, 62), _orthogonal(2, 63))]
    bases.append((torch.eye(4, dtype=DT), torch.eye(2, dtype=DT)))
    permuted = olds[1]
    assert permuted is not None
    bases[1] = (permuted.evecs_a[:, torch.tensor([3, 0, 4, 1, 2])], permuted.evecs_g[:, torch.tensor([2, 0, 1])])
    carry = ["keep", "keep", "keep", "project", "keep", "keep", "keep", "keep"]
    refresh = [(True, True), (True, True), (True, True), (True, True), (True, False), (True, True), (False, True)]
    refresh.append((True, True))
    widths = [(3, 5)] * 5 + [(2, 4)] * 3
    got = carried_moments_many(olds, bases, carry, widths, refresh)
    for i, (m, v, steps) in enumerate(got):
        want = carried_moments(olds[i], *bases[i], carry[i], widths[i], refresh[i])
        assert steps == want[2], i
        torch.testing.assert_close(m, want[0], rtol=1e-13, atol=1e-15, msg=f"m of layer {i}")
        torch.testing.assert_close(v, want[1], rtol=1e-13, atol=1e-15, msg=f"v of layer {i}")
    torch.testing.assert_close(got[1][1], permuted.exp_avg_sq[[2, 0, 1]][:, [3, 0, 4, 1, 2]], rtol=1e-12, atol=1e-14)
    storages = {t.untyped_storage().data_ptr() for m, v, _ in got for t in (m, v)}
    assert len(storages) == 2 * len(got)  # each layer's moments are tensors of its own


def test_first_state_starts_from_zero_moments() -> None:
    m, v, steps = carried_moments(None, torch.eye(3, dtype=DT), torch.eye(2, dtype=DT), "keep")
    assert steps == 0 and not m.any() and not v.any() and m.shape == v.shape == (2, 3)


# --------------------------------------------------------------------------- transactional steps
def _moments(pre: hylo.HyLoPreconditioner) -> dict[str, tuple[Tensor, Tensor, int]]:
    out = {}
    for info in pre.layer_info():
        state = info.state
        assert state is not None and state.kind == KFACAdamState.__name__
        out[info.name] = (state.tensors["exp_avg"].clone(), state.tensors["exp_avg_sq"].clone(), state.fields["steps"])
    return out


def test_a_failed_step_leaves_the_moments_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp()
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=2)
    for step in range(3):
        model.zero_grad()
        x, y, _ = _data(step)
        F.cross_entropy(model(x), y).backward()
        pre.step()
    before = _moments(pre)
    assert all(steps == 3 for _, _, steps in before.values())

    import hylo.preconditioner as module

    real = module.apply

    def failing(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # the moments were advanced into the step's outcome...
        raise RuntimeError("injected")  # ...which is then discarded

    monkeypatch.setattr(module, "apply", failing)
    model.zero_grad()
    x, y, _ = _data(3)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="injected"):
        pre.step()
    after = _moments(pre)
    for name, (m, v, steps) in before.items():
        assert torch.equal(after[name][0], m) and torch.equal(after[name][1], v) and after[name][2] == steps


def test_a_skipped_step_does_not_advance_the_moments() -> None:
    model = _mlp()
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=5)
    model.zero_grad()
    x, y, _ = _data(0)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    before = _moments(pre)
    model.zero_grad()
    (F.cross_entropy(model(x), y) * float("inf")).backward()
    with pytest.warns(UserWarning, match="non-finite"):
        pre.step()
    after = _moments(pre)
    for name, (m, v, steps) in before.items():
        assert torch.equal(after[name][0], m) and torch.equal(after[name][1], v) and after[name][2] == steps == 1


# --------------------------------------------------------------------------- checkpoints
def _trained(steps: int) -> tuple[nn.Module, hylo.HyLoPreconditioner]:
    model = _mlp()
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=3)
    for step in range(steps):
        model.zero_grad()
        x, y, _ = _data(step)
        F.cross_entropy(model(x), y).backward()
        pre.step()
    return model, pre


def test_state_dict_holds_the_moments_and_refuses_corrupt_ones() -> None:
    model, pre = _trained(4)
    saved = pre.state_dict()
    entry = next(iter(saved["layers"].values()))
    assert entry["steps"] == 4 and entry["rule"]["beta1"] == 0.9
    for corrupt, message in (
        (lambda e: e["tensors"]["exp_avg_sq"].fill_(-1.0), "exp_avg_sq holds negative values"),
        (lambda e: e.update(steps=-1), "steps must be an int >= 0"),
        (lambda e: e["rule"].update(beta1=1.5), "rule: adam_betas"),
        (lambda e: e["rule"].pop("eps"), "rule must be a mapping"),
        (lambda e: e["tensors"].pop("exp_avg"), "lacks tensor 'exp_avg'"),
    ):
        bad = copy.deepcopy(saved)
        corrupt(next(iter(bad["layers"].values())))
        bad = seal(bad)  # the checksum matches: the validation itself refuses
        fresh = hylo.HyLoPreconditioner(_mlp(), solver="kfac_adam", update_freq=3)
        with pytest.raises(ValueError, match=message):
            fresh.load_state_dict(bad)
        assert all(info.state is None for info in fresh.layer_info())  # nothing half-loaded


# --------------------------------------------------------------------------- options, hybrid, registration
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"adam_betas": (0.9, 1.0)}, "adam_betas must be a pair"),
        ({"adam_betas": 0.9}, "adam_betas must be a pair"),
        ({"adam_eps": 0.0}, "adam_eps must be a finite number > 0"),
        ({"adam_exponent": 0.0}, r"adam_exponent must be a number in \(0, 1\]"),
        ({"second_moment": "hessian"}, "second_moment must be one of"),
        ({"moment_carry": "reset"}, "moment_carry must be one of"),
        ({"kfac_solver": "kid"}, "kfac_solver must be a registered solver that is not a low-rank variant"),
    ],
)
def test_options_are_checked_when_the_config_is_made(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hylo.HyLoConfig(**options)


def test_hybrid_gives_kfac_adam_where_it_would_give_kfac() -> None:
    def decisions(**options: Any) -> list[tuple[str, str]]:
        model = _mlp()
        pre = hylo.HyLoPreconditioner(model, solver="hybrid", update_freq=2, **options)
        for step in range(4):
            model.zero_grad()
            x, y, _ = _data(step)
            F.cross_entropy(model(x.repeat(16, 1)), y.repeat(16)).backward()  # 256 rows: K-FAC is the cheaper
            pre.step()
        return [(d.layer, d.solver) for d in pre.decision_log]

    plain = decisions(fidelity_budget=0.0)
    adapted = decisions(fidelity_budget=0.0, kfac_solver="kfac_adam")
    assert "kfac" in {solver for _, solver in plain}  # not vacuous: hybrid takes K-FAC somewhere
    assert adapted == [(layer, "kfac_adam" if solver == "kfac" else solver) for layer, solver in plain]


def test_kfac_adam_is_a_family_registered_through_the_public_api() -> None:
    family = next(f for f in FAMILIES if f.name == "kfac_adam")
    assert isinstance(family, KFACAdamFamily) and "kfac_adam" in solver_names()
    with pytest.raises(ValueError, match="registered already"):
        register_family(KFACAdamFamily())
    with pytest.raises(ValueError, match="SolverFamily instance"):
        register_family("kfac_adam")  # type: ignore[arg-type]

    class Renamed(KFACFamily):
        name = "renamed"

    with pytest.raises(ValueError, match="solver name 'kfac' is taken"):
        register_family(Renamed())
    assert [f.name for f in FAMILIES].count("renamed") == 0


def test_kfac_max_state_mb_counts_the_moments() -> None:
    """A layer's kfac_adam state is K-FAC's plus m and v: a budget between the two refuses kfac_adam only."""
    model = nn.Sequential(nn.Linear(40, 30))
    kfac_mb = (2 * (41 * 41 + 30 * 30) + 41 + 30) * 4 / 2**20
    budget = kfac_mb + 30 * 41 * 4 / 2**20  # above K-FAC's, below K-FAC's + 2 d_a d_g
    hylo.HyLoPreconditioner(model, solver="kfac", kfac_max_state_mb=budget)
    with pytest.raises(ValueError, match="kfac_adam state"):
        hylo.HyLoPreconditioner(model, solver="kfac_adam", kfac_max_state_mb=budget)


def test_studies_and_profiling_run_with_kfac_adam(tmp_path: Any) -> None:
    model = _mlp()
    pre = hylo.HyLoPreconditioner(
        model,
        solver="kfac_adam",
        update_freq=2,
        profile_dir=tmp_path,
        studies=("grad_norm", "grad_error"),
        grad_error_methods=("kfac", "kfac_adam"),
    )
    for step in range(4):
        model.zero_grad()
        x, y, _ = _data(step)
        F.cross_entropy(model(x), y).backward()
        pre.step()
    pre.close()
    errors = (tmp_path / "grad-error.csv").read_text()
    assert "kfac_adam" in errors
    assert "kfac_adam" in (tmp_path / "decisions.csv").read_text()


# --------------------------------------------------------------------------- bf16 autocast
def test_bf16_autocast_keeps_the_state_in_float32_and_the_kfac_rule_within_bf16_tolerance() -> None:
    """As K-FAC (AS_KFAC, ε = λ) the family meets the mixed-precision suite's bound: preconditioning does not
    amplify the bf16 forward's error; the state (factors, bases, moments) stays float32."""
    options = {**AS_KFAC, "adam_eps": 0.1}
    raw32, pre32, _ = run_precision("kfac_adam", autocast=False, **options)
    raw16, pre16, pre = run_precision("kfac_adam", autocast=True, **options)
    for step in range(len(raw32)):
        for name, exact in pre32[step].items():
            raw_error = rel_err(raw16[step][name], raw32[step][name])
            assert rel_err(pre16[step][name], exact) <= 4 * raw_error + 0.02, f"{name} at step {step}"
    for info in pre.layer_info():
        assert info.state is not None and info.state.kind == KFACAdamState.__name__
        assert {t.dtype for t in info.state.tensors.values()} == {torch.float32}


def test_bf16_autocast_with_adams_rule_is_close_once_eps_is_above_bf16_noise() -> None:
    """Adam's rule divides by √v̂ + ε: entries of R below ε are damped, above it scaled to ~1, so bf16 round-off in
    near-zero entries becomes a unit step when ε is tiny, as in torch.optim.Adam (docs/solvers.md, "Adam in the
    K-FAC eigenbasis"). With ε 1e-3, above the noise, every layer's bf16 step points where the float32 one does."""
    raw32, pre32, _ = run_precision("kfac_adam", autocast=False, steps=3, adam_eps=1e-3)
    raw16, pre16, _ = run_precision("kfac_adam", autocast=True, steps=3, adam_eps=1e-3)
    for step in range(3):
        for name, exact in pre32[step].items():
            got = pre16[step][name]
            assert torch.isfinite(got).all()
            assert F.cosine_similarity(got.flatten(), exact.flatten(), dim=0) > 0.95, f"{name} at step {step}"


def test_a_huge_gradient_entry_keeps_the_second_moment_finite() -> None:
    """R² of a float32 entry of 1e20 overflows; it is clamped at the dtype's largest value, so v stays finite and
    the layer keeps stepping (an infinite v would divide every later step of that entry to 0)."""
    eye3, eye2 = torch.eye(3), torch.eye(2)
    rule = AdamRule(0.9, 0.999, 1e-8, 0.5, "gradient")
    zeros = torch.zeros(2, 3)
    state = KFACAdamState(eye3, eye2, torch.ones(3), eye3, torch.ones(2), eye2, zeros, zeros.clone(), 0, 1.0, rule)
    grad = torch.tensor([[1e20, 1.0, -2.0], [0.5, 0.0, 3.0]])
    result, after = state.advance(grad)
    assert isinstance(after, KFACAdamState) and after.steps == 1 and state.steps == 0  # the state itself unchanged
    assert torch.isfinite(after.exp_avg_sq).all() and torch.isfinite(result).all()
    # Adam's first step R / |R| (ε ≪ |R|) everywhere but the clamped entry, which still steps the right way
    torch.testing.assert_close(result.flatten()[1:], torch.sign(grad).flatten()[1:])
    assert result[0, 0] > 1.0
