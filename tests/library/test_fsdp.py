"""FSDP2 (``fully_shard``) models (gloo, CPU, forked ranks of tests/kit/harness.py; docs/distributed.md, "FSDP2").

- P = 2 and 4 ranks, per-layer and root sharding, every solver (ρ = 1): the preconditioned
  gradients and the parameters after update and in-between steps equal one process on the whole
  batch (the reference held to the dense definitions in test_distributed.py), with uneven and
  empty shards (3 and 5 rows over 4 ranks).
- Bytes per layer: a low-rank state's projection is one all-reduce of m numbers, K-FAC's one
  gather of the rank's rows of ∇W Q_a; nothing weight-sized for the low-rank solvers.
- ``kl_clip`` and the fallback decided over every rank's rows; checkpoints resume bit-exactly.
- Unsupported layouts and options raise ``ValueError`` at construction.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hylo
from hylo.solvers.kfac_kernels import EigenKernel
from tests.kit.checks import rel_err
from tests.kit.harness import run_distributed
from tests.kit.internals import apply_plan
from tests.library.test_distributed import DAMPING, LAYERS, NORM_FLOOR, Net, assert_rel_close, make_data, make_model

SOLVERS = ("kfac", "sngd", "kid", "kis", "kfac_adam")
#: The decoder's solvers: kfac_adam is left out, its embeddings' A are rank-deficient (unseen tokens; see options()).
LM_SOLVERS = ("kfac", "sngd", "kid", "kis")
#: Relative error allowed between FSDP2 and one process (float64; the sums run in another order).
TOL = 1e-6


def shard(model: Net, mode: str) -> nn.Module:
    """``fully_shard`` each layer then the root (``"layers"``), or the root only (``"root"``)."""
    if mode == "layers":
        for name in LAYERS:
            fully_shard(getattr(model, name))
    fully_shard(model)
    return model


def full(tensor: Tensor) -> Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def options(solver: str) -> dict[str, Any]:
    # kfac_adam: ε 1e-3 bounds Adam's amplification of round-off (|∂(r/(|r|+ε))/∂r| ≤ 1/ε), so that the float64
    # comparison of P ranks with one process stays meaningful over several steps; fc1 (d_a 28 > 8 rows a step) is
    # left out: its A is rank-deficient, and eigh's choice of vectors in its null space (which round-off decides)
    # changes the Adam scaling of those directions (docs/solvers.md, "Adam in the K-FAC eigenbasis")
    eps = {"adam_eps": 1e-3, "skip_layers": ("fc1",)} if solver == "kfac_adam" else {}
    return {"solver": solver, "damping": DAMPING, "factor_decay": 0.5, "rank_ratio": 1.0, "update_freq": 2, **eps}


def record_steps(
    model: nn.Module,
    pre: hylo.HyLoPreconditioner,
    batches: Iterable[Any],
    loss: Callable[[Any], Tensor],
    names: Sequence[str],
) -> dict[str, Any]:
    """SGD (lr 0.1) with hylo, one step per batch: per step the whole gradients before and after ``pre.step()``,
    the final parameters, and each of ``names``' bytes on the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raw, grads, traffic = [], [], {}
    for batch in batches:
        opt.zero_grad()
        loss(batch).backward()
        raw.append({k: full(p.grad).clone() for k, p in model.named_parameters()})
        before = dict(pre.comm.bytes_by_tag)
        pre.step()
        traffic = {name: pre.comm.bytes_by_tag[name] - before.get(name, 0) for name in names}
        grads.append({k: full(p.grad).clone() for k, p in model.named_parameters()})
        opt.step()
    params = {k: full(p.detach()).clone() for k, p in model.named_parameters()}
    return {"raw": raw, "grads": grads, "params": params, "traffic": traffic}


