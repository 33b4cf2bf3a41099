"""Subclasses of registered layer types, and errors of a layer's math (docs/extending.md, "Subclasses";
docs/reliability.md, "Registration").

A module's type is looked up along its class's method resolution order, but a subclass whose ``forward``
is not its registered class's is not taken for that class's operation on its first argument: Hugging
Face's learned position tables subclass ``nn.Embedding`` and look up positions computed from a mask
(OPT: the rows would be the mask's 1s instead of the positions 2…T+1 that receive gradient) or ignore
their argument's values (Whisper, BART: ``pre.step()`` crashed inside torch). Such a subclass stays with
the optimizer with its reason in ``summary()`` and the constructor's warning, for every built-in type,
unless it is registered itself (``hylo.register_layer_type(Sub, nn.Embedding)`` reuses the class's
math); a subclass that keeps its class's ``forward`` is preconditioned as before. An error raised by a
layer's math (in the backward's gradient hook or in ``step()``) names the layer.

The references are independent of hylo: which modules are left alone is read from the model's
classes, the positions that receive gradient from the mask as OPT computes them, and the preconditioned
gradient of an explicitly registered subclass is the dense (F + λI)⁻¹ ∇W built from the true per-token
gradients (plain autograd, one token at a time). The Hugging Face models are tiny ones built from their
configs offline (skipped without ``transformers``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo import HyLoConfig, HyLoPreconditioner
from hylo.layers import EmbeddingMath, LinearMath
from hylo.layers.walk import register_layers
from tests.kit.checks import DT, assert_rel_close, rel_err
from tests.kit.internals import restore_layer_types
from tests.kit.reference import dense_natural_gradient

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, T, B, C = 12, 5, 4, 3, 3
DAMPING = 0.1


@pytest.fixture(autouse=True)
def restored_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every registration a test makes is undone after it."""
    restore_layer_types(monkeypatch)
    yield


def _names(pre: HyLoPreconditioner) -> list[str]:
    return [info.name for info in pre.layer_info()]


def _reason(pre: HyLoPreconditioner, name: str) -> str:
    """The reason ``summary()`` gives for leaving ``name`` alone."""
    prefix = f"  not preconditioned: {name} ("
    (line,) = [line for line in pre.summary().splitlines() if line.startswith(prefix)]
    return line[len(prefix) : -1]


def _quiet(model: nn.Module, **options: Any) -> HyLoPreconditioner:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HyLoPreconditioner(model, **options)


# ------------------------------------------------------------------------------------------ the rule, per type
#: Each built-in type: a module of it, and an input of the shape it takes.
BASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor]]] = {
    "Linear": (lambda: nn.Linear(4, 3, dtype=DT), lambda: torch.randn(B, 4, dtype=DT)),
    "Conv1d": (lambda: nn.Conv1d(2, 3, 3, dtype=DT), lambda: torch.randn(B, 2, 7, dtype=DT)),
    "Conv2d": (lambda: nn.Conv2d(2, 3, 3, dtype=DT), lambda: torch.randn(B, 2, 6, 6, dtype=DT)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(2, 3, 3, dtype=DT), lambda: torch.randn(B, 2, 5, dtype=DT)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(2, 3, 3, dtype=DT), lambda: torch.randn(B, 2, 4, 4, dtype=DT)),
    "Embedding": (lambda: nn.Embedding(V, D, dtype=DT), lambda: torch.randint(0, V, (B, T))),
}


def _subclass(base: type[nn.Module], own_forward: bool) -> type[nn.Module]:
    """A subclass of ``base`` that doubles its output (a forward of its own), or that only adds a method."""
    if own_forward:

        def forward(self: nn.Module, x: Tensor) -> Tensor:
            return 2 * base.forward(self, x)

        return type(f"Doubled{base.__name__}", (base,), {"forward": forward})
    return type(f"Tagged{base.__name__}", (base,), {"tag": lambda self: "mine"})


def _as(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    module.__class__ = cls
    return module


class Head(nn.Module):
    """``layer`` then a Linear on its flattened output, so that the model has one layer hylo always takes."""

    def __init__(self, layer: nn.Module, x: Tensor) -> None:
        super().__init__()
        self.layer = layer
        with torch.no_grad():
            width = layer(x).flatten(1).shape[1]
        self.head = nn.Linear(width, C, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).flatten(1))


