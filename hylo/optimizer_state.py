"""A ``torch.optim`` state dict checked against the optimizer that is to load it, before anything changes.

docs/usage.md, "The optimizer form". ``torch.optim.Optimizer.load_state_dict`` takes what it is given: a group
without its ``lr`` fails at the next step, a NaN ``lr`` or moment gives NaN parameters steps later, a moment of
another shape fails at the next step, a missing state silently restarts a parameter's moments.
:class:`hylo.HyLoOptimizer` checks the wrapped optimizers' parts with :func:`check_numbering` and
:func:`check_part` first, and refuses with a ``ValueError`` naming the group, the parameter and the problem:

- **numbering**: the groups' ``params`` number the parameters 0, 1, … in order (as ``state_dict()`` writes them),
  and the state holds only those numbers;
- **group keys**: every key the optimizer's step reads (its ``defaults``, less those its ``__setstate__`` fills
  in for older checkpoints) is there; other keys (a scheduler's ``initial_lr``) are carried as saved;
- **hyperparameters**: a number (or a one-element tensor) where this optimizer's group has one, finite; a tuple of
  as many finite numbers where it has a tuple (``betas``); a bool where it has a bool; anything else as saved;
- **state layout**: each state holds the keys the optimizer creates for a parameter of that shape, dtype and
  device at a step (found by stepping a copy of the optimizer with the saved group's options on a small stand-in
  of the parameter's rank, :func:`layout`), each tensor of the shape that follows from the parameter's
  (``exp_avg``: the parameter's; ``step``: a scalar) and of the same kind (floating point, complex, integer;
  ``load_state_dict`` casts floating-point moments to the parameter's dtype); where that stepping fails (an
  optimizer that needs a closure or its own attributes) a tensor with the parameter's number of elements must
  have its shape (or be flat);
- **values**: every floating-point tensor and number finite; a ``step`` count whole, between 0 and the number of
  steps taken (hylo's step count);
- **presence**: a parameter has a state wherever the optimizer keeps one for a stepped parameter and the
  parameter was certainly stepped — its layer holds a saved hylo state, so it had gradients at an update, which
  the optimizer stepped. Any other parameter may lack a state (one that never had a gradient, as an expert
  never routed, has none).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from hylo.records import LayerInfo

#: The stand-in's sizes, per dimension: distinct primes, so that each size of a state tensor names the parameter
#: dimension it follows.
PROBE_SIZES = (2, 3, 5, 7, 11, 13, 17, 19)


@dataclass(frozen=True)
class Slot:
    """What the optimizer stores under one key for a parameter: ``dims`` (per dimension of the tensor: the index of
    the parameter dimension it follows, or ``-1`` for the parameter's number of elements, or a size ``("n", size)``
    it has whatever the parameter) and ``dtype``; ``dims`` None: not a tensor."""

    dims: tuple[int | tuple[str, int], ...] | None
    dtype: torch.dtype | None

    def shape_for(self, shape: torch.Size) -> tuple[int, ...] | None:
        """The shape this slot's tensor has for a parameter of ``shape`` (None: not a tensor)."""
        if self.dims is None:
            return None
        sizes = []
        for dim in self.dims:
            if isinstance(dim, tuple):
                sizes.append(dim[1])
            else:
                sizes.append(math.prod(shape) if dim == -1 else shape[dim])
        return tuple(sizes)


def layout(optimizer: torch.optim.Optimizer, hyper: Mapping[str, Any], like: Tensor) -> dict[str, Slot] | None:
    """What ``optimizer`` (with the group options ``hyper``) stores for a parameter like ``like`` after a step:
    found by stepping a copy of it on a stand-in of ``like``'s rank, dtype and device whose sizes are
    :data:`PROBE_SIZES`; None where that fails (an optimizer that needs a closure, its own attributes, sparse
    gradients)."""
    if like.dim() > len(PROBE_SIZES):
        return None
    sizes = PROBE_SIZES[: like.dim()]
    standin = nn.Parameter(torch.zeros(sizes, dtype=like.dtype, device=like.device))
    standin.grad = torch.full_like(standin, 0.5)
    probe = type(optimizer).__new__(type(optimizer))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe.__setstate__(
                {
                    "defaults": dict(optimizer.defaults),
                    "state": defaultdict(dict),
                    "param_groups": [{**hyper, "params": [standin]}],
                }
            )
            probe.step()
    except Exception:  # an optimizer this way of stepping does not fit: the shape rule of the fallback
        return None
    made = probe.state.get(standin, {})
    return {key: _slot(value, sizes) for key, value in made.items()}