def train(
    rank: int, world_size: int, solver: str, mode: str, xs: Tensor, ys: Tensor, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SGD with hylo on ``len(xs)`` steps (updates every other step); rank p takes its slice of each batch.

    Returns per step the whole gradients before and after ``pre.step()``, the final parameters, and each layer's bytes
    on the last (non-update) step.
    """
    model = make_model(xs.dtype)
    net = shard(model, mode) if world_size > 1 else model
    pre = hylo.HyLoPreconditioner(net, **{**options(solver), **(extra or {})})
    size = xs.shape[1] // world_size
    local = slice(rank * size, (rank + 1) * size)
    steps = record_steps(
        model, pre, zip(xs, ys, strict=True), lambda xy: F.cross_entropy(net(xy[0][local]), xy[1][local]), LAYERS
    )
    return {
        **steps,
        "local_rows": {name: getattr(model, name).weight.to_local().shape[0] for name in LAYERS}
        if world_size > 1
        else {},
        "world_size": pre.comm.world_size,
    }


@pytest.mark.parametrize(("world_size", "mode"), [(2, "layers"), (4, "layers"), (2, "root")])
@pytest.mark.parametrize("solver", SOLVERS)
def test_fsdp2_matches_single_process(solver: str, world_size: int, mode: str) -> None:
    """docs/distributed.md, "FSDP2": fully_shard on the split global batch == one process on the whole batch."""
    xs, ys = make_data(4, 8, torch.float64)
    reference = train(0, 1, solver, mode, xs, ys)
    out = run_distributed(train, world_size, solver, mode, xs, ys, timeout=120)
    for rank, result in enumerate(out):
        assert result["world_size"] == world_size
        if world_size == 4:  # uneven shards, one empty: conv 3 rows, fc1 5 rows, fc2 3 rows over 4 ranks
            assert result["local_rows"] == {
                "conv": [1, 1, 1, 0][rank],
                "fc1": [2, 2, 1, 0][rank],
                "fc2": [1, 1, 1, 0][rank],
            }
        for step, want in enumerate(reference["grads"]):
            assert_rel_close(result["raw"][step], reference["raw"][step], 1e-10, f"rank {rank} step {step} raw")
            assert_rel_close(result["grads"][step], want, TOL, f"rank {rank} step {step} preconditioned")
        assert_rel_close(result["params"], reference["params"], TOL, f"rank {rank} final parameters")
    for step, want in enumerate(reference["grads"]):  # not vacuous: far from the raw gradient over λ
        pre = torch.cat([g.flatten() for g in want.values()])
        raw = torch.cat([g.flatten() for g in reference["raw"][step].values()])
        assert rel_err(pre * DAMPING, raw, NORM_FLOOR) > 0.1, f"step {step}: preconditioning is ~ identity/λ"


@pytest.mark.parametrize("solver", ["sngd", "kfac"])
def test_fsdp2_bytes_per_layer(solver: str) -> None:
    """A non-update step moves, per layer, the m projections (low-rank: m = 8 rows at ρ = 1) or the rank's
    rows of ∇W Q_a (K-FAC, padded to the largest shard, ⌈d_g/P⌉ rows), never a whole weight for the low-rank
    solvers."""
    xs, ys = make_data(4, 8, torch.float64)
    out = run_distributed(train, 2, solver, "layers", xs, ys, timeout=120)
    d_a, d_g = {"conv": 19, "fc1": 28, "fc2": 5}, {"conv": 3, "fc1": 5, "fc2": 3}
    for result in out:
        for name in LAYERS:
            expected = 8 * 8 if solver == "sngd" else -(-d_g[name] // 2) * d_a[name] * 8
            assert result["traffic"][name] == expected, (name, result["traffic"])


def test_fsdp2_kl_clip_matches_single_process() -> None:
    """kl_clip's sum ⟨V̂, ∇W⟩ runs over every rank's rows: the same clipped step as one process."""
    xs, ys = make_data(3, 8, torch.float64)
    extra = {"kl_clip": 1e-4, "lr": 0.1}
    reference = train(0, 1, "sngd", "layers", xs, ys, extra)
    unclipped = train(0, 1, "sngd", "layers", xs, ys)
    assert not torch.allclose(reference["grads"][0]["fc1.weight"], unclipped["grads"][0]["fc1.weight"])
    for result in run_distributed(train, 2, "sngd", "layers", xs, ys, extra, timeout=120):
        for step, want in enumerate(reference["grads"]):
            assert_rel_close(result["grads"][step], want, TOL, f"step {step} clipped")


#: The names of three equal layers between a stem and a head: one group of the apply plan.
EQUAL = ("eq0", "eq1", "eq2")


def _grouped_and_layer_by_layer(
    rank: int, world_size: int, options: dict[str, Any], failing: bool = False
) -> tuple[list[Any], list[str]]:
    """The same sharded run twice, ``grouped`` True then False: each step's preconditioned gradients, and the
    warnings; ``failing``: K-FAC's kernel raises on every group of more than one layer (this forked rank only)."""
    if failing:
        real = EigenKernel.shard_partial

        def partial(self: EigenKernel, grads: Tensor, *args: Any) -> Any:
            if grads.shape[0] > 1:
                raise RuntimeError("an injected kernel failure")
            return real(self, grads, *args)

        EigenKernel.shard_partial = partial  # type: ignore[method-assign]
    xs, ys = make_data(4, 8, torch.float64)
    size = xs.shape[1] // world_size
    local = slice(rank * size, (rank + 1) * size)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for grouped in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Flatten())
            model.add_module("stem", nn.Linear(xs[0, 0].numel(), 8, dtype=torch.float64))
            for name in EQUAL:
                model.add_module(f"act_{name}", nn.Tanh())
                model.add_module(name, nn.Linear(8, 8, dtype=torch.float64))
            model.add_module("head", nn.Linear(8, 3, dtype=torch.float64))
            for name in ("stem", *EQUAL, "head"):
                fully_shard(getattr(model, name))
            fully_shard(model)
            pre = hylo.HyLoPreconditioner(model, grouped=grouped, **options)
            steps = record_steps(
                model,
                pre,
                zip(xs, ys, strict=True),
                lambda xy, m=model: F.cross_entropy(m(xy[0][local]), xy[1][local]),
                [],
            )
            if grouped:  # the three equal layers in one kernel
                assert sorted(len(group.members) for group in apply_plan(pre).groups) == [1, 1, 3]
            out.append(steps["grads"])
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "options",
    [
        {"solver": "kfac"},
        {"solver": "kfac", "kfac_method": "inverse"},
        {"solver": "sngd"},
        {"solver": "kfac_adam", "adam_eps": 1e-3},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_fsdp2_grouped_equals_layer_by_layer(options: dict[str, Any]) -> None:
    """docs/design.md, "The apply plan": on 2 sharded ranks the grouped step (the three equal layers in one
    kernel) equals the same kernels one layer a group (``grouped=False``), in float64 to 1e-12."""
    options = {"damping": DAMPING, "factor_decay": 0.5, "rank_ratio": 1.0, "update_freq": 2, **options}
    for (grouped, layer_by_layer), _ in run_distributed(_grouped_and_layer_by_layer, 2, options, timeout=120):
        for step, (a, b) in enumerate(zip(grouped, layer_by_layer, strict=True)):
            assert_rel_close(a, b, 1e-12, f"step {step}")


def test_fsdp2_a_failing_group_kernel_hands_the_step_to_one_layer_a_group() -> None:
    """A grouped kernel that raises under FSDP2 (on every rank alike): the step runs the same kernels one layer a
    group, with the same results, and warns naming the error and the layers."""
    options = {"solver": "kfac", "damping": DAMPING, "update_freq": 2}
    for (grouped, layer_by_layer), messages in run_distributed(
        _grouped_and_layer_by_layer, 2, options, True, timeout=120
    ):
        for step, (a, b) in enumerate(zip(grouped, layer_by_layer, strict=True)):
            assert_rel_close(a, b, 1e-12, f"step {step}")
        raised = [m for m in messages if "the grouped step raised RuntimeError: an injected kernel failure" in m]
        assert raised and all("eq0, eq1, eq2" in m for m in raised), messages


def _resume(rank: int, world_size: int, solver: str, xs: Tensor, ys: Tensor, stop: int | None) -> dict[str, Tensor]:
    """Train under FSDP2; at ``stop``, save hylo's state (through torch.save), rebuild hylo, load, go on."""
    model = make_model(xs.dtype)
    net = shard(model, "layers")
    pre = hylo.HyLoPreconditioner(net, **{**options(solver), "update_freq": 3})
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    local = slice(rank * 4, rank * 4 + 4)
    for i in range(len(xs)):
        if i == stop:
            buffer = io.BytesIO()
            torch.save(pre.state_dict(), buffer)
            pre.remove()
            pre = hylo.HyLoPreconditioner(net, **{**options(solver), "update_freq": 3})
            buffer.seek(0)
            pre.load_state_dict(torch.load(buffer, weights_only=False))
        opt.zero_grad()
        F.cross_entropy(net(xs[i][local]), ys[i][local]).backward()
        pre.step()
        opt.step()
    return {k: full(p.detach()).clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("solver", ["kfac", "kis"])
def test_fsdp2_checkpoint_resumes_exactly(solver: str) -> None:
    """A state_dict saved under FSDP2 (between updates) and loaded into a new preconditioner: bit-exact."""
    xs, ys = make_data(6, 8, torch.float64)
    whole = run_distributed(_resume, 2, solver, xs, ys, None, timeout=120)
    resumed = run_distributed(_resume, 2, solver, xs, ys, 4, timeout=120)
    for rank in range(2):
        for key, value in whole[rank].items():
            assert torch.equal(resumed[rank][key], value), (rank, key)


# ---------------------------------------------------------------------------- a transformer: embeddings, attention
#: The decoder's sharded layout at P = 2: the vocabulary (50 tokens) in halves of 25 columns of ∇W; the packed
#: in_proj_weight (48 rows) in halves of 24 rows: q whole and k's first 8 rows on rank 0, k's last 8 and v on rank 1.
VOCAB, WIDTH, CONTEXT = 50, 16, 8
#: ``positions`` is called on arange(T), shared by every sequence: its rows are the batch's sums, which no data
#: parallelism (DDP included) splits like one process, so it is left to the optimizer here.
LM_SKIP = ("positions",)


def _lm_data(steps: int) -> Tensor:
    return torch.randint(0, VOCAB, (steps, 8, CONTEXT + 1), generator=torch.Generator().manual_seed(3))


def train_lm(rank: int, world_size: int, solvers: tuple[str, ...], tokens: Tensor) -> dict[str, Any]:
    """The repository's decoder (1 block, width 16, 2 heads), sharded per block and root when P > 1, trained with
    SGD and hylo as :func:`train` does, once per solver; per solver the same record as :func:`train`."""
    from hylo_scripts.models.registry import DecoderLM

    out: dict[str, Any] = {}
    size = tokens.shape[1] // world_size
    local = slice(rank * size, (rank + 1) * size)
    for solver in solvers:
        torch.manual_seed(0)
        model = DecoderLM(vocab=VOCAB, context=CONTEXT, layers=1, width=WIDTH, heads=2).double()
        if world_size > 1:
            fully_shard(model.blocks[0])
            fully_shard(model)
        pre = hylo.HyLoPreconditioner(model, **options(solver), skip_layers=LM_SKIP)
        names = [info.name for info in pre.layer_info()]
        steps = record_steps(
            model,
            pre,
            tokens,
            lambda batch, lm=model: F.cross_entropy(
                lm(batch[local, :-1]).reshape(-1, VOCAB), batch[local, 1:].reshape(-1)
            ),
            names,
        )
        out[solver] = {**steps, "names": names}
    return out


@pytest.mark.parametrize(("world_size", "solvers"), [(2, LM_SOLVERS), (4, ("kfac",))])
def test_fsdp2_decoder_lm_matches_single_process(world_size: int, solvers: tuple[str, ...]) -> None:
    """docs/distributed.md, "FSDP2": a transformer LM (token embedding, packed attention projections, MLP, head)
    sharded per block and root equals one process on the whole batch, over update and in-between steps; at
    P = 2, the bytes of the last (non-update) step are :func:`lm_bytes`."""
    tokens = _lm_data(4)
    reference = train_lm(0, 1, solvers, tokens)
    out = run_distributed(train_lm, world_size, solvers, tokens, timeout=120)
    for solver in solvers:
        want = reference[solver]
        assert {"tokens", "blocks.0.attn.q_proj", "blocks.0.attn.v_proj", "head"} <= set(want["names"])
        for rank, result in enumerate(out):
            got = result[solver]
            assert got["names"] == want["names"]
            for step, grads in enumerate(want["grads"]):
                where = f"{solver} rank {rank} step {step}"
                assert_rel_close(got["raw"][step], want["raw"][step], 1e-10, f"{where} raw")
                assert_rel_close(got["grads"][step], grads, TOL, f"{where} preconditioned")
            assert_rel_close(got["params"], want["params"], TOL, f"{solver} rank {rank} final parameters")
            if world_size == 2:
                for name, sent in lm_bytes(solver).items():
                    assert got["traffic"][name] == sent, (solver, name, got["traffic"])
        for step, grads in enumerate(want["grads"]):  # not vacuous: the embedding and projections preconditioned
            for key in ("tokens.weight", "blocks.0.attn.in_proj_weight"):
                raw = want["raw"][step][key]
                assert rel_err(grads[key] * DAMPING, raw, NORM_FLOOR) > 0.05, f"{solver} step {step} {key} ~ identity/λ"


def lm_bytes(solver: str) -> dict[str, int]:
    """What each rank sends for the decoder's embedding and packed projections on a non-update step at P = 2
    (docs/distributed.md, "FSDP2"): the m projections for the low-rank solvers (every token of the global batch
    is a row at ρ = 1); for K-FAC, the embedding's ∇W Q_a summed over the two halves of the vocabulary
    (d_g·d_a numbers) and each projection's rows of ∇W Q_a padded to the larger of the two ranks' blocks (q
    and v: all 16 rows on one rank, none on the other; k: 8 and 8), d_a = 17 with the bias."""
    if solver != "kfac":
        return dict.fromkeys(("tokens", "blocks.0.attn.q_proj", "blocks.0.attn.k_proj"), 8 * CONTEXT * 8)
    d_a = WIDTH + 1
    return {
        "tokens": WIDTH * VOCAB * 8,
        "blocks.0.attn.q_proj": WIDTH * d_a * 8,
        "blocks.0.attn.k_proj": 8 * d_a * 8,
        "blocks.0.attn.v_proj": WIDTH * d_a * 8,
    }


# ---------------------------------------------------------------------------- refused at construction
def _refused(rank: int, world_size: int, case: str) -> str:
    """Build the case's model and preconditioner; return the ValueError's message (every rank must raise)."""
    model = make_model(torch.float64)
    kwargs: dict[str, Any] = {}
    if case == "gradient":
        shard(model, "layers")
        kwargs["strategy"] = "gradient"
    elif case == "mix":
        fully_shard(model.fc1)
    elif case == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    elif case == "tensor_parallel":
        mesh = init_device_mesh("cpu", (world_size,))
        model.fc1.weight = nn.Parameter(distribute_tensor(model.fc1.weight.detach(), mesh, [Shard(1)]))
    elif case == "unpacked_attention":  # q/k/v_proj_weight split by ⌈E/P⌉ rows, in_proj_bias by ⌈3E/P⌉
        model = nn.Sequential(nn.MultiheadAttention(8, 2, kdim=6, vdim=6))  # type: ignore[assignment]
        fully_shard(model)
    try:
        hylo.HyLoPreconditioner(model, **kwargs)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("gradient", "strategy='gradient'"),
        ("mix", "not sharded"),
        ("hsdp", "2-D device mesh (HSDP"),
        ("tensor_parallel", "tensor parallel"),
        ("unpacked_attention", "['0.q_proj', '0.k_proj', '0.v_proj']: its weight (q/k/v_proj_weight"),
    ],
)
def test_fsdp2_unsupported_combinations_refused(case: str, words: str) -> None:
    """Each unsupported combination is a ValueError naming it at construction, on every rank (step() never runs)."""
    for message in run_distributed(_refused, 4, case, timeout=120):
        assert "FSDP2" in message and words in message, message


