"""The training engine and the trainers: one run's description (:mod:`~hylo_scripts.training.runconfig`, hylo's
options in it: :mod:`~hylo_scripts.training.hylo_options`), the tasks, the loop (:mod:`~hylo_scripts.training.loop`,
one process or DDP), processes, the run directory, checkpoints, schedules and optimizers
(:mod:`~hylo_scripts.training.engine` gathers their public names); the trainers' flags
(:mod:`~hylo_scripts.training.options`, :mod:`~hylo_scripts.training.hylo_flags`, the argparse types of
:mod:`~hylo_scripts.training.argtypes`) and the trainers themselves (``train``, ``train_lm``,
``train_segmentation``). It builds on :mod:`hylo_scripts.data` and :mod:`hylo_scripts.models`."""
