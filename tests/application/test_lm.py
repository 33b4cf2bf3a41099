"""The language-model workload: the text corpora and their fixed split, byte windows, the causal transformer,
the lm task of the engine and its flags, train_lm.py at one and two ranks with exact resume, and
bench_accuracy.py --task lm.

Oracles are independent of the loaders: the bytes the fixture wrote, split by a CRC-32 ranking
recomputed here, and the model's logits recomputed with a changed future token.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from hylo_scripts.benchmarks import bench_accuracy
from hylo_scripts.data.registry import DATASETS, DataOptions, DatasetLayoutError, load_dataset
from hylo_scripts.data.text import (
    STDLIB_EXCLUDED,
    TokenWindows,
    directory_files,
    split_files,
    stdlib_files,
    stdlib_root,
)
from hylo_scripts.models.registry import MODELS, DecoderLM, build_model
from hylo_scripts.training import train_lm as lm_script
from hylo_scripts.training.engine import RunConfig, metrics_header, train
from hylo_scripts.training.options import build_parser, config_from_args
from hylo_scripts.training.schedules import lr_factor

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
TIME_COLUMNS = {"epoch_time_s", "total_time_s", "precondition_time_s"}
#: The tiny model and data of the end-to-end runs.
TINY = {"seq_len": 16, "layers": 1, "width": 32, "heads": 2}


def write_corpus(root: Path, n_files: int = 30) -> dict[str, bytes]:
    """``n_files`` small Python-like files under ``root`` (two folders), plus hidden ones the corpus skips."""
    files: dict[str, bytes] = {}
    for i in range(n_files):
        name = f"{'pkg' if i % 2 else 'lib/sub'}/mod{i:02d}.py"
        body = "".join(f"def f{i}_{k}(x):\n    return x * {k} + {i}  # line {k}\n" for k in range(10 + 3 * i))
        files[name] = body.encode()
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(files[name])
    (root / ".hidden.py").write_text("skipped\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("skipped\n")
    return files


def expected_split(names: list[str]) -> tuple[list[str], list[str]]:
    """The rule of hylo_scripts/data/text.py, restated: rank by (crc32 of the path, path); the first tenth is validation."""
    ranked = sorted(names, key=lambda n: (zlib.crc32(n.encode()), n))
    n_val = max(1, len(ranked) // 10)
    return ranked[n_val:], ranked[:n_val]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def _without_times(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIME_COLUMNS} for row in rows]


# --------------------------------------------------------------------------- corpora and split
def test_a_folder_splits_by_file_deterministically_and_disjointly(tmp_path: Path) -> None:
    files = write_corpus(tmp_path)
    assert directory_files(tmp_path) == sorted(files)  # hidden files and folders skipped
    train_files, val_files = split_files(sorted(files))
    assert (train_files, val_files) == expected_split(sorted(files))
    assert len(val_files) == 3 and not set(train_files) & set(val_files)
    assert set(train_files) | set(val_files) == set(files)
    assert split_files(list(reversed(sorted(files)))) == (train_files, val_files)  # the listing order is irrelevant

    data = load_dataset("text", DataOptions(data_dir=str(tmp_path), seq_len=16))
    again = load_dataset("text", DataOptions(data_dir=str(tmp_path), seq_len=16, seed=7))  # no seed in the split
    assert isinstance(data.train, TokenWindows) and isinstance(data.test, TokenWindows)
    assert isinstance(again.train, TokenWindows) and isinstance(again.test, TokenWindows)
    train_bytes = b"".join(files[n] for n in train_files)
    val_bytes = b"".join(files[n] for n in val_files)
    assert bytes(data.train.tokens.tolist()) == train_bytes and bytes(data.test.tokens.tolist()) == val_bytes
    assert torch.equal(again.train.tokens, data.train.tokens) and torch.equal(again.test.tokens, data.test.tokens)
    assert (data.input_shape, data.num_classes) == ((16,), 256)
    assert len(data.train) == (len(train_bytes) - 1) // 16 and len(data.test) == (len(val_bytes) - 1) // 16
    assert data.info["files"] == {"train": 27, "validation": 3}
    assert data.info["bytes"] == {"train": len(train_bytes), "validation": len(val_bytes)}


def test_the_byte_cap_cuts_each_split_in_file_order_without_moving_files(tmp_path: Path) -> None:
    files = write_corpus(tmp_path)
    train_files, val_files = expected_split(sorted(files))
    data = load_dataset("text", DataOptions(data_dir=str(tmp_path), seq_len=8, max_bytes=3000))
    assert isinstance(data.train, TokenWindows) and isinstance(data.test, TokenWindows)
    assert bytes(data.train.tokens.tolist()) == b"".join(files[n] for n in train_files)[:3000]
    assert bytes(data.test.tokens.tolist()) == b"".join(files[n] for n in val_files)[:300]
    assert data.info["bytes"] == {"train": 3000, "validation": 300} and len(data.train) == 2999 // 8


def test_too_little_text_is_a_layout_error(tmp_path: Path) -> None:
    (tmp_path / "only.txt").write_text("one file\n")
    with pytest.raises(DatasetLayoutError, match="need two"):
        load_dataset("text", DataOptions(data_dir=str(tmp_path)))
    (tmp_path / "other.txt").write_text("two\n")
    with pytest.raises(DatasetLayoutError, match="too few for a window of 128 tokens"):
        load_dataset("text", DataOptions(data_dir=str(tmp_path)))
    with pytest.raises(DatasetLayoutError, match="missing"):
        load_dataset("text", DataOptions(data_dir=str(tmp_path / "absent")))


def test_the_stdlib_corpus_is_the_librarys_own_py_files_split_by_file() -> None:
    root = stdlib_root()
    names = stdlib_files()
    assert names == sorted(names) and len(names) > 100 and "os.py" in names and "json/decoder.py" in names
    assert all(n.endswith(".py") and not STDLIB_EXCLUDED & set(n.split("/")[:-1]) for n in names)
    assert not any(n.startswith(("test/", "idlelib/", "site-packages/")) for n in names)
    train_files, val_files = split_files(names)
    assert (train_files, val_files) == expected_split(names) and not set(train_files) & set(val_files)
    assert len(val_files) == len(names) // 10
    data = load_dataset("stdlib", DataOptions(seq_len=32, max_bytes=5000))
    assert isinstance(data.train, TokenWindows)
    assert bytes(data.train.tokens.tolist()) == b"".join((root / n).read_bytes() for n in train_files[:20])[:5000]
    assert data.info["python"] == ".".join(map(str, sys.version_info[:3]))
    assert data.info["bytes"] == {"train": 5000, "validation": 500}
    assert data.info["windows"] == {"train": 4999 // 32, "validation": 499 // 32}


def test_windows_are_inputs_and_their_next_bytes() -> None:
    tokens = torch.arange(23, dtype=torch.uint8)
    windows = TokenWindows(tokens, 5)
    assert len(windows) == 4  # (23 - 1) // 5: the last window's next byte exists
    x, y = windows[3]
    assert x.dtype == torch.int64 and x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20]
    spread = windows.spread(2)
    assert len(spread) == 2 and spread[1][0].tolist() == x.tolist() and spread[0][0].tolist() == [0, 1, 2, 3, 4]
    assert windows.spread(10) is windows
    with pytest.raises(ValueError, match="uint8"):
        TokenWindows(tokens.long(), 5)


# --------------------------------------------------------------------------- the model
def test_the_transformer_is_causal_and_its_head_is_untied() -> None:
    model = DecoderLM(vocab=11, context=12, layers=2, width=16, heads=4).eval()
    x = torch.randint(0, 11, (3, 12))
    with torch.no_grad():
        logits = model(x)
        assert logits.shape == (3, 12, 11)
        for k in (0, 5, 11):
            changed = x.clone()
            changed[:, k] = (changed[:, k] + 1) % 11
            other = model(changed)
            assert torch.equal(other[:, :k], logits[:, :k]), k  # earlier positions never see token k
            assert not torch.allclose(other[:, k], logits[:, k])
        assert torch.allclose(model(x[:, :7]), logits[:, :7], atol=1e-6)  # shorter sequences: the same prefix
    assert model.head.weight is not model.tokens.weight and model.head.weight.shape == (11, 16)
    assert isinstance(model.blocks[0].attn, torch.nn.MultiheadAttention) and model.blocks[0].attn.batch_first
    with pytest.raises(ValueError, match="exceeds the context of 12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible by heads"):
        DecoderLM(width=10, heads=4)


def test_the_registry_builds_the_transformer_with_its_size_options() -> None:
    spec = MODELS["transformer"]
    assert (spec.task, spec.input_shape, spec.num_classes) == ("lm", (128,), 256)
    model = build_model("transformer", (8,), 50, layers=3, width=24, heads=2)
    assert isinstance(model, DecoderLM) and len(model.blocks) == 3 and model.head.out_features == 50
    assert model.positions.num_embeddings == 8
    x, y = spec.random_batch(2, side=8)
    assert x.shape == y.shape == (2, 8) and int(x.max()) < 256
    assert "(T,)" in (spec.fits((3, 8, 8)) or "") and "vocabulary" in (spec.fits((8,), 1) or "")
    with pytest.raises(ValueError, match="takes no option depth"):
        build_model("transformer", depth=2)
    with pytest.raises(ValueError, match="takes no option width"):
        build_model("mlp", width=2)


# --------------------------------------------------------------------------- config and flags
def test_lm_fields_default_to_the_models_and_belong_to_language_models() -> None:
    cfg = RunConfig(dataset="stdlib", model="transformer")
    assert (cfg.task, cfg.seq_len, cfg.layers, cfg.width, cfg.heads, cfg.max_bytes) == ("lm", 128, 4, 256, 4, None)
    assert RunConfig(**cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="seq_len: options of language models"):
        RunConfig(seq_len=16)
    with pytest.raises(ValueError, match="divisible by heads"):
        RunConfig(dataset="stdlib", model="transformer", width=30, heads=4)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
        RunConfig(dataset="stdlib", model="transformer", max_bytes=0)
    with pytest.raises(ValueError, match="does not fit the lm dataset"):
        RunConfig(dataset="stdlib", model="cnn")


def _parse(*argv: str) -> RunConfig:
    parser = build_parser("train_lm.py", task="lm", defaults=lm_script.DEFAULTS)
    return config_from_args(parser.parse_args(list(argv)), parser)


def test_train_lm_flags_and_defaults() -> None:
    cfg = _parse()
    expected = {"dataset": "stdlib", "model": "transformer", "optimizer": "adamw", "solver": "hybrid"}
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert (cfg.lr_schedule, cfg.max_bytes, cfg.seq_len, cfg.layers, cfg.width, cfg.heads) == (
        "cosine",
        300_000,
        128,
        4,
        256,
        4,
    )
    cfg = _parse("--seq-len", "64", "--layers", "2", "--width", "96", "--heads", "3", "--max-bytes", "0")
    assert (cfg.seq_len, cfg.layers, cfg.width, cfg.heads, cfg.max_bytes) == (64, 2, 96, 3, None)
    cfg = _parse("--dataset", "text", "--data-dir", "corpus", "--optimizer", "sgd", "--solver", "kfac")
    assert (cfg.dataset, cfg.data_dir, cfg.optimizer, cfg.momentum) == ("text", "corpus", "sgd", 0.9)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-dir", "somewhere"], "reads no directory (a folder of text files: --dataset text)"),
        (["--dataset", "text"], "needs data_dir"),
        (["--conv-rows", "exact"], "--conv-rows: the low-rank rows of Conv2d layers"),
        (["--kfc-exponent", "2"], "--kfc-exponent: the K-FAC factors of Conv2d layers"),
        (["--label-smoothing", "0.1"], "--label-smoothing: only for classification"),
        (["--momentum", "0.9"], "--momentum: SGD's"),
        (["--image-size", "32"], "unrecognized arguments: --image-size"),
        (["--width", "100", "--heads", "3"], "width 100 must be divisible by heads 3"),
        (["--max-bytes", "-1"], "must be an int >= 0"),
        (["--model", "cnn"], "invalid choice: 'cnn'"),
    ],
)
def test_lm_flag_misuse_is_an_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_image_trainers_have_no_lm_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser("train.py", task="classification", defaults={"dataset": "mnist5k"})
    with pytest.raises(SystemExit):
        parser.parse_args(["--seq-len", "8"])
    assert "unrecognized arguments: --seq-len" in capsys.readouterr().err
    assert {n for n, s in DATASETS.items() if s.task == "lm"} == {"stdlib", "text"}


# --------------------------------------------------------------------------- the trainer end to end
def _tiny(data_dir: Path, log_dir: Path, **fields: Any) -> RunConfig:
    base: dict[str, Any] = dict(
        dataset="text",
        data_dir=str(data_dir),
        model="transformer",
        optimizer="adamw",
        lr=3e-3,
        lr_schedule="cosine",
        warmup_epochs=0.5,
        solver="kfac",
        batch_size=8,
        max_steps=3,
        hylo={"update_freq": 2},
        log_dir=str(log_dir),
        checkpoint_freq=1,
        **TINY,
    )
    base.update(fields)
    return RunConfig(**base)


@pytest.mark.parametrize("solver", ["kfac", "hybrid"])
def test_the_engine_trains_a_language_model_and_resumes_exactly(tmp_path: Path, solver: str) -> None:
    write_corpus(tmp_path / "data")
    whole = train(_tiny(tmp_path / "data", tmp_path / "whole", epochs=2, solver=solver))
    rows = _rows(tmp_path / "whole" / "metrics.csv")
    assert list(rows[0]) == metrics_header("lm") and "test_bpb" in rows[0] and len(rows) == 2
    assert [int(r["step"]) for r in rows] == [3, 6] and float(rows[0]["precondition_time_s"]) > 0
    for row in rows:
        assert math.isfinite(float(row["train_loss"])) and 0 < float(row["test_loss"]) < 6.0
        assert float(row["test_bpb"]) == pytest.approx(float(row["test_loss"]) / math.log(2))
    info = json.loads((tmp_path / "whole" / "dataset.json").read_text())
    assert info["python"] and info["files"] == {"train": 27, "validation": 3}
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["seq_len"] == 16

    _interrupt_after_epoch_1(tmp_path / "whole", tmp_path / "part")
    resumed = train(_tiny(tmp_path / "data", tmp_path / "part", epochs=2, solver=solver), resume=True)
    assert [e.epoch for e in resumed.log] == [2]
    assert _without_times(_rows(tmp_path / "part" / "metrics.csv")) == _without_times(rows)
    assert resumed.log[-1].train_loss == whole.log[-1].train_loss  # bit for bit

    # More epochs: the cosine of the longer run takes over at the saved step (not the old run's lr of 0).
    longer = train(_tiny(tmp_path / "data", tmp_path / "part", epochs=3, solver=solver), resume=True)
    factor = lr_factor("cosine", total_steps=9, warmup_steps=2)
    assert [e.epoch for e in longer.log] == [3] and longer.log[0].lr == pytest.approx(3e-3 * factor(8))


def _interrupt_after_epoch_1(run: Path, copy: Path) -> None:
    """Copy ``run`` as it was after epoch 1: without the epoch-2 checkpoint (its metrics row is dropped on resume)."""
    shutil.copytree(run, copy)
    for path in copy.glob("checkpoint-0002*"):
        path.unlink()


def _script(*argv: str, ranks: int = 0, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    """``scripts/train_lm.py argv`` from the repository root (under torchrun with ``ranks``), one thread each."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path, OMP_NUM_THREADS="1")
    launcher = [sys.executable]
    if ranks:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return subprocess.run(
        [*launcher, "scripts/train_lm.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(("ranks", "solver"), [(1, "kfac"), (2, "hybrid")])
def test_train_lm_script_writes_its_run_and_resumes_exactly(tmp_path: Path, ranks: int, solver: str) -> None:
    write_corpus(tmp_path / "data")
    flags = ["--dataset", "text", "--data-dir", str(tmp_path / "data"), "--solver", solver, "--batch-size", "8"]
    flags += ["--max-steps", "2", "--freq", "2", "--checkpoint-freq", "1", "--warmup-epochs", "0"]
    flags += [f"--{name.replace('_', '-')}={value}" for name, value in TINY.items()]
    launch = {"ranks": ranks if ranks > 1 else 0}
    whole = _script(*flags, "--epochs", "2", "--log-dir", str(tmp_path / "whole"), **launch)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-2000:]
    assert "test_bpb" in whole.stdout and f"ranks {ranks}" in whole.stdout
    files = {p.name for p in (tmp_path / "whole").iterdir()}
    assert {"metrics.csv", "config.json", "dataset.json", "model-summary.txt", "checkpoint-0002.pt"} <= files
    assert {f"checkpoint-0002-hylo-r{r}.pt" for r in range(ranks)} <= files
    rows = _rows(tmp_path / "whole" / "metrics.csv")
    assert [r["step"] for r in rows] == ["2", "4"] and all(math.isfinite(float(r["test_bpb"])) for r in rows)
    _interrupt_after_epoch_1(tmp_path / "whole", tmp_path / "part")
    again = _script(*flags, "--epochs", "2", "--log-dir", str(tmp_path / "part"), "--resume", **launch)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _without_times(_rows(tmp_path / "part" / "metrics.csv")) == _without_times(rows)


def test_train_lm_script_names_a_missing_corpus(tmp_path: Path) -> None:
    done = _script("--dataset", "text", "--data-dir", str(tmp_path / "absent"))
    assert done.returncode == 1 and "text: missing" in done.stderr and "Traceback" not in done.stderr


# --------------------------------------------------------------------------- bench_accuracy --task lm
def test_bench_lm_ratios_use_each_seeds_adamw_target() -> None:
    adamw = [
        bench_accuracy.LMCurve("adamw", 1e-3, 0, [(10, 1.0, 3.0), (20, 2.0, 2.0)]),
        bench_accuracy.LMCurve("adamw", 2e-3, 0, [(10, 1.0, 2.5), (20, 2.0, 1.5)]),
        bench_accuracy.LMCurve("adamw", 2e-3, 1, [(10, 1.0, 2.0), (20, 2.0, 1.6)]),
    ]
    hylo = [
        bench_accuracy.LMCurve("hylo-kfac", 2e-3, 0, [(10, 1.5, 1.4), (20, 3.0, 1.0)]),
        bench_accuracy.LMCurve("hylo-kfac", 2e-3, 1, [(10, 1.5, 1.7), (20, 3.0, 1.65)]),
    ]
    assert bench_accuracy.best_adamw_lr(adamw) == 2e-3
    rows = bench_accuracy.lm_ratios(adamw + hylo, 2e-3)
    assert [(r["seed"], r["target_loss"], r["step_ratio"], r["time_ratio"]) for r in rows] == [
        (0, 1.5, 0.5, 0.75),
        (1, 1.6, None, None),
    ]
    table = bench_accuracy.summarise_lm(adamw + hylo, rows, 2e-3)
    assert "(target)" in table and "0.50 (1/2)" in table


def test_bench_lm_quick_mode_writes_curves_and_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lm.csv"
    argv = ["--task", "lm", "--quick", "--seeds", "0", "--solvers", "kfac", "--threads", "1", "--out", str(out)]
    assert bench_accuracy.main([*argv, "--device", "cpu"]) == 0
    curves = _rows(out)
    assert [(r["run"], r["step"]) for r in curves] == [("adamw", "4"), ("adamw", "8"), ("hylo-kfac", "4")] + [
        ("hylo-kfac", "8")
    ]
    assert all(math.isfinite(float(r["val_loss"])) for r in curves)
    ratios = _rows(tmp_path / "lm-ratios.csv")
    assert [r["run"] for r in ratios] == ["hylo-kfac"] and float(ratios[0]["target_loss"]) > 0
    assert {r["device"] for r in curves + ratios} == {"cpu"}
    printed = capsys.readouterr().out
    assert printed.startswith("device: cpu\n") and "steps ratio" in printed
    with pytest.raises(SystemExit):
        bench_accuracy.main(["--task", "lm", "--sgd-lrs", "0.1"])
    assert "--sgd-lrs: not a flag of --task lm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_accuracy.main(["--adamw-lrs", "0.1"])
    assert "--adamw-lrs: not a flag of --task classification" in capsys.readouterr().err


def test_bench_lm_default_damping_lets_kfac_precondition_the_decoder() -> None:
    """At the LM bench's default K-FAC damping, hylo's K-FAC turns the gradient of every preconditioned matrix of the bench's
    decoder away from the plain gradient (cosine < 0.95; docs/benchmarks.md, "KAISA and hylo's K-FAC on the language
    model"); the classification bench keeps 0.3, which on this decoder leaves most of them within 0.98 of the plain
    gradient: under AdamW, which sets the step's scale, it preconditioned almost nothing."""
    import hylo

    lm = bench_accuracy.parse_args(["--task", "lm"])
    assert bench_accuracy.parse_args([]).damping == 0.3
    assert bench_accuracy.lm_config(lm, "kis", 2e-3, 0).hylo["damping"] == 0.3
    assert (
        bench_accuracy.lm_config(bench_accuracy.parse_args(["--task", "lm", "--damping", "0.1"]), "kfac", 2e-3, 0).hylo[
            "damping"
        ]
        == 0.1
    )
    damping = bench_accuracy.lm_config(lm, "kfac", 2e-3, 0).hylo["damping"]

    def cosines(damping: float) -> dict[str, float]:
        torch.manual_seed(0)
        net = DecoderLM(256, lm.seq_len, layers=lm.layers, width=lm.width, heads=lm.heads)
        tokens = torch.randint(0, 256, (lm.batch_size, lm.seq_len + 1))
        pre = hylo.HyLoPreconditioner(net, solver="kfac", damping=damping, update_freq=1)
        try:
            logits = net(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            plain = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None and p.dim() == 2}
            pre.step()
        finally:
            pre.remove()
        params = dict(net.named_parameters())
        return {
            name: float(torch.nn.functional.cosine_similarity(g.flatten(), params[name].grad.flatten(), dim=0))
            for name, g in plain.items()
        }

    default = cosines(damping)
    assert len(default) == 4 * lm.layers + 3  # embeddings, in- and out-projections, the MLPs and the head
    assert max(default.values()) < 0.95, default
    old = cosines(0.3)
    assert sorted(old.values())[len(old) // 2] > 0.98, old


def test_bench_lm_runs_kfac_with_the_inverse_method_and_the_cnn_with_the_eigen_method() -> None:
    """The LM bench's hylo runs take ``kfac_method="inverse"`` (docs/benchmarks.md, "KAISA and hylo's K-FAC on the
    language model"), the classification bench's the exact eigen method; ``--kfac-method`` overrides either."""
    lm = bench_accuracy.parse_args(["--task", "lm"])
    assert bench_accuracy.lm_config(lm, "kfac", 2e-3, 0).hylo["kfac_method"] == "inverse"
    cnn = bench_accuracy.parse_args([])
    assert bench_accuracy.run_config(cnn, 500, "kfac", 0.1, 0).hylo["kfac_method"] == "eigen"
    chosen = bench_accuracy.parse_args(["--task", "lm", "--kfac-method", "eigen"])
    assert bench_accuracy.lm_config(chosen, "hybrid", 2e-3, 0).hylo["kfac_method"] == "eigen"


def test_bench_runs_each_ranked_solver_once_per_rank_ratio(tmp_path: Path) -> None:
    """``--rank-ratio 0.1 auto``: kid and hybrid run at each, named ``@ρ``; kfac keeps no rows and runs once."""
    out = tmp_path / "lm.csv"
    argv = ["--task", "lm", "--quick", "--seeds", "0", "--threads", "1", "--out", str(out)]
    argv += ["--solvers", "kfac", "kid", "--rank-ratio", "0.1", "auto"]
    assert bench_accuracy.main([*argv, "--device", "cpu"]) == 0
    runs = list(dict.fromkeys(r["run"] for r in _rows(out)))
    assert runs == ["adamw", "hylo-kfac", "hylo-kid@0.1", "hylo-kid@auto"]
    args = bench_accuracy.parse_args(["--rank-ratio", "auto"])
    assert bench_accuracy.run_config(args, 500, "kid", 0.1, 0, "auto").hylo["rank_ratio"] == "auto"
    with pytest.raises(SystemExit):
        bench_accuracy.parse_args(["--rank-ratio", "1.5"])
