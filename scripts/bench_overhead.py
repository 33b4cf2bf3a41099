"""Wall time per training iteration: plain SGD against SGD + hylo, on a paper workload's shapes.

The entry point of :mod:`hylo_scripts.benchmarks.bench_overhead`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_overhead import main

if __name__ == "__main__":
    main()
