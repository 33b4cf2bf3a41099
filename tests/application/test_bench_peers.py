"""scripts/bench_peers.py: its flags, the per-seed targets, the combined optimizer, the training loop's hooks for
other optimizers, the same start for every method, a skipped package, the interleaved per-step cost (its blocks of
whole cycles, its rounds, the time to a target from it) and one tiny run's CSV."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hylo_scripts.benchmarks import bench_accuracy, bench_interleave, bench_peers, peers
from hylo_scripts.benchmarks.bench_accuracy import LMCurve
from hylo_scripts.benchmarks.bench_interleave import Cost, Stepper
from hylo_scripts.training import loop
from hylo_scripts.training.hylo_options import ADAPTIVE_LR
from hylo_scripts.training.loop import make_optimizer, train
from hylo_scripts.training.optimizers import CombinedOptimizer
from hylo_scripts.training.runconfig import RunConfig

pytestmark = pytest.mark.usefixtures("single_thread")

#: A tiny language-model run (the quick bench's sizes): 2 intervals of 2 steps.
TINY = RunConfig(
    dataset="stdlib",
    model="transformer",
    seq_len=16,
    layers=1,
    width=32,
    heads=2,
    max_bytes=20_000,
    optimizer="adamw",
    epochs=2,
    max_steps=2,
    batch_size=8,
    lr=2e-3,
    lr_schedule="cosine",
    warmup_epochs=0.5,
    weight_decay=0.01,
)
#: The quick bench on lm, one seed, on CPU.
QUICK = ["--task", "lm", "--quick", "--seeds", "0", "--threads", "1", "--device", "cpu", "--steps", "4"]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


# --------------------------------------------------------------------------- flags
def test_flags_default_to_every_peer_both_tasks_three_seeds() -> None:
    args = bench_peers.parse_args(["--device", "cpu"])
    assert args.tasks == ("classification", "lm") and args.seeds == [0, 1, 2]
    assert args.methods == ["muon", "muon-f32", "soap", "shampoo", "singd", "kaisa"] and args.solvers == [
        "kfac",
        "hybrid",
    ]
    assert args.lrs == {} and args.out == Path("peers.csv")
    assert (args.cost_rounds, args.cost_warmup, args.cost_block, args.batch_size) == (5, 1, 60, None)
    lm = bench_peers.task_args(args, "lm")
    assert (lm.batch_size, lm.seq_len, lm.max_bytes) == (32, 64, 1_000_000)  # 2,048 tokens a step
    assert bench_peers.parse_args(["--quick", "--device", "cpu"]).cost_rounds == 2
    args = bench_peers.parse_args(["--task", "lm", "--lrs", "muon=0.01,0.03", "hylo-kfac=1e-3", "--device", "cpu"])
    assert args.lrs == {"muon": (0.01, 0.03), "hylo-kfac": (1e-3,)}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lrs", "muon"], "expected METHOD=lr,lr"),
        (["--lrs", "adam=0.1"], "unknown method 'adam'"),
        (["--lrs", "soap=0.1,x"], "could not convert"),
        (["--lrs", "soap=-0.1"], "every lr must be a finite number > 0"),
        (["--task", "classification", "--steps", "100"], "--steps: not a flag of --task classification"),
        (["--task", "lm", "--iterations", "100"], "--iterations: not a flag of --task lm"),
        (["--task", "lm", "--steps", "10"], "lm: 10 steps is fewer than one evaluation interval (25)"),
        (["--methods", "adam"], "invalid choice: 'adam'"),
        (["--steps", "0"], "must be an int >= 1"),
        (["--task", "classification", "--batch-size", "64"], "--batch-size: not a flag of --task classification"),
        (["--task", "classification", "--max-bytes", "9"], "--max-bytes: not a flag of --task classification"),
        (["--cost-rounds", "-1"], "--cost-rounds and --cost-warmup must be >= 0"),
        (["--cost-block", "0"], "must be an int >= 1"),
        (["--variant", "a", "damping=1", "--variant", "a"], "--variant 'a' given twice"),
        (["--variant", "a-b"], "--variant 'a-b': a name of letters, digits and _ comes first"),
        (["--variant", "neg", "damping=-1"], "--variant neg: "),
    ],
)
def test_misused_flags_are_refused_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench_peers.parse_args([*argv, "--device", "cpu"])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_device_cuda_is_refused_on_a_cpu_only_machine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--device", "cuda"])
    assert "cuda: no CUDA device is available on this machine" in capsys.readouterr().err


def test_a_variant_is_another_hylo_method_per_solver_with_its_options_over_set() -> None:
    """``--variant NAME KEY=VALUE ...``: ``hylo-<solver>-NAME`` beside ``hylo-<solver>``, its runs with its options
    over ``--set``'s (the two hylos of one race: a before and an after in one interleaved timing)."""
    argv = ["--task", "lm", "--solvers", "kfac_adam", "--set", "damping=0.5", "update_freq=4"]
    args = bench_peers.parse_args([*argv, "--variant", "often", "update_freq=2", "--lrs", "hylo-kfac_adam-often=1e-3"])
    assert args.variants == {"often": {"update_freq": 2}} and args.lrs == {"hylo-kfac_adam-often": (1e-3,)}
    lm = bench_peers.task_args(args, "lm")
    plain, often = peers.hylo_method("kfac_adam"), peers.hylo_method("kfac_adam", "often", {"update_freq": 2})
    assert often.name == "hylo-kfac_adam-often" and often.grids == plain.grids
    hylo = dict(args.set)
    assert bench_peers.run_config(lm, "lm", plain, 1e-3, 0, hylo).hylo["update_freq"] == 4
    cfg = bench_peers.run_config(lm, "lm", often, 1e-3, 0, hylo)
    assert (cfg.hylo["update_freq"], cfg.hylo["damping"]) == (2, 0.5) and bench_peers.cycle_of(often, cfg) == 2


