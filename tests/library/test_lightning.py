"""hylo inside Lightning, in both forms (docs/training-stacks.md, "Lightning").

- The optimizer form: ``configure_optimizers`` returns ``HyLoOptimizer(model, SGD)``; Lightning calls its
  ``step(closure)``, which runs the closure (forward, backward, ``on_before_optimizer_step``, clipping), then hylo,
  then SGD.
- The callback form: ``Trainer(callbacks=[HyLoCallback(pre)])`` with SGD from ``configure_optimizers``.

Each run is held to the hand-written loop it stands for — the same MLP, batches, SGD with momentum and hylo
options — bit for bit on CPU: per micro-batch the cross-entropy divided by ``accumulate_grad_batches`` (as
Lightning divides it), backward, then at the window's end ``pre.step()``, clipping where Lightning clips, the step.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import hylo
from tests.kit.stacks import (
    CASES,
    WINDOW,
    WINDOWS,
    Case,
    Run,
    assert_one_batch,
    backward_window,
    dataset,
    ended,
    hylo_of,
    step_by_hand,
    tiny_mlp,
    torch_optimizer,
    windows,
)

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

from hylo.integrations.lightning import HyLoCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),  # the resumed run saves no checkpoints
    # Lightning's own use of a torch API deprecated in torch 2.13
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]

EPOCHS = 2
STEPS_PER_EPOCH = 4
BATCH = 4
LR = 0.1
CLIP = 0.05  # well under the gradients' norm: clipping changes every step
#: The callback form's hylo options (the optimizer form takes SGD's defaults: damping 0.3, kl_clip at SGD's lr).
CALLBACK_OPTIONS: dict[str, Any] = {"solver": "kfac", "update_freq": 2, "damping": 0.3}
OPTIMIZER_OPTIONS: dict[str, Any] = {"update_freq": 2}
FORMS = ("optimizer", "callback")


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class Classifier(pl.LightningModule):
    """A LightningModule around the MLP: cross-entropy, SGD (wrapped in a HyLoOptimizer for the optimizer form)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.net = tiny_mlp()
        self.form = form
        self.validations = 0
        #: The optimizer form's HyLoOptimizer, once ``configure_optimizers`` built it.
        self.hylo_optimizer: hylo.HyLoOptimizer | None = None

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        x, y = batch
        self.validations += 1
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.form == "callback":
            return sgd(self.net.parameters())
        self.hylo_optimizer = hylo.HyLoOptimizer(self.net, sgd, **OPTIMIZER_OPTIONS)
        return self.hylo_optimizer


@functools.cache
def by_hand(form: str, accumulation: int = 1, clipping: str = "none") -> Run:
    """The hand-written loop; ``clipping``: "none", "before" (clip, then precondition) or "after" hylo's step."""
    model = tiny_mlp()
    optimizer: torch.optim.Optimizer
    if form == "optimizer":
        optimizer = hylo.HyLoOptimizer(model, sgd, **OPTIMIZER_OPTIONS)
        pre = optimizer.preconditioner
    else:
        pre, optimizer = hylo.HyLoPreconditioner(model, **CALLBACK_OPTIONS), sgd(model.parameters())
    data = dataset(STEPS_PER_EPOCH * accumulation * BATCH, seed=1)
    for _ in range(EPOCHS):
        for step in range(STEPS_PER_EPOCH):
            optimizer.zero_grad()
            backward_window(model, data, step, accumulation, BATCH)
            step_by_hand(model, pre, optimizer, optimizer_form=form == "optimizer", clipping=clipping, max_norm=CLIP)
    return ended(model, pre)


