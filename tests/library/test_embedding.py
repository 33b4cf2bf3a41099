"""``nn.Embedding`` as a preconditioned layer (hylo/layers.py ``EmbeddingMath``; docs/solvers.md, "Embeddings").

An embedding is a Linear on one-hot inputs: hylo's matrix is W = weightᵀ (embedding_dim ×
num_embeddings), every position of the index tensor is a row, a_i = onehot(t_i) (zero for a
``padding_idx`` token) and g_i = n·∂L/∂s_i. The oracles never use hylo's rows or capture:

- the **true per-token gradients** U_i come from plain autograd, one token at a time (the
  embedding's output is detached at every other position), so they carry torch's own padding
  semantics; SNGD, KID and KIS at ρ = 1 are checked against the dense (F + λI)⁻¹ vec ∇W with
  F = (1/n) Σ vec(U_i) vec(U_i)ᵀ;
- K-FAC against the dense (A ⊗ G + λI)⁻¹ vec ∇W (tests/kit/reference.py's convention), A built
  from ``F.one_hot`` of the indices (and checked to be diag(token counts)/n), G from autograd's
  gradient of the embedding's output;
- the same model written as ``nn.Linear(V, D, bias=False)`` on explicit one-hot float inputs
  (weight = embedding.weightᵀ) gives the same preconditioned gradients, transposed, for every
  solver.

Padding tokens count as rows (n is every position, as for a Linear) and contribute nothing else
to the Fisher: their true per-token gradient is exactly zero, so the oracles sum over the other
tokens only, with divisor n. For K-FAC their output gradients enter G as a Linear's rows with
a zero input would (the one-hot equivalence below pins this).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoConfig, HyLoPreconditioner
from hylo.layers import (
    EmbeddingMath,
    LayerBatch,
    OneHotRows,
    layer_math,
    unsupported_reason,
)
from hylo.layers.rows import FactoredRows, rows_from_fields
from hylo.solvers.smw import FactoredKernel, LowRankState, OneHotKernel
from tests.kit.checks import DT, REPLAY_RTOL, assert_rel_close, rel_err
from tests.kit.reference import dense_kfac, dense_natural_gradient

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

SOLVERS = ["kfac", "sngd", "kid", "kis", "hybrid"]
V, D, T, B, C = 11, 5, 4, 6, 3
DAMPING = 0.1


# ---------------------------------------------------------------------------------------- models
class EmbNet(nn.Module):
    """Embedding(V, D) → ``flat``: Flatten → Linear(T·D, C) (one label per sequence), or
    ``token``: Linear(D, 6) → Tanh → Linear(6, C) on every token (one label per token)."""

    def __init__(self, kind: str, padding_idx: int | None = None, dtype: torch.dtype = DT, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx, dtype=dtype)
        if kind == "flat":
            self.head: nn.Module = nn.Sequential(nn.Flatten(), nn.Linear(T * D, C, dtype=dtype))
        else:
            self.head = nn.Sequential(nn.Linear(D, 6, dtype=dtype), nn.Tanh(), nn.Linear(6, C, dtype=dtype))

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.emb(idx))


class OneHotNet(nn.Module):
    """The same model with the embedding written as Linear(V, D, bias=False) on explicit one-hot inputs.

    Its weight is the embedding's transposed and its head a copy of ``net``'s (own parameters, same values).
    """

    def __init__(self, net: EmbNet) -> None:
        super().__init__()
        dtype = net.emb.weight.dtype
        self.padding_idx = net.emb.padding_idx
        self.emb = nn.Linear(V, D, bias=False, dtype=dtype)
        self.head = EmbNet(net.kind, dtype=dtype).head
        with torch.no_grad():
            self.emb.weight.copy_(net.emb.weight.mT)
        self.head.load_state_dict({k: v.detach().clone() for k, v in net.head.state_dict().items()})

    def forward(self, idx: Tensor) -> Tensor:
        x = F.one_hot(idx, V).to(self.emb.weight.dtype)
        if self.padding_idx is not None:
            x = x * (idx != self.padding_idx).unsqueeze(-1).to(x.dtype)
        return self.head(self.emb(x))


def tokens(shape: tuple[int, ...], seed: int = 1, padding_idx: int | None = None) -> Tensor:
    """Indices of ``shape`` with repeated tokens (and, with ``padding_idx``, a few padding positions)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, shape, generator=gen)
    if padding_idx is not None:
        flat = idx.view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[: max(2, flat.numel() // 5)]] = padding_idx
    return idx


def loss_fn_for(kind: str, idx: Tensor, seed: int = 2) -> Callable[[Tensor], Tensor]:
    """Mean cross-entropy: one label per sequence (``flat``) or per token (``token``)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        labels = torch.randint(0, C, idx.shape[:1], generator=gen)
        return lambda out: F.cross_entropy(out, labels)
    labels = torch.randint(0, C, idx.shape, generator=gen)
    return lambda out: F.cross_entropy(out.reshape(-1, C), labels.reshape(-1))


# ---------------------------------------------------------------------------------------- oracles
def per_token_gradients(net: EmbNet, idx: Tensor, loss_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """True per-token gradients U_i (n, D, V) of the embedding in hylo's orientation, n·(token i's share).

    Token i's forward keeps its graph and every other position's embedding is detached, so the
    backward of the batch loss gives token i's share of ∇(weight) — plain autograd through the
    module itself (torch's padding_idx semantics included), nothing of hylo.
    """
    n = idx.numel()
    mats = []
    for i in range(n):
        net.zero_grad()
        emb = net.emb(idx)
        flat = emb.reshape(n, D)
        only_i = torch.zeros(n, 1, dtype=torch.bool)
        only_i[i] = True
        loss_fn(net.head(torch.where(only_i, flat, flat.detach()).reshape(emb.shape))).backward()
        mats.append(n * net.emb.weight.grad.mT.clone())
    net.zero_grad()
    return torch.stack(mats)


def one_hot_rows(net: EmbNet, idx: Tensor) -> Tensor:
    """a_i = onehot(t_i), zero for padding tokens (n, V), from ``F.one_hot``."""
    a = F.one_hot(idx.reshape(-1), V).to(DT)
    if net.emb.padding_idx is not None:
        a = a * (idx.reshape(-1) != net.emb.padding_idx).unsqueeze(1).to(DT)
    return a


def step_once(
    net: nn.Module, idx: Tensor, loss_fn: Callable[[Tensor], Tensor], **options: object
) -> HyLoPreconditioner:
    """One forward, backward and update step of hylo on ``net``."""
    pre = HyLoPreconditioner(net, update_freq=1, damping=DAMPING, **options)
    loss_fn(net(idx)).backward()
    pre.step()
    return pre


def hylo_matrix(net: EmbNet) -> Tensor:
    return net.emb.weight.grad.mT.detach().clone()


# ---------------------------------------------------------------------------------------- the math
def test_embedding_math_shapes_and_factors() -> None:
    """d_g = embedding_dim, d_a = num_embeddings; A = diag(counts) by bincount; rows are one-hot."""
    emb = nn.Embedding(V, D, padding_idx=3, dtype=DT)
    math = layer_math(emb, HyLoConfig())
    assert isinstance(math, EmbeddingMath)
    assert (math.d_g, math.d_a, math.bias) == (D, V, None)
    idx = torch.tensor([[1, 3, 1, 4], [3, 0, 1, 10]])
    grad_out = torch.randn(2, 4, D, dtype=DT)
    assert math.row_counts(idx, grad_out) == (8, 8)
    factor_a, factor_g = math.kfac_factors(idx, grad_out, 8.0)
    counts = torch.zeros(V, dtype=DT)
    counts[[0, 1, 4, 10]] = torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=DT)  # padding (3) counts nothing
    torch.testing.assert_close(factor_a, torch.diag(counts), rtol=0, atol=0)
    g = 8.0 * grad_out.reshape(8, D)
    torch.testing.assert_close(factor_g, g.mT @ g)
    rows = math.lowrank_rows(idx, grad_out, 8.0)
    expected_a = F.one_hot(idx.reshape(-1), V).to(DT) * (idx.reshape(-1) != 3).unsqueeze(1)
    assert torch.equal(rows.a, expected_a)
    torch.testing.assert_close(rows.g, g)
    assert isinstance(rows, OneHotRows)
    assert rows.tokens.tolist() == [1, -1, 1, 4, -1, 0, 1, 10]  # padding marked −1
    assert math.row_work(8, 8) == 0.0  # no n×V one-hot matrix is built
    batch = LayerBatch.of(math, [(idx, grad_out)], lambda n: n)
    assert batch.shape(1).d_a == V and batch.shape(1).rows == 8


def test_one_hot_rows_are_factored_rows_bit_for_bit() -> None:
    """The index kernel δ(t_i = t_j)(G Gᵀ), its columns and the norms equal the one-hot products exactly, after
    select/scale/to; the one-hot apply equals the factored apply to round-off."""
    math = EmbeddingMath(nn.Embedding(V, D, padding_idx=2))
    idx = torch.tensor([3, 2, 3, 7, 2, 0, 3, 9, 7])
    rows = math.lowrank_rows(idx, torch.randn(9, D), 9.0)
    assert isinstance(rows, OneHotRows)
    index, factors = torch.tensor([0, 1, 2, 4, 6, 7]), torch.rand(6) + 0.5
    for view in (rows, rows.to(torch.float64), rows.select(index).scaled(factors)):
        assert isinstance(view, OneHotRows)
        plain = FactoredRows(view.a, view.g)
        assert torch.equal(view.kernel(), plain.kernel())
        assert torch.equal(view.sq_norms(), plain.sq_norms())
        assert torch.equal(view.kernel_columns(index[:3]), plain.kernel_columns(index[:3]))
        assert view.fields().keys() == {"tokens", "g"}  # what the all-gather sends: no n×V matrix
        grad = torch.randn(1, D, V, dtype=view.dtype)
        # the one-hot kernel's gather-sum against the factored kernel's dense products: the same terms summed in
        # another order (float32 rounding)
        rtol = 1e-12 if view.dtype == torch.float64 else 1e-5
        inner = torch.randn(view.count, view.count, dtype=torch.float64)
        one_hot, factored = (LowRankState(r, inner, 4.0, 0.5) for r in (view, plain))
        applied = OneHotKernel([one_hot], view.dtype).apply(grad.clone(), [one_hot])[0]
        expected = FactoredKernel([factored], view.dtype).apply(grad.clone(), [factored])[0]
        torch.testing.assert_close(applied, expected, rtol=rtol, atol=rtol)
        again = rows_from_fields(view.fields(), D, V)
        assert isinstance(again, OneHotRows) and torch.equal(again.tokens, view.tokens)


# ---------------------------------------------------------------------------------------- (1) SNGD, (4) KID/KIS at ρ = 1
@pytest.mark.parametrize("kind", ["flat", "token"])
@pytest.mark.parametrize(
    "solver, options",
    [
        ("sngd", {}),
        ("kid", {"rank_ratio": 1.0}),
        ("kis", {"rank_ratio": 1.0}),
        ("kis", {"rank_ratio": 1.0, "kis_estimator": "hylo"}),
    ],
    ids=["sngd", "kid-rho1", "kis-rho1", "kis-hylo-rho1"],
)
def test_lowrank_matches_true_per_token_fisher(kind: str, solver: str, options: dict[str, object]) -> None:
    net = EmbNet(kind)
    idx = tokens((B, T))
    loss_fn = loss_fn_for(kind, idx)
    per_token = per_token_gradients(net, idx, loss_fn)
    loss_fn(net(idx)).backward()
    grad = hylo_matrix(net)
    assert_rel_close(per_token.mean(0), grad, REPLAY_RTOL)  # the per-token gradients add up to ∇W
    net.zero_grad()
    step_once(net, idx, loss_fn, solver=solver, **options)
    expected = dense_natural_gradient(per_token, grad, DAMPING)
    assert rel_err(expected, grad / DAMPING) > 1e-2  # the curvature matters at this damping
    assert_rel_close(hylo_matrix(net), expected)


@pytest.mark.parametrize("shape", [(T,), (2, 3, 4)], ids=["unbatched", "3d"])
def test_any_index_shape_is_rows_of_tokens(shape: tuple[int, ...]) -> None:
    """Indices of shape (T,) or (2, 3, 4): every position is a row."""
    net = EmbNet("token")
    idx = tokens(shape)
    loss_fn = loss_fn_for("token", idx)
    per_token = per_token_gradients(net, idx, loss_fn)
    pre = step_once(net, idx, loss_fn, solver="sngd")
    grad = per_token.mean(0)
    state = pre.layer_info()[0].state
    assert state is not None and state.fields["divisor"] == idx.numel()
    assert_rel_close(hylo_matrix(net), dense_natural_gradient(per_token, grad, DAMPING))


# ---------------------------------------------------------------------------------------- (2) K-FAC
def _kfac_step(
    kind: str, solver: str, **options: Any
) -> tuple[EmbNet, HyLoPreconditioner, Tensor, Tensor, Tensor, Tensor]:
    """One update step of ``solver`` on an EmbNet: the net, the preconditioner, the indices, ∇W, and the one-hot rows
    a and the true output gradients g = n·∂L/∂s of its tokens."""
    net = EmbNet(kind)
    idx = tokens((B, T))
    loss_fn = loss_fn_for(kind, idx)
    pre = HyLoPreconditioner(net, solver=solver, update_freq=1, damping=DAMPING, **options)
    out = net.emb(idx)
    out.retain_grad()
    loss_fn(net.head(out)).backward()
    grad = hylo_matrix(net)
    pre.step()
    n = idx.numel()
    return net, pre, idx, grad, one_hot_rows(net, idx), n * out.grad.reshape(n, D)


@pytest.mark.parametrize("kind", ["flat", "token"])
def test_kfac_matches_dense_with_diagonal_token_counts(kind: str) -> None:
    net, pre, idx, grad, a, g = _kfac_step(kind, "kfac")
    n = idx.numel()
    assert_rel_close(g.mT @ a / n, grad, REPLAY_RTOL)  # the one-hot rows reproduce ∇W
    factor_a, factor_g = a.mT @ a / n, g.mT @ g / n
    counts = torch.bincount(idx.reshape(-1), minlength=V).to(DT)
    torch.testing.assert_close(factor_a, torch.diag(counts / n), rtol=0, atol=1e-15)
    state = pre.layer_info()[0].state
    assert state is not None
    assert_rel_close(state.tensors["factor_a"], factor_a, REPLAY_RTOL)
    assert_rel_close(state.tensors["factor_g"], factor_g, REPLAY_RTOL)
    expected = dense_kfac(factor_a, factor_g, grad, DAMPING)
    assert rel_err(expected, grad / DAMPING) > 1e-2
    assert_rel_close(hylo_matrix(net), expected)


@pytest.mark.parametrize("kind", ["flat", "token"])
def test_kfac_adam_in_its_kfac_reduction_matches_dense_with_its_identity_token_basis(kind: str) -> None:
    """``kfac_adam`` keeps an embedding's token side in the identity basis, e_a = diag(A), never decomposed
    (docs/solvers.md, "Degenerate eigenspaces"); in its K-FAC reduction (v̂ = e_g e_aᵀ, exponent 1, β₁ 0, ε = λ) its
    step is the dense (A ⊗ G + λI)⁻¹ vec ∇W with A and G from the one-hot rows and the true output gradients."""
    options = {"adam_betas": (0.0, 0.999), "adam_exponent": 1.0, "second_moment": "factors", "adam_eps": DAMPING}
    net, pre, idx, grad, a, g = _kfac_step(kind, "kfac_adam", **options)
    n = idx.numel()
    state = pre.layer_info()[0].state
    assert state is not None
    assert torch.equal(state.tensors["evecs_a"], torch.eye(V, dtype=DT))
    expected = dense_kfac(a.mT @ a / n, g.mT @ g / n, grad, DAMPING)
    assert rel_err(expected, grad / DAMPING) > 1e-2
    assert_rel_close(hylo_matrix(net), expected)


# ---------------------------------------------------------------------------------------- (3) padding_idx
@pytest.mark.parametrize("kind", ["flat", "token"])
@pytest.mark.parametrize("solver", SOLVERS)
def test_padding_column_stays_zero_and_the_rest_matches(kind: str, solver: str) -> None:
    pad = 0
    net = EmbNet(kind, padding_idx=pad)
    idx = tokens((B, T), padding_idx=pad)
    is_pad = idx.reshape(-1) == pad
    assert 0 < int(is_pad.sum()) < idx.numel()
    loss_fn = loss_fn_for(kind, idx)
    per_token = per_token_gradients(net, idx, loss_fn)
    assert torch.equal(per_token[is_pad], torch.zeros_like(per_token[is_pad]))  # torch's padding semantics
    pre = HyLoPreconditioner(net, solver=solver, update_freq=1, damping=DAMPING, rank_ratio=1.0)
    out = net.emb(idx)
    out.retain_grad()
    loss_fn(net.head(out)).backward()
    grad = hylo_matrix(net)
    assert torch.equal(grad[:, pad], torch.zeros(D, dtype=DT))
    pre.step()
    got = hylo_matrix(net)
    assert torch.equal(got[:, pad], torch.zeros(D, dtype=DT)), "the padding column must stay exactly 0"
    n = idx.numel()
    used = pre.solver_of("emb")
    if used == "kfac":  # A over the non-padding one-hots, G over every row, both divided by n
        a = F.one_hot(idx.reshape(-1)[~is_pad], V).to(DT)
        g = n * out.grad.reshape(n, D)
        expected = dense_kfac(a.mT @ a / n, g.mT @ g / n, grad, DAMPING)
    else:  # the Fisher of the non-padding tokens, divisor n
        kept = per_token[~is_pad]
        fisher_rows = torch.cat([kept, torch.zeros(int(is_pad.sum()), D, V, dtype=DT)])
        expected = dense_natural_gradient(fisher_rows, grad, DAMPING)
    assert rel_err(expected, grad / DAMPING) > 1e-2
    assert_rel_close(got, expected)


@pytest.mark.parametrize("solver", SOLVERS)
def test_padding_row_of_the_weight_never_moves(solver: str) -> None:
    """A few optimizer steps with hylo: the padding embedding stays exactly zero."""
    net = EmbNet("token", padding_idx=2)
    pre = HyLoPreconditioner(net, solver=solver, update_freq=2, damping=DAMPING)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        idx = tokens((B, T), seed=10 + step, padding_idx=2)
        opt.zero_grad()
        loss_fn_for("token", idx, seed=20 + step)(net(idx)).backward()
        pre.step()
        opt.step()
    assert torch.equal(net.emb.weight[2], torch.zeros(D, dtype=DT))
    assert torch.isfinite(net.emb.weight).all()


# ---------------------------------------------------------------------------------------- (5) .grad dtype and shape
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("solver", SOLVERS)
def test_written_grad_keeps_its_tensor_dtype_and_shape(dtype: torch.dtype, solver: str) -> None:
    net = EmbNet("token", padding_idx=0, dtype=dtype)
    pre = HyLoPreconditioner(net, solver=solver, update_freq=1, damping=DAMPING)
    idx = tokens((B, T), padding_idx=0)
    loss_fn_for("token", idx)(net(idx)).backward()
    before = net.emb.weight.grad
    raw = before.clone()
    pre.step()
    after = net.emb.weight.grad
    assert after is before  # written in place
    assert after.dtype == dtype and after.shape == (V, D)
    assert torch.isfinite(after.float()).all()
    assert not torch.equal(after, raw)
    assert torch.equal(after[0], torch.zeros(D, dtype=dtype))
    assert pre.layer_info()[0].math.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


# ---------------------------------------------------------------------------------------- (6) what is left alone
class _BiasOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.shift


def test_unsupported_variants_are_listed_with_their_reasons() -> None:
    model = nn.ModuleDict(
        {
            "emb": nn.Embedding(7, 4),
            "sparse": nn.Embedding(7, 4, sparse=True),
            "freq": nn.Embedding(7, 4, scale_grad_by_freq=True),
            "bag": nn.EmbeddingBag(7, 4),
            "ln": nn.LayerNorm(4),
            "bn": nn.BatchNorm1d(4),
            "gn": nn.GroupNorm(2, 4),
            "rms": nn.RMSNorm(4),
            "prelu": nn.PReLU(4),
            "shift": _BiasOnly(),
            "frozen": nn.Embedding(7, 4).requires_grad_(False),
        }
    )
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        pre = HyLoPreconditioner(model)
    assert [info.name for info in pre.layer_info()] == ["emb"]
    assert pre.layer_info()[0].module_type == "Embedding"
    lines = pre.summary().splitlines()

    def reason(name: str) -> str:
        (line,) = [line for line in lines if line.startswith(f"  not preconditioned: {name} (")]
        return line

    assert "sparse=True" in reason("sparse") and "sparse gradients" in reason("sparse")
    assert "scale_grad_by_freq=True" in reason("freq")
    assert "EmbeddingBag" in reason("bag")
    for name in ("sparse", "freq", "bag", "ln", "bn", "gn", "rms", "prelu", "shift"):
        assert "stay with the optimizer" in reason(name) or "stays with the optimizer" in reason(name), reason(name)
    for name in ("ln", "bn", "gn", "rms"):
        assert "normalisation" in reason(name)
    assert "weight does not require grad" in reason("frozen")
    assert unsupported_reason(nn.Conv3d(2, 2, 3)).startswith("Conv3d is not a supported layer type")


def test_sparse_gradient_after_registration_raises_clearly() -> None:
    net = EmbNet("token")
    pre = HyLoPreconditioner(net, solver="sngd", update_freq=1)
    net.emb.sparse = True
    idx = tokens((B, T))
    loss_fn_for("token", idx)(net(idx)).backward()
    with pytest.raises(ValueError, match="sparse"):
        pre.step()


# ---------------------------------------------------------------------------------------- (7) == Linear on one-hot inputs
@pytest.mark.parametrize("kind", ["flat", "token"])
@pytest.mark.parametrize("padding_idx", [None, 0], ids=["nopad", "pad"])
@pytest.mark.parametrize("solver", SOLVERS)
def test_equals_linear_on_explicit_one_hot_inputs(kind: str, padding_idx: int | None, solver: str) -> None:
    """Every solver, default rank ratio (KID/KIS keep a fraction of the rows), three steps, update every 2."""
    net = EmbNet(kind, padding_idx=padding_idx)
    twin = OneHotNet(net)
    results = []
    for model in (net, twin):
        pre = HyLoPreconditioner(model, solver=solver, update_freq=2, damping=DAMPING, rank_ratio=0.5, seed=3)
        per_step = []
        for step in range(3):
            idx = tokens((B, T), seed=30 + step, padding_idx=padding_idx)
            model.zero_grad()
            loss_fn_for(kind, idx, seed=40 + step)(model(idx)).backward()
            pre.step()
            emb_grad = model.emb.weight.grad
            per_step.append(
                (
                    emb_grad.mT.clone() if model is net else emb_grad.clone(),
                    [p.grad.clone() for p in model.head.parameters()],
                    pre.solver_of("emb"),
                )
            )
        results.append(per_step)
    for (e_grad, e_head, e_solver), (l_grad, l_head, l_solver) in zip(*results, strict=True):
        assert e_solver == l_solver
        assert_rel_close(e_grad, l_grad, 1e-10)
        for a, b in zip(e_head, l_head, strict=True):
            assert_rel_close(a, b, 1e-10)
    if padding_idx is not None:
        assert torch.equal(results[0][-1][0][:, padding_idx], torch.zeros(D, dtype=DT))


# ---------------------------------------------------------------------------------------- the pipeline on sequences
@pytest.mark.parametrize("solver", SOLVERS)
def test_per_token_model_trains_with_every_solver(solver: str) -> None:
    """Embedding → per-token Linear → Tanh → Linear, AdamW + hylo: finite, and the loss goes down."""
    net = EmbNet("token", padding_idx=0)
    pre = HyLoPreconditioner(net, solver=solver, update_freq=2, damping=DAMPING)
    opt = torch.optim.AdamW(net.parameters(), lr=0.02)
    idx = tokens((B, T), seed=5, padding_idx=0)
    loss_fn = loss_fn_for("token", idx, seed=6)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = loss_fn(net(idx))
        loss.backward()
        pre.step()
        opt.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert losses[-1] < losses[0]
    assert pre.memory_usage()["emb"] > 0


@pytest.mark.parametrize("solver", SOLVERS)
def test_llm_like_shape_stays_cheap(solver: str) -> None:
    """V = 256, 2,048 tokens (8 × 256), D = 32, float32: one update step well under a few seconds."""
    torch.manual_seed(0)
    vocab, dim = 256, 32
    model = nn.Sequential(nn.Embedding(vocab, dim, padding_idx=0), nn.Linear(dim, vocab))
    idx = torch.randint(0, vocab, (8, 256))
    targets = torch.randint(0, vocab, (8, 256))
    pre = HyLoPreconditioner(model, solver=solver, update_freq=1, damping=DAMPING)
    F.cross_entropy(model(idx).reshape(-1, vocab), targets.reshape(-1)).backward()
    start = time.perf_counter()
    pre.step()
    elapsed = time.perf_counter() - start
    grad = model[0].weight.grad
    assert torch.isfinite(grad).all() and torch.equal(grad[0], torch.zeros(dim))
    assert elapsed < 20.0, f"{solver}: {elapsed:.1f} s"
