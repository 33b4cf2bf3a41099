"""The communicator, in one process: ``BucketedCommunicator`` on a cluster of ranks as threads.

Every expected value is computed here, in the main thread, from the per-rank inputs (concatenation
in rank order, a float64 weighted mean, the source's tensors, element-wise AND/OR, byte counts by
hand, a reference greedy bucketing); none is read back from the communicator. The cluster itself
(``tests/kit/cluster.py``) gets a few sanity tests first.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

import hylo
from hylo.distributed import BucketedCommunicator, Communicator, LocalCommunicator, Pending
from hylo.payload import CONTROL, Payload, PayloadKey
from tests.kit.cluster import Collective, InjectedFailure, ReduceOp, ThreadCluster

WORLD_SIZES = (2, 3, 4)
#: Collective timeout of the clusters here: failures must surface well before it.
TIMEOUT = 5.0
#: A bucket cap no payload here comes close to.
HUGE_CAP_MB = 1024.0

#: (layer, field, dtype, trailing dims) of the mixed payloads: float32 + float64 + int64, several layers.
SPECS: tuple[tuple[str, str, torch.dtype, tuple[int, ...]], ...] = (
    ("conv", "a", torch.float32, (3,)),
    ("conv", "g", torch.float64, (2, 2)),
    ("fc", "index", torch.int64, ()),
    ("fc", "a", torch.float64, (5,)),
    ("head", "w", torch.float32, (4,)),
    ("head", "count", torch.int64, (2,)),
)
KEYS: list[PayloadKey] = [(layer, name) for layer, name, _, _ in SPECS]


#: One intra-op thread (the ranks are threads already), restored afterwards.
pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- inputs and oracles
def make_tensor(rows: int, dtype: torch.dtype, trailing: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Random values of shape (rows, *trailing); integers for int64."""
    if dtype.is_floating_point:
        return torch.randn((rows, *trailing), generator=gen, dtype=dtype)
    return torch.randint(-1000, 1000, (rows, *trailing), generator=gen, dtype=dtype)


def mixed_payload(rank: int, rows: Sequence[int], seed: int = 0) -> Payload:
    """Rank ``rank``'s payload of :data:`SPECS`, ``rows[i]`` rows for the i-th tensor."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    payload = Payload()
    for (layer, name, dtype, trailing), n in zip(SPECS, rows, strict=True):
        payload.add(layer, {name: make_tensor(n, dtype, trailing, gen)})
    return payload


def unequal_rows(world_size: int) -> list[list[int]]:
    """Per rank, per tensor of :data:`SPECS`: different row counts, with zeros on some ranks."""
    return [[(3 * rank + 2 * i) % 5 for i in range(len(SPECS))] for rank in range(world_size)]


def nbytes(tensor: Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()


def by_layer(sizes: dict[PayloadKey, int]) -> dict[str, int]:
    """Sum byte counts keyed by (layer, field) per layer."""
    out: dict[str, int] = {}
    for (layer, _), size in sizes.items():
        out[layer] = out.get(layer, 0) + size
    return out


def reference_buckets(tensors: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Greedy bucketing as specified: per dtype in order of first appearance, cut when the next tensor overflows."""
    kinds: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault(t.dtype, []).append(i)
    buckets: list[list[int]] = []
    for indices in kinds.values():
        current: list[int] = []
        for i in indices:
            if current and sum(nbytes(tensors[j]) for j in current) + nbytes(tensors[i]) > cap_bytes:
                buckets.append(current)
                current = []
            current.append(i)
        buckets.append(current)
    return buckets


def assert_same_payload(actual: Payload, expected: dict[PayloadKey, Tensor]) -> None:
    """Same keys in the same order, same dtypes and shapes, bitwise equal values."""
    assert list(actual) == list(expected)
    for key, want in expected.items():
        got = actual[key]
        assert got.dtype == want.dtype and got.shape == want.shape, f"{key}: {got.dtype}{tuple(got.shape)}"
        assert torch.equal(got, want), f"{key}: values differ"


