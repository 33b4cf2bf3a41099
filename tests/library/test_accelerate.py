"""hylo with Hugging Face Accelerate, in both recipes (docs/training-stacks.md, "Accelerate").

- The optimizer form: ``accelerator.prepare(model, HyLoOptimizer(model, AdamW), loader)``; Accelerate's
  ``AcceleratedOptimizer`` skips ``step()`` (hence hylo) on the micro-batches of an accumulation window.
- The preconditioner form: ``if accelerator.sync_gradients: pre.step()`` inside ``accelerator.accumulate(model)``,
  with ``accelerator.register_for_checkpointing(pre)`` so that ``save_state``/``load_state`` carry hylo's state.

Each run is held to the hand-written loop it stands for — the same MLP, batches, optimizer and hylo options — bit for
bit on CPU: per micro-batch the cross-entropy divided by the accumulation steps (as ``accelerator.backward`` divides
it), backward, then at the window's end clipping (where the recipe clips: before hylo), ``pre.step()``, the step.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import hylo
from tests.kit.stacks import (
    CASES,
    WINDOW,
    Case,
    Run,
    assert_one_batch,
    backward_window,
    dataset,
    ended,
    hylo_of,
    step_by_hand,
    tiny_mlp,
    windows,
)

accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 8
BATCH = 4
LR = 1e-2
CLIP = 0.05  # well under the gradients' norm: clipping changes every step
#: The preconditioner form's options (kfac under AdamW, docs/transformers.md, "Damping under AdamW"); the optimizer
#: form takes AdamW's defaults (kfac_adam).
PRECONDITIONER_OPTIONS: dict[str, Any] = {"solver": "kfac", "update_freq": 2, "damping": 1e-3}
OPTIMIZER_OPTIONS: dict[str, Any] = {"update_freq": 2}
FORMS = ("optimizer", "preconditioner")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test's Accelerator starts from nothing (Accelerate keeps its state in process-wide singletons)."""
    _reset_accelerate()
    yield
    _reset_accelerate()


def _reset_accelerate() -> None:
    """Accelerate's singletons reset, as its own test cases reset them."""
    for singleton, arguments in ((accelerate.state.AcceleratorState, (True,)), (accelerate.state.GradientState, ())):
        singleton._reset_state(*arguments)


def built(form: str) -> tuple[nn.Module, hylo.HyLoPreconditioner, torch.optim.Optimizer]:
    model = tiny_mlp()
    if form == "optimizer":
        optimizer = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=LR), **OPTIMIZER_OPTIONS)
        return model, optimizer.preconditioner, optimizer
    return model, hylo.HyLoPreconditioner(model, **PRECONDITIONER_OPTIONS), torch.optim.AdamW(model.parameters(), lr=LR)


@functools.cache
def by_hand(form: str, accumulation: int = 1, clipping: str = "none") -> Run:
    """The hand-written loop; ``clipping``: "none", "before" (clip, then precondition) or "after" hylo's step."""
    model, pre, optimizer = built(form)
    data = dataset(STEPS * accumulation * BATCH, seed=1)
    for step in range(STEPS):
        backward_window(model, data, step, accumulation, BATCH)
        step_by_hand(model, pre, optimizer, optimizer_form=form == "optimizer", clipping=clipping, max_norm=CLIP)
        optimizer.zero_grad()
    return ended(model, pre)


def by_accelerate(
    form: str,
    root: Path,
    *,
    accumulation: int = 1,
    clipping: bool = False,
    evaluate: bool = False,
    save_at: int = 0,
    resume: Path | None = None,
) -> Run:
    """The recipe of the form, new objects throughout: ``save_at`` saves the state after that many optimizer steps
    (``save_state``), ``resume`` loads one (``load_state``) and skips the batches it had trained on."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model, pre, optimizer = built(form)
    loader = DataLoader(dataset(STEPS * accumulation * BATCH, seed=1), batch_size=BATCH)
    valid = [tensors for tensors in DataLoader(dataset(2 * BATCH, seed=2), batch_size=BATCH)]
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if form == "preconditioner":
        accelerator.register_for_checkpointing(pre)
    steps = 0
    if resume is not None:
        accelerator.load_state(str(resume))
        steps = pre.steps
        loader = accelerator.skip_first_batches(loader, steps * accumulation)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                if clipping:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                if form == "preconditioner":
                    pre.step()
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            if evaluate:
                model.eval()
                with torch.no_grad():
                    for vx, vy in valid:
                        F.cross_entropy(model(vx), vy)
                model.train()
            if steps == save_at:
                accelerator.save_state(str(root / f"step-{steps}"))
    return ended(accelerator.unwrap_model(model), pre, optimizer_steps=steps)


def assert_same(run: Run, reference: Run) -> None:
    """Every parameter and hylo's whole state equal bit for bit."""
    differ = [name for name, p in run.params.items() if not torch.equal(p, reference.params[name])]
    assert not differ, f"parameters differ: {differ}"
    assert run.hylo_steps == reference.hylo_steps
    assert run.hylo_state["checksum"] == reference.hylo_state["checksum"], "hylo's states differ"


