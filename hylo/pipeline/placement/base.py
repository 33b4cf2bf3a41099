"""What every placement is handed and returns (docs/design.md, "Placements")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.layers.gradmatrix import GradMatrix
from hylo.numerics import kl_scale
from hylo.payload import Payload
from hylo.pipeline.apply import Checked
from hylo.pipeline.stage import UpdateStage
from hylo.solvers import HeldState, LayerState, family_of
from hylo.solvers.base import Clock, UpdateContext, UpdateJob
from hylo.state import RegisteredLayer


@dataclass(frozen=True)
class Ready:
    """What a step hands its placement: the ready layers with their gradients, each one's state and owner after
    this step's update, its index among the registered layers, every registered layer's ‖∇W‖ (float64, over every
    rank's rows), ``kl_clip`` and lr (or None), the options and the clock."""

    layers: Sequence[tuple[RegisteredLayer, GradMatrix]]
    states: Sequence[HeldState]
    owners: Sequence[int]
    indices: Sequence[int]
    norms: Tensor
    clip: tuple[float, float] | None
    config: HyLoConfig
    watch: Clock

    @property
    def names(self) -> list[str]:
        """The layers' names."""
        return [layer.name for layer, _ in self.layers]

    @property
    def grads(self) -> list[GradMatrix]:
        """The layers' ∇W."""
        return [grad for _, grad in self.layers]

    def held(self) -> list[LayerState]:
        """The states, every one held on this rank (the placements where every rank holds every state)."""
        held = [state for state in self.states if isinstance(state, LayerState)]
        assert len(held) == len(self.states), "every rank holds every state here"
        return held

    def layer_norms(self) -> list[Tensor]:
        """Each layer's ‖∇W‖ (0-dim)."""
        return [self.norms[i] for i in self.indices]

    def kl_clipped(self, results: Sequence[Tensor], terms: Tensor, norms: Tensor, ok: Tensor) -> None:
        """``results`` scaled in place by ``kl_clip``'s one factor (:func:`~hylo.numerics.kl_scale`) from each
        result's terms [⟨∇W, V̂⟩, ‖V̂‖²], ‖∇W‖ and whether it is sound: every placement's last step, from the same
        terms on every rank; nothing without ``kl_clip``."""
        if self.clip is not None:
            torch._foreach_mul_(list(results), kl_scale(terms, norms, ok, *self.clip))


#: Each layer's result (not yet written back), the check and the successors of the states that advance (not yet
#: stored).
Applied = tuple[list[Tensor], Checked, dict[str, LayerState]]


class Placement(ABC):
    """Every distribution decision of a step, for one layout of states and gradients (docs/design.md, "Placements"):
    the apply, the check and ``kl_clip`` (:meth:`run`); every layer's ‖∇W‖ over the ranks' parts of it
    (:meth:`norms`, :meth:`safe_norms`); which solved states every rank holds and their sharing after a solve
    (:meth:`shares`, :meth:`share`); the vote on rejected states (:meth:`agreed`); whether a layer another rank
    solved is applied (:attr:`applies_remote`) and restored from a rank's own checkpoint (:attr:`keeps_remote`).
    The defaults are :class:`~hylo.pipeline.placement.local.Local`'s: every rank holds every state and whole
    gradients."""

    #: Whether a layer whose state another rank solved (a :class:`~hylo.solvers.base.RemoteState` here) is still
    #: preconditioned at this step: its owner applies it and shares the result.
    applies_remote: ClassVar[bool] = False
    #: Whether a rank's own checkpoint restores the layers other ranks solved as theirs (their owners are the same
    #: ranks on reload); elsewhere such a layer is solved anew at the next update (docs/reliability.md).
    keeps_remote: ClassVar[bool] = False

    def __init__(self, stage: UpdateStage) -> None:
        self.stage = stage
        self.comm = stage.comm

    @abstractmethod
    def run(self, ready: Ready) -> Applied:
        """Each ready layer's result, the fallbacks and the successors of the states that advance."""

    def tensors(self) -> list[Tensor]:
        """Tensors the placement keeps between steps (counted by ``memory_breakdown``)."""
        return []

    def check_gradient(self, name: str, grad: GradMatrix) -> None:
        """``ValueError`` unless ``grad`` is laid out as this placement holds gradients: whole here."""
        if grad.shard is not None:
            raise ValueError(
                f"layer {name!r}: its parameters were sharded by fully_shard after the HyLoPreconditioner was built; "
                "build it on the sharded model"
            )

    def norms(self, norms: Tensor) -> Tensor:
        """Every layer's ‖∇W‖ (float64) from this rank's norms of its part of it: the same, whole here."""
        return norms

    def safe_norms(self, grads: Sequence[GradMatrix | None], device: torch.device) -> list[Tensor]:
        """Every layer's ‖∇W‖ (float64, 0 where absent) in a form that cannot overflow: the largest entry m, then
        m·‖∇W/m‖."""
        norms = []
        tiny = torch.finfo(torch.float64).tiny
        for parts in grads:
            if parts is None:
                norms.append(torch.zeros((), dtype=torch.float64, device=device))
                continue
            g = parts.full()
            largest = torch.linalg.vector_norm(g, ord=float("inf")).to(torch.float64)
            scaled = torch.linalg.vector_norm(g.to(torch.float64) / largest.clamp_min(tiny))
            norms.append(torch.where(torch.isfinite(largest), scaled * largest, largest))
        return norms

    def shares(self, solver: str) -> bool:
        """Whether every rank holds the solved state of a layer of ``solver``: all of them with P > 1."""
        return self.comm.world_size > 1

    def received(self, payload: Payload) -> Payload:
        """The solved tensors an owner broadcast, as the states keep them."""
        return payload

    def share(
        self,
        jobs: Sequence[UpdateJob],
        owners: Mapping[str, int],
        prepared: Mapping[str, Any],
        solutions: Mapping[str, dict[str, Tensor]],
        context: UpdateContext,
    ) -> dict[str, HeldState]:
        """Each owner broadcasts its solved tensors of ``jobs``; every rank assembles every one of their states."""
        states: dict[str, HeldState] = {}
        watch = context.watch
        for src in range(self.comm.world_size):
            owned = [(job.name, family_of(job.solver)) for job in jobs if owners[job.name] == src]
            payload = Payload()
            for name, family in owned:
                if src == self.comm.rank:
                    payload.add(name, solutions[name])
                else:  # a family without a template: this rank solves the layer itself to shape the buffers
                    template = family.solution_template(prepared[name])
                    payload.add(name, template or family.solve([prepared[name]], context)[0])
            received = self.received(self.comm.broadcast(payload, src))
            for family in dict.fromkeys(family for _, family in owned):
                names = [name for name, other in owned if other is family]
                assembled = family.assemble_all(
                    [prepared[name] for name in names], [received.fields(name) for name in names], context
                )
                states.update(zip(names, assembled, strict=True))
            names = [name for name, _ in owned]
            watch.lap("broadcast", names, payload.bytes_of(names) if watch.enabled else None)
        return states

    def agreed(self, flags: Tensor) -> Tensor:
        """Per job, whether its new state is finite: every rank holds the same states, and so the same flags."""
        return flags
