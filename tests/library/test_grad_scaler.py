"""A ``torch.amp.GradScaler`` wired into hylo (``grad_scaler=``) when the scaler skips a window.

docs/transformers.md, "Mixed precision". ``scaler.step(optimizer)`` does not call the optimizer's ``step()`` when it
found infs, so neither the optimizer form's step nor a preconditioner stepped from the optimizer's step pre-hook is
taken for that window: the window must leave hylo as it leaves the wrapped optimizer — as if its batch had never
been seen. The references know nothing of the scaler: the same run without a scaler on the batches the scaler
kept, bit for bit (every scale here is a power of two, which scaling and unscaling leave exact), and at
``update_freq=1`` the hand loop too (``unscale_`` → ``pre.step()`` → ``scaler.step``), whose ``pre.step()`` sees
the infs and skips. Non-finite gradients come from an inf multiplied into the logits' gradient, as an fp16
overflow would make them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hylo
from tests.kit.models import batch, mlp

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 8
#: Options the form and the hand loop share under SGD (the form's own defaults set ``kl_clip`` from the lr).
PLAIN = {"damping": 0.3, "kl_clip": None}
Make = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SGD: Make = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAMW: Make = functools.partial(torch.optim.AdamW, lr=1e-2)
#: "form": HyLoOptimizer; "hooked": a preconditioner stepped from the optimizer's step pre-hook (as a training
#: stack's callback would); "hand": the hand loop of docs/transformers.md, "Mixed precision".
Form = Literal["form", "hooked", "hand"]


def backward(
    model: nn.Module, step: int, scale: Callable[[torch.Tensor], torch.Tensor], micro: int, poison: bool
) -> None:
    """Cross-entropy on ``batch(step, 16)`` in ``micro`` equal micro-batches (each loss over ``micro``); ``poison``:
    an inf multiplied into the logits' gradient of the first."""
    x, y = batch(step, 16)
    for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
        logits = model(xs)
        if poison and i == 0:
            logits.register_hook(lambda g: g * float("inf"))
        scale(F.cross_entropy(logits, ys) / micro).backward()


def train(
    form: Form,
    make: Make,
    options: dict[str, Any],
    steps: Iterable[int],
    *,
    scaled: bool = True,
    skip: frozenset[int] = frozenset(),
    growth_interval: int = 2,
    micro: int = 1,
    late: bool = False,
) -> tuple[nn.Module, hylo.HyLoPreconditioner, torch.amp.GradScaler | None]:
    """``form`` trained on ``steps`` (an inf injected at the steps in ``skip``), with a wired GradScaler (init 2¹⁰)
    or, ``scaled=False``, none; ``late``: the scaler given after construction (``pre.grad_scaler = scaler``, as for a
    stack's own scaler); any warning raises."""
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval) if scaled else None
    given = None if late else scaler
    if form == "form":
        opt: torch.optim.Optimizer = hylo.HyLoOptimizer(model, make, grad_scaler=given, **options)
        pre = opt.preconditioner
    else:
        pre = hylo.HyLoPreconditioner(model, grad_scaler=given, **options)
        opt = make(model.parameters())
        if form == "hooked":
            opt.register_step_pre_hook(lambda *_: pre.step())
    if late:
        pre.grad_scaler = scaler
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in steps:
            opt.zero_grad()
            backward(model, step, scaler.scale if scaler else lambda x: x, micro, step in skip)
            if form == "hand" and scaler is not None:
                scaler.unscale_(opt)
            if form == "hand":
                pre.step()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
    return model, pre, scaler


@torch.no_grad()
def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        error = float((p - q).abs().max() / q.abs().max())
        assert torch.equal(p, q), f"{name}: relative error {error:.2e}"


def kept(skip: frozenset[int]) -> list[int]:
    return [step for step in range(STEPS) if step not in skip]


