"""Owner assignment and the update stage with a simulated multi-rank cluster (ranks as threads).

- ``assign_owners``: hand examples, a reference LPT written here, and the 4/3 bound against a
  brute-force optimum.
- The stage through ``HyLoPreconditioner(model, communicator=...)`` on a ``ThreadCluster`` of
  P = 2, 3, 4 ranks: each rank trains its own copy of a small float64 conv + linear net on its
  shard of a global batch, with DDP simulated by averaging every ``.grad`` over the ranks
  through the cluster's backend before ``pre.step()``.

Every oracle is computed here: owners from solve costs recomputed from the layer shapes and the
row counts, byte counts from the formulas of the payloads, and the preconditioned gradients of a
one-process run on the whole batch.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.distributed import BucketedCommunicator, Communicator, LocalCommunicator, assign_owners
from hylo.payload import RESULTS
from hylo.solvers.kfac import KFACState
from hylo.solvers.smw import LowRankState
from tests.kit.cluster import Collective, ThreadCluster, average_gradients, split_rows

WORLD_SIZES = (2, 3, 4)
#: Global batch (divisible by every world size) and steps of a run (updates at steps 0 and 2).
BATCH, STEPS, UPDATE_FREQ = 12, 4, 2
DAMPING = 1e-2
#: Unequal local batches for the owner test.
UNEQUAL = {2: (5, 7), 3: (2, 4, 6), 4: (1, 2, 4, 5)}
#: Collective timeout of the clusters: failures must surface well before it.
TIMEOUT = 10.0
LAYERS = ("conv", "fc1", "fc2", "fc3")


#: One intra-op thread (the ranks are threads already), restored afterwards.
pytestmark = pytest.mark.usefixtures("single_thread")


# =========================================================================== assign_owners
def reference_lpt(costs: Sequence[float], world_size: int) -> list[int]:
    """Greedy LPT as specified, by linear scans: heaviest (then lowest index) first, to the least-loaded (then lowest) rank."""
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


def makespan(costs: Sequence[float], owners: Sequence[int], world_size: int) -> float:
    """The largest total cost of a rank."""
    return max(sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world_size))


def test_assign_owners_heaviest_first_to_the_least_loaded_rank() -> None:
    """Hand-worked examples: heaviest first, each to the least-loaded rank; ties to the lower index and rank."""
    # 5 → r0, 4 → r1, 3 → r1 (4 < 5), 1 → r0 (5 < 7)
    assert assign_owners([1.0, 5.0, 3.0, 4.0], 2) == [0, 0, 1, 1]
    # equal costs: lower index first, equal loads: lower rank
    assert assign_owners([2.0, 2.0, 2.0, 2.0], 2) == [0, 1, 0, 1]
    assert assign_owners([1.0, 1.0, 1.0], 3) == [0, 1, 2]
    # 7 (idx 1) → r0, 7 (idx 3) → r1, 3 (idx 0) → r0 (tie 7/7), 3 (idx 2) → r1
    assert assign_owners([3.0, 7.0, 3.0, 7.0], 2) == [0, 0, 1, 1]
    # more ranks than layers: one layer each, the rest idle
    assert assign_owners([3.0, 1.0], 4) == [0, 1]
    assert assign_owners([], 3) == []


def test_assign_owners_is_deterministic_and_matches_a_reference_lpt() -> None:
    """Random instances (ints with ties, floats): same answer twice, input untouched, equal to the reference here."""
    rng = random.Random(7)
    for _ in range(200):
        n, world_size = rng.randint(0, 12), rng.randint(1, 5)
        costs: list[float] = (
            [float(rng.randint(0, 4)) for _ in range(n)] if rng.random() < 0.5 else [rng.random() for _ in range(n)]
        )
        before = list(costs)
        owners = assign_owners(costs, world_size)
        assert costs == before
        assert owners == assign_owners(tuple(costs), world_size)
        assert owners == reference_lpt(costs, world_size), (costs, world_size)
        assert all(0 <= o < world_size for o in owners)


def test_assign_owners_one_rank_and_bad_world_size() -> None:
    """``world_size=1`` puts every layer on rank 0; a world size below 1 is a ``ValueError``."""
    assert assign_owners([5.0, 1.0, 3.0], 1) == [0, 0, 0]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="world_size"):
            assign_owners([1.0], bad)


def test_assign_owners_within_four_thirds_of_the_optimum() -> None:
    """Small random instances: LPT's makespan ≤ (4/3 − 1/(3P)) × the brute-force optimum."""
    rng = random.Random(11)
    for _ in range(60):
        n, world_size = rng.randint(2, 7), rng.randint(2, 3)
        costs = [float(rng.randint(1, 30)) for _ in range(n)]
        optimum = min(makespan(costs, owners, world_size) for owners in itertools.product(range(world_size), repeat=n))
        lpt = makespan(costs, assign_owners(costs, world_size), world_size)
        assert optimum <= lpt <= (4 / 3 - 1 / (3 * world_size)) * optimum + 1e-9, (costs, world_size)


