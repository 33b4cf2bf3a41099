"""The training engine end to end: schedules, flags -> config, every model on its dataset's fixture,
log directories, checkpoints and exact resume (one process and two ranks), bad input."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hylo import integrity
from hylo_scripts.models.registry import build_model
from hylo_scripts.training import checkpoint
from hylo_scripts.training import train as train_script
from hylo_scripts.training import train_lm as lm_script
from hylo_scripts.training import train_segmentation as seg_script
from hylo_scripts.training.checkpoint import RunError
from hylo_scripts.training.engine import RunConfig, make_preconditioner, metrics_header, train
from hylo_scripts.training.hylo_options import ADAPTIVE_LR
from hylo_scripts.training.options import build_parser, config_from_args
from hylo_scripts.training.schedules import damping_schedule, lr_factor
from tests.kit import fixtures
from tests.kit.internals import option_actions

ROOT = Path(__file__).resolve().parents[2]
TIME_COLUMNS = {"epoch_time_s", "total_time_s", "precondition_time_s"}


# --------------------------------------------------------------------------- schedules
def test_step_schedule_warms_up_then_decays_at_milestones() -> None:
    factor = lr_factor("step", total_steps=100, warmup_steps=4, milestones=[10, 30], decay=0.3)
    assert [factor(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert [factor(s) for s in (4, 9, 10, 29, 30, 99)] == pytest.approx([1, 1, 0.3, 0.3, 0.09, 0.09])


def test_cosine_schedule_reaches_zero_at_the_end() -> None:
    factor = lr_factor("cosine", total_steps=20, warmup_steps=4)
    after = [factor(s) for s in range(4, 21)]
    assert after[0] == pytest.approx(1.0) and after[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(after, after[1:], strict=False))
    assert factor(12) == pytest.approx(0.5)  # half-way through the cosine
    with pytest.raises(ValueError, match="lr schedule"):
        lr_factor("linear", total_steps=10, warmup_steps=0)


def test_damping_decays_log_linearly_after_the_warm_up() -> None:
    at = damping_schedule(1.5, 0.1, warmup_steps=5, decay_steps=10)
    assert at(0) == at(5) == 1.5
    assert at(10) == pytest.approx(math.sqrt(1.5 * 0.1))  # half-way: the geometric mean
    assert at(15) == pytest.approx(0.1) and at(1000) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="> 0"):
        damping_schedule(1.0, 0.0, warmup_steps=0, decay_steps=1)


# --------------------------------------------------------------------------- flags -> config
def _config(*argv: str, script: Any = train_script) -> RunConfig:
    parser = build_parser(
        "test", task="classification" if script is train_script else "segmentation", defaults=script.DEFAULTS
    )
    return config_from_args(parser.parse_args(list(argv)), parser)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], {"dataset": "mnist5k", "model": "cnn", "solver": "hybrid", "optimizer": "sgd", "lr_schedule": "step"}),
        (["--solver", "none"], {"solver": None}),
        (["--sngd"], {"solver": "sngd"}),
        (["--optimizer", "adamw"], {"optimizer": "adamw"}),
        (["--compression-ratio", "0.25"], {"rank_ratio": 0.25}),
        (["--rank-ratio", "0.5"], {"rank_ratio": 0.5}),
        (["--freq", "13"], {"update_freq": 13}),
        (["--milestone", "3", "5", "--lr-decay", "0.3"], {"milestones": (3, 5), "lr_decay": 0.3}),
        (["--lr-schedule", "cosine"], {"lr_schedule": "cosine"}),
        (["--damping", "1.5", "--target-damping", "0.1"], {"damping": 1.5, "target_damping": 0.1}),
        (["--target-damping", "0.1", "--damping-decay-epochs", "9"], {"damping_decay_epochs": 9.0}),
        (["--label-smoothing", "0.1"], {"label_smoothing": 0.1}),
        (["--kl-clip", "0"], {"kl_clip": None}),
        (["--adaptive", "1", "2", "3"], {"adaptive": (1, 2, 3)}),
        (["--trend-window", "4"], {"trend_window": 4}),
        (["--solver", "kfac", "--grad-norm", "--log-dir", "x", "--trend-window", "4"], {"trend_window": 4}),
        (["--max-steps", "3", "--epochs", "2", "--batch-size", "64"], {"max_steps": 3, "epochs": 2, "batch_size": 64}),
        (["--backend", "gloo", "--seed", "4", "--data-seed", "5"], {"backend": "gloo", "seed": 4, "data_seed": 5}),
        (["--warmup-epochs", "0", "--momentum", "0.5", "--weight-decay", "0"], {"warmup_epochs": 0, "momentum": 0.5}),
        (["--dataset", "cifar10", "--data-dir", "d", "--model", "resnet32"], {"data_dir": "d", "model": "resnet32"}),
        (["--log-dir", "x"], {"log_dir": "x", "checkpoint_freq": 5}),
        (["--log-dir", "x", "--checkpoint-freq", "0"], {"checkpoint_freq": 0}),
    ],
)
def test_each_flag_sets_its_field(argv: list[str], expected: dict[str, Any]) -> None:
    cfg = _config(*argv)
    assert {name: cfg.value(name) for name in expected} == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sngd", "--solver", "kid"], "--sngd trains with SNGD"),
        (["--lr-schedule", "cosine", "--milestone", "3"], "belong to --lr-schedule step"),
        (["--solver", "none", "--damping", "1"], "--damping: hylo options, not used by --solver none"),
        (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum: SGD's"),
        (["--data-dir", "somewhere"], "reads no directory"),
        (["--image-size", "64"], "--image-size: only for imagenet and lgg"),
        (["--checkpoint-freq", "2"], "--checkpoint-freq: needs --log-dir"),
        (["--resume"], "--resume: needs --log-dir"),
        (["--solver", "kid", "--adaptive", "1", "2", "3"], "--adaptive sets the hybrid policy's windows"),
        (["--damping-decay-epochs", "3"], "needs --target-damping"),
        (["--solver", "kfac", "--trend-window", "4"], "read by --solver hybrid or --grad-norm, not kfac"),
        (["--solver", "none", "--trend-window", "4"], "--trend-window: hylo options"),
        (["--dataset", "cifar10"], "needs data_dir"),
        (["--model", "unet"], "invalid choice: 'unet'"),  # train.py offers the classifiers only
    ],
)
def test_flags_that_would_be_ignored_or_contradict_are_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _config(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for script in (train_script, seg_script):
        with pytest.raises(SystemExit):
            script.main(["--help"])
        out = capsys.readouterr().out
        parser = build_parser("x", task="classification", defaults={})
        for action in option_actions(parser):
            if action.option_strings and action.dest != "help":
                assert action.help, f"{action.option_strings} has no help"
        for flag in (
            "--data-dir",
            "--lr-decay",
            "--milestone",
            "--target-damping",
            "--damping-decay-epochs",
            "--resume",
        ):
            assert flag in out


# --------------------------------------------------------------------------- the default lr per solver family
def _lm_config(*argv: str) -> RunConfig:
    parser = build_parser("test", task="lm", defaults=lm_script.DEFAULTS)
    return config_from_args(parser.parse_args(list(argv)), parser)


@pytest.mark.parametrize(
    ("argv", "lr"),
    [
        ([], 0.1),  # hybrid
        (["--solver", "kfac"], 0.1),
        (["--solver", "none"], 0.1),
        (["--sngd"], 0.1),
        (["--solver", "kfac_adam"], ADAPTIVE_LR),  # Adam-scaled: at SGD's 0.1 it diverged
        (["--solver", "kfac_adam", "--lr", "0.05"], 0.05),  # an explicit --lr always wins
        (["--solver", "kfac_adam", "--lr", "0.1"], 0.1),
        (["--solver", "kfac", "--lr", "0.01"], 0.01),
    ],
)
def test_the_default_lr_is_the_solver_familys_and_an_explicit_lr_wins(argv: list[str], lr: float) -> None:
    assert _config(*argv).lr == lr
    assert _config(*argv, "--data-dir", "d", script=seg_script).lr == lr


def test_the_language_models_default_lr_is_adams_for_every_solver() -> None:
    assert {_lm_config("--solver", s).lr for s in ("kfac", "kfac_adam", "hybrid", "none")} == {1e-3}
    assert _lm_config("--solver", "kfac_adam", "--lr", "4e-3").lr == 4e-3


def test_help_states_the_default_lr_of_each_solver_family(capsys: pytest.CaptureFixture[str]) -> None:
    for script, expected in (
        (train_script, "default: 0.1; 0.01 with --solver kfac_adam, whose step is Adam-scaled"),
        (seg_script, "default: 0.1; 0.01 with --solver kfac_adam, whose step is Adam-scaled"),
        (lm_script, "default: 0.001 with every solver"),
    ):
        with pytest.raises(SystemExit):
            script.main(["--help"])
        squeeze = "".join  # argparse wraps the help, at spaces and after hyphens
        assert squeeze(expected.split()) in squeeze(capsys.readouterr().out.split())


def test_kfac_adam_at_its_default_lr_learns_on_the_offline_dataset() -> None:
    """train.py --solver kfac_adam at its default lr: 8 steps of the offline MNIST subset learn (at SGD's 0.1, the
    old default, the same run ended at a train loss of 5.6 and 22% test accuracy; over 5 epochs, 1,656 and 27%)."""
    torch.set_num_threads(2)
    cfg = _config("--solver", "kfac_adam", "--epochs", "1", "--max-steps", "8", "--warmup-epochs", "0")
    assert cfg.lr == ADAPTIVE_LR
    (entry,) = train(cfg).log
    assert entry.train_loss < math.log(10) and entry.test_metric > 0.7, entry


def test_a_model_that_cannot_take_the_datasets_inputs_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit the classification dataset"):
        RunConfig(model="unet")
    with pytest.raises(ValueError, match=r"does not take 'digits' inputs \(1, 8, 8\)"):
        train(RunConfig(dataset="digits", model="resnet50", batch_size=8, epochs=1))


def test_target_damping_becomes_hylos_damping_schedule() -> None:
    cfg = RunConfig(
        model="mlp", solver="kfac", hylo={"damping": 2.0}, target_damping=0.5, damping_decay_epochs=1, warmup_epochs=0
    )
    pre = make_preconditioner(build_model("mlp"), cfg, lambda _step: 0.1, steps_per_epoch=4)
    assert pre is not None
    try:
        damping = pre.config.damping
        assert callable(damping) and [damping(s) for s in (0, 2, 4, 9)] == pytest.approx([2.0, 1.0, 0.5, 0.5])
    finally:
        pre.remove()


def test_trend_window_reaches_hylo() -> None:
    cfg = RunConfig(model="mlp", solver="hybrid", hylo={"trend_window": 7})
    pre = make_preconditioner(build_model("mlp"), cfg, lambda _step: 0.1, steps_per_epoch=4)
    assert pre is not None
    try:
        assert pre.config.policy.trend_window == 7
    finally:
        pre.remove()


# --------------------------------------------------------------------------- every model on its fixture
def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def _fixture(dataset: str, root: Path) -> tuple[str | None, dict[str, Any]]:
    """(data_dir, extra RunConfig fields) of a small on-disk fixture for ``dataset``."""
    if dataset == "fashion-mnist":
        return str(fixtures.write_fashion_mnist(root, n_train=32, n_test=16, gz=True).data_dir), {}
    if dataset == "cifar10":
        return str(fixtures.write_cifar10(root, n_train_per_batch=8, n_test=16).data_dir), {}
    if dataset == "cifar100":
        return str(fixtures.write_cifar100(root, n_train=40, n_test=16).data_dir), {}
    if dataset == "imagenet":
        folders = fixtures.write_imagenet(root, classes=["n01", "n02", "n03"], per_class=6, size=40)
        return str(folders.data_dir), {"image_size": 32}
    if dataset == "lgg":
        return str(fixtures.write_lgg(root, cases=5, slices=5, size=32).data_dir), {"image_size": 32}
    return None, {}


@pytest.mark.parametrize(
    ("model", "dataset", "solver"),
    [
        ("cnn", "digits", "hybrid"),
        ("3c1f", "fashion-mnist", "kid"),
        ("resnet20", "cifar10", "kfac"),
        ("resnet32", "cifar10", "hybrid"),
        ("resnet56", "cifar10", "kis"),
        ("densenet", "cifar100", "hybrid"),
        ("resnet50", "imagenet", "hybrid"),
        ("unet", "lgg", "hybrid"),
    ],
)
def test_each_model_trains_a_short_epoch_on_its_fixture(model: str, dataset: str, solver: str, tmp_path: Path) -> None:
    torch.set_num_threads(2)
    data_dir, extra = _fixture(dataset, tmp_path / "data")
    log_dir = tmp_path / "run"
    cfg = RunConfig(
        dataset=dataset,
        data_dir=data_dir,
        model=model,
        solver=solver,
        batch_size=8,
        epochs=1,
        max_steps=2,
        hylo={"update_freq": 2},  # an update step, then a step that applies the held state
        log_dir=str(log_dir),
        checkpoint_freq=1,
        **extra,
    )
    result = train(cfg)
    assert result.steps == 2 and len(result.log) == 1
    rows = _rows(log_dir / "metrics.csv")
    assert list(rows[0]) == metrics_header(cfg.task) and len(rows) == 1
    metric = "test_dsc" if dataset == "lgg" else "test_acc"
    assert 0.0 <= float(rows[0][metric]) <= 1.0 and math.isfinite(float(rows[0]["train_loss"]))
    assert float(rows[0]["precondition_time_s"]) > 0
    assert {"config.json", "model-summary.txt", "checkpoint-0001.pt", "checkpoint-0001-hylo-r0.pt"} <= {
        p.name for p in log_dir.iterdir()
    }


# --------------------------------------------------------------------------- log dirs, checkpoints, resume
def _mnist(log_dir: Path, **fields: Any) -> RunConfig:
    base: dict[str, Any] = dict(
        model="mlp", solver="kis", batch_size=250, max_steps=3, log_dir=str(log_dir), checkpoint_freq=1
    )
    base.update(fields)
    hylo = {"update_freq": 2, **base.pop("hylo", {})} if base["solver"] else {}
    return RunConfig(**base, hylo=hylo)


def _without_times(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIME_COLUMNS} for row in rows]


def test_a_checkpoint_is_a_weights_only_file_with_every_part(tmp_path: Path) -> None:
    train(_mnist(tmp_path / "run", epochs=1))
    state = torch.load(tmp_path / "run" / "checkpoint-0001.pt", weights_only=True)
    parts = {"model", "optimizer", "scheduler", "rng", "config", "epoch", "step", "world", "metrics_bytes", "run_id"}
    assert parts <= set(state) and state["format"] == checkpoint.FORMAT
    assert state["epoch"] == 1 and state["step"] == 3 and state["scheduler"]["last_epoch"] == 3
    hylo_file = torch.load(tmp_path / "run" / "checkpoint-0001-hylo-r0.pt", weights_only=True)
    assert hylo_file["hylo"]["steps"] == 3 and hylo_file["run_id"] == state["run_id"]
    integrity.verify(state, "rank 0's file")  # both sealed with a checksum of their contents
    integrity.verify(hylo_file, "the hylo file")
    assert checkpoint.latest_checkpoint(tmp_path / "run") == (1, tmp_path / "run" / "checkpoint-0001.pt")
    assert not list((tmp_path / "run").glob(".*tmp"))  # no temporary file left behind


@pytest.mark.parametrize("solver", ["kis", None])
def test_resume_continues_exactly_like_the_uninterrupted_run(tmp_path: Path, solver: str | None) -> None:
    extra = {"target_damping": 0.05, "milestones": (2,)} if solver else {"milestones": (2,)}
    whole = train(_mnist(tmp_path / "whole", epochs=3, solver=solver, **extra))
    train(_mnist(tmp_path / "part", epochs=1, solver=solver, **extra))
    resumed = train(_mnist(tmp_path / "part", epochs=3, solver=solver, **extra), resume=True)
    assert [e.epoch for e in resumed.log] == [2, 3]
    assert _without_times(_rows(tmp_path / "part" / "metrics.csv")) == _without_times(
        _rows(tmp_path / "whole" / "metrics.csv")
    )
    assert resumed.log[-1].train_loss == whole.log[-1].train_loss  # bit for bit


def test_resume_drops_rows_written_after_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(_mnist(run, epochs=2))
    expected = _without_times(_rows(run / "metrics.csv"))
    for path in run.glob("checkpoint-0002*"):
        path.unlink()  # as if the process died after logging epoch 2 and before its checkpoint
    train(_mnist(run, epochs=2), resume=True)
    assert _without_times(_rows(run / "metrics.csv")) == expected


def test_a_checkpoint_from_before_an_option_existed_resumes_with_its_default(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(_mnist(run, epochs=1))
    path = run / "checkpoint-0001.pt"
    state = torch.load(path, weights_only=True)
    del state["config"]["hylo"]["trend_window"]  # as written before --trend-window existed
    torch.save(integrity.seal(state), path)
    with pytest.raises(RunError, match=r"trend_window 100 -> 5"):
        train(_mnist(run, epochs=2, hylo={"trend_window": 5}), resume=True)
    assert [e.epoch for e in train(_mnist(run, epochs=2), resume=True).log] == [2]


def test_a_checkpoint_of_the_old_configuration_shape_is_refused(tmp_path: Path) -> None:
    """Before RunConfig.hylo, hylo's options were fields of the configuration: such a checkpoint is not resumed."""
    run = tmp_path / "run"
    train(_mnist(run, epochs=1))
    path = run / "checkpoint-0001.pt"
    state = torch.load(path, weights_only=True)
    state["config"].update(state["config"].pop("hylo"))  # the old shape: the options beside the fields
    torch.save(integrity.seal(state), path)
    with pytest.raises(RunError, match="does not resume it"):
        train(_mnist(run, epochs=2), resume=True)


