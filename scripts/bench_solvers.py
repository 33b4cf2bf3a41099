"""Time per update and per step of each solver on one nn.Linear(d, d) layer (CPU or GPU).

The entry point of :mod:`hylo_scripts.benchmarks.bench_solvers`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_solvers import main

if __name__ == "__main__":
    main()
