"""Train a U-Net on the LGG brain-MRI segmentation set with an optimizer + hylo (one process or torchrun).

The entry point of :mod:`hylo_scripts.training.train_segmentation`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.training.train_segmentation import main

if __name__ == "__main__":
    raise SystemExit(main())
