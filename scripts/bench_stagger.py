"""The slowest step and the mean with and without staggered updates, in one process, beside the plain optimizer.

The entry point of :mod:`hylo_scripts.benchmarks.bench_stagger`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_stagger import main

if __name__ == "__main__":
    main()
