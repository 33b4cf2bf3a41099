"""Hugging Face's ``Conv1D`` (GPT-2's Linear stored transposed) (docs/extending.md, "Layers of other packages").

Without ``transformers``: a stand-in with ``Conv1D``'s exact ``forward``, put where the real one
lives (``transformers.pytorch_utils`` in ``sys.modules``), is registered by hylo's walk with the
built-in math, and a user's own registration of the class wins. Every solver gives it the
preconditioned gradients of the twin model written with ``nn.Linear`` (weights transposed), and
SNGD equals the dense (F + λI)⁻¹ ∇W from the model's true per-sample gradients (``torch.func``).
hylo itself never imports ``transformers``.

With ``transformers`` installed: on a small ``GPT2LMHeadModel`` every ``Conv1D`` is registered (the
tied ``wte``/``lm_head`` stay with the optimizer, with that reason), K-FAC and SNGD equal the twin
whose ``Conv1D`` modules are swapped for ``nn.Linear``, training resumes exactly from a checkpoint,
and ``examples/gpt2.py`` runs.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import hylo
from hylo.layers import TransposedLinearMath
from tests.kit.checks import DT
from tests.kit.internals import restore_layer_types
from tests.kit.reference import dense_natural_gradient

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.device_tier]

SOLVERS = ("kfac", "sngd", "kid", "kis", "hybrid")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt2.py"


class Conv1D(nn.Module):
    """A stand-in for ``transformers.pytorch_utils.Conv1D``: its ``__init__`` and ``forward``, verbatim."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-in where hylo looks for ``Conv1D``, with the layer-type registry restored after the test."""
    module = types.ModuleType("transformers.pytorch_utils")
    module.Conv1D = Conv1D  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", module)
    restore_layer_types(monkeypatch)
    yield


def _pair(seed: int, widths: tuple[int, ...]) -> tuple[nn.Sequential, nn.Sequential]:
    """A Conv1D MLP (tanh between layers) and its nn.Linear twin with the transposed weights."""
    torch.manual_seed(seed)
    convs: list[nn.Module] = []
    linears: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        conv = Conv1D(d_out, d_in).to(DT)
        with torch.no_grad():
            conv.weight.normal_(0.0, d_in**-0.5)
            conv.bias.normal_(0.0, 0.1)
        linear = nn.Linear(d_in, d_out, dtype=DT)
        with torch.no_grad():
            linear.weight.copy_(conv.weight.mT)
            linear.bias.copy_(conv.bias)
        convs.append(conv)
        linears.append(linear)
        if i < len(widths) - 2:
            convs.append(nn.Tanh())
            linears.append(nn.Tanh())
    return nn.Sequential(*convs), nn.Sequential(*linears)


def _w(module: nn.Module, transposed: bool) -> Tensor:
    """hylo's ∇W of a Conv1D (``transposed``) or a Linear: (d_out, d_in + 1), bias last."""
    weight_grad = module.weight.grad.mT if transposed else module.weight.grad
    return torch.cat([weight_grad, module.bias.grad.unsqueeze(1)], dim=1).clone()