def test_the_users_regime_takes_8x_the_tokens_a_step_over_as_many_passes_of_the_data() -> None:
    """``--batch-size 256``: 8× the windows of a step, and 8× the training bytes unless ``--max-bytes`` says; the
    step count and the evaluation cadence stay."""
    lm = bench_peers.task_args(bench_peers.parse_args(["--task", "lm", "--batch-size", "256"]), "lm")
    assert (lm.batch_size, lm.max_bytes, lm.steps, lm.eval_every) == (256, 8_000_000, 400, 25)
    told = bench_peers.parse_args(["--task", "lm", "--batch-size", "256", "--max-bytes", "3000000"])
    assert bench_peers.task_args(told, "lm").max_bytes == 3_000_000
    cfg = bench_peers.run_config(lm, "lm", peers.METHODS["adamw"], 2e-3, 0, {})
    assert (cfg.batch_size, cfg.seq_len, cfg.max_bytes) == (256, 64, 8_000_000)
    assert "batch 256 × 64 tokens" in bench_peers.regime("lm", lm)


# --------------------------------------------------------------------------- the interleaved per-step cost
def test_blocks_are_the_common_multiple_of_every_cycle_or_each_methods_whole_cycles_within_the_cap() -> None:
    cycles = {"adamw": 1, "muon": 1, "hylo-kfac_adam": 3, "soap": 10}
    assert bench_interleave.block_lengths(cycles) == dict.fromkeys(cycles, 30)
    assert bench_interleave.block_lengths(cycles, cap=20) == {"adamw": 20, "muon": 20, "hylo-kfac_adam": 18, "soap": 20}
    assert bench_interleave.block_lengths({"a": 1, "b": 7, "c": 9}, cap=5) == {"a": 5, "b": 7, "c": 9}  # ≥ one cycle
    # at least 10 steps (whole multiples of the common cycle) where the cap allows
    assert bench_interleave.block_lengths({"adamw": 1, "muon": 1}) == {"adamw": 10, "muon": 10}
    assert bench_interleave.block_lengths({"adamw": 1, "hylo": 3}) == {"adamw": 12, "hylo": 12}
    assert bench_interleave.block_lengths({"adamw": 1, "hylo": 3}, cap=8) == {"adamw": 6, "hylo": 6}
    with pytest.raises(ValueError, match="must be >= 1"):
        bench_interleave.block_lengths({"a": 0})


def test_each_method_cycle_is_hylos_update_freq_or_the_peers_refresh_period() -> None:
    args = bench_peers.task_args(bench_peers.parse_args(["--task", "lm"]), "lm")
    cycle = {
        name: bench_peers.cycle_of(method, bench_peers.run_config(args, "lm", method, 1e-3, 0, {}, 2e-3))
        for name, method in [*peers.METHODS.items(), ("hylo-kfac_adam", peers.hylo_method("kfac_adam"))]
    }
    assert cycle == {"sgd": 1, "adamw": 1, "muon": 1, "muon-f32": 1, "soap": 10, "shampoo": 10, "singd": 10} | {
        "kaisa": 10,
        "hylo-kfac_adam": 3,
    }


