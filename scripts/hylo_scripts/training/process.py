"""Processes: torchrun's process group and this process's device, and the environment of the processes the
scripts start (torchrun's ranks, benchmark children)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hylo

#: torch.distributed backends (``auto``: NCCL on GPU, gloo on CPU).
BACKENDS = ("auto", "gloo", "nccl")


@contextmanager
def distributed(backend: str = "auto") -> Iterator[torch.device]:
    """Join torchrun's process group if launched by torchrun; yield this process's device.

    Without torchrun (no ``RANK`` in the environment) nothing is joined and the device is the
    GPU if there is one, else the CPU. ``backend="auto"`` is NCCL on GPU and gloo on CPU; the
    process group is destroyed on exit.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        yield torch.device("cuda" if cuda else "cpu")
        return
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if backend == "nccl" and not cuda:
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' (or 'auto') on CPU")
    dist.init_process_group(("nccl" if cuda else "gloo") if backend == "auto" else backend)
    try:
        yield device
        # every rank finishes before any tears the group down: gloo can abort a rank ("terminate
        # called without an active exception") whose peer destroys the group under it
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size P (0 and 1 unless torch.distributed is initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` leading to the hylo and hylo_scripts in use here.

    A child started with ``-m hylo_scripts.…`` then imports the same code as its parent, whether
    the packages are installed (editable or not) or imported from a checkout.
    """
    roots = [str(Path(hylo.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
    path = os.pathsep.join(dict.fromkeys(filter(None, [*roots, os.environ.get("PYTHONPATH")])))
    return dict(os.environ, PYTHONPATH=path, **overrides)


def run_child(module: str, config: dict[str, Any], what: str, timeout: float) -> dict[str, Any]:
    """Run ``python -m module --child <config as JSON>`` in a fresh process and return the JSON object its
    last line of output holds; ``RuntimeError`` naming ``what`` with its stderr's tail if it fails or times out."""
    command = [sys.executable, "-m", module, "--child", json.dumps(config)]
    try:
        done = subprocess.run(command, env=child_environment(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s") from err
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
