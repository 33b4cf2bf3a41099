"""The update stage: local reduction, fused gathers, owner solves, and broadcasts (DESIGN.md §5).

At an update step, for P ranks:

1. every rank builds its local data for every layer: K-FAC batch factors (all-reduce launched
   asynchronously) and, overlapping it, the low-rank rows reduced locally (KIS sample / KID
   skeleton and W_p), sent in one bucketed all-gather;
2. each layer gets one owner by greedy longest-processing-time on its estimated solve cost;
3. owners eigendecompose (K-FAC) or build M (SMW) for their layers, batched by shape;
4. ``strategy="inverse"``: owners broadcast the solved state, every rank preconditions every
   layer locally with no traffic between updates. ``strategy="gradient"``: only the owner keeps
   the state; every step it preconditions its layers and broadcasts the result (less memory
   per rank, a broadcast of every gradient each step).

With one rank every collective is the identity and rank 0 owns everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.distributed import Communicator, assign_owners
from hylo.policy import EIGH_COST
from hylo.registry import RegisteredLayer
from hylo.solvers import (
    KFACState,
    LowRankState,
    LowRankUpdate,
    blend_factors,
    kfac_update_many,
    lowrank_update_many,
)
from hylo.solvers.reduce import kid_skeleton, kis_select

#: Ways to share solved layers between ranks.
STRATEGIES = ("inverse", "gradient")


@dataclass
class RemoteState:
    """A layer another rank owns (``strategy="gradient"``); K-FAC keeps its running factors here."""

    kind: str
    owner: int
    damping: float
    factor_a: Tensor | None = None
    factor_g: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        """Running K-FAC factors, if any."""
        if self.factor_a is None or self.factor_g is None:
            return {}
        return {"factor_a": self.factor_a, "factor_g": self.factor_g}

    def nbytes(self) -> int:
        """Bytes held on this rank."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


LayerState = KFACState | LowRankState | RemoteState


def solve_cost(solver: str, d_a: int, d_g: int, kept: int) -> float:
    """Estimated multiply-adds of an owner's solve: eigendecompositions or kernel + SMW."""
    if solver == "kfac":
        return EIGH_COST * (d_a**3 + d_g**3)
    return kept**2 * (d_a + d_g) + kept**3


def _factors_of(state: LayerState | None) -> tuple[Tensor, Tensor] | None:
    """The running K-FAC factors a state carries, if any."""
    if isinstance(state, KFACState):
        return state.factor_a, state.factor_g
    if isinstance(state, RemoteState) and state.factor_a is not None and state.factor_g is not None:
        return state.factor_a, state.factor_g
    return None


