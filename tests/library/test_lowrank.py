"""The low-rank solvers end to end (hylo/solvers/smw.py and hylo/solvers/lowrank.py; docs/solvers.md, "SNGD", "KID", "KIS").

Covers SNGD against the dense (F + λI)⁻¹ vec ∇W of tests/kit/reference.py (float64, relative 1e-8;
the ``solver`` parameter of those comparisons is SNGD's half of a kfac/sngd parametrization whose
K-FAC half is in test_kfac.py), the invariants of the spec (ρ = 1 and rank ≥ n reduce to SNGD, KID
is exact on data whose per-sample gradients span ≤ r dimensions), the KIS and KID formulas against
a dense oracle, the error-vs-ρ trend, KIS draws and seeds, and the memory of the low-rank states.
The row reductions themselves (kis_select, kid_skeleton, pivoted Cholesky) are in test_reduce.py.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoConfig, HyLoPreconditioner
from hylo.layers.rows import FactoredRows
from hylo.solvers.reduce import kid_skeleton
from tests.kit.cases import LINEAR_SHAPES, conv_case, linear_case, scheduled_damping_steps
from tests.kit.checks import DT, assert_rel_close, grad_matrix, rel_err
from tests.kit.models import classifier_convnet, classifier_inputs, classifier_mlp
from tests.kit.reference import CONV_CASES, dense_natural_gradient, dense_sngd, per_sample_matrices, u_rows

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

MODELS: dict[str, Callable[..., nn.Module]] = {"linear": classifier_mlp, "conv": classifier_convnet}


# ---------------------------------------------------------------------------------------- helpers
def _repeated(kind: str, distinct: int, reps: int, seed: int) -> tuple[Tensor, Tensor]:
    """``distinct`` samples (inputs and targets), each repeated ``reps`` times, interleaved."""
    x, y = classifier_inputs(kind, distinct, seed)
    return x.repeat(reps, *([1] * (x.dim() - 1))), y.repeat(reps)


def _preconditioned(model: nn.Module, x: Tensor, y: Tensor, **options) -> list[Tensor]:
    """Gradients of every parameter after one (update) step of the preconditioner."""
    pre = HyLoPreconditioner(model, update_freq=1, **options)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return [p.grad.detach().clone() for p in model.parameters()]


def _max_rel_err(got: list[Tensor], ref: list[Tensor]) -> float:
    """Largest per-tensor relative error."""
    return max(rel_err(g, r) for g, r in zip(got, ref, strict=True))


def _flat_rel_err(got: list[Tensor], ref: list[Tensor]) -> float:
    """Relative error of all tensors flattened into one vector."""
    return rel_err(torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in ref]))


# --------------------------------------------------------------------------- SNGD vs dense: Linear
@pytest.mark.parametrize("solver", ["sngd"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_linear_matches_dense(solver: str, bias: bool, shape: str, loss: str) -> None:
    damping = 0.05
    case = linear_case(solver, bias, LINEAR_SHAPES[shape], loss, damping)
    a, g = case.a, case.g
    assert a is not None and g is not None
    expected = dense_sngd(a, g, case.grad, damping)
    assert rel_err(expected, case.grad / damping) > 1e-2  # the curvature matters at this damping
    assert_rel_close(case.got, expected)


# ------------------------------------------------------ Conv2d vs the true per-sample Fisher
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv2d_exact_rows_match_true_natural_gradient(bias: bool, case: str) -> None:
    """``conv_rows="exact"``: sngd is (F_true + λI)⁻¹ vec ∇W, F_true from per-sample autograd."""
    damping = 1e-3
    result = conv_case("sngd", bias, case, damping, conv_rows="exact")
    assert result.per_sample is not None
    expected = dense_natural_gradient(result.per_sample, result.grad, damping)
    assert rel_err(expected, result.grad / damping) > 1e-2
    assert_rel_close(result.got, expected, 1e-10)


@pytest.mark.parametrize("conv_rows", ["sum", "mean"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv2d_surrogate_rows_match_their_formula(conv_rows: str, bias: bool, case: str) -> None:
    """The surrogates: a_i = mean patch, g_i = Σ_p (``"sum"``) or mean_p (``"mean"``) of B·∂L/∂s_ip.

    With a bias, the ``"sum"`` row g_i is exactly the bias column of the true per-sample gradient.
    """
    damping = 1e-5
    result = conv_case("sngd", bias, case, damping, conv_rows=conv_rows)
    ref, per_sample = result.conv, result.per_sample
    assert ref is not None and per_sample is not None
    g = ref["g_sum"] if conv_rows == "sum" else ref["g"]
    if bias and conv_rows == "sum":
        assert_rel_close(g, per_sample[:, :, -1], 1e-12)
    expected = dense_sngd(ref["a"], g, result.grad, damping)
    assert rel_err(expected, result.grad / damping) > 1e-2
    assert_rel_close(result.got, expected)


def _two_conv_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    ).to(DT)


def _images(kind: str, n: int, gen: torch.Generator) -> Tensor:
    """8×8 RGB inputs: pixel intensities in [0, 1], smooth (upsampled) noise, or white noise."""
    if kind == "intensities":
        return torch.rand(n, 3, 8, 8, generator=gen, dtype=DT)
    if kind == "smooth":
        coarse = torch.randn(n, 3, 3, 3, generator=gen, dtype=DT)
        return F.interpolate(coarse, size=(8, 8), mode="bilinear", align_corners=True)
    return torch.randn(n, 3, 8, 8, generator=gen, dtype=DT)


@pytest.mark.parametrize("inputs", ["intensities", "smooth", "white"])
def test_conv_row_modes_against_true_natural_gradient(inputs: str) -> None:
    """Two-conv net, 8×8 inputs, B = 24, λ = 0.3: each row mode's error vs the true natural gradient.

    ``exact`` is exact; HyLo's ``mean`` rows are ∇W/λ to within 1% (no curvature); the ``sum``
    default removes a large part of the gap to the true step on the second convolution (white
    noise, the hardest case for a rank-one surrogate: ≈ 45%) and is within 0.1 on image-like
    intensities. Errors per mode and layer are printed on failure.
    """
    damping, n = 0.3, 24
    gen = torch.Generator().manual_seed(5)
    x, y = _images(inputs, n, gen), torch.randint(0, 10, (n,), generator=gen)

    def loss_fn(out: Tensor) -> Tensor:
        return F.cross_entropy(out, y)

    net = _two_conv_net(0)
    convs = {"0": net[0], "2": net[2]}
    per_sample = per_sample_matrices(net, convs, x, loss_fn)
    errors: dict[str, list[float]] = {}
    for conv_rows in ("exact", "sum", "mean"):
        model = _two_conv_net(0)
        pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=damping, conv_rows=conv_rows)
        loss_fn(model(x)).backward()
        grads = {name: grad_matrix(model[int(name)]) for name in convs}
        pre.step()
        references = {name: dense_natural_gradient(per_sample[name], grads[name], damping) for name in convs}
        errors[conv_rows] = [rel_err(grad_matrix(model[int(name)]), references[name]) for name in convs]
        errors["sgd"] = [rel_err(grads[name] / damping, references[name]) for name in convs]
    assert max(errors["exact"]) < 1e-10, errors
    assert all(abs(m - s) < 0.01 * s for m, s in zip(errors["mean"], errors["sgd"], strict=True)), errors
    assert errors["sum"][1] < 0.6 * errors["sgd"][1], errors
    assert errors["sum"][0] <= errors["sgd"][0], errors
    if inputs == "intensities":
        assert max(errors["sum"]) <= 0.1, errors


# --------------------------------------------------------------------------- SNGD: callable damping
@pytest.mark.parametrize("solver", ["sngd"])
def test_callable_damping_is_evaluated_per_update(solver: str) -> None:
    for case, lam in scheduled_damping_steps(solver):
        a, g = case.a, case.g
        assert a is not None and g is not None
        expected = dense_sngd(a, g, case.grad, lam)
        assert_rel_close(case.got, expected)


# ------------------------------------------------------------------- 1. ρ = 1 / rank ≥ n ⇒ SNGD
@pytest.mark.parametrize(
    "option", [{"rank_ratio": 1.0}, {"rank": 16}, {"rank": 50}], ids=["rho1", "rank_n", "rank_gt_n"]
)
@pytest.mark.parametrize("solver", ["kid", "kis", "kis-hylo"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", ["linear", "conv", "conv-exact"])
def test_full_rank_equals_sngd(kind: str, bias: bool, solver: str, option: dict) -> None:
    """Also with dense rows (``conv_rows="exact"``) and HyLo's KIS estimator."""
    rows = {"conv_rows": "exact"} if kind == "conv-exact" else {}
    kind = kind.removesuffix("-exact")
    x, y = classifier_inputs(kind, 16, seed=1)
    ref = _preconditioned(MODELS[kind](bias), x, y, solver="sngd", damping=0.1, **rows)
    raw_model = MODELS[kind](bias)
    F.cross_entropy(raw_model(x), y).backward()
    raw = [p.grad for p in raw_model.parameters()]
    assert _max_rel_err([r * 0.1 for r in ref], raw) > 1e-2  # the preconditioner does something
    estimator = {"kis_estimator": "hylo"} if solver == "kis-hylo" else {}
    got = _preconditioned(
        MODELS[kind](bias), x, y, solver=solver.removesuffix("-hylo"), damping=0.1, **option, **rows, **estimator
    )
    assert _max_rel_err(got, ref) < 1e-6


