"""``basis_refresh="power"``: kfac_adam's warm-started basis (docs/solvers.md, "The warm-started basis").

Specified against independent references:

- :func:`~hylo.numerics.power_refresh_many` is one step of subspace iteration on F + σI written with NumPy
  (Rayleigh quotients, columns sorted, the shift, ``numpy.linalg.qr``, signs fixed) matrix by matrix, batched or not; an exact
  eigenbasis is its fixed point (re-sorted where the eigenvalues changed order), and repeated refreshes converge
  to ``numpy.linalg.eigh``'s eigenpairs;
- in a run, a layer's first update eigendecomposes (the state equals ``basis_refresh="eigh"``'s); at each later
  update the basis is the NumPy refresh of the running factors from the previous basis, the momentum in the
  layer's own coordinates (Q_g m Q_aᵀ) is unchanged by the refresh and v is the previous v with its rows and
  columns re-sorted with their eigenvectors;
- a refresh that fails the check (a non-finite factor) is redone by the eigendecomposition, and the update stage
  then rejects the non-finite state.

P ranks = one process with the power refresh: tests/library/test_distributed.py (case ``kfac_adam-power``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.numerics import eigh_many, power_refresh_many
from hylo.solvers.bundled.kfac_adam import KFACAdamState
from tests.kit.checks import DT, assert_rel_close
from tests.kit.reference import numpy_power_refresh

pytestmark = [pytest.mark.usefixtures("single_thread")]


def _spd(d: int, seed: int, spread: float = 3.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * d, d, generator=gen, dtype=DT) * torch.linspace(0.1, spread, d, dtype=DT)
    return x.mT @ x / (4 * d)


# --------------------------------------------------------------------------- the refresh
def test_a_refresh_is_one_step_of_subspace_iteration_batched_or_not() -> None:
    factors = [_spd(9, seed) for seed in range(3)] + [_spd(5, 7)]
    previous = [q for _, q in eigh_many([_spd(9, 10 + s) for s in range(3)] + [_spd(5, 17)])]
    batched = power_refresh_many(factors, previous)
    for factor, basis, (evals, evecs, order) in zip(factors, previous, batched, strict=True):
        want_e, want_q, want_order = numpy_power_refresh(factor.numpy(), basis.numpy())
        assert_rel_close(evals, torch.from_numpy(want_e.copy()), 1e-12)
        assert_rel_close(evecs, torch.from_numpy(want_q.copy()), 1e-10)
        assert order.tolist() == want_order.tolist()
        ((alone_e, alone_q, alone_order),) = power_refresh_many([factor], [basis])
        assert torch.allclose(alone_e, evals, rtol=1e-13) and torch.allclose(alone_q, evecs, atol=1e-13)
        assert torch.equal(alone_order, order)
        assert torch.allclose(evecs.mT @ evecs, torch.eye(evecs.shape[0], dtype=DT), atol=1e-12)


def test_an_exact_eigenbasis_is_kept_and_re_sorted_when_its_eigenvalues_change_order() -> None:
    ((evals, basis),) = eigh_many([_spd(8, 1)])
    shuffle = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    changed = basis @ torch.diag(evals[shuffle]) @ basis.mT  # column i now has eigenvalue evals[shuffle[i]]
    ((new_evals, new_basis, order),) = power_refresh_many([changed], [basis])
    assert torch.equal(order, shuffle.argsort())
    assert_rel_close(new_evals, evals, 1e-12)
    # the same vectors, in the new order, with their signs kept (R's diagonal ≥ 0)
    assert torch.allclose(new_basis, basis[:, order], atol=1e-12)


def test_repeated_refreshes_converge_to_the_eigendecomposition() -> None:
    factor = _spd(10, 2)
    basis = torch.linalg.qr(torch.randn(10, 10, generator=torch.Generator().manual_seed(4), dtype=DT))[0]
    for _ in range(400):
        evals, basis, _ = power_refresh_many([factor], [basis])[0]
    want_e, want_q = np.linalg.eigh(factor.numpy())
    assert_rel_close(evals, torch.from_numpy(want_e), 1e-8)
    alignment = (basis.mT @ torch.from_numpy(want_q)).abs()
    assert torch.allclose(alignment, torch.eye(10, dtype=DT), atol=1e-6)


def test_a_rank_deficient_factor_keeps_an_orthonormal_basis() -> None:
    """A dead unit (row and column 2 zero, before and now): e₂ is a basis vector with F e₂ = 0, so F Q has a zero
    column and R a zero on its diagonal; the refreshed basis is still orthonormal and keeps e₂ at eigenvalue 0."""
    factor, earlier = _spd(6, 3), _spd(6, 4)
    for f in (factor, earlier):
        f[:, 2] = f[2, :] = 0.0
    ((_, basis),) = eigh_many([earlier])
    evals, evecs, _ = power_refresh_many([factor], [basis])[0]
    assert torch.allclose(evecs.mT @ evecs, torch.eye(6, dtype=DT), atol=1e-12)
    assert bool((evals >= 0).all()) and float(evals[0]) < 1e-20
    assert float(evecs[2, 0].abs()) == pytest.approx(1.0, abs=1e-12)


def test_a_failed_refresh_is_redone_by_the_eigendecomposition() -> None:
    bad = _spd(5, 5)
    bad[1, 1] = float("nan")
    good = _spd(5, 6)
    previous = [q for _, q in eigh_many([_spd(5, 7), _spd(5, 8)])]
    (bad_e, _, bad_order), (good_e, _, good_order) = power_refresh_many([bad, good], previous)
    assert not bool(torch.isfinite(bad_e).all())  # the update stage rejects this state
    assert torch.equal(bad_order, torch.arange(5))
    want_e, _, want_order = numpy_power_refresh(good.numpy(), previous[1].numpy())
    assert_rel_close(good_e, torch.from_numpy(want_e.copy()), 1e-12)
    assert good_order.tolist() == want_order.tolist()


# --------------------------------------------------------------------------- in a run
def _run(refresh: str, steps: int) -> tuple[list[dict[str, hylo.StateView]], list[dict[str, Tensor]]]:
    """Each step's held states of a two-layer MLP under kfac_adam (update every 2 steps), and its raw ∇W = [W | b]
    by layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7, dtype=DT), nn.Tanh(), nn.Linear(7, 3, dtype=DT))
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=2, basis_refresh=refresh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    held, grads = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 5, generator=gen, dtype=DT), torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append(
            {
                name: torch.cat([m.weight.grad, m.bias.grad[:, None]], 1)
                for name, m in (("0", model[0]), ("2", model[2]))
            }
        )
        pre.step()
        opt.step()
        states = {info.name: info.state for info in pre.layer_info()}
        assert all(state is not None and state.kind == KFACAdamState.__name__ for state in states.values())
        held.append(states)  # type: ignore[arg-type]
    return held, grads


