"""Adam in the K-FAC eigenbasis where the eigenbasis is not unique (docs/solvers.md, "Degenerate eigenspaces").

- A refresh of a factor with repeated eigenvalues (rank-deficient too), by ``eigh`` or by the warm-started refresh,
  from a previous basis that is any eigenbasis of it, leaves the next step unchanged to round-off: no rotation
  inside an eigenspace of equal eigenvalues mixes the moments. The previous basis is drawn so that the
  eigensolver's own basis differs from it inside those eigenspaces (the property is not vacuous).
- An embedding's factor is diagonal: its basis is the identity, never decomposed, and a token absent from a batch
  keeps its own moments (they decay as Adam's do).
- On a tiny untied Llama (width 64, batches of 16 windows of the standard library's sources) every embedding row
  stays bounded over 50 steps under the optimizer form's defaults and under ``kfac_adam`` with both refreshes
  (before: rows of norm ≤ 0.2 jumped to thousands right after the first refresh).
- On the tiny untied Llama and Mistral at lr 10⁻³ the optimizer form's defaults reach a held-out loss no worse than
  AdamW's from the same weights on the same batches (one seed, 80 steps; 3 seeds and 150 steps with ``-m slow``).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import hylo
from hylo.numerics import aligned_many
from hylo.solvers.base import FamilyOptions, UpdateContext
from hylo.solvers.bundled.adam_rule import AdamRule, KFACAdamConfig
from hylo.solvers.bundled.kfac_adam import KFACAdamFamily, KFACAdamInputs, KFACAdamState
from hylo.telemetry.profiling import DISABLED

pytestmark = pytest.mark.usefixtures("single_thread")

DT = torch.float64
FAMILY = KFACAdamFamily()


def _orthogonal(d: int, gen: torch.Generator) -> Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=DT))
    return q * torch.sign(torch.diagonal(r))


def _degenerate(sizes: list[int], zero: bool, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """A PSD factor whose eigenvalues repeat in clusters of ``sizes`` (the first cluster 0 with ``zero``), an eigenbasis
    of it other than the one ``eigh`` returns (each cluster turned by a random rotation), its eigenvalues ascending."""
    d = sum(sizes)
    values = torch.cat(
        [torch.full((k,), 0.0 if zero and i == 0 else float(i + 1) ** 2, dtype=DT) for i, k in enumerate(sizes)]
    )
    basis = _orthogonal(d, gen)
    factor = basis @ torch.diag(values) @ basis.mT
    turned, start = basis.clone(), 0
    for k in sizes:
        turned[:, start : start + k] = basis[:, start : start + k] @ _orthogonal(k, gen)
        start += k
    return (factor + factor.mT) / 2, values, turned


def _state(factors: list[tuple[Tensor, Tensor, Tensor]], gen: torch.Generator) -> KFACAdamState:
    (fa, ea, qa), (fg, eg, qg) = factors
    exp_avg = torch.randn(len(eg), len(ea), generator=gen, dtype=DT)
    exp_avg_sq = torch.rand(len(eg), len(ea), generator=gen, dtype=DT).pow(4) + 1e-6  # v over six decades
    return KFACAdamState(fa, fg, ea, qa, eg, qg, exp_avg, exp_avg_sq, 5, 0.1, AdamRule.of(KFACAdamConfig()))


def _refreshed(state: KFACAdamState, refresh: str) -> KFACAdamState:
    """The family's update of ``state`` from the same running factors (its solve and assemble)."""
    options = KFACAdamConfig(basis_refresh=refresh)
    prepared = KFACAdamInputs(state.factor_a, state.factor_g, state, options)
    context = UpdateContext(
        rank=0, damping=0.1, factor_decay=0.0, seed=0, watch=DISABLED, options=FamilyOptions([options])
    )
    (solution,) = FAMILY.solve([prepared], context)
    new = FAMILY.assemble(prepared, solution, context)
    assert isinstance(new, KFACAdamState)
    return new


@st.composite
def _clusters(draw: Any) -> tuple[list[int], list[int], bool, int]:
    sizes_a = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4).filter(lambda s: max(s) > 1))
    sizes_g = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    return sizes_a, sizes_g, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("refresh", ["eigh", "power"])
