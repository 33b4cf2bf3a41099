"""The row reductions of the low-rank solvers (hylo/solvers/reduce.py; docs/solvers.md, "KID", "KIS").

KIS's ``kis_select`` against its sampling distribution (chi-square and z tests), KID's
``kid_skeleton`` against scipy's interpolative decomposition and the interpolation of the design,
and the greedy ``pivoted_cholesky`` both rest on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.linalg.interpolative as sli
import torch
from scipy import stats
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from hylo.layers.rows import DenseRows, FactoredRows, sample_kernel
from hylo.solvers.reduce import kid_skeleton, kis_select, pivoted_cholesky
from tests.kit.checks import DT
from tests.kit.reference import u_rows


def row_weights(a: Tensor, g: Tensor) -> Tensor:
    """‖u_i‖² = ‖a_i‖²‖g_i‖², the KIS sampling weights."""
    return a.square().sum(dim=1) * g.square().sum(dim=1)


pytestmark = pytest.mark.usefixtures("single_thread")


def _random_rows(n: int, d_a: int, d_g: int, seed: int, structure: str = "iid") -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d_a, generator=gen, dtype=DT)
    g = torch.randn(n, d_g, generator=gen, dtype=DT)
    if structure == "scaled":  # widely varying row norms, as real per-sample gradients have
        a = a * 10 * torch.rand(n, 1, generator=gen, dtype=DT).pow(3)
    return a, g


# ----------------------------------------------------------- skeleton quality vs scipy's ID
# Greedy pivoted Cholesky on K = U Uᵀ (largest residual diagonal first) is, in exact arithmetic, the
# same greedy as column-pivoted QR of Uᵀ, which is what scipy's deterministic ID (rand=False) runs.
# So both pick the same skeleton and, both interpolations being least-squares optimal for their
# skeleton, reach the same error: measured ratio 1.0000 for every seed, structure and rank below
# (and h/optimal-SVD between 1.01 and 1.5). The 5% slack only absorbs a near-tie flipping a pivot.
SCIPY_FACTOR = 1.05


@pytest.mark.parametrize("structure", ["iid", "scaled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kid_skeleton_matches_scipy_interpolative(seed: int, structure: str) -> None:
    a, g = _random_rows(60, 10, 8, seed, structure)
    u = u_rows(a, g).numpy()  # 60 × 80
    singular = np.linalg.svd(u, compute_uv=False)
    for k in (5, 10, 20, 30):
        skeleton, _ = kid_skeleton(FactoredRows(a, g), k)
        j = skeleton.numpy()
        assert len(set(j.tolist())) == k
        u_j = u[j]
        ours = np.linalg.norm(u - u @ np.linalg.pinv(u_j) @ u_j)  # best reconstruction from rows U_J
        idx, proj = sli.interp_decomp(np.asfortranarray(u.T), k, rand=False)
        theirs = np.linalg.norm(u.T - sli.reconstruct_matrix_from_id(u.T[:, idx[:k]], idx, proj))
        optimal = np.sqrt(np.sum(singular[k:] ** 2))
        assert optimal * (1 - 1e-9) <= ours <= SCIPY_FACTOR * theirs, (k, ours, theirs, optimal)
        assert set(j.tolist()) == set(idx[:k].tolist())


def _design_interp(a: Tensor, g: Tensor, skeleton: Tensor) -> Tensor:
    """Π = K_JJ⁻¹ K_J,: straight from docs/solvers.md, "KID" (K_JJ must be invertible)."""
    kernel = sample_kernel(a, g)
    return torch.linalg.solve(kernel[skeleton][:, skeleton], kernel[skeleton])


@pytest.mark.parametrize("seed", [0, 1])
def test_kid_weights_are_design_interpolation(seed: int) -> None:
    """W_p = Π Πᵀ with Π = K_JJ⁻¹ K_J,:, Π[:, J] = I, and W_p ⪰ I (symmetric)."""
    a, g = _random_rows(40, 6, 5, seed, "scaled")
    skeleton, weights = kid_skeleton(FactoredRows(a, g), 12)
    interp = _design_interp(a, g, skeleton)
    torch.testing.assert_close(interp[:, skeleton], torch.eye(12, dtype=DT), atol=1e-8, rtol=0)
    torch.testing.assert_close(weights, interp @ interp.mT, rtol=1e-8, atol=1e-8 * float(weights.abs().max()))
    torch.testing.assert_close(weights, weights.mT, rtol=1e-12, atol=0)
    assert float(torch.linalg.eigvalsh(weights).min()) >= 1 - 1e-8


@pytest.mark.parametrize("k", [4, 7])
def test_kid_interpolation_exact_when_rank_le_k(k: int) -> None:
    """rank(U) = 4 ≤ k: U = Πᵀ U_J (rows), hence Uᵀ U = U_Jᵀ W_p U_J (the Fisher identity KID uses)."""
    gen = torch.Generator().manual_seed(5)
    n = 30
    a = torch.randn(n, 2, generator=gen, dtype=DT) @ torch.randn(2, 7, generator=gen, dtype=DT)
    g = torch.randn(n, 2, generator=gen, dtype=DT) @ torch.randn(2, 5, generator=gen, dtype=DT)
    a[3] = 0.0  # a zero row as well
    u = u_rows(a, g)
    assert int(torch.linalg.matrix_rank(u)) == 4
    skeleton, weights = kid_skeleton(FactoredRows(a, g), k)
    u_j = u[skeleton]
    scale = float(u.norm())
    if k == 4:  # K_JJ invertible: check the design's Π itself
        interp = _design_interp(a, g, skeleton)
        torch.testing.assert_close(interp.mT @ u_j, u, rtol=0, atol=1e-9 * scale)
        torch.testing.assert_close(weights, interp @ interp.mT, rtol=1e-8, atol=1e-8)
    fisher = u.mT @ u
    torch.testing.assert_close(u_j.mT @ weights @ u_j, fisher, rtol=0, atol=1e-9 * float(fisher.abs().max()))


# --------------------------------------------------------------------------- KIS sampling
def _rows_with_weights(p: list[float], seed: int = 0) -> tuple[Tensor, Tensor]:
    """Rows with ‖a_i‖²‖g_i‖² = p_i (a_i random direction of norm √p_i, ‖g_i‖ = 1)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(p)
    a = torch.randn(n, 3, generator=gen, dtype=DT)
    a = a / a.norm(dim=1, keepdim=True) * torch.tensor(p, dtype=DT).sqrt()[:, None]
    g = torch.randn(n, 4, generator=gen, dtype=DT)
    return a, g / g.norm(dim=1, keepdim=True)


