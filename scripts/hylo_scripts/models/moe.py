"""Small mixture-of-experts models built from their ``transformers`` configs, and their ``nn.Linear`` twins
(docs/moe.md).

Hugging Face's transformers 5.x stores each MoE layer's experts fused, as 3-D parameters (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]) applied to the tokens routed to each expert. :func:`linear_twin` writes the
same model with one ``nn.Linear`` per expert and projection, holding the same weights and computing the same
function in the same order (the eager loop of transformers' experts): the reference the tests hold hylo's fused
experts to, and the comparison ``scripts/bench_moe.py`` times.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

#: The tiny models' sizes: width, heads, blocks, experts, experts per token and each expert's MLP width.
WIDTH = 32
HEADS = 4
LAYERS = 2
EXPERTS = 4
TOP_K = 2
EXPERT_WIDTH = 48
VOCAB = 256
SEQ = 16


def _transformers() -> Any:
    import transformers

    return transformers


def mixtral(
    width: int = WIDTH,
    layers: int = LAYERS,
    experts: int = EXPERTS,
    expert_width: int = EXPERT_WIDTH,
    seq: int = SEQ,
    implementation: str | None = None,
) -> nn.Module:
    """A Mixtral (top-2 of ``experts`` SwiGLU experts per block, untied embeddings), float32, train mode; its experts
    run by transformers' ``implementation`` (``"eager"``, ``"grouped_mm"``, ``"batched_mm"``; None: its default)."""
    config = _transformers().MixtralConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=expert_width, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=experts, num_experts_per_tok=TOP_K,
        max_position_embeddings=seq, attention_dropout=0.0, router_jitter_noise=0.0, bos_token_id=1,
        eos_token_id=2, experts_implementation=implementation,
    )  # fmt: skip
    model: nn.Module = _transformers().MixtralForCausalLM(config)
    return model.train()


def qwen2_moe(
    width: int = WIDTH, layers: int = LAYERS, experts: int = EXPERTS, seq: int = SEQ, implementation: str | None = None
) -> nn.Module:
    """A Qwen2-MoE (top-2 of ``experts`` routed experts and a gated shared expert per block, untied embeddings)."""
    config = _transformers().Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * EXPERT_WIDTH, moe_intermediate_size=EXPERT_WIDTH,
        shared_expert_intermediate_size=EXPERT_WIDTH, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, num_experts=experts, num_experts_per_tok=TOP_K, max_position_embeddings=seq,
        attention_dropout=0.0, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
        bos_token_id=1, eos_token_id=2, experts_implementation=implementation,
    )  # fmt: skip
    model: nn.Module = _transformers().Qwen2MoeForCausalLM(config)
    return model.train()


