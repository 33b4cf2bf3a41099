"""Which layers hylo registers and how it follows them (hylo/registry.py, hylo/capture.py, LayerMath).

MultiheadAttention's projections (root or nested), parametrized and lazy modules, parameters
replaced after attaching, tied parameters (attention projections included), captured calls whose
backward never runs, and the checks of boolean hyperparameters and ``seed``.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

from hylo import HyLoConfig, HyLoPreconditioner
from hylo.config import resolve
from hylo.layers.walk import register_layers
from tests.kit.checks import DT
from tests.kit.internals import hooks
from tests.kit.models import backward, batch, mlp

pytestmark = pytest.mark.usefixtures("single_thread")


def _names(pre: HyLoPreconditioner) -> list[str]:
    return [info.name for info in pre.layer_info()]


# --------------------------------------------------------------------------- MultiheadAttention
def test_multihead_attention_at_the_root_registers_its_projections_once() -> None:
    mha = nn.MultiheadAttention(8, 2, dtype=DT)
    found = register_layers(mha, HyLoConfig(solver="sngd"))
    assert [layer.name for layer in found.layers] == ["q_proj", "k_proj", "v_proj", "out_proj"]
    assert found.unsupported == [] and len(found.taps) == 1
    assert not hooks(mha.out_proj)[1]  # forward hooks: captured by the attention's tap, never by a hook of its own
    found.remove()
    assert not hooks(mha)[0] and not hooks(mha)[1]  # no forward-pre or forward hook left


class _Attention(nn.Module):
    """A MultiheadAttention whose ``out_proj`` is also reachable under another name, listed first."""

    def __init__(self) -> None:
        super().__init__()
        mha = nn.MultiheadAttention(8, 2, dtype=DT)
        self.alias = mha.out_proj
        self.attn = mha
        self.attn_proj = nn.Linear(8, 8, dtype=DT)  # a sibling whose name starts with "attn"
        self.head = nn.Linear(8, 3, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.head(torch.tanh(self.attn_proj(h)).mean(dim=0))


def test_multihead_attention_projection_is_registered_once_under_its_attention() -> None:
    model = _Attention()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=1e-3)
    names = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "attn_proj", "head"]
    assert _names(pre) == names
    x = torch.randn(5, 4, 8, dtype=DT)
    F.cross_entropy(model(x), torch.tensor([0, 1, 2, 0])).backward()
    assert len(pre.layer_info()[3].calls) == 1
    raw = model.attn.out_proj.weight.grad.clone()
    pre.step()
    assert not torch.allclose(model.attn.out_proj.weight.grad, raw)


# --------------------------------------------------------------------------- tied attention weights
class _TiedAttention(nn.Module):
    """Three attention modules (``b`` with separate q/k/v weights), three Linears and a head; ``tie`` makes two
    uses hold one Parameter. Both uses run in the forward, so the tied Parameter's gradient sums them."""

    def __init__(self, tie: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.MultiheadAttention(8, 2, dtype=DT)
        self.b = nn.MultiheadAttention(8, 2, kdim=6, vdim=6, dtype=DT)
        self.c = nn.MultiheadAttention(8, 2, dtype=DT)
        self.mix = nn.Linear(8, 24, dtype=DT)
        self.gate = nn.Linear(8, 8, dtype=DT)
        self.other = nn.Linear(8, 8, dtype=DT)
        self.head = nn.Linear(8, 3, dtype=DT)
        if tie == "linear_to_out_proj":
            self.other.weight = self.a.out_proj.weight
        elif tie == "linear_to_out_proj_bias":
            self.other.bias = self.a.out_proj.bias
        elif tie == "out_proj_module":  # both attention modules apply it functionally: no hook of its own sees it
            self.c.out_proj = self.a.out_proj
        elif tie == "in_proj_weight":
            self.c.in_proj_weight = self.a.in_proj_weight
        elif tie == "linear_to_in_proj_weight":
            self.mix.weight = self.a.in_proj_weight
        elif tie == "linear_to_in_proj_bias":
            self.mix.bias = self.a.in_proj_bias
        elif tie == "linear_to_q_proj_weight":
            self.other.weight = self.b.q_proj_weight
        elif tie == "k_to_v_proj_weight":
            self.b.v_proj_weight = self.b.k_proj_weight
        elif tie == "linear_biases":
            self.other.bias = self.gate.bias
        else:
            raise AssertionError(tie)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        h = x + self.a(x, x, x, need_weights=False)[0]
        h = h + self.b(h, memory, memory, need_weights=False)[0]
        h = h + self.c(h, h, h, need_weights=False)[0]
        h = torch.tanh(h + self.mix(h)[..., :8] + self.gate(h) * self.other(h))
        return self.head(h.mean(dim=0))


#: tie → the registered users it ties, each with the words of its reason in summary().
TIES: dict[str, dict[str, str]] = {
    "linear_to_out_proj": {"a.out_proj": "weight tied to other", "other": "weight tied to a.out_proj"},
    "linear_to_out_proj_bias": {"a.out_proj": "bias tied to other", "other": "bias tied to a.out_proj"},
    "out_proj_module": {"a.out_proj": "weight tied to c.out_proj", "c.out_proj": "weight tied to a.out_proj"},
    "in_proj_weight": {f"{m}.{part}_proj": f"in_proj_weight tied to {n}" for m, n in ("ac", "ca") for part in "qkv"},
    "linear_to_in_proj_weight": {
        **{f"a.{part}_proj": "in_proj_weight tied to mix.weight" for part in "qkv"},
        "mix": "weight tied to a.in_proj_weight",
    },
    "linear_to_in_proj_bias": {
        **{f"a.{part}_proj": "in_proj_bias tied to mix.bias" for part in "qkv"},
        "mix": "bias tied to a.in_proj_bias",
    },
    "linear_to_q_proj_weight": {
        "b.q_proj": "q_proj_weight tied to other.weight",
        "other": "weight tied to b.q_proj_weight",
    },
    "k_to_v_proj_weight": {
        "b.k_proj": "k_proj_weight tied to b.v_proj_weight",
        "b.v_proj": "v_proj_weight tied to b.k_proj_weight",
    },
    "linear_biases": {"gate": "bias tied to other", "other": "bias tied to gate"},
}


def _attention_step(model: nn.Module, skip_layers: tuple[str, ...] | None = ()) -> HyLoPreconditioner | None:
    """One backward on a fixed batch, then hylo's step when ``skip_layers`` is not None (the raw gradients else)."""
    pre = None
    if skip_layers is not None:
        pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=1e-3, skip_layers=skip_layers)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, 8, dtype=DT, generator=generator)
    memory = torch.randn(7, 4, 6, dtype=DT, generator=generator)
    F.cross_entropy(model(x, memory), torch.tensor([0, 1, 2, 0])).backward()
    if pre is not None:
        pre.step()
    return pre


