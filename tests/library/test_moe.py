"""Fused mixture-of-experts layers (docs/moe.md).

transformers' Mixtral and Qwen2-MoE store each block's experts as 3-D parameters. hylo registers every expert's
two projections as layers of their own, with rows from the tokens routed to that expert, and the router as a
Linear. The specification: every solver gives the fused experts the preconditioned gradients of the same model
written with one ``nn.Linear`` per expert (``linear_twin``, same weights, float64, to 1e-10); SNGD equals the
dense (F + λI)⁻¹ ∇W of the true per-token gradients (one token's backward at a time); idle experts keep their
state, unwarned and counted; overloaded experts and dropped tokens are the twin's too; transformers' grouped_mm
experts are preconditioned as its eager ones; bf16 works; checkpoints resume bit-exactly; P ranks (DDP and FSDP2
sharding the experts) equal one process; an unrecognised 3-D parameter or layout is left alone with its reason;
on both models at least 90% of the trainable matrix parameters are preconditioned.
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.layers.experts import ExpertsLayers, ExpertsLayout
from hylo_scripts.models.moe import LinearExperts, linear_twin, mixtral, qwen2_moe
from tests.kit.checks import DT
from tests.kit.experts import expert_grads, joined_names
from tests.kit.harness import run_distributed
from tests.kit.internals import apply_plan
from tests.kit.reference import dense_natural_gradient

pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("single_thread")]

SOLVERS = ("kfac", "sngd", "kid", "kis", "kfac_adam", "hybrid")
BUILDERS = {"Mixtral": mixtral, "Qwen2-MoE": qwen2_moe}
#: The tiny models of these tests: width, blocks, experts, tokens per sequence; batches of two sequences.
SIZE: dict[str, Any] = {"width": 16, "layers": 1, "experts": 4, "seq": 8}
VOCAB = 256


def tiny(family: str = "Mixtral", dtype: torch.dtype = DT, implementation: str = "eager", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[family](**SIZE, implementation=implementation).to(dtype)


def batch(step: int, sequences: int = 2) -> Tensor:
    return torch.randint(0, VOCAB, (sequences, SIZE["seq"]), generator=torch.Generator().manual_seed(100 + step))


def lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    loss: Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def options(solver: str, split_gate_up: bool = False) -> dict[str, Any]:
    """The tests' options; ``split_gate_up`` off unless asked, so that a gate_up is one layer as in the twin."""
    extra = {"adam_eps": 1e-3} if solver == "kfac_adam" else {}
    return {"solver": solver, "update_freq": 2, "damping": 0.05, "rank_ratio": 0.5, "seed": 3, **extra} | {
        "split_gate_up": split_gate_up
    }


# ------------------------------------------------------------------------------------------------ registration
@pytest.mark.parametrize("family", BUILDERS)
def test_every_expert_and_router_is_a_layer_and_coverage_is_at_least_90_percent(family: str) -> None:
    model = BUILDERS[family]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left alone to warn about
        pre = hylo.HyLoPreconditioner(model)
    names = [info.name for info in pre.layer_info()]
    for block in range(2):
        prefix = f"model.layers.{block}.mlp"
        assert f"{prefix}.gate" in names
        for e in range(4):
            assert {f"{prefix}.experts.gate_up_proj.{e}", f"{prefix}.experts.down_proj.{e}"} <= set(names)
    coverage = pre.coverage()
    assert coverage.share >= 0.9 and coverage.share == 1.0, coverage.line()
    info = {i.name: i for i in pre.layer_info()}
    gate_up = info["model.layers.0.mlp.experts.gate_up_proj.0"]
    assert (gate_up.module_type, gate_up.d_a, gate_up.d_g, gate_up.bias) == (
        f"{'Mixtral' if family == 'Mixtral' else 'Qwen2Moe'}Experts.gate_up_proj",
        32,
        96,
        False,
    )
    assert info["model.layers.0.mlp.gate"].d_g == 4


