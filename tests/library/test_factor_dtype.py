"""K-FAC statistics whose products run in a lower precision (``factor_dtype``; docs/solvers.md, "Low-precision
statistics").

The references are the exact factors of ``test_sampled_statistics``: plain float64 products of each layer's true
input and output gradient, captured there, never hylo's rows. With ``factor_dtype`` a call's rows are rounded to
that dtype and multiplied there, so the factors hylo keeps (in the working dtype, float64 here) are the exact ones
to that dtype's rounding, and not closer: the products really ran in it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hylo import HyLoPreconditioner
from tests.kit.checks import rel_err
from tests.library.test_sampled_statistics import CASES, factors_after_an_update, packed_blocks

pytestmark = [pytest.mark.usefixtures("single_thread")]

#: (the largest relative error, the smallest) of each dtype's factors against the exact ones: bfloat16 keeps 8
#: bits of each row entry and of each sum, float32 24.
BOUNDS = {"bfloat16": (2.0**-7, 1e-5), "float32": (2.0**-20, 1e-12)}


@pytest.mark.parametrize("dtype", list(BOUNDS))
@pytest.mark.parametrize("case", list(CASES))
def test_factors_formed_in_a_lower_precision_are_the_exact_ones_to_its_rounding(case: str, dtype: str) -> None:
    """Linear, Conv2d, Embedding and attention: A and G within the dtype's rounding of the exact factors, held in
    the working dtype."""
    largest, smallest = BOUNDS[dtype]
    got, exact = factors_after_an_update(case, factor_dtype=dtype)
    for name, (want_a, want_g) in exact.items():
        factor_a, factor_g = got[name]
        assert factor_a.dtype == factor_g.dtype == torch.float64, name
        if case != "embedding":  # an embedding's A is its token counts, exact in any dtype
            assert smallest < rel_err(factor_a, want_a) < largest, (case, name, "A", rel_err(factor_a, want_a))
        assert smallest < rel_err(factor_g, want_g) < largest, (case, name, "G", rel_err(factor_g, want_g))


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam"])
def test_blocked_factors_formed_in_bfloat16_are_the_exact_blocks_to_its_rounding(solver: str) -> None:
    """With ``factor_block`` the blocks' products run in bfloat16 as well, for every family that keeps factors."""
    got, exact = factors_after_an_update("linear", solver, factor_dtype="bfloat16", factor_block=3)
    (factor_a, factor_g), (want_a, want_g) = next(iter(got.values())), next(iter(exact.values()))
    largest, smallest = BOUNDS["bfloat16"]
    assert smallest < rel_err(factor_a, packed_blocks(want_a, 3)) < largest
    assert smallest < rel_err(factor_g, packed_blocks(want_g, 3)) < largest


@pytest.mark.parametrize("value", ["float16", "bf16", torch.bfloat16, 16])
def test_an_unknown_factor_dtype_is_refused_at_construction(value: object) -> None:
    with pytest.raises(ValueError, match="factor_dtype"):
        HyLoPreconditioner(nn.Linear(3, 2), solver="kfac", factor_dtype=value)


def test_a_float64_layer_beside_a_float32_one_keeps_its_own_working_dtype() -> None:
    """Each layer's rows go to bfloat16 for the products and its sums come back to its own working dtype: the
    float64 layer's factors in float64, the float32 layer's in float32, each the exact factors of its own true
    inputs and output gradients to bfloat16's rounding."""
    torch.manual_seed(0)
    first, second = nn.Linear(5, 4), nn.Linear(4, 3, dtype=torch.float64)
    x, target = torch.randn(6, 5), torch.randn(6, 3, dtype=torch.float64)
    model = nn.Sequential(first, second)
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=1, damping=0.1, factor_dtype="bfloat16")
    hidden = first(x)
    hidden.retain_grad()
    out = second(torch.tanh(hidden).double())
    out.retain_grad()
    torch.nn.functional.mse_loss(out, target).backward()
    pre.step()
    largest, smallest = BOUNDS["bfloat16"]
    for info, inputs, grad in (
        (pre.layer_info()[0], x, hidden.grad),
        (pre.layer_info()[1], torch.tanh(hidden).double(), out.grad),
    ):
        assert grad is not None and info.state is not None
        a = torch.cat([inputs.detach().double(), torch.ones(6, 1, dtype=torch.float64)], dim=1)
        g = 6 * grad.double()
        state = info.state.tensors
        assert state["factor_a"].dtype == state["factor_g"].dtype == info.math.dtype
        assert smallest < rel_err(state["factor_a"].double(), a.mT @ a / 6) < largest, info.name
        assert smallest < rel_err(state["factor_g"].double(), g.mT @ g / 6) < largest, info.name
    assert [info.math.dtype for info in pre.layer_info()] == [torch.float32, torch.float64]
