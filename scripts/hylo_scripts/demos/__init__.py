"""The offline demonstrations on the MNIST subset: :mod:`~hylo_scripts.demos.demo_mnist` (plain SGD against SGD +
hylo, the README's main job) and :mod:`~hylo_scripts.demos.make_figures` (a short study whose runs draw every figure
of ``hylo_analysis``). Both run the trainers' engine, :mod:`hylo_scripts.training`."""
