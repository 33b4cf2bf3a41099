"""``state_dict``/``load_state_dict`` of HyLoPreconditioner beyond same-world round trips (test_checkpoint.py).

- Refusals: anything that is not a hylo state of a readable format, or does not fit, raises
  ``ValueError`` before anything changes (the preconditioner stays bit-identical and usable).
- Format: the state carries ``format`` and ``hylo_version``; format 1 files still load.
- World sizes (gloo processes of tests/kit/harness.py): a state saved at P ranks loads at P′
  (rank 0's file on every rank). Oracle: one uninterrupted process on the same global batches —
  exact reuse of the loaded states under ``"inverse"`` (and under ``"gradient"`` from one rank,
  whose file holds every state); from two ranks under ``"gradient"`` the layers rank 1 owned
  are recomputed at the first step, which the oracle does by an update forced at that step.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo import HyLoPreconditioner
from hylo.integrity import seal
from hylo.pipeline.checkpoint import READ_FORMATS, STATE_FORMAT
from hylo.state import UNSOLVED
from tests.kit.checks import assert_same_tensors, grads, rel_err, state_snapshot
from tests.kit.harness import run_distributed
from tests.kit.models import classifier_convnet, classifier_inputs, mlp, run

pytestmark = pytest.mark.usefixtures("single_thread")


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through ``torch.save``/``torch.load(weights_only=True)``, as a training script reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# =========================================================================== refusals change nothing
def _source_state(solver: str) -> dict[str, Any]:
    model = mlp(1)
    pre = HyLoPreconditioner(model, solver=solver, update_freq=2, damping=0.05, seed=5)
    run(model, pre, range(5))
    return _saved(pre.state_dict())


def _layer(name: str, key: str) -> Callable[[dict[str, Any]], None]:
    def drop(state: dict[str, Any]) -> None:
        del state["layers"][name][key]

    return drop


def _set(path: tuple[str, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def put(state: dict[str, Any]) -> None:
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return put


def _delete(key: str) -> Callable[[dict[str, Any]], None]:
    def drop(state: dict[str, Any]) -> None:
        del state[key]

    return drop


def _remote(carried: object) -> Callable[[dict[str, Any]], None]:
    """fc2's entry made a remote one carrying ``carried``."""

    def mark(state: dict[str, Any]) -> None:
        entry = state["layers"]["fc2"]
        for key in ("tensors", "damping", "divisor"):
            entry.pop(key, None)
        entry.update(remote=True, carried=carried)

    return mark


def _nan_tensor(state: dict[str, Any]) -> None:
    tensors = state["layers"]["fc2"]["tensors"]
    key = next(iter(tensors))
    tensors[key] = torch.full_like(tensors[key], float("nan"))


CORRUPTIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "format-missing": (_delete("format"), "format"),
    "format-newer": (_set(("format",), STATE_FORMAT + 1), "newer hylo"),
    "format-str": (_set(("format",), "2"), "reads formats"),
    "version-missing": (_delete("hylo_version"), "hylo_version"),
    "version-not-str": (_set(("hylo_version",), 0.1), "hylo_version"),
    "steps-missing": (_delete("steps"), "steps"),
    "steps-negative": (_set(("steps",), -1), "steps"),
    "steps-float": (_set(("steps",), 4.0), "steps"),
    "steps-bool": (_set(("steps",), True), "steps"),
    "layers-missing": (_delete("layers"), "layers"),
    "layers-list": (_set(("layers",), []), "layers"),
    "generator-missing": (_delete("generator"), "generator"),
    "generator-garbage": (_set(("generator",), torch.zeros(3, dtype=torch.uint8)), "generator"),
    "needs_update-missing": (_delete("needs_update"), "needs_update"),
    "needs_update-int": (_set(("needs_update",), 1), "needs_update"),
    "updates-negative": (_set(("updates",), -2), "updates"),
    "config-list": (_set(("config",), [1, 2]), "config"),
    "config-bad-value": (_set(("config", "damping"), -1.0), "config"),
    "rank-outside-world": (_set(("rank",), 4), "rank"),
    "entry-not-mapping": (_set(("layers", "fc2"), [1, 2]), "fc2"),
    "entry-without-d_a": (_layer("fc2", "d_a"), "d_a"),
    "entry-without-solver": (_layer("fc2", "solver"), "solver"),
    "entry-d_a-str": (_set(("layers", "fc2", "d_a"), "7"), "fc2"),
    "entry-unknown-solver": (_set(("layers", "fc2", "solver"), "adam"), "solver"),
    "entry-owner-negative": (_set(("layers", "fc2", "owner"), -2), "owner"),
    "entry-tensors-not-tensors": (_set(("layers", "fc2", "tensors"), {"a": [1.0]}), "fc2"),
    "entry-nan-tensor": (_nan_tensor, "finite"),
    "entry-carried-not-tensors": (_remote({"factor_a": 1.0}), "carried"),
    "entry-carried-wrong-shape": (_remote({"factor_a": torch.eye(3), "factor_g": torch.eye(3)}), "carried"),
    "entry-carried-and-full": (lambda s: s["layers"]["fc2"].update(remote=True, carried={}), "remote entry"),
    "entry-unknown-key": (_set(("layers", "fc2", "extra"), 1), "unknown"),
    "unknown-key": (_set(("extra",), 1), "unknown"),
    "trend-not-mapping": (_set(("trend",), [0.0]), "trend"),
    "trend-without-ema": (lambda s: s["trend"].pop("ema"), "trend"),
    "trend-ema-not-tensor": (_set(("trend", "ema"), [1.0, 2.0]), "trend"),
    "trend-ema-wrong-length": (_set(("trend", "ema"), torch.ones(3, dtype=torch.float64)), "trend"),
    "trend-critical-wrong-length": (_set(("trend", "critical"), [True]), "trend"),
    "trend-critical-not-bool": (_set(("trend", "critical"), ["yes", "no"]), "trend"),
    "trend-history-wrong-length": (_set(("trend", "history"), [(0, [1.0], [0.0])]), "trend"),
    "trend-history-garbage": (_set(("trend", "history"), [3]), "trend"),
}


def _everything(pre: HyLoPreconditioner) -> dict[str, Any]:
    """All a load may change, copied: states, step, options, generator, trend, cadence flags, owners."""
    progress = pre.progress()
    return {
        "states": state_snapshot(pre),
        "state_dict": copy.deepcopy(pre.state_dict()),
        "config": pre.config,
        "generator": pre.state_dict()["generator"],
        "flags": (progress.update_owed, progress.steps, progress.updates),
        "layers": [(info.solver, info.owner) for info in pre.layer_info()],
    }


@pytest.mark.parametrize("what", list(CORRUPTIONS))
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_invalid_state_dict_is_refused_and_changes_nothing(solver: str, what: str) -> None:
    corrupt, message = CORRUPTIONS[what]
    saved = _source_state(solver)
    corrupt(saved)
    saved = seal(saved)  # the checksum matches: the validation itself refuses

    model = mlp(0)
    pre = HyLoPreconditioner(model, solver=solver, update_freq=2, damping=0.3, seed=9)
    run(model, pre, range(3))
    before = _everything(pre)
    states, config = [info.state for info in pre.layer_info()], pre.config
    with pytest.raises(ValueError, match=message):
        pre.load_state_dict(saved)
    assert_same_tensors(_everything(pre), before)  # the generator and the trend too, in its state_dict
    assert pre.config is config
    assert all(a == b for a, b in zip(states, [info.state for info in pre.layer_info()], strict=True))

    # still usable, and continuing exactly as a preconditioner that never saw the bad state
    twin_model = mlp(0)
    twin = HyLoPreconditioner(twin_model, solver=solver, update_freq=2, damping=0.3, seed=9)
    run(twin_model, twin, range(3))
    run(model, pre, range(3, 5))
    run(twin_model, twin, range(3, 5))
    assert_same_tensors(state_snapshot(pre), state_snapshot(twin))


