"""The per-sample gradient oracle (hylo_scripts/benchmarks/persample.py), checked without hylo.

``vmap(grad)`` equals a plain per-sample loop on Linear, Conv2d (stride, padding, dilation,
"same") and BatchNorm-in-eval models, with and without bias; the mean of U is the model's
gradient under a mean-reduced loss; the dense and Woodbury SNGD references agree with a solve
of the dense F + λI; BatchNorm with batch statistics is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo_scripts.benchmarks.persample import (
    batchnorm_eval,
    per_sample_grads,
    per_sample_grads_loop,
    relative_error,
    sngd_reference,
    supported_layers,
)

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel"),
    pytest.mark.device_tier,
]

DT = torch.float64


def mlp(bias: bool) -> nn.Module:
    """4 → 6 → 3 with a tanh."""
    return nn.Sequential(nn.Linear(4, 6, bias=bias), nn.Tanh(), nn.Linear(6, 3, bias=bias)).to(DT)


def conv_net(bias: bool) -> nn.Module:
    """Convolutions with stride 2 and padding 1, dilation 2 with padding "same", an even "same" kernel, a Linear head."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=bias),
        nn.ReLU(),
        nn.Conv2d(4, 3, 3, dilation=2, padding="same", bias=bias),
        nn.Tanh(),
        nn.Conv2d(3, 3, (2, 3), padding="same", bias=not bias),
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 3, bias=bias),
    ).to(DT)


def batchnorm_net() -> nn.Module:
    """Conv → BatchNorm2d → ReLU → Linear → BatchNorm1d, with running statistics moved off their defaults."""
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 9 * 9, 3),
        nn.BatchNorm1d(3),
    ).to(DT)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 2, 9, 9, dtype=DT))
    return model.eval()


def cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy over the batch."""
    return F.cross_entropy(out, y)


def mse(out: Tensor, y: Tensor) -> Tensor:
    """Mean squared error against real-valued targets."""
    return F.mse_loss(out, y)


def image_batch(n: int = 6) -> tuple[Tensor, Tensor]:
    """Inputs (n, 2, 9, 9) and 3-class labels."""
    return torch.randn(n, 2, 9, 9, dtype=DT), torch.randint(0, 3, (n,))


def assert_same_grads(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """vmap and loop agree on every supported layer; returns the vmap result."""
    names = supported_layers(model)
    fast = per_sample_grads(model, cross_entropy, x, y, names)
    slow = per_sample_grads_loop(model, cross_entropy, x, y, names)
    assert fast.keys() == slow.keys() == set(names)
    for name in names:
        module = model.get_submodule(name)
        d_a = module.weight[0].numel() + (module.bias is not None)
        assert fast[name].shape == (x.shape[0], module.weight.shape[0], d_a)
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-12, atol=1e-14)
    return fast


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_vmap_equals_loop_on_an_mlp(bias: bool) -> None:
    assert_same_grads(mlp(bias), torch.randn(7, 4, dtype=DT), torch.randint(0, 3, (7,)))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_vmap_equals_loop_on_strided_dilated_same_convolutions(bias: bool) -> None:
    model = conv_net(bias)
    assert supported_layers(model) == ["0", "2", "4", "6"]
    assert_same_grads(model, *image_batch())


def test_vmap_equals_loop_with_batchnorm_in_eval_mode() -> None:
    assert_same_grads(batchnorm_net(), *image_batch())


def test_batchnorm_eval_takes_the_batch_statistics_and_leaves_other_modules_training() -> None:
    model = batchnorm_net().train()
    x, y = image_batch()
    momentum = model[1].momentum
    assert batchnorm_eval(model, x) is model
    assert not model[1].training and not model[5].training and model[0].training and model[4].training
    assert model[1].momentum == momentum
    with torch.no_grad():
        torch.testing.assert_close(model[1].running_mean, model[0](x).mean(dim=(0, 2, 3)))
    assert_same_grads(model, x, y)


@pytest.mark.parametrize("loss_fn", [cross_entropy, mse], ids=["cross_entropy", "mse"])
@pytest.mark.parametrize("build", [lambda: conv_net(True), batchnorm_net], ids=["conv", "batchnorm"])
def test_mean_of_per_sample_grads_is_the_model_gradient(
    loss_fn: Callable[[Tensor, Tensor], Tensor], build: Callable[[], nn.Module]
) -> None:
    model = build()
    x, y = image_batch()
    if loss_fn is mse:
        y = torch.randn(x.shape[0], 3, dtype=DT)
    loss_fn(model(x), y).backward()
    per_sample = per_sample_grads(model, loss_fn, x, y, supported_layers(model))
    for name, u in per_sample.items():
        module = model.get_submodule(name)
        grad = module.weight.grad.reshape(module.weight.shape[0], -1)
        if module.bias is not None:
            grad = torch.cat([grad, module.bias.grad.reshape(-1, 1)], dim=1)
        torch.testing.assert_close(u.mean(0), grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n", [5, 30], ids=["n<d", "n>d"])
def test_sngd_reference_dense_and_woodbury_equal_a_dense_solve(n: int) -> None:
    u = torch.randn(n, 3, 4, dtype=DT)
    grad = torch.randn(3, 4, dtype=DT)
    damping = 0.1
    fisher = sum(torch.outer(ui.reshape(-1), ui.reshape(-1)) for ui in u) / n
    expected = torch.linalg.solve(fisher + damping * torch.eye(12, dtype=DT), grad.reshape(-1)).reshape(3, 4)
    dense = sngd_reference(u, grad, damping, dense=True)
    woodbury = sngd_reference(u, grad, damping, dense=False)
    assert sngd_reference(u, grad, damping).equal(dense)  # 12 entries: dense by default
    assert relative_error(dense, expected) < 1e-10 and relative_error(woodbury, expected) < 1e-10
    assert relative_error(woodbury, dense) < 1e-10
    assert relative_error(expected, expected) == 0.0
    torch.testing.assert_close(sngd_reference(u, None, damping), sngd_reference(u, u.mean(0), damping))


def test_sngd_reference_rejects_bad_input() -> None:
    u = torch.randn(4, 3, 2, dtype=DT)
    with pytest.raises(ValueError, match="damping"):
        sngd_reference(u, None, 0.0)
    with pytest.raises(ValueError, match="does not match"):
        sngd_reference(u, torch.randn(2, 3, dtype=DT).reshape(-1)[:5], 1.0)


@pytest.mark.parametrize("oracle", [per_sample_grads, per_sample_grads_loop])
def test_batchnorm_with_batch_statistics_is_refused(oracle: Callable[..., dict[str, Tensor]]) -> None:
    x, y = image_batch()
    model = batchnorm_net().train()
    with pytest.raises(ValueError, match="BatchNorm 1 .*model.eval"):
        oracle(model, cross_entropy, x, y, ["0"])
    no_stats = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 3)).to(DT).eval()
    with pytest.raises(ValueError, match="BatchNorm 0"):
        oracle(no_stats, cross_entropy, torch.randn(5, 4, dtype=DT), y[:5], ["1"])


def test_unsupported_layers_are_refused() -> None:
    model = nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten(), nn.Linear(98, 3)).to(DT)
    assert supported_layers(model) == ["2"]
    with pytest.raises(ValueError, match="layer '0' is a Conv2d"):
        per_sample_grads(model, cross_entropy, *image_batch(), ["0"])
