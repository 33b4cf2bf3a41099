"""The trainers' hylo flags, generated from :func:`hylo.config.options`: a new hylo option is a flag of every trainer.

The rule: every option a run gives (:func:`hylo_scripts.training.hylo_options.user_options`, and
``solver``) is the flag ``--name-with-dashes`` (argparse ``dest`` the option's name), in a group
per section of hylo's configuration, whose

- help is the option's ``doc``, then its default in the scripts (hylo's, or
  :data:`~hylo_scripts.training.hylo_options.SCRIPT_DEFAULTS`);
- value is parsed by the option's type: ``int``, ``float``, ``str`` as themselves; a ``Literal``
  as its ``choices``; ``tuple[X, ...]`` as ``nargs="+"`` of X (a tuple of Literals: their
  choices, kept in the choices' order, once each); a fixed ``tuple[X, X, X]`` as ``nargs=3``;
  ``Mapping[str, str]`` as ``KEY=VALUE`` pairs; ``bool`` as ``--name``/``--no-name``;
- argparse default is None, so a flag given is told from one left out: the options given are
  the run's ``RunConfig.hylo`` (checked there by building ``hylo.HyLoConfig``, a bad value is
  an error naming the option), and any of them with ``--solver none`` is an error.

The exceptions, each listed once: the HyLo research code's flag names (:data:`HYLO_NAMES`: its
renames with the parse-time checks its flags made, ``--sngd``, and the study flags of
:data:`STUDY_FLAGS`, :data:`METHOD_FLAGS` and ``--study-every``), the scripts' defaults
(:data:`~hylo_scripts.training.hylo_options.SCRIPT_DEFAULTS`) and the options the engine sets
(:data:`~hylo_scripts.training.hylo_options.ENGINE_OPTIONS`). ``--solver`` adds ``none`` (the plain
optimizer) to hylo's solvers. Beyond parsing, the scripts add only their misuse errors (a flag
nothing would read): :func:`study_misuse` and :func:`policy_misuse`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import hylo
from hylo_scripts.training.argtypes import ratio
from hylo_scripts.training.hylo_options import RUN_OPTION, SCRIPT_DEFAULTS, default, solver_choices, user_options


@dataclass(frozen=True)
class HyLoName:
    """The HyLo research code's flag names of an option (aliases of its own flag) and the check its flag made."""

    flags: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None


#: HyLo's flag names and parse-time checks, by option.
HYLO_NAMES: dict[str, HyLoName] = {
    "update_freq": HyLoName(("--freq",)),
    "rank_ratio": HyLoName(("--compression-ratio",), ratio),
    "grad_error_ratios": HyLoName((), ratio),
}
#: HyLo's study flags -> the study each adds to ``studies``.
STUDY_FLAGS = {"--grad-norm": "grad_norm", "--rank-analysis": "rank", "--grad-error": "grad_error"}
#: HyLo's method flags of ``--grad-error`` -> the solver each adds to ``grad_error_methods``.
METHOD_FLAGS = {"--enable-id": "kid", "--enable-is": "kis", "--enable-kfac": "kfac"}
#: HyLo's ``--study-every N`` sets both (unless given by their own flags).
STUDY_EVERY = ("rank_every", "grad_error_every")


def flag(name: str) -> str:
    """The flag of option (or argparse dest) ``name``."""
    return "--" + name.replace("_", "-")


def _dest(option_string: str) -> str:
    return option_string.removeprefix("--").replace("-", "_")


def _pair(text: str) -> tuple[str, str]:
    """argparse type of a ``KEY=VALUE`` pair (split at the last ``=``)."""
    key, sep, value = text.rpartition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _shown(value: Any) -> str:
    """A default as the help text shows it."""
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, Mapping):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def help_text(spec: hylo.config.OptionSpec, default_value: Any) -> str:
    """A flag's help: the option's doc, then its default in the scripts (``%`` escaped for argparse)."""
    note = f"default: {_shown(default_value)}"
    off = SCRIPT_DEFAULTS[spec.name].off if spec.name in SCRIPT_DEFAULTS else None
    if off is not None:
        note += f"; {off}: off"
    return f"{spec.doc} ({note})".replace("%", "%%")


def _literal_choices(kind: Any) -> tuple[Any, ...] | None:
    return tuple(get_args(kind)) if get_origin(kind) is Literal else None


