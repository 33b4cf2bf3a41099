"""The layer types of Hugging Face ``transformers`` that hylo registers by class (docs/moe.md, "Models"; docs/extending.md,
"Layers of other packages").

One table, read by :mod:`hylo.layers.registry`, which registers each class through ``register_layer_type`` once its
module has been imported (hylo never imports ``transformers``):

- :data:`LINEARS`: subclasses of ``nn.Linear`` whose own ``forward`` is the Linear map (a plain ``x Wᵀ + b``);
- :data:`CONV1D`: GPT-2's ``Conv1D``, a Linear whose weight is stored (d_in, d_out);
- :data:`MIXTURES`: every fused mixture-of-experts family of transformers 5.24, by model package: its experts
  classes (3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], applied to each expert's routed tokens;
  one that declares another layout — transposed, interleaved, with biases, without a gate, with a norm after each
  expert — is refused with the reason it declares) and its routers (a Linear of the hidden states whose module
  returns the logits first; :data:`LOGITS_AT` names the one that returns them elsewhere).

``tests/library/test_moe_families.py`` holds every class to it: each experts class against its ``nn.Linear`` twin,
each router's logits against ``F.linear`` of its input, and every experts class transformers declares
(``@use_experts_implementation``) listed here.
"""

from __future__ import annotations

