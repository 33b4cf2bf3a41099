"""kfac_adam's adaptive refresh, ``refresh_tolerance`` and ``max_refresh_interval`` (docs/solvers.md, "Adaptive
refresh").

Specified against independent references:

- the measure is the relative off-diagonal mass ‖offdiag(Qᵀ F Q)‖_F / ‖F‖_F of the dense product, written with
  NumPy: 0 for F's own eigenbasis (``numpy.linalg.eigh``), the dense mass for a rotated one, batched or not;
- tolerance 0 takes today's path bit for bit (every update refreshes); an infinite tolerance refreshes only every
  ``max_refresh_interval`` updates, and in between holds the basis exactly, takes the Rayleigh quotients of the new
  running factor as eigenvalues and advances the moments without re-projecting them;
- every decision is logged (``decision_log``, ``decisions.csv``) and is the rule applied to the NumPy measure of
  the held basis in the new running factor; one host read per update decides them all;
- a run resumed from a checkpoint takes the same decisions and the same bits; a corrupt saved count is refused;
- two ranks take the decisions of one process on the whole batch;
- bad option values are refused at construction;
- with ``factor_block`` (blocked sides, docs/solvers.md, "Blocked factors"): tolerance 0 is the blocked path bit for
  bit, an infinite tolerance holds the exact packed basis with the blocks' Rayleigh quotients, a blocked side's
  staleness is the dense off-diagonal mass of its block-diagonal factor in its block-diagonal basis (both unpacked
  here by hand), the solve's cost counts the refreshed sides' blocks, and a resumed run takes the same bits.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.layers.blocks import block_layout
from hylo.numerics import POWER_COST
from hylo.solvers.bundled.adam_rule import KFACAdamConfig
from hylo.solvers.bundled.kfac_adam import KFACAdamFamily, KFACAdamInputs
from hylo.solvers.bundled.staleness import measured_many, refreshed
from hylo.solvers.kfac import EIGH_COST
from tests.kit.checks import DT, assert_rel_close, counting_host_syncs, rel_err
from tests.kit.harness import run_distributed
from tests.kit.reference import numpy_power_refresh
from tests.library.test_distributed import local_slice, make_data, make_model

pytestmark = [pytest.mark.usefixtures("single_thread")]

SIDES = ("a", "g")


def _spd(d: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * d, d, generator=gen, dtype=DT) * torch.linspace(0.2, 2.0, d, dtype=DT)
    return x.mT @ x / (3 * d)


def _dense_mass(factor: np.ndarray, basis: np.ndarray) -> float:
    """‖offdiag(Qᵀ F Q)‖_F / ‖F‖_F, densely."""
    inner = basis.T @ ((factor + factor.T) / 2) @ basis
    off = inner - np.diag(np.diag(inner))
    return float(np.linalg.norm(off) / np.linalg.norm(factor))


# --------------------------------------------------------------------------- the measure and the rule
def test_the_measure_is_the_dense_off_diagonal_mass_batched_or_not() -> None:
    factors = [_spd(7, s) for s in range(3)] + [_spd(4, 9)]
    exact = [torch.from_numpy(np.linalg.eigh(f.numpy())[1].copy()) for f in factors]
    for measure in measured_many(factors, exact):
        assert float(measure.staleness) < 1e-13  # an eigenbasis diagonalises its factor
    gen = torch.Generator().manual_seed(3)
    rotated = [
        q @ torch.linalg.matrix_exp(0.2 * (s - s.mT))
        for q in exact
        for s in [torch.randn(*q.shape, generator=gen, dtype=DT)]
    ]
    batched = measured_many(factors, rotated)
    for factor, basis, measure in zip(factors, rotated, batched, strict=True):
        want = _dense_mass(factor.numpy(), basis.numpy())
        assert want > 0.05  # not vacuous
        assert float(measure.staleness) == pytest.approx(want, rel=1e-12)
        inner = basis.mT @ factor @ basis
        assert_rel_close(measure.quotients, torch.diagonal(inner), 1e-13)
        assert_rel_close(measure.product, factor @ basis, 1e-13)
        (alone,) = measured_many([factor], [basis])
        assert float(alone.staleness) == pytest.approx(float(measure.staleness), rel=1e-13)
    zero, nan = torch.zeros(4, 4, dtype=DT), torch.full((4, 4), math.nan, dtype=DT)
    z, n = measured_many([zero, nan], [exact[-1], exact[-1]])
    assert float(z.staleness) == 0.0 and math.isnan(float(n.staleness))


def test_the_rule_refreshes_at_the_tolerance_at_nan_and_at_the_interval() -> None:
    assert refreshed([0.0, 0.1, 0.2, math.nan], [0, 0, 0, 0], 0.0, 10) == [True] * 4
    assert refreshed([0.05, 0.1, 0.2, math.nan], [0, 0, 0, 0], 0.1, 10) == [False, True, True, True]
    assert refreshed([0.0, 0.0, 0.0], [0, 1, 2], math.inf, 3) == [False, False, True]
    assert refreshed([0.0], [0], math.inf, 1) == [True]


# --------------------------------------------------------------------------- in a run
def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(32, 6, generator=gen, dtype=DT), torch.randint(0, 3, (32,), generator=gen)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, dtype=DT), nn.Tanh(), nn.Linear(8, 3, dtype=DT))


def _train(model: nn.Module, pre: hylo.HyLoPreconditioner, steps: range) -> list[dict[str, Any]]:
    """Each step's raw ∇W = [W | b] by layer, preconditioned gradients and held states (SGD, lr 0.05)."""
    out = []
    for step in steps:
        x, y = _batch(step)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = {
            name: torch.cat([m.weight.grad, m.bias.grad[:, None]], 1)
            for name, m in model.named_children()
            if isinstance(m, nn.Linear)
        }
        pre.step()
        out.append(
            {
                "raw": raw,
                "grads": [p.grad.clone() for p in model.parameters()],
                "states": {i.name: i.state for i in pre.layer_info()},
            }
        )
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
    return out


