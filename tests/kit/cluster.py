"""A cluster of ranks simulated as threads of one process, for communicator and stage tests.

:class:`ThreadCluster` hands out one :class:`ThreadBackend` per rank; each satisfies
:class:`hylo.distributed.CollectiveBackend`, so ``BucketedCommunicator(cluster.backend(rank))``
is the communicator of rank ``rank`` of a ``world_size``-rank job. Every collective works on
shared slots and a :class:`threading.Barrier`:

1. every rank deposits a copy of its tensor (and what it is doing: op, shape, dtype, src),
2. the ranks meet at the barrier,
3. every rank checks that all ranks called the same collective on tensors of the same shape
   and dtype (``RuntimeError`` otherwise, as a real backend would fail) and reads what it
   needs — reductions run in the fixed order rank 0 + rank 1 + …, so every rank computes the
   bitwise same result whatever the thread scheduling,
4. the ranks meet again, so nobody overwrites a slot another rank still reads.

Failures never hang: when a rank's body raises, :meth:`ThreadCluster.run` aborts the barrier,
so every collective pending or started later on the other ranks raises ``RuntimeError``
(which :class:`hylo.distributed.BucketedCommunicator` turns into
:class:`hylo.CommunicationError`) — a meeting every rank had already reached still completes;
a rank that never arrives at a collective breaks the barrier after ``timeout`` seconds. :meth:`ThreadCluster.fail` injects a backend failure on
one rank's k-th collective.

The collectives complete before they return (the returned :class:`DoneWork` is already
done), so the communicator's asynchronous launches simply run in order.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from hylo.distributed import BucketedCommunicator, CollectiveBackend

#: The three collectives of :class:`hylo.distributed.CollectiveBackend`.
Collective = Literal["all_gather", "all_reduce", "broadcast"]
ReduceOp = Literal["sum", "min", "max"]

#: Seconds a rank waits at a collective for the others before the barrier breaks.
DEFAULT_TIMEOUT = 10.0
#: Bucket cap of the communicators :meth:`ThreadCluster.run` builds (BucketedCommunicator's default).
DEFAULT_BUCKET_CAP_MB = 25.0

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_TIMEOUT",
    "CallRecord",
    "ClusterTimeoutError",
    "DoneWork",
    "InjectedFailure",
    "ReduceOp",
    "ThreadBackend",
    "ThreadCluster",
    "average_gradients",
    "split_rows",
]


class InjectedFailure(RuntimeError):
    """The backend failure :meth:`ThreadCluster.fail` injects (a ``RuntimeError``, like gloo's)."""


class ClusterTimeoutError(TimeoutError):
    """Some ranks of :meth:`ThreadCluster.run` had not finished when its timeout expired."""

    def __init__(self, message: str, unfinished: list[int]) -> None:
        super().__init__(message)
        self.unfinished = unfinished


class DoneWork:
    """A collective that has already completed: ``wait()`` returns at once."""

    def wait(self) -> None:
        """Nothing to wait for."""
        return None


@dataclass(frozen=True)
class CallRecord:
    """One backend call of one rank, as the cluster logged it."""

    op: Collective
    dtype: torch.dtype
    numel: int
    #: ``src`` of a broadcast, the reduce op of an all-reduce, ``None`` for an all-gather.
    detail: int | str | None = None


@dataclass
class _Deposit:
    """What a rank leaves in its slot for the others to read."""

    op: Collective
    shape: torch.Size
    dtype: torch.dtype
    detail: int | str | None
    tensor: Tensor


@dataclass
class _Failure:
    """A planned backend failure: the ``on_call``-th call (0-based) of kind ``op`` (any if None)."""

    on_call: int
    op: Collective | None
    seen: int = 0


@dataclass
class _RunState:
    """Errors of the ranks of one :meth:`ThreadCluster.run`, in the order they were recorded."""

    errors: dict[int, BaseException] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)


