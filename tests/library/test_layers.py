"""Layer math and capture (hylo/layers.py, hylo/capture.py): what a layer's rows are, whichever way it is called.

A 1×1 convolution on a 1×1 image is a Linear; a convolution followed by an in-place ReLU is
captured before the ReLU; gradient accumulation and a layer called twice count every call once; a
keyword call and an unbatched convolution input are captured like the plain call; nothing is
captured in eval mode or without grad. The cases run under both exact solvers, against dense
references (tests/kit/reference.py) or against the equivalent plain call.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hylo import HyLoPreconditioner
from hylo.layers import FACTORS, ROWS
from hylo.layers.rows import FactoredRows
from hylo.layers.statistics import CapturedCall
from tests.kit.checks import DT, REPLAY_RTOL, assert_rel_close, grad_matrix, rel_err
from tests.kit.models import batch, mlp, one_step
from tests.kit.reference import conv_reference, dense_kfac, dense_sngd, linear_rows

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]


# --------------------------------------------------------------------------- 2. 1×1 conv == Linear
@pytest.mark.parametrize(
    "solver, options",
    [
        ("kfac", {}),
        ("kfac", {"kfc_exponent": 0.0}),
        ("kfac", {"kfc_exponent": 2.0}),
        ("kfac", {"damping_convention": "kaisa", "kfc_exponent": 2.0}),
        ("sngd", {}),
        ("sngd", {"damping_convention": "kaisa"}),
    ],
    ids=["kfac", "kfac-e0", "kfac-e2", "kfac-kaisa-e2", "sngd", "sngd-kaisa"],
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv1x1_on_1x1_image_equals_linear(solver: str, options: dict[str, object], bias: bool) -> None:
    """With L = 1 output position every KFC exponent and both damping conventions give the Linear's step."""
    lin = nn.Linear(4, 3, bias=bias, dtype=DT)
    conv = nn.Conv2d(4, 3, 1, bias=bias, dtype=DT)
    with torch.no_grad():
        conv.weight.copy_(lin.weight.reshape(3, 4, 1, 1))
        if bias:
            conv.bias.copy_(lin.bias)
    x = torch.randn(5, 4, dtype=DT)
    labels = torch.randint(0, 3, (5,))
    damping = 0.05 / 25 if options.get("damping_convention") == "kaisa" else 0.05  # KAISA's Fisher is F/n²
    _, _, grad_lin, v_lin = one_step(
        lin, x, lambda out: F.cross_entropy(out, labels), solver=solver, damping=damping, **options
    )
    _, _, grad_conv, v_conv = one_step(
        conv,
        x.reshape(5, 4, 1, 1),
        lambda out: F.cross_entropy(out.reshape(5, 3), labels),
        solver=solver,
        damping=damping,
        **options,
    )
    torch.testing.assert_close(grad_conv, grad_lin, rtol=1e-12, atol=1e-14)
    assert rel_err(v_lin, grad_lin / damping) > 1e-2
    torch.testing.assert_close(v_conv, v_lin, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- 3. in-place ReLU
def _conv_relu_net(inplace: bool) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, dtype=DT),
        nn.ReLU(inplace=inplace),
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 4, dtype=DT),
    )


@pytest.mark.parametrize("solver", ["sngd", "kfac"])
def test_conv_followed_by_inplace_relu(solver: str) -> None:
    damping = 0.01
    model = _conv_relu_net(inplace=True)
    ref = _conv_relu_net(inplace=False)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    labels = torch.randint(0, 4, (4,))

    pre = HyLoPreconditioner(model, solver=solver, update_freq=1, damping=damping)
    F.cross_entropy(model(x), labels).backward()
    conv_layer = next(info for info in pre.layer_info() if info.name == "0")
    (call,) = conv_layer.calls  # the one forward, its backward run (none pending)
    assert conv_layer.pending == 0
    grads = [grad_matrix(model[0]), grad_matrix(model[3])]
    pre.step()

    # independent reference: same weights, out-of-place ReLU, gradients via retain_grad
    s = ref[0](x)
    s.retain_grad()
    h = ref[1](s)
    h.retain_grad()
    flat = ref[2](h)
    logits = ref[3](flat)
    logits.retain_grad()
    F.cross_entropy(logits, labels).backward()
    assert not torch.equal(s.grad, h.grad)  # the ReLU masks something: pre- and post-ReLU differ
    torch.testing.assert_close(grads[0], grad_matrix(ref[0]), rtol=1e-12, atol=1e-14)

    conv_ref = conv_reference(ref[0], x, s, s.grad)
    # the hook reduced the call from the pre-ReLU gradient (rows or factors with g = ∂L/∂s, unscaled)
    assert isinstance(call, CapturedCall) and call.raw is None  # reduced in the hook, the input dropped
    if solver == "sngd":
        assert isinstance(call.reduced.get(ROWS), FactoredRows)
        torch.testing.assert_close(call.reduced.get(ROWS).g * 4, conv_ref["g_sum"], rtol=1e-12, atol=1e-14)
    else:
        assert call.reduced.get(FACTORS) is not None
        torch.testing.assert_close(call.reduced.get(FACTORS)[1] * 16 / 4, conv_ref["G"], rtol=1e-12, atol=1e-14)
    a, g = linear_rows(ref[3], flat, logits.grad)
    if solver == "sngd":
        expected_conv = dense_sngd(conv_ref["a"], conv_ref["g_sum"], grads[0], damping)
        expected_lin = dense_sngd(a, g, grads[1], damping)
    else:
        expected_conv = dense_kfac(conv_ref["A"], conv_ref["G"], grads[0], damping)
        expected_lin = dense_kfac(a.mT @ a / 4, g.mT @ g / 4, grads[1], damping)
    assert_rel_close(grad_matrix(model[0]), expected_conv)
    assert_rel_close(grad_matrix(model[3]), expected_lin)


