"""The group kernels: a family's batched apply of a group of equal layers between updates, and its split around
the ranks' exchange under FSDP2 (docs/design.md, "The apply plan"; docs/distributed.md, "FSDP2"); and the
collective a family's contribution or a kernel's partial product needs (:class:`Exchange`)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hylo.layers.gradmatrix import GradMatrix, GradShard

if TYPE_CHECKING:
    from hylo.solvers.base import LayerState


class Exchange(enum.Enum):
    """The collective a family's contribution needs."""

    MEAN = "weighted mean over ranks (all-reduce)"
    ROWS = "every rank's rows, concatenated in rank order (all-gather)"
    SUM = "sum over ranks (all-reduce)"


def stacked(tensors: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``tensors`` stacked in ``dtype`` for a group kernel: a view, no copy, of a group of one in its own dtype."""
    if len(tensors) == 1:
        return tensors[0].unsqueeze(0).to(dtype)
    return torch.stack(list(tensors)).to(dtype)


class GroupKernel(ABC):
    """The batched apply of a group of states (docs/design.md, "The apply plan"): built once from the states
    (their tensors stacked), then applied at every step until they change."""

    def tensors(self) -> list[Tensor]:
        """The tensors the kernel holds (its stacked copies; counted by ``memory_breakdown``)."""
        return [value for value in vars(self).values() if isinstance(value, Tensor)]

    @abstractmethod
    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """V̂ of every layer of the group from its stacked gradients ``grads`` (k, d_g, d_a), in the working dtype
        the kernel was built in (bias last), as a new tensor the caller may overwrite, and each state's successor
        (itself unless it :attr:`~LayerState.advances`); ``states``: the group's states now, in the order the
        kernel was built with."""

    @classmethod
    def apply_all(
        cls, kernels: Sequence[GroupKernel], grads: Sequence[Tensor], states: Sequence[Sequence[LayerState]]
    ) -> list[tuple[Tensor, list[LayerState]]]:
        """:meth:`apply` of every group whose kernel is of this type, in one call: by default group by group; a
        kernel whose per-step work is elementwise (Adam's moments) runs it over every group's layers at once."""
        return [kernel.apply(g, s) for kernel, g, s in zip(kernels, grads, states, strict=True)]

    def shard_partial(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState]
    ) -> list[tuple[Exchange, Tensor]]:
        """Under FSDP2, what :meth:`apply` needs from the other ranks' rows (``shard.axis`` 0) or columns (1) of
        every layer's ∇W, from this rank's (``grads``: (k, rows, d_a) or (k, d_g, columns), bias last), as pieces
        the ranks combine by their :class:`Exchange` (:attr:`Exchange.ROWS`: concatenated along dim 0): one per
        layer, or one for the whole group (docs/distributed.md, "FSDP2"). By default the gradients themselves,
        gathered whole (:func:`gathered_rows`); a kernel that needs less overrides this and :meth:`shard_finish`."""
        return [(Exchange.ROWS, gathered_rows(grads, shard))]

    def shard_finish(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState], received: Sequence[Tensor]
    ) -> tuple[Tensor, list[LayerState]]:
        """This rank's rows (or columns) of every layer's V̂ from its ``grads`` and the combined pieces of
        :meth:`shard_partial`, as :meth:`apply` returns them, and each state's successor. By default :meth:`apply`
        on the whole gradients, every rank alike (a state that advances does so on every rank)."""
        result, successors = self.apply(whole_from_rows(received[0], shard), states)
        return own_rows(result, shard), successors

    @classmethod
    def shard_finish_all(
        cls,
        kernels: Sequence[GroupKernel],
        grads: Sequence[Tensor],
        shards: Sequence[GradShard],
        states: Sequence[Sequence[LayerState]],
        received: Sequence[Sequence[Tensor]],
    ) -> list[tuple[Tensor, list[LayerState]]]:
        """:meth:`shard_finish` of every group whose kernel is of this type, in one call (as :meth:`apply_all`): a
        type that keeps the default split runs :meth:`apply_all` on every group's whole gradients at once."""
        if cls.shard_finish is GroupKernel.shard_finish:
            wholes = [whole_from_rows(pieces[0], shard) for pieces, shard in zip(received, shards, strict=True)]
            applied = cls.apply_all(kernels, wholes, states)
            return [(own_rows(result, shard), after) for (result, after), shard in zip(applied, shards, strict=True)]
        return [
            kernel.shard_finish(g, shard, s, r)
            for kernel, g, shard, s, r in zip(kernels, grads, shards, states, received, strict=True)
        ]


def gathered_rows(grads: Tensor, shard: GradShard) -> Tensor:
    """A group's local ∇W (k, rows, d_a) (or (k, d_g, columns)) as rows to all-gather: (rows, k, d_a) (or
    (columns, k, d_g)), so that concatenating the ranks' along dim 0 gives every layer's whole ∇W."""
    return (grads.transpose(0, 1) if shard.axis == 0 else grads.permute(2, 0, 1)).contiguous()


def whole_from_rows(gathered: Tensor, shard: GradShard) -> Tensor:
    """The (k, d_g, d_a) tensors from their rows gathered by :func:`gathered_rows` (a view)."""
    return gathered.transpose(0, 1) if shard.axis == 0 else gathered.permute(1, 2, 0)


def own_rows(results: Tensor, shard: GradShard) -> Tensor:
    """This rank's rows (or columns) of a group's whole (k, d_g, d_a) results under FSDP2 (a view)."""
    if shard.axis == 0:
        return results[:, shard.start : shard.stop]
    return results[:, :, shard.start : shard.stop]


class LoopKernel(GroupKernel):
    """Each state's own :meth:`LayerState.advance`, layer by layer: what a family without a group kernel gets
    (under FSDP2 on every layer's whole ∇W, the default split)."""

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """Every state advanced on its gradient, the results stacked."""
        results, successors = [], []
        for grad, state in zip(grads.unbind(0), states, strict=True):
            result, successor = state.advance(grad)
            results.append(result.to(grads.dtype))
            successors.append(successor)
        return torch.stack(results), successors


def applied_alone(
    kernel: GroupKernel, state: LayerState, grad: Tensor | GradMatrix, dtype: torch.dtype
) -> tuple[Tensor, LayerState]:
    """``state`` applied on its own by ``kernel`` (built on ``[state]`` in ``dtype``, the state's working dtype):
    the per-layer form of a family that writes its step once, as its group kernel (docs/design.md, "The apply
    plan"); ∇W whole or as its parts."""
    whole = GradMatrix.of(grad).full().to(dtype)
    result, successors = kernel.apply(whole.unsqueeze(0), [state])
    return result[0], successors[0]
