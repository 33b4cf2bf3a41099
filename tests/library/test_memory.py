"""Memory (docs/design.md, "Memory"): calls reduced in their gradient hooks, chunked unfolds, what is held.

- A call reduced in its hook (K-FAC factor sums or low-rank rows) gives the same batch factors
  and rows as the (input, output gradient) pair kept raw, and both equal an independent
  reference from unfold and autograd's own ∂L/∂s, for Linear and Conv2d layers of every
  padding, stride and dilation, over several backward passes (gradient accumulation).
- A convolution's factors and exact rows built in blocks of ``max_unfold_mb`` equal the ones
  built in one block, and no block's patches exceed the cap.
- What ``memory_breakdown()`` reports is exactly the storages reachable from the preconditioner.
- When the backward reduced a layer for one family and the update decides the other, the
  update keeps the family of the data (reason ``"planned"``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections import deque

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from hylo import HyLoConfig, HyLoPreconditioner
from hylo.layers import FACTORS, ROWS, ConvMath, LayerBatch, LinearMath
from hylo.layers.rows import DenseRows, FactoredRows
from hylo.layers.walk import register_layers
from hylo.pipeline.planner import Planner
from hylo.policy import SolverPolicy
from hylo.records import Decision
from hylo.solvers import family_of
from hylo.state import registered_layers
from tests.kit.checks import DT, Unfolds, grad_matrix, rel_err
from tests.kit.devices import tolerances
from tests.kit.reference import conv_reference, dense_kfac, linear_rows

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

#: Convolutions of every geometry hylo supports (groups = 1).
CONVS = {
    "plain": {"kernel_size": 3},
    "stride-pad": {"kernel_size": 3, "stride": 2, "padding": 1},
    "dilated": {"kernel_size": 3, "dilation": 2, "padding": 2},
    "rect-no-bias": {"kernel_size": (2, 3), "stride": (1, 2), "padding": (1, 0), "bias": False},
    "same": {"kernel_size": 4, "padding": "same"},
    "valid": {"kernel_size": 2, "padding": "valid"},
    "reflect": {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
    "circular": {"kernel_size": 3, "padding": 2, "padding_mode": "circular", "dilation": 2},
    "replicate": {"kernel_size": 3, "stride": 2, "padding": 1, "padding_mode": "replicate"},
}
#: Sample counts of the backward passes of one step (gradient accumulation).
MICRO_BATCHES = (3, 2, 4)


def _conv_net(options: dict[str, object]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, **options, dtype=DT), nn.Tanh())  # type: ignore[arg-type]


def _reference_calls(net: nn.Sequential, xs: list[Tensor], target: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs, outputs, ∂L/∂s) of the first layer over every backward pass, from autograd alone."""
    outs, grads = [], []
    for x, t in zip(xs, target, strict=True):
        s = net[0](x)
        s.retain_grad()
        (net[1:](s) - t).square().mean().backward()
        outs.append(s.detach())
        grads.append(s.grad)
    return torch.cat(xs), torch.cat(outs), torch.cat(grads)


