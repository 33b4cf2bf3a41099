"""Coverage: the share of a model's trainable matrix parameters hylo preconditions, and what it leaves alone by reason
(docs/usage.md, "Coverage"). Counted here by hand from the model's own shapes."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import hylo
from hylo import Coverage


class Zoo(nn.Module):
    """Every reason a matrix is left alone, beside two layers hylo preconditions."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)  # preconditioned: 128 elements (its bias is a vector: not counted)
        self.attn = nn.MultiheadAttention(16, 2)  # preconditioned: in_proj 768 + out_proj 256
        self.norm = nn.LayerNorm(16)  # vectors only: not counted
        self.embed = nn.Embedding(10, 16)
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: 160, counted once
        self.grouped = nn.Conv1d(16, 16, 3, groups=4)  # unsupported: 16·4·3 = 192
        self.skipped = nn.Linear(16, 4)  # skip_layers: 64
        self.frozen = nn.Linear(16, 16)  # frozen: not counted
        self.frozen.requires_grad_(False)
        self.table = nn.Parameter(torch.zeros(5, 6))  # the root's own matrix: 30 under "Zoo"


def test_coverage_counts_elements_of_trainable_matrices_by_reason() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unsupported modules' warning
        pre = hylo.HyLoPreconditioner(Zoo(), skip_layers=("skipped",))
    left = (("Conv1d", 192), ("tied", 160), ("skip_layers", 64), ("Zoo", 30))
    assert pre.coverage() == Coverage(preconditioned=128 + 768 + 256, total=1152 + 192 + 160 + 64 + 30, left_alone=left)
    assert pre.coverage().share == 1152 / 1598


def test_the_summary_ends_with_the_coverage_line() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].requires_grad_(False)
    pre = hylo.HyLoPreconditioner(model)
    last = pre.summary().splitlines()[-1]
    assert last == "coverage: 100.0% of the trainable matrix parameters preconditioned (32 of 32 elements)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        partial = hylo.HyLoPreconditioner(Zoo())
    assert partial.summary().splitlines()[-1] == (
        "coverage: 76.1% of the trainable matrix parameters preconditioned (1,216 of 1,598 elements); "
        "left alone: 192 Conv1d, 160 tied, 30 Zoo"
    )
