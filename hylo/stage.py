"""The update stage: local reductions, fused collectives, owner solves, sharing (docs/design.md, "Data path of one step").

At an update step, for P ranks, with layers grouped by solver family:

1. every family reduces its layers' batches locally and launches its collective at once
   (K-FAC's all-reduce first, so it overlaps the low-rank local reductions and all-gather);
2. every family prepares its layers' solve inputs from the collective's result;
3. each layer gets one owner by greedy longest-processing-time on its estimated solve cost;
4. owners solve their layers, batched within each family;
5. ``strategy="inverse"``: owners broadcast the solved tensors and every rank assembles every
   layer's state (no traffic between updates). ``strategy="gradient"``: only the owner keeps
   the state; every step it preconditions its layers and broadcasts the result (less memory
   per rank, a broadcast of every gradient each step).

With one rank every collective is the identity and rank 0 owns everything. The stage calls
the family interface only; it never tests a solver's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hylo.config import Strategy
from hylo.distributed import Communicator, Pending, assign_owners
from hylo.payload import Payload
from hylo.registry import RegisteredLayer
from hylo.solvers import FAMILIES, HeldState, LayerState, RemoteState, family_of
from hylo.solvers.base import Contribution, Exchange, SolverFamily, UpdateContext, UpdateJob


@dataclass
class UpdateResult:
    """New states of every layer (not yet stored), their owners, and the layers to keep as they were."""

    states: dict[str, HeldState]
    owners: dict[str, int]
    #: Layers whose new state is non-finite on some rank: every rank keeps their previous state.
    rejected: list[str]


class UpdateStage:
    """Runs the update and the per-step preconditioning across ranks for a list of layers."""

    def __init__(self, strategy: Strategy, comm: Communicator) -> None:
        self.strategy = strategy
        self.comm = comm

    # ---------------------------------------------------------------- update
    def update(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> UpdateResult:
        """Solve every job; see the module docstring for the phases."""
        exchanges = self._exchange(jobs, context)
        groups = [(family, members) for family, members, _ in exchanges]
        prepared: dict[str, Any] = {}
        for family, members, pending in exchanges:
            received = pending.wait()
            prepared.update(zip([job.name for job in members], family.prepare(members, received, context), strict=True))

        costs = [family_of(job.solver).solve_cost(prepared[job.name]) for job in jobs]
        owners = dict(zip([job.name for job in jobs], assign_owners(costs, self.comm.world_size), strict=True))
        solutions: dict[str, dict[str, Tensor]] = {}
        for family, members in groups:
            mine = [job.name for job in members if owners[job.name] == self.comm.rank]
            solutions.update(zip(mine, family.solve([prepared[name] for name in mine], context), strict=True))

        if self.strategy == "inverse" and self.comm.world_size > 1:
            states = self._share(jobs, owners, prepared, solutions, context)
        else:
            states = {}
            for job in jobs:
                family = family_of(job.solver)
                if job.name in solutions:
                    states[job.name] = family.assemble(prepared[job.name], solutions[job.name], context)
                else:
                    states[job.name] = RemoteState(family.name, family.carried(prepared[job.name]))
        return UpdateResult(states, owners, self._rejected(jobs, states))

    def refresh(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> UpdateResult:
        """Between updates: fold this step's batches into the running statistics of ``jobs`` (families
        that :attr:`~hylo.solvers.base.SolverFamily.refreshes`), one collective per family, no solve."""
        states: dict[str, HeldState] = {}
        for family, members, pending in self._exchange(jobs, context):
            refreshed = family.refresh(members, pending.wait(), context)
            states.update(zip([job.name for job in members], refreshed, strict=True))
        return UpdateResult(states, {}, self._rejected(jobs, states))

    def _exchange(
        self, jobs: Sequence[UpdateJob], context: UpdateContext
    ) -> list[tuple[SolverFamily[Any], list[UpdateJob], Pending]]:
        """Jobs grouped by family in registry order, each family's collective launched at once."""
        groups = [(family, [job for job in jobs if family_of(job.solver) is family]) for family in FAMILIES]
        return [
            (family, members, self._launch(family.contribute(members, context)))
            for family, members in groups
            if members
        ]

    def _launch(self, share: Contribution) -> Pending:
        if share.exchange is Exchange.MEAN:
            return self.comm.all_reduce_mean(share.payload, share.weights)
        return self.comm.all_gather_rows(share.payload)

    def _share(
        self,
        jobs: Sequence[UpdateJob],
        owners: dict[str, int],
        prepared: dict[str, Any],
        solutions: dict[str, dict[str, Tensor]],
        context: UpdateContext,
    ) -> dict[str, HeldState]:
        """strategy="inverse": each owner broadcasts its solved tensors; every rank assembles every state."""
        states: dict[str, HeldState] = {}
        for src in range(self.comm.world_size):
            owned = [(job.name, family_of(job.solver)) for job in jobs if owners[job.name] == src]
            payload = Payload()
            for name, family in owned:
                mine = src == self.comm.rank
                payload.add(name, solutions[name] if mine else family.solution_template(prepared[name]))
            received = self.comm.broadcast(payload, src)
            for name, family in owned:
                states[name] = family.assemble(prepared[name], received.fields(name), context)
        return states

    def _rejected(self, jobs: Sequence[UpdateJob], states: dict[str, HeldState]) -> list[str]:
        """Layers whose new state is non-finite, agreed on by all ranks (one host sync)."""
        device = jobs[0].batch.math.weight.device
        flags = torch.stack(
            [
                torch.stack([torch.isfinite(t).all() for t in tensors.values()]).all()
                if (tensors := states[job.name].tensors())
                else torch.tensor(True, device=device)
                for job in jobs
            ]
        )
        if self.comm.world_size > 1 and self.strategy == "gradient":
            flags = self.comm.all_true(flags)
        return [job.name for job, ok in zip(jobs, flags.tolist(), strict=True) if not ok]

    # ---------------------------------------------------------------- every step
    def precondition(
        self, layers: Sequence[RegisteredLayer], grads: Sequence[Tensor]
    ) -> list[tuple[RegisteredLayer, Tensor, Tensor]]:
        """(layer, ∇W, V̂) for every layer that has a state; owners broadcast under "gradient"."""
        ready = [(layer, grad) for layer, grad in zip(layers, grads, strict=True) if layer.state is not None]
        results: dict[str, Tensor] = {}
        for layer, grad in ready:
            if isinstance(layer.state, LayerState):
                results[layer.name] = layer.state.precondition(grad)
        if self.strategy == "gradient" and self.comm.world_size > 1:
            for src in range(self.comm.world_size):
                owned = [(layer.name, grad) for layer, grad in ready if layer.owner == src]
                payload = Payload({(name, "grad"): results.get(name, torch.empty_like(grad)) for name, grad in owned})
                received = self.comm.broadcast(payload, src)
                results.update((name, received[(name, "grad")]) for name, _ in owned)
        return [(layer, grad, results[layer.name]) for layer, grad in ready]