@pytest.mark.parametrize("base", sorted(BASES))
def test_a_subclass_with_a_forward_of_its_own_is_left_alone_with_its_reason(base: str) -> None:
    make, inputs = BASES[base]
    module = make()
    cls = _subclass(type(module), own_forward=True)
    x = inputs()
    model = Head(_as(module, cls), x)
    with pytest.warns(UserWarning, match=f"{cls.__name__} subclasses {base} with a forward of its own"):
        pre = HyLoPreconditioner(model, solver="kfac", update_freq=1, damping=DAMPING)
    assert _names(pre) == ["head"]
    why = _reason(pre, "layer")
    assert "stays with the optimizer" in why and f"hylo.register_layer_type({cls.__name__}, {base})" in why
    F.cross_entropy(model(x), torch.randint(0, C, (B,))).backward()
    raw = model.layer.weight.grad.clone()
    pre.step()
    assert torch.equal(model.layer.weight.grad, raw)  # left to the optimizer: its gradient as autograd gave it


@pytest.mark.parametrize("base", sorted(BASES))
def test_a_subclass_that_keeps_its_class_forward_is_preconditioned(base: str) -> None:
    make, inputs = BASES[base]
    module = make()
    cls = _subclass(type(module), own_forward=False)
    model = Head(_as(module, cls), inputs())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left alone, nothing warned
        pre = HyLoPreconditioner(model, solver="kfac")
    assert _names(pre) == ["layer", "head"]
    assert pre.layer_info()[0].module_type == cls.__name__


def test_a_wrapper_class_without_a_forward_keeps_the_type() -> None:
    """Like ``fully_shard``'s FSDPLinear (a mixin without ``forward`` before nn.Linear in the MRO)."""

    class Mixin:
        def unshard(self) -> None:
            pass

    layer = nn.Linear(4, 3, dtype=DT)
    layer.__class__ = type("FSDPLinear", (Mixin, nn.Linear), {})
    found = register_layers(nn.Sequential(layer), HyLoConfig())
    assert [f.name for f in found.layers] == ["0"] and found.unsupported == []
    found.remove()


def test_a_subclass_of_an_explicitly_registered_subclass_is_held_to_its_forward() -> None:
    doubled = _subclass(nn.Linear, own_forward=True)
    hylo.register_layer_type(doubled, lambda module, config: LinearMath(module))
    keeps = type("KeepsDoubled", (doubled,), {})
    again = _subclass(doubled, own_forward=True)
    model = nn.Sequential(_as(nn.Linear(4, 4, dtype=DT), doubled), _as(nn.Linear(4, 4, dtype=DT), keeps))
    model.append(_as(nn.Linear(4, 2, dtype=DT), again))
    pre = _quiet(model)
    assert _names(pre) == ["0", "1"]
    assert f"{again.__name__} subclasses {doubled.__name__} with a forward of its own" in _reason(pre, "2")


def test_a_tied_subclass_is_left_alone_for_its_tie() -> None:
    """Registering it would not help: the reason is the tie (a scaled word embedding tied to an LM head)."""

    class Scaled(nn.Embedding):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) * 2.0

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = Scaled(V, D, dtype=DT)
            self.mix = nn.Linear(D, D, dtype=DT)
            self.head = nn.Linear(D, V, bias=False, dtype=DT)
            self.head.weight = self.tokens.weight

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.mix(self.tokens(x)))

    pre = _quiet(LM())
    assert _names(pre) == ["mix"]
    assert _reason(pre, "tokens").startswith("weight tied to head")


# ------------------------------------------------------------------------------------------ position tables
class PositionTable(nn.Embedding):
    """OPT's learned positions, as Hugging Face writes them: the argument is the attention mask."""

    offset = 2

    def forward(self, mask: Tensor) -> Tensor:
        positions = (torch.cumsum(mask, dim=1) * mask - 1).long()
        return super().forward(positions + self.offset)


