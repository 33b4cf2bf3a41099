"""The stopwatch's attribution and the append-only CSV files, unit by unit.

1. Consecutive laps: each interval is charged once, split by weights (or evenly), step-level
   laps go to their slot, and the charged times add up to the total.
2. ``CsvLog``: created at its first flush with one header, quoting, None → empty (NaN), full
   float precision, refusing an existing file unless appending, header mismatch on append.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from hylo.telemetry import profiling
from hylo.telemetry.profiling import Stopwatch
from hylo.telemetry.recording import CsvLog, existing_files


def test_laps_split_by_weight_and_sum_to_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scripted clock: 1 ms check, 3 ms gather split 1:2, 2 ms precondition split evenly."""
    ticks = iter([0.0, 0.001, 0.004, 0.006])
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(ticks))
    watch = Stopwatch(profiling.torch.device("cpu"))
    watch.start()
    watch.lap("check")
    watch.lap("gather", ["a", "b"], [1.0, 2.0])
    watch.lap("precondition", ["a", "b"])
    times = watch.finish()
    assert times.slots["check"] == pytest.approx(1.0)
    assert times.layers["a"]["gather"] == pytest.approx(1.0) and times.layers["b"]["gather"] == pytest.approx(2.0)
    assert times.layers["a"]["precondition"] == pytest.approx(1.0) == times.layers["b"]["precondition"]
    assert times.total == pytest.approx(6.0)
    charged = sum(times.slots.values()) + sum(sum(p.values()) for p in times.layers.values())
    assert charged == pytest.approx(times.total)


def test_disabled_stopwatch_does_nothing() -> None:
    """Stopwatch(None) never reads a clock and reports nothing."""
    watch = Stopwatch(None)
    watch.start()
    watch.lap("check")
    times = watch.finish()
    assert not watch.enabled and times.total == 0.0 and not times.layers


def test_csv_log_writes_one_header_and_whole_rows(tmp_path: Path) -> None:
    """Nothing on disk before the first flush; quoting, empty cells and full precision after."""
    path = tmp_path / "log.csv"
    log = CsvLog(path, ("step", "layer", "value"), append=False)
    log.add((0, "block.0, conv", 1 / 3))
    assert not path.exists()
    log.flush()
    log.add((1, 'say "hi"', None))
    log.close()
    text = path.read_text()
    assert text.count("step,layer,value") == 1 and text.endswith("\n")
    table = pd.read_csv(path)
    assert list(table.layer) == ["block.0, conv", 'say "hi"']
    assert table.value.iloc[0] == 1 / 3 and pd.isna(table.value.iloc[1])
    with pytest.raises(ValueError, match="3 columns"):
        log.add((1, 2))


def test_csv_log_refuses_existing_files_and_checks_headers(tmp_path: Path) -> None:
    """An existing file: refused without append; appended with a matching header; refused with another."""
    path = tmp_path / "log.csv"
    first = CsvLog(path, ("step", "x"), append=False)
    first.add((0, 1.0))
    first.close()
    with pytest.raises(ValueError, match="profile_append"):
        CsvLog(path, ("step", "x"), append=False)
    with pytest.raises(ValueError, match="columns"):
        CsvLog(path, ("step", "y"), append=True)
    second = CsvLog(path, ("step", "x"), append=True)
    second.add((1, 2.0))
    second.close()
    assert list(pd.read_csv(path).step) == [0, 1]


def test_existing_files_per_rank(tmp_path: Path) -> None:
    """Rank 0 sees any of hylo's files; rank r only its own; other files are ignored."""
    for name in ("metrics.csv", "timing-r1.csv", "notes.txt"):
        (tmp_path / name).write_text("x\n")
    assert existing_files(tmp_path, 0) == ["timing-r1.csv"]
    assert existing_files(tmp_path, 1) == ["timing-r1.csv"]
    assert existing_files(tmp_path, 2) == []