@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(case=_clusters())
def test_a_refresh_of_a_factor_with_repeated_eigenvalues_leaves_the_step_unchanged(
    refresh: str, case: tuple[list[int], list[int], bool, int]
) -> None:
    sizes_a, sizes_g, zero, seed = case
    gen = torch.Generator().manual_seed(seed)
    state = _state([_degenerate(sizes_a, zero, gen), _degenerate(sizes_g, False, gen)], gen)
    new = _refreshed(state, refresh)
    grad = torch.randn(state.exp_avg.shape, generator=gen, dtype=DT)
    before, after = state.advance(grad)[0], new.advance(grad)[0]
    assert float((after - before).abs().max()) <= 1e-9 * float(before.abs().max())
    # not vacuous: the eigensolver's own basis differs from the previous one inside the repeated eigenspace
    if refresh == "eigh":
        _, own = torch.linalg.eigh(state.factor_a)
        assert float((own.mT @ state.evecs_a).abs().sub(torch.eye(len(own), dtype=DT)).abs().max()) > 1e-3


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(patterns=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=5), min_size=2, max_size=4))
def test_every_eigenspace_of_every_matrix_is_turned_at_once(patterns: list[list[int]]) -> None:
    """Factors of one size with other eigenspace patterns (sizes 1–4, padded to the largest in one batched turn), each
    decomposed by ``eigh``: the turned basis of each is its previous eigenbasis again, to round-off (a column alone
    in its eigenspace up to its sign, which the turn leaves to the eigensolver) — every column an eigenvector of its
    eigenvalue, none mixed with another eigenspace or with the padding."""
    d = min(sum(p) for p in patterns)
    gen = torch.Generator().manual_seed(sum(len(p) for p in patterns))
    sizes = [_cut(p, d) for p in patterns]
    cases = [_degenerate(s, zero=False, gen=gen) for s in sizes]
    decompositions = [torch.linalg.eigh(factor) for factor, _, _ in cases]
    turned = aligned_many([e for e, _ in decompositions], [q for _, q in decompositions], [q for _, _, q in cases])
    for (factor, values, previous), basis, pattern in zip(cases, turned, sizes, strict=True):
        alone = torch.tensor([size == 1 for size in pattern for _ in range(size)])
        signs = torch.where(alone, torch.sign(torch.diagonal(previous.mT @ basis)), 1.0)
        assert float((basis - previous * signs).abs().max()) <= 1e-8
        assert float((basis @ torch.diag(values) @ basis.mT - factor).abs().max()) <= 1e-10 * float(values.max())


def _cut(sizes: list[int], d: int) -> list[int]:
    """``sizes`` cut to add up to ``d``."""
    out: list[int] = []
    for size in sizes:
        out.append(min(size, d - sum(out)))
    return [size for size in out if size]


def test_an_embedding_keeps_the_identity_basis_and_absent_tokens_keep_their_moments() -> None:
    """Tokens 0–3 at the first update, then only 4–7: the basis on the vocabulary side is the identity at every
    update (no decomposition: e_a = diag(A)), and tokens 0–3 keep their moments: their momentum in parameter space,
    Q_g m, decays by β₁ at each step without a gradient, across updates too (m is carried exactly), and their v by
    β₂ between updates."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 3, dtype=DT), nn.Flatten(), nn.Linear(6, 2, dtype=DT))
    pre = hylo.HyLoPreconditioner(model, solver="kfac_adam", update_freq=2, skip_layers=["2"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    history = []
    for step in range(6):
        tokens = torch.tensor([[0, 1], [2, 3]]) if step < 2 else torch.tensor([[4, 5], [6, 7]])
        opt.zero_grad()
        model(tokens).square().sum().backward()
        pre.step()
        (info,) = pre.layer_info()
        assert info.state is not None
        history.append({k: v.clone() for k, v in info.state.tensors.items()})
    rule = AdamRule.of(KFACAdamConfig())
    for now in history:
        assert torch.equal(now["evecs_a"], torch.eye(8, dtype=DT))
        assert torch.equal(now["evals_a"], torch.diagonal(now["factor_a"]))
    for step in range(2, 6):
        then, now = history[step - 1], history[step]
        momentum_now, momentum_then = (s["evecs_g"] @ s["exp_avg"][:, :4] for s in (now, then))
        torch.testing.assert_close(momentum_now, rule.beta1 * momentum_then, rtol=1e-10, atol=0)
        if step % 2:  # between updates
            torch.testing.assert_close(
                now["exp_avg_sq"][:, :4], rule.beta2 * then["exp_avg_sq"][:, :4], rtol=1e-12, atol=0
            )
    assert float(history[1]["exp_avg"][:, :4].abs().min()) > 0  # the absent tokens had moments to keep


# --------------------------------------------------------------------------- the tiny untied Llama
WIDTH = 64
BATCH, SEQ = 16, 32


def _llama(seed: int, family: str = "llama") -> nn.Module:
    """The tiny untied Llama (or Mistral: grouped-query attention, a sliding window) with weights from ``seed``."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    common = {
        "vocab_size": 256, "hidden_size": WIDTH, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": SEQ, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    if family == "llama":
        config = transformers.LlamaConfig(intermediate_size=176, num_key_value_heads=4, **common)
        model: nn.Module = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MistralConfig(intermediate_size=224, num_key_value_heads=2, sliding_window=16, **common)
        model = transformers.MistralForCausalLM(config)
    return model.train()


