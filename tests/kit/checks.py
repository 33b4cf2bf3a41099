"""Comparisons and tolerances shared by the tests."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from hylo import HyLoPreconditioner
from hylo.layers.gradmatrix import GradMatrix
from tests.kit.devices import tolerances

#: dtype of the models whose results are compared tightly.
DT = torch.float64
#: Relative (Frobenius) error allowed between a float64 preconditioned gradient and its dense oracle (per device:
#: :data:`tests.kit.devices.TOLERANCES`).
RTOL = tolerances().rtol
#: Relative error allowed between two float64 computations of the same quantity (no solve in between).
REPLAY_RTOL = tolerances().replay_rtol


def rel_err(actual: Tensor, expected: Tensor, floor: float = 0.0) -> float:
    """‖actual − expected‖ / max(‖expected‖, floor) (Frobenius norms)."""
    return float((actual - expected).norm() / expected.norm().clamp_min(floor))


def assert_rel_close(actual: Tensor, expected: Tensor, rtol: float = RTOL) -> None:
    """Same shape and ``rel_err(actual, expected) <= rtol``."""
    assert actual.shape == expected.shape
    err = rel_err(actual, expected)
    assert err <= rtol, f"relative error {err:.3e} > {rtol:g}"


def assert_same_step(actual: Tensor, expected: Tensor, what: str = "") -> None:
    """A layer's step computed alone equals the step batched with other layers': bit for bit on the CPU, within the
    device's ``batched`` tolerance elsewhere (:data:`tests.kit.devices.TOLERANCES`)."""
    tol = tolerances().batched
    if tol == 0.0:
        assert torch.equal(actual, expected), what
    else:
        assert_rel_close(actual, expected, tol)


def grad_matrix(module: nn.Module) -> Tensor:
    """∇W of a Linear/Conv2d as (d_g, d_a), bias as the last column (a copy)."""
    weight = module.weight
    grad = weight.grad.reshape(weight.shape[0], -1)
    if module.bias is not None:
        grad = torch.cat([grad, module.bias.grad.reshape(-1, 1)], dim=1)
    return grad.detach().clone()


def as_parts(matrix: Tensor, bias: bool) -> GradMatrix:
    """A (d_g, d_a) matrix as the weight and bias parts a step reads ∇W in (the same arithmetic, bit for bit)."""
    return GradMatrix(matrix[:, :-1].contiguous(), matrix[:, -1].contiguous()) if bias else GradMatrix(matrix)


def grads(model: nn.Module) -> list[Tensor]:
    """Copies of the gradients of every parameter of ``model``."""
    return [p.grad.detach().clone() for p in model.parameters()]


def state_snapshot(pre: HyLoPreconditioner) -> dict[str, dict[str, Tensor] | None]:
    """Copies of every registered layer's state tensors, by layer name (``None`` before any update)."""
    return {
        info.name: None if info.state is None else {k: v.detach().clone() for k, v in info.state.tensors.items()}
        for info in pre.layer_info()
    }


class Unfolds(TorchFunctionMode):
    """Records the bytes of every block of patches ``F.unfold`` returns while active (a convolution's chunks)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is F.unfold:
            self.sizes.append(out.nbytes)
        return out


def assert_same_tensors(a: object, b: object) -> None:
    """Recursive equality of nested dicts/lists of tensors and plain values (bit for bit)."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor)
        assert a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tensors(x, y)
    else:
        assert a == b


#: The tensor methods that copy a value to the host (and so synchronise with the device).
HOST_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")


@contextmanager
def counting_host_syncs(
    monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...] = HOST_SYNCS
) -> Iterator[dict[str, int]]:
    """Count calls of the tensor methods ``names`` while the block runs (the dict updates live)."""
    calls = dict.fromkeys(names, 0)
    depth = [0]  # a torch function mode (the device tier's) re-enters the patched method: count the outer call

    def counting(name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)

        def wrapper(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            calls[name] += depth[0] == 0
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    with monkeypatch.context() as patched:
        for name in names:
            patched.setattr(torch.Tensor, name, counting(name))
        yield calls


def through_torch_save(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``, as the stacks' checkpoints go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded
