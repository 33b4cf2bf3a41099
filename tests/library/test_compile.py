"""torch.compile in both orders (docs/wrappers.md, "torch.compile").

The reference is the same model preconditioned without compilation (whose preconditioned gradients
other files check against dense solves): a compiled model, attached before or after compiling, must
give the same gradients at update and non-update steps. On steps that do not capture, the compiled
model must run the graphs it runs without hylo, with no recompilation from step to step; a capture
step on which hooks never fired must raise, naming the cause.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.layers.compiled import _EagerStance
from tests.kit.checks import DT

pytestmark = pytest.mark.usefixtures("single_thread")

dynamo = pytest.importorskip("torch._dynamo")

STEPS = 6
UPDATE_FREQ = 3  # steps 0 and 3 capture and update; 1, 2, 4, 5 do not


def stance() -> str:
    """torch.compile's current stance (``torch.compiler.set_stance`` sets it; nothing public reads it)."""
    return str(dynamo.eval_frame._stance.stance)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Every test starts and ends without compiled code and with the default stance (preconditioners that
    other tests left to the garbage collector, awaiting a capture step, hold "force_eager")."""
    if stance() != "default":
        gc.collect()
    assert stance() == "default"
    dynamo.reset()
    yield
    if stance() != "default":
        gc.collect()
    assert stance() == "default"


class Net(nn.Module):
    """conv → relu → linear → tanh → linear: a class of its own, so its forward is a compiled frame."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(2, 3, 3, dtype=DT)
        self.fc1 = nn.Linear(3 * 4 * 4, 6, dtype=DT)
        self.fc2 = nn.Linear(6, 3, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(F.relu(self.conv(x)).flatten(1))))


