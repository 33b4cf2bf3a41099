"""The real-data grid of ``scripts/bench_models.py --grid`` (docs/models.md, "Learning rates on real data").

The specification: the batches are real (the standard library's bytes, MNIST's digits 0–3) and the same for both
methods; both runs start from the same weights (the same held-out loss at step 0), their steps are timed and
interleaved; the tables take medians over seeds, compare at equal steps and at equal time (the form's last
evaluation within AdamW's total time) and pick each method's best lr.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers")
pytest.importorskip("mlxtend", reason="needs mlxtend")

from hylo_scripts.benchmarks import bench_models, model_grid  # noqa: E402
from hylo_scripts.data.text import read_corpus, stdlib_files, stdlib_root  # noqa: E402
from hylo_scripts.models.model_families import FAMILIES, SEQ  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_thread")]


def test_text_batches_are_windows_of_the_corpus_and_images_are_the_first_four_digits() -> None:
    train, validation = model_grid.corpus()
    read = read_corpus(stdlib_root(), stdlib_files(), model_grid.CORPUS_BYTES)
    assert torch.equal(train, read.train.long()) and torch.equal(validation, read.validation.long())
    data = model_grid.text_data("lm")
    batch = data.batch(1, 7)
    assert batch["input_ids"].shape == (model_grid.TEXT_BATCH, SEQ) and torch.equal(batch["input_ids"], batch["labels"])
    assert torch.equal(batch["input_ids"], model_grid.text_data("lm").batch(1, 7)["input_ids"])  # a fixed function
    assert not torch.equal(batch["input_ids"], data.batch(2, 7)["input_ids"])
    text = bytes(train.to(torch.uint8).tolist())
    assert bytes(batch["input_ids"][0].to(torch.uint8).tolist()) in text  # a window of the training split
    pairs = model_grid.text_data("seq2seq").batch(0, 0)
    joined = torch.cat([pairs["input_ids"], pairs["labels"]], 1)
    assert bytes(joined[0].to(torch.uint8).tolist()) in text  # a window and the bytes that follow it
    images = model_grid.real_data(FAMILIES["ViT"])
    assert images is not None
    held = images.held_out[0]
    assert held["pixel_values"].shape[1:] == (3, 16, 16) and set(held["labels"].tolist()) <= {0, 1, 2, 3}
    assert model_grid.real_data(FAMILIES["Whisper"]) is None


def test_the_quick_grid_runs_both_methods_from_the_same_weights(tmp_path: Path) -> None:
    lines: list[str] = []
    out = tmp_path / "grid.csv"
    bench_models.main(["--grid", str(out), "--quick", "--threads", "1"], out=lines.append)
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["method"], row["step"]) for row in rows} == {(m, s) for m in model_grid.METHODS for s in ("0", "5")}
    start = {row["method"]: float(row["held_out"]) for row in rows if row["step"] == "0"}
    assert start["AdamW"] == start["HyLoOptimizer"]
    end = {row["method"]: row for row in rows if row["step"] == "5"}
    assert all(float(row["seconds"]) > 0 and math.isfinite(float(row["held_out"])) for row in end.values())
    assert float(end["AdamW"]["held_out"]) != float(end["HyLoOptimizer"]["held_out"])
    assert lines[0].startswith("| family | lr | start | AdamW | HyLoOptimizer |")
    assert any(line.startswith("| GPT-2 | 0.003 |") for line in lines[0].splitlines())
    grafted = tmp_path / "grafted.csv"  # --graft: the same AdamW rows, another form; --against sets them side by side
    bench_models.main(["--grid", str(grafted), "--quick", "--graft", "--threads", "1"], out=lines.append)
    with grafted.open() as handle:
        again = {(row["method"], row["step"]): row["held_out"] for row in csv.DictReader(handle)}
    assert again[("AdamW", "5")] == end["AdamW"]["held_out"] != again[("HyLoOptimizer", "5")]
    assert again[("HyLoOptimizer", "5")] != end["HyLoOptimizer"]["held_out"]
    bench_models.main(["--tables", str(grafted), "--against", str(out)], out=lines.append)
    assert lines[-1].splitlines()[2].startswith(f"| GPT-2 | 0.003 | {float(end['AdamW']['held_out']):.3f} |")


def rows_of(runs: dict[tuple[float, int, str], list[tuple[int, float, float]]]) -> list[dict[str, str]]:
    return [
        {"family": "F", "lr": str(lr), "seed": str(seed), "method": method, "step": str(step), "seconds": str(spent),
         "held_out": str(loss)}
        for (lr, seed, method), points in runs.items()
        for step, spent, loss in points
    ]  # fmt: skip


def test_the_tables_compare_medians_at_equal_steps_and_at_equal_time_and_pick_the_best_lrs() -> None:
    runs = {}
    for seed, shift in enumerate((0.0, 0.1, 0.3)):  # medians: the middle seed's
        runs[(1e-3, seed, "AdamW")] = [(0, 0.0, 5.0), (10, 1.0, 4.0 + shift), (20, 2.0, 3.0 + shift)]
        runs[(1e-3, seed, "HyLoOptimizer")] = [(0, 0.0, 5.0), (10, 1.5, 3.5 + shift), (20, 3.0, 2.5 + shift)]
        runs[(1e-2, seed, "AdamW")] = [(0, 0.0, 5.0), (20, 2.0, 3.2 + shift)]
        runs[(1e-2, seed, "HyLoOptimizer")] = [(0, 0.0, 5.0), (20, 1.0, 2.0 + shift)]
    cells = {cell.lr: cell for cell in model_grid.cells(rows_of(runs))}
    low = cells[1e-3]
    assert (low.start, low.adamw, low.form, low.time_ratio) == (5.0, 3.1, 2.6, 1.5)
    assert low.form_at_time == 3.6  # the form's last evaluation within AdamW's 2 s: step 10
    assert cells[1e-2].form_at_time == cells[1e-2].form == pytest.approx(2.1)  # faster: its last step
    text = model_grid.tables(rows_of(runs))
    assert "| F | 0.001 | 3.100 | 0.01 | 2.100 | -1.000 | 2.600 | 3.600 |" in text


def test_the_grafting_tables_set_the_grafted_form_beside_the_plain_one_and_pick_each_best_lr() -> None:
    """``--tables GRAFTED --against PLAIN``: per cell the medians of AdamW, the plain form and the grafted form; per
    family each method's best lr with its loss."""
    plain, grafted = {}, {}
    for seed, shift in enumerate((0.0, 0.1, 0.3)):
        for lr, adamw, form, graft in ((1e-3, 3.0, 3.2, 2.9), (1e-2, 3.5, 2.5, 2.7)):
            for runs, mine in ((plain, form), (grafted, graft)):
                runs[(lr, seed, "AdamW")] = [(0, 0.0, 5.0), (20, 2.0, adamw + shift)]
                runs[(lr, seed, "HyLoOptimizer")] = [(0, 0.0, 5.0), (20, 3.0, mine + shift)]
    text = model_grid.grafting_tables(rows_of(plain), rows_of(grafted))
    assert "| F | 0.001 | 3.100 | 3.300 | 3.000 | -0.100 | -0.300 |" in text
    assert "| F | 0.01 | 3.600 | 2.600 | 2.800 | -0.800 | +0.200 |" in text
    assert "| F | 0.001 (3.100) | 0.01 (2.600) | 0.01 (2.800) |" in text
