"""FSDP2: every rank holds every state and rows (or columns) of every ∇W (docs/distributed.md, "FSDP2";
docs/design.md, "Placements"). :func:`fsdp2_sharded` checks at construction that the layers are sharded as hylo
supports; the norms of every ∇W are then summed over the ranks' rows.

The apply plan, with each group's kernel split around the exchange: every group's
:meth:`~hylo.solvers.kernel.GroupKernel.shard_partial` (from this rank's rows of its layers' ∇W) goes into one
fused all-reduce (sums, e.g. the low-rank projections) and one fused all-gather (rows, e.g. K-FAC's ∇W Q_a), then
every group's :meth:`~hylo.solvers.kernel.GroupKernel.shard_finish` gives this rank's rows of V̂. The check's sums
over this rank's rows are made every rank's by one all-reduce, so that every rank decides each fallback and
``kl_clip`` alike. A step costs the same operations and collectives for 4 equal layers as for 16.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.distributed import Communicator
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.sharded import is_sharded, local
from hylo.payload import CONTROL, Payload, PayloadKey
from hylo.pipeline.apply import Group, GroupedApply, kernel_batches, naming
from hylo.pipeline.placement.base import Applied, Placement, Ready
from hylo.pipeline.placement.local import apply_here
from hylo.pipeline.stage import UpdateStage
from hylo.solvers import LayerState
from hylo.solvers.base import Clock
from hylo.solvers.kernel import Exchange
from hylo.state import RegisteredLayer

#: The payload keys of the check's terms, summed over the ranks, of the layers' shards, gathered, and of the norms.
TERMS: PayloadKey = (CONTROL, "results")
SHARDS: PayloadKey = (CONTROL, "shards")
NORMS: PayloadKey = (CONTROL, "norms")


def fsdp2_sharded(layers: Sequence[RegisteredLayer], config: HyLoConfig, comm: Communicator) -> bool:
    """Whether the registered layers are sharded by ``fully_shard``; ``ValueError`` naming what is not supported.

    Every registered layer's weight must be sharded on dim 0 over a 1-D mesh of this communicator's
    ranks, in a layout its layer type maps to rows or columns of ∇W (no HSDP, no tensor parallel, no
    mix with unsharded layers), with ``strategy="inverse"``
    and no studies. Every rank raises alike (the layout is the same on every rank; the mesh's rank
    order is agreed in one collective).
    """
    sharded = [layer for layer in layers if is_sharded(layer.math.weight) or is_sharded(layer.math.bias)]
    if not sharded:
        return False
    problems: dict[str, list[str]] = {}
    for layer in sharded:
        if (problem := layer.math.sharding_problem()) is not None:
            problems.setdefault(problem, []).append(layer.name)
    if problems:
        listed = "; ".join(f"layers {names[:4]}: {problem}" for problem, names in problems.items())
        raise ValueError(
            f"FSDP2: hylo cannot precondition these sharded layers ({listed}); shard them with fully_shard on a "
            "1-D mesh, or leave them out with skip_layers"
        )
    plain = [layer.name for layer in layers if layer not in sharded]
    if plain:
        raise ValueError(
            f"FSDP2: layers {plain[:4]} are not sharded while {[layer.name for layer in sharded][:4]} are; hylo "
            "needs every registered layer sharded by fully_shard (shard the root module too) or none"
        )
    if config.distributed.strategy != "inverse":
        raise ValueError(
            f'FSDP2: strategy={config.distributed.strategy!r} is not supported on sharded models: use "inverse" '
            "(every rank holds every layer's state and preconditions its own rows)"
        )
    if config.telemetry.studies:
        raise ValueError(
            f"FSDP2: the studies {config.telemetry.studies} need whole gradients and are not supported on "
            "sharded models; run them without fully_shard (e.g. under DDP)"
        )
    mesh = sharded[0].math.weight.device_mesh  # type: ignore[attr-defined]
    here = int(mesh.get_coordinate()[0])
    device = local(sharded[0].math.weight).device
    same = comm.all_true(torch.tensor([mesh.size() == comm.world_size and here == comm.rank], device=device))
    if not bool(same.all()):
        raise ValueError(
            f"FSDP2: the parameters' device mesh ({mesh.size()} ranks, this rank at {here}) is not the "
            f"preconditioner's communicator ({comm.world_size} ranks, this rank {comm.rank}) in the same order on "
            "every rank; pass communicator=hylo.distributed.TorchCommunicator(group=the mesh's group)"
        )
    return True


class Sharded(Placement):
    """FSDP2: the apply plan on this rank's rows, its kernels' partial products exchanged (see the module
    docstring); ``grouped=False`` runs the same kernels one layer a group."""

    def __init__(self, stage: UpdateStage) -> None:
        super().__init__(stage)
        self.grouped = GroupedApply(kernels=self._exchanged, combine=self._summed, shards=self._every_ranks)
        self.singles = GroupedApply(
            singles=True, kernels=self._exchanged, combine=self._summed, shards=self._every_ranks
        )

    def tensors(self) -> list[Tensor]:
        """Both plans' stacked copies and limits."""
        return self.grouped.tensors() + self.singles.tensors()

    def check_gradient(self, name: str, grad: GradMatrix) -> None:
        """``ValueError`` unless ``grad`` is this rank's rows (or columns) of ∇W."""
        if grad.shard is None:
            raise ValueError(
                f"layer {name!r}: its parameters are no longer sharded by fully_shard as when the HyLoPreconditioner "
                "was built; build it on the model as it trains"
            )

    def norms(self, norms: Tensor) -> Tensor:
        """Per-layer ‖∇W‖ from each rank's norms of its rows (float64): √(Σ_p ‖∇W_p‖²), one all-reduce."""
        return self.comm.all_reduce(Payload({NORMS: norms.square()}), "sum").wait()[NORMS].sqrt()

    def safe_norms(self, grads: Sequence[GradMatrix | None], device: torch.device) -> list[Tensor]:
        """Per-layer ‖∇W‖ (float64, 0 where absent) that cannot overflow: the largest entry m over every rank's
        rows (an all-reduce by max), then m·√(Σ_p ‖∇W_p/m‖²) (an all-reduce by sum)."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        parts = [None if g is None or g.weight.numel() == 0 else g.full().to(torch.float64) for g in grads]
        largest = torch.stack([zero if g is None else torch.linalg.vector_norm(g, ord=float("inf")) for g in parts])
        largest = self.comm.all_reduce(Payload({NORMS: largest}), "max").wait()[NORMS]
        tiny = torch.finfo(torch.float64).tiny
        squares = torch.stack(
            [zero if g is None else (g / largest[i].clamp_min(tiny)).square().sum() for i, g in enumerate(parts)]
        )
        scaled = self.comm.all_reduce(Payload({NORMS: squares}), "sum").wait()[NORMS].sqrt()
        return list(torch.where(torch.isfinite(largest), scaled * largest, largest))

    def received(self, payload: Payload) -> Payload:
        """Own allocations of the broadcast tensors, aligned as a loaded checkpoint's (docs/distributed.md,
        "FSDP2")."""
        return Payload({key: tensor.clone() for key, tensor in payload.items()})

    def run(self, ready: Ready) -> Applied:
        """Each rank's rows of every result, decided over every rank's rows (every rank holds the same states, so
        a grouped kernel that raises does so on every rank, which all fall back alike)."""
        done = apply_here(self.grouped, self.singles, ready, range(len(ready.layers)))
        ready.kl_clipped(done.stacks, done.terms, done.norms, done.ok)
        return done.in_ready_order(), done.checked(), done.successors

    def _exchanged(
        self,
        groups: Sequence[Group],
        grads: Sequence[Tensor],
        states: Sequence[Sequence[LayerState]],
        names: Sequence[str],
        watch: Clock,
        alone: bool,
    ) -> list[tuple[Tensor, list[LayerState]]]:
        """Every group's kernel around one all-reduce and one all-gather of all groups' partial products; the groups
        of one kernel type finish in one call (as :func:`~hylo.pipeline.apply.apply_groups`), or with ``alone``
        each on its own (one layer a group: an error names its layer)."""
        payloads = {Exchange.SUM: Payload(), Exchange.ROWS: Payload()}
        keys: list[list[PayloadKey]] = []
        for group, grad, members in zip(groups, grads, states, strict=True):
            shard, mine = group.shard, [names[i] for i in group.members]
            assert shard is not None, "every layer is sharded under FSDP2"
            with naming(names, group.members, members):
                pieces = group.kernel.shard_partial(grad, shard, members)
            keys.append([])
            for p, (exchange, piece) in enumerate(pieces):
                layers = mine if len(pieces) == 1 else [mine[p]]
                key = (layers[0], f"partial {p}")
                payloads[exchange].add_shared(key, piece, layers)
                keys[-1].append(key)
        watch.lap("precondition", names)
        summed = self.comm.all_reduce(payloads[Exchange.SUM], "sum")
        gathered = self.comm.all_gather_rows(payloads[Exchange.ROWS])
        received = {**summed.wait(), **gathered.wait()}
        if watch.enabled:
            sizes = dict.fromkeys(names, 0)
            for payload in payloads.values():
                for key in payload:
                    owners = payload.owners(key)
                    for layer in owners:
                        sizes[layer] += received[key].numel() * received[key].element_size() // len(owners)
            watch.lap("gather", names, list(sizes.values()))
        finished: dict[int, tuple[Tensor, list[LayerState]]] = {}
        for chosen in kernel_batches(groups, alone):
            first = groups[chosen[0]]
            shards = [groups[i].shard for i in chosen]
            with naming(names, first.members if alone else [], states[chosen[0]]):
                done = type(first.kernel).shard_finish_all(
                    [groups[i].kernel for i in chosen],
                    [grads[i] for i in chosen],
                    [shard for shard in shards if shard is not None],
                    [states[i] for i in chosen],
                    [[received[key] for key in keys[i]] for i in chosen],
                )
            finished.update(zip(chosen, done, strict=True))
        return [finished[i] for i in range(len(groups))]

    def _every_ranks(self, grads: Sequence[GradMatrix]) -> list[Hashable]:
        """Each layer's rows (or columns) on every rank, from one all-gather when a plan is built: layers of one
        shape may be split differently (an attention's packed q, k and v), and every rank must group alike."""
        device = grads[0].device
        spans = torch.tensor([[g.shard.start, g.shard.stop] if g.shard else [0, 0] for g in grads], dtype=torch.long)
        gathered = self.comm.all_gather(Payload({SHARDS: spans.to(device)})).wait()[SHARDS]
        every = gathered.transpose(0, 1).tolist()  # (layers, ranks, 2): one host sync per plan
        return [(g.shard, tuple(map(tuple, spans_of))) for g, spans_of in zip(grads, every, strict=True)]

    def _summed(self, terms: Tensor) -> Tensor:
        """The check's terms of this rank's rows summed over the ranks (one all-reduce)."""
        return self.comm.all_reduce(Payload({TERMS: terms}), "sum").wait()[TERMS]
