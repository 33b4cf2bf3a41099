"""Solver families and the registry of solver names (docs/design.md, "Solver families").

The update stage groups layers by family and calls the family interface
(:class:`~hylo.solvers.base.SolverFamily`); it never tests a solver's name. Adding a
solver means a family (or a variant of one) and an entry here: its name in
:data:`LayerSolver` and its family in :data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Literal, get_args

from hylo.layers import LayerShape
from hylo.solvers.base import HeldState, LayerState, RemoteState, SolverFamily
from hylo.solvers.kfac import KFACFamily
from hylo.solvers.lowrank import LowRankFamily

#: A solver one layer can run.
LayerSolver = Literal["kfac", "sngd", "kid", "kis"]
#: Every layer solver, in a fixed order (decision encoding relies on it).
LAYER_SOLVERS: tuple[LayerSolver, ...] = get_args(LayerSolver)

#: The families, in the order the stage launches their collectives (K-FAC's all-reduce first,
#: so that it overlaps the low-rank local reductions).
FAMILIES: tuple[SolverFamily, ...] = (KFACFamily(), LowRankFamily())

_FAMILY_OF: dict[str, SolverFamily] = {name: family for family in FAMILIES for name in family.solvers}
if set(_FAMILY_OF) != set(LAYER_SOLVERS):
    raise ImportError(f"solver registry out of sync: families run {sorted(_FAMILY_OF)}, LayerSolver is {LAYER_SOLVERS}")


def family_of(solver: str) -> SolverFamily:
    """The family that runs ``solver``."""
    try:
        return _FAMILY_OF[solver]
    except KeyError:
        raise ValueError(f"unknown solver {solver!r}; expected one of {LAYER_SOLVERS}") from None


__all__ = [
    "FAMILIES",
    "LAYER_SOLVERS",
    "HeldState",
    "LayerShape",
    "LayerSolver",
    "LayerState",
    "RemoteState",
    "SolverFamily",
    "family_of",
]
