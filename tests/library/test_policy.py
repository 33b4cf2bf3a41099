"""The hybrid per-layer solver policy (docs/hybrid-policy.md, "Rules"; hylo/policy.py).

1. Cost model: K-FAC where it is cheaper (small layers), low-rank for wide layers; the formulas
   of the families' ``cost()`` recomputed by hand; the preconditioner picks accordingly.
2. Priority: ``layer_solvers`` (regex full match) > ``solver_fn`` > built-in rule.
3. Switching solvers mid-run: the step after a switch equals a fresh preconditioner of the new
   solver (K-FAC starts from the batch factors, no stale running average).
4. Two gloo ranks (DDP, different data): identical decisions and gradients.
5. ``decision_log`` bound.

The gradient-norm trend and HyLo's ``adaptive`` windows are in test_trend.py, validation of the
policy options in test_config.py, the hybrid ``state_dict`` round trip in test_checkpoint.py.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo.preconditioner as preconditioner_module
from hylo import HyLoConfig, HyLoPreconditioner, LayerStats
from hylo.layers import LayerShape
from hylo.numerics import POWER_COST
from hylo.policy import SolverPolicy, is_dynamic
from hylo.solvers import LAYER_SOLVERS, FamilyOptions, family_of
from hylo.solvers.kfac import EIGH_COST, INVERSE_COST, KFACConfig
from hylo.solvers.lowrank import PIVOT_WORK_WEIGHT
from tests.kit.checks import DT, grad_matrix
from tests.kit.harness import run_distributed
from tests.kit.models import override_model, regression_data, sequential

#: Every family's options at their defaults (what the cost model prices without a config).
DEFAULTS = HyLoConfig().family_options()

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- helpers
def kfac_cost(d_a: int, d_g: int, kfac_rows: int, f: int) -> float:
    """K-FAC per update period, by hand: n_k(d_a² + d_g²) + 4(d_a³ + d_g³) + f·2 d_a d_g (d_a + d_g)."""
    return kfac_rows * (d_a**2 + d_g**2) + EIGH_COST * (d_a**3 + d_g**3) + f * 2.0 * d_a * d_g * (d_a + d_g)


def lowrank_cost(solver: str, d_a: int, d_g: int, rows: int, kept: int, f: int, world: int = 1) -> float:
    """A low-rank variant per update period, by hand (factored rows, w = d_a + d_g, no traffic).

    m = P·n (sngd) or P·r; local work: none (sngd), 10 (n r w + n r²) (kid: r kernel columns, pivoted Cholesky),
    n w (kis: row norms); then m² w + m³ + f·2 m d_a d_g.
    """
    w = d_a + d_g
    m = world * (rows if solver == "sngd" else kept)
    local = {"sngd": 0.0, "kid": PIVOT_WORK_WEIGHT * (rows * kept * w + rows * kept**2), "kis": rows * w}[solver]
    return local + m**2 * w + m**3 + f * 2.0 * m * d_a * d_g


def regression_step(model: nn.Module, x: Tensor, direction: Tensor, scale: float = 1.0) -> None:
    """Backward of ``scale · <model(x), direction>`` (grads zeroed first)."""
    model.zero_grad(set_to_none=False)
    (scale * (model(x) * direction).sum()).backward()


# ============================================================================ 1. cost model
# (d_a, d_g, rows n, kfac_rows n_k, kept r, update_freq f); d_a includes the bias column.
KFAC_CHEAPER = [
    pytest.param(65, 10, 2048, 2048, 204, 10, id="classifier-65x10-n2048"),
    pytest.param(65, 10, 1024, 1024, 102, 10, id="classifier-65x10-n1024"),
    pytest.param(5, 3, 256, 256, 25, 10, id="tiny-5x3-n256"),
    pytest.param(10, 4, 256, 256, 25, 10, id="tiny-10x4-n256"),
]
LOWRANK_CHEAPER = [
    pytest.param(4608, 512, 128, 128, 48, 10, id="conv-4608x512"),
    pytest.param(1024, 256, 128, 128, 48, 10, id="fc-1024x256"),
    pytest.param(577, 64, 128, 128, 48, 10, id="conv-577x64"),
    pytest.param(577, 64, 128, 128 * 64, 48, 10, id="conv-577x64-8x8-positions"),
    pytest.param(2001, 2000, 8, 8, 1, 10, id="fc-2000x2000-n8"),
    pytest.param(65, 64, 8, 8, 1, 1, id="fc-64x64-n8"),
]


@pytest.mark.parametrize(("d_a", "d_g", "n", "n_k", "r", "f"), KFAC_CHEAPER)
def test_cost_kfac_cheaper_for_small_layers(d_a: int, d_g: int, n: int, n_k: int, r: int, f: int) -> None:
    c_kfac, c_kid = kfac_cost(d_a, d_g, n_k, f), lowrank_cost("kid", d_a, d_g, n, r, f)
    assert lowrank_cost("kis", d_a, d_g, n, r, f) < c_kid
    assert c_kfac < c_kid, (c_kfac, c_kid)
    config = HyLoConfig(solver="hybrid", update_freq=f, fidelity_budget=0.0)
    (decision,) = SolverPolicy(["layer"]).decide(0, [LayerShape(d_a, d_g, n, n_k, r)], f, 1, config)
    assert (decision.solver, decision.reason) == ("kfac", "cost")
    assert (decision.cost_kfac, decision.cost_lowrank) == (c_kfac, c_kid)  # critical at step 0: KID's cost
    assert decision.cost_sngd == lowrank_cost("sngd", d_a, d_g, n, r, f)


@pytest.mark.parametrize(("d_a", "d_g", "n", "n_k", "r", "f"), LOWRANK_CHEAPER)
def test_cost_lowrank_cheaper_for_wide_layers(d_a: int, d_g: int, n: int, n_k: int, r: int, f: int) -> None:
    c_kfac, c_kid = kfac_cost(d_a, d_g, n_k, f), lowrank_cost("kid", d_a, d_g, n, r, f)
    assert c_kid < c_kfac, (c_kfac, c_kid)
    config = HyLoConfig(solver="hybrid", update_freq=f, trend_window=1, fidelity_budget=0.0)
    policy = SolverPolicy(["layer"])
    shape = LayerShape(d_a, d_g, n, n_k, r)
    (first,) = policy.decide(0, [shape], f, 1, config)
    assert (first.solver, first.reason, first.critical) == ("kid", "critical", True)  # no history yet
    assert first.cost_lowrank == c_kid
    # A stable gradient norm afterwards → stable → KIS, charged only for the row norms it computes.
    policy.trend.observe(torch.tensor([3.0], dtype=DT), config.policy.decay)
    policy.decide(f, [shape], f, 1, config)
    policy.trend.observe(torch.tensor([3.0], dtype=DT), config.policy.decay)
    (later,) = policy.decide(2 * f, [shape], f, 1, config)
    assert (later.solver, later.reason, later.critical, later.trend) == ("kis", "stable", False, 0.0)
    assert later.cost_lowrank == lowrank_cost("kis", d_a, d_g, n, r, f)
    assert c_kid - later.cost_lowrank == PIVOT_WORK_WEIGHT * (n * r * (d_a + d_g) + n * r**2) - n * (d_a + d_g)


def test_cost_formulas_recomputed_by_hand() -> None:
    """One row of the table written out term by term (module docstring formulas, EIGH_COST = 4)."""
    assert EIGH_COST == 4.0
    d_a, d_g, n, r, f = 4608, 512, 128, 48, 10
    # K-FAC: n_k (d_a² + d_g²) + 4 (d_a³ + d_g³) + f · 2 d_a d_g (d_a + d_g)
    factors = 128 * (21_233_664 + 262_144)  # 4608² = 21 233 664, 512² = 262 144
    eighs = 4 * (97_844_723_712 + 134_217_728)  # 4608³, 512³
    rotations = 10 * 2 * 4608 * 512 * 5120
    assert (factors, eighs, rotations) == (2_751_463_424, 391_915_765_760, 241_591_910_400)
    shape = LayerShape(d_a, d_g, n, n, r)
    assert (
        family_of("kfac").cost(shape, "kfac", DEFAULTS).per_period(f) == 636_259_139_584 == factors + eighs + rotations
    )
    # KID: 10 (n r (d_a + d_g) + n r²) + m² (d_a + d_g) + m³ + f · 2 m d_a d_g, m = r on one rank
    assert PIVOT_WORK_WEIGHT == 10.0
    local_kernel = 10 * 128 * 48 * 5120  # 314 572 800: r columns of the n×n kernel, weighted
    pivots = 10 * 128 * 48**2  # 2 949 120
    gathered_kernel = 48**2 * 5120  # 11 796 480
    smw = 48**3  # 110 592
    apply = 10 * 2 * 48 * 4608 * 512  # 2 264 924 160
    kid = family_of("kid").cost(shape, "kid", DEFAULTS).per_period(f)
    assert kid == 2_594_353_152 == local_kernel + pivots + gathered_kernel + smw + apply
    # KIS: the row norms n (d_a + d_g) instead of the kernel and the pivots
    assert family_of("kis").cost(shape, "kis", DEFAULTS).per_period(f) == kid - local_kernel - pivots + 128 * 5120
    # SNGD: every row, m = n = 128
    sngd = 128**2 * 5120 + 128**3 + 10 * 2 * 128 * 4608 * 512
    assert family_of("sngd").cost(shape, "sngd", DEFAULTS).per_period(f) == sngd == 6_125_780_992
    # The per-step terms scale with update_freq.
    assert family_of("kid").cost(shape, "kid", DEFAULTS).per_period(2 * f) - kid == apply


def test_the_cost_model_prices_the_method_the_run_solves_k_fac_by() -> None:
    """``kfac_method="inverse"``: Cholesky inverses (d_a³ + d_g³) and two products a step instead of four; kfac_adam
    with ``basis_refresh="power"``: a product and a QR per factor (POWER_COST d³) instead of an eigendecomposition.
    The policy sets the methods on the shapes it prices from the config."""
    d_a, d_g, n = 513, 128, 2048
    shape = LayerShape(d_a, d_g, n, n, 0)
    eigen = family_of("kfac").cost(shape, "kfac", DEFAULTS)
    inverse = family_of("kfac").cost(shape, "kfac", FamilyOptions([KFACConfig(kfac_method="inverse")]))
    cubes = float(d_a) ** 3 + float(d_g) ** 3
    assert (eigen.solve, inverse.solve) == (EIGH_COST * cubes, INVERSE_COST * cubes)
    assert (eigen.apply, inverse.apply) == (2.0 * d_a * d_g * (d_a + d_g), 1.0 * d_a * d_g * (d_a + d_g))
    assert inverse.build == eigen.build
    adam = family_of("kfac_adam").cost(shape, "kfac_adam", DEFAULTS)
    warm = family_of("kfac_adam").cost(shape, "kfac_adam", HyLoConfig(basis_refresh="power").family_options())
    assert (adam.solve, warm.solve) == (EIGH_COST * cubes, POWER_COST * cubes)
    assert adam.apply == warm.apply > eigen.apply  # the eigen method's rotations and the moments
    # the policy prices what the config runs
    model = nn.Sequential(nn.Linear(512, 128))
    for method, priced in (("eigen", eigen), ("inverse", inverse)):
        pre = HyLoPreconditioner(model, solver="hybrid", kfac_method=method, update_freq=1)
        model.zero_grad()
        model(torch.randn(n, 512)).square().sum().backward()
        pre.step()
        pre.remove()
        assert pre.decision_log[-1].costs["kfac"] == priced.per_period(1)


def test_exact_conv_rows_are_charged_for_their_width_and_traffic_when_distributed() -> None:
    """Dense rows: w = d_a·d_g and their build n_k·d_a·d_g; with P ranks the bytes exchanged count."""
    d_a, d_g, n, n_k, r, f = 577, 64, 32, 32 * 64, 3, 10
    dense = LayerShape(d_a, d_g, n, n_k, r, 1, True, float(n_k * d_a * d_g))
    w = d_a * d_g
    cost = family_of("sngd").cost(dense, "sngd", DEFAULTS)
    assert (cost.build, cost.solve, cost.bytes) == (n_k * d_a * d_g, n**2 * w + n**3, 0.0)
    spread = LayerShape(d_a, d_g, n, n_k, r, world_size=4, itemsize=4)
    m = 4 * n
    lowrank = family_of("sngd").cost(spread, "sngd", DEFAULTS)
    assert lowrank.bytes == 4 * (m * (d_a + d_g) + m**2)  # gathered rows and the broadcast M
    assert family_of("kfac").cost(spread, "kfac", DEFAULTS).bytes == 4 * 3 * (d_a**2 + d_g**2)
    assert lowrank.per_period(f, 100.0) - lowrank.per_period(f) == 100.0 * lowrank.bytes
    # the policy adds the traffic only when P > 1
    config = HyLoConfig(solver="hybrid", fidelity_budget=0.0, comm_flops_per_byte=100.0)
    (d,) = SolverPolicy(["layer"]).decide(0, [spread], f, 4, config)
    assert d.cost_sngd == lowrank.per_period(f, 100.0)


def test_fidelity_first_where_exact_is_affordable() -> None:
    """ResNet-20's last conv and its 64→10 classifier at batch 128: cost alone gives the classifier
    KID at ρ = 0.1 (12 of 128 rows); with the fidelity budget it gets exact SNGD, for a cost that
    is a tiny share of an average layer's forward+backward work."""
    f, n = 10, 128
    conv = LayerShape(577, 64, n, n * 64, 12)
    classifier = LayerShape(65, 10, n, n, 12)
    average = f * (3 * n * 64 * 577 * 64 + 3 * n * 65 * 10) / 2
    cheap_only = HyLoConfig(solver="hybrid", fidelity_budget=0.0)
    policy = SolverPolicy(["conv", "fc"])
    assert [d.solver for d in policy.decide(0, [conv, classifier], f, 1, cheap_only)] == ["kid", "kid"]
    hybrid = HyLoConfig(solver="hybrid")
    decisions = policy.decide(0, [conv, classifier], f, 1, hybrid)
    assert [(d.solver, d.reason) for d in decisions] == [("sngd", "fidelity"), ("sngd", "fidelity")]
    assert all(d.cost_sngd <= 0.05 * average for d in decisions)
    # A budget too small for SNGD on the classifier but enough for K-FAC gives K-FAC.
    c_sngd, c_kfac = decisions[1].cost_sngd, decisions[1].cost_kfac
    assert c_kfac < c_sngd
    budget = (c_kfac + c_sngd) / 2 / average
    middle = HyLoConfig(solver="hybrid", fidelity_budget=budget)
    assert [(d.solver, d.reason) for d in policy.decide(0, [conv, classifier], f, 1, middle)][1] == ("kfac", "fidelity")
    # Many ranks: the gathered SNGD solve (m = 64·128) is no longer negligible; the cost rule decides.
    wide = [LayerShape(577, 64, n, n * 64, 12, 64), LayerShape(65, 10, n, n, 12, 64)]
    assert all(d.reason != "fidelity" or d.solver == "kfac" for d in policy.decide(0, wide, f, 64, hybrid))