def test_the_first_update_eigendecomposes_and_later_ones_refresh_from_the_previous_basis() -> None:
    (power, grads), (eigh, _) = _run("power", 7), _run("eigh", 1)
    for name, state in power[0].items():
        for field in ("evals_a", "evecs_a", "evals_g", "evecs_g", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state.tensors[field], eigh[0][name].tensors[field]), field
    resorted = 0
    for update in (2, 4, 6):
        for name, state in power[update].items():
            before = power[update - 1][name]  # the state the update started from (its moments one step on)
            moments = {}
            for side in ("a", "g"):
                want_e, want_q, order = numpy_power_refresh(
                    state.tensors[f"factor_{side}"].numpy(), before.tensors[f"evecs_{side}"].numpy()
                )
                assert_rel_close(state.tensors[f"evals_{side}"], torch.from_numpy(want_e.copy()), 1e-10)
                assert_rel_close(state.tensors[f"evecs_{side}"], torch.from_numpy(want_q.copy()), 1e-8)
                moments[side] = torch.from_numpy(order.copy())
            # the update step advanced the moments carried into the new basis by this step's R = Q_gᵀ ∇W Q_a
            assert state.fields["steps"] == before.fields["steps"] + 1
            now, then = state.tensors, before.tensors
            rotated = now["evecs_g"].mT @ grads[update][name] @ now["evecs_a"]
            carried_m = now["evecs_g"].mT @ (then["evecs_g"] @ then["exp_avg"] @ then["evecs_a"].mT) @ now["evecs_a"]
            # v: each entry with the vectors it refines, never below its projection (docs/solvers.md, "Degenerate
            # eigenspaces")
            kept_v = then["exp_avg_sq"].index_select(0, moments["g"]).index_select(1, moments["a"])
            w_a, w_g = ((then[f"evecs_{s}"].mT @ now[f"evecs_{s}"]).square() for s in ("a", "g"))
            kept_v = torch.maximum(kept_v, w_g.mT @ then["exp_avg_sq"] @ w_a)
            rule = state.fields["rule"]
            beta1, beta2 = rule.beta1, rule.beta2
            assert_rel_close(state.tensors["exp_avg"], beta1 * carried_m + (1 - beta1) * rotated, 1e-10)
            assert_rel_close(state.tensors["exp_avg_sq"], beta2 * kept_v + (1 - beta2) * rotated.square(), 1e-10)
            resorted += int(any(not torch.equal(o, torch.arange(len(o))) for o in moments.values()))
    assert resorted  # some refresh re-sorted its basis (the check of v's re-sort is not vacuous)


def test_power_refresh_options_are_checked() -> None:
    with pytest.raises(ValueError, match="basis_refresh must be one of"):
        hylo.HyLoPreconditioner(nn.Linear(3, 2), solver="kfac_adam", basis_refresh="qr")


# --------------------------------------------------------------------------- degenerate spectra in a run
def _orthonormal_rows(d: int, k: int, gen: torch.Generator) -> Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=DT))
    return (q * torch.sign(torch.diagonal(r)))[:, :k]


