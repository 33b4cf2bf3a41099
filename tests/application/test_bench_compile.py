"""scripts/bench_compile.py: the graphs a compiled, preconditioned model runs (docs/wrappers.md, "torch.compile")."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("torch._dynamo")


@pytest.mark.slow
def test_the_benchmark_counts_the_graphs_of_a_compiled_decoder() -> None:
    """scripts/bench_compile.py on a tiny DecoderLM (inductor): one graph per step that does not capture."""
    from hylo_scripts.benchmarks import bench_compile

    args = argparse.Namespace(
        model="decoder",
        vocab=32,
        context=8,
        batch_size=2,
        solver="kfac",
        update_freq=2,
        steps=4,
        warmup=2,
        device=torch.device("cpu"),
    )
    plain = bench_compile.measure("compiled", args)
    for setup in ("compiled+hylo (after)", "compiled+hylo (before)"):
        row = bench_compile.measure(setup, args)
        assert row.graphs == plain.graphs and row.compiled == plain.compiled, (row, plain)
