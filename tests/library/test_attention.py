"""``nn.MultiheadAttention``'s projections preconditioned as Linear layers (hylo/attention.py).

The oracle is the same attention written with four plain ``nn.Linear`` projections and an
attention core written here from its definition (softmax(QKᵀ/√d + mask)·V per head): every
solver must give the projections of both models the same preconditioned gradients, for
packed and separate weights, ``batch_first`` either way, with and without bias, masks,
``need_weights`` either way, cross-attention, ``add_bias_kv``/``add_zero_attn`` and unbatched
inputs. Also: the stock forward is unchanged (outputs, attention weights, gradients), ``remove()``
restores it, ``state_dict`` keys never change, checkpoints round-trip, and the projections of
``nn.TransformerEncoderLayer``/``DecoderLayer`` are all captured with one row per token, and
2 gloo ranks under DDP give one process's result on the whole batch. On the common path
(``need_weights=False`` without ``bias_k``/``bias_v``/``add_zero_attn``; docs/transformers.md, "Attention") a capture step's forward does the
stock forward's products only (no identity products) and dropout draws the stock forward's random
numbers; other calls still take the identity-projection path and fail as torch fails them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from hylo import HyLoPreconditioner
from tests.kit.checks import DT
from tests.kit.devices import OnDevice, chosen, on_device
from tests.kit.harness import run_distributed
from tests.kit.internals import hooks

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

E, HEADS, L, S, N = 8, 2, 5, 6, 3
SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")


@dataclass(frozen=True)
class Variant:
    """One way of building and calling the attention module."""

    name: str
    module: dict[str, Any] = field(default_factory=dict)
    #: "self": query is key is value; "kv": key is value; "qkv": three different tensors.
    inputs: str = "self"
    call: dict[str, Any] = field(default_factory=dict)
    batched: bool = True
    #: Whether the call is on the common path (docs/transformers.md, "Attention"): no identity products.
    common: bool = False


def _causal(length: int) -> Tensor:
    return torch.triu(torch.ones(length, length, dtype=torch.bool), 1)


def _padding() -> Tensor:
    mask = torch.zeros(N, S, dtype=torch.bool)
    mask[0, -2:] = True
    mask[2, -1] = True
    return mask


def _float_padding() -> Tensor:
    return torch.zeros(N, S, dtype=DT).masked_fill(_padding(), float("-inf")) + torch.linspace(-0.5, 0.5, S, dtype=DT)


def _head_masks() -> Tensor:
    """A boolean (N·heads, L, S) mask, different per sequence and head, never masking a whole row."""
    mask = torch.zeros(N * HEADS, L, S, dtype=torch.bool)
    for i in range(N * HEADS):
        mask[i, :, i % S] = True
    return mask


with on_device(chosen()):  # the tier's device (tests/kit/devices.py): the masks beside the model
    VARIANTS = [
        Variant(
            "packed-batch-first-causal",
            {"batch_first": True},
            call={"attn_mask": _causal(L), "need_weights": False},
            common=True,
        ),
        Variant("packed-seq-first-weights", {}, call={"attn_mask": _causal(L), "need_weights": True}),
        Variant(
            "no-bias-is-causal", {"bias": False, "batch_first": True}, call={"attn_mask": _causal(L), "is_causal": True}
        ),
        Variant(
            "cross-kv-padding",
            {"batch_first": True},
            inputs="kv",
            call={"key_padding_mask": _padding(), "need_weights": True, "average_attn_weights": False},
        ),
        Variant(
            "three-inputs-float-mask",
            {},
            inputs="qkv",
            call={"attn_mask": torch.linspace(-1.0, 0.5, L * S, dtype=DT).reshape(L, S), "need_weights": False},
            common=True,
        ),
        Variant("separate-weights", {"kdim": 3, "vdim": 5, "batch_first": True}, inputs="qkv"),
        Variant(
            "bias-kv-zero-attn-padding",
            {"add_bias_kv": True, "add_zero_attn": True},
            inputs="kv",
            call={"key_padding_mask": _padding()},
        ),
        Variant("unbatched", {"batch_first": True}, call={"attn_mask": _causal(L)}, batched=False),
        Variant(  # outside the common path although need_weights=False: a float mask not of the query's dtype
            "float32-mask",
            {"batch_first": True},
            call={"attn_mask": torch.linspace(-1.0, 0.5, L * L).reshape(L, L), "need_weights": False},
        ),
        # more of the common path (need_weights=False, no bias_k/bias_v/add_zero_attn): no identity products
        Variant(
            "direct-no-bias-is-causal",
            {"bias": False, "batch_first": True},
            call={"attn_mask": _causal(L), "is_causal": True, "need_weights": False},
            common=True,
        ),
        Variant(
            "direct-is-causal-with-padding",
            {},
            inputs="kv",
            call={
                "attn_mask": _causal(S)[:L],
                "is_causal": True,
                "key_padding_mask": _padding(),
                "need_weights": False,
            },
            common=True,
        ),
        Variant(
            "direct-cross-kv-float-padding",
            {"batch_first": True},
            inputs="kv",
            call={"key_padding_mask": _float_padding(), "need_weights": False},
            common=True,
        ),
        Variant(
            "direct-separate-weights-3d-mask-padding",
            {"kdim": 3, "vdim": 5},
            inputs="qkv",
            call={"attn_mask": _head_masks(), "key_padding_mask": _padding(), "need_weights": False},
            common=True,
        ),
        Variant(
            "direct-unbatched",
            {"batch_first": True},
            call={"attn_mask": _causal(L), "need_weights": False},
            batched=False,
            common=True,
        ),
    ]


def _explicit_core(
    q: Tensor, k: Tensor, v: Tensor, bias_kv: tuple[Tensor, Tensor] | None, zero_attn: bool, **call: Any
) -> Tensor:
    """Multi-head attention on projected (N, L, E) / (N, S, E) tensors, from its definition."""
    n, tgt, _ = q.shape
    head = E // HEADS
    if bias_kv is not None:
        k = torch.cat([k, bias_kv[0].reshape(1, 1, E).expand(n, 1, E)], dim=1)
        v = torch.cat([v, bias_kv[1].reshape(1, 1, E).expand(n, 1, E)], dim=1)
    split = [t.reshape(n, t.shape[1], HEADS, head).transpose(1, 2) for t in (q, k, v)]  # (N, H, ·, d)
    qh, kh, vh = split
    if zero_attn:
        kh = torch.cat([kh, kh.new_zeros(n, HEADS, 1, head)], dim=2)
        vh = torch.cat([vh, vh.new_zeros(n, HEADS, 1, head)], dim=2)
    scores = qh @ kh.transpose(-2, -1) / math.sqrt(head)  # (N, H, L, S')
    mask = call.get("attn_mask")
    if mask is not None:
        mask = F.pad(mask, (0, scores.shape[-1] - mask.shape[-1]))
        if mask.dim() == 3:  # (N·heads, L, S)
            mask = mask.reshape(n, HEADS, tgt, scores.shape[-1])
        scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    padding = call.get("key_padding_mask")
    if padding is not None:
        padding = F.pad(padding, (0, scores.shape[-1] - padding.shape[-1]))
        padding = padding[:, None, None, :]
        scores = scores.masked_fill(padding, float("-inf")) if padding.dtype == torch.bool else scores + padding
    out = torch.softmax(scores, dim=-1) @ vh  # (N, H, L, d)
    return out.transpose(1, 2).reshape(n, tgt, E)


class ExplicitAttention(nn.Module):
    """The same attention with plain nn.Linear projections (the oracle's model)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        bias = mha.in_proj_bias is not None
        self.q_proj = nn.Linear(E, E, bias=bias, dtype=DT)
        self.k_proj = nn.Linear(mha.kdim, E, bias=bias, dtype=DT)
        self.v_proj = nn.Linear(mha.vdim, E, bias=bias, dtype=DT)
        self.out_proj = nn.Linear(E, E, bias=mha.out_proj.bias is not None, dtype=DT)
        self.batch_first = mha.batch_first
        self.bias_kv = None if mha.bias_k is None else (mha.bias_k.detach().clone(), mha.bias_v.detach().clone())
        self.zero_attn = mha.add_zero_attn
        with torch.no_grad():
            for i, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
                proj.weight.copy_(
                    mha.in_proj_weight[i * E : (i + 1) * E]
                    if mha.in_proj_weight is not None
                    else getattr(mha, f"{'qkv'[i]}_proj_weight")
                )
                if bias:
                    proj.bias.copy_(mha.in_proj_bias[i * E : (i + 1) * E])
            self.out_proj.weight.copy_(mha.out_proj.weight)
            if self.out_proj.bias is not None:
                self.out_proj.bias.copy_(mha.out_proj.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **call: Any) -> tuple[Tensor, None]:
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        unbatched = query.dim() == 2
        if unbatched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        elif not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        call = {key_: value_ for key_, value_ in call.items() if key_ in ("attn_mask", "key_padding_mask")}
        out = _explicit_core(q, k, v, self.bias_kv, self.zero_attn, **call)
        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return self.out_proj(out), None


class Wrapper(nn.Module):
    """attention → tanh → a Linear head; the loss is a fixed regression target."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.head = nn.Linear(E, 2, dtype=DT)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **call: Any) -> Tensor:
        out, _ = self.attn(query, key, value, **call)
        return self.head(torch.tanh(out))


def _models(variant: Variant, seed: int = 0) -> tuple[Wrapper, Wrapper]:
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, HEADS, dtype=DT, **variant.module)
    if mha.bias_k is not None:
        with torch.no_grad():
            mha.bias_k.normal_()
            mha.bias_v.normal_()
    with torch.no_grad():
        if mha.in_proj_bias is not None:
            mha.in_proj_bias.normal_(0, 0.1)
    stock = Wrapper(mha)
    explicit = Wrapper(ExplicitAttention(mha))
    explicit.head.load_state_dict(stock.head.state_dict())
    return stock, explicit


def _inputs(variant: Variant, mha: nn.MultiheadAttention, step: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)

    def make(length: int, dim: int) -> Tensor:
        if not variant.batched:
            return torch.randn(length, dim, generator=gen, dtype=DT)
        shape = (N, length, dim) if mha.batch_first else (length, N, dim)
        return torch.randn(*shape, generator=gen, dtype=DT)

    query = make(L, E)
    if variant.inputs == "self":
        return query, query, query
    key = make(S, mha.kdim)
    if variant.inputs == "kv":
        return query, key, key
    return query, key, make(S, mha.vdim)


def _backward(model: Wrapper, inputs: tuple[Tensor, Tensor, Tensor], call: dict[str, Any]) -> None:
    model.zero_grad()
    out = model(*inputs, **call)
    target = torch.linspace(-1, 1, out.numel(), dtype=DT).reshape(out.shape)
    F.mse_loss(out, target).backward()


def _projection_grads(model: Wrapper) -> dict[str, Tensor]:
    """Each projection's (weight | bias) gradient, by name, from either model."""
    attn = model.attn
    grads: dict[str, Tensor] = {}
    if isinstance(attn, nn.MultiheadAttention):
        for i, part in enumerate("qkv"):
            if attn.in_proj_weight is not None:
                weight = attn.in_proj_weight.grad[i * E : (i + 1) * E]
            else:
                weight = getattr(attn, f"{part}_proj_weight").grad
            grads[part] = weight.clone()
            if attn.in_proj_bias is not None:
                grads[part + ".bias"] = attn.in_proj_bias.grad[i * E : (i + 1) * E].clone()
    else:
        for part in "qkv":
            proj = getattr(attn, f"{part}_proj")
            grads[part] = proj.weight.grad.clone()
            if proj.bias is not None:
                grads[part + ".bias"] = proj.bias.grad.clone()
    grads["out"] = attn.out_proj.weight.grad.clone()
    if attn.out_proj.bias is not None:
        grads["out.bias"] = attn.out_proj.bias.grad.clone()
    grads["head"] = model.head.weight.grad.clone()
    return grads


def _options(solver: str) -> dict[str, Any]:
    return {"solver": solver, "update_freq": 2, "damping": 0.05, "rank_ratio": 0.5, "seed": 3}


# --------------------------------------------------------------------------- the stock forward is unchanged
def _rows(variant: Variant) -> tuple[int, int]:
    """The numbers of query rows and of key/value rows (tokens) of one call."""
    rows = N * L if variant.batched else L
    return rows, (rows // L * S if variant.inputs != "self" else rows)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_capturing_forward_equals_the_stock_forward(variant: Variant) -> None:
    stock, _ = _models(variant)
    mha = stock.attn
    assert isinstance(mha, nn.MultiheadAttention)
    inputs = _inputs(variant, mha, 0)
    expected = nn.MultiheadAttention.forward(mha, *inputs, **variant.call)  # no hooks run
    stock.head(torch.tanh(expected[0])).square().mean().backward()
    expected_grads = {name: p.grad.clone() for name, p in stock.named_parameters()}
    stock.zero_grad()
    pre = HyLoPreconditioner(stock, solver="sngd", update_freq=1)
    got = mha(*inputs, **variant.call)  # a capture step: hylo's projections
    torch.testing.assert_close(got[0], expected[0], rtol=1e-13, atol=1e-13)
    assert (got[1] is None) == (expected[1] is None)
    if got[1] is not None:
        torch.testing.assert_close(got[1], expected[1], rtol=1e-13, atol=1e-13)
    assert all(not info.calls for info in pre.layer_info())  # no backward yet
    stock.head(torch.tanh(got[0])).square().mean().backward()
    for name, p in stock.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], rtol=1e-12, atol=1e-14, msg=name)
    rows, key_rows = _rows(variant)
    counts = {info.name: sum(call.rows for call in info.calls) for info in pre.layer_info()}
    assert counts == {
        "attn.q_proj": rows,
        "attn.k_proj": key_rows,
        "attn.v_proj": key_rows,
        "attn.out_proj": rows,
        "head": rows,
    }


