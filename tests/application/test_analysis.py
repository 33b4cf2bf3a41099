"""analysis/: every figure on the CSVs of a short real study, its plotted data read back from the
artists and compared with the CSV values (read here with pandas alone), the CLI, the loaders'
errors, and the notebooks executed end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection, QuadMesh
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

import hylo_analysis
from hylo_analysis.cli import main as cli_main
from hylo_scripts.demos import make_figures

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("capture", "reduce", "solve", "precondition", "gather", "broadcast")
#: A study small enough for the default suite: 2 epochs of 4 steps at batch 128, every update studied.
SIZE = make_figures.StudySize(
    epochs=2, max_steps=4, batch_size=128, update_freq=2, seeds=(0, 1), study_every=1, ratios=(0.1, 0.5), trend_window=2
)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs directory of a real short study (train.py on mnist5k, one of them on 2 ranks)."""
    runs = tmp_path_factory.mktemp("study") / "runs"
    make_figures.run_study(runs, SIZE, quiet=True)
    return runs


def _csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, dtype={"layer": str})


def _gid(figure: Figure, gid: str) -> list:
    found = [artist for artist in figure.findobj(lambda a: a.get_gid() == gid)]
    assert found, f"no artist with gid {gid!r}"
    return found


def _line(figure: Figure, gid: str) -> Line2D:
    (line,) = _gid(figure, gid)
    assert isinstance(line, Line2D)
    return line


def _saves(figure: Figure, tmp_path: Path, name: str) -> None:
    for suffix, magic in ((".png", b"\x89PNG"), (".pdf", b"%PDF")):
        path = hylo_analysis.save_figure(figure, tmp_path / f"{name}{suffix}")
        assert path.read_bytes()[:4] == magic


def test_the_study_writes_every_file_the_figures_read(study: Path) -> None:
    names = sorted(path.name for path in study.iterdir())
    assert names == ["auto-s0", "hybrid-p2", "hybrid-s0", "hybrid-s1", "kfac-s0", "sgd-s0", "sgd-s1", "studies-s0"]
    for name in ("grad-norm.csv", "rank-analysis.csv", "grad-error.csv", "decisions.csv", "timing-r0.csv"):
        assert (study / "studies-s0" / name).exists()
    assert not (study / "hybrid-s0" / "grad-norm.csv").exists()
    assert (study / "hybrid-p2" / "steps-r1.csv").exists()
    assert json.loads((study / "hybrid-p2" / "run.json").read_text())["world_size"] == 2


def test_loaders_give_tidy_frames_with_run_columns_and_string_layers(study: Path) -> None:
    frame = hylo_analysis.load_table([study / "hybrid-s0", study / "hybrid-p2"], "timing")
    assert frame["layer"].map(type).eq(str).all() and set(frame["layer"]) == {"0", "3", "7", "9"}
    assert set(frame["rank"]) == {0, 1} and set(frame["world_size"]) == {1, 2}
    assert set(frame["run_solver"]) == {"hybrid"}  # the layer's own solver stays in "solver"
    assert set(frame["solver"]) <= {"kfac", "sngd", "kid", "kis"}
    norms = hylo_analysis.load_table(study / "studies-s0", "grad_norm")
    assert str(norms["critical"].dtype) == "boolean"
    raw = _csv(study / "studies-s0" / "grad-norm.csv")
    assert len(norms) == len(raw) and np.allclose(norms["norm"], raw["norm"])


def test_labels_group_seeds_and_name_the_options_that_differ(study: Path) -> None:
    runs = hylo_analysis.read_runs([study / "sgd-s0", study / "sgd-s1", study / "hybrid-s0", study / "hybrid-p2"])
    labels = [run.label for run in runs]
    assert labels[0] == labels[1] == "SGD"
    assert labels[2] != labels[3] and labels[2].startswith("SGD + hybrid, ")
    assert "batch_size=256" in labels[3] and "P=2" in labels[3]
    assert [run.seed for run in runs] == [0, 1, 0, 0]
    assert hylo_analysis.read_runs([study / "sgd-s0"], labels=["mine"])[0].label == "mine"
    # Labels given by the user group runs as they say, also once the figure reads them again.
    grouped = hylo_analysis.read_runs([study / "sgd-s0", study / "hybrid-s1"], labels=["both", "both"])
    figure = hylo_analysis.accuracy(grouped)
    line = _line(figure, "accuracy/epoch/both")
    sgd, hybrid = (_csv(study / name / "metrics.csv")["test_acc"] for name in ("sgd-s0", "hybrid-s1"))
    assert np.allclose(line.get_ydata(), 100 * (sgd.to_numpy() + hybrid.to_numpy()) / 2)


