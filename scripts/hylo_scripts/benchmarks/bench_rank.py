"""Adaptive rank against a fixed rank with as many rows: each layer's error to the exact SNGD step of the true gradients.

Example:
    python scripts/bench_rank.py --model resnet32 --batch-size 64 --energies 0.9 0.99 --csv rank.csv
    python scripts/bench_rank.py --model resnet32 --data mnist --train-steps 300
    python scripts/bench_rank.py --model transformer --batch-size 8 --train-steps 200

One update step in float64 (docs/benchmarks.md, "Adaptive rank"). For each ``--solvers`` solver
(KID, KIS) and each ``--energies`` target e, hylo runs with ``rank_ratio="auto"``,
``rank_energy=e`` and ``rank_cap=--cap``; its L compared layers keep T rows in total. Then the
same solver runs at the two fixed ranks around T / L (``rank`` ⌊T/L⌋ and ⌈T/L⌉ in every layer, L·r
rows), and the fixed choice's error at exactly T rows is read off the line between them (a fixed
rank equal to T / L when it divides). Each compared layer's preconditioned gradient is measured
against (F + λI)⁻¹ vec ∇W, F the empirical Fisher of the model's true per-sample gradients:

- image models (``--data random`` or ``mnist``, weights at initialisation or after
  ``--train-steps`` of SGD, as in bench_fidelity.py): ``torch.func`` per-sample gradients of
  every Linear and Conv2d (hylo_scripts/benchmarks/persample.py); convolutions take ``--conv-rows``
  (default ``exact``, the true per-sample rows, so the error is the rank's alone);
- ``transformer`` (the LM bench size: 2 blocks, width 128, 64 tokens; uniform tokens, or
  ``--train-steps`` of AdamW on the standard library's bytes): every token is a row, and the
  oracle's rows g_t a_tᵀ of each Linear the model calls as a module (the MLPs and the head) come
  from forward hooks and ``torch.autograd.grad`` of the outputs, solved by Woodbury.

KIS draws at random: it runs ``--draws`` times (seeds 0, 1, …) and its errors are averaged. The
table gives, per damping, solver and target, the rows kept by each choice, the relative error
‖V̂ − V‖_F / ‖V‖_F of the whole step (every compared layer's V̂ together) and its mean and median
over the layers (the fixed choice's at T rows), and in how many layers the adaptive choice is
closer; ``--csv`` writes one row per layer and one for the whole step (layer ``<step>``).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo_scripts.benchmarks import flags, timing
from hylo_scripts.benchmarks.bench_fidelity import grad_matrix, mnist_batches, train_sgd
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.benchmarks.persample import (
    batchnorm_eval,
    per_sample_grads,
    relative_error,
    sngd_reference,
    supported_layers,
)
from hylo_scripts.models.registry import MODELS, build_model
from hylo_scripts.training.engine import write_rows

#: The LM bench's decoder (bench_accuracy.py's ``--task lm`` size).
LM_SIZE = {"layers": 2, "width": 128, "heads": 4}
LM_SEQ_LEN = 64
#: The solvers compared (they keep r of n rows).
SOLVERS = ("kid", "kis")
#: A layer's exact step: (the reference V, its gradient ∇W), both (d_g, d_a) float64.
Reference = tuple[Tensor, Tensor]


def token_rows(model: nn.Module, loss: Callable[[], Tensor], names: Sequence[str]) -> dict[str, tuple[Tensor, Tensor]]:
    """Each named Linear's token rows (a_t with a 1 for the bias, g_t = n ∂L/∂s_t), n the tokens, by forward hooks
    and ``torch.autograd.grad`` of its outputs: U_t = g_t a_tᵀ and ∇W = (1/n) Σ_t U_t (docs/solvers.md, "Notation")."""
    inputs: dict[str, Tensor] = {}
    outputs: dict[str, Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            inputs[name], outputs[name] = args[0].detach(), out

        return record

    handles = [model.get_submodule(name).register_forward_hook(hook(name)) for name in names]
    try:
        value = loss()
    finally:
        for handle in handles:
            handle.remove()
    grads = torch.autograd.grad(value, [outputs[name] for name in names])
    rows = {}
    for name, grad in zip(names, grads, strict=True):
        a = inputs[name].reshape(-1, inputs[name].shape[-1])
        n = a.shape[0]
        if model.get_submodule(name).bias is not None:
            a = torch.cat([a, a.new_ones(n, 1)], dim=1)
        rows[name] = (a.to(torch.float64), (grad.reshape(n, -1) * n).to(torch.float64))
    return rows


def factored_reference(a: Tensor, g: Tensor, damping: float) -> Reference:
    """(F + λI)⁻¹ vec ∇W for F = (1/n) Σ_t vec(g_t a_tᵀ) vec(g_t a_tᵀ)ᵀ, by Woodbury on the n×n kernel
    (a∘a)(g∘g): (V − Uᵀ(K + nλI)⁻¹ U V) / λ with ∇W = Gᵀ A / n."""
    n = a.shape[0]
    grad = g.mT @ a / n
    kernel = (a @ a.mT) * (g @ g.mT) + n * damping * torch.eye(n, dtype=a.dtype, device=a.device)
    projected = ((g @ grad) * a).sum(1)  # ⟨U_t, ∇W⟩
    coefficients = torch.linalg.solve(kernel, projected)
    return (grad - (g * coefficients[:, None]).mT @ a) / damping, grad


@dataclass
class Problem:
    """A model, one batch and its loss, and the exact step of every compared layer at each damping."""

    model: nn.Module
    loss: Callable[[nn.Module], Tensor]
    layers: list[str]
    references: dict[float, dict[str, Reference]]
    rows: int


def image_problem(args: argparse.Namespace, device: torch.device) -> tuple[Problem, str]:
    """An image classifier's batch (random or MNIST, weights at init or trained) and its exact steps."""
    spec = MODELS[args.model]
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    weights = "init"
    if args.data == "mnist":
        batches, x, y = mnist_batches(spec, args.batch_size, args.seed)
        if args.train_steps:
            print(f"trained: final loss {train_sgd(model, batches, args.train_steps, args.train_lr):.3f}", flush=True)
            weights = f"sgd{args.train_steps}"
    else:
        x, y = spec.random_batch(args.batch_size)
    model = model.to(torch.float64)
    x, y = x.to(device, torch.float64), y.to(device)
    batchnorm_eval(model, x)
    layers = supported_layers(model)
    per_sample = per_sample_grads(model, F.cross_entropy, x, y, layers)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = {name: grad_matrix(model.get_submodule(name)) for name in layers}
    model.zero_grad(set_to_none=True)
    references = {
        damping: {name: (sngd_reference(per_sample[name], grads[name], damping), grads[name]) for name in layers}
        for damping in args.damping
    }
    return Problem(model, lambda m: F.cross_entropy(m(x), y), layers, references, args.batch_size), weights


