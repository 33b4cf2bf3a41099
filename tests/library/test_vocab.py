"""Vocabulary-sized layers: K-FAC's memory budget (``kfac_max_state_mb``) and the summary of long names.

A layer's K-FAC state — running A and G, their eigenvectors and eigenvalues — is known from its
shape at construction (docs/hybrid-policy.md, "Memory budget"). Over the budget, ``solver="kfac"``
(or a ``layer_solvers`` entry) refuses the layer before anything is hooked, and the hybrid policy
never gives it K-FAC. The size formula is checked against the bytes the preconditioner really
holds after a K-FAC update (``memory_usage``, counted from the state's storages).
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo import HyLoPreconditioner
from hylo.distributed import BucketedCommunicator
from hylo.integrity import seal
from hylo.layers import EmbeddingMath
from hylo.layers.rows import FactoredRows, OneHotRows, rows_from_fields
from hylo.payload import Payload
from hylo.policy import MB
from hylo.solvers.kfac import kfac_state_bytes
from tests.kit.cluster import ThreadCluster
from tests.kit.internals import hooked

pytestmark = pytest.mark.usefixtures("single_thread")

V, D, T, B = 300, 8, 6, 4


class TinyLM(nn.Module):
    """Embedding(V, D) → Linear(D, D) → Tanh → head Linear(D, V) on every token."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.tokens(x))))


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _train(model: nn.Module, pre: HyLoPreconditioner | None, steps: int = 3) -> dict[str, Tensor]:
    """``steps`` steps of SGD; the gradients of the last step after ``pre.step()``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if pre is not None:
            pre.step()
        if step < steps - 1:
            optimizer.step()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# K-FAC state of the embedding (A 300×300, G 8×8) and of the head (A 9×9, G 300×300) in float32: 0.69 MB each;
# the middle layer's (9×9, 8×8) is 1.2 KB.
BUDGET = 0.5


def _hooked(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if hooked(module)]


def test_kfac_over_budget_raises_naming_the_layers_and_leaves_the_model_untouched() -> None:
    model, twin = TinyLM(), TinyLM()
    with pytest.raises(ValueError) as caught:
        HyLoPreconditioner(model, solver="kfac", kfac_max_state_mb=BUDGET)
    message = str(caught.value)
    size = f"{kfac_state_bytes(V, D, 4) / MB:.3g}"
    assert size == "0.688"
    assert f"'tokens' (Embedding, float32): K-FAC state {size} MB (A {V}×{V}, G {D}×{D})" in message
    assert f"'head' (Linear, float32): K-FAC state {size} MB (A {D + 1}×{D + 1}, G {V}×{V})" in message
    assert "'mid'" not in message
    assert "kfac_max_state_mb=0.5" in message and "skip_layers=['tokens', 'head']" in message
    assert "kfac_max_state_mb=None" in message
    assert _hooked(model) == []
    assert all(name not in vars(module) for module in model.modules() for name in ("forward",))
    # the model trains exactly as one hylo never touched
    plain, untouched = _train(model, None), _train(twin, None)
    assert all(torch.equal(plain[name], untouched[name]) for name in untouched)


def test_a_layer_solvers_entry_for_kfac_is_held_to_the_budget_too() -> None:
    with pytest.raises(ValueError, match=r"'head' \(Linear"):
        HyLoPreconditioner(TinyLM(), layer_solvers={"head": "kfac"}, kfac_max_state_mb=BUDGET)
    HyLoPreconditioner(TinyLM(), layer_solvers={"mid": "kfac"}, kfac_max_state_mb=BUDGET).remove()


@pytest.mark.parametrize(
    "options",
    [{"kfac_max_state_mb": None}, {"kfac_max_state_mb": math.inf}, {"kfac_max_state_mb": 1.0}],
    ids=["none", "inf", "larger"],
)
def test_opting_in_builds_kfac_and_the_state_is_the_size_counted(options: dict[str, float | None]) -> None:
    model = TinyLM()
    pre = HyLoPreconditioner(model, solver="kfac", damping=0.1, **options)
    _train(model, pre, steps=1)
    held = pre.memory_usage()
    assert held["tokens"] == kfac_state_bytes(V, D, 4)
    assert held["head"] == kfac_state_bytes(D + 1, V, 4)
    assert held["mid"] == kfac_state_bytes(D + 1, D, 4)


def test_skip_layers_leaves_the_vocabulary_layers_to_the_optimizer() -> None:
    pre = HyLoPreconditioner(TinyLM(), solver="kfac", kfac_max_state_mb=BUDGET, skip_layers=["tokens", "head"])
    assert [info.name for info in pre.layer_info()] == ["mid"]


def test_a_layer_under_the_budget_is_unaffected() -> None:
    runs = []
    for budget in (0.01, None):
        model = TinyLM()
        pre = HyLoPreconditioner(
            model, solver="kfac", damping=0.1, skip_layers=["tokens", "head"], kfac_max_state_mb=budget
        )
        runs.append(_train(model, pre))
        assert pre.layer_info()[0].note == ""
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


def test_hybrid_never_gives_an_over_budget_layer_kfac_and_says_why() -> None:
    model = TinyLM()
    # fidelity off and every row kept (rank_ratio=1): the cost rule alone would take K-FAC for the middle layer (9×9, 8×8), so a
    # budget below its 1.2 KB state shows the "memory" reason where the rule would have taken K-FAC
    budget = 0.001
    assert kfac_state_bytes(D + 1, D, 4) > budget * MB
    pre = HyLoPreconditioner(
        model, damping=0.1, fidelity_budget=0.0, kfac_max_state_mb=budget, update_freq=1, rank_ratio=1.0
    )
    _train(model, pre, steps=2)
    decisions = {d.layer: d for d in pre.decision_log}
    assert all(d.solver != "kfac" for d in pre.decision_log)
    for d in pre.decision_log:  # every layer is over this budget: the cheaper variant, whatever the regime
        assert d.reason == "memory" and d.solver == min(("kid", "kis"), key=lambda v: d.costs[v]), d
    assert decisions["mid"].cost_kfac <= decisions["mid"].cost_lowrank  # the rule would have taken K-FAC
    assert decisions["mid"].solver == "kis" and decisions["mid"].critical  # KIS although critical
    info = {i.name: i for i in pre.layer_info()}
    assert info["mid"].note.startswith("never K-FAC: K-FAC state")
    summary = pre.summary()
    (line,) = [line for line in summary.splitlines() if line.startswith("  mid ")]
    assert "(never K-FAC: K-FAC state 0.00117 MB (A 9×9, G 8×8) > kfac_max_state_mb=0.001)" in line


def test_hybrid_keeps_kfac_where_it_fits() -> None:
    model = TinyLM()
    pre = HyLoPreconditioner(model, damping=0.1, fidelity_budget=0.0, update_freq=1, rank_ratio=1.0)
    _train(model, pre, steps=2)
    decisions = {d.layer: d for d in pre.decision_log}
    assert decisions["mid"].solver == "kfac" and decisions["mid"].reason == "cost"
    assert all(info.note == "" for info in pre.layer_info())


def test_solver_fn_choosing_kfac_over_the_budget_is_refused() -> None:
    model = TinyLM()
    pre = HyLoPreconditioner(model, solver_fn=lambda name, step, stats: "kfac", kfac_max_state_mb=BUDGET)
    with pytest.raises(ValueError, match="solver_fn returned 'kfac' for layer 'tokens'"):
        _train(model, pre, steps=1)


def test_reconfigure_to_kfac_is_checked_and_changes_nothing_when_refused() -> None:
    pre = HyLoPreconditioner(TinyLM(), kfac_max_state_mb=BUDGET)
    with pytest.raises(ValueError, match="'tokens' \\(Embedding"):
        pre.reconfigure(solver="kfac")
    assert pre.config.solver == "hybrid"
    pre.reconfigure(solver="kfac", kfac_max_state_mb=None)
    assert pre.config.solver == "kfac"


@pytest.mark.parametrize("bad", [-1.0, 0, 0.0, float("nan"), "2048", True])
def test_the_budget_option_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="kfac_max_state_mb must be a number > 0"):
        HyLoPreconditioner(TinyLM(), kfac_max_state_mb=bad)


def test_the_default_budget_refuses_a_32k_vocabulary_and_keeps_a_wide_mlp() -> None:
    """The default's doc: V = 32,000 at width 128 is 7,813 MB; a 4096×11008 Linear's state 1,053 MB."""
    for model, refused in ((nn.Embedding(32_000, 128), True), (nn.Linear(4096, 11008), False)):
        model = model.to("meta")  # shapes only: nothing is allocated
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if refused:
                with pytest.raises(ValueError, match="7,813 MB"):
                    HyLoPreconditioner(model, solver="kfac")
            else:
                info = HyLoPreconditioner(model, solver="kfac").layer_info()[0]
                assert info.note == "" and kfac_state_bytes(4097, 11008, 4) / MB == pytest.approx(1053, abs=0.5)


# ------------------------------------------------------------------------------------ summary
class Deep(nn.Module):
    """Hugging Face-like names: model.layers.0.self_attn.q_proj, and one of 70+ characters."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].self_attn = nn.Module()
        self.model.layers[0].self_attn.q_proj = nn.Linear(4, 4)
        inner = nn.Module()
        inner.a_rather_long_projection_name_for_the_test = nn.Linear(4, 4)
        self.model.layers[0].cross_attention_block_with_a_long_name = inner
        self.fc = nn.Embedding(12_345_678, 1).to("meta")


