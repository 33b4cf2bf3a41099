"""The device tier (docs/contributing.md, "The device tier"): the device the numerical oracle tests run on, chosen
by one switch, and the tolerances each device's results are held to.

``python -m pytest --device cuda`` (or ``HYLO_TEST_DEVICE=cuda``; default ``cpu``) runs every test of a module
marked ``device_tier`` inside :class:`OnDevice`: tensors and modules the test (and its kit) creates without naming a
device are created on the chosen one, so the same test body checks the same equalities there. Random draws are
made on the CPU and moved, so a case holds the same numbers (weights, batches) on every device. A test of the
tier that places its tensors itself is marked ``explicit_device``: no mode is entered for it. With the switch at
``cpu`` nothing changes: no mode is entered.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

#: The environment variable of the switch (pytest's ``--device`` sets it for the session and its child processes).
ENV = "HYLO_TEST_DEVICE"
#: The marker of the modules whose tests run on the chosen device.
TIER = "device_tier"
#: The marker of a tier test that places its tensors itself, on the CPU (it forks gloo ranks) or on the chosen device
#: explicitly (tests/library/test_cuda.py: a library tensor made without a device then fails): no default-device mode.
EXPLICIT = "explicit_device"


@dataclass(frozen=True)
class Tolerances:
    """Relative (Frobenius) errors a device's float64 results are held to.

    ``rtol``: a preconditioned gradient against its dense oracle (a solve in between); ``replay_rtol``: two
    computations of the same quantity without a solve (a reference's ∇W against autograd's); ``cross_device``: a
    run on this device against the same run on the CPU, over several steps of every solver; ``batched``: a layer's
    step computed alone against the same step batched with other layers' (hybrid's families), 0 = bit for bit;
    ``float32``: two float32 computations of one quantity in different blocks (∇W's weight and bias apart, or whole);
    ``clock``: profiling's recorded phases against the step's time they add up to (CUDA events report float32 ms).
    """

    rtol: float
    replay_rtol: float
    cross_device: float
    batched: float
    float32: float
    clock: float


#: Every device type's tolerances, the one place they are stated. CUDA's float64 kernels (cuBLAS, cuSOLVER, cuDNN)
#: sum in other orders than the CPU's, and a batched product picks other kernels than a single one, so a replay is
#: held to 1e-11 there and a batched step to 1e-12; the solves' error against the oracle is dominated by
#: conditioning, the same on both.
TOLERANCES: dict[str, Tolerances] = {
    "cpu": Tolerances(rtol=1e-8, replay_rtol=1e-12, cross_device=0.0, batched=0.0, float32=1e-6, clock=1e-9),
    "cuda": Tolerances(rtol=1e-8, replay_rtol=1e-11, cross_device=1e-9, batched=1e-12, float32=1e-5, clock=1e-6),
}


def parse(name: str) -> torch.device:
    """The device ``name`` names (``cpu``, ``cuda``, ``cuda:N``); ``ValueError`` naming it otherwise, or when this
    machine lacks it."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"{ENV}/--device: {name!r} is not a device ({err})") from None
    if device.type not in TOLERANCES:
        raise ValueError(f"{ENV}/--device: {name!r}: the tier runs on {sorted(TOLERANCES)}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{ENV}/--device: {name!r}: no CUDA device is available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{ENV}/--device: {name!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def chosen() -> torch.device:
    """The device the tier runs on: ``$HYLO_TEST_DEVICE``, default ``cpu``."""
    return parse(os.environ.get(ENV, "cpu") or "cpu")


def tolerances() -> Tolerances:
    """The chosen device's :class:`Tolerances`."""
    return TOLERANCES[chosen().type]


#: Random draws that create a tensor (a device of their own, or their input's).
_DRAWS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal}
_DRAWS_LIKE = {torch.rand_like, torch.randn_like, torch.randint_like}
#: Random draws into an existing tensor (``torch.nn.init``'s functions, also intercepted, call them).
_DRAWS_IN_PLACE = {
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
}


class OnDevice(TorchFunctionMode):
    """Tensor factories called without a device create on ``device`` (as ``with torch.device(device)`` does); every
    random draw of a factory, a ``*_like`` draw, an in-place draw or a ``torch.nn.init`` function is made on the CPU,
    from the CPU generator it names or the CPU's default one, and moved: the same numbers, parameters and batches as
    on the CPU, so a case and the thresholds measured on it carry over. Draws inside a model's forward (dropout)
    stay the device's."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        generator = kwargs.get("generator")
        on_host = generator is None or generator.device.type == "cpu"
        # an in-place draw: torch.nn.init's (its tensor a keyword) or a tensor method's (its tensor first)
        in_place = getattr(func, "__module__", None) == "torch.nn.init" or func in _DRAWS_IN_PLACE
        target = kwargs.get("tensor") if "tensor" in kwargs else (args[0] if args else None)
        if in_place and on_host and isinstance(target, torch.Tensor) and target.device.type != "cpu":
            host = torch.empty(target.shape, dtype=target.dtype)
            if "tensor" in kwargs:
                func(*args, **{**kwargs, "tensor": host})
            else:
                func(host, *args[1:], **kwargs)
            with torch.no_grad():
                return target.copy_(host)
        if func in _DRAWS_LIKE and on_host and args[0].device.type != "cpu" and kwargs.get("device") is None:
            like = torch.empty(args[0].shape, dtype=args[0].dtype)  # its shape and dtype: nothing copied
            return func(like, *args[1:], **kwargs).to(args[0].device)
        if func in _device_constructors() and kwargs.get("device") is None:
            if func in _DRAWS and on_host:
                return func(*args, **kwargs).to(self.device)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


@contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Run the block with :class:`OnDevice` and, on CUDA, without TF32 (float32 products at full precision, as on the
    CPU) and with deterministic algorithms (a test that runs a step twice compares bits; warn where torch has
    none); restore all after."""
    if device.type == "cpu":
        yield
        return
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with OnDevice(device):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def allocations(device: torch.device) -> int:
    """How many allocations ``device`` has served in this process (0 on the CPU): a tier test that served none ran
    nothing there."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))
