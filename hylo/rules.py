"""The machinery of an option: its rule, its documentation, and a section that checks its fields.

hylo's configuration (:mod:`hylo.config`) declares every option as a dataclass field made by
:func:`option`, carrying its documentation, its :class:`Rule`, and whether it may be a schedule
(a callable of the step) or is fixed once a preconditioner is built. :class:`Section` checks its
fields by those rules when it is made; :class:`OptionSpec` describes one option for a command line
or a docs table.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, cast, get_args, get_origin

#: A hyperparameter: a constant or a callable of the step (0-based count of ``step()`` calls).
Hyper = float | Callable[[int], float]
IntHyper = int | Callable[[int], int]


@dataclass(frozen=True)
class Rule:
    """What an option's value must satisfy, and how the message says it (a string, or a callable for
    rules whose choices are read when they are checked, such as the registered solvers)."""

    holds: Callable[[Any], bool]
    expected: str | Callable[[], str]

    def check(self, name: str, value: Any, step: int | None = None) -> None:
        """Raise ``ValueError`` naming ``name`` if ``value`` breaks the rule."""
        try:
            ok = bool(self.holds(value))
        except (TypeError, ValueError, OverflowError, re.error):
            ok = False
        if not ok:
            expected = self.expected() if callable(self.expected) else self.expected
            where = "" if step is None else f" (returned by the callable at step {step})"
            why = "" if representable(value) else f" ({OUT_OF_RANGE})"
            raise ValueError(f"{name} must be {expected}, got {_shown(value)}{where}{why}")


#: Every numeric option's ints lie in [-INT_LIMIT, INT_LIMIT): torch takes a Python int as an int64, and the
#: cost model and the trend compute with floats, so a wider int (``2**70``, ``10**400``) would pass a
#: comparison here and fail at ``step()`` with ``OverflowError``.
INT_LIMIT = 2**63
OUT_OF_RANGE = "a number must be an int in [-2**63, 2**63), torch's int64, or convert to a float without overflow"


def representable(x: object) -> bool:
    """Whether a numeric value can reach torch and float arithmetic: an int within int64 (what torch makes
    of a Python int), or a real whose float conversion neither overflows nor turns a finite value into inf
    (``Fraction(10**400)``, a NumPy longdouble beyond float64). Anything that is not a number is left to
    the rules (True)."""
    if is_bool(x) or isinstance(x, str) or not isinstance(x, numbers.Real):
        return True
    if isinstance(x, numbers.Integral):
        return -INT_LIMIT <= int(x) < INT_LIMIT
    try:
        as_float = float(x)
    except (OverflowError, ValueError, TypeError):
        return False
    return not math.isinf(as_float) or bool(x == as_float)


def _shown(value: object) -> str:
    """``repr(value)``, but an int of more than 128 bits by its size (``10**5000`` has no repr: Python refuses
    to write an int of over 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"{'-' if value < 0 else ''}an int of {value.bit_length()} bits"
    try:
        return repr(value)
    except ValueError:  # a container holding such an int
        return f"a {type(value).__name__} holding an int too long to write"


def is_bool(x: object) -> bool:
    """Python, NumPy and 0-dim torch booleans: never a number here."""
    return isinstance(x, bool) or str(getattr(x, "dtype", "")) in ("bool", "torch.bool")


def is_number(x: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_index(x: object) -> bool:
    """An int ≥ 0 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def is_real(x: object) -> bool:
    """A real number (not a bool) that torch and float arithmetic can take (:func:`representable`); inf and
    NaN are left to each rule."""
    return not is_bool(x) and isinstance(x, numbers.Real) and not isinstance(x, str) and representable(x)


def is_count(x: object, least: int = 1) -> bool:
    """An int (not a bool) in [least, 2**63): a count or an index an option gives."""
    return isinstance(x, int) and not isinstance(x, bool) and least <= x < INT_LIMIT


def is_collection(x: object) -> bool:
    """A list, tuple, set or other sized collection, not a string and not a one-shot iterator (which the
    check would consume)."""
    return isinstance(x, (collections.abc.Sequence, collections.abc.Set)) and not isinstance(x, (str, bytes))


def _regexes(patterns: Any) -> bool:
    if not is_collection(patterns):
        return False
    for pattern in patterns:
        re.compile(pattern)
    return True


POSITIVE = Rule(lambda x: is_real(x) and 0 < x < math.inf, "a finite number > 0")
NON_NEGATIVE = Rule(lambda x: is_real(x) and 0 <= x < math.inf, "a finite number >= 0")
COUNT = Rule(is_count, "an int >= 1")
DECAY = Rule(lambda x: is_real(x) and 0.0 <= x < 1.0, "a number in [0, 1)")
RATIO = Rule(lambda x: is_real(x) and 0.0 < x <= 1.0, "in (0, 1]")
#: The most megabytes an option may give: 2**43 MB, whose bytes (× 2**20) still fit an int64.
MAX_MB = 2**43
MEGABYTES = Rule(lambda x: is_real(x) and 0 < x < MAX_MB, "a number of MB > 0 and < 2**43 (its bytes fit an int64)")
MEGABYTES_OR_ZERO = Rule(
    lambda x: is_real(x) and 0 <= x < MAX_MB, "a number of MB >= 0 and < 2**43 (its bytes fit an int64)"
)
REGEXES = Rule(_regexes, "a sequence of valid regular expressions (not a single string)")
PATH = Rule(lambda x: isinstance(x, (str, os.PathLike)), "a path or None")


def window_decay(window: int) -> float:
    """EMA decay whose effective memory is ``window`` steps: 1 − 2/(window + 1)."""
    return 1.0 - 2.0 / (window + 1)


def option(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    rule: Rule | None = None,
    schedule: bool = False,
    fixed: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A config field with its documentation and rule (see :class:`Section`).

    ``schedule``: a callable of the step is accepted (checked by the rule at each step, see
    :func:`resolve`). ``fixed``: the option cannot change after the preconditioner is made
    (:meth:`hylo.HyLoPreconditioner.reconfigure` refuses it). A Literal-typed option's rule is
    its choices; ``None`` is accepted only where the type says ``| None``.
    """
    metadata = {"doc": doc, "rule": rule, "schedule": schedule, "fixed": fixed}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class OptionSpec:
    """One option as :func:`hylo.config.options` describes it (what a command line or a docs table needs)."""

    name: str
    #: The section's attribute on :class:`hylo.HyLoConfig` (``"kfac"``, …), or None at the top level.
    section: str | None
    #: The value's type with ``| None`` and a schedule's callable removed.
    type: Any
    optional: bool
    default: Any
    doc: str
    #: The Literal's values, for an option with fixed choices.
    choices: tuple[Any, ...] | None
    schedule: bool
    fixed: bool
    #: What a value must satisfy: the option's own rule, else one of its choices (None: anything).
    rule: Rule | None = None


_NONE = type(None)


def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """The dataclass fields of a section class."""
    return fields(cast(Any, cls))


def default_of(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (its factory called)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING
    return f.default_factory()


def _spec(section: str | None, f: dataclasses.Field[Any], hint: Any) -> OptionSpec:
    members = list(get_args(hint)) if get_origin(hint) in (typing.Union, types.UnionType) else [hint]
    optional = _NONE in members
    values = [m for m in members if m is not _NONE and Callable not in (m, get_origin(m))]
    if not values:  # a callable option (solver_fn)
        kind: Any = Callable
    else:
        kind = values[0] if len(values) == 1 else typing.Union[tuple(values)]  # noqa: UP007
    members = values
    flat = [a for m in members if get_origin(m) is Literal for a in get_args(m)]
    choices = tuple(flat) if flat and all(get_origin(m) is Literal for m in members) else None
    default = default_of(f)
    meta = f.metadata
    rule = meta["rule"]
    if rule is None and choices is not None:
        rule = Rule(lambda x: isinstance(x, str) and x in choices, f"one of {choices}")
    return OptionSpec(
        f.name, section, kind, optional, default, meta["doc"], choices, meta["schedule"], meta["fixed"], rule
    )


class Section:
    """Base of the config's sections: checks every field by its rule, type and optionality."""

    _specs: ClassVar[dict[str, OptionSpec]]
    section_name: ClassVar[str | None] = None

    @classmethod
    def option_specs(cls) -> dict[str, OptionSpec]:
        """This section's options by name (resolved once per class)."""
        if "_specs" not in cls.__dict__:
            hints = typing.get_type_hints(cls)
            cls._specs = {
                f.name: _spec(cls.section_name, f, hints[f.name]) for f in _fields(cls) if "doc" in f.metadata
            }
        return cls._specs

    def __post_init__(self) -> None:
        self._check_fields()

    def _check_fields(self) -> None:
        """Check every option's value by its rule (a schedule's callable is checked at each step)."""
        for name, spec in self.option_specs().items():
            value = getattr(self, name)
            if (value is None and spec.optional) or (spec.schedule and callable(value)):
                continue
            if spec.rule is not None:
                spec.rule.check(name, value)
            elif value is None:
                raise ValueError(f"{name} must not be None")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
