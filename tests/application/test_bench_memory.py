"""scripts/bench_memory.py: runs in their own processes, the profiler replay, failures reported."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from hylo_scripts.benchmarks import bench_memory
from hylo_scripts.benchmarks.bench_memory import PHASES, RunConfig, replay_peaks


def test_replay_peaks_by_hand() -> None:
    """Peaks above each phase's starting point, from signed allocation events."""
    allocations = [(1, 10), (2, 5), (3, -10), (4, 20), (6, -25), (7, 8), (8, -8)]
    phases = [("a", 0, 3), ("b", 4, 6), ("c", 7, 9)]
    peaks, iteration = replay_peaks(allocations, phases)
    assert peaks == {"a": 15, "b": 20, "c": 8}
    assert iteration == 25  # 10 + 5 − 10 + 20, before the frees
    assert replay_peaks([(5, -4)], [("only", 0, 9)]) == ({"only": 0}, 0)  # frees alone: nothing above the start


def test_each_run_in_its_own_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "memory.csv"
    bench_memory.main(
        ["--model", "mlp", "--batch-size", "8", "--steps", "3", "--update-freq", "2", "--solvers", "sgd", "kfac"]
        + ["--threads", "1", "--profile-update", "--device", "cpu", "--csv", str(out)]
    )
    assert capsys.readouterr().out.startswith("device: cpu\n")
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["solver"] for row in rows] == ["sgd", "kfac"]
    assert list(rows[0]) == list(bench_memory.CSV_COLUMNS)
    assert {row["device"] for row in rows} == {"cpu"}
    sgd, kfac = rows
    for row in rows:
        assert float(row["peak_rss_mb"]) >= float(row["baseline_rss_mb"]) > 0
        assert float(row["ms_per_iter"]) > 0
        phases = [float(row[f"transient_{phase}_mb"]) for phase in PHASES]
        assert all(p >= 0 for p in phases) and float(row["transient_iteration_mb"]) >= max(phases)
        assert float(row["transient_backward_mb"]) > 0  # the backward allocates gradients
    assert sgd["state_mb"] == sgd["captured_mb"] == "" and float(sgd["transient_hylo.step_mb"]) == 0
    # the MLP's K-FAC state: factors and eigendecompositions of 785², 10², 129² ... held after the run
    assert float(kfac["state_mb"]) > 2 * 785**2 * 4 / 2**20 and int(kfac["tensors"]) > 0
    assert float(kfac["transient_hylo.step_mb"]) > 0


def test_child_in_process_counts_what_the_hooks_keep() -> None:
    config = RunConfig("cnn", "sngd", batch=4, steps=2, update_freq=1, threads=1)
    result = bench_memory.child_run(config)
    assert result["captured_mb"] > 0 and result["state_mb"] > 0 and result["cuda_peak_mb"] is None


def test_a_failing_child_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match=r"nope on mlp failed \(exit 1\):[\s\S]*solver"):
        bench_memory.run_in_process(RunConfig("mlp", "nope", batch=4, steps=1), timeout=120)
    with pytest.raises(SystemExit, match=r"bench_memory: kfac on mlp failed[\s\S]*max_unfold_mb must be"):
        bench_memory.main(["--model", "mlp", "--solvers", "kfac", "--steps", "1", "--max-unfold-mb", "-1"])
    with pytest.raises(SystemExit):
        bench_memory.main(["--model", "mlp", "--steps", "1", "--batch-size", "0"])
    assert "must be at least 1" in capsys.readouterr().err
