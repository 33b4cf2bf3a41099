"""Per-layer fidelity of every solver against the exact SNGD step built from the true per-sample gradients.

The entry point of :mod:`hylo_scripts.benchmarks.bench_fidelity`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_fidelity import main

if __name__ == "__main__":
    raise SystemExit(main())