@pytest.mark.parametrize("n,r", [(10, 1), (10, 4), (10, 10), (33, 7)])
def test_kis_select_draws_r_distinct_indices(n: int, r: int) -> None:
    gen = torch.Generator().manual_seed(0)
    a, g = _random_rows(n, 3, 2, seed=n, structure="scaled")
    for _ in range(20):
        idx = kis_select(row_weights(a, g), r, gen)
        assert idx.shape == (r,) and idx.dtype == torch.long
        assert len(set(idx.tolist())) == r and 0 <= int(idx.min()) and int(idx.max()) < n


def test_kis_select_never_takes_zero_rows_while_enough_nonzero() -> None:
    a, g = _random_rows(10, 3, 2, seed=1)
    a[[0, 4, 7]] = 0.0  # zero activation
    g[[2, 9]] = 0.0  # zero output gradient
    nonzero = {1, 3, 5, 6, 8}
    gen = torch.Generator().manual_seed(0)
    for r in (1, 3, 5):
        for _ in range(100):
            assert set(kis_select(row_weights(a, g), r, gen).tolist()) <= nonzero
    seen = [kis_select(row_weights(a, g), 5, gen) for _ in range(5)]
    assert all(set(s.tolist()) == nonzero for s in seen)


def test_kis_select_fills_uniformly_from_zero_rows() -> None:
    a, g = _random_rows(6, 3, 2, seed=2)
    a[[1, 2, 4, 5]] = 0.0  # only rows 0 and 3 have weight; r = 3 ⇒ one zero row, uniformly
    gen = torch.Generator().manual_seed(0)
    draws = 2000
    counts = np.zeros(6)
    for _ in range(draws):
        idx = set(kis_select(row_weights(a, g), 3, gen).tolist())
        assert {0, 3} <= idx and len(idx) == 3
        counts[list(idx - {0, 3})] += 1
    observed = counts[[1, 2, 4, 5]]
    chi2 = stats.chisquare(observed).statistic
    assert chi2 < stats.chi2.ppf(1 - 1e-4, df=3), observed


