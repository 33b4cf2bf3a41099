"""The options tables of docs/usage.md, made from ``hylo.config.options()``: the config is their one source.

``python -m tests.kit.options_table`` rewrites every table between ``<!-- options: SECTION -->`` and
``<!-- /options -->`` in docs/usage.md; ``tests/repository/test_docs.py`` checks that the page equals its rewrite.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from hylo.config import OptionSpec, options

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
_BLOCK = re.compile(r"(<!-- options: (\w+) -->\n)(.*?)(<!-- /options -->)", re.S)


def _value(value: Any) -> str:
    """A default as Python writes it, strings in double quotes."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        inner = ", ".join(_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def row(spec: OptionSpec) -> str:
    """One option's table row: name, default, its doc and whether it may be a schedule or is fixed."""
    marks = [mark for mark, on in (("*callable*", spec.schedule), ("*fixed*", spec.fixed)) if on]
    meaning = (spec.doc + (f"; {', '.join(marks)}" if marks else "")).replace("|", "\\|")
    return f"| `{spec.name}` | `{_value(spec.default)}` | {meaning} |"


def table(section: str) -> str:
    """The table of one section (``top`` for the top-level options)."""
    wanted = None if section == "top" else section
    rows = [row(spec) for spec in options() if spec.section == wanted]
    if not rows:
        raise ValueError(f"no options in section {section!r}")
    return "\n".join(["| option | default | meaning |", "|---|---|---|", *rows, ""])


def render(text: str) -> str:
    """``text`` with every marked table rewritten from the config."""
    return _BLOCK.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(4), text)


if __name__ == "__main__":
    USAGE.write_text(render(USAGE.read_text()))
    sys.exit(0)