def by_lightning(
    form: str,
    root: Path,
    *,
    accumulation: int = 1,
    clipping: bool = False,
    validate: bool = False,
    checkpoints: bool = False,
    resume: Path | None = None,
) -> Run:
    """A Lightning run of the form, new objects throughout; ``resume`` is ``fit(ckpt_path=)``."""
    module = Classifier(form)
    pre = None if form == "optimizer" else hylo.HyLoPreconditioner(module.net, **CALLBACK_OPTIONS)
    callbacks: list[pl.Callback] = [] if pre is None else [HyLoCallback(pre)]
    if checkpoints:  # one checkpoint per epoch: epoch=0-step=4.ckpt, epoch=1-step=8.ckpt
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(
        default_root_dir=root, max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpoints, callbacks=callbacks,
        accumulate_grad_batches=accumulation, gradient_clip_val=CLIP if clipping else None,
        val_check_interval=2 if validate else None, num_sanity_val_steps=2 if validate else 0,
        limit_val_batches=None if validate else 0,
    )  # fmt: skip
    train = DataLoader(dataset(STEPS_PER_EPOCH * accumulation * BATCH, seed=1), batch_size=BATCH)
    valid = DataLoader(dataset(2 * BATCH, seed=2), batch_size=BATCH)
    trainer.fit(module, train, valid if validate else None, ckpt_path=resume)
    if pre is None:
        assert module.hylo_optimizer is not None
        pre = module.hylo_optimizer.preconditioner
    return ended(module.net, pre, optimizer_steps=trainer.global_step, evaluations=module.validations)


def assert_same(run: Run, reference: Run) -> None:
    """Every parameter and hylo's whole state equal bit for bit."""
    differ = [name for name, p in run.params.items() if not torch.equal(p, reference.params[name])]
    assert not differ, f"parameters differ: {differ}"
    assert run.hylo_steps == reference.hylo_steps
    assert run.hylo_state["checksum"] == reference.hylo_state["checksum"], "hylo's states differ"


@pytest.mark.parametrize("form", FORMS)
def test_lightning_runs_the_hand_written_loop(form: str, tmp_path: Path) -> None:
    """A Lightning fit ends with the parameters and hylo state of the hand-written loop, bit for bit (one hylo
    step per optimizer step, after the backward and before SGD)."""
    run = by_lightning(form, tmp_path)
    assert run.optimizer_steps == run.hylo_steps == EPOCHS * STEPS_PER_EPOCH
    assert_same(run, by_hand(form))


@pytest.mark.parametrize("form", FORMS)
def test_gradient_accumulation_steps_hylo_once_per_optimizer_step(form: str, tmp_path: Path) -> None:
    """With ``accumulate_grad_batches=4`` hylo steps once per optimizer step (``on_before_optimizer_step`` and the
    optimizer's ``step(closure)`` run once per window), on the whole window's gradient: the hand-written loop that
    accumulates four micro-batches."""
    run = by_lightning(form, tmp_path, accumulation=4)
    assert run.optimizer_steps == run.hylo_steps == EPOCHS * STEPS_PER_EPOCH
    assert_same(run, by_hand(form, accumulation=4))


