"""Peak memory of a training process: plain SGD against SGD + hylo, each run in its own process.

The entry point of :mod:`hylo_scripts.benchmarks.bench_memory`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_memory import main

if __name__ == "__main__":
    main()