# --------------------------------------------------------------------------- registration without transformers
def test_hylo_never_imports_transformers() -> None:
    code = (
        "import sys, torch, hylo\n"
        "pre = hylo.HyLoPreconditioner(torch.nn.Sequential(torch.nn.Linear(3, 2)))\n"
        "assert pre.summary() and not [m for m in sys.modules if m.split('.')[0] == 'transformers']\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_conv1d_is_registered_when_its_module_is_imported_and_a_users_registration_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    restore_layer_types(monkeypatch)
    monkeypatch.delitem(sys.modules, "transformers.pytorch_utils", raising=False)
    model, _ = _pair(0, (4, 3, 2))
    with pytest.warns(UserWarning, match="Conv1D is not a supported layer type"):
        pre = hylo.HyLoPreconditioner(nn.Sequential(model, nn.Linear(2, 2)))  # not where hylo looks: left alone
    assert [info.name for info in pre.layer_info()] == ["1"]
    pre.remove()

    module = types.ModuleType("transformers.pytorch_utils")
    module.Conv1D = Conv1D  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", module)
    pre = hylo.HyLoPreconditioner(model)
    assert [(i.name, i.module_type, i.d_a, i.d_g) for i in pre.layer_info()] == [
        ("0", "Conv1D", 5, 3),
        ("2", "Conv1D", 4, 2),
    ]
    assert all(type(info.math) is TransposedLinearMath for info in pre.layer_info())
    pre.remove()

    class Mine(TransposedLinearMath):
        @property
        def module_type(self) -> str:
            return "mine"

    handle = hylo.register_layer_type(Conv1D, lambda module, config: Mine(module))  # after the built-in
    assert {i.module_type for i in hylo.HyLoPreconditioner(model).layer_info()} == {"mine"}
    handle.remove()  # restores the built-in
    assert {i.module_type for i in hylo.HyLoPreconditioner(model).layer_info()} == {"Conv1D"}

    restore_layer_types(monkeypatch, without=[Conv1D])
    handle = hylo.register_layer_type(Conv1D, lambda module, config: Mine(module))  # before any walk
    assert {i.module_type for i in hylo.HyLoPreconditioner(model).layer_info()} == {"mine"}
    handle.remove()


# --------------------------------------------------------------------------- the same as nn.Linear, every solver
@pytest.mark.usefixtures("stand_in")
@pytest.mark.parametrize("solver", SOLVERS)
def test_every_solver_gives_conv1d_the_gradients_of_the_linear_twin(solver: str) -> None:
    conv, linear = _pair(1, (6, 8, 4))
    options: dict[str, Any] = {"solver": solver, "update_freq": 2, "damping": 0.05, "rank_ratio": 0.5, "seed": 3}
    pre_conv, pre_linear = hylo.HyLoPreconditioner(conv, **options), hylo.HyLoPreconditioner(linear, **options)
    assert [i.name for i in pre_conv.layer_info()] == ["0", "2"] == [i.name for i in pre_linear.layer_info()]
    gen = torch.Generator().manual_seed(2)
    for step in range(3):  # an update, a step between updates, an update with running statistics
        x = torch.randn(3, 5, 6, generator=gen, dtype=DT)  # (batch, tokens, features): every token is a row
        y = torch.randn(3, 5, 4, generator=gen, dtype=DT)
        for model in (conv, linear):
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
        raw = {name: _w(conv[int(name)], True) for name in ("0", "2")}
        for name, matrix in raw.items():
            torch.testing.assert_close(matrix, _w(linear[int(name)], False), rtol=1e-12, atol=1e-14)
        pre_conv.step()
        pre_linear.step()
        for name in raw:
            got, expected = _w(conv[int(name)], True), _w(linear[int(name)], False)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=f"layer {name} at step {step}")
            assert not torch.allclose(got, raw[name]), f"layer {name} was not preconditioned at step {step}"
    assert [i.solver for i in pre_conv.layer_info()] == [i.solver for i in pre_linear.layer_info()]


@pytest.mark.usefixtures("stand_in")
def test_sngd_on_conv1d_is_the_dense_solve_of_the_true_per_sample_fisher() -> None:
    model, _ = _pair(4, (5, 4, 3))
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 5, generator=gen, dtype=DT), torch.randn(6, 3, generator=gen, dtype=DT)
    damping = 0.1
    params = {name: p.detach() for name, p in model.named_parameters()}

    def sample_loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.mse_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    # U_i: the gradient of sample i's loss, B × its share of the batch mean (torch.func, nothing of hylo)
    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    references = {
        name: torch.cat([per_sample[f"{name}.weight"].mT, per_sample[f"{name}.bias"].unsqueeze(2)], dim=2)
        for name in ("0", "2")
    }
    pre = hylo.HyLoPreconditioner(model, solver="sngd", damping=damping, update_freq=1)
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    raw = {name: _w(model[int(name)], True) for name in references}
    pre.step()
    for name, u in references.items():
        torch.testing.assert_close(u.mean(0), raw[name], rtol=1e-10, atol=1e-13)  # the oracle's ∇W
        written = _w(model[int(name)], True)  # read back from the stored (d_in, d_out) weight.grad
        torch.testing.assert_close(written, dense_natural_gradient(u, raw[name], damping), rtol=1e-9, atol=1e-12)
        assert (written - raw[name]).norm() > 0.1 * raw[name].norm()  # the curvature mattered


# --------------------------------------------------------------------------- a Hugging Face GPT-2
def _gpt2(seed: int, dtype: torch.dtype = DT) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def _conv1d_names(model: nn.Module) -> list[str]:
    from transformers.pytorch_utils import Conv1D as HFConv1D

    return [name for name, module in model.named_modules() if isinstance(module, HFConv1D)]


