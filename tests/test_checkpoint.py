"""Checkpoints: ``state_dict``/``load_state_dict`` of HyLoPreconditioner (hylo/preconditioner.py).

Round trips continue bit for bit (exact solvers, KIS/KID with their generator, the hybrid policy
with its gradient-norm trend); a state_dict that does not fit the model raises and changes nothing.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from hylo import HyLoPreconditioner
from tests.kit.models import classifier_inputs, classifier_mlp

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- low-rank solvers
def _training_run(
    solver: str, steps: int, save_at: int | None, resume: bytes | None = None
) -> tuple[list[Tensor], bytes | None]:
    """SGD + hylo (update_freq=2) on a fixed data stream; optionally checkpoint or resume."""
    data = [classifier_inputs("linear", 24, seed=50 + i) for i in range(steps)]
    model = classifier_mlp(seed=0 if resume is None else 123)  # the resumed run starts from other weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = HyLoPreconditioner(
        model, solver=solver, update_freq=2, rank_ratio=0.25, damping=0.1, seed=11 if resume is None else 0
    )
    start = 0
    if resume is not None:
        ckpt = torch.load(io.BytesIO(resume), weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        pre.load_state_dict(ckpt["hylo"])
        start = pre.steps
    saved = None
    for step in range(start, steps):
        if step == save_at:
            buffer = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hylo": pre.state_dict()},
                buffer,
            )
            saved = buffer.getvalue()
        x, y = data[step]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], saved


@pytest.mark.parametrize("save_at", [2, 3], ids=["before_update_step", "before_reuse_step"])
@pytest.mark.parametrize("solver", ["kis", "kid"])
def test_state_dict_round_trip_continues_bit_for_bit(solver: str, save_at: int) -> None:
    straight, checkpoint = _training_run(solver, 6, save_at)
    assert checkpoint is not None
    resumed, _ = _training_run(solver, 6, None, resume=checkpoint)
    assert all(torch.equal(s, r) for s, r in zip(straight, resumed, strict=True))
    again, _ = _training_run(solver, 6, None)  # the uninterrupted run itself is deterministic
    assert all(torch.equal(s, r) for s, r in zip(straight, again, strict=True))