class Decoder(nn.Module):
    """Token embeddings plus OPT-style positions, a Linear on every token and a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens = nn.Embedding(V, D, dtype=DT)
        self.positions = PositionTable(T + PositionTable.offset, D, dtype=DT)
        self.mix = nn.Linear(D, D, dtype=DT)
        self.head = nn.Linear(D, C, dtype=DT)

    def forward(self, idx: Tensor) -> Tensor:
        mask = torch.ones_like(idx)
        return self.head(torch.tanh(self.mix(self.tokens(idx) + self.positions(mask))))


def _token_loss(out: Tensor, seed: int = 3) -> Tensor:
    labels = torch.randint(0, C, out.shape[:-1], generator=torch.Generator().manual_seed(seed))
    return F.cross_entropy(out.reshape(-1, C), labels.reshape(-1))


@pytest.mark.parametrize("solver", ["kfac", "sngd", "hybrid"])
def test_an_opt_style_position_table_is_left_alone_and_the_rest_preconditioned(solver: str) -> None:
    net = Decoder()
    with pytest.warns(UserWarning, match="PositionTable subclasses Embedding with a forward of its own"):
        pre = HyLoPreconditioner(net, solver=solver, update_freq=1, damping=DAMPING)
    assert _names(pre) == ["tokens", "mix", "head"]
    assert "hylo.register_layer_type(PositionTable, Embedding)" in _reason(pre, "positions")
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    _token_loss(net(idx)).backward()
    raw = {name: p.grad.clone() for name, p in net.named_parameters()}
    pre.step()
    assert torch.equal(net.positions.weight.grad, raw["positions.weight"])
    for name in ("tokens.weight", "mix.weight", "head.weight"):
        assert rel_err(dict(net.named_parameters())[name].grad, raw[name]) > 1e-3, name


def _per_token_gradients(net: Decoder, table: nn.Embedding, idx: Tensor) -> Tensor:
    """True per-token gradients U_i (n, D, rows of ``table``) of ``table`` in hylo's orientation (n·token i's
    share of ∇ weightᵀ): token i keeps its graph through ``table``'s output, every other position is detached."""
    n = idx.numel()
    mats = []
    for i in range(n):
        net.zero_grad()

        def only_i(module: nn.Module, args: Any, out: Tensor, i: int = i) -> Tensor:
            keep = torch.zeros(n, 1, dtype=torch.bool)
            keep[i] = True
            flat = out.reshape(n, -1)
            return torch.where(keep, flat, flat.detach()).reshape(out.shape)

        hook = table.register_forward_hook(only_i)
        _token_loss(net(idx)).backward()
        hook.remove()
        mats.append(n * table.weight.grad.mT.clone())
    net.zero_grad()
    return torch.stack(mats)


class Lookup(nn.Embedding):
    """A subclass whose own forward is the lookup of its first argument (it counts its calls)."""

    calls = 0

    def forward(self, idx: Tensor) -> Tensor:
        type(self).calls += 1
        return F.embedding(idx, self.weight)


class LookupDecoder(Decoder):
    """:class:`Decoder` whose token embedding is a :class:`Lookup`."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.tokens = _as(self.tokens, Lookup)  # type: ignore[assignment]


@pytest.mark.parametrize("how", ["class", "factory"])
def test_an_explicitly_registered_subclass_is_preconditioned_exactly(how: str) -> None:
    """Registered with ``nn.Embedding`` (its math and reasons) or a factory: SNGD equals the dense natural
    gradient of the true per-token gradients."""
    math: Any = nn.Embedding if how == "class" else (lambda module, config: EmbeddingMath(module))
    hylo.register_layer_type(Lookup, math)
    net = LookupDecoder()
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    per_token = _per_token_gradients(net, net.tokens, idx)
    pre = _quiet(net, solver="sngd", update_freq=1, damping=DAMPING)
    assert _names(pre) == ["tokens", "mix", "head"]
    assert pre.layer_info()[0].module_type == "Lookup"
    _token_loss(net(idx)).backward()
    grad = net.tokens.weight.grad.mT.clone()
    pre.step()
    expected = dense_natural_gradient(per_token, grad, DAMPING)
    assert rel_err(expected, grad / DAMPING) > 1e-2  # the curvature matters at this damping
    assert_rel_close(net.tokens.weight.grad.mT, expected)


def test_registering_with_a_class_reuses_its_reasons_and_is_checked() -> None:
    hylo.register_layer_type(Lookup, nn.Embedding)
    sparse = _as(nn.Embedding(V, D, sparse=True), Lookup)
    found = register_layers(nn.Sequential(sparse, nn.Linear(D, 2)), HyLoConfig())
    assert [f.name for f in found.layers] == ["1"]
    assert "sparse=True" in found.unsupported[0][1]
    found.remove()
    with pytest.raises(ValueError, match="a registered class that Lookup subclasses"):
        hylo.register_layer_type(Lookup, nn.Linear)
    with pytest.raises(ValueError, match="Conv3d is not a registered layer type"):
        hylo.register_layer_type(type("MyConv3d", (nn.Conv3d,), {}), nn.Conv3d)
    with pytest.raises(ValueError, match="PositionTable is not a registered layer type.*keeps its forward"):
        hylo.register_layer_type(type("Later", (PositionTable,), {}), PositionTable)


def test_a_math_class_is_still_a_factory() -> None:
    """A LayerMath class taking (module, config) is a factory, not a class whose registration is reused."""

    class Math(LinearMath):
        def __init__(self, module: nn.Module, config: HyLoConfig) -> None:
            super().__init__(module)

    doubled = _subclass(nn.Linear, own_forward=True)
    hylo.register_layer_type(doubled, Math)
    found = register_layers(nn.Sequential(_as(nn.Linear(3, 2), doubled)), HyLoConfig())
    assert [type(f.math) for f in found.layers] == [Math]
    found.remove()


# ------------------------------------------------------------------------------------------ errors name the layer
class Boom(Exception):
    """An exception that takes two arguments (it cannot be rebuilt from a message)."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} ({code})")


