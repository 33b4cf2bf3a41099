"""Model families (docs/models.md): tiny models of twelve ``transformers`` families, each run through hylo.

For every family of :mod:`hylo_scripts.models.model_families` (GPT-2, Llama, Qwen2 with grouped-query attention,
Mistral, T5, BART, Whisper, OPT, ViT, Mamba, Falcon, LoRA on Llama), built from its config:

- **Registration.** hylo registers exactly the supported layers the model trains (every ``nn.Linear``,
  ``nn.Embedding``, ungrouped ``nn.Conv1d``/``nn.Conv2d`` and Hugging Face ``Conv1D`` whose weight is trainable and
  held by that module alone, found here without hylo), leaves matrices alone only for the family's documented
  reasons (:data:`DOCUMENTED`; docs/models.md, "What is left alone"), counts every trainable matrix element, and
  preconditions ≥ 90% of them once the documented exclusions (:data:`EXCLUDED`) are out of the total.
- **The optimizer form.** ``hylo.HyLoOptimizer(model, partial(AdamW, lr=LR))`` at its defaults (``kfac_adam``,
  updates every 3 steps) runs :data:`STEPS` steps, two updates and the steps between: every loss is finite; hylo's
  step leaves the gradients of the parameters it does not own as they were and rewrites, at every step, every
  nonzero gradient of those it owns, but for the layers whose forward never runs (:data:`UNCALLED`); and the loss
  after the steps is clear of plain AdamW's from the same weights on the same batch (:data:`MARGIN`).
- **No silent wrong rows.** With ``solver="kfac", update_freq=1``, the preconditioned gradient V of each layer of
  :data:`PROBES` solves (A ⊗ G + λI) vec V = vec ∇W, with A and G built from the rows this file's own forward and
  tensor hooks record in the same step (docs/solvers.md, "Notation" and "K-FAC": every leading position of a
  Linear a row, g = n·∂L/∂s, the KFC factors of a convolution; ``tests/kit/reference.py``'s dense solve where the
  system is small).
- **Proportions.** The tiny model leaves alone what its full-size model (on the meta device) leaves alone, the
  exclusions in about the same share and the rest in no smaller a share, so its coverage understates the full
  model's.

Skipped without ``transformers`` or ``peft``. About 10 s on two cores.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from tests.kit.checks import RTOL, rel_err
from tests.kit.reference import conv_reference, dense_kfac

transformers = pytest.importorskip("transformers", reason="needs transformers")
pytest.importorskip("peft", reason="needs peft")

from transformers.models.falcon.modeling_falcon import FalconLinear  # noqa: E402  (after the skip)
from transformers.pytorch_utils import Conv1D  # noqa: E402

from hylo_scripts.benchmarks import bench_models  # noqa: E402
from hylo_scripts.models.model_families import EXCLUDED as BENCH_EXCLUDED  # noqa: E402
from hylo_scripts.models.model_families import FAMILIES, Batch, Family, loss_of  # noqa: E402

#: The reasons under which hylo leaves each family's matrices alone (``Coverage.left_alone``), each explained in
#: docs/models.md, "What is left alone": ``tied`` (token embeddings and LM heads that share one weight), the
#: learned position tables of OPT, BART and Whisper (subclasses of ``nn.Embedding`` with a forward of their own),
#: ViT's class token and position embeddings (bare parameters of ``ViTEmbeddings``), Mamba's ``A_log`` (a bare
#: parameter of ``MambaMixer``) and depthwise ``Conv1d``.
DOCUMENTED: dict[str, set[str]] = {
    "GPT-2": {"tied"},
    "Llama": set(),
    "Qwen2 (GQA)": {"tied"},
    "Mistral": set(),
    "T5": {"tied"},
    "BART": {"tied", "BartLearnedPositionalEmbedding"},
    "Whisper": {"tied", "WhisperPositionalEmbedding"},
    "OPT": {"tied", "OPTLearnedPositionalEmbedding"},
    "ViT": {"ViTEmbeddings"},
    "Mamba": {"tied", "MambaMixer", "Conv1d"},
    "LoRA on Llama": set(),
    "Falcon": {"tied"},
}
#: The documented exclusions: left alone for a reason that is no layer's shortcoming (a tied weight's gradient sums
#: two uses; a position table is not a lookup of its argument), so coverage is judged without them.
EXCLUDED = {"tied", "OPTLearnedPositionalEmbedding", "BartLearnedPositionalEmbedding", "WhisperPositionalEmbedding"}
#: The preconditioned share of the trainable matrix elements, exclusions out, that every family reaches.
MIN_COVERAGE = 0.9
#: Registered layers whose forward never runs: Mamba uses ``dt_proj.weight`` in a product of its own and passes
#: ``dt_proj.bias`` to the scan, so hylo's hooks see no rows (it warns and leaves the gradient as it is).
UNCALLED: dict[str, set[str]] = {"Mamba": {"backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj"}}

#: Steps of the optimizer form: updates at 0 and 3 (``update_freq=3``), steps between.
STEPS = 6
#: AdamW's learning rate in both runs: 1e-2 moves every tiny model's loss on its batch by 0.2–7.6 nats in 6 steps.
LR = 1e-2
#: The least |loss(HyLoOptimizer) − loss(AdamW)| after :data:`STEPS` steps on one batch. Measured (torch 2.13,
#: transformers 5.24): 0.006 (LoRA on Llama, whose B starts at zero), 0.017 (Mamba), 0.036 (BART), 0.09–0.98 for the
#: rest. Both runs are deterministic from the same weights, so round-off differs between them by ~1e-6: a margin
#: of 2e-3 is 3× under the smallest measured gap and 1000× over round-off. Under ``adam_basis="identity"``, where
#: the optimizer form's step is AdamW's, the gap was under 1e-5 for every family: the test fails, as it should.
MARGIN = 2e-3

_LLAMA = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj")
_LORA = "base_model.model.model.layers.0"
#: Layers checked against the dense reference: an attention projection and an MLP layer of each family, and the
#: family's convolutions (Whisper's Conv1d stem, ViT's patch embedding), GQA's narrower k/v projections, its
#: untied tables (GPT-2's positions, Llama's tokens, T5's relative-position bias) and LoRA's A and B.
PROBES: dict[str, tuple[str, ...]] = {
    "GPT-2": ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc", "transformer.wpe"),
    "Llama": (*_LLAMA, "model.embed_tokens"),
    "Qwen2 (GQA)": (*_LLAMA, "model.layers.0.self_attn.k_proj"),
    "Mistral": (*_LLAMA, "model.layers.0.self_attn.v_proj"),
    "T5": (
        "encoder.block.0.layer.0.SelfAttention.q",
        "encoder.block.0.layer.1.DenseReluDense.wi",
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
        "decoder.block.0.layer.1.EncDecAttention.k",
    ),
    "BART": ("model.encoder.layers.0.self_attn.q_proj", "model.encoder.layers.0.fc1", "model.decoder.layers.0.fc1"),
    "Whisper": (
        "model.encoder.conv1",
        "model.encoder.conv2",
        "model.encoder.layers.0.self_attn.q_proj",
        "model.decoder.layers.0.fc1",
    ),
    "OPT": ("model.decoder.layers.0.self_attn.q_proj", "model.decoder.layers.0.fc1"),
    "ViT": ("vit.embeddings.patch_embeddings.projection", "vit.layers.0.attention.q_proj", "vit.layers.0.mlp.fc1"),
    "Mamba": ("backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.x_proj", "backbone.layers.1.mixer.out_proj"),
    "Falcon": ("transformer.h.0.self_attention.query_key_value", "transformer.h.1.mlp.dense_4h_to_h"),
    "LoRA on Llama": (
        f"{_LORA}.self_attn.q_proj.lora_A.default",
        f"{_LORA}.self_attn.q_proj.lora_B.default",
        f"{_LORA}.mlp.down_proj.lora_B.default",
    ),
}
#: The damping of a probe's check, relative to the largest eigenvalue of its A ⊗ G: small enough that the curvature
#: turns the gradient (:data:`MIN_TURN`), large enough that the system is well conditioned (κ ≤ 1001).
RELATIVE_DAMPING = 1e-3
#: How far the preconditioned gradient must be from ∇W/λ (relative), so that the check could fail: rows other than
#: the layer's would give another V.
MIN_TURN = 0.1
#: The largest system (d_a·d_g unknowns) the dense reference solves; above it, only the residual is checked.
DENSE_LIMIT = 1600

NAMES = sorted(FAMILIES)
#: peft calls a method transformers 5 deprecates; not this file's subject.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
#: The supported classes: the built-in ones, transformers' ``Conv1D`` and ``FalconLinear`` (a subclass whose own forward
#: is the Linear map, registered by class: docs/extending.md, "Layers of other packages").
SUPPORTED = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, Conv1D, FalconLinear)


@contextmanager
def quiet() -> Iterator[list[warnings.WarningMessage]]:
    """Record warnings instead of printing them (hylo's notes on what it leaves alone, peft's deprecations)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def trainable_matrices(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters with two or more dimensions, each once, by (first) name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad and p.dim() >= 2}