def _forward_flops(module: nn.Module, *args: Any, **kwargs: Any) -> int:
    """The floating-point operations of one forward, as torch's FlopCounterMode counts them (products)."""
    with FlopCounterMode(display=False) as counter:
        module(*args, **kwargs)
    return counter.get_total_flops()


def _modes_left() -> list[Any]:
    """torch's function modes active now, less the device mode a test tier runs under: what a forward left behind."""
    return [m for m in torch.overrides._get_current_function_mode_stack() if not isinstance(m, OnDevice)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_a_capture_step_multiplies_by_identities_only_outside_the_common_path(variant: Variant) -> None:
    stock, _ = _models(variant)
    mha = stock.attn
    assert isinstance(mha, nn.MultiheadAttention)
    inputs = _inputs(variant, mha, 0)
    plain = _forward_flops(mha, *inputs, **variant.call)
    pre = HyLoPreconditioner(stock, solver="kfac", update_freq=1)
    captured = _forward_flops(mha, *inputs, **variant.call)
    assert all(info.calls or info.pending for info in pre.layer_info() if info.name.startswith("attn."))
    rows, key_rows = _rows(variant)
    # the old path: q, k, v and the output multiplied by (E, E) identities, 2·rows·E² operations each
    identities = 0 if variant.common else 2 * E * E * (2 * rows + 2 * key_rows)
    assert captured == plain + identities


def test_an_active_function_mode_keeps_the_common_path() -> None:
    """A torch function mode (``torch.set_default_device``'s, here ``with torch.device(...)``) is not a tensor with a
    ``__torch_function__`` of its own: the capture step still multiplies by no identities."""
    variant = VARIANTS[0]
    assert variant.common
    stock, _ = _models(variant)
    mha = stock.attn
    inputs = _inputs(variant, mha, 0)
    plain = _forward_flops(mha, *inputs, **variant.call)
    pre = HyLoPreconditioner(stock, solver="kfac", update_freq=1)
    with torch.device(chosen()):
        captured = _forward_flops(mha, *inputs, **variant.call)
    assert all(info.calls or info.pending for info in pre.layer_info() if info.name.startswith("attn."))
    assert captured == plain


@pytest.mark.parametrize(
    "call",
    (
        {"is_causal": True, "need_weights": False},  # is_causal without its mask
        {"attn_mask": _causal(L + 1), "need_weights": False},  # a mask of the wrong shape
    ),
    ids=("is-causal-without-mask", "mask-shape"),
)
def test_calls_outside_the_common_path_fail_as_torch_fails_them(call: dict[str, Any]) -> None:
    stock, _ = _models(VARIANTS[0])
    mha = stock.attn
    assert isinstance(mha, nn.MultiheadAttention)
    inputs = _inputs(VARIANTS[0], mha, 0)
    with pytest.raises(RuntimeError) as expected:
        nn.MultiheadAttention.forward(mha, *inputs, **call)
    pre = HyLoPreconditioner(stock, solver="kfac", update_freq=1)
    with pytest.raises(RuntimeError) as got:
        mha(*inputs, **call)
    assert str(got.value) == str(expected.value)
    assert not _modes_left()
    assert all(not info.calls for info in pre.layer_info())


@pytest.mark.parametrize("batch_first", (True, False))
def test_dropout_in_training_draws_the_stock_forwards_random_numbers(batch_first: bool) -> None:
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=16, dropout=0.3, batch_first=batch_first, dtype=DT)
    x = torch.randn(N, L, E, dtype=DT) if batch_first else torch.randn(L, N, E, dtype=DT)
    weights = torch.randn(x.shape, dtype=DT)
    stock = copy.deepcopy(block)
    torch.manual_seed(7)
    expected = stock(x, src_mask=_causal(L), is_causal=True)
    (expected * weights).sum().backward()
    plain = _forward_flops(stock, x, src_mask=_causal(L))
    pre = HyLoPreconditioner(block, solver="kfac", update_freq=1)
    torch.manual_seed(7)
    got = block(x, src_mask=_causal(L), is_causal=True)
    assert torch.equal(got, expected)
    (got * weights).sum().backward()
    for (name, p), q in zip(block.named_parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    assert all(info.calls for info in pre.layer_info())
    assert _forward_flops(block, x, src_mask=_causal(L)) == plain  # the common path: no identity products


# --------------------------------------------------------------------------- equivalence with plain Linear projections
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_projections_are_preconditioned_as_plain_linear_layers(variant: Variant, solver: str) -> None:
    stock, explicit = _models(variant)
    pre_stock = HyLoPreconditioner(stock, **_options(solver))
    pre_explicit = HyLoPreconditioner(explicit, **_options(solver))
    assert [info.name for info in pre_stock.layer_info()] == [info.name for info in pre_explicit.layer_info()]
    assert isinstance(stock.attn, nn.MultiheadAttention)
    for step in range(3):  # an update, a step between updates, an update with running statistics
        inputs = _inputs(variant, stock.attn, step)
        _backward(stock, inputs, variant.call)
        _backward(explicit, inputs, variant.call)
        raw_stock, raw_explicit = _projection_grads(stock), _projection_grads(explicit)
        for part, grad in raw_stock.items():
            torch.testing.assert_close(grad, raw_explicit[part], rtol=1e-10, atol=1e-12)
        pre_stock.step()
        pre_explicit.step()
        got, expected = _projection_grads(stock), _projection_grads(explicit)
        for part, grad in got.items():
            torch.testing.assert_close(grad, expected[part], rtol=1e-9, atol=1e-11, msg=f"{part} at step {step}")
            if part != "head" or solver != "hybrid":
                assert not torch.allclose(grad, raw_stock[part]), f"{part} was not preconditioned at step {step}"
    assert [info.solver for info in pre_stock.layer_info()] == [info.solver for info in pre_explicit.layer_info()]


# --------------------------------------------------------------------------- remove, state_dict, checkpoints
def test_state_dict_keys_never_change_and_remove_restores_the_stock_forward() -> None:
    variant = VARIANTS[0]
    stock, _ = _models(variant)
    mha = stock.attn
    assert isinstance(mha, nn.MultiheadAttention)
    keys = list(stock.state_dict())
    attached = (hooks(mha), hooks(mha.out_proj))
    pre = HyLoPreconditioner(stock, solver="kfac", update_freq=1)
    assert type(mha) is nn.MultiheadAttention and "forward" not in vars(mha)
    assert list(stock.state_dict()) == keys
    _backward(stock, _inputs(variant, mha, 0), variant.call)
    pre.step()
    assert list(stock.state_dict()) == keys
    pre.remove()
    assert (hooks(mha), hooks(mha.out_proj)) == attached
    inputs = _inputs(variant, mha, 1)
    _backward(stock, inputs, variant.call)
    assert all(not (info.calls or info.pending) for info in pre.layer_info())
    raw = _projection_grads(stock)
    fresh, _ = _models(variant)
    fresh.load_state_dict(stock.state_dict())
    _backward(fresh, inputs, variant.call)
    for part, grad in _projection_grads(fresh).items():
        assert torch.equal(grad, raw[part])


def test_a_forward_that_raises_leaves_no_mode_behind() -> None:
    variant = VARIANTS[0]
    stock, _ = _models(variant)
    mha = stock.attn
    assert isinstance(mha, nn.MultiheadAttention)
    HyLoPreconditioner(stock, solver="sngd", update_freq=1)
    query = _inputs(variant, mha, 0)[0]
    with pytest.raises((AssertionError, RuntimeError)):
        mha(query, query[:, :, :3], query)  # wrong key width
    assert not _modes_left()
    out, _ = mha(query, query, query)
    assert out.shape == query.shape


@pytest.mark.parametrize("solver", ("kfac", "sngd", "hybrid"))
def test_checkpoint_round_trip_continues_like_an_uninterrupted_run(solver: str) -> None:
    variant = VARIANTS[3]
    a, _ = _models(variant)
    b = copy.deepcopy(a)
    pre_a = HyLoPreconditioner(a, **_options(solver))
    pre_b = HyLoPreconditioner(b, **_options(solver))
    assert isinstance(a.attn, nn.MultiheadAttention)
    for step in range(2):
        for model, pre in ((a, pre_a), (b, pre_b)):
            _backward(model, _inputs(variant, a.attn, step), variant.call)
            pre.step()
    state = pre_b.state_dict()
    assert {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"} <= set(state["layers"])
    pre_b.remove()
    resumed = HyLoPreconditioner(b, **_options(solver))
    resumed.load_state_dict(state)
    for step in range(2, 5):
        for model, pre in ((a, pre_a), (b, resumed)):
            _backward(model, _inputs(variant, a.attn, step), variant.call)
            pre.step()
        for part, grad in _projection_grads(a).items():
            assert torch.equal(grad, _projection_grads(b)[part]), f"{part} at step {step}"


# --------------------------------------------------------------------------- registration details
def test_skip_layers_and_frozen_projections() -> None:
    stock, _ = _models(VARIANTS[5])  # separate q/k/v weights
    mha = stock.attn
    assert isinstance(mha, nn.MultiheadAttention)
    mha.k_proj_weight.requires_grad_(False)
    pre = HyLoPreconditioner(stock, solver="sngd", skip_layers=("attn.v_proj",))
    assert [info.name for info in pre.layer_info()] == ["attn.q_proj", "attn.out_proj", "head"]
    summary = pre.summary()
    assert "attn.v_proj (skip_layers)" in summary and "attn.k_proj (weight does not require grad)" in summary
    pre.remove()
    pre = HyLoPreconditioner(stock, solver="sngd", skip_layers=("MultiheadAttention",))
    assert [info.name for info in pre.layer_info()] == ["head"]
    assert not hooks(mha)[0]  # forward-pre hooks


def test_bias_kv_stays_with_the_optimizer_and_is_listed() -> None:
    stock, _ = _models(VARIANTS[6])
    summary = HyLoPreconditioner(stock, solver="kfac").summary()
    assert "attn.bias_k (a bias vector: stays with the optimizer)" in summary
    assert "MHA.q" in summary and "MHA.out" in summary


def test_root_attention_registers_its_projections() -> None:
    mha = nn.MultiheadAttention(E, HEADS, dtype=DT)
    pre = HyLoPreconditioner(mha, solver="sngd", update_freq=1)
    assert [info.name for info in pre.layer_info()] == ["q_proj", "k_proj", "v_proj", "out_proj"]


@pytest.mark.parametrize("layer_cls", (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
@pytest.mark.parametrize("solver", ("kfac", "kid", "hybrid"))
def test_transformer_layers_capture_every_projection_with_one_row_per_token(
    layer_cls: type[nn.Module], solver: str
) -> None:
    torch.manual_seed(0)
    block = layer_cls(E, HEADS, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=DT)
    pre = HyLoPreconditioner(block, solver=solver, update_freq=1, damping=1e-3)
    attentions = ["self_attn"] + (["multihead_attn"] if layer_cls is nn.TransformerDecoderLayer else [])
    expected = [f"{a}.{p}_proj" for a in attentions for p in ("q", "k", "v", "out")] + ["linear1", "linear2"]
    assert sorted(info.name for info in pre.layer_info()) == sorted(expected)
    x = torch.randn(N, L, E, dtype=DT)
    args = (x,) if layer_cls is nn.TransformerEncoderLayer else (x, torch.randn(N, S, E, dtype=DT))
    out = block(
        *args, **({"src_mask": _causal(L)} if layer_cls is nn.TransformerEncoderLayer else {"tgt_mask": _causal(L)})
    )
    (out * torch.randn(out.shape, dtype=DT)).sum().backward()  # (LayerNorm makes the mean square constant)
    for info in pre.layer_info():
        calls = info.calls
        assert len(calls) == 1, info.name
        rows = calls[0].rows
        memory = info.name.startswith("multihead_attn.") and info.name[15] in "kv"
        assert rows == N * (S if memory else L), info.name
    raw = {name: p.grad.clone() for name, p in block.named_parameters()}
    pre.step()
    for name, p in block.named_parameters():
        assert torch.isfinite(p.grad).all()
        if name.endswith("in_proj_weight") or name.endswith("out_proj.weight"):
            assert (p.grad - raw[name]).norm() > 1e-3 * raw[name].norm(), name


# --------------------------------------------------------------------------- P ranks = one process
def _ddp_attention_run(
    rank: int, world_size: int, solver: str, batches: list[Tensor], local: int
) -> list[dict[str, Tensor]]:
    """Three steps of an attention model under DDP; rank ``rank`` takes its ``local`` sequences of each batch."""
    torch.manual_seed(0)
    model = Wrapper(nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=DT))
    net: nn.Module = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    pre = HyLoPreconditioner(net, solver=solver, update_freq=2, damping=0.05)
    out = []
    for x in batches:
        part = x[rank * local : (rank + 1) * local]
        net.zero_grad()
        y = net(part, part, part, attn_mask=_causal(L))
        target = torch.linspace(-1, 1, x.shape[0] * L * 2, dtype=DT).reshape(x.shape[0], L, 2)
        # the mean over the global batch: each rank's sum over its sequences, DDP averages over ranks
        (
            (y - target[rank * local : (rank + 1) * local]).square().sum()
            * world_size
            / y.new_tensor(x.numel() / E * 2)
        ).backward()
        pre.step()
        out.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return out


@pytest.mark.explicit_device(reason="forks gloo ranks on the CPU (NCCL: tests/library/test_distributed.py)")
@pytest.mark.parametrize("solver", ("kfac", "sngd"))
def test_two_ranks_with_ddp_equal_one_process_on_the_whole_batch(solver: str) -> None:
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(4, L, E, generator=gen, dtype=DT) for _ in range(3)]
    (single,) = run_distributed(_ddp_attention_run, 1, solver, batches, 4, timeout=120)
    ranks = run_distributed(_ddp_attention_run, 2, solver, batches, 2, timeout=120)
    for rank_result in ranks:
        for step, grads in enumerate(single):
            for name, grad in grads.items():
                torch.testing.assert_close(
                    rank_result[step][name], grad, rtol=1e-8, atol=1e-12, msg=f"{name} at {step}"
                )
