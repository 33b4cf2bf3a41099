"""The K-FAC solver (hylo/solvers/kfac.py) against dense references built independently in tests/kit/reference.py.

Every reference is assembled from the layer's input and the autograd gradient w.r.t. its output
(``out.retain_grad()``), never from hylo's own capture or row code, and then solved densely:
(A ⊗ G + λI) vec(V) = vec(∇W) with column-major vec, W of shape (d_g, d_a).

Models are float64 so the comparisons can be tight (relative 1e-8 in the Frobenius norm). The
``solver`` parameter of the dense comparisons is K-FAC's half of a kfac/sngd parametrization
(SNGD's half is in test_lowrank.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from hylo import HyLoPreconditioner
from tests.kit.cases import LINEAR_SHAPES, conv_case, linear_case, scheduled_damping_steps
from tests.kit.checks import DT, REPLAY_RTOL, RTOL, assert_rel_close, grad_matrix, rel_err
from tests.kit.models import fixed_target, one_step
from tests.kit.reference import CONV_CASES, conv_reference, dense_kfac, linear_rows, vec_cm

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]


def test_reference_vec_convention() -> None:
    """kron(A, G) acts on column-major vec as X ↦ G X Aᵀ (the convention dense_kfac relies on)."""
    a, g, x = torch.randn(4, 4, dtype=DT), torch.randn(3, 3, dtype=DT), torch.randn(3, 4, dtype=DT)
    torch.testing.assert_close(torch.kron(a, g) @ vec_cm(x), vec_cm(g @ x @ a.mT), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- 1. Linear
@pytest.mark.parametrize("solver", ["kfac"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_linear_matches_dense(solver: str, bias: bool, shape: str, loss: str) -> None:
    damping = 0.05
    case = linear_case(solver, bias, LINEAR_SHAPES[shape], loss, damping)
    a, g = case.a, case.g
    assert a is not None and g is not None
    rows = a.shape[0]
    expected = dense_kfac(a.mT @ a / rows, g.mT @ g / rows, case.grad, damping)
    assert rel_err(expected, case.grad / damping) > 1e-2  # the curvature matters at this damping
    assert_rel_close(case.got, expected)


# --------------------------------------------------------------------------- 1. Conv2d
@pytest.mark.parametrize("solver", ["kfac"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv2d_matches_dense(solver: str, bias: bool, case: str) -> None:
    damping = 1e-5
    result = conv_case(solver, bias, case, damping)
    ref = result.conv
    assert ref is not None
    expected = dense_kfac(ref["A"], ref["G"], result.grad, damping)
    assert rel_err(expected, result.grad / damping) > 1e-2
    assert_rel_close(result.got, expected)


@pytest.mark.parametrize("exponent", [0.0, 1.0, 1.5, 2.0])
@pytest.mark.parametrize("case", ["stride2-pad1", "dilation2", "same-even"])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv2d_kfc_exponent_scales_the_fisher_by_positions(exponent: float, case: str) -> None:
    """kfc_exponent e: the Fisher is L^e·E_p[a aᵀ] ⊗ E_p[g gᵀ] over the L output positions."""
    damping = 0.03
    result = conv_case("kfac", True, case, damping, kfc_exponent=exponent)
    ref = result.conv
    assert ref is not None
    positions = float(ref["positions"])
    assert positions > 1
    mean_g = ref["G"] / positions  # the reference's G is Σ_p over positions, averaged over samples
    expected = dense_kfac(ref["A"], positions**exponent * mean_g, result.grad, damping)
    other = dense_kfac(ref["A"], positions ** (exponent + 0.5) * mean_g, result.grad, damping)
    assert rel_err(expected, other) > 1e-2  # the exponent matters at this damping
    assert_rel_close(result.got, expected)


# --------------------------------------------------------------------------- 5. callable damping
@pytest.mark.parametrize("solver", ["kfac"])
def test_callable_damping_is_evaluated_per_update(solver: str) -> None:
    for case, lam in scheduled_damping_steps(solver):
        a, g = case.a, case.g
        assert a is not None and g is not None
        expected = dense_kfac(a.mT @ a / 6, g.mT @ g / 6, case.grad, lam)
        assert_rel_close(case.got, expected)


# --------------------------------------------------------------------------- 6. K-FAC running average
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_kfac_running_average(kind: str) -> None:
    decay, damping = 0.7, 0.05
    if kind == "linear":
        layer: nn.Module = nn.Linear(4, 3, dtype=DT)
    else:
        layer = nn.Conv2d(2, 3, 3, stride=2, padding=1, dtype=DT)
    pre = HyLoPreconditioner(layer, solver="kfac", update_freq=1, factor_decay=decay, damping=damping)
    running: tuple[Tensor, Tensor] | None = None
    for step in range(3):
        layer.zero_grad()
        x = torch.randn((6, 4) if kind == "linear" else (3, 2, 5, 5), dtype=DT)
        out = layer(x)
        out.retain_grad()
        F.mse_loss(out, fixed_target(out.shape, seed=step)).backward()
        grad = grad_matrix(layer)
        pre.step()
        if kind == "linear":
            a, g = linear_rows(layer, x, out.grad)
            batch = (a.mT @ a / a.shape[0], g.mT @ g / a.shape[0])
        else:
            ref = conv_reference(layer, x, out, out.grad)
            batch = (ref["A"], ref["G"])
        if running is None:  # the first update takes the batch factors as they are
            running = batch
        else:
            running = tuple(decay * old + (1 - decay) * new for old, new in zip(running, batch, strict=True))
        state = pre.layer_info()[0].state
        assert state is not None
        assert_rel_close(state.tensors["factor_a"], running[0], REPLAY_RTOL)
        assert_rel_close(state.tensors["factor_g"], running[1], REPLAY_RTOL)
        assert_rel_close(grad_matrix(layer), dense_kfac(running[0], running[1], grad, damping))


# --------------------------------------------------------------------------- 7. factor_update_freq
@pytest.mark.parametrize("factor_update_freq", [None, 1, 2])
def test_factor_update_freq_refreshes_running_factors_between_updates(factor_update_freq: int | None) -> None:
    """KAISA's cadences: factors blended at every ``factor_update_freq`` step, decompositions at updates.

    update_freq = 3 (updates at steps 0 and 3). Between updates the preconditioner keeps the
    step-0 decomposition; at step 3 it decomposes the running factors that every refresh step
    (and step 3's batch) was blended into. Rows are rebuilt independently for every step.
    """
    decay, damping = 0.6, 0.05
    layer = nn.Linear(4, 3, dtype=DT)
    pre = HyLoPreconditioner(
        layer,
        solver="kfac",
        update_freq=3,
        factor_update_freq=factor_update_freq,
        factor_decay=decay,
        damping=damping,
    )
    running: tuple[Tensor, Tensor] | None = None
    solved: tuple[Tensor, Tensor] | None = None
    for step in range(4):
        layer.zero_grad()
        x = torch.randn(6, 4, dtype=DT)
        out = layer(x)
        out.retain_grad()
        F.mse_loss(out, fixed_target(out.shape, seed=step)).backward()
        grad = grad_matrix(layer)
        pre.step()
        a, g = linear_rows(layer, x, out.grad)
        batch = (a.mT @ a / 6, g.mT @ g / 6)
        is_update = step % 3 == 0
        refreshed = factor_update_freq is not None and step % factor_update_freq == 0
        if is_update or refreshed:
            running = (
                batch
                if running is None
                else (
                    decay * running[0] + (1 - decay) * batch[0],
                    decay * running[1] + (1 - decay) * batch[1],
                )
            )
        if is_update:
            assert running is not None
            solved = running
        assert running is not None and solved is not None
        state = pre.layer_info()[0].state
        assert state is not None
        assert_rel_close(state.tensors["factor_a"], running[0], REPLAY_RTOL)
        assert_rel_close(state.tensors["factor_g"], running[1], REPLAY_RTOL)
        assert_rel_close(grad_matrix(layer), dense_kfac(solved[0], solved[1], grad, damping))


class _LargestEntryReads(TorchDispatchMode):
    """The numbers each ``_foreach_norm(·, ∞)`` of a step reads (the finiteness check of new float64 states)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func).startswith("aten._foreach_norm") and len(args) > 1 and args[1] == float("inf"):
            self.reads.append(sum(t.numel() for t in args[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam"])
def test_a_refresh_step_checks_the_new_running_factors_only(solver: str) -> None:
    """The finiteness check of a ``factor_update_freq`` step reads the running factors it folded, not the solve and
    moments the state keeps from the last update (checked when that update stored them); an update reads them all."""
    layer = nn.Linear(4, 3, dtype=DT)
    pre = HyLoPreconditioner(layer, solver=solver, update_freq=3, factor_update_freq=1, damping=0.05)
    for step in range(2):
        layer.zero_grad()
        F.mse_loss(layer(torch.randn(6, 4, dtype=DT)), fixed_target((6, 3), seed=step)).backward()
        with _LargestEntryReads() as spy:
            pre.step()
        state = pre.layer_info()[0].state
        assert state is not None
        every = sum(t.numel() for t in state.tensors.values() if t.is_floating_point())
        factors = state.tensors["factor_a"].numel() + state.tensors["factor_g"].numel()
        assert spy.reads == [every if step == 0 else factors], (step, spy.reads)


# --------------------------------------------------------------------------- eigh failures
def _failing_eigh(*args: object, **kwargs: object) -> None:
    raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge (simulated)")


def test_kfac_falls_back_when_torch_eigh_does_not_converge(monkeypatch: pytest.MonkeyPatch) -> None:
    """LAPACK's syevd can fail on large factors with repeated eigenvalues, even in float64: the
    SciPy QR-iteration fallback must give the same preconditioned gradient as the dense solve."""
    damping = 0.05
    layer = nn.Linear(5, 3, dtype=DT)
    x = torch.randn(7, 5, dtype=DT)
    monkeypatch.setattr(torch.linalg, "eigh", _failing_eigh)
    _, dout, grad, got = one_step(layer, x, lambda out: F.mse_loss(out, fixed_target(out.shape)), solver="kfac",
                                  damping=damping)  # fmt: skip
    a, g = linear_rows(layer, x, dout)
    rows = a.shape[0]
    assert_rel_close(got, dense_kfac(a.mT @ a / rows, g.mT @ g / rows, grad, damping))


def test_kfac_keeps_previous_state_when_every_eigh_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import scipy.linalg

    layer = nn.Linear(5, 3, dtype=DT)
    pre = HyLoPreconditioner(layer, solver="kfac", update_freq=1, damping=0.05)
    x = torch.randn(7, 5, dtype=DT)
    F.mse_loss(layer(x), fixed_target((7, 3))).backward()
    pre.step()
    held = pre.layer_info()[0].state
    assert held is not None
    stored = {k: v.clone() for k, v in held.tensors.items()}

    def fail_scipy(*args: object, **kwargs: object) -> None:
        raise scipy.linalg.LinAlgError("simulated")

    monkeypatch.setattr(torch.linalg, "eigh", _failing_eigh)
    monkeypatch.setattr(scipy.linalg, "eigh", fail_scipy)
    layer.zero_grad()
    F.mse_loss(layer(2 * x), fixed_target((7, 3))).backward()
    grad = grad_matrix(layer)
    with pytest.warns(UserWarning, match="non-finite curvature"):
        pre.step()
    state = pre.layer_info()[0].state
    assert state is not None
    for key, value in state.tensors.items():
        assert torch.equal(value, stored[key]), key
    expected = dense_kfac(stored["factor_a"], stored["factor_g"], grad, 0.05)
    assert state is not None and rel_err(grad_matrix(layer), expected) < RTOL


# --------------------------------------------------------------------------- kfac_method="inverse"
def dense_factored(factor_a: Tensor, factor_g: Tensor, grad: Tensor, damping: float) -> Tensor:
    """V with ((A + δ_a I) ⊗ (G + δ_g I)) vec(V) = vec(∇W), δ_a = π√λ, δ_g = √λ/π, π² = (tr A/d_a)/(tr G/d_g)."""
    d_g, d_a = grad.shape
    pi = ((factor_a.trace() / d_a) / (factor_g.trace() / d_g)).sqrt()
    shifted_a = factor_a + pi * damping**0.5 * torch.eye(d_a, dtype=DT)
    shifted_g = factor_g + damping**0.5 / pi * torch.eye(d_g, dtype=DT)
    return torch.linalg.solve(torch.kron(shifted_a, shifted_g), vec_cm(grad)).reshape(d_a, d_g).mT


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
def test_inverse_method_is_the_factored_damping_solve(bias: bool, shape: str) -> None:
    """kfac_method="inverse" = a dense solve of (A + δ_a I) ⊗ (G + δ_g I) from the layer's own rows, which differs
    from the exact (A ⊗ G + λI) solve of the eigen method at the same λ, and keeps the step within ‖∇W‖/λ."""
    damping = 0.05
    layer = nn.Linear(5, 3, bias=bias, dtype=DT)
    x = torch.randn(LINEAR_SHAPES[shape], dtype=DT)
    labels = torch.randint(0, 3, LINEAR_SHAPES[shape][:-1])

    def loss_fn(out: Tensor) -> Tensor:
        return F.cross_entropy(out.reshape(-1, 3), labels.reshape(-1))

    _, dout, grad, got = one_step(layer, x, loss_fn, solver="kfac", damping=damping, kfac_method="inverse")
    a, g = linear_rows(layer, x, dout)
    rows = a.shape[0]
    factor_a, factor_g = a.mT @ a / rows, g.mT @ g / rows
    expected = dense_factored(factor_a, factor_g, grad, damping)
    assert rel_err(expected, dense_kfac(factor_a, factor_g, grad, damping)) > 1e-2  # another damping
    assert_rel_close(got, expected)
    assert torch.linalg.matrix_norm(got) <= torch.linalg.matrix_norm(grad) / damping
    assert float((got * grad).sum()) > 0


def test_inverse_method_on_a_convolution_and_its_state_round_trip() -> None:
    """A Conv2d under the inverse method = the factored solve of the reference's KFC factors; its state saved and
    loaded into a preconditioner of the eigen method applies the same step (the option decides the next update)."""
    damping = 0.02
    result = conv_case("kfac", True, "stride2-pad1", damping, kfac_method="inverse")
    ref = result.conv
    assert ref is not None
    assert_rel_close(result.got, dense_factored(ref["A"], ref["G"], result.grad, damping))

    torch.manual_seed(3)
    layer = nn.Linear(6, 4, dtype=DT)
    x, labels = torch.randn(10, 6, dtype=DT), torch.randint(0, 4, (10,))
    pre = HyLoPreconditioner(layer, solver="kfac", update_freq=100, damping=damping, kfac_method="inverse")
    F.cross_entropy(layer(x), labels).backward()
    pre.step()
    twin = nn.Linear(6, 4, dtype=DT)
    twin.load_state_dict(layer.state_dict())
    other = HyLoPreconditioner(twin, solver="kfac", update_freq=100, damping=damping)
    other.load_state_dict(pre.state_dict(), options="keep")
    for module in (layer, twin):
        module.zero_grad()
        F.cross_entropy(module(x), labels).backward()
    pre.step()
    other.step()  # not an update step: the loaded inverse state applies
    torch.testing.assert_close(grad_matrix(twin), grad_matrix(layer), rtol=0, atol=0)


def test_kfac_method_is_checked() -> None:
    with pytest.raises(ValueError, match="kfac_method"):
        HyLoPreconditioner(nn.Linear(2, 2), kfac_method="cholesky")
