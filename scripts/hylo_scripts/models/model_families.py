"""Tiny models of the model families hylo is run on, built from their ``transformers`` configs
(docs/models.md, "Model families").

One definition, shared by ``scripts/bench_models.py`` (the table of coverage and losses) and
``tests/application/test_model_families.py``: for each family (:data:`FAMILIES`) a builder of a tiny model (dropout 0,
small vocabulary, train mode), a deterministic batch maker and the full-size model whose proportions it keeps
(built on the meta device: shapes without memory). The loss is the model's own (:func:`loss_of`); what hylo
leaves alone in each, and why, is the tests' specification (docs/models.md, "What is left alone").

**Sizes** (docs/models.md, "Sizes"). Every tiny transformer is :data:`WIDTH` wide with :data:`HEADS` heads and
:data:`LAYERS` blocks (per stack for encoder-decoders), its MLP as many times wider as the full-size model's, on
batches of :data:`BATCH` × :data:`SEQ` tokens. In a model that small a vocabulary-sized table would dominate, so
each vocabulary is chosen to give the table the share of the trainable matrix elements it has at full size
(tied: GPT-2 small 31%, Qwen2-0.5B 28%, T5-small 27%, BART-base 28%, Whisper-tiny 54%, OPT-125m 31%,
Mamba-130m 30%); position tables are as long as the sequences, within a point of their full-size share. Llama
and Mistral untie their embeddings, which hylo preconditions, so their vocabulary (256) does not change the
coverage. Mamba is :data:`MAMBA_WIDTH` wide: its ``A_log`` and depthwise convolution, which hylo leaves alone,
are 16/(3·width) and 4/(3·width) of a block's matrices (state size 16, kernel 4, the projections about 3·width
per inner channel): 4.4% of the untied matrix elements at width 128 against 0.8% in Mamba-130m. hylo's coverage
of :attr:`Family.full` gives the full-size shares (``scripts/bench_models.py`` prints both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

#: Tokens per sequence (encoder and decoder sides) and sequences per batch.
SEQ = 16
BATCH = 4
#: Width, heads and blocks (per stack) of every tiny transformer.
WIDTH = 32
HEADS = 4
LAYERS = 2
#: Mamba's width (its state size is the full-size model's 16; see the module's docstring).
MAMBA_WIDTH = 128
#: Falcon's width and blocks: with a vocabulary of 256 its tied table holds 4.5% of the matrix elements, Falcon-7B's 4.3%.
FALCON_WIDTH = 128
FALCON_LAYERS = 4

#: The reason hylo's coverage counts a matrix held by two modules under (tied embeddings and LM heads).
TIED = "tied"
#: Hugging Face's learned position tables: subclasses of ``nn.Embedding`` with a ``forward`` of their own, which hylo
#: leaves alone (docs/transformers.md, "Hugging Face position tables").
POSITION_TABLES = frozenset(
    {"OPTLearnedPositionalEmbedding", "BartLearnedPositionalEmbedding", "WhisperPositionalEmbedding"}
)
#: The documented exclusions: reasons whose elements "coverage excluding exclusions" takes out of the total.
EXCLUDED = frozenset({TIED, *POSITION_TABLES})
#: The steps whose batches are held out of training (the loss the benchmark reports is their mean).
HELD_OUT = tuple(range(1_000_000, 1_000_004))

Batch = dict[str, Tensor]


def loss_of(model: nn.Module, batch: Batch) -> Tensor:
    """The model's own loss on ``batch``: every family here takes ``labels`` and returns ``.loss``, the mean
    cross-entropy over the labelled tokens (over the images for ViT)."""
    loss: Tensor = model(**batch).loss
    return loss


def batch_on(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with its tensors on ``device`` (the batch makers draw on the CPU)."""
    return {key: value.to(device) for key, value in batch.items()}


@dataclass(frozen=True)
class Family:
    """A model family: how to build its tiny model and its full-size one, and its batches."""

    #: The name in the table ("GPT-2").
    name: str
    #: Builds the tiny model from its ``transformers`` config (float32, dropout 0, train mode); see :meth:`model`.
    build: Callable[[], nn.Module]
    #: The batch of step ``step``, a fixed function of it: keyword arguments of the model's ``forward``, labels
    #: included.
    batch: Callable[[int], Batch]
    #: Builds the full-size model on the meta device (no memory, no weights): the proportions the tiny one keeps.
    full: Callable[[], nn.Module]
    #: The full-size model's name ("GPT-2 small").
    full_name: str
    #: The loss of the model on a batch: the model's own (:func:`loss_of`) unless the family's model returns
    #: logits alone (torchvision's classifiers, ``hylo_scripts.models.vision_families``).
    loss: Callable[[nn.Module, Batch], Tensor] = loss_of

    def model(self, seed: int = 0) -> nn.Module:
        """The tiny model, its weights drawn from ``seed``."""
        torch.manual_seed(seed)
        return self.build().train()


