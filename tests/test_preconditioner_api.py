"""HyLoPreconditioner's public behaviour: cadence, hyperparameters, checkpoints, lifecycle, errors."""

from __future__ import annotations

import copy
import io
import math
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoConfig, HyLoPreconditioner

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64


# --------------------------------------------------------------------------- helpers
def mlp(seed: int = 0, dtype: torch.dtype = DT) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(4, 6, dtype=dtype),
            act=nn.Tanh(),
            fc2=nn.Linear(6, 3, dtype=dtype),
        )
    )


def batch(step: int, n: int = 8) -> tuple[Tensor, Tensor]:
    """Deterministic data of step ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 4, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)


def backward(model: nn.Module, step: int, n: int = 8) -> None:
    x, y = batch(step, n)
    F.cross_entropy(model(x), y).backward()


def grad_matrix(module: nn.Module) -> Tensor:
    grad = module.weight.grad.reshape(module.weight.shape[0], -1)
    if module.bias is not None:
        grad = torch.cat([grad, module.bias.grad.reshape(-1, 1)], dim=1)
    return grad.detach().clone()


def grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def state_snapshot(pre: HyLoPreconditioner) -> dict[str, dict[str, Tensor] | None]:
    return {
        layer.name: None if layer.state is None else {k: v.detach().clone() for k, v in layer.state.tensors().items()}
        for layer in pre.layers
    }


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


def run(
    model: nn.Module,
    pre: HyLoPreconditioner,
    steps: Iterable[int],
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    for step in steps:
        if optimizer is not None:
            optimizer.zero_grad()
        else:
            model.zero_grad()
        backward(model, step)
        pre.step()
        if optimizer is not None:
            optimizer.step()


# --------------------------------------------------------------------------- 4. update cadence
def _cadence(pre: HyLoPreconditioner, model: nn.Module, steps: int) -> tuple[list[int], list[int]]:
    """Steps whose forward captured, and steps whose step() replaced the layer states."""
    captured, replaced = [], []
    for step in range(steps):
        model.zero_grad()
        backward(model, step)
        has_records = [bool(layer.capture.records) for layer in pre.layers]
        assert len(set(has_records)) == 1, "all layers capture on the same steps"
        if has_records[0]:
            captured.append(step)
        before = [layer.state for layer in pre.layers]
        raw = [layer.math.grad_matrix().clone() for layer in pre.layers]
        pre.step()
        changed = [layer.state is not old for layer, old in zip(pre.layers, before, strict=True)]
        assert len(set(changed)) == 1, "all layers update on the same steps"
        if changed[0]:
            replaced.append(step)
        else:  # between updates the stored state is reused on the fresh gradient
            for layer, old, g in zip(pre.layers, before, raw, strict=True):
                torch.testing.assert_close(layer.math.grad_matrix(), old.precondition(g), rtol=1e-12, atol=0)
                assert not torch.allclose(layer.math.grad_matrix(), g)
    return captured, replaced


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_update_cadence(solver: str) -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=3, damping=0.1)
    captured, replaced = _cadence(pre, model, 8)
    assert captured == [0, 3, 6]
    assert replaced == [0, 3, 6]


def test_no_capture_in_eval_mode_or_without_grad() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    x, _ = batch(0)
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert all(not layer.capture.records for layer in pre.layers)


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


# --------------------------------------------------------------------------- 7. state_dict round trip
@pytest.mark.parametrize("save_at", [3, 4], ids=["before-update-step", "between-updates"])
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_state_dict_round_trip_is_bit_exact(solver: str, save_at: int) -> None:
    options = {"solver": solver, "update_freq": 3, "damping": 0.1, "factor_decay": 0.8}

    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, HyLoPreconditioner]:
        model = mlp(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optimizer, HyLoPreconditioner(model, **options)

    model, optimizer, pre = make(0)
    run(model, pre, range(save_at), optimizer)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "pre": pre.state_dict()}, buffer)
    run(model, pre, range(save_at, 7), optimizer)

    buffer.seek(0)
    checkpoint = torch.load(buffer)  # weights_only=True: the state_dict holds plain data only
    model2, optimizer2, pre2 = make(1)
    model2.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["opt"])
    pre2.load_state_dict(checkpoint["pre"])
    run(model2, pre2, range(save_at, 7), optimizer2)

    for (name, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert_same_tensors(state_snapshot(pre), state_snapshot(pre2))


# --------------------------------------------------------------------------- 8. load_state_dict mismatches
def _renamed() -> nn.Module:
    return nn.Sequential(OrderedDict(l1=nn.Linear(4, 6, dtype=DT), act=nn.Tanh(), l2=nn.Linear(6, 3, dtype=DT)))


def _reshaped() -> nn.Module:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 5, dtype=DT), act=nn.Tanh(), fc2=nn.Linear(5, 3, dtype=DT)))


def _no_bias() -> nn.Module:
    return nn.Sequential(
        OrderedDict(fc1=nn.Linear(4, 6, bias=False, dtype=DT), act=nn.Tanh(), fc2=nn.Linear(6, 3, dtype=DT))
    )


def _extra_layer() -> nn.Module:
    model = mlp()
    model.add_module("fc3", nn.Linear(3, 3, dtype=DT))
    return model


@pytest.mark.parametrize("other", [_renamed, _reshaped, _no_bias, _extra_layer])
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_load_state_dict_from_other_model_raises_and_changes_nothing(
    solver: str, other: Callable[[], nn.Module]
) -> None:
    source_model = other()
    source = HyLoPreconditioner(source_model, solver=solver, update_freq=1)
    run(source_model, source, [0])
    saved = source.state_dict()

    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=2, damping=0.3)
    run(model, pre, range(3))
    before = copy.deepcopy(pre.state_dict())
    states_before = [layer.state for layer in pre.layers]
    with pytest.raises(ValueError, match=r"layer|shape|d_a|d_g"):
        pre.load_state_dict(saved)
    assert_same_tensors(pre.state_dict(), before)
    assert all(layer.state is old for layer, old in zip(pre.layers, states_before, strict=True))
    run(model, pre, [3])  # still usable


@pytest.mark.parametrize(("saved_solver", "solver"), [("sngd", "kfac"), ("kfac", "sngd")])
def test_load_state_dict_solver_mismatch_raises(saved_solver: str, solver: str) -> None:
    source_model = mlp()
    source = HyLoPreconditioner(source_model, solver=saved_solver, update_freq=1)
    run(source_model, source, [0])
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1)
    run(model, pre, [0])
    before = copy.deepcopy(pre.state_dict())
    with pytest.raises(ValueError, match="solver"):
        pre.load_state_dict(source.state_dict())
    assert_same_tensors(pre.state_dict(), before)


def test_load_state_dict_with_corrupt_tensor_shape_raises() -> None:
    source_model = mlp()
    source = HyLoPreconditioner(source_model, solver="sngd", update_freq=1)
    run(source_model, source, [0])
    saved = source.state_dict()
    saved["layers"]["fc1"]["tensors"]["a"] = saved["layers"]["fc1"]["tensors"]["a"][:, :-1]
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    with pytest.raises(ValueError, match="fc1"):
        pre.load_state_dict(saved)
    assert all(layer.state is None for layer in pre.layers)


# --------------------------------------------------------------------------- 9. remove
def test_remove_detaches_hooks_and_disables_step() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    assert model.fc1._forward_hooks
    assert model.fc2._forward_hooks
    run(model, pre, [0])
    pre.remove()
    assert all(not module._forward_hooks for module in model.modules())
    model.zero_grad()
    backward(model, 1)  # the model still trains on its own
    raw = grads(model)
    with pytest.raises(RuntimeError):
        pre.step()
    assert_same_tensors(grads(model), raw)
    assert all(not layer.capture.records for layer in pre.layers)


# --------------------------------------------------------------------------- 10. bad input
@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"damping": 0}, "damping"),
        ({"damping": -1.0}, "damping"),
        ({"damping": float("nan")}, "damping"),
        ({"damping": float("inf")}, "damping"),
        ({"update_freq": 0}, "update_freq"),
        ({"update_freq": 1.5}, "update_freq"),
        ({"update_freq": -3}, "update_freq"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"factor_decay": -0.1}, "factor_decay"),
        ({"kl_clip": 1e-3}, "lr"),
        ({"kl_clip": 0.0, "lr": 0.1}, "kl_clip"),
        ({"kl_clip": 1.0, "lr": -0.1}, "lr"),
        ({"rank_ratio": 0}, "rank_ratio"),
        ({"rank_ratio": 1.5}, "rank_ratio"),
        ({"rank": 0}, "rank"),
        ({"solver": "adam"}, "solver"),
        ({"solver": "KFAC"}, "solver"),
        ({"skip_layers": "fc1"}, "skip_layers"),
    ],
)
def test_invalid_option_raises_value_error_naming_it(options: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoPreconditioner(mlp(), **options)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoConfig(**options)


def test_invalid_skip_layers_regex_raises_in_preconditioner() -> None:
    with pytest.raises(ValueError, match="skip_layers"):
        HyLoPreconditioner(mlp(), skip_layers=("fc[",))


def test_invalid_skip_layers_regex_raises_in_config() -> None:
    with pytest.raises(ValueError, match="skip_layers"):
        HyLoConfig(skip_layers=("fc[",))


def test_kl_clip_without_lr_message_names_both() -> None:
    with pytest.raises(ValueError, match=r"\blr\b") as info:
        HyLoPreconditioner(mlp(), kl_clip=1e-3)
    assert "kl_clip" in str(info.value)


def test_step_before_backward_names_the_layer() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    x, _ = batch(0)
    model(x)
    with pytest.raises(RuntimeError, match="fc1"):
        pre.step()


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_update_step_without_capture_names_the_layer(solver: str) -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1)
    x, y = batch(0)
    with torch.no_grad():
        hidden = model.act(model.fc1(x))
    F.cross_entropy(model.fc2(hidden), y).backward()
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    model.fc1.bias.grad = torch.ones_like(model.fc1.bias)
    with pytest.raises(RuntimeError, match="fc1") as info:
        pre.step()
    assert "fc2" not in str(info.value)


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
    states = [layer.state for layer in pre.layers]
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
    assert all(layer.state is old for layer, old in zip(pre.layers, states, strict=True))
    assert_same_tensors(state_snapshot(pre), snapshot)

    # the next step with finite gradients updates and preconditions as usual
    model.zero_grad()
    backward(model, 2)
    raw = grads(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre.step()
    assert all(layer.state is not old for layer, old in zip(pre.layers, states, strict=True))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert not torch.allclose(model.fc1.weight.grad, raw[0])


# --------------------------------------------------------------------------- 11. unsupported, skip_layers
class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, dtype=DT)
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
    for name in ("emb", "dw", "bn"):
        assert name in message
    assert [layer.name for layer in pre.layers] == ["conv", "fc"]
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
    assert [layer.name for layer in pre.layers] == kept
    summary = pre.summary()
    for name in {"conv1", "conv10", "fc", "fc_out"} - set(kept):
        assert re.search(rf"\b{name}\b", summary), name


def test_frozen_layer_is_skipped_and_model_without_supported_layers_raises() -> None:
    model = mlp()
    model.fc1.weight.requires_grad_(False)
    pre = HyLoPreconditioner(model, solver="sngd")
    assert [layer.name for layer in pre.layers] == ["fc2"]
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
    for layer in pre.layers:
        assert usage[layer.name] == _nbytes(layer.state.tensors().values())
    size = torch.finfo(dtype).bits // 8
    # O(m (d_a + d_g) + m²) numbers: rows a (m×d_a), g (m×d_g) and the m×m SMW matrix
    for name, d_a, d_g in [("conv", 2 * 9 + 1, 4), ("fc1", 64 + 1, 5), ("fc2", 5, 3)]:
        assert usage[name] == size * (m * (d_a + d_g) + m * m), name


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
    for layer in pre.layers:
        assert usage[layer.name] == _nbytes(layer.state.tensors().values())
    # factors, eigenvectors (d×d each) and eigenvalues (d each), float64
    for name, d_a, d_g in [("fc1", 5, 6), ("fc2", 7, 3)]:
        assert usage[name] == 8 * (2 * d_a * d_a + d_a + 2 * d_g * d_g + d_g), name


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