class ThreadBackend:
    """Rank ``rank``'s view of a :class:`ThreadCluster`: a :class:`hylo.distributed.CollectiveBackend`.

    Every call blocks until all ranks have made the matching call and returns a :class:`DoneWork`.
    Errors (mismatched calls, a broken barrier after another rank failed or timed out, an
    injected failure) are ``RuntimeError``.
    """

    def __init__(self, cluster: ThreadCluster, rank: int) -> None:
        self.cluster = cluster
        self.rank = rank
        self.world_size = cluster.world_size

    def all_gather(self, outputs: list[Tensor], tensor: Tensor) -> DoneWork:
        """Fill ``outputs[p]`` with rank p's ``tensor``."""
        if len(outputs) != self.world_size:
            raise RuntimeError(
                f"ThreadCluster: all_gather on rank {self.rank} got {len(outputs)} output tensors "
                f"for a world of {self.world_size}"
            )
        for p, out in enumerate(outputs):
            if out.shape != tensor.shape or out.dtype != tensor.dtype:
                raise RuntimeError(
                    f"ThreadCluster: all_gather on rank {self.rank}: output {p} is {_describe(out)}, "
                    f"the input is {_describe(tensor)}"
                )
        deposits = self.cluster.exchange(self.rank, "all_gather", tensor, None)
        for out, deposit in zip(outputs, deposits, strict=True):
            out.copy_(deposit.tensor)
        self.cluster.leave(self.rank, "all_gather")
        return DoneWork()

    def all_reduce(self, tensor: Tensor, op: ReduceOp) -> DoneWork:
        """Reduce ``tensor`` over ranks in place, in the fixed order rank 0, 1, …"""
        if op not in ("sum", "min", "max"):
            raise RuntimeError(f"ThreadCluster: unknown reduce op {op!r} on rank {self.rank}")
        deposits = self.cluster.exchange(self.rank, "all_reduce", tensor, op)
        result = deposits[0].tensor.clone()
        for deposit in deposits[1:]:
            if op == "sum":
                result.add_(deposit.tensor)
            elif op == "min":
                result = torch.minimum(result, deposit.tensor)
            else:
                result = torch.maximum(result, deposit.tensor)
        self.cluster.leave(self.rank, "all_reduce")
        tensor.copy_(result)
        return DoneWork()

    def broadcast(self, tensor: Tensor, src: int) -> DoneWork:
        """Overwrite ``tensor`` with rank ``src``'s in place."""
        if not 0 <= src < self.world_size:
            raise RuntimeError(f"ThreadCluster: broadcast from rank {src} on rank {self.rank}: no such rank")
        deposits = self.cluster.exchange(self.rank, "broadcast", tensor, src)
        if self.rank != src:
            tensor.copy_(deposits[src].tensor)
        self.cluster.leave(self.rank, "broadcast")
        return DoneWork()


def _describe(tensor: Tensor | _Deposit) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}{list(tensor.shape)}"