def run(cluster: ThreadCluster, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """``cluster.run`` that also checks it took well under the collective timeout (nothing waited for one)."""
    start = time.monotonic()
    out = cluster.run(fn, *args, **kwargs)
    assert time.monotonic() - start < TIMEOUT / 2, "a collective waited for the timeout"
    return out


# =========================================================================== the thread cluster itself
def test_cluster_reduces_in_rank_order_and_returns_results_by_rank() -> None:
    """Sum/min/max over 4 threads: the result is ((x0 + x1) + x2) + x3 bitwise, identical on every rank."""
    values = [torch.tensor([1.0, 1e8, -3.0]), torch.tensor([1e-8, -1e8, 2.0]), torch.tensor([3.0, 1.0, 5.0])]
    values.append(torch.tensor([-1e-8, 0.5, -7.0]))  # column 1 sums to 1.5 in this order, to 0 in reverse

    def body(rank: int, comm: BucketedCommunicator) -> tuple[int, Tensor, Tensor, Tensor]:
        backend = comm.backend
        out = [values[rank].clone() for _ in range(3)]
        ops: tuple[ReduceOp, ...] = ("sum", "min", "max")
        for t, op in zip(out, ops, strict=True):
            backend.all_reduce(t, op).wait()
        return rank, out[0], out[1], out[2]

    results = run(ThreadCluster(4, timeout=TIMEOUT), body)
    expected_sum = ((values[0] + values[1]) + values[2]) + values[3]
    stacked = torch.stack(values)
    for rank, (seen, total, low, high) in enumerate(results):
        assert seen == rank
        assert torch.equal(total, expected_sum)
        assert torch.equal(low, stacked.min(0).values) and torch.equal(high, stacked.max(0).values)


def test_cluster_rejects_mismatched_collectives() -> None:
    """Shapes or collectives that differ across ranks fail on every rank, like a real backend."""

    def shapes(rank: int, comm: BucketedCommunicator) -> None:
        comm.backend.all_reduce(torch.zeros(2 + rank), "sum").wait()

    out = ThreadCluster(3, timeout=TIMEOUT).run(shapes, return_exceptions=True)
    assert all(isinstance(e, RuntimeError) and "disagree" in str(e) for e in out), out

    def kinds(rank: int, comm: BucketedCommunicator) -> None:
        if rank == 0:
            comm.backend.broadcast(torch.zeros(2), 0).wait()
        else:
            comm.backend.all_reduce(torch.zeros(2), "sum").wait()

    out = ThreadCluster(2, timeout=TIMEOUT).run(kinds, return_exceptions=True)
    assert all(isinstance(e, RuntimeError) and "disagree" in str(e) for e in out), out


def test_cluster_reraises_the_failing_rank_with_its_rank() -> None:
    """``run`` re-raises the error of the rank that failed, not the others' consequential errors."""

    def body(rank: int, comm: BucketedCommunicator) -> None:
        if rank == 2:
            raise ValueError("boom on rank 2")
        comm.all_true(torch.ones(1, dtype=torch.bool))

    cluster = ThreadCluster(3, timeout=TIMEOUT)
    with pytest.raises(ValueError, match="boom on rank 2") as info:
        run(cluster, body)
    assert cluster.failed_rank == 2
    assert any("rank 2" in note for note in getattr(info.value, "__notes__", ["rank 2"]))
    assert isinstance(cluster.errors[0], hylo.CommunicationError)
    assert isinstance(cluster.errors[1], hylo.CommunicationError)


# =========================================================================== named payload round trips
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_rows_concatenates_in_rank_order(world_size: int) -> None:
    """Each tensor is every rank's rows, concatenated in rank order; keys, order and dtypes kept (mixed dtypes)."""
    rows = [[2 + rank + i for i in range(len(SPECS))] for rank in range(world_size)]
    payloads = [mixed_payload(rank, rows[rank]) for rank in range(world_size)]

    def body(rank: int, comm: BucketedCommunicator) -> Payload:
        return comm.all_gather_rows(payloads[rank]).wait()

    expected = {key: torch.cat([payloads[p][key] for p in range(world_size)]) for key in KEYS}
    for result in run(ThreadCluster(world_size, timeout=TIMEOUT), body):
        assert isinstance(result, Payload)
        assert_same_payload(result, expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_pads_and_trims_unequal_rows(world_size: int) -> None:
    """Different row counts per rank (0 on some ranks, trailing dims): the gather trims the padding exactly.

    Also a tensor with no rows on any rank.
    """
    rows = unequal_rows(world_size)
    assert any(0 in r for r in rows) and any(len(set(col)) > 1 for col in zip(*rows, strict=True))
    payloads = [mixed_payload(rank, rows[rank], seed=1) for rank in range(world_size)]
    for payload in payloads:
        payload.add("empty", {"rows": torch.zeros(0, 3, dtype=torch.float64)})

    def body(rank: int, comm: BucketedCommunicator) -> Payload:
        return comm.all_gather_rows(payloads[rank]).wait()

    expected = {key: torch.cat([payloads[p][key] for p in range(world_size)]) for key in payloads[0]}
    assert expected[("empty", "rows")].shape == (0, 3)
    for result in run(ThreadCluster(world_size, timeout=TIMEOUT), body):
        assert_same_payload(result, expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_mean_is_the_weighted_mean(world_size: int) -> None:
    """Σ_p w_p X_p / Σ_p w_p with unequal weights per rank and key (one of them 0), against float64 by hand."""
    specs = [
        ("a", torch.float64, (3, 4)),
        ("b", torch.float32, (5,)),
        ("c", torch.float64, (2,)),
        ("d", torch.float32, (1, 1)),
    ]
    keys: list[PayloadKey] = [(f"layer{i % 2}", name) for i, (name, _, _) in enumerate(specs)]
    payloads, weights = [], []
    for rank in range(world_size):
        gen = torch.Generator().manual_seed(50 + rank)
        payloads.append(
            Payload(
                {
                    key: make_tensor(shape[0], dtype, shape[1:], gen)
                    for key, (_, dtype, shape) in zip(keys, specs, strict=True)
                }
            )
        )
        weights.append({key: float((rank + 2 * i) % 4) for i, key in enumerate(keys)})
    assert any(w[key] == 0.0 for w in weights for key in keys)

    def body(rank: int, comm: BucketedCommunicator) -> Payload:
        return comm.all_reduce_mean(payloads[rank], weights[rank]).wait()

    results = run(ThreadCluster(world_size, timeout=TIMEOUT), body)
    for key, (_, dtype, _) in zip(keys, specs, strict=True):
        total = sum(w[key] for w in weights)
        want = sum(w[key] * p[key].double() for w, p in zip(weights, payloads, strict=True)) / total
        tol = 1e-13 if dtype == torch.float64 else 1e-6
        for rank, result in enumerate(results):
            assert list(result) == keys
            got = result[key]
            assert got.dtype == dtype and got.shape == payloads[rank][key].shape
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
            assert torch.equal(got, results[0][key]), "ranks disagree"


def test_all_reduce_mean_of_integers_is_a_float_mean() -> None:
    """An int64 tensor in a mean comes back as floating point Σ w_p X_p / Σ w_p (here exactly representable)."""
    ints = [torch.tensor([[3, -6], [9, 12]]), torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0, 0], [6, 6]])]
    floats = [torch.full((2,), float(rank), dtype=torch.float64) for rank in range(3)]
    w = [1.0, 2.0, 3.0]

    def body(rank: int, comm: BucketedCommunicator) -> Payload:
        payload = Payload({("L", "i"): ints[rank], ("L", "x"): floats[rank]})
        return comm.all_reduce_mean(payload, {("L", "i"): w[rank], ("L", "x"): w[rank]}).wait()

    want = sum(wp * x.double() for wp, x in zip(w, ints, strict=True)) / sum(w)
    for result in run(ThreadCluster(3, timeout=TIMEOUT), body):
        assert list(result) == [("L", "i"), ("L", "x")]
        assert result[("L", "i")].is_floating_point()
        torch.testing.assert_close(result[("L", "i")].double(), want, rtol=1e-6, atol=0.0)
        assert torch.equal(result[("L", "x")], torch.full((2,), 8.0 / 6.0, dtype=torch.float64))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_from_every_source(world_size: int) -> None:
    """Every rank receives the source's tensors (mixed dtypes, keys in order), for every source rank."""
    shapes = [3] * len(SPECS)
    payloads = [mixed_payload(rank, shapes, seed=2) for rank in range(world_size)]

    def body(rank: int, comm: BucketedCommunicator) -> list[Payload]:
        return [comm.broadcast(payloads[rank], src) for src in range(world_size)]

    for received in run(ThreadCluster(world_size, timeout=TIMEOUT), body):
        for src, result in enumerate(received):
            assert_same_payload(result, payloads[src])