#: Mixture-of-experts families of transformers 5.24 beyond Mixtral and Qwen2-MoE, tiny, by name: (config class, model
#: class, the family's own options). Each has :data:`EXPERTS` experts per block, :data:`TOP_K` per token
#: (Llama 4: 1), each :data:`EXPERT_WIDTH` wide; docs/moe.md, "Models".
MOE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "moe_intermediate_size": EXPERT_WIDTH, "num_experts": EXPERTS, "head_dim": WIDTH // HEADS,
        "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "OLMoE": ("OlmoeConfig", "OlmoeForCausalLM", {"intermediate_size": EXPERT_WIDTH, "num_experts": EXPERTS}),
    "DeepSeek-V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "intermediate_size": 2 * EXPERT_WIDTH, "moe_intermediate_size": EXPERT_WIDTH, "n_routed_experts": EXPERTS,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": WIDTH // HEADS}),
    "Granite-MoE": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        "intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS}),
    "PhiMoE": ("PhimoeConfig", "PhimoeForCausalLM", {"intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS}),
    "Jamba": ("JambaConfig", "JambaForCausalLM", {
        "intermediate_size": EXPERT_WIDTH, "num_experts": EXPERTS, "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 1, "expert_layer_offset": 0, "mamba_d_state": 4, "mamba_dt_rank": 4,
        "use_mamba_kernels": False}),
    "GPT-OSS": ("GptOssConfig", "GptOssForCausalLM", {
        "intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS, "head_dim": WIDTH // HEADS,
        "sliding_window": SEQ // 2}),
    "Llama 4": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "intermediate_size": EXPERT_WIDTH, "intermediate_size_mlp": 2 * EXPERT_WIDTH, "num_local_experts": EXPERTS,
        "num_experts_per_tok": 1, "head_dim": WIDTH // HEADS, "interleave_moe_layer_step": 1}),
    "DBRX": ("DbrxConfig", "DbrxForCausalLM", {
        "d_model": WIDTH, "n_heads": HEADS, "n_layers": LAYERS, "max_seq_len": SEQ,
        "ffn_config": {"ffn_hidden_size": EXPERT_WIDTH, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K},
        "attn_config": {"kv_n_heads": HEADS, "rope_theta": 10_000.0}}),
}  # fmt: skip


def moe_family(name: str, implementation: str | None = None) -> nn.Module:
    """The tiny model of :data:`MOE_FAMILIES`' family ``name`` (untied embeddings, float32, train mode), its experts
    run by transformers' ``implementation`` (None: its default)."""
    config_class, model_class, own = MOE_FAMILIES[name]
    tf = _transformers()
    config = getattr(tf, config_class)(**{
        "vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "num_experts_per_tok": TOP_K, "max_position_embeddings": SEQ,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "experts_implementation": implementation, **own,
    })  # fmt: skip
    model: nn.Module = getattr(tf, model_class)(config)
    return model.train()


def glu(act: Callable[[Tensor], Tensor], pre: Tensor) -> Tensor:
    """``act(gate) * up`` of gate_up's output ``pre`` (its first half the gate, its second the up)."""
    gate, up = pre.chunk(2, dim=-1)
    return act(gate) * up


class GateUp(nn.Module):
    """An expert's gate and up projections as two ``nn.Linear`` layers (Mixtral's unfused ``w1`` and ``w3``), applied
    as the fused ``gate_up`` is: the gate's outputs, then the up's."""

    def __init__(self, hidden: int, width: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, width, False, device, dtype)
        self.up = nn.Linear(hidden, width, False, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        """[gate x, up x] along the last dimension."""
        return torch.cat([self.gate(x), self.up(x)], dim=-1)


class LinearExperts(nn.Module):
    """Fused experts written with one ``nn.Linear`` per expert and projection (``<gate_up>.<e>``, ``<down>.<e>``:
    the names hylo gives the fused experts' layers), the same function in the same order; with ``halves`` each
    gate_up a :class:`GateUp` (``<gate_up>.<e>.gate`` and ``.up``)."""

    def __init__(
        self, fused: nn.Module, gate_up: str = "gate_up_proj", down: str = "down_proj", halves: bool = False
    ) -> None:
        super().__init__()
        gate_up_weight, down_weight = getattr(fused, gate_up), getattr(fused, down)
        assert isinstance(gate_up_weight, Tensor) and isinstance(down_weight, Tensor)
        experts, double, hidden = gate_up_weight.shape
        self.num_experts = int(experts)
        #: The fused module's gate on gate_up's output: its ``_apply_gate`` (transformers' experts modules have one,
        #: some with a clamp of their own), else ``act_fn(gate) * up``.
        own: Callable[[Tensor], Tensor] | None = getattr(fused, "_apply_gate", None)
        self.apply_gate = own or functools.partial(glu, fused.act_fn)  # type: ignore[arg-type]
        self.names = (gate_up, down)
        dtype, device = gate_up_weight.dtype, gate_up_weight.device
        first: Callable[[], nn.Module] = (
            functools.partial(GateUp, hidden, double // 2, device, dtype)
            if halves
            else functools.partial(nn.Linear, hidden, double, False, device, dtype)
        )
        setattr(self, gate_up, nn.ModuleList(first() for _ in range(experts)))
        setattr(self, down, nn.ModuleList(nn.Linear(double // 2, hidden, False, device, dtype) for _ in range(experts)))
        with torch.no_grad():
            for e in range(experts):
                projection = self.projection(0, e)
                if isinstance(projection, GateUp):
                    projection.gate.weight.copy_(gate_up_weight[e, : double // 2])
                    projection.up.weight.copy_(gate_up_weight[e, double // 2 :])
                else:
                    assert isinstance(projection, nn.Linear)
                    projection.weight.copy_(gate_up_weight[e])
                second = self.projection(1, e)
                assert isinstance(second, nn.Linear)
                second.weight.copy_(down_weight[e])

    def projection(self, which: int, expert: int) -> nn.Module:
        """Expert ``expert``'s gate_up (``which`` 0: a Linear or a :class:`GateUp`) or down (1: a Linear)."""
        linears = getattr(self, self.names[which])
        assert isinstance(linears, nn.ModuleList)
        module: nn.Module = linears[expert]
        return module

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Each expert on its routed tokens (in ``torch.where`` order of (slot, token)), weighted and summed."""
        final = torch.zeros_like(hidden_states)
        routed = top_k_index.mT  # (k, tokens)
        for e in range(self.num_experts):
            slot, token = torch.where(routed == e)
            if token.numel() == 0:
                continue
            hidden = self.apply_gate(self.projection(0, e)(hidden_states[token]))
            out = self.projection(1, e)(hidden) * top_k_weights[token, slot, None]
            final.index_add_(0, token, out.to(final.dtype))
        return final


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's fused experts modules (those with 3-D ``gate_up_proj`` and ``down_proj``), by name."""
    found = []
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(gate_up, Tensor) and gate_up.dim() == 3:
            found.append((name, module))
    return found


def linear_twin(model: nn.Module, halves: bool = False) -> nn.Module:
    """A copy of ``model`` whose fused experts are :class:`LinearExperts` holding the same weights (each gate_up as
    two Linear layers with ``halves``)."""
    twin = copy.deepcopy(model)
    for name, module in fused_experts(twin):
        parent_name, _, child = name.rpartition(".")
        parent = twin.get_submodule(parent_name) if parent_name else twin
        setattr(parent, child, LinearExperts(module, halves=halves))
    return twin
