"""The benchmarks (``bench_*``, each the code of ``scripts/bench_*.py``) and what they share: the device and its
clock (:mod:`~hylo_scripts.benchmarks.devices`, :mod:`~hylo_scripts.benchmarks.timing`), their flags
(:mod:`~hylo_scripts.benchmarks.flags`), the peer optimizers (:mod:`~hylo_scripts.benchmarks.peers`), the
per-sample gradient oracle (:mod:`~hylo_scripts.benchmarks.persample`), the interleaved stepper
(:mod:`~hylo_scripts.benchmarks.bench_interleave`) and the model families' learning-rate grid
(:mod:`~hylo_scripts.benchmarks.model_grid`). Its runs go through :mod:`hylo_scripts.training`."""
