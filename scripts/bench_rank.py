"""Adaptive rank against a fixed rank with as many rows: each layer's error to the exact SNGD step.

The entry point of :mod:`hylo_scripts.benchmarks.bench_rank`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_rank import main

if __name__ == "__main__":
    raise SystemExit(main())
