"""hylo's training and benchmark scripts and their shared engine.

- :mod:`hylo_scripts.engine`: run configuration, the training loop (one process or DDP), evaluation,
  the log directory, checkpoints and exact resume; :mod:`hylo_scripts.options`: the command-line
  flags; :mod:`hylo_scripts.schedules`: the lr and damping schedules; :mod:`hylo_scripts.checkpoint`:
  checkpoint files.
- :mod:`hylo_scripts.data` (the dataset registry) and :mod:`hylo_scripts.datasets` (the on-disk formats,
  transforms and layout errors).
- :mod:`hylo_scripts.models` (the model registry) and :mod:`hylo_scripts.segmentation` (Dice loss, DSC).

The repository's entry points (``scripts/train.py``, ``train_segmentation.py``, ``train_lm.py``,
``demo_mnist.py``, ``bench_*.py``, ``make_figures.py``) are thin files that run the ``main`` of
the module of the same name here (``python scripts/train.py`` = ``python -m hylo_scripts.train``).
"""