@pytest.mark.parametrize("value", [None, [("steps", 3)], "state.pt", 3])
def test_non_mapping_is_refused(value: object) -> None:
    model = mlp(0)
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=1)
    run(model, pre, [0])
    before = _everything(pre)
    with pytest.raises(ValueError, match="mapping"):
        pre.load_state_dict(value)  # type: ignore[arg-type]
    assert_same_tensors(_everything(pre), before)


# =========================================================================== format and version
def test_state_dict_carries_format_and_version() -> None:
    model = mlp(0)
    pre = HyLoPreconditioner(model, solver="kfac")
    state = pre.state_dict()
    assert state["format"] == STATE_FORMAT == 3 and STATE_FORMAT in READ_FORMATS
    assert state["hylo_version"] == hylo.version.__version__


def test_newer_format_names_the_readable_ones() -> None:
    saved = _source_state("kfac")
    saved.update(format=99, hylo_version="9.0")
    pre = HyLoPreconditioner(mlp(0), solver="kfac")
    with pytest.raises(ValueError) as refused:
        pre.load_state_dict(saved)
    text = str(refused.value)
    assert "99" in text and "9.0" in text and "reads formats 1, 2, 3" in text and "newer hylo" in text


@pytest.mark.parametrize("solver", ["kfac", "kis"])
def test_format_1_state_dict_loads_and_continues_bit_for_bit(solver: str) -> None:
    """A format-1 file (no ``hylo_version``) loads like the current format."""
    options = {"solver": solver, "update_freq": 2, "damping": 0.1, "rank_ratio": 0.5, "seed": 3}
    model = mlp(0)
    pre = HyLoPreconditioner(model, **options)
    run(model, pre, range(3))
    saved = _saved({"model": model.state_dict(), "pre": pre.state_dict()})
    run(model, pre, range(3, 6))

    old = dict(saved["pre"])
    old["format"] = 1
    del old["hylo_version"], old["checksum"]  # formats 1 and 2 carry no checksum
    model2 = mlp(1)
    model2.load_state_dict(saved["model"])
    pre2 = HyLoPreconditioner(model2, **options)
    pre2.load_state_dict(old)
    run(model2, pre2, range(3, 6))
    assert_same_tensors(state_snapshot(pre2), state_snapshot(pre))
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