def _linear_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose every Conv1D is an nn.Linear holding the transposed weight (module surgery)."""
    twin = copy.deepcopy(model)
    for name in _conv1d_names(twin):
        parent_name, _, attr = name.rpartition(".")
        conv = twin.get_submodule(name)
        linear = nn.Linear(conv.nx, conv.nf, dtype=conv.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(conv.weight.mT)
            linear.bias.copy_(conv.bias)
        setattr(twin.get_submodule(parent_name), attr, linear)
    return twin


def _lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss


def test_gpt2_every_conv1d_is_preconditioned() -> None:
    model = _gpt2(0)
    conv1d = _conv1d_names(model)
    assert len(conv1d) == 8  # c_attn, c_proj of attention; c_fc, c_proj of the MLP; two blocks
    with pytest.warns(UserWarning, match="hylo leaves 2 modules") as caught:
        pre = hylo.HyLoPreconditioner(model, solver="hybrid")
    assert "Conv1D" not in str(caught[0].message)
    info = {i.name: i for i in pre.layer_info()}
    assert list(info) == ["transformer.wpe", *conv1d]
    assert all(info[name].module_type == "Conv1D" for name in conv1d)
    c_attn = info["transformer.h.0.attn.c_attn"]
    assert (c_attn.d_a, c_attn.d_g, c_attn.bias) == (33, 96, True)  # q, k and v: one fused matrix
    assert (info["transformer.h.0.mlp.c_proj"].d_a, info["transformer.h.0.mlp.c_proj"].d_g) == (129, 32)
    assert (info["transformer.wpe"].module_type, info["transformer.wpe"].d_a) == ("Embedding", 16)
    summary = pre.summary()
    assert "transformer.wte (weight tied to lm_head: its gradient sums every use" in summary
    assert "lm_head (weight tied to transformer.wte" in summary
    assert "not supported" not in summary


@pytest.mark.parametrize("solver", ("kfac", "sngd"))
def test_gpt2_conv1d_is_preconditioned_as_its_linear_twin(solver: str) -> None:
    stock = _gpt2(1)
    twin = _linear_twin(stock)
    conv1d = _conv1d_names(stock)
    assert not _conv1d_names(twin)
    options: dict[str, Any] = {"solver": solver, "update_freq": 1, "damping": 0.05}
    with pytest.warns(UserWarning, match="weight tied"):
        pre_stock = hylo.HyLoPreconditioner(stock, **options)
    with pytest.warns(UserWarning, match="weight tied"):
        pre_twin = hylo.HyLoPreconditioner(twin, **options)
    assert [i.name for i in pre_stock.layer_info()] == [i.name for i in pre_twin.layer_info()]
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        ids = torch.randint(0, 100, (2, 8), generator=gen)
        for model in (stock, twin):
            model.zero_grad()
            _lm_loss(model, ids).backward()
        raw = {name: _w(stock.get_submodule(name), True) for name in conv1d}
        pre_stock.step()
        pre_twin.step()
        for name in conv1d:
            got, expected = _w(stock.get_submodule(name), True), _w(twin.get_submodule(name), False)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12, msg=f"{name} at step {step}")
            assert not torch.allclose(got, raw[name]), f"{name} was not preconditioned at step {step}"
        for (name, p), q in zip(stock.named_parameters(), twin.parameters(), strict=True):
            if name.rpartition(".")[0] not in conv1d:  # wte, wpe, the norms: the same in both
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_gpt2_trains_and_resumes_exactly_from_a_checkpoint() -> None:
    options: dict[str, Any] = {"solver": "hybrid", "update_freq": 2, "damping": 0.1, "seed": 1}
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 100, (4, 12), generator=gen) for _ in range(3)]

    def run(model: nn.Module, opt: torch.optim.Optimizer, pre: hylo.HyLoPreconditioner, steps: range) -> list[float]:
        losses = []
        for step in steps:
            opt.zero_grad()
            loss = _lm_loss(model, batches[step % 3])
            loss.backward()
            pre.step()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, hylo.HyLoPreconditioner]:
        model = _gpt2(2, torch.float32)
        with pytest.warns(UserWarning, match="weight tied"):
            pre = hylo.HyLoPreconditioner(model, **options)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3), pre

    whole, whole_opt, whole_pre = fresh()
    losses = run(whole, whole_opt, whole_pre, range(9))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[2] - 0.05  # the same three batches again: it learns them
    assert {d.layer for d in whole_pre.decision_log} == {info.name for info in whole_pre.layer_info()}

    first, first_opt, first_pre = fresh()
    run(first, first_opt, first_pre, range(5))
    saved = (first.state_dict(), first_opt.state_dict(), first_pre.state_dict())
    resumed, resumed_opt, resumed_pre = fresh()
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    resumed_pre.load_state_dict(saved[2])
    run(resumed, resumed_opt, resumed_pre, range(5, 9))
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_the_gpt2_example_runs() -> None:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("gpt2_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    with pytest.warns(UserWarning, match="weight tied"):
        results = example.main(["--steps", "11", "--warmup", "0", "--threads", str(threads)])
    assert list(results) == ["AdamW", "AdamW + hylo hybrid"]
    assert all(ms > 0 for times in results.values() for ms in times.values())