@pytest.mark.parametrize("tie", list(TIES))
def test_every_user_of_a_tied_parameter_stays_with_the_optimizer(tie: str) -> None:
    """Each user of a Parameter held twice (an attention projection's weight or bias, a Linear's) is left to the
    optimizer with the tie in summary(): its gradients are the raw ones bit for bit, and every other layer gets
    exactly what it gets when those users are named in skip_layers."""
    tied = TIES[tie]
    model = _TiedAttention(tie)
    skipped, raw = copy.deepcopy(model), copy.deepcopy(model)
    with pytest.warns(UserWarning, match="tied to"):
        pre = _attention_step(model)
    assert pre is not None
    summary = pre.summary()
    for name, words in tied.items():
        assert f"{name} ({words}" in summary, (name, summary)
    reference = _attention_step(skipped, tuple(re.escape(name) for name in tied))
    assert reference is not None and _names(pre) == _names(reference)
    _attention_step(raw, None)
    for (name, p), skipped_p in zip(model.named_parameters(), skipped.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, skipped_p.grad), name
    for name in tied:  # the optimizer's gradients
        for grad, raw_grad in zip(_grads_of(model, name), _grads_of(raw, name), strict=True):
            assert torch.equal(grad, raw_grad), name
    assert not torch.allclose(model.head.weight.grad, raw.head.weight.grad)  # the others are preconditioned


