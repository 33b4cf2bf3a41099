"""The public extension API, used from outside the package (docs/extending.md).

``examples/extend_hylo.py`` adds a layer type (``TransposedLinear``, W stored transposed: a module
class hylo does not know, described by hylo's ``TransposedLinearMath``) and a low-rank variant
(``"uniform"``: rows kept uniformly, rescaled) with no edit to hylo. Specified here:

- the example runs as a user would run it, and its variant shows in ``decisions.csv`` (as a
  decision and as a ``cost_uniform`` column) and in the gradient-error study, its layer type in
  ``summary()``;
- the registered layer type is exact (a user's class through the registry, the hooks and the
  transposed write-back): SNGD on it equals the dense (F + λI)⁻¹ ∇W built from the
  model's true per-sample gradients (a loop of single-sample backward passes), and its result is
  written into the transposed ``weight.grad``;
- the registered variant at ρ = 1 is exact SNGD, and its estimate of the Fisher is unbiased;
- the hybrid policy takes the variant in the stable regime when told to;
- registration is validated and undone by the handles, and configs naming an unregistered
  variant are refused.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.layers import FactoredRows
from hylo.solvers import UpdateContext, solver_names
from hylo.telemetry.profiling import DISABLED
from tests.kit.checks import DT
from tests.kit.examples import EXAMPLES, load_example
from tests.kit.reference import dense_natural_gradient

pytestmark = pytest.mark.usefixtures("single_thread")

EXAMPLE = EXAMPLES / "extend_hylo.py"


example = load_example("extend_hylo")


@pytest.fixture
def registered() -> Iterator[None]:
    """The example's layer type and variant, registered for one test and removed after it."""
    handles = example.register()
    yield
    for handle in handles:
        handle.remove()


