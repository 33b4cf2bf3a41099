"""Shared pytest setup: make the in-tree package importable and seed every test."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Running from a checkout without `pip install -e .`: the packages from their folders.
_ROOT = Path(__file__).resolve().parents[1]
for _package, _folder in (("hylo", _ROOT), ("hylo_scripts", _ROOT / "scripts"), ("hylo_analysis", _ROOT / "analysis")):
    if importlib.util.find_spec(_package) is None:
        sys.path.insert(0, str(_folder))


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same global RNG state (tests also pass explicit generators)."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Run a module's tiny tensor ops on one intra-op thread (faster on shared cores), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