# ------------------------------------------------------------------------------------------------- batches
def sequences(step: int, vocab: int, low: int = 3) -> Tensor:
    """:data:`BATCH` arithmetic sequences of :data:`SEQ` tokens in ``[low, vocab)``, a random start and stride per
    row drawn from ``step``: each token follows from the two before it, a rule a small model can learn (ids below
    ``low`` are left to the special tokens)."""
    gen = torch.Generator().manual_seed(step)
    span = vocab - low
    start = torch.randint(0, span, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 8, (BATCH, 1), generator=gen)
    return low + (start + stride * torch.arange(SEQ)) % span


def lm_batch(step: int, vocab: int) -> Batch:
    """A causal language model's batch: the sequences labelled with themselves (the model shifts them)."""
    ids = sequences(step, vocab)
    return {"input_ids": ids, "labels": ids.clone()}


def seq2seq_batch(step: int, vocab: int) -> Batch:
    """An encoder-decoder's batch: a sequence in, the same sequence reversed out (the model shifts the labels
    right into the decoder's inputs)."""
    ids = sequences(step, vocab)
    return {"input_ids": ids, "labels": ids.flip(1)}


def speech_batch(step: int, vocab: int, mel_bins: int, frames: int) -> Batch:
    """Whisper's batch: log-mel features, ``frames`` long as its encoder requires, and a token sequence."""
    gen = torch.Generator().manual_seed(step)
    features = torch.randn(BATCH, mel_bins, frames, generator=gen)
    return {"input_features": features, "labels": sequences(step, vocab)}


def image_batch(step: int, image: int, classes: int) -> Batch:
    """ViT's batch: random images labelled by which quadrant of their first channel is brightest."""
    gen = torch.Generator().manual_seed(step)
    pixels = torch.randn(BATCH, 3, image, image, generator=gen)
    half = image // 2
    quadrants = pixels[:, 0].unfold(1, half, half).unfold(2, half, half).mean((-1, -2)).flatten(1)
    return {"pixel_values": pixels, "labels": quadrants.argmax(1) % classes}


# ------------------------------------------------------------------------------------------------- tiny models
def _transformers() -> Any:
    """The ``transformers`` package (imported when a model is built: hylo_scripts does not need it otherwise)."""
    import transformers

    return transformers


GPT2_VOCAB = 352
LLAMA_VOCAB = 256
QWEN2_VOCAB = 480
T5_VOCAB = 672
BART_VOCAB = 704
WHISPER_VOCAB = 2240
OPT_VOCAB = 352
MAMBA_VOCAB = 768
MEL_BINS = 8
IMAGE = 16
PATCH = 4
CLASSES = 4
#: The projections of every Llama block LoRA adapts, and its rank.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 4


def gpt2() -> nn.Module:
    """GPT-2: ``Conv1D`` projections, ``wpe`` a plain ``nn.Embedding``, ``wte`` tied to the LM head."""
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=GPT2_VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model: nn.Module = tf.GPT2LMHeadModel(config)
    return model


def _llama_config() -> Any:
    """Llama's tiny config: untied embeddings, SwiGLU MLP 2.75 times the width (Llama-2-7B's 11008/4096)."""
    return _transformers().LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=WIDTH, intermediate_size=88, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ, attention_dropout=0.0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def llama() -> nn.Module:
    """Llama: Linear projections without biases, untied embeddings."""
    model: nn.Module = _transformers().LlamaForCausalLM(_llama_config())
    return model


