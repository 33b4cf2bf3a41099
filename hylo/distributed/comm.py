"""Fused, bucketed collectives on named payloads (docs/distributed.md, "Communication").

Every collective takes a :class:`~hylo.payload.Payload` (tensors keyed by ``(layer, field)``)
and moves it as flat buffers, one per dtype and bucket, so an update issues a fixed handful of
collectives whatever the number of layers; the result is a payload with the same keys. Row
gathers and weighted means are launched asynchronously and return a :class:`Pending`; the
caller overlaps other work before ``wait()``.

Byte counts: ``bytes_by_tag[layer]`` is the payload this rank contributes for a layer (a
gather's padded local rows, a mean's buffer, a broadcast's buffer on its source);
``bytes_by_tag["<control>"]`` counts the rest (row counts, mean weights, agreement flags,
policy decisions); ``bytes_sent`` is their sum.

:class:`BucketedCommunicator` does the flattening, bucketing and padding on top of a
:class:`CollectiveBackend` — torch.distributed's default group for
:class:`TorchCommunicator`, or any object with the same three collectives (the tests
simulate a cluster of ranks as threads of one process this way).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from hylo.payload import CONTROL, Payload, PayloadKey

DEFAULT_BUCKET_CAP_MB = 25.0
ReduceOp = Literal["sum", "min", "max"]


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
    """Collectives in flight; ``wait()`` completes them and returns the resulting payload (once)."""

    def __init__(
        self,
        works: Sequence[Work],
        finish: Callable[[], Payload],
        what: str = "",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self._where = (what, rank, world_size)

    def wait(self) -> Payload:
        """Block until every collective is done and return the result."""
        with _guard(*self._where):
            for work in self._works:
                work.wait()
        self._works = []
        return self._finish()


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Communicator(ABC):
    """What the preconditioner needs from the ranks; injectable for tests and simulations."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_by_tag: dict[str, int] = defaultdict(int)

    def _count(self, tag: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.bytes_by_tag[tag] += nbytes

    def _count_payload(self, payload: Mapping[PayloadKey, Tensor], like: Payload | None = None) -> None:
        """Count each tensor's bytes to its key's layer, or in equal parts to the layers ``like`` (the payload it
        was made from, by default ``payload`` itself) shares it among (:attr:`Payload.shared`)."""
        source = like if like is not None else payload
        for key, tensor in payload.items():
            layers = source.owners(key) if isinstance(source, Payload) else (key[0],)
            nbytes = _nbytes(tensor)
            for i, layer in enumerate(layers):  # equal parts, the remainder to the first
                self._count(layer, nbytes // len(layers) + (nbytes % len(layers) if i == 0 else 0))

    @abstractmethod
    def all_gather_rows(self, payload: Payload) -> Pending:
        """Each tensor concatenated along dim 0 over ranks, in rank order (row counts may differ)."""

    @abstractmethod
    def all_reduce_mean(self, payload: Payload, weights: Mapping[PayloadKey, float]) -> Pending:
        """Σ_p w_p X_p / Σ_p w_p for each tensor X, with w_p this rank's weight for X's key."""

    @abstractmethod
    def all_reduce(self, payload: Payload, op: ReduceOp = "sum") -> Pending:
        """Each tensor reduced element-wise over ranks by ``op`` (every rank passes the same keys and shapes)."""

    @abstractmethod
    def broadcast(self, payload: Payload, src: int) -> Payload:
        """Every rank receives ``src``'s tensors (other ranks pass tensors of the same shapes)."""

    def all_gather(self, payload: Payload) -> Pending:
        """Every rank's tensors stacked in rank order, each (P, *shape) (every rank passes the same keys and
        shapes). By default one :meth:`broadcast` from each rank; a communicator with an all-gather overrides it."""
        gathered: dict[PayloadKey, list[Tensor]] = {key: [] for key in payload}
        for src in range(self.world_size):
            for key, tensor in self.broadcast(payload, src).items():
                gathered[key].append(tensor)
        stacked = Payload({key: torch.stack(tensors) for key, tensors in gathered.items()})
        return Pending([], lambda: stacked)

    @abstractmethod
    def all_true(self, flags: Tensor) -> Tensor:
        """Element-wise logical AND of a boolean tensor over ranks."""

    @abstractmethod
    def any_true(self, flags: Tensor) -> Tensor:
        """Element-wise logical OR of a boolean tensor over ranks."""


class LocalCommunicator(Communicator):
    """World size 1: every collective is the identity and nothing is sent."""

    rank = 0
    world_size = 1

    def all_gather_rows(self, payload: Payload) -> Pending:
        """Identity."""
        return Pending([], lambda: Payload(payload))

    def all_reduce_mean(self, payload: Payload, weights: Mapping[PayloadKey, float]) -> Pending:
        """Identity."""
        return Pending([], lambda: Payload(payload))

    def all_reduce(self, payload: Payload, op: ReduceOp = "sum") -> Pending:
        """Identity."""
        return Pending([], lambda: Payload(payload))

    def broadcast(self, payload: Payload, src: int) -> Payload:
        """Identity."""
        return Payload(payload)

    def all_gather(self, payload: Payload) -> Pending:
        """Each tensor with a leading dimension of 1."""
        return Pending([], lambda: Payload({key: tensor.unsqueeze(0) for key, tensor in payload.items()}))

    def all_true(self, flags: Tensor) -> Tensor:
        """Identity."""
        return flags.bool()

    def any_true(self, flags: Tensor) -> Tensor:
        """Identity."""
        return flags.bool()


class Work(Protocol):
    """A collective in flight."""

    def wait(self) -> Any:
        """Block until it is done."""


class CollectiveBackend(Protocol):
    """Three asynchronous collectives on flat tensors, as torch.distributed provides them."""

    rank: int
    world_size: int

    def all_gather(self, outputs: list[Tensor], tensor: Tensor) -> Work:
        """Fill ``outputs[p]`` with rank p's ``tensor`` (all the same shape)."""

    def all_reduce(self, tensor: Tensor, op: ReduceOp) -> Work:
        """Reduce ``tensor`` over ranks in place."""

    def broadcast(self, tensor: Tensor, src: int) -> Work:
        """Overwrite ``tensor`` with rank ``src``'s in place (``src`` is a rank of this backend)."""


class TorchBackend:
    """:class:`CollectiveBackend` on an initialised torch.distributed process group."""

    _OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, outputs: list[Tensor], tensor: Tensor) -> Work:
        """``dist.all_gather``, asynchronous."""
        return dist.all_gather(outputs, tensor, group=self.group, async_op=True)

    def all_reduce(self, tensor: Tensor, op: ReduceOp) -> Work:
        """``dist.all_reduce``, asynchronous."""
        return dist.all_reduce(tensor, op=self._OPS[op], group=self.group, async_op=True)

    def broadcast(self, tensor: Tensor, src: int) -> Work:
        """``dist.broadcast`` from the group's rank ``src``, asynchronous."""
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[offset : offset + n].reshape(shape))
        offset += n
    return out