def test_kis_select_all_zero_rows() -> None:
    a, g = torch.zeros(8, 3, dtype=DT), torch.randn(8, 2, dtype=DT)
    gen = torch.Generator().manual_seed(0)
    firsts = np.zeros(8)
    for _ in range(800):
        idx = kis_select(row_weights(a, g), 3, gen)
        assert len(set(idx.tolist())) == 3
        firsts[idx.tolist()] += 1
    assert stats.chisquare(firsts).statistic < stats.chi2.ppf(1 - 1e-4, df=7), firsts


def test_kis_first_draw_frequencies_follow_weights() -> None:
    """r = 1: P(i) = p_i / Σp with p_i = ‖a_i‖²‖g_i‖² (chi-square test, level 1e-4)."""
    p = [1.0, 2.0, 0.5, 4.0, 2.5]
    a, g = _rows_with_weights(p)
    sample_kernel_diag = sample_kernel(a, g).diagonal()
    torch.testing.assert_close(sample_kernel_diag, torch.tensor(p, dtype=DT))
    gen = torch.Generator().manual_seed(0)
    draws = 6000
    counts = np.bincount([int(kis_select(row_weights(a, g), 1, gen)) for _ in range(draws)], minlength=len(p))
    expected = draws * np.array(p) / sum(p)
    chi2 = stats.chisquare(counts, expected).statistic
    assert chi2 < stats.chi2.ppf(1 - 1e-4, df=len(p) - 1), (counts, expected)


def test_kis_inclusion_probabilities_without_replacement() -> None:
    """r = 2 is sequential sampling without replacement: P(i ∈ S) = p_i + Σ_{j≠i} p_j p_i / (1 − p_j)."""
    p = np.array([1.0, 2.0, 0.5, 4.0, 2.5])
    p = p / p.sum()
    a, g = _rows_with_weights(p.tolist())
    gen = torch.Generator().manual_seed(1)
    draws = 3000
    counts = np.zeros(len(p))
    for _ in range(draws):
        counts[kis_select(row_weights(a, g), 2, gen).tolist()] += 1
    incl = np.array([p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(len(p)) if j != i) for i in range(len(p))])
    z = (counts / draws - incl) / np.sqrt(incl * (1 - incl) / draws)
    assert np.all(np.abs(z) < 4), (counts / draws, incl)
    # and it is not with-replacement / proportional inclusion (2·p_i), which the big row would exceed
    assert counts[3] / draws < 2 * p[3] - 0.05


# ---------------------------------------------------------------------- pivoted Cholesky
def test_pivoted_cholesky_exact_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    n, q, r = 15, 4, 8
    x = torch.randn(n, q, generator=gen, dtype=DT) * torch.rand(n, 1, generator=gen, dtype=DT)
    kernel = x @ x.mT
    rows = DenseRows(x.unsqueeze(2))  # (n, q, 1): the kernel x xᵀ
    pivots, factor, alive = pivoted_cholesky(rows, r)
    assert pivots.shape == (r,) and factor.shape == (n, r) and alive.shape == (r,)
    assert alive[:q].all() and not alive[q:].any()
    assert len(set(pivots.tolist())) == r
    assert int(pivots[0]) == int(kernel.diagonal().argmax())
    torch.testing.assert_close(factor @ factor.mT, kernel, rtol=0, atol=1e-10 * float(kernel.abs().max()))
    assert torch.equal(factor[:, q:], torch.zeros(n, r - q, dtype=DT))
    lower = factor[pivots]  # lower triangular in pivot order
    assert float(lower.triu(1).abs().max()) <= 1e-12 * float(lower.abs().max())
    again = pivoted_cholesky(rows, r)
    assert all(torch.equal(s, t) for s, t in zip((pivots, factor, alive), again, strict=True))


