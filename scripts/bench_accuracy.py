"""Time to accuracy: iterations and seconds to 96% / 97% test accuracy on MNIST, or to AdamW's loss on a language model.

The entry point of :mod:`hylo_scripts.benchmarks.bench_accuracy`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_accuracy import main

if __name__ == "__main__":
    raise SystemExit(main())
