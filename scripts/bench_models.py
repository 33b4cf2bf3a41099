"""hylo's coverage of each model family and the loss of its optimizer form against plain AdamW.

The entry point of :mod:`hylo_scripts.benchmarks.bench_models`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_models import main

if __name__ == "__main__":
    main()
