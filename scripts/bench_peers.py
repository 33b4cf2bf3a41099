"""hylo against Muon, SOAP, Shampoo, SINGD, KAISA and a tuned SGD / AdamW baseline, on MNIST and a language model.

The entry point of :mod:`hylo_scripts.benchmarks.bench_peers`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.benchmarks.bench_peers import main

if __name__ == "__main__":
    raise SystemExit(main())