# =========================================================================== owners outside the world
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_owner_outside_the_world_is_reset(solver: str) -> None:
    """A full state whose owner is rank 7 (saved in a larger world) is used here with owner 0; the run goes on."""
    model = mlp(0)
    pre = HyLoPreconditioner(model, solver=solver, update_freq=3, damping=0.1)
    run(model, pre, range(2))
    saved = _saved(pre.state_dict())
    for entry in saved["layers"].values():
        entry["owner"] = 7
    saved["rank"], saved["world_size"] = 5, 8
    saved = seal(saved)
    run(model, pre, range(2, 5))

    model2 = mlp(0)
    pre2 = HyLoPreconditioner(model2, solver=solver, update_freq=3, damping=0.1)
    run(model2, pre2, range(2))
    pre2.load_state_dict(saved)
    assert [info.owner for info in pre2.layer_info()] == [0, 0]
    assert not pre2.progress().update_owed  # full states are used as they are
    run(model2, pre2, range(2, 5))
    assert_same_tensors(state_snapshot(pre2), state_snapshot(pre))


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "negative-control-without-carried"])
def test_remote_entry_of_another_rank_is_recomputed_from_its_carried_factors(carry: bool) -> None:
    """A remote K-FAC entry (owner 3 of 4) loaded in one process: no owner yet, and the next step (2, off the
    cadence) recomputes, blending the carried running factors — as a run that updates at step 2 does."""
    options = {"solver": "kfac", "damping": 0.1, "factor_decay": 0.5}
    model = mlp(0)  # run() without an optimizer: the weights stay as they are
    pre = HyLoPreconditioner(model, update_freq=3, **options)
    run(model, pre, range(2))
    saved = _saved(pre.state_dict())
    tensors = saved["layers"]["fc2"].pop("tensors")
    del saved["layers"]["fc2"]["damping"]
    saved["layers"]["fc2"].update(owner=3, remote=True)
    if carry:
        saved["layers"]["fc2"]["carried"] = {k: tensors[k] for k in ("factor_a", "factor_g")}
    saved["rank"], saved["world_size"] = 0, 4
    saved = seal(saved)

    model2 = mlp(0)
    pre2 = HyLoPreconditioner(model2, update_freq=3, **options)
    pre2.load_state_dict(saved)
    fc2 = pre2.layer_info()[1]
    assert fc2.owner == UNSOLVED and pre2.progress().update_owed
    assert (fc2.state is not None and fc2.state.remote) if carry else fc2.state is None
    run(model2, pre2, [2])
    assert [d.step for d in pre2.decision_log] == [2, 2]

    oracle_model = mlp(0)
    oracle = HyLoPreconditioner(oracle_model, update_freq=lambda step: 2 if step == 2 else 3, **options)
    run(oracle_model, oracle, range(3))
    fresh, expected = pre2.layer_info()[1].state, oracle.layer_info()[1].state
    assert fresh is not None and not fresh.remote and expected is not None and not expected.remote
    if carry:
        assert_same_tensors(dict(fresh.tensors), dict(expected.tensors))
    else:  # the carried factors matter: without them the factors restart from step 2's batch
        assert not torch.allclose(fresh.tensors["factor_a"], expected.tensors["factor_a"])


# =========================================================================== across world sizes (gloo)
STEPS, SAVE_AT, BATCH = 8, 4, 8
OPTIONS: dict[str, Any] = {"update_freq": 3, "damping": 0.05, "factor_decay": 0.5}


def _data() -> list[tuple[Tensor, Tensor]]:
    return [classifier_inputs("conv", BATCH, seed=300 + step) for step in range(STEPS)]