def test_preconditioner_picks_by_cost_on_real_layers() -> None:
    """Linear(2000, 2000) at batch 8 → low-rank; Linear(4, 3) at batch 256 → K-FAC; conv rows."""
    torch.manual_seed(0)
    big = nn.Sequential(OrderedDict(fc=nn.Linear(2000, 2000)))
    small = nn.Sequential(OrderedDict(fc=nn.Linear(4, 3)))
    conv = nn.Sequential(OrderedDict(conv=nn.Conv2d(2, 4, 3, padding=1), flat=nn.Flatten(), fc=nn.Linear(100, 5)))

    pre_big = HyLoPreconditioner(big, solver="hybrid")
    assert pre_big.solver_of("fc") == "hybrid"  # configured solver before the first update
    big(torch.randn(8, 2000)).square().mean().backward()
    pre_big.step()
    assert pre_big.solver_of("fc") == "kid"  # critical: no trend history at step 0
    (d,) = pre_big.decision_log
    assert (d.step, d.layer, d.solver, d.reason) == (0, "fc", "kid", "critical")
    # update_freq defaults to 10; kept = max(1, floor(0.1 · 8)) = 1.
    assert d.cost_kfac == kfac_cost(2001, 2000, 8, 10) == 384_352_096_012
    assert d.cost_lowrank == lowrank_cost("kid", 2001, 2000, 8, 1, 10) == 80_364_162
    assert torch.isfinite(big.fc.weight.grad).all()

    pre_small = HyLoPreconditioner(small, solver="hybrid")
    small(torch.randn(256, 4)).square().mean().backward()
    pre_small.step()
    assert pre_small.solver_of("fc") == "kfac"
    (d,) = pre_small.decision_log
    assert (d.solver, d.reason) == ("kfac", "cost")
    assert d.cost_kfac == kfac_cost(5, 3, 256, 10) == 11_712

    # Conv2d: K-FAC rows are samples × output positions, low-rank rows are samples; the
    # surrogate rows cost one pass over the n_k positions.
    pre_conv = HyLoPreconditioner(conv, solver="hybrid", update_freq=3, rank_ratio=0.5)
    conv(torch.randn(6, 2, 5, 5)).square().mean().backward()
    pre_conv.step()
    log = {d.layer: d for d in pre_conv.decision_log}
    assert log["conv"].cost_kfac == kfac_cost(19, 4, 6 * 25, 3)
    assert log["conv"].cost_lowrank == lowrank_cost("kid", 19, 4, 6, 3, 3) + 6 * 25 * (19 + 4)
    assert log["fc"].cost_kfac == kfac_cost(101, 5, 6, 3)
    assert log["fc"].cost_lowrank == lowrank_cost("kid", 101, 5, 6, 3, 3)
    budget = 0.05 * 3 * (3 * 150 * 19 * 4 + 3 * 6 * 101 * 5) / 2
    for name, d in log.items():
        if d.cost_sngd <= budget:
            expected = "sngd"
        elif d.cost_kfac <= budget or d.cost_kfac <= d.cost_lowrank:
            expected = "kfac"
        else:
            expected = "kid"
        assert pre_conv.solver_of(name) == d.solver == expected


