"""Model registry of the training scripts and benchmarks (not used by the library).

``MODELS`` maps a name to a :class:`ModelSpec`: a builder ``build(input_shape, num_classes)``, the
canonical image shape (C, H, W) and class count, the task, and :meth:`ModelSpec.fits`, which says
why a model cannot take a given shape (by its task's :class:`Inputs`, in :data:`INPUTS`).
:func:`build_model` builds one (canonical shape by default) and :func:`models_for` lists the models a
dataset can train.

- ``cnn``, ``mlp``: the small MNIST networks, for any (C, H, W) (cnn: H, W ≥ 4).
- ``3c1f``: HyLo's Fashion-MNIST network, three 3×3 convolutions of 128 channels, a 3×3 max-pool
  and two linear layers (500 hidden units); H, W ≥ 3. About 5.49M parameters at 1×28×28.
- ``resnet20``, ``resnet32``, ``resnet56``: the CIFAR ResNets of depth 6k+2
  (:func:`resnet_cifar` builds depths 20/32/44/56/110), three stages of 16/32/64 channels with
  parameter-free option-A shortcuts (stride subsampling and zero channel padding); 0.27M, 0.46M
  and 0.85M parameters at 10 classes.
- ``densenet``: the compact DenseNet-BC of depth 40 and growth rate 12 (three dense blocks of
  six bottleneck layers, compression 0.5; 176,122 parameters at 10 classes); the classic
  CIFAR DenseNet-BC is depth 100 (0.8M). Depth 40 keeps a plain SGD training step at batch 8
  on 32×32 images near 0.07 s on two CPU cores.
- ``resnet50``: the ImageNet bottleneck ResNet-50 (stride on the 3×3 conv), H, W ≥ 32.
- ``unet``: the U-Net of the LGG brain-MRI recipe (4 levels, 32 initial features, double 3×3
  conv + BatchNorm + ReLU blocks, 2×2 transposed-convolution up-sampling, skip concatenation;
  7,763,041 parameters at 3 channels in, 1 out). It outputs one logit map per class (no sigmoid:
  the loss applies it); H and W must be multiples of 16. hylo preconditions its 19 Conv2d
  layers and its 4 ConvTranspose2d up-convolutions.
- ``transformer`` (language models): the decoder-only :class:`DecoderLM` over a vocabulary of
  ``num_classes`` tokens with a context of T = ``input_shape[0]`` positions (canonical: 256
  byte values, T = 128) and the size options ``layers``, ``width`` and ``heads`` (default 4,
  256, 4: 3.3M parameters). Its input is a B×T int64 token batch, its output B×T×V logits.

The CIFAR networks (resnet20/32/56, densenet) keep their 3-channel stem, so they take colour
images only; every other model takes its input channels from the shape. ``resnet32`` and
``resnet50`` build the same modules, in the same order and with the same initialisation, as
before the registry took shapes, so a seed gives the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: An input shape: (channels, height, width) of an image, or (length,) of a token sequence.
Shape = tuple[int, ...]


class _BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.pad = planes - in_planes
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x
        if self.stride != 1 or self.pad:
            shortcut = x[:, :, :: self.stride, :: self.stride]
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + shortcut)


class ResNetCifar(nn.Module):
    """CIFAR ResNet of depth 6k+2 (3-channel input)."""

    def __init__(self, depth: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6k+2, got {depth}")
        blocks = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                layers.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def resnet_cifar(depth: int = 32, num_classes: int = 10) -> ResNetCifar:
    """A CIFAR-10 ResNet (depth 20, 32, 44, 56 or 110)."""
    return ResNetCifar(depth, num_classes)


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != out_planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False), nn.BatchNorm2d(out_planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """ImageNet ResNet-50."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages: list[nn.Module] = []
        in_planes = 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                stages.append(_Bottleneck(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes * _Bottleneck.expansion
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        out = self.layers(out)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def resnet50(num_classes: int = 1000, in_channels: int = 3) -> ResNet50:
    """The ImageNet ResNet-50."""
    return ResNet50(num_classes, in_channels)


class _DenseLayer(nn.Module):
    """BN-ReLU-Conv1×1(4k)-BN-ReLU-Conv3×3(k) bottleneck whose k new maps are appended to its input."""

    def __init__(self, in_channels: int, growth: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, 4 * growth, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return torch.cat((x, out), 1)


class _Transition(nn.Module):
    """BN-ReLU-Conv1×1 to ``out_channels`` and 2×2 average pooling between dense blocks."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(in_channels)
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(self.conv(F.relu(self.bn(x))), 2)


class DenseNetBC(nn.Module):
    """CIFAR DenseNet-BC: a 3×3 stem of 2k channels, three dense blocks of (depth − 4) / 6 bottleneck
    layers with growth rate k, transitions compressing the channels by ``compression``, BN-ReLU,
    global average pooling and a linear classifier."""

    def __init__(self, depth: int = 40, growth: int = 12, compression: float = 0.5, num_classes: int = 10) -> None:
        super().__init__()
        if (depth - 4) % 6 or depth < 10:
            raise ValueError(f"DenseNet-BC depth must be 6n+4 with n ≥ 1, got {depth}")
        per_block = (depth - 4) // 6
        channels = 2 * growth
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        for block in range(3):
            for _ in range(per_block):
                stages.append(_DenseLayer(channels, growth))
                channels += growth
            if block < 2:
                stages.append(_Transition(channels, int(channels * compression)))
                channels = int(channels * compression)
        self.features = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn(self.features(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def _double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    """Two 3×3 convolutions (no bias), each followed by BatchNorm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """U-Net with four 2×2 max-pooling levels: encoders of f, 2f, 4f, 8f features, a 16f bottleneck,
    2×2 stride-2 transposed convolutions up, each decoder taking the up-sampled maps concatenated
    with the encoder maps of its level, and a 1×1 convolution to ``out_channels`` logit maps."""

    def __init__(self, in_channels: int = 3, out_channels: int = 1, features: int = 32) -> None:
        super().__init__()
        f = features
        self.encoder1 = _double_conv(in_channels, f)
        self.encoder2 = _double_conv(f, 2 * f)
        self.encoder3 = _double_conv(2 * f, 4 * f)
        self.encoder4 = _double_conv(4 * f, 8 * f)
        self.bottleneck = _double_conv(8 * f, 16 * f)
        self.upconv4 = nn.ConvTranspose2d(16 * f, 8 * f, 2, stride=2)
        self.decoder4 = _double_conv(16 * f, 8 * f)
        self.upconv3 = nn.ConvTranspose2d(8 * f, 4 * f, 2, stride=2)
        self.decoder3 = _double_conv(8 * f, 4 * f)
        self.upconv2 = nn.ConvTranspose2d(4 * f, 2 * f, 2, stride=2)
        self.decoder2 = _double_conv(4 * f, 2 * f)
        self.upconv1 = nn.ConvTranspose2d(2 * f, f, 2, stride=2)
        self.decoder1 = _double_conv(2 * f, f)
        self.conv = nn.Conv2d(f, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        enc1 = self.encoder1(x)
        enc2 = self.encoder2(F.max_pool2d(enc1, 2))
        enc3 = self.encoder3(F.max_pool2d(enc2, 2))
        enc4 = self.encoder4(F.max_pool2d(enc3, 2))
        out = self.bottleneck(F.max_pool2d(enc4, 2))
        out = self.decoder4(torch.cat((self.upconv4(out), enc4), 1))
        out = self.decoder3(torch.cat((self.upconv3(out), enc3), 1))
        out = self.decoder2(torch.cat((self.upconv2(out), enc2), 1))
        out = self.decoder1(torch.cat((self.upconv1(out), enc1), 1))
        return self.conv(out)


class _DecoderBlock(nn.Module):
    """Pre-LayerNorm block: x + attention(LN(x)) under the causal mask, then x + MLP(LN(x)) (Linear-GELU-Linear, 4×)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class DecoderLM(nn.Module):
    """A decoder-only transformer language model: learned token and position embeddings (``nn.Embedding``),
    ``layers`` pre-LayerNorm blocks of ``nn.MultiheadAttention(batch_first=True)`` with a causal mask
    and a Linear-GELU-Linear MLP, a final LayerNorm and a Linear head to the ``vocab`` logits (not
    tied to the token embedding). Linear and embedding weights start from N(0, 0.02²), biases at 0;
    the attention's packed input projection keeps PyTorch's initialisation."""

    def __init__(self, vocab: int = 256, context: int = 128, layers: int = 4, width: int = 256, heads: int = 4) -> None:
        super().__init__()
        if min(vocab, context, layers, width, heads) < 1:
            raise ValueError(
                f"vocab, context, layers, width and heads must be >= 1, got {vocab, context, layers, width, heads}"
            )
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        self.context = context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_DecoderBlock(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        length = x.shape[1]
        if length > self.context:
            raise ValueError(f"a sequence of {length} tokens exceeds the context of {self.context}")
        h = self.tokens(x) + self.positions(torch.arange(length, device=x.device))
        # the mask in the activations' dtype: torch 2.13's CPU attention kernel for AVX2 processors reads a float32
        # mask beside float64 queries wrongly (docs/transformers.md, "Attention")
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=x.device, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln(h))


def mnist_cnn(input_shape: Shape = (1, 28, 28), num_classes: int = 10) -> nn.Sequential:
    """Two 5×5 conv layers (8 and 16 channels, each with 2×2 max-pooling) and two linear layers (64, classes)."""
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 8, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * (height // 4) * (width // 4), 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def mnist_mlp(input_shape: Shape = (1, 28, 28), num_classes: int = 10) -> nn.Sequential:
    """A (C·H·W)-256-128-classes perceptron with ReLU activations."""
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(channels * height * width, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def three_conv_one_fc(input_shape: Shape = (1, 28, 28), num_classes: int = 10) -> nn.Sequential:
    """HyLo's Fashion-MNIST network: three 3×3 convolutions (128 channels, padding 1, ReLU), 3×3 max-pooling,
    a linear layer of 500 units with ReLU and the linear classifier."""
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 128, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3),
        nn.Flatten(),
        nn.Linear(128 * (height // 3) * (width // 3), 500),
        nn.ReLU(),
        nn.Linear(500, num_classes),
    )


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its builder, canonical input shape ((C, H, W), or (T,) for language models),
    class count (a language model's vocabulary) and task, the inputs it takes (``channels`` if
    fixed, H and W at least ``min_side`` and multiples of ``multiple``) and ``options``, the
    keyword size options of its builder with their defaults."""

    build: Callable[..., nn.Module]
    input_shape: Shape
    num_classes: int
    task: str = "classification"
    channels: int | None = None
    min_side: int = 1
    multiple: int = 1
    options: Mapping[str, int] = field(default_factory=dict)

    def fits(self, input_shape: Shape, num_classes: int | None = None) -> str | None:
        """None if the model takes ``input_shape`` inputs (and predicts ``num_classes``), else the reason."""
        return INPUTS[self.task].fits(self, input_shape, num_classes)

    def shape(self, side: int | None = None) -> Shape:
        """The canonical input shape, with ``side`` as H and W (a language model's T) when given."""
        return INPUTS[self.task].shape(self, side)

    def random_batch(self, batch: int, side: int | None = None) -> tuple[Tensor, Tensor]:
        """Random inputs of :meth:`shape` and targets from the global RNG: class labels, {0, 1} float
        masks of ``num_classes`` maps for segmentation, or uniform tokens (inputs and next tokens)."""
        return INPUTS[self.task].random_batch(self, batch, side)


class Inputs:
    """What the models of one task take and predict (a :class:`ModelSpec`'s ``task`` is its key in :data:`INPUTS`,
    as in :data:`hylo_scripts.training.tasks.TASKS`): which input shapes fit, the canonical one, random batches."""

    #: The task's key.
    name: ClassVar[str]

    def fits(self, spec: ModelSpec, input_shape: Shape, num_classes: int | None) -> str | None:
        """None if the task's model ``spec`` takes ``input_shape`` inputs (and predicts ``num_classes``), else why."""
        raise NotImplementedError

    def shape(self, spec: ModelSpec, side: int | None) -> Shape:
        """The model's canonical input shape, with ``side`` as H and W (a sequence's T) when given."""
        raise NotImplementedError

    def random_batch(self, spec: ModelSpec, batch: int, side: int | None) -> tuple[Tensor, Tensor]:
        """Random inputs of :meth:`shape` and targets of the task from the global RNG."""
        raise NotImplementedError


class ImageInputs(Inputs):
    """The image tasks' inputs: (C, H, W) images."""

    #: The fewest classes a model of the task predicts.
    min_classes: ClassVar[int] = 1

    def fits(self, spec: ModelSpec, input_shape: Shape, num_classes: int | None) -> str | None:
        if len(input_shape) != 3 or min(input_shape) < 1:
            return f"the input shape must be (C, H, W) with positive sizes, got {tuple(input_shape)}"
        channels, height, width = input_shape
        if spec.channels is not None and channels != spec.channels:
            return f"it takes {spec.channels}-channel images, got {channels} channels"
        if min(height, width) < spec.min_side:
            return f"it needs H and W of at least {spec.min_side}, got {height}×{width}"
        if height % spec.multiple or width % spec.multiple:
            return f"it needs H and W divisible by {spec.multiple}, got {height}×{width}"
        if num_classes is not None and num_classes < self.min_classes:
            return f"a {self.name} model needs at least {self.min_classes} classes, got {num_classes}"
        return None

    def shape(self, spec: ModelSpec, side: int | None) -> Shape:
        channels, height, width = spec.input_shape
        return (channels, height, width) if side is None else (channels, side, side)


class ClassificationInputs(ImageInputs):
    """Images and class labels."""

    name = "classification"
    min_classes = 2

    def random_batch(self, spec: ModelSpec, batch: int, side: int | None) -> tuple[Tensor, Tensor]:
        channels, height, width = self.shape(spec, side)
        return torch.randn(batch, channels, height, width), torch.randint(0, spec.num_classes, (batch,))


class SegmentationInputs(ImageInputs):
    """Images and {0, 1} float masks of ``num_classes`` maps."""

    name = "segmentation"

    def random_batch(self, spec: ModelSpec, batch: int, side: int | None) -> tuple[Tensor, Tensor]:
        channels, height, width = self.shape(spec, side)
        x = torch.randn(batch, channels, height, width)
        return x, torch.randint(0, 2, (batch, spec.num_classes, height, width)).float()


class TokenInputs(Inputs):
    """A language model's inputs: (T,) token sequences over a vocabulary of ``num_classes``; uniform tokens as
    inputs and next tokens."""

    name = "lm"

    def fits(self, spec: ModelSpec, input_shape: Shape, num_classes: int | None) -> str | None:
        if len(input_shape) != 1 or input_shape[0] < 1:
            return f"the input shape must be (T,) with a positive sequence length T, got {tuple(input_shape)}"
        if num_classes is not None and num_classes < 2:
            return f"a language model needs a vocabulary of at least 2 tokens, got {num_classes}"
        return None

    def shape(self, spec: ModelSpec, side: int | None) -> Shape:
        return spec.input_shape if side is None else (side,)

    def random_batch(self, spec: ModelSpec, batch: int, side: int | None) -> tuple[Tensor, Tensor]:
        (length,) = self.shape(spec, side)
        return torch.randint(0, spec.num_classes, (batch, length)), torch.randint(0, spec.num_classes, (batch, length))


#: Each task's inputs, by the task's key (the keys of :data:`hylo_scripts.training.tasks.TASKS`).
INPUTS: dict[str, Inputs] = {
    inputs.name: inputs for inputs in (ClassificationInputs(), SegmentationInputs(), TokenInputs())
}


def _cifar_resnet(depth: int) -> Callable[[Shape, int], nn.Module]:
    """The builder of the CIFAR ResNet of ``depth``."""
    return lambda input_shape, num_classes: resnet_cifar(depth, num_classes)


#: Every model the scripts can build, by name.
MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec(mnist_cnn, (1, 28, 28), 10, min_side=4),
    "mlp": ModelSpec(mnist_mlp, (1, 28, 28), 10),
    "3c1f": ModelSpec(three_conv_one_fc, (1, 28, 28), 10, min_side=3),
    "resnet20": ModelSpec(_cifar_resnet(20), (3, 32, 32), 10, channels=3, min_side=4),
    "resnet32": ModelSpec(_cifar_resnet(32), (3, 32, 32), 10, channels=3, min_side=4),
    "resnet56": ModelSpec(_cifar_resnet(56), (3, 32, 32), 10, channels=3, min_side=4),
    "densenet": ModelSpec(
        lambda input_shape, num_classes: DenseNetBC(40, 12, 0.5, num_classes), (3, 32, 32), 10, channels=3, min_side=4
    ),
    "resnet50": ModelSpec(
        lambda input_shape, num_classes: resnet50(num_classes, input_shape[0]), (3, 224, 224), 1000, min_side=32
    ),
    "unet": ModelSpec(
        lambda input_shape, num_classes: UNet(input_shape[0], num_classes),
        (3, 256, 256),
        1,
        task="segmentation",
        multiple=16,
    ),
    "transformer": ModelSpec(
        lambda input_shape, num_classes, **options: DecoderLM(num_classes, input_shape[0], **options),
        (128,),
        256,
        task="lm",
        options={"layers": 4, "width": 256, "heads": 4},
    ),
}


def build_model(
    name: str, input_shape: Shape | None = None, num_classes: int | None = None, **options: int
) -> nn.Module:
    """A fresh model ``name`` for ``input_shape`` inputs and ``num_classes`` classes (default: the
    registry's canonical ones) with the size ``options`` it takes (the rest at their defaults),
    initialised from the global RNG."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (expected one of {sorted(MODELS)})")
    spec = MODELS[name]
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ValueError(f"model {name!r} takes no option {', '.join(unknown)} (its options: {sorted(spec.options)})")
    shape = spec.input_shape if input_shape is None else input_shape
    classes = spec.num_classes if num_classes is None else num_classes
    reason = spec.fits(shape, classes)
    if reason is not None:
        raise ValueError(f"model {name!r} does not take {shape} inputs with {classes} classes: {reason}")
    return spec.build(shape, classes, **options)


def model_names(task: str = "classification") -> list[str]:
    """Names of the registered ``task`` models (the image benchmarks' choices: classifiers)."""
    tasks = tuple(INPUTS)
    if task not in tasks:
        raise ValueError(f"task must be one of {tasks}, got {task!r}")
    return [name for name, spec in MODELS.items() if spec.task == task]


def models_for(input_shape: Shape, num_classes: int, task: str = "classification") -> list[str]:
    """Names of the registered ``task`` models that take ``input_shape`` images and predict ``num_classes``."""
    return [name for name in model_names(task) if MODELS[name].fits(input_shape, num_classes) is None]
