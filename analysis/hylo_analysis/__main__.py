"""``python -m hylo_analysis``: see :mod:`hylo_analysis.cli`."""

from hylo_analysis.cli import main

raise SystemExit(main())
