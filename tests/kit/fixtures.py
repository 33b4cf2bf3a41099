"""Writers of small datasets in the real on-disk formats, returning what they wrote.

Each writer lays files out as the official downloads do (see :mod:`hylo_scripts.data.datasets` for the
formats) and returns the ``data_dir`` to pass to the loader with the ground truth: the pixels
and labels written (for JPEGs, the pixels Pillow decodes from the written file, since JPEG is
lossy). Arrays are in the loaders' layout: uint8 N×C×H×W images, int64 labels.
"""

from __future__ import annotations

import gzip
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass
class ArraySet:
    """A written classification set: the data_dir and the uint8 N×C×H×W images and int64 labels written."""

    data_dir: Path
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _images(rng: np.random.Generator, n: int, channels: int, height: int, width: int) -> np.ndarray:
    """Random uint8 images N×C×H×W that use the whole 0..255 range."""
    return rng.integers(0, 256, size=(n, channels, height, width), dtype=np.uint8)


def _dump(path: Path, obj: object) -> None:
    """Pickle ``obj`` with protocol 2, as the CIFAR archives were written."""
    with path.open("wb") as f:
        pickle.dump(obj, f, protocol=2)


def _cifar_batch(images: np.ndarray, labels: dict[bytes, list[int]], name: str) -> dict[bytes, object]:
    """A CIFAR batch dict: bytes keys, data uint8 N×3072 (R, G, B planes), labels as lists of ints."""
    return {
        b"batch_label": name.encode(),
        **labels,
        b"data": images.reshape(images.shape[0], -1),
        b"filenames": [f"img_{i}.png".encode() for i in range(images.shape[0])],
    }


