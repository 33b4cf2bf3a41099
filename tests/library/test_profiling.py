"""Profiling and studies (hylo/profiling.py, hylo/recording.py, hylo/recorder.py, hylo/studies.py).

1. One rank: every file of ``profile_dir`` read by pandas, with its exact columns, row counts
   (sampling by ``rank_every``/``grad_error_every``), dtypes and values that fit the layers.
2. Two gloo ranks: per-rank timing/steps files, rank-0 files written once, traffic counted,
   the rank study sees the gathered global batch.
3. A run killed with SIGKILL leaves only whole lines; a run that exits without ``close()``
   still has all its rows (finalizer at exit).
4. An existing run's files are refused unless ``profile_append``; a resumed run appends
   (headers once, steps continue, ``run.json`` gains "resumed"); mismatched headers refused.
5. Timing fidelity: the phases and slots add up to the wall time of ``step()``.
6. Profiling off costs nothing: one host sync per non-update step, no files, no recorder.
7. Training is bit-for-bit the same with and without profiling and studies.
8. ``close()``/``remove()``/garbage collection flush the buffered rows; nothing is written after.
9. grad-norm.csv holds the gradient norms before and after preconditioning.
"""

from __future__ import annotations

import csv
import datetime
import gc
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner, fingerprint
from hylo.config import options
from tests.kit.checks import counting_host_syncs
from tests.kit.devices import chosen, tolerances
from tests.kit.harness import run_distributed
from tests.kit.internals import hooks

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("conv", "fc1", "fc2")
#: (d_a, d_g) of Net's layers, bias column included.
DIMS = {"conv": (2 * 3 * 3 + 1, 3), "fc1": (27 + 1, 5), "fc2": (5, 3)}
BATCH = 8
PHASES_MS = ["capture_ms", "reduce_ms", "gather_ms", "solve_ms", "broadcast_ms", "precondition_ms"]
SLOTS_MS = ["check_ms", "decide_ms", "study_ms"]
TIMING_COLUMNS = [
    "step",
    "layer",
    "solver",
    "rows",
    "rows_kept",
    "d_a",
    "d_g",
    *PHASES_MS,
    "bytes_sent",
    "bytes_held",
    "hook_ms",
]
STEPS_COLUMNS = ["step", "kind", "step_ms", *SLOTS_MS, *PHASES_MS, "bytes_sent", "hook_ms"]
GRAD_NORM_COLUMNS = ["step", "layer", "norm", "ema", "trend", "critical", "norm_after"]
GRAD_ERROR_COLUMNS = ["step", "layer", "method", "rank_ratio", "rel_error", "reference"]
DECISION_COLUMNS = [
    *["step", "layer", "solver", "reason", "trend", "cost_kfac", "cost_lowrank", "cost_sngd", "critical"],
    "rows_kept",  # the rows the layer's low-rank solve kept over all ranks (empty for K-FAC)
    "cost_kfac_adam",  # the registered kfac_adam family (docs/profiling.md, "Files")
    # its adaptive refresh's decisions (docs/solvers.md, "Adaptive refresh")
    *["refreshed_a", "refreshed_g", "staleness_a", "staleness_g", "held_a", "held_g"],
]
STUDIES = ("grad_norm", "rank", "grad_error")
#: The options of the runs whose files are checked: updates every 2nd step, fc2 on K-FAC, all studies.
STUDY_RUN: dict[str, Any] = {
    "solver": "hybrid",
    "layer_solvers": {"fc2": "kfac"},
    "update_freq": 2,
    "damping": 1e-2,
    "rank_ratio": 0.5,
    "studies": STUDIES,
}
RANK_FILES = {"grad-norm.csv", "rank-analysis.csv", "grad-error.csv", "decisions.csv", "run.json"}


def rank_columns(top_k: int) -> list[str]:
    return ["step", "layer", "batch_rows", "reference", "rank_90", "rank_99", "rank_999"] + [
        f"sv_{i}" for i in range(1, top_k + 1)
    ]


# --------------------------------------------------------------------------- model, data, loop
class Net(nn.Module):
    """Conv2d (stride 2, padding 1, bias) → Linear (bias) → Linear (no bias) on 2×5×5 inputs, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)  # 5×5 → 3×3
        self.fc1 = nn.Linear(27, 5)
        self.fc2 = nn.Linear(5, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.conv(x))
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def data(step: int, n: int = BATCH) -> tuple[Tensor, Tensor]:
    """Deterministic inputs and labels of ``step``'s global batch."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 2, 5, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def train(
    model: nn.Module,
    pre: HyLoPreconditioner,
    steps: range,
    optimizer: torch.optim.Optimizer | None = None,
    rows: slice = slice(None),
) -> None:
    """For each step: zero the gradients, backward on ``rows`` of the step's batch, ``pre.step()``, optimizer."""
    for step in steps:
        model.zero_grad()
        x, y = data(step)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        pre.step()
        if optimizer is not None:
            optimizer.step()