# ------------------------------------------------ 2. per-sample gradients span ≤ r dims ⇒ KID exact
@pytest.mark.parametrize(
    "option",
    [{"rank": 4}, {"rank": 7}, {"rank_ratio": 4 / 32}],
    ids=["rank_r", "rank_gt_r_dead_pivots", "ratio_r"],
)
@pytest.mark.parametrize("kind", ["linear", "conv", "conv-exact"])
def test_kid_exact_on_low_rank_batch(kind: str, option: dict) -> None:
    distinct = 4
    rows = {"conv_rows": "exact"} if kind == "conv-exact" else {}
    kind = kind.removesuffix("-exact")
    x, y = _repeated(kind, distinct, reps=8, seed=2)  # n = 32 rows, ≤ 4 distinct per-sample gradients
    ref = _preconditioned(MODELS[kind](), x, y, solver="sngd", damping=0.1, **rows)
    got = _preconditioned(MODELS[kind](), x, y, solver="kid", damping=0.1, **option, **rows)
    assert _max_rel_err(got, ref) < 1e-6
    # and the test is discriminating: one skeleton row too few is far from exact
    fewer = _preconditioned(MODELS[kind](), x, y, solver="kid", damping=0.1, rank=distinct - 1, **rows)
    assert _max_rel_err(fewer, ref) > 1e-3


