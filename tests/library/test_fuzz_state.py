"""Corrupted-state fuzz of ``HyLoPreconditioner.load_state_dict`` with hypothesis (docs/reliability.md, "Validation").

Each example takes a real ``state_dict`` — K-FAC, SNGD, KID, KIS or the hybrid policy (with its
gradient-norm trend and history), on Linear or Conv2d layers, full or remote entries — applies 1 to
3 random mutations anywhere in it (delete or add a key or list item; replace a value by another
type, number, string, bool or nested entry; change a tensor's shape, dtype or values to NaN, ±Inf,
negative, zero or huge; swap two layers' entries or two values), and seals it again
(:func:`hylo.integrity.seal`), so that what is tested is the validation, not the checksum.

Property: either ``load_state_dict`` raises ``ValueError`` and the preconditioner is unchanged (its
whole ``state_dict`` bit-equal, the same objects held), or it loads, and the next steps raise nothing
but the documented ``ValueError`` and turn finite gradients into finite ones.

``test_corrupted_state`` runs a bounded, derandomized set of examples; ``test_corrupted_state_many``
(``-m slow``) runs many more.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.integrity import seal
from tests.kit.checks import assert_same_tensors
from tests.kit.models import classifier_convnet, classifier_inputs, classifier_mlp

pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass(frozen=True)
class Source:
    """A run whose ``state_dict`` is mutated: its model, its options and how many steps it ran."""

    kind: str  # "linear" (classifier_mlp) or "conv" (classifier_convnet)
    options: tuple[tuple[str, Any], ...]
    steps: int
    remote: bool = False  # rewrite one full K-FAC entry as the remote entry a rank of 4 would have saved


SOURCES = (
    Source("linear", (("solver", "kfac"),), 3),
    Source("conv", (("solver", "kfac"), ("factor_update_freq", 1)), 3, remote=True),
    Source("linear", (("solver", "sngd"),), 3),
    Source("conv", (("solver", "sngd"), ("conv_rows", "exact")), 3),
    Source("conv", (("solver", "kid"), ("rank_ratio", 0.5)), 3),
    Source("linear", (("solver", "kis"), ("rank_ratio", 0.5), ("kl_clip", 0.01), ("lr", 0.1)), 3),
    Source("linear", (("solver", "hybrid"), ("trend_window", 2)), 7),
    Source("conv", (("solver", "hybrid"), ("trend_window", 2), ("critical_variant", "sngd")), 5),
)
BASE: dict[str, Any] = {"update_freq": 2, "damping": 0.1, "seed": 3}
BATCH = 6


def _model(kind: str) -> nn.Module:
    return classifier_mlp(seed=0) if kind == "linear" else classifier_convnet(seed=0)


def _train(model: nn.Module, pre: HyLoPreconditioner, kind: str, steps: range) -> None:
    for step in steps:
        x, y = classifier_inputs(kind, BATCH, seed=700 + step)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()


def _preconditioner(source: Source) -> tuple[nn.Module, HyLoPreconditioner]:
    model = _model(source.kind)
    return model, HyLoPreconditioner(model, **BASE, **dict(source.options))


_SAVED: dict[Source, dict[str, Any]] = {}


def _saved(source: Source) -> dict[str, Any]:
    """The source's ``state_dict`` (computed once; callers mutate a deep copy)."""
    if source not in _SAVED:
        model, pre = _preconditioner(source)
        _train(model, pre, source.kind, range(source.steps))
        state = pre.state_dict()
        if source.remote:
            entry = next(e for e in state["layers"].values() if "tensors" in e)
            tensors = entry.pop("tensors")
            del entry["damping"]
            entry.update(owner=3, remote=True, carried={k: tensors[k] for k in ("factor_a", "factor_g")})
            state.update(rank=0, world_size=4)
        _SAVED[source] = state
    return _SAVED[source]


# --------------------------------------------------------------------------- mutations
def _values(rng: random.Random) -> Any:
    """A replacement value of any kind a state holds (or should not)."""
    pool: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.choice([0, 1, -1, 2, 7, 2**40, -(2**40)]),
        lambda: rng.choice([0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, 1e300, -1e300, math.nan, math.inf, -math.inf]),
        lambda: rng.choice(["", "x", "kfac", "sngd", "kid", "kis", "hybrid", "fc1", "restore", "0"]),
        lambda: rng.choice([[], [1.0], [None], [True, False], (), (0, [1.0], [0.0])]),
        lambda: rng.choice([{}, {"a": 1}, {"tensors": {}}, {"ema": None}]),
        lambda: rng.choice(
            [
                torch.zeros(0),
                torch.tensor(1.0),
                torch.ones(3, dtype=torch.float64),
                torch.eye(5),
                torch.full((6, 6), math.nan, dtype=torch.float64),
                torch.zeros(4, dtype=torch.uint8),
                torch.ones(2, 2, dtype=torch.int64),
            ]
        ),
    ]
    return rng.choice(pool)()