# ============================================================================ 2. priority and overrides
def test_layer_solvers_beat_solver_fn_beat_builtin_rule() -> None:
    model = override_model()
    calls: list[tuple[str, int, LayerStats]] = []

    def fn(name: str, step: int, stats: LayerStats) -> str:
        calls.append((name, step, stats))
        return "kis"

    x, direction = regression_data(0, 8, 16, 3)
    # built-in rule only
    builtin = HyLoPreconditioner(m0 := copy.deepcopy(model), solver="hybrid", update_freq=1)
    regression_step(m0, x, direction)
    builtin.step()
    assert {d.layer: (d.solver, d.reason) for d in builtin.decision_log} == dict.fromkeys(
        ("fc1", "fc2", "head"), ("kid", "critical")
    )
    # solver_fn beats the built-in rule
    with_fn = HyLoPreconditioner(m1 := copy.deepcopy(model), solver="hybrid", update_freq=1, solver_fn=fn)
    regression_step(m1, x, direction)
    with_fn.step()
    assert {d.layer: (d.solver, d.reason) for d in with_fn.decision_log} == dict.fromkeys(
        ("fc1", "fc2", "head"), ("kis", "solver_fn")
    )
    # layer_solvers beat solver_fn (which is then not even consulted for that layer)
    calls.clear()
    both = HyLoPreconditioner(
        m2 := copy.deepcopy(model),
        solver="hybrid",
        update_freq=1,
        solver_fn=fn,
        layer_solvers={r"fc\d": "sngd"},
    )
    assert [both.solver_of(n) for n in ("fc1", "fc2", "head")] == ["sngd", "sngd", "hybrid"]
    for _ in range(2):
        regression_step(m2, x, direction)
        both.step()
    got = {(d.step, d.layer): (d.solver, d.reason) for d in both.decision_log}
    for step in (0, 1):
        assert got[(step, "fc1")] == got[(step, "fc2")] == ("sngd", "override")
        assert got[(step, "head")] == ("kis", "solver_fn")
    assert [(name, step) for name, step, _ in calls] == [("head", 0), ("head", 1)]
    assert [both.solver_of(n) for n in ("fc1", "fc2", "head")] == ["sngd", "sngd", "kis"]


