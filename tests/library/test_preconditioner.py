"""HyLoPreconditioner's public behaviour (hylo/preconditioner.py): cadence, callable hyperparameters,
lifecycle, errors, unsupported and skipped layers, kl_clip, memory_usage, solver_of and summary.

Checkpoints are in test_checkpoint.py, option validation in test_config.py.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from tests.kit.checks import DT, assert_same_tensors, grads, state_snapshot
from tests.kit.internals import hooks
from tests.kit.models import backward, batch, mlp, override_model, run

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- 4. update cadence
def _cadence(pre: HyLoPreconditioner, model: nn.Module, steps: int) -> tuple[list[int], list[int]]:
    """Steps whose forward captured, and steps whose step() replaced the layer states."""
    captured, replaced = [], []
    for step in range(steps):
        model.zero_grad()
        backward(model, step)
        has_records = [bool(info.calls or info.pending) for info in pre.layer_info()]
        assert len(set(has_records)) == 1, "all layers capture on the same steps"
        if has_records[0]:
            captured.append(step)
        before = [info.state for info in pre.layer_info()]
        raw = [info.math.grad_matrix().clone() for info in pre.layer_info()]
        pre.step()
        changed = [info.state != old for info, old in zip(pre.layer_info(), before, strict=True)]
        assert len(set(changed)) == 1, "all layers update on the same steps"
        if changed[0]:
            replaced.append(step)
        else:  # between updates the stored state is reused on the fresh gradient
            for info, old, g in zip(pre.layer_info(), before, raw, strict=True):
                assert old is not None
                torch.testing.assert_close(info.math.grad_matrix(), old.precondition(g), rtol=1e-12, atol=0)
                assert not torch.allclose(info.math.grad_matrix(), g)
    return captured, replaced


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_update_cadence(solver: str) -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=3, damping=0.1)
    captured, replaced = _cadence(pre, model, 8)
    assert captured == [0, 3, 6]
    assert replaced == [0, 3, 6]


# --------------------------------------------------------------------------- 5. callable hyperparameters
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_callable_update_freq(solver: str) -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=lambda step: 1 if step < 2 else 3, damping=0.1)
    captured, replaced = _cadence(pre, model, 8)
    assert captured == [0, 1, 3, 6]
    assert replaced == [0, 1, 3, 6]


def _valid_then(bad: object, good: object) -> Callable[[int], object]:
    return lambda step: good if step == 0 else bad


@pytest.mark.parametrize(
    ("name", "fn", "extra"),
    [
        ("damping", _valid_then(0.0, 0.1), {}),
        ("damping", _valid_then(float("nan"), 0.1), {}),
        ("damping", _valid_then(-1.0, 0.1), {}),
        ("update_freq", _valid_then(0, 1), {}),
        ("update_freq", _valid_then(1.5, 1), {}),
        ("factor_decay", _valid_then(1.0, 0.9), {}),
        ("kl_clip", _valid_then(-1.0, 1.0), {"lr": 0.1}),
        ("lr", _valid_then(float("inf"), 0.1), {"kl_clip": 1.0}),
    ],
)
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_callable_returning_invalid_value_raises(
    solver: str, name: str, fn: Callable[[int], object], extra: dict[str, object]
) -> None:
    model = mlp()
    options = {"update_freq": 1, **extra, name: fn}
    pre = HyLoPreconditioner(model, solver=solver, **options)
    run(model, pre, [0])  # valid at step 0
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        run(model, pre, [1])


# --------------------------------------------------------------------------- 9. remove
def test_remove_detaches_hooks_and_disables_step() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    assert hooks(model.fc1)[1]  # forward hooks
    assert hooks(model.fc2)[1]
    run(model, pre, [0])
    pre.remove()
    assert all(not hooks(module)[1] for module in model.modules())
    model.zero_grad()
    backward(model, 1)  # the model still trains on its own
    raw = grads(model)
    with pytest.raises(RuntimeError):
        pre.step()
    assert_same_tensors(grads(model), raw)
    assert all(not (info.calls or info.pending) for info in pre.layer_info())


# --------------------------------------------------------------------------- 10. bad input
def test_step_before_backward_names_the_layer() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    x, _ = batch(0)
    model(x)
    with pytest.raises(RuntimeError, match="fc1"):
        pre.step()


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_update_step_without_capture_warns_once_and_keeps_the_layer_as_it_was(solver: str) -> None:
    """A layer with a gradient but no captured rows (run under no_grad here) keeps its state, warned once."""
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1)
    for step in range(2):
        model.zero_grad()
        x, y = batch(step)
        with torch.no_grad():
            hidden = model.act(model.fc1(x))
        F.cross_entropy(model.fc2(hidden), y).backward()
        model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
        model.fc1.bias.grad = torch.ones_like(model.fc1.bias)
        raw = grads(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        messages = [str(w.message) for w in caught]
        assert len([m for m in messages if "captured no rows" in m]) == (1 if step == 0 else 0)
        if step == 0:
            assert "fc1" in messages[0] and "fc2" not in messages[0]
        assert_same_tensors(grads(model)[:2], raw[:2])  # fc1: no state, gradient as it was
        infos = pre.layer_info()
        assert infos[0].state is None and infos[1].state is not None
        assert not torch.equal(model.fc2.weight.grad, raw[2])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["fc1.weight", "fc2.bias"])
@pytest.mark.parametrize("update_freq", [1, 2], ids=["on-update-step", "between-updates"])
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_non_finite_gradient_leaves_grads_and_state_alone(
    solver: str, update_freq: int, where: str, bad: float
) -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=update_freq, damping=0.1)
    run(model, pre, [0])
    states = [info.state for info in pre.layer_info()]
    snapshot = state_snapshot(pre)

    model.zero_grad()
    backward(model, 1)
    with torch.no_grad():
        model.get_parameter(where).grad.view(-1)[0] = bad
    raw = grads(model)
    with pytest.warns(UserWarning, match="non-finite"):
        pre.step()
    for p, g in zip(model.parameters(), raw, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
    assert all(info.state == old for info, old in zip(pre.layer_info(), states, strict=True))
    assert_same_tensors(state_snapshot(pre), snapshot)

    # the next step with finite gradients updates and preconditions as usual
    model.zero_grad()
    backward(model, 2)
    raw = grads(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre.step()
    assert all(info.state != old for info, old in zip(pre.layer_info(), states, strict=True))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert not torch.allclose(model.fc1.weight.grad, raw[0])


# --------------------------------------------------------------------------- 11. unsupported, skip_layers
class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, scale_grad_by_freq=True, dtype=DT)  # left alone (see test_embedding.py)
        self.conv = nn.Conv2d(4, 4, 3, padding=1, dtype=DT)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=2, dtype=DT)
        self.bn = nn.BatchNorm2d(4, dtype=DT)
        self.fc = nn.Linear(4, 3, dtype=DT)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx).permute(0, 3, 1, 2)  # (n, 4, H, W)
        h = torch.relu(self.bn(self.dw(self.conv(h))))
        return self.fc(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_unsupported_modules_warn_and_are_left_alone(solver: str) -> None:
    model = _Mixed()
    with pytest.warns(UserWarning, match="emb") as record:
        pre = HyLoPreconditioner(model, solver=solver, update_freq=1)
    message = " ".join(str(w.message) for w in record)
    for name in ("emb", "dw"):
        assert name in message
    assert ": bn" not in message  # a normalisation layer stays with the optimizer without a warning
    assert [info.name for info in pre.layer_info()] == ["conv", "fc"]
    summary = pre.summary()
    for name in ("emb", "dw", "bn", "conv", "fc"):
        assert name in summary

    idx = torch.randint(0, 10, (3, 4, 4))
    y = torch.randint(0, 3, (3,))
    F.cross_entropy(model(idx), y).backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    pre.step()
    for n, p in model.named_parameters():
        if n.split(".")[0] in ("emb", "dw", "bn"):
            assert torch.equal(p.grad, raw[n]), n
        else:
            assert not torch.allclose(p.grad, raw[n]), n


def _convnet() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(1, 2, 3, dtype=DT),
            relu=nn.ReLU(),
            conv10=nn.Conv2d(2, 2, 1, dtype=DT),
            flat=nn.Flatten(),
            fc=nn.Linear(2 * 3 * 3, 4, dtype=DT),
            fc_out=nn.Linear(4, 2, dtype=DT),
        )
    )


@pytest.mark.parametrize(
    ("skip", "kept"),
    [
        (("fc.*",), ["conv1", "conv10"]),
        (("fc",), ["conv1", "conv10", "fc_out"]),  # full match: fc_out is not skipped
        (("conv1",), ["conv10", "fc", "fc_out"]),
        (("Conv2d",), ["fc", "fc_out"]),  # class name
        (("Linear", "conv1"), ["conv10"]),
    ],
)
def test_skip_layers_by_name_regex_and_class(skip: tuple[str, ...], kept: list[str]) -> None:
    model = _convnet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # skipping is not a warning
        pre = HyLoPreconditioner(model, solver="sngd", skip_layers=skip)
    assert [info.name for info in pre.layer_info()] == kept
    summary = pre.summary()
    for name in {"conv1", "conv10", "fc", "fc_out"} - set(kept):
        assert re.search(rf"\b{name}\b", summary), name


def test_frozen_layer_is_skipped_and_model_without_supported_layers_raises() -> None:
    model = mlp()
    model.fc1.weight.requires_grad_(False)
    pre = HyLoPreconditioner(model, solver="sngd")
    assert [info.name for info in pre.layer_info()] == ["fc2"]
    assert "fc1" in pre.summary()
    with pytest.raises(ValueError, match="layer"):
        HyLoPreconditioner(mlp(), skip_layers=("Linear",))


# --------------------------------------------------------------------------- 12. kl_clip
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
@pytest.mark.parametrize(("kl_clip", "clipped"), [(1e-4, True), (1e4, False)])
@pytest.mark.parametrize("callable_options", [False, True], ids=["const", "callable"])
def test_kl_clip_scales_by_the_trust_region(solver: str, kl_clip: float, clipped: bool, callable_options: bool) -> None:
    lr = 0.1
    model = mlp()
    reference = copy.deepcopy(model)
    clip_option = (lambda step: kl_clip) if callable_options else kl_clip
    lr_option = (lambda step: lr) if callable_options else lr
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1, damping=0.1, kl_clip=clip_option, lr=lr_option)
    pre_ref = HyLoPreconditioner(reference, solver=solver, update_freq=1, damping=0.1)
    backward(model, 0)
    backward(reference, 0)
    raw = grads(model)
    pre.step()
    pre_ref.step()
    unclipped = grads(reference)
    vg = sum(float((v * g).sum()) for v, g in zip(unclipped, raw, strict=True))
    scale = min(1.0, math.sqrt(kl_clip / (lr**2 * abs(vg))))
    assert (scale < 1.0) == clipped
    for p, v in zip(model.parameters(), unclipped, strict=True):
        torch.testing.assert_close(p.grad, v * scale, rtol=1e-10, atol=0)


# --------------------------------------------------------------------------- 13. memory_usage
def _nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_memory_usage_sngd_exact(dtype: torch.dtype) -> None:
    model = nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(2, 4, 3, dtype=dtype),
            flat=nn.Flatten(),
            fc1=nn.Linear(4 * 4 * 4, 5, dtype=dtype),
            fc2=nn.Linear(5, 3, bias=False, dtype=dtype),
        )
    )
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    assert pre.memory_usage() == {"conv": 0, "fc1": 0, "fc2": 0}
    m = 6  # batch rows: the whole batch is kept
    x = torch.randn(m, 2, 6, 6, dtype=dtype)
    F.cross_entropy(model(x), torch.randint(0, 3, (m,))).backward()
    pre.step()
    usage = pre.memory_usage()
    for info in pre.layer_info():
        assert info.state is not None and info.memory == usage[info.name]
        assert usage[info.name] == _nbytes(info.state.tensors.values())
    size = torch.finfo(dtype).bits // 8
    # O(m (d_a + d_g) + m²) numbers: rows a (m×d_a), g (m×d_g) and the m×m SMW matrix (float64, docs/solvers.md)
    for name, d_a, d_g in [("conv", 2 * 9 + 1, 4), ("fc1", 64 + 1, 5), ("fc2", 5, 3)]:
        assert usage[name] == size * m * (d_a + d_g) + 8 * m * m, name


def test_memory_usage_sngd_counts_leading_positions_as_rows() -> None:
    layer = nn.Linear(5, 3, dtype=DT)
    pre = HyLoPreconditioner(layer, solver="sngd", update_freq=1)
    layer(torch.randn(2, 3, 5, dtype=DT)).square().mean().backward()
    pre.step()
    m, d_a, d_g = 6, 6, 3
    assert pre.memory_usage() == {"": 8 * (m * (d_a + d_g) + m * m)}


def test_memory_usage_kfac_exact() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=1)
    run(model, pre, [0])
    usage = pre.memory_usage()
    for info in pre.layer_info():
        assert info.state is not None and info.memory == usage[info.name]
        assert usage[info.name] == _nbytes(info.state.tensors.values())
    # factors, eigenvectors (d×d each) and eigenvalues (d each), float64
    for name, d_a, d_g in [("fc1", 5, 6), ("fc2", 7, 3)]:
        assert usage[name] == 8 * (2 * d_a * d_a + d_a + 2 * d_g * d_g + d_g), name


# --------------------------------------------------------------------------- solver_of
def test_solver_of_unknown_name_raises_key_error() -> None:
    pre = HyLoPreconditioner(override_model(), solver="hybrid")
    for name in ("nope", "act1", "", "fc"):
        with pytest.raises(KeyError, match="no registered layer"):
            pre.solver_of(name)
