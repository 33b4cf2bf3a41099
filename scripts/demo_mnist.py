"""Offline demo: plain SGD against SGD + hylo on a 5,000-image MNIST subset, at batch size 500.

The entry point of :mod:`hylo_scripts.demos.demo_mnist`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.demos.demo_mnist import main

if __name__ == "__main__":
    raise SystemExit(main())
