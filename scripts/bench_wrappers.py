"""What each wrapper (autocast, GradScaler, checkpointing, compile, DDP, FSDP2) costs with hylo.

The entry point of :mod:`hylo_scripts.benchmarks.bench_wrappers`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_wrappers import main

if __name__ == "__main__":
    main()
