"""The layer-type registry: which module classes hylo knows and the math each one maps to.

A layer type maps a module class to its :class:`~hylo.layers.math.LayerMath` (docs/extending.md,
"Layer types"). The built-in types are ``nn.Linear``, the convolutions ``nn.Conv2d``,
``nn.Conv1d``, ``nn.ConvTranspose2d`` and ``nn.ConvTranspose1d`` (groups = 1; a grouped one is
left alone with its reason), ``nn.Embedding``, and ``nn.MultiheadAttention``, whose four
projections are registered as Linear layers through an attention tap
(:mod:`hylo.layers.attention`). :func:`register_layer_type` adds a type from user code
(docs/extending.md); a module's type is looked up along its class's method resolution order, so
a subclass of a registered class is supported unless registered itself, as long as it keeps that
class's ``forward``: a subclass with a ``forward`` of its own (Hugging Face's learned position
tables, which look up positions computed from their argument) is not assumed to compute the
registered class's operation on its first argument, and stays with the optimizer with its reason
until it is registered itself (docs/extending.md, "Subclasses"). Layer types of other
packages (Hugging Face's ``Conv1D``, Mixtral's and Qwen2-MoE's fused experts and routers) are registered through
:func:`register_layer_type` once their module has been imported, never importing it (docs/extending.md, "Layers of
other packages"; docs/moe.md).
The walk over a model that applies the registry is :mod:`hylo.layers.walk`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from torch import nn

from hylo.layers.conv import ConvMath
from hylo.layers.conv_transpose import ConvTransposeMath
from hylo.layers.embedding import EmbeddingMath
from hylo.layers.experts import experts_refused, fused_experts, router
from hylo.layers.fused import FusedLayers
from hylo.layers.linear import LinearMath, TransposedLinearMath
from hylo.layers.math import LayerMath
from hylo.layers.transformers_types import CONV1D, LINEARS, LOGITS_AT, MIXTURES, modeling_module

if TYPE_CHECKING:
    from hylo.config import HyLoConfig

#: Builds a layer type's math for one module (a :class:`~hylo.layers.fused.FusedLayers` for a module holding several
#: layers), or returns None when this module cannot be preconditioned.
MathFactory = Callable[[nn.Module, "HyLoConfig"], LayerMath | FusedLayers | None]
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
    module_class: type[nn.Module],
    math: MathFactory | type[nn.Module],
    *,
    unsupported: UnsupportedReason | None = None,
) -> LayerTypeHandle:
    """Precondition modules of ``module_class`` (and of its subclasses) with ``math(module, config)``.

    ``math`` returns a :class:`~hylo.layers.math.LayerMath` for the module, or None when this
    instance cannot be preconditioned; ``unsupported(module)`` then says why (in ``summary()`` and
    the constructor's warning). ``math`` may instead be a registered class that ``module_class``
    subclasses (``register_layer_type(MyEmbedding, nn.Embedding)``): its math and reason, as
    registered now, for a subclass whose own ``forward`` computes that class's operation on its
    first argument (docs/extending.md, "Subclasses"). A subclass of ``module_class`` with a
    ``forward`` of its own is not covered: it must be registered itself. Registering a class again
    replaces its entry; the returned handle's ``remove()`` undoes the registration. Preconditioners
    made before keep their layers.
    """
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise ValueError(f"register_layer_type needs an nn.Module subclass, got {module_class!r}")
    if unsupported is not None and not callable(unsupported):
        raise ValueError(f"register_layer_type: unsupported must be callable (module) -> str, got {unsupported!r}")
    if issubclass(module_class, nn.MultiheadAttention):
        raise ValueError("nn.MultiheadAttention is registered through its projections; it cannot be replaced")
    factory: MathFactory
    if isinstance(math, type) and issubclass(math, nn.Module):  # a class of math's own is a factory
        base = _registered_base(module_class, math)
        factory, unsupported = base.math, unsupported or base.unsupported
    elif callable(math):
        factory = cast(MathFactory, math)
    else:
        raise ValueError(f"register_layer_type: math must be callable (module, config) -> LayerMath, got {math!r}")
    previous = _LAYER_TYPES.get(module_class)
    _LAYER_TYPES[module_class] = LayerType(module_class, factory, unsupported)
    return LayerTypeHandle(module_class, previous)


def _registered_base(module_class: type[nn.Module], base: type[nn.Module]) -> LayerType:
    """The registered type of ``base``, a class that ``module_class`` subclasses, for ``register_layer_type(module_class,
    base)``; ``ValueError`` when ``base`` is not such a class or is not registered."""
    if not issubclass(module_class, base):
        raise ValueError(
            f"register_layer_type({module_class.__name__}, {base.__name__}): a class given as the math must be a "
            f"registered class that {module_class.__name__} subclasses; pass a factory (module, config) -> LayerMath "
            "otherwise"
        )
    _register_other_packages()
    found = _class_type(base)
    if found is None or not _keeps_forward(base, found):
        raise ValueError(
            f"register_layer_type({module_class.__name__}, {base.__name__}): {base.__name__} is not a registered "
            f"layer type ({', '.join(supported_types())}){'' if found is None else ', nor a subclass of one that keeps its forward'}"
        )
    return found


#: Layer types of other packages: (module, class name, math, why a refused instance is left alone). Each is
#: registered through :func:`register_layer_type` when a model is walked after its module was imported (a model
#: holding one has imported it) and the class is not registered yet, so a user's registration of the class, made
#: before or after, wins (docs/extending.md, "Layers of other packages"). The classes are
#: :mod:`hylo.layers.transformers_types`'s; the fused experts and their routers are docs/moe.md's.
OTHER_PACKAGES: tuple[tuple[str, str, MathFactory, UnsupportedReason | None], ...] = (
    (*CONV1D, lambda module, config: TransposedLinearMath(module), None),
    *((module, name, lambda module, config: LinearMath(module), None) for module, name in LINEARS),
    *(
        (modeling_module(package), name, fused_experts, experts_refused)
        for package, experts, _ in MIXTURES
        for name in experts
    ),
    *(
        (modeling_module(package), name, router(LOGITS_AT.get(name, 0)), None)
        for package, _, routers in MIXTURES
        for name in routers
    ),
)


#: The (module, class name) pairs of :data:`OTHER_PACKAGES`.
_OTHER_CLASSES = frozenset((module, name) for module, name, *_ in OTHER_PACKAGES)


def _register_other_packages() -> None:
    """Register the :data:`OTHER_PACKAGES` types whose module is imported and whose class is not registered."""
    for module_name, class_name, math, unsupported in OTHER_PACKAGES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in _LAYER_TYPES:
            register_layer_type(cls, math, unsupported=unsupported)


def _class_type(cls: type) -> LayerType | None:
    """The registered type of ``cls``: the first class of its method resolution order that is registered."""
    for base in cls.__mro__:
        found = _LAYER_TYPES.get(base)
        if found is not None:
            return found
    return None


def layer_type_of(module: nn.Module) -> LayerType | None:
    """The registered type of ``module``: the first class of its method resolution order that is registered.

    That type's math applies to the module only if :func:`own_forward` finds no ``forward`` of its own.
    """
    _register_other_packages()
    return _class_type(type(module))


def _keeps_forward(cls: type, layer_type: LayerType) -> bool:
    """Whether ``cls`` is ``layer_type``'s class or a subclass of it that keeps its ``forward``."""
    base = layer_type.module_class
    return cls is base or getattr(cls, "forward", None) is getattr(base, "forward", None)


def own_forward(module: nn.Module, layer_type: LayerType) -> str | None:
    """Why ``module`` is not taken for ``layer_type``'s operation, or None when it is.

    A module is its registered class's operation when its class is that class, or a subclass that
    keeps its ``forward`` (one that only adds attributes or methods, or a wrapper class such as
    ``fully_shard``'s, which adds none). A subclass with a ``forward`` of its own may compute anything
    from anything (Hugging Face's learned position tables look up positions computed from a mask,
    or ignore their argument's values), so the rows hylo would take from its first argument and its
    output are not known to be its gradient's: it stays with the optimizer until registered itself
    (docs/extending.md, "Subclasses").
    """
    kind, base = type(module), layer_type.module_class
    if _keeps_forward(kind, layer_type):
        return None
    return (
        f"{kind.__name__} subclasses {base.__name__} with a forward of its own, which hylo does not take for "
        f"{base.__name__}'s operation on its first argument: it stays with the optimizer; if its forward is "
        f"that operation, register it: hylo.register_layer_type({kind.__name__}, {base.__name__})"
    )


def layer_math(module: nn.Module, config: HyLoConfig) -> LayerMath | FusedLayers | None:
    """The math of ``module`` by its registered type (its layers, for a module holding several), or None when its
    type is not registered, refuses it, or the module's class is a subclass with a ``forward`` of its own
    (:func:`own_forward`)."""
    layer_type = layer_type_of(module)
    if layer_type is None or own_forward(module, layer_type) is not None:
        return None
    math = layer_type.math(module, config)
    if math is not None and not isinstance(math, (LayerMath, FusedLayers)):
        raise ValueError(
            f"the math registered for {type(module).__name__} returned {type(math).__name__}, "
            "not a hylo.layers.LayerMath or FusedLayers"
        )
    return math


def supported_types() -> list[str]:
    """The registered module classes by name, ``MultiheadAttention``, and how many classes of other packages are
    registered (:data:`OTHER_PACKAGES`, counted rather than named: for messages)."""
    _register_other_packages()
    named = [cls.__name__ for cls in _LAYER_TYPES if (cls.__module__, cls.__name__) not in _OTHER_CLASSES]
    counted = len(_LAYER_TYPES) - len(named)
    return [*named, "MultiheadAttention"] + ([f"{counted} classes of other packages"] if counted else [])


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
    if layer_type is not None:
        own = own_forward(module, layer_type)
        if own is not None:
            return own
        if layer_type.unsupported is not None:
            return layer_type.unsupported(module)
    kind = type(module).__name__
    if isinstance(module, nn.EmbeddingBag):
        return (
            f"{kind} pools the tokens of each bag ({module.mode}), which hylo does not model: it stays with the "
            "optimizer; nn.Embedding is supported"
        )
    return f"{kind} is not a supported layer type ({', '.join(supported_types())}; see hylo.register_layer_type)"
