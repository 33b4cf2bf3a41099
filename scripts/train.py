"""Train a classifier with an optimizer + hylo, on one process or many (torchrun), CPU (gloo) or GPU (NCCL).

The entry point of :mod:`hylo_scripts.training.train`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.training.train import main

if __name__ == "__main__":
    raise SystemExit(main())
