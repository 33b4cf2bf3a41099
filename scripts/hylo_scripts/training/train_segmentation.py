"""Train a U-Net on the LGG brain-MRI segmentation set with an optimizer + hylo (one process or torchrun).

    python scripts/train_segmentation.py --data-dir ~/data/kaggle_3m --solver hybrid --log-dir runs/unet
    torchrun --standalone --nproc_per_node=4 scripts/train_segmentation.py --data-dir ~/data --epochs 50

--data-dir names the kaggle_3m folder (one folder per patient: <case>/<case>_<k>.tif and
<case>_<k>_mask.tif) or its parent. Patients are split 90/10 into training and validation
with --data-seed, so no patient is in both. The training loss is the soft Dice loss of the
sigmoid output; the test metric (test_dsc in metrics.csv) is the mean over validation
patients of the Dice similarity coefficient of each whole volume, after thresholding at 0.5
and keeping the largest 3-D connected component of the prediction (scipy.ndimage).

The flags, outputs, checkpoints and --resume are those of train.py (python scripts/train.py
--help); --batch-size is the global batch.
"""

from __future__ import annotations

from hylo_scripts.training.options import run_script

#: train_segmentation.py's defaults: LGG with the U-Net at HyLo's batch size.
DEFAULTS = {"dataset": "lgg", "model": "unet", "epochs": 50, "batch_size": 16}


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and train (exit status: 0 done, 1 data problem, 2 flag misuse or a log dir that cannot be used)."""
    return run_script(__doc__ or "", argv, task="segmentation", defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(main())
