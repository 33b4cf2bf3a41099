"""Every benchmark's ``--device`` (docs/benchmarks.md, "Devices"): a CUDA device this machine lacks is refused
with exit status 2 and a message naming it, multi-rank CUDA runs need a GPU per rank, every clock reading of a
benchmark is :func:`hylo_scripts.benchmarks.timing.now` (a device synchronisation first), and the device is printed and
written to the CSVs."""

from __future__ import annotations

import ast
import csv
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hylo_scripts.benchmarks import (
    bench_accuracy,
    bench_comm,
    bench_compile,
    bench_fidelity,
    bench_memory,
    bench_models,
    bench_moe,
    bench_solvers,
    bench_stagger,
    bench_wrappers,
    devices,
    model_grid,
    timing,
)
from hylo_scripts.models.model_families import FAMILIES

#: The benchmarks of this file (bench_overhead and bench_peers have their own tests).
BENCHMARKS: list[ModuleType] = [
    bench_accuracy,
    bench_comm,
    bench_compile,
    bench_fidelity,
    bench_memory,
    bench_models,
    bench_moe,
    bench_solvers,
    bench_stagger,
    bench_wrappers,
]
#: The module whose clock a benchmark times with, where not its own (None: it times nothing): bench_comm counts bytes;
#: bench_models' tables time nothing, its grid times in model_grid.
CLOCKS: dict[ModuleType, ModuleType | None] = {bench_comm: None, bench_models: model_grid}


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This process sees ``count`` CUDA devices (none when 0), named ``Fake GPU <index>``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"Fake GPU {index}")