class FakeMachine:
    """A clock and steppers whose every step costs a method's seconds times the machine's slowdown, which doubles
    from one round (one block of every method) to the next: the drift the interleaving must see through."""

    def __init__(self, per_step: dict[str, float]) -> None:
        self.now = 0.0
        self.calls: list[tuple[str, int]] = []
        self.per_step = per_step

    def clock(self) -> float:
        return self.now

    def slowdown(self) -> float:
        return 2.0 ** (len(self.calls) // len(self.per_step))

    def stepper(self, name: str) -> Any:
        def take(steps: int) -> None:
            self.now += steps * self.per_step[name] * self.slowdown()
            self.calls.append((name, steps))

        return take


def test_interleaving_steps_every_method_one_block_of_whole_cycles_per_round_in_rotating_order() -> None:
    machine = FakeMachine({"adamw": 0.010, "muon": 0.012, "hylo": 0.015})
    blocks = bench_interleave.block_lengths({"adamw": 1, "muon": 1, "hylo": 3}, cap=60)
    seconds = bench_interleave.interleave(
        {name: machine.stepper(name) for name in machine.per_step}, blocks, rounds=3, warmup=1, clock=machine.clock
    )
    warmup, timed = machine.calls[:3], machine.calls[3:]
    assert warmup == [("adamw", 12), ("muon", 12), ("hylo", 12)]  # untimed, whole cycles
    assert [name for name, _ in timed] == ["adamw", "muon", "hylo", "muon", "hylo", "adamw", "hylo", "adamw", "muon"]
    assert all(steps == 12 for _, steps in timed)
    # round r runs at 2^(r+1) the base cost (the warm-up was round 0): each block's per-step time, exactly
    for name, cost in machine.per_step.items():
        assert seconds[name] == pytest.approx([cost * 2.0, cost * 4.0, cost * 8.0])
    costs = bench_interleave.costs(seconds, blocks, "adamw")
    assert costs["adamw"].ratio == pytest.approx(1.0) and costs["adamw"].ms_per_step == pytest.approx(10.0 * 14 / 3)
    # the machine's speed drifted 4× over the rounds; every round's ratio is still the true one
    assert costs["hylo"].round_ratios == pytest.approx((1.5, 1.5, 1.5)) and costs["hylo"].ratio == pytest.approx(1.5)
    assert (costs["muon"].block, costs["muon"].rounds) == (12, 3)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench_interleave.interleave({}, {}, rounds=0, clock=machine.clock)


def test_time_to_a_target_is_the_deterministic_steps_times_the_interleaved_cost() -> None:
    adamw = Cost(ms_per_step=50.0, ratio=1.0, round_ratios=(1.0, 1.0), block=30, rounds=2)
    hylo = Cost(ms_per_step=80.0, ratio=1.6, round_ratios=(1.5, 1.7), block=30, rounds=2)
    muon = Cost(ms_per_step=55.0, ratio=1.1, round_ratios=(1.1, 1.1), block=30, rounds=2)
    assert bench_interleave.time_to(125, hylo) == pytest.approx(10.0) and bench_interleave.time_to(None, hylo) is None
    reached = {"steps_to_target": 125, "baseline_steps": 400}
    timed = bench_peers.interleaved_reach(reached, hylo, adamw)
    assert timed["interleaved_seconds_to_target"] == pytest.approx(10.0)
    assert timed["interleaved_time_ratio"] == pytest.approx(125 * 80.0 / (400 * 50.0))  # 0.3125 × 1.6 = 0.5
    assert bench_peers.interleaved_reach({"steps_to_target": None, "baseline_steps": 400}, hylo, adamw) == {
        "interleaved_seconds_to_target": None,
        "interleaved_time_ratio": None,
    }
    assert bench_peers.interleaved_reach(reached, hylo, None)["interleaved_time_ratio"] is None  # no baseline cost
    columns = bench_peers.cost_columns(hylo)
    assert (columns["cost_ratio_median"], columns["cost_ratio_min"], columns["cost_ratio_max"]) == (1.6, 1.5, 1.7)
    # the second target: Muon's final value at its best lr, per seed, and its own steps to it (150)
    run = _run("hylo", 4e-3, 0, [(100, 1.0, 1.60), (125, 2.0, 1.50), (150, 3.0, 1.45)])
    second = bench_peers.second_reach(run, "muon", {0: (1.51, 150, 9.0)}, hylo, muon)
    assert (second["steps_to_second"], second["second_step_ratio"]) == (125, pytest.approx(125 / 150))
    assert second["interleaved_seconds_to_second"] == pytest.approx(10.0)
    assert second["second_time_ratio"] == pytest.approx(125 * 80.0 / (150 * 55.0))
    assert bench_peers.second_reach(run, None, {}, hylo, muon)["second_target"] is None


@pytest.mark.parametrize("method", ["adamw", "muon", "hylo-kfac_adam"])
def test_a_stepper_takes_the_runs_own_steps(method: str) -> None:
    """The interleaved timing steps what the run stepped: after the run's steps, the stepper's model has the run's
    test loss to the bit (the loop, with its evaluations between intervals, is the reference)."""
    if method == "hylo-kfac_adam":
        cfg = RunConfig(**{**TINY.__dict__, "solver": "kfac_adam", "rest_lr": 1e-3, "hylo": {"update_freq": 3}})
        factory = None
    else:
        cfg = TINY
        factory = None if method == "adamw" else peers.METHODS[method].optimizer(0.02, 2e-3)  # type: ignore[misc]
    data = bench_peers.load("lm", argparse.Namespace(seq_len=16, max_bytes=20_000, eval_windows=8))
    want = train(cfg, data, optimizer_factory=factory).log[-1].test_loss
    stepper = Stepper(cfg, data, torch.device("cpu"), optimizer_factory=factory, steps=3)
    stepper(1)
    stepper(3)  # blocks resume where the last one stopped
    assert loop.evaluate(stepper.model, cfg, data, torch.device("cpu"))[0] == want
    stepper.close()


def test_a_stepper_stretches_the_run_when_the_timing_needs_more_steps() -> None:
    stepper = Stepper(
        TINY,
        bench_peers.load("lm", argparse.Namespace(seq_len=16, max_bytes=20_000, eval_windows=8)),
        torch.device("cpu"),
        steps=9,
    )
    assert stepper.cfg.epochs == 5 and TINY.epochs == 2  # 2 steps an epoch
    stepper(9)
    assert stepper.optimizer.param_groups[0]["lr"] > 0  # still inside the stretched schedule


# --------------------------------------------------------------------------- targets and ratios
def _run(method: str, lr: float, seed: int, points: list[tuple[int, float, float]]) -> bench_peers.Run:
    return bench_peers.Run(method, LMCurve(method, lr, seed, points), 10.0)


def test_each_seed_targets_the_baselines_final_value_at_its_best_lr() -> None:
    runs = [
        _run("adamw", 1e-3, 0, [(10, 1.0, 3.0), (20, 2.0, 2.0)]),
        _run("adamw", 1e-3, 1, [(10, 1.0, 3.0), (20, 2.0, 2.2)]),
        _run("adamw", 2e-3, 0, [(10, 1.0, 1.5), (20, 2.0, 1.5)]),  # reaches its own final value at step 10
        _run("adamw", 2e-3, 1, [(10, 1.0, 2.0), (20, 2.0, 1.6)]),
        _run("muon", 0.02, 0, [(10, 4.0, 1.4), (20, 8.0, 1.0)]),
        _run("muon", 0.02, 1, [(10, 4.0, 1.7), (20, 8.0, 1.65)]),
        _run("muon", 0.04, 0, [(10, 4.0, float("nan")), (20, 8.0, float("nan"))]),  # diverged: ranks last
        _run("muon", 0.04, 1, [(10, 4.0, 0.5), (20, 8.0, 0.5)]),
    ]
    assert bench_peers.best_lr(runs, "adamw") == 2e-3
    assert bench_peers.best_lr(runs, "muon") == 0.02  # medians: 0.02 → 1.325, 0.04 → (0.5 + inf) / 2
    goals = bench_peers.targets(runs, "adamw", 2e-3)
    assert goals == {0: (1.5, 10, 1.0), 1: (1.6, 20, 2.0)}
    seed0 = bench_peers.reach(runs[4], goals)
    assert (seed0["steps_to_target"], seed0["seconds_to_target"], seed0["step_ratio"], seed0["time_ratio"]) == (
        10,
        4.0,
        1.0,
        4.0,
    )
    seed1 = bench_peers.reach(runs[5], goals)
    assert seed1["target"] == 1.6 and seed1["steps_to_target"] is None and seed1["step_ratio"] is None
    assert bench_peers.reach(_run("muon", 0.02, 7, [(10, 1.0, 0.1)]), goals)["target"] is None  # no baseline seed 7


def test_classification_curves_are_errors_so_the_target_is_reached_upwards() -> None:
    result = loop.RunResult(TINY)
    for step, interval_s, seconds, accuracy in [(8, 1.0, 1.0, 0.90), (16, 1.5, 2.5, 0.96), (24, 0.5, 3.0, 0.95)]:
        result.log.append(loop.EpochLog(step // 8, step, 0.1, 0.3, 0.2, accuracy, interval_s, seconds, 0.0))
    run = bench_peers.to_run("sgd", 0.1, 0, result, "classification")
    assert run.curve.first_below(1.0 - 0.955) == (16, 2.5)
    assert bench_peers.metric_of("classification", run.curve.final_loss) == pytest.approx(95.0)
    assert run.ms_per_step == pytest.approx(1000.0 * 1.0 / 8)  # median of 125, 187.5, 62.5 ms per step


# --------------------------------------------------------------------------- the combined optimizer
def test_combined_muon_and_adamw_step_every_parameter_once_at_each_groups_scheduled_lr() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 11))
    twin = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 11))
    twin.load_state_dict(model.state_dict())
    matrices = peers.muon_matrices(model)
    assert [tuple(p.shape) for p in matrices] == [(5, 6)]  # the hidden Linear only: not the embedding, not the head

    def split(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        mine = peers.muon_matrices(net)
        rest = [p for p in net.parameters() if all(p is not q for q in mine)]
        return torch.optim.Muon(mine, lr=0.02), torch.optim.AdamW(rest, lr=2e-3, weight_decay=0.01)

    combined = CombinedOptimizer(split(model))
    by_hand = split(twin)
    factor = [0.5, 1.0, 0.25]
    schedule = torch.optim.lr_scheduler.LambdaLR(combined, lambda step: factor[min(step, 2)])
    by_hand_schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: factor[min(step, 2)]) for o in by_hand]
    tokens = torch.randint(0, 11, (4, 3))
    for _ in range(3):
        assert [g["lr"] for g in combined.param_groups] == [g["lr"] for o in by_hand for g in o.param_groups]
        for net, optimizers in ((model, [combined]), (twin, list(by_hand))):
            for optimizer in optimizers:
                optimizer.zero_grad()
            nn.functional.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten()).backward()
            for optimizer in optimizers:
                optimizer.step()
        schedule.step()
        for s in by_hand_schedules:
            s.step()
    assert [g["lr"] for g in combined.param_groups] == [0.02 * 0.25, 2e-3 * 0.25]
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    muon_state, adamw_state = (s["state"] for s in combined.state_dict()["optimizers"])
    assert len(muon_state) == 1 and len(adamw_state) == 4  # embedding, hidden bias, head weight and bias
    assert all(float(state["step"]) == 3 for state in adamw_state.values())  # once per step


