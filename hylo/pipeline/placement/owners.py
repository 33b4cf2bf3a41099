"""``strategy="gradient"`` with P > 1: each layer's owner applies and checks its state, then the ranks share the
results in one all-gather per dtype (docs/distributed.md, "Strategies"; docs/design.md, "Placements").

A layer's owner holds its solved state (the other ranks a :class:`~hylo.solvers.base.RemoteState`), except the
states that advance at every step (Adam's moments), which every rank holds and applies itself. Each rank applies
the layers it holds as :class:`~hylo.pipeline.placement.local.Local` does — per group, checked against its
bound, the raw gradient where a result is not sound — and packs the owned results, in the working dtype, with
their check (the terms [⟨∇W, V̂⟩, ‖V̂‖²] and the fallback flag) into one buffer per dtype, padded to the largest
rank's: one all-gather per dtype hands every rank every owner's results and checks. Every rank then holds the
one-process results and check of every layer, and computes ``kl_clip``'s scale from the same terms, so the ranks'
weights stay equal bit for bit. The layout of the buffers is fixed between updates: a step costs the same
operations whatever the number of layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch
from torch import Tensor

from hylo.payload import CONTROL, RESULTS, Payload, PayloadKey
from hylo.pipeline.apply import Checked, GroupedApply
from hylo.pipeline.placement.base import Applied, Placement, Ready
from hylo.pipeline.placement.local import apply_here
from hylo.pipeline.stage import UpdateStage
from hylo.solvers import LayerState, whole_step

#: The payload key of the owners' checks: per owned layer [⟨∇W, V̂⟩, ‖V̂‖², 1 if it fell back] (float64).
CHECKS: PayloadKey = (CONTROL, "checks")


def _results_key(dtype: torch.dtype) -> PayloadKey:
    return (RESULTS, str(dtype))


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a shared layer's result lies in the gathered buffers: its dtype's buffer, its owner's row, the offset
    and the (d_g, d_a) shape."""

    dtype: torch.dtype
    owner: int
    offset: int
    shape: tuple[int, int]


@dataclasses.dataclass
class Sharing:
    """The layout of a step's exchange, fixed while the ready layers, their owners and layouts are."""

    key: tuple[Hashable, ...]
    #: Positions in the ready list of the layers this rank applies (the states it holds that it owns or that
    #: advance), in ready order.
    members: list[int]
    #: Each shared layer's slot, by position in the ready list (the layers whose states do not advance).
    slots: dict[int, Slot]
    #: This rank's shared layers, in ready order, and their positions among ``members``.
    mine: list[int]
    mine_rows: Tensor | None
    #: Elements of each dtype's buffer per rank, and the check rows per rank (the most any rank owns).
    sizes: dict[torch.dtype, int]
    rows: int
    #: For every ready layer, its row in [every rank's gathered check rows; this rank's own rows].
    row_index: Tensor
    #: Each ready layer's index among the registered layers (None: all of them, in order).
    norm_index: Tensor | None


def _sharing(ready: Ready, rank: int, world_size: int, key: tuple[Hashable, ...], total: int) -> Sharing:
    """The exchange's layout (the same on every rank but for ``mine``)."""
    n = len(ready.layers)
    advancing = [isinstance(state, LayerState) and state.advances for state in ready.states]
    members = [
        i
        for i, state in enumerate(ready.states)
        if isinstance(state, LayerState) and (advancing[i] or ready.owners[i] == rank)
    ]
    offsets: list[dict[torch.dtype, int]] = [{} for _ in range(world_size)]
    counts = [0] * world_size
    slots: dict[int, Slot] = {}
    own_row: dict[int, int] = {}
    for i, (layer, grad) in enumerate(ready.layers):
        if advancing[i]:
            continue
        owner, dtype = ready.owners[i], layer.math.dtype
        shape = (int(grad.shape[0]), int(grad.shape[1]))
        offset = offsets[owner].get(dtype, 0)
        slots[i] = Slot(dtype, owner, offset, shape)
        offsets[owner][dtype] = offset + shape[0] * shape[1]
        own_row[i] = counts[owner]
        counts[owner] += 1
    sizes = {dtype: max(sizes.get(dtype, 0) for sizes in offsets) for dtype in {s.dtype for s in slots.values()}}
    rows = max(counts)
    device = ready.norms.device
    mine = [i for i in slots if slots[i].owner == rank]
    place = {i: k for k, i in enumerate(members)}
    missing = [ready.layers[i][0].name for i in mine if i not in place]
    assert not missing, f"this rank owns {missing} but holds no state for them"
    mine_rows = None
    if mine:  # padded to the most rows a rank owns with copies of the first (never read)
        padded = [place[i] for i in mine] + [place[mine[0]]] * (rows - len(mine))
        mine_rows = torch.tensor(padded, dtype=torch.long).to(device)
    index = [slots[i].owner * rows + own_row[i] if i in slots else world_size * rows + place[i] for i in range(n)]
    full = list(ready.indices)
    norm_index = None if full == list(range(total)) else torch.tensor(full, dtype=torch.long).to(device)
    row_index = torch.tensor(index, dtype=torch.long).to(device)
    return Sharing(key, members, slots, mine, mine_rows, sizes, rows, row_index, norm_index)