def layer_norms(model: Net) -> dict[str, float]:
    """Each layer's gradient norm, weight and bias gradients together, in float64."""
    out = {}
    for name in LAYERS:
        module = getattr(model, name)
        parts = [p.grad.detach().to(torch.float64).flatten() for p in module.parameters()]
        out[name] = float(torch.linalg.vector_norm(torch.cat(parts)))
    return out


def read(directory: Path, name: str) -> Any:
    """A profile CSV as a pandas DataFrame."""
    return pd.read_csv(directory / name)


def assert_whole_lines(path: Path) -> None:
    """``path`` is a CSV ending on a newline whose every row has as many fields as its single header."""
    raw = path.read_bytes()
    assert raw.endswith(b"\n"), f"{path.name} ends on a torn line: {raw[-80:]!r}"
    rows = list(csv.reader(raw.decode().splitlines()))
    header = rows[0]
    assert all(len(row) == len(header) for row in rows), f"{path.name}: a row does not have {len(header)} fields"
    assert sum(row == header for row in rows) == 1, f"{path.name}: header written more than once"


def is_string(series: Any) -> bool:
    return bool(pd.api.types.is_string_dtype(series) or pd.api.types.is_object_dtype(series)) and all(
        isinstance(v, str) for v in series
    )


def assert_dtypes(frame: Any, ints: list[str], floats: list[str], strings: list[str], bools: list[str]) -> None:
    for column in ints:
        assert frame[column].dtype == "int64", f"{column}: {frame[column].dtype}"
    for column in floats:
        assert frame[column].dtype == "float64", f"{column}: {frame[column].dtype}"
    for column in strings:
        assert is_string(frame[column]), f"{column}: {frame[column].dtype}"
    for column in bools:
        assert frame[column].dtype == "bool", f"{column}: {frame[column].dtype}"


def keys(frame: Any, *columns: str) -> list[tuple[Any, ...]]:
    """The rows of ``frame`` as tuples of ``columns`` (NaN → None), in file order."""
    return [
        tuple(None if isinstance(v, float) and math.isnan(v) else v for v in row)
        for row in frame[list(columns)].itertuples(index=False)
    ]


