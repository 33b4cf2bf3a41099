"""scripts/bench_rank.py: adaptive rank against a fixed rank with as many rows, each against the independent oracle.

At ``rank_energy=1`` and ``rank_cap=1`` the adaptive choice keeps every row, and so does the fixed one at the same
total: both are exact SNGD, so their errors to the oracle's step — the true per-sample gradients of the image model
(torch.func) with exact convolution rows, the token rows of the decoder's Linears (hooks and autograd) — must be at
float64 round-off. The oracle is thereby checked against hylo, and the CSV's bookkeeping against the run.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from hylo_scripts.benchmarks import bench_rank

pytestmark = pytest.mark.usefixtures("single_thread")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize(
    ("model", "batch", "layers", "rows"),
    [
        ("cnn", "8", ["0", "3", "7", "9", "<step>"], 8),
        ("transformer", "1", [*(f"blocks.{b}.mlp.{i}" for b in (0, 1) for i in (0, 2)), "head", "<step>"], 64),
    ],
)
def test_at_full_energy_and_cap_both_choices_are_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, batch: str, layers: list[str], rows: int
) -> None:
    out = tmp_path / "rank.csv"
    argv = ["--model", model, "--batch-size", batch, "--damping", "0.3", "--energies", "1.0", "--cap", "1.0"]
    argv += ["--draws", "1", "--device", "cpu", "--csv", str(out)]
    assert bench_rank.main(argv) == 0
    found = _rows(out)
    assert [(r["solver"], r["layer"]) for r in found] == [(s, name) for s in ("kid", "kis") for name in layers]
    for row in found:
        assert int(row["rows"]) == rows and int(row["rows_kept_auto"]) == (
            rows if row["layer"] != "<step>" else rows * (len(layers) - 1)
        )
        assert float(row["rows_fixed"]) == rows
        assert float(row["rel_error_auto"]) < 1e-9, row
        assert float(row["rel_error_fixed"]) < 1e-9, row
    assert f"wrote {out}" in capsys.readouterr().out


def test_below_full_energy_the_fixed_choice_is_read_at_the_same_total(tmp_path: Path) -> None:
    out = tmp_path / "rank.csv"
    argv = ["--model", "cnn", "--batch-size", "16", "--damping", "1.0", "--energies", "0.9", "--solvers", "kid"]
    assert bench_rank.main([*argv, "--device", "cpu", "--csv", str(out)]) == 0
    found = _rows(out)
    total = sum(int(r["rows_kept_auto"]) for r in found if r["layer"] != "<step>")
    assert float(found[0]["rows_fixed"]) == pytest.approx(total / 4)  # 4 layers at T / L rows each
    assert all(0 < float(r["rel_error_fixed"]) and 0 < float(r["rel_error_auto"]) for r in found)


def test_training_an_image_model_needs_mnist() -> None:
    with pytest.raises(SystemExit):
        bench_rank.parse_args(["--model", "cnn", "--train-steps", "3"])
    with pytest.raises(SystemExit):
        bench_rank.parse_args(["--energies", "0"])