def test_summary_columns_stay_aligned_for_long_names() -> None:
    model = Deep()
    names = [name for name, _ in model.named_modules() if name.endswith(("q_proj", "test", "fc"))]
    assert max(len(name) for name in names) >= 60
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = HyLoPreconditioner(model, kfac_max_state_mb=None)
    table = pre.summary().splitlines()[1:-1]  # the coverage line ends it
    lines = [line for line in table if not line.startswith("  not preconditioned")]
    assert len(lines) == 4  # the header and three layers
    for column in (r"(Linear|Embedding|type)", r"(hybrid|solver)"):
        starts = {re.search(rf" {column}\b", line).start(1) for line in lines}  # type: ignore[union-attr]
        assert len(starts) == 1, (column, lines)
    for column in ("d_a", "d_g", "bias"):  # right-aligned: every cell ends where the header ends
        end = lines[0].index(column) + len(column)
        for line in lines[1:]:
            assert line[end] == " " and line[end - 1] != " ", (column, line)


# ------------------------------------------------------------------------------------ one-hot rows
def test_one_hot_rows_gathered_from_two_ranks_are_the_concatenated_rows() -> None:
    """Rank 0 has four token rows (one padding), rank 1 none: the all-gather of their fields (indices and g,
    no V-wide one-hot matrix) gives back rank 0's rows as one-hot rows, and their kernel equals the one-hot
    product's."""
    math = EmbeddingMath(nn.Embedding(V, D, padding_idx=7))
    tokens, grad_out = torch.tensor([3, 7, 299, 3]), torch.randn(4, D)
    mine = [math.lowrank_rows(tokens, grad_out, 4.0), math.empty_rows()]

    def body(rank: int, comm: BucketedCommunicator) -> OneHotRows:
        fields = mine[rank].fields()
        assert fields.keys() == {"tokens", "g"} and fields["tokens"].shape == (mine[rank].count, 1)
        received = comm.all_gather_rows(Payload({("tokens", k): v for k, v in fields.items()})).wait()
        rows = rows_from_fields(received.fields("tokens"), D, V)
        assert isinstance(rows, OneHotRows)
        return rows

    for rows in ThreadCluster(2, timeout=30.0).run(body):
        assert rows.tokens.tolist() == [3, -1, 299, 3] and torch.equal(rows.g, mine[0].g)
        assert torch.equal(rows.kernel(), FactoredRows(rows.a, rows.g).kernel())


