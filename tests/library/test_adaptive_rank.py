"""``rank_ratio="auto"``: each layer keeps as many rows as its kernel spectrum needs (docs/solvers.md, "Adaptive rank").

- data of known rank k (per-sample gradients spanning k directions plus noise far below the energy target): KID keeps
  exactly k rows and KIS k ± :data:`KIS_TOLERANCE`; the step then matches the dense solve of the true per-sample
  Fisher (torch.func-free autograd oracle) to the noise's order;
- at ``rank_energy=1`` and ``rank_cap=1`` KID and KIS keep every row: the step of exact SNGD, checked against the
  dense solve of the true per-sample gradients;
- the pivoted Cholesky stops at the target with the pivots of the run to the cap (both of its paths), and the mass
  it leaves is the first below the target;
- P ranks: every rank keeps what one process keeps on its rows, all ranks record the same (rows kept, rows), and at
  energy 1 P ranks give one process's step (the DDP equality is tests/library/test_distributed.py's);
- the chosen rank is recorded (``layer_info``, ``summary()``, ``decision_log``) and read by the cost model at the
  next update; a checkpoint carries it and resumes bit for bit; a bad saved entry is refused naming the layer;
- bad options are ``ValueError`` naming them, and a registered variant that cannot choose its rank is refused.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.layers.rows import FactoredRows
from hylo.solvers.reduce import dropped_mass, pivoted_cholesky
from tests.kit.checks import DT
from tests.kit.harness import run_distributed
from tests.kit.reference import dense_natural_gradient, per_sample_matrices

pytestmark = pytest.mark.usefixtures("single_thread")

#: How far KIS's sketched rank may miss the known rank (the sketch's shares estimate the spectrum's).
KIS_TOLERANCE = 1
D, N, DAMPING = 16, 48, 1e-3


def low_rank_batch(k: int, seed: int, noise: float = 1e-8) -> tuple[Tensor, Tensor]:
    """N inputs in the span of k orthonormal directions, with equal weight in each, plus ``noise``; targets of a
    one-output regression. With one output and no bias the per-sample gradients U_i = g_i x_iᵀ span the same k
    directions."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(D, k, generator=gen, dtype=DT)).Q.mT  # k × D, orthonormal rows
    signs = torch.randint(0, 2, (N, k), generator=gen).to(DT) * 2 - 1
    x = signs @ basis + noise * torch.randn(N, D, generator=gen, dtype=DT)
    return x, torch.randn(N, 1, generator=gen, dtype=DT)


