"""The scripts' shared engine: config checks, schedule, model registry, CSV log, train.py smoke run."""

from __future__ import annotations

import ast
import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.engine import RunConfig, lr_schedule, train
from scripts.models import MODELS, models_for

ROOT = Path(__file__).resolve().parents[1]
CSV_HEADER = ["epoch", "step", "train_loss", "test_loss", "test_acc", "seconds", "ranks"]


def test_run_config_normalises_and_checks() -> None:
    cfg = RunConfig(solver="none", kl_clip=0.0)
    assert cfg.solver is None and cfg.kl_clip is None and cfg.name == "sgd"
    assert RunConfig(solver="kfac").name == "hylo-kfac"
    with pytest.raises(ValueError, match="solver"):
        RunConfig(solver="adam")
    with pytest.raises(ValueError, match="does not fit"):
        RunConfig(model="resnet32")  # 3×32×32 inputs, the default dataset has 1×28×28
    with pytest.raises(ValueError, match="unknown dataset"):
        RunConfig(dataset="nope")


def test_lr_schedule_warms_up_then_decays_to_zero() -> None:
    lr_at = lr_schedule(0.1, total_steps=20, warmup_steps=4)
    assert [lr_at(s) for s in range(4)] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    after = [lr_at(s) for s in range(4, 21)]
    assert after[0] == pytest.approx(0.1) and after[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(after, after[1:], strict=False))
    assert lr_at(12) == pytest.approx(0.05)  # half-way through the cosine


def test_model_registry_entries_match_their_shapes() -> None:
    assert models_for((1, 28, 28), 10) == ["cnn", "mlp"]
    for name, spec in MODELS.items():
        torch.manual_seed(0)
        x, _ = spec.random_batch(2, side=32 if name == "resnet50" else None)
        assert spec.build()(x).shape == (2, spec.num_classes), name


def test_engine_logs_one_csv_row_per_epoch(tmp_path: Path) -> None:
    pytest.importorskip("mlxtend")
    out = tmp_path / "log" / "run.csv"
    result = train(RunConfig(model="mlp", epochs=2, lr=0.05), csv_path=out)
    with out.open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == CSV_HEADER and len(rows) == 3
    assert [int(r[1]) for r in rows[1:]] == [8, 16] and {r[6] for r in rows[1:]} == {"1"}
    assert result.steps == 16 and len(result.log) == 2
    assert float(rows[2][2]) == result.train_loss and float(rows[2][4]) == result.test_accuracy
    assert result.train_loss < result.log[0].train_loss  # epoch means, and training makes progress


def test_engine_with_preconditioner_stops_at_max_steps() -> None:
    pytest.importorskip("mlxtend")
    result = train(RunConfig(model="mlp", solver="kfac", epochs=3, max_steps=3))
    assert result.steps == 3 and len(result.log) == 1
    assert math.isfinite(result.train_loss) and math.isfinite(result.test_loss)


def test_train_script_runs_with_the_plain_optimizer(tmp_path: Path) -> None:
    pytest.importorskip("mlxtend")
    out = tmp_path / "train.csv"
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "scripts/train.py", "--solver", "none", "--max-steps", "2", "--out", str(out)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=python_path, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "HyLoPreconditioner" not in done.stdout and "epoch 0 step 2" in done.stdout
    lines = out.read_text().splitlines()
    assert lines[0] == ",".join(CSV_HEADER) and len(lines) == 2 and lines[1].startswith("0,2,")


def test_scripts_neither_edit_sys_path_nor_import_hylo_internals() -> None:
    for path in sorted((ROOT / "scripts").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        assert "sys.path" not in ast.unparse(tree), path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(name.startswith("hylo.") for name in names), f"{path.name} imports {names}"