# --------------------------------------------------------------------------- several forward calls per step
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_gradient_accumulation_matches_one_batch(solver: str) -> None:
    damping = 0.05
    whole = nn.Linear(4, 3, dtype=DT)
    accumulated = nn.Linear(4, 3, dtype=DT)
    accumulated.load_state_dict(whole.state_dict())
    x = torch.randn(8, 4, dtype=DT)
    labels = torch.randint(0, 3, (8,))
    _, dout, grad, expected_v = one_step(
        whole, x, lambda out: F.cross_entropy(out, labels), solver=solver, damping=damping
    )
    a, g = linear_rows(whole, x, dout)
    if solver == "kfac":
        assert_rel_close(expected_v, dense_kfac(a.mT @ a / 8, g.mT @ g / 8, grad, damping))
    else:
        assert_rel_close(expected_v, dense_sngd(a, g, grad, damping))

    pre = HyLoPreconditioner(accumulated, solver=solver, update_freq=1, damping=damping)
    for xs, ys in zip(x.split(4), labels.split(4), strict=True):  # two micro-batches, loss / 2 each
        (F.cross_entropy(accumulated(xs), ys) / 2).backward()
    assert_rel_close(grad_matrix(accumulated), grad, REPLAY_RTOL)
    pre.step()
    assert_rel_close(grad_matrix(accumulated), expected_v)


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_layer_called_twice_matches_one_call_on_stacked_input(solver: str) -> None:
    once = nn.Linear(4, 3, dtype=DT)
    twice = nn.Linear(4, 3, dtype=DT)
    twice.load_state_dict(once.state_dict())
    x1, x2 = torch.randn(5, 4, dtype=DT), torch.randn(5, 4, dtype=DT)
    labels = torch.randint(0, 3, (10,))
    _, _, _, expected_v = one_step(
        once, torch.cat([x1, x2]), lambda out: F.cross_entropy(out, labels), solver=solver, damping=0.05
    )
    pre = HyLoPreconditioner(twice, solver=solver, update_freq=1, damping=0.05)
    F.cross_entropy(torch.cat([twice(x1), twice(x2)]), labels).backward()
    pre.step()
    assert_rel_close(grad_matrix(twice), expected_v)


# --------------------------------------------------------------------------- calling conventions
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_keyword_call_matches_positional_call(solver: str) -> None:
    positional = nn.Linear(4, 3, dtype=DT)
    keyword = copy.deepcopy(positional)
    x, y = batch(0)
    results = []
    for layer, call in [(positional, lambda m: m(x)), (keyword, lambda m: m(input=x))]:
        pre = HyLoPreconditioner(layer, solver=solver, update_freq=1, damping=0.1)
        F.cross_entropy(call(layer), y).backward()
        pre.step()
        results.append(grad_matrix(layer))
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_unbatched_conv_input_matches_batch_of_one(solver: str) -> None:
    batched = nn.Conv2d(2, 3, 3, dtype=DT)
    unbatched = copy.deepcopy(batched)
    x = torch.randn(2, 5, 5, dtype=DT)
    results = []
    for layer, inp in [(batched, x[None]), (unbatched, x)]:
        pre = HyLoPreconditioner(layer, solver=solver, update_freq=1, damping=0.1)
        layer(inp).square().mean().backward()
        pre.step()
        results.append(grad_matrix(layer))
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- when nothing is captured
def test_no_capture_in_eval_mode_or_without_grad() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    x, _ = batch(0)
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert all(not (info.calls or info.pending) for info in pre.layer_info())
