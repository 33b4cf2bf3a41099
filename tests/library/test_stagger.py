"""``stagger_updates``: each layer updates at its own offset in the cycle (docs/usage.md, "Staggered updates").

Specified against independent references:

- the offsets put the layers' estimated solve costs about evenly on the cycle's steps (largest first, each to the
  least loaded step) and every layer updates once per cycle, at its offset; step 0 updates every layer;
- a staggered K-FAC layer is K-FAC on its own update steps: its preconditioned gradient at every step is the dense
  (A ⊗ G + λI)⁻¹ vec ∇W with A and G the running averages of the factors built from the layer's own inputs and
  output gradients at its update steps only;
- an update owed (a skipped step) updates every layer at the next step;
- the combinations it cannot serve are refused at construction.

P ranks = one process with staggered updates: tests/library/test_distributed.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.pipeline.planner import stagger_offsets
from tests.kit.checks import DT, assert_rel_close
from tests.kit.reference import dense_kfac, linear_rows
from tests.library.test_basis_refresh import Degenerate, assert_refreshes_change_nothing, degenerate_batch

pytestmark = [pytest.mark.usefixtures("single_thread")]

WIDTHS = (6, 12, 5, 9, 3)  # four Linear layers of different sizes


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for d_in, d_out in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
        layers += [nn.Linear(d_in, d_out, dtype=DT), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(20, WIDTHS[0], generator=gen, dtype=DT), torch.randint(0, WIDTHS[-1], (20,), generator=gen)


def test_offsets_balance_the_estimated_costs() -> None:
    # 8 alone; the 4s apart; the 1s onto them (8, 5, 5); the 0 to the first of the two with the least cost and
    # count (step 1: 5 with two layers, as step 2)
    assert stagger_offsets([8.0, 1.0, 1.0, 4.0, 4.0, 0.0], 3) == [0, 1, 2, 1, 2, 1]
    # equal (or unknown, 0) costs: by count, in order
    assert stagger_offsets([0.0] * 5, 2) == [0, 1, 0, 1, 0]
    assert stagger_offsets([1.0, 2.0], 4) == [1, 0]


def test_each_layer_updates_once_a_cycle_at_its_offset() -> None:
    model = _model()
    pre = hylo.HyLoPreconditioner(model, solver="kfac", update_freq=3, damping=0.1, stagger_updates=True)
    names = [info.name for info in pre.layer_info()]
    updated: list[set[str]] = []
    for step in range(10):
        before = {info.name: info.state for info in pre.layer_info()}
        model.zero_grad()
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        updated.append({info.name for info in pre.layer_info() if info.state != before[info.name]})
    assert updated[0] == set(names)
    offsets = {}
    for name in names:
        steps = [step for step in range(1, 10) if name in updated[step]]
        assert len(steps) == 3 and steps[1] - steps[0] == steps[2] - steps[1] == 3, (name, steps)
        offsets[name] = steps[0] % 3
    assert set(offsets.values()) == {0, 1, 2}  # four layers over three steps: no step carries them all
    # the two largest solves (layer 2: 13³ + 5³, layer 0: 7³ + 12³, with the bias column) are on different steps
    assert offsets["2"] != offsets["0"]


def test_a_staggered_layer_is_kfac_on_its_own_update_steps() -> None:
    model = _model()
    damping, decay = 0.1, 0.7
    pre = hylo.HyLoPreconditioner(
        model, solver="kfac", update_freq=2, damping=damping, factor_decay=decay, stagger_updates=True
    )
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    inputs: dict[str, Tensor] = {}
    outputs: dict[str, Tensor] = {}
    for name, module in linears.items():
        module.register_forward_hook(_recorder(name, inputs, outputs))
    running: dict[str, tuple[Tensor, Tensor]] = {}
    offsets = dict.fromkeys(linears, -1)
    for step in range(7):
        model.zero_grad()
        x, y = _batch(step)
        loss = F.cross_entropy(model(x), y)
        for out in outputs.values():
            out.retain_grad()
        loss.backward()
        raw = {name: torch.cat([m.weight.grad, m.bias.grad[:, None]], 1) for name, m in linears.items()}
        before = {info.name: info.state for info in pre.layer_info()}
        pre.step()
        for info in pre.layer_info():
            name = info.name
            if info.state == before[name]:
                continue  # not this layer's update step
            offsets[name] = step % 2 if step else offsets[name]
            grad_out = outputs[name].grad
            assert grad_out is not None
            a, g = linear_rows(linears[name], inputs[name], grad_out)
            batch = (a.mT @ a / a.shape[0], g.mT @ g / g.shape[0])
            previous = running.get(name)
            running[name] = (
                batch
                if previous is None
                else (decay * previous[0] + (1 - decay) * batch[0], decay * previous[1] + (1 - decay) * batch[1])
            )
        for name, m in linears.items():
            got = torch.cat([m.weight.grad, m.bias.grad[:, None]], 1)
            assert_rel_close(got, dense_kfac(*running[name], raw[name], damping), 1e-9)
    assert set(offsets.values()) == {0, 1}  # the layers did update at different steps


def _recorder(name: str, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> Any:
    def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        inputs[name] = args[0].detach()
        outputs[name] = output

    return hook


def test_an_owed_update_updates_every_layer() -> None:
    model = _model()
    pre = hylo.HyLoPreconditioner(model, solver="kfac", update_freq=4, damping=0.1, stagger_updates=True)
    for step in range(3):
        model.zero_grad()
        x, y = _batch(step)
        loss = F.cross_entropy(model(x), y)
        (loss * float("inf") if step == 1 else loss).backward()
        before = {info.name: info.state for info in pre.layer_info()}
        if step == 1:
            with pytest.warns(UserWarning, match="non-finite"):
                pre.step()
        else:
            pre.step()
        changed = {info.name for info in pre.layer_info() if info.state != before[info.name]}
        if step == 2:  # step 1 was skipped: its layers' update is owed, and an owed update updates every layer
            assert changed == {info.name for info in pre.layer_info()}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"solver": "hybrid"}, "stagger_updates needs a fixed solver"),
        ({"solver": "kfac", "factor_update_freq": 2}, "stagger_updates and factor_update_freq"),
        ({"solver": "kfac", "studies": ("rank",), "profile_dir": "unused"}, r"studies \['rank'\]"),
        ({"solver": "kfac", "stagger_updates": 1}, "stagger_updates must be a bool"),
    ],
)
def test_what_staggering_cannot_serve_is_refused_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hylo.HyLoPreconditioner(_model(), **{"stagger_updates": True, **options})


@pytest.mark.parametrize("refresh", ["eigh", "power"])
@pytest.mark.parametrize(("rows", "zero_at"), [(5, None), (5, 4), (1, None)], ids=["repeated", "zero-grad", "one-row"])
def test_staggered_refreshes_of_unchanged_degenerate_factors_leave_the_steps_unchanged(
    refresh: str, rows: int, zero_at: int | None
) -> None:
    """kfac_adam staggered over a cycle of 2 on degenerate spectra (repeated eigenvalues, rank-deficient factors, a
    duplicated input column, a dead unit, an embedding, one row, all gradients zero at a step): every layer's
    refresh from its unchanged running factors takes the steps of the run that never refreshes, to round-off
    (docs/solvers.md, "Degenerate eigenspaces"); states finite, bases orthonormal, no warning. Before the refresh
    was turned to the previous basis, the staggered ``eigh`` steps differed by 20-25% (relative)."""
    assert_refreshes_change_nothing(rows, zero_at, basis_refresh=refresh, stagger_updates=True)


def test_staggered_layers_refresh_at_different_steps_on_degenerate_spectra() -> None:
    """The comparison above is not vacuous: the layers of :class:`Degenerate` do update at different steps."""
    model = Degenerate()
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=2, adam_eps=1e-3, stagger_updates=True)
    x, ids, y = degenerate_batch(5)
    updated: list[set[str]] = []
    for step in range(4):
        before = {info.name: info.state for info in pre.layer_info()}
        model.zero_grad()
        F.cross_entropy(model(x * (1 + step), ids), y).backward()  # factors that move at each update
        pre.step()
        updated.append(
            {
                info.name
                for info in pre.layer_info()
                if (then := before[info.name]) is None
                or not torch.equal(info.state.tensors["factor_g"], then.tensors["factor_g"])  # type: ignore[union-attr]
            }
        )
    assert updated[0] == {"first", "wide", "embed", "out"}
    assert updated[2] and updated[3] and not updated[2] & updated[3]
