"""The documentation holds together (docs/contributing.md, "Documentation rules").

1. Links: every relative link and image in ``README.md`` and ``docs/*.md`` names an existing file, and a
   ``#anchor`` in it names a heading of that file under GitHub's slug rules.
2. Citations: code and tests cite the reference as ``docs/<page>.md, "Heading"`` (or several quoted headings,
   the same in parentheses, or an emphasised ``*Heading*``, possibly wrapped over comment or docstring lines);
   every cited page exists and every cited heading is the exact text of a heading of that page, at any level.
3. The README: at most ``README_MAX_LINES`` lines; its first fenced block installs hylo and hylo-scripts and runs
   the demo, its second installs the three distributions and runs the tests, with the same installs as ``.ci/run``.

Fast and offline: it reads files only.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.kit.options_table import USAGE, render

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
CODE_DIRS = ("hylo", "scripts", "analysis", "examples", "tests")
CODE_SUFFIXES = (".py", ".sh")
README_MAX_LINES = 260

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...
_QUOTED_LIST = r"\"[^\"\n]+\"(?:\s*,\s*\"[^\"\n]+\")*"
#: ``docs/<page>.md``, then optionally its headings: ``, "A"``, ``, "A", "B"``, ``("A", "B")`` or ``, *A*``.
CITATION = re.compile(
    rf"docs/(?P<page>[\w.-]+\.md)(?P<headings>,\s*{_QUOTED_LIST}|\s*\(\s*{_QUOTED_LIST}\s*\)?|,\s*\*[^*\n]+\*)?"
)
QUOTED = re.compile(r"\"([^\"]+)\"|\*([^*]+)\*")
COMMENT_MARKER = re.compile(r"^\s*#*:?")


# --- The specification ---------------------------------------------------------------------------------------


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [problem for path in DOC_FILES for link in links(path) if (problem := broken(link))]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_documentation_citation_in_code_resolves() -> None:
    problems = [
        problem for path in citing_files() for citation in citations_in(path) for problem in unresolved(citation)
    ]
    assert not problems, "citations of missing pages or headings:\n" + "\n".join(problems)


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, more than {README_MAX_LINES}"
    blocks = fenced_blocks(text)
    assert len(blocks) >= 2, "README.md: expected the set-up command and the test command as its first fenced blocks"
    install, tests = blocks[0], blocks[1]
    assert "pip install -e . -e ./scripts" in install and "scripts/demo_mnist.py" in install, (
        f"README.md: the first fenced block must install hylo and hylo-scripts and run scripts/demo_mnist.py, got:\n{install}"
    )
    assert "pytest" in tests and "-e ./scripts -e ./analysis" in tests, (
        f"README.md: the second fenced block must install the three distributions and run the tests, got:\n{tests}"
    )
    # .ci/run runs the README's test command one step per line: its installs are the README's, in order.
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    steps = [step.strip() for step in tests.split("&&") if step.strip().startswith("pip install")]
    assert [line for line in ci if line.startswith("pip install")] == steps, f".ci/run must install as {steps}"


def test_every_page_starts_with_a_title() -> None:
    untitled = [
        str(path.relative_to(ROOT))
        for path in DOC_FILES
        if not path.read_text(encoding="utf-8").lstrip().startswith("# ")
    ]
    assert not untitled, f"pages without a '# Title' first line: {untitled}"


# --- The checker's own rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("K-FAC conventions", "k-fac-conventions"),
        ("Attention, token rows and mixed precision", "attention-token-rows-and-mixed-precision"),
        ("Overrides and solver_fn", "overrides-and-solver_fn"),
        ("KAISA's convention", "kaisas-convention"),
        (
            "Time to AdamW's loss (`scripts/bench_accuracy.py --task lm`)",
            "time-to-adamws-loss-scriptsbench_accuracypy---task-lm",
        ),
        ("Größe ≥ 2 × n → m", "größe--2--n--m"),
        ("  Padded heading  ", "padded-heading"),
        ("[Linked](other.md) text", "linked-text"),
    ],
)
def test_slug_follows_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_repeated_headings_get_numbered_anchors(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Notes\n\n```\n# not a heading\n```\n\n## Notes\n", encoding="utf-8")
    assert anchors(page) == {"title", "notes", "notes-1"}
    assert headings(page) == ("Title", "Notes", "Notes")


def test_citations_are_read_in_every_form(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    page = "docs/" + "design.md"  # split so that this file holds no citation of its own
    source.write_text(
        f'"""The memory plan ({page}, "Memory").\n\n'
        f'Rows as in {page}, "SNGD", "KID",\n    "KIS"; see {page} ("Notation", "SNGD").\n"""\n'
        f'# a wrapped one ({page},\n#     "Data path of one step") and a bare {page}.\n'
        f"#: the figures ({page}, *Figures*)\n",
        encoding="utf-8",
    )
    found = [(c.line, c.page, c.headings) for c in citations_in(source)]
    assert found == [
        (1, "design.md", ("Memory",)),
        (3, "design.md", ("SNGD", "KID", "KIS")),
        (4, "design.md", ("Notation", "SNGD")),
        (6, "design.md", ("Data path of one step",)),
        (7, "design.md", ()),
        (8, "design.md", ("Figures",)),
    ]


