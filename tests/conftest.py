"""Shared pytest setup: make the in-tree package importable, seed every test, and the device tier's switch."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Running from a checkout without `pip install -e .`: the packages from their folders.
_ROOT = Path(__file__).resolve().parents[1]
for _package, _folder in (("hylo", _ROOT), ("hylo_scripts", _ROOT / "scripts"), ("hylo_analysis", _ROOT / "analysis")):
    if importlib.util.find_spec(_package) is None:
        sys.path.insert(0, str(_folder))


from tests.kit import devices  # noqa: E402  (after the path set-up above)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--device``: the device tier's switch (docs/contributing.md, "The device tier")."""
    parser.addoption(
        "--device",
        default=None,
        help=f"device of the tests marked {devices.TIER} (cpu, cuda, cuda:N; default ${devices.ENV} or cpu)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Check the switch before collection and hand it to the kit (and child processes) through the environment."""
    config.addinivalue_line("markers", f"{devices.TIER}: the module's tests run on the device --device chooses")
    config.addinivalue_line(
        "markers", f"{devices.EXPLICIT}(reason): a tier test that places its tensors itself (no default device)"
    )
    name = config.getoption("--device") or os.environ.get(devices.ENV) or "cpu"
    try:
        devices.parse(name)
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    os.environ[devices.ENV] = name
    if name.startswith("cuda"):  # cuBLAS's deterministic workspace, before its first use (devices.on_device)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _tier_device(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of a ``device_tier`` module (not ``explicit_device``) runs with the chosen device as its default."""
    node = request.node
    if node.get_closest_marker(devices.TIER) is None or node.get_closest_marker(devices.EXPLICIT) is not None:
        yield
        return
    device = devices.chosen()
    before = devices.allocations(device)
    with devices.on_device(device):
        yield
    if device.type != "cpu" and devices.allocations(device) == before:
        node.user_properties.append((_IDLE_KEY, str(device)))  # reaches the controller under pytest-xdist too


_IDLE_KEY = "device_tier_idle"
#: Tier tests that allocated nothing on a non-CPU device (they check what they check on the CPU): listed at the end.
_IDLE: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the tier tests that ran nothing on the chosen device (:func:`_tier_device` marks them)."""
    if report.when == "teardown" and any(key == _IDLE_KEY for key, _ in report.user_properties):
        _IDLE.append(report.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the tier tests that ran nothing on the chosen device, so that a device run says what it covered."""
    if _IDLE:
        terminalreporter.write_sep("-", f"{len(_IDLE)} device-tier tests allocated nothing on {devices.chosen()}")
        for nodeid in _IDLE:
            terminalreporter.write_line(nodeid)


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