@pytest.mark.parametrize("form", FORMS)
def test_validation_between_steps_changes_nothing(form: str, tmp_path: Path) -> None:
    """The sanity check and a validation loop every 2 training batches (forwards without backward between an
    update step and the next) leave the run equal to the loop without validation."""
    run = by_lightning(form, tmp_path, validate=True)
    assert run.evaluations == 2 + EPOCHS * (STEPS_PER_EPOCH // 2) * 2  # sanity batches, then 2 per validation
    assert_same(run, by_hand(form))


@pytest.mark.parametrize("form", FORMS)
def test_resuming_from_lightnings_checkpoint_is_bit_exact(form: str, tmp_path: Path) -> None:
    """Fit 2 epochs saving a checkpoint per epoch, then fit new objects from the first epoch's checkpoint
    (``ckpt_path=``): parameters and hylo's state equal the uninterrupted run's exactly (the optimizer form's state
    rides in the checkpoint's optimizer states, the callback's in its ``callbacks`` entry)."""
    straight = by_lightning(form, tmp_path, checkpoints=True)
    halfway = tmp_path / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    saved = torch.load(halfway, weights_only=True)
    holder = saved["optimizer_states"][0] if form == "optimizer" else saved["callbacks"]["HyLoCallback"]
    assert holder["hylo" if form == "optimizer" else "preconditioner"]["steps"] == STEPS_PER_EPOCH
    resumed = by_lightning(form, tmp_path / "resumed", resume=halfway)
    assert resumed.optimizer_steps == EPOCHS * STEPS_PER_EPOCH
    assert_same(resumed, straight)


@pytest.mark.parametrize(("form", "order"), [("optimizer", "before"), ("callback", "after")])
def test_gradient_clip_val_clips_after_the_callback_and_before_the_optimizer_form(
    form: str, order: str, tmp_path: Path
) -> None:
    """Lightning clips (``gradient_clip_val``) right after ``on_before_optimizer_step``, inside the closure: after
    the callback's ``pre.step()`` (it clips the preconditioned gradient), but before the optimizer form's hylo step,
    which runs once the closure has returned (it clips the raw gradient)."""
    run = by_lightning(form, tmp_path, clipping=True)
    assert_same(run, by_hand(form, clipping=order))
    other = by_hand(form, clipping="after" if order == "before" else "before")
    assert any(not torch.equal(p, other.params[name]) for name, p in run.params.items())


def test_the_callback_takes_a_preconditioner_built_on_the_trained_model(tmp_path: Path) -> None:
    """A HyLoOptimizer (the other form) is refused at construction, a preconditioner of another model at ``fit``,
    before any step."""
    model = tiny_mlp()
    with pytest.raises(ValueError, match="optimizer form"):
        HyLoCallback(hylo.HyLoOptimizer(model, sgd))  # type: ignore[arg-type]
    stranger = HyLoCallback(hylo.HyLoPreconditioner(model, **CALLBACK_OPTIONS))
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=1, accelerator="cpu", logger=False, callbacks=[stranger])
    with pytest.raises(ValueError, match="another model"):
        trainer.fit(Classifier("callback"), DataLoader(dataset(8, seed=1), batch_size=BATCH))


class CaseModule(pl.LightningModule):
    """The MLP with ``case``'s optimizer from ``configure_optimizers``: a HyLoOptimizer (the optimizer form), the
    torch optimizer alone (the preconditioner form, whose callback the Trainer gets, or ``plain``)."""

    def __init__(self, case: Case, plain: bool) -> None:
        super().__init__()
        self.net = tiny_mlp()
        self.case, self.plain = case, plain
        #: hylo's preconditioner, once ``configure_optimizers`` built the optimizer form.
        self.preconditioner: hylo.HyLoPreconditioner | None = None

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.case.form == "preconditioner" or self.plain:
            return torch_optimizer(self.case.optimizer)(self.net.parameters())
        self.preconditioner, optimizer = hylo_of(self.net, self.case)
        return optimizer


def accumulated_by_lightning(
    case: Case, accumulation: int, root: Path, *, plain: bool = False, reorder: bool = False
) -> Run:
    """A Lightning fit of ``case`` over :func:`~tests.kit.stacks.windows` (``precision="64-true"``), one epoch of
    ``accumulate_grad_batches=accumulation`` micro-batches of ``WINDOW // accumulation`` per optimizer step."""
    module = CaseModule(case, plain)
    callbacks: list[pl.Callback] = []
    pre = None
    if case.form == "preconditioner" and not plain:
        module.net.to(torch.float64)  # the preconditioner is built on the parameters Lightning will train
        pre = hylo.HyLoPreconditioner(module.net, **dict(case.options))
        callbacks.append(HyLoCallback(pre))
    trainer = pl.Trainer(
        default_root_dir=root, max_epochs=1, accelerator="cpu", devices=1, logger=False, precision="64-true",
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
        accumulate_grad_batches=accumulation, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(windows(reorder=reorder), batch_size=WINDOW // accumulation))
    assert trainer.global_step == WINDOWS
    return ended(module.net, pre if pre is not None else module.preconditioner)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_accumulate_grad_batches_gives_the_one_batch_parameters(case: Case, tmp_path: Path) -> None:
    """``accumulate_grad_batches=4`` over micro-batches of 8 ends with the parameters of batches of 32 (the same
    samples, in the same order) after 6 optimizer steps, to the stack's own rounding (float64): Lightning divides
    each micro-batch's mean loss by 4, and hylo counts the window's rows once."""
    run = functools.partial(accumulated_by_lightning, case, root=tmp_path)
    difference = assert_one_batch(run)
    print(f"lightning {case.name}: {difference:.1e}")