def expected_layers(model: nn.Module) -> list[str]:
    """The layers hylo should register, found without hylo: modules of exactly a supported class (a subclass with a
    forward of its own is another operation), convolutions ungrouped, whose weight is trainable and held by that
    module alone."""
    holders = Counter(
        id(p) for module in model.modules() for _, p in module.named_parameters(recurse=False, remove_duplicate=False)
    )
    return sorted(
        name
        for name, module in model.named_modules()
        if type(module) in SUPPORTED
        and module.weight.requires_grad
        and holders[id(module.weight)] == 1
        and getattr(module, "groups", 1) == 1
    )


def registered(pre: hylo.HyLoPreconditioner) -> list[str]:
    return sorted(info.name for info in pre.layer_info())


# ------------------------------------------------------------------------------------------ registration
def test_the_benchmark_excludes_what_the_tests_exclude() -> None:
    assert set(BENCH_EXCLUDED) == EXCLUDED
    assert set(FAMILIES) == set(DOCUMENTED) == set(PROBES)


@pytest.mark.parametrize("name", NAMES)
def test_registers_every_supported_layer_and_leaves_alone_only_for_documented_reasons(name: str) -> None:
    model = FAMILIES[name].model()
    with quiet():
        pre = hylo.HyLoPreconditioner(model)
    assert registered(pre) == expected_layers(model)
    coverage = pre.coverage()
    assert coverage.total == sum(p.numel() for p in trainable_matrices(model).values())
    assert {why for why, _ in coverage.left_alone} == DOCUMENTED[name]
    excluded = sum(count for why, count in coverage.left_alone if why in EXCLUDED)
    assert coverage.preconditioned / (coverage.total - excluded) >= MIN_COVERAGE, coverage.line()
    summary = pre.summary()
    for table in DOCUMENTED[name] & (EXCLUDED - {"tied"}):
        assert f"{table} subclasses Embedding with a forward of its own" in summary


