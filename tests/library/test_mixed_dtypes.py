"""Layers of several working dtypes in one model, and layers whose ∇W is zero between updates: the grouped step equals
the per-layer step (docs/design.md, "The apply plan"; docs/reliability.md, "Guarantees").

- Every solver over every order of the dtypes float64, float32, bf16 and float16 (one equal-shaped Linear of each,
  in that order): the grouped step's gradients equal the layer-by-layer step's at every step, to the resolution of
  each layer's dtype, and neither raises.
- A kernel that raises, whatever it raises, reaches the per-layer path: the step goes on layer by layer and a
  warning names the layers of the step and the error; a layer whose own math raises is named by the error.
- A layer present with ∇W = 0 between updates (not called, ``zero_grad(set_to_none=False)``) under a state whose
  step changes its moments (Adam's momentum step) gets the same step in both paths, in every dtype.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.pipeline.apply import GroupedApply

pytestmark = pytest.mark.usefixtures("single_thread")

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
#: Every built-in solver, kfac_adam with both second moments (an ε above float16's noise: Adam divides by it).
SOLVERS: dict[str, dict[str, Any]] = {
    "kfac": {"solver": "kfac"},
    "kfac-inverse": {"solver": "kfac", "kfac_method": "inverse"},
    "sngd": {"solver": "sngd"},
    "kid": {"solver": "kid", "rank_ratio": 0.5},
    "kis": {"solver": "kis", "rank_ratio": 0.5},
    "hybrid": {"solver": "hybrid"},
    "kfac_adam": {"solver": "kfac_adam", "adam_eps": 1e-3},
    "kfac_adam-factors": {"solver": "kfac_adam", "second_moment": "factors", "adam_eps": 1e-3},
}
WIDTH = 6


class Chain(nn.Module):
    """Equal-shaped Linear layers of the given dtypes in that order, each fed its predecessor's output cast to its
    dtype; ``skip`` leaves one layer out of the forward (its gradient is then whatever ``zero_grad`` left)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...], seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH).to(dtype) for dtype in dtypes)
        self.skip: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return x.to(torch.float64)


def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(12, WIDTH, generator=gen, dtype=torch.float64), torch.randint(0, WIDTH, (12,), generator=gen)


def _run(
    dtypes: tuple[torch.dtype, ...],
    options: dict[str, Any],
    grouped: bool,
    steps: int = 4,
    skip: dict[int, int] | None = None,
) -> list[list[Tensor]]:
    """Each step's preconditioned weight gradients (float64 copies) of a run of :class:`Chain`; ``skip``: step → the
    layer not called at that step. The weights stay as they are (lr 0), so that both paths see the same gradients
    at every step and differ only by the rounding of their own arithmetic."""
    model = Chain(dtypes)
    pre = hylo.HyLoPreconditioner(model, damping=0.1, update_freq=3, grouped=grouped, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = []
    for step in range(steps):
        model.skip = (skip or {}).get(step)
        x, y = _batch(step)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        out.append([layer.weight.grad.to(torch.float64).clone() for layer in model.layers])
        opt.step()
    return out


def _assert_paths_agree(
    grouped: list[list[Tensor]], per_layer: list[list[Tensor]], dtypes: tuple[torch.dtype, ...]
) -> None:
    for step, (a_step, b_step) in enumerate(zip(grouped, per_layer, strict=True)):
        for dtype, a, b in zip(dtypes, a_step, b_step, strict=True):
            assert bool(torch.isfinite(a).all()), (step, dtype)
            # both paths compute in the working dtype and round to the layer's dtype once
            tol = 1e-10 if dtype == torch.float64 else 8 * torch.finfo(dtype).eps
            scale = max(float(b.abs().max()), 1e-30)
            assert float((a - b).abs().max()) <= tol * scale, (step, dtype, float((a - b).abs().max()) / scale)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_every_order_of_working_dtypes_steps_alike_grouped_and_per_layer(solver: str) -> None:
    for dtypes in itertools.permutations(DTYPES):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fallback warning, no rejected state
            grouped = _run(dtypes, SOLVERS[solver], grouped=True)
        _assert_paths_agree(grouped, _run(dtypes, SOLVERS[solver], grouped=False), dtypes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("second_moment", ["gradient", "factors"])
def test_a_layer_with_zero_gradient_between_updates_gets_one_step_in_both_paths(
    dtype: torch.dtype, second_moment: str
) -> None:
    """The second layer is not called at steps 4 and 5 (between updates): its ∇W is the zero ``zero_grad`` left, and
    both paths take Adam's momentum step, m̂/(v̂^p + ε) rotated back, nonzero and finite."""
    dtypes = (torch.float32, dtype, torch.float32)
    options = {"solver": "kfac_adam", "second_moment": second_moment, "adam_eps": 1e-3}
    skip = {4: 1, 5: 1}
    grouped = _run(dtypes, options, grouped=True, steps=6, skip=skip)
    per_layer = _run(dtypes, options, grouped=False, steps=6, skip=skip)
    _assert_paths_agree(grouped, per_layer, dtypes)
    for step in (4, 5):
        assert float(grouped[step][1].abs().max()) > 0  # the momentum step, not the zero gradient


def test_a_kernel_error_of_any_kind_reaches_the_per_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grouped kernel raising a torch error, an arithmetic error or an assertion: the step goes on with the
    kernels one layer a group (the same gradients as ``grouped=False``) and warns, naming the error and the
    layers."""
    dtypes = (torch.float32, torch.float32, torch.float32)
    reference = _run(dtypes, {"solver": "kfac"}, grouped=False)
    real = GroupedApply.checked
    for error in (RuntimeError("value cannot be converted"), ZeroDivisionError("boom"), AssertionError()):

        def failing(self: GroupedApply, *args: Any, error: BaseException = error) -> Any:
            if self.singles:  # the kernels one layer a group, where the step goes on
                return real(self, *args)
            raise error

        with monkeypatch.context() as patch:
            patch.setattr(GroupedApply, "checked", failing)
            with pytest.warns(UserWarning, match=r"layer by layer.*layers\.0.*layers\.2") as caught:
                got = _run(dtypes, {"solver": "kfac"}, grouped=True)
        assert any(type(error).__name__ in str(w.message) for w in caught)
        _assert_paths_agree(got, reference, dtypes)