def _grads_of(model: nn.Module, layer: str) -> list[Tensor]:
    """The gradients of a registered layer's weight and bias (a projection's rows of the packed parameters)."""
    owner, _, part = layer.rpartition(".")
    attention = model.get_submodule(owner)
    if isinstance(attention, nn.MultiheadAttention) and part != "out_proj":
        index, embed = "qkv".index(part[0]), attention.embed_dim
        rows = slice(index * embed, (index + 1) * embed)
        packed = attention.in_proj_weight
        weight = packed.grad[rows] if packed is not None else getattr(attention, f"{part}_weight").grad
        return [weight, attention.in_proj_bias.grad[rows]]
    module = model.get_submodule(layer)
    return [module.weight.grad, module.bias.grad]


# --------------------------------------------------------------------------- parametrized modules
def _old_weight_norm(module: nn.Linear) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(module)


def _old_spectral_norm(module: nn.Linear) -> nn.Module:
    return nn.utils.spectral_norm(module)


PARAMETRIZE: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "old weight_norm": _old_weight_norm,
    "old spectral_norm": _old_spectral_norm,
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", list(PARAMETRIZE))
def test_parametrized_layer_is_left_alone_and_the_model_trains(kind: str, bias: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(4, 6, dtype=DT),
            act=nn.Tanh(),
            mid=PARAMETRIZE[kind](nn.Linear(6, 6, bias=bias, dtype=DT)),
            act2=nn.Tanh(),
            fc2=nn.Linear(6, 3, dtype=DT),
        )
    )
    with pytest.warns(UserWarning, match="parametrized"):
        pre = HyLoPreconditioner(model, solver="sngd", update_freq=2, damping=0.1)
    assert _names(pre) == ["fc1", "fc2"]
    summary = pre.summary()
    reason = kind.removeprefix("old ")
    assert f"mid (weight is parametrized ({reason})" in summary
    assert "parametrizations" not in summary  # the parametrization's own modules are not listed

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        optimizer.zero_grad()
        backward(model, step)
        raw = {n: p.grad.clone() for n, p in model.named_parameters()}
        pre.step()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, raw[n]) == n.startswith("mid."), n
        optimizer.step()


