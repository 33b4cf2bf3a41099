"""hylo's training and benchmark scripts and their shared engine, in five subpackages, lowest first:

- :mod:`hylo_scripts.data`: the dataset registry, the on-disk formats and the byte corpora;
- :mod:`hylo_scripts.models`: the model registry, the MoE models and the model families' tiny models;
- :mod:`hylo_scripts.training`: the engine (the run configuration, the tasks, the loop, processes, the run
  directory, checkpoints, schedules), the trainers' flags and the three trainers;
- :mod:`hylo_scripts.benchmarks`: every benchmark, with their harness (devices, timing, flags), the peers
  and the per-sample gradient oracle;
- :mod:`hylo_scripts.demos`: the offline MNIST demo and the short study that draws every figure.

A subpackage imports only from its own level or a lower one (``data`` and ``models`` below ``training``, below
``benchmarks`` and ``demos``; ``tests/repository/test_architecture.py``, ``SCRIPT_LEVELS``), and nothing here
imports its subpackages, so importing one loads no other it does not need.

The repository's entry points (``scripts/train.py``, ``train_segmentation.py``, ``train_lm.py``,
``demo_mnist.py``, ``bench_*.py``, ``make_figures.py``) are thin files that run the ``main`` of
the module of the same name here (``python scripts/train.py`` = ``python -m hylo_scripts.training.train``).
"""