def test_lora_preconditions_the_adapters_and_leaves_the_frozen_base_out() -> None:
    model = FAMILIES["LoRA on Llama"].model()
    with quiet():
        pre = hylo.HyLoPreconditioner(model)
    adapters = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and ".lora_" in name]
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 projections in 2 blocks
    assert registered(pre) == sorted(adapters)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and pre.coverage().total == sum(p.numel() for p in trainable_matrices(model).values())
    assert pre.coverage().share == 1.0


# ------------------------------------------------------------------------------------------ the optimizer form
@dataclass
class Run:
    """What one ``HyLoOptimizer`` run of :data:`STEPS` steps on batch 0 saw."""

    losses: list[float]
    #: The loss of batch 0 after the steps.
    final: float
    #: Parameter names: of the layers hylo registered, whose forward ran / never ran; not owned by hylo; stepped
    #: by the optimizer form's SGD.
    called: set[str]
    uncalled_layers: set[str]
    uncalled: set[str]
    foreign: set[str]
    sgd: set[str]
    #: hylo's update_freq and the steps it took.
    update_freq: int = 0
    steps: int = 0
    #: Per step: the parameters with a nonzero gradient before hylo's step, and those whose gradient it changed.
    nonzero: list[set[str]] = field(default_factory=list)
    changed: list[set[str]] = field(default_factory=list)


def _batch(family: Family, dtype: torch.dtype = torch.float32) -> Batch:
    return {key: value.to(dtype) if value.is_floating_point() else value for key, value in family.batch(0).items()}


@functools.cache
def optimizer_run(name: str) -> Run:
    """``HyLoOptimizer(model, partial(AdamW, lr=LR))`` at its defaults for :data:`STEPS` steps on batch 0, hylo's
    step observed through a wrapper that compares every gradient before and after it."""
    family = FAMILIES[name]
    model = family.model()
    names = {id(p): n for n, p in model.named_parameters()}
    with quiet():
        opt = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=LR))
    pre = opt.preconditioner
    modules = dict(model.named_modules())
    ran: set[str] = set()
    for layer in registered(pre):
        modules[layer].register_forward_hook(lambda *_, layer=layer: ran.add(layer))
    owned = {names[id(p)] for p in pre.parameters()}
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    run = Run([], math.nan, set(), set(), set(), set(params) - owned, set())
    inner = pre.step

    def observed() -> None:
        before = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        inner()
        run.nonzero.append({n for n, g in before.items() if g.any()})
        run.changed.append({n for n, g in before.items() if not torch.equal(params[n].grad, g)})

    pre.step = observed  # type: ignore[method-assign]
    batch = _batch(family)
    with quiet():
        for _ in range(STEPS):
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            opt.step()
            run.losses.append(float(loss))
    with torch.no_grad():
        run.final = float(loss_of(model, batch))
    run.update_freq, run.steps = int(pre.config.update_freq), pre.steps
    run.sgd = {  # what SGD steps at the end: a layer without rows was handed back to AdamW at the first update
        names[id(p)]
        for optimizer in opt.optimizers
        if isinstance(optimizer, torch.optim.SGD)  # the wrapped optimizer is AdamW
        for group in optimizer.param_groups
        for p in group["params"]
    }
    run.uncalled_layers = set(registered(pre)) - ran
    for layer in registered(pre):
        held = {names[id(p)] for p in modules[layer].parameters(recurse=False) if id(p) in names}
        (run.called if layer in ran else run.uncalled).update(held & owned)
    return run