#: ``nn.Linear`` subclasses with a ``forward`` of their own that is the Linear map: (module, class).
LINEARS: tuple[tuple[str, str], ...] = (("transformers.models.falcon.modeling_falcon", "FalconLinear"),)
#: GPT-2's ``Conv1D``: (module, class).
CONV1D = ("transformers.pytorch_utils", "Conv1D")
#: The fused mixture-of-experts families: (model package under ``transformers.models``, its experts classes, its
#: routers), each class in the package's ``modeling_<package>`` module.
MIXTURES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("afmoe", ("AfmoeExperts",), ()),
    ("aria", ("AriaExperts",), ("AriaTextTopKRouter",)),
    ("axk1", ("AXK1Experts",), ("AXK1TopkRouter",)),
    ("axk2", ("AXK2Experts",), ("AXK2TopkRouter",)),
    ("bailing_hybrid", ("BailingHybridExperts",), ("BailingHybridTopkRouter",)),
    ("beam", ("BeamExperts",), ("BeamTopKRouter",)),
    ("cohere2_moe", ("Cohere2MoeExperts",), ("Cohere2MoeTopKRouter",)),
    ("deepseek_ocr2", ("DeepseekOcr2TextExperts",), ("DeepseekOcr2TextTopkRouter",)),
    ("deepseek_v2", ("DeepseekV2Experts",), ("DeepseekV2TopkRouter",)),
    ("deepseek_v3", ("DeepseekV3Experts",), ("DeepseekV3TopkRouter",)),
    ("deepseek_v32", ("DeepseekV32Experts",), ("DeepseekV32TopkRouter",)),
    ("deepseek_v4", ("DeepseekV4Experts",), ("DeepseekV4TopKRouter",)),
    ("diffusion_gemma", ("DiffusionGemmaTextExperts",), ()),
    ("dots1", ("Dots1Experts",), ("Dots1TopkRouter",)),
    ("dots3_note", ("Dots3NoteExperts",), ("Dots3NoteTextTopkRouter",)),
    ("ernie4_5_moe", ("Ernie4_5_MoeExperts",), ("Ernie4_5_MoeTopKRouter",)),
    ("ernie4_5_vl_moe", ("Ernie4_5_VLMoeMoeExperts",), ()),
    ("exaone_moe", ("ExaoneMoeExperts",), ("ExaoneMoeTopkRouter",)),
    ("flex_olmo", ("FlexOlmoExperts",), ("FlexOlmoTopKRouter",)),
    ("flint", ("FlintExperts",), ("FlintTopKRouter",)),
    ("gemma4", ("Gemma4TextExperts",), ()),
    ("glm4_moe", ("Glm4MoeExperts",), ("Glm4MoeTopkRouter",)),
    ("glm4_moe_lite", ("Glm4MoeLiteExperts",), ("Glm4MoeLiteTopkRouter",)),
    ("glm4v_moe", ("Glm4vMoeTextExperts",), ("Glm4vMoeTextTopkRouter",)),
    ("glm5_next", ("Glm5NextTextExperts",), ("Glm5NextTextTopkRouter",)),
    ("glm_moe_dsa", ("GlmMoeDsaExperts",), ("GlmMoeDsaTopkRouter",)),
    ("gpt_oss", ("GptOssExperts",), ("GptOssTopKRouter",)),
    ("granitemoe", ("GraniteMoeExperts",), ("GraniteMoeTopKRouter",)),
    ("granitemoe_swa", ("GraniteMoeSWAExperts",), ("GraniteMoeSWATopKRouter",)),
    ("granitemoehybrid", ("GraniteMoeHybridExperts",), ()),
    ("granitemoeshared", ("GraniteMoeSharedExperts",), ("GraniteMoeSharedTopKRouter",)),
    ("hunyuan_v1_moe", ("HunYuanMoEV1Experts",), ()),
    ("hy_v3", ("HYV3Experts",), ("HYV3TopKRouter",)),
    ("hy_v4", ("HYV4Experts",), ("HYV4TopkRouter",)),
    ("hy_v4_vl", ("HYV4VLExperts",), ("HYV4VLTopkRouter",)),
    ("inkling", ("InklingExperts",), ()),
    ("inkling2", ("Inkling2Experts",), ("Inkling2TopKRouter",)),
    ("inkling2_loop", ("Inkling2LoopExperts",), ("Inkling2LoopTopKRouter",)),
    ("jamba", ("JambaExperts",), ("JambaTopKRouter",)),
    ("kimi_linear", ("KimiLinearExperts",), ("KimiLinearTopkRouter",)),
    ("kolibri1", ("Kolibri1Experts",), ("Kolibri1TopKRouter",)),
    ("laguna", ("LagunaExperts",), ("LagunaTopKRouter",)),
    ("lara_mini", ("LaraMiniExperts",), ("LaraMiniTopKRouter",)),
    ("lfm2_moe", ("Lfm2MoeExperts",), ("Lfm2MoeTopKRouter",)),
    ("llama4", (), ("Llama4Router",)),
    ("mellum", ("MellumExperts",), ("MellumTopKRouter",)),
    ("mimo_v2_flash", ("MiMoV2FlashExperts",), ("MiMoV2FlashTopkRouter",)),
    ("minimax", ("MiniMaxExperts",), ("MiniMaxTopKRouter",)),
    ("minimax_m2", ("MiniMaxM2Experts",), ("MiniMaxM2TopKRouter",)),
    ("minimax_m3_vl", ("MiniMaxM3VLExperts",), ("MiniMaxM3VLTopKRouter",)),
    ("mistral4", ("Mistral4Experts",), ("Mistral4TopkRouter",)),
    ("mistral_large4", ("MistralLarge4TextExperts",), ("MistralLarge4TextTopkRouter",)),
    ("mixtral", ("MixtralExperts",), ("MixtralTopKRouter",)),
    ("muse_spark", ("MuseSparkExperts",), ()),
    ("nemotron_h", ("NemotronHExperts",), ("NemotronHTopkRouter",)),
    ("olmoe", ("OlmoeExperts",), ("OlmoeTopKRouter",)),
    ("openai_privacy_filter", ("OpenAIPrivacyFilterExperts",), ("OpenAIPrivacyFilterTopKRouter",)),
    ("phimoe", ("PhimoeExperts",), ("PhimoeTopKRouter",)),
    ("qwen2_moe", ("Qwen2MoeExperts",), ("Qwen2MoeTopKRouter",)),
    ("qwen3_5_moe", ("Qwen3_5MoeExperts",), ("Qwen3_5MoeTopKRouter",)),
    ("qwen3_moe", ("Qwen3MoeExperts",), ("Qwen3MoeTopKRouter",)),
    ("qwen3_next", ("Qwen3NextExperts",), ("Qwen3NextTopKRouter",)),
    (
        "qwen3_omni_moe",
        ("Qwen3OmniMoeThinkerTextExperts", "Qwen3OmniMoeTalkerTextExperts"),
        ("Qwen3OmniMoeTextTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter"),
    ),
    ("qwen3_vl_moe", ("Qwen3VLMoeTextExperts",), ("Qwen3VLMoeTextTopKRouter",)),
    ("qwen4_exp", ("Qwen4ExpTextExperts",), ("Qwen4ExpTextTopKRouter",)),
    ("solar_open", ("SolarOpenExperts",), ("SolarOpenTopkRouter",)),
    ("step3p7", ("Step3p7Experts",), ("Step3p7TopKRouter",)),
    ("unlimited_ocr", ("UnlimitedOcrTextExperts",), ("UnlimitedOcrTextTopkRouter",)),
    ("zaya", ("ZayaExperts",), ()),
)
#: Routers whose module returns the logits at another position than the first: class -> position.
LOGITS_AT: dict[str, int] = {"Llama4Router": 1}


def modeling_module(package: str) -> str:
    """The module of a model package's classes: ``transformers.models.<package>.modeling_<package>``."""
    return f"transformers.models.{package}.modeling_{package}"
