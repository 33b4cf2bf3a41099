"""The grouped step equals the per-layer step (docs/design.md, "The apply plan").

Each case draws a small model — an optional Conv2d or an Embedding in front (with a padding token), a Linear
stem, 2 to 4 equal-shaped Linear layers (with a bias, without, or alternating: several groups of one shape), a
head — a solver configuration (every solver, K-FAC's inverse method and refreshes, adaptive ranks, mixed
families), ``kl_clip`` or not, and a fault injected after the warm-up into one layer's state (a NaN, or a
damping of the wrong sign that breaks the length bound) so that the raw-gradient fallback fires. Two forks of
the run, fed the same data and stepped by SGD with momentum, differ only in ``grouped``: True (one batched kernel
per group) or False (layer by layer, the reference).

Property: at every step the preconditioned gradients, then the parameters, of the grouped fork equal the
reference's to 1e-12 in float64 (relative to each tensor's largest entry), the fallback counts are equal, and so
are the held states at the end (kfac_adam's moments advance in both). In bf16 (parameters and gradients), the
same to bf16's resolution. A family without a kernel of its own (the default ``LoopKernel``) gives the per-layer results
in its groups.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.solvers import FAMILIES, LayerState, LoopKernel, SolverFamily
from hylo.solvers.bundled.kfac_adam import KFACAdamState
from hylo.solvers.kfac import KFACInverseState, KFACState
from hylo.solvers.smw import LowRankState
from tests.kit.harness import run_distributed
from tests.kit.internals import apply_plan, replace_state
from tests.library.test_fuzz_resume import SOLVERS as RESUME_SOLVERS

pytestmark = pytest.mark.usefixtures("single_thread")

#: Every solver configuration of the resume fuzz (its "mixed" names the front layer "conv"), kfac_adam with an ε
#: that keeps Adam's division from magnifying the last bit of its rotated gradient by 1/ε (both paths' products
#: round alike only to a few ulps), and kfac_adam's second moment from the factors.
SOLVERS: dict[str, dict[str, Any]] = {
    name: {**options, "adam_eps": 1e-3} if options["solver"] == "kfac_adam" else options
    for name, options in RESUME_SOLVERS.items()
}
SOLVERS["kfac_adam-factors"] = {**SOLVERS["kfac_adam"], "second_moment": "factors", "adam_exponent": 0.25}
#: What the fault breaks: the state field set to NaN, per state type (a tensor its apply reads).
NAN_FIELDS = {KFACState: "evecs_g", KFACInverseState: "inverse_g", LowRankState: "inner", KFACAdamState: "evecs_g"}


@dataclass(frozen=True)
class Case:
    """One drawn example (see the module docstring)."""

    solver: str
    front: str  # "conv", "embedding" or "none"
    equal: int
    bias: str  # "all", "none" or "alternate"
    width: int
    batch: int
    update_freq: int
    damping: float
    kl_clip: bool
    fault: str  # "none", "nan" or "negate"
    seed: int


def draw(rng: random.Random, solver: str) -> Case:
    """A case of ``solver`` from ``rng``."""
    return Case(
        solver=solver,
        front=rng.choice(["conv", "embedding", "none"]),
        equal=rng.randint(2, 4),
        bias=rng.choice(["all", "none", "alternate"]),
        width=rng.randint(2, 8),
        batch=rng.randint(3, 10),
        update_freq=rng.randint(2, 3),
        damping=10.0 ** rng.uniform(-2.5, -0.5),
        kl_clip=rng.random() < 0.5,
        fault=rng.choice(["none", "nan", "negate"]),
        seed=rng.randrange(2**16),
    )


#: Tokens of the embedding front and classes of the head.
VOCAB, CLASSES, TOKENS = 7, 3, 3


def model_of(case: Case, dtype: torch.dtype) -> nn.Module:
    """The case's model, initialised from its seed."""
    torch.manual_seed(case.seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    features = 5
    if case.front == "conv":
        layers.update(conv=nn.Conv2d(2, 3, 3, padding=1), act=nn.Tanh(), flat=nn.Flatten())
        features = 3 * 4 * 4
    elif case.front == "embedding":
        layers.update(conv=nn.Embedding(VOCAB, 4, padding_idx=0), flat=nn.Flatten())  # "mixed" gives it KID
        features = 4 * TOKENS
    layers["stem"] = nn.Linear(features, case.width)
    for i in range(case.equal):
        bias = case.bias == "all" or (case.bias == "alternate" and i % 2 == 0)
        layers[f"act{i}"] = nn.Tanh()
        layers[f"eq{i}"] = nn.Linear(case.width, case.width, bias=bias)
    layers["head"] = nn.Linear(case.width, CLASSES)
    return nn.Sequential(layers).to(dtype)


def options_of(case: Case) -> dict[str, Any]:
    """The case's hylo options."""
    options = {**SOLVERS[case.solver], "update_freq": case.update_freq, "damping": case.damping, "seed": 3}
    if case.kl_clip:
        options.update(kl_clip=1e-4, lr=0.05)
    if "layer_solvers" in options and case.front == "none":
        options["layer_solvers"] = {k: v for k, v in options["layer_solvers"].items() if k != "conv"}
    return options


def inputs(case: Case, step: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The batch of ``step``."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + step)
    if case.front == "embedding":
        x = torch.randint(0, VOCAB, (case.batch, TOKENS), generator=gen)
    elif case.front == "conv":
        x = torch.randn(case.batch, 2, 4, 4, generator=gen, dtype=dtype)
    else:
        x = torch.randn(case.batch, 5, generator=gen, dtype=dtype)
    return x, torch.randint(0, CLASSES, (case.batch,), generator=gen)


def faulted(state: LayerState, fault: str) -> LayerState:
    """``state`` with the case's fault: a NaN in a tensor its apply reads, or (``"negate"``, a state with a length
    bound) its result negated, no longer a descent direction: K-FAC's λ and one factor's eigenvalues, the inverse
    method's (G + δ_g I)⁻¹ or the low-rank λ negated (a state without a bound gets the NaN)."""
    if fault == "negate" and state.bound is not None:
        if isinstance(state, KFACState):
            return dataclasses.replace(state, evals_a=-state.evals_a, damping=-state.damping)
        if isinstance(state, KFACInverseState):
            return dataclasses.replace(state, inverse_g=-state.inverse_g)
        return dataclasses.replace(state, damping=-state.damping)  # type: ignore[type-var]
    name = NAN_FIELDS[type(state)]
    nan = torch.full_like(getattr(state, name), float("nan"))
    return dataclasses.replace(state, **{name: nan})  # type: ignore[type-var]


@dataclass
class Fork:
    """One run: its model, optimizer and preconditioner."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    pre: HyLoPreconditioner


def forks(case: Case, dtype: torch.dtype, extra: dict[str, Any] | None = None) -> tuple[Fork, Fork]:
    """The grouped run and the reference, on equal copies of the model (``extra``: more hylo options)."""
    model = model_of(case, dtype)
    out = []
    for grouped in (True, False):
        copy_ = copy.deepcopy(model)
        pre = HyLoPreconditioner(copy_, grouped=grouped, **options_of(case), **(extra or {}))
        # a step of at most ~0.1 ‖∇W‖: the run stays where float64 keeps 1e-12 (its kernels' ‖K‖/λ moderate)
        optimizer = torch.optim.SGD(copy_.parameters(), lr=0.1 * case.damping, momentum=0.9)
        out.append(Fork(copy_, optimizer, pre))
    return out[0], out[1]


def train(case: Case, fork: Fork, step: int, dtype: torch.dtype) -> tuple[list[Tensor], list[float]]:
    """One step: the preconditioned gradients and each one's scale, that of its layer: the larger of its
    result's largest entry and its raw gradient's norm over λ (what (F̃ + λI)⁻¹ ∇W is bounded by, and the size of
    the terms an SMW solve subtracts)."""
    x, y = inputs(case, step, dtype)
    fork.optimizer.zero_grad()
    F.cross_entropy(fork.model(x).float(), y).backward()
    modules = [m for m in fork.model.modules() if not list(m.children()) and list(m.parameters())]
    raw = [float(torch.stack([p.grad.double().norm() for p in m.parameters()]).norm()) for m in modules]
    fork.pre.step()
    grads, scales = [], []
    for module, norm in zip(modules, raw, strict=True):
        mine = [p.grad.clone() for p in module.parameters()]
        largest = max(float(g.abs().max()) for g in mine)
        grads += mine
        scales += [max(largest, norm / case.damping)] * len(mine)
    fork.optimizer.step()
    return grads, scales


def assert_near(
    a: list[Tensor], b: list[Tensor], tolerance: float, what: str, scales: list[float] | None = None
) -> None:
    """Each pair equal to ``tolerance`` relative to its scale (default: the reference's largest entry); NaN where
    the reference has NaN."""
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x.isnan(), y.isnan()), f"{what} {i}: NaN at other places"
        x, y = x.nan_to_num(), y.nan_to_num()
        if not y.numel():
            continue
        scale = max(float(y.abs().max()) if scales is None else scales[i], 1e-30)
        error = float((x.double() - y.double()).abs().max())
        assert error <= tolerance * scale, f"{what} {i}: error {error:.3g} against scale {scale:.3g}"


def synced(grouped: Fork, reference: Fork) -> None:
    """The grouped fork made the reference's: parameters, optimizer and preconditioner (its ``state_dict``)."""
    grouped.model.load_state_dict(reference.model.state_dict())
    grouped.optimizer.load_state_dict(copy.deepcopy(reference.optimizer.state_dict()))  # its tensors, not shared
    grouped.pre.load_state_dict(copy.deepcopy(reference.pre.state_dict()))


def run_case(case: Case, dtype: torch.dtype, tolerance: float, **extra: Any) -> None:
    """The property on one case (see the module docstring); ``extra``: more hylo options. Under
    ``strategy="gradient"`` with P > 1 the fault goes into the state on the rank that holds it."""
    grouped, reference = forks(case, dtype, extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(case.update_freq * 4):
            if step % case.update_freq == 0 and step:  # from the same point: chaos neither path causes stays out
                synced(grouped, reference)
                if case.fault != "none" and step == case.update_freq * 3:  # the same fault in both, one layer
                    for fork in (grouped, reference):
                        if not fork.pre.layer_info()[-2].state.remote:
                            replace_state(fork.pre, -2, lambda state: faulted(state, case.fault))
            g_grads, _ = train(case, grouped, step, dtype)
            r_grads, scales = train(case, reference, step, dtype)
            assert_near(g_grads, r_grads, tolerance, f"step {step} gradient", scales)
            infos = grouped.pre.layer_info(), reference.pre.layer_info()
            assert [i.fallbacks for i in infos[0]] == [i.fallbacks for i in infos[1]], f"step {step}"
            for a, b in zip(*infos, strict=True):  # kfac_adam's moments
                kinds = [None if i.state is None else (i.state.kind, i.state.remote) for i in (a, b)]
                assert kinds[0] == kinds[1], a.name
                if a.state is not None and b.state is not None and not a.state.remote:
                    names = sorted(a.state.tensors)
                    assert names == sorted(b.state.tensors)
                    held = [a.state.tensors[n] for n in names], [b.state.tensors[n] for n in names]
                    assert_near(*held, tolerance, f"step {step} {a.name}")


CASES = [draw(random.Random(f"{solver}-{k}"), solver) for solver in SOLVERS for k in range(3)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.solver}-{c.front}-{c.bias}-{c.fault}-{c.seed}")
def test_grouped_equals_per_layer(case: Case) -> None:
    """float64: the grouped step is the per-layer step to 1e-12."""
    run_case(case, torch.float64, 1e-12)


@pytest.mark.parametrize("solver", ["kfac", "sngd", "kfac_adam", "hybrid"])
def test_grouped_equals_per_layer_bf16(solver: str) -> None:
    """bf16 parameters and gradients (float32 working dtype): equal to bf16's resolution."""
    case = dataclasses.replace(draw(random.Random(f"bf16-{solver}"), solver), fault="none")
    run_case(case, torch.bfloat16, 2e-2)


#: The cases run on 2 ranks with ``strategy="gradient"`` (the ``Owners`` placement): per solver, its first case
#: with a fault.
OWNER_CASES = [
    next(case for case in CASES if case.solver == solver and case.fault != "none")
    for solver in ("kfac-refresh", "kfac-inverse", "sngd", "kis-auto", "kfac_adam", "mixed")
]


def _owners_case(rank: int, world_size: int, case: Case) -> None:
    torch.set_num_threads(1)
    run_case(case, torch.float64, 1e-12, strategy="gradient")


@pytest.mark.parametrize("case", OWNER_CASES, ids=lambda c: f"{c.solver}-{c.front}-{c.bias}-{c.fault}-{c.seed}")
def test_grouped_equals_per_layer_with_owners(case: Case) -> None:
    """2 ranks, ``strategy="gradient"`` (each layer applied and checked by its owner, the results shared): the
    property on every rank, in float64 to 1e-12."""
    run_distributed(_owners_case, 2, case, timeout=120)


def test_faults_fire() -> None:
    """The drawn cases exercise what the property is about: fallbacks (both faults), kl_clip, every front and
    bias layout, and padding of adaptive ranks."""
    assert {case.fault for case in CASES} == {"none", "nan", "negate"}
    assert {case.front for case in CASES} == {"conv", "embedding", "none"}
    assert {case.bias for case in CASES} == {"all", "none", "alternate"}
    assert {case.kl_clip for case in CASES} == {True, False}


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam", "sngd", "mixed"])
def test_a_family_without_a_kernel_of_its_own_is_applied_layer_by_layer_in_its_groups(
    solver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default ``SolverFamily.group_kernel`` (what a registered family without one gets) is
    :class:`~hylo.solvers.LoopKernel`: each state's own ``advance`` in the grouped step, the per-layer results."""
    for family in FAMILIES:
        monkeypatch.setattr(type(family), "group_kernel", SolverFamily.group_kernel)
    case = dataclasses.replace(draw(random.Random(f"loop-{solver}"), solver), front="conv")
    run_case(case, torch.float64, 1e-12)
    grouped, _ = forks(case, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(case, grouped, 0, torch.float64)
    plan = apply_plan(grouped.pre)
    assert plan is not None and all(isinstance(group.kernel, LoopKernel) for group in plan.groups)
