"""hylo on mixture-of-experts models: what it preconditions, what a step costs, and a short race against peers.

The entry point of :mod:`hylo_scripts.benchmarks.bench_moe`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_moe import main

if __name__ == "__main__":
    raise SystemExit(main())