class UpdateStage:
    """Runs the update and the per-step preconditioning across ranks for a list of layers."""

    def __init__(self, config: HyLoConfig, comm: Communicator) -> None:
        self.config = config
        self.comm = comm
        self.owners: dict[str, int] = {}  # owners chosen at the latest update

    # ---------------------------------------------------------------- update
    def update(
        self, layers: Sequence[RegisteredLayer], step: int, damping: float, decay: float, base_seed: int
    ) -> tuple[dict[str, LayerState], list[str]]:
        """New states for every layer (not yet stored) and the layers whose result is non-finite."""
        comm = self.comm
        kfac_layers = [layer for layer in layers if layer.solver == "kfac"]
        lowrank_layers = [layer for layer in layers if layer.solver != "kfac"]

        factors: list[Tensor] = []
        weights: list[float] = []
        for layer in kfac_layers:
            a_batch, g_batch, rows = _batch_factors(layer)
            factors += [a_batch, g_batch]
            weights += [float(rows), float(rows)]
        kfac_pending = comm.all_reduce_weighted_mean(factors, weights, [x.name for x in kfac_layers for _ in (0, 1)])

        payload, tags = self._local_lowrank(lowrank_layers, base_seed)
        gathered = comm.all_gather_rows(payload, tags).wait()
        updates = _lowrank_updates(lowrank_layers, gathered)
        reduced = kfac_pending.wait()

        running = {
            layer.name: blend_factors(_factors_of(layer.state), (reduced[2 * i], reduced[2 * i + 1]), decay)
            for i, layer in enumerate(kfac_layers)
        }
        update_of = {layer.name: u for layer, u in zip(lowrank_layers, updates, strict=True)}
        costs = [
            solve_cost(
                layer.solver,
                layer.math.d_a,
                layer.math.d_g,
                update_of[layer.name].a.shape[0] if layer.name in update_of else 0,
            )
            for layer in layers
        ]
        owners = assign_owners(costs, comm.world_size)
        self.owners = {layer.name: owner for layer, owner in zip(layers, owners, strict=True)}
        mine = [layer for layer in layers if self.owners[layer.name] == comm.rank]

        states: dict[str, LayerState] = {}
        own_kfac = [layer for layer in mine if layer.solver == "kfac"]
        for layer, state in zip(own_kfac, kfac_update_many([running[x.name] for x in own_kfac], damping), strict=True):
            states[layer.name] = state
        own_low = [layer for layer in mine if layer.solver != "kfac"]
        solved = lowrank_update_many([update_of[x.name] for x in own_low], damping, [x.solver for x in own_low])
        for layer, low_state in zip(own_low, solved, strict=True):
            states[layer.name] = low_state

        if self.config.strategy == "inverse" and comm.world_size > 1:
            self._share_states(layers, states, running, update_of, damping)
        else:
            for layer in layers:
                if layer.name not in states:
                    fa, fg = running.get(layer.name, (None, None))
                    states[layer.name] = RemoteState(layer.solver, self.owners[layer.name], damping, fa, fg)
        return states, self._rejected(layers, states)

    def _local_lowrank(self, layers: Sequence[RegisteredLayer], base_seed: int) -> tuple[list[Tensor], list[str]]:
        """Per layer: kept rows a, g, flattened W_p (KID) and [n, r], reduced on this rank."""
        payload: list[Tensor] = []
        tags: list[str] = []
        for index, layer in enumerate(layers):
            a, g = _rows(layer)
            n = a.shape[0]
            r = self.config.rows_kept(n) if layer.solver in ("kid", "kis") else n
            weights = a.new_zeros(0, 1)
            if layer.solver == "kis" and r < n:
                generator = torch.Generator().manual_seed((base_seed + 7919 * index + self.comm.rank) % 2**63)
                keep = kis_select(a, g, r, generator)
                a, g = a.index_select(0, keep), g.index_select(0, keep)
            elif layer.solver == "kid":
                if r < n:
                    keep, w_local = kid_skeleton(a, g, r)
                    a, g = a.index_select(0, keep), g.index_select(0, keep)
                else:
                    w_local = torch.eye(n, dtype=a.dtype, device=a.device)
                weights = w_local.reshape(-1, 1)
            payload += [a, g, weights, a.new_tensor([[float(n), float(r)]])]
            tags += [layer.name] * 4
        return payload, tags

    def _share_states(
        self,
        layers: Sequence[RegisteredLayer],
        states: dict[str, LayerState],
        running: dict[str, tuple[Tensor, Tensor]],
        update_of: dict[str, LowRankUpdate],
        damping: float,
    ) -> None:
        """strategy="inverse": each owner broadcasts its solved tensors; all ranks rebuild every state."""
        for src in range(self.comm.world_size):
            owned = [layer for layer in layers if self.owners[layer.name] == src]
            tensors: list[Tensor] = []
            tags: list[str] = []
            for layer in owned:
                mine = states.get(layer.name)
                if layer.solver == "kfac":
                    fa, fg = running[layer.name]
                    if isinstance(mine, KFACState):
                        parts = [mine.evals_a, mine.evecs_a, mine.evals_g, mine.evecs_g]
                    else:
                        parts = [
                            fa.new_empty(fa.shape[0]),
                            torch.empty_like(fa),
                            fg.new_empty(fg.shape[0]),
                            torch.empty_like(fg),
                        ]
                else:
                    u = update_of[layer.name]
                    parts = [
                        mine.inner if isinstance(mine, LowRankState) else u.a.new_empty(u.a.shape[0], u.a.shape[0])
                    ]
                tensors += parts
                tags += [layer.name] * len(parts)
            received = iter(self.comm.broadcast(tensors, src, tags))
            for layer in owned:
                if layer.solver == "kfac":
                    fa, fg = running[layer.name]
                    ea, qa, eg, qg = (next(received) for _ in range(4))
                    states[layer.name] = KFACState(fa, fg, ea, qa, eg, qg, damping)
                else:
                    u = update_of[layer.name]
                    states[layer.name] = LowRankState(u.a, u.g, next(received), float(u.divisor), damping, layer.solver)

    def _rejected(self, layers: Sequence[RegisteredLayer], states: dict[str, LayerState]) -> list[str]:
        """Layers whose new state is non-finite, agreed on by all ranks (one host sync)."""
        device = layers[0].math.weight.device
        flags = torch.stack(
            [
                torch.stack([torch.isfinite(t).all() for t in states[layer.name].tensors().values()]).all()
                if states[layer.name].tensors()
                else torch.tensor(True, device=device)
                for layer in layers
            ]
        ).to(torch.float32)
        if self.comm.world_size > 1 and self.config.strategy == "gradient":
            (flags,) = self.comm.all_reduce_weighted_mean([flags], [1.0]).wait()
        return [layer.name for layer, ok in zip(layers, flags.tolist(), strict=True) if ok != 1.0]

    # ---------------------------------------------------------------- every step
    def precondition(
        self, layers: Sequence[RegisteredLayer], grads: Sequence[Tensor]
    ) -> list[tuple[RegisteredLayer, Tensor, Tensor]]:
        """(layer, ∇W, V̂) for every layer that has a state; owners broadcast under "gradient"."""
        ready = [(layer, grad) for layer, grad in zip(layers, grads, strict=True) if layer.state is not None]
        results: dict[str, Tensor] = {}
        for layer, grad in ready:
            if not isinstance(layer.state, RemoteState):
                assert layer.state is not None
                results[layer.name] = layer.state.precondition(grad)
        if self.config.strategy == "gradient" and self.comm.world_size > 1:
            for src in range(self.comm.world_size):
                owned = [(layer, grad) for layer, grad in ready if layer.owner == src]
                tensors = [results.get(layer.name, torch.empty_like(grad)) for layer, grad in owned]
                for (layer, _), v in zip(
                    owned, self.comm.broadcast(tensors, src, [x.name for x, _ in owned]), strict=True
                ):
                    results[layer.name] = v
        return [(layer, grad, results[layer.name]) for layer, grad in ready]