@pytest.mark.parametrize("form", FORMS)
def test_the_recipe_runs_the_hand_written_loop(form: str, tmp_path: Path) -> None:
    """The recipe ends with the parameters and hylo state of the hand-written loop, bit for bit."""
    run = by_accelerate(form, tmp_path)
    assert run.optimizer_steps == run.hylo_steps == STEPS
    assert_same(run, by_hand(form))


@pytest.mark.parametrize("form", FORMS)
def test_gradient_accumulation_steps_hylo_once_per_optimizer_step(form: str, tmp_path: Path) -> None:
    """Under ``gradient_accumulation_steps=4`` hylo steps once per optimizer step — the AcceleratedOptimizer skips the
    optimizer form's ``step()`` while accumulating, the other recipe asks ``sync_gradients`` — on the whole window's
    gradient: the hand-written loop that accumulates four micro-batches."""
    run = by_accelerate(form, tmp_path, accumulation=4)
    assert run.optimizer_steps == run.hylo_steps == STEPS
    assert_same(run, by_hand(form, accumulation=4))


@pytest.mark.parametrize("form", FORMS)
def test_evaluation_between_steps_changes_nothing(form: str, tmp_path: Path) -> None:
    """Evaluating after every step (``model.eval()``, forwards under ``no_grad``) leaves the run equal to the loop
    without evaluation."""
    assert_same(by_accelerate(form, tmp_path, evaluate=True), by_hand(form))


@pytest.mark.parametrize("form", FORMS)
def test_resuming_from_save_state_is_bit_exact(form: str, tmp_path: Path) -> None:
    """Save the state after 4 of 8 optimizer steps (``accumulation`` 4), then ``load_state`` into new objects and
    train to step 8: parameters and hylo's state equal the uninterrupted run's exactly (the optimizer form's state
    rides in the optimizer's file, the preconditioner's in the custom object ``register_for_checkpointing`` adds)."""
    straight = by_accelerate(form, tmp_path, accumulation=4, save_at=STEPS // 2)
    halfway = tmp_path / f"step-{STEPS // 2}"
    assert (halfway / "custom_checkpoint_0.pkl").is_file() == (form == "preconditioner")
    resumed = by_accelerate(form, tmp_path, accumulation=4, resume=halfway)
    assert resumed.optimizer_steps == STEPS
    assert_same(resumed, straight)


@pytest.mark.parametrize("form", FORMS)
def test_the_recipe_clips_before_hylo(form: str, tmp_path: Path) -> None:
    """``accelerator.clip_grad_norm_`` where the recipes call it — before ``optimizer.step()``, before ``pre.step()``
    — clips the raw gradient: the loop that clips, then preconditions, not the one that preconditions, then clips."""
    run = by_accelerate(form, tmp_path, clipping=True)
    assert_same(run, by_hand(form, clipping="before"))
    after = by_hand(form, clipping="after")
    assert any(not torch.equal(p, after.params[name]) for name, p in run.params.items())


def accumulated_by_accelerate(case: Case, accumulation: int, *, plain: bool = False, reorder: bool = False) -> Run:
    """The recipe of ``case`` over :func:`~tests.kit.stacks.windows` in float64, ``gradient_accumulation_steps=
    accumulation`` micro-batches of ``WINDOW // accumulation`` per optimizer step; ``plain``: without hylo."""
    _reset_accelerate()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = tiny_mlp().to(torch.float64)
    pre, optimizer = hylo_of(model, case, plain=plain)
    loader = DataLoader(windows(reorder=reorder), batch_size=WINDOW // accumulation)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))  # divides the loss by the accumulation steps
            if accelerator.sync_gradients and case.form == "preconditioner" and pre is not None:
                pre.step()
            optimizer.step()
            optimizer.zero_grad()
    return ended(accelerator.unwrap_model(model), pre)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_gradient_accumulation_gives_the_one_batch_parameters(case: Case) -> None:
    """``gradient_accumulation_steps=4`` over micro-batches of 8 ends with the parameters of batches of 32 (the same
    samples, in the same order) after 6 optimizer steps, to the stack's own rounding (float64): Accelerate divides each
    micro-batch's mean loss by 4, and hylo counts the window's rows once."""
    difference = assert_one_batch(functools.partial(accumulated_by_accelerate, case))
    print(f"accelerate {case.name}: {difference:.1e}")
