"""The trainer's checkpoints under kills, corruption and mix-ups (docs/training-scripts.md, "Checkpoints and resume").

A killed and resumed run leaves hylo's profile and study CSVs as an uninterrupted run would; a
flipped bit in any checkpoint file, or a hylo file of another run, is refused naming the file; a
refused resume writes nothing; a run killed before its first checkpoint restarts with
``--resume``; temporaries of a killed writer are removed.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hylo import HyLoPreconditioner, integrity
from hylo_scripts.training import checkpoint
from hylo_scripts.training import train as train_script
from hylo_scripts.training.checkpoint import RunError
from hylo_scripts.training.engine import RunConfig, train

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[2]
PROFILE_CSVS = ("timing-r0.csv", "steps-r0.csv", "decisions.csv", "grad-norm.csv")


def _fields(log_dir: Path, **fields: Any) -> dict[str, Any]:
    """A tiny hylo run (3 steps an epoch, an update every 2 steps, so epoch 2 ends on a step that is not an update
    and its rows are still queued at the checkpoint), profiled with the gradient-norm study."""
    base: dict[str, Any] = dict(
        model="mlp",
        solver="kis",
        batch_size=250,
        max_steps=3,
        log_dir=str(log_dir),
        checkpoint_freq=1,
        hylo={"update_freq": 2, "studies": ["grad_norm"]},
    )
    return {**base, **fields}


def _run(log_dir: Path, **fields: Any) -> RunConfig:
    return RunConfig(**_fields(log_dir, **fields))


def _rows(path: Path) -> list[dict[str, str]]:
    """A CSV's rows without its time columns (``*_ms``, ``*_time_s``), which differ from run to run."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [{k: v for k, v in row.items() if not k.endswith(("_ms", "_time_s"))} for row in rows]


def _snapshot(log_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(log_dir.iterdir())}


# --------------------------------------------------------------------------- item 2: profile CSVs across a kill
_KILLED_RUN = """
import json, os, sys
import torch
from hylo_scripts.training import checkpoint
from hylo_scripts.training.engine import RunConfig, train
epoch, when = int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(int(sys.argv[4]))  # the test's: the same rounding, bit for bit
save = checkpoint.save_checkpoint
def save_then_die(*args, **kwargs):
    if kwargs["epoch"] == epoch and when == "before":
        os._exit(9)  # like SIGKILL: no finally, no finalizer, queued rows lost
    save(*args, **kwargs)
    if kwargs["epoch"] == epoch and when == "after":
        os._exit(9)
checkpoint.save_checkpoint = save_then_die
train(RunConfig(**json.loads(sys.argv[1])))
"""


def _killed(fields: dict[str, Any], epoch: int, when: str) -> None:
    """Train ``fields`` in a child process killed (``os._exit``) just before or just after the checkpoint of
    ``epoch``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts")]))
    threads = str(torch.get_num_threads())
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, json.dumps(fields), str(epoch), when, threads],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 9, done.stderr[-2000:]


def _same_profile(run: Path, whole: Path) -> None:
    """``run``'s profile CSVs and metrics equal ``whole``'s (times aside): no step missing, none repeated."""
    for name in (*PROFILE_CSVS, "metrics.csv"):
        assert _rows(run / name) == _rows(whole / name), name


def test_profile_rows_queued_at_a_checkpoint_survive_a_kill_right_after_it(tmp_path: Path) -> None:
    """Epoch 2 ends on a step that is not an update: its rows are queued when checkpoint 2 is written, and the
    process is killed before the next update would have flushed them."""
    train(_run(tmp_path / "whole", epochs=3))
    _killed(_fields(tmp_path / "part", epochs=3), 2, "after")
    assert checkpoint.latest_checkpoint(tmp_path / "part") == (2, tmp_path / "part" / "checkpoint-0002.pt")
    assert [row["step"] for row in _rows(tmp_path / "part" / "steps-r0.csv")] == [str(s) for s in range(6)]
    train(_run(tmp_path / "part", epochs=3), resume=True)
    _same_profile(tmp_path / "part", tmp_path / "whole")
    assert [int(row["step"]) for row in _rows(tmp_path / "part" / "steps-r0.csv")] == list(range(9))
    assert len(json.loads((tmp_path / "part" / "run.json").read_text())["resumed"]) == 1


def test_profile_rows_written_after_the_checkpoint_are_dropped_on_resume(tmp_path: Path) -> None:
    train(_run(tmp_path / "whole", epochs=3))
    part = tmp_path / "part"
    train(_run(part, epochs=3))
    for path in part.glob("checkpoint-0003*"):
        path.unlink()  # as if killed after epoch 3's rows were written and before its checkpoint
    train(_run(part, epochs=3), resume=True)
    _same_profile(part, tmp_path / "whole")


def test_flush_profile_puts_every_queued_row_on_disk_and_rewind_cuts_back_to_it(tmp_path: Path) -> None:
    """The library's side of it: ``flush_profile()`` at a checkpoint, ``rewind_profile`` at the resume."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=2, profile_dir=tmp_path, studies=("grad_norm",))
    for _ in range(3):  # an update, an apply, an update
        model(torch.randn(8, 4)).square().sum().backward()
        pre.step()
    model(torch.randn(8, 4)).square().sum().backward()
    pre.step()  # an apply step: its rows are queued
    sizes = pre.flush_profile()
    assert sizes == {name: (tmp_path / name).stat().st_size for name in sizes}
    assert [row["step"] for row in _rows(tmp_path / "steps-r0.csv")] == ["0", "1", "2", "3"]
    assert {row["step"] for row in _rows(tmp_path / "grad-norm.csv")} == {"0", "1", "2", "3"}
    for _ in range(2):
        model(torch.randn(8, 4)).square().sum().backward()
        pre.step()
    pre.close()
    assert HyLoPreconditioner.profile_files(tmp_path) == sorted([*sizes, "run.json"])
    assert HyLoPreconditioner.rewind_profile(tmp_path, sizes) == list(sizes)  # every file had rows past the flush
    assert {name: (tmp_path / name).stat().st_size for name in sizes} == sizes
    with pytest.raises(ValueError, match="shorter"):
        HyLoPreconditioner.rewind_profile(tmp_path, {"steps-r0.csv": sizes["steps-r0.csv"] + 1})
    with pytest.raises(ValueError, match="not one of hylo's CSV files"):
        HyLoPreconditioner.rewind_profile(tmp_path, {"../elsewhere.csv": 0})


