"""The device a benchmark runs on, by name, and the devices of its ranks (docs/benchmarks.md, "Devices")."""

from __future__ import annotations

import torch


def describe(device: torch.device) -> str:
    """``device`` as a benchmark's header and CSV name it: ``cpu``, or ``cuda:N (the GPU's name)``."""
    if device.type != "cuda":
        return str(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def backend(device: torch.device) -> str:
    """The process-group backend of ranks on ``device``: NCCL on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of rank ``rank`` of a run on ``device``: ``cuda:rank`` on CUDA (one GPU per rank)."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def ranks_problem(device: torch.device, ranks: int) -> str | None:
    """Why ``ranks`` ranks cannot run on ``device`` with :func:`rank_device`'s one GPU each, or None when they can.

    On CUDA rank r runs on ``cuda:r``, so a device index is refused (it would be ignored), as are
    more ranks than this machine has GPUs.
    """
    if device.type != "cuda":
        return None
    if device.index is not None:
        return (
            f"--device {device}: rank r of a {ranks}-rank run uses cuda:r (NCCL, one GPU per rank); give --device cuda"
        )
    count = torch.cuda.device_count()
    if ranks > count:
        return f"--device cuda: {ranks} ranks need one GPU each (NCCL), this machine has {count}"
    return None