def test_broken_links_name_the_file_line_and_target(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Known part\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#known-part) [gone](missing.md)\n[bad](other.md#unknown) [self](#page)\n",
        encoding="utf-8",
    )
    problems = [problem for link in links(page) if (problem := broken(link))]
    assert problems == [
        f"{page}:3: (missing.md): no file {tmp_path / 'missing.md'}",
        f"{page}:4: (other.md#unknown): no heading with anchor #unknown in {tmp_path / 'other.md'}",
    ]


def test_links_skip_code_and_external_targets(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [a](missing.md), ![img](fig.png) and [web](https://example.com).\n"
        "`[not](a-link.md)`\n\n```\n[not](either.md)\n```\n",
        encoding="utf-8",
    )
    assert [link.target for link in links(page)] == ["missing.md", "fig.png", "https://example.com"]


def shown(path: Path) -> str:
    """A path as messages name it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --- Markdown, as GitHub renders it -------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline code and link markup dropped, lowercase, every character that is
    not a letter, a digit, a combining mark, ``-``, ``_`` or a space dropped, each space turned into ``-``."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    kept = (ch for ch in text.strip().lower() if ch in "-_ " or unicodedata.category(ch)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The 1-based numbered lines of a Markdown text outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip(fence[0]).strip():
            fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


def fenced_blocks(text: str) -> list[str]:
    """The contents of a Markdown text's fenced code blocks, in order."""
    blocks, fence, body = [], None, []
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence, body = opening.group(1), []
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip(fence[0]).strip():
            blocks.append("\n".join(body))
            fence = None
        elif fence is not None:
            body.append(line)
    return blocks


@cache
def headings(path: Path) -> tuple[str, ...]:
    """The text of every heading of a Markdown file (after its ``#``s), in order."""
    return tuple(
        m.group(2) for _, line in prose_lines(path.read_text(encoding="utf-8")) if (m := ATX_HEADING.match(line))
    )


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file; repeated slugs get ``-1``, ``-2``, … as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


@dataclass(frozen=True)
class Link:
    source: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{shown(self.source)}:{self.line}: ({self.target})"


def links(path: Path) -> list[Link]:
    """The link and image targets of a Markdown file, outside code (fenced blocks and code spans)."""
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            found.append(Link(path, number, definition.group(1)))
            continue
        for match in LINK.finditer(CODE_SPAN.sub("code", line)):
            found.append(Link(path, number, match.group(1)))
    return found


def broken(link: Link) -> str | None:
    """Why a relative link does not resolve, or None when it does (external links are not fetched)."""
    if EXTERNAL.match(link.target):
        return None
    file_part, _, anchor = link.target.partition("#")
    target = (link.source.parent / file_part).resolve() if file_part else link.source
    if not target.exists():
        return f"{link}: no file {shown(target)}"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"{link}: no heading with anchor #{anchor} in {shown(target)}"
    return None


# --- Citations in code ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Citation:
    source: Path
    line: int
    page: str
    headings: tuple[str, ...]
    text: str

    def __str__(self) -> str:
        return f"{shown(self.source)}:{self.line}: {self.text}"


def joined(text: str) -> tuple[str, list[int]]:
    """A source's lines stripped of indentation and comment markers and joined by single spaces, so that a
    citation wrapped over comment or docstring lines reads as one; with each line's offset in the result."""
    parts, starts, offset = [], [], 0
    for line in text.splitlines():
        stripped = COMMENT_MARKER.sub("", line, count=1).strip()
        starts.append(offset)
        parts.append(stripped)
        offset += len(stripped) + 1
    return " ".join(parts), starts


def citations_in(path: Path) -> list[Citation]:
    text, starts = joined(path.read_text(encoding="utf-8"))
    found = []
    for match in CITATION.finditer(text):
        cited = tuple(a or b for a, b in QUOTED.findall(match.group("headings") or ""))
        line = bisect.bisect_right(starts, match.start())
        headings = tuple(" ".join(h.split()) for h in cited)
        found.append(Citation(path, line, match.group("page"), headings, match.group(0)))
    return found


def citing_files() -> list[Path]:
    files = []
    for directory in CODE_DIRS:
        for path in sorted((ROOT / directory).rglob("*")):
            if path.suffix in CODE_SUFFIXES and path.is_file():
                files.append(path)
    return files


def unresolved(citation: Citation) -> list[str]:
    page = ROOT / "docs" / citation.page
    if not page.is_file():
        return [f"{citation}: no file docs/{citation.page}"]
    return [
        f'{citation}: docs/{citation.page} has no heading "{heading}"'
        for heading in citation.headings
        if heading not in headings(page)
    ]


def test_the_options_tables_are_made_from_the_config() -> None:
    """docs/usage.md's option tables are the config's own field docs (``python -m tests.kit.options_table``)."""
    text = USAGE.read_text()
    assert text.count("<!-- options: ") == 8  # the top level and the seven sections
    assert render(text) == text, "docs/usage.md's options tables are stale: run python -m tests.kit.options_table"
