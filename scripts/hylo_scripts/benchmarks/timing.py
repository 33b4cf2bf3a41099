"""Wall-clock timing of benchmarks on CPU or CUDA: a device synchronisation before every reading."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` has finished."""
    synchronize(device)
    return time.perf_counter()