def test_a_log_dir_of_another_run_is_refused_and_left_untouched(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(_mnist(run, epochs=1))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(RunError, match="holds another run"):
        train(_mnist(run, epochs=1, lr=0.2))
    with pytest.raises(RunError, match=r"lr 0\.1 -> 0\.2"):
        train(_mnist(run, epochs=2, lr=0.2), resume=True)
    with pytest.raises(RunError, match="has finished 1 epochs"):
        train(_mnist(run, epochs=1), resume=True)
    with pytest.raises(RunError, match="nothing to resume"):
        train(_mnist(tmp_path / "empty", epochs=1), resume=True)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def _script(script: str, *argv: str, torchrun: int = 0, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<script>`` (under torchrun with ``torchrun`` ranks) from the repository root, one thread each."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path, OMP_NUM_THREADS="1")
    launcher = [sys.executable]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    return subprocess.run(
        [*launcher, f"scripts/{script}", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(("ranks", "strategy"), [(1, "inverse"), (2, "gradient")])
def test_train_script_on_mnist5k_writes_its_run_and_resumes_exactly(tmp_path: Path, ranks: int, strategy: str) -> None:
    """Every rank saves its own hylo state (under "gradient" a layer's inverse lives on its owner only)."""
    flags = ["--model", "mlp", "--solver", "hybrid", "--strategy", strategy, "--batch-size", "250", "--max-steps", "3"]
    flags += ["--freq", "2", "--milestone", "2", "--checkpoint-freq", "1"]
    whole = _script("train.py", *flags, "--epochs", "2", "--log-dir", str(tmp_path / "whole"), torchrun=ranks)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-2000:]
    files = {p.name for p in (tmp_path / "whole").iterdir()}
    assert {"metrics.csv", "config.json", "model-summary.txt", "checkpoint-0002.pt"} <= files
    assert {f"checkpoint-0002-hylo-r{r}.pt" for r in range(ranks)} <= files
    assert "Trainable params" in (tmp_path / "whole" / "model-summary.txt").read_text()
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["solver"] == "hybrid"
    part = _script("train.py", *flags, "--epochs", "1", "--log-dir", str(tmp_path / "part"), torchrun=ranks)
    assert part.returncode == 0, part.stderr[-2000:]
    again = _script(
        "train.py", *flags, "--epochs", "2", "--log-dir", str(tmp_path / "part"), "--resume", torchrun=ranks
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert _without_times(_rows(tmp_path / "part" / "metrics.csv")) == _without_times(
        _rows(tmp_path / "whole" / "metrics.csv")
    )
    refused = _script("train.py", *flags, "--epochs", "3", "--log-dir", str(tmp_path / "part"))
    assert refused.returncode == 2 and "train.py: error: " in refused.stderr and "holds another run" in refused.stderr


def test_a_missing_dataset_names_the_layout_and_the_first_missing_file(tmp_path: Path) -> None:
    done = _script("train.py", "--dataset", "cifar10", "--data-dir", str(tmp_path), "--model", "resnet20")
    assert done.returncode == 1
    assert "data_batch_1" in done.stderr and "Traceback" not in done.stderr


def test_bench_accuracy_reports_the_first_evaluation_over_each_threshold(tmp_path: Path) -> None:
    from hylo_scripts.benchmarks import bench_accuracy
    from hylo_scripts.training.engine import EpochLog, RunResult

    def entry(step: int, acc: float, seconds: float) -> EpochLog:
        return EpochLog(step // 8, step, 0.1, 0.0, 0.0, acc, 0.0, seconds, 0.0)

    result = RunResult(RunConfig(), [entry(8, 0.95, 1.0), entry(16, 0.965, 2.0), entry(24, 0.96, 3.0)])
    assert bench_accuracy.first_reach(result, 0.96) == (16, 2.0)
    assert bench_accuracy.first_reach(result, 0.97) is None
    out = tmp_path / "curves.csv"
    argv = ["--batch-sizes", "500", "--iterations", "16", "--solvers", "kfac", "--sgd-lrs", "0.1", "--seeds", "0"]
    assert bench_accuracy.main([*argv, "--threads", "1", "--out", str(out)]) == 0
    rows = _rows(out)
    assert [(r["run"], r["step"]) for r in rows] == [
        ("sgd", "8"),
        ("sgd", "16"),
        ("hylo-kfac", "8"),
        ("hylo-kfac", "16"),
    ]
