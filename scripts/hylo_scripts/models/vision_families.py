"""Vision families hylo is run on: tiny DeiT, Swin, ConvNeXt and CLIP's vision tower built from their
``transformers`` configs, and torchvision's ResNet-18, MobileNetV3-small, EfficientNet-B0, ConvNeXt-Tiny and
ViT-B/16 at a small image size where torchvision imports (docs/models.md, "Vision families").

The same shape of definition as :mod:`hylo_scripts.models.model_families` (a :class:`~hylo_scripts.models.model_families.Family`
per model: a builder, a batch maker, a full-size model on the meta device), shared by ``scripts/bench_models.py
--vision`` and ``tests/application/test_vision_families.py``. Every batch is 4 random images (``BATCH`` of
model_families) labelled by which quadrant of their first channel is brightest
(:func:`~hylo_scripts.models.model_families.image_batch`), a rule a model can learn, among :data:`CLASSES` classes.

**transformers.** Each tiny model is 32 wide (``WIDTH`` of model_families; Swin's and ConvNeXt's first stage) with
2 blocks (per stage for Swin and ConvNeXt), dropout and stochastic depth 0, and its own loss (``labels`` in,
``.loss`` out): DeiT and CLIP take :data:`IMAGE` × :data:`IMAGE` images in :data:`PATCH` × :data:`PATCH` patches
like ViT; Swin takes them in :data:`SWIN_PATCH` × :data:`SWIN_PATCH` patches under :data:`SWIN_WINDOW` ×
:data:`SWIN_WINDOW` windows (the first stage's second block shifted); ConvNeXt has two stages
:data:`CONVNEXT_WIDTHS` wide behind a :data:`SWIN_PATCH` × :data:`SWIN_PATCH` stem. The full-size models are
DeiT-small, Swin-tiny, ConvNeXt-tiny and CLIP ViT-B/32's vision tower.

**torchvision** (optional: ``pip install torchvision``; the families need it only when built). The models are the
named architectures themselves, at :data:`TORCHVISION_CLASSES` classes with dropout and stochastic depth 0, on
:data:`TORCHVISION_IMAGE` × :data:`TORCHVISION_IMAGE` images (ViT-B/16's position table is built for that size); the
loss is the cross-entropy of their logits (:func:`classify`). Their full-size models are the same architectures
with 1,000 classes at 224 × 224.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from hylo_scripts.models.model_families import (
    CLASSES,
    HEADS,
    IMAGE,
    LAYERS,
    PATCH,
    VIT_OPTIONS,
    WIDTH,
    Batch,
    Family,
    at_defaults,
    image_batch,
    on_meta,
)

#: Swin's patch and window (the tiny model's images: :data:`IMAGE`), and ConvNeXt's stem patch.
SWIN_PATCH = 2
SWIN_WINDOW = 4
#: The widths of ConvNeXt's two stages.
CONVNEXT_WIDTHS = (32, 64)
#: torchvision's images (pixels per side) and classes.
TORCHVISION_IMAGE = 32
TORCHVISION_CLASSES = CLASSES


def _transformers() -> Any:
    """The ``transformers`` package (imported when a model is built)."""
    import transformers

    return transformers


def _torchvision_models() -> Any:
    """``torchvision.models`` (imported when a model is built: torchvision is optional)."""
    import torchvision.models

    return torchvision.models


def torchvision_missing() -> str | None:
    """Why ``torchvision`` does not import here (the exception's text), or None where it does."""
    try:
        _torchvision_models()
    except Exception as e:  # an ImportError, or a RuntimeError of its compiled operators beside another torch
        return f"{type(e).__name__}: {e}"
    return None


def classify(model: nn.Module, batch: Batch) -> Tensor:
    """The cross-entropy of ``model``'s logits on ``batch["pixel_values"]`` against ``batch["labels"]`` (a
    torchvision classifier returns logits alone)."""
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])


