"""A user's solver family with an option and a statistic of its own (docs/extending.md, "Family options and
statistics").

``examples/diagonal_family.py`` registers ``"diagonal"``: V̂ = ∇W / (diag F + λ)^p, its statistic the per-call sum
of squared per-sample gradients, its option ``diag_exponent`` (p). Specified here:

- the example runs as a user would run it; its family shows in ``summary()`` and ``decisions.csv`` (a decision
  and a ``cost_diagonal`` column), and a run resumed from a checkpoint continues bit for bit;
- the family's step is the diagonal of the model's true empirical Fisher (per-sample gradients of a loop of
  single-sample backward passes), raised to -p with the p the config gives; 2 ranks under DDP = one process;
- its section is a section of ``HyLoConfig`` (flat keyword, section keyword, ``section()``, checked by its rule,
  listed by ``options()``) while the family is registered, and unknown once it is removed;
- the hooks capture its statistic exactly when the config can give a layer the family;
- registration refuses a section whose names clash, one that is not a frozen named ``Section``, and a
  statistic that is not a ``CallStatistic``.
"""

from __future__ import annotations

import csv
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hylo
from hylo.config import options
from hylo.layers import FACTORS, ROWS
from hylo.rules import Section, option
from tests.kit.checks import DT, rel_err
from tests.kit.examples import EXAMPLES, load_example
from tests.kit.harness import run_distributed
from tests.kit.reference import per_sample_matrices
from tests.library.test_distributed import make_data, train

pytestmark = pytest.mark.usefixtures("single_thread")

EXAMPLE = EXAMPLES / "diagonal_family.py"


example = load_example("diagonal_family")


@pytest.fixture
def registered() -> Iterator[None]:
    """The example's family, registered for one test and removed after it."""
    handle = example.register()
    yield
    handle.remove()