def flag_arguments(spec: hylo.config.OptionSpec) -> dict[str, Any]:
    """argparse's keyword arguments of option ``spec``'s flag (type, choices, nargs, metavar)."""
    kind, origin = spec.type, get_origin(spec.type)
    custom = HYLO_NAMES[spec.name].type if spec.name in HYLO_NAMES else None
    if spec.choices is not None:
        return {"choices": spec.choices}
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if kind in (int, float, str) or (custom is not None and origin is not tuple):
        return {"type": custom or kind}
    if origin is tuple:
        items = get_args(kind)
        if len(items) == 2 and items[1] is Ellipsis:
            choices = _literal_choices(items[0])
            if choices is not None:
                return {"nargs": "+", "choices": choices}
            return {"nargs": "+", "type": custom or items[0]}
        if len(set(items)) == 1:
            letter = spec.name[0].upper()
            return {"nargs": len(items), "type": items[0], "metavar": tuple(f"{letter}{k}" for k in range(len(items)))}
    if origin is Mapping and get_args(kind) == (str, str):
        return {"nargs": "+", "type": _pair, "metavar": "KEY=VALUE"}
    if get_origin(kind) is not None and str in get_args(kind):  # str | os.PathLike
        return {"type": str}
    raise TypeError(
        f"hylo option {spec.name!r} of type {kind} has no flag: give it a flag type here or list it in ENGINE_OPTIONS"
    )


def add_hylo_arguments(
    parser: argparse.ArgumentParser, *, solver: bool = True, skip_sections: tuple[str, ...] = ()
) -> dict[str | None, argparse._ArgumentGroup]:
    """Add a flag for every option a run gives (``solver`` too, unless ``solver=False``), one group per section.

    ``skip_sections`` leaves out the options of those sections of hylo's configuration. Returns
    the groups by section (None: the top level), so that callers can add their own hylo flags.
    """
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    specs = [spec for spec in hylo.config.options() if spec.name == RUN_OPTION] if solver else []
    specs += [spec for spec in user_options() if spec.section not in skip_sections]
    for spec in specs:
        if spec.section not in groups:
            if spec.section is None:
                title, text = "hylo: solver, cadence, damping", "(with --solver none every hylo flag is an error)"
            else:
                title, text = f"hylo, {spec.section} options", "(errors with --solver none)"
            groups[spec.section] = parser.add_argument_group(title, text)
        names = [flag(spec.name)]
        if spec.name == RUN_OPTION:
            arguments: dict[str, Any] = {"choices": ("none", *solver_choices())}
            text = f"{spec.doc}; 'none' trains with the plain optimizer (default: {spec.default})"
            groups[spec.section].add_argument(*names, dest=spec.name, help=text.replace("%", "%%"), **arguments)
            continue
        if spec.name in HYLO_NAMES:
            names += HYLO_NAMES[spec.name].flags
        groups[spec.section].add_argument(
            *names, dest=spec.name, help=help_text(spec, default(spec)), **flag_arguments(spec)
        )
    return groups


def _selection(spec: hylo.config.OptionSpec, values: list[Any]) -> tuple[Any, ...]:
    """A tuple option's values once each; a tuple of choices in the choices' order."""
    items = get_args(spec.type)
    choices = _literal_choices(items[0]) if items else None
    unique = tuple(dict.fromkeys(values))
    return tuple(c for c in choices if c in unique) if choices is not None else unique


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options whose flags were given (not None), as ``RunConfig.hylo`` takes them."""
    given: dict[str, Any] = {}
    for spec in user_options():
        value = getattr(args, spec.name, None)
        if value is None:
            continue
        if get_origin(spec.type) is Mapping:
            value = dict(value)
        elif get_origin(spec.type) is tuple:
            value = _selection(spec, list(value)) if get_args(spec.type)[-1] is Ellipsis else tuple(value)
        given[spec.name] = value
    return given


def add_study_flags(group: argparse._ArgumentGroup) -> None:
    """HyLo's study flags: shorthands of ``--studies``, ``--grad-error-methods``, ``--rank-every``/``--grad-error-every``."""
    group.add_argument(
        "--grad-norm", action="store_true", help="gradient-norm study, every step and layer: grad-norm.csv"
    )
    group.add_argument(
        "--rank-analysis",
        action="store_true",
        help="rank study (eigenvalues of the exact SNGD kernel, numerical rank) at sampled updates: rank-analysis.csv",
    )
    group.add_argument(
        "--grad-error",
        action="store_true",
        help="gradient-error study against exact SNGD at sampled updates: grad-error.csv "
        "(methods from --enable-id/--enable-is/--enable-kfac; none given: KID and KIS)",
    )
    group.add_argument(
        "--enable-id", action="store_true", help="--grad-error measures KID (train with it: --solver kid)"
    )
    group.add_argument(
        "--enable-is", action="store_true", help="--grad-error measures KIS (train with it: --solver kis)"
    )
    group.add_argument("--enable-kfac", action="store_true", help="--grad-error measures K-FAC")
    group.add_argument(
        "--study-every",
        type=int,
        metavar="N",
        help="run --rank-analysis and --grad-error at every N-th update (default: every update)",
    )


