"""Property-based fuzz of :class:`hylo.HyLoPreconditioner` with hypothesis.

What is fuzzed (one drawn :class:`Case` per example, each a few milliseconds to ~0.2 s):

- the model: Linear → ReLU → Linear, or Conv2d (kernel, stride, padding incl. ``"same"``,
  dilation, padding mode) → flatten → Linear; dimensions 1..12, images 3..6 px, bias on or off
  per layer; float32 or float64;
- the batch: 1..24 rows drawn with replacement from a smaller pool (duplicated rows, sometimes
  all identical, with identical labels), inputs scaled by 1e-20 … 1e20 (log-uniform) or exactly 0;
- the loss: cross-entropy or MSE, reduction mean or sum;
- the options: solver (kfac, sngd, kid, kis, hybrid), ``rank_ratio`` in (0, 1] or an absolute
  ``rank``, damping 1e-12 … 1e6 (log-uniform), ``update_freq`` 1..3, ``conv_rows``, ``kl_clip``
  (with ``lr``) on or off;
- the run: 2..4 steps of forward, backward, ``pre.step()`` and optionally plain SGD; any step
  may get a NaN/±Inf injected into its input or into the gradient of one registered parameter.

Properties checked at every ``pre.step()``:

1. it raises nothing but ``ValueError`` (the documented error; the options are validated at
   construction, where a ``ValueError`` rejects the example); ``UserWarning`` is allowed;
2. finite gradients in ⇒ finite gradients out;
3. a step that receives a non-finite gradient is rejected: every layer's stored state is
   unchanged bit for bit and every gradient is left exactly as it was (unpreconditioned).
4. a step whose gradients are all finite is never skipped as non-finite (however large they are).

``test_fuzz`` runs a bounded, derandomized set of examples (deterministic in CI, no example
database); ``test_fuzz_many`` (``-m slow``) runs many more.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given, reject, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from tests.kit.checks import assert_same_tensors, state_snapshot

pytestmark = pytest.mark.usefixtures("single_thread")

SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")
BAD_VALUES = (math.nan, math.inf, -math.inf)
PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]
PADDING_MODES: tuple[PaddingMode, ...] = ("zeros", "reflect", "replicate", "circular")


# --------------------------------------------------------------------------- the drawn case
@dataclass(frozen=True)
class LinearNet:
    """Linear(d_in, hidden) → ReLU → Linear(hidden, d_out)."""

    d_in: int
    hidden: int
    d_out: int
    bias: tuple[bool, bool]


@dataclass(frozen=True)
class ConvNet:
    """Conv2d(c_in, c_out, kernel, ...) on c_in×h×w images → flatten → Linear(·, d_out)."""

    c_in: int
    c_out: int
    h: int
    w: int
    kernel: int
    stride: int
    padding: int | Literal["same"]
    dilation: int
    padding_mode: PaddingMode
    d_out: int
    bias: tuple[bool, bool]


@dataclass(frozen=True)
class Inject:
    """A non-finite ``value`` written into step ``step``'s input, or into one parameter's gradient after backward."""

    step: int
    where: Literal["input", "grad"]
    value: float
    #: Which parameter's gradient (index into ``model.parameters()``), for ``where="grad"``.
    param: int
    #: Flat index (modulo the size) of the entry of the input or gradient that is overwritten.
    element: int


@dataclass(frozen=True)
class Case:
    net: LinearNet | ConvNet
    dtype: torch.dtype
    batch: int
    #: Row i of every batch is pool row ``rows[i]`` (duplicates share their label/target too).
    rows: tuple[int, ...]
    pool: int
    scale: float
    loss: Literal["ce", "mse"]
    reduction: Literal["mean", "sum"]
    options: dict[str, Any]
    sgd: bool
    steps: int
    inject: Inject | None
    seed: int


def _log_uniform(low: int, high: int) -> st.SearchStrategy[float]:
    """10**e for e uniform in [low, high]; whole decades (the extremes included) are drawn often."""
    decades = st.integers(low, high).map(lambda e: 10.0**e)
    return st.one_of(decades, st.floats(min_value=low, max_value=high).map(lambda e: 10.0**e))


@st.composite
def _conv_nets(draw: st.DrawFn) -> ConvNet:
    h, w = draw(st.integers(3, 6)), draw(st.integers(3, 6))
    kernel = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2))
    stride = draw(st.integers(1, 2))
    mode = draw(st.sampled_from(PADDING_MODES))
    span = dilation * (kernel - 1) + 1
    # the dilated kernel must fit the padded image; reflect needs padding < size and circular
    # padding <= size, which padding <= 2 on images of >= 3 px always satisfies
    choices: list[int | Literal["same"]] = [p for p in range(3) if span <= h + 2 * p and span <= w + 2 * p]
    if stride == 1:
        choices.append("same")
    padding = draw(st.sampled_from(choices))
    return ConvNet(
        c_in=draw(st.integers(1, 4)),
        c_out=draw(st.integers(1, 6)),
        h=h,
        w=w,
        kernel=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        padding_mode=mode,
        d_out=draw(st.integers(1, 12)),
        bias=(draw(st.booleans()), draw(st.booleans())),
    )


_linear_nets = st.builds(
    LinearNet,
    d_in=st.integers(1, 12),
    hidden=st.integers(1, 12),
    d_out=st.integers(1, 12),
    bias=st.tuples(st.booleans(), st.booleans()),
)


@st.composite
def _options(draw: st.DrawFn) -> dict[str, Any]:
    options: dict[str, Any] = {
        "solver": draw(st.sampled_from(SOLVERS)),
        "damping": draw(_log_uniform(-12, 6)),
        "update_freq": draw(st.integers(1, 3)),
        "conv_rows": draw(st.sampled_from(["sum", "exact", "mean"])),
    }
    if draw(st.booleans()):
        options["rank_ratio"] = draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
    else:
        options["rank"] = draw(st.integers(1, 30))
    if draw(st.booleans()):
        options["kl_clip"] = draw(_log_uniform(-6, 1))
        options["lr"] = draw(_log_uniform(-4, 0))
    return options


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """One fuzz example: model, data, loss, options and the steps' injections."""
    net: LinearNet | ConvNet = draw(st.one_of(_linear_nets, _conv_nets()))
    batch = draw(st.integers(1, 24))
    duplicates = draw(st.sampled_from(["distinct", "some", "identical"]))
    if duplicates == "distinct":
        pool, rows = batch, tuple(range(batch))
    elif duplicates == "identical":
        pool, rows = 1, (0,) * batch
    else:
        pool = draw(st.integers(1, batch))
        rows = tuple(draw(st.lists(st.integers(0, pool - 1), min_size=batch, max_size=batch)))
    # exactly 0 in about one example of five; otherwise 1e-20 … 1e20
    scale = 0.0 if draw(st.integers(0, 4)) == 4 else draw(_log_uniform(-20, 20))
    steps = draw(st.integers(2, 4))
    inject = None
    if draw(st.integers(0, 2)) == 2:  # about one example in three has one non-finite step
        inject = Inject(
            step=draw(st.integers(0, steps - 1)),
            where=draw(st.sampled_from(["input", "grad"])),
            value=draw(st.sampled_from(BAD_VALUES)),
            param=draw(st.integers(0, sum(net.bias) + 1)),
            element=draw(st.integers(0, 10_000)),
        )
    return Case(
        net=net,
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        batch=batch,
        rows=rows,
        pool=pool,
        scale=scale,
        loss=draw(st.sampled_from(["ce", "mse"])),
        reduction=draw(st.sampled_from(["mean", "sum"])),
        options=draw(_options()),
        sgd=draw(st.booleans()),
        steps=steps,
        inject=inject,
        seed=draw(st.integers(0, 2**16)),
    )