def test_an_unrecognised_3d_parameter_and_an_unmodelled_layout_are_left_alone_with_their_reason() -> None:
    class Batched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(2, 6, 4))
            self.down_proj = nn.Parameter(torch.randn(2, 4, 3))

        def forward(self, x: Tensor) -> Tensor:
            return torch.einsum("eoi,ti->to", self.gate_up_proj, x).sum(-1, keepdim=True) * x

    model = nn.Sequential(nn.Linear(4, 4), Batched())
    with pytest.warns(UserWarning, match="Batched is not a supported layer type"):
        pre = hylo.HyLoPreconditioner(model)
    assert [info.name for info in pre.layer_info()] == ["0"]

    model = tiny()
    experts = model.model.layers[0].mlp.experts
    experts.is_transposed = True
    with pytest.warns(UserWarning, match=r"declares is_transposed=True \(weights stored transposed\)"):
        pre = hylo.HyLoPreconditioner(model)
    assert not [info.name for info in pre.layer_info() if "experts" in info.name]
    assert ("not preconditioned: model.layers.0.mlp.experts (MixtralExperts declares is_transposed=True (weights "
            "stored transposed), a layout hylo's fused experts do not model)") in pre.summary()  # fmt: skip


# ------------------------------------------------------------------------------------------ the twin, every solver


