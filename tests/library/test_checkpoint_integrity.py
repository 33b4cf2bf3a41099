"""Checkpoints that detect corruption, refuse unusable per-layer values and say what happens to the options.

- Checksums (docs/reliability.md, "Checksums"): ``state_dict()`` is sealed; a single flipped bit
  anywhere in a file written by ``torch.save(pre.state_dict(), path)`` is refused by
  :func:`hylo.load_checkpoint` with a ``ValueError`` naming the file (or, where the bit lies
  outside the state's contents, the state loads bit-equal), and nothing changes.
- Per-layer values (docs/reliability.md, "Validation"): a damping or divisor that is not a finite
  number > 0, a tensor of another dtype, negative K-FAC eigenvalues are refused naming the layer
  and the field — on states re-sealed after the change, so the validation itself is tested.
- Options (docs/usage.md, "Checkpoints"): ``options="restore"`` restores the saved options with one
  warning listing those that differ (a callable of this run is kept, and said so), ``"keep"`` keeps the constructor's, ``"refuse"`` refuses a
  mismatch (on every rank with P > 1).
"""

from __future__ import annotations

import copy
import io
import random
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import hylo
from hylo import HyLoPreconditioner
from hylo.integrity import seal
from tests.kit.checks import assert_same_tensors, state_snapshot
from tests.kit.harness import run_distributed
from tests.kit.models import mlp, run

pytestmark = pytest.mark.usefixtures("single_thread")

OPTIONS: dict[str, Any] = {"update_freq": 2, "damping": 0.05, "seed": 5}


def _trained(solver: str, **options: Any) -> tuple[torch.nn.Module, HyLoPreconditioner]:
    model = mlp(0)
    pre = HyLoPreconditioner(model, solver=solver, **{**OPTIONS, **options})
    run(model, pre, range(3))
    return model, pre


def _fresh(solver: str, **options: Any) -> HyLoPreconditioner:
    model = mlp(1)
    pre = HyLoPreconditioner(model, solver=solver, **{**OPTIONS, **options})
    run(model, pre, range(1))
    return pre


# =========================================================================== item 4: checksums
def test_state_dict_is_sealed_and_verified() -> None:
    _, pre = _trained("sngd")
    state = pre.state_dict()
    assert state == seal(state)  # the checksum is that of the rest
    tampered = copy.deepcopy(state)
    tampered["layers"]["fc1"]["tensors"]["a"][0, 0] += 1e-12
    target = _fresh("sngd")
    before = target.state_dict()
    with pytest.raises(ValueError, match="corrupted"):
        target.load_state_dict(tampered)
    with pytest.raises(ValueError, match="run-7.pt: state_dict is corrupted"):
        target.load_state_dict(tampered, where="run-7.pt")
    without = {k: v for k, v in state.items() if k != "checksum"}
    with pytest.raises(ValueError, match="checksum"):
        target.load_state_dict(without)  # format 3 requires it
    assert_same_tensors(target.state_dict(), before)


def test_a_tensor_with_odd_strides_is_sealed_by_its_values() -> None:
    """A loaded (or corrupted) file can hold a tensor whose size-1 dimension has a stride other than 1: it is sealed
    by its values like any copy of it, not refused with a RuntimeError."""
    odd = torch.arange(10.0)[::5][:1]  # shape (1,), stride (5,)
    assert odd.stride() == (5,)
    assert seal({"x": odd})["checksum"] == seal({"x": odd.clone(memory_format=torch.contiguous_format)})["checksum"]


@pytest.mark.parametrize("solver", ["kfac", "kis"])
def test_flipped_bit_in_a_saved_file_is_refused_naming_it(tmp_path: Path, solver: str) -> None:
    """One bit flipped at 300 spread positions of ``torch.save(pre.state_dict(), path)``'s file: each load through
    ``hylo.load_checkpoint`` either refuses with a ValueError naming the file, changing nothing, or — for a bit
    outside the state's contents (zip padding, unused header fields) — loads a state bit-equal to the saved one."""
    _, pre = _trained(solver)
    path = tmp_path / "hylo.pt"
    torch.save(pre.state_dict(), path)
    data = path.read_bytes()
    target = _fresh(solver)
    hylo.load_checkpoint(target, path)  # the intact file loads
    assert_same_tensors(target.state_dict(), pre.state_dict())
    target = _fresh(solver)
    before = target.state_dict()
    rng = random.Random(0)
    refused = 0
    for position in sorted({int(i * len(data) / 300) for i in range(300)}):
        flipped = bytearray(data)
        flipped[position] ^= 1 << rng.randrange(8)
        bad = tmp_path / f"flip-{position}.pt"
        bad.write_bytes(bytes(flipped))
        try:
            hylo.load_checkpoint(target, bad)
        except ValueError as err:
            assert str(bad) in str(err)
            assert_same_tensors(target.state_dict(), before)
            refused += 1
        else:
            assert_same_tensors(target.state_dict(), pre.state_dict())
            target = _fresh(solver)
        bad.unlink()
    assert refused >= 200, refused  # most bits are contents (the rest: the zip records' padding and headers)


