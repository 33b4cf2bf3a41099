"""hylo's training and benchmark scripts and their shared engine.

- The engine (:mod:`hylo_scripts.engine` gathers its public names): :mod:`~hylo_scripts.runconfig`
  (the run configuration), :mod:`~hylo_scripts.tasks` (classification, segmentation, language
  model as objects), :mod:`~hylo_scripts.loop` (the training loop, one process or DDP),
  :mod:`~hylo_scripts.process` (torchrun's process group, the device), :mod:`~hylo_scripts.rundir`
  (the run directory's files) and :mod:`~hylo_scripts.checkpoint` (checkpoints, exact resume);
  :mod:`~hylo_scripts.schedules`: the lr and damping schedules.
- The flags: :mod:`~hylo_scripts.options` (the trainers'), :mod:`~hylo_scripts.hylo_flags`
  (hylo's, generated from :func:`hylo.config.options`) and :mod:`~hylo_scripts.hylo_options`
  (which hylo options the engine sets, the scripts' defaults).
- :mod:`hylo_scripts.data` (the dataset registry) and :mod:`hylo_scripts.datasets` (the on-disk
  formats, transforms and layout errors); :mod:`hylo_scripts.text` (byte corpora).
- :mod:`hylo_scripts.models` (the model registry) and :mod:`hylo_scripts.segmentation` (Dice loss, DSC).

The repository's entry points (``scripts/train.py``, ``train_segmentation.py``, ``train_lm.py``,
``demo_mnist.py``, ``bench_*.py``, ``make_figures.py``) are thin files that run the ``main`` of
the module of the same name here (``python scripts/train.py`` = ``python -m hylo_scripts.train``).
"""