@pytest.mark.parametrize(
    ("layer_solvers", "expected"),
    [
        ({"fc": "sngd"}, {}),  # full match: "fc" matches neither fc1 nor fc2
        ({"c1": "sngd"}, {}),  # not re.search
        ({"fc1": "sngd"}, {"fc1": "sngd"}),
        ({"fc.": "kis", "fc1": "kfac"}, {"fc1": "kis", "fc2": "kis"}),  # first match wins
        ({"fc1": "kfac", "fc.": "kis"}, {"fc1": "kfac", "fc2": "kis"}),
        ({"head|fc2": "kfac"}, {"fc2": "kfac", "head": "kfac"}),
        ({".*": "sngd"}, {"fc1": "sngd", "fc2": "sngd", "head": "sngd"}),
    ],
)
def test_layer_solvers_regex_full_match(layer_solvers: dict[str, str], expected: dict[str, str]) -> None:
    model = override_model()
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=1, layer_solvers=layer_solvers)
    x, direction = regression_data(0, 8, 16, 3)
    regression_step(model, x, direction)
    pre.step()
    for d in pre.decision_log:
        if d.layer in expected:
            assert (d.solver, d.reason) == (expected[d.layer], "override")
        else:
            assert d.reason != "override"
        assert pre.solver_of(d.layer) == d.solver