class ThreadCluster:
    """``world_size`` ranks as threads of this process, meeting at a shared barrier.

    Args:
        world_size: number of ranks (>= 1).
        timeout: seconds a rank waits at a collective for the others before the barrier
            breaks (every pending collective then raises ``RuntimeError``).
        bucket_cap_mb: bucket cap of the communicators :meth:`run` and :meth:`communicator` build.

    Attributes:
        calls: per rank, the number of backend calls by collective (``Counter``).
        log: per rank, every backend call in order (:class:`CallRecord`).
    """

    def __init__(
        self, world_size: int, timeout: float = DEFAULT_TIMEOUT, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.bucket_cap_mb = bucket_cap_mb
        self.calls: list[Counter[str]] = [Counter() for _ in range(world_size)]
        self.log: list[list[CallRecord]] = [[] for _ in range(world_size)]
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[_Deposit | None] = [None] * world_size
        self._failures: dict[int, _Failure] = {}
        self._lock = threading.Lock()
        self._origin: int | None = None
        self._arrivals = [0] * world_size
        #: Errors of the last :meth:`run`, by rank.
        self.errors: dict[int, BaseException] = {}
        #: The rank whose error the last :meth:`run` re-raised (None if it raised none).
        self.failed_rank: int | None = None

    # ------------------------------------------------------------------ setup
    def backend(self, rank: int) -> ThreadBackend:
        """The collective backend of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return ThreadBackend(self, rank)

    def communicator(self, rank: int, bucket_cap_mb: float | None = None) -> BucketedCommunicator:
        """``BucketedCommunicator`` of ``rank`` on this cluster (bucket cap: the cluster's unless given)."""
        cap = self.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb
        return BucketedCommunicator(self.backend(rank), bucket_cap_mb=cap)

    def fail(self, rank: int, on_call: int = 0, op: Collective | None = None) -> None:
        """Make ``rank``'s ``on_call``-th backend call (0-based; counting only ``op`` calls if given) fail.

        The failing call raises :class:`InjectedFailure` (a ``RuntimeError``) on ``rank`` without
        entering the collective and aborts the barrier, as a peer closing its connections would:
        the collectives the other ranks are in, or enter later, raise ``RuntimeError`` at once.
        The plan applies to the next :meth:`run` (or to direct use of the backends).
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if on_call < 0:
            raise ValueError(f"on_call must be >= 0, got {on_call}")
        self._failures[rank] = _Failure(on_call, op)

    def abort(self, rank: int | None = None) -> None:
        """Break the barrier: every pending and later collective raises ``RuntimeError``.

        ``rank`` is the rank whose failure causes the abort (remembered if it is the first).
        """
        with self._lock:
            if self._origin is None and rank is not None:
                self._origin = rank
        self._barrier.abort()

    def reset(self) -> None:
        """A fresh barrier and slots, cleared call counts (keeps planned failures)."""
        self._barrier = threading.Barrier(self.world_size, timeout=self.timeout)
        self._slots = [None] * self.world_size
        self._origin = None
        self._arrivals = [0] * self.world_size
        self.calls = [Counter() for _ in range(self.world_size)]
        self.log = [[] for _ in range(self.world_size)]

    # ------------------------------------------------------------------ collectives
    def _wait(self, rank: int, op: Collective, phase: str) -> None:
        """Meet the other ranks; ``RuntimeError`` if the barrier breaks before all of them arrived.

        A meeting every rank arrived at has taken place even if the barrier is aborted before
        this thread wakes up (a rank failing right after it): such a rank carries on.
        """
        with self._lock:
            self._arrivals[rank] += 1
            meeting = self._arrivals[rank]
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            with self._lock:
                if min(self._arrivals) >= meeting:
                    return
            origin = self._origin
            why = (
                f"rank {origin} failed"
                if origin is not None and origin != rank
                else f"the barrier broke (a rank failed or did not arrive within {self.timeout:g} s)"
            )
            raise RuntimeError(f"ThreadCluster: {op} on rank {rank} aborted while {phase}: {why}") from None

    def exchange(self, rank: int, op: Collective, tensor: Tensor, detail: int | str | None) -> list[_Deposit]:
        """Deposit ``tensor``, meet the others, check agreement; return every rank's deposit."""
        self.calls[rank][op] += 1
        self.log[rank].append(CallRecord(op, tensor.dtype, tensor.numel(), detail))
        failure = self._failures.get(rank)
        if failure is not None and (failure.op is None or failure.op == op):
            failure.seen += 1
            if failure.seen == failure.on_call + 1:
                del self._failures[rank]
                self.abort(rank)
                raise InjectedFailure(f"ThreadCluster: injected failure of {op} on rank {rank}")
        self._slots[rank] = _Deposit(op, tensor.shape, tensor.dtype, detail, tensor.detach().clone())
        self._wait(rank, op, "waiting for the other ranks")
        deposits = [slot for slot in self._slots if slot is not None]  # all filled after the barrier
        mine = (op, detail, tensor.dtype, tensor.shape)
        if any((d.op, d.detail, d.dtype, d.shape) != mine for d in deposits):  # every rank sees it: no abort
            calls = ", ".join(f"rank {p}: {d.op}({_describe(d)}, {d.detail!r})" for p, d in enumerate(deposits))
            raise RuntimeError(
                f"ThreadCluster: {op} on rank {rank}: ranks disagree on the collective, shape or dtype ({calls})"
            )
        return deposits

    def leave(self, rank: int, op: Collective) -> None:
        """Second meeting: after it, slots may be overwritten by the next collective."""
        self._wait(rank, op, "waiting for the other ranks to read")

    # ------------------------------------------------------------------ runner
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        bucket_cap_mb: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run ``fn(rank, communicator, *args)`` on every rank's thread; results by rank.

        ``communicator`` is :meth:`communicator` of the rank. If a rank raises, the barrier is
        aborted so that the others' collectives fail instead of waiting; then the first error
        is re-raised (the error of the rank that caused the abort, else the earliest
        recorded) with a note naming its rank (Python >= 3.11; :attr:`failed_rank` holds it
        too, and :attr:`errors` every rank's error). With ``return_exceptions=True`` the errors
        are returned in place of results instead. If the ranks have not all finished after
        ``timeout`` seconds (default: four times the collective timeout), the barrier is
        aborted and :class:`ClusterTimeoutError` names the unfinished ranks.
        """
        self.reset()
        state = _RunState()
        self.errors = state.errors
        self.failed_rank = None
        results: list[Any] = [None] * self.world_size
        comms = [self.communicator(rank, bucket_cap_mb) for rank in range(self.world_size)]

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, comms[rank], *args)
            except BaseException as exc:  # noqa: BLE001 - every error is reported to the caller
                with self._lock:
                    state.errors[rank] = exc
                    state.order.append(rank)
                self.abort(rank)

        threads = [
            threading.Thread(target=body, args=(rank,), name=f"hylo-rank-{rank}", daemon=True)
            for rank in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + (4.0 * self.timeout if timeout is None else timeout)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        unfinished = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
        if unfinished:
            self.abort()
            for rank in unfinished:
                threads[rank].join(1.0)
            raise ClusterTimeoutError(
                f"ThreadCluster.run({getattr(fn, '__qualname__', fn)!r}): ranks {unfinished} had not finished "
                f"after the timeout",
                unfinished,
            )
        if return_exceptions:
            return [state.errors.get(rank, result) for rank, result in enumerate(results)]
        if state.errors:
            first = self._origin if self._origin in state.errors else state.order[0]
            assert first is not None
            error = state.errors[first]
            self.failed_rank = first
            if sys.version_info >= (3, 11):
                error.add_note(f"(raised on rank {first} of {self.world_size} in ThreadCluster.run)")
            raise error
        return results


def split_rows(total: int, counts: Sequence[int]) -> list[slice]:
    """Consecutive slices of ``counts[p]`` rows each (``sum(counts) == total``), one per rank."""
    if sum(counts) != total:
        raise ValueError(f"counts {list(counts)} do not add up to {total}")
    starts = [sum(counts[:p]) for p in range(len(counts))]
    return [slice(start, start + n) for start, n in zip(starts, counts, strict=True)]


def average_gradients(backend: CollectiveBackend, parameters: Sequence[torch.nn.Parameter]) -> None:
    """What DDP does after backward: every ``.grad`` replaced by its mean over ranks (fixed order).

    Goes straight through the backend (not a hylo communicator), one all-reduce per parameter.
    """
    for param in parameters:
        assert param.grad is not None, "average_gradients needs every parameter's .grad"
        backend.all_reduce(param.grad, "sum").wait()
        param.grad.div_(backend.world_size)
