"""hylo's training and benchmark scripts and their shared engine.

- :mod:`hylo_scripts.engine`: run configuration, the training loop (one process or DDP), evaluation,
  the log directory, checkpoints and exact resume; :mod:`hylo_scripts.options`: the command-line
  flags; :mod:`hylo_scripts.schedules`: the lr and damping schedules; :mod:`hylo_scripts.checkpoint`:
  checkpoint files.
- :mod:`hylo_scripts.data` (the dataset registry) and :mod:`hylo_scripts.datasets` (the on-disk formats,
  transforms and layout errors).
- :mod:`hylo_scripts.models` (the model registry) and :mod:`hylo_scripts.segmentation` (Dice loss, DSC).

Entry points (``train.py``, ``train_segmentation.py``, ``demo_mnist.py``, ``bench_*.py``) run as
files, e.g. ``python scripts/train.py``, and import the package as ``scripts``.
"""
