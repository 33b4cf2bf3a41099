"""The rank and gradient-error studies against references built from true per-sample gradients.

1. ``numerical_ranks`` and ``kernel_spectrum`` against NumPy on known spectra.
2. rank-analysis.csv: the eigenvalues of K/B equal those of the empirical Fisher built from
   autograd's per-sample gradients (Linear and Conv2d, exact conv rows); rank 1 for a batch
   whose per-sample gradients are collinear, full rank for a random batch.
3. grad-error.csv: KID and KIS at ρ = 1 match exact SNGD (≤ 1e-6 in float32, on Linear and
   Conv2d); below ρ = 1 the error is positive; KID ≤ KIS on data of low rank; the K-FAC and
   reference errors equal a dense computation from per-sample gradients and the layer's own
   input and output gradients; the reference falls back to the run's conv rows above
   ``study_exact_rows_mb``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import Tensor, nn

import hylo
from hylo.layers.rows import FactoredRows
from hylo.telemetry.studies import kernel_spectrum, numerical_ranks
from tests.kit.checks import grad_matrix
from tests.kit.reference import dense_kfac, dense_natural_gradient, per_sample_matrices


def _train(model: nn.Module, x: Tensor, loss_fn, steps: int = 1, **options: object) -> hylo.HyLoPreconditioner:
    """``steps`` steps of ``pre.step()`` on the same batch (no optimizer step: the weights stay put)."""
    pre = hylo.HyLoPreconditioner(model, update_freq=1, **options)
    for _ in range(steps):
        model.zero_grad()
        loss_fn(model(x)).backward()
        pre.step()
    pre.close()
    return pre


def _numpy_ranks(eigenvalues: np.ndarray, levels: tuple[float, ...]) -> list[int]:
    share = np.cumsum(eigenvalues) / eigenvalues.sum()
    return [int(np.argmax(share >= level - 1e-12)) + 1 for level in levels]


# ============================================================================ 1. helpers
def test_numerical_ranks_match_numpy() -> None:
    """Known spectra: a flat one, a decaying one, a rank-one one and an empty one."""
    levels = (0.9, 0.99, 0.999)
    for values in ([1.0] * 10, [2.0**-k for k in range(30)], [5.0] + [0.0] * 7):
        eig = torch.tensor(values, dtype=torch.float64)
        assert numerical_ranks(eig, levels) == _numpy_ranks(np.array(values), levels)
    assert numerical_ranks(torch.tensor([1.0] * 10, dtype=torch.float64), levels) == [9, 10, 10]
    assert numerical_ranks(torch.zeros(4, dtype=torch.float64), levels) == [0, 0, 0]


def test_kernel_spectrum_is_the_fisher_spectrum() -> None:
    """Eigenvalues of K/B equal the nonzero eigenvalues of F = UᵀU/B (NumPy, dense)."""
    gen = torch.Generator().manual_seed(0)
    a, g = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
    spectrum = kernel_spectrum(FactoredRows(a, g), 6.0)
    u = np.einsum("bi,bj->bij", g.numpy(), a.numpy()).reshape(6, -1).astype(np.float64)
    fisher = np.sort(np.linalg.eigvalsh(u.T @ u / 6))[::-1][:6]
    np.testing.assert_allclose(spectrum.numpy(), fisher, rtol=1e-5, atol=1e-9)


# ============================================================================ 2. rank analysis
class ConvNet(nn.Module):
    """Conv2d → ReLU → Linear, small enough for per-sample references."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _fisher_eigenvalues(per_sample: Tensor) -> np.ndarray:
    u = per_sample.reshape(per_sample.shape[0], -1).double()
    kernel = (u @ u.mT / u.shape[0]).numpy()
    return np.sort(np.linalg.eigvalsh(kernel))[::-1]