def _refused_studies(rank: int, world_size: int, directory: str) -> tuple[str, bool]:
    model = shard(make_model(torch.float64), "root")
    try:
        hylo.HyLoPreconditioner(model, studies=("grad_norm",), profile_dir=f"{directory}/{rank}")
    except ValueError as err:
        return str(err), os.path.exists(f"{directory}/{rank}")
    return "no error", False


def test_fsdp2_studies_refused(tmp_path: Path) -> None:
    """The studies need whole gradients: refused at construction under FSDP2, before any file is written."""
    for message, _ in run_distributed(_refused_studies, 2, str(tmp_path), timeout=60):
        assert "FSDP2" in message and "studies" in message, message


def _sharded_after(rank: int, world_size: int) -> str:
    """hylo built on the plain model, then fully_shard: the first step() raises on every rank."""
    model = make_model(torch.float64)
    pre = hylo.HyLoPreconditioner(model)
    shard(model, "root")
    xs, ys = make_data(1, 4, torch.float64)
    F.cross_entropy(model(xs[0]), ys[0]).backward()
    try:
        pre.step()
    except ValueError as err:
        return str(err)
    return "no error"


def test_fsdp2_sharded_after_construction_raises_at_first_step() -> None:
    for message in run_distributed(_sharded_after, 2, timeout=60):
        assert "sharded by fully_shard after the HyLoPreconditioner was built" in message, message