def test_combined_optimizer_refuses_a_parameter_in_two_optimizers() -> None:
    weight = nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="a parameter is in two of the optimizers"):
        CombinedOptimizer([torch.optim.SGD([weight], lr=0.1), torch.optim.AdamW([weight], lr=0.1)])


def test_kronecker_peers_leave_out_the_projections_attention_calls_functionally() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.TransformerEncoderLayer(4, 2, 8))
    names = set(peers.curvature_modules(model))
    assert names == {"0", "1.linear1", "1.linear2"}  # not "1.self_attn.out_proj"


# --------------------------------------------------------------------------- the loop's hooks
def test_an_optimizer_factory_of_the_runs_own_optimizer_trains_bit_identically() -> None:
    plain = train(TINY)
    built = train(TINY, optimizer_factory=make_optimizer)
    assert [(e.step, e.train_loss, e.test_loss, e.lr) for e in built.log] == [
        (e.step, e.train_loss, e.test_loss, e.lr) for e in plain.log
    ]


def test_a_preconditioner_factory_steps_once_per_step_between_backward_and_the_optimizer() -> None:
    seen: list[tuple[bool, float]] = []

    class Probe:
        def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
            self.weight = next(model.parameters())
            self.optimizer = optimizer
            self.before = self.weight.detach().clone()

        def step(self) -> None:
            # gradients are there, and the weights are those the last optimizer step left
            seen.append((self.weight.grad is not None, float((self.weight.detach() - self.before).abs().max())))
            self.before = self.weight.detach().clone()

    result = train(TINY, preconditioner_factory=Probe)
    assert len(seen) == result.steps == 4
    assert seen[0] == (True, 0.0) and all(grad for grad, _ in seen) and all(moved > 0 for _, moved in seen[1:])


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (RunConfig(solver="kfac"), "one preconditioner per run"),
        (RunConfig(log_dir="unused", checkpoint_freq=1), "cannot checkpoint or resume"),
    ],
)
def test_the_hooks_refuse_what_they_cannot_do(cfg: RunConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train(cfg, preconditioner_factory=lambda model, optimizer: optimizer)


# --------------------------------------------------------------------------- end to end
def test_every_method_starts_from_the_same_weights_and_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    build = loop.build_model

    def recording(*args: Any, **kwargs: Any) -> nn.Module:
        model = build(*args, **kwargs)
        weights = [p.detach().clone() for p in model.parameters()]
        inputs: list[torch.Tensor] = []
        model.register_forward_pre_hook(lambda _m, given: None if inputs else inputs.append(given[0].clone()))
        starts.append((weights, inputs))
        return model

    monkeypatch.setattr(loop, "build_model", recording)
    argv = [*QUICK, "--methods", "muon", "--solvers", "kfac", "hybrid"]  # torch alone: no optional package
    assert bench_peers.main([*argv, "--out", str(tmp_path / "peers.csv")]) == 0
    assert len(starts) == 4  # adamw, muon, hylo-kfac, hylo-hybrid
    weights, inputs = starts[0]
    for other_weights, other_inputs in starts[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights, other_weights, strict=True))
        assert torch.equal(inputs[0], other_inputs[0])