# --------------------------------------------------------------------------- running a case
def _model(case: Case) -> tuple[nn.Module, tuple[int, ...]]:
    """The model of ``case`` (initialised from its seed) and the shape of one input sample."""
    torch.manual_seed(case.seed)
    net = case.net
    if isinstance(net, LinearNet):
        model: nn.Module = nn.Sequential(
            nn.Linear(net.d_in, net.hidden, bias=net.bias[0]),
            nn.ReLU(),
            nn.Linear(net.hidden, net.d_out, bias=net.bias[1]),
        )
        return model.to(case.dtype), (net.d_in,)
    conv = nn.Conv2d(
        net.c_in,
        net.c_out,
        net.kernel,
        stride=net.stride,
        padding=net.padding,
        dilation=net.dilation,
        padding_mode=net.padding_mode,
        bias=net.bias[0],
    )
    with torch.no_grad():
        features = conv(torch.zeros(1, net.c_in, net.h, net.w)).numel()
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(features, net.d_out, bias=net.bias[1]))
    return model.to(case.dtype), (net.c_in, net.h, net.w)


def _data(case: Case, step: int, sample: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Step ``step``'s inputs (pool rows picked by ``case.rows``, times ``case.scale``) and targets."""
    gen = torch.Generator().manual_seed(case.seed * 8 + step)
    pool = torch.randn((case.pool, *sample), generator=gen, dtype=torch.float64) * case.scale
    index = torch.tensor(case.rows)
    x = pool.to(case.dtype)[index]
    if case.loss == "ce":
        y = torch.randint(0, case.net.d_out, (case.pool,), generator=gen)[index]
    else:
        y = torch.randn(case.pool, case.net.d_out, generator=gen, dtype=case.dtype)[index]
    return x, y


def _bits(tree: Any) -> Any:
    """Every tensor of nested dicts/lists replaced by its raw bytes (so NaNs compare equal to themselves)."""
    if isinstance(tree, Tensor):
        return tree.detach().reshape(-1).contiguous().view(torch.uint8).clone()
    if isinstance(tree, dict):
        return {k: _bits(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_bits(v) for v in tree]
    return tree


def _grads(model: nn.Module) -> list[Tensor]:
    grads = []
    for p in model.parameters():
        assert p.grad is not None
        grads.append(p.grad.detach().clone())
    return grads


def _note_warnings(caught: list[warnings.WarningMessage]) -> None:
    """Label the example with what hylo warned about (``--hypothesis-show-statistics``); re-issue other warnings."""
    for w in caught:
        if not issubclass(w.category, UserWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            continue
        text = str(w.message)
        if "non-finite gradients" in text:
            event("step skipped: non-finite gradients")
        elif "non-finite curvature" in text:
            event("update kept the previous state: non-finite curvature")
        elif "non-finite factors" in text:
            event("refresh kept the previous factors: non-finite factors")


def _check(case: Case) -> None:
    """Run ``case`` step by step and assert the four properties of the module docstring.

    Property 1 is the absence of any other exception: anything but ``ValueError`` escaping
    ``pre.step()`` fails the example with its own traceback. ``UserWarning`` (hylo's skipped
    steps and rejected updates, torch's notes on convolution padding) is allowed and ignored.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _run(case)


def _run(case: Case) -> None:
    model, sample = _model(case)
    params = list(model.parameters())
    try:
        pre = HyLoPreconditioner(model, **case.options)
    except ValueError:
        reject()  # an invalid option combination: not an example
    optimizer = torch.optim.SGD(params, lr=1e-2) if case.sgd else None
    for step in range(case.steps):
        inject = case.inject if case.inject is not None and case.inject.step == step else None
        model.zero_grad()
        x, y = _data(case, step, sample)
        if inject is not None and inject.where == "input":
            x.view(-1)[inject.element % x.numel()] = inject.value
        out = model(x)
        if case.loss == "ce":
            loss = F.cross_entropy(out, y, reduction=case.reduction)
        else:
            loss = F.mse_loss(out, y, reduction=case.reduction)
        torch.autograd.backward(loss)
        if inject is not None and inject.where == "grad":
            grad = params[inject.param].grad
            assert grad is not None
            grad.view(-1)[inject.element % grad.numel()] = inject.value

        before = _grads(model)
        finite_in = all(bool(torch.isfinite(g).all()) for g in before)
        snapshot = _bits(state_snapshot(pre))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                pre.step()
            except ValueError:
                event("step() raised ValueError")
                return  # property 1: the documented error; the run cannot continue
        _note_warnings(caught)
        after = _grads(model)
        if finite_in:  # properties 2 and 4
            bad = [i for i, g in enumerate(after) if not torch.isfinite(g).all()]
            assert not bad, f"step {step}: finite gradients in, non-finite gradients out (parameters {bad})"
            skipped = [str(w.message) for w in caught if "non-finite gradients" in str(w.message)]
            assert not skipped, f"step {step}: finite gradients skipped as non-finite: {skipped}"
        else:  # property 3: the step is rejected, state and gradients untouched
            assert_same_tensors(_bits(state_snapshot(pre)), snapshot)
            assert_same_tensors(_bits(after), _bits(before))
        if optimizer is not None:
            optimizer.step()


# --------------------------------------------------------------------------- the tests
_COMMON: dict[str, Any] = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "print_blob": True,
}


@settings(max_examples=200, **_COMMON)
@given(case=cases())
def test_fuzz(case: Case) -> None:
    _check(case)


@pytest.mark.slow
@settings(max_examples=10_000, **_COMMON)
@given(case=cases())
def test_fuzz_many(case: Case) -> None:
    _check(case)


# --------------------------------------------------------------------------- retry without a new backward
@dataclass(frozen=True)
class RetryCase:
    """A run in which one step is made to fail once by a callable option, then retried without a backward."""

    solver: str
    update_freq: int
    #: The option whose callable fails ("solver_fn" only under "hybrid").
    option: Literal["damping", "factor_decay", "lr", "kl_clip", "solver_fn"]
    #: Raise from the callable, or return a value its rule refuses (NaN; an unknown solver for solver_fn).
    how: Literal["raise", "bad value"]
    fail_at: int
    steps: int
    batch: int
    dtype: torch.dtype
    seed: int


class _Refused(Exception):
    """What a drawn callable raises: any exception type, not only the documented ValueError."""


@st.composite
def retry_cases(draw: st.DrawFn) -> RetryCase:
    solver = draw(st.sampled_from(SOLVERS))
    options = ["damping", "factor_decay", "lr", "kl_clip"] + (["solver_fn"] if solver == "hybrid" else [])
    steps = draw(st.integers(2, 4))
    return RetryCase(
        solver=solver,
        update_freq=draw(st.integers(1, 3)),
        option=draw(st.sampled_from(options)),
        how=draw(st.sampled_from(["raise", "bad value"])),
        fail_at=draw(st.integers(0, steps - 1)),
        steps=steps,
        batch=draw(st.integers(1, 12)),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        seed=draw(st.integers(0, 2**16)),
    )


def _retry_options(case: RetryCase, fail: bool) -> dict[str, Any]:
    """The case's options; with ``fail``, ``case.option``'s callable fails the first time it sees ``fail_at``."""
    failed: list[int] = []

    def failing(value: Any, bad: Any) -> Any:
        def at(step: int, *rest: Any) -> Any:
            if fail and step == case.fail_at and not failed:
                failed.append(step)
                if case.how == "raise":
                    raise _Refused(f"{case.option} refused step {step}")
                return bad
            return value

        return at

    def hybrid_rule(name: str, step: int, stats: Any) -> str:
        return "kid" if step % 2 == 0 else "kfac"

    options: dict[str, Any] = {
        "solver": case.solver,
        "update_freq": case.update_freq,
        "damping": failing(0.1, math.nan) if case.option == "damping" else 0.1,
        "factor_decay": failing(0.9, math.nan) if case.option == "factor_decay" else 0.9,
        "kl_clip": failing(1e-2, math.nan) if case.option == "kl_clip" else 1e-2,
        "lr": failing(0.1, math.nan) if case.option == "lr" else 0.1,
        "rank_ratio": 0.5,
        "seed": case.seed,
    }
    if case.option == "solver_fn":
        rule = failing(None, "no-such-solver")
        options["solver_fn"] = lambda name, step, stats: rule(step) or hybrid_rule(name, step, stats)
    return options


def _check_retry(case: RetryCase) -> None:
    """The failing run, retried without a backward, is bit-equal to its twin after every step."""
    runs = []
    for fail in (True, False):
        torch.manual_seed(case.seed)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(case.dtype)
        runs.append((model, HyLoPreconditioner(model, **_retry_options(case, fail))))
    gen = torch.Generator().manual_seed(case.seed)
    failures = 0
    for step in range(case.steps):
        x = torch.randn(case.batch, 5, generator=gen, dtype=case.dtype)
        y = torch.randint(0, 3, (case.batch,), generator=gen)
        for model, pre in runs:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            try:
                pre.step()
            except (ValueError, _Refused):
                assert pre is runs[0][1] and step == case.fail_at, f"step {step}: only the made failure raises"
                failures += 1
                pre.step()  # the retry: no new forward, no new backward
        (model, pre), (twin, reference) = runs
        assert_same_tensors(_bits(_grads(model)), _bits(_grads(twin)))
        assert_same_tensors(_bits(state_snapshot(pre)), _bits(state_snapshot(reference)))
        assert not any(pre.memory_breakdown().captured.values()), f"step {step}: captures kept after success"
    # solver_fn is called at updates only: a fail_at between updates never calls it
    event(f"failed and retried: {failures}")


@settings(max_examples=40, **_COMMON)
@given(case=retry_cases())
def test_fuzz_retry_without_backward(case: RetryCase) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _check_retry(case)


@pytest.mark.slow
@settings(max_examples=10_000, **_COMMON)
@given(case=retry_cases())
def test_fuzz_retry_without_backward_many(case: RetryCase) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _check_retry(case)


# --------------------------------------------------------------------------- duplicated rows, small damping
@dataclass(frozen=True)
class DuplicatedCase:
    """A small float32/float64 net stepped on one batch taken twice (concatenated, or accumulated by two
    backwards), at damping ≤ 10⁻², with any solver (docs/reliability.md, "Fallbacks")."""

    conv: bool
    width: int
    rows: int
    twice: Literal["cat", "accumulate"]
    dtype: torch.dtype
    solver: str
    damping: float
    kl_clip: bool
    update_freq: int
    seed: int


@st.composite
def duplicated_cases(draw: st.DrawFn) -> DuplicatedCase:
    """Cases for :func:`test_fuzz_duplicated_rows_descend`."""
    return DuplicatedCase(
        conv=draw(st.booleans()),
        width=draw(st.integers(1, 8)),
        rows=draw(st.integers(1, 6)),
        twice=draw(st.sampled_from(("cat", "accumulate"))),
        dtype=draw(st.sampled_from((torch.float32, torch.float32, torch.float64))),
        solver=draw(st.sampled_from(SOLVERS)),
        damping=draw(_log_uniform(-6, -2)),
        kl_clip=draw(st.booleans()),
        update_freq=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 2**16)),
    )


def _check_duplicated(case: DuplicatedCase) -> None:
    """At every step, each registered layer's applied gradient v of its raw gradient g satisfies ⟨g, v⟩ > 0 and
    ‖v‖ ≤ ‖g‖/λ (1 + tol) (``kl_clip`` only shortens v), or v is g and the fallback was counted: warned at
    this step (an update) or pending for the next update."""
    from tests.kit.checks import grad_matrix  # this property's own import (the section stands alone)

    torch.manual_seed(case.seed)
    first: nn.Module = nn.Conv2d(2, case.width, 3) if case.conv else nn.Linear(5, case.width)
    features = case.width * 9 if case.conv else case.width
    model = nn.Sequential(first, nn.Tanh(), nn.Flatten(), nn.Linear(features, 3)).to(case.dtype)
    options: dict[str, Any] = {"kl_clip": 1e-3, "lr": 0.1} if case.kl_clip else {}
    pre = HyLoPreconditioner(model, solver=case.solver, damping=case.damping, update_freq=case.update_freq, **options)
    modules = {info.name: info.module for info in pre.layer_info()}
    for step in range(3):
        x = torch.randn((case.rows, 2, 5, 5) if case.conv else (case.rows, 5), dtype=case.dtype)
        y = torch.randint(0, 3, (case.rows,))
        model.zero_grad()
        if case.twice == "cat":
            F.cross_entropy(model(torch.cat([x, x])), torch.cat([y, y])).backward()
        else:
            for _ in range(2):
                F.cross_entropy(model(x), y).backward()
        raw = {name: grad_matrix(module).double() for name, module in modules.items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        reported = " ".join(str(w.message) for w in caught if "descent direction" in str(w.message))
        infos = {info.name: info for info in pre.layer_info()}
        pending = {name: info.fallbacks for name, info in infos.items()}
        for name, module in modules.items():
            g, v = raw[name], grad_matrix(module).double()
            if torch.equal(v, g):
                if infos[name].state is not None and g.any():
                    assert f"'{name}'" in reported or pending[name] > 0, f"step {step}: {name} fell back silently"
                    event("a layer fell back to its raw gradient")
                continue
            assert (g * v).sum() > 0, f"step {step}: layer {name} went uphill"
            assert v.norm() <= g.norm() / case.damping * (1 + 2e-3), f"step {step}: layer {name} too long"


@settings(max_examples=60, **_COMMON)
@given(case=duplicated_cases())
def test_fuzz_duplicated_rows_descend(case: DuplicatedCase) -> None:
    _check_duplicated(case)


@pytest.mark.slow
@settings(max_examples=10_000, **_COMMON)
@given(case=duplicated_cases())
def test_fuzz_duplicated_rows_descend_many(case: DuplicatedCase) -> None:
    _check_duplicated(case)