class BucketedCommunicator(Communicator):
    """Payloads flattened into per-dtype buckets of at most ``bucket_cap_mb``, on a backend.

    Args:
        backend: the collectives between ranks.
        bucket_cap_mb: largest flat buffer of one collective; bigger payloads are split at
            tensor boundaries into several buckets, all in flight at once.
    """

    def __init__(self, backend: CollectiveBackend, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.backend = backend
        self.rank = backend.rank
        self.world_size = backend.world_size
        self.bucket_bytes = int(bucket_cap_mb * 2**20)

    def buckets(self, tensors: Sequence[Tensor]) -> list[list[int]]:
        """Indices grouped by dtype/device, then cut into buckets of at most ``bucket_bytes``."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            by_kind[(t.dtype, t.device)].append(i)
        buckets: list[list[int]] = []
        for indices in by_kind.values():
            current: list[int] = []
            size = 0
            for i in indices:
                nbytes = _nbytes(tensors[i])
                if current and size + nbytes > self.bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append(i)
                size += nbytes
            buckets.append(current)
        return buckets

    def _guard(self, what: str) -> AbstractContextManager[None]:
        return _guard(what, self.rank, self.world_size)

    def all_gather_rows(self, payload: Payload) -> Pending:
        """Blocking exchange of row counts, then padded all-gathers (async); rows trimmed on ``wait()``."""
        if not payload:
            return Pending([], Payload)
        keys, tensors = list(payload), list(payload.values())
        counts = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64, device=tensors[0].device)
        all_counts = [torch.empty_like(counts) for _ in range(self.world_size)]
        self._count(CONTROL, _nbytes(counts))
        with self._guard("all-gather of row counts"):
            self.backend.all_gather(all_counts, counts).wait()
        per_rank = torch.stack(all_counts).tolist()  # (P, tensors): the one host sync of a gather
        max_rows = [max(rows[i] for rows in per_rank) for i in range(len(tensors))]
        padded = []
        for i, t in enumerate(tensors):
            pad = max_rows[i] - t.shape[0]
            padded.append(torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t)
        self._count_payload(dict(zip(keys, padded, strict=True)), payload)
        works, received = [], []
        for bucket in self.buckets(padded):
            flat = _flatten([padded[i] for i in bucket]).contiguous()
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
            with self._guard("all-gather of rows"):
                works.append(self.backend.all_gather(gathered, flat))
            received.append((bucket, gathered))

        def finish() -> Payload:
            out = Payload(payload)
            for bucket, gathered in received:
                pieces = [_unflatten(buf, [padded[i].shape for i in bucket]) for buf in gathered]
                for j, i in enumerate(bucket):
                    out[keys[i]] = torch.cat([pieces[p][j][: per_rank[p][i]] for p in range(self.world_size)])
            return out

        return Pending(works, finish, "all-gather of rows", self.rank, self.world_size)

    def all_reduce_mean(self, payload: Payload, weights: Mapping[PayloadKey, float]) -> Pending:
        """Async all-reduces of every w·X, each bucket followed by its weights."""
        if not payload:
            return Pending([], Payload)
        keys = list(payload)
        scaled = [payload[key] * float(weights[key]) for key in keys]
        self._count_payload(dict(zip(keys, scaled, strict=True)), payload)
        works, reduced = [], []
        for bucket in self.buckets(scaled):
            w = scaled[bucket[0]].new_tensor([float(weights[keys[i]]) for i in bucket])
            flat = _flatten([*(scaled[i] for i in bucket), w]).contiguous()
            self._count(CONTROL, _nbytes(w))
            with self._guard("all-reduce"):
                works.append(self.backend.all_reduce(flat, "sum"))
            reduced.append((bucket, flat))

        def finish() -> Payload:
            out = Payload(payload)
            for bucket, flat in reduced:
                parts = _unflatten(flat, [*(scaled[i].shape for i in bucket), torch.Size([len(bucket)])])
                for j, i in enumerate(bucket):
                    out[keys[i]] = parts[j] / parts[-1][j]
            return out

        return Pending(works, finish, "all-reduce", self.rank, self.world_size)

    def all_reduce(self, payload: Payload, op: ReduceOp = "sum") -> Pending:
        """Async all-reduces by ``op``, one per bucket."""
        if not payload:
            return Pending([], Payload)
        keys, tensors = list(payload), list(payload.values())
        self._count_payload(payload)
        works, reduced = [], []
        for bucket in self.buckets(tensors):
            flat = _flatten([tensors[i] for i in bucket]).contiguous()
            with self._guard("all-reduce"):
                works.append(self.backend.all_reduce(flat, op))
            reduced.append((bucket, flat))

        def finish() -> Payload:
            out = Payload(payload)
            for bucket, flat in reduced:
                for i, t in zip(bucket, _unflatten(flat, [tensors[i].shape for i in bucket]), strict=True):
                    out[keys[i]] = t
            return out

        return Pending(works, finish, "all-reduce", self.rank, self.world_size)

    def all_gather(self, payload: Payload) -> Pending:
        """Async all-gathers, one per bucket, each into one (P, bucket) buffer (no copy on ``wait()``)."""
        if not payload:
            return Pending([], Payload)
        keys, tensors = list(payload), list(payload.values())
        self._count_payload(payload)
        works, gathered = [], []
        for bucket in self.buckets(tensors):
            flat = _flatten([tensors[i] for i in bucket]).contiguous()
            out = flat.new_empty((self.world_size, flat.numel()))
            with self._guard("all-gather"):
                works.append(self.backend.all_gather(list(out.unbind(0)), flat))
            gathered.append((bucket, out))

        def finish() -> Payload:
            result = Payload(payload)
            for bucket, out in gathered:
                offset = 0
                for i in bucket:
                    size = tensors[i].numel()
                    result[keys[i]] = out[:, offset : offset + size].view(self.world_size, *tensors[i].shape)
                    offset += size
            return result

        return Pending(works, finish, "all-gather", self.rank, self.world_size)

    def broadcast(self, payload: Payload, src: int) -> Payload:
        """Bucketed broadcasts from ``src``, all in flight at once."""
        if not payload:
            return Payload()
        keys, tensors = list(payload), list(payload.values())
        if self.rank == src:
            self._count_payload(payload)
        works, sent = [], []
        for bucket in self.buckets(tensors):
            flat = _flatten([tensors[i] for i in bucket]).contiguous()
            with self._guard(f"broadcast from rank {src}"):
                works.append(self.backend.broadcast(flat, src))
            sent.append((bucket, flat))
        with self._guard(f"broadcast from rank {src}"):
            for work in works:
                work.wait()
        out = Payload(payload)
        for bucket, flat in sent:
            for i, t in zip(bucket, _unflatten(flat, [tensors[i].shape for i in bucket]), strict=True):
                out[keys[i]] = t
        return out

    def _logical(self, flags: Tensor, op: ReduceOp) -> Tensor:
        values = flags.to(torch.int32).reshape(-1).clone()
        self._count(CONTROL, _nbytes(values))
        with self._guard("agreement of all ranks"):
            self.backend.all_reduce(values, op).wait()
        return values.reshape(flags.shape).bool()

    def all_true(self, flags: Tensor) -> Tensor:
        """Element-wise logical AND over ranks (an all-reduce of int32 with MIN)."""
        return self._logical(flags, "min")

    def any_true(self, flags: Tensor) -> Tensor:
        """Element-wise logical OR over ranks (an all-reduce of int32 with MAX)."""
        return self._logical(flags, "max")


class TorchCommunicator(BucketedCommunicator):
    """Collectives on an initialised torch.distributed process group (gloo on CPU, NCCL on GPU).

    Args:
        group: the process group (default: the world).
        bucket_cap_mb: largest flat buffer of one collective.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        super().__init__(TorchBackend(group), bucket_cap_mb)


def default_communicator(bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> Communicator:
    """A TorchCommunicator on the default group when one is initialised with >1 rank, else local."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCommunicator(bucket_cap_mb=bucket_cap_mb)
    return LocalCommunicator()