# --------------------------------------------------------------------------- item 4: flipped bits
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run after one epoch, with its checkpoint (not to be modified: copy it)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(_run(run, epochs=1))
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


@pytest.mark.parametrize("name", ["checkpoint-0001.pt", "checkpoint-0001-hylo-r0.pt"])
def test_a_flipped_bit_anywhere_in_a_checkpoint_file_is_never_loaded(
    saved_run: Path, tmp_path: Path, name: str
) -> None:
    """Every one of 160 single-bit flips, spread over the whole file, is refused with a ValueError naming the file,
    or (a flip in bytes the format ignores, such as the zip records' alignment padding) loads the very same
    contents."""
    original = (saved_run / name).read_bytes()
    digest = integrity.checksum(checkpoint.load(saved_run / name))
    path = tmp_path / name
    refused = 0
    for i in range(160):
        position = i * (len(original) - 1) // 159
        flipped = bytearray(original)
        flipped[position] ^= 1 << (i % 8)
        path.write_bytes(bytes(flipped))
        try:
            loaded = checkpoint.load(path)
        except ValueError as err:
            assert str(path) in str(err), err
            refused += 1
        else:
            assert integrity.checksum(loaded) == digest, f"a flip at byte {position} was loaded"
    assert refused >= 120  # most bytes carry contents