def _phase(
    rank: int,
    world: int,
    solver: str,
    strategy: str,
    steps: range,
    checkpoint: dict[str, Any] | None,
    update_freq: Any = None,
) -> dict[str, Any]:
    """Train ``steps`` on rank ``rank``'s share of each global batch (DDP when ``world`` > 1), from ``checkpoint``.

    Returns the preconditioned gradients per step, whether each step updated, the owners right after the
    load, whether every held state is finite at the end and the checkpoint of this rank at the end.
    """
    model = classifier_convnet(seed=0)
    net: nn.Module = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    options = dict(OPTIONS, update_freq=update_freq or OPTIONS["update_freq"])
    pre = HyLoPreconditioner(net, solver=solver, strategy=strategy, **options)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    owners = None
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        pre.load_state_dict(checkpoint["hylo"])
        owners = [info.owner for info in pre.layer_info()]
    data = _data()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    raw, preconditioned, updated = {}, {}, {}
    for step in steps:
        x, y = data[step]
        optimizer.zero_grad()
        F.cross_entropy(net(x[rows]), y[rows]).backward()
        raw[step] = torch.cat([p.grad.flatten() for p in model.parameters()])
        before = len(pre.decision_log)
        pre.step()
        updated[step] = len(pre.decision_log) > before
        preconditioned[step] = torch.cat([p.grad.flatten() for p in model.parameters()])
        optimizer.step()
    finite = all(
        bool(torch.isfinite(t).all()) for info in pre.layer_info() if info.state for t in info.state.tensors.values()
    )
    out = {
        "raw": raw,
        "pre": preconditioned,
        "updated": updated,
        "owners": owners,
        "finite": finite,
        "checkpoint": {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hylo": pre.state_dict()},
    }
    pre.remove()
    return out


def _recompute_at_load(step: int) -> int:
    """update_freq of the oracle of a load that recomputes: 3, and an update at ``SAVE_AT``."""
    return SAVE_AT if step == SAVE_AT else 3


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(1, 2), (2, 1)], ids=["1to2", "2to1"])
@pytest.mark.parametrize("strategy", ["inverse", "gradient"])
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_state_saved_at_one_world_size_loads_at_another(
    solver: str, strategy: str, saved_at: int, loaded_at: int
) -> None:
    first = run_distributed(_phase, saved_at, solver, strategy, range(SAVE_AT), None, timeout=120)
    checkpoint = _saved(first[0]["checkpoint"])  # rank 0's file, loaded on every rank
    remote = [name for name, entry in checkpoint["hylo"]["layers"].items() if entry.get("remote")]
    recomputes = strategy == "gradient" and saved_at > 1
    assert bool(remote) == recomputes  # not vacuous: rank 1 owned some layer
    second = run_distributed(_phase, loaded_at, solver, strategy, range(SAVE_AT, STEPS), checkpoint, timeout=120)

    oracle = _phase(0, 1, solver, strategy, range(STEPS), None, _recompute_at_load if recomputes else None)
    assert [s for s, u in oracle["updated"].items() if u] == ([0, 3, 4, 6] if recomputes else [0, 3, 6])
    for rank, result in enumerate(second):
        assert result["finite"]
        # a recomputed layer has no owner until its first update; the others are owned inside the new world
        for name, owner in zip(checkpoint["hylo"]["layers"], result["owners"], strict=True):
            assert owner == UNSOLVED if name in remote else 0 <= owner < loaded_at, (name, owner)
        assert result["updated"] == {s: oracle["updated"][s] for s in range(SAVE_AT, STEPS)}, rank
        for step in range(SAVE_AT, STEPS):
            assert rel_err(result["raw"][step], oracle["raw"][step]) < 1e-10, (rank, step)
            err = rel_err(result["pre"][step], oracle["pre"][step])
            assert err < 1e-7, f"rank {rank} step {step}: relative error {err:.2e}"
            assert rel_err(result["pre"][step], result["raw"][step]) > 0.1  # preconditioning did something
    for step in range(SAVE_AT):  # and the run that saved matched the oracle too
        assert rel_err(first[0]["pre"][step], oracle["pre"][step]) < 1e-7


def test_after_a_load_every_component_uses_the_restored_options(tmp_path: Path) -> None:
    """A state saved with rank_ratio 0.5 and seed 7, loaded into a preconditioner made with 0.1 and 0: the
    config, the policy, the stage (KIS's draws) and the gradient-error study all run on 0.5 and 7 — the
    loaded run writes the very rows the saving run writes when both go on."""
    saving, loading = mlp(0), mlp(0)
    study = {"studies": ("grad_error",), "grad_error_methods": ("kis", "kid")}
    source = HyLoPreconditioner(
        saving, solver="kis", update_freq=2, rank_ratio=0.5, seed=7, profile_dir=tmp_path / "a", **study
    )
    run(saving, source, range(3))
    target = HyLoPreconditioner(
        loading, solver="kis", update_freq=2, rank_ratio=0.1, seed=0, profile_dir=tmp_path / "b", **study
    )
    target.load_state_dict(source.state_dict())
    assert (target.config.lowrank.rank_ratio, target.config.lowrank.seed) == (0.5, 7)
    run(saving, source, range(3, 7))
    run(loading, target, range(3, 7))
    source.close()
    target.close()
    assert_same_tensors(state_snapshot(target), state_snapshot(source))
    assert_same_tensors(grads(loading), grads(saving))

    def rows(directory: Path) -> list[list[str]]:
        lines = (directory / "grad-error.csv").read_text().splitlines()[1:]
        return [line.split(",") for line in lines if int(line.split(",")[0]) >= 3]

    after = rows(tmp_path / "b")
    assert after == rows(tmp_path / "a") and len(after) == 2 * 2 * 2  # 2 updates × 2 layers × 2 methods
    assert {row[3] for row in after} == {"0.5"}  # the study's ρ: the restored rank_ratio