def regression(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(D, 1, bias=False).to(DT)


def step(model: nn.Module, x: Tensor, y: Tensor, **options: Any) -> tuple[hylo.HyLoPreconditioner, Tensor]:
    """One update of hylo on a mean squared error; the preconditioner and the preconditioned gradient."""
    pre = hylo.HyLoPreconditioner(model, update_freq=1, damping=DAMPING, **options)
    F.mse_loss(model(x), y).backward()
    pre.step()
    return pre, next(model.parameters()).grad.detach().clone()


def exact_step(x: Tensor, y: Tensor, damping: float = DAMPING) -> Tensor:
    """(F + λI)⁻¹ ∇W from the model's true per-sample gradients (autograd, one sample at a time)."""
    model = regression()
    per_sample = per_sample_matrices(model, {"": model}, x, lambda out: F.mse_loss(out, y))[""]
    return dense_natural_gradient(per_sample, per_sample.mean(0), damping)


# ---------------------------------------------------------------------------- known rank
@pytest.mark.parametrize("k", [1, 3, 6])
def test_kid_keeps_the_known_rank_and_its_step_is_exact_sngd(k: int) -> None:
    x, y = low_rank_batch(k, seed=k)
    pre, got = step(regression(), x, y, solver="kid", rank_ratio="auto", rank_energy=0.99)
    assert pre.layer_info()[0].rows_kept == (k, N)
    want = exact_step(x, y)
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-3  # the noise's order, ≪ the fixed-r error
    _, short = step(regression(), x, y, solver="kid", rank=max(1, k - 1))
    if k > 1:  # a row fewer than the spectrum needs is far off: the comparison is not vacuous
        assert torch.linalg.norm(short - want) / torch.linalg.norm(want) > 0.1


@pytest.mark.parametrize("k", [1, 3, 6])
def test_kis_keeps_about_the_known_rank(k: int) -> None:
    x, y = low_rank_batch(k, seed=k)
    for seed in range(4):
        pre, _ = step(regression(), x, y, solver="kis", rank_ratio="auto", seed=seed)
        kept, rows = pre.layer_info()[0].rows_kept  # type: ignore[misc]
        assert rows == N and abs(kept - k) <= KIS_TOLERANCE, (seed, kept)


@pytest.mark.parametrize("solver", ["kid", "kis"])
def test_energy_one_at_full_cap_is_exact_sngd(solver: str) -> None:
    x, y = low_rank_batch(5, seed=0, noise=0.3)  # full rank: every row counts
    pre, got = step(regression(), x, y, solver=solver, rank_ratio="auto", rank_energy=1.0, rank_cap=1.0)
    assert pre.layer_info()[0].rows_kept == (N, N)
    want = exact_step(x, y, DAMPING)
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-8
    _, sngd = step(regression(), x, y, solver="sngd")
    torch.testing.assert_close(got, sngd, rtol=1e-8, atol=0)


def test_the_cap_bounds_the_rows_and_rank_is_an_absolute_cap() -> None:
    x, y = low_rank_batch(6, seed=1)
    pre, _ = step(regression(), x, y, solver="kid", rank_ratio="auto", rank_cap=0.05)  # ⌊0.05·48⌋ = 2
    assert pre.layer_info()[0].rows_kept == (2, N)
    pre, _ = step(regression(), x, y, solver="kid", rank_ratio="auto", rank=4)
    assert pre.layer_info()[0].rows_kept == (4, N)


# ---------------------------------------------------------------------------- the stopping rule
@pytest.mark.parametrize("lookahead", [True, False])
def test_pivoted_cholesky_stops_at_the_target_with_the_pivots_of_the_full_run(lookahead: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    scales = torch.logspace(0, -3, 40, dtype=DT)[:, None]  # decaying row norms: a graded spectrum
    rows = FactoredRows(
        torch.randn(40, 12, generator=gen, dtype=DT) * scales, torch.randn(40, 3, generator=gen, dtype=DT)
    )
    pivots, factor, _ = pivoted_cholesky(rows, 30, lookahead=lookahead)
    trace = float(rows.sq_norms().sum())
    left = trace - factor.square().sum(0).cumsum(0)  # the residual trace after each pivot
    for energy in (0.5, 0.9, 0.99, 0.999):
        stop = dropped_mass(rows, 0.1, energy)
        k = int((left >= stop).sum()) + 1
        assert 1 < k < 30  # the target falls inside the run
        got, got_factor, _ = pivoted_cholesky(rows, 30, lookahead=lookahead, stop_below=stop)
        assert got.tolist() == pivots[:k].tolist()
        torch.testing.assert_close(got_factor, factor[:, :k], rtol=1e-12, atol=1e-14)
        assert left[k - 1] < stop <= left[k - 2]  # the first pivot count that leaves less than the target


def test_dropped_mass_is_a_share_of_the_damping_floor() -> None:
    rows = FactoredRows(torch.ones(4, 2, dtype=DT), torch.ones(4, 1, dtype=DT))
    assert dropped_mass(rows, 0.5, 0.75) == pytest.approx(0.25 * 4 * 0.5)  # (1 − e)·nλ in kernel units
    assert dropped_mass(rows, 0.5, 1.0) == 0.0


# ---------------------------------------------------------------------------- ranks
def _rank_body(rank: int, world_size: int, x: Tensor, y: Tensor, options: dict[str, Any]) -> dict[str, Any]:
    model = regression()
    net: nn.Module = model
    if world_size > 1:
        net = nn.parallel.DistributedDataParallel(model)
    rows = slice(rank * N // world_size, (rank + 1) * N // world_size)
    pre, got = step(net, x[rows], y[rows], **options)
    return {"info": pre.layer_info()[0].rows_kept, "grad": got}


@pytest.mark.parametrize("solver", ["kid", "kis"])
def test_p_ranks_keep_what_one_process_keeps_on_each_ranks_rows_and_agree(solver: str) -> None:
    """Two ranks (DDP, gloo), each with half the batch of rank k = 3 data: each keeps k (KID exactly, as one process
    does on its rows alone; KIS k ± :data:`KIS_TOLERANCE`), both record (Σ r_p, B) and precondition bit for bit alike,
    and KID's step is the exact one of the whole batch to the noise's order (KIS's k rows estimate the Fisher
    without bias, not exactly)."""
    x, y = low_rank_batch(3, seed=5)
    options = {"solver": solver, "rank_ratio": "auto"}
    out = run_distributed(_rank_body, 2, x, y, options, timeout=60)
    halves = [slice(p * N // 2, (p + 1) * N // 2) for p in range(2)]
    alone = [step(regression(), x[half], y[half], **options)[0] for half in halves]
    kept = [pre.layer_info()[0].rows_kept[0] for pre in alone]  # type: ignore[index]
    if solver == "kid":
        assert kept == [3, 3]
        assert out[0]["info"] == out[1]["info"] == (6, N)
    else:
        assert all(abs(r - 3) <= KIS_TOLERANCE for r in kept)
        assert out[0]["info"] == out[1]["info"] and out[0]["info"][1] == N
    assert torch.equal(out[0]["grad"], out[1]["grad"])
    if solver == "kid":
        want = exact_step(x, y)
        assert torch.linalg.norm(out[0]["grad"] - want) / torch.linalg.norm(want) < 1e-3


def test_p_ranks_at_energy_one_equal_one_process() -> None:
    x, y = low_rank_batch(5, seed=2, noise=0.3)
    options = {"solver": "kid", "rank_ratio": "auto", "rank_energy": 1.0, "rank_cap": 1.0}
    out = run_distributed(_rank_body, 2, x, y, options, timeout=60)
    _, one = step(regression(), x, y, **options)
    for result in out:
        assert result["info"] == (N, N)
        assert torch.linalg.norm(result["grad"] - one) / torch.linalg.norm(one) < 1e-9


# ---------------------------------------------------------------------------- records, cost model, checkpoints
class TwoLayers(nn.Module):
    """A layer whose rows have rank 2 (one output, inputs of rank 2) and one whose rows are full rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.low = nn.Linear(D, 1, bias=False).to(DT)
        self.full = nn.Linear(D, 4).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.low(x[:, :D]) + self.full(x[:, D:]).sum(1, keepdim=True)


def two_layer_batches(steps: int) -> list[tuple[Tensor, Tensor]]:
    batches = []
    for s in range(steps):
        low, y = low_rank_batch(2, seed=100 + s)
        full = torch.randn(N, D, generator=torch.Generator().manual_seed(200 + s), dtype=DT)
        batches.append((torch.cat([low, full], dim=1), y))
    return batches


def train(model: nn.Module, pre: hylo.HyLoPreconditioner, batches: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    grads = []
    for x, y in batches:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        pre.step()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return grads


AUTO = {"rank_ratio": "auto", "rank_energy": 0.9, "damping": 1e-3, "update_freq": 2}


def test_the_chosen_rank_is_recorded_and_read_by_the_cost_model() -> None:
    seen: list[tuple[str, int, int]] = []

    def rule(name: str, step_: int, stats: hylo.LayerStats) -> str:
        seen.append((name, step_, stats.kept))
        return "kid"

    model = TwoLayers()
    pre = hylo.HyLoPreconditioner(model, solver="hybrid", solver_fn=rule, **AUTO)
    train(model, pre, two_layer_batches(3))
    info = {i.name: i.rows_kept for i in pre.layer_info()}
    assert info["low"] == (2, N)
    assert info["full"] is not None and 2 < info["full"][0] <= N // 4  # the cap, ⌊0.25·48⌋
    decided = {(d.step, d.layer): d.rows_kept for d in pre.decision_log}
    assert decided[(2, "low")] == 2 and decided[(2, "full")] == info["full"][0]
    cap = N // 4
    first = {name: kept for name, s, kept in seen if s == 0}
    second = {name: kept for name, s, kept in seen if s == 2}
    assert first == {"low": cap, "full": cap}  # nothing chosen yet: the cost model prices the cap
    assert second["low"] == decided[(0, "low")] == 2  # then the share the layer kept (one process: m = r)
    assert second["full"] == decided[(0, "full")]
    lines = {line.split()[0]: line for line in pre.summary().splitlines()[2:]}
    assert lines["low"].split()[-1] == f"2/{N}"


def test_kfac_layers_record_no_rows() -> None:
    model = TwoLayers()
    pre = hylo.HyLoPreconditioner(model, solver="kid", layer_solvers={"full": "kfac"}, **AUTO)
    train(model, pre, two_layer_batches(1))
    assert {i.name: i.rows_kept for i in pre.layer_info()}["full"] is None
    assert [d.rows_kept for d in pre.decision_log if d.layer == "full"] == [None]
    lines = {line.split()[0]: line for line in pre.summary().splitlines()[2:]}
    assert lines["full"].split()[-2:] == ["kfac", "-"] and lines["low"].split()[-1] == f"2/{N}"


#: hybrid with K-FAC refused (state budget): each layer takes the cheaper of KID and KIS, priced at its last rows.
LOW_RANK_HYBRID = {"solver": "hybrid", "kfac_max_state_mb": 1e-6}


@pytest.mark.parametrize("options", [LOW_RANK_HYBRID, {"solver": "kis"}], ids=["hybrid", "kis"])
def test_a_checkpoint_resumes_the_adaptive_run_bit_for_bit(options: dict[str, Any]) -> None:
    batches = two_layer_batches(7)
    model = TwoLayers()
    pre = hylo.HyLoPreconditioner(model, **options, **AUTO)
    train(model, pre, batches[:3])
    saved, weights = pre.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    kept_at_save = [i.rows_kept for i in pre.layer_info()]
    assert all(kept is not None for kept in kept_at_save)  # every layer was solved from rows
    assert {name: entry.get("kept") for name, entry in saved["layers"].items()} == {
        i.name: list(i.rows_kept) if i.rows_kept else None for i in pre.layer_info()
    }
    expected = train(model, pre, batches[3:])
    twin = TwoLayers()
    twin.load_state_dict(weights)
    resumed = hylo.HyLoPreconditioner(twin, **options, **AUTO)
    resumed.load_state_dict(saved)
    assert [i.rows_kept for i in resumed.layer_info()] == kept_at_save  # what the next update is priced on
    got = train(twin, resumed, batches[3:])
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert [(d.step, d.layer, d.solver, d.rows_kept) for d in resumed.decision_log] == [
        (d.step, d.layer, d.solver, d.rows_kept) for d in pre.decision_log if d.step >= 3
    ]


@pytest.mark.parametrize("kept", [[0, 48], [49, 48], [2], "2/48", [2.0, 48]])
def test_a_bad_saved_rank_is_refused_naming_the_layer(kept: Any) -> None:
    model = TwoLayers()
    pre = hylo.HyLoPreconditioner(model, solver="kid", **AUTO)
    train(model, pre, two_layer_batches(1))
    saved = pre.state_dict()
    saved["layers"]["low"]["kept"] = kept
    saved.pop("checksum", None)
    saved["format"] = 2  # an unsealed format, so that the entry itself is checked
    before = pre.layer_info()
    with pytest.raises(ValueError, match="layer 'low'.*kept"):
        pre.load_state_dict(saved)
    assert pre.layer_info() == before


def test_a_checkpoint_without_ranks_loads_and_prices_the_cap() -> None:
    model = TwoLayers()
    pre = hylo.HyLoPreconditioner(model, solver="kid", **AUTO)
    train(model, pre, two_layer_batches(1))
    saved = pre.state_dict()
    for entry in saved["layers"].values():
        entry.pop("kept")
    saved.pop("checksum", None)
    saved["format"] = 2
    pre.load_state_dict(saved)
    assert [i.rows_kept for i in pre.layer_info()] == [None, None]


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"rank_ratio": "Auto"}, "rank_ratio"),
        ({"rank_ratio": "full"}, "rank_ratio"),
        ({"rank_energy": 0.0}, "rank_energy"),
        ({"rank_energy": 1.5}, "rank_energy"),
        ({"rank_cap": 0}, "rank_cap"),
        ({"grad_error_ratios": ("auto", 2.0)}, "grad_error_ratios"),
    ],
)
def test_bad_options_are_value_errors_naming_them(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        hylo.HyLoConfig(**options)


def test_rows_kept_under_auto_is_the_cap_and_the_cost_model_scales_the_last_share() -> None:
    lowrank = hylo.HyLoConfig(rank_ratio="auto", rank_cap=0.25).lowrank
    assert lowrank.adaptive and lowrank.energy == 0.99
    assert lowrank.rows_kept(64) == 16 and lowrank.expected_rows(64, None) == 16
    assert lowrank.expected_rows(64, (3, 32)) == 6  # 3 of 32 rows last time: ⌈3·64/32⌉
    assert lowrank.expected_rows(64, (32, 32)) == 16  # never above the cap
    fixed = hylo.HyLoConfig(rank_ratio=0.1).lowrank
    assert not fixed.adaptive and fixed.energy is None and fixed.expected_rows(64, (3, 32)) == 6 == fixed.rows_kept(64)


def test_a_variant_that_cannot_choose_its_rank_is_refused() -> None:
    class Uniform(hylo.RowReduction):
        def reduce(self, rows: Any, r: int, seed: int, context: Any) -> Any:
            return rows.select(torch.arange(r)), None

        def update(self, rows: Any, counts: Any, weights: Any, context: Any) -> Any:
            from hylo.solvers.smw import LowRankUpdate

            return LowRankUpdate(rows, sum(n for n, _ in counts))

    handle = hylo.register_variant("uniform_fixed", Uniform())
    try:
        with pytest.raises(ValueError, match="uniform_fixed.*choose"):
            hylo.HyLoConfig(solver="uniform_fixed", rank_ratio="auto")
        with pytest.raises(ValueError, match="uniform_fixed"):
            hylo.HyLoConfig(rank_ratio="auto", layer_solvers={"fc": "uniform_fixed"})
        model = TwoLayers()  # a solver_fn returning it is refused by the step, which changes nothing
        pre = hylo.HyLoPreconditioner(model, solver="hybrid", solver_fn=lambda *_: "uniform_fixed", **AUTO)
        with pytest.raises(ValueError, match="uniform_fixed.*adapts_rank"):
            train(model, pre, two_layer_batches(1))
        assert pre.steps == 0
        hylo.HyLoConfig(solver="uniform_fixed", rank_ratio=0.5)  # a fixed rank is fine
    finally:
        handle.remove()


def test_the_gradient_error_study_measures_auto(tmp_path: Any) -> None:
    model = TwoLayers()
    pre = hylo.HyLoPreconditioner(
        model,
        solver="kid",
        profile_dir=tmp_path,
        studies=("grad_error",),
        grad_error_methods=("kid",),
        grad_error_ratios=("auto", 0.5),
        **AUTO,
    )
    train(model, pre, two_layer_batches(1))
    pre.close()
    import pandas as pd

    errors = pd.read_csv(tmp_path / "grad-error.csv")
    assert sorted(set(errors.rank_ratio.astype(str))) == ["0.5", "auto"]
    low = errors[(errors.layer == "low") & (errors.rank_ratio.astype(str) == "auto")].rel_error.iloc[0]
    assert low < 1e-2 and not math.isnan(low)  # rank 2 kept: the error is the noise's
