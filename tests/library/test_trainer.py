"""hylo inside Hugging Face's ``Trainer``, in both forms (docs/training-stacks.md, "Trainer").

- The optimizer form: ``Trainer(optimizers=(HyLoOptimizer(model, AdamW), None))`` (kfac_adam under AdamW).
- The callback form: ``Trainer(callbacks=[HyLoCallback(pre)])`` with the Trainer's own AdamW (kfac at damping 1e-3).

Each run is held to the hand-written loop it stands for — the same tiny GPT-2, the same batches, the same
optimizer, schedule and hylo options — bit for bit on CPU: every micro-batch's loss is the model's own (its token
sum over the window's label count, as the Trainer passes ``num_items_in_batch``), backward, then at the window's
end clipping (``max_grad_norm``), ``pre.step()`` and ``optimizer.step()``, the linear schedule, ``zero_grad``.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hylo
from tests.kit.stacks import Run, ended, step_by_hand

transformers = pytest.importorskip("transformers")
from hylo.integrations.transformers import STATE_FILE, HyLoCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore:hylo leaves 2 modules unpreconditioned"),  # GPT-2's tied embedding and head
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before"),  # the "after" loop
]

STEPS = 8
BATCH = 2
LR = 1e-2
CLIP = 0.05  # well under the gradients' norm (about 1): clipping changes every step
#: The callback form's hylo options: a natural-gradient solver under AdamW (docs/transformers.md, "Damping under AdamW").
CALLBACK_OPTIONS: dict[str, Any] = {"solver": "kfac", "update_freq": 2, "damping": 1e-3}
#: The optimizer form's: AdamW's defaults (kfac_adam), updated every 2 steps.
OPTIMIZER_OPTIONS: dict[str, Any] = {"update_freq": 2}
FORMS = ("optimizer", "callback")


def tiny_gpt2() -> nn.Module:
    """GPT-2 from a config (2 layers, width 32, vocabulary 64), no dropout, the same weights at every call."""
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def examples(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Token sequences of length 16; the first label is ignored (-100), so that every count of labelled tokens
    (the whole row or the shifted one) is the same: 15 per row."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, 64, (16,), generator=generator)
        labels = ids.clone()
        labels[0] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


TRAIN = examples(STEPS * BATCH * 4, seed=1)
EVAL = examples(4, seed=2)


def built(form: str) -> tuple[nn.Module, hylo.HyLoPreconditioner, torch.optim.Optimizer]:
    """The model, its preconditioner and the optimizer the form steps (the callback form's AdamW is built here
    for the hand-written loop; the Trainer builds its own, the same)."""
    model = tiny_gpt2()
    if form == "optimizer":
        optimizer = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=LR), **OPTIMIZER_OPTIONS)
        return model, optimizer.preconditioner, optimizer
    pre = hylo.HyLoPreconditioner(model, **CALLBACK_OPTIONS)
    return model, pre, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)


@functools.cache
def by_hand(form: str, accumulation: int = 1, clipping: str = "none") -> Run:
    """The hand-written loop; ``clipping``: "none", "before" (clip, then precondition) or "after" hylo's step."""
    model, pre, optimizer = built(form)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, 0, STEPS)
    rows = iter(TRAIN)
    for _ in range(STEPS):
        window = [[next(rows) for _ in range(BATCH)] for _ in range(accumulation)]
        batches = [{key: torch.stack([row[key] for row in rows_]) for key in rows_[0]} for rows_ in window]
        labelled = sum(b["labels"].ne(-100).sum() for b in batches) / 1  # the Trainer's num_items_in_batch
        for b in batches:
            model(**b, num_items_in_batch=labelled).loss.backward()
        step_by_hand(model, pre, optimizer, optimizer_form=form == "optimizer", clipping=clipping, max_norm=CLIP)
        schedule.step()
        model.zero_grad()
    return ended(model, pre)


def by_trainer(
    form: str,
    output_dir: Path,
    *,
    accumulation: int = 1,
    clipping: bool = False,
    evaluate: bool = False,
    save_steps: int = 0,
    resume: str | None = None,
    callback_options: dict[str, Any] | None = None,
) -> Run:
    """A ``Trainer`` run of the form, new objects throughout; ``resume`` is ``train(resume_from_checkpoint=)``."""
    model, pre, optimizer = built(form)
    callbacks = [] if form == "optimizer" else [HyLoCallback(pre, **(callback_options or {}))]
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accumulation, learning_rate=LR, max_grad_norm=CLIP if clipping else 0.0,
        train_sampling_strategy="sequential", use_cpu=True, report_to=[], disable_tqdm=True, logging_strategy="no",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        eval_strategy="steps" if evaluate else "no", eval_steps=2, per_device_eval_batch_size=2,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=TRAIN,
        eval_dataset=EVAL if evaluate else None,
        optimizers=(optimizer, None) if form == "optimizer" else (None, None),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resume)
    evaluations = sum("eval_loss" in entry for entry in trainer.state.log_history)
    return ended(model, pre, optimizer_steps=trainer.state.global_step, evaluations=evaluations)


def assert_same(run: Run, reference: Run) -> None:
    """Every parameter and hylo's whole state equal bit for bit."""
    differ = [name for name, p in run.params.items() if not torch.equal(p, reference.params[name])]
    assert not differ, f"parameters differ: {differ}"
    assert run.hylo_steps == reference.hylo_steps
    assert run.hylo_state["checksum"] == reference.hylo_state["checksum"], "hylo's states differ"


