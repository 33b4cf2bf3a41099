"""hylo_scripts/training/segmentation.py: the Dice loss and the per-volume DSC with largest-component
post-processing, on small constructed masks whose values are counted by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hylo_scripts.training.segmentation import (
    dice_coefficient,
    dice_loss,
    largest_component,
    mean_volume_dsc,
    volume_dsc,
)


def test_dice_coefficient_of_known_masks() -> None:
    pred = np.array([[1, 1, 0], [0, 1, 0]])
    true = np.array([[1, 0, 0], [0, 1, 1]])
    assert dice_coefficient(pred, true) == pytest.approx(2 * 2 / (3 + 3))
    assert dice_coefficient(pred.astype(bool), true.astype(np.float32)) == pytest.approx(2 / 3)
    assert dice_coefficient(pred, pred) == 1.0
    assert dice_coefficient(pred, np.zeros_like(true)) == 0.0
    assert dice_coefficient(np.zeros((2, 3)), np.zeros((2, 3))) == 1.0  # nothing to find, nothing found
    assert dice_coefficient(np.ones((4, 4)), np.eye(4)) == pytest.approx(2 * 4 / (16 + 4))


def test_dice_coefficient_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        dice_coefficient(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="pred must be binary"):
        dice_coefficient(np.full((2, 2), 0.7), np.zeros((2, 2)))


def test_dice_loss_by_hand() -> None:
    """p = sigmoid(0, ln 3, −ln 3, 0) = (1/2, 3/4, 1/4, 1/2), t = (1, 0, 1, 1) pooled over the batch:
    Σpt = 5/4, Σp = 2, Σt = 3, so the Dice is (5/2 + 1) / (5 + 1) = 7/12 (the mean of the two
    per-sample Dice values, 2/3.25 and 2/3, would differ)."""
    logits = torch.tensor([[[[0.0, math.log(3)]]], [[[-math.log(3), 0.0]]]], requires_grad=True)
    mask = torch.tensor([[[[1.0, 0.0]]], [[[1.0, 1.0]]]])
    loss = dice_loss(logits, mask)
    assert loss.item() == pytest.approx(1 - 7 / 12)
    assert dice_loss(logits, mask, smooth=0.0).item() == pytest.approx(1 - 2.5 / 5)
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    # d(loss)/dp_i = −(2 t_i (Σp + Σt + 1) − (2Σpt + 1)) / (Σp + Σt + 1)², times p_i (1 − p_i)
    p = torch.tensor([0.5, 0.75, 0.25, 0.5])
    t = torch.tensor([1.0, 0.0, 1.0, 1.0])
    by_hand = -(2 * t * 6 - 3.5) / 36 * p * (1 - p)
    assert torch.allclose(logits.grad.flatten(), by_hand)
    confident = 20 * (2 * mask - 1)
    assert dice_loss(confident, mask).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="shapes differ"):
        dice_loss(logits, mask[:1])


def blobs() -> np.ndarray:
    """A 4×5×5 volume: a 7-voxel blob spanning slices 0–1, a 4-voxel blob in slice 3, and a voxel
    touching the first blob only along an edge (its own component under face connectivity)."""
    volume = np.zeros((4, 5, 5), dtype=np.uint8)
    volume[0, 0, 0:3] = 1
    volume[1, 0, 0:3] = 1
    volume[1, 1, 0] = 1  # 3 + 3 + 1 = 7 voxels, face-connected across the two slices
    volume[3, 2:4, 2:4] = 1  # 4 voxels
    volume[2, 1, 1] = 1  # shares only an edge with volume[1, 0, 1] and with volume[1, 1, 0]
    return volume


def test_largest_component_keeps_the_biggest_face_connected_blob() -> None:
    kept = largest_component(blobs())
    expected = np.zeros((4, 5, 5), dtype=bool)
    expected[0, 0, 0:3] = expected[1, 0, 0:3] = expected[1, 1, 0] = True
    assert kept.dtype == np.bool_ and np.array_equal(kept, expected) and kept.sum() == 7


def test_largest_component_ties_and_empty() -> None:
    tie = np.zeros((3, 4, 4), dtype=bool)
    tie[2, 3, 1:4] = True  # 3 voxels, later in C order
    tie[0, 0, 0:3] = True  # 3 voxels, first in C order: kept
    kept = largest_component(tie)
    assert kept.sum() == 3 and kept[0, 0, 0:3].all() and not kept[2].any()
    empty = largest_component(np.zeros((2, 3, 3)))
    assert empty.shape == (2, 3, 3) and not empty.any()
    with pytest.raises(ValueError, match="3-D"):
        largest_component(np.ones((3, 3)))


def test_largest_component_post_processing_changes_the_dsc() -> None:
    true = np.zeros((3, 6, 6), dtype=bool)
    true[0:2, 0:2, 0:2] = True  # 8 voxels
    probs = np.where(true, 0.9, 0.1)
    probs[2, 4:6, 5] = 0.8
    probs[1, 5, 5] = 0.7  # a separate 3-voxel false positive
    assert volume_dsc(probs, true, lcc=False) == pytest.approx(2 * 8 / (11 + 8))
    assert volume_dsc(probs, true) == 1.0  # the false positive is removed
    true[2, 4:6, 5] = true[1, 5, 5] = True  # now it is a second true lesion: LCC drops it
    assert volume_dsc(probs, true, lcc=False) == 1.0
    assert volume_dsc(probs, true) == pytest.approx(2 * 8 / (8 + 11))


def test_volume_dsc_thresholds_strictly_and_takes_a_channel_axis() -> None:
    probs = np.array([[[0.5, 0.51], [0.9, 0.2]]])  # one 2×2 slice: 0.5 is background
    true = np.array([[[1, 1], [0, 0]]])
    # 0.51 and 0.9 touch diagonally only: two 1-voxel components, LCC keeps the first in C order
    assert volume_dsc(probs, true) == pytest.approx(2 * 1 / (1 + 2))
    assert volume_dsc(probs, true, lcc=False) == pytest.approx(2 * 1 / (2 + 2))
    assert volume_dsc(probs, true, threshold=0.1, lcc=False) == pytest.approx(2 * 2 / (4 + 2))
    assert volume_dsc(probs[:, None], true[:, None], lcc=False) == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"\(S, H, W\)"):
        volume_dsc(probs[0], true[0])


def test_mean_volume_dsc_rebuilds_each_volume_from_its_indices() -> None:
    """Case a: predictions on slices 0 and 1 (4 voxels, one component when a0, a1 are neighbours)
    and 3 voxels on slice 2; the truth is the first 4. Case b: DSC 1/2. Stored shuffled."""
    a = np.zeros((3, 4, 4))
    a[0, 0, 0:2] = a[1, 0, 0:2] = 0.9
    a[2, 3, 1:4] = 0.9
    a_true = np.zeros((3, 4, 4))
    a_true[0, 0, 0:2] = a_true[1, 0, 0:2] = 1
    b = np.zeros((2, 4, 4))
    b[0, 0, 0:2] = 0.9
    b_true = np.zeros((2, 4, 4))
    b_true[0, 0:2, 1] = 1
    stored = [b[1], a[2], a[0], b[0], a[1]]
    stored_true = [b_true[1], a_true[2], a_true[0], b_true[0], a_true[1]]
    probs, masks = np.stack(stored)[:, None], np.stack(stored_true)[:, None]  # (N, 1, H, W), as the model gives
    volumes = [("a", [2, 4, 1]), ("b", [3, 0])]
    assert mean_volume_dsc(probs, masks, volumes) == pytest.approx((1.0 + 0.5) / 2)
    assert mean_volume_dsc(probs, masks, volumes, lcc=False) == pytest.approx((2 * 4 / (7 + 4) + 0.5) / 2)
    # a0, a2, a1: the two halves of a's true blob are no longer neighbours, LCC keeps the 3 false voxels
    assert mean_volume_dsc(probs, masks, [("a", [2, 1, 4]), ("b", [3, 0])]) == pytest.approx((0.0 + 0.5) / 2)
    assert mean_volume_dsc(torch.from_numpy(probs), torch.from_numpy(masks), volumes) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="volumes is empty"):
        mean_volume_dsc(probs, masks, [])
    with pytest.raises(ValueError, match="'b' has no slices"):
        mean_volume_dsc(probs, masks, [("a", [2, 4, 1]), ("b", [])])