def test_a_quick_run_writes_one_csv_row_per_run_and_reports_a_missing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "singd", None)  # import singd raises ImportError
    out, curves = tmp_path / "peers.csv", tmp_path / "curves.csv"
    argv = [*QUICK, "--methods", "muon", "singd", "--solvers", "--out", str(out), "--curves", str(curves)]
    assert bench_peers.main(argv) == 0
    rows = _rows(out)
    assert list(rows[0]) == list(bench_peers.COLUMNS)
    assert [(r["method"], r["status"]) for r in rows] == [("adamw", "ok"), ("muon", "ok"), ("singd", "skipped")]
    assert "singd is not importable" in rows[2]["reason"]
    adamw, muon = rows[0], rows[1]
    assert adamw["best_lr"] == "True" and adamw["step_ratio"] == "1.0" and float(adamw["final"]) > 0
    assert float(muon["lr"]) == peers.METHODS["muon"].grids["lm"][1]  # --quick: the middle of the grid
    assert float(muon["target"]) == float(adamw["final"])
    # the interleaved cost: 2 rounds (--quick) of whole blocks, the time ratio = steps ratio × cost ratio
    for row in (adamw, muon):
        assert (row["cost_rounds"], row["block_steps"], row["batch_size"]) == ("2", "10", "8")
        assert float(row["interleaved_ms_per_step"]) > 0
    assert float(adamw["cost_ratio"]) == 1.0 and float(adamw["interleaved_time_ratio"]) == 1.0
    if muon["step_ratio"]:
        assert float(muon["interleaved_time_ratio"]) == pytest.approx(
            float(muon["step_ratio"]) * float(muon["cost_ratio"]), rel=1e-3
        )
    # the second target is Muon's own final loss: Muon reaches it in its own steps and time
    assert muon["second_method"] == "muon" and float(muon["second_target"]) == float(muon["final"])
    assert (muon["steps_to_second"], muon["second_step_ratio"], muon["second_time_ratio"]) == ("4", "1.0", "1.0")
    printed = capsys.readouterr().out
    assert "singd: skipped, singd is not importable" in printed and "final val loss" in printed
    assert "time vs muon" in printed and "seq. time ratio" in printed and "batch 8 × 16 tokens" in printed
    assert [(r["method"], r["step"]) for r in _rows(curves)] == [("adamw", "4"), ("muon", "4")]