# ------------------------------------------- dense oracle of the KIS and KID formulas (§3) at ρ < 1
@pytest.mark.parametrize("solver", ["kis", "kis-hylo", "kid"])
def test_lowrank_matches_dense_formula(solver: str) -> None:
    """One Linear layer, rows built by hand: v̂ = (F̃ + λI)⁻¹ vec ∇W with the d×d F̃ formed explicitly.

    KIS: F̃ = (1/B) Σ_{k∈S} c_k u_k u_kᵀ over the sampled rows S with Horvitz–Thompson factors
    c_k = max(1, τ/‖u_k‖²) for one threshold τ. HyLo's KIS: F̃ = (1/m) Σ_{k∈S} u_k u_kᵀ
    (divisor m, not B). KID: F̃ = (1/B) U_Jᵀ W_p U_J with (J, W_p) = kid_skeleton of the rows.
    """
    n, r, damping = 24, 6, 0.05
    torch.manual_seed(0)
    layer = nn.Linear(6, 4).to(DT)
    x, y = classifier_inputs("linear", n, seed=4)
    x = x[:, :6] * torch.linspace(0.2, 3.0, n, dtype=DT)[:, None]  # varied row norms
    estimator = "hylo" if solver == "kis-hylo" else "unbiased"
    pre = HyLoPreconditioner(
        layer,
        solver=solver.removesuffix("-hylo"),
        update_freq=1,
        rank=r,
        damping=damping,
        seed=1,
        kis_estimator=estimator,
    )
    out = layer(x)
    out.retain_grad()
    F.cross_entropy(out, y[:n] % 4).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    a = torch.cat([x, torch.ones(n, 1, dtype=DT)], dim=1)
    g = out.grad * n
    pre.step()
    held = pre.layer_info()[0].state
    assert held is not None
    rows = held.tensors  # the kept rows' a and g, and the inner matrix
    if solver.startswith("kis"):
        # the kept rows are r distinct rows of the batch
        match = (rows["a"][:, None, :] == a[None]).all(-1)
        assert match.shape == (r, n) and bool(match.any(1).all()) and len(set(match.int().argmax(1).tolist())) == r
        kept = match.int().argmax(1)
        u = u_rows(a[kept], g[kept])
        if solver == "kis":
            factors = (rows["g"].square().sum(1) / g[kept].square().sum(1)).reshape(-1, 1)
            weights = u.square().sum(1, keepdim=True)
            assert bool((factors >= 1 - 1e-12).all())
            raised = factors[:, 0] > 1 + 1e-12
            if bool(raised.any()):  # every raised row sits at the same threshold τ = c_k‖u_k‖²
                tau = factors[raised] * weights[raised]
                assert torch.allclose(tau, tau[0].expand_as(tau), rtol=1e-10)
                assert bool((weights[~raised] >= tau[0] * (1 - 1e-10)).all())
            fisher = u.mT @ (factors * u) / n
        else:
            assert torch.equal(rows["g"], g[kept])
            fisher = u.mT @ u / r
    else:
        skeleton, weights = kid_skeleton(FactoredRows(a, g), r)
        assert torch.equal(rows["a"], a[skeleton]) and torch.allclose(rows["g"], g[skeleton], rtol=1e-14, atol=0)
        u_j = u_rows(a[skeleton], g[skeleton])
        fisher = u_j.mT @ weights @ u_j / n
    eye = torch.eye(fisher.shape[0], dtype=DT)
    expected = torch.linalg.solve(fisher + damping * eye, grad.reshape(-1)).reshape(grad.shape)
    got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    assert float((got - expected).norm() / expected.norm()) < 1e-8
    assert float((got - grad / damping).norm() / expected.norm()) > 1e-2  # the curvature term matters


