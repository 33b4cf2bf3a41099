"""Per-layer fidelity of every solver against the exact SNGD step built from the true per-sample gradients.

Example:
    python scripts/bench_fidelity.py --model resnet32 --batch-size 32 --damping 0.1 1.0 --csv fidelity.csv
    python scripts/bench_fidelity.py --methods kfac sngd kid kis --damping 0.3

One update step in float64 on a random batch with a mean cross-entropy loss; BatchNorm is in
eval mode with the batch's own statistics, every other module in training mode. For each
method a fresh copy of the model (same weights) gets
``HyLoPreconditioner(update_freq=1, damping=λ, **options)``; each registered layer's
preconditioned gradient is compared with (F + λI)⁻¹ vec ∇W, F the empirical Fisher of the
model's true per-sample gradients (scripts/persample.py; docs/design.md, "SNGD"). The error
is ‖V̂ − V‖_F / ‖V‖_F; the ``sgd`` column is the error of ∇W/λ, the unpreconditioned step.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from scripts.engine import write_rows
from scripts.models import MODELS, build_model, model_names
from scripts.persample import batchnorm_eval, per_sample_grads, relative_error, sngd_reference, supported_layers

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


@dataclasses.dataclass(frozen=True)
class Run:
    """One preconditioner to measure: a method, its rank ratio (None: not a low-rank method) and options."""

    method: str
    rank_ratio: float | None
    options: Mapping[str, Any]

    @property
    def label(self) -> str:
        """Column name, e.g. ``kid@0.25``."""
        return self.method if self.rank_ratio is None else f"{self.method}@{self.rank_ratio:g}"


def plan_runs(methods: Sequence[str], rank_ratios: Sequence[float]) -> list[Run]:
    """Every run of ``methods``, the low-rank ones once per rank ratio.

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
        else:
            runs.append(Run(method, None, options))
    return runs


def grad_matrix(module: nn.Module) -> Tensor:
    """A Linear/Conv2d's ``.grad`` as a (d_g, d_a) matrix, bias as the last column (docs/design.md, "Notation")."""
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


def format_tables(
    damping: float,
    shapes: Mapping[str, tuple[int, int]],
    sgd: Mapping[str, float],
    errors: Mapping[str, Mapping[str, float]],
) -> str:
    """Per-layer errors (``sgd`` = ∇W/λ, then one column per run label of ``errors``) and a median/max summary."""
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
    lines += ["", f"{'method':<{width}} {'median':>9} {'max':>9}"]
    for label, column in columns.items():
        values = list(column.values())
        lines.append(f"{label:<{width}} {statistics.median(values):>9.2e} {max(values):>9.2e}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=model_names())
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="weights, batch and hylo's KIS draws")
    parser.add_argument("--damping", type=float, nargs="+", default=[0.1, 1.0], help="hylo's absolute λ")
    parser.add_argument("--rank-ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5], help="ρ of kid/kis methods")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--csv", default=None, help="write one row per damping, run and layer to this CSV")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure every run at every damping, print the tables and optionally write the CSV; returns 0."""
    args = parse_args(argv)
    runs = plan_runs(args.methods, args.rank_ratios)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    start = time.perf_counter()
    spec = MODELS[args.model]
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(torch.float64)
    x, y = spec.random_batch(args.batch_size)
    x = x.to(torch.float64)
    batchnorm_eval(model, x)
    layers = supported_layers(model)
    per_sample = per_sample_grads(model, F.cross_entropy, x, y, layers)
    F.cross_entropy(model(x), y).backward()
    grads = {name: grad_matrix(model.get_submodule(name)) for name in layers}
    print(
        f"{args.model}, batch {args.batch_size}, {len(layers)} layers, float64; "
        f"per-sample gradients in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    shapes = {name: (grads[name].shape[0], grads[name].shape[1]) for name in layers}
    rows: list[dict[str, Any]] = []
    for damping in args.damping:
        references = {name: sngd_reference(per_sample[name], grads[name], damping) for name in layers}
        sgd = {name: relative_error(grads[name] / damping, references[name]) for name in layers}
        errors: dict[str, dict[str, float]] = {}
        for run in runs:
            run_start = time.perf_counter()
            results = preconditioned(model, x, y, run, damping, args.seed)
            print(f"  damping {damping:g}, {run.label}: {time.perf_counter() - run_start:.1f} s", flush=True)
            if results.keys() != set(layers):
                raise RuntimeError(f"hylo registered {sorted(results)}, the oracle covers {layers}")
            errors[run.label] = {name: relative_error(results[name], references[name]) for name in layers}
            rows += [
                {
                    "model": args.model,
                    "batch": args.batch_size,
                    "damping": damping,
                    "method": run.method,
                    "rank_ratio": "" if run.rank_ratio is None else run.rank_ratio,
                    "layer": name,
                    "d_a": shapes[name][1],
                    "d_g": shapes[name][0],
                    "rel_error": errors[run.label][name],
                    "rel_error_sgd": sgd[name],
                }
                for name in layers
            ]
        print()
        print(format_tables(damping, shapes, sgd, errors), flush=True)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    if args.csv:
        write_rows(args.csv, rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