def qwen2() -> nn.Module:
    """Qwen2 as Qwen2-0.5B: grouped-query attention (4 query heads, 2 key-value heads) with q/k/v biases, MLP 5.5
    times the width, embeddings tied to the LM head."""
    tf = _transformers()
    config = tf.Qwen2Config(
        vocab_size=QWEN2_VOCAB, hidden_size=WIDTH, intermediate_size=176, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True,
        attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model: nn.Module = tf.Qwen2ForCausalLM(config)
    return model


def mistral() -> nn.Module:
    """Mistral: grouped-query attention (4 query heads, 2 key-value heads), a sliding window shorter than the
    sequence, MLP 3.5 times the width (Mistral-7B's 14336/4096), untied embeddings."""
    tf = _transformers()
    config = tf.MistralConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=WIDTH, intermediate_size=112, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, sliding_window=SEQ // 2,
        attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model: nn.Module = tf.MistralForCausalLM(config)
    return model


def t5() -> nn.Module:
    """T5: bias-free projections, a relative-position bias table (a plain ``nn.Embedding``) in each stack's
    first block, the shared embedding tied to both stacks and the LM head."""
    tf = _transformers()
    config = tf.T5Config(
        vocab_size=T5_VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=4 * WIDTH, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model: nn.Module = tf.T5ForConditionalGeneration(config)
    return model


def bart() -> nn.Module:
    """BART: a learned position table (a subclass with a ``forward`` of its own) in each stack, the word
    embedding tied to both stacks and the LM head."""
    tf = _transformers()
    config = tf.BartConfig(
        vocab_size=BART_VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=4 * WIDTH,
        decoder_ffn_dim=4 * WIDTH, max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0,
    )  # fmt: skip
    model: nn.Module = tf.BartForConditionalGeneration(config)
    return model


def whisper() -> nn.Module:
    """Whisper: a ``Conv1d`` stem, a frozen encoder position table, the decoder's learned one (a subclass), the
    token embedding tied to the output projection."""
    tf = _transformers()
    config = tf.WhisperConfig(
        vocab_size=WHISPER_VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=4 * WIDTH,
        decoder_ffn_dim=4 * WIDTH, num_mel_bins=MEL_BINS, max_source_positions=SEQ, max_target_positions=SEQ,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    model: nn.Module = tf.WhisperForConditionalGeneration(config)
    return model


def opt() -> nn.Module:
    """OPT: a learned position table (a subclass called with the attention mask), embeddings tied to the head."""
    tf = _transformers()
    config = tf.OPTConfig(
        vocab_size=OPT_VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, ffn_dim=4 * WIDTH,
        num_attention_heads=HEADS, max_position_embeddings=SEQ, word_embed_proj_dim=WIDTH, dropout=0.0,
        attention_dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2,
    )  # fmt: skip
    model: nn.Module = tf.OPTForCausalLM(config)
    return model


#: The tiny ViT's config options, which DeiT's shares (:mod:`hylo_scripts.models.vision_families`).
VIT_OPTIONS: dict[str, Any] = dict(
    hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=4 * WIDTH,
    image_size=IMAGE, patch_size=PATCH, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip


def vit() -> nn.Module:
    """ViT: a ``Conv2d`` patch embedding (stride = kernel), the class token and position embeddings as bare
    parameters of ``ViTEmbeddings``, a Linear classifier."""
    tf = _transformers()
    model: nn.Module = tf.ViTForImageClassification(tf.ViTConfig(**VIT_OPTIONS))
    return model


def mamba() -> nn.Module:
    """Mamba on its pure-torch path: Linear in/x/dt/out projections, a depthwise ``Conv1d`` and ``A_log`` per
    block, embeddings tied to the LM head."""
    tf = _transformers()
    config = tf.MambaConfig(
        vocab_size=MAMBA_VOCAB, hidden_size=MAMBA_WIDTH, num_hidden_layers=LAYERS, state_size=16, expand=2,
        use_mambapy=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model: nn.Module = tf.MambaForCausalLM(config)
    return model


def falcon() -> nn.Module:
    """Falcon as Falcon-7B: ``FalconLinear`` projections (an ``nn.Linear`` subclass with a ``forward`` of its own),
    multi-query attention, attention and MLP in parallel, embeddings tied to the LM head."""
    tf = _transformers()
    config = tf.FalconConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=FALCON_WIDTH, num_hidden_layers=FALCON_LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model: nn.Module = tf.FalconForCausalLM(config)
    return model


def lora_llama() -> nn.Module:
    """LoRA (``peft``, rank :data:`LORA_RANK`, no dropout) on every projection of the tiny Llama: the base model
    frozen, each adapter's A and B an ``nn.Linear`` (B starts at zero, as ``peft`` initialises it)."""
    import peft

    base = _transformers().LlamaForCausalLM(_llama_config())
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    model: nn.Module = peft.get_peft_model(base, config)
    return model


# ------------------------------------------------------------------------------------------------- full size
def on_meta(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build`` run with the meta device as the default: parameters with shapes and no memory."""

    @functools.wraps(build)
    def built_on_meta() -> nn.Module:
        with torch.device("meta"):
            return build()

    return built_on_meta


def at_defaults(model: str, config: str, **options: Any) -> Callable[[], nn.Module]:
    """The full-size builder of ``transformers``' ``model`` class from its ``config`` class's defaults (and
    ``options``), on the meta device."""

    @on_meta
    def build() -> nn.Module:
        tf = _transformers()
        built: nn.Module = getattr(tf, model)(getattr(tf, config)(**options))
        return built

    build.__doc__ = f"{model} at {config}'s defaults{f' and {options}' if options else ''}, on the meta device."
    return build


#: GPT-2 small (``GPT2Config``'s defaults).
gpt2_small = at_defaults("GPT2LMHeadModel", "GPT2Config")


#: Llama-2-7B's shapes (``LlamaConfig``'s defaults).
llama_7b = at_defaults("LlamaForCausalLM", "LlamaConfig")


@on_meta
def qwen2_half() -> nn.Module:
    """Qwen2-0.5B."""
    tf = _transformers()
    config = tf.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model: nn.Module = tf.Qwen2ForCausalLM(config)
    return model


#: Mistral-7B (``MistralConfig``'s defaults).
mistral_7b = at_defaults("MistralForCausalLM", "MistralConfig")


#: T5-small (``T5Config``'s defaults).
t5_small = at_defaults("T5ForConditionalGeneration", "T5Config", decoder_start_token_id=0)


@on_meta
def bart_base() -> nn.Module:
    """BART-base."""
    tf = _transformers()
    config = tf.BartConfig(
        d_model=768, encoder_layers=6, decoder_layers=6, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
        encoder_attention_heads=12, decoder_attention_heads=12,
    )  # fmt: skip
    model: nn.Module = tf.BartForConditionalGeneration(config)
    return model


#: Whisper-tiny (``WhisperConfig``'s defaults).
whisper_tiny = at_defaults("WhisperForConditionalGeneration", "WhisperConfig")


#: OPT-125m (``OPTConfig``'s defaults).
opt_125m = at_defaults("OPTForCausalLM", "OPTConfig")


#: ViT-base (``ViTConfig``'s defaults).
vit_base = at_defaults("ViTForImageClassification", "ViTConfig")


#: Mamba-130m (``MambaConfig``'s defaults with its 24 blocks and 50,280 tokens).
mamba_130m = at_defaults("MambaForCausalLM", "MambaConfig", num_hidden_layers=24, vocab_size=50280)


#: Falcon-7B (``FalconConfig``'s defaults).
falcon_7b = at_defaults("FalconForCausalLM", "FalconConfig")


@on_meta
def lora_llama_7b() -> nn.Module:
    """LoRA of rank 8 on every projection of Llama-2-7B's shapes."""
    import peft

    tf = _transformers()
    config = peft.LoraConfig(r=8, target_modules=list(LORA_TARGETS))
    model: nn.Module = peft.get_peft_model(tf.LlamaForCausalLM(tf.LlamaConfig()), config)
    return model


# ------------------------------------------------------------------------------------------------- the families
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("GPT-2", gpt2, functools.partial(lm_batch, vocab=GPT2_VOCAB), gpt2_small, "GPT-2 small"),
        Family("Llama", llama, functools.partial(lm_batch, vocab=LLAMA_VOCAB), llama_7b, "Llama-2-7B"),
        Family("Qwen2 (GQA)", qwen2, functools.partial(lm_batch, vocab=QWEN2_VOCAB), qwen2_half, "Qwen2-0.5B"),
        Family("Mistral", mistral, functools.partial(lm_batch, vocab=LLAMA_VOCAB), mistral_7b, "Mistral-7B"),
        Family("T5", t5, functools.partial(seq2seq_batch, vocab=T5_VOCAB), t5_small, "T5-small"),
        Family("BART", bart, functools.partial(seq2seq_batch, vocab=BART_VOCAB), bart_base, "BART-base"),
        Family(
            "Whisper",
            whisper,
            functools.partial(speech_batch, vocab=WHISPER_VOCAB, mel_bins=MEL_BINS, frames=2 * SEQ),
            whisper_tiny,
            "Whisper-tiny",
        ),
        Family("OPT", opt, functools.partial(lm_batch, vocab=OPT_VOCAB), opt_125m, "OPT-125m"),
        Family("ViT", vit, functools.partial(image_batch, image=IMAGE, classes=CLASSES), vit_base, "ViT-base"),
        Family("Mamba", mamba, functools.partial(lm_batch, vocab=MAMBA_VOCAB), mamba_130m, "Mamba-130m"),
        Family("Falcon", falcon, functools.partial(lm_batch, vocab=LLAMA_VOCAB), falcon_7b, "Falcon-7B"),
        Family(
            "LoRA on Llama",
            lora_llama,
            functools.partial(lm_batch, vocab=LLAMA_VOCAB),
            lora_llama_7b,
            "LoRA r=8 on Llama-2-7B",
        ),
    )
}
