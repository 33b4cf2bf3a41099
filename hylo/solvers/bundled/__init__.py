"""Solver families that ship with hylo and register themselves through the public
:func:`hylo.register_family`, as a user's family does (docs/extending.md, "Solver families").

Importing this package imports each of its modules, which registers its family; nothing else in
hylo names them.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
