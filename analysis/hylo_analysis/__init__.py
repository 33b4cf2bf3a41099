"""Figures of the HyLo paper from run directories: loaders, figure functions, a CLI and notebooks.

    from hylo_analysis import load_table, accuracy, save_figure
    save_figure(accuracy(["runs/sgd", "runs/hybrid"]), "accuracy.pdf")

``python -m hylo_analysis --help`` lists the figures. See docs/figures.md, "Figures".
"""

from hylo_analysis.figures import (
    FIGURES,
    FigureSpec,
    accuracy,
    critical_windows,
    grad_error,
    grad_norm,
    layer_dims,
    rank,
    rank_choice,
    rank_reference,
    solver_matrix,
    solvers,
    timing,
)
from hylo_analysis.runs import TABLES, Run, RunDataError, check_columns, default_label, load_table, read_run, read_runs
from hylo_analysis.style import OPTIMIZER_COLOURS, SOLVER_COLOURS, figure_style, run_colour, save_figure, solver_colour

__all__ = [
    "FIGURES",
    "OPTIMIZER_COLOURS",
    "SOLVER_COLOURS",
    "TABLES",
    "FigureSpec",
    "Run",
    "RunDataError",
    "accuracy",
    "check_columns",
    "critical_windows",
    "default_label",
    "figure_style",
    "grad_error",
    "grad_norm",
    "layer_dims",
    "load_table",
    "rank",
    "rank_choice",
    "rank_reference",
    "read_run",
    "read_runs",
    "run_colour",
    "save_figure",
    "solver_colour",
    "solver_matrix",
    "solvers",
    "timing",
]