def test_hylo_options_reach_every_hylo_run_and_bad_ones_stop_before_any(capsys: pytest.CaptureFixture[str]) -> None:
    """``--set KEY=VALUE`` is merged into every hylo run's options (the peers' and the baseline's runs have none), and
    an option hylo refuses is an argparse error before anything runs."""
    args = bench_peers.parse_args(["--task", "lm", "--quick", "--set", "damping=0.003", "kfac_method=inverse"])
    options = bench_peers.task_args(args, "lm")
    hylo_run = bench_peers.run_config(options, "lm", peers.hylo_method("kfac"), 1e-3, 0, dict(args.set))
    assert (hylo_run.hylo["damping"], hylo_run.hylo["kfac_method"]) == (0.003, "inverse")
    assert hylo_run.hylo["kl_clip"] == options.kl_clip  # the task's other options stay
    plain = bench_peers.run_config(options, "lm", peers.METHODS["adamw"], 1e-3, 0, dict(args.set))
    assert plain.hylo == {}
    with pytest.raises(SystemExit) as exit_info:
        bench_peers.parse_args(["--task", "lm", "--quick", "--set", "kfac_method=cholesky"])
    assert exit_info.value.code == 2 and "--set" in capsys.readouterr().err


# --------------------------------------------------------------------------- adaptive solvers (kfac_adam)
def test_an_adaptive_solvers_parameters_take_sgd_without_momentum_and_the_rest_the_runs_optimizer() -> None:
    """docs/training-scripts.md, "Engine": kfac_adam's result is the whole step, so its parameters take SGD
    without momentum at lr (decoupled weight decay) and the others (here the LayerNorms) the run's AdamW at
    rest_lr."""
    import hylo
    from hylo_scripts.models.registry import DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(vocab=256, context=16, layers=1, width=32, heads=2)
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam")
    cfg = RunConfig(**{**TINY.__dict__, "solver": "kfac_adam", "lr": 4e-3, "rest_lr": 2e-3, "hylo": {}})
    assert loop.adapts(cfg) and not loop.adapts(RunConfig(**{**TINY.__dict__, "solver": "kfac", "hylo": {}}))
    optimizer = make_optimizer(model, cfg, pre.parameters())
    assert isinstance(optimizer, CombinedOptimizer)
    sgd, adamw = optimizer.optimizers
    assert isinstance(sgd, torch.optim.SGD) and isinstance(adamw, torch.optim.AdamW)
    assert sgd.defaults["momentum"] == 0.0 and sgd.defaults["lr"] == 4e-3 and sgd.defaults["weight_decay"] == 0.01
    assert adamw.defaults["lr"] == 2e-3
    adapted = {id(p) for p in sgd.param_groups[0]["params"]}
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    assert adapted == {id(p) for p in pre.parameters()} and adapted.isdisjoint(norms)
    assert {id(p) for p in adamw.param_groups[0]["params"]} == norms
    assert id(model.blocks[0].attn.in_proj_weight) in adapted  # attention's packed projection, once
    pre.remove()


