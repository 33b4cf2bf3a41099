"""Vision families (docs/models.md, "Vision families"): DeiT, Swin, ConvNeXt and CLIP's vision tower built from their
``transformers`` configs, and torchvision's ResNet-18, MobileNetV3-small, EfficientNet-B0, ConvNeXt-Tiny and ViT-B/16
at 32 × 32 pixels where torchvision imports (:mod:`hylo_scripts.models.vision_families`), each run through hylo:

- **What is counted and what is left alone.** ``pre.coverage()`` counts every trainable parameter of two or more
  dimensions once, and no vector (HF ConvNeXt's LayerScale and CLIP's class embedding are vectors); it leaves alone
  exactly the parameters of :data:`LEFT_ALONE`, under the reason given there, and found here without hylo: a
  depthwise ``Conv2d`` (``groups`` = channels ≠ 1) under ``Conv2d``, a bare parameter (class and distillation
  tokens, position tables, Swin's relative position bias tables, torchvision's (C, 1, 1) LayerScale) under the
  type of the module that holds it. The share it preconditions is :data:`COVERAGE` (to 0.1%), and ≥ 90% once the
  bare-parameter holders are out of the total.
- **Five steps that train.** ``hylo.HyLoOptimizer(model, partial(AdamW, lr=1e-3))`` at its defaults (updates at
  steps 0 and 3) runs :data:`STEPS` steps on one batch: every loss is finite; at each step hylo's step rewrites every
  nonzero gradient it owns and no other; at the second update (step 3) every registered layer's gradient is nonzero
  and rewritten (each third of ``nn.MultiheadAttention``'s ``in_proj_weight`` on its own); the loss of the batch
  after the steps is lower than before them.
- **Proportions.** Each tiny model leaves alone what its full-size model (on the meta device) does, and the
  transformers' tiny models no smaller a share, so their coverage understates the full-size models'.

Skipped without ``transformers``; the torchvision families are skipped where torchvision does not import (here:
none is installed beside torch 2.13.0+cpu). Their training tests above 10 s are marked slow (:data:`SLOW`). About
10 s on two cores.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import hylo

pytest.importorskip("transformers", reason="needs transformers")

from hylo_scripts.benchmarks import bench_models  # noqa: E402  (after the skip)
from hylo_scripts.models.vision_families import TORCHVISION, VISION_FAMILIES, torchvision_missing  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # hylo names what it leaves alone; tested from coverage()
]

#: Why a depthwise convolution is left alone.
DEPTHWISE = (
    "a depthwise Conv2d (groups = channels): its kernel is a stack of per-channel filters, not one matrix on one "
    "input; hylo leaves grouped convolutions alone"
)
#: Why a bare parameter is left alone.
BARE = "a bare parameter of the module, added to or concatenated with the activations: no layer's weight, no rows"


@dataclass(frozen=True)
class LeftAlone:
    """One reason of ``Coverage.left_alone``: the attribute names of the parameters counted under it and why."""

    params: frozenset[str]
    why: str

    @property
    def bare(self) -> bool:
        """Bare parameters (no layer's weight): out of the total of "coverage excluding bare-parameter holders"."""
        return self.why.startswith(BARE)


def _bare(*params: str, what: str) -> LeftAlone:
    return LeftAlone(frozenset(params), f"{BARE}: {what}")


_DW = LeftAlone(frozenset({"weight"}), DEPTHWISE)
#: Per family, every reason hylo leaves a matrix alone (docs/models.md, "Vision families").
LEFT_ALONE: dict[str, dict[str, LeftAlone]] = {
    "DeiT": {
        "DeiTEmbeddings": _bare(
            "cls_token",
            "distillation_token",
            "position_embeddings",
            what="the class and distillation tokens "
            "(1 × 1 × width) concatenated to the patches, the position table (1 × tokens × width) added to them",
        )
    },
    "Swin": {
        "SwinRelativePositionBias": _bare(
            "relative_position_bias_table",
            what="((2·window − 1)² × heads), indexed by relative offset and added to "
            "the attention scores of each window",
        )
    },
    "ConvNeXt": {"Conv2d": _DW},  # LayerScale is a vector here, not counted
    "CLIP vision": {},  # the class embedding is a vector, the position table a registered nn.Embedding
    "ResNet-18 (torchvision)": {},
    "MobileNetV3-small (torchvision)": {"Conv2d": _DW},
    "EfficientNet-B0 (torchvision)": {"Conv2d": _DW},
    "ConvNeXt-Tiny (torchvision)": {
        "Conv2d": _DW,
        "CNBlock": _bare("layer_scale", what="LayerScale, a (C, 1, 1) scale of the block's output"),
    },
    "ViT-B/16 (torchvision)": {
        "Encoder": _bare("pos_embedding", what="the position table (1 × tokens × width) added to the tokens"),
        "VisionTransformer": _bare("class_token", what="the class token (1 × 1 × width) concatenated to the patches"),
    },
}
#: ``pre.coverage().share`` of each tiny model, measured (torch 2.13, transformers 5.24; torchvision 0.28).
COVERAGE: dict[str, float] = {
    "DeiT": 0.976,
    "Swin": 0.996,
    "ConvNeXt": 0.906,
    "CLIP vision": 1.0,
    "ResNet-18 (torchvision)": 1.0,
    "MobileNetV3-small (torchvision)": 0.961,
    "EfficientNet-B0 (torchvision)": 0.954,
    "ConvNeXt-Tiny (torchvision)": 0.988,
    "ViT-B/16 (torchvision)": 1.0,
}
#: Vectors each model trains that coverage does not count (they stay with the optimizer).
VECTORS: dict[str, tuple[str, ...]] = {
    "ConvNeXt": ("convnext.encoder.stages.0.layers.0.layer_scale_parameter",),
    "CLIP vision": ("vision_model.embeddings.class_embedding",),
}
#: The least preconditioned share once the bare-parameter holders are out of the total.
MIN_COVERAGE = 0.9
#: Steps and AdamW's learning rate of the optimizer form (updates at 0 and 3 under ``update_freq=3``).
STEPS = 5
LR = 1e-3
#: The training tests over 10 s (measured on two shared cores: ResNet-18 595 s, ViT-B/16 538 s, ConvNeXt-Tiny 384 s,
#: EfficientNet-B0 103 s, 12 s alone; MobileNetV3-small 8 s): hylo's eigendecompositions of factors up to 4,608 wide.
SLOW = frozenset(
    {
        "ResNet-18 (torchvision)",
        "EfficientNet-B0 (torchvision)",
        "ConvNeXt-Tiny (torchvision)",
        "ViT-B/16 (torchvision)",
    }
)


def _params(slow: bool = False) -> list[Any]:
    """Every family as a parameter, those of :data:`SLOW` marked slow when ``slow``."""
    found = []
    for name in VISION_FAMILIES:
        marks = [pytest.mark.slow, pytest.mark.timeout(3600)] if slow and name in SLOW else []
        found.append(pytest.param(name, marks=marks, id=name))
    return found


def _needs(name: str) -> None:
    """Skip a torchvision family where torchvision does not import. Not ``pytest.importorskip``: a torchvision built
    for another torch raises RuntimeError (its compiled operators), which importorskip lets through."""
    if name in TORCHVISION and (missing := torchvision_missing()) is not None:
        pytest.skip(f"needs torchvision ({missing})")


@contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def holders(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Each trainable matrix (two or more dimensions), by name: the module that holds it and its attribute name."""
    found: dict[str, tuple[nn.Module, str]] = {}
    for module_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if p.requires_grad and p.dim() >= 2:
                found[f"{module_name}.{attr}".lstrip(".")] = (module, attr)
    return found


def _coverage(model: nn.Module) -> hylo.Coverage:
    with quiet():
        pre = hylo.HyLoPreconditioner(model, kfac_max_state_mb=None)
    pre.remove()
    return pre.coverage()


def test_the_spec_names_every_family() -> None:
    assert set(LEFT_ALONE) == set(COVERAGE) == set(VISION_FAMILIES)
    assert TORCHVISION < set(VISION_FAMILIES) and SLOW < TORCHVISION


# ------------------------------------------------------------------------------------------ coverage
@pytest.mark.parametrize("name", _params())
def test_coverage_leaves_alone_only_what_the_spec_says_and_why(name: str) -> None:
    _needs(name)
    model = VISION_FAMILIES[name].model()
    with quiet():
        pre = hylo.HyLoPreconditioner(model)
    coverage, spec = pre.coverage(), LEFT_ALONE[name]
    matrices = holders(model)
    assert coverage.total == sum(module.get_parameter(attr).numel() for module, attr in matrices.values())
    for vector in VECTORS.get(name, ()):
        assert model.get_parameter(vector).dim() == 1 and vector not in matrices
    registered = {info.name for info in pre.layer_info()}
    # found without hylo: each matrix not held by a registered module, under its holder's type
    found: dict[str, set[str]] = defaultdict(set)
    count: dict[str, int] = defaultdict(int)
    for param, (module, attr) in matrices.items():
        holder = param.rpartition(".")[0]
        if holder in registered or (
            isinstance(module, nn.MultiheadAttention) and {f"{holder}.{p}_proj" for p in "qkv"} <= registered
        ):
            continue  # a registered layer's (an nn.MultiheadAttention is registered as q, k, v and out)
        why = type(module).__name__
        found[why].add(attr)
        count[why] += module.get_parameter(attr).numel()
        if isinstance(module, nn.Conv2d):
            assert module.groups == module.in_channels == module.out_channels > 1, param  # depthwise
    assert {why: set(reason.params) for why, reason in spec.items()} == dict(found)
    assert dict(coverage.left_alone) == dict(count)
    assert coverage.preconditioned == coverage.total - sum(count.values())
    assert coverage.share == pytest.approx(COVERAGE[name], abs=5e-4), coverage.line()
    bare = sum(n for why, n in coverage.left_alone if spec[why].bare)
    assert coverage.preconditioned / (coverage.total - bare) >= MIN_COVERAGE, coverage.line()


@pytest.mark.parametrize("name", _params())
def test_the_tiny_model_leaves_alone_what_the_full_size_model_does(name: str) -> None:
    """The same reasons; the transformers' tiny models leave each alone in no smaller a share than their full-size
    ones (torchvision's are the full-size architectures, with 4 classes on 32 × 32 images)."""
    _needs(name)
    family = VISION_FAMILIES[name]
    tiny, full = _coverage(family.model()), _coverage(family.full())
    tiny_share = {why: n / tiny.total for why, n in tiny.left_alone}
    full_share = {why: n / full.total for why, n in full.left_alone}
    assert set(tiny_share) == set(full_share) == set(LEFT_ALONE[name])
    if name not in TORCHVISION:
        assert all(full_share[why] <= share for why, share in tiny_share.items())


# ------------------------------------------------------------------------------------------ five steps
@dataclass
class Run:
    """What :data:`STEPS` steps of the optimizer form on batch 0 saw."""

    losses: list[float] = field(default_factory=list)
    start: float = math.nan
    final: float = math.nan
    steps: int = 0
    update_freq: int = 0
    #: Per step: the trainable parameters with a nonzero gradient before hylo's step, and those it changed.
    nonzero: list[set[str]] = field(default_factory=list)
    changed: list[set[str]] = field(default_factory=list)
    #: Per step, per registered layer: whether each of its gradients (weight, bias; its slices of an
    #: ``nn.MultiheadAttention``'s) was nonzero before hylo's step and changed by it.
    layers: list[dict[str, tuple[bool, bool]]] = field(default_factory=list)
    owned: set[str] = field(default_factory=set)


def layer_grads(model: nn.Module, layer: str, module_type: str) -> list[torch.Tensor]:
    """The gradients hylo rewrites for ``layer``: its module's weight and bias, or its slice of an
    ``nn.MultiheadAttention`` (``MHA.q``, ``.k``, ``.v``: a third of ``in_proj_weight`` and ``in_proj_bias``)."""
    if not module_type.startswith("MHA."):
        module = model.get_submodule(layer)
        return [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
    attention = model.get_submodule(layer.rpartition(".")[0])
    part = module_type.removeprefix("MHA.")
    if part == "out":
        return [p.grad for p in attention.out_proj.parameters() if p.grad is not None]
    width, third = attention.embed_dim, "qkv".index(part)
    rows = slice(third * width, (third + 1) * width)
    return [p.grad[rows] for p in (attention.in_proj_weight, attention.in_proj_bias) if p is not None]


@functools.cache
def optimizer_run(name: str) -> Run:
    """``HyLoOptimizer(model, partial(AdamW, lr=LR))`` for :data:`STEPS` steps on batch 0, hylo's step observed
    through a wrapper that compares every gradient before and after it."""
    family = VISION_FAMILIES[name]
    model = family.model()
    batch = family.batch(0)
    names = {id(p): n for n, p in model.named_parameters()}
    with quiet():
        opt = hylo.HyLoOptimizer(model, functools.partial(torch.optim.AdamW, lr=LR))
    pre = opt.preconditioner
    layers = {info.name: info.module_type for info in pre.layer_info()}
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    run = Run(owned={names[id(p)] for p in pre.parameters()})
    inner = pre.step

    def observed() -> None:
        before = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        grads = {layer: [g.clone() for g in layer_grads(model, layer, kind)] for layer, kind in layers.items()}
        inner()
        run.nonzero.append({n for n, g in before.items() if g.any()})
        run.changed.append({n for n, g in before.items() if not torch.equal(params[n].grad, g)})
        after = {layer: layer_grads(model, layer, kind) for layer, kind in layers.items()}
        run.layers.append(
            {
                layer: (
                    all(g.any() for g in old),
                    all(not torch.equal(g, new) for g, new in zip(old, after[layer], strict=True)),
                )
                for layer, old in grads.items()
            }
        )

    pre.step = observed  # type: ignore[method-assign]
    with quiet():
        with torch.no_grad():
            run.start = float(family.loss(model, batch))
        for _ in range(STEPS):
            opt.zero_grad()
            loss = family.loss(model, batch)
            loss.backward()
            opt.step()
            run.losses.append(float(loss.detach()))
        with torch.no_grad():
            run.final = float(family.loss(model, batch))
    run.steps, run.update_freq = pre.steps, int(pre.config.update_freq)
    return run


@pytest.mark.parametrize("name", _params(slow=True))
def test_five_steps_of_the_optimizer_form_train_and_rewrite_every_layer(name: str) -> None:
    _needs(name)
    run = optimizer_run(name)
    assert (run.steps, run.update_freq) == (STEPS, 3)  # updates at steps 0 and 3
    assert all(math.isfinite(loss) for loss in [run.start, *run.losses, run.final]), run.losses
    for nonzero, changed in zip(run.nonzero, run.changed, strict=True):
        assert changed <= run.owned  # what hylo does not own its step leaves as it was
        assert nonzero & run.owned <= changed  # every nonzero gradient it owns is rewritten
    second_update = run.layers[3]
    assert second_update and all(nonzero and changed for nonzero, changed in second_update.values()), {
        layer: seen for layer, seen in second_update.items() if seen != (True, True)
    }
    assert run.final < run.start, (run.start, run.losses, run.final)


# ------------------------------------------------------------------------------------------ the benchmark
def test_the_benchmark_runs_the_vision_families(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--vision`` without torchvision: the transformers families' rows and the reason torchvision's are absent."""
    monkeypatch.setattr(bench_models, "torchvision_missing", lambda: "ModuleNotFoundError: no torchvision")
    lines: list[str] = []
    bench_models.main(["--vision", "--steps", "1", "--threads", "1"], out=lines.append)
    text = "\n".join(lines)
    assert "torchvision does not import here (ModuleNotFoundError: no torchvision)" in text
    (row,) = [line for line in text.splitlines() if line.startswith("| ConvNeXt | 11 |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2:6] == ["90.6%", "90.6%", "90.6%", "Conv2d 9.4%"]
    assert "| Swin | Swin-tiny | SwinRelativePositionBias 0.4% | SwinRelativePositionBias 0.1% |" in text
    assert not any(name in text for name in TORCHVISION)
