"""Distributed behaviour of HyLoPreconditioner (gloo on CPU, forked ranks of tests/kit/harness.py; the DDP
equalities also under NCCL, one GPU per rank, when the device tier runs on a machine with ≥ 2 GPUs).

- DDP smoke test: every rank ends with the same preconditioned gradients and parameters.
- docs/distributed.md ("Distribution invariant") invariant: P ranks with DDP on the global batch split across them give the
  preconditioned gradients of one process on the whole batch (float64, exact solvers).
- Unequal local batches: the result matches the definition (docs/solvers.md, "Notation", "SNGD") computed by a dense
  oracle written here, independently of hylo.

The harness's own tests are in test_harness.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo import integrity
from hylo.solvers.smw import LowRankState
from tests.kit.checks import rel_err
from tests.kit.harness import nccl_problem, rank_device, run_distributed

DAMPING = 1e-2
LAYERS = ("conv", "fc1", "fc2")


class Net(nn.Module):
    """Conv2d (stride 2, padding 1, bias) → Linear (bias) → Linear (no bias); no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)  # 5×5 → 3×3: d_a = 19, d_g = 3
        self.fc1 = nn.Linear(27, 5)  # d_a = 28, d_g = 5
        self.fc2 = nn.Linear(5, 3, bias=False)  # d_a = 5, d_g = 3

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.conv(x))
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)


#: Test cases that are a solver with options: K-FAC's inverse method; kfac_adam with ε 1e-3, which bounds Adam's
#: amplification of round-off, and (compared with one process) without fc1, whose A is rank-deficient (d_a 28 > 8
#: rows a step): see tests/library/test_fsdp.py's options().
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "kfac-inverse": ("kfac", {"kfac_method": "inverse"}),
    "kfac_adam": ("kfac_adam", {"adam_eps": 1e-3}),
    "kfac_adam-full-rank": ("kfac_adam", {"adam_eps": 1e-3, "skip_layers": ("fc1",)}),
    "kfac_adam-power": ("kfac_adam", {"adam_eps": 1e-3, "skip_layers": ("fc1",), "basis_refresh": "power"}),
    "kfac-stagger": ("kfac", {"stagger_updates": True}),
}


def backends(world_size: int) -> list[Any]:
    """gloo, and NCCL (skipped with the reason when this machine cannot run ``world_size`` NCCL ranks)."""
    problem = nccl_problem(world_size)
    return ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(problem is not None, reason=problem or ""))]


def make_model(dtype: torch.dtype) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def make_data(steps: int, batch: int, dtype: torch.dtype, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, batch, 2, 5, 5, generator=gen).to(dtype)
    ys = torch.randint(0, 3, (steps, batch), generator=gen)
    return xs, ys