def test_kl_clip_is_off_by_default_for_an_adaptive_solver_and_kept_when_given() -> None:
    base = {**TINY.__dict__, "hylo": {}}
    assert RunConfig(**{**base, "solver": "kfac_adam"}).hylo["kl_clip"] is None
    assert RunConfig(**{**base, "solver": "kfac"}).hylo["kl_clip"] == 1e-3  # the scripts' default
    assert RunConfig(**{**base, "solver": "kfac_adam", "hylo": {"kl_clip": 0.01}}).hylo["kl_clip"] == 0.01


def test_the_lm_bench_refreshes_kfac_adams_basis_by_power_every_3_steps_unless_told_otherwise() -> None:
    args = bench_peers.task_args(bench_peers.parse_args(["--task", "lm"]), "lm")
    method = peers.hylo_method("kfac_adam")
    lm = bench_peers.run_config(args, "lm", method, 4e-3, 0, {}, 2e-3)
    assert (lm.hylo["update_freq"], lm.hylo["basis_refresh"], lm.rest_lr) == (3, "power", 2e-3)
    told = bench_peers.run_config(args, "lm", method, 4e-3, 0, {"update_freq": 10, "basis_refresh": "eigh"})
    assert (told.hylo["update_freq"], told.hylo["basis_refresh"]) == (10, "eigh")
    kfac = bench_peers.run_config(args, "lm", peers.hylo_method("kfac"), 2e-3, 0, {}).hylo
    assert kfac["update_freq"] == 10 and kfac.get("basis_refresh", "eigh") == "eigh"
    classification = bench_peers.task_args(bench_peers.parse_args([]), "classification")
    other = bench_peers.run_config(classification, "classification", method, 1e-2, 0, {}).hylo
    assert other["update_freq"] == 10 and other.get("basis_refresh", "eigh") == "eigh"


