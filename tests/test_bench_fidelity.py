"""scripts/bench_fidelity.py: the CSV it writes, and hylo's SNGD against the independent oracle.

SNGD on a Linear layer is exact, so its error to the SNGD step built from the model's true
per-sample gradients (scripts/persample.py) must be at float64 round-off; the
unpreconditioned step ∇W/λ is far from it, so the check has teeth.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from torch import nn

from scripts import bench_fidelity
from scripts.models import build_model

pytestmark = pytest.mark.usefixtures("single_thread")

COLUMNS = ["model", "batch", "damping", "method", "rank_ratio", "layer", "d_a", "d_g", "rel_error", "rel_error_sgd"]


def test_bench_writes_long_rows_and_sngd_is_exact_on_linear_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fidelity.csv"
    argv = ["--model", "cnn", "--batch-size", "8", "--damping", "0.3", "--methods", "kfac", "sngd", "--csv", str(out)]
    assert bench_fidelity.main(argv) == 0
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
    for row in rows:
        if row["method"] == "sngd" and row["layer"] in linear:
            assert float(row["rel_error"]) < 1e-8, row
            assert float(row["rel_error_sgd"]) > 1e-2, row
    printed = capsys.readouterr().out
    assert "median" in printed and "kfac" in printed and f"wrote {out}" in printed


def test_low_rank_methods_run_once_per_rank_ratio() -> None:
    runs = bench_fidelity.plan_runs(["kfac", "kid", "kis"], [0.1, 0.5])
    assert [run.label for run in runs] == ["kfac", "kid@0.1", "kid@0.5", "kis@0.1", "kis@0.5"]
    assert runs[2].options == {"solver": "kid", "rank_ratio": 0.5}


def test_an_option_hylo_does_not_accept_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_fidelity.METHODS, "bogus", {"solver": "sngd", "no_such_option": 1})
    with pytest.raises(SystemExit, match="method 'bogus' needs HyLoPreconditioner option.s. no_such_option"):
        bench_fidelity.plan_runs(["kfac", "bogus"], [0.1])