def test_layer_solvers_nested_module_names() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 8), nn.Linear(8, 2)).to(DT)
    pre = HyLoPreconditioner(model, solver="sngd", layer_solvers={r"0\.\d+": "kis", "2": "kfac"})
    assert [info.name for info in pre.layer_info()] == ["0.0", "1", "2"]
    assert [pre.solver_of(n) for n in ("0.0", "1", "2")] == ["kis", "sngd", "kfac"]


def test_solver_fn_receives_sensible_layer_stats() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(conv=nn.Conv2d(2, 4, 3, padding=1), act=nn.Tanh(), flat=nn.Flatten(), fc=nn.Linear(100, 5))
    ).to(DT)
    seen: list[LayerStats] = []

    def fn(name: str, step: int, stats: LayerStats) -> str:
        assert isinstance(stats, LayerStats) and stats.name == name and stats.step == step
        seen.append(stats)
        return LAYER_SOLVERS[(step // 3) % 4]

    decay = 0.5
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=3, rank_ratio=0.5, solver_fn=fn, trend_decay=decay)
    assert is_dynamic(pre.config)  # a solver_fn makes decisions data-dependent even with a fixed solver
    gen = torch.Generator().manual_seed(3)
    norms: dict[str, list[float]] = {"conv": [], "fc": []}
    for step in range(7):
        x = torch.randn(6, 2, 5, 5, generator=gen, dtype=DT) * (1 + step)
        model.zero_grad()
        model(x).square().sum().backward()
        for name, values in norms.items():
            values.append(float(torch.linalg.vector_norm(grad_matrix(getattr(model, name)))))
        pre.step()
    assert [(s.name, s.step) for s in seen] == [(n, t) for t in (0, 3, 6) for n in ("conv", "fc")]
    shapes = {"conv": (19, 4, 6, 6 * 25, 3), "fc": (101, 5, 6, 6, 3)}  # (d_a, d_g, rows, kfac_rows, kept)
    for stats in seen:
        d_a, d_g, rows, kfac_rows, kept = shapes[stats.name]
        assert (stats.d_a, stats.d_g, stats.rows, stats.kfac_rows, stats.kept) == shapes[stats.name]
        assert (stats.update_freq, stats.world_size) == (3, 1)
        assert stats.cost_kfac == kfac_cost(d_a, d_g, kfac_rows, 3)
        row_work = kfac_rows * (d_a + d_g) if stats.name == "conv" else 0  # the conv surrogate's pass
        assert stats.cost_lowrank == lowrank_cost("kid", d_a, d_g, rows, kept, 3) + row_work
        assert stats.cost_sngd == lowrank_cost("sngd", d_a, d_g, rows, kept, 3) + row_work
        assert stats.budget == pytest.approx(0.05 * 3 * (3 * 150 * 19 * 4 + 3 * 6 * 101 * 5) / 2, rel=1e-12)
        assert stats.trend is None and stats.critical is True  # default window of 100 steps
        ema = norms[stats.name][0]
        for value in norms[stats.name][1 : stats.step + 1]:
            ema = decay * ema + (1 - decay) * value
        assert isinstance(stats.grad_norm, float)
        assert stats.grad_norm == pytest.approx(ema, rel=1e-12)
    assert seen[0].grad_norm == pytest.approx(norms["conv"][0], rel=1e-12)  # step 0: the norm itself
    assert [pre.solver_of(n) for n in ("conv", "fc")] == [LAYER_SOLVERS[2]] * 2


@pytest.mark.parametrize("bad", ["hybrid", "KFAC", "adam", None, 3])
def test_solver_fn_invalid_return_raises(bad: Any) -> None:
    model = override_model()
    pre = HyLoPreconditioner(model, solver="hybrid", solver_fn=lambda name, step, stats: bad)
    x, direction = regression_data(0, 8, 16, 3)
    regression_step(model, x, direction)
    with pytest.raises(ValueError, match="solver_fn returned .* for layer 'fc1'"):
        pre.step()


def test_layer_override_with_fixed_solver() -> None:
    """solver="kis", layer_solvers={"fc2": "kfac"}: fc2 runs exactly K-FAC, the rest exactly KIS."""
    model = override_model()
    x, direction = regression_data(0, 8, 16, 3)
    results = {}
    for key, options in {
        "mixed": {"solver": "kis", "layer_solvers": {"fc2": "kfac"}},
        "kfac": {"solver": "kfac"},
        "kis": {"solver": "kis"},
    }.items():
        m = copy.deepcopy(model)
        pre = HyLoPreconditioner(m, update_freq=2, rank_ratio=1.0, damping=0.1, **options)
        if key == "mixed":
            assert not is_dynamic(pre.config)
            assert [pre.solver_of(n) for n in ("fc1", "fc2", "head")] == ["kis", "kfac", "kis"]
        grads = []
        for step in range(3):
            regression_step(m, x * (1 + step), direction)
            pre.step()
            grads.append({n: grad_matrix(getattr(m, n)) for n in ("fc1", "fc2", "head")})
        results[key] = (pre, grads)
    pre, grads = results["mixed"]
    assert [pre.solver_of(n) for n in ("fc1", "fc2", "head")] == ["kis", "kfac", "kis"]
    assert {(d.layer, d.solver, d.reason) for d in pre.decision_log} == {
        ("fc1", "kis", "fixed"),
        ("fc2", "kfac", "override"),
        ("head", "kis", "fixed"),
    }
    for step in range(3):
        torch.testing.assert_close(grads[step]["fc2"], results["kfac"][1][step]["fc2"], rtol=1e-10, atol=1e-12)
        for name in ("fc1", "head"):
            torch.testing.assert_close(grads[step][name], results["kis"][1][step][name], rtol=1e-10, atol=1e-12)
    # not vacuous: K-FAC and KIS differ on fc2
    assert not torch.allclose(results["kfac"][1][0]["fc2"], results["kis"][1][0]["fc2"], rtol=1e-3)


# ============================================================================ 3. switching mid-run
SCHEDULES = {
    "fc1": ["kfac", "kfac", "kid", "kis", "sngd", "kfac", "kfac", "kfac", "kis", "kfac"],
    "fc2": ["kid", "kfac", "kfac", "sngd", "kfac", "kis", "kid", "kfac", "kfac", "kid"],
}


def test_switching_solvers_mid_run_matches_fresh_preconditioner() -> None:
    """Right after a switch a layer's preconditioned gradient is that of a fresh preconditioner.

    Low-rank solvers keep no memory between updates (rank_ratio=1: no sampling), so they match
    a fresh preconditioner at every step; K-FAC matches it on its first update after a switch
    (batch factors taken as they are) and blends the running average afterwards.
    """
    decay = 0.7
    model = sequential(0, fc1=nn.Linear(6, 8), act=nn.Tanh(), fc2=nn.Linear(8, 4))
    options = {"update_freq": 1, "damping": 0.05, "factor_decay": decay, "rank_ratio": 1.0, "seed": 7}
    pre = HyLoPreconditioner(
        model, solver="hybrid", solver_fn=lambda name, step, stats: SCHEDULES[name][step], **options
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5)
    checked = {"switch": 0, "kfac-continued": 0}
    running: dict[str, tuple[Tensor, Tensor]] = {}  # expected K-FAC running factors, per layer
    for step in range(len(SCHEDULES["fc1"])):
        x = torch.randn(10, 6, generator=gen, dtype=DT)
        y = torch.randn(10, 4, generator=gen, dtype=DT)
        before = copy.deepcopy(model)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        pre.step()
        fresh_grads: dict[str, dict[str, Tensor]] = {}
        fresh_states: dict[str, Any] = {}
        for solver in {SCHEDULES[n][step] for n in SCHEDULES}:
            m = copy.deepcopy(before)
            fresh = HyLoPreconditioner(m, solver=solver, **options)
            F.mse_loss(m(x), y).backward()
            fresh.step()
            fresh_grads[solver] = {n: grad_matrix(getattr(m, n)) for n in SCHEDULES}
            fresh_states[solver] = {info.name: info.state for info in fresh.layer_info()}
        for name, schedule in SCHEDULES.items():
            solver = schedule[step]
            assert pre.solver_of(name) == solver
            got, want = grad_matrix(getattr(model, name)), fresh_grads[solver][name]
            switched = step == 0 or schedule[step - 1] != solver
            registered = next(info for info in pre.layer_info() if info.name == name)
            state = registered.state
            assert registered.solver == solver and state is not None
            assert state.family == family_of(solver).name and not state.remote  # built by the solver's family
            if switched or solver != "kfac":
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"step {step} {name} {solver}")
                checked["switch"] += switched
            else:
                # K-FAC continued: the running average differs from this batch alone
                assert not torch.allclose(got, want, rtol=1e-6), f"step {step} {name}: no running average?"
                checked["kfac-continued"] += 1
            if solver == "kfac":
                batch = fresh_states["kfac"][name]  # a fresh K-FAC's first factors are the batch factors
                if switched:
                    running[name] = (batch.tensors["factor_a"], batch.tensors["factor_g"])
                else:
                    old_a, old_g = running[name]
                    running[name] = (
                        decay * old_a + (1 - decay) * batch.tensors["factor_a"],
                        decay * old_g + (1 - decay) * batch.tensors["factor_g"],
                    )
                torch.testing.assert_close(state.tensors["factor_a"], running[name][0], rtol=1e-12, atol=1e-15)
                torch.testing.assert_close(state.tensors["factor_g"], running[name][1], rtol=1e-12, atol=1e-15)
        opt.step()
    assert [(d.step, d.layer, d.solver, d.reason) for d in pre.decision_log] == [
        (step, name, SCHEDULES[name][step], "solver_fn") for step in range(10) for name in SCHEDULES
    ]
    assert checked["switch"] >= 12 and checked["kfac-continued"] >= 4, checked