def lm_batches(batch: int, seed: int) -> tuple[Iterator[tuple[Tensor, Tensor]], tuple[Tensor, Tensor]]:
    """Endless shuffled training batches of the standard library's bytes in windows of :data:`LM_SEQ_LEN`, and one
    held-out batch."""
    from hylo_scripts.data.registry import DataOptions, load_dataset

    data = load_dataset("stdlib", DataOptions(seq_len=LM_SEQ_LEN, max_bytes=1_000_000))
    generator = torch.Generator().manual_seed(seed)

    def stack(dataset: Any, index: Sequence[int]) -> tuple[Tensor, Tensor]:
        pairs = [dataset[int(i)] for i in index]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def batches() -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            order = torch.randperm(len(data.train), generator=generator)
            for start in range(0, len(order) - batch + 1, batch):
                yield stack(data.train, order[start : start + batch].tolist())

    return batches(), stack(data.test, range(batch))


def lm_problem(args: argparse.Namespace, device: torch.device) -> tuple[Problem, str]:
    """The LM bench decoder's batch (uniform tokens, or held-out text after AdamW) and its exact steps on token rows."""
    torch.manual_seed(args.seed)
    model = build_model("transformer", (LM_SEQ_LEN,), **LM_SIZE).to(device)
    weights = "init"
    if args.train_steps:
        batches, (x, y) = lm_batches(args.batch_size, args.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
        for _ in range(args.train_steps):
            bx, by = (t.to(device) for t in next(batches))
            optimizer.zero_grad()
            loss = F.cross_entropy(model(bx).flatten(0, 1), by.flatten())
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"trained {args.train_steps} AdamW steps: training loss {float(loss):.3f}", flush=True)
        weights = f"adamw{args.train_steps}"
    else:
        x, y = MODELS["transformer"].random_batch(args.batch_size, LM_SEQ_LEN)
    model = model.to(torch.float64)
    x, y = x.to(device), y.to(device)

    def lm_loss(m: nn.Module) -> Tensor:
        return F.cross_entropy(m(x).flatten(0, 1), y.flatten())

    layers = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    rows = token_rows(model, lambda: lm_loss(model), layers)
    references = {
        damping: {name: factored_reference(*rows[name], damping) for name in layers} for damping in args.damping
    }
    return Problem(model, lm_loss, layers, references, args.batch_size * LM_SEQ_LEN), weights