# ============================================================================ 1. one rank
def test_files_at_one_rank(tmp_path: Path) -> None:
    """7 steps, updates every 2nd (0, 2, 4, 6), rank study every 2nd update (0, 4), gradient-error
    study every 3rd (0, 6): each file's columns, rows, dtypes and values."""
    directory = tmp_path / "profile"
    model = make_net()
    pre = HyLoPreconditioner(
        model,
        **STUDY_RUN,
        profile_dir=directory,
        rank_every=2,
        rank_top_k=4,
        grad_error_every=3,
        grad_error_methods=("kid", "kis", "kfac", "sngd"),
        grad_error_ratios=(0.25, 0.5),
    )
    info = {layer.name: layer for layer in pre.layer_info()}
    assert {name: (i.d_a, i.d_g) for name, i in info.items()} == DIMS
    train(model, pre, range(7), torch.optim.SGD(model.parameters(), lr=0.1))
    held = pre.memory_usage()
    pre.close()

    updates, rank_steps, error_steps = [0, 2, 4, 6], [0, 4], [0, 6]
    assert sorted(p.name for p in directory.iterdir()) == sorted(["timing-r0.csv", "steps-r0.csv", *RANK_FILES])
    for path in directory.glob("*.csv"):
        assert_whole_lines(path)

    # decisions.csv: one row per update and layer
    decisions = read(directory, "decisions.csv")
    assert list(decisions.columns) == DECISION_COLUMNS
    assert keys(decisions, "step", "layer") == list(itertools.product(updates, LAYERS))
    assert_dtypes(
        decisions,
        ["step"],
        ["trend", "cost_kfac", "cost_lowrank", "cost_sngd"],
        ["layer", "solver", "reason"],
        ["critical"],
    )
    assert set(decisions.solver) <= {"kfac", "sngd", "kid", "kis"}
    assert set(decisions[decisions.layer == "fc2"].solver) == {"kfac"}
    solver_at = {(s, layer): solver for s, layer, solver in keys(decisions, "step", "layer", "solver")}
    kept_at = {(s, layer): kept for s, layer, kept in keys(decisions, "step", "layer", "rows_kept")}

    # timing-r0.csv: one row per update and layer
    timing = read(directory, "timing-r0.csv")
    assert list(timing.columns) == TIMING_COLUMNS
    assert keys(timing, "step", "layer") == list(itertools.product(updates, LAYERS))
    assert_dtypes(
        timing,
        ["step", "rows", "rows_kept", "d_a", "d_g", "bytes_sent", "bytes_held"],
        [*PHASES_MS, "hook_ms"],
        ["layer", "solver"],
        [],
    )
    assert (timing[PHASES_MS] >= 0).all().all()
    for row in timing.itertuples():
        assert row.solver == solver_at[(row.step, row.layer)]
        assert (row.d_a, row.d_g) == DIMS[row.layer] == (info[row.layer].d_a, info[row.layer].d_g)
        assert row.rows == BATCH
        assert row.rows_kept == (BATCH // 2 if row.solver in ("kid", "kis") else BATCH)
        decided = kept_at[(row.step, row.layer)]
        assert decided == (row.rows_kept if row.solver != "kfac" else None)  # one rank: m = r; K-FAC keeps no rows
        assert row.bytes_sent == 0  # one rank: no traffic
        assert row.bytes_held > 0
    last = timing[timing.step == updates[-1]]
    assert dict(zip(last.layer, last.bytes_held, strict=True)) == held
    assert (timing.capture_ms > 0).all() and (timing.solve_ms > 0).all()
    assert (timing.hook_ms > 0).all()  # every captured call passes its layer's gradient hook

    # steps-r0.csv: one row per step; the slots and phases add up to the step; phases match timing-r0
    steps = read(directory, "steps-r0.csv")
    assert list(steps.columns) == STEPS_COLUMNS
    assert list(steps.step) == list(range(7))
    assert list(steps.kind) == ["update" if s in updates else "apply" for s in range(7)]
    assert_dtypes(steps, ["step", "bytes_sent"], ["step_ms", *SLOTS_MS, *PHASES_MS, "hook_ms"], ["kind"], [])
    assert (steps[["step_ms", *SLOTS_MS, *PHASES_MS]] >= 0).all().all()
    assert (steps.bytes_sent == 0).all()
    for row in steps.itertuples():
        parts = sum(getattr(row, c) for c in [*SLOTS_MS, *PHASES_MS])
        assert parts == pytest.approx(row.step_ms, rel=tolerances().clock)
        assert (row.study_ms > 0) == (row.step in set(rank_steps) | set(error_steps)), row
        if row.kind == "update":
            per_layer = timing[timing.step == row.step][[*PHASES_MS, "hook_ms"]].sum()
            for column in [*PHASES_MS, "hook_ms"]:
                assert getattr(row, column) == pytest.approx(per_layer[column], rel=tolerances().clock, abs=1e-12)
        else:
            assert row.capture_ms == row.solve_ms == row.decide_ms == row.hook_ms == 0
            assert row.precondition_ms > 0

    # grad-norm.csv: every step and layer
    norms = read(directory, "grad-norm.csv")
    assert list(norms.columns) == GRAD_NORM_COLUMNS
    assert keys(norms, "step", "layer") == list(itertools.product(range(7), LAYERS))
    assert_dtypes(norms, ["step"], ["norm", "ema", "trend", "norm_after"], ["layer"], ["critical"])
    assert (norms.norm > 0).all() and (norms.norm_after > 0).all() and (norms.ema > 0).all()

    # rank-analysis.csv: sampled updates × layers, ranks ordered, eigenvalues descending
    ranks = read(directory, "rank-analysis.csv")
    assert list(ranks.columns) == rank_columns(4)
    assert keys(ranks, "step", "layer") == list(itertools.product(rank_steps, LAYERS))
    levels = ["rank_90", "rank_99", "rank_999"]
    assert_dtypes(ranks, ["step", "batch_rows", *levels], ["sv_1", "sv_2", "sv_3", "sv_4"], ["layer", "reference"], [])
    assert (ranks.batch_rows == BATCH).all()
    assert set(ranks.reference) == {"sngd-exact"}
    for row in ranks.itertuples():
        assert 1 <= row.rank_90 <= row.rank_99 <= row.rank_999 <= BATCH
        eigenvalues = [row.sv_1, row.sv_2, row.sv_3, row.sv_4]
        assert eigenvalues == sorted(eigenvalues, reverse=True) and eigenvalues[-1] >= 0

    # grad-error.csv: sampled updates × layers × (2 methods × 2 ratios + kfac + sngd)
    errors = read(directory, "grad-error.csv")
    assert list(errors.columns) == GRAD_ERROR_COLUMNS
    methods = [("kid", 0.25), ("kid", 0.5), ("kis", 0.25), ("kis", 0.5), ("kfac", None), ("sngd", None)]
    expected = [(s, layer, m, r) for s in error_steps for m, r in methods for layer in LAYERS]
    assert sorted(keys(errors, "step", "layer", "method", "rank_ratio"), key=str) == sorted(expected, key=str)
    assert len(errors) == len(error_steps) * len(LAYERS) * 6
    assert_dtypes(errors, ["step"], ["rank_ratio", "rel_error"], ["layer", "method", "reference"], [])
    assert (errors.rel_error >= 0).all() and errors.rel_error.map(math.isfinite).all()
    assert set(errors.reference) == {"sngd-exact"}
    # the run's own SNGD rows are the reference's rows for a Linear layer, not for a conv ("sum" rows)
    sngd = errors[errors.method == "sngd"]
    assert (sngd[sngd.layer != "conv"].rel_error < 1e-5).all()
    assert (sngd[sngd.layer == "conv"].rel_error > 1e-3).all()

    # run.json
    run = json.loads((directory / "run.json").read_text())
    assert run["world_size"] == 1
    assert run["torch_version"] == torch.__version__
    assert torch.device(run["device"]).type == chosen().type
    started = datetime.datetime.fromisoformat(run["start_time"])
    assert abs((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()) < 600
    assert run["config"]["profile_dir"] == str(directory)
    assert run["config"]["studies"] == list(STUDIES)
    assert run["config"]["rank_top_k"] == 4 and run["config"]["update_freq"] == 2
    assert "resumed" not in run


# ============================================================================ 2. two ranks
COUNTS = [5, 3]  # rows of each step's global batch of 8 on ranks 0 and 1


def _profiled_rank(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Rank ``rank`` of a DDP run with every study on, 4 steps, updates at 0 and 2, studies at 0 only."""
    model = make_net()
    net = nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    pre = HyLoPreconditioner(
        net,
        **STUDY_RUN,
        profile_dir=directory,
        rank_every=2,
        grad_error_every=2,
        grad_error_methods=("kid", "kfac"),
    )
    start = sum(COUNTS[:rank])
    train(net, pre, range(4), torch.optim.SGD(net.parameters(), lr=0.1), rows=slice(start, start + COUNTS[rank]))
    pre.close()
    return {"world_size": pre.comm.world_size, "rank": pre.comm.rank}


@pytest.mark.explicit_device(reason="forks gloo ranks on the CPU (NCCL: tests/library/test_distributed.py)")
def test_files_at_two_ranks(tmp_path: Path) -> None:
    """Each rank writes its own timing and steps files; rank 0 alone writes the others, once; update
    steps send bytes (the studies' traffic not counted), steps between updates none; the rank study sees
    the global batch."""
    directory = tmp_path / "profile"
    results = run_distributed(_profiled_rank, 2, str(directory), timeout=90.0)
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["timing-r0.csv", "timing-r1.csv", "steps-r0.csv", "steps-r1.csv", *RANK_FILES]
    )
    for path in directory.glob("*.csv"):
        assert_whole_lines(path)
    updates = [0, 2]
    for rank in (0, 1):
        timing = read(directory, f"timing-r{rank}.csv")
        assert list(timing.columns) == TIMING_COLUMNS
        assert keys(timing, "step", "layer") == list(itertools.product(updates, LAYERS))
        assert (timing.rows == COUNTS[rank]).all()
        for row in timing.itertuples():
            assert row.rows_kept == (COUNTS[rank] // 2 if row.solver in ("kid", "kis") else COUNTS[rank])
            assert (row.d_a, row.d_g) == DIMS[row.layer]
        assert (timing.bytes_sent > 0).all(), timing[["step", "layer", "bytes_sent"]]
        steps = read(directory, f"steps-r{rank}.csv")
        assert list(steps.step) == [0, 1, 2, 3]
        for row in steps.itertuples():  # every interval is charged to a written slot or phase
            parts = sum(getattr(row, c) for c in [*SLOTS_MS, *PHASES_MS])
            assert parts == pytest.approx(row.step_ms, rel=tolerances().clock), (rank, row)
        assert list(steps.kind) == ["update", "apply", "update", "apply"]
        update_rows = steps[steps.kind == "update"]
        assert (update_rows.bytes_sent > 0).all()
        # the step's traffic is the layers' plus control messages (counts, flags), studies excluded
        for row in update_rows.itertuples():
            assert row.bytes_sent >= timing[timing.step == row.step].bytes_sent.sum()
        # "inverse": between updates only the step's agreement (int32 flags: finite, usable, no gradients added
        # onto the last step's, options as last compared, and per layer "has a gradient" and "has no rows"),
        # no layer traffic
        assert (steps[steps.kind == "apply"].bytes_sent == 4 * (4 + 2 * len(LAYERS))).all()
        # both updates exchange the same payloads; only step 0 also runs the studies, whose traffic is left out
        assert list(steps.study_ms > 0) == [True, False, False, False]
        # ... but the first step also compares the ranks' fingerprints: 2 int64 per field (hylo's version,
        # the layers, sharding, and every option a rank may not set for itself)
        n_fields = 3 + sum(spec.name not in fingerprint.RANK_LOCAL for spec in options())
        first, later = update_rows.bytes_sent
        assert first - later == 16 * n_fields, update_rows
        by_step = [list(timing[timing.step == s].bytes_sent) for s in updates]
        assert by_step[0] == by_step[1]

    norms = read(directory, "grad-norm.csv")
    assert keys(norms, "step", "layer") == list(itertools.product(range(4), LAYERS))
    decisions = read(directory, "decisions.csv")
    assert keys(decisions, "step", "layer") == list(itertools.product(updates, LAYERS))
    ranks = read(directory, "rank-analysis.csv")
    assert keys(ranks, "step", "layer") == list(itertools.product([0], LAYERS))
    assert (ranks.batch_rows == sum(COUNTS)).all()
    errors = read(directory, "grad-error.csv")
    assert keys(errors, "step", "method", "layer") == list(itertools.product([0], ["kid", "kfac"], LAYERS))
    run = json.loads((directory / "run.json").read_text())
    assert run["world_size"] == 2 and "resumed" not in run


# ============================================================================ 3. killed and exiting runs
KILLED_SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
import hylo

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(100, 3))
pre = hylo.HyLoPreconditioner(
    model, update_freq=int(sys.argv[2]), damping=1e-2, profile_dir=sys.argv[1],
    studies=("grad_norm", "rank", "grad_error"),
)
gen = torch.Generator().manual_seed(0)
step = 0
while step < int(sys.argv[3]):
    model.zero_grad()
    F.cross_entropy(model(torch.randn(8, 2, 5, 5, generator=gen)), torch.randint(0, 3, (8,), generator=gen)).backward()
    pre.step()
    step += 1
"""


def _start(directory: Path, update_freq: int, steps: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-c", KILLED_SCRIPT, str(directory), str(update_freq), str(steps)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )


def _line_count(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_sigkill_leaves_whole_lines(tmp_path: Path) -> None:
    """A training loop killed by SIGKILL in the middle of its run leaves CSVs of whole lines that pandas reads."""
    directory = tmp_path / "profile"
    log = tmp_path / "stderr.txt"
    proc = _start(directory, update_freq=1, steps=10**9, log=log)
    try:
        deadline = time.monotonic() + 60.0
        while _line_count(directory / "timing-r0.csv") < 1 + 2 * 6:  # header + 6 updates of 2 layers
            assert proc.poll() is None, f"the training process exited early: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no update rows within 60 s"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)  # while the other files of this flush are being written, if ever
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    names = sorted(p.name for p in directory.iterdir())
    assert set(names) <= {"timing-r0.csv", "steps-r0.csv", *RANK_FILES}, names
    assert {"timing-r0.csv", "steps-r0.csv", "run.json", "decisions.csv"} <= set(names)
    for path in directory.glob("*.csv"):
        assert_whole_lines(path)
        frame = read(directory, path.name)
        assert len(frame) > 0 and not frame.step.isna().any(), path.name
    json.loads((directory / "run.json").read_text())
    assert len(read(directory, "timing-r0.csv")) >= 2 * 6


def test_exit_without_close_writes_every_row(tmp_path: Path) -> None:
    """A script that never calls close(): at interpreter exit the rows of its last steps (after its last
    update) are written too."""
    directory = tmp_path / "profile"
    log = tmp_path / "stderr.txt"
    proc = _start(directory, update_freq=4, steps=7, log=log)  # updates 0, 4; steps 5, 6 after the last flush
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert list(read(directory, "steps-r0.csv").step) == list(range(7))
    assert list(read(directory, "grad-norm.csv").step.unique()) == list(range(7))
    assert list(read(directory, "timing-r0.csv").step.unique()) == [0, 4]


# ============================================================================ 4. refusal and resume
def _profiled(directory: Path, **options: Any) -> tuple[Net, HyLoPreconditioner]:
    model = make_net()
    settings: dict[str, Any] = {
        "solver": "kis",
        "update_freq": 2,
        "damping": 1e-2,
        "rank_ratio": 0.5,
        "profile_dir": directory,
        "studies": ("grad_norm", "rank"),
        "rank_top_k": 3,
    }
    return model, HyLoPreconditioner(model, **{**settings, **options})


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_refused_directory_leaves_no_hooks(tmp_path: Path) -> None:
    """The constructor that refuses profile_dir removes the hooks it had registered on the model."""
    model = make_net()
    pre = HyLoPreconditioner(model, profile_dir=tmp_path)
    pre.close()
    (tmp_path / "steps-r0.csv").write_text("step\n0\n")
    hooked = [hooks(m) for m in model.modules()]
    with pytest.raises(ValueError, match="profile_append"):
        HyLoPreconditioner(model, profile_dir=tmp_path)
    assert [hooks(m) for m in model.modules()] == hooked


def test_existing_files_are_refused_unless_appending(tmp_path: Path) -> None:
    """A second run on the same directory raises ValueError naming it and profile_append (and touches
    nothing); with profile_append=True and the first run's state the files continue."""
    directory = tmp_path / "profile"
    model, pre = _profiled(directory)
    train(model, pre, range(5))  # updates 0, 2, 4
    state = pre.state_dict()
    pre.close()
    first = _snapshot(directory)
    assert set(first) == {
        "timing-r0.csv",
        "steps-r0.csv",
        "grad-norm.csv",
        "rank-analysis.csv",
        "decisions.csv",
        "run.json",
    }

    with pytest.raises(ValueError) as refused:
        _profiled(directory)
    assert str(directory) in str(refused.value) and "profile_append" in str(refused.value)
    assert _snapshot(directory) == first

    model, pre = _profiled(directory, profile_append=True)
    pre.load_state_dict(state)
    train(model, pre, range(5, 9))  # updates 6, 8
    pre.close()
    for name in first:
        if name.endswith(".csv"):
            path = directory / name
            assert_whole_lines(path)
            assert path.read_bytes().startswith(first[name]), f"{name}: the first run's rows were rewritten"
    steps = read(directory, "steps-r0.csv")
    assert list(steps.step) == list(range(9))
    assert list(steps.kind) == ["update" if s % 2 == 0 else "apply" for s in range(9)]
    assert list(read(directory, "timing-r0.csv").step.unique()) == [0, 2, 4, 6, 8]
    assert list(read(directory, "rank-analysis.csv").step.unique()) == [0, 2, 4, 6, 8]
    assert list(read(directory, "grad-norm.csv").step.unique()) == list(range(9))
    run = json.loads((directory / "run.json").read_text())
    before = json.loads(first["run.json"])
    assert run["start_time"] == before["start_time"] and run["config"] == before["config"]
    assert len(run["resumed"]) == 1
    resumed = run["resumed"][0]
    assert resumed["config"]["profile_append"] is True
    assert resumed["start_time"] >= before["start_time"]


def test_directory_with_unrelated_files_is_accepted(tmp_path: Path) -> None:
    """Files hylo does not write (the training script's own logs) do not make a directory "used"; any of
    hylo's files does, even another rank's."""
    directory = tmp_path / "logs"
    directory.mkdir()
    (directory / "metrics.csv").write_text("epoch,loss\n0,1.0\n")
    (directory / "timing.csv").write_text("x\n")
    (directory / "notes").mkdir()
    model, pre = _profiled(directory)
    train(model, pre, range(3))
    pre.close()
    assert (directory / "metrics.csv").read_text() == "epoch,loss\n0,1.0\n"
    assert list(read(directory, "steps-r0.csv").step) == [0, 1, 2]

    other = tmp_path / "other"
    other.mkdir()
    (other / "steps-r3.csv").write_text("step\n")
    with pytest.raises(ValueError, match="profile_append"):
        _profiled(other)


def test_append_with_other_columns_is_refused(tmp_path: Path) -> None:
    """Appending with a different rank_top_k (other sv_ columns) raises ValueError naming the file; nothing changes."""
    directory = tmp_path / "profile"
    model, pre = _profiled(directory)
    train(model, pre, range(3))
    state = pre.state_dict()
    pre.close()
    first = _snapshot(directory)
    with pytest.raises(ValueError, match="rank-analysis.csv"):
        _profiled(directory, profile_append=True, rank_top_k=5)
    assert _snapshot(directory) == first
    # the same settings do append
    model, pre = _profiled(directory, profile_append=True)
    pre.load_state_dict(state)
    train(model, pre, range(3, 5))
    pre.close()
    assert list(read(directory, "steps-r0.csv").step) == list(range(5))


# ============================================================================ 5. timing fidelity
def test_timing_adds_up_to_the_wall_time(tmp_path: Path) -> None:
    """On update steps the six phases of the step's timing rows plus its check, decide and study slots are
    within 20% of the wall time of ``step()`` (median over updates); step_ms never exceeds it."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )
    pre = HyLoPreconditioner(model, update_freq=2, damping=1e-2, profile_dir=tmp_path)
    gen = torch.Generator().manual_seed(0)
    wall: dict[int, float] = {}
    for step in range(14):
        model.zero_grad()
        F.cross_entropy(
            model(torch.randn(256, 3, 16, 16, generator=gen)), torch.randint(0, 10, (256,), generator=gen)
        ).backward()
        start = time.perf_counter()
        pre.step()
        wall[step] = 1e3 * (time.perf_counter() - start)
    pre.close()
    steps = read(tmp_path, "steps-r0.csv").set_index("step")
    timing = read(tmp_path, "timing-r0.csv")
    assert (steps.step_ms <= pd.Series(wall)).all(), (steps.step_ms, wall)
    ratios, update_walls = [], []
    for step in range(2, 14, 2):  # step 0 pays one-time costs
        accounted = timing[timing.step == step][PHASES_MS].to_numpy().sum() + steps.loc[step, SLOTS_MS].sum()
        ratios.append(accounted / wall[step])
        update_walls.append(wall[step])
    assert statistics.median(update_walls) >= 5.0, f"step() too quick to time: {update_walls}"
    assert 0.8 <= statistics.median(ratios) <= 1.2, f"accounted / wall time per update: {ratios}"


# ============================================================================ 6. profiling off
def test_profiling_off_costs_no_sync_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_dir=None: one host sync per non-update step (as before profiling existed), no recorder, no
    files; with profiling and the grad_norm study on, a non-update step still syncs once."""
    monkeypatch.chdir(tmp_path)

    def syncs(directory: Path | None) -> tuple[list[int], HyLoPreconditioner]:
        """Host syncs of each of 4 steps (updates at 0 and 3)."""
        model = make_net()
        options: dict[str, Any] = {"profile_dir": directory, "studies": ("grad_norm",)} if directory else {}
        pre = HyLoPreconditioner(model, solver="hybrid", update_freq=3, damping=1e-2, **options)
        counts = []
        with counting_host_syncs(monkeypatch) as calls:
            for step in range(4):
                model.zero_grad()
                x, y = data(step)
                F.cross_entropy(model(x), y).backward()
                before = sum(calls.values())
                pre.step()
                counts.append(sum(calls.values()) - before)
        return counts, pre

    off, pre = syncs(None)
    assert off[1] == off[2] == 1, off
    progress = pre.progress()
    assert not progress.profiling and not progress.studies and not progress.timing
    assert list(tmp_path.iterdir()) == []

    on, pre = syncs(tmp_path / "profile")
    assert on[1] == on[2] == 1, on
    assert pre.progress().profiling
    pre.close()


# ============================================================================ 7. training unperturbed
@pytest.mark.parametrize("solver", ["kis", "hybrid"])
def test_training_is_the_same_with_profiling_and_studies(tmp_path: Path, solver: str) -> None:
    """Same seed, model and data: the parameters after 6 steps are bit-identical with and without
    profiling and all three studies (the studies draw no number from the run's generator)."""

    def run(directory: Path | None) -> tuple[dict[str, Tensor], list[str]]:
        model = make_net()
        options: dict[str, Any] = {}
        if directory is not None:
            options = {
                "profile_dir": directory,
                "studies": STUDIES,
                "grad_error_methods": ("kid", "kis", "kfac"),
                "grad_error_ratios": (0.25, 0.5),
            }
        # (hybrid: a high threshold turns layers stable (KIS) from the second update on)
        pre = HyLoPreconditioner(
            model,
            solver=solver,
            update_freq=2,
            damping=1e-2,
            rank_ratio=0.5,
            trend_window=1,
            critical_enter=5.0,
            critical_exit=4.0,
            **options,
        )
        train(model, pre, range(6), torch.optim.SGD(model.parameters(), lr=0.1))
        pre.close()
        return {k: p.detach().clone() for k, p in model.named_parameters()}, [d.solver for d in pre.decision_log]

    plain, plain_solvers = run(None)
    profiled, profiled_solvers = run(tmp_path)
    assert len(read(tmp_path, "grad-error.csv")) == 3 * len(LAYERS) * 5  # the studies did run
    assert profiled_solvers == plain_solvers
    assert "kis" in plain_solvers and (solver == "kis" or "kid" in plain_solvers)
    assert plain.keys() == profiled.keys()
    for name, value in plain.items():
        assert torch.equal(value, profiled[name]), name


# ============================================================================ 8. close, remove, finalizer
def test_close_flushes_once_and_stops_recording(tmp_path: Path) -> None:
    """close() writes the rows buffered since the last update, is idempotent, and nothing is written after it."""
    model, pre = _profiled(tmp_path, studies=("grad_norm",))
    train(model, pre, range(4))  # updates 0, 2: step 3's rows are buffered
    assert list(read(tmp_path, "steps-r0.csv").step) == [0, 1, 2]
    assert list(read(tmp_path, "grad-norm.csv").step.unique()) == [0, 1, 2]
    pre.close()
    closed = _snapshot(tmp_path)
    assert list(read(tmp_path, "steps-r0.csv").step) == [0, 1, 2, 3]
    assert list(read(tmp_path, "grad-norm.csv").step.unique()) == [0, 1, 2, 3]
    pre.close()
    train(model, pre, range(4, 7))  # training continues, unrecorded
    pre.close()
    assert _snapshot(tmp_path) == closed
    assert not pre.progress().profiling


def test_remove_closes(tmp_path: Path) -> None:
    """remove() flushes and closes the files too."""
    model, pre = _profiled(tmp_path, studies=("grad_norm",))
    train(model, pre, range(4))
    pre.remove()
    assert not pre.progress().profiling
    assert list(read(tmp_path, "steps-r0.csv").step) == [0, 1, 2, 3]
    assert list(read(tmp_path, "grad-norm.csv").step.unique()) == [0, 1, 2, 3]
    pre.close()
    model.zero_grad()
    x, y = data(0)
    F.cross_entropy(model(x), y).backward()  # the model trains on without hylo
    assert list(read(tmp_path, "steps-r0.csv").step) == [0, 1, 2, 3]


def test_dropped_preconditioner_writes_its_rows(tmp_path: Path) -> None:
    """A preconditioner that is dropped without close() (the model lives on) writes its buffered rows when
    collected."""
    model, pre = _profiled(tmp_path, studies=("grad_norm",))
    train(model, pre, range(4))
    assert list(read(tmp_path, "steps-r0.csv").step) == [0, 1, 2]
    del pre
    gc.collect()
    assert list(read(tmp_path, "steps-r0.csv").step) == [0, 1, 2, 3]
    assert list(read(tmp_path, "grad-norm.csv").step.unique()) == [0, 1, 2, 3]
    model.zero_grad()
    x, y = data(0)
    F.cross_entropy(model(x), y).backward()  # the model still trains
    assert all(p.grad is not None for p in model.parameters())


# ============================================================================ 9. gradient norms
def test_grad_norm_before_and_after_preconditioning(tmp_path: Path) -> None:
    """grad-norm.csv's norm is each layer's gradient norm (weight and bias together) before step(),
    norm_after the norm of what step() wrote (kl_clip's scaling included), at every step."""
    model, pre = _profiled(tmp_path, studies=("grad_norm",), solver="hybrid", kl_clip=1e-3, lr=0.1)
    before: dict[int, dict[str, float]] = {}
    after: dict[int, dict[str, float]] = {}
    steps = range(6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        optimizer.zero_grad()
        x, y = data(step)
        F.cross_entropy(model(x), y).backward()
        before[step] = layer_norms(model)
        pre.step()
        after[step] = layer_norms(model)
        optimizer.step()
    pre.close()
    norms = read(tmp_path, "grad-norm.csv")
    assert keys(norms, "step", "layer") == list(itertools.product(steps, LAYERS))
    for row in norms.itertuples():
        assert row.norm == pytest.approx(before[row.step][row.layer], rel=1e-5), row
        assert row.norm_after == pytest.approx(after[row.step][row.layer], rel=1e-5), row
    # preconditioning changed the norms (the two columns are not the same numbers)
    assert (abs(norms.norm_after / norms.norm - 1) > 1e-3).all()
