"""Segmentation loss and metrics of the LGG brain-MRI U-Net recipe.

- :func:`dice_loss`: the training loss, one minus the soft Dice of the sigmoid probabilities over
  the whole batch (every pixel of every slice pooled, smoothed by ``smooth``).
- :func:`dice_coefficient`: the Dice similarity coefficient (DSC) of two binary masks; two empty
  masks agree perfectly (1.0).
- :func:`largest_component`: keeps the largest 3-D connected component of a binary volume, with
  face connectivity (6 neighbours: ``scipy.ndimage.label``'s default structure), as the recipe's
  post-processing does (medpy's ``largest_connected_component`` with its default structure). Of
  components of equal size the one labelled first (first in C order) is kept.
- :func:`volume_dsc`: the DSC of one patient's volume: its slices stacked, the probabilities
  thresholded (strictly above ``threshold``), optionally reduced to their largest component.
- :func:`mean_volume_dsc`: the mean of :func:`volume_dsc` over volumes given as
  (case name, slice indices) into per-slice arrays, the validation score of the recipe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import scipy.ndimage
import torch
from torch import Tensor


def dice_loss(logits: Tensor, mask: Tensor, smooth: float = 1.0) -> Tensor:
    """``1 − (2 Σ p·t + smooth) / (Σ p + Σ t + smooth)`` with ``p = sigmoid(logits)`` and the sums over
    the whole batch."""
    if logits.shape != mask.shape:
        raise ValueError(f"logits and mask shapes differ: {tuple(logits.shape)} vs {tuple(mask.shape)}")
    probs = torch.sigmoid(logits).flatten()
    target = mask.flatten().to(probs.dtype)
    overlap = (probs * target).sum()
    return 1.0 - (2.0 * overlap + smooth) / (probs.sum() + target.sum() + smooth)


def _binary(name: str, array: npt.ArrayLike) -> np.ndarray:
    """``array`` as a bool array; it must hold only 0 and 1 (or be boolean)."""
    values = np.asarray(array)
    if values.dtype != np.bool_:
        if not np.isin(values, (0, 1)).all():
            raise ValueError(f"{name} must be binary (0/1 or bool)")
        values = values.astype(bool)
    return values


def dice_coefficient(pred: npt.ArrayLike, true: npt.ArrayLike) -> float:
    """``2 |P ∩ T| / (|P| + |T|)`` of two binary masks of one shape; 1.0 when both are empty."""
    p, t = _binary("pred", pred), _binary("true", true)
    if p.shape != t.shape:
        raise ValueError(f"pred and true shapes differ: {p.shape} vs {t.shape}")
    total = int(p.sum()) + int(t.sum())
    if total == 0:
        return 1.0
    return 2.0 * int(np.logical_and(p, t).sum()) / total


def largest_component(volume: npt.ArrayLike) -> np.ndarray:
    """The largest face-connected component of a binary 3-D ``volume`` (bool array); empty stays empty."""
    binary = _binary("volume", volume)
    if binary.ndim != 3:
        raise ValueError(f"volume must be 3-D, got shape {binary.shape}")
    labels, count = scipy.ndimage.label(binary)
    if count == 0:
        return np.zeros_like(binary)
    sizes = np.bincount(labels.ravel())[1:]
    return np.asarray(labels == 1 + int(np.argmax(sizes)))


def _slices(name: str, array: npt.ArrayLike) -> np.ndarray:
    """Stacked slices (S, H, W), from (S, H, W) or (S, 1, H, W) (one channel, as the model outputs)."""
    values = np.asarray(array)
    if values.ndim == 4 and values.shape[1] == 1:
        values = values[:, 0]
    if values.ndim != 3:
        raise ValueError(f"{name} must be slices of shape (S, H, W) or (S, 1, H, W), got {values.shape}")
    return values


def volume_dsc(probs: npt.ArrayLike, masks: npt.ArrayLike, threshold: float = 0.5, lcc: bool = True) -> float:
    """DSC of one volume: ``probs > threshold`` (its largest component if ``lcc``) against the binary
    ``masks``; both given as stacked slices (S, H, W) or (S, 1, H, W)."""
    pred = _slices("probs", probs) > threshold
    if lcc:
        pred = largest_component(pred)
    return dice_coefficient(pred, _slices("masks", masks))


def mean_volume_dsc(
    probs: npt.ArrayLike,
    masks: npt.ArrayLike,
    volumes: Sequence[tuple[str, Sequence[int]]],
    threshold: float = 0.5,
    lcc: bool = True,
) -> float:
    """Mean :func:`volume_dsc` over ``volumes``, each (case name, the indices of its slices in order) into
    the per-slice ``probs`` and ``masks`` (N, H, W) or (N, 1, H, W)."""
    if not volumes:
        raise ValueError("volumes is empty")
    all_probs, all_masks = np.asarray(probs), np.asarray(masks)
    if all_probs.shape != all_masks.shape:
        raise ValueError(f"probs and masks shapes differ: {all_probs.shape} vs {all_masks.shape}")
    scores = []
    for name, indices in volumes:
        if len(indices) == 0:
            raise ValueError(f"volume {name!r} has no slices")
        rows = np.asarray(indices, dtype=np.int64)
        scores.append(volume_dsc(all_probs[rows], all_masks[rows], threshold, lcc))
    return float(np.mean(scores))