def _slot(value: object, sizes: tuple[int, ...]) -> Slot:
    if not isinstance(value, Tensor):
        return Slot(None, None)
    dims: list[int | tuple[str, int]] = []
    for size in value.shape:
        if size in sizes:
            dims.append(sizes.index(size))
        elif len(sizes) > 1 and size == math.prod(sizes):
            dims.append(-1)
        else:
            dims.append(("n", size))
    return Slot(tuple(dims), value.dtype)


def filled_keys(optimizer: torch.optim.Optimizer) -> set[str]:
    """The group keys ``optimizer``'s ``__setstate__`` fills in where a saved group lacks them (options added to
    torch after a checkpoint was written)."""
    probe = type(optimizer).__new__(type(optimizer))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe.__setstate__({"defaults": dict(optimizer.defaults), "state": {}, "param_groups": [{"params": []}]})
    except Exception:
        return set()
    return set(probe.param_groups[0]) - {"params"}


def check_groups(groups: object, state: object, where: str) -> None:
    """``ValueError`` unless ``groups`` is a list of groups, each with a list of ``params``, and ``state`` a mapping."""
    if not isinstance(groups, Sequence) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), Sequence) for g in groups
    ):
        raise ValueError(f"{where}: 'param_groups' must be a list of groups, each with its list of 'params'")
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: 'state' must be a mapping from parameter numbers, got {type(state).__name__}")


def check_numbering(groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any], where: str) -> None:
    """``ValueError`` unless ``groups`` (checked by :func:`check_groups`) number the parameters 0, 1, … in order
    (each once, as ``state_dict()`` writes them) and ``state`` holds only those numbers."""
    count = 0
    for g, group in enumerate(groups):
        numbers = group["params"]
        expected = list(range(count, count + len(numbers)))
        if list(numbers) != expected:
            raise ValueError(
                f"{where}: group {g} numbers its parameters {list(numbers)}, expected {expected} (each parameter once, "
                "in the order of the groups: a state saved from another grouping)"
            )
        count += len(numbers)
    for key in state:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < count:
            raise ValueError(
                f"{where}: a state for parameter {key!r}, which does not exist (parameters 0 to {count - 1})"
            )


def stepped_parameters(saved_hylo: object, layers: Sequence[LayerInfo]) -> set[int]:
    """``id`` of the parameters of ``layers`` (the live preconditioner's) whose layer holds a state in the saved
    hylo part ``saved_hylo``: each had gradients at an update, which the form's optimizers stepped right after. A
    malformed part gives none (hylo's own load refuses it)."""
    saved = saved_hylo.get("layers") if isinstance(saved_hylo, Mapping) else None
    if not isinstance(saved, Mapping):
        return set()
    found: set[int] = set()
    for info in layers:
        entry = saved.get(info.name)
        if isinstance(entry, Mapping) and ("tensors" in entry or entry.get("remote")):
            for tensor in (info.math.weight, info.math.bias):
                if tensor is not None:  # a view (MultiheadAttention's projections) counts as its base
                    found.add(id(tensor if isinstance(tensor, nn.Parameter) else tensor._base))
    return found


@dataclass(frozen=True)
class Part:
    """One optimizer's part of the saved state, as it will be loaded, and what it is checked against."""

    #: The optimizer that loads it.
    optimizer: torch.optim.Optimizer
    #: Its state dict, numbered from 0.
    saved: Mapping[str, Any]
    #: The parameters of each of its groups, once the part is loaded (the split's hand-backs made).
    params: Sequence[Sequence[nn.Parameter]]
    #: The index of its first group and first parameter in the whole state (for the messages).
    first_group: int
    first_index: int