# --------------------------------------------------------------- 4. error vs ρ, KID beats KIS
RHOS = (0.1, 0.25, 0.5, 0.75)


def test_error_decreases_with_rank_ratio_and_kid_beats_kis() -> None:
    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)).to(DT)

    errors: dict[tuple[str, float], list[float]] = {}
    for seed in range(5):
        gen = torch.Generator().manual_seed(100 + seed)
        x, y = torch.randn(64, 20, generator=gen, dtype=DT), torch.randint(0, 10, (64,), generator=gen)
        ref = _preconditioned(model(seed), x, y, solver="sngd", damping=1.0)
        for rho in RHOS:
            for solver in ("kid", "kis"):
                got = _preconditioned(model(seed), x, y, solver=solver, damping=1.0, rank_ratio=rho, seed=seed)
                errors.setdefault((solver, rho), []).append(_flat_rel_err(got, ref))
    med = {key: statistics.median(v) for key, v in errors.items()}
    table = {f"{s}@{r}": round(m, 4) for (s, r), m in sorted(med.items())}
    for solver in ("kid", "kis"):
        curve = [med[(solver, rho)] for rho in RHOS]
        assert all(x > y for x, y in itertools.pairwise(curve)), table
        assert 0 < curve[-1] < curve[0] < 0.5, table
    for rho in RHOS:
        assert med[("kid", rho)] < med[("kis", rho)], table


# --------------------------------------------------------------------------- 5. zero rows
def test_lowrank_solvers_survive_zero_rows_in_the_model() -> None:
    """All-zero activations (no bias) give all-zero kernels: no error, finite (zero) gradients."""
    for solver in ("kis", "kid"):
        model = classifier_mlp(bias=False)
        x = torch.zeros(16, 12, dtype=DT)
        y = torch.randint(0, 5, (16,))
        grads = _preconditioned(model, x, y, solver=solver, rank_ratio=0.25)
        assert all(torch.isfinite(t).all() for t in grads)


# ------------------------------------------------------------------ 6. KIS reproducibility
def _kept_rows(pre: HyLoPreconditioner) -> list[Tensor]:
    """Copies of the rows' input halves a each layer's low-rank state keeps."""
    states = [info.state for info in pre.layer_info()]
    assert all(state is not None for state in states)
    return [state.tensors["a"].clone() for state in states if state is not None]