class Owners(Placement):
    """``strategy="gradient"`` with P > 1: owners apply and check, one all-gather per dtype shares the results and
    their checks (see the module docstring). Only the owner of a solved state holds it (the others a
    :class:`~hylo.solvers.base.RemoteState`), but for the states that advance at every step, which every rank holds
    and advances; a rejected state is rejected on every rank (one vote); a rank's own checkpoint restores what the
    others own as theirs."""

    applies_remote = True
    keeps_remote = True

    def __init__(self, stage: UpdateStage) -> None:
        super().__init__(stage)
        self.grouped = GroupedApply()
        self.singles = GroupedApply(singles=True)
        self.sharing: Sharing | None = None

    def tensors(self) -> list[Tensor]:
        """Both apply plans' stacked copies and limits, and the exchange's indices."""
        held = self.grouped.tensors() + self.singles.tensors()
        if self.sharing is not None:
            indices = [self.sharing.mine_rows, self.sharing.row_index, self.sharing.norm_index]
            held += [t for t in indices if t is not None]
        return held

    def shares(self, solver: str) -> bool:
        """Whether ``solver``'s states change at every step they are applied (Adam's moments): every rank then
        holds its own copy and advances it (docs/distributed.md, "Strategies")."""
        return whole_step(solver)

    def agreed(self, flags: Tensor) -> Tensor:
        """A state is rejected on every rank if it is on its owner (one all-reduce): the others hold none."""
        return self.comm.all_true(flags)

    def _sharing_for(self, ready: Ready) -> Sharing:
        key = tuple(
            (layer.name, owner, isinstance(state, LayerState), isinstance(state, LayerState) and state.advances)
            + (tuple(grad.shape), layer.math.dtype, grad.device, index)
            for (layer, grad), state, owner, index in zip(
                ready.layers, ready.states, ready.owners, ready.indices, strict=True
            )
        )
        if self.sharing is None or self.sharing.key != key:
            self.sharing = _sharing(ready, self.comm.rank, self.comm.world_size, key, len(ready.norms))
        return self.sharing

    def run(self, ready: Ready) -> Applied:
        """Every ready layer's result and check, each computed by its owner (or here, for a state that advances),
        then ``kl_clip`` on every rank from the same terms."""
        share = self._sharing_for(ready)
        device = ready.norms.device
        here = apply_here(self.grouped, self.singles, ready, share.members) if share.members else None
        own_rows = None
        results: dict[int, Tensor] = {}
        if here is not None:
            own_rows = torch.cat([here.terms, here.fell.to(torch.float64).unsqueeze(1)], 1)
            if here.placed is not None:
                own_rows = own_rows.index_select(0, here.placed)
            results.update(zip(share.members, here.in_ready_order(), strict=True))
        rows = own_rows
        if share.slots:
            payload = Payload(
                {
                    _results_key(dtype): torch.empty(size, dtype=dtype, device=device)
                    for dtype, size in share.sizes.items()
                }
            )
            if share.mine:
                assert own_rows is not None and share.mine_rows is not None
                slots = [self._view(payload[_results_key(share.slots[i].dtype)], share.slots[i]) for i in share.mine]
                torch._foreach_copy_(slots, [results[i] for i in share.mine])
                payload[CHECKS] = own_rows.index_select(0, share.mine_rows)
            else:
                payload[CHECKS] = torch.zeros(share.rows, 3, dtype=torch.float64, device=device)
            received = self.comm.all_gather(payload).wait()
            for i, slot in share.slots.items():
                results[i] = self._view(received[_results_key(slot.dtype)][slot.owner], slot)
            gathered = received[CHECKS].reshape(-1, 3)
            rows = gathered if own_rows is None else torch.cat([gathered, own_rows])
            names = [ready.layers[i][0].name for i in share.slots]
            sizes = [slot.shape[0] * slot.shape[1] * slot.dtype.itemsize for slot in share.slots.values()]
            ready.watch.lap("broadcast", names, sizes if ready.watch.enabled else None)
        assert rows is not None
        checks = rows.index_select(0, share.row_index)
        terms, fell = checks[:, :2], checks[:, 2]
        done = [results[i] for i in range(len(ready.layers))]  # each computed here or received
        if ready.clip is not None:
            norms = ready.norms if share.norm_index is None else ready.norms.index_select(0, share.norm_index)
            ready.kl_clipped(done, terms, norms, fell == 0)
        successors = here.successors if here is not None else {}
        return done, Checked(list(ready.indices), fell, terms), successors

    @staticmethod
    def _view(buffer: Tensor, slot: Slot) -> Tensor:
        """A slot's (d_g, d_a) view of one rank's flat buffer."""
        size = slot.shape[0] * slot.shape[1]
        return buffer[slot.offset : slot.offset + size].view(slot.shape)