def check_part(
    part: Part,
    *,
    names: Mapping[int, str],
    stepped: set[int],
    steps: int | None,
    where: str,
) -> None:
    """``ValueError`` naming the group, the parameter and the problem where ``part`` does not fit its optimizer
    (the module's list). ``names``: parameter names by ``id``; ``stepped``: ``id`` of the parameters certainly
    stepped (which must hold a state where the optimizer keeps one); ``steps``: the steps taken (a ``step`` count's
    bound), None if unknown."""
    optimizer, saved = part.optimizer, part.saved
    required = set(optimizer.defaults) - filled_keys(optimizer) - {"params"}
    index = part.first_index
    for g, (group, params) in enumerate(zip(saved["param_groups"], part.params, strict=True)):
        live = optimizer.param_groups[g]
        at = f"{where}: group {part.first_group + g}"
        missing = sorted(required - set(group))
        if missing:
            raise ValueError(f"{at} lacks {missing} (the keys {type(optimizer).__name__}'s step reads)")
        for key, value in group.items():
            if key != "params":
                _check_option(f"{at}, option {key!r}", value, live.get(key))
        hyper = {key: value for key, value in group.items() if key != "params"}
        layouts: dict[tuple[int, torch.dtype, torch.device], dict[str, Slot] | None] = {}
        for i, p in enumerate(params):
            number = index + i
            name = names.get(id(p), "?")
            here = f"{at}, parameter {number} ({name}, shape {tuple(p.shape)})"
            kind = (p.dim(), p.dtype, p.device)
            if kind not in layouts:
                layouts[kind] = layout(optimizer, hyper, p)
            expected = layouts[kind]
            entry = saved["state"].get(number - part.first_index)
            if not entry:
                if id(p) in stepped and expected:
                    raise ValueError(
                        f"{here}: no state, though its layer holds hylo's state (it was stepped; "
                        f"{type(optimizer).__name__} keeps {sorted(expected)} for a stepped parameter)"
                    )
                continue
            if not isinstance(entry, Mapping):
                raise ValueError(f"{here}: its state must be a mapping, got {type(entry).__name__}")
            _check_state(here, entry, p, expected, steps)
        index += len(params)


def _check_option(at: str, value: object, live: object) -> None:
    """One group option against this optimizer's value of it."""
    if isinstance(live, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{at} must be a bool (as this optimizer's {live}), got {value!r}")
    elif _real(live):
        if not _real(value):
            raise ValueError(f"{at} must be a number (as this optimizer's {float(live)}), got {value!r}")  # type: ignore[arg-type]
    elif isinstance(live, (tuple, list)) and all(_real(x) for x in live):
        if not isinstance(value, (tuple, list)) or len(value) != len(live) or not all(_real(x) for x in value):
            raise ValueError(f"{at} must be {len(live)} numbers (as this optimizer's {tuple(live)}), got {value!r}")
    if _real(value) and not math.isfinite(float(value)):  # type: ignore[arg-type]
        raise ValueError(f"{at} is {float(value)}, not finite")  # type: ignore[arg-type]
    if isinstance(value, (tuple, list)) and any(_real(x) and not math.isfinite(float(x)) for x in value):
        raise ValueError(f"{at} is {tuple(value)}, not finite")


def _real(value: object) -> bool:
    """A real number: an int or float (not a bool), or a one-element real tensor."""
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_state(
    here: str, entry: Mapping[str, Any], p: Tensor, expected: dict[str, Slot] | None, steps: int | None
) -> None:
    """One parameter's state: its keys, shapes, kinds and values."""
    if expected is not None:
        missing = sorted(set(expected) - set(entry))
        if missing:
            raise ValueError(f"{here}: its state lacks {missing} (it holds {sorted(entry)})")
    for key, value in entry.items():
        slot = (expected or {}).get(key)
        what = f"{here}: state {key!r}"
        if slot is not None and slot.dims is not None:
            shape = slot.shape_for(p.shape)
            scalar = shape == () and _real(value)  # a step count: a number or a one-element tensor of any kind
            if not scalar and (not isinstance(value, Tensor) or tuple(value.shape) != shape):
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"{what} has shape {got}, expected {shape}")
            if not scalar and isinstance(value, Tensor) and slot.dtype and _kind(value.dtype) != _kind(slot.dtype):
                raise ValueError(f"{what} is {value.dtype}, expected a {_kind(slot.dtype)} tensor ({slot.dtype})")
        elif expected is None and isinstance(value, Tensor) and value.numel() == p.numel() > 1:
            if value.shape != p.shape and value.dim() != 1:
                raise ValueError(f"{what} has shape {tuple(value.shape)}, expected the parameter's {tuple(p.shape)}")
        _check_finite(what, value)
        if key == "step" and _real(value):
            count = float(value)
            if count != int(count) or not 0 <= count <= (steps if steps is not None else math.inf):
                raise ValueError(f"{what} is {count}, expected a whole number of steps from 0 to {steps}")


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating-point"
    return str(dtype)


def _check_finite(what: str, value: object) -> None:
    """``ValueError`` where a floating-point tensor or number in ``value`` (or in a list of them) is not finite."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, Tensor) and (item.is_floating_point() or item.is_complex()):
            if not bool(torch.isfinite(item).all()):
                bad = int((~torch.isfinite(item)).sum())
                raise ValueError(f"{what} holds {bad} non-finite value(s) of {item.numel()}")
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{what} is {item}, not finite")
