"""Resume fuzz: a copied or reloaded state continues exactly like the live one (docs/reliability.md, "One layout").

Each example draws a small model — an optional Conv2d, a Linear stem, 2 to 4 equal-shaped Linear layers (whose
factors, eigenvectors and inverses share batched solves) and a head; float32 or float64 — a solver
configuration, an ``update_freq``, a damping, a batch size and a number of warm-up steps. After the warm-up the
run forks three ways, all fed the same data and stepped by SGD with momentum:

- ``live``: the preconditioner that ran the warm-up;
- ``reloaded``: its ``state_dict()`` through ``torch.save``/``torch.load`` into a new preconditioner on a deep
  copy of the model;
- ``relaid``: its ``state_dict()`` with every state tensor copied into another layout — fresh row-major or
  column-major copies, or views at odd offsets packed into one shared buffer, as another storage format or a
  broadcast hands them over — loaded without ``torch.save``.

Property: at every one of :data:`STEPS` steps the preconditioned gradients and then the parameters of every fork
are bit-equal to the live run's, and so are the held states at the end. Before the layout was made one (every
state tensor row-major at offset 0 of its own storage, :func:`hylo.solvers.layout.canonical`), the ``relaid`` fork
drifted for K-FAC, its inverse method, kfac_adam, the low-rank solvers and hybrid.

``test_resume`` runs a bounded, derandomized set of examples per solver configuration; ``test_resume_many``
(``-m slow``) many more. ``python -m tests.library.test_fuzz_resume N`` counts, over N drawn examples, how many forks
of each kind differed (the figures of docs/reliability.md, "One layout"); ``--before`` counts them with states
that keep their tensors as built, as hylo did before.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import random
import sys
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.integrity import seal
from hylo.solvers import layout
from hylo.solvers.base import HeldState, LayerState, RemoteState
from hylo.solvers.layout import canonical, canonical_held, is_canonical
from tests.kit.checks import assert_same_tensors, state_snapshot
from tests.kit.internals import held_states

pytestmark = pytest.mark.usefixtures("single_thread")

#: Every solver configuration the property covers: each solver, K-FAC's inverse method and refreshes, adaptive
#: ranks and mixed families in one model (``layer_solvers``).
SOLVERS: dict[str, dict[str, Any]] = {
    "kfac": {"solver": "kfac"},
    "kfac-inverse": {"solver": "kfac", "kfac_method": "inverse"},
    "kfac-refresh": {"solver": "kfac", "factor_update_freq": 1},
    "sngd": {"solver": "sngd"},
    "kid": {"solver": "kid", "rank_ratio": 0.5},
    "kid-auto": {"solver": "kid", "rank_ratio": "auto"},
    "kis": {"solver": "kis", "rank_ratio": 0.5},
    "kis-auto": {"solver": "kis", "rank_ratio": "auto"},
    "kfac_adam": {"solver": "kfac_adam"},
    "kfac_adam-refresh": {"solver": "kfac_adam", "factor_update_freq": 1},
    "hybrid": {"solver": "hybrid"},
    "hybrid-auto": {"solver": "hybrid", "rank_ratio": "auto"},
    "mixed": {"solver": "kfac", "layer_solvers": {"eq0": "kfac_adam", "eq1": "sngd", "head": "kis", "conv": "kid"}},
}
#: How the ``relaid`` fork lays out the state tensors it loads.
LAYOUTS = ("row-major", "column-major", "packed")
#: Steps every fork runs after the warm-up.
STEPS = 20


@dataclass(frozen=True)
class Case:
    """One drawn example (see the module docstring)."""

    solver: str
    dtype: torch.dtype
    conv: tuple[int, int, int] | None  # (channels in, channels out, kernel) on 4×4 images, or no conv
    d_in: int
    width: int
    equal: int  # equal-shaped Linear(width, width) layers
    bias: bool
    d_out: int
    batch: int
    update_freq: int
    damping: float
    warmup: int
    layout: str
    seed: int


def draw_case(rng: random.Random, solver: str) -> Case:
    """A case of ``solver`` drawn from ``rng``."""
    return Case(
        solver=solver,
        dtype=rng.choice([torch.float32, torch.float64]),
        conv=(rng.randint(1, 3), rng.randint(1, 4), rng.choice([1, 3])) if rng.random() < 0.4 else None,
        d_in=rng.randint(1, 10),
        width=rng.randint(1, 12),
        equal=rng.randint(2, 4),
        bias=rng.random() < 0.7,
        d_out=rng.randint(2, 6),
        batch=rng.randint(2, 12),
        update_freq=rng.randint(1, 3),
        damping=10.0 ** rng.uniform(-3.0, -0.5),
        warmup=rng.randint(1, 5),
        layout=rng.choice(LAYOUTS),
        seed=rng.randrange(2**16),
    )


# --------------------------------------------------------------------------- the runs
def _model(case: Case) -> tuple[nn.Module, tuple[int, ...]]:
    """The case's model (initialised from its seed) and the shape of one input sample."""
    torch.manual_seed(case.seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    sample: tuple[int, ...] = (case.d_in,)
    features = case.d_in
    if case.conv is not None:
        c_in, c_out, kernel = case.conv
        sample = (c_in, 4, 4)
        layers.update(conv=nn.Conv2d(c_in, c_out, kernel, padding=1), act=nn.Tanh(), flat=nn.Flatten())
        with torch.no_grad():
            features = nn.Sequential(layers)(torch.zeros(1, *sample)).shape[1]
    layers["stem"] = nn.Linear(features, case.width)
    for i in range(case.equal):
        layers[f"act{i}"] = nn.Tanh()
        layers[f"eq{i}"] = nn.Linear(case.width, case.width, bias=case.bias)
    layers["head"] = nn.Linear(case.width, case.d_out)
    return nn.Sequential(layers).to(case.dtype), sample


def _options(case: Case) -> dict[str, Any]:
    options = {**SOLVERS[case.solver], "update_freq": case.update_freq, "damping": case.damping, "seed": 5}
    if "layer_solvers" in options and case.conv is None:
        options["layer_solvers"] = {k: v for k, v in options["layer_solvers"].items() if k != "conv"}
    return options


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


@dataclass
class Run:
    """One fork: its model, optimizer and preconditioner."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    pre: HyLoPreconditioner


def _step(case: Case, sample: tuple[int, ...], run: Run, step: int) -> tuple[list[Tensor], list[Tensor]]:
    """One training step on the case's data of ``step``: (preconditioned gradients, parameters after it)."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + step)
    x = torch.randn((case.batch, *sample), generator=gen, dtype=case.dtype)
    y = torch.randint(0, case.d_out, (case.batch,), generator=gen)
    run.optimizer.zero_grad()
    F.cross_entropy(run.model(x), y).backward()
    run.pre.step()
    grads = [p.grad.clone() for p in run.model.parameters() if p.grad is not None]
    run.optimizer.step()
    return grads, [p.detach().clone() for p in run.model.parameters()]


def _tensor_slots(tree: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every floating-point tensor in nested dicts and lists."""
    found: list[tuple[Any, Any]] = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        if isinstance(value, Tensor):
            if value.is_floating_point():
                found.append((tree, key))
        else:
            found.extend(_tensor_slots(value))
    return found


def relaid(state: dict[str, Any], layout: str) -> dict[str, Any]:
    """``state`` (a ``state_dict``) with every layer's floating-point tensor copied into ``layout``: fresh
    row-major or column-major copies, or row-major views one element apart in one buffer per dtype (odd offsets,
    one shared storage). The values are the same, so the checksum still holds."""
    slots = _tensor_slots(state["layers"])
    if layout == "packed":
        size = sum(holder[key].numel() + 1 for holder, key in slots) + 1
        buffers: dict[torch.dtype, Tensor] = {}
        offsets: dict[torch.dtype, int] = {}
        for holder, key in slots:
            t = holder[key]
            buffer = buffers.setdefault(t.dtype, torch.empty(size, dtype=t.dtype, device=t.device))
            start = offsets.get(t.dtype, 1)
            holder[key] = buffer[start : start + t.numel()].view(t.shape).copy_(t)
            offsets[t.dtype] = start + t.numel() + 1
        return state
    for holder, key in slots:
        t = holder[key]
        if layout == "column-major" and t.dim() == 2:
            holder[key] = torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).mT.copy_(t)
        else:
            holder[key] = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return state


def _fork(case: Case, live: Run, how: str) -> Run:
    """A fork of ``live`` after the warm-up (see the module docstring)."""
    model = copy.deepcopy(live.model)
    optimizer = _optimizer(model)
    optimizer.load_state_dict(copy.deepcopy(live.optimizer.state_dict()))
    pre = HyLoPreconditioner(model, **_options(case))
    if how == "reloaded":
        buffer = io.BytesIO()
        torch.save(live.pre.state_dict(), buffer)
        buffer.seek(0)
        pre.load_state_dict(torch.load(buffer))
    else:
        pre.load_state_dict(relaid(live.pre.state_dict(), case.layout))
    return Run(model, optimizer, pre)


FORKS = ("reloaded", "relaid")


def first_differences(case: Case) -> dict[str, int | None]:
    """Per fork, the first step after the warm-up at which its gradients or parameters differed from the live
    run's in any bit (None: never in :data:`STEPS` steps, nor its held states at the end)."""
    model, sample = _model(case)
    live = Run(model, _optimizer(model), HyLoPreconditioner(model, **_options(case)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for step in range(case.warmup):
            _step(case, sample, live, step)
        forks = {how: _fork(case, live, how) for how in FORKS}
        first: dict[str, int | None] = dict.fromkeys(FORKS)
        for step in range(case.warmup, case.warmup + STEPS):
            expected = _step(case, sample, live, step)
            for how, run in forks.items():
                got = _step(case, sample, run, step)
                if first[how] is None and not _same_bits(expected, got):
                    first[how] = step - case.warmup
    end = state_snapshot(live.pre)
    for how, run in forks.items():
        if first[how] is None and not _same_bits(end, state_snapshot(run.pre)):
            first[how] = STEPS
    return first


def _same_bits(a: Any, b: Any) -> bool:
    """Whether nested lists/dicts of tensors are equal bit for bit (a NaN equals itself)."""
    try:
        assert_same_tensors(_bits(a), _bits(b))
    except AssertionError:
        return False
    return True


def _bits(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return tree.detach().contiguous().reshape(-1).view(torch.uint8)
    if isinstance(tree, dict):
        return {k: _bits(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_bits(v) for v in tree]
    return tree


def check_resume(case: Case) -> None:
    first = first_differences(case)
    assert all(step is None for step in first.values()), f"forks first differing at step: {first}"


# --------------------------------------------------------------------------- the property
@pytest.mark.parametrize("solver", list(SOLVERS))
@settings(max_examples=3, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False))
def test_resume(solver: str, rng: random.Random) -> None:
    check_resume(draw_case(rng, solver))


@pytest.mark.slow
@pytest.mark.parametrize("solver", list(SOLVERS))
@settings(max_examples=200, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False))
def test_resume_many(solver: str, rng: random.Random) -> None:
    check_resume(draw_case(rng, solver))


# --------------------------------------------------------------------------- the regression and the layout
def _equal_layers_case(solver: str, layout: str) -> Case:
    """Three equal-shaped float32 layers of odd width (batched eigenvectors at odd offsets), warmed up past an
    update."""
    return Case(solver, torch.float32, None, 5, 7, 3, True, 3, 8, 2, 0.05, 3, layout, 11)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("solver", ["kfac", "kfac_adam", "sngd"])
def test_a_relaid_state_continues_bit_for_bit(solver: str, layout: str) -> None:
    """The state_dict of equal-shaped layers loaded from another layout continues like the live run. Before the
    layout was one, 5 of these 9 forks differed from the first step on (kfac and kfac_adam row-major or packed, sngd
    column-major): K-FAC and SNGD in the last bits, kfac_adam's preconditioned gradients by 17% at once."""
    assert first_differences(_equal_layers_case(solver, layout)) == dict.fromkeys(FORKS)


def _assert_canonical(states: list[HeldState]) -> None:
    assert states
    for state in states:
        tensors = state.carried_tensors if isinstance(state, RemoteState) else state.tensors()
        for name, tensor in tensors.items():
            assert is_canonical(tensor), (type(state).__name__, name, tensor.stride(), tensor.storage_offset())
        if not isinstance(state, RemoteState):  # the rows themselves, not only their saved fields
            assert canonical_held(state) is state


@pytest.mark.parametrize("solver", [*SOLVERS])
def test_every_held_state_has_the_one_layout(solver: str) -> None:
    """After updates and refreshes, after a load from any layout and in a loaded remote entry, every tensor a state
    holds is row-major at offset 0 of its own storage."""
    case = _equal_layers_case(solver, "packed")
    model, sample = _model(case)
    live = Run(model, _optimizer(model), HyLoPreconditioner(model, **_options(case)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for step in range(5):
            _step(case, sample, live, step)
            _assert_canonical(held_states(live.pre))
        for layout in LAYOUTS:
            _assert_canonical(held_states(_fork(dataclasses.replace(case, layout=layout), live, "relaid").pre))
    state = live.pre.state_dict()
    entry = next((e for e in state["layers"].values() if "factor_a" in e.get("tensors", {})), None)
    if entry is not None:  # a remote entry (as a rank of 4 saves one) loads as a RemoteState of the one layout
        tensors = entry.pop("tensors")
        for key in [k for k in entry if k not in ("solver", "d_a", "d_g", "owner", "kept")]:
            del entry[key]
        entry.update(owner=3, remote=True, carried={k: tensors[k] for k in ("factor_a", "factor_g")})
        state.update(rank=0, world_size=4)
        pre = HyLoPreconditioner(copy.deepcopy(model), **_options(case))
        pre.load_state_dict(seal(relaid(state, "packed")))
        remote = [s for s in held_states(pre) if isinstance(s, RemoteState)]
        assert remote
        _assert_canonical(remote)


def test_canonical_copies_only_what_is_not() -> None:
    """A tensor already in the layout is returned as it is; views, transposes, offsets and shared storages are
    copied into a fresh allocation."""
    fresh = torch.randn(3, 4)
    assert canonical(fresh) is fresh and is_canonical(torch.empty(0, 5)) and is_canonical(torch.tensor(1.0))
    stacked = torch.randn(2, 3, 3)
    for view in (stacked[0], stacked[1], stacked[1].mT, fresh[:, 1:], fresh[1:], fresh.mT, fresh.view(4, 3)[:3]):
        copied = canonical(view)
        assert torch.equal(copied, view) and is_canonical(copied) and copied.untyped_storage().nbytes() == view.nbytes
    ones = torch.randn(1, 4).as_strided((1, 4), (1, 1))  # contiguous, but not row-major's strides
    assert not is_canonical(ones) and canonical(ones).stride() == (4, 1)


@pytest.mark.parametrize("solver", ["kfac_adam", "kfac_adam-refresh", "kfac-refresh", "sngd"])
def test_only_updates_copy(solver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout costs no copy between updates — kfac_adam's per-step states and the refreshed running factors are
    fresh tensors already — and at an update only the views of the batched solves are copied."""
    copied: list[tuple[int, ...]] = []

    def counted(tensor: Tensor) -> Tensor:
        held = canonical(tensor)
        if held is not tensor:
            copied.append(tuple(tensor.shape))
        return held

    monkeypatch.setattr(layout, "canonical", counted)
    case = _equal_layers_case(solver, "row-major")  # update_freq=2: updates at steps 0 and 2
    model, sample = _model(case)
    run = Run(model, _optimizer(model), HyLoPreconditioner(model, **_options(case)))
    per_step = []
    for step in range(4):
        _step(case, sample, run, step)
        per_step.append(len(copied))
        copied.clear()
    assert per_step[0] > 0 and per_step[1] == per_step[3] == 0, per_step
    _assert_canonical(held_states(run.pre))


# --------------------------------------------------------------------------- the tally
def tally(examples: int) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    """Over ``examples`` drawn cases (the solver configurations in turn), how many forks of each kind ran and how
    many differed from the live run, by (solver configuration, fork)."""
    runs: Counter[tuple[str, str]] = Counter()
    differed: Counter[tuple[str, str]] = Counter()
    names = list(SOLVERS)
    for i in range(examples):
        case = draw_case(random.Random(i), names[i % len(names)])
        for how, first in first_differences(case).items():
            key = (case.solver, f"{how} ({case.layout})" if how == "relaid" else how)
            runs[key] += 1
            differed[key] += first is not None
    return runs, differed


def _without_one_layout() -> None:
    """States keep their tensors as they were built (the code before docs/reliability.md, "One layout")."""

    def keep(self: object) -> None:
        return None

    setattr(LayerState, "__post_init__", keep)  # noqa: B010  (the dataclass __init__ looks it up at each call)
    setattr(RemoteState, "__post_init__", keep)  # noqa: B010


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "--before" in sys.argv:
        _without_one_layout()
    counts = [int(arg) for arg in sys.argv[1:] if arg.isdigit()]
    runs, differed = tally(counts[0] if counts else 130)
    for key in sorted(runs):
        print(f"{key[0]:20} {key[1]:26} {differed[key]:4} of {runs[key]}")
    for how in FORKS:
        total = sum(n for key, n in runs.items() if key[1].startswith(how))
        bad = sum(n for key, n in differed.items() if key[1].startswith(how))
        print(f"{how}: {bad} of {total} differed")