def test_parametrized_bias_is_left_alone() -> None:
    class Positive(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.exp()

    model = mlp()
    torch.nn.utils.parametrize.register_parametrization(model.fc1, "bias", Positive())
    with pytest.warns(UserWarning, match="bias is parametrized"):
        pre = HyLoPreconditioner(model, solver="sngd")
    assert _names(pre) == ["fc2"]
    assert "fc1 (bias is parametrized (positive)" in pre.summary()


def test_skip_layers_takes_precedence_over_parametrized() -> None:
    model = mlp()
    parametrizations.weight_norm(model.fc1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = HyLoPreconditioner(model, solver="sngd", skip_layers=("fc1",))
    assert _names(pre) == ["fc2"]
    assert "fc1 (skip_layers)" in pre.summary()


# --------------------------------------------------------------------------- lazy modules
def _lazy_model(conv: bool) -> nn.Module:
    torch.manual_seed(0)
    if conv:
        first: nn.Module = nn.LazyConv2d(4, 3, dtype=DT)
        return nn.Sequential(
            OrderedDict(first=first, act=nn.Tanh(), flat=nn.Flatten(), last=nn.Linear(16, 3, dtype=DT))
        )
    first = nn.LazyLinear(6, dtype=DT)
    return nn.Sequential(OrderedDict(first=first, act=nn.Tanh(), last=nn.Linear(6, 3, dtype=DT)))


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_lazy_layer_needs_a_dry_run(conv: bool) -> None:
    model = _lazy_model(conv)
    x = torch.randn(8, 2, 4, 4, dtype=DT) if conv else torch.randn(8, 4, dtype=DT)
    with pytest.raises(ValueError, match=r"'first'.*forward pass.*dry run") as info:
        HyLoPreconditioner(model, solver="sngd")
    assert "last" not in str(info.value)
    assert not hooks(model.last)[1]  # nothing left attached
    with torch.no_grad():
        model(x)  # the dry run
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    assert _names(pre) == ["first", "last"]
    F.cross_entropy(model(x), torch.arange(8) % 3).backward()
    raw = model.first.weight.grad.clone()
    pre.step()
    assert not torch.allclose(model.first.weight.grad, raw)


def test_skipped_lazy_layer_does_not_raise() -> None:
    model = _lazy_model(conv=False)
    pre = HyLoPreconditioner(model, solver="sngd", skip_layers=("first",))
    assert _names(pre) == ["last"]


# --------------------------------------------------------------------------- replaced parameters
@pytest.mark.parametrize("which", ["weight", "bias", "both"])
def test_replaced_parameter_is_the_one_preconditioned(which: str) -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=0.1)
    backward(model, 0)
    pre.step()
    old = {n: getattr(model.fc1, n) for n in ("weight", "bias")}
    old_grads = {n: p.grad.clone() for n, p in old.items()}

    gen = torch.Generator().manual_seed(7)
    for name in ("weight", "bias") if which == "both" else (which,):
        setattr(model.fc1, name, nn.Parameter(torch.randn(old[name].shape, generator=gen, dtype=DT)))
    reference = copy.deepcopy(model)
    reference_pre = HyLoPreconditioner(reference, solver="sngd", update_freq=1, damping=0.1)

    for m, p in ((model, pre), (reference, reference_pre)):
        m.zero_grad()
        backward(m, 1)
        p.step()
    for name in ("weight", "bias"):
        new = getattr(model.fc1, name)
        torch.testing.assert_close(new.grad, getattr(reference.fc1, name).grad, rtol=1e-12, atol=0)
        if new is not old[name]:
            assert torch.equal(old[name].grad, old_grads[name])  # the old parameter is untouched
    assert pre.layer_info()[0].math.weight is model.fc1.weight


def test_replaced_parameter_of_another_shape_raises_naming_both_shapes() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd")
    model.fc2.weight = nn.Parameter(torch.randn(2, 6, dtype=DT))
    model.fc2.bias = nn.Parameter(torch.zeros(2, dtype=DT))
    x, _ = batch(0)
    model(x).square().sum().backward()
    with pytest.raises(ValueError, match=r"'fc2'.*\(2, 6\).*\(3, 6\)"):
        pre.step()


# --------------------------------------------------------------------------- boolean hyperparameters, seed
@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"damping": True}, "damping"),
        ({"damping": False}, "damping"),
        ({"damping": np.bool_(True)}, "damping"),
        ({"factor_decay": False}, "factor_decay"),
        ({"factor_decay": True}, "factor_decay"),
        ({"kl_clip": True, "lr": 0.1}, "kl_clip"),
        ({"kl_clip": 1e-3, "lr": True}, "lr"),
        ({"seed": True}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "3"}, "seed"),
        ({"seed": None}, "seed"),
    ],
)
def test_bool_hyperparameters_and_bad_seeds_raise(options: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoConfig(**options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        HyLoPreconditioner(mlp(), **options)


@pytest.mark.parametrize("name", ["damping", "factor_decay", "kl_clip", "lr"])
def test_callable_returning_a_bool_raises(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}.*step 3"):
        resolve(name, lambda step: True, 3)


@pytest.mark.parametrize("seed", [0, 2**63 - 1, np.int64(5)])
def test_valid_seeds_are_plain_ints(seed: int) -> None:
    config = HyLoConfig(seed=seed)
    assert type(config.lowrank.seed) is int and config.lowrank.seed == seed


# --------------------------------------------------------------------------- pending captures
def test_forwards_without_backward_are_dropped_with_one_warning_per_layer() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=0.1)
    x, _ = batch(0)
    with pytest.warns(UserWarning, match="no_grad") as record:
        for _ in range(50):  # "evaluation" in train mode with autograd on, at a capture step
            model(x).argmax(dim=1)
    for info in pre.layer_info():
        assert len(info.calls) + info.pending <= 2, info.name  # the forwards kept: at most the latest two
        assert sum(f"'{info.name}'" in str(w.message) for w in record) == 1, info.name

    reference = copy.deepcopy(model)
    reference_pre = HyLoPreconditioner(reference, solver="sngd", update_freq=1, damping=0.1)
    for m, p in ((model, pre), (reference, reference_pre)):
        backward(m, 1)
        p.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)