# ------------------------------------------------------------------------------------------------- transformers
def deit() -> nn.Module:
    """DeiT: ViT's encoder with a distillation token beside the class token; both tokens and the position
    embeddings are bare parameters of ``DeiTEmbeddings``. ``DeiTForImageClassification`` classifies from the class
    token (the distillation head is the ``WithTeacher`` variant's, for inference)."""
    tf = _transformers()
    model: nn.Module = tf.DeiTForImageClassification(tf.DeiTConfig(**VIT_OPTIONS))
    return model


def swin() -> nn.Module:
    """Swin: a ``Conv2d`` patch embedding, window attention whose relative position bias table is a bare
    parameter of ``SwinRelativePositionBias``, a bias-free Linear patch merging between the two stages."""
    tf = _transformers()
    config = tf.SwinConfig(
        image_size=IMAGE, patch_size=SWIN_PATCH, embed_dim=WIDTH, depths=[LAYERS, LAYERS], num_heads=[2, HEADS],
        window_size=SWIN_WINDOW, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )  # fmt: skip
    model: nn.Module = tf.SwinForImageClassification(config)
    return model


def convnext() -> nn.Module:
    """ConvNeXt: a ``Conv2d`` stem and downsampling, a 7 × 7 depthwise ``Conv2d`` (``groups`` = channels) and two
    Linear pointwise layers per block, LayerScale a vector per block."""
    tf = _transformers()
    config = tf.ConvNextConfig(
        num_stages=len(CONVNEXT_WIDTHS), hidden_sizes=list(CONVNEXT_WIDTHS), depths=[LAYERS] * len(CONVNEXT_WIDTHS),
        patch_size=SWIN_PATCH, image_size=IMAGE, num_labels=CLASSES, drop_path_rate=0.0,
    )  # fmt: skip
    model: nn.Module = tf.ConvNextForImageClassification(config)
    return model


def clip_vision() -> nn.Module:
    """CLIP's vision tower with a Linear classifier on its mean patch token (``CLIPForImageClassification``, which
    builds no text tower): a bias-free ``Conv2d`` patch embedding, the class embedding a vector, the position
    table a plain ``nn.Embedding`` looked up with the positions."""
    tf = _transformers()
    vision = {
        "hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "intermediate_size": 4 * WIDTH, "image_size": IMAGE, "patch_size": PATCH, "attention_dropout": 0.0,
    }  # fmt: skip
    model: nn.Module = tf.CLIPForImageClassification(tf.CLIPConfig(vision_config=vision, num_labels=CLASSES))
    return model


#: DeiT-small (patch 16, 224 × 224, 384 wide, 6 heads, 12 blocks).
deit_small = at_defaults(
    "DeiTForImageClassification", "DeiTConfig", hidden_size=384, num_attention_heads=6, intermediate_size=1536
)


#: Swin-tiny (``SwinConfig``'s defaults: 96 wide, depths 2, 2, 6, 2, window 7).
swin_tiny = at_defaults("SwinForImageClassification", "SwinConfig")


#: ConvNeXt-tiny (``ConvNextConfig``'s defaults: widths 96–768, depths 3, 3, 9, 3).
convnext_tiny = at_defaults("ConvNextForImageClassification", "ConvNextConfig")


#: CLIP ViT-B/32's vision tower (``CLIPVisionConfig``'s defaults) with the classifier.
clip_vit_b32 = at_defaults("CLIPForImageClassification", "CLIPConfig")


# ------------------------------------------------------------------------------------------------- torchvision
def resnet18(num_classes: int = TORCHVISION_CLASSES) -> nn.Module:
    """torchvision's ResNet-18: ungrouped ``Conv2d`` layers, BatchNorm, a Linear classifier."""
    model: nn.Module = _torchvision_models().resnet18(num_classes=num_classes)
    return model


def mobilenet_v3_small(num_classes: int = TORCHVISION_CLASSES) -> nn.Module:
    """torchvision's MobileNetV3-small: inverted residuals with a depthwise ``Conv2d`` each, squeeze-and-excitation
    by 1 × 1 ``Conv2d`` layers, a Linear classifier (dropout 0)."""
    model: nn.Module = _torchvision_models().mobilenet_v3_small(num_classes=num_classes, dropout=0.0)
    return model


