"""Run a short study on the offline MNIST subset and draw every figure of ``analysis`` from it.

The entry point of :mod:`hylo_scripts.demos.make_figures`, which holds the code and the ``--help`` text.
"""

from hylo_scripts.demos.make_figures import main

if __name__ == "__main__":
    raise SystemExit(main())
