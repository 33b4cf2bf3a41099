"""argparse types of the trainers' and benchmarks' flags: checked numbers, parsed as the flags are read (the
benchmarks' shared flags: :mod:`hylo_scripts.benchmarks.flags`)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def byte_cap(text: str) -> int | None:
    """A byte cap: an int >= 0, where 0 means no cap (None)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0 (0: no cap), got {text}")
    return value or None


def ratio(text: str) -> float | str:
    """A rank ratio ρ in (0, 1], or ``auto`` (hylo's adaptive rank)."""
    if text == "auto":
        return text
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a ratio must be in (0, 1] or 'auto', got {text}")
    return value