# --------------------------------------------------------------------------- the example as a user runs it
def test_the_example_runs_and_its_family_shows_in_summary_and_decisions(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [row[-2] for row in rows if row[:2] in (["0", "Linear"], ["2", "Linear"])] == ["diagonal", "diagonal"]
    with (out / "decisions.csv").open() as handle:
        decisions = list(csv.DictReader(handle))
    assert {row["solver"] for row in decisions if row["layer"] in ("0", "2")} == {"diagonal"}
    assert {row["solver"] for row in decisions if row["layer"] == "4"} == {"kfac"}
    assert all(float(row["cost_diagonal"]) > 0 for row in decisions)
    assert len(decisions) == 3 * 4  # 8 steps at update_freq 2, across the resume (appended)


def test_a_run_resumed_from_its_checkpoint_continues_bit_for_bit(registered: None) -> None:
    whole, whole_state = example.run(None)
    resumed, resumed_state = example.run(None, resume_at=3)
    assert resumed == whole
    for name, entry in whole_state["layers"].items():
        again = resumed_state["layers"][name]
        assert again["solver"] == entry["solver"]
        for key, tensor in entry["tensors"].items():
            assert torch.equal(again["tensors"][key], tensor), (name, key)
    assert whole_state["layers"]["0"]["exponent"] == 0.5  # the state's own checkpoint field


# --------------------------------------------------------------------------- the family's math
@pytest.mark.parametrize("exponent", [1.0, 0.5])
def test_the_step_is_the_diagonal_of_the_true_fisher(registered: None, exponent: float) -> None:
    """V̂ = ∇W / (diag F + λ)^p with diag F = (1/n) Σ U_i², U_i the true per-sample gradients (n · the sample's share
    of the mean loss's gradient, from single-sample backward passes: nothing of hylo)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DT)
    x, y = torch.randn(12, 5, dtype=DT), torch.randint(0, 3, (12,))
    damping = 0.05
    layers = {"0": model[0], "2": model[2]}
    per_sample = per_sample_matrices(model, layers, x, lambda out: F.cross_entropy(out, y))
    pre = hylo.HyLoPreconditioner(model, solver="diagonal", diag_exponent=exponent, damping=damping)
    F.cross_entropy(model(x), y).backward()
    grads = {name: torch.cat([m.weight.grad, m.bias.grad[:, None]], 1) for name, m in layers.items()}
    pre.step()
    for name, layer in layers.items():
        u = per_sample[name]
        assert rel_err(u.mean(0), grads[name]) < 1e-12  # the oracle's U_i average to the model's gradient
        expected = grads[name] / (u.square().mean(0) + damping) ** exponent
        got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
        assert rel_err(got, expected) < 1e-10, name
        assert rel_err(got, grads[name] / (grads[name].square() + damping) ** exponent) > 1e-3  # not the batch mean²
    pre.remove()


def test_two_ranks_equal_one_process(registered: None) -> None:
    """The conv net of test_distributed.py (a Conv2d's summed rows, two Linear layers) under DDP on 2 gloo ranks:
    each step's preconditioned gradients = one process on the whole batch (the family registered before the
    ranks fork)."""
    steps, batch = 3, 8
    xs, ys = make_data(steps, batch, torch.float64)
    one = train(0, 1, "diagonal", xs, ys, [batch], 1)
    two = run_distributed(train, 2, "diagonal", xs, ys, [4, 4], 1, timeout=120)
    for step in range(steps):
        for key, expected in one["pre"][step].items():
            for rank in range(2):
                assert rel_err(two[rank]["pre"][step][key], expected) < 1e-10, (step, key, rank)
        assert any(rel_err(g, one["raw"][step][k]) > 1e-3 for k, g in one["pre"][step].items())


# --------------------------------------------------------------------------- the family's options
def test_its_section_is_a_section_of_the_config_while_registered() -> None:
    handle = example.register()
    try:
        flat = hylo.HyLoConfig(diag_exponent=0.5)
        given = hylo.HyLoConfig(diagonal=example.DiagonalConfig(diag_exponent=0.25))
        assert flat.section("diagonal") == example.DiagonalConfig(diag_exponent=0.5)
        assert given.section("diagonal").diag_exponent == 0.25
        assert given.replace(damping=2.0).section("diagonal").diag_exponent == 0.25
        assert given.replace(diag_exponent=0.75).section("diagonal").diag_exponent == 0.75
        assert flat.family_options()(example.DiagonalConfig).diag_exponent == 0.5
        assert hylo.HyLoConfig().section("diagonal") == example.DiagonalConfig()
        specs = {spec.name: spec for spec in options()}
        assert specs["diag_exponent"].section == "diagonal" and specs["diag_exponent"].default == 1.0
        with pytest.raises(ValueError, match="diag_exponent"):
            hylo.HyLoConfig(diag_exponent=2.0)
        with pytest.raises(ValueError, match="diagonal must be a DiagonalConfig"):
            hylo.HyLoConfig(diagonal=hylo.KFACConfig())
        assert "diag_exponent" in flat.constants()
    finally:
        handle.remove()
    assert "diag_exponent" not in {spec.name for spec in options()}
    with pytest.raises(TypeError, match="unknown hylo option 'diag_exponent'"):
        hylo.HyLoConfig(diag_exponent=0.5)
    with pytest.raises(KeyError, match="no section 'diagonal'"):
        hylo.HyLoConfig().section("diagonal")


def test_the_statistic_is_captured_where_the_config_can_reach_the_family(registered: None) -> None:
    statistic = example.SQUARED_GRADIENTS
    assert hylo.HyLoConfig(solver="diagonal").statistics() == (statistic,)
    assert hylo.HyLoConfig(solver="kfac").statistics() == (FACTORS,)
    assert hylo.HyLoConfig().statistics() == (FACTORS, ROWS)  # hybrid: K-FAC and the low-rank variants
    assert hylo.HyLoConfig(layer_solvers={"head": "diagonal"}).statistics() == (FACTORS, ROWS, statistic)
    assert statistic in hylo.HyLoConfig(solver_fn=lambda name, step, stats: "kfac").statistics()
    # the hook reduces each call to it: between backward and step() the layer holds its d_g × d_a sum, not rows
    model = nn.Sequential(nn.Linear(64, 48)).to(DT)
    pre = hylo.HyLoPreconditioner(model, solver="diagonal", damping=1e-4)
    F.mse_loss(model(torch.randn(256, 64, dtype=DT)), torch.zeros(256, 48, dtype=DT)).backward()
    assert pre.memory_breakdown().captured == {"0": 48 * 65 * DT.itemsize}
    pre.step()
    pre.remove()


# --------------------------------------------------------------------------- registration
def _family_with(**attributes: Any) -> hylo.solvers.SolverFamily[Any]:
    cls = type("Other", (example.DiagonalFamily,), {"name": "other", "solvers": property(lambda self: ("other",))})
    for key, value in attributes.items():
        setattr(cls, key, value)
    return cls()


@dataclass(frozen=True)
class Clashing(Section):
    """A section that takes a built-in option's name."""

    section_name: ClassVar[str | None] = "clashing"
    damping: float = option(1.0, doc="a second damping")


@dataclass(frozen=True)
class TakesASectionName(Section):
    """A section named like a built-in one."""

    section_name: ClassVar[str | None] = "kfac"
    my_option: float = option(1.0, doc="an option")


@dataclass(frozen=True)
class Unnamed(Section):
    """A section without a name."""

    my_option: float = option(1.0, doc="an option")


@dataclass
class Mutable(Section):
    """A section that is not frozen."""

    section_name: ClassVar[str | None] = "mutable"
    my_option: float = option(1.0, doc="an option")


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"section": Clashing}, r"reuses option or section names \['damping'\]"),
        ({"section": TakesASectionName}, r"reuses option or section names \['kfac'\]"),
        ({"section": Unnamed}, "needs a section_name"),
        ({"section": Mutable}, "must be a frozen dataclass"),
        ({"section": dict}, "must be a Section dataclass"),
        ({"statistic": "squared"}, "statistic must be a hylo.layers.CallStatistic instance"),
    ],
    ids=["option-clash", "section-clash", "unnamed", "mutable", "not-a-section", "statistic"],
)
def test_registration_refuses_what_would_break_the_config(attributes: dict[str, Any], message: str) -> None:
    before = [spec.name for spec in options()]
    with pytest.raises(ValueError, match=message):
        hylo.register_family(_family_with(**attributes))
    assert [spec.name for spec in options()] == before
    assert "other" not in hylo.solvers.solver_names()