def test_rank_analysis_matches_per_sample_fisher(tmp_path: Path) -> None:
    """sv_k and rank_q of each layer from autograd's per-sample gradients (float64, exact conv rows)."""
    torch.manual_seed(0)
    model = ConvNet().double()
    x = torch.randn(12, 2, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (12,))

    def loss_fn(out: Tensor) -> Tensor:
        return nn.functional.cross_entropy(out, y)

    layers = {"conv": model.conv, "fc": model.fc}
    per_sample = per_sample_matrices(model, layers, x, loss_fn)
    _train(model, x, loss_fn, solver="sngd", profile_dir=tmp_path, studies=("rank",), rank_top_k=12)
    table = pd.read_csv(tmp_path / "rank-analysis.csv")
    assert list(table.layer) == ["conv", "fc"]
    assert (table.reference == "sngd-exact").all() and (table.batch_rows == 12).all()
    for row in table.itertuples():
        expected = _fisher_eigenvalues(per_sample[row.layer])
        got = np.array([getattr(row, f"sv_{k}") for k in range(1, 13)])
        np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12 * expected[0])
        assert [row.rank_90, row.rank_99, row.rank_999] == _numpy_ranks(expected, (0.9, 0.99, 0.999))


def test_rank_one_and_full_rank_batches(tmp_path: Path) -> None:
    """Collinear per-sample gradients give rank 1 at every level; a random batch is full rank."""
    torch.manual_seed(0)
    n = 8
    model = nn.Linear(5, 3, bias=False).double()
    weights = torch.linspace(0.5, 2.0, n, dtype=torch.float64).reshape(n, 1)
    same = torch.randn(1, 5, dtype=torch.float64).expand(n, 5)  # U_i = (c_i/n) 1 xᵀ: one direction
    _train(
        model,
        same,
        lambda out: (weights * out).mean(0).sum(),
        solver="sngd",
        profile_dir=tmp_path / "one",
        studies=("rank",),
    )
    one = pd.read_csv(tmp_path / "one" / "rank-analysis.csv")
    assert (one[["rank_90", "rank_99", "rank_999"]] == 1).all().all()

    x, target = torch.randn(n, 5, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)
    _train(
        model,
        x,
        lambda out: nn.functional.mse_loss(out, target),
        solver="sngd",
        profile_dir=tmp_path / "full",
        studies=("rank",),
    )
    full = pd.read_csv(tmp_path / "full" / "rank-analysis.csv")
    assert int(full.rank_999.iloc[0]) == n and int(full.batch_rows.iloc[0]) == n


# ============================================================================ 3. gradient error
def _errors(tmp_path: Path, model: nn.Module, x: Tensor, loss_fn, **options: object) -> pd.DataFrame:
    _train(model, x, loss_fn, profile_dir=tmp_path, studies=("grad_error",), **options)
    return pd.read_csv(tmp_path / "grad-error.csv", dtype={"layer": str})


@pytest.mark.parametrize("solver", ["kis", "sngd"])
def test_kid_and_kis_at_full_rank_equal_exact_sngd(tmp_path: Path, solver: str) -> None:
    """float32, Linear and Conv2d (exact rows): ρ = 1 gives ≤ 1e-6; ρ = 0.25 gives a positive error."""
    torch.manual_seed(1)
    model = ConvNet()
    x, y = torch.randn(16, 2, 4, 4), torch.randint(0, 4, (16,))
    table = _errors(
        tmp_path,
        model,
        x,
        lambda out: nn.functional.cross_entropy(out, y),
        solver=solver,
        grad_error_ratios=(0.25, 1.0),
        damping=0.1,
    )
    assert set(table.layer) == {"conv", "fc"} and (table.reference == "sngd-exact").all()
    full = table[table.rank_ratio == 1.0]
    assert len(full) == 4 and (full.rel_error <= 1e-6).all(), full
    low = table[table.rank_ratio == 0.25]
    assert len(low) == 4 and (low.rel_error > 1e-3).all(), low