class Degenerate(nn.Module):
    """Every degenerate spectrum at once (docs/solvers.md, "Degenerate eigenspaces"):

    - ``first`` (6 → 5, no bias) sees inputs whose A has the eigenvalues 1, 1, 1, 4, 4 in a random basis, and 0 (six
      inputs, five rows: rank-deficient); with one row, A has rank one;
    - ``wide`` (7 → 4) sees ``first``'s five outputs, the first of them again (a duplicated column) and a constant
      zero (a dead unit), so its A is rank-deficient twice over;
    - ``embed`` (8 tokens of width 4, added to ``wide``'s output) sees tokens 0 and 1 twice and 2 once: its A is
      diagonal with a repeated eigenvalue and five unseen tokens at 0.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 5, bias=False, dtype=DT)
        self.wide = nn.Linear(7, 4, dtype=DT)
        self.embed = nn.Embedding(8, 4, dtype=DT)
        self.out = nn.Linear(4, 3, dtype=DT)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        h = torch.tanh(self.first(x))
        h = torch.cat([h, h[:, :1], torch.zeros_like(h[:, :1])], 1)
        out: Tensor = self.out(torch.tanh(self.wide(h) + self.embed(ids)))
        return out


def degenerate_batch(rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs, token ids, targets) of ``rows`` rows (5 or 1): XᵀX/n = V diag(1, 1, 1, 4, 4) Vᵀ, V random."""
    values = torch.tensor([1.0, 1.0, 1.0, 4.0, 4.0][:rows], dtype=DT)
    gen = torch.Generator().manual_seed(1)
    u, v = _orthonormal_rows(rows, len(values), gen), _orthonormal_rows(6, len(values), gen)
    x = (u * (values * rows).sqrt()) @ v.mT
    return x, torch.tensor([0, 1, 2, 0, 1][:rows]), torch.tensor([0, 1, 2, 0, 1][:rows])


def assert_refreshes_change_nothing(rows: int, zero_at: int | None, **options: Any) -> None:
    """:func:`degenerate_run` refreshing every second step takes every step of the run that never refreshes (after
    its first update), to round-off: a step that is zero in one is zero in the other."""
    refreshed = degenerate_run(2, rows, zero_at, **options)
    kept = degenerate_run(1000, rows, zero_at, **options)
    for step, (got, want) in enumerate(zip(refreshed, kept, strict=True)):
        for name, value in want.items():
            if value.any():
                assert_rel_close(got[name], value, 1e-10)
            else:
                assert not got[name].any(), (name, step)


def degenerate_run(
    update_freq: int, rows: int = 5, zero_at: int | None = None, steps: int = 9, **options: Any
) -> list[dict[str, Tensor]]:
    """Each step's preconditioned gradients of :class:`Degenerate` under kfac_adam (ε 10⁻³), the parameters held
    fixed and the same batch at every step, its rows shuffled (so the running factors are unchanged up to the
    round-off of their sums: eigh's vectors inside a repeated eigenvalue are then arbitrary); the loss times 0 at
    step ``zero_at`` (∇W = 0 and G's batch factor 0). Checks at every step that nothing warns, every state tensor is
    finite and every held basis orthonormal."""
    model = Degenerate()
    pre = hylo.HyLoPreconditioner(
        model, solver="kfac_adam", update_freq=update_freq, damping=0.01, adam_eps=1e-3, factor_decay=0.5, **options
    )
    x, ids, y = degenerate_batch(rows)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(steps):
            shuffle = torch.randperm(rows, generator=torch.Generator().manual_seed(step))
            model.zero_grad()
            loss = F.cross_entropy(model(x[shuffle], ids[shuffle]), y[shuffle])
            (loss * (0.0 if step == zero_at else 1.0)).backward()
            pre.step()
            seen.append({name: p.grad.clone() for name, p in model.named_parameters()})
            for info in pre.layer_info():
                assert info.state is not None, info.name
                for field, value in info.state.tensors.items():
                    assert bool(torch.isfinite(value).all()), (info.name, field, step)
                    if field.startswith("evecs_"):
                        eye = torch.eye(value.shape[-1], dtype=DT)
                        assert torch.allclose(value.mT @ value, eye, atol=1e-12), (info.name, field, step)
    for step, grads in enumerate(seen):
        assert all(bool(torch.isfinite(g).all()) for g in grads.values()), step
    return seen


@pytest.mark.parametrize("refresh", ["power", "eigh"])
@pytest.mark.parametrize(("rows", "zero_at"), [(5, None), (5, 4), (1, None)], ids=["repeated", "zero-grad", "one-row"])
def test_a_refresh_of_an_unchanged_degenerate_factor_leaves_the_step_unchanged(
    refresh: str, rows: int, zero_at: int | None
) -> None:
    """Repeated eigenvalues, rank-deficient factors (a Linear wider than its rows, a duplicated input column, a dead
    unit), an embedding, a batch of one row and a step whose gradients are all zero at an update: refreshing the
    basis every second step from the unchanged running factors takes every step of the run that never refreshes
    (the first basis kept), to round-off (docs/solvers.md, "Degenerate eigenspaces"); states finite, bases
    orthonormal, no warning. Before the refresh was turned to the previous basis, ``eigh`` rotated inside the
    repeated eigenvalues and the steps differed by 33% (relative)."""
    assert_refreshes_change_nothing(rows, zero_at, basis_refresh=refresh)
