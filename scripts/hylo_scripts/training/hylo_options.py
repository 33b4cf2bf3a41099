"""hylo's options in the trainers: which the engine sets, the scripts' own defaults, a run's values.

Every option of :func:`hylo.config.options` reaches a run in one of two ways:

- the engine sets it (:data:`ENGINE_OPTIONS`, with where its value comes from), or
- the run gives it: ``RunConfig.solver`` for ``solver`` (None: the plain optimizer), a key of
  ``RunConfig.hylo`` for every other option — a flag of every trainer, generated from the
  option's spec by :mod:`hylo_scripts.training.hylo_flags`. Its default is hylo's, except where
  :data:`SCRIPT_DEFAULTS` says otherwise.

A run's ``hylo`` mapping holds every such option (the given values over the defaults, in the
order of :func:`hylo.config.options`), so that ``config.json`` records all of them;
:func:`hylo_scripts.training.runconfig.preconditioner_options` adds the engine's and gives
``hylo.HyLoPreconditioner`` its keyword arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_origin

import hylo

#: The option that is a field of the run itself: ``RunConfig.solver`` (``--solver``; None: no hylo).
RUN_OPTION = "solver"
#: Options the engine sets itself (no flag, no key of ``RunConfig.hylo``), and from what.
ENGINE_OPTIONS: dict[str, str] = {
    "lr": "the optimizer's scheduled lr, read at every step (kl_clip scales by lr²); only with kl_clip",
    "iters_per_epoch": "the run's steps per epoch; only with adaptive",
    "profile_dir": "--log-dir, with --profiling or a study",
    "profile_append": "--resume: a resumed run continues its profile files",
    "seed": "the run's --seed (initial weights, batch order and hylo's draws)",
    "solver_fn": "not set: a function is no flag (--layer-solvers pins layers to solvers)",
}


@dataclass(frozen=True)
class Default:
    """A default of the scripts that differs from hylo's; ``off``: a value that stands for None (off)."""

    value: Any
    off: Any = None


#: The scripts' defaults where they differ from hylo's (the one place they are set).
SCRIPT_DEFAULTS: dict[str, Default] = {
    "damping": Default(0.3),
    "kl_clip": Default(1e-3, off=0),  # --kl-clip 0 turns the clip off (hylo's None)
}


#: hylo's solvers whose result is the whole update direction (their states keep per-step moments: ``kfac_adam``):
#: trained by SGD without momentum (:func:`hylo_scripts.training.loop.make_optimizer`), ``kl_clip`` off by default.
ADAPTIVE: tuple[str, ...] = tuple(name for name in hylo.solvers.solver_names() if hylo.solvers.whole_step(name))
#: The adaptive solvers' peak learning rate on the MNIST CNN (demo and time-to-accuracy bench): Adam's scale, applied
#: by SGD without momentum to the layers they adapt (docs/usage.md, "Adaptive solvers"); the best of bench_peers'
#: grid for kfac_adam (docs/benchmarks.md, "Peers").
ADAPTIVE_LR = 0.01


@dataclass(frozen=True)
class PeakLR:
    """A trainer's default peak learning rate per solver family, where the scale of the step differs.

    ``natural``: plain runs and the natural-gradient solvers (kfac, sngd, kid, kis, hybrid), whose direction the
    run's optimizer scales; ``adaptive``: the :data:`ADAPTIVE` solvers (``kfac_adam``), whose result is the whole
    Adam-scaled step, applied by SGD without momentum (at SGD's 0.1 it diverges).
    """

    natural: float
    adaptive: float

    def of(self, solver: str | None) -> float:
        """The default peak lr of a run with ``solver`` (None or ``"none"``: the plain optimizer)."""
        return self.adaptive if solver in ADAPTIVE else self.natural

    def describe(self) -> str:
        """The defaults as ``--help`` states them."""
        if self.adaptive == self.natural:
            return f"{self.natural:g} with every solver"
        return f"{self.natural:g}; {self.adaptive:g} with --solver {'/'.join(ADAPTIVE)}, whose step is Adam-scaled"