def study_options(args: argparse.Namespace, given: Mapping[str, Any]) -> dict[str, Any]:
    """The options HyLo's study flags set, merged with those of the options' own flags in ``given``."""
    specs = {spec.name: spec for spec in user_options()}
    options: dict[str, Any] = {}
    studies = [study for option, study in STUDY_FLAGS.items() if getattr(args, _dest(option))]
    if studies:
        options["studies"] = _selection(specs["studies"], [*given.get("studies", ()), *studies])
    methods = [method for option, method in METHOD_FLAGS.items() if getattr(args, _dest(option))]
    if methods:
        options["grad_error_methods"] = _selection(
            specs["grad_error_methods"], [*given.get("grad_error_methods", ()), *methods]
        )
    if args.study_every is not None:
        options.update({name: args.study_every for name in STUDY_EVERY if name not in given})
    return options


def study_misuse(args: argparse.Namespace, given: Mapping[str, Any], log_dir: str | None, solver: str) -> str | None:
    """The message for HyLo's study flags (and the options they set) used where nothing reads them, or None.

    Profiling and studies need ``--log-dir`` and a hylo solver; ``--enable-*``,
    ``--grad-error-methods``, ``--grad-error-ratios`` need the gradient-error study;
    ``--study-every`` the rank or the gradient-error study.
    """
    asked = [option for option in ("--profiling", *STUDY_FLAGS) if getattr(args, _dest(option))]
    asked += [flag("studies")] if "studies" in given else []
    if asked and log_dir is None:
        return f"{' '.join(asked)}: needs --log-dir DIR, where hylo writes its profile and study files"
    if asked and solver == "none":
        return f"{' '.join(asked)}: not available with --solver none (profiling and studies measure hylo)"
    studies = set(given.get("studies", ())) | {s for option, s in STUDY_FLAGS.items() if getattr(args, _dest(option))}
    if "grad_error" not in studies:
        misplaced = [option for option in METHOD_FLAGS if getattr(args, _dest(option))]
        misplaced += [flag(name) for name in ("grad_error_methods", "grad_error_ratios") if name in given]
        if misplaced:
            return f"{' '.join(misplaced)}: only with --grad-error (to train with KID or KIS: --solver kid/kis)"
    if args.study_every not in (None, 1) and not {"rank", "grad_error"} & studies:
        return "--study-every: only with --rank-analysis or --grad-error"
    return None


def add_sngd_flag(group: argparse._ArgumentGroup) -> None:
    """HyLo's ``--sngd``: train with exact SNGD (``--solver sngd``)."""
    group.add_argument("--sngd", action="store_true", help="HyLo's flag: train with exact SNGD (= --solver sngd)")


def solver_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """``--solver`` with ``--sngd`` folded in (a conflict is an error); the default is hylo's (hybrid)."""
    if args.sngd:
        if args.solver not in (None, "sngd"):
            parser.error(f"--sngd trains with SNGD; it contradicts --solver {args.solver}")
        return "sngd"
    return args.solver or hylo.HyLoConfig().solver


def policy_misuse(given: Mapping[str, Any], solver: str, studies: set[str]) -> str | None:
    """The message for the hybrid policy's options with a fixed solver (nothing would read them), or None."""
    if "adaptive" in given and solver != hylo.solvers.HYBRID:
        return f"--adaptive sets the hybrid policy's windows; it needs --solver hybrid, not {solver}"
    if "trend_window" in given and solver != hylo.solvers.HYBRID and "grad_norm" not in studies:
        return f"--trend-window: the gradient-norm trend is read by --solver hybrid or --grad-norm, not {solver}"
    return None
