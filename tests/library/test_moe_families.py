"""Every mixture-of-experts family of transformers 5.24 (docs/moe.md, "Models").

The specification, against :mod:`hylo.layers.transformers_types`' table:

- **The survey is complete.** Every experts class transformers declares (``@use_experts_implementation``, found in
  its model sources) is in the table.
- **Every experts class is its twin.** Each experts class of the table, built from its family's config (small,
  float64, random weights) and routed by a Linear router, gives under K-FAC (``split_gate_up`` on, its default)
  the preconditioned gradients of the same block written with two ``nn.Linear`` per expert for gate and up and one
  for down (``LinearExperts(halves=True)``, the module's own gate), to 1e-10; or, where the class declares a layout
  hylo does not model, it is left alone with the reason it declares.
- **Every router is a Linear.** Each router class of the table returns ``F.linear`` of its input (and its bias) at
  the position the table gives, and is registered as a router.
- **Whole models.** Tiny models of the named families, built from config: the supported ones have every expert and
  router registered and at least 90% of their matrix elements preconditioned; GPT-OSS, Llama 4 and DBRX leave their
  experts alone with the reasons docs/moe.md gives; the twin equality holds on whole Qwen3-MoE and OLMoE models.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hylo
from hylo.layers.experts import RouterMath, layout_problem
from hylo.layers.registry import layer_math
from hylo.layers.transformers_types import LOGITS_AT, MIXTURES, modeling_module
from hylo_scripts.models.moe import MOE_FAMILIES, LinearExperts, linear_twin, moe_family
from tests.kit.experts import expert_grads

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("single_thread")]

DT = torch.float64
#: The size every class is built at: hidden width, expert width, experts, experts per token.
SMALL: dict[str, Any] = dict(
    hidden_size=16, intermediate_size=12, moe_intermediate_size=12, num_experts=4, num_local_experts=4,
    n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, hidden_act="silu", num_attention_heads=4,
    num_key_value_heads=4, head_dim=4, vocab_size=64, experts_implementation="eager",
)  # fmt: skip
#: What a family's config validates beyond :data:`SMALL`.
OWN: dict[str, dict[str, Any]] = {"granitemoehybrid": {"mamba_n_heads": 8}, "zaya": {"num_experts_per_tok": 1}}
#: The experts classes that declare a layout hylo does not model, and the declaration their reason names.
REFUSED = {
    "AriaExperts": "is_transposed=True",
    "GptOssExperts": "is_concatenated=False",
    "OpenAIPrivacyFilterExperts": "is_transposed=True",
    "NemotronHExperts": "has_gate=False",
    "MuseSparkExperts": "has_post_expert_norm=True",
}
#: Classes whose gate (a softcapped SwiGLU) computes in float32 whatever the working dtype: the twin's rows equal
#: theirs to float32's precision, not float64's.
FLOAT32_GATE = {"Inkling2Experts", "Inkling2LoopExperts"}
EXPERTS = [(package, name) for package, experts, _ in MIXTURES for name in experts]
ROUTERS = [(package, name) for package, _, routers in MIXTURES for name in routers]


def built(package: str, class_name: str, dtype: torch.dtype) -> nn.Module:
    """``class_name`` of ``package`` built from a small config (the first of the module's config classes, by the
    longest prefix shared with the class's name, that builds it), its parameters drawn N(0, 0.3²) from a fixed
    seed."""
    module = importlib.import_module(modeling_module(package))
    cls = getattr(module, class_name)
    configs = {
        name: value for name, value in vars(module).items() if name.endswith("Config") and isinstance(value, type)
    }
    stem = re.sub(r"(Experts|TopKRouter|TopkRouter|Router)$", "", class_name)
    for name in sorted(configs, key=lambda n: (-len(os.path.commonprefix([n, stem])), len(n))):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made: nn.Module = cls(configs[name](**SMALL | OWN.get(package, {}))).to(dtype)
        except Exception:  # noqa: BLE001  (a config that does not validate or does not fit the class: the next)
            continue
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in made.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=dtype))
        return made
    raise AssertionError(f"no config of {package} builds {class_name}")


def test_every_experts_class_transformers_declares_is_in_the_table() -> None:
    root = os.path.dirname(transformers.__file__) + "/models"
    declared = set()
    for package in os.listdir(root):
        path = f"{root}/{package}/modeling_{package}.py"
        if os.path.exists(path):
            with open(path) as source:
                found = re.findall(r"@use_experts_implementation(?:\([^)]*\))?\s*\nclass (\w+)", source.read())
            declared |= {(package, name) for name in found}
    assert len(declared) >= 60
    assert declared <= set(EXPERTS), sorted(declared - set(EXPERTS))


# ------------------------------------------------------------------------------------------ every experts class
class Block(nn.Module):
    """A Linear router (softmax, top-2) and an experts module: the MoE block every family shares."""

    def __init__(self, experts: nn.Module, width: int, count: int) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.gate = nn.Linear(width, count, bias=False, dtype=DT)
        self.experts = experts

    def forward(self, x: Tensor) -> Tensor:
        weights, index = self.gate(x).softmax(-1).topk(2, dim=-1)
        out: Tensor = self.experts(x, index, weights)
        return out


def preconditioned(block: Block, steps: int = 3) -> list[dict[str, Tensor]]:
    """K-FAC (every step an update) on ``block`` for ``steps`` SGD steps: each step's preconditioned gradients by
    layer name, a twin's gate and up joined as the fused gate_up."""
    pre = hylo.HyLoPreconditioner(block, solver="kfac", update_freq=1, damping=0.05)
    opt = torch.optim.SGD(block.parameters(), lr=0.05)
    seen = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, target = (torch.randn(24, block.gate.in_features, generator=gen, dtype=DT) for _ in range(2))
        opt.zero_grad()
        (0.5 * (block(x) - target).pow(2).sum(-1).mean()).backward()
        pre.step()
        seen.append(expert_grads(block))
        opt.step()
    pre.remove()
    return seen


@pytest.mark.parametrize(("package", "name"), EXPERTS, ids=[name for _, name in EXPERTS])
def test_every_experts_class_equals_its_linear_twin_or_is_left_alone_with_its_declared_layout(
    package: str, name: str
) -> None:
    experts = built(package, name, DT)
    if name in REFUSED:
        assert REFUSED[name] in (layout_problem(experts) or "")
        assert layer_math(experts, hylo.HyLoConfig()) is None
        return
    assert layout_problem(experts) is None
    width, count = experts.gate_up_proj.shape[2], experts.gate_up_proj.shape[0]
    fused, twin = Block(experts, width, count), Block(LinearExperts(experts, halves=True), width, count)
    got, expected = preconditioned(fused), preconditioned(twin)
    rtol, atol = (1e-4, 1e-6) if name in FLOAT32_GATE else (1e-10, 1e-12)
    for step, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine.keys() == theirs.keys()
        for layer, value in mine.items():
            torch.testing.assert_close(value, theirs[layer], rtol=rtol, atol=atol, msg=f"{layer} at step {step}")


@pytest.mark.parametrize(("package", "name"), ROUTERS, ids=[name for _, name in ROUTERS])
def test_every_router_returns_the_linear_map_of_its_input_and_is_registered_as_a_router(
    package: str, name: str
) -> None:
    router = built(package, name, torch.float32)
    x = torch.randn(2, 5, router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    more = list(inspect.signature(router.forward).parameters)[1:]
    out = router(x, *(torch.zeros(router.weight.shape[0]) for _ in more))  # score-correction biases: zero
    logits = out[LOGITS_AT.get(name, 0)]
    expected = F.linear(x.reshape(-1, x.shape[-1]), router.weight, getattr(router, "bias", None))
    torch.testing.assert_close(logits.reshape(expected.shape).float(), expected, rtol=1e-5, atol=1e-5)
    math = layer_math(router, hylo.HyLoConfig())
    assert isinstance(math, RouterMath) and math.logits_at == LOGITS_AT.get(name, 0)


# ------------------------------------------------------------------------------------------ whole models
#: What each named family leaves alone, by reason (docs/moe.md, "Models"): Jamba's Mamba layers (its depthwise
#: Conv1d and the mixer's A_log); the experts of GPT-OSS (transposed, interleaved gate and up, biases), Llama 4 (every
#: expert applied to every token, transposed) and DBRX (2-D flattened experts, down transposed).
LEFT_ALONE: dict[str, set[str]] = {
    "Qwen3-MoE": set(),
    "OLMoE": set(),
    "DeepSeek-V3": set(),
    "Granite-MoE": set(),
    "PhiMoE": set(),
    "Jamba": {"Conv1d", "JambaMambaMixer"},
    "GPT-OSS": {"GptOssExperts"},
    "Llama 4": {"Llama4TextExperts"},
    "DBRX": {"DbrxExpertGLU"},
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_named_family_registers_its_experts_and_routers_or_leaves_them_alone_with_the_documented_reason(
    family: str,
) -> None:
    model = moe_family(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = hylo.HyLoPreconditioner(model)
    coverage = pre.coverage()
    assert {why for why, _ in coverage.left_alone} == LEFT_ALONE[family], coverage.line()
    names = [info.name for info in pre.layer_info()]
    experts = [n for n in names if ".experts.gate_up_proj." in n or ".experts.down_proj." in n]
    if any("Experts" in why or "ExpertGLU" in why for why in LEFT_ALONE[family]):
        assert not experts
        return
    assert coverage.share >= 0.9, coverage.line()
    assert len(experts) >= 8  # 4 experts × 2 projections in each MoE block
    routers = [info for info in pre.layer_info() if info.d_g == 4 and info.d_a == 32]
    assert routers, "no router registered"


@pytest.mark.parametrize("family", ["Qwen3-MoE", "OLMoE"])
def test_whole_qwen3_moe_and_olmoe_models_are_their_linear_twins(family: str) -> None:
    torch.manual_seed(0)
    fused = moe_family(family, implementation="eager").to(DT)
    twin = linear_twin(fused, halves=True)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    results = []
    for model in (fused, twin):
        pre = hylo.HyLoPreconditioner(model, solver="kfac", update_freq=1, damping=0.05)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        pre.step()
        results.append(expert_grads(model))
    assert results[0].keys() == results[1].keys()
    for name, value in results[0].items():
        torch.testing.assert_close(value, results[1][name], rtol=1e-10, atol=1e-12, msg=name)