def run_pair(
    fused: nn.Module,
    twin: nn.Module,
    solver: str,
    steps: int,
    loss: Any = lm_loss,
    rtol: float = 1e-10,
    split_gate_up: bool = False,
    **more: Any,
) -> list[tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]]:
    """``steps`` steps of hylo on both models (SGD, lr 0.05; ``split_gate_up`` for the fused one; ``more`` options
    for both): per step the fused raw gradients (the twin's to ``rtol``), its preconditioned ones and the twin's
    preconditioned ones."""
    pres = [
        hylo.HyLoPreconditioner(fused, **options(solver, split_gate_up), **more),
        hylo.HyLoPreconditioner(twin, **options(solver), **more),
    ]
    assert [x.name for x in pres[0].layer_info()] == joined_names([x.name for x in pres[1].layer_info()])
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, twin)]
    seen = []
    for step in range(steps):
        ids = batch(step)
        raws = []
        for model, pre, opt in zip((fused, twin), pres, opts, strict=True):
            opt.zero_grad()
            loss(model, ids).backward()
            raws.append(expert_grads(model))
            pre.step()
        for name, value in raws[0].items():  # an idle expert: a zero slice, the twin's Linear no gradient
            expected = raws[1].get(name, torch.zeros_like(value))
            torch.testing.assert_close(value, expected, rtol=rtol, atol=rtol / 100, msg=f"raw {name}")
        seen.append((raws[0], expert_grads(fused), expert_grads(twin)))
        for opt in opts:
            opt.step()
    assert {x.solver for x in pres[0].layer_info()} == {x.solver for x in pres[1].layer_info()}
    return seen


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("solver", SOLVERS)
def test_every_solver_gives_fused_experts_the_gradients_of_the_linear_twin(family: str, solver: str) -> None:
    fused = tiny(family)
    twin = linear_twin(fused)
    for step, (raw, got, expected) in enumerate(run_pair(fused, twin, solver, 3)):
        assert got.keys() == expected.keys()
        for name, value in got.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12, msg=f"{name} at step {step}")
        for name in ("model.layers.0.mlp.experts.gate_up_proj.0", "model.layers.0.mlp.experts.down_proj.3"):
            assert not torch.allclose(got[name], raw[name]), f"{name} was not preconditioned at step {step}"


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize(
    ("solver", "more"), [("kfac", {}), ("kfac_adam", {}), ("kfac_adam", {"basis_refresh": "power"})]
)
def test_split_gate_up_is_kfac_on_an_expert_written_with_separate_gate_and_up_linears(
    family: str, solver: str, more: dict[str, Any]
) -> None:
    """The default ``split_gate_up``: a fused expert's gate_up preconditioned as K-FAC preconditions the model whose
    experts hold their gate and up projections as two ``nn.Linear`` layers (Mixtral's unfused w1 and w3), over
    two updates (the second, with the optimizer form's warm-started refresh, refreshing each half from its own
    basis) and a step between them."""
    fused = tiny(family)
    twin = linear_twin(fused, halves=True)
    for step, (_, got, expected) in enumerate(run_pair(fused, twin, solver, 3, split_gate_up=True, **more)):
        assert got.keys() == expected.keys()
        for name, value in got.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12, msg=f"{name} at step {step}")
    unsplit = hylo.HyLoPreconditioner(tiny(family), **options(solver))
    split = hylo.HyLoPreconditioner(tiny(family), solver=solver)
    widths = [(x.name, x.d_g) for x in split.layer_info() if ".gate_up_proj." in x.name]
    assert widths and hylo.HyLoConfig().kfac.split_gate_up
    for pre, blocks in ((split, [(None, d_g // 2) for _, d_g in widths]), (unsplit, [(None, None)] * len(widths))):
        held = {info.name: info.math.factor_blocks for info in pre.layer_info()}
        assert [held[name] for name, _ in widths] == blocks


@pytest.mark.parametrize("solver", ["kfac", "kfac_adam", "sngd"])
def test_the_experts_of_a_block_are_applied_as_one_group(solver: str) -> None:
    model = tiny()
    pre = hylo.HyLoPreconditioner(model, **options(solver))
    for step in range(2):  # an update, then a step between updates: the plan's groups
        model.zero_grad()
        lm_loss(model, batch(step)).backward()
        pre.step()
    plan = apply_plan(pre)
    assert plan is not None
    names = [info.name for info in pre.layer_info()]
    groups = [{names[plan.order[i]] if plan.order is not None else names[i] for i in range(g.start, g.stop)}
              for g in plan.groups]  # fmt: skip
    for attr in ("gate_up_proj", "down_proj"):
        experts = {f"model.layers.0.mlp.experts.{attr}.{e}" for e in range(4)}
        assert any(experts <= group for group in groups), (attr, groups)


def test_grouped_mm_experts_are_preconditioned_as_the_eager_ones() -> None:
    eager = tiny(dtype=torch.float32)
    grouped = tiny(dtype=torch.float32, implementation="grouped_mm")
    grouped.load_state_dict(eager.state_dict())
    for step, (_, got, expected) in enumerate(run_pair(grouped, eager, "kfac", 3, rtol=1e-4)):
        for name, value in got.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-3, atol=1e-5, msg=f"{name} at step {step}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_changes_nothing(reentrant: bool) -> None:
    """transformers' gradient checkpointing: the recomputed forward is not captured again; the preconditioned
    gradients are those without checkpointing."""
    checkpointed, plain = tiny(), tiny()
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    got = run_pair(checkpointed, linear_twin(checkpointed), "sngd", 3)
    expected = run_pair(plain, linear_twin(plain), "sngd", 3)
    for (_, mine, _), (_, want, _) in zip(got, expected, strict=True):
        for name, value in want.items():
            assert torch.equal(mine[name], value), name


# ----------------------------------------------------------------------------------- SNGD against the definition
def test_sngd_on_experts_and_router_is_the_dense_solve_of_the_true_per_token_fisher() -> None:
    """A Mixtral MoE block on 12 tokens with a per-token loss: each token's gradient is its own backward; the
    rows of expert e are the tokens routed to it (n_e of them), U_t = n_e · (the token's share of ∇W_e)."""
    block = tiny().model.layers[0].mlp
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 12, SIZE["width"], generator=gen, dtype=DT)
    target = torch.randn(1, 12, SIZE["width"], generator=gen, dtype=DT)

    def loss_of(out: Tensor, rows: slice) -> Tensor:
        return 0.5 * (out - target[:, rows]).pow(2).sum(-1).mean() * out.shape[1] / 12

    per_token: list[dict[str, Tensor]] = []
    for t in range(12):
        block.zero_grad()
        loss_of(block(x[:, t : t + 1]), slice(t, t + 1)).backward()
        per_token.append(expert_grads(block))
    routed = block.gate(x[0])[2]  # (tokens, k)
    damping = 0.1
    pre = hylo.HyLoPreconditioner(block, solver="sngd", damping=damping, update_freq=1)
    block.zero_grad()
    loss_of(block(x), slice(None)).backward()
    raw = expert_grads(block)
    pre.step()
    got = expert_grads(block)
    checked = 0
    for name, value in raw.items():
        if "experts" in name:
            expert = int(name.rpartition(".")[2])
            tokens = [t for t in range(12) if expert in routed[t].tolist()]
        else:
            tokens = list(range(12))
        if not tokens:
            continue
        u = torch.stack([len(tokens) * per_token[t][name] for t in tokens])
        torch.testing.assert_close(u.mean(0), value, rtol=1e-10, atol=1e-13)  # the oracle's ∇W
        expected = dense_natural_gradient(u, value, damping)
        torch.testing.assert_close(got[name], expected, rtol=1e-8, atol=1e-11, msg=name)
        checked += 1
    assert checked >= 7  # the router and most of the 8 expert projections


# ------------------------------------------------------------------------------ routing: idle, overloaded, dropped
class Routed(nn.Module):
    """A Linear, then fused experts called with a fixed routing (``index``: experts per token; ``num_experts`` is a
    dropped token), positionally or by the ``keywords`` of the routing's two arguments."""

    def __init__(self, experts: nn.Module, index: Tensor, weights: Tensor, keywords: tuple[str, str] | None = None):
        super().__init__()
        self.inp = nn.Linear(SIZE["width"], SIZE["width"], dtype=DT)
        self.experts = experts
        self.index, self.weights, self.keywords = index, weights, keywords

    def forward(self, x: Tensor) -> Tensor:
        if self.keywords is None:
            out: Tensor = self.experts(self.inp(x), self.index, self.weights)
        else:
            out = self.experts(self.inp(x), **dict(zip(self.keywords, (self.index, self.weights), strict=True)))
        return out


def test_idle_experts_keep_their_state_unwarned_and_counted_and_overloaded_experts_and_dropped_tokens_are_the_twins() -> (
    None
):
    fused = tiny().model.layers[0].mlp.experts
    index = torch.tensor([[0, 1]] * 9 + [[1, 4]] * 3)  # experts 2 and 3 idle; token 9..11's second slot dropped
    weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    torch.manual_seed(0)
    model = Routed(fused, index, weights)
    twin = copy.deepcopy(model)
    twin.experts = LinearExperts(fused)
    x = torch.randn(12, SIZE["width"], generator=torch.Generator().manual_seed(2), dtype=DT)

    def loss(m: nn.Module, step: Any) -> Tensor:
        return m(x * (1 + 0.1 * int(step[0, 0] % 3))).pow(2).mean()

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*captured no rows")  # an idle expert is no layer without rows
        seen = run_pair(model, twin, "sngd", 3, loss)
    for raw, got, expected in seen:
        idle = {name for name in got if name not in expected}  # the twin's idle Linears have no gradient
        assert idle == {f"experts.{attr}.{e}" for attr in ("gate_up_proj", "down_proj") for e in (2, 3)}
        for name, value in got.items():
            if name in idle:
                assert not raw[name].any() and not value.any()
            else:
                torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12, msg=name)
    pre = hylo.HyLoPreconditioner(model, solver="sngd", update_freq=1)
    model.zero_grad()
    loss(model, batch(0)).backward()
    pre.step()
    info = {i.name: i for i in pre.layer_info()}
    assert info["experts.down_proj.2"].note == "idle at 1 capture steps: no token routed to it"
    assert info["experts.down_proj.0"].note == ""
    assert info["experts.down_proj.2"].state is None and info["experts.down_proj.0"].state is not None
    assert info["experts.down_proj.1"].rows_kept == (12, 12)  # 9 + 3 tokens


def test_under_kfac_adam_an_expert_idle_between_updates_takes_its_momentum_step_without_a_fallback() -> None:
    """At a step between updates an expert no token reached has ∇W = 0; Adam's step from its moments is finite and
    applied (as AdamW steps a zero gradient of the fused parameter), not refused as non-finite."""
    fused = tiny(dtype=torch.float32).model.layers[0].mlp.experts
    every = torch.tensor([[0, 1], [2, 3]] * 6)
    model = Routed(fused, every, torch.full((12, 2), 0.5))
    model.inp.float()
    # p = 1 and a tiny ε: the step m̂/v̂ of a small gradient has entries far above 1 (the check's scale overflowed)
    options = {"adam_exponent": 1.0, "adam_eps": 1e-12}
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=2, damping=0.1, **options)
    x = torch.randn(12, SIZE["width"], generator=torch.Generator().manual_seed(5))
    for step in range(2):
        model.index = every if step == 0 else torch.tensor([[0, 1], [2, 1]] * 6)  # expert 3 idle at step 1
        model.zero_grad()
        model(x).pow(2).mean().backward()
        pre.step()
    assert not any(info.fallbacks for info in pre.layer_info())  # counted here, reported at the next update
    grad = fused.gate_up_proj.grad
    assert torch.isfinite(grad).all() and grad[3].abs().max() > 1  # the momentum step, written into the zero slice


# ------------------------------------------------------------------------------------------------ your own module
class MyExperts(nn.Module):
    """A user's fused experts: other parameter names, a GELU gate, keyword routing arguments."""

    def __init__(self, experts: int, width: int, inner: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, 2 * inner, width, dtype=DT) / width**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, width, inner, dtype=DT) / inner**0.5)
        self.act_fn = nn.GELU()

    def forward(self, x: Tensor, *, experts: Tensor, scores: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            slot, token = torch.where(experts.mT == e)
            gate, up = F.linear(x[token], self.w_in[e]).chunk(2, dim=-1)
            out.index_add_(0, token, F.linear(self.act_fn(gate) * up, self.w_out[e]) * scores[token, slot, None])
        return out


def test_a_users_fused_experts_registered_with_their_layout_equal_their_twin() -> None:
    layout = ExpertsLayout(gate_up="w_in", down="w_out", arguments=("x", "experts", "scores"))
    handle = hylo.register_layer_type(MyExperts, lambda module, config: ExpertsLayers(module, layout))
    try:
        torch.manual_seed(3)
        mine = MyExperts(3, SIZE["width"], 6)
        index = torch.stack([torch.arange(12) % 3, (torch.arange(12) + 1) % 3], dim=1)
        model = Routed(mine, index, torch.rand(12, 2, dtype=DT), ("experts", "scores"))
        twin = copy.deepcopy(model)
        twin.experts, twin.keywords = LinearExperts(mine, "w_in", "w_out"), None
        x = torch.randn(12, SIZE["width"], generator=torch.Generator().manual_seed(4), dtype=DT)

        def loss(m: nn.Module, step: Tensor) -> Tensor:
            return m(x * (1 + 0.1 * int(step[0, 0] % 3))).pow(2).mean()

        for _, got, expected in run_pair(model, twin, "kfac", 3, loss):
            for name, value in got.items():
                torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12, msg=name)
    finally:
        handle.remove()


