"""Fused, bucketed collectives over torch.distributed (gloo on CPU, NCCL on CUDA), and a 1-rank stand-in.

Every collective takes a list of tensors (several per layer) and moves them as flat
buffers, one per dtype and bucket, so an update issues a fixed handful of collectives
whatever the number of layers. Row gathers and weighted all-reduces are launched
asynchronously and return a :class:`Pending`; the caller overlaps other work before
``wait()``. ``bytes_sent`` / ``bytes_by_tag`` count the payload this rank contributes
(a gather's padded local rows, an all-reduce's buffer, a broadcast's buffer on its source).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_BUCKET_CAP_MB = 25.0


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[offset : offset + n].reshape(shape))
        offset += n
    return out


class CommunicationError(RuntimeError):
    """A collective failed, typically because another rank raised, exited or timed out."""


@contextmanager
def _guard(what: str, rank: int, world_size: int) -> Iterator[None]:
    """Re-raise backend errors of a collective as a :class:`CommunicationError` saying where."""
    try:
        yield
    except CommunicationError:
        raise
    except (RuntimeError, dist.DistError) as err:
        raise CommunicationError(
            f"hylo: {what} failed on rank {rank} of {world_size}; another rank most likely raised, "
            f"exited or fell behind (process-group timeout). Backend error: {err}"
        ) from err


class Pending:
    """Collectives in flight; ``wait()`` completes them and returns the results (once)."""

    def __init__(
        self,
        works: Sequence[dist.Work],
        finish: Callable[[], list[Tensor]],
        what: str = "",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self._where = (what, rank, world_size)

    def wait(self) -> list[Tensor]:
        """Block until every collective is done and return the results."""
        with _guard(*self._where):
            for work in self._works:
                work.wait()
        self._works = []
        return self._finish()


class Communicator(ABC):
    """What the preconditioner needs from the ranks; injectable for tests and simulations."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_by_tag: dict[str, int] = defaultdict(int)

    def _count(self, tensors: Sequence[Tensor], tags: Sequence[str] | None) -> None:
        for i, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            self.bytes_sent += nbytes
            if tags is not None:
                self.bytes_by_tag[tags[i]] += nbytes

    @abstractmethod
    def all_gather_rows(self, tensors: Sequence[Tensor], tags: Sequence[str] | None = None) -> Pending:
        """Concatenate each tensor along dim 0 over ranks, in rank order (row counts may differ)."""

    @abstractmethod
    def all_reduce_weighted_mean(
        self, tensors: Sequence[Tensor], weights: Sequence[float], tags: Sequence[str] | None = None
    ) -> Pending:
        """Σ_p w_p X_p / Σ_p w_p for each tensor X, with w_p this rank's weight for X."""

    @abstractmethod
    def broadcast(self, tensors: Sequence[Tensor], src: int, tags: Sequence[str] | None = None) -> list[Tensor]:
        """Every rank receives ``src``'s tensors (other ranks pass tensors of the same shapes)."""


class LocalCommunicator(Communicator):
    """World size 1: every collective is the identity and nothing is sent."""

    rank = 0
    world_size = 1

    def all_gather_rows(self, tensors: Sequence[Tensor], tags: Sequence[str] | None = None) -> Pending:
        """Identity."""
        return Pending([], lambda: list(tensors))

    def all_reduce_weighted_mean(
        self, tensors: Sequence[Tensor], weights: Sequence[float], tags: Sequence[str] | None = None
    ) -> Pending:
        """Identity."""
        return Pending([], lambda: list(tensors))

    def broadcast(self, tensors: Sequence[Tensor], src: int, tags: Sequence[str] | None = None) -> list[Tensor]:
        """Identity."""
        return list(tensors)