def test_classification_rows_carry_the_best_accuracy_and_the_steps_to_the_accuracy_goal() -> None:
    run = _run("sgd", 0.03, 0, [(8, 1.0, 0.10), (16, 2.0, 0.03), (24, 3.0, 0.05)])  # errors: 90%, 97%, 95%
    assert bench_peers.goal_reach(run, "classification", 96.0) == {
        "best": pytest.approx(97.0),
        "goal": 96.0,
        "steps_to_goal": 16,
        "seconds_to_goal": 2.0,
    }
    never = bench_peers.goal_reach(run, "classification", 98.0)
    assert never["steps_to_goal"] is None and never["best"] == pytest.approx(97.0)
    assert bench_peers.goal_reach(run, "lm", 96.0)["goal"] is None


def test_bench_accuracy_runs_an_adaptive_solver_at_adams_scale_unless_told() -> None:
    """The MNIST time-to-accuracy bench gives kfac_adam the adaptive lr (its step is Adam-scaled; at the natural
    gradient's 0.1 it diverges) and the natural-gradient solvers 0.1; ``--lr`` sets every solver's."""
    args = bench_accuracy.parse_args(["--solvers", "kfac", "kfac_adam"])
    assert [bench_accuracy.classification_lr(args, s) for s in args.solvers] == [0.1, ADAPTIVE_LR]
    args = bench_accuracy.parse_args(["--solvers", "kfac", "kfac_adam", "--lr", "0.05"])
    assert [bench_accuracy.classification_lr(args, s) for s in args.solvers] == [0.05, 0.05]


def test_float32_muon_takes_torch_muons_step_with_the_iteration_in_float32() -> None:
    """``muon-f32``: the Newton–Schulz iteration X ← aX + (bA + cA²)X, A = XXᵀ, from X = G/‖G‖_F on the wide
    orientation, written out in float64, equals the float32 one to float32 round-off and torch's bfloat16 one to
    bfloat16's; one step of :class:`~hylo_scripts.benchmarks.peers.Float32Muon` is torch's Muon step (Nesterov momentum,
    its lr adjustment, decoupled decay) with that iteration, and the stock function is back afterwards."""
    import torch.optim._muon as muon_module

    coefficients, steps, eps = (3.4445, -4.775, 2.0315), 5, 1e-7
    stock_function = muon_module._zeropower_via_newtonschulz
    gen = torch.Generator().manual_seed(0)
    for shape in ((6, 10), (10, 6)):
        grad = torch.randn(*shape, generator=gen)
        x = grad.double().mT if shape[0] > shape[1] else grad.double()
        x = x / x.norm()
        for _ in range(steps):
            gram = x @ x.mT
            x = coefficients[0] * x + (coefficients[1] * gram + coefficients[2] * gram @ gram) @ x
        want = x.mT if shape[0] > shape[1] else x
        got = peers.newton_schulz_float32(grad, coefficients, steps, eps)
        assert got.dtype == torch.float32 and got.shape == grad.shape
        assert float((got.double() - want).abs().max()) < 1e-5
        stock = stock_function(grad, coefficients, steps, eps)
        assert stock.dtype == torch.bfloat16 and 1e-4 < float((stock.double() - want).abs().max()) < 0.1
    param = nn.Parameter(torch.randn(6, 10, generator=gen))
    start, grad = param.detach().clone(), torch.randn(6, 10, generator=gen)
    param.grad = grad.clone()
    lr, decay, momentum = 0.02, 0.1, 0.95
    peers.Float32Muon([param], lr=lr, weight_decay=decay, momentum=momentum).step()
    assert muon_module._zeropower_via_newtonschulz is stock_function
    update = grad.lerp(grad * (1 - momentum), momentum)  # Nesterov: the gradient towards the first buffer
    expected = start * (1 - lr * decay) - muon_module._adjust_lr(lr, None, param.shape) * peers.newton_schulz_float32(
        update, coefficients, steps, eps
    )
    torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=1e-6)
