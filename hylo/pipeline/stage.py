"""The update stage: the family phases of an update — local reductions, fused collectives, owner solves
(docs/design.md, "Data path of one step").

Which solved states every rank assembles and the vote on rejected states are the placement's
(:class:`Sharing`, :mod:`hylo.pipeline.placement`), passed to each call: the stage keeps no option of its
own and never asks which distribution is in force.

At an update step, for P ranks, with layers grouped by solver family:

1. every family reduces its layers' batches locally and launches its collective at once
   (K-FAC's all-reduce first, so it overlaps the low-rank local reductions and all-gather);
2. every family prepares its layers' solve inputs from the collective's result;
3. each layer gets one owner by greedy longest-processing-time on its estimated solve cost;
4. owners solve their layers, batched within each family;
5. the placement shares the solved states it says every rank holds (owners broadcast the solved
   tensors, every rank assembles them: all of them with P > 1 under ``strategy="inverse"`` and
   FSDP2, the states that advance at every step under ``"gradient"``); the owner assembles the
   others, every other rank keeps a :class:`~hylo.solvers.base.RemoteState`.

With one rank every collective is the identity and rank 0 owns everything. The stage calls
the family interface only; it never tests a solver's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from hylo.distributed import Communicator, Pending, assign_owners
from hylo.numerics import finite_each
from hylo.solvers import FAMILIES, HeldState, RemoteState, family_of
from hylo.solvers.base import Contribution, SolverFamily, UpdateContext, UpdateJob
from hylo.solvers.kernel import Exchange


@dataclass
class Launched:
    """One family's jobs with their collective in flight (and each layer's bytes in it, when timed)."""

    family: SolverFamily[Any]
    members: list[UpdateJob]
    names: list[str]
    sizes: list[int] | None
    pending: Pending


@dataclass
class UpdateResult:
    """New states of every layer (not yet stored), their owners, and the layers to keep as they were."""

    states: dict[str, HeldState]
    owners: dict[str, int]
    #: Layers whose new state is non-finite on some rank: every rank keeps their previous state.
    rejected: list[str]
    #: Each low-rank layer's (rows, rows kept) per rank, as gathered (the same on every rank).
    chosen: dict[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    #: What each layer's update decided beyond its solver (:meth:`~hylo.solvers.base.SolverFamily.update_notes`).
    notes: dict[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)


class Sharing(Protocol):
    """What a placement decides about an update's solved states (docs/design.md, "Placements")."""

    def shares(self, solver: str) -> bool:
        """Whether every rank holds the solved state of a layer of ``solver`` (its owner broadcasts it)."""

    def share(
        self,
        jobs: Sequence[UpdateJob],
        owners: Mapping[str, int],
        prepared: Mapping[str, Any],
        solutions: Mapping[str, dict[str, Tensor]],
        context: UpdateContext,
    ) -> dict[str, HeldState]:
        """Every one of ``jobs``' states on every rank, from its owner's ``solutions``."""

    def agreed(self, flags: Tensor) -> Tensor:
        """Per job, whether its new state is finite, as every rank must take it."""