def _failing(method: str, error: Exception) -> Callable[[nn.Module, HyLoConfig], LinearMath]:
    """A factory for a Linear's math whose ``method`` raises ``error``."""

    def fail(self: LinearMath, *args: Any) -> Any:
        raise error

    cls = type("Failing", (LinearMath,), {method: fail})
    return lambda module, config: cls(module)


class Plain(nn.Linear):
    """An nn.Linear registered by class for the failing math."""


@pytest.mark.parametrize(
    ("method", "solver", "error", "kind"),
    [
        ("kfac_factors", "kfac", RuntimeError("boom"), RuntimeError),
        ("lowrank_rows", "sngd", ValueError("boom"), ValueError),
        ("row_counts", "kfac", IndexError("boom"), IndexError),
        ("grad_parts", "kfac", Boom("boom", 7), RuntimeError),
        ("set_grad_matrix", "sngd", RuntimeError("boom"), RuntimeError),
    ],
)
def test_an_error_of_a_layer_math_names_the_layer(method: str, solver: str, error: Exception, kind: type) -> None:
    """In the backward's hook or in step(): ``layer '<name>' (<type>): <message>``, of the error's own type where
    it takes a message, chained to the original."""
    hylo.register_layer_type(Plain, _failing(method, error))
    net = nn.Sequential(nn.Linear(4, 6, dtype=DT), nn.Tanh(), _as(nn.Linear(6, 3, dtype=DT), Plain))
    pre = HyLoPreconditioner(net, solver=solver, update_freq=1, damping=DAMPING)
    with pytest.raises(kind, match=r"^layer '2' \(Plain\): boom") as raised:
        F.cross_entropy(net(torch.randn(8, 4, dtype=DT)), torch.randint(0, 3, (8,))).backward()
        pre.step()
    assert raised.value.__cause__ is error


def test_an_error_of_a_layer_factory_names_the_module() -> None:
    def factory(module: nn.Module, config: HyLoConfig) -> LinearMath:
        raise RuntimeError("no math today")

    hylo.register_layer_type(Plain, factory)
    net = nn.Sequential(nn.Linear(4, 6), nn.Sequential(_as(nn.Linear(6, 3), Plain)))
    with pytest.raises(RuntimeError, match=r"^layer '1\.0' \(Plain\): no math today"):
        HyLoPreconditioner(net)


def _embedding_math(module: nn.Module, config: HyLoConfig) -> EmbeddingMath:
    assert isinstance(module, nn.Embedding)
    return EmbeddingMath(module)


class FirstRows(nn.Embedding):
    """Whisper's learned positions: the first rows of the table, whatever the argument's values."""

    def forward(self, idx: Tensor) -> Tensor:
        return self.weight[: idx.shape[1]]


class WhisperLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(V, D, dtype=DT)
        self.positions = FirstRows(T, D, dtype=DT)
        self.head = nn.Linear(D, C, dtype=DT)

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.tokens(idx) + self.positions(idx))


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
def test_a_wrongly_registered_position_table_raises_naming_it_and_the_step_applies_not(solver: str) -> None:
    """Registered by hand as a lookup of its first argument, it is not one: a ValueError names it (was: a
    size mismatch or an index out of bounds from inside torch, naming nothing)."""
    hylo.register_layer_type(FirstRows, _embedding_math)
    net = WhisperLike()
    pre = HyLoPreconditioner(net, solver=solver, update_freq=1, damping=DAMPING)
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    raw: list[Tensor] | None = None
    with pytest.raises(ValueError, match=r"layer 'positions'.*not a lookup of its first argument"):
        _token_loss(net(idx)).backward()  # raises here where the call is reduced in its gradient hook
        raw = [p.grad.clone() for p in net.parameters()]
        pre.step()
    if raw is not None:  # raised by step(): it applied not at all
        assert all(torch.equal(p.grad, r) for p, r in zip(net.parameters(), raw, strict=True))
    assert pre.steps == 0