def test_accuracy_plots_the_mean_and_range_over_seeds(study: Path, tmp_path: Path) -> None:
    runs = [study / name for name in ("sgd-s0", "sgd-s1", "hybrid-s0", "hybrid-s1", "kfac-s0")]
    figure = hylo_analysis.accuracy(runs)
    _saves(figure, tmp_path, "accuracy")
    for label, names in (("SGD", ["sgd-s0", "sgd-s1"]), ("SGD + kfac", ["kfac-s0"])):
        tables = [_csv(study / name / "metrics.csv") for name in names]
        acc = np.stack([t["test_acc"].to_numpy() for t in tables])
        time = np.stack([t["total_time_s"].to_numpy() for t in tables])
        by_epoch = _line(figure, f"accuracy/epoch/{label}")
        assert np.array_equal(by_epoch.get_xdata(), tables[0]["epoch"].to_numpy())
        assert np.allclose(by_epoch.get_ydata(), 100 * acc.mean(axis=0))
        by_time = _line(figure, f"accuracy/time/{label}")
        assert np.allclose(by_time.get_xdata(), time.mean(axis=0))
        if len(names) > 1:
            (band,) = _gid(figure, f"accuracy/epoch-range/{label}")
            assert isinstance(band, PolyCollection)
            ys = band.get_paths()[0].vertices[:, 1]
            for value in np.concatenate([100 * acc.min(axis=0), 100 * acc.max(axis=0)]):
                assert np.isclose(ys, value).any()
    # One colour per solver / optimizer in every figure.
    assert _line(figure, "accuracy/epoch/SGD").get_color() == hylo_analysis.OPTIMIZER_COLOURS["sgd"]
    assert _line(figure, "accuracy/epoch/SGD + kfac").get_color() == hylo_analysis.SOLVER_COLOURS["kfac"]


def test_timing_bars_are_the_mean_phase_times_per_update(study: Path, tmp_path: Path) -> None:
    names = ["hybrid-s0", "hybrid-s1", "kfac-s0", "hybrid-p2"]
    figure = hylo_analysis.timing([study / name for name in names])
    _saves(figure, tmp_path, "timing")
    configs = {("hybrid", 1): ["hybrid-s0", "hybrid-s1"], ("kfac", 1): ["kfac-s0"], ("hybrid", 2): ["hybrid-p2"]}
    for (solver, world), members in configs.items():
        for phase in PHASES:
            per_run = []
            for name in members:
                per_rank = []
                for path in sorted((study / name).glob("steps-r*.csv")):
                    steps = _csv(path)
                    updates = steps[steps["kind"] == "update"]
                    updates = updates[updates["step"] != updates["step"].min()]  # the first update is left out
                    per_rank.append(updates[f"{phase}_ms"].mean())
                assert len(per_rank) == world
                per_run.append(np.mean(per_rank))
            (bar,) = _gid(figure, f"timing/{phase}/{solver}/P{world}")
            assert isinstance(bar, Rectangle)
            assert np.isclose(bar.get_height(), np.mean(per_run))
        (split,) = _gid(figure, f"timing/communication/{solver}/P{world}")
        expected = sum(_gid(figure, f"timing/{p}/{solver}/P{world}")[0].get_height() for p in ("gather", "broadcast"))
        assert np.isclose(split.get_height(), expected)
    assert _gid(figure, "timing/gather/hybrid/P2")[0].get_height() > 0  # two ranks exchange factors