def _kis_rows(seed: int, x: Tensor, y: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    model = classifier_mlp()
    pre = HyLoPreconditioner(model, solver="kis", update_freq=1, rank_ratio=0.25, seed=seed)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return _kept_rows(pre), [p.grad.clone() for p in model.parameters()]


def test_kis_same_seed_same_rows_different_seed_different() -> None:
    x, y = classifier_inputs("linear", 32, seed=3)
    rows1, grads1 = _kis_rows(7, x, y)
    rows2, grads2 = _kis_rows(7, x, y)
    rows3, grads3 = _kis_rows(8, x, y)
    assert all(torch.equal(s, t) for s, t in zip(rows1, rows2, strict=True))
    assert all(torch.equal(s, t) for s, t in zip(grads1, grads2, strict=True))
    assert any(not torch.equal(s, t) for s, t in zip(rows1, rows3, strict=True))
    assert any(not torch.equal(s, t) for s, t in zip(grads1, grads3, strict=True))


def test_kis_draws_fresh_rows_at_each_update() -> None:
    x, y = classifier_inputs("linear", 32, seed=3)
    model = classifier_mlp()
    pre = HyLoPreconditioner(model, solver="kis", update_freq=1, rank_ratio=0.25, seed=7)
    picked = []
    for _ in range(2):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        picked.append(_kept_rows(pre))
    assert any(not torch.equal(s, t) for s, t in zip(*picked, strict=True))


# --------------------------------------------------------------------------- 8. memory usage
@pytest.mark.parametrize("dtype", [torch.float32, DT], ids=["f32", "f64"])
@pytest.mark.parametrize("option", [{"rank_ratio": 0.25}, {"rank": 7}])
@pytest.mark.parametrize("solver", ["kid", "kis"])
def test_memory_usage_is_m_rows_plus_m_squared(solver: str, option: dict, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lin, conv = nn.Linear(40, 30).to(dtype), nn.Conv2d(3, 8, 3, bias=False).to(dtype)
    model = nn.ModuleDict({"lin": lin, "conv": conv})
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1, **option)
    n = 20
    x, img = torch.randn(n, 40, dtype=dtype), torch.randn(n, 3, 5, 5, dtype=dtype)
    (lin(x).square().mean() + conv(img).square().mean()).backward()
    pre.step()
    m = HyLoConfig(**option).lowrank.rows_kept(n)
    dims = {"lin": (40 + 1, 30), "conv": (3 * 3 * 3, 8)}
    usage = pre.memory_usage()
    elem = torch.finfo(dtype).bits // 8
    for info in pre.layer_info():
        d_a, d_g = dims[info.name]
        assert usage[info.name] == m * (d_a + d_g) * elem + m * m * 8  # M in float64 (docs/solvers.md, "Numerics")
        assert info.state is not None and info.state.fields["rows"] == m
        shapes = {name: tuple(t.shape) for name, t in info.state.tensors.items()}
        assert shapes == {"a": (m, d_a), "g": (m, d_g), "inner": (m, m)}


@pytest.mark.parametrize(
    "geometry",
    [
        {"kernel_size": 3, "padding": 1},
        {"kernel_size": (3, 2), "stride": (2, 3), "padding": (2, 0), "dilation": (1, 2)},
        {"kernel_size": 4, "padding": "same", "dilation": 2},
        {"kernel_size": 5, "stride": 3, "padding": 4},
        {"kernel_size": 2, "stride": 2},
    ],
)
def test_conv_patch_sums_from_the_unpadded_input_equal_the_padded_blocks(geometry: dict[str, object]) -> None:
    """The surrogate rows' patch sums read from the unpadded input (windows clipped to it) equal the sums over the
    padded, blocked input (the path of other padding modes), including windows that fall wholly in the padding:
    the rows' a (the patch means, then the bias's 1) of both paths, times the output positions."""
    from hylo.layers.conv import ConvMath

    class Blocked(ConvMath):
        """The patch sums of the padded input's blocks, as for other padding modes."""

        sums_from_input = False

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, dtype=DT, **geometry)  # type: ignore[arg-type]
    x = torch.randn(5, 3, 9, 8, dtype=DT)
    out = conv(x)
    grad_out = torch.randn_like(out)
    positions = out.shape[2] * out.shape[3]
    sums = []
    for math in (ConvMath(conv, "sum"), Blocked(conv, "sum")):
        rows = math.lowrank_rows(x, grad_out, 1.0)
        assert isinstance(rows, FactoredRows) and torch.equal(rows.a[:, -1], torch.ones(5, dtype=DT))
        sums.append(rows.a[:, :-1] * positions)
    direct, blocked = sums
    if isinstance(conv.padding, str):  # "same" (stride 1): torch pads the odd element after
        totals = [d * (k - 1) for k, d in zip(conv.kernel_size, conv.dilation, strict=True)]
        pads = [(t // 2, t - t // 2) for t in totals]
    else:
        pads = [(p, p) for p in conv.padding]
    padded = F.pad(x, [*pads[1], *pads[0]])
    unfolded = F.unfold(padded, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    assert unfolded.shape[2] == positions
    torch.testing.assert_close(direct, blocked, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direct, unfolded.sum(dim=2), rtol=1e-12, atol=1e-12)