# ----------------------------------------------------------------------------------- checkpoints, bf16, P ranks
def steps_of(model: nn.Module, pre: hylo.HyLoPreconditioner, opt: torch.optim.Optimizer, steps: range) -> list[Any]:
    """The preconditioned gradients of ``steps`` (SGD with hylo), in order."""
    seen = []
    for step in steps:
        opt.zero_grad()
        lm_loss(model, batch(step)).backward()
        pre.step()
        seen.append(expert_grads(model))
        opt.step()
    return seen


@pytest.mark.parametrize(
    ("solver", "split_gate_up"), [("kfac", False), ("kfac", True), ("kfac_adam", True), ("kis", False)]
)
def test_training_resumes_bit_exactly_from_a_checkpoint(solver: str, split_gate_up: bool) -> None:
    model = tiny()
    pre = hylo.HyLoPreconditioner(model, **options(solver, split_gate_up))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps_of(model, pre, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hylo": pre.state_dict()}, buffer)
    expected = steps_of(model, pre, opt, range(3, 6))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = tiny(seed=1)
    resumed.load_state_dict(saved["model"])
    resumed_pre = hylo.HyLoPreconditioner(resumed, **options(solver, split_gate_up))
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.05)
    resumed_opt.load_state_dict(saved["opt"])
    resumed_pre.load_state_dict(saved["hylo"])
    for got, want in zip(steps_of(resumed, resumed_pre, resumed_opt, range(3, 6)), expected, strict=True):
        assert got.keys() == want.keys()
        for name, value in got.items():
            assert torch.equal(value, want[name]), name