def test_layer_dims_shows_the_last_update_of_rank_zero(study: Path, tmp_path: Path) -> None:
    run = study / "hybrid-p2"
    figure = hylo_analysis.layer_dims(run)
    _saves(figure, tmp_path, "layer-dims")
    timing = _csv(run / "timing-r0.csv")
    last = timing[timing["step"] == timing["step"].max()]
    heights = [bar.get_height() for bar in _gid(figure, f"layer-dims/{run}/d_a")]
    assert heights == last["d_a"].tolist()
    assert [bar.get_height() for bar in _gid(figure, f"layer-dims/{run}/d_g")] == last["d_g"].tolist()
    for solver, rows in last.groupby("solver"):
        (points,) = _gid(figure, f"layer-dims/{run}/rows_kept/{solver}")
        assert points.get_offsets()[:, 1].tolist() == rows["rows_kept"].tolist()
        positions = [last["layer"].tolist().index(layer) for layer in rows["layer"]]
        assert points.get_offsets()[:, 0].tolist() == positions
        assert points.get_facecolor()[0][:3] == pytest.approx(
            tuple(int(hylo_analysis.solver_colour(solver)[k : k + 2], 16) / 255 for k in (1, 3, 5))
        )


def test_rank_boxes_have_the_csv_medians_per_layer_and_batch(study: Path, tmp_path: Path) -> None:
    runs = [study / "studies-s0", study / "hybrid-p2"]
    figure = hylo_analysis.rank(runs, level="99")
    _saves(figure, tmp_path, "rank")
    frame = pd.concat([_csv(run / "rank-analysis.csv") for run in runs])
    assert sorted(frame["batch_rows"].unique()) == [128, 256]
    for (layer, batch), rows in frame.groupby(["layer", "batch_rows"]):
        median = _line(figure, f"rank/median/{layer}/{batch}")
        assert np.allclose(median.get_ydata(), np.median(rows["rank_99"]))
    relative = hylo_analysis.rank(runs, level="90", relative=True)
    rows = frame[(frame["layer"] == "7") & (frame["batch_rows"] == 256)]
    assert np.allclose(_line(relative, "rank/median/7/256").get_ydata(), np.median(rows["rank_90"] / 256))


def _rgb(colour: str) -> tuple[float, ...]:
    return tuple(int(colour[k : k + 2], 16) / 255 for k in (1, 3, 5))


def _check_rank_choice(figure: Figure, run: Path, label: str) -> tuple[pd.DataFrame, list[str]]:
    """Every KID/KIS row of ``run``'s timing-r*.csv is a point of the figure: rows_kept / rows, and rows_kept.

    Returns those rows and the layers drawn, in the order of the file."""
    timing = pd.concat([_csv(path) for path in sorted(run.glob("timing-r*.csv"))]).sort_values("step", kind="stable")
    reduced = timing[timing["solver"].isin(["kid", "kis"])]
    assert not reduced.empty
    for (layer, solver), rows in reduced.groupby(["layer", "solver"]):
        (shares,) = _gid(figure, f"rank-choice/{label}/share/{layer}/{solver}")
        assert np.allclose(shares.get_offsets()[:, 1], rows["rows_kept"] / rows["rows"])
        (kept,) = _gid(figure, f"rank-choice/{label}/rows-kept/{layer}/{solver}")
        assert kept.get_offsets()[:, 1].tolist() == rows["rows_kept"].tolist()
        assert shares.get_facecolor()[0][:3] == pytest.approx(_rgb(hylo_analysis.solver_colour(solver)))
        median = _line(figure, f"rank-choice/{label}/share/{layer}/{solver}/median")
        assert np.allclose(median.get_ydata(), np.median(rows["rows_kept"] / rows["rows"]))
    for layer in set(timing["layer"]) - set(reduced["layer"]):  # never solved by KID or KIS: nothing drawn
        assert not figure.findobj(lambda a, lay=layer: f"/share/{lay}/" in str(a.get_gid()))
    return reduced, [layer for layer in dict.fromkeys(timing["layer"]) if layer in set(reduced["layer"])]


