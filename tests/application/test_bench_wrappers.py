"""scripts/bench_wrappers.py: each wrapper trains with and without hylo, in its own process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import hylo
from hylo_scripts.benchmarks import bench_wrappers
from hylo_scripts.benchmarks.bench_wrappers import WrapperRun


def test_checkpointed_blocks_compute_the_same_gradients_and_keep_their_layers() -> None:
    run = WrapperRun("transformer", "none", None, batch=4, layers=1, width=16, context=8)
    plain, x, y = bench_wrappers.build(run)
    wrapped = bench_wrappers.wrap(bench_wrappers.build(run)[0], "checkpoint")
    for model in (plain, wrapped):
        out = model(x)  # the bench's loss: cross-entropy over every position
        F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten() if out.dim() > 2 else y).backward()
    grads = [p.grad for p in plain.parameters()]
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, wrapped.parameters(), strict=True))
    names = [info.name for info in hylo.HyLoPreconditioner(plain).layer_info()]
    wrapped_names = [info.name for info in hylo.HyLoPreconditioner(wrapped).layer_info()]
    assert [name.replace(".inner", "") for name in wrapped_names] == names


@pytest.mark.parametrize("wrapper", ["scaler", "compile"])
def test_one_process_wrappers_train_with_hylo(wrapper: str) -> None:
    run = WrapperRun("cnn", wrapper, "kfac", batch=8, steps=2, warmup=0, update_freq=1, threads=1)
    result = bench_wrappers.train(run)
    assert result["ms_per_iter"] > 0 and result["peak_rss_mb"] > 0


def test_table_of_plain_and_hylo_runs_in_their_own_processes(capsys: pytest.CaptureFixture[str]) -> None:
    bench_wrappers.main(
        ["--model", "cnn", "--batch-size", "8", "--steps", "1", "--warmup", "0", "--threads", "1"]
        + ["--wrappers", "none", "--solver", "sngd", "--device", "cpu"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device: cpu"
    assert lines[1].split()[:3] == ["wrapper", "plain", "ms"] and len(lines) == 3
    fields = lines[2].split()
    assert fields[0] == "none" and "not run" not in lines[2]
    plain, with_hylo, ratio = (float(f) for f in fields[1:4])  # ms printed to 0.1, the ratio to 0.01
    assert (with_hylo - 0.05) / (plain + 0.05) - 0.005 <= ratio <= (with_hylo + 0.05) / (plain - 0.05) + 0.005
    assert float(fields[4]) >= plain - 0.05 and float(fields[5]) >= with_hylo - 0.05  # the slowest iterations


def test_hylo_options_reach_the_run_and_the_slowest_iteration_is_reported() -> None:
    run = WrapperRun("cnn", "none", "kfac", batch=8, steps=3, warmup=0, update_freq=2, threads=1)
    staggered = dataclasses.replace(run, options={"stagger_updates": True})
    result = bench_wrappers.train(staggered)
    assert result["slowest_ms"] >= result["ms_per_iter"] > 0
    with pytest.raises(ValueError, match="stagger_updates needs a fixed solver"):
        bench_wrappers.train(dataclasses.replace(staggered, solver="hybrid"))


def test_distributed_wrappers_run_on_spawned_ranks() -> None:
    run = WrapperRun("cnn", "ddp", "sngd", batch=8, steps=2, warmup=0, update_freq=1, world=2)
    result = bench_wrappers.child(run)
    assert result["ms_per_iter"] > 0 and result["peak_rss_mb"] > 0


def test_a_failing_child_is_reported_in_its_row() -> None:
    base = WrapperRun("cnn", "none", None, batch=4, steps=1, warmup=0, threads=1)
    rows = bench_wrappers.measure(dataclasses.replace(base), "nope", ["none"])
    assert rows == [{"wrapper": "none", "error": rows[0]["error"]}] and "solver" in rows[0]["error"]
    with pytest.raises(SystemExit):
        bench_wrappers.main(["--batch-size", "3", "--world", "2"])
