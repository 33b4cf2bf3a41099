"""The device tier's own machinery (docs/contributing.md, "The device tier"), checked on the CPU: the switch refuses
what it cannot run, the default-device mode puts what a test creates on the chosen device while drawing every random
number from the CPU's generators, and the host-sync counter counts a call once under that mode. The ``meta`` device
stands in for a GPU here: tensors land on it, no values are computed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kit import devices
from tests.kit.checks import counting_host_syncs

META = torch.device("meta")


def test_the_switch_names_what_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert devices.parse("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'bogus' is not a device"):
        devices.parse("bogus")
    with pytest.raises(ValueError, match="'meta': the tier runs on \\['cpu', 'cuda'\\]"):
        devices.parse("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'cuda': no CUDA device is available on this machine"):
        devices.parse("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="'cuda:1': this machine has 1 CUDA devices"):
        devices.parse("cuda:1")
    monkeypatch.setenv(devices.ENV, "cpu")
    assert devices.chosen() == torch.device("cpu") and devices.tolerances() == devices.TOLERANCES["cpu"]


def _make() -> list[torch.Tensor]:
    """What a test typically creates: module parameters (nn.init's in-place draws), draws from the default and
    from a seeded CPU generator, a ``*_like`` draw, and plain factories."""
    layer = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, generator=gen)
    return [layer.weight, layer.bias, x, torch.randint(0, 3, (2,)), torch.rand_like(x), torch.zeros(2), torch.eye(2)]


def test_the_mode_creates_on_the_device_and_draws_on_the_cpu() -> None:
    torch.manual_seed(0)
    on_cpu = _make()
    after_cpu = torch.randn(3)
    torch.manual_seed(0)
    with devices.OnDevice(META):
        on_meta = _make()
    after_meta = torch.randn(3)
    assert all(t.device == META for t in on_meta)
    assert [t.shape for t in on_meta] == [t.shape for t in on_cpu]
    assert [t.dtype for t in on_meta] == [t.dtype for t in on_cpu]
    # the mode drew exactly the CPU run's numbers from the CPU's default generator: the stream continues alike
    assert torch.equal(after_meta, after_cpu)
    assert isinstance(on_meta[0], nn.Parameter) and on_meta[0].requires_grad


def test_a_tensor_named_on_the_cpu_stays_there() -> None:
    with devices.OnDevice(META):
        kept = torch.zeros(2, device="cpu")
        drawn = torch.randn(2, device="cpu")
    assert kept.device.type == drawn.device.type == "cpu"


def test_the_host_sync_counter_counts_a_call_once_under_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.ones(2)
    with counting_host_syncs(monkeypatch) as calls, devices.OnDevice(torch.device("cpu")):
        x.sum().item()
        bool(x.all())
    assert calls["item"] == 1 and calls["__bool__"] == 1


def test_every_device_states_every_tolerance() -> None:
    fields = set(devices.Tolerances.__dataclass_fields__)
    assert set(devices.TOLERANCES) == {"cpu", "cuda"}
    for tolerances in devices.TOLERANCES.values():
        assert {name for name in fields if getattr(tolerances, name) >= 0} == fields
    cpu = devices.TOLERANCES["cpu"]
    assert cpu.batched == 0.0 and cpu.cross_device == 0.0  # the CPU is the reference, bit for bit