def _calls(layer: RegisteredLayer) -> list[tuple[Tensor, Tensor]]:
    """(input, output gradient) of each of this step's forward calls of the layer."""
    return [(r.inputs, r.grad_output) for r in layer.capture.complete() if r.grad_output is not None]


def _batch_factors(layer: RegisteredLayer) -> tuple[Tensor, Tensor, int]:
    """K-FAC batch factors over all of this step's calls, and the step's sample count."""
    calls = _calls(layer)
    counts = [layer.math.row_counts(x, gy) for x, gy in calls]
    samples, kfac_rows = sum(c[0] for c in counts), sum(c[1] for c in counts)
    sums = [layer.math.kfac_factors(x, gy, float(samples)) for x, gy in calls]
    a = torch.stack([s[0] for s in sums]).sum(0) / kfac_rows
    g = torch.stack([s[1] for s in sums]).sum(0) / samples
    return a, g, samples


def _rows(layer: RegisteredLayer) -> tuple[Tensor, Tensor]:
    """Per-sample rows of all of this step's calls, g scaled by the step's sample count."""
    calls = _calls(layer)
    samples = sum(layer.math.row_counts(x, gy)[0] for x, gy in calls)
    pairs = [layer.math.lowrank_rows(x, gy, float(samples)) for x, gy in calls]
    return torch.cat([a for a, _ in pairs]), torch.cat([g for _, g in pairs])


def _lowrank_updates(layers: Sequence[RegisteredLayer], gathered: Sequence[Tensor]) -> list[LowRankUpdate]:
    """Gathered rows → SMW inputs: divisor B (SNGD, KID) or m (KIS), KID's block-diagonal W."""
    if not layers:
        return []
    counts = torch.stack([gathered[4 * i + 3] for i in range(len(layers))]).tolist()  # one host sync
    updates = []
    for i, layer in enumerate(layers):
        a, g, w_flat = gathered[4 * i], gathered[4 * i + 1], gathered[4 * i + 2]
        total_rows = sum(int(n) for n, _ in counts[i])
        if layer.solver == "kis":
            updates.append(LowRankUpdate(a, g, a.shape[0]))
        elif layer.solver == "kid":
            sizes = [int(r) for _, r in counts[i]]
            flat_blocks = torch.split(w_flat.flatten(), [s * s for s in sizes])
            blocks = [block.reshape(s, s) for block, s in zip(flat_blocks, sizes, strict=True)]
            updates.append(LowRankUpdate(a, g, total_rows, torch.block_diag(*blocks)))
        else:
            updates.append(LowRankUpdate(a, g, total_rows))
    return updates