def _run(steps: int = 10, **options: Any) -> tuple[list[dict[str, Any]], hylo.HyLoPreconditioner]:
    model = _model()
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=1, damping=0.01, **options)
    return _train(model, pre, range(steps)), pre


def _assert_same_steps(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    """Every step's gradients and every layer's state tensors, bit for bit."""
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True))
        for name, state in a["states"].items():
            for key, tensor in state.tensors.items():
                assert torch.equal(tensor, b["states"][name].tensors[key]), key


@pytest.mark.parametrize("refresh", ["power", "eigh"])
def test_tolerance_zero_refreshes_every_update_bit_for_bit_as_today(refresh: str) -> None:
    today, _ = _run(basis_refresh=refresh)
    zero, pre = _run(basis_refresh=refresh, refresh_tolerance=0.0)
    _assert_same_steps(today, zero)
    notes = [d.notes for d in pre.decision_log if d.step > 0]
    assert notes and all(n["refreshed_a"] and n["refreshed_g"] and n["held_a"] == n["held_g"] == 0 for n in notes)
    assert all(n["staleness_a"] > 0 for n in notes)  # measured, and refreshed although small
    assert not any(d.notes for d in pre.decision_log if d.step == 0)  # a first update measures nothing


#: A tolerance between the run's smaller and larger measures: some sides refresh, some are kept.
TOLERANCE = 0.02