def test_rank_choice_plots_the_rows_each_layer_kept_under_auto(study: Path, tmp_path: Path) -> None:
    run = study / "auto-s0"
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["rank_ratio"] == "auto" and config["solver"] == "hybrid"
    figure = hylo_analysis.rank_choice(run)
    _saves(figure, tmp_path, "rank-choice")
    label = hylo_analysis.read_run(run).label
    reduced, layers = _check_rank_choice(figure, run, label)
    cap = config["rank_cap"]
    assert (reduced["rows_kept"] <= np.maximum(1, np.floor(cap * reduced["rows"]))).all()
    # The cap: a line at rank_cap on the shares, and the rows it allows each layer on the rows kept.
    line = _line(figure, f"rank-choice/{label}/cap/{cap:g}")
    assert np.allclose(line.get_ydata(), cap)
    (allowed,) = _gid(figure, f"rank-choice/{label}/cap/{cap:g}/rows")
    expected = [max(1, int(cap * reduced.loc[reduced["layer"] == layer, "rows"].median())) for layer in layers]
    assert [segment[0, 1] for segment in allowed.get_segments()] == expected


def test_rank_choice_of_a_run_of_hylo(tmp_path: Path) -> None:
    """A profile_dir written by hylo itself: KID under rank_ratio="auto" keeps what the spectrum asks, at most the cap."""
    import torch

    import hylo

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    preconditioner = hylo.HyLoPreconditioner(
        model, solver="kid", rank_ratio="auto", rank_cap=0.5, update_freq=1, profile_dir=tmp_path
    )
    basis = torch.randn(2, 12)  # inputs of rank 2: fewer directions than the cap's 16 rows
    for _ in range(4):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(32, 2) @ basis), torch.randint(0, 3, (32,))).backward()
        preconditioner.step()
        optimizer.step()
    figure = hylo_analysis.rank_choice(tmp_path)
    reduced, _ = _check_rank_choice(figure, tmp_path, "kid")
    assert len(reduced) == 4 * 3 and set(reduced["solver"]) == {"kid"}
    assert reduced["rows_kept"].max() <= 16 and reduced["rows_kept"].min() < 16  # some layer kept fewer
    assert np.allclose(_line(figure, "rank-choice/kid/cap/0.5").get_ydata(), 0.5)
    # decisions.csv's rows_kept sums the ranks' rows: on one rank it is timing's.
    decisions = _csv(tmp_path / "decisions.csv")
    assert decisions["rows_kept"].tolist() == _csv(tmp_path / "timing-r0.csv")["rows_kept"].tolist()


def _timing_rows(run: str, label: str, solvers: list[str], kept: list[int], rows: int = 64) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "run": run,
            "label": label,
            "step": [2 * (k // 2) for k in range(len(solvers))],
            "rank": 0,
            "layer": [str(k % 2) for k in range(len(solvers))],
            "solver": solvers,
            "rows": rows,
            "rows_kept": kept,
        }
    )