def test_pivoted_cholesky_is_greedy_on_residual_diagonal() -> None:
    a, g = _random_rows(25, 5, 4, seed=3, structure="scaled")
    kernel = sample_kernel(a, g)
    r = 10
    pivots, factor, alive = pivoted_cholesky(FactoredRows(a, g), r)
    assert alive.all()
    for k in range(r):
        residual = kernel.diagonal() - factor[:, :k].square().sum(dim=1)
        residual[pivots[:k]] = -torch.inf
        assert int(pivots[k]) == int(residual.argmax())
    residual = kernel - factor @ factor.mT  # PSD Schur complement, zero on the skeleton
    assert float(residual[pivots][:, pivots].abs().max()) < 1e-10 * float(kernel.abs().max())
    assert float(torch.linalg.eigvalsh(residual).min()) > -1e-10 * float(kernel.abs().max())
    _, full_factor, full_alive = pivoted_cholesky(FactoredRows(a, g), 25)
    assert full_alive[:20].all() and not full_alive[20:].any()  # rank(U) = min(25, 5·4) = 20
    torch.testing.assert_close(full_factor @ full_factor.mT, kernel, rtol=0, atol=1e-10 * float(kernel.abs().max()))


class _HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: every read of a tensor's value by the host (``item``, ``int``,
    ``bool``), which on a GPU waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stop", [None, 1e-3], ids=["rank-r", "auto"])
def test_pivoted_cholesky_off_the_cpu_reads_nothing_back_per_pivot(stop: float | None) -> None:
    """The path other devices take (``lookahead=False``) keeps the pivots, the threshold and the residual on the
    device: no host read in the loop over 40 pivots, one with ``stop_below`` (where to cut, after the loop); the CPU
    path reads each pivot (free there)."""
    gen = torch.Generator().manual_seed(2)
    rows = FactoredRows(torch.randn(200, 9, generator=gen, dtype=DT), torch.randn(200, 7, generator=gen, dtype=DT))
    with _HostReads() as device_path:
        pivoted_cholesky(rows, 40, lookahead=False, stop_below=stop)
    assert device_path.reads == (0 if stop is None else 1)
    with _HostReads() as cpu_path:
        pivoted_cholesky(rows, 40, lookahead=True, stop_below=stop)
    assert cpu_path.reads >= 40  # the counter sees host reads (the check above is not vacuous)


@pytest.mark.parametrize("structure", ["scaled", "duplicated", "low-rank", "non-finite"])
def test_pivoted_cholesky_lookahead_takes_the_greedy_pivots(structure: str) -> None:
    """The CPU path's lookahead (residual columns of the LOOKAHEAD largest residuals, kept current) takes the very
    pivots of the one-column greedy path, with the same factor up to round-off, over 300 rows and 60 pivots: several
    candidate blocks, dead pivots where rows repeat or span few dimensions, NaN rows without an exception."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(300, 9, generator=gen, dtype=DT) * torch.rand(300, 1, generator=gen, dtype=DT)
    g = torch.randn(300, 7, generator=gen, dtype=DT)
    if structure == "duplicated":
        a, g = torch.cat([a[:20]] * 15), torch.cat([g[:20]] * 15)
    elif structure == "low-rank":
        a = a[:, :2] @ torch.randn(2, 9, generator=gen, dtype=DT)
        g = g[:, :3] @ torch.randn(3, 7, generator=gen, dtype=DT)
    elif structure == "non-finite":
        a[[4, 50]] = float("nan")
    rows = FactoredRows(a, g)
    ahead = pivoted_cholesky(rows, 60, lookahead=True)
    plain = pivoted_cholesky(rows, 60, lookahead=False)
    alive = plain[2]
    assert torch.equal(ahead[2], alive)
    # a dead pivot is any row at round-off residual (its column of L is 0 either way): the live ones are the same
    assert torch.equal(ahead[0][alive], plain[0][alive])
    scale = float(plain[1].nan_to_num().abs().max())
    torch.testing.assert_close(ahead[1], plain[1], rtol=1e-9, atol=1e-9 * scale, equal_nan=True)
    if structure in ("duplicated", "low-rank"):
        assert not bool(plain[2].all())  # dead pivots were taken