def test_save_checkpoint_round_trip_and_unreadable_file(tmp_path: Path) -> None:
    model, pre = _trained("kfac")
    path = tmp_path / "pre.pt"
    hylo.save_checkpoint(pre, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pre.pt"]  # no temporary left
    target = _fresh("kfac")
    hylo.load_checkpoint(target, path)
    assert_same_tensors(state_snapshot(target), state_snapshot(pre))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt is not a readable hylo checkpoint"):
        hylo.load_checkpoint(target, tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError):
        hylo.load_checkpoint(target, tmp_path / "missing.pt")


def test_formats_1_and_2_without_a_checksum_still_load() -> None:
    _, pre = _trained("kfac")
    for fmt in (1, 2):
        old = {k: v for k, v in pre.state_dict().items() if k != "checksum"}
        old["format"] = fmt
        target = _fresh("kfac")
        target.load_state_dict(old)
        assert_same_tensors(state_snapshot(target), state_snapshot(pre))
    flipped_format = dict(pre.state_dict(), format=2)  # an old format does not skip a checksum it carries
    with pytest.raises(ValueError, match="corrupted"):
        _fresh("kfac").load_state_dict(flipped_format)


# =========================================================================== item 6: per-layer values
BAD_NUMBERS = [-1.0, 0.0, float("nan"), float("inf"), True, "0.1", None]


def _resealed_with(solver: str, field: str, value: Any) -> dict[str, Any]:
    _, pre = _trained(solver)
    state = pre.state_dict()
    state["layers"]["fc2"][field] = value
    return seal(state)


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize(("solver", "field"), [("kfac", "damping"), ("sngd", "damping"), ("kis", "divisor")])
def test_bad_damping_or_divisor_is_refused_naming_layer_and_field(solver: str, field: str, value: Any) -> None:
    state = _resealed_with(solver, field, value)
    target = _fresh(solver)
    before = target.state_dict()
    with pytest.raises(ValueError, match=rf"layer 'fc2'.*{field}"):
        target.load_state_dict(state)
    assert_same_tensors(target.state_dict(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.complex128])
@pytest.mark.parametrize(("solver", "key"), [("kfac", "evecs_a"), ("sngd", "inner"), ("kid", "g")])
def test_tensor_of_another_dtype_is_refused(solver: str, key: str, dtype: torch.dtype) -> None:
    _, pre = _trained(solver)
    state = pre.state_dict()
    tensors = state["layers"]["fc1"]["tensors"]
    tensors[key] = tensors[key].to(dtype)
    with pytest.raises(ValueError, match=rf"layer 'fc1'.*{key}.*dtype"):
        _fresh(solver).load_state_dict(seal(state))


def test_negative_kfac_eigenvalues_are_refused() -> None:
    """(e_g e_aᵀ + λ) must be > 0 for the step to go downhill: eigenvalues < 0 never come from eigh_many."""
    _, pre = _trained("kfac")
    state = pre.state_dict()
    state["layers"]["fc2"]["tensors"]["evals_g"][0] = -1.0
    with pytest.raises(ValueError, match="layer 'fc2'.*evals_g.*negative"):
        _fresh("kfac").load_state_dict(seal(state))


def test_every_state_the_library_writes_is_one_it_loads() -> None:
    """The save side of the validation: states of every solver, saved mid-run and between updates, all load."""
    for solver in ("kfac", "sngd", "kid", "kis", "hybrid"):
        model = mlp(0)
        pre = HyLoPreconditioner(model, solver=solver, update_freq=2, rank_ratio=0.5, trend_window=2)
        for step in range(6):
            run(model, pre, [step])
            target = HyLoPreconditioner(mlp(1), solver=solver, update_freq=2, rank_ratio=0.5, trend_window=2)
            target.load_state_dict(pre.state_dict())


# =========================================================================== item 7: options
def test_restore_warns_once_listing_every_option_that_differs() -> None:
    _, pre = _trained("kis", rank_ratio=0.5)
    target = _fresh("kis", damping=0.3, rank_ratio=0.25, seed=9, trend_window=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.load_state_dict(pre.state_dict())
    assert len(caught) == 1
    text = str(caught[0].message)
    for listed in ("damping=0.05 (this preconditioner: 0.3)", "rank_ratio=0.5", "seed=5"):
        assert listed in text, listed
    assert "options='keep'" in text and "trend_window" not in text and "update_freq" not in text
    assert (target.config.damping, target.config.lowrank.rank_ratio, target.config.lowrank.seed) == (0.05, 0.5, 5)
    assert target.config.policy.trend_window == 7  # not an option a load changes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal options: no warning
        _fresh("kis", rank_ratio=0.5).load_state_dict(pre.state_dict())


def test_a_callable_of_this_run_is_kept_and_said_so() -> None:
    _, pre = _trained("kfac")
    target = _fresh("kfac", update_freq=lambda step: 3)
    with pytest.warns(UserWarning, match=r"kept this run's callable update_freq \(the checkpoint has update_freq=2"):
        target.load_state_dict(pre.state_dict())
    assert callable(target.config.update_freq)


def test_keep_keeps_the_constructors_options_and_reseeds() -> None:
    model, pre = _trained("kis", rank_ratio=0.5)
    target = _fresh("kis", damping=0.3, seed=9)
    config = target.config
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(pre.state_dict(), options="keep")
    assert target.config is config
    assert_same_tensors(state_snapshot(target), state_snapshot(pre))  # the state is restored
    assert torch.equal(target.state_dict()["generator"], torch.Generator().manual_seed(9).get_state())


def test_refuse_refuses_a_mismatch_and_changes_nothing() -> None:
    _, pre = _trained("sngd")
    target = _fresh("sngd", damping=0.3)
    before = target.state_dict()
    with pytest.raises(ValueError, match=r"other options: damping=0.05 \(this preconditioner: 0.3\)"):
        target.load_state_dict(pre.state_dict(), options="refuse")
    assert_same_tensors(target.state_dict(), before)
    _fresh("sngd").load_state_dict(pre.state_dict(), options="refuse")  # equal options load


@pytest.mark.parametrize("mode", ["Keep", "", None, 1])
def test_unknown_options_mode_is_refused_eagerly(mode: object) -> None:
    pre = _fresh("kfac")
    with pytest.raises(ValueError, match="options must be one of 'restore', 'keep', 'refuse'"):
        pre.load_state_dict(pre.state_dict(), options=mode)  # type: ignore[arg-type]


def _load_refusing(rank: int, world: int, state: dict[str, Any]) -> tuple[str, bool]:
    """Rank 1 is built with another damping and refuses; every rank raises and none changes."""
    model = mlp(1)
    pre = HyLoPreconditioner(model, solver="kfac", **{**OPTIONS, "damping": 0.05 if rank == 0 else 0.3})
    before = pre.state_dict()
    try:
        pre.load_state_dict(state, options="refuse")
    except ValueError as err:
        unchanged = True
        try:
            assert_same_tensors(pre.state_dict(), before)
        except AssertionError:
            unchanged = False
        return str(err), unchanged
    return "", False


def test_refuse_on_one_rank_refuses_on_every_rank() -> None:
    _, pre = _trained("kfac")
    buffer = io.BytesIO()
    torch.save(pre.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    (msg0, same0), (msg1, same1) = run_distributed(_load_refusing, 2, state, timeout=60)
    assert same0 and same1
    assert "another rank refused" in msg0 and "damping=0.05 (this preconditioner: 0.3)" in msg1


# =========================================================================== truncated files, another solver
@pytest.mark.parametrize("solver", ["kfac", "kfac_adam"])
def test_a_truncated_file_is_refused_naming_it_and_nothing_changes(tmp_path: Path, solver: str) -> None:
    """A file cut short (a copy interrupted, a full disk) at any of 40 lengths, from empty to one byte short: each
    load refuses with a ValueError naming the file, and the preconditioner is as it was."""
    _, pre = _trained(solver)
    path = tmp_path / "hylo.pt"
    hylo.save_checkpoint(pre, path)
    data = path.read_bytes()
    target = _fresh(solver)
    before, progress = target.state_dict(), target.progress()
    cut = tmp_path / "cut.pt"
    for length in sorted({int(i * (len(data) - 1) / 39) for i in range(40)}):
        cut.write_bytes(data[:length])
        with pytest.raises(
            ValueError,
            match=rf"^{re.escape(str(cut))} is not a readable hylo checkpoint \({length} bytes; empty, truncated",
        ):
            hylo.load_checkpoint(target, cut)
        assert_same_tensors(target.state_dict(), before)
        assert target.progress() == progress
    hylo.load_checkpoint(target, path)  # the whole file loads
    assert_same_tensors(state_snapshot(target), state_snapshot(pre))


@pytest.mark.parametrize("into", ["sngd", "kis", "kfac_adam", "hybrid"])
@pytest.mark.parametrize("mode", ["restore", "keep", "refuse"])
def test_a_state_saved_under_another_solver_is_refused_naming_both(tmp_path: Path, into: str, mode: str) -> None:
    """Saved with ``kfac``, loaded into a preconditioner built with another solver, under every ``options`` mode:
    a ValueError naming the file and both solvers; nothing changes."""
    _, pre = _trained("kfac")
    path = tmp_path / "kfac.pt"
    hylo.save_checkpoint(pre, path)
    target = _fresh(into)
    before, progress = target.state_dict(), target.progress()
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: .*solver='kfac', this preconditioner uses '{into}'"
    ):
        hylo.load_checkpoint(target, path, options=mode)
    with pytest.raises(ValueError, match=rf"solver='kfac', this preconditioner uses '{into}'"):
        target.load_state_dict(pre.state_dict(), options=mode)
    assert_same_tensors(target.state_dict(), before)
    assert target.progress() == progress