def test_kfac_after_lowrank_takes_batch_factors_not_stale_average() -> None:
    """kfac → kid → kfac: the second K-FAC period ignores the factors of the first."""
    model = sequential(0, fc=nn.Linear(5, 4))
    schedule = ["kfac", "kfac", "kid", "kfac"]
    options = {"update_freq": 1, "damping": 0.1, "factor_decay": 0.9, "rank_ratio": 1.0}
    pre = HyLoPreconditioner(model, solver="hybrid", solver_fn=lambda n, s, st: schedule[s], **options)
    for step in range(4):
        x, y = regression_data(step, 12, 5, 4, seed=1)
        before = copy.deepcopy(model)
        model.zero_grad()
        F.mse_loss(model(x) * (1 + 10 * step), y).backward()
        pre.step()
    fresh = HyLoPreconditioner(before, solver="kfac", **options)
    before.zero_grad()
    F.mse_loss(before(x) * 31, y).backward()
    fresh.step()
    info, fresh_state = pre.layer_info()[0], fresh.layer_info()[0].state
    state = info.state
    assert info.solver == "kfac" and state is not None and state.family == family_of("kfac").name
    assert fresh_state is not None
    torch.testing.assert_close(state.tensors["factor_a"], fresh_state.tensors["factor_a"], rtol=1e-12, atol=0)
    torch.testing.assert_close(state.tensors["factor_g"], fresh_state.tensors["factor_g"], rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_matrix(model.fc), grad_matrix(before.fc), rtol=1e-10, atol=1e-12)


