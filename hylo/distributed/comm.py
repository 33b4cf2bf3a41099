"""Fused collectives over torch.distributed (gloo on CPU, NCCL on CUDA) and a 1-rank stand-in.

Every collective takes a list of tensors (one or more per layer) and moves them as one
flat buffer per dtype, so an update step issues a fixed number of collectives whatever
the number of layers. ``bytes_sent`` counts the payload this rank contributes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflatten(flat: Tensor, like: Sequence[torch.Size]) -> list[Tensor]:
    out, offset = [], 0
    for shape in like:
        n = int(torch.Size(shape).numel())
        out.append(flat[offset : offset + n].reshape(shape))
        offset += n
    return out


class Communicator(ABC):
    """What the preconditioner needs from the ranks; injectable for tests."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        self.bytes_sent = 0

    @abstractmethod
    def all_gather_rows(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Concatenate each tensor along dim 0 over ranks, in rank order (row counts may differ)."""

    @abstractmethod
    def all_reduce_weighted_mean(self, tensors: Sequence[Tensor], weights: Sequence[float]) -> list[Tensor]:
        """Σ_p w_p X_p / Σ_p w_p for each tensor X, with w_p this rank's weight for X."""

    @abstractmethod
    def broadcast(self, tensors: Sequence[Tensor], src: int) -> list[Tensor]:
        """Every rank receives ``src``'s tensors (other ranks pass tensors of the same shapes)."""


class LocalCommunicator(Communicator):
    """World size 1: every collective is the identity and nothing is sent."""

    rank = 0
    world_size = 1

    def all_gather_rows(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Identity."""
        return list(tensors)

    def all_reduce_weighted_mean(self, tensors: Sequence[Tensor], weights: Sequence[float]) -> list[Tensor]:
        """Identity."""
        return list(tensors)

    def broadcast(self, tensors: Sequence[Tensor], src: int) -> list[Tensor]:
        """Identity."""
        return list(tensors)


class TorchCommunicator(Communicator):
    """Collectives on an initialised torch.distributed process group."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _by_dtype(self, tensors: Sequence[Tensor]) -> dict[torch.dtype, list[int]]:
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        return groups

    def all_gather_rows(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Size exchange, then one padded all-gather per dtype; rows trimmed and concatenated."""
        if not tensors:
            return []
        device = tensors[0].device
        counts = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64, device=device)
        all_counts = [torch.empty_like(counts) for _ in range(self.world_size)]
        dist.all_gather(all_counts, counts, group=self.group)
        per_rank = torch.stack(all_counts).cpu()  # (P, layers): one host sync
        max_rows = per_rank.max(dim=0).values.tolist()
        out: list[Tensor] = [tensors[0]] * len(tensors)
        for indices in self._by_dtype(tensors).values():
            padded = []
            for i in indices:
                t = tensors[i]
                pad = max_rows[i] - t.shape[0]
                padded.append(torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t)
            flat = _flatten(padded).contiguous()
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
            self.bytes_sent += flat.numel() * flat.element_size()
            dist.all_gather(gathered, flat, group=self.group)
            pieces = [_unflatten(buf, [p.shape for p in padded]) for buf in gathered]
            for j, i in enumerate(indices):
                out[i] = torch.cat([pieces[p][j][: int(per_rank[p, i])] for p in range(self.world_size)])
        return out

    def all_reduce_weighted_mean(self, tensors: Sequence[Tensor], weights: Sequence[float]) -> list[Tensor]:
        """One all-reduce per dtype of every w·X followed by the weights themselves."""
        if not tensors:
            return []
        out: list[Tensor] = [tensors[0]] * len(tensors)
        for indices in self._by_dtype(tensors).values():
            items = [tensors[i] * weights[i] for i in indices]
            w = items[0].new_tensor([float(weights[i]) for i in indices])
            flat = _flatten([*items, w]).contiguous()
            self.bytes_sent += flat.numel() * flat.element_size()
            dist.all_reduce(flat, group=self.group)
            parts = _unflatten(flat, [*(t.shape for t in items), w.shape])
            totals = parts[-1]
            for j, i in enumerate(indices):
                out[i] = parts[j] / totals[j]
        return out

    def broadcast(self, tensors: Sequence[Tensor], src: int) -> list[Tensor]:
        """One broadcast per dtype."""
        if not tensors:
            return []
        out: list[Tensor] = [tensors[0]] * len(tensors)
        for indices in self._by_dtype(tensors).values():
            items = [tensors[i] for i in indices]
            flat = _flatten(items).contiguous()
            if self.rank == src:
                self.bytes_sent += flat.numel() * flat.element_size()
            dist.broadcast(flat, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
            for i, t in zip(indices, _unflatten(flat, [t.shape for t in items]), strict=True):
                out[i] = t
        return out


def default_communicator() -> Communicator:
    """A TorchCommunicator on the default group when one is initialised with >1 rank, else local."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCommunicator()
    return LocalCommunicator()
