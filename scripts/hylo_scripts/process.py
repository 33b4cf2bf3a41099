"""Processes: the environment of the Python processes the scripts start (torchrun's ranks, benchmark children)."""

from __future__ import annotations

import os
from pathlib import Path

import hylo


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` leading to the hylo and hylo_scripts in use here.

    A child started with ``-m hylo_scripts.…`` then imports the same code as its parent, whether
    the packages are installed (editable or not) or imported from a checkout.
    """
    roots = [str(Path(hylo.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1])]
    path = os.pathsep.join(dict.fromkeys(filter(None, [*roots, os.environ.get("PYTHONPATH")])))
    return dict(os.environ, PYTHONPATH=path, **overrides)