# ============================================================================ 4. two ranks
def _hybrid_ddp(rank: int, world_size: int, steps: int, strategy: str) -> dict[str, Any]:
    """DDP, solver="hybrid", unequal local batches (rank 0: 8 rows, rank 1: 40), loss ×10 mid-run."""
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            inp=nn.Linear(3, 2),
            act1=nn.Tanh(),
            wide=nn.Linear(2, 48),
            act2=nn.Tanh(),
            mid=nn.Linear(48, 8),
            act3=nn.Tanh(),
            head=nn.Linear(8, 3),
        )
    )
    net = nn.parallel.DistributedDataParallel(model)
    pre = HyLoPreconditioner(
        net,
        solver="hybrid",
        update_freq=2,
        trend_window=2,
        trend_decay=0.5,
        critical_noise=0.0,  # a 2-step window: the noise floor would absorb the ×10 jump
        rank_ratio=0.25,
        damping=0.1,
        strategy=strategy,
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    n = 8 if rank == 0 else 40
    x = torch.randn(n, 3, generator=gen)  # one batch per rank: the trend follows the loss scale
    y = torch.randint(0, 3, (n,), generator=gen)
    grads = []
    for step in range(steps):
        scale = 10.0 if 6 <= step < 10 else 1.0
        opt.zero_grad()
        (scale * F.cross_entropy(net(x), y)).backward()
        pre.step()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
    return {
        "world_size": pre.comm.world_size,
        "decisions": [(d.step, d.layer, d.solver) for d in pre.decision_log],
        "records": list(pre.decision_log),
        "grads": grads,
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
    }


@functools.cache
def two_rank_results(strategy: str) -> tuple[dict[str, Any], dict[str, Any]]:
    r0, r1 = run_distributed(_hybrid_ddp, 2, 20, strategy, timeout=90.0)
    return r0, r1


@pytest.mark.parametrize("strategy", ["inverse", "gradient"])
def test_two_ranks_agree_on_hybrid_decisions_and_gradients(strategy: str) -> None:
    r0, r1 = two_rank_results(strategy)
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["decisions"] == r1["decisions"]
    assert len(r0["decisions"]) == 4 * 10  # 4 layers × updates at steps 0, 2, ..., 18
    wide = [solver for _, layer, solver in r0["decisions"] if layer == "wide"]
    # early KID, stable KIS, KID after the ×10 loss scale at step 6 (and its removal at 10), KIS again
    assert wide[0] == "kid" and wide[1:3] == ["kis", "kis"] and wide[3] == "kid" and wide[-1] == "kis", wide
    for d in r0["records"]:  # the cost rule as logged (the budget is far below these tiny layers' costs)
        assert d.reason != "fidelity"
        assert (d.solver == "kfac") == (d.cost_kfac <= d.cost_lowrank), d
    # The ranks' local cost estimates disagree on the head (8 vs 40 local rows): rank 1 alone would
    # pick K-FAC, yet it runs and logs rank 0's decision, record for record.
    head0 = {d.step: d for d in r0["records"] if d.layer == "head"}
    for d0 in head0.values():
        assert d0.cost_lowrank < d0.cost_kfac and d0.solver != "kfac"
    assert r0["records"] == r1["records"]
    for step in range(20):
        for key, g0 in r0["grads"][step].items():
            assert torch.isfinite(g0).all()
            assert torch.equal(g0, r1["grads"][step][key]), f"step {step} {key}: ranks differ"
    for key, p0 in r0["params"].items():
        assert torch.equal(p0, r1["params"][key]), key


def test_two_ranks_log_consistent_decision_records() -> None:
    r0, r1 = two_rank_results("inverse")
    for rank, result in enumerate((r0, r1)):
        for d in result["records"]:
            expected = {"cost": "kfac", "critical": "kid", "stable": "kis"}[d.reason]
            assert d.solver == expected, f"rank {rank}: {d}"
            assert (d.cost_kfac <= d.cost_lowrank) == (d.solver == "kfac"), f"rank {rank}: {d}"


# ============================================================================ 5. decision log
def test_decision_log_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    pre = HyLoPreconditioner(override_model(), solver="hybrid")
    assert pre.decision_log.maxlen == preconditioner_module.DECISION_LOG_SIZE == 100_000
    monkeypatch.setattr(preconditioner_module, "DECISION_LOG_SIZE", 7)
    model = override_model()
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=1)
    x, direction = regression_data(0, 8, 16, 3)
    for _ in range(5):
        regression_step(model, x, direction)
        pre.step()
    assert len(pre.decision_log) == 7  # 15 decisions made, the 7 newest kept
    assert [(d.step, d.layer) for d in pre.decision_log] == [
        (2, "head"),
        (3, "fc1"),
        (3, "fc2"),
        (3, "head"),
        (4, "fc1"),
        (4, "fc2"),
        (4, "head"),
    ]