@pytest.mark.parametrize("saved_split", [False, True])
def test_a_checkpoint_whose_gate_up_factors_are_held_otherwise_is_refused_naming_the_layer(saved_split: bool) -> None:
    """A state_dict made with the other ``split_gate_up`` (or before the option existed: whole factors) holds
    gate_up's G in another layout: the load refuses it, naming the layer, and leaves the preconditioner as it was."""
    model = tiny()
    pre = hylo.HyLoPreconditioner(model, **options("kfac", saved_split))
    steps_of(model, pre, torch.optim.SGD(model.parameters(), lr=0.05), range(2))
    saved = pre.state_dict()
    other = tiny()
    other_pre = hylo.HyLoPreconditioner(other, **options("kfac", not saved_split))
    steps_of(other, other_pre, torch.optim.SGD(other.parameters(), lr=0.05), range(2))
    before = other_pre.state_dict()
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.mlp\.experts\.gate_up_proj\.0'.*G factor"):
        other_pre.load_state_dict(saved)
    after = other_pre.state_dict()
    assert after["checksum"] == before["checksum"]  # the seal over every step count, option and tensor


def test_bf16_experts_are_preconditioned_close_to_float32() -> None:
    """transformers' default grouped_mm experts in bfloat16: factors in float32, the result within bf16 round-off
    of the float32 model's."""
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny(dtype=dtype, implementation="grouped_mm")
        pre = hylo.HyLoPreconditioner(model, solver="kfac", damping=0.1, update_freq=1)
        model.zero_grad()
        lm_loss(model, batch(0)).backward()
        raw = expert_grads(model)
        pre.step()
        results[dtype] = (raw, expert_grads(model))
    raw32, got32 = results[torch.float32]
    raw16, got16 = results[torch.bfloat16]
    for name in ("model.layers.0.mlp.experts.gate_up_proj.1", "model.layers.0.mlp.experts.down_proj.2"):
        assert got16[name].dtype == torch.bfloat16 and torch.isfinite(got16[name]).all()
        assert not torch.allclose(got16[name].float(), raw16[name].float())  # preconditioned
        error = (got16[name].float() - got32[name]).norm() / got32[name].norm()
        raw_error = (raw16[name].float() - raw32[name]).norm() / raw32[name].norm()
        assert error < max(0.1, 4 * raw_error), (name, error, raw_error)


