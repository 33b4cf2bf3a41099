"""hylo's training and benchmark scripts and their shared engine.

- :mod:`scripts.engine`: run configuration, the training loop (one process or DDP), evaluation,
  the log directory, checkpoints and exact resume; :mod:`scripts.options`: the command-line
  flags; :mod:`scripts.schedules`: the lr and damping schedules; :mod:`scripts.checkpoint`:
  checkpoint files.
- :mod:`scripts.data` (the dataset registry) and :mod:`scripts.datasets` (the on-disk formats,
  transforms and layout errors).
- :mod:`scripts.models` (the model registry) and :mod:`scripts.segmentation` (Dice loss, DSC).

Entry points (``train.py``, ``train_segmentation.py``, ``demo_mnist.py``, ``bench_*.py``) run as
files, e.g. ``python scripts/train.py``, and import the package as ``scripts``.
"""