class UpdateStage:
    """Runs the family phases of an update across ranks for a list of layers."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    # ---------------------------------------------------------------- update
    def update(self, jobs: Sequence[UpdateJob], context: UpdateContext, sharing: Sharing) -> UpdateResult:
        """Solve every job; see the module docstring for the phases (timed on ``context.watch``)."""
        watch = context.watch
        prepared: dict[str, Any] = {}
        launched = self._exchange(jobs, context)
        for exchange in launched:
            received = exchange.pending.wait()
            watch.lap("gather", exchange.names, exchange.sizes)
            members = exchange.members
            prepared.update(zip(exchange.names, exchange.family.prepare(members, received, context), strict=True))
            watch.lap("reduce", exchange.names, exchange.sizes)

        costs = [family_of(job.solver).solve_cost(prepared[job.name]) for job in jobs]
        owners = dict(zip([job.name for job in jobs], assign_owners(costs, self.comm.world_size), strict=True))
        solutions: dict[str, dict[str, Tensor]] = {}
        for exchange in launched:
            mine = [name for name in exchange.names if owners[name] == self.comm.rank]
            solutions.update(zip(mine, exchange.family.solve([prepared[name] for name in mine], context), strict=True))
            watch.lap("solve", mine, [exchange.family.solve_cost(prepared[name]) for name in mine])

        shared = [job for job in jobs if sharing.shares(job.solver)]
        states = sharing.share(shared, owners, prepared, solutions, context) if shared else {}
        local = [job for job in jobs if job.name not in states]
        built: dict[str, HeldState] = {}
        for exchange in launched:  # each family's solved layers assembled together (it may batch them)
            solved = [name for name in exchange.names if name in solutions and name not in states]
            if solved:
                assembled = exchange.family.assemble_all(
                    [prepared[name] for name in solved], [solutions[name] for name in solved], context
                )
                built.update(zip(solved, assembled, strict=True))
        for job in local:
            family = family_of(job.solver)
            remote = job.name not in built
            states[job.name] = (
                RemoteState(family.name, family.carried(prepared[job.name])) if remote else built[job.name]
            )
        if local:
            watch.lap("solve", [job.name for job in local])
        rejected = self._rejected(jobs, states, sharing)
        watch.lap("check")
        chosen = {job.name: rows for job in jobs if (rows := family_of(job.solver).rows_chosen(prepared[job.name]))}
        notes = {job.name: note for job in jobs if (note := family_of(job.solver).update_notes(prepared[job.name]))}
        return UpdateResult(states, owners, rejected, chosen, notes)

    def refresh(self, jobs: Sequence[UpdateJob], context: UpdateContext, sharing: Sharing) -> UpdateResult:
        """Between updates: fold this step's batches into the running statistics of ``jobs`` (families
        that :attr:`~hylo.solvers.base.SolverFamily.refreshes`), one collective per family, no solve."""
        watch = context.watch
        states: dict[str, HeldState] = {}
        for exchange in self._exchange(jobs, context):
            received = exchange.pending.wait()
            watch.lap("gather", exchange.names, exchange.sizes)
            refreshed = exchange.family.refresh(exchange.members, received, context)
            states.update(zip(exchange.names, refreshed, strict=True))
            watch.lap("reduce", exchange.names, exchange.sizes)
        rejected = self._rejected(jobs, states, sharing)
        watch.lap("check")
        return UpdateResult(states, {}, rejected)

    def _exchange(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> list[Launched]:
        """Jobs grouped by family in registry order, each family's collective launched at once."""
        launched = []
        for family in FAMILIES:
            members = [job for job in jobs if family_of(job.solver) is family]
            if not members:
                continue
            share = family.contribute(members, context)  # times its own capture and reduce
            names = [job.name for job in members]
            sizes = share.payload.bytes_of(names) if context.watch.enabled else None
            launched.append(Launched(family, members, names, sizes, self._launch(share)))
            context.watch.lap("gather", names, sizes)
        return launched

    def _launch(self, share: Contribution) -> Pending:
        if share.exchange is Exchange.MEAN:
            return self.comm.all_reduce_mean(share.payload, share.weights)
        if share.exchange is Exchange.SUM:
            return self.comm.all_reduce(share.payload, "sum")
        return self.comm.all_gather_rows(share.payload)

    def _rejected(self, jobs: Sequence[UpdateJob], states: dict[str, HeldState], sharing: Sharing) -> list[str]:
        """Layers whose new state is non-finite, as the placement agrees them (one host sync): every floating tensor by
        :func:`~hylo.numerics.finite_each`, one norm per dtype, folded per layer. A tensor the state shares with the
        layer's previous one (a refresh replaces only the running factors) was checked when that state was stored,
        and is not read again."""
        device = jobs[0].batch.math.weight.device
        by_dtype: dict[tuple[torch.dtype, torch.device], tuple[list[Tensor], list[int]]] = {}
        for i, job in enumerate(jobs):
            before = job.previous.tensors() if job.previous is not None else {}
            for name, t in states[job.name].tensors().items():
                if t.is_floating_point() and before.get(name) is not t:
                    tensors, owner = by_dtype.setdefault((t.dtype, t.device), ([], []))
                    tensors.append(t)
                    owner.append(i)
        bad = torch.zeros(len(jobs), device=device)
        for tensors, owner in by_dtype.values():
            bad.index_add_(0, torch.tensor(owner).to(device), (~finite_each(tensors)).to(device, bad.dtype))
        flags = sharing.agreed(bad == 0)
        return [job.name for job, ok in zip(jobs, flags.tolist(), strict=True) if not ok]