# =========================================================================== the simulated cluster
class Net(nn.Module):
    """Conv2d (bias) → Linear (bias) → Linear (bias) → Linear (no bias): four different layer sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1)  # 6×6 → 3×3: d_a = 19, d_g = 4
        self.fc1 = nn.Linear(36, 10)  # d_a = 37, d_g = 10
        self.fc2 = nn.Linear(10, 8)  # d_a = 11, d_g = 8
        self.fc3 = nn.Linear(8, 3, bias=False)  # d_a = 8, d_g = 3

    def forward(self, x: Tensor) -> Tensor:
        """Logits of a (n, 2, 6, 6) batch."""
        x = torch.tanh(self.conv(x)).flatten(1)
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def layer_dims(module: nn.Module) -> tuple[int, int]:
    """(d_a, d_g) of a Linear/Conv2d from its definition: inputs (× kernel) plus a bias column, outputs."""
    bias = 1 if getattr(module, "bias", None) is not None else 0
    if isinstance(module, nn.Conv2d):
        return module.in_channels * math.prod(module.kernel_size) + bias, module.out_channels
    assert isinstance(module, nn.Linear)
    return module.in_features + bias, module.out_features


DIMS = {name: layer_dims(getattr(Net(), name)) for name in LAYERS}


def make_models(count: int) -> list[Net]:
    """``count`` identical float64 copies of one initialisation."""
    torch.manual_seed(0)
    base = Net().to(torch.float64)
    return [copy.deepcopy(base) for _ in range(count)]


def make_data(steps: int = STEPS) -> tuple[Tensor, Tensor]:
    """Per step a global batch of inputs (BATCH, 2, 6, 6) and labels in {0, 1, 2}."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(steps, BATCH, 2, 6, 6, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (steps, BATCH), generator=gen
    )


@dataclass
class RankRun:
    """What one rank saw in a run, step by step."""

    raw: list[dict[str, Tensor]]
    preconditioned: list[dict[str, Tensor]]
    owners: list[dict[str, int]]
    solvers: list[dict[str, str]]
    states: dict[str, Any]
    first_step_bytes: dict[str, int]
    params: dict[str, Tensor]


