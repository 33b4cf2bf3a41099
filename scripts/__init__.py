"""hylo's training and benchmark scripts and their shared engine.

- :mod:`scripts.engine`: run configuration, learning-rate schedule, the training loop (one
  process or DDP), evaluation, distributed setup and the CSV writer.
- :mod:`scripts.data`: the dataset registry (name -> normalised train/test tensors).
- :mod:`scripts.models`: the model registry (name -> builder, input shape, classes).

Entry points (``demo_mnist.py``, ``train.py``, ``bench_*.py``) run as files, e.g.
``python scripts/train.py``, and import the package as ``scripts``.
"""
