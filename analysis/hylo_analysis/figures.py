"""The paper's figures, each a function from DataFrames (or run directories) to a matplotlib Figure.

Every function takes either the table it draws (from :func:`hylo_analysis.runs.load_table`, or any
DataFrame with the same columns) or run directories, and returns a ``Figure`` that is not
registered with pyplot (no global state; display it in a notebook or save it with
:func:`hylo_analysis.style.save_figure`). Every artist that carries data has a ``gid``
(``"figure/…"``), so the plotted values can be found again (SVG output keeps them as ids).
See docs/figures.md, "The figures".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure, SubFigure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from hylo_analysis.runs import (
    TABLES,
    Run,
    RunDataError,
    check_columns,
    layer_order,
    load_table,
    read_run,
    require_rows,
)
from hylo_analysis.style import (
    COMMUNICATION_HATCH,
    COMMUNICATION_PHASES,
    COMPUTE_PHASES,
    CRITICAL_COLOUR,
    NEUTRAL_COLOUR,
    PHASE_COLOURS,
    SOLVERS,
    figure_style,
    run_colour,
    run_linestyle,
    solver_colour,
)

#: What a figure function accepts: a loaded table, or run directories.
Data: TypeAlias = "pd.DataFrame | str | Path | Run | Iterable[str | Path | Run]"

#: The update phases in the order they are stacked (compute, then communication).
PHASES = (*COMPUTE_PHASES, *COMMUNICATION_PHASES)
_RATIO_STYLES = ("-", "--", ":", "-.")


def _frame(data: Data, table: str, columns: Sequence[str], figure: str) -> pd.DataFrame:
    purpose = f"the {figure!r} figure"
    if isinstance(data, pd.DataFrame):
        check_columns(data, columns, purpose)
        frame = data
    else:
        frame = load_table(data, table, columns, purpose)
    require_rows(frame, f"the {table} table", purpose)
    return frame


def _one_run(frame: pd.DataFrame, figure: str) -> pd.DataFrame:
    runs = frame["run"].unique()
    if len(runs) != 1:
        raise RunDataError(f"the {figure!r} figure draws one run; got {len(runs)}: {', '.join(map(str, runs))}")
    return frame


def _time_unit(seconds: float) -> tuple[float, str]:
    """A scale and unit for wall-clock axes: seconds, minutes or hours."""
    if seconds < 600:
        return 1.0, "s"
    if seconds < 3 * 3600:
        return 1 / 60, "min"
    return 1 / 3600, "h"


def _solver_key(solver: str) -> tuple[int, str]:
    return (SOLVERS.index(solver) if solver in SOLVERS else len(SOLVERS), solver)


def _grid(figure: Figure, panels: int, columns: int) -> list[Axes]:
    columns = max(1, min(columns, panels))
    rows = math.ceil(panels / columns)
    axes = figure.subplots(rows, columns, squeeze=False, sharex=True)
    flat: list[Axes] = list(axes.ravel())
    for ax in flat[panels:]:
        ax.set_visible(False)
    return flat[:panels]


def accuracy(data: Data, metric: str | None = None) -> Figure:
    """Test metric vs epoch and vs wall time: one line per label (mean over seeds), the range shaded.

    Runs sharing a ``label`` are seeds of one configuration. ``metric`` defaults to
    ``test_acc`` (drawn in %) or ``test_dsc``. Needs ``metrics.csv``.
    """
    frame = _frame(data, "metrics", ("run", "label", "solver", "optimizer", "epoch", "total_time_s"), "accuracy")
    if metric is None:
        metric = next((m for m in ("test_acc", "test_dsc") if m in frame.columns), None)
        if metric is None:
            raise RunDataError("metrics.csv has neither 'test_acc' nor 'test_dsc' (the 'accuracy' figure needs one)")
    check_columns(frame, (metric,), "the 'accuracy' figure")
    scale, y_label = (100.0, "test accuracy (%)") if metric == "test_acc" else (1.0, metric.replace("_", " "))
    time_scale, time_unit = _time_unit(float(frame["total_time_s"].max()))
    with figure_style():
        figure = Figure(figsize=(7.0, 2.8), layout="constrained")
        by_epoch, by_time = figure.subplots(1, 2, sharey=True)
        for label in dict.fromkeys(frame["label"]):
            runs = frame[frame["label"] == label]
            first = runs.iloc[0]
            stats = runs.groupby("epoch").agg(
                mean=(metric, "mean"), low=(metric, "min"), high=(metric, "max"), time=("total_time_s", "mean")
            )
            seeds = runs["run"].nunique()
            style = {
                "color": run_colour(str(first["solver"]), str(first["optimizer"])),
                "linestyle": run_linestyle(str(first["solver"]), str(first["optimizer"])),
                "marker": "o",
                "markersize": 3,
            }
            name = f"{label} ({seeds} seed{'s' if seeds > 1 else ''})"
            epochs = stats.index.to_numpy(dtype=float)
            times = stats["time"].to_numpy() * time_scale
            by_epoch.plot(epochs, stats["mean"] * scale, label=name, gid=f"accuracy/epoch/{label}", **style)
            by_time.plot(times, stats["mean"] * scale, gid=f"accuracy/time/{label}", **style)
            if seeds > 1:
                for ax, x, axis in ((by_epoch, epochs, "epoch"), (by_time, times, "time")):
                    ax.fill_between(
                        x,
                        stats["low"] * scale,
                        stats["high"] * scale,
                        color=style["color"],
                        alpha=0.2,
                        linewidth=0,
                        gid=f"accuracy/{axis}-range/{label}",
                    )
        by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
        by_epoch.set_xlabel("epoch")
        by_epoch.set_ylabel(y_label)
        by_time.set_xlabel(f"wall time ({time_unit})")
        by_epoch.legend(loc="lower right")
        figure.suptitle("Test metric: mean over seeds, min–max shaded")
    return figure


def timing(data: Data, skip_first: bool = True) -> Figure:
    """Time per update step by phase, per solver and world size (stacked bars), and compute vs communication.

    The mean over update steps (``kind == "update"``) of each rank's ``steps-r{rank}.csv``, then
    over ranks, then over runs with the same solver and world size. ``skip_first`` leaves out
    each run's first update (one-off allocation and warm-up) when it has more than one.
    """
    phase_columns = [f"{p}_ms" for p in PHASES]
    frame = _frame(data, "steps", ("run", "solver", "world_size", "rank", "step", "kind", *phase_columns), "timing")
    updates = frame[frame["kind"] == "update"]
    require_rows(updates, "the steps table's update steps", "the 'timing' figure")
    if skip_first:
        first = updates.groupby("run")["step"].transform("min")
        several = updates.groupby("run")["step"].transform("nunique") > 1
        updates = updates[~((updates["step"] == first) & several)]
    per_rank = updates.groupby(["run", "solver", "world_size", "rank"])[phase_columns].mean()
    per_run = per_rank.groupby(level=["run", "solver", "world_size"]).mean()
    per_config = per_run.groupby(level=["solver", "world_size"]).mean()
    configs = sorted(per_config.index, key=lambda key: (_solver_key(str(key[0])), int(key[1])))
    names = [f"{solver}\nP={world}" for solver, world in configs]
    x = np.arange(len(configs), dtype=float)
    with figure_style():
        figure = Figure(figsize=(max(4.5, 1.1 * len(configs) + 3.5), 3.0), layout="constrained")
        phases_ax, split_ax = figure.subplots(1, 2, width_ratios=(3, 2))
        bottom = np.zeros(len(configs))
        for phase in PHASES:
            heights = np.array([per_config.loc[key, f"{phase}_ms"] for key in configs], dtype=float)
            communication = phase in COMMUNICATION_PHASES
            bars = phases_ax.bar(
                x,
                heights,
                0.6,
                bottom=bottom,
                color=PHASE_COLOURS[phase],
                hatch=COMMUNICATION_HATCH if communication else None,
                edgecolor="white" if not communication else "#555555",
                linewidth=0.5,
                label=phase,
            )
            for bar, (solver, world) in zip(bars, configs, strict=True):
                bar.set_gid(f"timing/{phase}/{solver}/P{world}")
            bottom += heights
        phases_ax.set_xticks(x, names)
        phases_ax.set_ylabel("time per update step (ms)")
        phases_ax.legend(title="phase (hatched: communication)", fontsize=7, title_fontsize=7)
        compute = np.array([sum(per_config.loc[key, f"{p}_ms"] for p in COMPUTE_PHASES) for key in configs])
        communicate = np.array([sum(per_config.loc[key, f"{p}_ms"] for p in COMMUNICATION_PHASES) for key in configs])
        for offset, values, name, hatch in (
            (-0.2, compute, "compute", None),
            (0.2, communicate, "communication", "//"),
        ):
            bars = split_ax.bar(
                x + offset,
                values,
                0.4,
                color=[solver_colour(str(solver)) for solver, _ in configs],
                hatch=hatch,
                edgecolor="#333333",
                linewidth=0.5,
            )
            for bar, (solver, world) in zip(bars, configs, strict=True):
                bar.set_gid(f"timing/{name}/{solver}/P{world}")
        split_ax.set_xticks(x, names)
        split_ax.set_ylabel("time per update step (ms)")
        split_ax.legend(
            handles=[
                Patch(facecolor="white", edgecolor="#333333", label="compute"),
                Patch(facecolor="white", edgecolor="#333333", hatch="//", label="communication"),
            ],
            fontsize=7,
        )
        figure.suptitle("Update step by phase (mean over update steps and ranks)")
    return figure


def layer_dims(data: Data, step: int | None = None) -> Figure:
    """Per layer: d_a and d_g (bars), the rows kept for the solve coloured by the solver chosen (Fig. 2).

    One panel per run, from rank 0's ``timing-r0.csv`` at ``step`` (default: the last update).
    """
    frame = _frame(data, "timing", ("run", "step", "layer", "solver", "rows", "rows_kept", "d_a", "d_g"), "layer-dims")
    if "rank" in frame.columns:
        frame = frame[frame["rank"] == 0]
    runs = list(dict.fromkeys(frame["run"]))
    with figure_style():
        width = max(4.5, 0.45 * frame["layer"].nunique() + 2.0)
        figure = Figure(figsize=(width, 2.6 * len(runs)), layout="constrained")
        axes = figure.subplots(len(runs), 1, squeeze=False)[:, 0]
        for ax, run in zip(axes, runs, strict=True):
            rows = frame[frame["run"] == run]
            at = int(rows["step"].max()) if step is None else step
            rows = rows[rows["step"] == at]
            require_rows(rows, f"{run}: timing at step {at}", "the 'layer-dims' figure")
            layers = layer_order(rows)
            rows = rows.set_index("layer").loc[layers]
            x = np.arange(len(layers), dtype=float)
            ax.bar(
                x - 0.2, rows["d_a"], 0.4, color="#BBBBBB", label="$d_a$ (inputs, + bias)", gid=f"layer-dims/{run}/d_a"
            )
            ax.bar(x + 0.2, rows["d_g"], 0.4, color="#666666", label="$d_g$ (outputs)", gid=f"layer-dims/{run}/d_g")
            ax.plot(x, rows["rows"], color=NEUTRAL_COLOUR, linestyle=":", label="rows n", gid=f"layer-dims/{run}/rows")
            for solver in sorted(dict.fromkeys(rows["solver"]), key=_solver_key):
                chosen = rows["solver"] == solver
                ax.scatter(
                    x[chosen.to_numpy()],
                    rows.loc[chosen, "rows_kept"],
                    color=solver_colour(str(solver)),
                    marker="D",
                    s=28,
                    zorder=3,
                    label=f"rows kept: {solver}",
                    gid=f"layer-dims/{run}/rows_kept/{solver}",
                )
            ax.set_yscale("log")
            ax.set_xticks(x, layers, rotation=45 if len(layers) > 8 else 0, ha="right" if len(layers) > 8 else "center")
            ax.set_xlabel("layer")
            ax.set_ylabel("dimension / rows")
            ax.set_title(f"{Path(str(run)).name}: step {at}")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


def rank(data: Data, level: str = "99", relative: bool = False) -> Figure:
    """Box plots of the numerical rank per layer, one box per batch size (gathered rows).

    ``level`` is 90, 99 or 99.9 (% of the spectrum's sum); ``relative`` divides by the rows.
    Needs ``rank-analysis.csv``.
    """
    column = {"90": "rank_90", "99": "rank_99", "99.9": "rank_999", "999": "rank_999"}.get(str(level))
    if column is None:
        raise ValueError(f"level must be 90, 99 or 99.9, not {level!r}")
    frame = _frame(data, "rank", ("run", "step", "layer", "batch_rows", column), "rank")
    layers = layer_order(frame)
    batches = sorted(int(b) for b in frame["batch_rows"].unique())
    colours = _sequential(len(batches))
    width = 0.8 / len(batches)
    with figure_style():
        figure = Figure(figsize=(max(4.5, 0.6 * len(layers) * len(batches) + 2.0), 3.0), layout="constrained")
        ax = figure.subplots()
        for b, batch in enumerate(batches):
            samples = []
            positions = []
            drawn_layers = []
            for index, layer in enumerate(layers):
                values = frame.loc[(frame["layer"] == layer) & (frame["batch_rows"] == batch), column].to_numpy(float)
                if relative:
                    values = values / batch
                if values.size:
                    samples.append(values)
                    positions.append(index - 0.4 + width * (b + 0.5))
                    drawn_layers.append(layer)
            if not samples:
                continue
            drawn = ax.boxplot(samples, positions=positions, widths=width * 0.85, patch_artist=True, manage_ticks=False)
            for box in drawn["boxes"]:
                box.set_facecolor(colours[b])
                box.set_edgecolor("#333333")
            for median, layer in zip(drawn["medians"], drawn_layers, strict=True):
                median.set_color("#000000")
                median.set_gid(f"rank/median/{layer}/{batch}")
        ax.set_xticks(np.arange(len(layers)), layers)
        ax.set_xlabel("layer")
        percent = {"rank_90": "90", "rank_99": "99", "rank_999": "99.9"}[column]
        ax.set_ylabel(f"rank at {percent}% of spectrum" + (" / rows" if relative else " (eigenvalues)"))
        ax.legend(
            handles=[
                Patch(facecolor=colours[b], edgecolor="#333333", label=f"{batch} rows")
                for b, batch in enumerate(batches)
            ],
            title="batch (gathered rows)",
            fontsize=7,
            title_fontsize=7,
        )
        figure.suptitle("Numerical rank of the empirical Fisher over sampled updates")
    return figure


#: The solvers that keep fewer rows than a rank has (K-FAC keeps no rows, SNGD all of them).
ROW_REDUCING = ("kid", "kis")


@dataclass(frozen=True)
class RankReference:
    """What a run's options say about the rows its KID and KIS solves keep (from its ``run.json``).

    ``share``: a fixed ``rank_ratio`` ρ, or under ``rank_ratio="auto"`` the cap ``rank_cap`` (a rank keeps
    max(1, ⌊share·n⌋) of its n rows, at most); ``rows``: the ``rank`` option when given (rows per rank,
    the cap under ``"auto"``), which overrides the share.
    """

    adaptive: bool
    share: float | None = None
    rows: int | None = None
    energy: float | None = None

    def rows_for(self, n: float) -> int:
        """The most rows a rank with ``n`` rows keeps under this reference."""
        if self.rows is not None:
            return int(min(self.rows, n))
        return max(1, math.floor((self.share or 0.0) * n))

    @property
    def name(self) -> str:
        """The reference's legend entry."""
        if self.rows is not None:
            return f"rank = {self.rows} rows" + (" (cap)" if self.adaptive else "")
        if self.adaptive:
            energy = "" if self.energy is None else f", e = {self.energy:g}"
            return f"cap = {self.share:g} (auto{energy})"
        return f"ρ = {self.share:g}"


def rank_reference(config: Mapping[str, Any]) -> RankReference | None:
    """The reference of hylo options ``config`` (a run's ``hylo_config``); None when they name no rank."""
    ratio = config.get("rank_ratio")
    adaptive = ratio == "auto"
    if config.get("rank") is not None:
        return RankReference(adaptive=adaptive, rows=int(config["rank"]))
    if adaptive:
        cap, energy = config.get("rank_cap"), config.get("rank_energy")
        if cap is None:
            return None
        return RankReference(adaptive=True, share=float(cap), energy=None if energy is None else float(energy))
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        return RankReference(adaptive=False, share=float(ratio))
    return None


def has_row_reduction(run: str | Path | Run) -> bool:
    """Whether ``run``'s ``timing-r*.csv`` has a row of a layer solved by KID or KIS (what ``rank_choice`` draws)."""
    frame = load_table(run, "timing", ("solver",), "the 'rank-choice' figure")
    return bool(frame["solver"].astype(str).isin(ROW_REDUCING).any())


def _run_reference(run: str) -> RankReference | None:
    """The reference of the run directory ``run`` (a table's ``run`` column); None without its ``run.json``."""
    path = Path(run)
    if not (path / "run.json").is_file():
        return None
    return rank_reference(read_run(path).hylo_config)


def rank_choice(data: Data) -> Figure:
    """Per layer: the share of its rows each rank kept for KID and KIS (rows_kept / rows), and the rows kept.

    Over every update step (and rank) at which the layer was solved by a row-reducing solver (KID or
    KIS): a box per layer and solver, in the solver's colour, with every observation as a point; runs
    sharing a label (seeds) are pooled, a row of two panels per label. Under ``rank_ratio="auto"``
    the shares are what each layer's spectrum asked for. The reference, read from each run's
    ``run.json`` (none for a DataFrame whose runs are not directories): a fixed ``rank_ratio`` ρ,
    or under ``"auto"`` the cap ``rank_cap``, as a line on the left panel, and on the right the rows
    it allows each layer (max(1, ⌊ρ·n⌋), or ``rank``), n being the layer's median rows (shown
    under the layer's name). Needs ``timing-r*.csv`` (docs/figures.md, "Rank choice").
    """
    columns = ("run", "label", "step", "layer", "solver", "rows", "rows_kept")
    frame = _frame(data, "timing", columns, "rank-choice")
    order = [c for c in ("run", "step", "rank") if c in frame.columns]
    frame = frame.sort_values(order, kind="stable")
    reduced = frame[frame["solver"].astype(str).isin(ROW_REDUCING) & (frame["rows"] > 0)]
    without = [run for run in dict.fromkeys(frame["run"]) if not (reduced["run"] == run).any()]
    if without:
        found = ", ".join(sorted(dict.fromkeys(frame.loc[frame["run"].isin(without), "solver"].astype(str))))
        raise RunDataError(
            f"no layer of {', '.join(map(str, without))} was solved by KID or KIS (its timing has "
            f"solver {found} only), and the 'rank-choice' figure draws the rows those keep; leave it out"
        )
    labels = list(dict.fromkeys(frame["label"]))
    with figure_style():
        slots = max(
            frame.loc[frame["label"] == label, "layer"].nunique()
            * reduced.loc[reduced["label"] == label, "solver"].nunique()
            for label in labels
        )
        figure = Figure(figsize=(max(6.5, 0.5 * slots + 4.0), 2.9 * len(labels) + 0.4), layout="constrained")
        for panel, label in zip(figure.subfigures(len(labels), 1, squeeze=False)[:, 0], labels, strict=True):
            _draw_rank_choice(panel, str(label), frame[frame["label"] == label], reduced[reduced["label"] == label])
        figure.suptitle("Rows kept by KID and KIS per layer, over update steps and ranks")
    return figure


def _draw_rank_choice(panel: SubFigure, label: str, everything: pd.DataFrame, rows: pd.DataFrame) -> None:
    """One label's two panels: the shares kept and the rows kept per layer and solver, and the references.

    ``everything`` is the label's timing rows, ``rows`` those of KID and KIS. A layer never solved by
    either is named with the solvers it had instead.
    """
    share_ax, rows_ax = panel.subplots(1, 2, sharex=True)
    layers = layer_order(everything)
    names = sorted(dict.fromkeys(rows["solver"].astype(str)), key=_solver_key)
    width = 0.8 / len(names)
    shares = (rows["rows_kept"] / rows["rows"]).to_numpy(float)
    for b, solver in enumerate(names):
        for index, layer in enumerate(layers):
            chosen = ((rows["layer"] == layer) & (rows["solver"] == solver)).to_numpy()
            if not chosen.any():
                continue
            position = index - 0.4 + width * (b + 0.5)
            kept = rows.loc[chosen, "rows_kept"].to_numpy(float)
            for ax, values, what in ((share_ax, shares[chosen], "share"), (rows_ax, kept, "rows-kept")):
                _box_with_points(ax, values, position, width, solver, f"rank-choice/{label}/{what}/{layer}/{solver}")
    drawn = [k for k, layer in enumerate(layers) if (rows["layer"] == layer).any()]
    n = {k: float(rows.loc[rows["layer"] == layers[k], "rows"].median()) for k in drawn}
    references = {ref for run in dict.fromkeys(rows["run"]) if (ref := _run_reference(str(run))) is not None}
    handles: list[Any] = [Patch(facecolor=solver_colour(name), edgecolor="#333333", label=name) for name in names]
    top = float(shares.max())
    for k, ref in enumerate(sorted(references, key=lambda r: r.name)):
        style: dict[str, Any] = {
            "color": NEUTRAL_COLOUR,
            "linestyle": _RATIO_STYLES[(k + 1) % len(_RATIO_STYLES)],
            "linewidth": 1,
        }
        kind = "rank" if ref.rows is not None else "cap" if ref.adaptive else "ratio"
        gid = f"rank-choice/{label}/{kind}/{ref.rows if ref.rows is not None else f'{ref.share:g}'}"
        if ref.share is not None and ref.rows is None:
            share_ax.axhline(ref.share, gid=gid, **style)
            top = max(top, ref.share)
        allowed = [ref.rows_for(n[x]) for x in drawn]
        rows_ax.hlines(allowed, [x - 0.45 for x in drawn], [x + 0.45 for x in drawn], gid=f"{gid}/rows", **style)
        handles.append(Line2D([], [], label=ref.name, **style))
    share_ax.set_ylim(0.0, min(1.0, top) * 1.12)
    rows_ax.set_ylim(bottom=0.0)
    rows_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ticks = []
    for k, layer in enumerate(layers):
        if k in n:
            ticks.append(f"{layer}\nn = {n[k]:g}")
        else:
            other = dict.fromkeys(everything.loc[everything["layer"] == layer, "solver"].astype(str))
            ticks.append(f"{layer}\n({'/'.join(sorted(other, key=_solver_key))})")
    for ax in (share_ax, rows_ax):
        ax.set_xticks(np.arange(len(layers)), ticks, rotation=45 if len(layers) > 8 else 0)
        ax.set_xlim(-0.6, len(layers) - 0.4)
        ax.set_xlabel("layer (n: median rows per rank)")
    share_ax.set_ylabel("rows kept / rows n")
    rows_ax.set_ylabel("rows kept")
    share_ax.set_title("share of its rows a rank kept")
    rows_ax.set_title("rows a rank kept")
    panel.suptitle(label, fontsize=9, fontweight="bold")
    rows_ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _box_with_points(ax: Axes, values: np.ndarray, position: float, width: float, solver: str, gid: str) -> None:
    """A box of ``values`` at ``position`` in ``solver``'s colour, every value a point over it (gid ``gid``)."""
    colour = solver_colour(solver)
    drawn = ax.boxplot(
        [values], positions=[position], widths=width * 0.8, patch_artist=True, manage_ticks=False, showfliers=False
    )
    for box in drawn["boxes"]:
        box.set_facecolor(colour)
        box.set_alpha(0.45)
        box.set_edgecolor("#333333")
        box.set_gid(f"{gid}/box")
    for median in drawn["medians"]:
        median.set_color("#000000")
        median.set_gid(f"{gid}/median")
    spread = width * 0.3 * (np.linspace(-1.0, 1.0, values.size) if values.size > 1 else np.zeros(1))
    ax.scatter(position + spread, values, s=7, color=colour, edgecolors="none", alpha=0.8, zorder=3, gid=gid)


def grad_norm(
    data: Data, decisions: pd.DataFrame | None = None, layers: Sequence[str] | None = None, columns: int = 3
) -> Figure:
    """Per-layer gradient norm (and the policy's running mean) over steps; critical windows shaded.

    A window is shaded from each update step whose decision says ``critical`` to the next update
    step. ``decisions`` is the decisions table (loaded from the run directory when ``data`` is one).
    One run. Needs ``grad-norm.csv`` and ``decisions.csv``.
    """
    frame = _one_run(_frame(data, "grad_norm", ("run", "step", "layer", "norm", "ema"), "grad-norm"), "grad-norm")
    if decisions is None:
        if isinstance(data, pd.DataFrame):
            raise ValueError("pass decisions= (the decisions table) with a grad-norm DataFrame")
        decisions = load_table(data, "decisions", ("step", "layer", "critical"), "the 'grad-norm' figure")
    check_columns(decisions, ("step", "layer", "critical"), "the 'grad-norm' figure")
    if "run" in decisions.columns:
        decisions = decisions[decisions["run"] == frame["run"].iloc[0]]
    shown = _pick_layers(frame, layers, "grad-norm")
    last = int(frame["step"].max())
    with figure_style():
        figure = Figure(figsize=(2.6 * min(columns, len(shown)) + 0.6, 2.1 * math.ceil(len(shown) / columns) + 0.4))
        figure.set_layout_engine("constrained")
        for ax, layer in zip(_grid(figure, len(shown), columns), shown, strict=True):
            rows = frame[frame["layer"] == layer].sort_values("step")
            ax.plot(
                rows["step"],
                rows["norm"],
                color=NEUTRAL_COLOUR,
                linewidth=1,
                label="‖∇W‖",
                gid=f"grad-norm/{layer}/norm",
            )
            ax.plot(
                rows["step"],
                rows["ema"],
                color=NEUTRAL_COLOUR,
                linestyle="--",
                linewidth=0.8,
                label="running mean",
                gid=f"grad-norm/{layer}/ema",
            )
            for k, (start, end) in enumerate(critical_windows(decisions, layer, last)):
                ax.axvspan(
                    start, end, color=CRITICAL_COLOUR, alpha=0.4, linewidth=0, gid=f"grad-norm/{layer}/critical/{k}"
                )
            ax.set_yscale("log")
            ax.set_title(f"layer {layer}")
            ax.set_xlabel("step")
            ax.set_ylabel("gradient norm (Frobenius)")
        figure.axes[0].legend(
            handles=[*figure.axes[0].get_lines(), Patch(color=CRITICAL_COLOUR, alpha=0.4, label="critical window")],
            fontsize=7,
        )
    return figure


def critical_windows(decisions: pd.DataFrame, layer: str, last_step: int) -> list[tuple[float, float]]:
    """Merged [start, end) step intervals in which ``layer``'s decisions were critical.

    Each critical update step covers the steps up to the next update step (the last one up to
    ``last_step + 1``); missing values (trend window not yet full) count as not critical.
    """
    rows = decisions[decisions["layer"] == layer].sort_values("step")
    steps = rows["step"].to_numpy(dtype=float)
    critical = rows["critical"].fillna(False).to_numpy(dtype=bool)
    ends = np.append(steps[1:], float(last_step + 1))
    windows: list[tuple[float, float]] = []
    for start, end, flag in zip(steps, ends, critical, strict=True):
        if not flag:
            continue
        if windows and windows[-1][1] == start:
            windows[-1] = (windows[-1][0], float(end))
        else:
            windows.append((float(start), float(end)))
    return windows


def grad_error(data: Data, per_layer: bool = False, layers: Sequence[str] | None = None, columns: int = 3) -> Figure:
    """Relative error of KID, KIS (and K-FAC, SNGD's surrogate) vs exact SNGD over training.

    Aggregated: the mean over layers at each sampled update; ``per_layer`` (implied by
    ``layers``): one panel per layer.
    One line per method (the solver's colour) and rank ratio (line style). One run.
    Needs ``grad-error.csv``.
    """
    frame = _frame(data, "grad_error", ("run", "step", "layer", "method", "rank_ratio", "rel_error"), "grad-error")
    frame = _one_run(frame, "grad-error")
    per_layer = per_layer or layers is not None
    ratios = sorted(float(r) for r in frame["rank_ratio"].dropna().unique())
    panels: list[tuple[str, pd.DataFrame]]
    if per_layer:
        panels = [
            (f"layer {layer}", frame[frame["layer"] == layer]) for layer in _pick_layers(frame, layers, "grad-error")
        ]
    else:
        panels = [("mean over layers", frame)]
    with figure_style():
        shape = min(columns, len(panels))
        figure = Figure(figsize=(3.2 * shape + 1.0, 2.6 * math.ceil(len(panels) / columns) + 0.3))
        figure.set_layout_engine("constrained")
        for ax, (title, rows) in zip(_grid(figure, len(panels), columns), panels, strict=True):
            means = rows.groupby(["method", "rank_ratio", "step"], dropna=False)["rel_error"].mean()
            for (method, ratio), series in means.groupby(level=["method", "rank_ratio"], dropna=False):
                has_ratio = not pd.isna(ratio)
                style = _RATIO_STYLES[ratios.index(float(ratio)) % len(_RATIO_STYLES)] if has_ratio else "-"
                label = f"{method}, ρ = {float(ratio):g}" if has_ratio else str(method)
                steps = series.index.get_level_values("step").to_numpy(float)
                ax.plot(
                    steps,
                    series.to_numpy(),
                    color=solver_colour(str(method)),
                    linestyle=style,
                    marker="o",
                    markersize=2.5,
                    label=label,
                    gid=f"grad-error/{title}/{method}/{float(ratio):g}"
                    if has_ratio
                    else f"grad-error/{title}/{method}",
                )
            ax.set_yscale("log")
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel("relative error vs exact SNGD")
        figure.axes[0].legend(fontsize=7)
    return figure


def solvers(data: Data) -> Figure:
    """The solver of every layer at every update step as a heat-map strip, one per run.

    Needs ``decisions.csv``.
    """
    frame = _frame(data, "decisions", ("run", "step", "layer", "solver"), "solvers")
    names = sorted(dict.fromkeys(frame["solver"].astype(str)), key=_solver_key)
    cmap = ListedColormap([solver_colour(name) for name in names])
    runs = list(dict.fromkeys(frame["run"]))
    with figure_style():
        layers_max = max(frame[frame["run"] == run]["layer"].nunique() for run in runs)
        figure = Figure(figsize=(6.5, sum(0.25 * layers_max + 1.0 for _ in runs) + 0.4), layout="constrained")
        axes = figure.subplots(len(runs), 1, squeeze=False)[:, 0]
        for ax, run in zip(axes, runs, strict=True):
            rows = frame[frame["run"] == run]
            layers = layer_order(rows)
            steps = sorted(int(s) for s in rows["step"].unique())
            codes = solver_matrix(rows, layers, steps, names)
            gap = steps[-1] - steps[-2] if len(steps) > 1 else 1
            x_edges = np.array([*steps, steps[-1] + gap], dtype=float)
            y_edges = np.arange(len(layers) + 1, dtype=float)
            ax.pcolormesh(
                x_edges,
                y_edges,
                np.ma.masked_invalid(codes),
                cmap=cmap,
                vmin=-0.5,
                vmax=len(names) - 0.5,
                gid=f"solvers/{run}",
            )
            ax.set_yticks(y_edges[:-1] + 0.5, layers)
            ax.invert_yaxis()
            ax.grid(False)
            ax.set_xlabel("step")
            ax.set_ylabel("layer")
            ax.set_title(Path(str(run)).name)
        axes[0].legend(
            handles=[Patch(facecolor=solver_colour(name), label=name) for name in names],
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=7,
            title="solver",
            title_fontsize=7,
        )
    return figure


def solver_matrix(rows: pd.DataFrame, layers: Sequence[str], steps: Sequence[int], names: Sequence[str]) -> np.ndarray:
    """Layers × update steps of indices into ``names`` (NaN where a layer has no decision)."""
    codes = np.full((len(layers), len(steps)), np.nan)
    row_of = {layer: k for k, layer in enumerate(layers)}
    column_of = {step: k for k, step in enumerate(steps)}
    for step, layer, solver in rows[["step", "layer", "solver"]].itertuples(index=False):
        codes[row_of[layer], column_of[int(step)]] = names.index(str(solver))
    return codes


def _pick_layers(frame: pd.DataFrame, layers: Sequence[str] | None, figure: str) -> list[str]:
    present = layer_order(frame)
    if layers is None:
        return present
    unknown = [layer for layer in layers if layer not in present]
    if unknown:
        raise RunDataError(
            f"the {figure!r} figure: no layer {', '.join(map(repr, unknown))}; the run has {', '.join(present)}"
        )
    return list(layers)


def _sequential(count: int) -> list[Any]:
    """``count`` colours of the colour-blind-safe sequential map cividis, light to dark."""
    from matplotlib import colormaps

    cmap = colormaps["cividis"]
    if count == 1:
        return [cmap(0.6)]
    return [cmap(0.85 - 0.7 * k / (count - 1)) for k in range(count)]


@dataclass(frozen=True)
class FigureSpec:
    """A figure the CLI draws: its function, the tables it reads and how many runs it takes."""

    name: str
    draw: Callable[..., Figure]
    tables: tuple[str, ...]
    runs: str
    description: str
    #: Whether a run (with the files) holds the rows the figure draws, where it draws only some
    #: (``all`` leaves the others out); ``holds_what`` names those rows in its report.
    holds: Callable[[Run], bool] | None = None
    holds_what: str = ""

    @property
    def files(self) -> tuple[str, ...]:
        """The files of :attr:`tables`, as messages and ``--help`` show them."""
        return tuple(TABLES[table].shown_name for table in self.tables)


#: Every figure by its CLI name.
FIGURES: dict[str, FigureSpec] = {
    spec.name: spec
    for spec in (
        FigureSpec(
            "accuracy",
            accuracy,
            ("metrics",),
            "one or more",
            "test metric vs epoch and wall time, mean ± range over seeds",
        ),
        FigureSpec(
            "timing",
            timing,
            ("steps",),
            "one or more",
            "time per update by phase per solver and world size; compute vs communication",
        ),
        FigureSpec(
            "layer-dims",
            layer_dims,
            ("timing",),
            "one or more",
            "per-layer d_a, d_g and rows kept, by the solver chosen",
        ),
        FigureSpec("rank", rank, ("rank",), "one or more", "numerical rank per layer and batch size (box plots)"),
        FigureSpec(
            "rank-choice",
            rank_choice,
            ("timing",),
            "one or more",
            "rows KID and KIS kept per layer (share and count) over updates, against rank_ratio or its cap",
            holds=has_row_reduction,
            holds_what="rows of layers solved by KID or KIS (timing-r*.csv's solver)",
        ),
        FigureSpec(
            "grad-norm",
            grad_norm,
            ("grad_norm", "decisions"),
            "one",
            "per-layer gradient norm over training, critical windows shaded",
        ),
        FigureSpec(
            "grad-error", grad_error, ("grad_error",), "one", "KID / KIS / K-FAC error vs exact SNGD over training"
        ),
        FigureSpec(
            "solvers",
            solvers,
            ("decisions",),
            "one or more",
            "the solver of each layer at each update (heat-map strip)",
        ),
    )
}