def test_gradient_accumulation_and_repeated_calls_keep_every_call() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for micro in range(20):
            backward(model, micro, n=2)
        assert [len(info.calls) for info in pre.layer_info()] == [20, 20]
        pre.step()

        model.zero_grad()
        x, _ = batch(0, n=2)
        hidden = [model.fc1(x + i) for i in range(20)]  # 20 calls awaiting one backward
        model.fc2(torch.tanh(torch.stack(hidden).mean(dim=0))).sum().backward()
        assert len(pre.layer_info()[0].calls) == 20
        pre.step()


def test_checkpointed_recomputation_does_not_warn() -> None:
    model = mlp()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    x, y = batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            F.cross_entropy(checkpoint(model, x, use_reentrant=False), y).backward()
        assert all(len(info.calls) == 3 for info in pre.layer_info())
        pre.step()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_checkpointed_model_is_preconditioned_as_the_plain_one(solver: str, reentrant: bool) -> None:
    """Activation checkpointing (either implementation): each call is captured once, the step is the plain run's."""
    results = []
    for checkpointed in (False, True):
        model = mlp()
        pre = HyLoPreconditioner(model, solver=solver, update_freq=2, damping=0.1)
        for step in range(3):
            model.zero_grad()
            x, y = batch(step)
            x.requires_grad_(reentrant)  # the reentrant implementation needs an input that requires grad
            out = checkpoint(model, x, use_reentrant=reentrant) if checkpointed else model(x)
            F.cross_entropy(out, y).backward()
            pre.step()
        results.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for plain, checkpointed in zip(*results, strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- tied weights
class _Tied(nn.Module):
    """A language-model head tied to its token embedding (the tied weight's gradient sums both uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 5, dtype=DT)
        self.mid = nn.Linear(5, 5, dtype=DT)
        self.head = nn.Linear(5, 11, bias=False, dtype=DT)
        self.head.weight = self.tok.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.tok(x))))


def test_tied_weights_stay_with_the_optimizer() -> None:
    model = _Tied()
    with pytest.warns(UserWarning, match="weight tied to"):
        pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=1e-3)
    assert _names(pre) == ["mid"]
    summary = pre.summary()
    assert "tok (weight tied to head" in summary and "head (weight tied to tok" in summary
    tokens = torch.randint(0, 11, (4, 6))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    tied, mid = model.tok.weight.grad.clone(), model.mid.weight.grad.clone()
    pre.step()
    assert torch.equal(model.tok.weight.grad, tied)
    assert not torch.allclose(model.mid.weight.grad, mid)


class _Lens(nn.Module):
    """Not a layer type: multiplies by a Parameter it holds as ``matrix``, here a Linear's weight."""

    def __init__(self, matrix: nn.Parameter) -> None:
        super().__init__()
        self.matrix = matrix

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix


def test_a_weight_held_by_a_module_of_any_type_is_tied() -> None:
    """A Parameter held under any name by any other module is tied: its gradient sums that module's use too."""
    model = nn.Sequential(nn.Linear(5, 5, dtype=DT), nn.Tanh(), nn.Linear(5, 5, dtype=DT), nn.Linear(5, 2, dtype=DT))
    model.insert(3, _Lens(model[2].weight))
    with pytest.warns(UserWarning, match="weight tied to 3.matrix"):
        pre = HyLoPreconditioner(model, solver="sngd", update_freq=1, damping=1e-3)
    assert _names(pre) == ["0", "4"]
    assert "2 (weight tied to 3.matrix: its gradient sums every use" in pre.summary()
    F.cross_entropy(model(torch.randn(6, 5, dtype=DT)), torch.tensor([0, 1, 0, 1, 1, 0])).backward()
    tied = model[2].weight.grad.clone()
    pre.step()
    assert torch.equal(model[2].weight.grad, tied)