def test_a_checkpoint_of_one_hot_rows_resumes_exactly_and_bad_tokens_are_refused() -> None:
    model, twin = TinyLM(), TinyLM()
    pre = HyLoPreconditioner(model, solver="kid", damping=0.1, update_freq=2, kfac_max_state_mb=None)
    _train(model, pre, steps=1)
    saved = pre.state_dict()
    assert set(saved["layers"]["tokens"]["tensors"]) == {"tokens", "g", "inner"}
    other = HyLoPreconditioner(twin, solver="kid", damping=0.1, update_freq=2)
    twin.load_state_dict(model.state_dict())
    other.load_state_dict(saved)
    x, y = _batch(7)
    grads = []
    for net, p in ((model, pre), (twin, other)):
        net.zero_grad()
        F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
        p.step()  # an apply step: the restored one-hot rows precondition
        grads.append(net.tokens.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])
    for bad in (1.5, float(V), -2.0):
        tensors = dict(saved["layers"]["tokens"]["tensors"])
        tensors["tokens"] = tensors["tokens"].clone()
        tensors["tokens"][0, 0] = bad
        layers = {**saved["layers"], "tokens": {**saved["layers"]["tokens"], "tensors": tensors}}
        with pytest.raises(ValueError, match="tokens must be integers"):
            other.load_state_dict(seal({**saved, "layers": layers}))  # the checksum matches: validation refuses