def ranks_train(rank: int, world_size: int, solver: str, sharded: bool) -> list[dict[str, Tensor]]:
    """Three steps of SGD with hylo on tiny Mixtral (float64); of each batch of two sequences one process takes
    both, two ranks one each; DDP, or FSDP2 per block and root (the experts sharded over their dim 0)."""
    model = tiny()
    net: nn.Module = model
    if world_size > 1 and sharded:
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    elif world_size > 1:
        net = nn.parallel.DistributedDataParallel(model)
    pre = hylo.HyLoPreconditioner(net, **{**options(solver), "rank_ratio": 1.0})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(3):
        ids = batch(step)
        mine = ids if world_size == 1 else ids[rank : rank + 1]
        opt.zero_grad()
        lm_loss(net, mine).backward()
        pre.step()
        seen.append({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in full_grads(model).items()})
        opt.step()
    return seen


def full_grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("sharded", [False, True], ids=["DDP", "FSDP2"])
@pytest.mark.parametrize("solver", ["kfac", "sngd", "kid"])
def test_two_ranks_equal_one_process(solver: str, sharded: bool) -> None:
    world_size = 2
    one = ranks_train(0, 1, solver, sharded)  # the whole batch of two sequences
    out = run_distributed(ranks_train, world_size, solver, sharded, timeout=180)
    for step, expected in enumerate(one):
        for rank in range(world_size):
            got = out[rank][step]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, rtol=1e-8, atol=1e-11, msg=f"{name} step {step}")


# ------------------------------------------------------------------------------ a fault in one expert
#: Twelve tokens, every expert routed six of them; tokens 12 and 13 go to expert 2 alone (their second slot dropped).
FAULT_INDEX = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]] * 3 + [[2, 4]] * 2)