class TorchCommunicator(Communicator):
    """Collectives on an initialised torch.distributed process group.

    Args:
        group: the process group (default: the world).
        bucket_cap_mb: largest flat buffer of one collective; bigger payloads are split at
            tensor boundaries into several buckets, all in flight at once.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs an initialised torch.distributed process group")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.bucket_bytes = int(bucket_cap_mb * 2**20)

    def _buckets(self, tensors: Sequence[Tensor]) -> list[list[int]]:
        """Indices grouped by dtype/device, then cut into buckets of at most ``bucket_bytes``."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            by_kind[(t.dtype, t.device)].append(i)
        buckets: list[list[int]] = []
        for indices in by_kind.values():
            current: list[int] = []
            size = 0
            for i in indices:
                nbytes = tensors[i].numel() * tensors[i].element_size()
                if current and size + nbytes > self.bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append(i)
                size += nbytes
            buckets.append(current)
        return buckets

    def _guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _guard(what, self.rank, self.world_size)

    def _src(self, src: int) -> int:
        return dist.get_global_rank(self.group, src) if self.group is not None else src

    def all_gather_rows(self, tensors: Sequence[Tensor], tags: Sequence[str] | None = None) -> Pending:
        """Blocking size exchange, then padded all-gathers (async); rows trimmed on ``wait()``."""
        if not tensors:
            return Pending([], list)
        counts = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64, device=tensors[0].device)
        all_counts = [torch.empty_like(counts) for _ in range(self.world_size)]
        with self._guard("all-gather of row counts"):
            dist.all_gather(all_counts, counts, group=self.group)
        per_rank = torch.stack(all_counts).cpu()  # (P, tensors): the one host sync of a gather
        max_rows = per_rank.max(dim=0).values.tolist()
        padded = []
        for i, t in enumerate(tensors):
            pad = int(max_rows[i]) - t.shape[0]
            padded.append(torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t)
        self._count(padded, tags)
        works, received = [], []
        for bucket in self._buckets(padded):
            flat = _flatten([padded[i] for i in bucket]).contiguous()
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
            with self._guard("all-gather of low-rank rows"):
                works.append(dist.all_gather(gathered, flat, group=self.group, async_op=True))
            received.append((bucket, gathered))

        def finish() -> list[Tensor]:
            out: list[Tensor] = list(tensors)
            for bucket, gathered in received:
                pieces = [_unflatten(buf, [padded[i].shape for i in bucket]) for buf in gathered]
                for j, i in enumerate(bucket):
                    out[i] = torch.cat([pieces[p][j][: int(per_rank[p, i])] for p in range(self.world_size)])
            return out

        return Pending(works, finish, "all-gather of low-rank rows", self.rank, self.world_size)

    def all_reduce_weighted_mean(
        self, tensors: Sequence[Tensor], weights: Sequence[float], tags: Sequence[str] | None = None
    ) -> Pending:
        """Async all-reduces of every w·X, each bucket followed by its weights."""
        if not tensors:
            return Pending([], list)
        scaled = [t * float(w) for t, w in zip(tensors, weights, strict=True)]
        self._count(scaled, tags)
        works, reduced = [], []
        for bucket in self._buckets(scaled):
            w = scaled[bucket[0]].new_tensor([float(weights[i]) for i in bucket])
            flat = _flatten([*(scaled[i] for i in bucket), w]).contiguous()
            self.bytes_sent += w.numel() * w.element_size()
            with self._guard("all-reduce"):
                works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            reduced.append((bucket, flat))

        def finish() -> list[Tensor]:
            out: list[Tensor] = list(tensors)
            for bucket, flat in reduced:
                parts = _unflatten(flat, [*(scaled[i].shape for i in bucket), torch.Size([len(bucket)])])
                for j, i in enumerate(bucket):
                    out[i] = parts[j] / parts[-1][j]
            return out

        return Pending(works, finish, "all-reduce", self.rank, self.world_size)

    def broadcast(self, tensors: Sequence[Tensor], src: int, tags: Sequence[str] | None = None) -> list[Tensor]:
        """Bucketed broadcasts from ``src``, all in flight at once."""
        if not tensors:
            return []
        if self.rank == src:
            self._count(tensors, tags)
        works, sent = [], []
        for bucket in self._buckets(tensors):
            flat = _flatten([tensors[i] for i in bucket]).contiguous()
            with self._guard(f"broadcast from rank {src}"):
                works.append(dist.broadcast(flat, src=self._src(src), group=self.group, async_op=True))
            sent.append((bucket, flat))
        with self._guard(f"broadcast from rank {src}"):
            for work in works:
                work.wait()
        out: list[Tensor] = list(tensors)
        for bucket, flat in sent:
            for i, t in zip(bucket, _unflatten(flat, [tensors[i].shape for i in bucket]), strict=True):
                out[i] = t
        return out


def default_communicator(bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> Communicator:
    """A TorchCommunicator on the default group when one is initialised with >1 rank, else local."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCommunicator(bucket_cap_mb=bucket_cap_mb)
    return LocalCommunicator()
