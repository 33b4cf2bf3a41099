"""Finding the layers of a model that hylo preconditions, and their per-layer state."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from hylo.attention import PROJECTIONS, AttentionTap, OutProjectionMath, ProjectionMath, projection_name
from hylo.capture import LayerCapture
from hylo.config import SolverName
from hylo.layers import (
    DEFAULT_KFC_EXPONENT,
    DEFAULT_MAX_UNFOLD_MB,
    ConvRows,
    LayerMath,
    supported_math,
    unsupported_reason,
)
from hylo.solvers import HeldState

#: ``owner`` of a layer whose carried statistics no rank has solved yet (recomputed at the next update).
UNSOLVED = -1


@dataclass
class RegisteredLayer:
    """One preconditioned layer: its math, its hooks, its solver and what it holds.

    ``solver`` is the configured solver until the first update, then the one the latest
    update used; ``owner`` is the rank that solved ``state`` (the one place it is kept).
    """

    name: str
    math: LayerMath
    capture: LayerCapture
    solver: SolverName
    state: HeldState | None = None
    owner: int = 0


@dataclass
class Registration:
    """Result of walking a model: registered layers and the modules left alone, with reasons.

    ``taps`` are the hooks of attention modules whose projections are registered layers.
    """

    layers: list[RegisteredLayer] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    taps: list[AttentionTap] = field(default_factory=list)

    def remove(self) -> None:
        """Detach every hook of the registered layers and attention modules."""
        for tap in self.taps:
            tap.remove()
        for layer in self.layers:
            layer.capture.remove()


def _matcher(patterns: tuple[str, ...]) -> Callable[[str, nn.Module], bool]:
    """Whether a module's name or its class name fully matches one of ``patterns``."""
    try:
        compiled = [re.compile(pattern) for pattern in patterns]
    except re.error as err:
        raise ValueError(f"skip_layers holds an invalid regular expression: {err}") from err

    def matches(name: str, module: nn.Module) -> bool:
        cls = type(module).__name__
        return any(rx.fullmatch(name) or rx.fullmatch(cls) for rx in compiled)

    return matches


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel/DataParallel, or ``model`` itself."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return inner
    return model


def _snake(name: str) -> str:
    """``_WeightNorm`` → ``weight_norm``: a parametrization's class name as the summary shows it."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.lstrip("_")).lower()


def _parametrizations(module: nn.Module) -> nn.ModuleDict:
    """The ``parametrizations`` container of a parametrized module."""
    container = module.parametrizations
    assert isinstance(container, nn.ModuleDict)
    return container


def _parametrized_reason(module: nn.Module) -> str | None:
    """Why ``module``'s weight or bias is not the leaf Parameter hylo writes to, or None if it is.

    Covers ``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``spectral_norm``,
    ``orthogonal``, ...), the old hooks ``torch.nn.utils.weight_norm``/``spectral_norm`` and any
    other weight or bias computed from other tensors.
    """
    for attr in ("weight", "bias"):
        kinds: list[str] = []
        if parametrize.is_parametrized(module, attr):
            kinds = [_snake(type(p).__name__) for p in _parametrizations(module)[attr].children()]
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm) and hook.name == attr:
                kinds.append("weight_norm")
            elif isinstance(hook, SpectralNorm) and hook.name == attr:
                kinds.append("spectral_norm")
        if kinds:
            return (
                f"{attr} is parametrized ({', '.join(kinds)}): its gradient belongs to the parametrization's parameters"
            )
        value = getattr(module, attr, None)
        if isinstance(value, Tensor) and not is_lazy(value) and not value.is_leaf:
            return f"{attr} is computed from other tensors (not a leaf Parameter): hylo cannot write its gradient"
    return None


def _register_attention(
    name: str,
    attention: nn.MultiheadAttention,
    skip: Callable[[str, nn.Module], bool],
    should_capture: Callable[[str], bool],
    initial_solver: Callable[[str], SolverName],
    result: Registration,
) -> None:
    """Register the q/k/v/out projections of one attention module as Linear layers (docs/design.md, "Attention")."""
    if skip(name, attention):
        result.skipped.append((name, "skip_layers"))
        return
    if parametrize.is_parametrized(attention) or parametrize.is_parametrized(attention.out_proj):
        result.unsupported.append((name, "MultiheadAttention with parametrized projections"))
        return
    captures: dict[str, LayerCapture] = {}
    for part in PROJECTIONS:
        layer_name = projection_name(name, part)
        math: LayerMath = OutProjectionMath(attention) if part == "out" else ProjectionMath(attention, part)
        math.name = layer_name
        if skip(layer_name, attention.out_proj if part == "out" else attention):
            result.skipped.append((layer_name, "skip_layers"))
            continue
        if not math.weight.requires_grad:
            result.skipped.append((layer_name, "weight does not require grad"))
            continue
        capture = LayerCapture(None, functools.partial(should_capture, layer_name), layer_name)
        captures[part] = capture
        result.layers.append(RegisteredLayer(layer_name, math, capture, initial_solver(layer_name)))
    for extra in ("bias_k", "bias_v"):
        if getattr(attention, extra, None) is not None:
            result.skipped.append((f"{name}.{extra}" if name else extra, "a bias vector: stays with the optimizer"))
    if captures:
        result.taps.append(AttentionTap(attention, captures, name or "<root>"))


_NORMALISATIONS: tuple[type[nn.Module], ...] = tuple(
    kind
    for kind in (
        nn.modules.batchnorm._NormBase,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),  # torch >= 2.4
        nn.LocalResponseNorm,
    )
    if kind is not None
)


def _shared_weights(model: nn.Module, inner: set[int]) -> dict[int, list[str]]:
    """Weight parameters that more than one module uses (tied weights), with the modules' names."""
    users: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if id(module) not in inner and isinstance(weight, nn.Parameter):
            users.setdefault(id(weight), []).append(name or "<root>")
    return {key: names for key, names in users.items() if len(names) > 1}