def test_rank_choice_draws_a_fixed_ratio_and_a_fixed_rank(tmp_path: Path) -> None:
    runs = {}
    for name, config in (("fixed", {"rank_ratio": 0.1}), ("rows", {"rank_ratio": "auto", "rank": 8})):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        (runs[name] / "run.json").write_text(json.dumps({"world_size": 1, "config": {"solver": "kid", **config}}))
    frame = pd.concat(
        [
            _timing_rows(str(runs["fixed"]), "fixed", ["kid", "kis", "kid", "kfac"], [6, 6, 6, 64]),
            _timing_rows(str(runs["rows"]), "rows", ["kid", "kid", "kis", "kis"], [8, 3, 5, 8], rows=32),
            _timing_rows("elsewhere", "no run.json", ["kis", "kis"], [4, 2]),
        ]
    )
    figure = hylo_analysis.rank_choice(frame)
    assert np.allclose(_line(figure, "rank-choice/fixed/ratio/0.1").get_ydata(), 0.1)
    (allowed,) = _gid(figure, "rank-choice/fixed/ratio/0.1/rows")
    assert [segment[0, 1] for segment in allowed.get_segments()] == [6, 6]
    # A layer solved by K-FAC at one step and KID at another: only KID's rows are drawn.
    assert _gid(figure, "rank-choice/fixed/share/1/kis")[0].get_offsets()[:, 1].tolist() == [6 / 64]
    assert not figure.findobj(lambda a: str(a.get_gid()).startswith("rank-choice/fixed/share/1/kfac"))
    # rank= is the cap in rows: no share line, the rows on the rows-kept panel.
    (rank,) = _gid(figure, "rank-choice/rows/rank/8/rows")
    assert [segment[0, 1] for segment in rank.get_segments()] == [8, 8]
    assert not figure.findobj(lambda a: str(a.get_gid()) == "rank-choice/rows/rank/8")
    assert _gid(figure, "rank-choice/rows/share/0/kid")[0].get_offsets()[:, 1].tolist() == [8 / 32]
    assert _gid(figure, "rank-choice/no run.json/rows-kept/1/kis")[0].get_offsets()[:, 1].tolist() == [2]
    assert not figure.findobj(lambda a: str(a.get_gid()).startswith("rank-choice/no run.json/cap"))
    assert hylo_analysis.rank_reference({"rank_ratio": "auto", "rank_cap": 0.25}).name == "cap = 0.25 (auto)"
    assert hylo_analysis.rank_reference({"solver": "kfac"}) is None