def test_decisions_are_the_rule_on_the_dense_measure_and_are_written(tmp_path: Path) -> None:
    steps, pre = _run(
        10, basis_refresh="power", refresh_tolerance=TOLERANCE, max_refresh_interval=4, profile_dir=tmp_path
    )
    pre.close()
    logged = {(d.step, d.layer): d.notes for d in pre.decision_log}
    kinds = set()
    for update in range(1, 10):
        for name, state in steps[update]["states"].items():
            before, notes = steps[update - 1]["states"][name], logged[(update, name)]
            for k, side in enumerate(SIDES):
                mass = _dense_mass(state.tensors[f"factor_{side}"].numpy(), before.tensors[f"evecs_{side}"].numpy())
                assert notes[f"staleness_{side}"] == pytest.approx(mass, rel=1e-10)
                want = mass >= TOLERANCE or before.fields["held"][k] + 1 >= 4
                assert notes[f"refreshed_{side}"] == want
                assert notes[f"held_{side}"] == (0 if want else before.fields["held"][k] + 1) == state.fields["held"][k]
                kinds.add(want)
    assert kinds == {True, False}  # both decisions occur
    with (tmp_path / "decisions.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        notes = logged[(int(row["step"]), row["layer"])]
        for side in SIDES:
            assert row[f"refreshed_{side}"] == str(notes.get(f"refreshed_{side}", ""))
            assert row[f"held_{side}"] == str(notes.get(f"held_{side}", ""))
            if notes:
                assert float(row[f"staleness_{side}"]) == pytest.approx(notes[f"staleness_{side}"], rel=1e-12)


@pytest.mark.parametrize("block", [None, 4])
def test_one_host_read_decides_every_layer(monkeypatch: pytest.MonkeyPatch, block: int | None) -> None:
    """Tolerance 0 takes today's path and measures every side: one host read more than today, whatever the
    number of layers (and of blocks)."""
    reads = []
    for tolerance in (None, 0.0):
        model = _model()
        pre = hylo.HyLoPreconditioner(
            model,
            solver="kfac_adam",
            update_freq=1,
            basis_refresh="power",
            refresh_tolerance=tolerance,
            factor_block=block,
        )
        _train(model, pre, range(2))
        x, y = _batch(2)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with counting_host_syncs(monkeypatch) as calls:
            pre.step()
        reads.append(dict(calls))
    assert reads[1]["tolist"] == reads[0]["tolist"] + 1
    assert {k: v for k, v in reads[1].items() if k != "tolist"} == {k: v for k, v in reads[0].items() if k != "tolist"}


@pytest.mark.parametrize("block", [None, 4])
def test_a_resumed_run_takes_the_same_decisions_and_bits(block: int | None) -> None:
    options = {
        "basis_refresh": "power",
        "refresh_tolerance": TOLERANCE,
        "max_refresh_interval": 3,
        "factor_block": block,
    }
    model = _model()
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=1, damping=0.01, **options)
    _train(model, pre, range(5))
    assert (block is not None) == any(i.state.tensors["evecs_a"].dim() == 1 for i in pre.layer_info())
    saved, weights = pre.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert [entry["held"] for entry in saved["layers"].values()] == [
        list(i.state.fields["held"]) for i in pre.layer_info()
    ]
    assert any(any(entry["held"]) for entry in saved["layers"].values())  # a kept basis is saved mid-hold
    expected = _train(model, pre, range(5, 12))
    twin = _model()
    twin.load_state_dict(weights)
    resumed = hylo.HyLoPreconditioner(twin, solver="kfac_adam", update_freq=1, damping=0.01, **options)
    resumed.load_state_dict(saved)
    got = _train(twin, resumed, range(5, 12))
    for a, b in zip(got, expected, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True))
    assert [(d.step, d.layer, dict(d.notes)) for d in resumed.decision_log] == [
        (d.step, d.layer, dict(d.notes)) for d in pre.decision_log if d.step >= 5
    ]
    for bad in ([-1, 0], [0], "0,0", [0.0, 1]):
        corrupt = dict(saved, layers={**saved["layers"], "0": {**saved["layers"]["0"], "held": bad}})
        corrupt.pop("checksum", None)
        corrupt["format"] = 2  # an unsealed format, so that the entry itself is checked
        with pytest.raises(ValueError, match="held"):
            resumed.load_state_dict(corrupt)


