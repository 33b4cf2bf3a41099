"""Every built-in group kernel's FSDP2 split equals its whole apply (docs/distributed.md, "FSDP2").

Each case trains a small float64 model two steps with a solver, takes the states of two equal layers (the
eigen and inverse methods of K-FAC, blocked factors, the low-rank solvers on factored, one-hot and dense rows,
``kfac_adam``) and builds their group's kernel. Random gradients are cut into the shards four ranks would hold —
rows (``torch.chunk``-style over four ranks, the last empty) and columns — and every shard's
:meth:`~hylo.solvers.kernel.GroupKernel.shard_partial` is combined as the ranks combine it (summed, or its rows
concatenated in rank order). Property: each shard's :meth:`~hylo.solvers.kernel.GroupKernel.shard_finish` is its
rows (columns) of the kernel's :meth:`~hylo.solvers.kernel.GroupKernel.apply` on the whole gradients, to 1e-12, and
a state that advances has the same successor on every shard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.layers.gradmatrix import GradShard
from hylo.solvers import LayerState, family_named
from hylo.solvers.kernel import Exchange
from tests.kit.internals import held_states

DT = torch.float64


class Twins(nn.Module):
    """Two equal layers of ``kind`` side by side, summed, then a head: the twins' states form one group."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "embedding":
            self.one, self.two = nn.Embedding(9, 6), nn.Embedding(9, 6)
            self.head: nn.Module = nn.Linear(6, 3)
        elif kind == "conv":
            self.one, self.two = nn.Conv2d(2, 5, 3, padding=1), nn.Conv2d(2, 5, 3, padding=1)
            self.head = nn.Linear(5 * 9, 3)
        else:
            self.one, self.two = nn.Linear(7, 6), nn.Linear(7, 6)
            self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        joined = torch.tanh(self.one(x) + self.two(x))
        if self.kind == "conv":
            return self.head(joined.flatten(1))
        return self.head(joined.mean(1) if self.kind == "embedding" else joined)


def inputs(kind: str, batch: int) -> Tensor:
    """A batch for ``kind``'s twins."""
    if kind == "embedding":
        return torch.randint(0, 9, (batch, 4))
    if kind == "conv":
        return torch.randn(batch, 2, 3, 3, dtype=DT)
    return torch.randn(batch, 7, dtype=DT)


#: Each twin's ∇W (d_g, d_a): rows over 4 ranks leave the last one empty.
SHAPES = {"linear": (6, 8), "embedding": (6, 9), "conv": (5, 19)}
#: (twins, hylo options): the kernels of every built-in family and method.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("linear", {"solver": "kfac"}),
    ("linear", {"solver": "kfac", "kfac_method": "inverse"}),
    ("linear", {"solver": "kfac", "factor_block": 4}),
    ("linear", {"solver": "kfac", "kfac_method": "inverse", "factor_block": 4}),
    ("linear", {"solver": "sngd"}),
    ("linear", {"solver": "kfac_adam"}),
    ("embedding", {"solver": "sngd"}),
    ("embedding", {"solver": "kfac"}),
    ("conv", {"solver": "sngd"}),
    ("conv", {"solver": "sngd", "conv_rows": "exact"}),
]


def twin_states(kind: str, options: dict[str, Any]) -> list[LayerState]:
    """The twins' states after two steps (an update, then a step that advances what advances)."""
    torch.manual_seed(0)
    model = Twins(kind).to(DT)
    pre = HyLoPreconditioner(model, update_freq=10, damping=0.1, skip_layers=("head",), **options)
    for _ in range(2):
        model.zero_grad()
        F.cross_entropy(model(inputs(kind, 6)), torch.randint(0, 3, (6,))).backward()
        pre.step()
    states = [state for state in held_states(pre) if isinstance(state, LayerState)]
    assert len(states) == 2
    return states


def shards(total: int, axis: int, world_size: int = 4) -> list[GradShard]:
    """The parts of ``total`` rows (or columns) ``world_size`` ranks hold under ``fully_shard``."""
    chunk = -(-total // world_size)
    starts = [min(p * chunk, total) for p in range(world_size)]
    return [GradShard(start, min(start + chunk, total), total, axis) for start in starts]


def combined(pieces: list[list[tuple[Exchange, Tensor]]]) -> list[Tensor]:
    """Every rank's pieces combined as the ranks combine them: summed, or concatenated along dim 0."""
    out = []
    for of_ranks in zip(*pieces, strict=True):
        exchanges = {exchange for exchange, _ in of_ranks}
        assert len(exchanges) == 1
        tensors = [piece for _, piece in of_ranks]
        out.append(torch.stack(tensors).sum(0) if Exchange.SUM in exchanges else torch.cat(tensors))
    return out


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize(("kind", "options"), CASES, ids=lambda v: str(v))
def test_a_kernels_shards_finish_to_its_whole_apply(kind: str, options: dict[str, Any], axis: int) -> None:
    """See the module docstring."""
    states = twin_states(kind, options)
    family = family_named(states[0].family)
    kernel = family.group_kernel(states, DT)
    d_g, d_a = SHAPES[kind]
    grads = torch.randn(2, d_g, d_a, dtype=DT)
    whole, after = kernel.apply(grads.clone(), states)
    parts = shards(d_g if axis == 0 else d_a, axis)
    local = [grads[:, s.start : s.stop] if axis == 0 else grads[:, :, s.start : s.stop] for s in parts]
    received = combined([kernel.shard_partial(g.clone(), s, states) for g, s in zip(local, parts, strict=True)])
    for grad, shard in zip(local, parts, strict=True):
        result, successors = kernel.shard_finish(grad.clone(), shard, states, received)
        own = whole[:, shard.start : shard.stop] if axis == 0 else whole[:, :, shard.start : shard.stop]
        torch.testing.assert_close(result, own, rtol=0, atol=1e-12 * float(whole.abs().max()))
        for mine, theirs in zip(successors, after, strict=True):
            for name, tensor in mine.tensors().items():
                torch.testing.assert_close(tensor, theirs.tensors()[name], rtol=0, atol=1e-12)
