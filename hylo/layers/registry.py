"""Which modules hylo preconditions: the layer-type registry and the walk over a model.

A layer type maps a module class to its :class:`~hylo.layers.math.LayerMath` (docs/extending.md,
"Layer types"). The built-in types are ``nn.Linear``, the convolutions ``nn.Conv2d``,
``nn.Conv1d``, ``nn.ConvTranspose2d`` and ``nn.ConvTranspose1d`` (groups = 1; a grouped one is
left alone with its reason), ``nn.Embedding``, and ``nn.MultiheadAttention``, whose four
projections are registered as Linear layers through an attention tap
(:mod:`hylo.layers.attention`). :func:`register_layer_type` adds a type from user code
(docs/extending.md); a module's type is looked up along its class's method resolution order, so
a subclass of a registered class is supported unless registered itself. Layer types of other
packages (Hugging Face's ``Conv1D``) are registered through :func:`register_layer_type` once their
module has been imported, never importing it (docs/extending.md, "Layers of other packages").
A layer whose weight or bias is tied (held by another module too) stays with the optimizer
(:mod:`hylo.layers.ties`).
"""

from __future__ import annotations

import re
import sys
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
from hylo.layers.conv import ConvMath
from hylo.layers.conv_transpose import ConvTransposeMath
from hylo.layers.embedding import EmbeddingMath
from hylo.layers.linear import LinearMath, TransposedLinearMath
from hylo.layers.math import LayerMath
from hylo.layers.ties import Holder, find_holders, own_attr, tied_reason

if TYPE_CHECKING:
    from hylo.config import HyLoConfig

#: Builds a layer type's math for one module, or returns None when this module cannot be preconditioned.
MathFactory = Callable[[nn.Module, "HyLoConfig"], LayerMath | None]
#: Why a module of a registered type that the factory refused stays with the optimizer.
UnsupportedReason = Callable[[nn.Module], str]


@dataclass(frozen=True)
class LayerType:
    """A registered module class: how to build its math, and why a refused instance is left alone."""

    module_class: type[nn.Module]
    math: MathFactory
    unsupported: UnsupportedReason | None = None


class LayerTypeHandle:
    """Returned by :func:`register_layer_type`: ``remove()`` restores what was registered before."""

    def __init__(self, module_class: type[nn.Module], previous: LayerType | None) -> None:
        self._module_class = module_class
        self._previous = previous
        self._removed = False

    def remove(self) -> None:
        """Unregister the type (or restore the entry it replaced); idempotent."""
        if self._removed:
            return
        self._removed = True
        if self._previous is None:
            _LAYER_TYPES.pop(self._module_class, None)
        else:
            _LAYER_TYPES[self._module_class] = self._previous


_LAYER_TYPES: dict[type[nn.Module], LayerType] = {}


def register_layer_type(
    module_class: type[nn.Module], math: MathFactory, *, unsupported: UnsupportedReason | None = None
) -> LayerTypeHandle:
    """Precondition modules of ``module_class`` (and of its subclasses) with ``math(module, config)``.

    ``math`` returns a :class:`~hylo.layers.math.LayerMath` for the module, or None when this
    instance cannot be preconditioned; ``unsupported(module)`` then says why (in ``summary()`` and
    the constructor's warning). Registering a class again replaces its entry; the returned
    handle's ``remove()`` undoes the registration. Preconditioners made before keep their layers.
    """
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise ValueError(f"register_layer_type needs an nn.Module subclass, got {module_class!r}")
    if not callable(math):
        raise ValueError(f"register_layer_type: math must be callable (module, config) -> LayerMath, got {math!r}")
    if unsupported is not None and not callable(unsupported):
        raise ValueError(f"register_layer_type: unsupported must be callable (module) -> str, got {unsupported!r}")
    if issubclass(module_class, nn.MultiheadAttention):
        raise ValueError("nn.MultiheadAttention is registered through its projections; it cannot be replaced")
    previous = _LAYER_TYPES.get(module_class)
    _LAYER_TYPES[module_class] = LayerType(module_class, math, unsupported)
    return LayerTypeHandle(module_class, previous)


#: Layer types of other packages: (module, class name, math). Each is registered through
#: :func:`register_layer_type` when a model is walked after its module was imported (a model holding
#: one has imported it) and the class is not registered yet, so a user's registration of the class,
#: made before or after, wins (docs/extending.md, "Layers of other packages").
OTHER_PACKAGES: tuple[tuple[str, str, MathFactory], ...] = (
    ("transformers.pytorch_utils", "Conv1D", lambda module, config: TransposedLinearMath(module)),
)


def _register_other_packages() -> None:
    """Register the :data:`OTHER_PACKAGES` types whose module is imported and whose class is not registered."""
    for module_name, class_name, math in OTHER_PACKAGES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in _LAYER_TYPES:
            register_layer_type(cls, math)


def layer_type_of(module: nn.Module) -> LayerType | None:
    """The registered type of ``module``: the first class of its method resolution order that is registered."""
    _register_other_packages()
    for cls in type(module).__mro__:
        found = _LAYER_TYPES.get(cls)
        if found is not None:
            return found
    return None