@pytest.mark.parametrize("form", FORMS)
def test_the_trainer_runs_the_hand_written_loop(form: str, tmp_path: Path) -> None:
    """A Trainer run ends with the parameters and hylo state of the hand-written loop, bit for bit (one hylo
    step per optimizer step, after the backward and before the optimizer; the linear schedule on every group)."""
    run = by_trainer(form, tmp_path)
    assert run.optimizer_steps == run.hylo_steps == STEPS
    assert_same(run, by_hand(form))


@pytest.mark.parametrize("form", FORMS)
def test_gradient_accumulation_steps_hylo_once_per_optimizer_step(form: str, tmp_path: Path) -> None:
    """With ``gradient_accumulation_steps=4`` hylo steps once per optimizer step, on the whole window's gradient
    (its captures are all four micro-batches'): the hand-written loop that accumulates four micro-batches."""
    run = by_trainer(form, tmp_path, accumulation=4)
    assert run.optimizer_steps == run.hylo_steps == STEPS
    assert_same(run, by_hand(form, accumulation=4))


@pytest.mark.parametrize("form", FORMS)
def test_evaluation_between_steps_changes_nothing(form: str, tmp_path: Path) -> None:
    """Evaluating every 2 steps (``eval_strategy="steps"``: forwards under ``no_grad`` between an update step's
    backward and the next) leaves the run equal to the loop without evaluation."""
    run = by_trainer(form, tmp_path, evaluate=True)
    assert run.evaluations == STEPS // 2
    assert_same(run, by_hand(form))


@pytest.mark.parametrize("form", FORMS)
def test_resuming_from_the_trainers_checkpoint_is_bit_exact(form: str, tmp_path: Path) -> None:
    """Train 8 steps saving every 4, then resume new objects from ``checkpoint-4`` to step 8: parameters and hylo's
    state equal the uninterrupted run's exactly (the optimizer form's state rides in ``optimizer.pt``, the
    callback's in ``checkpoint-4/hylo_state.pt``)."""
    straight = by_trainer(form, tmp_path, save_steps=4)
    halfway = tmp_path / "checkpoint-4"
    assert (halfway / STATE_FILE).is_file() == (form == "callback")
    resumed = by_trainer(form, tmp_path, resume=str(halfway))
    assert resumed.hylo_steps == STEPS
    assert_same(resumed, straight)


@pytest.mark.parametrize("form", FORMS)
def test_max_grad_norm_clips_before_hylo(form: str, tmp_path: Path) -> None:
    """The Trainer clips (``max_grad_norm``) the raw gradients before ``on_pre_optimizer_step`` and
    ``optimizer.step()``, so before hylo in both forms: the loop that clips, then preconditions — not the one
    that preconditions, then clips."""
    run = by_trainer(form, tmp_path, clipping=True)
    assert_same(run, by_hand(form, clipping="before"))
    after = by_hand(form, clipping="after")
    assert any(not torch.equal(p, after.params[name]) for name, p in run.params.items())


def test_the_callback_resumes_from_a_checkpoint_elsewhere_only_when_told(tmp_path: Path) -> None:
    """A checkpoint moved out of ``output_dir`` is found with ``HyLoCallback(pre, resume_from=folder)``; without
    it the callback looks in ``output_dir``, finds nothing there (or another run's state at the same step: other
    weights) and refuses before any step rather than train on from a fresh or a foreign state."""
    straight = by_trainer("callback", tmp_path / "first", save_steps=4)
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "first" / "checkpoint-4", moved)
    with pytest.raises(ValueError, match="no hylo state fits it"):
        by_trainer("callback", tmp_path / "second", resume=str(moved))
    foreign = tmp_path / "second" / "checkpoint-4"
    foreign.mkdir(parents=True)
    shutil.copy(tmp_path / "first" / "checkpoint-8" / STATE_FILE, foreign / STATE_FILE)
    with pytest.raises(ValueError, match="saved at step 8"):
        by_trainer("callback", tmp_path / "second", resume=str(moved))
    other = torch.load(moved / STATE_FILE, weights_only=True)
    torch.save({**other, "weights": "another run's"}, foreign / STATE_FILE)
    with pytest.raises(ValueError, match="other weights"):
        by_trainer("callback", tmp_path / "second", resume=str(moved))
    resumed = by_trainer("callback", tmp_path / "second", resume=str(moved), callback_options={"resume_from": moved})
    assert_same(resumed, straight)


def test_the_callback_takes_a_preconditioner_built_on_the_trained_model() -> None:
    """A HyLoOptimizer (the other form) or a preconditioner of another model is refused, before any step."""
    model, pre, optimizer = built("optimizer")
    with pytest.raises(ValueError, match="optimizer form"):
        HyLoCallback(optimizer)  # type: ignore[arg-type]
    callback = HyLoCallback(pre)
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="another model"):
        callback.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(), model=tiny_gpt2())


def test_import_hylo_imports_no_training_stack() -> None:
    """``import hylo`` (and ``hylo.integrations``, the package) imports none of transformers, lightning and
    accelerate: only ``hylo.integrations.transformers`` / ``.lightning`` import their stack, when imported."""
    code = (
        "import sys, hylo, hylo.integrations\n"
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    found = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"
