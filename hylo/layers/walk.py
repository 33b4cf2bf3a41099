"""The walk over a model: which modules hylo preconditions and why the others stay with the optimizer.

:func:`register_layers` looks each module up in the layer-type registry (:mod:`hylo.layers.registry`), registers
``nn.MultiheadAttention``'s projections through an attention tap (:mod:`hylo.layers.attention`), and lists every
module it leaves alone with its reason: ``skip_layers``, normalisations and vector-only modules, parametrized or
computed weights, tied parameters (:mod:`hylo.layers.ties`), subclasses with a ``forward`` of their own
(docs/extending.md, "Subclasses") and types hylo does not support (docs/reliability.md, "Registration").
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from hylo.layers.attention import PROJECTIONS, AttentionTap, OutProjectionMath, ProjectionMath, projection_name
from hylo.layers.capture import LayerCapture
from hylo.layers.compiled import unwrap_compiled
from hylo.layers.coverage import SKIPPED, Coverage, measure
from hylo.layers.fused import FusedLayers, Tap
from hylo.layers.math import LayerMath, named_error
from hylo.layers.registry import layer_math, layer_type_of, own_forward, supported_types, unsupported_reason
from hylo.layers.ties import Holder, find_holders, own_attr, tied_reason

if TYPE_CHECKING:
    from hylo.config import HyLoConfig


class NoLayerError(ValueError):
    """A model with no layer hylo can precondition: the ``ValueError`` a preconditioner raises at construction, and
    that ``HyLoOptimizer`` turns into a warning, leaving the model to the optimizer it wraps (docs/usage.md, "The
    optimizer form")."""

    def __init__(self) -> None:
        super().__init__(
            f"model has no layer hylo can precondition ({', '.join(supported_types())}; convolutions with groups=1): "
            "see the warning for what it leaves alone and why"
        )


@dataclass(frozen=True)
class FoundLayer:
    """A module hylo preconditions: its name, its math and its capture hooks."""

    name: str
    math: LayerMath
    capture: LayerCapture


@dataclass
class Registration:
    """Result of walking a model: registered layers and the modules left alone, with reasons.

    ``taps`` are the hooks of modules holding several registered layers (attention modules' projections, fused
    experts).
    """

    layers: list[FoundLayer] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    taps: list[Tap] = field(default_factory=list)
    #: The share of the model's trainable matrix parameters the registered layers hold (:mod:`hylo.layers.coverage`).
    coverage: Coverage = field(default_factory=lambda: Coverage(0, 0, ()))

    def warn_unsupported(self) -> None:
        """One warning listing the modules with matrix parameters hylo leaves alone, grouped by reason."""
        if not self.unsupported:
            return
        by_reason: dict[str, list[str]] = {}
        for name, why in self.unsupported:
            by_reason.setdefault(why, []).append(name or "<root>")
        listed = "; ".join(
            f"{why}: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
            for why, names in by_reason.items()
        )
        warnings.warn(
            f"hylo leaves {len(self.unsupported)} modules unpreconditioned ({listed}); see summary()", stacklevel=4
        )

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
    """The module inside DistributedDataParallel/DataParallel and ``torch.compile``'s wrapper, or ``model`` itself."""
    model = unwrap_compiled(model)
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return unwrap_compiled(inner)
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


def _tapped(name: str, math: LayerMath, tied: str | None, result: Registration) -> LayerCapture | None:
    """Register one layer a tap feeds (an attention projection, a fused expert's projection), or list it as left
    alone: tied (``tied``, the reason) or frozen. Its capture, or None."""
    if tied is not None:
        result.unsupported.append((name, tied))
        return None
    if not math.weight.requires_grad:
        result.skipped.append((name, "weight does not require grad"))
        return None
    capture = LayerCapture(name)
    result.layers.append(FoundLayer(name, math, capture))
    return capture


def _register_attention(
    name: str,
    attention: nn.MultiheadAttention,
    skip: Callable[[str, nn.Module], bool],
    holders: dict[int, list[Holder]],
    result: Registration,
) -> None:
    """Register the q/k/v/out projections of one attention module as Linear layers (docs/transformers.md, "Attention").

    A projection whose weight or bias is tied (``out_proj.weight``, ``in_proj_weight``, ``in_proj_bias`` or a
    ``q/k/v_proj_weight`` held elsewhere too) stays with the optimizer, with the reason.
    """
    if skip(name, attention):
        result.skipped.append((name, SKIPPED))
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
            result.skipped.append((layer_name, SKIPPED))
            continue
        if part == "out":
            parts = [("out_proj.weight", math.weight), ("out_proj.bias", math.bias)]
        else:
            packed = attention.in_proj_weight is not None
            parts = [("in_proj_weight" if packed else f"{part}_proj_weight", math.weight), ("in_proj_bias", math.bias)]
        capture = _tapped(layer_name, math, tied_reason(holders, attention, parts), result)
        if capture is not None:
            captures[part] = capture
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


def _parts(module: nn.Module, math: LayerMath) -> list[tuple[str, Tensor]]:
    """The layer's weight and bias, each with the attribute of ``module`` holding it (for :func:`tied_reason`)."""
    return [
        (own_attr(module, tensor, role), tensor)
        for role, tensor in (("weight", math.weight), ("bias", math.bias))
        if tensor is not None
    ]


def _register_fused(
    name: str,
    fused: FusedLayers,
    skip: Callable[[str, nn.Module], bool],
    holders: dict[int, list[Holder]],
    result: Registration,
) -> None:
    """Register the layers of a module holding several (fused experts; docs/extending.md, "Fused layers"), each
    named ``<module>.<its suffix>``, and hook the module once to feed them."""
    module = fused.module
    captures: dict[str, LayerCapture] = {}
    for suffix, math in fused.layers():
        layer_name = f"{name}.{suffix}" if name else suffix
        math.name = layer_name
        if skip(layer_name, module):
            result.skipped.append((layer_name, SKIPPED))
            continue
        capture = _tapped(layer_name, math, tied_reason(holders, module, _parts(module, math)), result)
        if capture is not None:
            captures[suffix] = capture
    if captures:
        result.taps.append(fused.tap(captures, name or "<root>"))


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


def _own_forward_tied(module: nn.Module, holders: dict[int, list[Holder]]) -> str | None:
    """For a subclass with a forward of its own (:func:`own_forward`) whose parameter is tied, the tie: registering
    it would not help (a tied word embedding of Hugging Face's that scales its output, e.g.). None otherwise."""
    layer_type = layer_type_of(module)
    if layer_type is None or own_forward(module, layer_type) is None:
        return None
    return tied_reason(holders, module, [(attr, p) for attr, p in module._parameters.items() if p is not None])


def register_layers(model: nn.Module, config: HyLoConfig) -> Registration:
    """Hook every supported, trainable, non-skipped layer of ``model``; list the rest.

    A layer captures at the steps its capture's ``active`` flag is set for (by the planner).
    """
    skip = _matcher(config.skip_layers)
    model = _unwrap(model)
    inner = _internal_modules(model)
    _check_lazy(model, skip, inner)
    holders = find_holders(model)
    result = Registration()
    try:
        for name, module in model.named_modules():
            if id(module) in inner:
                continue
            if isinstance(module, nn.MultiheadAttention):
                _register_attention(name, module, skip, holders, result)
                continue
            parametrized = _parametrized_reason(module)
            if parametrized is None and next(module.parameters(recurse=False), None) is None:
                continue
            if skip(name, module):
                result.skipped.append((name, SKIPPED))
                continue
            if parametrized is not None:
                result.unsupported.append((name, parametrized))
                continue
            try:
                math = layer_math(module, config)
            except Exception as err:  # a registered factory's error names the module
                named = named_error(err, name or "<root>", type(module).__name__)
                if named is None:
                    raise
                raise named from err
            kept = None if math is not None else _stays_with_optimizer(module)
            if kept is not None:
                result.skipped.append((name, kept))
                continue
            if math is None:
                result.unsupported.append((name, _own_forward_tied(module, holders) or unsupported_reason(module)))
                continue
            if isinstance(math, FusedLayers):
                _register_fused(name, math, skip, holders, result)
                continue
            tied = tied_reason(holders, module, _parts(module, math))
            if tied is not None:
                result.unsupported.append((name, tied))
                continue
            math.name = name
            if not math.weight.requires_grad:
                result.skipped.append((name, "weight does not require grad"))
                continue
            capture = LayerCapture(name, module, math.layer_output)
            result.layers.append(FoundLayer(name, math, capture))
    except BaseException:
        result.remove()  # leave no hooks behind
        raise
    skipped = [name for name, why in result.skipped if why == SKIPPED]
    result.coverage = measure(model, [found.math.weight for found in result.layers], skipped, holders)
    return result