def _refused(main: Callable[[Sequence[str]], Any], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)``'s usage error message (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda module: module.__name__.rsplit(".", 1)[-1])
def test_a_cuda_device_this_machine_lacks_is_refused(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_gpus(monkeypatch, 0)
    assert "argument --device: cuda: no CUDA device is available on this machine" in _refused(
        bench.main, ["--device", "cuda"], capsys
    )
    _fake_gpus(monkeypatch, 1)
    assert "argument --device: cuda:1: this machine has 1 CUDA devices" in _refused(
        bench.main, ["--device", "cuda:1"], capsys
    )


@pytest.mark.parametrize(
    ("bench", "argv"),
    [
        (bench_comm, ["--measure", "--measure-ranks", "2", "4"]),
        (bench_wrappers, ["--wrappers", "none", "ddp", "--world", "4", "--batch-size", "8"]),
    ],
    ids=["bench_comm", "bench_wrappers"],
)
def test_multi_rank_cuda_runs_need_a_gpu_per_rank(
    bench: ModuleType, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_gpus(monkeypatch, 2)
    error = _refused(bench.main, [*argv, "--device", "cuda"], capsys)
    assert "--device cuda: 4 ranks need one GPU each (NCCL), this machine has 2" in error
    error = _refused(bench.main, [*argv, "--device", "cuda:0"], capsys)
    assert "--device cuda:0: rank r of a 4-rank run uses cuda:r (NCCL, one GPU per rank); give --device cuda" in error


def test_the_ranks_devices_and_backend() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [devices.rank_device(cpu, r) for r in (0, 1)] == [cpu, cpu] and devices.backend(cpu) == "gloo"
    assert [devices.rank_device(cuda, r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert devices.backend(cuda) == "nccl" and devices.ranks_problem(cpu, 64) is None


def test_the_device_is_named_with_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)
    assert devices.describe(torch.device("cpu")) == "cpu"
    assert devices.describe(torch.device("cuda")) == "cuda:0 (Fake GPU 0)"
    assert devices.describe(torch.device("cuda:1")) == "cuda:1 (Fake GPU 1)"
    assert devices.ranks_problem(torch.device("cuda"), 2) is None


def test_the_clock_synchronises_the_device_before_each_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"sync {device}"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: calls.append("clock") or float(len(calls)))
    timing.now(torch.device("cuda:1"))
    timing.now(torch.device("cpu"))
    assert calls == ["sync cuda:1", "clock", "clock"]


def _imports(module: ModuleType) -> tuple[set[str], set[str]]:
    """The modules ``module`` imports and the names it imports from them."""
    tree = ast.parse(inspect.getsource(module))
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    return modules, names


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda module: module.__name__.rsplit(".", 1)[-1])
def test_benchmarks_read_no_clock_but_the_synchronised_one(bench: ModuleType) -> None:
    """No ``time`` module: every timed section reads :func:`timing.now` (bench_accuracy's runs time through
    ``hylo_scripts.training.loop``, whose clocks are CUDA events and a host read of the loss; :data:`CLOCKS` where a
    benchmark's clock is another module's)."""
    clock = CLOCKS.get(bench, bench)
    assert "time" not in _imports(bench)[0]
    if clock is not None:
        assert "time" not in _imports(clock)[0] and "timing" in _imports(clock)[1]


def test_bench_solvers_on_cpu_prints_and_writes_its_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "solvers.csv"
    argv = ["--dims", "8", "--batches", "4", "--solvers", "kfac", "kis", "--repeats", "1", "--threads", "1"]
    bench_solvers.main([*argv, "--device", "cpu", "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device: cpu" and lines[1].split() == ["solver", "d", "n", "update_ms", "step_ms"]
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["solver"], r["device"]) for r in rows] == [("kfac", "cpu"), ("kis", "cpu")]


def test_bench_compile_eager_on_cpu_prints_its_device(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "decoder", "--vocab", "32", "--context", "8", "--batch-size", "2", "--solver", "kfac"]
    argv += ["--steps", "2", "--warmup", "1", "--threads", "1", "--setups", "eager", "eager+hylo", "--device", "cpu"]
    bench_compile.main(argv)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device: cpu" and [line.split()[0] for line in lines[2:]] == ["eager", "eager+hylo"]


def test_bench_comm_measures_on_cpu_as_counted(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--models", "mlp", "--ranks", "2", "--measure", "--measure-ranks", "2", "--measure-solvers", "kfac"]
    bench_comm.main([*argv, "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "measured on gloo vs analytic" in printed and "device: cpu\n" in printed
    assert "layers differing: 0" in printed


def test_bench_stagger_on_cpu_prints_its_device(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "mlp", "--batch-size", "8", "--solver", "kfac", "--update-freq", "2", "--no-staggered"]
    bench_stagger.main([*argv, "--steps", "2", "--warmup", "0", "--rounds", "1", "--threads", "1", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu, threads 1,")
    assert [line.split()[0] for line in lines[2:]] == ["plain", "hylo"]


def test_bench_moe_on_cpu_prints_and_writes_its_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    argv = ["--parts", "coverage", "cost", "--width", "16", "--layers", "1", "--experts", "2", "--expert-width", "16"]
    argv += ["--batch-size", "2", "--seq-len", "8", "--cost-steps", "2", "--cost-rounds", "1", "--warmup", "0"]
    assert bench_moe.main([*argv, "--threads", "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("device: cpu, torch ")
    for name, count in (("coverage.csv", 3), ("cost.csv", 4)):
        with (tmp_path / name).open() as handle:
            assert [row["device"] for row in csv.DictReader(handle)] == ["cpu"] * count, name


def test_bench_models_on_cpu_prints_its_device_and_the_grid_writes_it(tmp_path: Path) -> None:
    """The tables' runs name the device first; the grid (:func:`model_grid.measure`) writes it in its rows and
    appends to a file begun without that column in the file's own columns."""
    pytest.importorskip("transformers")
    lines: list[str] = []
    bench_models.main(["--families", "OPT", "--steps", "1", "--threads", "1", "--device", "cpu"], out=lines.append)
    assert lines[0].startswith("device: cpu, torch ")
    out = tmp_path / "grid.csv"
    model_grid.measure([FAMILIES["GPT-2"]], [3e-3], [0], 1, out, device=torch.device("cpu"))
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["device"] for row in rows} == {"cpu"} and len(rows) == 4
    old = tmp_path / "old.csv"
    old.write_text(",".join(field for field in model_grid.FIELDS if field != "device") + "\n")
    model_grid.measure([FAMILIES["GPT-2"]], [3e-3], [0], 1, old, device=torch.device("cpu"))
    with old.open() as handle:
        again = list(csv.DictReader(handle))
    assert len(again) == 4 and "device" not in again[0] and None not in again[0]