class Attention(nn.Module):
    """An nn.MultiheadAttention (its projections captured by hylo's tap) and a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, dtype=DT)
        self.head = nn.Linear(4, 3, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.head(h.mean(dim=1))


def _sequential(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, dtype=DT), nn.Tanh(), nn.Linear(6, 3, dtype=DT))


MODELS: dict[str, tuple[Callable[[int], nn.Module], tuple[int, ...]]] = {
    "conv-mlp": (Net, (2, 6, 6)),
    "attention": (Attention, (5, 4)),
    "sequential": (_sequential, (4,)),
}


def _batch(shape: tuple[int, ...], step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, *shape, generator=gen, dtype=DT), torch.randint(0, 3, (8,), generator=gen)


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _train(call: Callable[[Tensor], Tensor], model: nn.Module, pre: HyLoPreconditioner, shape: tuple[int, ...]):
    """Preconditioned gradients of STEPS steps (plain SGD in between, so that the steps differ)."""
    out = []
    for step in range(STEPS):
        model.zero_grad()
        x, y = _batch(shape, step)
        F.cross_entropy(call(x), y).backward()
        pre.step()
        out.append(_grads(model))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return out


def _assert_same(actual: list[list[Tensor]], expected: list[list[Tensor]]) -> None:
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14, msg=f"step {step}")


def _options(solver: str) -> dict[str, object]:
    return {"solver": solver, "update_freq": UPDATE_FREQ, "damping": 0.1}


ORDERS = ["after-torch.compile", "after-.compile", "before-torch.compile", "before-.compile", "before-other-instance"]
CASES = [
    *[("conv-mlp", "kfac", order, "eager") for order in ORDERS],
    ("conv-mlp", "kfac", "after-torch.compile", "aot_eager"),
    ("conv-mlp", "sngd", "after-torch.compile", "eager"),
    ("conv-mlp", "sngd", "before-other-instance", "eager"),
    ("attention", "kfac", "after-torch.compile", "eager"),
    ("attention", "sngd", "before-torch.compile", "eager"),
    ("sequential", "kfac", "before-torch.compile", "eager"),
    ("sequential", "sngd", "after-.compile", "eager"),
]


@pytest.mark.parametrize(("kind", "solver", "order", "backend"), CASES)
def test_compiled_model_gives_the_eager_preconditioned_gradients(
    kind: str, solver: str, order: str, backend: str
) -> None:
    build, shape = MODELS[kind]
    reference = build(0)
    expected = _train(reference, reference, HyLoPreconditioner(reference, **_options(solver)), shape)

    model = build(0)
    warm = _batch(shape, 99)[0]
    if order == "before-other-instance":  # code compiled for another instance of the same classes
        other = build(1)
        torch.compile(other, backend=backend)(warm).sum().backward()
    if order == "before-torch.compile":
        compiled: nn.Module = torch.compile(model, backend=backend)
        compiled(warm).sum().backward()
        pre = HyLoPreconditioner(compiled, **_options(solver))  # the wrapper itself is handed over
        assert [i.name for i in pre.layer_info()] == [i.name for i in HyLoPreconditioner(build(0)).layer_info()]
    elif order == "before-.compile":
        model.compile(backend=backend)
        model(warm).sum().backward()
        compiled, pre = model, HyLoPreconditioner(model, **_options(solver))
    else:
        pre = HyLoPreconditioner(model, **_options(solver))
        if order == "after-.compile":
            model.compile(backend=backend)
            compiled = model
        else:
            compiled = torch.compile(model, backend=backend)
    model.zero_grad()
    _assert_same(_train(compiled, model, pre, shape), expected)
    assert pre.steps == STEPS and all(info.state is not None for info in pre.layer_info())


class GraphCounter:
    """A backend that counts the graphs it compiles and the graphs run."""

    def __init__(self) -> None:
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., object]:
        self.compiled += 1

        def run(*args: object) -> object:
            self.runs += 1
            return gm.forward(*args)

        return run


def _graphs_per_step(use_hylo: bool, kind: str, steps: int = 3 * UPDATE_FREQ) -> tuple[list[int], list[int]]:
    """Graphs run and graphs compiled at each step of a compiled model, with or without hylo."""
    build, shape = MODELS[kind]
    model = build(0)
    pre = HyLoPreconditioner(model, **_options("kfac")) if use_hylo else None
    counter = GraphCounter()
    compiled = torch.compile(model, backend=counter)
    runs, compiles = [], []
    for step in range(steps):
        counter.runs, before = 0, counter.compiled
        model.zero_grad()
        x, y = _batch(shape, step)
        F.cross_entropy(compiled(x), y).backward()
        if pre is not None:
            pre.step()
        runs.append(counter.runs)
        compiles.append(counter.compiled - before)
    return runs, compiles


@pytest.mark.parametrize("kind", list(MODELS))
def test_steps_without_capture_run_the_graphs_of_the_model_without_hylo(kind: str) -> None:
    plain_runs, plain_compiles = _graphs_per_step(False, kind)
    runs, compiles = _graphs_per_step(True, kind)
    for step, (ran, plain) in enumerate(zip(runs, plain_runs, strict=True)):
        # capture steps run eagerly; the others run exactly the graphs of the model without hylo
        assert ran == (0 if step % UPDATE_FREQ == 0 else plain), (runs, plain_runs)
    assert plain_runs[0] == 1
    # compiled once, at the first step that does not capture; never again
    assert sum(compiles) == sum(plain_compiles) and compiles[1] == sum(compiles), compiles


def test_a_capture_step_whose_hooks_never_fired_raises_naming_torch_compile() -> None:
    """Code compiled before hylo was attached, run at a capture step under a stance the user forced."""
    model = Net()
    compiled = torch.compile(model, backend="eager")
    x, y = _batch((2, 6, 6), 0)
    compiled(x).sum().backward()
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=1)
    model.zero_grad()
    with torch.compiler.set_stance("default"):
        F.cross_entropy(compiled(x), y).backward()
    raw = _grads(model)
    with pytest.raises(RuntimeError, match=r"no registered layer captured anything.*torch\.compile") as caught:
        pre.step()
    assert all(name in str(caught.value) for name in ("conv", "fc1", "fc2"))
    assert pre.steps == 0 and all(torch.equal(a, b) for a, b in zip(_grads(model), raw, strict=True))


def test_a_capture_step_in_eval_mode_raises_naming_it() -> None:
    model = Net()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    model.eval()
    x, y = _batch((2, 6, 6), 0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"eval mode.*model\.train\(\)"):
        pre.step()


def test_a_layer_without_rows_beside_captured_ones_is_named_in_a_warning() -> None:
    model = Net()
    pre = HyLoPreconditioner(model, solver="sngd", update_freq=1)
    x, y = _batch((2, 6, 6), 0)
    model.fc1.eval()
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match=r"\['fc1'\] have gradients but their hooks captured no rows.*eval mode"):
        pre.step()


def test_the_stance_is_held_on_capture_steps_only_and_given_back() -> None:
    model = Net()
    pre = HyLoPreconditioner(model, solver="kfac", update_freq=2)
    assert stance() == "force_eager"  # step 0 captures
    x, y = _batch((2, 6, 6), 0)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    assert stance() == "default"  # step 1 does not
    pre.reconfigure(update_freq=1)
    assert stance() == "force_eager"
    pre.remove()
    assert stance() == "default"
    # a preconditioner dropped without remove() gives it back too, and its hooks capture nothing more
    HyLoPreconditioner(model, solver="kfac", update_freq=1)
    gc.collect()
    assert stance() == "default"
    # a stance the user set meanwhile is left alone
    other = HyLoPreconditioner(model, solver="kfac", update_freq=1)
    torch.compiler.set_stance("eager_on_recompile")
    other.remove()
    assert stance() == "eager_on_recompile"
    torch.compiler.set_stance("default")


def test_a_warning_free_compiled_run() -> None:
    """Compiling a preconditioned model warns about nothing (no graph-break or recompile-limit warnings)."""
    model = Net()
    pre = HyLoPreconditioner(model, **_options("kfac"))
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(compiled, model, pre, (2, 6, 6))


class _Key:
    """A capture's stand-in: anything weakly referenceable."""


def test_a_finalizer_inside_set_stance_does_not_call_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture collected while ``set_stance`` runs (a collection during the first import of torch._dynamo) gives
    up its want from inside that call: the stance is still set exactly once and held while another capture wants
    it, instead of ``set_stance`` being entered again on a half-imported torch._dynamo."""
    stance, first, second = _EagerStance(), _Key(), _Key()
    calls: list[str] = []
    holder = object()

    def set_stance(name: str) -> object:
        calls.append(name)
        if len(calls) == 1:
            stance.want(second, False)  # what the collected capture's finalizer does, mid-call
        return holder

    monkeypatch.setattr(torch.compiler, "set_stance", set_stance)
    stance.want(first, True)
    assert calls == ["force_eager"] and stance.holder is holder and stance.wanting == {id(first)}
