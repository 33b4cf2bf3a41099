"""The forked-gloo test harness itself (tests/kit/harness.py).

Results come back by rank; errors, dead ranks and hangs in a rank fail the test promptly and
clearly, and no child process outlives a call.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.kit.harness import DistributedTimeoutError, WorkerError, run_distributed


def _report(rank: int, world_size: int, payload: str) -> dict[str, Any]:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "sum": total,
        "threads": torch.get_num_threads(),
        "payload": payload,
        "pid": os.getpid(),
    }


def test_harness_returns_results_by_rank() -> None:
    out = run_distributed(_report, 3, "hello", timeout=30)
    assert [r["rank"] for r in out] == [r["dist_rank"] for r in out] == [0, 1, 2]
    assert all(r["world_size"] == 3 and r["threads"] == 1 and r["payload"] == "hello" for r in out)
    assert all(float(r["sum"]) == 3.0 for r in out)
    assert len({r["pid"] for r in out} | {os.getpid()}) == 4
    assert not multiprocessing.active_children()


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here for rank 1 forever without the harness


def test_harness_reports_worker_error_promptly() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match="boom from rank 1") as info:
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < 15, f"took {elapsed:.1f} s to report a worker error"
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "_raise_on_rank_1" in str(info.value)  # the remote traceback is in the message
    assert "Traceback" in str(info.value)
    assert not multiprocessing.active_children()


def _hang_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)  # never enters the collective
    dist.all_reduce(torch.ones(1))


def test_harness_kills_hung_workers_at_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match="timed out after 10 s") as info:
        run_distributed(_hang_on_rank_1, 2, timeout=10, pg_timeout=120)
    elapsed = time.monotonic() - start
    assert 10 <= elapsed < 25, elapsed
    assert 1 in info.value.unfinished
    if os.environ.get("HYLO_TEST_START_METHOD", "fork") == "fork":  # spawned ranks may still be importing
        assert "_hang_on_rank_1" in info.value.stacks.get(1, "")  # where the hung rank was stuck
    assert not multiprocessing.active_children()


def test_harness_collective_timeout_is_a_worker_error() -> None:
    """With a gloo timeout shorter than the harness timeout, the waiting rank raises inside all_reduce."""
    start = time.monotonic()
    with pytest.raises(WorkerError, match="(?i)timed out") as info:
        run_distributed(_hang_on_rank_1, 2, timeout=60, pg_timeout=2)
    assert time.monotonic() - start < 20
    assert info.value.rank == 0
    assert not multiprocessing.active_children()


def _exit_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_harness_reports_dead_worker() -> None:
    with pytest.raises(WorkerError, match="rank 0 .*exit code 3"):
        run_distributed(_exit_on_rank_0, 2, timeout=30)
    assert not multiprocessing.active_children()