def test_a_wrongly_registered_table_beyond_its_rows_raises_naming_it_under_kfac() -> None:
    """BART's positions ignore the token ids they are given, which may exceed the table's rows."""

    class Short(nn.Embedding):
        def forward(self, idx: Tensor) -> Tensor:
            return super().forward(torch.arange(idx.shape[1]).expand_as(idx))

    hylo.register_layer_type(Short, _embedding_math)
    net = WhisperLike()
    net.positions = Short(T, D, dtype=DT)  # type: ignore[assignment]
    pre = HyLoPreconditioner(net, solver="kfac", update_freq=1, damping=DAMPING)
    idx = torch.full((B, T), V - 1)
    with pytest.raises(ValueError, match=rf"layer 'positions'.*largest index is {V - 1}, beyond the {T} rows"):
        _token_loss(net(idx)).backward()  # raises here where the call is reduced in its gradient hook
        pre.step()


# ------------------------------------------------------------------------------------------ Hugging Face
def _opt() -> nn.Module:
    tf = pytest.importorskip("transformers", reason="needs transformers")
    config = tf.OPTConfig(
        vocab_size=V + 20,
        hidden_size=16,
        num_hidden_layers=1,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=16,
        word_embed_proj_dim=16,
    )
    return tf.OPTForCausalLM(config)


def _bart() -> nn.Module:
    tf = pytest.importorskip("transformers", reason="needs transformers")
    config = tf.BartConfig(
        vocab_size=V + 20,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=16,
    )
    return tf.BartForConditionalGeneration(config)