# --------------------------------------------------------------------------- blocked sides
#: The block size of the blocked runs: layer 0's A (7) is cut (4, 3) and its G (8) (4, 4); layer 2's A (9)
#: (3, 3, 3), its G (3) stays whole (and is measured in one batch with the blocks of size 3).
BLOCK = 4


def _sizes(d: int) -> list[int]:
    """Balanced block sizes of a side of ``d`` under :data:`BLOCK`, written out independently of hylo."""
    if BLOCK >= d:
        return [d]
    k = -(-d // BLOCK)
    return [d // k + (1 if i < d % k else 0) for i in range(k)]


def _unpacked(matrix: Tensor, d: int) -> list[np.ndarray]:
    """A side's matrix as held, as its diagonal blocks: itself whole, or its packed blocks (row-major, in order)."""
    if matrix.dim() == 2:
        return [matrix.numpy()]
    flat, out, at = matrix.numpy(), [], 0
    for size in _sizes(d):
        out.append(flat[at : at + size * size].reshape(size, size))
        at += size * size
    assert at == flat.size
    return out


def _dense(matrix: Tensor, d: int) -> np.ndarray:
    """The dense (d × d) block-diagonal matrix of a side's matrix as held."""
    out, start = np.zeros((d, d)), 0
    for block in _unpacked(matrix, d):
        out[start : start + len(block), start : start + len(block)] = block
        start += len(block)
    return out


def _width(state: Any, side: str) -> int:
    d_g, d_a = state.tensors["exp_avg"].shape
    return d_a if side == "a" else d_g


@pytest.mark.parametrize("refresh", ["power", "eigh"])
def test_blocked_tolerance_zero_is_the_blocked_path_bit_for_bit(refresh: str) -> None:
    blocked, _ = _run(basis_refresh=refresh, factor_block=BLOCK)
    zero, pre = _run(basis_refresh=refresh, factor_block=BLOCK, refresh_tolerance=0.0)
    dense, _ = _run(basis_refresh=refresh)
    assert not torch.equal(blocked[-1]["grads"][0], dense[-1]["grads"][0])  # the blocks change the run
    assert {i.name: i.state.tensors["evecs_a"].dim() for i in pre.layer_info()} == {"0": 1, "2": 1}
    _assert_same_steps(blocked, zero)
    notes = [d.notes for d in pre.decision_log if d.step > 0]
    assert notes and all(n["refreshed_a"] and n["refreshed_g"] and n["staleness_a"] > 0 for n in notes)


@pytest.mark.parametrize("block", [None, BLOCK])
def test_an_infinite_tolerance_holds_each_basis_whole_between_forced_refreshes(block: int | None) -> None:
    """Dense sides, and blocked ones (each kept or refreshed whole): a kept side keeps its very basis with the new
    factor's Rayleigh quotients, a forced one takes one step of subspace iteration from it (block by block), and
    the moments advance in a held basis without a re-projection."""
    steps, beta1 = (
        _run(9, basis_refresh="power", refresh_tolerance=math.inf, max_refresh_interval=3, factor_block=block)[0],
        0.9,
    )
    for update in range(1, 9):
        held = 1 + (update - 1) % 3  # updates 1, 2 kept; 3 refreshed; ...
        for name, state in steps[update]["states"].items():
            before = steps[update - 1]["states"][name]
            assert state.fields["held"] == ((held, held) if held < 3 else (0, 0))
            for side in SIDES:
                d, old = _width(state, side), before.tensors[f"evecs_{side}"]
                factors, bases = _unpacked(state.tensors[f"factor_{side}"], d), _unpacked(old, d)
                if held < 3:  # kept: the very packed basis, each block's Rayleigh quotients joined in block order
                    assert torch.equal(state.tensors[f"evecs_{side}"], old)
                    want = np.concatenate([np.diag(q.T @ f @ q) for f, q in zip(factors, bases, strict=True)])
                    assert_rel_close(state.tensors[f"evals_{side}"], torch.from_numpy(want), 1e-12)
                else:  # forced: every block refreshed from its held block
                    pairs = [numpy_power_refresh(f, q)[:2] for f, q in zip(factors, bases, strict=True)]
                    want_q = torch.block_diag(*[torch.from_numpy(q.copy()) for _, q in pairs])
                    got_q = torch.from_numpy(_dense(state.tensors[f"evecs_{side}"], d))
                    assert_rel_close(got_q, want_q, 1e-8)
                    want_e = torch.from_numpy(np.concatenate([e for e, _ in pairs]))
                    assert_rel_close(state.tensors[f"evals_{side}"], want_e, 1e-10)
            if held < 3:  # the moments advance in the held block-diagonal basis, not re-projected
                q_a = _dense(state.tensors["evecs_a"], _width(state, "a"))
                q_g = _dense(state.tensors["evecs_g"], _width(state, "g"))
                rotated = q_g.T @ steps[update]["raw"][name].numpy() @ q_a
                want = beta1 * before.tensors["exp_avg"].numpy() + (1 - beta1) * rotated
                assert_rel_close(state.tensors["exp_avg"], torch.from_numpy(want), 1e-10)


def test_a_blocked_sides_staleness_is_the_dense_mass_over_its_diagonal_blocks() -> None:
    """s² = Σ_b ‖offdiag(Q_bᵀ F_b Q_b)‖² / Σ_b ‖F_b‖²: the dense off-diagonal mass of the block-diagonal factor in
    the block-diagonal basis; one decision per side, which keeps or refreshes all of its blocks."""
    steps, pre = _run(
        10, basis_refresh="power", refresh_tolerance=TOLERANCE, max_refresh_interval=4, factor_block=BLOCK
    )
    logged = {(d.step, d.layer): d.notes for d in pre.decision_log}
    kinds, spread = set(), []
    for update in range(1, 10):
        for name, state in steps[update]["states"].items():
            before, notes = steps[update - 1]["states"][name], logged[(update, name)]
            for k, side in enumerate(SIDES):
                d, old = _width(state, side), before.tensors[f"evecs_{side}"]
                factor = _dense(state.tensors[f"factor_{side}"], d)
                mass = _dense_mass(factor, _dense(old, d))
                assert notes[f"staleness_{side}"] == pytest.approx(mass, rel=1e-10)
                blocks = list(zip(_unpacked(state.tensors[f"factor_{side}"], d), _unpacked(old, d), strict=True))
                if len(blocks) > 1:  # not the mean, nor the largest, of the blocks' own measures
                    spread.append(max(_dense_mass(f, q) for f, q in blocks) / min(_dense_mass(f, q) for f, q in blocks))
                want = mass >= TOLERANCE or before.fields["held"][k] + 1 >= 4
                assert notes[f"refreshed_{side}"] == want
                assert notes[f"held_{side}"] == state.fields["held"][k] == (0 if want else before.fields["held"][k] + 1)
                assert torch.equal(state.tensors[f"evecs_{side}"], old) != want
                kinds.add((len(blocks) > 1, want))
    assert kinds == {(True, True), (True, False), (False, True), (False, False)}  # both decisions, blocked or not
    assert max(spread) > 1.5  # the blocks' measures differ: the aggregate is a choice


def test_the_solve_cost_counts_the_refreshed_sides_blocks() -> None:
    """POWER_COST·Σ s³ (or EIGH_COST's) over the blocks of the sides an update refreshes; none for a kept side."""
    family, cubes = KFACAdamFamily(), {"a": sum(s**3 for s in _sizes(7)), "g": sum(s**3 for s in _sizes(8))}
    assert cubes == {"a": 4**3 + 3**3, "g": 2 * 4**3}
    for method, unit in (("eigh", EIGH_COST), ("power", POWER_COST)):
        _, pre = _run(2, basis_refresh=method, factor_block=BLOCK)
        previous = family.state_type.from_dict(pre.state_dict()["layers"]["0"], 7, 8, DT, torch.device("cpu"))
        for refresh in ((True, True), (True, False), (False, True), (False, False)):
            prepared = KFACAdamInputs(
                previous.factor_a,
                previous.factor_g,
                previous,
                KFACAdamConfig(basis_refresh=method),
                layouts=(block_layout(7, BLOCK), block_layout(8, BLOCK)),
                refresh=refresh,
            )
            want = unit * sum(cubes[side] for side, on in zip(SIDES, refresh, strict=True) if on)
            assert family.solve_cost(prepared) == pytest.approx(want, rel=1e-12)


# --------------------------------------------------------------------------- ranks
def _ranks(
    rank: int, world_size: int, strategy: str, block: int | None, xs: Tensor, ys: Tensor, counts: list[int]
) -> dict[str, Any]:
    """tests/library/test_distributed.py's Net under kfac_adam with the adaptive refresh (fc1 skipped: its A is
    rank-deficient), DDP on ``counts`` rows per rank; every step's preconditioned gradients and the decisions."""
    model = make_model(xs.dtype)
    net: nn.Module = model
    if world_size > 1:
        net = nn.parallel.DistributedDataParallel(model)
    options = {} if strategy == "inverse" else {"strategy": strategy}
    pre = hylo.HyLoPreconditioner(
        net,
        solver="kfac_adam",
        update_freq=1,
        damping=1e-2,
        factor_decay=0.5,
        adam_eps=1e-3,
        skip_layers=("fc1",),
        basis_refresh="power",
        refresh_tolerance=0.01,
        max_refresh_interval=3,
        factor_block=block,
        **options,
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rows, out = local_slice(counts, rank), []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        F.cross_entropy(net(x[rows]), y[rows]).backward()
        pre.step()
        out.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
    return {"pre": out, "notes": [(d.step, d.layer, dict(d.notes)) for d in pre.decision_log]}


@pytest.mark.parametrize(("strategy", "block"), [("inverse", None), ("gradient", None), ("inverse", 2)])
def test_two_ranks_take_the_decisions_of_one_process(strategy: str, block: int | None) -> None:
    xs, ys = make_data(6, 8, torch.float64)
    one = _ranks(0, 1, strategy, block, xs, ys, [8])
    decided = [n for _, _, n in one["notes"] if n]
    assert {n["refreshed_g"] for n in decided} | {n["refreshed_a"] for n in decided} == {True, False}
    for result in run_distributed(_ranks, 2, strategy, block, xs, ys, [4, 4]):
        assert [
            (s, layer, {k: v for k, v in n.items() if "staleness" not in k}) for s, layer, n in result["notes"]
        ] == [(s, layer, {k: v for k, v in n.items() if "staleness" not in k}) for s, layer, n in one["notes"]]
        for (_, _, got), (_, _, want) in zip(result["notes"], one["notes"], strict=True):
            for side in SIDES:
                if want:
                    assert got[f"staleness_{side}"] == pytest.approx(want[f"staleness_{side}"], rel=1e-8)
        for got, want in zip(result["pre"], one["pre"], strict=True):
            for key, tensor in want.items():
                assert rel_err(got[key], tensor) <= 1e-5, key


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"refresh_tolerance": -0.1}, "refresh_tolerance must be a number >= 0"),
        ({"refresh_tolerance": math.nan}, "refresh_tolerance must be a number >= 0"),
        ({"refresh_tolerance": True}, "refresh_tolerance must be a number >= 0"),
        ({"refresh_tolerance": "0.1"}, "refresh_tolerance must be a number >= 0"),
        ({"max_refresh_interval": 0}, "max_refresh_interval must be an int >= 1"),
        ({"max_refresh_interval": 2.0}, "max_refresh_interval must be an int >= 1"),
        ({"max_refresh_interval": True}, "max_refresh_interval must be an int >= 1"),
    ],
)
def test_bad_options_are_refused_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hylo.HyLoPreconditioner(_model(), solver="kfac_adam", **options)