def test_rank_choice_refuses_runs_without_kid_or_kis(
    study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frame = _timing_rows("a", "a", ["kid", "kis"], [6, 6])
    kfac = _timing_rows("b", "b", ["kfac", "sngd"], [64, 64])
    with pytest.raises(hylo_analysis.RunDataError, match="no layer of b was solved by KID or KIS .*kfac, sngd"):
        hylo_analysis.rank_choice(pd.concat([frame, kfac]))
    with pytest.raises(hylo_analysis.RunDataError, match="'rows_kept'"):
        hylo_analysis.rank_choice(frame.drop(columns=["rows_kept"]))
    assert cli_main(["rank-choice", str(study / "kfac-s0"), "-o", str(tmp_path / "r.png")]) == 1
    message = capsys.readouterr().err
    assert "kfac-s0 was solved by KID or KIS" in message and "solver kfac only" in message
    assert not (tmp_path / "r.png").exists()


def test_grad_norm_lines_and_critical_windows_match_the_csvs(study: Path, tmp_path: Path) -> None:
    run = study / "studies-s0"
    figure = hylo_analysis.grad_norm(run)
    _saves(figure, tmp_path, "grad-norm")
    norms = _csv(run / "grad-norm.csv")
    decisions = _csv(run / "decisions.csv")
    last = norms["step"].max()
    seen_both = set()
    for layer, rows in norms.groupby("layer"):
        line = _line(figure, f"grad-norm/{layer}/norm")
        assert np.array_equal(line.get_xdata(), rows["step"].to_numpy())
        assert np.allclose(line.get_ydata(), rows["norm"].to_numpy())
        assert np.allclose(_line(figure, f"grad-norm/{layer}/ema").get_ydata(), rows["ema"].to_numpy())
        # A step is shaded when the latest update at or before it was critical for this layer.
        mine = decisions[decisions["layer"] == layer].sort_values("step")
        flags = dict(zip(mine["step"], mine["critical"].astype(str) == "True", strict=True))
        expected = {s for s in range(last + 1) if flags[max(u for u in flags if u <= s)]}
        spans = figure.findobj(lambda a, lay=layer: str(a.get_gid()).startswith(f"grad-norm/{lay}/critical/"))
        shaded = set()
        for span in spans:
            x0, x1 = span.get_bbox().x0, span.get_bbox().x1
            shaded |= {s for s in range(last + 1) if x0 <= s < x1}
        assert shaded == expected
        seen_both.add((bool(expected), len(expected) <= last))
    assert (True, True) in seen_both  # some layer left its critical window in this run


def test_grad_error_lines_are_the_csv_errors(study: Path, tmp_path: Path) -> None:
    run = study / "studies-s0"
    errors = _csv(run / "grad-error.csv")
    assert set(errors["method"]) == {"kid", "kis", "kfac"}
    mean = hylo_analysis.grad_error(run)
    _saves(mean, tmp_path, "grad-error")
    for (method, ratio), rows in errors.groupby(["method", "rank_ratio"], dropna=False):
        gid = f"grad-error/mean over layers/{method}" + ("" if pd.isna(ratio) else f"/{ratio:g}")
        line = _line(mean, gid)
        expected = rows.groupby("step")["rel_error"].mean()
        assert np.array_equal(line.get_xdata(), expected.index.to_numpy())
        assert np.allclose(line.get_ydata(), expected.to_numpy())
        assert line.get_color() == hylo_analysis.solver_colour(method)
    per_layer = hylo_analysis.grad_error(run, per_layer=True)
    rows = errors[(errors["layer"] == "3") & (errors["method"] == "kis") & (errors["rank_ratio"] == 0.5)]
    assert np.allclose(_line(per_layer, "grad-error/layer 3/kis/0.5").get_ydata(), rows["rel_error"])


def test_solvers_strip_holds_every_decision(study: Path, tmp_path: Path) -> None:
    runs = [study / "hybrid-s0", study / "hybrid-p2"]
    figure = hylo_analysis.solvers(runs)
    _saves(figure, tmp_path, "solvers")
    names = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    for run in runs:
        decisions = _csv(run / "decisions.csv")
        (mesh,) = _gid(figure, f"solvers/{run}")
        assert isinstance(mesh, QuadMesh)
        codes = np.asarray(mesh.get_array()).reshape(decisions["layer"].nunique(), decisions["step"].nunique())
        layers = list(dict.fromkeys(decisions["layer"]))
        steps = sorted(decisions["step"].unique())
        for step, layer, solver in decisions[["step", "layer", "solver"]].itertuples(index=False):
            assert names[int(codes[layers.index(layer), steps.index(step)])] == solver
    assert {"kid", "kis"} <= set(names)  # the policy switched within the run


def test_figures_accept_loaded_tables_too(study: Path) -> None:
    table = hylo_analysis.load_table(study / "studies-s0", "grad_error")
    assert isinstance(hylo_analysis.grad_error(table), Figure)
    with pytest.raises(hylo_analysis.RunDataError, match="'rel_error'"):
        hylo_analysis.grad_error(table.drop(columns=["rel_error"]))
    # Decisions of several runs: the figure shades the grad-norm run's own.
    norms = hylo_analysis.load_table(study / "studies-s0", "grad_norm")
    both = hylo_analysis.load_table([study / "hybrid-p2", study / "studies-s0"], "decisions")
    mine = hylo_analysis.load_table(study / "studies-s0", "decisions")
    spans = [
        [a.get_bbox().x0 for a in figure.findobj(lambda a: "/critical/" in str(a.get_gid()))]
        for figure in (hylo_analysis.grad_norm(norms, decisions=both), hylo_analysis.grad_norm(norms, decisions=mine))
    ]
    assert spans[0] == spans[1]
    with pytest.raises(ValueError, match="decisions="):
        hylo_analysis.grad_norm(hylo_analysis.load_table(study / "studies-s0", "grad_norm"))


@pytest.mark.parametrize("figure", list(hylo_analysis.FIGURES))
@pytest.mark.parametrize("suffix", [".pdf", ".png", ".svg"])
def test_cli_draws_each_figure(study: Path, tmp_path: Path, figure: str, suffix: str) -> None:
    runs = {name: [str(path) for path in paths] for name, paths in make_figures.figure_inputs(study).items()}
    out = tmp_path / f"{figure}{suffix}"
    assert cli_main([figure, *runs[figure], "-o", str(out)]) == 0
    assert out.stat().st_size > 1000


def test_cli_help_lists_the_figures_and_their_inputs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hylo_analysis", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0
    for spec in hylo_analysis.FIGURES.values():
        assert spec.name in done.stdout and spec.files[0] in done.stdout


def test_cli_names_a_missing_column(study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(study / "studies-s0", run)
    errors = _csv(run / "grad-error.csv").drop(columns=["rel_error"])
    errors.to_csv(run / "grad-error.csv", index=False)
    assert cli_main(["grad-error", str(run), "-o", str(tmp_path / "e.pdf")]) == 1
    message = capsys.readouterr().err
    assert "grad-error.csv: no column 'rel_error'" in message and "'grad-error' figure" in message
    assert not (tmp_path / "e.pdf").exists()


def test_cli_names_a_missing_file(study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["rank", str(study / "kfac-s0"), "-o", str(tmp_path / "r.png")]) == 1
    message = capsys.readouterr().err
    assert "kfac-s0: no rank-analysis.csv" in message and "--rank-analysis" in message
    assert cli_main(["timing", str(study / "sgd-s0"), "-o", str(tmp_path / "t.png")]) == 1
    assert "no steps-r*.csv" in capsys.readouterr().err
    assert cli_main(["accuracy", str(tmp_path), "-o", str(tmp_path / "a.png")]) == 1
    assert "not a run directory" in capsys.readouterr().err


def test_cli_refuses_misuse(study: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["grad-norm", str(study / "hybrid-s0"), str(study / "hybrid-s1"), "-o", str(tmp_path / "g.png")])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        cli_main(["accuracy", str(study / "sgd-s0"), "-o", str(tmp_path / "a.jpg")])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        cli_main(["nonsense", str(study / "sgd-s0"), "-o", str(tmp_path / "a.png")])
    assert exit_.value.code == 2


def test_cli_all_draws_what_the_runs_hold(study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["all", str(study / "sgd-s0"), str(study / "kfac-s0"), "-o", str(tmp_path), "--format", "svg"]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "accuracy.svg").exists() and (tmp_path / "timing.svg").exists()
    assert not (tmp_path / "rank.svg").exists() and "rank        skipped" in printed
    # kfac-s0 has timing-r0.csv, but no KID or KIS rows to draw.
    assert not (tmp_path / "rank-choice.svg").exists()
    assert "rank-choice skipped: no run directory holds rows of layers solved by KID or KIS" in printed
    both = ["all", str(study / "kfac-s0"), str(study / "auto-s0"), "-o", str(tmp_path / "both"), "--format", "svg"]
    assert cli_main(both) == 0
    assert (tmp_path / "both" / "rank-choice.svg").exists()
    assert "SGD + kfac" not in (tmp_path / "both" / "rank-choice.svg").read_text()


def test_make_figures_draws_every_figure_and_refuses_to_overwrite_runs(study: Path, tmp_path: Path) -> None:
    shutil.copytree(study, tmp_path / "runs")
    assert make_figures.main(["--out", str(tmp_path), "--figures-only", "--format", "pdf", "png", "--dpi", "50"]) == 0
    for name in hylo_analysis.FIGURES:
        assert (tmp_path / f"{name}.pdf").exists() and (tmp_path / f"{name}.png").exists()
    with pytest.raises(SystemExit):
        make_figures.main(["--out", str(tmp_path), "--runs-only"])


NOTEBOOKS = sorted((ROOT / "analysis" / "notebooks").glob("*.ipynb"))


def test_notebooks_cover_every_figure_and_are_committed_without_outputs() -> None:
    nbformat = pytest.importorskip("nbformat")
    assert [path.stem for path in NOTEBOOKS] == ["accuracy", "policy", "studies", "timing"]
    called = ""
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        for cell in book.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name} holds outputs"
                called += cell.source
    for spec in hylo_analysis.FIGURES.values():
        assert f"analysis.{spec.draw.__name__}(" in called


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(study: Path, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    book = nbformat.read(path, as_version=4)
    # The kernel imports this checkout's hylo_analysis and hylo_scripts, and reads the study's runs.
    roots = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "analysis"), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, roots)))
    monkeypatch.setenv("HYLO_FIGURE_RUNS", str(study))
    nbclient.NotebookClient(book, timeout=180, resources={"metadata": {"path": str(path.parent)}}).execute()
    images = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no figure"
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