# --------------------------------------------------------------------------- the example as a user runs it
def test_the_example_runs_and_hylo_sees_its_layer_type_and_variant(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "TransposedLinear" in done.stdout  # summary() lists the new layer type
    with (out / "decisions.csv").open() as handle:
        decisions = list(csv.DictReader(handle))
    assert "cost_uniform" in decisions[0]
    uniform = [row for row in decisions if row["solver"] == "uniform"]
    assert {row["reason"] for row in uniform} >= {"override", "stable"}  # forced on the head, chosen elsewhere
    assert all(float(row["cost_uniform"]) > 0 for row in decisions)
    with (out / "grad-error.csv").open() as handle:
        errors = list(csv.DictReader(handle))
    measured = {row["method"] for row in errors}
    assert measured == {"kid", "kis", "uniform", "sngd"}
    uniform_errors = [float(row["rel_error"]) for row in errors if row["method"] == "uniform"]
    assert all(0 < e < 10 and math.isfinite(e) for e in uniform_errors)
    # the registration lived in that process only
    assert "uniform" not in solver_names()


# --------------------------------------------------------------------------- the layer type is exact
def _transposed_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(example.TransposedLinear(5, 4), nn.Tanh(), example.TransposedLinear(4, 3)).to(DT)


def _per_sample(model: nn.Sequential, layer: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """U_i (B, d_out, d_in + 1) of ``layer``: B × the gradient of sample i's share of the mean loss."""
    n = x.shape[0]
    mats = []
    for i in range(n):
        model.zero_grad()
        outs = torch.cat([model(x[j : j + 1]) if j == i else model(x[j : j + 1]).detach() for j in range(n)])
        F.mse_loss(outs, y).backward()
        mats.append(n * torch.cat([layer.weight.grad.mT, layer.bias.grad.unsqueeze(1)], dim=1))
    model.zero_grad()
    return torch.stack(mats)


@pytest.mark.usefixtures("registered")
def test_a_registered_layer_type_gets_exact_sngd_from_the_true_per_sample_gradients() -> None:
    model = _transposed_model(0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, generator=gen, dtype=DT), torch.randn(6, 3, generator=gen, dtype=DT)
    damping = 0.1
    references = {name: _per_sample(model, model[int(name)], x, y) for name in ("0", "2")}
    pre = hylo.HyLoPreconditioner(model, solver="sngd", damping=damping, update_freq=1)
    assert [info.module_type for info in pre.layer_info()] == ["TransposedLinear", "TransposedLinear"]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    raw = {
        name: torch.cat([model[int(name)].weight.grad.mT, model[int(name)].bias.grad.unsqueeze(1)], 1).clone()
        for name in references
    }
    pre.step()
    for name, per_sample in references.items():
        layer = model[int(name)]
        torch.testing.assert_close(per_sample.mean(0), raw[name], rtol=1e-10, atol=1e-12)  # the oracle's ∇W
        expected = dense_natural_gradient(per_sample, raw[name], damping)
        written = torch.cat([layer.weight.grad.mT, layer.bias.grad.unsqueeze(1)], dim=1)
        torch.testing.assert_close(written, expected, rtol=1e-9, atol=1e-12)
        assert (written - raw[name]).norm() > 0.1 * raw[name].norm()  # the curvature mattered
    pre.remove()


# --------------------------------------------------------------------------- the variant
@pytest.mark.usefixtures("registered")
def test_the_variant_at_full_rank_is_exact_sngd() -> None:
    def run(solver: str) -> list[Tensor]:
        model = _transposed_model(2)
        pre = hylo.HyLoPreconditioner(model, solver=solver, rank_ratio=1.0, damping=0.05, update_freq=1)
        gen = torch.Generator().manual_seed(3)
        x, y = torch.randn(8, 5, generator=gen, dtype=DT), torch.randn(8, 3, generator=gen, dtype=DT)
        F.mse_loss(model(x), y).backward()
        pre.step()
        pre.remove()
        return [p.grad.clone() for p in model.parameters()]

    for got, expected in zip(run("uniform"), run("sngd"), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_the_uniform_estimate_of_the_fisher_is_unbiased() -> None:
    """The mean over many draws of (1/n) Σ_kept U_k U_kᵀ (rows rescaled by √(n/r)) is the batch Fisher."""
    gen = torch.Generator().manual_seed(4)
    n, r = 12, 4
    rows = FactoredRows(torch.randn(n, 3, generator=gen, dtype=DT), torch.randn(n, 2, generator=gen, dtype=DT))
    u = torch.einsum("ni,nj->nij", rows.g, rows.a).reshape(n, -1)
    fisher = u.mT @ u / n
    context = UpdateContext(rank=0, damping=1.0, factor_decay=0.0, seed=0, watch=DISABLED)
    reduction = example.UniformRows()
    total = torch.zeros_like(fisher)
    draws = 4000
    for seed in range(draws):
        kept, weights = reduction.reduce(rows, r, seed, context)
        update = reduction.update(kept, [[float(n), float(r)]], weights, context)
        assert weights is None and update.divisor == n and kept.count == r
        v = torch.einsum("ni,nj->nij", kept.g, kept.a).reshape(r, -1)
        total += v.mT @ v / update.divisor
    assert torch.linalg.norm(total / draws - fisher) / torch.linalg.norm(fisher) < 0.05


@pytest.mark.usefixtures("registered")
def test_the_hybrid_policy_takes_the_variant_in_the_stable_regime() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(DT)
    pre = hylo.HyLoPreconditioner(
        model, solver="hybrid", update_freq=1, trend_window=1, fidelity_budget=0.0, stable_variant="uniform"
    )
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, generator=gen, dtype=DT)
    for _ in range(4):
        model.zero_grad()
        model(x).square().mean().backward()  # the same batch: the gradient norm is stable
        pre.step()
    last = [d for d in pre.decision_log if d.step == 3]
    assert [(d.solver, d.reason) for d in last] == [("uniform", "stable")] * 2
    assert all(d.lowrank == "uniform" and d.cost_lowrank == d.costs["uniform"] for d in last)
    pre.remove()


# --------------------------------------------------------------------------- registration
def test_registration_is_validated_and_undone_by_its_handle() -> None:
    with pytest.raises(ValueError, match="taken"):
        hylo.register_variant("kis", example.UniformRows())
    with pytest.raises(ValueError, match="hybrid"):
        hylo.register_variant("hybrid", example.UniformRows())
    with pytest.raises(ValueError, match="name"):
        hylo.register_variant("Uniform Rows", example.UniformRows())
    with pytest.raises(ValueError, match="RowReduction"):
        hylo.register_variant("uniform", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nn.Module"):
        hylo.register_layer_type(int, lambda module, config: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stable_variant"):
        hylo.HyLoConfig(stable_variant="uniform")  # not registered yet
    handle = hylo.register_variant("uniform", example.UniformRows())
    try:
        assert (
            hylo.HyLoConfig(stable_variant="uniform", layer_solvers={"x": "uniform"}).policy.stable_variant == "uniform"
        )
    finally:
        handle.remove()
    handle.remove()  # idempotent
    with pytest.raises(ValueError, match="layer_solvers"):
        hylo.HyLoConfig(layer_solvers={"x": "uniform"})


def test_a_layer_type_whose_math_is_not_layer_math_is_refused_at_construction() -> None:
    handle = hylo.register_layer_type(example.TransposedLinear, lambda module, config: "not math")
    try:
        with pytest.raises(ValueError, match="TransposedLinear.*LayerMath"):
            hylo.HyLoPreconditioner(nn.Sequential(example.TransposedLinear(3, 2)))
    finally:
        handle.remove()
    # unregistered again: the module is left alone, and the constructor says why
    with pytest.warns(UserWarning, match="TransposedLinear is not a supported layer type"):
        pre = hylo.HyLoPreconditioner(nn.Sequential(example.TransposedLinear(3, 2), nn.Linear(2, 2)))
    assert [info.name for info in pre.layer_info()] == ["1"]
    pre.remove()
