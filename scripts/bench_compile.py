"""torch.compile with hylo: graphs per step and time per step, eager against compiled, with and without hylo.

The entry point of :mod:`hylo_scripts.benchmarks.bench_compile`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_compile import main

if __name__ == "__main__":
    main()