def efficientnet_b0(num_classes: int = TORCHVISION_CLASSES) -> nn.Module:
    """torchvision's EfficientNet-B0: MBConv blocks with a depthwise ``Conv2d`` each, squeeze-and-excitation by
    1 × 1 ``Conv2d`` layers (dropout and stochastic depth 0)."""
    models = _torchvision_models()
    model: nn.Module = models.efficientnet_b0(num_classes=num_classes, dropout=0.0, stochastic_depth_prob=0.0)
    return model


def tv_convnext_tiny(num_classes: int = TORCHVISION_CLASSES) -> nn.Module:
    """torchvision's ConvNeXt-Tiny: a depthwise 7 × 7 ``Conv2d`` per block, LayerScale a (C, 1, 1) bare parameter of
    ``CNBlock`` (stochastic depth 0)."""
    model: nn.Module = _torchvision_models().convnext_tiny(num_classes=num_classes, stochastic_depth_prob=0.0)
    return model


def vit_b_16(num_classes: int = TORCHVISION_CLASSES, image_size: int = TORCHVISION_IMAGE) -> nn.Module:
    """torchvision's ViT-B/16 at ``image_size``: ``nn.MultiheadAttention`` blocks, the class token a bare parameter
    of ``VisionTransformer``, the position embeddings one of ``Encoder``, the head's weight starting at zero."""
    model: nn.Module = _torchvision_models().vit_b_16(num_classes=num_classes, image_size=image_size)
    return model


def _full_size(build: Callable[..., nn.Module], **kwargs: Any) -> Callable[[], nn.Module]:
    """The torchvision model ``build`` with 1,000 classes (and ``kwargs``) on the meta device."""

    @on_meta
    def full() -> nn.Module:
        return build(num_classes=1000, **kwargs)

    return full


# ------------------------------------------------------------------------------------------------- the families
#: The names of the families that need torchvision.
TORCHVISION = frozenset(
    {
        "ResNet-18 (torchvision)",
        "MobileNetV3-small (torchvision)",
        "EfficientNet-B0 (torchvision)",
        "ConvNeXt-Tiny (torchvision)",
        "ViT-B/16 (torchvision)",
    }
)

_small = functools.partial(image_batch, image=IMAGE, classes=CLASSES)
_torchvision_batch = functools.partial(image_batch, image=TORCHVISION_IMAGE, classes=TORCHVISION_CLASSES)

VISION_FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("DeiT", deit, _small, deit_small, "DeiT-small"),
        Family("Swin", swin, _small, swin_tiny, "Swin-tiny"),
        Family("ConvNeXt", convnext, _small, convnext_tiny, "ConvNeXt-tiny"),
        Family("CLIP vision", clip_vision, _small, clip_vit_b32, "CLIP ViT-B/32 vision"),
        Family("ResNet-18 (torchvision)", resnet18, _torchvision_batch, _full_size(resnet18), "ResNet-18", classify),
        Family(
            "MobileNetV3-small (torchvision)",
            mobilenet_v3_small,
            _torchvision_batch,
            _full_size(mobilenet_v3_small),
            "MobileNetV3-small",
            classify,
        ),
        Family(
            "EfficientNet-B0 (torchvision)",
            efficientnet_b0,
            _torchvision_batch,
            _full_size(efficientnet_b0),
            "EfficientNet-B0",
            classify,
        ),
        Family(
            "ConvNeXt-Tiny (torchvision)",
            tv_convnext_tiny,
            _torchvision_batch,
            _full_size(tv_convnext_tiny),
            "ConvNeXt-Tiny",
            classify,
        ),
        Family(
            "ViT-B/16 (torchvision)",
            vit_b_16,
            _torchvision_batch,
            _full_size(vit_b_16, image_size=224),
            "ViT-B/16 at 224 × 224",
            classify,
        ),
    )
}