@pytest.mark.parametrize("name", NAMES)
def test_the_optimizer_form_rewrites_only_its_own_gradients(name: str) -> None:
    run = optimizer_run(name)
    assert (run.update_freq, run.steps) == (3, STEPS)  # updates at steps 0 and 3, and steps between
    assert len(run.losses) == STEPS and all(math.isfinite(loss) for loss in run.losses + [run.final])
    assert run.uncalled_layers == UNCALLED.get(name, set())
    assert run.called
    for nonzero, changed in zip(run.nonzero, run.changed, strict=True):
        assert not changed & run.foreign  # what hylo does not own, its step leaves alone
        assert not changed & run.uncalled  # so too the layers it captured no rows of
        assert (nonzero & run.called) <= changed  # every nonzero gradient it owns is preconditioned


@pytest.mark.parametrize("name", NAMES)
def test_every_gradient_the_optimizer_form_gives_sgd_is_preconditioned(name: str) -> None:
    """Under an Adam-type optimizer the registered layers' parameters take SGD without momentum, hylo's result
    being the whole step: a raw gradient there would be stepped by SGD at Adam's learning rate. Mamba's dt_proj,
    without rows, was handed back to AdamW at the first update (docs/usage.md, "The optimizer form")."""
    run = optimizer_run(name)
    assert run.sgd and not run.sgd & run.uncalled
    for nonzero, changed in zip(run.nonzero, run.changed, strict=True):
        assert (nonzero & run.sgd) <= changed


@pytest.mark.parametrize("name", NAMES)
def test_the_loss_moves_away_from_plain_adamw(name: str) -> None:
    family = FAMILIES[name]
    model = family.model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    batch = _batch(family)
    with quiet():
        for _ in range(STEPS):
            opt.zero_grad()
            loss_of(model, batch).backward()
            opt.step()
        with torch.no_grad():
            adamw = float(loss_of(model, batch))
    hylo_loss = optimizer_run(name).final
    assert abs(hylo_loss - adamw) >= MARGIN, (hylo_loss, adamw)


# ------------------------------------------------------------------------------------------ no silent wrong rows
class Tap:
    """Records each call of a module: its input, output and (in the backward) output gradient."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.calls: list[dict[str, Tensor]] = []
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        call = {"x": args[0].detach(), "out": out.detach()}
        self.calls.append(call)
        out.register_hook(lambda grad: call.update(g=grad.detach()))

    def factors(self) -> tuple[Tensor, Tensor]:
        """K-FAC's A and G of the recorded calls (docs/solvers.md, "Notation" and "K-FAC")."""
        module = self.module
        if isinstance(module, nn.Conv1d | nn.Conv2d):
            (call,) = self.calls
            if isinstance(module, nn.Conv1d):  # the Conv2d of a unit-height image
                module = types.SimpleNamespace(
                    kernel_size=(1, *module.kernel_size), stride=(1, *module.stride), padding=(0, *module.padding),
                    dilation=(1, *module.dilation), padding_mode=module.padding_mode,
                    weight=module.weight.unsqueeze(2), bias=module.bias,
                )  # fmt: skip
                call = {key: value.unsqueeze(2) for key, value in call.items()}
            ref = conv_reference(module, call["x"], call["out"], call["g"])  # type: ignore[arg-type]
            return ref["A"], ref["G"]
        if isinstance(module, nn.Embedding):  # the Linear on one-hot rows
            weight = module.weight
            a = torch.cat([F.one_hot(c["x"].reshape(-1), module.num_embeddings).to(weight.dtype) for c in self.calls])
        else:
            a = torch.cat([c["x"].reshape(-1, c["x"].shape[-1]) for c in self.calls])
            if module.bias is not None:
                a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
        rows = a.shape[0]
        g = rows * torch.cat([c["g"].reshape(-1, c["g"].shape[-1]) for c in self.calls])
        return a.T @ a / rows, g.T @ g / rows


