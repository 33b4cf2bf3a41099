"""Bytes moved per update, per layer and in total: K-FAC against the low-rank path (KID / KIS).

The entry point of :mod:`hylo_scripts.benchmarks.bench_comm`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_comm import main

if __name__ == "__main__":
    main()