@pytest.mark.parametrize("case", list(CONVS))
@pytest.mark.parametrize("solver", ["kfac", "sngd", "hybrid"])
def test_conv_calls_reduced_in_the_hook_equal_raw_and_reference(case: str, solver: str) -> None:
    net = _conv_net(CONVS[case])
    twin = _conv_net(CONVS[case])
    pre = HyLoPreconditioner(net, solver=solver, update_freq=1, damping=0.1)
    torch.manual_seed(1)
    xs = [torch.randn(n, 2, 16, 15, dtype=DT) for n in MICRO_BATCHES]
    with torch.no_grad():
        target = [torch.randn_like(net(x)) for x in xs]
    for x, t in zip(xs, target, strict=True):
        (net(x) - t).square().mean().backward()
    layer = pre.layer_info()[0]
    calls = layer.calls
    assert len(calls) == len(MICRO_BATCHES)
    # no input held after the backward: no call awaits it, and each was reduced in its hook (call.raw below)
    assert layer.pending == 0
    d_a, d_g = layer.math.d_a, layer.math.d_g
    expected_bytes = 0
    for call, n in zip(calls, MICRO_BATCHES, strict=True):  # what each call holds: its rows and/or factor sums
        assert call.raw is None
        expected_bytes += (n * (d_a + d_g) if call.reduced.get(ROWS) is not None else 0) * DT.itemsize
        expected_bytes += (d_a**2 + d_g**2 if call.reduced.get(FACTORS) is not None else 0) * DT.itemsize
    assert pre.memory_breakdown().captured[layer.name] == expected_bytes
    reduced = LayerBatch.of(layer.math, calls, pre.config.lowrank.rows_kept)

    x, s, ds = _reference_calls(twin, xs, target)
    ref = conv_reference(twin[0], x, s, ds)
    raw = LayerBatch.of(layer.math, [(x, ds)], pre.config.lowrank.rows_kept)
    assert (reduced.rows, reduced.kfac_rows) == (raw.rows, raw.kfac_rows) == (x.shape[0], x.shape[0] * s[0, 0].numel())
    if solver == "kfac":
        assert all(call.reduced.get(FACTORS) is not None and call.reduced.get(ROWS) is None for call in reduced.calls)
        for got, today, expected in zip(
            reduced.collect(FACTORS), raw.collect(FACTORS), (ref["A"], ref["G"]), strict=True
        ):
            torch.testing.assert_close(got, today, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    else:
        assert all(call.reduced.get(ROWS) is not None for call in reduced.calls)
        got, today = reduced.collect(ROWS), raw.collect(ROWS)
        assert isinstance(got, FactoredRows) and isinstance(today, FactoredRows)
        for field, expected in (("a", ref["a"]), ("g", ref["g_sum"])):
            torch.testing.assert_close(getattr(got, field), getattr(today, field), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(getattr(got, field), expected, rtol=1e-12, atol=1e-14)
    pre.step()
    assert pre.memory_breakdown().captured[layer.name] == 0


@pytest.mark.parametrize("bias", [True, False])
def test_linear_kfac_calls_reduce_to_factors_when_smaller(bias: bool) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2, bias=bias, dtype=DT))
    twin = nn.Sequential(nn.Linear(3, 2, bias=bias, dtype=DT))
    twin.load_state_dict(net.state_dict())
    pre = HyLoPreconditioner(net, solver="kfac", update_freq=1, damping=0.1)
    xs = [torch.randn(n, 4, 3, dtype=DT) for n in MICRO_BATCHES]  # leading dims: n·4 rows per call
    target = [torch.randn(n, 4, 2, dtype=DT) for n in MICRO_BATCHES]
    for x, t in zip(xs, target, strict=True):
        (net(x) - t).square().mean().backward()
    layer = pre.layer_info()[0]
    reduced = LayerBatch.of(layer.math, list(layer.calls), pre.config.lowrank.rows_kept)
    assert all(call.raw is None and call.reduced.get(FACTORS) is not None for call in reduced.calls)

    inputs, grads = [], []
    for x, t in zip(xs, target, strict=True):
        s = twin[0](x)
        s.retain_grad()
        (s - t).square().mean().backward()
        inputs.append(x)
        grads.append(s.grad)
    a, g = linear_rows(twin[0], torch.cat(inputs), torch.cat(grads))
    expected = (a.mT @ a / a.shape[0], g.mT @ g / a.shape[0])
    today = LayerBatch.of(LinearMath(twin[0]), [(torch.cat(inputs), torch.cat(grads))], pre.config.lowrank.rows_kept)
    for got, raw, ref in zip(reduced.collect(FACTORS), today.collect(FACTORS), expected, strict=True):
        torch.testing.assert_close(got, raw, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)


