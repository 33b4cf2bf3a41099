"""Model registry of the training scripts and benchmarks (not used by the library).

``MODELS`` maps a name to a :class:`ModelSpec` (builder, input shape, classes):

- ``cnn``, ``mlp``: small networks for 28×28 digits (the MNIST demo and ``train.py``).
- ``resnet32``: the CIFAR-10 ResNet-32 (``resnet_cifar(depth)`` builds depths 20/32/44/56/110)
  with parameter-free (zero-padding) shortcuts, three stages of 16/32/64 channels.
- ``resnet50``: the ImageNet bottleneck ResNet-50 (stride on the 3×3 conv).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
    """CIFAR ResNet of depth 6k+2."""

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

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
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


def resnet50(num_classes: int = 1000) -> ResNet50:
    """The ImageNet ResNet-50."""
    return ResNet50(num_classes)


def mnist_cnn() -> nn.Sequential:
    """Two 5×5 conv layers (8 and 16 channels, each with 2×2 max-pooling) and two linear layers (64, 10)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def mnist_mlp() -> nn.Sequential:
    """A 784-256-128-10 perceptron with ReLU activations."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its builder, the image shape (C, H, W) it takes and its class count."""

    build: Callable[[], nn.Module]
    input_shape: tuple[int, int, int]
    num_classes: int

    def random_batch(self, batch: int, side: int | None = None) -> tuple[Tensor, Tensor]:
        """Random inputs (``side`` replaces H and W when given) and labels from the global RNG."""
        channels, height, width = self.input_shape
        if side is not None:
            height = width = side
        return torch.randn(batch, channels, height, width), torch.randint(0, self.num_classes, (batch,))


#: Every model the scripts can build, by name.
MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec(mnist_cnn, (1, 28, 28), 10),
    "mlp": ModelSpec(mnist_mlp, (1, 28, 28), 10),
    "resnet32": ModelSpec(lambda: resnet_cifar(32), (3, 32, 32), 10),
    "resnet50": ModelSpec(lambda: resnet50(1000), (3, 224, 224), 1000),
}


def build_model(name: str) -> nn.Module:
    """A fresh model ``name`` of the registry, initialised from the global RNG."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (expected one of {sorted(MODELS)})")
    return MODELS[name].build()


def models_for(input_shape: tuple[int, int, int], num_classes: int) -> list[str]:
    """Names of the registered models that take ``input_shape`` images and predict ``num_classes``."""
    return [
        name for name, spec in MODELS.items() if spec.input_shape == input_shape and spec.num_classes == num_classes
    ]