def fault_model(solver: str, grouped: bool) -> tuple[Routed, hylo.HyLoPreconditioner]:
    fused = tiny().model.layers[0].mlp.experts
    weights = torch.rand(14, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    model = Routed(fused, FAULT_INDEX, weights)
    pre = hylo.HyLoPreconditioner(model, **{**options(solver), "update_freq": 1, "grouped": grouped})
    return model, pre


def fault_backward(model: Routed, step: int, scale: float = 1.0) -> None:
    """A loss linear in the output (its gradient is ``target`` at any scale), tokens 12 and 13 times ``scale``."""
    gen = torch.Generator().manual_seed(20 + step)
    x = torch.randn(14, SIZE["width"], generator=gen, dtype=DT)
    x[12:] *= scale
    target = torch.randn(14, SIZE["width"], generator=gen, dtype=DT)
    model.zero_grad()
    (model(x) * target).sum().backward()


def expert_layers(model: Routed) -> dict[str, Tensor]:
    return {k: v for k, v in expert_grads(model).items() if k.startswith("experts.")}


def stepped(pre: hylo.HyLoPreconditioner) -> list[str]:
    """``pre.step()``; the messages of the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre.step()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-layer"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("solver", SOLVERS)
def test_a_non_finite_gradient_in_one_expert_skips_the_step_on_every_layer(
    solver: str, bad: float, grouped: bool
) -> None:
    """docs/reliability.md, "Non-finite values": a NaN or Inf in one expert's slice of the fused gradient skips the
    step on every layer — every gradient left as it was, every state untouched — with a warning naming that
    expert's layer (and no other); the next step is the one a run without the faulty step takes."""
    model, pre = fault_model(solver, grouped)
    fault_backward(model, 0)
    assert not stepped(pre)
    states = {info.name: info.state for info in pre.layer_info()}
    fault_backward(model, 1)
    model.experts.gate_up_proj.grad[1, 0, 0] = bad
    raw = {name: p.grad.clone() for name, p in model.named_parameters()}
    (message,) = stepped(pre)
    assert "non-finite" in message and "['experts.gate_up_proj.1']" in message, message
    for name, p in model.named_parameters():
        assert torch.equal(p.grad.nan_to_num(), raw[name].nan_to_num()), name  # left as it was
    assert {info.name: info.state for info in pre.layer_info()} == states  # untouched
    fault_backward(model, 2)
    assert not stepped(pre)
    got = expert_grads(model)
    clean, clean_pre = fault_model(solver, grouped)
    for step in (0, 2):
        fault_backward(clean, step)
        assert not stepped(clean_pre)
    want = expert_grads(clean)
    for name, value in want.items():
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-layer"])
@pytest.mark.parametrize("solver", SOLVERS)
def test_overflowing_curvature_of_one_expert_keeps_its_state_and_the_other_experts_update(
    solver: str, grouped: bool
) -> None:
    """Two tokens ×10⁸⁰ routed to expert 2 alone (float64): its gradients stay finite (10¹⁶⁰), its down projection's
    factor or kernel (10³²⁰) does not. That layer keeps its previous state with a warning naming it (and no other
    expert); every other expert updates, to the very state and preconditioned gradient of the run without the huge
    tokens (their rows are the same: the loss is linear in the output); every result is finite; the next step
    updates it again (docs/reliability.md, "Non-finite values")."""
    model, pre = fault_model(solver, grouped)
    clean, clean_pre = fault_model(solver, grouped)
    for m, p in ((model, pre), (clean, clean_pre)):
        fault_backward(m, 0)
        assert not stepped(p)
    before = {info.name: info.state for info in pre.layer_info()}
    fault_backward(model, 1, scale=1e80)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    messages = stepped(pre)
    fault_backward(clean, 1)
    assert not stepped(clean_pre)
    curvature = [m for m in messages if "non-finite curvature" in m]
    assert len(curvature) == 1 and "experts.down_proj.2" in curvature[0], messages
    faulted = {f"experts.{attr}.2" for attr in ("gate_up_proj", "down_proj")}
    others = [x for x in faulted | {f"experts.{a}.{e}" for a in ("gate_up_proj", "down_proj") for e in (0, 1, 3)}]
    assert not any(f"experts.{a}.{e}" in curvature[0] for a in ("gate_up_proj", "down_proj") for e in (0, 1, 3))
    infos = {info.name: info for info in pre.layer_info()}
    clean_infos = {info.name: info for info in clean_pre.layer_info()}
    kept, previous = infos["experts.down_proj.2"].state, before["experts.down_proj.2"]
    assert infos["experts.down_proj.2"].rejected and kept is not None and previous is not None
    for field, value in previous.tensors.items():  # kfac_adam's moments take the step with the kept basis
        assert field.startswith("exp_avg") or torch.equal(kept.tensors[field], value), field
    got, want = expert_layers(model), expert_layers(clean)
    for name in others:
        assert torch.isfinite(got[name]).all(), name
        if name in faulted:
            continue
        assert infos[name].state != before[name] and not infos[name].rejected, name
        mine, theirs = infos[name].state, clean_infos[name].state
        assert mine is not None and theirs is not None and mine.tensors.keys() == theirs.tensors.keys()
        for field, value in theirs.tensors.items():
            torch.testing.assert_close(mine.tensors[field], value, rtol=1e-10, atol=1e-13, msg=f"{name} {field}")
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13, msg=name)
    fault_backward(model, 2)
    assert not [m for m in stepped(pre) if "non-finite" in m]
    infos = {info.name: info for info in pre.layer_info()}
    assert infos["experts.down_proj.2"].state != before["experts.down_proj.2"]
    assert not any(info.rejected for info in infos.values())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