def test_linear_lowrank_calls_stay_raw() -> None:
    """A Linear's rows are its input and output gradient: nothing smaller to reduce them to."""
    net = nn.Sequential(nn.Linear(3, 2, dtype=DT))
    pre = HyLoPreconditioner(net, solver="sngd", update_freq=1)
    x = torch.randn(5, 3, dtype=DT)
    net(x).sum().backward()
    (call,) = pre.layer_info()[0].calls
    assert call.raw is not None and call.raw[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- chunked unfolds
@pytest.mark.parametrize("case", list(CONVS))
def test_chunked_factors_and_rows_equal_one_block(case: str) -> None:
    conv = _conv_net(CONVS[case])[0]
    torch.manual_seed(2)
    x = torch.randn(5, 2, 11, 9, dtype=DT)
    grad_out = torch.randn_like(conv(x))
    scale = 3.0
    whole = {rows: ConvMath(conv, rows, max_unfold_mb=1e6) for rows in ("exact", "sum", "mean")}
    one_row = (grad_out.shape[3] * whole["exact"].d_a * DT.itemsize) / 2**20  # one output row of one sample
    for cap in (one_row, 2.5 * one_row, 2.5 * one_row * grad_out.shape[2]):  # rows of a sample; whole samples
        chunked = {rows: ConvMath(conv, rows, max_unfold_mb=cap) for rows in ("exact", "sum", "mean")}
        with Unfolds() as unfolds:  # the chunked exact math's blocks of patches
            factors = chunked["exact"].kfac_factors(x, grad_out, scale)
            exact = chunked["exact"].lowrank_rows(x, grad_out, scale)
        sizes = unfolds.sizes
        for got, expected in zip(factors, whole["exact"].kfac_factors(x, grad_out, scale), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        assert isinstance(exact, DenseRows)
        torch.testing.assert_close(exact.u, whole["exact"].lowrank_rows(x, grad_out, scale).u, rtol=1e-12, atol=1e-12)
        for rows in ("sum", "mean"):
            got_rows, expected_rows = (m.lowrank_rows(x, grad_out, scale) for m in (chunked[rows], whole[rows]))
            assert isinstance(got_rows, FactoredRows) and isinstance(expected_rows, FactoredRows)
            torch.testing.assert_close(got_rows.a, expected_rows.a, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(got_rows.g, expected_rows.g, rtol=0, atol=0)
        assert len(sizes) > 2 and max(sizes) <= cap * 2**20 * (1 + 1e-12), (cap, sizes)


def test_whole_rows_reference_for_chunks() -> None:
    """The one-block factors themselves are the unfold reference (bias column included)."""
    conv = _conv_net(CONVS["stride-pad"])[0]
    x = torch.randn(4, 2, 7, 7, dtype=DT)
    s = conv(x)
    ds = torch.randn_like(s)
    ref = conv_reference(conv, x, s, ds)
    factor_a, factor_g = ConvMath(conv, max_unfold_mb=1e-4).kfac_factors(x, ds, 4.0)
    torch.testing.assert_close(factor_a / ref["positions"] / 4, ref["A"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(factor_g / 4, ref["G"], rtol=1e-12, atol=1e-14)


def test_max_unfold_mb_is_checked() -> None:
    net = _conv_net(CONVS["plain"])
    for bad in (0, -1.0, float("inf"), True, "8"):
        with pytest.raises(ValueError, match="max_unfold_mb"):
            HyLoPreconditioner(net, max_unfold_mb=bad)


# --------------------------------------------------------------------------- what is held
def _reachable_storages(root: object) -> dict[tuple[str, int], int]:
    """Every tensor storage reachable from ``root`` through hylo's own objects (the model's modules excluded)."""
    found: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            found[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack += list(obj)
        elif isinstance(obj, functools.partial):
            stack += [*obj.args, *obj.keywords.values()]
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        elif isinstance(obj, (nn.Module, type, weakref.ref, types.FunctionType, torch.Generator)):
            continue
        elif type(obj).__module__.startswith("hylo") and hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
        elif dataclasses.is_dataclass(obj):
            stack += [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return found


def _conv_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.Flatten(), nn.Linear(36, 5)
    )


@pytest.mark.parametrize("solver", ["hybrid", "kfac", "sngd", "kis"])
def test_memory_breakdown_is_what_the_preconditioner_holds(solver: str) -> None:
    model = _conv_mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=2, damping=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 5, (6,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        during = pre.memory_breakdown()
        reachable = _reachable_storages(pre)
        assert (len(reachable), sum(reachable.values())) == (during.tensors, during.total), step
        assert (sum(during.captured.values()) > 0) == (step % 2 == 0)  # captured only at update steps
        pre.step()
        optimizer.step()
        after = pre.memory_breakdown()
        reachable = _reachable_storages(pre)
        assert (len(reachable), sum(reachable.values())) == (after.tensors, after.total), step
        assert sum(after.captured.values()) == 0
        # every state tensor owns its storage (docs/reliability.md, "One layout"): the bytes of the
        # distinct storages are the bytes of the state tensors
        assert sum(after.state.values()) == sum(pre.memory_usage().values()) > 0


# --------------------------------------------------------------------------- the family of the data
def _small_conv_head() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 2, 1, dtype=DT), nn.Flatten(), nn.Linear(2 * 4, 3, dtype=DT))


def test_update_keeps_the_family_the_backward_reduced_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hybrid picks K-FAC for a cheap 1×1 conv; a forecast that said low-rank leaves it on KID (critical at first)."""
    x, y = torch.randn(64, 2, 2, 2, dtype=DT), torch.randint(0, 3, (64,))
    options = {"update_freq": 1, "damping": 0.1, "fidelity_budget": 0.0}
    natural = _small_conv_head()
    pre = HyLoPreconditioner(natural, solver="hybrid", **options)
    F.cross_entropy(natural(x), y).backward()
    pre.step()
    assert pre.decision_log[0].layer == "0" and (pre.decision_log[0].solver, pre.decision_log[0].reason) == (
        "kfac",
        "cost",
    )

    model = _small_conv_head()
    pre = HyLoPreconditioner(model, solver="hybrid", **options)
    # the backward reduces for the forecast's family (only this hybrid preconditioner forecasts)
    monkeypatch.setattr(Planner, "forecast", lambda planner, config: [family_of("kid")] * len(planner.layers))
    F.cross_entropy(model(x), y).backward()
    pre.step()
    conv_decision = next(d for d in pre.decision_log if d.layer == "0")
    assert (conv_decision.solver, conv_decision.reason) == ("kid", "planned")

    fixed = _small_conv_head()
    reference = HyLoPreconditioner(fixed, solver="kid", **options)
    F.cross_entropy(fixed(x), y).backward()
    reference.step()
    torch.testing.assert_close(grad_matrix(model[0]), grad_matrix(fixed[0]), rtol=1e-12, atol=1e-14)
    assert not torch.allclose(grad_matrix(model[0]), grad_matrix(natural[0]))


def test_forecast_for_kfac_keeps_rows_for_a_lowrank_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the hybrid policy rows are always reduced: a forecast of K-FAC never blocks a low-rank decision."""
    model = _small_conv_head()
    x, y = torch.randn(64, 2, 2, 2, dtype=DT), torch.randint(0, 3, (64,))
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=1, damping=0.1, fidelity_budget=1e9)
    monkeypatch.setattr(Planner, "forecast", lambda planner, config: [family_of("kfac")] * len(planner.layers))
    F.cross_entropy(model(x), y).backward()
    (call,) = pre.layer_info()[0].calls
    assert call.reduced.get(FACTORS) is not None and call.reduced.get(ROWS) is not None
    pre.step()
    assert [(d.solver, d.reason) for d in pre.decision_log] == [("sngd", "fidelity")] * 2


def test_hybrid_forecast_matches_its_decisions_in_training() -> None:
    """On a conv net over several updates the forecast agrees with the decisions: no "planned" fallback."""
    model = _conv_mlp()
    pre = HyLoPreconditioner(model, solver="hybrid", update_freq=2, damping=0.1, trend_window=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(12):
        x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 5, (16,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    assert len(pre.decision_log) == 6 * 3 and all(d.reason != "planned" for d in pre.decision_log)


def test_kfac_reference_of_reduced_calls() -> None:
    """The end-to-end K-FAC step from hook-reduced calls equals the dense (A ⊗ G + λI)⁻¹ solve."""
    net = _conv_net(CONVS["stride-pad"])
    twin = _conv_net(CONVS["stride-pad"])
    pre = HyLoPreconditioner(net, solver="kfac", update_freq=1, damping=0.1)
    xs = [torch.randn(n, 2, 16, 15, dtype=DT) for n in MICRO_BATCHES]
    with torch.no_grad():
        target = [torch.randn_like(net(x)) for x in xs]
    for x, t in zip(xs, target, strict=True):
        (net(x) - t).square().mean().backward()
    grad = grad_matrix(net[0])
    pre.step()
    x, s, ds = _reference_calls(twin, xs, target)
    ref = conv_reference(twin[0], x, s, ds)
    torch.testing.assert_close(grad_matrix(net[0]), dense_kfac(ref["A"], ref["G"], grad, 0.1), rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- no concatenated gradient
class _Concatenations(TorchFunctionMode):
    """Records the sizes of every torch.cat's output while active."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in (torch.cat, torch.concat, torch.concatenate):
            self.sizes.append(out.numel())
        return out


@pytest.mark.parametrize("solver", ["kfac", "sngd", "kis"])
def test_steps_read_the_bias_without_concatenating_the_gradient(solver: str) -> None:
    """∇W = [weight | bias] is read part by part: no step between updates concatenates a gradient (the only
    concatenation is of the check's two sums per layer)."""
    model = _conv_mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=3, damping=0.1)
    for step in range(3):
        model.zero_grad()
        F.cross_entropy(model(torch.randn(6, 1, 8, 8)), torch.randint(0, 5, (6,))).backward()
        expected = [state.precondition(grad_matrix(info.module)) for info in pre.layer_info() if (state := info.state)]
        with _Concatenations() as mode:
            pre.step()
        if step:
            infos = pre.layer_info()
            assert all(size <= 2 * len(infos) for size in mode.sizes), mode.sizes
            for info, v in zip(infos, expected, strict=True):
                err = rel_err(grad_matrix(info.module), v)
                assert err <= tolerances().float32, (info.name, err)


def test_reconcile_moves_a_decision_to_the_family_every_ranks_calls_serve() -> None:
    """Planner.reconcile, on its own: a decision whose family's statistic some rank's calls lack moves to the
    family they do give (K-FAC → the regime's low-rank variant, low-rank → K-FAC), reason "planned";
    a decision they serve, or one no family can serve, stays as it is."""
    model = nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 2)
    )
    config = HyLoConfig(solver="hybrid", stable_variant="kis", critical_variant="kid")
    found = register_layers(model.to(DT), config)
    layers = registered_layers(found, config)
    names = [layer.name for layer in layers]
    planner = Planner(layers, SolverPolicy(names), 1, config)
    costs = dict.fromkeys(("kfac", "sngd", "kid", "kis"), 1.0)
    decisions = [
        Decision(5, names[0], "kfac", "cost", True, None, costs, "kid"),  # no factors anywhere: critical → kid
        Decision(5, names[1], "kfac", "cost", False, 0.0, costs, "kis"),  # no factors: stable → kis
        Decision(5, names[2], "kis", "stable", False, 0.0, costs, "kis"),  # no rows: → kfac
        Decision(5, names[3], "sngd", "fidelity", True, None, costs, "kid"),  # neither: nothing to move to
    ]
    gives = {FACTORS: [False, False, True, False], ROWS: [True, True, False, False]}
    reconciled = planner.reconcile(decisions, gives, config)
    assert [(d.solver, d.reason) for d in reconciled] == [
        ("kid", "planned"),
        ("kis", "planned"),
        ("kfac", "planned"),
        ("sngd", "fidelity"),
    ]
    served = {FACTORS: [True] * 4, ROWS: [True] * 4}
    assert planner.reconcile(decisions, served, config) == decisions
    found.remove()