def test_a_second_family_may_share_a_registered_section(registered: None) -> None:
    """A family built on another (as kfac_adam on K-FAC) may read that family's section: no clash."""
    handle = hylo.register_family(_family_with())
    try:
        assert hylo.HyLoConfig(solver="other", diag_exponent=0.5).section("diagonal").diag_exponent == 0.5
    finally:
        handle.remove()


def test_the_state_refuses_a_bad_checkpoint_entry(registered: None) -> None:
    good = example.DiagonalState(torch.ones(3, 4, dtype=DT), 0.1, 0.5).to_dict()
    example.DiagonalState.from_dict(good, 4, 3, DT, torch.device("cpu"))
    with pytest.raises(ValueError, match="exponent"):
        example.DiagonalState.from_dict({**good, "exponent": -1.0}, 4, 3, DT, torch.device("cpu"))
    with pytest.raises(ValueError, match="scale has shape"):
        example.DiagonalState.from_dict(good, 5, 3, DT, torch.device("cpu"))
    assert dataclasses.replace(example.DiagonalState(torch.ones(2, 2), 4.0, 0.5)).bound == 2.0


def test_a_family_defines_eight_members_and_its_state_five() -> None:
    """docs/extending.md, "Solver families": a family defines its name, state type and statistic and five phases;
    every other member is a capability with a default, and the example's family takes every default."""
    from hylo.solvers import LayerState, SolverFamily

    assert SolverFamily.__abstractmethods__ == {"contribute", "prepare", "cost", "solve", "assemble"}
    declared = {name for name in SolverFamily.__annotations__ if not hasattr(SolverFamily, name)}
    assert declared == {"name", "state_type", "statistic"}
    assert LayerState.__abstractmethods__ == {"precondition", "tensors", "from_dict"}
    assert {name for name in LayerState.__annotations__ if not hasattr(LayerState, name)} == {"family", "damping"}
    interface = {name for cls in SolverFamily.__mro__ for name in (*vars(cls), *getattr(cls, "__annotations__", {}))}
    defined = {name for name in vars(example.DiagonalFamily) if name in interface and not name.startswith("_")}
    assert defined == {
        "name",
        "state_type",
        "statistic",
        "section",
        "contribute",
        "prepare",
        "cost",
        "solve",
        "assemble",
    }