#: Standard-library sources read as bytes: the training text, and the held-out text.
SOURCES = {"train": ("argparse", "typing", "functools", "inspect", "enum"), "validation": ("pathlib", "textwrap")}


@functools.cache
def _text(split: str = "train") -> Tensor:
    files = [Path(importlib.import_module(name).__file__ or "") for name in SOURCES[split]]
    joined = b"".join(path.read_bytes() for path in files)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8).long()


def _windows(step: int, split: str = "train") -> Tensor:
    data = _text(split)
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen).tolist()
    return torch.stack([data[s : s + SEQ] for s in starts])


@pytest.mark.parametrize(
    "options",
    [{}, {"basis_refresh": "eigh"}, {"solver": "kfac_adam", "basis_refresh": "power", "update_freq": 5}],
    ids=["form-defaults", "eigh", "power-every-5"],
)
def test_the_embedding_rows_of_an_untied_llama_stay_bounded(options: dict[str, Any]) -> None:
    """50 steps at lr 3·10⁻³: an AdamW step moves an entry by about lr, so a 64-wide row moves by at most about
    50 · 3·10⁻³ · √64 = 1.2 from its initial norm (≤ 0.2); the bound 2 leaves room and is 1,000 times below what
    the rows reached before."""
    model = _llama(0)
    optimizer = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=3e-3), **options)
    table = model.get_input_embeddings().weight
    largest = 0.0
    for step in range(50):
        ids = _windows(step)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        largest = max(largest, float(table.detach().norm(dim=1).max()))
    assert largest <= 2.0


def _held_out_loss(family: str, seed: int, steps: int, form: bool) -> float:
    """Mean held-out loss over 8 validation batches after ``steps`` steps of AdamW(lr 10⁻³), alone or in the form."""
    model = _llama(seed, family)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    optimizer = hylo.HyLoOptimizer(model, adamw) if form else adamw(model.parameters())
    for step in range(steps):
        ids = _windows(step)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return sum(float(model(input_ids=ids, labels=ids).loss) for ids in map(_held_out, range(8))) / 8


def _held_out(k: int) -> Tensor:
    return _windows(10_000 + k, "validation")


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize(
    ("seeds", "steps"), [pytest.param(1, 80, id="1-seed"), pytest.param(3, 150, id="3-seeds", marks=pytest.mark.slow)]
)
def test_the_forms_defaults_are_no_worse_than_adamw_at_a_small_lr(family: str, seeds: int, steps: int) -> None:
    """The issue's race: the form lost to AdamW at lr 10⁻³ on Llama and Mistral (2.86 against 2.50, 3 seeds) — its
    embedding rows exploding, and Adam in the eigenbasis of the LM head's factors. With the embedding's identity
    basis and the head left to AdamW (:func:`hylo.optimizer.output_layers`), the mean over seeds is no worse."""
    form = [_held_out_loss(family, seed, steps, form=True) for seed in range(seeds)]
    adamw = [_held_out_loss(family, seed, steps, form=False) for seed in range(seeds)]
    assert sum(form) / seeds <= sum(adamw) / seeds, (form, adamw)