def _tensor_variant(rng: random.Random, t: Tensor) -> Tensor:
    """``t`` with another shape, dtype or values (a sparse tensor an earlier mutation made is mutated dense)."""
    if t.layout != torch.strided:
        t = t.to_dense()
    ops: list[Callable[[], Tensor]] = [
        lambda: t.to(
            rng.choice([torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.bool])
        ),
        lambda: t.to(torch.complex128) if t.is_floating_point() else t.flip(0) if t.dim() else t,
        lambda: t.reshape(-1),
        lambda: t[:-1] if t.dim() and t.shape[0] else t.reshape(1, -1),
        lambda: torch.cat([t, t[:1]]) if t.dim() else t.reshape(1),
        lambda: t.unsqueeze(0),
        lambda: t.mT.contiguous() if t.dim() == 2 else t,
        lambda: (
            # through float64, so that 1e300 becomes ±inf in a narrower dtype instead of raising
            torch.full(
                t.shape,
                rng.choice([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, -1e300, 1e-310]),
                dtype=torch.float64,
            ).to(t.dtype)
            if t.is_floating_point()
            else t + 1
        ),
        lambda: -t if t.dtype != torch.bool else ~t,
        lambda: t * rng.choice([1e30, 1e-30, 1e150, -2.0]) if t.is_floating_point() else t,
        lambda: _poke(rng, t),
        lambda: t.to_sparse() if t.dim() and t.numel() else t,
    ]
    return rng.choice(ops)()


def _poke(rng: random.Random, t: Tensor) -> Tensor:
    """``t`` with one element changed."""
    if not t.numel() or not t.is_floating_point():
        return t
    out = t.clone().reshape(-1)
    value = rng.choice([math.nan, math.inf, -1.0, 0.0, -1e300, 1e300, -1e-3])
    out[rng.randrange(out.numel())] = torch.tensor(value, dtype=torch.float64)  # ±inf in a narrower dtype
    return out.reshape(t.shape)


def _containers(state: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every mapping and list in ``state`` (``state`` itself included)."""
    found = [path]
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        if isinstance(value, dict | list):
            found.extend(_containers(value, (*path, key)))
        elif isinstance(value, tuple):  # trend history entries: mutate them as lists
            state[key] = list(value)
            found.extend(_containers(state[key], (*path, key)))
    return found


def _tensors(state: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every tensor in ``state``."""
    if isinstance(state, Tensor):
        return [path]
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    return [found for key, value in items for found in _tensors(value, (*path, key))]


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


def _mutate(rng: random.Random, state: dict[str, Any]) -> str:
    """Apply one random mutation to ``state`` in place; its name (for hypothesis' statistics)."""
    tensors = _tensors(state)
    if tensors and rng.random() < 0.3:
        *where, key = rng.choice(tensors)
        holder = _at(state, tuple(where))
        if isinstance(holder, tuple):  # inside a trend history entry: not a tensor there
            return "none"
        holder[key] = _tensor_variant(rng, holder[key])
        return "tensor"
    container = _at(state, rng.choice(_containers(state)))
    keys = list(container) if isinstance(container, dict) else list(range(len(container)))
    op = rng.choice(["delete", "add", "replace", "replace", "tensor", "tensor", "swap"])
    if op == "add" or not keys:
        if isinstance(container, dict):
            container[rng.choice(["extra", "format", "tensors", "carried", "divisor", "remote", "ema_sq", 3])] = (
                _values(rng)
            )
        else:
            container.insert(rng.randrange(len(container) + 1), _values(rng))
        return "add"
    key = rng.choice(keys)
    if op == "delete":
        del container[key]
        return "delete"
    if op == "swap":
        other = rng.choice(keys)
        if state.get("layers") is not None and isinstance(state["layers"], dict) and len(state["layers"]) > 1:
            if rng.random() < 0.5:
                layers = state["layers"]
                a, b = rng.sample(list(layers), 2)
                layers[a], layers[b] = layers[b], layers[a]
                return "swap-layers"
        container[key], container[other] = container[other], container[key]
        return "swap"
    value = container[key]
    if op == "tensor" and isinstance(value, Tensor):
        container[key] = _tensor_variant(rng, value)
        return "tensor"
    if isinstance(value, bool):
        container[key] = not value if rng.random() < 0.5 else _values(rng)
    elif isinstance(value, int | float) and rng.random() < 0.7:
        container[key] = rng.choice([value + 1, value - 1, -value, 0, value * 1e300, float(value), math.nan])
    else:
        container[key] = _values(rng)
    return "replace"


# --------------------------------------------------------------------------- the property
def _finite_grads(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def check_corrupted_state(source: Source, rng: random.Random, mutations: int) -> None:
    state = copy.deepcopy(_saved(source))
    for _ in range(mutations):
        event(_mutate(rng, state))
    state = seal(state)

    model, pre = _preconditioner(source)
    _train(model, pre, source.kind, range(1))
    before = copy.deepcopy(pre.state_dict())
    held = ([info.state for info in pre.layer_info()], pre.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pre.load_state_dict(state)
        except ValueError:
            event("refused")
            assert_same_tensors(pre.state_dict(), before)  # the generator and the trend among the rest
            now = ([info.state for info in pre.layer_info()], pre.config)
            assert all(a == b for a, b in zip(held[0], now[0], strict=True)) and held[1] == now[1]
            return
        event("loaded")
        for step in range(3):
            x, y = classifier_inputs(source.kind, BATCH, seed=900 + step)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert _finite_grads(model)
            try:
                pre.step()
            except ValueError:
                event("step refused")
                continue
            assert _finite_grads(model), f"step {step} made finite gradients non-finite"


_CASE = {
    "source": st.sampled_from(SOURCES),
    "rng": st.randoms(use_true_random=False),
    "mutations": st.integers(1, 3),
}


@settings(max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(**_CASE)
def test_corrupted_state(source: Source, rng: random.Random, mutations: int) -> None:
    check_corrupted_state(source, rng, mutations)


@pytest.mark.slow
@settings(max_examples=10_000, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(**_CASE)
def test_corrupted_state_many(source: Source, rng: random.Random, mutations: int) -> None:
    check_corrupted_state(source, rng, mutations)
