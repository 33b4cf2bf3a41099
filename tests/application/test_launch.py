"""The torchrun launcher and the training script run end to end on CPU with gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], tmp_path: Path) -> str:
    # The entry points import hylo_scripts beside them and hylo (installed, or the root on PYTHONPATH).
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONPATH=python_path,
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("solver", ["hybrid", "kfac"])
def test_torchrun_two_ranks_trains_and_writes_csv(tmp_path: Path, solver: str) -> None:
    log_dir = tmp_path / "run"
    argv = ["--solver", solver, "--epochs", "1", "--max-steps", "3", "--log-dir", str(log_dir)]
    stdout = _run(["bash", "scripts/launch_mnist.sh", *argv], tmp_path)
    assert "world_size=2" in stdout
    assert "ranks 2" in stdout
    lines = (log_dir / "metrics.csv").read_text().splitlines()
    assert lines[0].startswith("epoch,step,lr,train_loss") and len(lines) == 2


def test_one_process_and_two_ranks_see_the_same_first_step(tmp_path: Path) -> None:
    """The global batch is split across ranks, so step 1's loss is the same for P = 1 and P = 2."""
    args = ["--solver", "sngd", "--epochs", "1", "--max-steps", "1", "--kl-clip", "0"]
    one = _run([sys.executable, "scripts/train.py", *args, "--log-dir", str(tmp_path / "one")], tmp_path)
    two = _run(["bash", "scripts/launch_mnist.sh", *args, "--log-dir", str(tmp_path / "two")], tmp_path)
    assert one and two
    row_one = (tmp_path / "one" / "metrics.csv").read_text().splitlines()[1].split(",")
    row_two = (tmp_path / "two" / "metrics.csv").read_text().splitlines()[1].split(",")
    assert abs(float(row_one[5]) - float(row_two[5])) <= 0.002  # test_acc
    assert abs(float(row_one[3]) - float(row_two[3])) <= 1e-5  # train_loss: mean over both ranks' halves