def grad_matrix(module: nn.Module) -> Tensor:
    """The layer's gradient as hylo's (d_g, d_a) matrix: a Linear's or convolution's weight flattened, HF
    ``Conv1D``'s and an Embedding's transposed, the bias last."""
    grad = module.weight.grad
    if isinstance(module, Conv1D | nn.Embedding):
        matrix = grad.T
    else:
        matrix = grad.reshape(grad.shape[0], -1)
    bias = getattr(module, "bias", None)
    if bias is not None and not isinstance(module, nn.Embedding):
        matrix = torch.cat([matrix, bias.grad[:, None]], dim=1)
    return matrix.detach().clone()


def _forward_backward(model: nn.Module, batch: Batch) -> None:
    model.zero_grad()
    loss_of(model, batch).backward()


@pytest.mark.parametrize("name", NAMES)
def test_preconditioned_gradients_solve_k_fac_with_the_layers_own_rows(name: str) -> None:
    """Each probe's λ is set from its own curvature (one pass without hylo), then hylo steps with it."""
    family = FAMILIES[name]
    model = family.model().double()
    for module_name, module in model.named_modules():
        if module_name.endswith("lora_B.default"):  # peft starts B at zero, which zeroes A's output gradient
            nn.init.normal_(module.weight, std=0.02)
    batch = _batch(family, torch.float64)
    modules = dict(model.named_modules())
    for probe in PROBES[name]:
        tap = Tap(modules[probe])
        _forward_backward(model, batch)
        a, g = tap.factors()
        damping = RELATIVE_DAMPING * float(torch.linalg.eigvalsh(a)[-1] * torch.linalg.eigvalsh(g)[-1])
        tap.calls.clear()
        with quiet():
            pre = hylo.HyLoPreconditioner(model, solver="kfac", update_freq=1, damping=damping)
            _forward_backward(model, batch)
            raw = grad_matrix(modules[probe])
            a, g = tap.factors()
            pre.step()
        tap.handle.remove()
        pre.remove()
        v = grad_matrix(modules[probe])
        # kron(A, G) vec(V) = vec(G V Aᵀ) (column-major vec): the defining equation, solved by no one here
        assert rel_err(g @ v @ a.T + damping * v, raw) <= RTOL, probe
        if a.shape[0] * g.shape[0] <= DENSE_LIMIT:
            assert rel_err(v, dense_kfac(a, g, raw, damping)) <= RTOL, probe
        assert rel_err(v, raw / damping) >= MIN_TURN, probe  # the rows matter: the check can fail


# ------------------------------------------------------------------------------------------ proportions
def _coverage(model: nn.Module) -> hylo.Coverage:
    with quiet():
        pre = hylo.HyLoPreconditioner(model, kfac_max_state_mb=None)
    pre.remove()
    return pre.coverage()


@pytest.mark.parametrize("name", NAMES)
def test_the_tiny_model_leaves_alone_what_the_full_size_model_does(name: str) -> None:
    """Exclusions within 2.5 points of their full-size share; anything else left alone no smaller a share (so the
    tiny model's coverage excluding exclusions is no higher than the full-size model's)."""
    family = FAMILIES[name]
    tiny, full = _coverage(family.model()), _coverage(family.full())
    tiny_share = {why: count / tiny.total for why, count in tiny.left_alone}
    full_share = {why: count / full.total for why, count in full.left_alone}
    assert set(tiny_share) == set(full_share) == DOCUMENTED[name]
    for why, share in tiny_share.items():
        if why in EXCLUDED:
            assert share == pytest.approx(full_share[why], abs=0.025), why
        else:
            assert full_share[why] <= share <= 0.05, why
    assert bench_models.excluding(tiny) <= bench_models.excluding(full)


# ------------------------------------------------------------------------------------------ the benchmark
def test_the_benchmark_prints_both_tables() -> None:
    lines: list[str] = []
    bench_models.main(["--families", "OPT", "Mamba", "--steps", "2", "--threads", "1"], out=lines.append)
    text = "\n".join(lines)
    (row,) = [line for line in text.splitlines() if line.startswith("| OPT | 12 |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2:5] == ["67.5%", "100.0%", "67.5%"]
    assert cells[5] == "tied 30.9%, OPTLearnedPositionalEmbedding 1.6%"
    assert all(math.isfinite(float(cell)) for cell in cells[6:])
    assert "| Mamba | Mamba-130m |" in text
    assert "dt_proj" in text and "captured no rows" in text  # the warning is reported, not swallowed
