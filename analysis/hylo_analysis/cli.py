"""``python -m hylo_analysis FIGURE RUN_DIR… -o OUT.{pdf,png,svg}``: draw a figure from run directories.

``python -m hylo_analysis all RUN_DIR… -o DIR`` draws every figure the run directories hold the files
for. Exit status: 0 drawn, 1 a run directory lacks a file, column or rows a figure needs (the
message names it), 2 flag misuse.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from hylo_analysis.figures import FIGURES, FigureSpec
from hylo_analysis.runs import Run, RunDataError, read_runs, table_files
from hylo_analysis.style import FORMATS, save_figure


def _figure_list() -> str:
    lines = ["figures (run directories → files read):"]
    for spec in FIGURES.values():
        lines.append(f"  {spec.name:<11} {spec.description}")
        lines.append(f"  {'':<11} runs: {spec.runs}; reads {', '.join(spec.files)}")
    lines.append(f"  {'all':<11} every figure the run directories have the files for, into -o DIR")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser: one sub-command per figure, plus ``all``."""
    parser = argparse.ArgumentParser(
        prog="python -m hylo_analysis",
        description="Draw the HyLo paper's figures from run directories (a training script's --log-dir, "
        "or hylo's profile_dir).",
        epilog=_figure_list(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    figures = parser.add_subparsers(dest="figure", required=True, metavar="FIGURE")
    for spec in FIGURES.values():
        sub = figures.add_parser(
            spec.name,
            help=spec.description,
            description=f"{spec.description}. Runs: {spec.runs}; reads {', '.join(spec.files)} in each.",
        )
        sub.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
        sub.add_argument("-o", "--output", type=Path, required=True, help=f"output file ({', '.join(FORMATS)})")
        _add_options(spec, sub)
    every = figures.add_parser("all", help="every figure the run directories hold the files for")
    every.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    every.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    every.add_argument(
        "--format", nargs="+", default=["pdf", "png"], choices=[f[1:] for f in FORMATS], help="formats to write"
    )
    return parser


#: Parsed arguments that are not options of the figure function.
_NOT_FIGURE_OPTIONS = frozenset({"figure", "runs", "output", "labels"})


def _add_options(spec: FigureSpec, sub: argparse.ArgumentParser) -> None:
    """The figure's options; each ``dest`` is the keyword of the figure function it sets."""
    if spec.name == "accuracy":
        sub.add_argument("--metric", help="metrics.csv column to plot (default test_acc, else test_dsc)")
        sub.add_argument(
            "--labels", nargs="+", help="one legend label per run directory (runs sharing a label are seeds)"
        )
    elif spec.name == "timing":
        sub.add_argument(
            "--keep-first",
            dest="skip_first",
            action="store_false",
            help="include each run's first update step (warm-up)",
        )
    elif spec.name == "layer-dims":
        sub.add_argument("--step", type=int, help="update step to show (default: the last)")
    elif spec.name == "rank":
        sub.add_argument("--level", choices=["90", "99", "99.9"], default="99", help="%% of the spectrum (default 99)")
        sub.add_argument("--relative", action="store_true", help="divide the rank by the batch's rows")
    elif spec.name in ("grad-norm", "grad-error"):
        sub.add_argument("--layers", nargs="+", help="layers to draw (default: all)")
        sub.add_argument("--columns", type=int, default=3, help="panels per row (default 3)")
        if spec.name == "grad-error":
            sub.add_argument("--per-layer", action="store_true", help="one panel per layer instead of the mean")


def _draw(spec: FigureSpec, runs: list[Run], args: argparse.Namespace) -> Figure:
    options = {name: value for name, value in vars(args).items() if name not in _NOT_FIGURE_OPTIONS}
    return spec.draw(runs, **options)


def has_files(run: Run, spec: FigureSpec) -> bool:
    """Whether ``run``'s directory holds every table ``spec`` reads."""
    return all(table_files(run, table) for table in spec.tables)


def draw_all(runs: Sequence[Run], directory: Path, formats: Sequence[str] = ("pdf", "png")) -> dict[str, str]:
    """Draw every figure from the runs that hold its files; returns, per figure, what was written or why not.

    Figures that take one run use the first run with the files. A figure that draws only some rows of
    its files (``rank-choice``: those of KID and KIS) uses the runs that hold such rows.
    """
    report: dict[str, str] = {}
    for spec in FIGURES.values():
        usable = [run for run in runs if has_files(run, spec)]
        if not usable:
            report[spec.name] = f"skipped: no run directory has {', '.join(spec.files)}"
            continue
        if spec.holds is not None:
            usable = [run for run in usable if spec.holds(run)]
            if not usable:
                report[spec.name] = f"skipped: no run directory holds {spec.holds_what}"
                continue
        if spec.runs == "one":
            usable = usable[:1]
        figure = spec.draw(usable)
        paths = [save_figure(figure, directory / f"{spec.name}.{suffix}") for suffix in formats]
        report[spec.name] = ", ".join(str(path) for path in paths)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, draw and save; exit status 0, 1 (data problem, message on stderr) or 2 (flag misuse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.runs, getattr(args, "labels", None))
        if args.figure == "all":
            for name, outcome in draw_all(runs, args.output, args.format).items():
                print(f"{name:<11} {outcome}")
            return 0
        if args.output.suffix.lower() not in FORMATS:
            parser.error(f"-o {args.output}: the output must end in one of {', '.join(FORMATS)}")
        spec = FIGURES[args.figure]
        if spec.runs == "one" and len(runs) != 1:
            parser.error(f"the {spec.name!r} figure draws one run directory; got {len(runs)}")
        save_figure(_draw(spec, runs, args), args.output)
        print(args.output)
    except (RunDataError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    return 0