# --------------------------------------------------------------------------- update_freq 1: also the hand loop
@pytest.mark.parametrize(
    ("form", "make", "options"),
    [
        pytest.param("form", SGD, {"solver": "kfac", **PLAIN}, id="form-sgd-kfac"),
        pytest.param("form", ADAMW, {}, id="form-adamw-defaults"),
        pytest.param("form", SGD, {"solver": "hybrid", **PLAIN}, id="form-sgd-hybrid"),
        pytest.param("hooked", SGD, {"solver": "kfac", **PLAIN}, id="hooked-sgd-kfac"),
    ],
)
def test_a_skipped_window_is_a_batch_never_seen_and_the_hand_loop(
    form: Form, make: Make, options: dict[str, Any]
) -> None:
    """``update_freq=1``, an inf at step 2: the parameters of the run that never saw batch 2 and of the hand loop,
    bit for bit; no warning (the scaler reports the skip); one hylo step fewer than windows."""
    options = {"update_freq": 1, **options}
    skip = frozenset({2})
    model, pre, scaler = train(form, make, options, range(STEPS), skip=skip)
    assert scaler is not None and scaler.get_scale() < 2.0**10 * 2 ** (STEPS // 2)  # it backed off once
    never_seen, _, _ = train(form, make, options, kept(skip), scaled=False)
    assert_same_parameters(model, never_seen)
    if form == "form" and make is SGD:  # the hand loop of the same preconditioner and optimizer
        by_hand, _, _ = train("hand", make, options, range(STEPS), skip=skip)
        assert_same_parameters(model, by_hand)
    assert pre.progress().steps == STEPS - 1


# --------------------------------------------------------------------------- windows skipped around updates
@pytest.mark.parametrize("form", ["form", "hooked"])
@pytest.mark.parametrize(
    "skip",
    [
        pytest.param(frozenset({3}), id="at-an-update"),
        pytest.param(frozenset({2}), id="right-before-an-update"),
        pytest.param(frozenset({4, 5}), id="two-between-updates"),
        pytest.param(frozenset({2, 3}), id="before-and-at-an-update"),
    ],
)
def test_windows_skipped_around_updates_are_batches_never_seen(form: Form, skip: frozenset[int]) -> None:
    """K-FAC, ``update_freq=3`` with the factors refreshed at every step (``factor_update_freq=1``, so every window
    captures): windows skipped at, right before and between updates leave the run that never saw their batches."""
    options = {"solver": "kfac", "update_freq": 3, "factor_update_freq": 1, **PLAIN}
    model, pre, _ = train(form, SGD, options, range(STEPS), skip=skip)
    never_seen, reference, _ = train(form, SGD, options, kept(skip), scaled=False)
    assert_same_parameters(model, never_seen)
    assert pre.progress() == reference.progress()


# --------------------------------------------------------------------------- growth is no skip
def test_a_growing_scale_is_not_taken_for_a_skip() -> None:
    """The scale doubles after every successful step (``growth_interval=1``) and backs off at the skipped step 4;
    two micro-batches a window (the scale is read again at the second backward pass): the run that never saw
    batch 4, bit for bit, with one update per kept window."""
    options = {"solver": "kfac", "update_freq": 1, **PLAIN}
    skip = frozenset({4})
    model, pre, scaler = train("form", SGD, options, range(STEPS), skip=skip, growth_interval=1, micro=2)
    assert scaler is not None and scaler.get_scale() == 2.0 ** (10 + (STEPS - 1) - 1)  # 7 growths, 1 backoff
    never_seen, _, _ = train("form", SGD, options, kept(skip), scaled=False, micro=2)
    assert_same_parameters(model, never_seen)
    assert pre.progress().updates == STEPS - 1


# --------------------------------------------------------------------------- a scaler given after construction
@pytest.mark.parametrize("form", ["form", "hooked"])
def test_a_scaler_set_after_construction_is_the_scaler_given_at_construction(form: Form) -> None:
    """A training stack makes its GradScaler after the optimizer: ``pre.grad_scaler = scaler`` (the optimizer form's
    ``optimizer.preconditioner``) before the first step gives the run with ``grad_scaler=scaler``, bit for bit —
    the unscaled run's, with a skipped window a batch never seen."""
    options = {"solver": "kfac", "update_freq": 1, **PLAIN}
    skip = frozenset({2})
    model, pre, scaler = train(form, SGD, options, range(STEPS), skip=skip, late=True)
    assert pre.grad_scaler is scaler
    wired, _, _ = train(form, SGD, options, range(STEPS), skip=skip)
    assert_same_parameters(model, wired)
    never_seen, _, _ = train(form, SGD, options, kept(skip), scaled=False)
    assert_same_parameters(model, never_seen)


def test_a_grad_scaler_that_is_not_one_is_refused_and_changes_nothing() -> None:
    scaler = torch.amp.GradScaler("cpu")
    pre = hylo.HyLoPreconditioner(mlp(), grad_scaler=scaler)
    with pytest.raises(ValueError, match="grad_scaler must be a torch.amp.GradScaler, got float"):
        pre.grad_scaler = 2.0**16  # type: ignore[assignment]
    assert pre.grad_scaler is scaler
    pre.grad_scaler = None
    assert pre.grad_scaler is None
