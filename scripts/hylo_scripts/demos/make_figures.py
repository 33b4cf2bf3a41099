"""Run a short study on the offline MNIST subset and draw every figure of ``hylo_analysis`` from it.

    python scripts/make_figures.py --out figures            # runs into figures/runs/, figures into figures/
    python scripts/make_figures.py --out figures --runs-only
    python scripts/make_figures.py --out figures --figures-only --format svg

The runs (``train.py`` on ``mnist5k`` with the small CNN, ``--epochs`` epochs of at most
``--max-steps`` steps at ``--batch-size``; each in ``OUT/runs/NAME``):

- ``sgd-s{seed}``: plain SGD (lr 0.025, the demo's best) for each ``--seeds``;
- ``hybrid-s{seed}``: SGD + hylo ``hybrid`` (gradient-norm trend over ``--trend-window`` steps),
  profiled, for each seed;
- ``kfac-s{first seed}``: SGD + hylo ``kfac``, profiled;
- ``auto-s{first seed}``: as ``hybrid-s{first seed}`` with ``--rank-ratio auto`` (each layer's KID and
  KIS solves keep the rows its kernel spectrum asks for, at most the cap), profiled;
- ``studies-s{first seed}``: as ``hybrid-s{first seed}`` with every study on (gradient norm, rank
  analysis, gradient error of KID, KIS and K-FAC at ρ ∈ ``--ratios``, every ``--study-every``-th
  update), in a run of its own so that the studies' solves stay out of the others' wall time;
- ``hybrid-p2``: SGD + hylo ``hybrid`` on 2 processes (torchrun, gloo) at twice the batch (the
  same per-rank batch), profiled, with the rank study (skipped with ``--ranks 1``).

The figures (``OUT/NAME.{pdf,png}``): accuracy (the SGD, hybrid and kfac runs), timing
(hybrid and kfac on 1 rank, hybrid on 2), layer-dims and solvers (hybrid on 1 and 2 ranks),
rank (the studies run and hybrid on 2 ranks), rank-choice (the auto run), grad-norm and
grad-error (the studies run). The notebooks in ``analysis/notebooks/`` read the same runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hylo_analysis import FIGURES, read_runs, save_figure
from hylo_scripts.training import train as train_script
from hylo_scripts.training.process import child_environment


@dataclass(frozen=True)
class StudySize:
    """How long the study's runs are."""

    epochs: int = 3
    max_steps: int = 8
    batch_size: int = 500
    update_freq: int = 2
    seeds: tuple[int, ...] = (0, 1)
    study_every: int = 2
    ratios: tuple[float, ...] = (0.1, 0.25)
    ranks: int = 2
    trend_window: int = 4


def _common(size: StudySize, log_dir: Path, seed: int) -> list[str]:
    return [
        "--epochs", str(size.epochs),
        "--max-steps", str(size.max_steps),
        "--seed", str(seed),
        "--log-dir", str(log_dir),
        "--checkpoint-freq", "0",
    ]  # fmt: skip


def _hylo(size: StudySize) -> list[str]:
    return ["--freq", str(size.update_freq), "--profiling"]


def run_study(runs_dir: Path, size: StudySize = StudySize(), quiet: bool = False) -> list[Path]:
    """Train the study's runs into ``runs_dir`` (which must not hold them yet); returns their directories."""
    first = size.seeds[0]
    batch = ["--batch-size", str(size.batch_size)]
    studies = [
        "--grad-norm", "--rank-analysis", "--grad-error", "--enable-id", "--enable-is", "--enable-kfac",
        "--study-every", str(size.study_every), "--grad-error-ratios", *map(str, size.ratios),
    ]  # fmt: skip
    # A trend window short enough for a run of a few dozen steps (the default, 100 steps, would
    # keep every layer critical throughout).
    windows = ["--trend-window", str(size.trend_window)]
    plan: list[tuple[str, list[str]]] = []
    for seed in size.seeds:
        plan.append((f"sgd-s{seed}", ["--solver", "none", "--lr", "0.025", *batch]))
    for seed in size.seeds:
        plan.append((f"hybrid-s{seed}", ["--solver", "hybrid", *batch, *_hylo(size), *windows]))
    plan.append((f"kfac-s{first}", ["--solver", "kfac", *batch, *_hylo(size)]))
    plan.append((f"auto-s{first}", ["--solver", "hybrid", "--rank-ratio", "auto", *batch, *_hylo(size), *windows]))
    # The studies in a run of their own: their extra solves would count in the others' wall time.
    plan.append((f"studies-s{first}", ["--solver", "hybrid", *batch, *_hylo(size), *windows, *studies]))
    done = []
    for name, argv in plan:
        seed = int(name.rsplit("-s", 1)[1])
        log_dir = runs_dir / name
        _say(quiet, f"== {name}")
        status = _quietly(quiet, functools.partial(train_script.main, [*argv, *_common(size, log_dir, seed)]))
        if status != 0:
            raise RuntimeError(f"{name}: train.py exited with status {status}")
        done.append(log_dir)
    if size.ranks > 1:
        name = f"hybrid-p{size.ranks}"
        _say(quiet, f"== {name}")
        argv = [
            "--solver", "hybrid", "--batch-size", str(size.batch_size * size.ranks), *_hylo(size), *windows,
            "--rank-analysis", "--study-every", str(size.study_every),
            *_common(size, runs_dir / name, first),
        ]  # fmt: skip
        _torchrun(size.ranks, argv, quiet)
        done.append(runs_dir / name)
    return done