def preconditioned(
    problem: Problem, damping: float, seed: int, options: Mapping[str, Any]
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Each compared layer's preconditioned gradient after one update of hylo with ``options`` on a copy of the
    model, and the rows each kept."""
    model = copy.deepcopy(problem.model)
    pre = hylo.HyLoPreconditioner(model, update_freq=1, damping=damping, seed=seed, **options)
    problem.loss(model).backward()
    pre.step()
    pre.remove()
    kept = {info.name: info.rows_kept[0] for info in pre.layer_info() if info.rows_kept is not None}
    missing = sorted(set(problem.layers) - set(kept))
    if missing:
        raise RuntimeError(f"hylo solved no rows for {missing}")
    return {name: grad_matrix(model.get_submodule(name)) for name in problem.layers}, kept


#: The key of the whole step's relative error among the layers' (all compared layers' V̂ concatenated).
STEP = "<step>"


def errors(
    problem: Problem, damping: float, draws: int, options: Mapping[str, Any]
) -> tuple[dict[str, float], dict[str, int]]:
    """Each compared layer's relative error to the exact step and the whole step's (:data:`STEP`), means over
    ``draws`` seeds, and the rows each layer kept (the first draw's)."""
    totals: dict[str, float] = dict.fromkeys([*problem.layers, STEP], 0.0)
    kept: dict[str, int] = {}
    exact = problem.references[damping]
    for seed in range(draws):
        results, rows = preconditioned(problem, damping, seed, options)
        kept = kept or rows
        for name in problem.layers:
            totals[name] += relative_error(results[name], exact[name][0]) / draws
        whole = torch.cat([results[name].flatten() for name in problem.layers])
        totals[STEP] += relative_error(whole, torch.cat([exact[name][0].flatten() for name in problem.layers])) / draws
    return totals, kept


def fixed_at(
    problem: Problem, damping: float, draws: int, options: Mapping[str, Any], total: int
) -> tuple[dict[str, float], float]:
    """The fixed-rank choice's per-layer errors at ``total`` rows over the L compared layers, interpolated linearly
    in the rows between ``rank`` ⌊total/L⌋ and ⌈total/L⌉ (at least 1), and the rows per layer that means."""
    per_layer = total / len(problem.layers)
    low, high = max(1, math.floor(per_layer)), max(1, math.ceil(per_layer))
    below, _ = errors(problem, damping, draws, {**options, "rank": low})
    if high == low:
        return below, float(low)
    above, _ = errors(problem, damping, draws, {**options, "rank": high})
    weight = (per_layer - low) / (high - low)
    return {name: (1 - weight) * below[name] + weight * above[name] for name in below}, per_layer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=[*(n for n in MODELS if n != "unet"), "transformer"])
    parser.add_argument("--batch-size", type=int, default=64, help="samples (transformer: windows of 64 tokens)")
    parser.add_argument("--seed", type=int, default=0, help="weights, batch and training")
    parser.add_argument("--damping", type=float, nargs="+", default=[0.1, 1.0], help="hylo's absolute λ")
    parser.add_argument("--energies", type=float, nargs="+", default=[0.9, 0.99], help="rank_energy targets")
    parser.add_argument(
        "--cap", type=float, default=hylo.HyLoConfig().lowrank.rank_cap, help="rank_cap of the adaptive runs (hylo's)"
    )
    parser.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=SOLVERS)
    parser.add_argument("--draws", type=int, default=3, help="KIS runs (seeds 0, 1, …) averaged")
    parser.add_argument("--conv-rows", default="exact", choices=("exact", "sum", "mean"), help="hylo's conv_rows")
    parser.add_argument("--data", default="random", choices=("random", "mnist"), help="image models' batch")
    parser.add_argument("--train-steps", type=int, default=0, help="training steps before measuring")
    parser.add_argument("--train-lr", type=float, default=0.05, help="SGD's lr of --train-steps (image models)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    flags.add_device(parser)
    parser.add_argument("--csv", default=None, help="write one row per damping, solver, target and layer")
    args = parser.parse_args(argv)
    if args.train_steps < 0 or (args.train_steps and args.model != "transformer" and args.data != "mnist"):
        parser.error("--train-steps must be >= 0, and training an image model needs --data mnist")
    if not all(0.0 < e <= 1.0 for e in args.energies):
        parser.error("--energies must be in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure every (damping, solver, energy), print the table and optionally write the CSV; returns 0."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    device: torch.device = args.device
    start = timing.now(device)
    device_name = describe(device)
    print(f"device: {device_name}", flush=True)
    lm = args.model == "transformer"
    problem, weights = lm_problem(args, device) if lm else image_problem(args, device)
    layers = problem.layers
    print(f"{args.model} ({weights}), {len(layers)} compared layers of {problem.rows} rows, float64", flush=True)
    extra = {} if lm else {"conv_rows": args.conv_rows}
    header = f"{'damping':>8} {'solver':<6} {'energy':>6} {'rows auto':>10} {'fixed r':>10}"
    header += f" {'step err auto':>13} {'fixed':>8} {'mean err auto':>13} {'fixed':>8} {'median auto':>11} {'fixed':>8}"
    header += f" {'auto closer':>11}"
    lines = [header, "-" * len(header)]
    out: list[dict[str, Any]] = []
    for damping in args.damping:
        for solver in args.solvers:
            draws = args.draws if solver == "kis" else 1
            for energy in args.energies:
                auto = {"solver": solver, "rank_ratio": "auto", "rank_energy": energy, "rank_cap": args.cap} | extra
                auto_err, auto_kept = errors(problem, damping, draws, auto)
                total = sum(auto_kept[name] for name in layers)
                fixed_err, per_layer = fixed_at(problem, damping, draws, {"solver": solver} | extra, total)
                closer = sum(auto_err[name] < fixed_err[name] for name in layers)
                auto_layers, fixed_layers = [auto_err[name] for name in layers], [fixed_err[name] for name in layers]
                lines.append(
                    f"{damping:>8g} {solver:<6} {energy:>6g} {total:>10} {per_layer:>10.2f}"
                    f" {auto_err[STEP]:>13.3e} {fixed_err[STEP]:>8.3e}"
                    f" {statistics.fmean(auto_layers):>13.3e} {statistics.fmean(fixed_layers):>8.3e}"
                    f" {statistics.median(auto_layers):>11.3e} {statistics.median(fixed_layers):>8.3e}"
                    f" {f'{closer}/{len(layers)}':>11}"
                )
                print(lines[-1], flush=True)
                out += [
                    {
                        "model": args.model,
                        "weights": weights,
                        "batch": args.batch_size,
                        "rows": problem.rows,
                        "damping": damping,
                        "solver": solver,
                        "energy": energy,
                        "cap": args.cap,
                        "layer": name,
                        "rows_kept_auto": auto_kept.get(name, total),
                        "rows_fixed": per_layer,
                        "rel_error_auto": auto_err[name],
                        "rel_error_fixed": fixed_err[name],
                        "device": device_name,
                    }
                    for name in [*layers, STEP]
                ]
    print()
    print("\n".join(lines))
    print(f"\ntotal {timing.now(device) - start:.1f} s")
    if args.csv:
        write_rows(args.csv, out)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
