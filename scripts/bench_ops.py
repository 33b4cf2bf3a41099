"""The tensor operations a step dispatches, per solver, beside the model's forward and backward and KAISA's.

The entry point of :mod:`hylo_scripts.benchmarks.bench_ops`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_ops import main

if __name__ == "__main__":
    main()