def figure_inputs(runs_dir: Path) -> dict[str, list[Path]]:
    """The study's run directories each figure draws (by the figure's CLI name)."""
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"{runs_dir}: no study runs; run scripts/make_figures.py --out {runs_dir.parent} first")
    runs = {path.name: path for path in sorted(runs_dir.iterdir()) if path.is_dir()}

    def pick(*prefixes: str) -> list[Path]:
        return [path for name, path in runs.items() if name.startswith(prefixes)]

    hybrid_one = pick("hybrid-s")[:1]
    studies = pick("studies-s")[:1]
    return {
        "accuracy": pick("sgd-s", "hybrid-s", "kfac-s"),
        "timing": pick("hybrid-", "kfac-s"),
        "layer-dims": hybrid_one + pick("hybrid-p"),
        "rank": studies + pick("hybrid-p"),
        "rank-choice": pick("auto-s")[:1],
        "grad-norm": studies,
        "grad-error": studies,
        "solvers": hybrid_one + pick("hybrid-p"),
    }


def draw_figures(runs_dir: Path, out: Path, formats: Sequence[str] = ("pdf", "png"), dpi: int = 200) -> list[Path]:
    """Draw every figure from the study in ``runs_dir`` into ``out``; returns the files written."""
    inputs = figure_inputs(runs_dir)
    written = []
    for name, spec in FIGURES.items():
        figure = spec.draw(read_runs(inputs[name]))
        for suffix in formats:
            written.append(save_figure(figure, out / f"{name}.{suffix}", dpi=dpi))
    return written


def _torchrun(ranks: int, argv: list[str], quiet: bool) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    done = subprocess.run(
        [*command, "-m", "hylo_scripts.training.train", *argv],
        env=child_environment(OMP_NUM_THREADS="1"),
        capture_output=quiet,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"torchrun with {ranks} ranks exited with status {done.returncode}: {done.stderr or ''}")


def _quietly(quiet: bool, run: Callable[[], int]) -> int:
    if not quiet:
        return int(run())
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return int(run())


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the study (unless ``--figures-only``) and draw its figures (unless ``--runs-only``)."""
    defaults = StudySize()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output directory (runs go to OUT/runs)")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps, help="steps per epoch at most")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per-rank batch")
    parser.add_argument("--freq", type=int, default=defaults.update_freq, help="hylo's update_freq")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(defaults.seeds))
    parser.add_argument("--study-every", type=int, default=defaults.study_every)
    parser.add_argument("--ratios", type=float, nargs="+", default=list(defaults.ratios), help="gradient-error ρ")
    parser.add_argument("--ranks", type=int, default=defaults.ranks, help="processes of the distributed run (1: none)")
    parser.add_argument("--trend-window", type=int, default=defaults.trend_window, help="hybrid's trend window")
    parser.add_argument("--format", nargs="+", default=["pdf", "png"], choices=["pdf", "png", "svg"])
    parser.add_argument("--dpi", type=int, default=200, help="PNG resolution")
    parser.add_argument("--quiet", action="store_true", help="do not print the runs' output")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--runs-only", action="store_true", help="train the runs, draw nothing")
    only.add_argument("--figures-only", action="store_true", help="draw from the runs already in OUT/runs")
    args = parser.parse_args(argv)
    runs_dir = args.out / "runs"
    if not args.figures_only:
        if runs_dir.exists() and any(runs_dir.iterdir()):
            parser.error(f"{runs_dir} already holds runs; use --figures-only to draw them, or another --out")
        size = StudySize(
            epochs=args.epochs,
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            update_freq=args.freq,
            seeds=tuple(args.seeds),
            study_every=args.study_every,
            ratios=tuple(args.ratios),
            ranks=args.ranks,
            trend_window=args.trend_window,
        )
        run_study(runs_dir, size, quiet=args.quiet)
    if not args.runs_only:
        if not runs_dir.is_dir():
            parser.error(f"{runs_dir}: no runs to draw; run without --figures-only first")
        for path in draw_figures(runs_dir, args.out, args.format, args.dpi):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
