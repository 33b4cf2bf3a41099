"""Write a list of same-keyed dicts as a CSV file (the scripts' one CSV writer)."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write ``rows`` (header from the first row's keys) to ``path``, creating parent folders."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