def train(
    rank: int,
    comm: Communicator,
    models: list[Net],
    counts: Sequence[int],
    options: dict[str, Any],
) -> RankRun:
    """SGD steps with hylo on rank ``rank``'s rows of each global batch; DDP through the cluster's backend."""
    model = models[rank]
    xs, ys = make_data()
    pre = hylo.HyLoPreconditioner(
        model, communicator=comm, update_freq=UPDATE_FREQ, damping=DAMPING, factor_decay=0.5, **options
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = split_rows(BATCH, counts)[rank]
    params = list(model.parameters())
    run = RankRun([], [], [], [], {}, {}, {})
    for step, (x, y) in enumerate(zip(xs, ys, strict=True)):
        opt.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        if isinstance(comm, BucketedCommunicator):
            average_gradients(comm.backend, params)
        run.raw.append({k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
        pre.step()
        run.preconditioned.append(
            {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        )
        run.owners.append({info.name: info.owner for info in pre.layer_info()})
        run.solvers.append({info.name: info.solver for info in pre.layer_info()})
        if step == 0:
            run.first_step_bytes = dict(pre.comm.bytes_by_tag)
        opt.step()
    run.states = {info.name: info.state for info in pre.layer_info()}
    run.params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return run


def options_of(solver: str, rank_ratio: float, strategy: str) -> dict[str, Any]:
    """Preconditioner options; hybrid forces fc3 to K-FAC so that both families take part.

    ``"kfac+factors"`` is K-FAC refreshing its running factors every step between updates;
    ``"<solver>+exact"`` uses the convolution's exact per-sample gradients as its rows.
    """
    options: dict[str, Any] = {"solver": solver, "rank_ratio": rank_ratio, "strategy": strategy}
    if solver == "kfac+factors":
        options.update(solver="kfac", factor_update_freq=1)
    if solver.endswith("+exact"):
        options.update(solver=solver.removesuffix("+exact"), conv_rows="exact")
    if solver == "hybrid":
        options["layer_solvers"] = {"fc3": "kfac"}
    return options


@functools.cache
def cluster_run(
    world_size: int, solver: str, strategy: str, rank_ratio: float, counts: tuple[int, ...] | None = None
) -> list[RankRun]:
    """A run on ``world_size`` thread ranks (equal shards unless ``counts``), cached across tests."""
    counts = counts or (BATCH // world_size,) * world_size
    cluster = ThreadCluster(world_size, timeout=TIMEOUT)
    models = make_models(world_size)
    return cluster.run(train, models, counts, options_of(solver, rank_ratio, strategy))


@functools.cache
def single_process_run(solver: str, rank_ratio: float) -> RankRun:
    """The same training in one process on the whole batch (``LocalCommunicator``)."""
    return train(0, LocalCommunicator(), make_models(1), (BATCH,), options_of(solver, rank_ratio, "inverse"))


def rows_kept(solver: str, rows: int, rank_ratio: float) -> int:
    """Rows a rank keeps: all for SNGD, max(1, ⌊ρ n⌋) (at most n) for KID/KIS."""
    return rows if solver == "sngd" else min(rows, max(1, math.floor(rank_ratio * rows)))


def solve_cost(solver: str, d_a: int, d_g: int, counts: Sequence[int], rank_ratio: float) -> float:
    """K-FAC 4(d_a³ + d_g³); low-rank m²(d_a + d_g) + m³ with m the rows gathered from every rank."""
    if solver == "kfac":
        return 4.0 * (d_a**3 + d_g**3)
    m = sum(rows_kept(solver, n, rank_ratio) for n in counts)
    return float(m * m * (d_a + d_g) + m**3)


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖."""
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))


SOLVER_CASES = [("kfac", 1.0), ("sngd", 1.0), ("kid", 0.5), ("kis", 0.5), ("hybrid", 0.5)]
SOLVER_IDS = [s for s, _ in SOLVER_CASES]


# --------------------------------------------------------------------------- owners
@pytest.mark.parametrize(("solver", "rank_ratio"), SOLVER_CASES, ids=SOLVER_IDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_records_the_owners_of_the_solve_costs(world_size: int, solver: str, rank_ratio: float) -> None:
    """Unequal local batches: every rank's owners == assign_owners of costs recomputed from shapes and row counts."""
    counts = UNEQUAL[world_size]
    runs = cluster_run(world_size, solver, "inverse", rank_ratio, counts)
    for step in range(0, STEPS, UPDATE_FREQ):
        solvers = runs[0].solvers[step]
        assert all(run.solvers[step] == solvers for run in runs), "ranks chose different solvers"
        costs = [solve_cost(solvers[name], *DIMS[name], counts, rank_ratio) for name in LAYERS]
        expected = dict(zip(LAYERS, assign_owners(costs, world_size), strict=True))
        for rank, run in enumerate(runs):
            assert run.owners[step] == expected, f"rank {rank}, step {step}"
    if world_size == 2:  # not vacuous: the work is spread
        assert len(set(expected.values())) == 2


# --------------------------------------------------------------------------- who holds what
@pytest.mark.parametrize(("solver", "rank_ratio"), SOLVER_CASES, ids=SOLVER_IDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_strategy_only_the_owner_holds_a_state(world_size: int, solver: str, rank_ratio: float) -> None:
    """strategy="gradient": the owner a LayerState, the others a RemoteState (K-FAC's carrying the running factors)."""
    runs = cluster_run(world_size, solver, "gradient", rank_ratio)
    owners = runs[0].owners[-1]
    for name in LAYERS:
        owned = runs[owners[name]].states[name]
        assert owned is not None and not owned.remote, f"{name}: the owner holds {owned}"
        for rank, run in enumerate(runs):
            state = run.states[name]
            if rank == owners[name]:
                continue
            assert state is not None and state.remote, f"{name} on rank {rank}: {state}"
            assert state.family == owned.family
            if owned.kind == KFACState.__name__:  # a remote state's tensors: the carried ones
                assert list(state.tensors) == ["factor_a", "factor_g"]
                assert torch.equal(state.tensors["factor_a"], owned.tensors["factor_a"])
                assert torch.equal(state.tensors["factor_g"], owned.tensors["factor_g"])
            else:
                assert dict(state.tensors) == {}


@pytest.mark.parametrize(("solver", "rank_ratio"), SOLVER_CASES, ids=SOLVER_IDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_inverse_strategy_every_rank_holds_every_state(world_size: int, solver: str, rank_ratio: float) -> None:
    """strategy="inverse": every rank holds every layer's full state, bitwise equal across ranks."""
    runs = cluster_run(world_size, solver, "inverse", rank_ratio)
    for name in LAYERS:
        first = runs[0].states[name]
        assert first is not None and not first.remote
        for rank, run in enumerate(runs[1:], start=1):
            state = run.states[name]
            assert state is not None and (state.kind, state.remote) == (first.kind, False), f"{name} on rank {rank}"
            assert state.damping == first.damping
            if first.kind == LowRankState.__name__:
                assert state.fields["divisor"] == first.fields["divisor"]
            tensors, expected = state.tensors, first.tensors
            assert list(tensors) == list(expected)
            for key, want in expected.items():
                assert torch.equal(tensors[key], want), f"{name}.{key} differs on rank {rank}"


# --------------------------------------------------------------------------- preconditioned gradients
EXACT = [("kfac", 1.0), ("kfac+factors", 1.0), ("sngd", 1.0), ("sngd+exact", 1.0), ("kid", 1.0), ("kis", 1.0)]


@pytest.mark.parametrize(("solver", "rank_ratio"), EXACT, ids=[s for s, _ in EXACT])
@pytest.mark.parametrize("strategy", ["inverse", "gradient"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_exact_solvers_match_one_process_on_the_whole_batch(
    world_size: int, strategy: str, solver: str, rank_ratio: float
) -> None:
    """P ranks on shards of the batch == one process on all of it, every step (updates at 0 and 2), to 1e-10."""
    reference = single_process_run(solver, rank_ratio)
    runs = cluster_run(world_size, solver, strategy, rank_ratio)
    for step in range(STEPS):
        flat_pre = torch.cat([g.flatten() for g in reference.preconditioned[step].values()])
        flat_raw = torch.cat([g.flatten() for g in reference.raw[step].values()])
        assert rel_err(flat_pre * DAMPING, flat_raw) > 0.1, f"step {step}: preconditioning is ~ identity/λ"
        for key, want in reference.preconditioned[step].items():
            raw = reference.raw[step][key]
            for rank, run in enumerate(runs):
                assert rel_err(run.raw[step][key], raw) < 1e-12, f"rank {rank} step {step} {key}: DDP gradient"
                err = rel_err(run.preconditioned[step][key], want)
                assert err < 1e-10, f"rank {rank} step {step} {key}: relative error {err:.2e}"


@pytest.mark.parametrize(
    ("solver", "rank_ratio"), [("kid", 0.5), ("kis", 0.5), ("kis+exact", 0.5), ("hybrid", 0.5)], ids=str
)
@pytest.mark.parametrize("strategy", ["inverse", "gradient"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_approximate_solvers_agree_across_ranks(world_size: int, strategy: str, solver: str, rank_ratio: float) -> None:
    """KID/KIS keeping half the rows, and hybrid (both families): every rank has bitwise the same gradients."""
    runs = cluster_run(world_size, solver, strategy, rank_ratio)
    for step in range(STEPS):
        for key, want in runs[0].preconditioned[step].items():
            assert torch.isfinite(want).all()
            assert not torch.allclose(want, runs[0].raw[step][key]), f"step {step} {key}: not preconditioned"
            for rank, run in enumerate(runs[1:], start=1):
                assert torch.equal(run.preconditioned[step][key], want), f"rank {rank} step {step} {key}"
    for key, want in runs[0].params.items():
        assert all(torch.equal(run.params[key], want) for run in runs[1:]), f"final {key}"
    if solver == "hybrid":
        used = {s for step in range(0, STEPS, UPDATE_FREQ) for s in runs[0].solvers[step].values()}
        assert "kfac" in used and used - {"kfac"}, used


# --------------------------------------------------------------------------- bytes
def update_bytes(solver: str, d_a: int, d_g: int, world_size: int, rows: int, rank_ratio: float) -> tuple[int, int]:
    """Bytes of one layer's update summed over ranks (float64, equal local batches): contributions, solution.

    Low-rank: every rank sends its r kept rows of a and g, KID's r×r weights and its [n, r]; under
    "inverse" the owner broadcasts the m×m inner matrix (m = P·r). K-FAC: every rank sends its two
    factors; the owner broadcasts both eigendecompositions (vectors and values).
    """
    if solver == "kfac":
        return world_size * (d_a**2 + d_g**2) * 8, (d_a**2 + d_a + d_g**2 + d_g) * 8
    r = rows_kept(solver, rows, rank_ratio)
    weights = r * r if solver == "kid" else 0
    return world_size * (r * (d_a + d_g) + weights + 2) * 8, (world_size * r) ** 2 * 8


@pytest.mark.parametrize(("solver", "rank_ratio"), SOLVER_CASES[:4], ids=SOLVER_IDS[:4])
@pytest.mark.parametrize("strategy", ["inverse", "gradient"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_update_bytes_per_layer_match_the_formula(
    world_size: int, strategy: str, solver: str, rank_ratio: float
) -> None:
    """bytes_by_tag[layer] summed over ranks after step 0 (one update) == the payload formula.

    Under "gradient" the owner broadcasts no solution but, at the step, every rank sends its owned layers' d_g×d_a
    preconditioned gradients under ``<results>``, packed into one buffer padded to the largest rank's share.
    """
    runs = cluster_run(world_size, solver, strategy, rank_ratio)
    for name in LAYERS:
        d_a, d_g = DIMS[name]
        contributions, solution = update_bytes(solver, d_a, d_g, world_size, BATCH // world_size, rank_ratio)
        expected = contributions + (solution if strategy == "inverse" else 0)
        total = sum(run.first_step_bytes.get(name, 0) for run in runs)
        assert total == expected, f"{name}: {total} bytes, expected {expected}"
    owners = runs[0].owners[0]
    shares = [sum(DIMS[n][0] * DIMS[n][1] * 8 for n in LAYERS if owners[n] == rank) for rank in range(world_size)]
    results = [run.first_step_bytes.get(RESULTS, 0) for run in runs]
    assert results == ([max(shares)] * world_size if strategy == "gradient" else [0] * world_size), (results, shares)


# --------------------------------------------------------------------------- failures
FAILURES: list[tuple[str, str, Collective, int]] = [
    ("kfac", "inverse", "broadcast", 0),  # the owners' eigendecompositions, step 0
    ("sngd", "gradient", "all_gather", 0),  # the row counts, step 0
    ("kid", "inverse", "all_gather", 3),  # the gathered rows of the second update (step 2)
]


@pytest.mark.parametrize(("solver", "strategy", "op", "on_call"), FAILURES, ids=lambda v: str(v))
def test_failure_during_an_update_is_a_communication_error_on_every_rank(
    solver: str, strategy: str, op: Collective, on_call: int
) -> None:
    """A backend failure on rank 1 of 3 inside an update: ``hylo.CommunicationError`` on every rank, no hang."""
    cluster = ThreadCluster(3, timeout=TIMEOUT)
    cluster.fail(1, on_call=on_call, op=op)
    start = time.monotonic()
    errors = cluster.run(train, make_models(3), (4, 4, 4), options_of(solver, 0.5, strategy), return_exceptions=True)
    assert time.monotonic() - start < TIMEOUT / 2
    for rank, error in enumerate(errors):
        assert isinstance(error, hylo.CommunicationError), f"rank {rank}: {error!r}"
        assert f"rank {rank} of 3" in str(error)