def layer_math(module: nn.Module, config: HyLoConfig) -> LayerMath | None:
    """The math of ``module`` by its registered type, or None when its type is not registered or refuses it."""
    layer_type = layer_type_of(module)
    math = None if layer_type is None else layer_type.math(module, config)
    if math is not None and not isinstance(math, LayerMath):
        raise ValueError(
            f"the math registered for {type(module).__name__} returned {type(math).__name__}, "
            "not a hylo.layers.LayerMath"
        )
    return math


def supported_types() -> list[str]:
    """The registered module classes by name, and ``MultiheadAttention`` (for messages)."""
    _register_other_packages()
    return [cls.__name__ for cls in _LAYER_TYPES] + ["MultiheadAttention"]


#: The convolutions of the built-in types: nn.Conv1d, nn.Conv2d and their transposes (groups = 1).
CONVOLUTIONS: tuple[type[nn.modules.conv._ConvNd], ...] = (nn.Conv1d, nn.Conv2d, nn.ConvTranspose1d, nn.ConvTranspose2d)


def _convolution(module: nn.Module, config: HyLoConfig) -> LayerMath | None:
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d)):
        kind: type[ConvMath] = ConvTransposeMath
    else:
        assert isinstance(module, (nn.Conv1d, nn.Conv2d))
        kind = ConvMath
    if module.groups != 1:
        return None
    return kind(module, config.conv.conv_rows, config.kfac.kfc_exponent, config.conv.max_unfold_mb)


def _convolution_refused(module: nn.Module) -> str:
    assert isinstance(module, CONVOLUTIONS)
    return f"grouped/depthwise {type(module).__name__} (groups={module.groups}) is not supported"


def _embedding(module: nn.Module, config: HyLoConfig) -> LayerMath | None:
    assert isinstance(module, nn.Embedding)
    return None if module.sparse or module.scale_grad_by_freq else EmbeddingMath(module)


def _embedding_refused(module: nn.Module) -> str:
    assert isinstance(module, nn.Embedding)
    kind = type(module).__name__
    if module.sparse:
        return (
            f"{kind}(sparse=True) produces sparse gradients and hylo preconditions dense ones: it stays with the "
            "optimizer; set sparse=False to precondition it"
        )
    return (
        f"{kind}(scale_grad_by_freq=True) divides each token's gradient by its count in the batch, so the "
        "per-token gradients are not the rows hylo's curvature is built from: it stays with the optimizer"
    )


register_layer_type(nn.Linear, lambda module, config: LinearMath(module))
for _convolution_class in CONVOLUTIONS:
    register_layer_type(_convolution_class, _convolution, unsupported=_convolution_refused)
register_layer_type(nn.Embedding, _embedding, unsupported=_embedding_refused)


def unsupported_reason(module: nn.Module) -> str:
    """Why a module with matrix parameters is left unregistered (for the summary and warning)."""
    layer_type = layer_type_of(module)
    if layer_type is not None and layer_type.unsupported is not None:
        return layer_type.unsupported(module)
    kind = type(module).__name__
    if isinstance(module, nn.EmbeddingBag):
        return (
            f"{kind} pools the tokens of each bag ({module.mode}), which hylo does not model: it stays with the "
            "optimizer; nn.Embedding is supported"
        )
    return f"{kind} is not a supported layer type ({', '.join(supported_types())}; see hylo.register_layer_type)"


@dataclass(frozen=True)
class FoundLayer:
    """A module hylo preconditions: its name, its math and its capture hooks."""

    name: str
    math: LayerMath
    capture: LayerCapture


@dataclass
class Registration:
    """Result of walking a model: registered layers and the modules left alone, with reasons.

    ``taps`` are the hooks of attention modules whose projections are registered layers.
    """

    layers: list[FoundLayer] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    taps: list[AttentionTap] = field(default_factory=list)

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
        if part == "out":
            parts = [("out_proj.weight", math.weight), ("out_proj.bias", math.bias)]
        else:
            packed = attention.in_proj_weight is not None
            parts = [("in_proj_weight" if packed else f"{part}_proj_weight", math.weight), ("in_proj_bias", math.bias)]
        tied = tied_reason(holders, attention, parts)
        if tied is not None:
            result.unsupported.append((layer_name, tied))
            continue
        if not math.weight.requires_grad:
            result.skipped.append((layer_name, "weight does not require grad"))
            continue
        capture = LayerCapture(None, layer_name)
        captures[part] = capture
        result.layers.append(FoundLayer(layer_name, math, capture))
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
                result.skipped.append((name, "skip_layers"))
                continue
            if parametrized is not None:
                result.unsupported.append((name, parametrized))
                continue
            math = layer_math(module, config)
            kept = None if math is not None else _stays_with_optimizer(module)
            if kept is not None:
                result.skipped.append((name, kept))
                continue
            if math is None:
                result.unsupported.append((name, unsupported_reason(module)))
                continue
            parts = [
                (own_attr(module, tensor, role), tensor)
                for role, tensor in (("weight", math.weight), ("bias", math.bias))
                if tensor is not None
            ]
            tied = tied_reason(holders, module, parts)
            if tied is not None:
                result.unsupported.append((name, tied))
                continue
            math.name = name
            if not math.weight.requires_grad:
                result.skipped.append((name, "weight does not require grad"))
                continue
            capture = LayerCapture(module, name)
            result.layers.append(FoundLayer(name, math, capture))
    except BaseException:
        result.remove()  # leave no hooks behind
        raise
    return result