def test_kid_beats_kis_on_low_rank_data(tmp_path: Path) -> None:
    """Per-sample gradients spanning 2 dimensions: a 4-row skeleton is exact, 4 sampled rows are not."""
    torch.manual_seed(2)
    model = nn.Linear(6, 1, bias=False).double()
    basis = torch.randn(2, 6, dtype=torch.float64)
    x = torch.randn(16, 2, dtype=torch.float64) @ basis
    target = torch.randn(16, 1, dtype=torch.float64)
    table = _errors(
        tmp_path,
        model,
        x,
        lambda out: nn.functional.mse_loss(out, target),
        steps=3,
        solver="sngd",
        grad_error_ratios=(0.25,),
        damping=0.01,
    )
    kid, kis = (table[table.method == m].rel_error.to_numpy() for m in ("kid", "kis"))
    assert len(kid) == len(kis) == 3
    assert (kid < 1e-8).all() and (kis > 1e-3).all() and (kid <= kis).all()


def test_kfac_and_reference_errors_match_a_dense_computation(tmp_path: Path) -> None:
    """Linear with bias, float64: v_ref from per-sample gradients, v_kfac from the layer's own a and g."""
    torch.manual_seed(3)
    n, damping = 10, 0.05
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))

    def loss_fn(out: Tensor) -> Tensor:
        return nn.functional.cross_entropy(out, y)

    layer = model[2]
    per_sample = per_sample_matrices(model, {"fc": layer}, x, loss_fn)["fc"]
    seen: dict[str, Tensor] = {}

    def keep(_module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        seen["a"] = args[0].detach()
        out.register_hook(lambda grad: seen.update(g=grad.detach() * n))

    handle = layer.register_forward_hook(keep)
    model.zero_grad()
    loss_fn(model(x)).backward()
    handle.remove()
    grad = grad_matrix(layer)
    a = torch.cat([seen["a"], torch.ones(n, 1, dtype=torch.float64)], dim=1)
    reference = dense_natural_gradient(per_sample, grad, damping)
    kfac = dense_kfac(a.mT @ a / n, seen["g"].mT @ seen["g"] / n, grad, damping)
    expected = float(torch.linalg.vector_norm(kfac - reference) / torch.linalg.vector_norm(reference))

    table = _errors(tmp_path, model, x, loss_fn, solver="sngd", damping=damping, grad_error_methods=("kfac", "kid"))
    row = table[(table.layer == "2") & (table.method == "kfac")]
    assert len(row) == 1 and np.isnan(row.rank_ratio.iloc[0])
    assert row.rel_error.iloc[0] == pytest.approx(expected, rel=1e-8)
    assert expected > 1e-3  # the comparison is not between zeros


def test_reference_falls_back_to_the_run_conv_rows(tmp_path: Path) -> None:
    """With no room for exact rows the reference is the run's ``conv_rows``; the run's sngd then has error 0."""
    torch.manual_seed(4)
    model = ConvNet()
    x, y = torch.randn(8, 2, 4, 4), torch.randint(0, 4, (8,))
    table = _errors(
        tmp_path,
        model,
        x,
        lambda out: nn.functional.cross_entropy(out, y),
        solver="sngd",
        study_exact_rows_mb=0,
        grad_error_methods=("sngd",),
    )
    conv, fc = table[table.layer == "conv"].iloc[0], table[table.layer == "fc"].iloc[0]
    assert conv.reference == "sngd-sum" and fc.reference == "sngd-exact"
    assert conv.rel_error == 0.0 and fc.rel_error == 0.0

    exact = _errors(
        tmp_path / "exact",
        ConvNet(),
        x,
        lambda out: nn.functional.cross_entropy(out, y),
        solver="sngd",
        grad_error_methods=("sngd",),
    )
    conv_exact = exact[exact.layer == "conv"].iloc[0]
    assert conv_exact.reference == "sngd-exact" and conv_exact.rel_error > 1e-3  # the sum surrogate's own error