def test_a_corrupted_checkpoint_is_refused_by_the_script_naming_it_and_the_fix(
    saved_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(saved_run, tmp_path / "run")
    path = run / "checkpoint-0001.pt"
    state = torch.load(path, weights_only=True)
    weight = next(iter(state["model"].values()))
    data = bytearray(path.read_bytes())
    at = bytes(data).find(weight.numpy().tobytes()[:16])  # a byte of the first weight tensor's storage
    assert at > 0
    data[at + 3] ^= 0x10
    path.write_bytes(bytes(data))
    before = _snapshot(run)
    flags = ["--model", "mlp", "--solver", "kis", "--batch-size", "250", "--max-steps", "3", "--freq", "2"]
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([*flags, "--grad-norm", "--epochs", "2", "--log-dir", str(run), "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {path} is corrupted" in err and "to restart the run from scratch, delete" in err
    assert "Traceback" not in err
    assert _snapshot(run) == before


# --------------------------------------------------------------------------- item 8: the run's files tied together
def test_a_hylo_file_of_another_run_is_refused_naming_it(saved_run: Path, tmp_path: Path) -> None:
    run = _copy(saved_run, tmp_path / "run")
    other = tmp_path / "other"
    train(_run(other, epochs=1, seed=1))  # the same model, another seed: hylo would load its state
    shutil.copy(other / "checkpoint-0001-hylo-r0.pt", run / "checkpoint-0001-hylo-r0.pt")
    before = _snapshot(run)
    with pytest.raises(RunError, match=r"checkpoint-0001-hylo-r0\.pt belongs to another run \(run id '[0-9a-f]{32}'"):
        train(_run(run, epochs=2), resume=True)
    assert _snapshot(run) == before
    shutil.copy(saved_run / "checkpoint-0001-hylo-r0.pt", run / "checkpoint-0001-hylo-r0.pt")
    assert [e.epoch for e in train(_run(run, epochs=2), resume=True).log] == [2]


# --------------------------------------------------------------------------- item 13: failed resumes, restarts, temporaries
def test_a_resume_hylo_refuses_changes_no_file(saved_run: Path, tmp_path: Path) -> None:
    """hylo's refusal (here: a layer of another size, sealed as if genuine) comes before hylo's run.json gets its
    "resumed" entry, and before metrics.csv or the profile files are cut back."""
    run = _copy(saved_run, tmp_path / "run")
    path = run / "checkpoint-0001-hylo-r0.pt"
    contents = torch.load(path, weights_only=True)
    layer = next(iter(contents["hylo"]["layers"].values()))
    layer["d_a"] += 1
    torch.save(integrity.seal(contents), path)
    with (run / "metrics.csv").open("a") as handle:
        handle.write("2,6,0.1,0.5,0.5,0.5,1.0,2.0,0.1\n")  # as if killed after epoch 2's row
    (run / ".checkpoint-0002.pt.k3j2_x.tmp").write_bytes(b"partial")
    before = _snapshot(run)
    with pytest.raises(RunError, match=r"checkpoint-0001-hylo-r0\.pt: hylo refuses the state: .*delete"):
        train(_run(run, epochs=2), resume=True)
    assert _snapshot(run) == before
    assert "resumed" not in json.loads((run / "run.json").read_text())


def test_a_run_killed_before_its_first_checkpoint_restarts_with_resume(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    train(_run(whole, epochs=1))
    run = tmp_path / "run"
    train(_run(run, epochs=1))
    for path in run.glob("checkpoint-0001*"):
        path.unlink()  # as if killed before its first checkpoint: config, metrics and hylo's files remain
    (run / ".config.json.tmp").write_text("{")
    (run / ".checkpoint-0001-hylo-r0.pt.0a1b2c.tmp").write_bytes(b"partial")
    with pytest.raises(RunError, match="stopped before its first checkpoint .*restart it from scratch with --resume"):
        train(_run(run, epochs=1))
    result = train(_run(run, epochs=1), resume=True)
    assert [e.epoch for e in result.log] == [1]
    for name in (*PROFILE_CSVS, "metrics.csv"):
        assert _rows(run / name) == _rows(whole / name), name
    assert "resumed" not in json.loads((run / "run.json").read_text())
    assert not list(run.glob("*.tmp")) and not list(run.glob(".*tmp"))


def test_resume_refuses_a_directory_without_a_run_or_without_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="nothing to resume: .* holds no run"):
        train(_run(tmp_path / "empty", epochs=1), resume=True)
    train(_run(tmp_path / "run", epochs=1, checkpoint_freq=0))
    before = _snapshot(tmp_path / "run")
    with pytest.raises(RunError, match="wrote no checkpoints .*checkpoint_freq 0.*another log_dir"):
        train(_run(tmp_path / "run", epochs=2), resume=True)
    with pytest.raises(RunError, match="holds another run .*which wrote no checkpoints .*choose another log_dir"):
        train(_run(tmp_path / "run", epochs=2))
    assert _snapshot(tmp_path / "run") == before


def test_a_resume_removes_temporaries_and_an_incomplete_checkpoints_hylo_files(saved_run: Path, tmp_path: Path) -> None:
    run = _copy(saved_run, tmp_path / "run")
    left = [".checkpoint-0002.pt.x8y9z0.tmp", ".dataset.json.tmp", "run.json.tmp", "checkpoint-0002-hylo-r0.pt"]
    for name in left:
        (run / name).write_bytes(b"partial")
    (run / "notes.tmp").write_text("the user's")
    train(_run(run, epochs=2), resume=True)
    assert not list(run.glob(".*tmp")) and not (run / "run.json.tmp").exists()
    assert (run / "notes.tmp").exists()  # only the trainer's and hylo's temporaries are removed
    assert (
        checkpoint.load(run / "checkpoint-0002-hylo-r0.pt")["run_id"]
        == checkpoint.load(run / "checkpoint-0002.pt")["run_id"]
    )


# --------------------------------------------------------------------------- issue 56: other solvers, cut files, mix-ups
def _final_state(run: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's weights and hylo's state in ``run``'s last checkpoint, without what names the run's directory
    (``profile_dir``, ``profile_append``) and the checksum of it all."""
    epoch, path = checkpoint.latest_checkpoint(run) or (0, run)
    state = dict(checkpoint.load(path.with_name(f"checkpoint-{epoch:04d}-hylo-r0.pt"))["hylo"])
    state["config"] = {k: v for k, v in state["config"].items() if k not in ("profile_dir", "profile_append")}
    return checkpoint.load(path)["model"], {k: v for k, v in state.items() if k != integrity.CHECKSUM_KEY}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("solver", ["kfac_adam", "hybrid"])
def test_a_killed_run_resumes_bit_for_bit_under_kfac_adam_and_hybrid(tmp_path: Path, solver: str, when: str) -> None:
    """Killed just before or just after epoch 2's checkpoint and resumed: the metrics, the profile CSVs, the final
    weights and hylo's final state equal the uninterrupted run's, bit for bit."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    train(_run(whole, epochs=3, solver=solver))
    _killed(_fields(part, epochs=3, solver=solver), 2, when)
    assert checkpoint.latest_checkpoint(part) == (2 if when == "after" else 1, ANY_PATH)
    train(_run(part, epochs=3, solver=solver), resume=True)
    _same_profile(part, whole)
    (model, state), (model_whole, state_whole) = _final_state(part), _final_state(whole)
    assert model.keys() == model_whole.keys() and all(torch.equal(model[k], model_whole[k]) for k in model)
    assert integrity.checksum(state) == integrity.checksum(state_whole)


class _AnyPath:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Path)


ANY_PATH: Any = _AnyPath()


@pytest.mark.parametrize("name", ["checkpoint-0001.pt", "checkpoint-0001-hylo-r0.pt"])
def test_a_truncated_checkpoint_is_refused_by_the_script_naming_it_and_nothing_changes(
    saved_run: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trainer's file or hylo's, cut at 0 bytes, a few bytes, half and one byte short: ``train`` refuses with a
    RunError naming the file and what to do, the script exits with status 2 saying so, and no file changes."""
    run = _copy(saved_run, tmp_path / "run")
    path = run / name
    data = path.read_bytes()
    for length in (0, 7, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:length])
        before = _snapshot(run)
        with pytest.raises(RunError, match=rf"{name} is not a readable checkpoint \({length} bytes; empty, truncated"):
            train(_run(run, epochs=2), resume=True)
        assert _snapshot(run) == before
    flags = ["--model", "mlp", "--solver", "kis", "--batch-size", "250", "--max-steps", "3", "--freq", "2"]
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([*flags, "--grad-norm", "--epochs", "2", "--log-dir", str(run), "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {path} is not a readable checkpoint" in err and "delete" in err and "Traceback" not in err
    assert _snapshot(run) == before
    path.write_bytes(data)
    assert [e.epoch for e in train(_run(run, epochs=2), resume=True).log] == [2]


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam", "hybrid"])
def test_resuming_with_another_solver_is_refused_naming_both(saved_run: Path, tmp_path: Path, solver: str) -> None:
    """The run was saved under ``kis``: a resume under another ``--solver`` is refused naming the change, and no
    file changes."""
    run = _copy(saved_run, tmp_path / "run")
    before = _snapshot(run)
    with pytest.raises(
        RunError, match=rf"checkpoint-0001\.pt was made with a different configuration \(solver 'kis' -> '{solver}'"
    ):
        train(_run(run, epochs=2, solver=solver), resume=True)
    assert _snapshot(run) == before
    flags = ["--model", "mlp", "--solver", solver, "--batch-size", "250", "--max-steps", "3", "--freq", "2"]
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([*flags, "--grad-norm", "--epochs", "2", "--log-dir", str(run), "--resume"])
    assert exit_info.value.code == 2
    assert _snapshot(run) == before


def test_a_hylo_file_saved_under_another_solver_is_refused_naming_it(saved_run: Path, tmp_path: Path) -> None:
    """hylo's state in this run's file replaced by a ``kfac`` run's (resealed, so that neither the checksum nor the
    run id catches it): refused by hylo naming the file and both solvers, and no file changes."""
    run = _copy(saved_run, tmp_path / "run")
    other = tmp_path / "other"
    train(_run(other, epochs=1, solver="kfac"))
    ours = checkpoint.load(run / "checkpoint-0001-hylo-r0.pt")
    ours["hylo"] = checkpoint.load(other / "checkpoint-0001-hylo-r0.pt")["hylo"]
    torch.save(integrity.seal(ours), run / "checkpoint-0001-hylo-r0.pt")
    before = _snapshot(run)
    with pytest.raises(
        RunError,
        match=r"checkpoint-0001-hylo-r0\.pt: hylo refuses the state: .*solver='kfac', this preconditioner uses 'kis'",
    ):
        train(_run(run, epochs=2), resume=True)
    assert _snapshot(run) == before
