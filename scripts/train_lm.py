"""Train a byte-level transformer language model with an optimizer + hylo, on one process or many (torchrun).

The entry point of :mod:`hylo_scripts.training.train_lm`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.training.train_lm import main

if __name__ == "__main__":
    raise SystemExit(main())