#: The trainers' default peak lr by task, per solver family (the one place they are set; ``--lr`` always wins):
#: the image trainers (SGD) take :data:`ADAPTIVE_LR` with an adaptive solver; the language model's AdamW lr is
#: Adam's scale already, the same for every solver.
TRAINER_LRS: dict[str, PeakLR] = {
    "classification": PeakLR(natural=0.1, adaptive=ADAPTIVE_LR),
    "segmentation": PeakLR(natural=0.1, adaptive=ADAPTIVE_LR),
    "lm": PeakLR(natural=1e-3, adaptive=1e-3),
}


def user_options() -> list[hylo.config.OptionSpec]:
    """The options a run gives in ``RunConfig.hylo`` (every option but the engine's and ``solver``), hylo's order."""
    return [spec for spec in hylo.config.options() if spec.name not in ENGINE_OPTIONS and spec.name != RUN_OPTION]


def solver_choices() -> tuple[str, ...]:
    """hylo's solver names: the registered solvers and the hybrid policy."""
    return (*hylo.solvers.solver_names(), hylo.solvers.HYBRID)


def default(spec: hylo.config.OptionSpec) -> Any:
    """An option's default in the scripts: :data:`SCRIPT_DEFAULTS`, else hylo's."""
    return SCRIPT_DEFAULTS[spec.name].value if spec.name in SCRIPT_DEFAULTS else spec.default


def is_sequence(spec: hylo.config.OptionSpec) -> bool:
    """Whether the option's value is a tuple (given as a sequence)."""
    return get_origin(spec.type) is tuple


def is_mapping(spec: hylo.config.OptionSpec) -> bool:
    """Whether the option's value is a mapping."""
    return get_origin(spec.type) is Mapping


def _normal(spec: hylo.config.OptionSpec, value: Any) -> Any:
    """``value`` as the run keeps it: the off value as None, sequences as tuples, mappings as dicts."""
    off = SCRIPT_DEFAULTS[spec.name].off if spec.name in SCRIPT_DEFAULTS else None
    if off is not None and value == off and not isinstance(value, bool):
        return None
    if value is None:
        return None
    if is_sequence(spec):
        if isinstance(value, str):
            raise ValueError(f"{spec.name} must be a sequence, not a single string")
        return tuple(value)
    if is_mapping(spec):
        return dict(value)
    return value


def run_options(given: Mapping[str, Any], solver: str | None) -> dict[str, Any]:
    """Every option of a run with a solver — ``given`` over the defaults — in hylo's order; {} without a solver.

    A ``ValueError`` names an unknown option, one the engine sets, or options given to a run
    without a solver. The values are checked by :func:`check`.
    """
    specs = {spec.name: spec for spec in user_options()}
    for name in given:
        if name in ENGINE_OPTIONS or name == RUN_OPTION:
            where = ENGINE_OPTIONS.get(name, "RunConfig.solver")
            raise ValueError(f"hylo option {name!r} is not a run's to give: it comes from {where}")
        if name not in specs:
            raise ValueError(f"unknown hylo option {name!r} (see hylo.config.options())")
    if solver is None:
        if given:
            raise ValueError(
                f"hylo options ({', '.join(given)}) need a solver; solver None trains with the plain optimizer"
            )
        return {}
    values = {name: _normal(spec, given[name] if name in given else default(spec)) for name, spec in specs.items()}
    if solver in ADAPTIVE and "kl_clip" not in given:
        values["kl_clip"] = None  # an adaptive step is normalised already: no trust region unless asked for
    return values


def default_options() -> dict[str, Any]:
    """Every option of :func:`user_options` at its default (:func:`default`), as JSON values, in hylo's order
    (``RunConfig.hylo`` of :func:`hylo_scripts.training.runconfig.run_defaults`)."""
    return json.loads(json.dumps({spec.name: _normal(spec, default(spec)) for spec in user_options()}))
