"""Colours, line styles and output settings shared by every figure (docs/figures.md, "Style").

One colour per solver and per optimizer, the same in every figure, from the Okabe–Ito palette
(distinguishable under the common colour-vision deficiencies). Phases of an update step get
their own palette (Paul Tol's *light* scheme) so that they are never read as solvers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib as mpl
from matplotlib.figure import Figure

#: hylo's solvers, in the order legends and bars list them.
SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")

#: Okabe–Ito colours: solvers, then the optimizers of runs without a solver.
SOLVER_COLOURS = {
    "kfac": "#0072B2",  # blue
    "sngd": "#D55E00",  # vermillion
    "kid": "#009E73",  # bluish green
    "kis": "#E69F00",  # orange
    "hybrid": "#CC79A7",  # reddish purple
}
OPTIMIZER_COLOURS = {
    "sgd": "#000000",  # black
    "adamw": "#56B4E9",  # sky blue
}
#: Anything outside the two tables above (a solver or optimizer added later).
OTHER_COLOUR = "#999999"

#: Line style of the optimizer under a preconditioned run (the colour is the solver's).
OPTIMIZER_LINESTYLES = {"sgd": "-", "adamw": "--"}

#: The phases of an update step (hylo's profile columns, without ``_ms``), compute first.
COMPUTE_PHASES = ("capture", "reduce", "solve", "precondition")
COMMUNICATION_PHASES = ("gather", "broadcast")
PHASE_COLOURS = {
    "capture": "#77AADD",
    "reduce": "#EEDD88",
    "solve": "#EE8866",
    "precondition": "#44BB99",
    "gather": "#BBCC33",
    "broadcast": "#FFAABB",
}
#: Hatching marks communication wherever compute and communication share an axis.
COMMUNICATION_HATCH = "//"

#: Shading of the gradient-norm study's critical windows (Okabe–Ito yellow).
CRITICAL_COLOUR = "#F0E442"
#: Lines that belong to no solver (a layer's gradient norm).
NEUTRAL_COLOUR = "#333333"

#: Written formats and the raster resolution.
FORMATS = (".pdf", ".png", ".svg")
PNG_DPI = 200

_RC: dict[Any, Any] = {
    "figure.dpi": 100,
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    # Text stays text in vector output: TrueType in PDF, <text> in SVG.
    "pdf.fonttype": 42,
    "svg.fonttype": "none",
}


def solver_colour(solver: str) -> str:
    """The colour of ``solver`` in every figure."""
    return SOLVER_COLOURS.get(solver, OTHER_COLOUR)


def run_colour(solver: str, optimizer: str) -> str:
    """A run's colour: its solver's, or its optimizer's for a run without a solver (``"none"``)."""
    if solver == "none":
        return OPTIMIZER_COLOURS.get(optimizer, OTHER_COLOUR)
    return solver_colour(solver)


def run_linestyle(solver: str, optimizer: str) -> str:
    """A run's line style: solid for plain optimizers, the optimizer's style under a solver."""
    if solver == "none":
        return "-"
    return OPTIMIZER_LINESTYLES.get(optimizer, ":")


@contextmanager
def figure_style() -> Iterator[None]:
    """The rcParams every figure is drawn under (small fonts, light grid, text kept as text)."""
    with mpl.rc_context(_RC):
        yield


def save_figure(figure: Figure, path: str | Path, **savefig: Any) -> Path:
    """Write ``figure`` to ``path`` (.pdf, .png or .svg); PDF and SVG are vector output.

    Raises ``ValueError`` for another suffix. Extra keywords go to ``Figure.savefig``.
    """
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"cannot write {path}: the output must end in one of {', '.join(FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"bbox_inches": "tight", "dpi": PNG_DPI}
    options.update(savefig)
    with figure_style():
        figure.savefig(path, **options)
    return path