def _stays_with_optimizer(module: nn.Module) -> str | None:
    """Why a module's parameters are left to the optimizer by design (normalisation, vectors only), or None."""
    if isinstance(module, _NORMALISATIONS):
        return f"{type(module).__name__}: normalisation scales and biases stay with the optimizer"
    if all(p.dim() <= 1 for p in module.parameters(recurse=False)):
        return f"{type(module).__name__}: only vector parameters (scales, biases), which stay with the optimizer"
    return None


def _internal_modules(model: nn.Module) -> set[int]:
    """Ids of modules used only inside another: a MultiheadAttention's projections, parametrizations."""
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            inner.update(id(sub) for sub in module.modules() if sub is not module)
        if parametrize.is_parametrized(module):
            inner.update(id(sub) for sub in _parametrizations(module).modules())
    return inner


def _check_lazy(model: nn.Module, skip: Callable[[str, nn.Module], bool], inner: set[int]) -> None:
    """Raise ``ValueError`` naming the non-skipped layers whose parameters are still uninitialized."""
    lazy = [
        name or "<root>"
        for name, module in model.named_modules()
        if id(module) not in inner
        and any(is_lazy(p) for p in module.parameters(recurse=False))
        and not skip(name, module)
    ]
    if lazy:
        raise ValueError(
            f"layers {lazy} have uninitialized (lazy) parameters: run one forward pass of the model "
            "(a dry run on a batch) before creating the HyLoPreconditioner"
        )


def register_layers(
    model: nn.Module,
    skip_layers: tuple[str, ...],
    should_capture: Callable[[str], bool],
    initial_solver: Callable[[str], SolverName],
    conv_rows: ConvRows = "sum",
    kfc_exponent: float = DEFAULT_KFC_EXPONENT,
    max_unfold_mb: float = DEFAULT_MAX_UNFOLD_MB,
) -> Registration:
    """Hook every supported, trainable, non-skipped layer of ``model``; list the rest.

    ``should_capture(name)`` says whether layer ``name`` captures at the current step.
    """
    skip = _matcher(skip_layers)
    model = _unwrap(model)
    inner = _internal_modules(model)
    _check_lazy(model, skip, inner)
    shared = _shared_weights(model, inner)
    result = Registration()
    try:
        for name, module in model.named_modules():
            if id(module) in inner:
                continue
            if isinstance(module, nn.MultiheadAttention):
                _register_attention(name, module, skip, should_capture, initial_solver, result)
                continue
            parametrized = _parametrized_reason(module)
            if parametrized is None and next(module.parameters(recurse=False), None) is None:
                continue
            if skip(name, module):
                result.skipped.append((name, "skip_layers"))
                continue
            if parametrized is not None:
                result.unsupported.append((name, parametrized))
                continue
            tied = shared.get(id(getattr(module, "weight", None)))
            if tied is not None:
                others = ", ".join(other for other in tied if other != (name or "<root>"))
                result.unsupported.append(
                    (name, f"weight tied to {others}: its gradient sums every use, so it stays with the optimizer")
                )
                continue
            math = supported_math(module, conv_rows, kfc_exponent, max_unfold_mb)
            kept = None if math is not None else _stays_with_optimizer(module)
            if kept is not None:
                result.skipped.append((name, kept))
                continue
            if math is None:
                result.unsupported.append((name, unsupported_reason(module)))
                continue
            math.name = name
            if not math.weight.requires_grad:
                result.skipped.append((name, "weight does not require grad"))
                continue
            capture = LayerCapture(module, functools.partial(should_capture, name), name)
            result.layers.append(RegisteredLayer(name, math, capture, initial_solver(name)))
    except BaseException:
        result.remove()  # leave no hooks behind
        raise
    return result