def local_slice(counts: list[int], rank: int) -> slice:
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def train(
    rank: int,
    world_size: int,
    solver: str,
    xs: Tensor,
    ys: Tensor,
    counts: list[int],
    update_freq: int,
    strategy: str = "inverse",
) -> dict[str, Any]:
    """A few SGD steps with hylo; DDP when a process group with >1 rank exists.

    Rank ``rank`` trains on rows ``local_slice(counts, rank)`` of each step's global batch.
    Returns per step the gradients before and after ``preconditioner.step()``, the final
    parameters and the number of rows in each layer's low-rank state.
    """
    device = rank_device(rank)
    model = make_model(xs.dtype).to(device)
    xs, ys = xs.to(device), ys.to(device)
    net: nn.Module = model
    if world_size > 1 and dist.is_initialized():
        net = nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    options: dict[str, Any] = {"strategy": strategy} if strategy != "inverse" else {}
    solver, extra = CASES.get(solver, (solver, {}))
    options.update(extra)
    pre = hylo.HyLoPreconditioner(
        net, solver=solver, update_freq=update_freq, damping=DAMPING, factor_decay=0.5, **options
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rows = local_slice(counts, rank)
    raw, preconditioned = [], []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        F.cross_entropy(net(x[rows]), y[rows]).backward()
        raw.append({k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()})
        pre.step()
        preconditioned.append({k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()})
        opt.step()
    state_rows = {
        info.name: info.state.fields["rows"]
        for info in pre.layer_info()
        if info.state is not None and info.state.kind == LowRankState.__name__
    }
    return {
        "raw": raw,
        "pre": preconditioned,
        "params": {k: p.detach().cpu().clone() for k, p in model.named_parameters()},
        "state_rows": state_rows,
        "world_size": pre.comm.world_size,
    }


#: Floor of the reference norm in the relative errors below (an all-zero reference does not divide by 0).
NORM_FLOOR = 1e-300


def assert_rel_close(actual: dict[str, Tensor], expected: dict[str, Tensor], tol: float, what: str) -> None:
    """Same keys, and every tensor within relative error ``tol`` of its reference (compared in float64)."""
    assert actual.keys() == expected.keys()
    for key, want in expected.items():
        err = rel_err(actual[key].to(torch.float64), want.to(torch.float64), NORM_FLOOR)
        assert err <= tol, f"{what}, {key}: relative error {err:.3e} > {tol:g}"


# ============================================================================ 1. DDP smoke test
@pytest.mark.parametrize("backend", backends(2))
@pytest.mark.parametrize("strategy", ["inverse", "gradient"])
@pytest.mark.parametrize("solver", ["kfac", "sngd", "kfac_adam"])
def test_ddp_ranks_agree(solver: str, strategy: str, backend: str) -> None:
    """Two ranks, different data each, update every other step: identical gradients and parameters.

    Bit-identical, not merely close: both ranks solve from the same all-reduced/all-gathered data
    (or receive the owner's result), so any difference means a rank computed something else.
    """
    steps, batch = 3, 8
    xs, ys = make_data(steps, batch, torch.float32)
    out = run_distributed(train, 2, solver, xs, ys, [4, 4], 2, strategy, backend=backend)
    r0, r1 = out
    assert r0["world_size"] == r1["world_size"] == 2
    for step in range(steps):
        for key, g0 in r0["pre"][step].items():
            g1 = r1["pre"][step][key]
            assert torch.isfinite(g0).all()
            diff = float((g1 - g0).abs().max())
            assert torch.equal(g1, g0), f"step {step} {key}: ranks differ (max abs diff {diff:.3e})"
            # preconditioning changed the gradient (the comparison is not vacuous)
            assert not torch.allclose(g0, r0["raw"][step][key])
    for key, p0 in r0["params"].items():
        assert torch.equal(r1["params"][key], p0), f"final {key}: ranks differ"
    if solver == "sngd" and strategy == "inverse":  # every rank holds the rows of the global batch
        assert r0["state_rows"] == r1["state_rows"] == dict.fromkeys(LAYERS, batch)


# ============================================================================ 2. equivalence with one process
@pytest.mark.parametrize(
    ("world_size", "strategy"),
    [(2, "inverse"), (4, "inverse"), (4, "gradient")],
    ids=["2-inverse", "4-inverse", "4-gradient"],
)
@pytest.mark.parametrize("backend", backends(2))
@pytest.mark.parametrize("solver", ["kfac", "sngd", "kfac-inverse", "kfac_adam-full-rank", "kfac_adam-power"])
def test_ddp_matches_single_process(solver: str, world_size: int, strategy: str, backend: str) -> None:
    """docs/distributed.md, "Distribution invariant": DDP on the split global batch == one process on the whole batch (float64).

    With 4 ranks and 3 layers one rank owns no layer; ``strategy="gradient"`` has owners
    broadcast preconditioned gradients instead of solved states; ``kfac-inverse`` is K-FAC with
    ``kfac_method="inverse"`` (its owners broadcast the damped inverses); ``kfac_adam``'s moments advance on
    every rank, under either strategy (``kfac_adam-power``: its owners refresh the bases from the previous ones and
    broadcast them with the column orders the moments are re-sorted by). Under NCCL the ranks run on GPUs and the one process on the CPU.
    """
    steps, batch = 3, 8
    xs, ys = make_data(steps, batch, torch.float64)
    reference = train(0, 1, solver, xs, ys, [batch], 1)  # here, in the parent: no process group
    assert reference["world_size"] == 1
    counts = [batch // world_size] * world_size
    if backend == "nccl" and (problem := nccl_problem(world_size)) is not None:
        pytest.skip(problem)
    out = run_distributed(train, world_size, solver, xs, ys, counts, 1, strategy, backend=backend)
    for step in range(steps):
        # not vacuous: the preconditioner is far from a multiple of the identity
        pre = torch.cat([g.flatten() for g in reference["pre"][step].values()])
        raw = torch.cat([g.flatten() for g in reference["raw"][step].values()])
        assert rel_err(pre * DAMPING, raw, NORM_FLOOR) > 0.1, f"step {step}: preconditioning is ~ identity/λ"
        for rank, result in enumerate(out):
            assert_rel_close(result["raw"][step], reference["raw"][step], 1e-10, f"rank {rank} step {step} DDP grad")
            assert_rel_close(
                result["pre"][step], reference["pre"][step], 1e-5, f"rank {rank} step {step} preconditioned"
            )
    for rank, result in enumerate(out):
        assert_rel_close(result["params"], reference["params"], 1e-5, f"rank {rank} final parameters")


@pytest.mark.parametrize("backend", backends(2))
@pytest.mark.parametrize("strategy", ["inverse", "gradient"])
def test_staggered_updates_on_two_ranks_match_one_process(strategy: str, backend: str) -> None:
    """``stagger_updates`` with update_freq 2: the three layers update on alternate steps (their offsets from the
    same estimates on every rank), and two ranks equal one process on the whole batch, step by step."""
    steps, batch = 5, 8
    xs, ys = make_data(steps, batch, torch.float64)
    reference = train(0, 1, "kfac-stagger", xs, ys, [batch], 2)
    out = run_distributed(train, 2, "kfac-stagger", xs, ys, [4, 4], 2, strategy, backend=backend)
    for step in range(steps):
        for rank, result in enumerate(out):
            assert_rel_close(
                result["pre"][step], reference["pre"][step], 1e-6, f"rank {rank} step {step} preconditioned"
            )


# ---------------------------------------------------------------------------- unequal local batches
def _recorder(name: str, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> Any:
    def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        inputs[name] = args[0].detach()
        outputs[name] = output

    return hook


def reference_curvature(model: Net, xs: Tensor, ys: Tensor, counts: list[int]) -> dict[str, Any]:
    """The definitions of docs/solvers.md ("Notation", "SNGD"), computed densely and independently of hylo.

    Rank p computes L_p = mean over its n_p rows; DDP averages the rank gradients, so
    ∇W = (1/P) Σ_p ∇L_p. Rows: g_i = n_p ∂L_p/∂s_i (per position for Conv2d, then the default
    ``conv_rows="sum"`` surrogate for SNGD: a_i = mean of the unfolded patches over positions,
    g_i = sum over positions).
    SNGD: F = (1/B) Σ u_i u_iᵀ, u_i = vec(g_i a_iᵀ); K-FAC (first update, no running average):
    A = E[a aᵀ] over all samples (and positions), G = (1/B) Σ_i Σ_pos g gᵀ.
    """
    modules = {name: getattr(model, name) for name in LAYERS}
    batch = sum(counts)
    a_rows: dict[str, list[Tensor]] = {k: [] for k in LAYERS}
    g_rows: dict[str, list[Tensor]] = {k: [] for k in LAYERS}
    a_sum: dict[str, Tensor] = {}
    a_count: dict[str, int] = dict.fromkeys(LAYERS, 0)
    g_sum: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}
    for rank in range(len(counts)):
        x, y = xs[local_slice(counts, rank)], ys[local_slice(counts, rank)]
        n = x.shape[0]
        inputs: dict[str, Tensor] = {}
        outputs: dict[str, Tensor] = {}
        handles = [m.register_forward_hook(_recorder(k, inputs, outputs)) for k, m in modules.items()]
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        for h in handles:
            h.remove()
        out_tensors = [outputs[k] for k in LAYERS]
        grad_out = dict(zip(LAYERS, torch.autograd.grad(loss, out_tensors, retain_graph=True), strict=True))
        loss.backward()
        for k, m in modules.items():
            w = m.weight.grad.reshape(m.weight.shape[0], -1)
            if m.bias is not None:
                w = torch.cat([w, m.bias.grad[:, None]], dim=1)
            grads[k] = grads.get(k, 0) + w / len(counts)
            inp, gout = inputs[k], grad_out[k] * n
            if isinstance(m, nn.Conv2d):
                patches = F.unfold(inp, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
                patch_rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])  # (n·L, C·kh·kw)
                a_sample, g_sample = patches.mean(-1), gout.sum((2, 3))
                g_pos = gout.permute(0, 2, 3, 1).reshape(-1, gout.shape[1])
            else:
                patch_rows, a_sample, g_sample, g_pos = inp, inp, gout, gout
            if m.bias is not None:
                patch_rows = torch.cat([patch_rows, torch.ones(patch_rows.shape[0], 1, dtype=inp.dtype)], 1)
                a_sample = torch.cat([a_sample, torch.ones(n, 1, dtype=inp.dtype)], 1)
            a_rows[k].append(a_sample)
            g_rows[k].append(g_sample)
            a_sum[k] = a_sum.get(k, 0) + patch_rows.T @ patch_rows
            a_count[k] += patch_rows.shape[0]
            g_sum[k] = g_sum.get(k, 0) + g_pos.T @ g_pos
    result: dict[str, Any] = {"grad": grads, "sngd": {}, "kfac": {}}
    for k in LAYERS:
        grad = grads[k]
        d = grad.numel()
        eye = torch.eye(d, dtype=grad.dtype)
        a, g = torch.cat(a_rows[k]), torch.cat(g_rows[k])
        u = (g[:, :, None] * a[:, None, :]).reshape(batch, -1)  # row-major vec(g aᵀ), like grad.flatten()
        fisher = u.T @ u / batch
        result["sngd"][k] = torch.linalg.solve(fisher + DAMPING * eye, grad.flatten()).reshape(grad.shape)
        factor_a, factor_g = a_sum[k] / a_count[k], g_sum[k] / batch
        kron = torch.kron(factor_g, factor_a)  # (G ⊗ A) vec_r(X) = vec_r(G X A)
        result["kfac"][k] = torch.linalg.solve(kron + DAMPING * eye, grad.flatten()).reshape(grad.shape)
    return result


def as_matrices(grads: dict[str, Tensor], model: Net) -> dict[str, Tensor]:
    out = {}
    for k in LAYERS:
        m = getattr(model, k)
        w = grads[f"{k}.weight"].reshape(m.weight.shape[0], -1)
        if m.bias is not None:
            w = torch.cat([w, grads[f"{k}.bias"][:, None]], dim=1)
        out[k] = w
    return out


@pytest.mark.parametrize("solver", ["sngd", "kfac"])
def test_unequal_local_batches_match_definition(solver: str) -> None:
    """3 and 5 rows on two ranks: the preconditioned gradient is (F̃ + λI)⁻¹ ∇W of the definition.

    F̃ uses all B = 8 rows (divisor B for SNGD, row-weighted factors for K-FAC); ∇W is DDP's
    (unweighted) average of the rank gradients. The run must neither hang nor differ across ranks.
    """
    counts = [3, 5]
    xs, ys = make_data(1, sum(counts), torch.float64, seed=2)
    out = run_distributed(train, 2, solver, xs, ys, counts, 1, timeout=60)
    oracle = reference_curvature(make_model(torch.float64), xs[0], ys[0], counts)
    for rank, result in enumerate(out):
        model = make_model(torch.float64)
        assert_rel_close(as_matrices(result["raw"][0], model), oracle["grad"], 1e-10, f"rank {rank} DDP grad")
        assert_rel_close(as_matrices(result["pre"][0], model), oracle[solver], 1e-6, f"rank {rank} {solver}")
    if solver == "sngd":
        assert out[0]["state_rows"] == out[1]["state_rows"] == dict.fromkeys(LAYERS, sum(counts))


def test_single_process_matches_dense_oracle() -> None:
    """Sanity of the oracle above (and of hylo at world size 1): one process, one step."""
    xs, ys = make_data(1, 8, torch.float64, seed=2)
    oracle = reference_curvature(make_model(torch.float64), xs[0], ys[0], [8])
    model = make_model(torch.float64)
    for solver in ("sngd", "kfac"):
        result = train(0, 1, solver, xs, ys, [8], 1)
        assert_rel_close(as_matrices(result["raw"][0], model), oracle["grad"], 1e-12, "grad")
        assert_rel_close(as_matrices(result["pre"][0], model), oracle[solver], 1e-8, solver)


def _resume_run(rank: int, world_size: int, solver: str, xs: Tensor, ys: Tensor, stop: int, load_from: str) -> Any:
    """Train ``len(xs)`` steps under ``strategy="gradient"``, or ``stop`` steps, save, rebuild, load, and go on.

    ``load_from``: ``"none"`` (uninterrupted), ``"own"`` (each rank loads its own state_dict) or
    ``"rank0"`` (every rank loads rank 0's). Returns the final parameters and, per step after
    ``stop``, whether it was an update step on this rank.
    """
    local = slice(rank * xs.shape[1] // world_size, (rank + 1) * xs.shape[1] // world_size)

    def build() -> tuple[nn.Module, torch.optim.Optimizer, hylo.HyLoPreconditioner]:
        net = nn.parallel.DistributedDataParallel(make_model(xs.dtype))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        pre = hylo.HyLoPreconditioner(net, solver=solver, update_freq=3, damping=DAMPING, strategy="gradient")
        return net, opt, pre

    def one_step(net: nn.Module, opt: torch.optim.Optimizer, pre: hylo.HyLoPreconditioner, i: int) -> bool:
        opt.zero_grad()
        F.cross_entropy(net(xs[i][local]), ys[i][local]).backward()
        before = len(pre.decision_log)  # one decision per layer per update
        pre.step()
        opt.step()
        return len(pre.decision_log) > before

    net, opt, pre = build()
    kinds: list[bool] = []
    for i in range(len(xs) if load_from == "none" else stop):
        kinds.append(one_step(net, opt, pre, i))
    if load_from != "none":
        states = [None] * world_size
        dist.all_gather_object(states, pre.state_dict())
        model_state, opt_state = net.state_dict(), opt.state_dict()
        pre.remove()
        net, opt, pre = build()
        net.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        pre.load_state_dict(states[rank if load_from == "own" else 0])  # type: ignore[arg-type]
        for i in range(stop, len(xs)):
            kinds.append(one_step(net, opt, pre, i))
    pre.remove()
    return {"params": {k: v.detach().clone() for k, v in net.module.state_dict().items()}, "updates": kinds}


@pytest.mark.parametrize("solver", ["kfac", "kid"])
def test_gradient_strategy_resumes_exactly_from_each_ranks_own_state(solver: str) -> None:
    """Each rank's state_dict carries what its remote layers build on: a resume is bit-exact, with no extra update;
    loading rank 0's state everywhere recomputes at the first step on every rank (agreed), never on one alone."""
    xs, ys = make_data(8, 8, torch.float64)
    whole = run_distributed(_resume_run, 2, solver, xs, ys, 4, "none", timeout=120)
    own = run_distributed(_resume_run, 2, solver, xs, ys, 4, "own", timeout=120)
    shared = run_distributed(_resume_run, 2, solver, xs, ys, 4, "rank0", timeout=120)
    for rank in range(2):
        assert own[rank]["updates"] == whole[rank]["updates"] == [i % 3 == 0 for i in range(8)]
        for key, value in whole[rank]["params"].items():
            assert torch.equal(own[rank]["params"][key], value), (rank, key)
        assert shared[rank]["updates"][4] is True  # step 4 is not on the cadence: the agreed recompute
    assert shared[0]["updates"] == shared[1]["updates"]


def _load_with_one_bad_rank(rank: int, world_size: int, bad_rank: int) -> dict[str, Any]:
    """Train 3 steps, save, corrupt ``bad_rank``'s copy, load on every rank: what each rank saw and kept."""
    xs, ys = make_data(5, 8, torch.float64)
    torch.manual_seed(0)
    net = nn.parallel.DistributedDataParallel(make_model(torch.float64))
    pre = hylo.HyLoPreconditioner(net, solver="kfac", update_freq=2, damping=0.1)
    local = slice(rank * 4, rank * 4 + 4)

    def one_step(i: int) -> None:
        net.zero_grad()
        F.cross_entropy(net(xs[i][local]), ys[i][local]).backward()
        pre.step()

    for i in range(3):
        one_step(i)
    saved = pre.state_dict()
    before = [info.state.tensors["factor_a"].clone() for info in pre.layer_info() if info.state is not None]
    corrupt = dict(saved, steps=1, layers=dict(saved["layers"]))
    if rank == bad_rank:
        first = next(iter(corrupt["layers"]))
        corrupt["layers"][first] = dict(corrupt["layers"][first], d_a=-1)
    error = None
    try:
        pre.load_state_dict(integrity.seal(corrupt))  # re-sealed: the entries themselves are refused
    except ValueError as err:
        error = str(err)
    after = [info.state.tensors["factor_a"] for info in pre.layer_info() if info.state is not None]
    unchanged = pre.steps == 3 and len(after) == len(before) and all(map(torch.equal, after, before))
    pre.load_state_dict(saved)  # a valid state on every rank still loads, and the run goes on
    one_step(3)
    return {"error": error, "unchanged": unchanged, "steps": pre.steps}


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_load_refused_by_one_rank_changes_no_rank(bad_rank: int) -> None:
    """load_state_dict agrees across ranks: one rank's invalid state makes every rank raise and keep its own."""
    results = run_distributed(_load_with_one_bad_rank, 2, bad_rank, timeout=120)
    for rank, result in enumerate(results):
        assert result["error"] is not None, rank
        expected = "d_a" if rank == bad_rank else "another rank refused its state_dict"
        assert expected in result["error"], (rank, result["error"])
        assert result["unchanged"] and result["steps"] == 4, (rank, result)


# --------------------------------------------------------------------------- ranks that differ
class Wider(Net):
    """Net with one more Linear after fc2 (registered on the rank that builds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.extra(super().forward(x))


#: What rank 1 does differently, and what every rank's error must name.
DIFFERENCES: dict[str, tuple[dict[str, Any], str]] = {
    "skip_layers": ({"skip_layers": ("fc2",)}, "'fc2' registered on ranks [0] only"),
    "update_freq": ({"update_freq": 3}, "update_freq: 2 on ranks [0]; 3 on ranks [1]"),
    "extra-layer": ({}, "'extra' registered on ranks [1] only"),
    "solver": ({"solver": "sngd"}, "solver: 'kfac' on ranks [0]; 'sngd' on ranks [1]"),
    "reconfigure-on-one-rank": ({}, "damping: 0.1 on ranks [0]; 0.5 on ranks [1]"),
}


def _differing_rank(rank: int, world_size: int, difference: str) -> dict[str, Any]:
    """Build a preconditioner whose rank 1 differs by ``difference`` and step: the error each rank raised."""
    torch.manual_seed(0)
    model: Net = Wider() if difference == "extra-layer" and rank == 1 else Net()
    options: dict[str, Any] = {"solver": "kfac", "update_freq": 2, "damping": 0.1}
    if rank == 1:
        options |= DIFFERENCES[difference][0]
    pre = hylo.HyLoPreconditioner(model, **options)
    xs, ys = make_data(4, 4, torch.float32)
    steps = 0
    try:
        for step in range(4):
            if difference == "reconfigure-on-one-rank" and step == 2 and rank == 1:
                pre.reconfigure(damping=0.5)
            model.zero_grad()
            F.cross_entropy(model(xs[step]), ys[step]).backward()
            pre.step()
            steps += 1
    except ValueError as err:
        return {"error": str(err), "steps": steps}
    return {"error": None, "steps": steps}


@pytest.mark.parametrize("difference", list(DIFFERENCES))
def test_ranks_that_differ_raise_value_error_on_every_rank_naming_the_difference(difference: str) -> None:
    """Different registrations, cadence or options on one rank: a ValueError on both ranks naming the field
    and the ranks of each value, at the first step (or the first after a reconfigure), within seconds — no
    backend abort, no process-group timeout (the harness's timeout is far below gloo's default)."""
    results = run_distributed(_differing_rank, 2, difference, timeout=30, pg_timeout=20)
    expected_steps = 2 if difference == "reconfigure-on-one-rank" else 0
    for rank, result in enumerate(results):
        assert result["error"] is not None, (rank, result)
        assert DIFFERENCES[difference][1] in result["error"], (rank, result["error"])
        assert result["steps"] == expected_steps, (rank, result)


# --------------------------------------------------------------------------- ranks stay equal
def _gradient_strategy_weights(rank: int, world_size: int, solver: str) -> list[Tensor]:
    """Six float32 steps under "gradient" with kl_clip: this rank's parameters afterwards."""
    xs, ys = make_data(6, 8, torch.float32)
    net = nn.parallel.DistributedDataParallel(make_model(torch.float32))
    pre = hylo.HyLoPreconditioner(
        net, solver=solver, strategy="gradient", update_freq=2, damping=1e-3, kl_clip=1e-3, lr=0.1
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in zip(xs, ys, strict=True):
        optimizer.zero_grad()
        F.cross_entropy(net(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
        pre.step()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("solver", ["sngd", "kfac"])
def test_gradient_strategy_with_kl_clip_keeps_every_ranks_weights_equal(solver: str) -> None:
    """Owners and the ranks that receive their results apply the same step, bit for bit: every rank computes
    kl_clip's ⟨∇W, V̂⟩ the same way, whoever owns the layer (docs/reliability.md, "Fallbacks")."""
    first, second = run_distributed(_gradient_strategy_weights, 2, solver, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