class _BroadcastOnly(Communicator):
    """A communicator that keeps :meth:`Communicator.all_gather`'s default (one broadcast per rank)."""

    def __init__(self, inner: BucketedCommunicator) -> None:
        super().__init__()
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def all_gather_rows(self, payload: Payload) -> Pending:
        return self.inner.all_gather_rows(payload)

    def all_reduce_mean(self, payload: Payload, weights: Mapping[PayloadKey, float]) -> Pending:
        return self.inner.all_reduce_mean(payload, weights)

    def all_reduce(self, payload: Payload, op: ReduceOp = "sum") -> Pending:
        return self.inner.all_reduce(payload, op)

    def broadcast(self, payload: Payload, src: int) -> Payload:
        return self.inner.broadcast(payload, src)

    def all_true(self, flags: Tensor) -> Tensor:
        return self.inner.all_true(flags)

    def any_true(self, flags: Tensor) -> Tensor:
        return self.inner.any_true(flags)


@pytest.mark.parametrize("kind", ["bucketed", "small buckets", "default"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_stacks_every_ranks_tensors(world_size: int, kind: str) -> None:
    """Every rank receives each key as (P, *shape), row p rank p's tensor bit for bit (mixed dtypes, keys in
    order): the bucketed all-gather (one bucket per dtype, or a bucket per tensor) and the default of a
    communicator without one (a broadcast from each rank). One rank: each tensor with a leading 1."""
    payloads = [mixed_payload(rank, [3] * len(SPECS), seed=4) for rank in range(world_size)]

    def body(rank: int, comm: BucketedCommunicator) -> Payload:
        used: Communicator = _BroadcastOnly(comm) if kind == "default" else comm
        return used.all_gather(payloads[rank]).wait()

    cap = 1e-6 if kind == "small buckets" else HUGE_CAP_MB
    for received in run(ThreadCluster(world_size, timeout=TIMEOUT), body, bucket_cap_mb=cap):
        assert_same_payload(received, {key: torch.stack([p[key] for p in payloads]) for key in payloads[0]})
    assert_same_payload(
        LocalCommunicator().all_gather(payloads[0]).wait(), {k: t.unsqueeze(0) for k, t in payloads[0].items()}
    )


def test_empty_payloads_issue_no_collective() -> None:
    """An empty payload gives an empty payload, on every collective, without touching the backend."""

    def body(rank: int, comm: BucketedCommunicator) -> list[Payload]:
        return [
            comm.all_gather_rows(Payload()).wait(),
            comm.all_reduce_mean(Payload(), {}).wait(),
            comm.broadcast(Payload(), 1),
            comm.all_gather(Payload()).wait(),
        ]

    cluster = ThreadCluster(2, timeout=TIMEOUT)
    for results in run(cluster, body):
        assert all(isinstance(r, Payload) and not r for r in results)
    assert cluster.calls == [{}, {}]


# =========================================================================== bucketing
def test_buckets_split_at_tensor_boundaries_by_dtype_under_the_cap() -> None:
    """``buckets()``: a partition, one dtype per bucket, order kept, ≤ cap unless a lone oversized tensor."""
    cap = 100
    sizes = [(torch.float32, 4), (torch.float64, 3), (torch.float32, 10), (torch.int64, 20), (torch.float32, 25),
             (torch.float64, 5), (torch.float32, 2), (torch.float32, 2), (torch.float64, 30), (torch.float32, 40),
             (torch.float32, 1), (torch.int64, 1), (torch.float64, 12), (torch.float64, 0)]  # fmt: skip
    tensors = [torch.zeros(n, dtype=dtype) for dtype, n in sizes]
    comm = BucketedCommunicator(ThreadCluster(1).backend(0), bucket_cap_mb=cap / 2**20)
    assert comm.bucket_bytes == cap
    buckets = comm.buckets(tensors)
    assert sorted(i for b in buckets for i in b) == list(range(len(tensors)))
    for bucket in buckets:
        assert bucket and len({tensors[i].dtype for i in bucket}) == 1
        same_dtype = [i for i, t in enumerate(tensors) if t.dtype == tensors[bucket[0]].dtype]
        start = same_dtype.index(bucket[0])
        assert bucket == same_dtype[start : start + len(bucket)], "not a run of consecutive tensors"
        size = sum(nbytes(tensors[i]) for i in bucket)
        assert size <= cap or len(bucket) == 1, f"bucket {bucket} of {size} bytes"
    assert any(len(b) == 1 and nbytes(tensors[b[0]]) > cap for b in buckets), "no oversized tensor was tested"
    assert buckets == reference_buckets(tensors, cap)


def _all_three(world_size: int) -> tuple[list[Payload], list[Payload], list[dict[PayloadKey, float]]]:
    """Per rank: a gather payload with unequal rows, a mean payload and its weights."""
    rows = unequal_rows(world_size)
    gather = [mixed_payload(rank, rows[rank], seed=3) for rank in range(world_size)]
    mean = [
        Payload(
            {
                key: t.to(torch.float64 if t.dtype == torch.int64 else t.dtype)
                for key, t in mixed_payload(rank, [4] * len(SPECS), seed=4).items()
            }
        )
        for rank in range(world_size)
    ]
    weights = [dict.fromkeys(KEYS, 1.0 + rank) for rank in range(world_size)]
    return gather, mean, weights


@pytest.mark.parametrize("world_size", [2, 3])
def test_tiny_buckets_give_the_same_results_with_more_collectives(world_size: int) -> None:
    """A 64-byte cap splits every payload into many collectives; results are bitwise those of one bucket per dtype."""
    gather, mean, weights = _all_three(world_size)

    def body(rank: int, comm: BucketedCommunicator) -> list[Payload]:
        return [
            comm.all_gather_rows(gather[rank]).wait(),
            comm.all_reduce_mean(mean[rank], weights[rank]).wait(),
            comm.broadcast(mean[rank], world_size - 1),
        ]

    tiny_cap = 64
    big, small = ThreadCluster(world_size, timeout=TIMEOUT), ThreadCluster(world_size, timeout=TIMEOUT)
    huge_results = run(big, body, bucket_cap_mb=HUGE_CAP_MB)
    tiny_results = run(small, body, bucket_cap_mb=tiny_cap / 2**20)
    for huge, tiny in zip(huge_results, tiny_results, strict=True):
        for a, b in zip(huge, tiny, strict=True):
            assert_same_payload(b, a)

    # backend calls: the row-count exchange plus one per bucket (padded rows), one per bucket otherwise
    max_rows = [max(r[i] for r in unequal_rows(world_size)) for i in range(len(SPECS))]
    padded = [
        torch.zeros((m, *trailing), dtype=dtype) for m, (*_, dtype, trailing) in zip(max_rows, SPECS, strict=True)
    ]
    means = list(mean[0].values())
    for cluster, cap in ((big, 2**40), (small, tiny_cap)):
        expected = {
            "all_gather": 1 + len(reference_buckets(padded, cap)),
            "all_reduce": len(reference_buckets(means, cap)),
            "broadcast": len(reference_buckets(means, cap)),
        }
        assert all(calls == expected for calls in cluster.calls), (cap, cluster.calls, expected)
    assert big.calls[0] == {"all_gather": 1 + 3, "all_reduce": 2, "broadcast": 2}  # one bucket per dtype
    assert all(small.calls[0][op] > big.calls[0][op] for op in ("all_gather", "all_reduce", "broadcast"))


# =========================================================================== byte counts
@pytest.mark.parametrize("collective", ["gather", "mean", "broadcast", "flags"])
def test_bytes_by_tag_per_layer_and_control(collective: str) -> None:
    """``bytes_by_tag`` per layer and under ``<control>`` by hand, and ``bytes_sent`` their sum (3 ranks).

    Gather: padded local rows per tensor, control one int64 row count per tensor. Mean: the
    scaled buffer, control one weight per tensor (in its dtype). Broadcast: the buffer on the
    source only. all_true/any_true: control only, one int32 per flag.
    """
    world_size, src = 3, 1
    gather, mean, weights = _all_three(world_size)

    def body(rank: int, comm: BucketedCommunicator) -> tuple[dict[str, int], int]:
        if collective == "gather":
            comm.all_gather_rows(gather[rank]).wait()
        elif collective == "mean":
            comm.all_reduce_mean(mean[rank], weights[rank]).wait()
        elif collective == "broadcast":
            comm.broadcast(mean[rank], src)
        else:
            comm.all_true(torch.ones(2, 3, dtype=torch.bool))
            comm.any_true(torch.zeros(5, dtype=torch.bool))
        return dict(comm.bytes_by_tag), comm.bytes_sent

    rows = unequal_rows(world_size)
    for rank, (tags, sent) in enumerate(run(ThreadCluster(world_size, timeout=TIMEOUT), body)):
        if collective == "gather":
            max_rows = [max(r[i] for r in rows) for i in range(len(SPECS))]
            sizes = {
                key: m * math.prod(t) * dtype.itemsize
                for key, m, (*_, dtype, t) in zip(KEYS, max_rows, SPECS, strict=True)
            }
            expected = {**by_layer(sizes), CONTROL: 8 * len(KEYS)}
        elif collective == "mean":
            expected = {**by_layer({key: nbytes(t) for key, t in mean[rank].items()})}
            expected[CONTROL] = sum(t.element_size() for t in mean[rank].values())
        elif collective == "broadcast":
            expected = by_layer({key: nbytes(t) for key, t in mean[rank].items()}) if rank == src else {}
        else:
            expected = {CONTROL: 4 * (6 + 5)}
        assert {tag: n for tag, n in tags.items() if n} == expected, f"rank {rank}"
        assert sent == sum(tags.values())


# =========================================================================== agreement flags
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_true_and_any_true_are_elementwise_over_ranks(world_size: int) -> None:
    """AND/OR of each element over ranks; shape kept, bool out; all-true and all-false columns included."""
    gen = torch.Generator().manual_seed(world_size)
    flags = [torch.rand(2, 5, generator=gen) < 0.6 for _ in range(world_size)]
    for f in flags:
        f[0, 0], f[0, 1] = True, False

    def body(rank: int, comm: BucketedCommunicator) -> tuple[Tensor, Tensor]:
        return comm.all_true(flags[rank]), comm.any_true(flags[rank])

    stacked = torch.stack(flags)
    for every, some in run(ThreadCluster(world_size, timeout=TIMEOUT), body):
        assert every.dtype == some.dtype == torch.bool and every.shape == some.shape == (2, 5)
        assert torch.equal(every, stacked.all(0)) and torch.equal(some, stacked.any(0))
        assert bool(every[0, 0]) and not bool(some[0, 1])


# =========================================================================== failures
def _gather(rank: int, comm: BucketedCommunicator) -> None:
    comm.all_gather_rows(Payload({("L", "a"): torch.ones(rank + 1, 2)})).wait()


def _mean(rank: int, comm: BucketedCommunicator) -> None:
    comm.all_reduce_mean(Payload({("L", "a"): torch.ones(3)}), {("L", "a"): 1.0}).wait()


def _broadcast(rank: int, comm: BucketedCommunicator) -> None:
    comm.broadcast(Payload({("L", "a"): torch.ones(3)}), src=2)


def _flags(rank: int, comm: BucketedCommunicator) -> None:
    comm.all_true(torch.ones(3, dtype=torch.bool))


FAILURES: dict[str, tuple[Callable[[int, BucketedCommunicator], None], Collective, int, str]] = {
    # name: (body, collective that fails, its 0-based index, what the message names)
    "gather-counts": (_gather, "all_gather", 0, "all-gather of row counts"),
    "gather-rows": (_gather, "all_gather", 1, "all-gather of rows"),
    "mean": (_mean, "all_reduce", 0, "all-reduce"),
    "broadcast": (_broadcast, "broadcast", 0, "broadcast from rank 2"),
    "flags": (_flags, "all_reduce", 0, "agreement of all ranks"),
}


@pytest.mark.parametrize("failing_rank", [0, 2])
@pytest.mark.parametrize("case", list(FAILURES))
def test_backend_failure_is_a_communication_error_on_every_rank(case: str, failing_rank: int) -> None:
    """A backend error on one rank: ``hylo.CommunicationError`` naming the collective and the rank, on every rank, at once."""
    body, op, on_call, what = FAILURES[case]
    cluster = ThreadCluster(3, timeout=TIMEOUT)
    cluster.fail(failing_rank, on_call=on_call, op=op)
    errors = run(cluster, body, return_exceptions=True)
    for rank, error in enumerate(errors):
        assert isinstance(error, hylo.CommunicationError), f"rank {rank}: {error!r}"
        assert what in str(error) and f"rank {rank} of 3" in str(error), str(error)
    assert isinstance(errors[failing_rank].__cause__, InjectedFailure)
    assert all(not isinstance(e.__cause__, InjectedFailure) for r, e in enumerate(errors) if r != failing_rank)


def test_rank_that_skips_a_collective_makes_the_others_fail_at_the_timeout() -> None:
    """A rank that never joins: the others' collective raises ``CommunicationError`` after the timeout, no hang."""
    timeout = 0.3

    def body(rank: int, comm: BucketedCommunicator) -> None:
        if rank != 1:
            comm.all_true(torch.ones(1, dtype=torch.bool))

    start = time.monotonic()
    errors = ThreadCluster(3, timeout=timeout).run(body, return_exceptions=True)
    elapsed = time.monotonic() - start
    assert errors[1] is None
    for rank in (0, 2):
        assert isinstance(errors[rank], hylo.CommunicationError) and f"rank {rank} of 3" in str(errors[rank])
    assert timeout <= elapsed < timeout + 2.0
    assert not [t for t in threading.enumerate() if t.name.startswith("hylo-rank")], "a rank thread is left"


# =========================================================================== one rank
def test_local_communicator_is_the_identity_and_counts_nothing() -> None:
    """World size 1: every collective hands back its input (keys, order, values) and no byte is counted."""
    comm: Communicator = LocalCommunicator()
    assert (comm.rank, comm.world_size) == (0, 1)
    payload = mixed_payload(0, [3, 0, 2, 1, 4, 2])
    weights = dict.fromkeys(payload, 5.0)
    assert_same_payload(comm.all_gather_rows(payload).wait(), payload)
    assert_same_payload(comm.all_reduce_mean(payload, weights).wait(), payload)
    assert_same_payload(comm.broadcast(payload, 0), payload)
    flags = torch.tensor([1, 0, 2])
    assert torch.equal(comm.all_true(flags), torch.tensor([True, False, True]))
    assert torch.equal(comm.any_true(flags), torch.tensor([True, False, True]))
    assert comm.bytes_sent == 0 and not any(comm.bytes_by_tag.values())