def write_cifar10(root: Path, n_train_per_batch: int = 4, n_test: int = 6, seed: int = 0) -> ArraySet:
    """``root/cifar-10-batches-py``: data_batch_1..5 (``n_train_per_batch`` images each), test_batch, batches.meta."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    x_train = _images(rng, 5 * n_train_per_batch, 3, 32, 32)
    y_train = rng.integers(0, 10, size=5 * n_train_per_batch)
    for b in range(5):
        part = slice(b * n_train_per_batch, (b + 1) * n_train_per_batch)
        labels = {b"labels": [int(v) for v in y_train[part]]}
        _dump(folder / f"data_batch_{b + 1}", _cifar_batch(x_train[part], labels, f"training batch {b + 1} of 5"))
    x_test = _images(rng, n_test, 3, 32, 32)
    y_test = rng.integers(0, 10, size=n_test)
    _dump(folder / "test_batch", _cifar_batch(x_test, {b"labels": [int(v) for v in y_test]}, "testing batch 1 of 1"))
    _dump(
        folder / "batches.meta",
        {b"num_cases_per_batch": n_train_per_batch, b"label_names": [f"class{i}".encode() for i in range(10)]},
    )
    return ArraySet(folder, x_train, y_train, x_test, y_test)


def write_cifar100(root: Path, n_train: int = 12, n_test: int = 6, seed: int = 0) -> ArraySet:
    """``root/cifar-100-python`` with ``train``, ``test`` (fine and coarse labels) and ``meta``."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    sets = []
    for name, n in (("train", n_train), ("test", n_test)):
        images = _images(rng, n, 3, 32, 32)
        fine = rng.integers(0, 100, size=n)
        labels = {b"fine_labels": [int(v) for v in fine], b"coarse_labels": [int(v) // 5 for v in fine]}
        _dump(folder / name, _cifar_batch(images, labels, name))
        sets += [images, fine]
    _dump(folder / "meta", {b"fine_label_names": [f"fine{i}".encode() for i in range(100)]})
    return ArraySet(folder, *sets)


def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    """Write a uint8 array as an IDX file (magic 0x0000 08 <ndim>, big-endian sizes), gzip-compressed if ``gz``."""
    header = bytes((0, 0, 0x08, array.ndim)) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def write_fashion_mnist(root: Path, n_train: int = 20, n_test: int = 8, gz: bool = False, seed: int = 0) -> ArraySet:
    """The four Fashion-MNIST IDX files in ``root``, raw or ``.gz``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    x_train, x_test = _images(rng, n_train, 1, 28, 28), _images(rng, n_test, 1, 28, 28)
    y_train, y_test = rng.integers(0, 10, size=n_train), rng.integers(0, 10, size=n_test)
    write_idx(root / "train-images-idx3-ubyte", x_train[:, 0], gz)
    write_idx(root / "train-labels-idx1-ubyte", y_train.astype(np.uint8), gz)
    write_idx(root / "t10k-images-idx3-ubyte", x_test[:, 0], gz)
    write_idx(root / "t10k-labels-idx1-ubyte", y_test.astype(np.uint8), gz)
    return ArraySet(root, x_train, y_train, x_test, y_test)


@dataclass
class ImageFolderSet:
    """A written ImageNet-style set: data_dir, the sorted classes, and (path, label, decoded uint8 3×H×W) per split."""

    data_dir: Path
    classes: list[str]
    train: list[tuple[Path, int, np.ndarray]]
    val: list[tuple[Path, int, np.ndarray]]


#: Extensions the ImageNet writer cycles through (the loader matches them case-insensitively).
IMAGE_EXTENSIONS = (".JPEG", ".jpg", ".png")


def write_imagenet(
    root: Path, classes: Sequence[str], per_class: int = 2, size: int | tuple[int, int] = 32, seed: int = 0
) -> ImageFolderSet:
    """``root/{train,val}/<class>/`` with ``per_class`` RGB images each of ``size`` (side, or (height, width)).

    Files cycle through :data:`IMAGE_EXTENSIONS` (JPEG or PNG by Pillow); every class folder
    also holds a ``notes.txt`` that the loader must skip. Labels index the sorted ``classes``.
    """
    rng = np.random.default_rng(seed)
    height, width = (size, size) if isinstance(size, int) else size
    ordered = sorted(classes)
    splits: dict[str, list[tuple[Path, int, np.ndarray]]] = {"train": [], "val": []}
    for split, written in splits.items():
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            (folder / "notes.txt").write_text("not an image\n")
            for k in range(per_class):
                # smooth content (upsampled noise) so that JPEG keeps it recognisable
                coarse = rng.integers(0, 256, size=(max(1, height // 4), max(1, width // 4), 3), dtype=np.uint8)
                image = Image.fromarray(coarse, "RGB").resize((width, height), Image.Resampling.BILINEAR)
                path = folder / f"{name}_{k}{IMAGE_EXTENSIONS[k % len(IMAGE_EXTENSIONS)]}"
                image.save(path, format="PNG" if path.suffix == ".png" else "JPEG", quality=95)
                with Image.open(path) as saved:
                    decoded = np.asarray(saved.convert("RGB")).transpose(2, 0, 1).copy()
                written.append((path, ordered.index(name), decoded))
        written.sort(key=lambda item: (item[1], str(item[0])))
    return ImageFolderSet(root, ordered, splits["train"], splits["val"])


@dataclass
class LggSet:
    """A written kaggle_3m set: its folder and, per case, the uint8 images n×3×S×S and masks n×1×S×S (0/255)."""

    data_dir: Path
    volumes: dict[str, tuple[np.ndarray, np.ndarray]]


def write_lgg(
    root: Path, cases: int | Sequence[str] = 3, slices: int | Sequence[int] = 3, size: int = 16, seed: int = 0
) -> LggSet:
    """``root/kaggle_3m/<case>/<case>_<k>.tif`` (RGB) and ``<case>_<k>_mask.tif`` (8-bit, 0/255), k = 1..n.

    ``cases``: a count or the names; ``slices``: one count for all cases or one per case. Masks
    hold a random rectangle (some are empty); ``data.csv`` and ``README.md`` sit beside the cases
    as in the Kaggle download.
    """
    rng = np.random.default_rng(seed)
    names = [f"TCGA_X{i}_{1000 + i}_19990101" for i in range(cases)] if isinstance(cases, int) else list(cases)
    counts = [slices] * len(names) if isinstance(slices, int) else list(slices)
    folder = root / "kaggle_3m"
    folder.mkdir(parents=True)
    (folder / "data.csv").write_text("Patient,RNASeqCluster\n")
    (folder / "README.md").write_text("LGG segmentation dataset\n")
    volumes = {}
    for case, n in zip(names, counts, strict=True):
        (folder / case).mkdir()
        images = _images(rng, n, 3, size, size)
        masks = np.zeros((n, 1, size, size), dtype=np.uint8)
        for k in range(n):
            if rng.random() < 0.7:
                top, left = rng.integers(0, size // 2, size=2)
                h, w = rng.integers(1, size // 2 + 1, size=2)
                masks[k, 0, top : top + h, left : left + w] = 255
            Image.fromarray(images[k].transpose(1, 2, 0), "RGB").save(folder / case / f"{case}_{k + 1}.tif")
            Image.fromarray(masks[k, 0], "L").save(folder / case / f"{case}_{k + 1}_mask.tif")
        volumes[case] = (images, masks)
    return LggSet(folder, volumes)