def _whisper() -> nn.Module:
    tf = pytest.importorskip("transformers", reason="needs transformers")
    config = tf.WhisperConfig(
        vocab_size=V + 20,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=8,
        max_source_positions=8,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return tf.WhisperForConditionalGeneration(config)


HF_MODELS: dict[str, Callable[[], nn.Module]] = {"opt": _opt, "bart": _bart, "whisper": _whisper}


def _hf_loss(kind: str, model: nn.Module, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V + 20, (2, 7), generator=gen)
    if kind == "opt":
        return model(input_ids=ids, labels=ids).loss
    if kind == "bart":
        return model(input_ids=ids, decoder_input_ids=ids, labels=ids).loss
    features = torch.randn(2, 8, 16, generator=gen)
    return model(input_features=features, decoder_input_ids=ids, labels=ids).loss


def _position_tables(model: nn.Module) -> list[str]:
    """The trainable learned position tables, found by their class's name (independently of hylo)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and type(module).__name__.endswith("PositionalEmbedding")
        and module.weight.requires_grad
    ]


def _expected_layers(model: nn.Module) -> list[str]:
    """Every trainable nn.Linear, nn.Conv1d (Whisper's encoder) and nn.Embedding of exactly these classes whose
    weight no other module holds (the LM head is tied to the word embeddings)."""
    users: dict[int, int] = {}
    for module in model.modules():
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            users[id(p)] = users.get(id(p), 0) + 1
    return [
        name
        for name, module in model.named_modules()
        if type(module) in (nn.Linear, nn.Conv1d, nn.Embedding)
        and module.weight.requires_grad
        and users[id(module.weight)] == 1
    ]


@pytest.mark.parametrize("solver", ["kfac", "sngd"])
@pytest.mark.parametrize("kind", sorted(HF_MODELS))
def test_hugging_face_position_tables_are_left_alone_and_the_step_works(kind: str, solver: str) -> None:
    """OPT (wrong rows, silently) and BART/Whisper (crashes in step()): each learned position table is left
    alone with its reason, every untied Linear is preconditioned, and step() works."""
    torch.manual_seed(0)
    model = HF_MODELS[kind]()
    tables = _position_tables(model)
    assert tables  # OPT: 1, BART: 2 (encoder and decoder), Whisper: 1 (the decoder's; the encoder's is frozen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = HyLoPreconditioner(model, solver=solver, update_freq=1, damping=DAMPING)
    _hf_loss(kind, model).backward()
    raw = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    pre.step()  # BART and Whisper: an error from inside torch, naming no layer, before the rule
    (warned,) = [str(w.message) for w in caught]
    for name in tables:
        assert "PositionalEmbedding subclasses Embedding with a forward of its own" in _reason(pre, name)
        assert name in warned
    assert _names(pre) == _expected_layers(model)
    params = dict(model.named_parameters())
    for name in tables:
        assert torch.equal(params[f"{name}.weight"].grad, raw[f"{name}.weight"])
    changed = [name for name in _names(pre) if not torch.equal(params[f"{name}.weight"].grad, raw[f"{name}.weight"])]
    assert changed == _names(pre)
    assert all(torch.isfinite(p.grad).all() for p in params.values() if p.grad is not None)


def test_opt_position_rows_are_the_positions_not_the_mask() -> None:
    """Why OPT's table is not a lookup of its first argument: the rows that receive gradient are the positions
    2…T (OPT's offset 2; the last of the T + 1 positions predicts no label), while its first argument, the
    attention mask, holds only 1s: as a lookup of it, row 1 would carry all the curvature."""
    model = _opt()
    table = model.model.decoder.embed_positions
    seen: list[Tensor] = []
    table.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    _hf_loss("opt", model).backward()
    (mask,) = seen
    assert set(mask.unique().tolist()) == {1}
    touched = table.weight.grad.abs().sum(1).nonzero().flatten().tolist()
    assert touched == list(range(2, 1 + mask.shape[1]))


def test_a_hugging_face_position_table_registered_by_hand_raises_naming_it() -> None:
    model = _whisper()
    table = model.model.decoder.embed_positions
    hylo.register_layer_type(type(table), _embedding_math)
    pre = _quiet(model, solver="kfac", update_freq=1, damping=DAMPING)
    assert "model.decoder.embed_positions" in _names(pre)
    with pytest.raises(ValueError, match=r"layer 'model\.decoder\.embed_positions'.*not a lookup"):
        _hf_loss("whisper", model).backward()
        pre.step()


def test_hugging_face_conv1d_subclasses_follow_the_rule() -> None:
    conv1d = pytest.importorskip("transformers.pytorch_utils", reason="needs transformers").Conv1D
    own = type("MyConv1D", (conv1d,), {"forward": lambda self, x: 2 * conv1d.forward(self, x)})
    plain = type("PlainConv1D", (conv1d,), {})
    model = nn.Sequential(conv1d(4, 3), nn.Tanh(), own(4, 4), nn.Tanh(), plain(2, 4))
    pre = _quiet(model)
    assert _names(pre) == ["0", "4"]
    assert "MyConv1D subclasses Conv1D with a forward of its own" in _reason(pre, "2")


# ------------------------------------------------------------------------------------------ attention
class ScaledAttention(nn.MultiheadAttention):
    """A forward of its own that hands F.multi_head_attention_forward a weight that is not its parameter."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> tuple[Tensor, None]:  # type: ignore[override]
        out, _ = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, 2 * self.in_proj_weight, self.in_proj_bias,
            None, None, False, 0.0, self.out_proj.weight, self.out_proj.bias, training=self.training,
            need_weights=False,
        )  # fmt: skip
        return out, None


class HalvedInputAttention(nn.MultiheadAttention):
    """A forward of its own that calls the stock one on other inputs: the projections' rows are those inputs."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor | None]:  # type: ignore[override]
        return super().forward(query / 2, key / 2, value / 2, need_weights=False)


class AttentionNet(nn.Module):
    def __init__(self, attention: type[nn.MultiheadAttention]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = attention(8, 2, dtype=DT)
        self.head = nn.Linear(8, C, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attn(x, x, x)[0])


def test_an_attention_subclass_is_captured_only_from_its_own_parameters() -> None:
    """The tap checks the call: projections applied with the module's own parameters are captured (the stock
    forward on halved inputs); a call with another weight captures nothing, with a warning, and the projections
    keep their gradients as autograd gave them."""
    x = torch.randn(5, 4, 8, dtype=DT)
    labels = torch.randint(0, C, (5 * 4,))
    for attention, captured in ((HalvedInputAttention, True), (ScaledAttention, False)):
        net = AttentionNet(attention)
        pre = HyLoPreconditioner(net, solver="sngd", update_freq=1, damping=DAMPING)
        assert _names(pre) == ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "head"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.cross_entropy(net(x).reshape(-1, C), labels).backward()
            raw = net.attn.in_proj_weight.grad.clone()
            pre.step()
        messages = [str(w.message) for w in caught]
        foreign = [m for m in messages if "in_proj_weight that is not its own parameter" in m]
        assert len(foreign) == (0 if captured else 1), messages
        assert torch.equal(net.attn.in_proj_weight.grad, raw) != captured
