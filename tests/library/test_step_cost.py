"""The shape of a step's cost between updates: O(groups), not O(layers) (docs/design.md, "The apply plan").

Counted, not timed: the aten operations ``step()`` dispatches (:class:`hylo_scripts.benchmarks.bench_ops.OpCounter`) on a
step between curvature updates. A stack of 16 equal Linear layers issues at most 16 operations more than a stack
of 4 (one group either way), where the per-layer path (``grouped=False``) issues dozens more per layer; the plan
is built once per update and reused by the steps between. The same holds on every rank of 2 gloo ranks under DDP's
default strategy, under ``strategy="gradient"`` and under FSDP2 (docs/design.md, "Placements"), and FSDP2 costs at
most twice one process on the LM bench decoder.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hylo import HyLoPreconditioner
from hylo_scripts.benchmarks.bench_ops import OpCounter, count, stack, step_counts
from tests.kit.harness import run_distributed
from tests.kit.internals import apply_plan

pytestmark = pytest.mark.usefixtures("single_thread")


def between_updates(layers: int, solver: str, grouped: bool = True) -> tuple[OpCounter, HyLoPreconditioner]:
    """The operations of the step after the first update (between updates) on a stack of ``layers`` equal
    Linear(64, 64) layers (``scripts/bench_ops.py --model stack``'s), batch 32."""
    model, x, y, _ = stack(layers, 32)
    pre = HyLoPreconditioner(model, solver=solver, update_freq=10, damping=0.1, grouped=grouped)
    counted = OpCounter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if step == 1:
                counted = count(pre.step)
            else:
                pre.step()
    return counted, pre


#: The pin of the cost's shape (docs/design.md, "The apply plan"; docs/benchmarks.md, "Operations per step"): a stack
#: of ``MANY`` equal layers issues at most ``MARGIN`` operations more than one of ``FEW``.
FEW, MANY, MARGIN = 4, 16, 16


@pytest.mark.parametrize("solver", ["kfac", "sngd", "kis", "kfac_adam"])
def test_sixteen_layers_cost_four_layers_plus_a_constant(solver: str) -> None:
    """16 equal layers: at most 16 operations more than 4, one group either way; one layer a group, at least 4
    more per layer."""
    four, _ = between_updates(FEW, solver)
    sixteen, pre = between_updates(MANY, solver)
    assert sixteen.total <= four.total + MARGIN, (four.counts, sixteen.counts)
    plan = apply_plan(pre)
    assert plan is not None and len(plan.groups) == 1
    (per_few, _), (per_many, _) = (between_updates(n, solver, grouped=False) for n in (FEW, MANY))
    assert per_many.total - per_few.total >= 4 * (MANY - FEW), (per_few.total, per_many.total)


def _between_on_rank(
    rank: int, world_size: int, model: str, sizes: dict[str, int], solver: str, placement: str, options: dict[str, str]
) -> int:
    """Operations of this rank's step between updates (under DDP, or each block ``fully_shard``-ed; the same batch on
    every rank), as ``torchrun --nproc-per-node 2 scripts/bench_ops.py`` counts them."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        options = {**PLACEMENTS[placement], **options}
        shard = placement == "fsdp2"
        image = 16 if model == "transformer" else None
        _, _, between = step_counts(model, solver, 8, 10, image, model_options=sizes, options=options, shard=shard)
    return between.total


#: The placements at P > 1 (docs/design.md, "Placements"): DDP's default strategy (``Local``),
#: ``strategy="gradient"`` (``Owners``) and FSDP2 (``Sharded``), as hylo options.
PLACEMENTS: dict[str, dict[str, str]] = {"inverse": {}, "gradient": {"strategy": "gradient"}, "fsdp2": {}}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("solver", ["kfac", "kfac_adam", "sngd"])
def test_two_ranks_sixteen_layers_cost_four_layers_plus_a_constant(placement: str, solver: str) -> None:
    """2 gloo ranks: on every rank 16 equal layers cost at most 16 operations more than 4, whichever rank owns
    which layer, whichever placement."""
    few, many = (
        run_distributed(_between_on_rank, 2, "stack", {"layers": n}, solver, placement, {}, timeout=120)
        for n in (FEW, MANY)
    )
    assert all(b <= a + MARGIN for a, b in zip(few, many, strict=True)), (few, many)


@pytest.mark.parametrize(("solver", "options"), [("kfac", {"kfac_method": "inverse"}), ("kfac_adam", {})], ids=str)
def test_fsdp2_costs_at_most_twice_one_process_on_the_lm_decoder(solver: str, options: dict[str, str]) -> None:
    """The LM bench decoder (2 blocks of width 128), each block ``fully_shard``-ed on 2 gloo ranks: a step between
    updates costs at most twice what it costs in one process (the kernels' exchange and the check's agreement)."""
    sizes = {"layers": 2, "width": 128}
    sharded = run_distributed(_between_on_rank, 2, "transformer", sizes, solver, "fsdp2", options, timeout=120)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, alone = step_counts("transformer", solver, 8, 10, 16, model_options=sizes, options=options)
    assert max(sharded) <= 2 * alone.total, (sharded, alone.total)


def test_the_plan_is_reused_between_updates_and_rebuilt_after_one() -> None:
    """Between updates the plan is the same object; an update (new states) or a load rebuilds it."""
    model, x, y, _ = stack(3, 8)
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=3, damping=0.1)
    plans = []
    for _ in range(7):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        plans.append(apply_plan(pre))
    assert plans[0] is plans[1] is plans[2]  # step 0 updates, 1 and 2 reuse its plan
    assert plans[3] is not plans[2] and plans[3] is plans[4] is plans[5]  # step 3 updated
    pre.load_state_dict(pre.state_dict())
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()
    assert apply_plan(pre) is not plans[6]  # the loaded states are new objects


def test_memory_breakdown_counts_the_plan() -> None:
    """The plan's stacked copies are part of what the preconditioner holds."""
    _, pre = between_updates(4, "kfac")
    plan = apply_plan(pre)
    assert plan is not None
    held = pre.memory_breakdown()
    kernel = sum(t.numel() * t.element_size() for t in plan.groups[0].kernel.tensors())
    assert kernel > 0
    assert held.bookkeeping >= kernel


#: Operations of a step between updates the benchmarks' workloads must stay within (docs/benchmarks.md,
#: "Operations per step"): (model, its options, solver, hylo options) → the most operations.
TARGETS = [
    ("transformer", {"layers": 2, "width": 128}, "kfac", {"kfac_method": "inverse"}, 80),
    ("transformer", {"layers": 2, "width": 128}, "kfac_adam", {}, 100),
    ("resnet32", {}, "kfac", {}, 150),
    ("resnet32", {}, "hybrid", {}, 150),
    ("resnet32", {}, "kfac_adam", {}, 180),
]


@pytest.mark.parametrize(("model", "sizes", "solver", "options", "most"), TARGETS, ids=lambda v: str(v))
def test_the_benchmarks_step_stays_within_its_operations(
    model: str, sizes: dict[str, int], solver: str, options: dict[str, str], most: int
) -> None:
    """The LM bench decoder and ResNet-32, counted as ``scripts/bench_ops.py`` counts them (small batches: the
    count does not depend on the batch), each phase counted once."""
    fwd_bwd, update, between = step_counts(model, solver, 2, 10, 8, model_options=sizes, options=options)
    assert 0 < fwd_bwd.total and between.total < update.total
    assert between.total <= most, between.counts
