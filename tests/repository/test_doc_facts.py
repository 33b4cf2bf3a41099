"""The figures the documentation states about the code hold (docs/contributing.md, "Documentation rules").

A figure or a name that README.md or docs/*.md states about the code is read here from the page and compared with
the code it comes from: the value is always the code's (an import, a count, ``hylo.config.options()``), never a
number written into this file.

1. Paths and names: every ``hylo/…``, ``scripts/…``, ``analysis/…``, ``examples/…``, ``tests/…``, ``docs/…`` and
   ``.ci/…`` path exists (a glob matches something); every file name in code (``guard.py``,
   ``pipeline/guard.py``) is a file of the repository; every dotted name ``hylo.…``, ``hylo_scripts.…`` or
   ``hylo_analysis.…`` resolves; every test named (``test_…``, with its parameter ids) is a test of ``tests/``.
2. Option defaults: "`option` (default X)", "`option` (X)" for a literal X, "`option=X` (the default)",
   "default `option=X`", the rows of a table with "option" and "default" columns, and the row marked "(default)"
   of a table headed by an option: X is the option's default in ``hylo.config.options()``.
3. Named constants: "`NAME` = X" and "`NAME` (X)", NAME a module-level constant of hylo, the scripts, the
   analysis package or the tests: X is its value.
4. Stated facts (:data:`FACTS`): a phrase of a page whose figure or names the code determines (a count of
   families, columns or test cases, a limit, a threshold, a model's size) equals what the code gives. Each phrase
   must still be on its page, so a reworded fact fails here until its entry follows.
5. Tables: the device tier's tolerances, the profile files' columns, the optimizer form's defaults, the figures,
   the trainers' learning rates and the cluster launchers' settings.
6. Counts the code determines: the agreement's flags (``hylo.pipeline.guard.agreement_flags``, and what the guard
   sends on 2 ranks), the operation pins of ``tests/library/test_step_cost.py``, the operations of a stack of equal
   layers (counted again as ``scripts/bench_ops.py`` counts them), K-FAC's memory budget.

Every checker is also run on a statement that is wrong (in a test of its own, or beside its real check), so a
checker that stops reading its pages fails instead of passing quietly.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hylo
from hylo.config import options
from tests.repository.test_docs import CODE_SPAN, DOC_FILES, README_MAX_LINES, ROOT, prose_lines

#: Where a repository path may start (``hylo/…``, ``tests/…``); a path anywhere else is a user's (``runs/…``).
PATH_ROOTS = ("hylo", "scripts", "analysis", "examples", "tests", "docs", ".ci")
#: Folders whose files a file name written in code (``guard.py``) may name.
CODE_FOLDERS = ("hylo", "scripts", "analysis", "examples", "tests", ".ci")
#: This file, whose patterns name what the pages say (never a source of the code's names).
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
#: A file name written in code: a source, a shell script or a notebook.
CODE_FILE = re.compile(r"^[\w./-]+\.(?:py|sh|ipynb)$")
#: The packages a dotted name in the docs may start with.
PACKAGES = ("hylo", "hylo_scripts", "hylo_analysis")
#: Where module-level constants are looked up: package folders and the module prefix they import as.
CONSTANT_SOURCES = (
    (ROOT / "hylo", "hylo"),
    (ROOT / "scripts" / "hylo_scripts", "hylo_scripts"),
    (ROOT / "analysis" / "hylo_analysis", "hylo_analysis"),
    (ROOT / "tests", "tests"),
)

# --- Reading a page ------------------------------------------------------------------------------------------


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@cache
def page_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def flat(text: str) -> str:
    """A page's prose (fenced blocks left out) as one line, so that a phrase wrapped over lines reads as one."""
    return " ".join(line.strip() for _, line in prose_lines(text))


def page(name: str) -> Path:
    """``README.md`` or a page of docs/ by file name."""
    path = ROOT / name if name == "README.md" else ROOT / "docs" / name
    assert path in DOC_FILES, f"no page {name}"
    return path


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """The code spans of a Markdown text's prose, with their 1-based line numbers."""
    for number, line in prose_lines(text):
        for match in CODE_SPAN.finditer(line):
            yield number, match.group(2).strip()


def tables(text: str) -> Iterator[list[list[str]]]:
    """The Markdown tables of a text's prose, each a list of rows of cells (the header first, no separator row)."""
    rows: list[list[str]] = []
    for _, line in [*prose_lines(text), (0, "")]:
        if line.lstrip().startswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                rows.append(cells)
        elif rows:
            yield rows
            rows = []


# --- Reading a stated value ----------------------------------------------------------------------------------

SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")
WORDS = {
    word: value
    for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
NUMBER = re.compile(
    r"(?P<mantissa>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    r"(?:\s*[·×]\s*10(?P<exponent>[⁻⁺]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+))?(?P<power>[⁻⁺]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+)?"
)


def number(text: str) -> float | None:
    """The number a page writes: ``2,048``, ``1e-8``, ``0.25``, ``10⁻¹⁸``, ``6.7·10¹⁵³``, ``2²⁰``, ``½``,
    ``5%`` (0.05) or a number word (``eleven``); None when ``text`` is not one number (units after it allowed)."""
    text = text.strip().strip("`").strip()
    if text.lower() in WORDS:
        return float(WORDS[text.lower()])
    if text.startswith("½"):
        return 0.5
    match = NUMBER.match(text)
    if match is None:
        return None
    value = float(match.group("mantissa").replace(",", ""))
    if match.group("exponent"):
        value *= 10.0 ** int(match.group("exponent").translate(SUPERSCRIPTS))
    if match.group("power"):
        value **= int(match.group("power").translate(SUPERSCRIPTS))
    rest = text[match.end() :]
    if rest.startswith("%"):
        return value / 100
    return value if not rest or re.match(r"\s|×|MB\b|KB\b|M\b|B\b|ms\b|s\b", rest) else None


def literal(text: str) -> Any:
    """A literal a page writes for an option's value: a number, ``(a, b)``, a quoted or backticked string,
    ``None``, ``True``/``False``, ``{}``; ``ValueError`` when ``text`` is none of these."""
    text = text.strip().strip("`").strip()
    if text in ("None", "True", "False", "{}", "()"):
        return ast.literal_eval(text)
    if re.fullmatch(r"\(.*\)", text):
        parts = [part for part in (p.strip() for p in text[1:-1].split(", ")) if part]
        values = [literal(part) for part in parts]
        return tuple(values)
    if re.fullmatch(r"\"[^\"]*\"|'[^']*'", text):
        return text[1:-1]
    value = number(text)
    if value is not None:
        return value
    if re.fullmatch(r"[a-z_][a-z0-9_]*", text):
        return text
    raise ValueError(f"not a literal: {text!r}")


def same(stated: Any, value: Any) -> bool:
    """Whether a stated literal is the code's value (numbers by value: ``2048`` is ``2048.0``)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return bool(stated == value)
    if isinstance(value, (int, float)):
        return isinstance(stated, (int, float)) and math.isclose(stated, value, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(value, (tuple, list)):
        return (
            isinstance(stated, tuple)
            and len(stated) == len(value)
            and all(same(s, v) for s, v in zip(stated, value, strict=True))
        )
    return bool(stated == value)


def rounded(value: float, stated: str) -> float:
    """``value`` rounded as ``stated`` writes its number (its significant digits, or its decimals)."""
    mantissa = NUMBER.match(stated.strip().strip("`"))
    digits = mantissa.group("mantissa").replace(",", "") if mantissa else stated
    if mantissa and mantissa.group("exponent"):
        significant = len(digits.replace(".", "").lstrip("0"))
        return float(f"{value:.{significant - 1}e}")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return round(value, decimals)


# --- 1. Paths and names --------------------------------------------------------------------------------------

REPO_PATH = re.compile(rf"(?<![\w/.~$-])(?:{'|'.join(re.escape(r) for r in PATH_ROOTS)})/[\w.*/{{}}<>\[\]-]*")


def repo_paths(text: str) -> Iterator[tuple[int, str]]:
    """Every repository path a Markdown text names (prose, code spans and fenced blocks), with its line."""
    for number, line in enumerate(text.splitlines(), start=1):
        for match in REPO_PATH.finditer(line):
            path = match.group(0).rstrip(".,;:)]")
            if "/" in path.rstrip("/") and not re.search(r"[<>]|\{(?!rank\})", path):
                yield number, path


def path_problem(path: str) -> str | None:
    """Why a path a page names does not exist, or None (``{rank}`` and ``*`` are globs)."""
    pattern = path.rstrip("/").replace("{rank}", "*")
    if "*" in pattern or "[" in pattern:
        return None if any(ROOT.glob(pattern)) else f"{path}: nothing matches"
    return None if (ROOT / pattern).exists() else f"{path}: no such file or folder"


@cache
def repository_files() -> tuple[str, ...]:
    """Every file of the code folders, relative to the root."""
    found = []
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
                found.append(path.relative_to(ROOT).as_posix())
    return tuple(sorted(found))


def file_name_problem(name: str) -> str | None:
    """Why a file name written in code (``guard.py``, ``pipeline/guard.py``) names no file of the repository."""
    name = name.removeprefix("./")
    if (ROOT / name).is_file() or any(f == name or f.endswith("/" + name) for f in repository_files()):
        return None
    return f"{name}: no file of the repository has this name"


DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.\w+)+(?:\(\))?$")


def resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` names a module, or an attribute of one (a dataclass field or annotated attribute too)."""
    parts = dotted.removesuffix("()").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if hasattr(target, attribute):
                target = getattr(target, attribute)
            elif inspect.isclass(target) and any(
                attribute in getattr(k, "__annotations__", {}) for k in target.__mro__
            ):
                return True
            else:
                return False
        return True
    return False


#: A test's name (``test_`` and two words at least, so that a column such as ``test_loss`` is none), its ids.
TEST_NAME = re.compile(r"(?:^|(?<=::))(test_[a-z0-9]+_\w+)(?:\[([^\]]+)\])?$")


@cache
def sources_of_tests() -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
    }


def missing_test(name: str, ids: str | None) -> str | None:
    """Why ``name`` (with parameter ids ``ids``, ``a-b``) is no test of ``tests/``."""
    defining = [text for text in sources_of_tests().values() if re.search(rf"^\s*def {name}\(", text, re.M)]
    if not defining:
        return f"{name}: no test function of that name in tests/"
    if ids:
        missing = [part for part in ids.split("-") if not any(f'"{part}"' in t or f"'{part}'" in t for t in defining)]
        if missing:
            return f"{name}[{ids}]: no parameter {missing} in the module that defines it"
    return None


def name_problems(path: Path, text: str | None = None) -> list[str]:
    """Every path, file name, dotted name and test name of a page that the repository does not hold."""
    text = page_text(path) if text is None else text
    problems = [f"{shown(path)}:{line}: {p}" for line, found in repo_paths(text) if (p := path_problem(found))]
    for line, span in code_spans(text):
        span = span.split("::")[0] if "::" in span and span.split("::")[0].endswith(".py") else span
        if CODE_FILE.match(span) and not span.startswith(PATH_ROOTS):
            if problem := file_name_problem(span):
                problems.append(f"{shown(path)}:{line}: {problem}")
        elif DOTTED.match(span) and not resolves(span):
            problems.append(f"{shown(path)}:{line}: {span}: no such module or attribute")
    for line, span in code_spans(text):
        for match in TEST_NAME.finditer(span):
            if problem := missing_test(match.group(1), match.group(2)):
                problems.append(f"{shown(path)}:{line}: {problem}")
    return problems


@pytest.mark.parametrize("path", DOC_FILES, ids=shown)
def test_every_path_file_name_dotted_name_and_test_name_exists(path: Path) -> None:
    problems = name_problems(path)
    assert not problems, "names the repository does not hold:\n" + "\n".join(problems)


def test_the_names_check_catches_what_is_not_there(tmp_path: Path) -> None:
    text = (
        "# Page\n\nSee `hylo/pipeline/guard.py`, `pipeline/nowhere.py`, hylo/missing.py, `hylo.numerics.nothing`,\n"
        "`hylo.HyLoPreconditioner`, `test_no_such_test` and `test_every_page_starts_with_a_title[x]`.\n"
        "```\npython scripts/bench_nothing.py\n```\n"
    )
    problems = name_problems(tmp_path / "page.md", text)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "hylo/missing.py: no such file or folder",
        "scripts/bench_nothing.py: no such file or folder",
        "pipeline/nowhere.py: no file of the repository has this name",
        "hylo.numerics.nothing: no such module or attribute",
        "test_no_such_test: no test function of that name in tests/",
        "test_every_page_starts_with_a_title[x]: no parameter ['x'] in the module that defines it",
    ], problems


# --- 2. Option defaults --------------------------------------------------------------------------------------


@cache
def defaults() -> dict[str, Any]:
    """Every option's default, and the other keyword defaults a page states as a table header (``options``)."""
    found = {spec.name: spec.default for spec in options()}
    load = inspect.signature(hylo.HyLoPreconditioner.load_state_dict).parameters
    return {**found, "options": load["options"].default}


_NAME = r"`(?P<name>[a-z_][a-z0-9_]*)`"
_ASSIGNED = r"`(?P<name>[a-z_][a-z0-9_]*)=(?P<value>[^`]+)`"
DEFAULT_PHRASES = (
    re.compile(rf"{_NAME}\s*,?\s*\(?\s*default:?\s+(?P<value>`[^`]+`|[^\s),;]+)"),
    re.compile(rf"{_NAME}\s*\((?P<value>[\d.,·⁰¹²³⁴⁵⁶⁷⁸⁹⁻½e+\- ]+|\([^()]*\))(?:\s*MB)?\)"),
    re.compile(rf"{_ASSIGNED}\s*\((?:the\s+)?default\s*[),]"),
    re.compile(rf"\bdefault\s*\(?\s*{_ASSIGNED}"),
)


def stated_defaults(text: str) -> Iterator[tuple[str, str]]:
    """(option, stated value) for every default a page's prose states in one of :data:`DEFAULT_PHRASES` or in a
    table (an "option"/"default" table, or a table headed by an option whose row says "(default)")."""
    prose = flat(text)
    for phrase in DEFAULT_PHRASES:
        for match in phrase.finditer(prose):
            if match.group("name") in defaults():
                yield match.group("name"), match.group("value")
    for rows in tables(text):
        header = [cell.lower() for cell in rows[0]]
        if "option" in header and "default" in header:
            at = header.index("default")
            for row in rows[1:]:
                for name in re.findall(r"`(\w+)`", row[header.index("option")]):
                    yield name, row[at]
        elif (head := re.fullmatch(r"`(\w+)`", rows[0][0])) and head.group(1) in defaults():
            for row in rows[1:]:
                if re.search(r"\(default\b", row[0]):
                    yield head.group(1), row[0].split("(default")[0]


def default_problems(path: Path, text: str | None = None) -> list[str]:
    text = page_text(path) if text is None else text
    problems = []
    for name, stated in stated_defaults(text):
        try:
            value = literal(stated)
        except ValueError:
            if stated.strip().startswith(("`", '"')) or number(stated) is not None:
                problems.append(f"{shown(path)}: `{name}` (default {stated}): cannot read the value")
            continue
        if not same(value, defaults()[name]):
            problems.append(
                f"{shown(path)}: `{name}`'s default is stated as {stated}, the config's is {defaults()[name]!r}"
            )
    return problems


@pytest.mark.parametrize("path", DOC_FILES, ids=shown)
def test_every_stated_option_default_is_the_configs(path: Path) -> None:
    problems = default_problems(path)
    assert not problems, "\n".join(problems)


def test_the_defaults_check_reads_every_form_and_catches_a_wrong_one(tmp_path: Path) -> None:
    right = (
        "`max_unfold_mb` (default 32), `kfac_max_state_mb` (2,048 MB), `adam_betas` (0.9, 0.999), `adam_exponent`\n"
        '(½), `strategy="inverse"` (default), the default (`kis_estimator="unbiased"`), `critical_variant` (default\n'
        "`kid`), hylo's default `damping=1.0`.\n\n| option | default |\n|---|---|\n| `kl_clip`, `lr` | `None` |\n\n"
        '| `conv_rows` | what |\n|---|---|\n| `"mean"` | a |\n| `"sum"` (default) | b |\n'
    )
    assert sorted(name for name, _ in stated_defaults(right)) == sorted(
        [
            "max_unfold_mb",
            "kfac_max_state_mb",
            "adam_betas",
            "adam_exponent",
            "strategy",
            "kis_estimator",
            "critical_variant",
            "damping",
            "kl_clip",
            "lr",
            "conv_rows",
        ]
    )
    assert default_problems(tmp_path / "page.md", right) == []
    wrong = right.replace("(default 32)", "(default 64)").replace('"sum"` (default)', '"mean"` (default)')
    assert len(default_problems(tmp_path / "page.md", wrong)) == 2


# --- 3. Named constants --------------------------------------------------------------------------------------


@cache
def constant_modules() -> dict[str, list[str]]:
    """Each module-level UPPER_CASE name of the code → the modules that assign it."""
    found: dict[str, list[str]] = {}
    for folder, package in CONSTANT_SOURCES:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            parts = path.relative_to(folder).with_suffix("").parts
            module = ".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))
            for node in tree.body:
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign)
                    else []
                )
                for target in targets:
                    if isinstance(target, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]+", target.id):
                        found.setdefault(target.id, []).append(module)
    return found


def constant(name: str, prefix: str = "") -> Any:
    """The value of the constant ``name`` (of a module ending with ``prefix`` when given); ``LookupError`` if the
    code has none, or several of different values."""
    modules = [m for m in constant_modules().get(name, []) if not prefix or m.endswith("." + prefix.rstrip("."))]
    values = [getattr(importlib.import_module(module), name) for module in modules]
    if not values or any(v is not values[0] and v != values[0] for v in values):
        raise LookupError(f"{prefix}{name}: {'no such constant' if not values else f'defined in {modules}'}")
    return values[0]


NAMED_CONSTANT = re.compile(
    r"`(?P<prefix>(?:[a-z_]\w*\.)*)(?P<name>[A-Z][A-Z0-9_]+)`\s*(?:=|\()\s*"
    r"(?P<value>\([^()]*\)|[\d½][\d.,·×⁰¹²³⁴⁵⁶⁷⁸⁹⁻e+\-]*)"
)


def constant_problems(path: Path, text: str | None = None) -> list[str]:
    text = page_text(path) if text is None else text
    problems = []
    for match in NAMED_CONSTANT.finditer(flat(text)):
        name, stated = match.group("prefix") + match.group("name"), match.group("value").rstrip(",.")
        try:
            value = constant(match.group("name"), match.group("prefix"))
        except LookupError as err:
            problems.append(f"{shown(path)}: {err}")
            continue
        parsed = literal(stated) if stated.startswith("(") else number(stated)
        if not same(parsed, tuple(value) if isinstance(value, (tuple, list)) else value):
            problems.append(f"{shown(path)}: `{name}` is stated as {stated}, the code's is {value!r}")
    return problems


@pytest.mark.parametrize("path", DOC_FILES, ids=shown)
def test_every_named_constant_has_its_stated_value(path: Path) -> None:
    problems = constant_problems(path)
    assert not problems, "\n".join(problems)


def test_the_constants_check_catches_a_wrong_value_and_a_missing_name(tmp_path: Path) -> None:
    right = "`LOOKAHEAD` = 16 and `numerics.STACK_CAP_MB` (64) and `NORM_CLAMP` = (10⁻¹⁸, 10⁸); `POWER_COST` = 2.5 d³"
    assert constant_problems(tmp_path / "page.md", right) == []
    wrong = "`LOOKAHEAD` = 8, `numerics.STACK_CAP_MB` (32), `NO_SUCH_CONSTANT` = 1, `NORM_CLAMP` = (10⁻¹⁸, 10⁹)"
    assert len(constant_problems(tmp_path / "page.md", wrong)) == 4


def test_every_upper_case_name_in_code_is_in_the_repository(tmp_path: Path) -> None:
    """A constant, table or variable named in code (`STACK_CAP_MB`, `TOLERANCES`, `NPROC`) is one of the code's:
    a renamed constant leaves no stale name behind."""
    problems = [problem for path in DOC_FILES for problem in upper_name_problems(path)]
    assert not problems, "\n".join(problems)
    missing = "NO_SUCH_" + "NAME_ANYWHERE"  # written in two parts so that this file does not hold it either
    assert upper_name_problems(tmp_path / "page.md", f"`STACK_CAP_MB`, `{missing}`") == [
        f"{tmp_path / 'page.md'}: `{missing}` is not a name of the code"
    ]


@cache
def code_words() -> frozenset[str]:
    """Every UPPER_CASE word of the code folders' sources (constants, shell and environment variables)."""
    words: set[str] = set()
    for name in repository_files():
        if (name.endswith((".py", ".sh")) or name.startswith(".ci/")) and name != THIS:
            words.update(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", (ROOT / name).read_text(encoding="utf-8")))
    # this file's own constants (FACTS), not the words of its patterns
    own = ast.parse((ROOT / THIS).read_text(encoding="utf-8")).body
    targets = [t for n in own if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in own if isinstance(n, ast.AnnAssign)]
    return frozenset(words | {t.id for t in targets if isinstance(t, ast.Name)})


def upper_name_problems(path: Path, text: str | None = None) -> list[str]:
    text = page_text(path) if text is None else text
    names = {m.group(1) for _, span in code_spans(text) if (m := re.fullmatch(r"(?:\w+\.)*([A-Z][A-Z0-9_]{2,})", span))}
    return [f"{shown(path)}: `{name}` is not a name of the code" for name in sorted(names - code_words())]


# --- 4. Stated facts -----------------------------------------------------------------------------------------


def function_node(relpath: str, function: str) -> ast.FunctionDef:
    """The ``def function`` of a source file (at any depth)."""
    tree = ast.parse((ROOT / relpath).read_text(encoding="utf-8"))
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    assert len(found) == 1, f"{relpath}: {len(found)} functions named {function}"
    return found[0]


def examples(relpath: str, function: str) -> int:
    """The ``max_examples`` of a hypothesis test's ``@settings``."""
    for decorator in function_node(relpath, function).decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "settings":
            for keyword in decorator.keywords:
                if keyword.arg == "max_examples":
                    return int(ast.literal_eval(keyword.value))
    raise AssertionError(f"{relpath}::{function} has no @settings(max_examples=...)")


def slow_examples(*relpaths: str) -> tuple[int, ...]:
    """The ``max_examples`` of every hypothesis test marked ``slow`` in the given files."""
    found = []
    for relpath in relpaths:
        for node in ast.walk(ast.parse((ROOT / relpath).read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any("slow" in ast.unparse(d) for d in node.decorator_list):
                found.append(examples(relpath, node.name))
    return tuple(found)


def range_bound(relpath: str, function: str) -> int:
    """The bound of the one ``range(N)`` loop of a function (the cases a test runs)."""
    bounds = [
        int(ast.literal_eval(node.args[0]))
        for node in ast.walk(function_node(relpath, function))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "range" and len(node.args) == 1
    ]
    assert len(bounds) == 1, f"{relpath}::{function}: range bounds {bounds}"
    return bounds[0]


def compared(relpath: str, function: str, callee: str | None = None) -> int:
    """The one integer a function compares with (with a call of ``callee`` when given): a test's bound."""
    found = []
    for node in ast.walk(function_node(relpath, function)):
        if isinstance(node, ast.Compare):
            left = node.left
            if callee is None or (isinstance(left, ast.Call) and getattr(left.func, "id", None) == callee):
                found += [c.value for c in node.comparators if isinstance(c, ast.Constant) and type(c.value) is int]
    assert len(found) == 1, f"{relpath}::{function}: compared with {found}"
    return found[0]


def parameters(relpath: str, function: str, argname: str) -> int:
    """How many values ``@pytest.mark.parametrize(argname, [...])`` gives a test."""
    for decorator in function_node(relpath, function).decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("parametrize"):
            if ast.literal_eval(decorator.args[0]) == argname:
                return len(ast.literal_eval(decorator.args[1]))
    raise AssertionError(f"{relpath}::{function} has no parametrize({argname!r}, ...)")


def module(name: str) -> Any:
    return importlib.import_module(name)


@cache
def built(model: str) -> nn.Module:
    """A model of the training scripts at its defaults (seeded: the same weights every time)."""
    torch.manual_seed(0)
    return module("hylo_scripts.models.registry").build_model(model)


def parameter_count(model: str) -> float:
    return float(sum(p.numel() for p in built(model).parameters()))


def registered(model: str, kind: type[nn.Module] | None = None) -> int:
    """How many layers hylo registers in a training script's model (of ``kind`` when given)."""
    net = built(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = hylo.HyLoPreconditioner(net)
    try:
        modules = dict(net.named_modules())
        return sum(1 for info in pre.layer_info() if kind is None or isinstance(modules.get(info.name), kind))
    finally:
        pre.remove()


def bundled_families() -> int:
    """The solver families hylo itself registers (a test's own registrations left out)."""
    return sum(1 for family in hylo.solvers.FAMILIES if type(family).__module__.startswith("hylo."))


def notebooks() -> int:
    return len(list((ROOT / "analysis" / "notebooks").glob("*.ipynb")))


def form_defaults(optimizer: type[torch.optim.Optimizer], **given: Any) -> dict[str, Any]:
    """The options the optimizer form gives hylo under ``optimizer`` (``hylo.optimizer.default_options``)."""
    return dict(module("hylo.optimizer").default_options(optimizer([nn.Parameter(torch.zeros(1))], lr=0.1), given))


def option_default(name: str) -> Any:
    return defaults()[name]


def line_length() -> int:
    """ruff's line length (``[tool.ruff]`` of pyproject.toml; read by hand: tomllib is Python 3.11's)."""
    ruff = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[tool.ruff]", 1)[1].split("\n[", 1)[0]
    found = re.search(r"^line-length\s*=\s*(\d+)", ruff, re.M)
    assert found, "pyproject.toml: no line-length under [tool.ruff]"
    return int(found.group(1))


def example_steps() -> int:
    """The default ``steps`` of ``examples/extend_hylo.py``'s ``train`` (read, not imported: it registers types)."""
    arguments = function_node("examples/extend_hylo.py", "train").args
    named = dict(zip([a.arg for a in arguments.args][-len(arguments.defaults) :], arguments.defaults, strict=True))
    return int(ast.literal_eval(named["steps"]))


@dataclass(frozen=True)
class Fact:
    """A figure or list of names a page states about the code: ``pattern`` (a regex on the page's prose, which must
    still match) captures what the page says, one group per value; ``value`` gives the code's (a tuple for several
    groups). Names compare as the backticked names of their group, in order (as a set for a ``frozenset``);
    ``approx``: the page rounds, so the code's number is rounded as the page writes it."""

    page: str
    pattern: str
    value: Callable[[], Any]
    approx: bool = False

    def __str__(self) -> str:
        return f"{self.page}: /{self.pattern}/"


def stated_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip("\"'") for name in re.findall(r"`([^`]+)`", text))


def agrees(stated: str, value: Any, approx: bool = False) -> bool:
    if isinstance(value, frozenset):
        return frozenset(stated_names(stated)) == value
    if isinstance(value, (tuple, list)):
        return stated_names(stated) == tuple(value)
    if isinstance(value, str):
        return stated.strip().strip("`").strip("\"'") == value
    if value is None or isinstance(value, bool):
        try:
            return same(literal(stated), value)
        except ValueError:
            return False
    parsed = number(stated)
    if parsed is None:
        return False
    return parsed == rounded(float(value), stated) if approx else same(parsed, value)


def fact_problems(fact: Fact, text: str) -> list[str]:
    matches = list(re.finditer(fact.pattern, flat(text)))
    if not matches:
        return [f"{fact}: the page no longer says this (reworded? then update FACTS)"]
    value = fact.value()
    problems = []
    for match in matches:
        values = value if len(match.groups()) > 1 else (value,)
        assert len(values) == len(match.groups()), f"{fact}: {len(match.groups())} groups, {len(values)} values"
        for stated, expected in zip(match.groups(), values, strict=True):
            if not agrees(stated, expected, fact.approx):
                problems.append(f"{fact}: states {stated!r}, the code gives {expected!r}")
    return problems


def _m(relpath: str) -> str:
    """A test file's module name."""
    return relpath.removesuffix(".py").replace("/", ".")


FUZZ, FUZZ_STATE, FUZZ_RESUME = (
    "tests/library/test_fuzz.py",
    "tests/library/test_fuzz_state.py",
    "tests/library/test_fuzz_resume.py",
)
INTEGRITY, RESUME = "tests/library/test_checkpoint_integrity.py", "tests/application/test_resume.py"
ARCHITECTURE, TREND = "tests/repository/test_architecture.py", "tests/library/test_trend.py"
FAMILIES_MODULE = "hylo_scripts.models.model_families"
_flips = "test_stationary_noise_flips_at_most_three_times_per_300_updates"
_flipped_bit = "test_flipped_bit_in_a_saved_file_is_refused_naming_it"
_resume_flip = "test_a_flipped_bit_anywhere_in_a_checkpoint_file_is_never_loaded"


def _slow_fuzz() -> tuple[int, int]:
    """How many properties the slow fuzz runs, and its examples of each (the same for all)."""
    found = slow_examples(FUZZ, FUZZ_STATE)
    assert len(set(found)) == 1, found
    return len(found), found[0]


def _c(module_name: str, name: str) -> Callable[[], Any]:
    return lambda: getattr(module(module_name), name)


FACTS: tuple[Fact, ...] = (
    # README.md
    Fact(
        "README.md", r"where that costs at most (\S+) of an average layer's", lambda: option_default("fidelity_budget")
    ),
    Fact(
        "README.md", r"\(SGD: damping (\S+) and `kl_clip` at its lr", lambda: form_defaults(torch.optim.SGD)["damping"]
    ),
    Fact("README.md", r"AdamW: `(\w+)`, Adam in K-FAC's", lambda: form_defaults(torch.optim.AdamW)["solver"]),
    Fact(
        "README.md",
        r"\| `solver` \| `\"hybrid\"` \| ((?:`\"\w+\"`(?:, | or ))+`\"\w+\"`) \(per layer",
        lambda: (*hylo.solvers.solver_names(), hylo.solvers.HYBRID),
    ),
    Fact(
        "README.md",
        r"the LGG U-Net: all (\d+) layers, its (\d+) up-convolutions",
        lambda: (registered("unet"), registered("unet", nn.ConvTranspose2d)),
    ),
    Fact("README.md", r"\((\d+) patterns\)", lambda: len(module("tests.library.test_registration").TIES)),
    Fact(
        "README.md",
        r"the tests flip (\d+) positions of a hylo file, (\d+) of each trainer file",
        lambda: (range_bound(INTEGRITY, _flipped_bit), range_bound(RESUME, _resume_flip)),
    ),
    Fact("README.md", r"fuzzes (\w+) properties, ([\d,]+) cases each", _slow_fuzz),
    Fact("README.md", r"— ([\d,]+) cases, 0 failures", lambda: math.prod(_slow_fuzz())),
    # contributing.md
    Fact(
        "contributing.md",
        r"on Linear and (\w+) Conv2d configurations; the KFC scale L\^e at (\w+) exponents",
        lambda: (
            len(module("tests.kit.reference").CONV_CASES),
            parameters(
                "tests/library/test_kfac.py", "test_conv2d_kfc_exponent_scales_the_fisher_by_positions", "exponent"
            ),
        ),
    ),
    Fact(
        "contributing.md",
        r"at most (\d+) flips per (\d+) updates on a noisy stationary norm",
        lambda: (compared(TREND, _flips, "flips"), compared(TREND, _flips, "len")),
    ),
    Fact(
        "contributing.md",
        r"for (\w+) Conv2d geometries .{0,120} and Linear, over (\w+) backward passes",
        lambda: (
            len(module("tests.library.test_memory").CONVS),
            len(module("tests.library.test_memory").MICRO_BATCHES),
        ),
    ),
    Fact(
        "contributing.md",
        r"`nn.Conv1d` on (\w+) geometries",
        lambda: len(module("tests.library.test_conv_transpose").GEOMETRIES),
    ),
    Fact("contributing.md", r"finite gradients never skipped \((\d+) examples\)", lambda: examples(FUZZ, "test_fuzz")),
    Fact(
        "contributing.md",
        r"the raw gradient with a warning \((\d+)\)",
        lambda: examples(FUZZ, "test_fuzz_duplicated_rows_descend"),
    ),
    Fact(
        "contributing.md",
        r"= the step that never failed \((\d+)\); ([\d,]+) each with `-m slow`",
        lambda: (examples(FUZZ, "test_fuzz_retry_without_backward"), _slow_fuzz()[1]),
    ),
    Fact(
        "contributing.md",
        r"continue (\d+) steps bit-equal \((\d+) examples per configuration; (\d+) with `-m slow`\)",
        lambda: (
            module(_m(FUZZ_RESUME)).STEPS,
            examples(FUZZ_RESUME, "test_resume"),
            examples(FUZZ_RESUME, "test_resume_many"),
        ),
    ),
    Fact(
        "contributing.md",
        r"finite in ⇒ finite out \((\d+) examples; ([\d,]+) with `-m slow`\)",
        lambda: (examples(FUZZ_STATE, "test_corrupted_state"), examples(FUZZ_STATE, "test_corrupted_state_many")),
    ),
    Fact(
        "contributing.md",
        r"a flipped bit at (\d+) positions of a saved file",
        lambda: range_bound(INTEGRITY, _flipped_bit),
    ),
    Fact(
        "contributing.md",
        r"\| (\w+) `transformers` families built from config",
        lambda: len(module(FAMILIES_MODULE).FAMILIES),
    ),
    Fact("contributing.md", r"the (\w+) notebooks executed with nbclient", notebooks),
    Fact(
        "contributing.md",
        r"no module over (\d+) lines, the preconditioner class under (\d+)",
        lambda: (
            compared(ARCHITECTURE, "test_no_module_is_over_500_lines"),
            compared(ARCHITECTURE, "test_the_preconditioner_class_is_under_400_lines"),
        ),
    ),
    Fact("contributing.md", r"\(line length (\d+)\)", line_length),
    Fact("contributing.md", r"the README has at most (\d+) lines", lambda: README_MAX_LINES),
    # design.md
    Fact("design.md", r"There are (\w+) families\.", bundled_families),
    Fact(
        "design.md",
        r"no module is over (\d+) lines",
        lambda: compared(ARCHITECTURE, "test_no_module_is_over_500_lines"),
    ),
    # hybrid-policy.md
    Fact(
        "hybrid-policy.md",
        r"`kfac`: n_k\(d_a² \+ d_g²\) \+ (\d+)\(d_a³ \+ d_g³\)",
        _c("hylo.solvers.kfac", "EIGH_COST"),
    ),
    Fact(
        "hybrid-policy.md",
        r"plus f·(\d+) d_a d_g for the moments",
        _c("hylo.solvers.bundled.kfac_adam", "ELEMENTWISE_COST"),
    ),
    Fact(
        "hybrid-policy.md",
        r"its \d+\(d_a³ \+ d_g³\) becomes ([\d.]+)\(d_a³ \+ d_g³\)",
        _c("hylo.numerics", "POWER_COST"),
    ),
    Fact("hybrid-policy.md", r"C = √\(float64 max\)/2 ≈ (\S+),", _c("hylo.trend", "NORM_CAP"), approx=True),
    Fact(
        "hybrid-policy.md", r"`pre.decision_log` \(the last ([\d,]+)\)", _c("hylo.preconditioner", "DECISION_LOG_SIZE")
    ),
    Fact("hybrid-policy.md", r"so with z = (\d+) a window", lambda: option_default("critical_noise")),
    Fact("hybrid-policy.md", r"the default window of (\d+) catches", lambda: option_default("trend_window")),
    Fact(
        "hybrid-policy.md",
        r"at most (\d+) flips per (\d+) updates on a noisy",
        lambda: (compared(TREND, _flips, "flips"), compared(TREND, _flips, "len")),
    ),
    # models.md
    Fact("models.md", r"tiny models of (\w+) `transformers` families", lambda: len(module(FAMILIES_MODULE).FAMILIES)),
    Fact(
        "models.md",
        r"Every tiny transformer is (\d+) wide, with (\d+) heads and (\d+) blocks",
        lambda: tuple(getattr(module(FAMILIES_MODULE), n) for n in ("WIDTH", "HEADS", "LAYERS")),
    ),
    Fact(
        "models.md",
        r"on batches of (\d+) × (\d+) tokens",
        lambda: (module(FAMILIES_MODULE).BATCH, module(FAMILIES_MODULE).SEQ),
    ),
    Fact(
        "models.md",
        r"\(GPT-2 (\d+) tokens, Qwen2 (\d+), T5 (\d+), BART (\d+), Whisper ([\d,]+), OPT (\d+), Mamba (\d+)\)",
        lambda: tuple(
            getattr(module(FAMILIES_MODULE), f"{n}_VOCAB")
            for n in ("GPT2", "QWEN2", "T5", "BART", "WHISPER", "OPT", "MAMBA")
        ),
    ),
    Fact("models.md", r"their vocabulary \((\d+)\)", _c(FAMILIES_MODULE, "LLAMA_VOCAB")),
    Fact("models.md", r"Mamba is (\d+) wide", _c(FAMILIES_MODULE, "MAMBA_WIDTH")),
    Fact(
        "models.md",
        r"ViT takes (\d+) × \d+ images in (\d+) × \d+ patches",
        lambda: (module(FAMILIES_MODULE).IMAGE, module(FAMILIES_MODULE).PATCH),
    ),
    Fact("models.md", r"LoRA is rank (\d+) on every projection", _c(FAMILIES_MODULE, "LORA_RANK")),
    Fact(
        "models.md",
        r"exactly its (\d+) adapter `nn.Linear`s \(A and B of (\d+) projections in (\d+) blocks\)",
        lambda: (
            2 * len(module(FAMILIES_MODULE).LORA_TARGETS) * module(FAMILIES_MODULE).LAYERS,
            len(module(FAMILIES_MODULE).LORA_TARGETS),
            module(FAMILIES_MODULE).LAYERS,
        ),
    ),
    Fact("models.md", r"the mean loss of (\d+) held-out batches", lambda: len(module(FAMILIES_MODULE).HELD_OUT)),
    Fact(
        "models.md",
        r"at its defaults \(`(\w+)`, `update_freq=(\d+)`, `basis_refresh=\"(\w+)\"`, `damping=([\d.]+)`\)",
        lambda: tuple(
            form_defaults(torch.optim.AdamW)[k] for k in ("solver", "update_freq", "basis_refresh", "damping")
        ),
    ),
    # moe.md
    Fact(
        "moe.md",
        r"at its defaults \(`(\w+)`, `update_freq` (\d+)\)",
        lambda: tuple(form_defaults(torch.optim.AdamW)[k] for k in ("solver", "update_freq")),
    ),
    Fact("moe.md", r"1/\((10⁻²⁴) \+ ‖∇W‖·m\)", _c("hylo.numerics", "UNBOUNDED_FLOOR")),
    # profiling.md
    Fact("profiling.md", r"study_ms`, the (\w+) phase columns", lambda: len(module("hylo.telemetry.profiling").PHASES)),
    Fact("profiling.md", r"per solver beyond the (\w+) built-in ones", lambda: len(hylo.solvers.LAYER_SOLVERS)),
    Fact(
        "profiling.md",
        r"the numerical rank at ([\d./]+)% of their sum",
        lambda: "/".join(f"{100 * level:g}" for level in module("hylo.telemetry.studies").RANK_LEVELS),
    ),
    # reliability.md
    Fact(
        "reliability.md",
        r"its format version \(`\"format\"`, currently (\d+)\)",
        _c("hylo.pipeline.checkpoint", "STATE_FORMAT"),
    ),
    Fact(
        "reliability.md",
        r"this hylo reads formats (\d+) to (\d+)",
        lambda: (
            min(module("hylo.pipeline.checkpoint").READ_FORMATS),
            max(module("hylo.pipeline.checkpoint").READ_FORMATS),
        ),
    ),
    Fact(
        "reliability.md",
        r"is sealed \(format (\d+), which requires the checksum; formats (\d+) and (\d+) carry none",
        lambda: (
            module("hylo.pipeline.checkpoint").SEALED_FORMAT,
            *(
                f
                for f in module("hylo.pipeline.checkpoint").READ_FORMATS
                if f < module("hylo.pipeline.checkpoint").SEALED_FORMAT
            ),
        ),
    ),
    Fact(
        "reliability.md",
        r"The digest is BLAKE2b \((\d+) bits\)",
        lambda: 4 * len(module("hylo.integrity").checksum({})),
    ),
    Fact(
        "reliability.md",
        r"every option except the rank's own ((?:`\w+`(?:, | and ))+`\w+`)",
        lambda: frozenset(module("hylo.fingerprint").RANK_LOCAL),
    ),
    Fact(
        "reliability.md",
        r"jitter ladder \((10⁻\S+)…(10⁻\S+) × mean diagonal\)",
        lambda: (
            min(v for v in module("hylo.numerics").JITTER_LADDER if v > 0),
            max(module("hylo.numerics").JITTER_LADDER),
        ),
    ),
    Fact("reliability.md", r"clamp\(‖∇W‖, (10\S+), (10\S+)\)\)", _c("hylo.numerics", "NORM_CLAMP")),
    Fact("reliability.md", r"within (\d+%) \(sin ≤ ([\d.]+),", lambda: (module("hylo.pipeline.effect").UNCHANGED,) * 2),
    Fact("reliability.md", r"on (\w+) tie patterns", lambda: len(module("tests.library.test_registration").TIES)),
    Fact("reliability.md", r"(\d+) examples run by default", lambda: examples(FUZZ, "test_fuzz")),
    Fact("reliability.md", r"runs ([\d,]+) examples of each of the (\w+) properties", lambda: _slow_fuzz()[::-1]),
    Fact(
        "reliability.md",
        r"flips one bit at (\d+) positions of a saved file",
        lambda: range_bound(INTEGRITY, _flipped_bit),
    ),
    Fact("reliability.md", r"side by side for (\d+) steps of SGD", _c(_m(FUZZ_RESUME), "STEPS")),
    Fact(
        "reliability.md",
        r"bit-equal \((\d+) examples per configuration; (\d+) with `-m slow`\)",
        lambda: (examples(FUZZ_RESUME, "test_resume"), examples(FUZZ_RESUME, "test_resume_many")),
    ),
    Fact(
        "reliability.md",
        r"`python -m pytest -m slow tests/library/test_fuzz_state.py` \(([\d,]+) examples\)",
        lambda: examples(FUZZ_STATE, "test_corrupted_state_many"),
    ),
    Fact(
        "reliability.md",
        r"puts the saved ((?:`\w+`,? (?:and )?)+)in place",
        _c("hylo.pipeline.checkpoint", "RESTORABLE"),
    ),
    # solvers.md
    Fact("solvers.md", r"e = `kfc_exponent`, (\d+) by default", lambda: option_default("kfc_exponent")),
    Fact("solvers.md", r"The default \((None)\) refreshes factors", lambda: option_default("factor_update_freq")),
    Fact("solvers.md", r"with the default (1e-8), round-off", lambda: option_default("adam_eps")),
    Fact("solvers.md", r"\"(\w+)\" is the default", lambda: option_default("moment_carry")),
    Fact(
        "solvers.md",
        r"\(`rank_cap`·n, default ([\d.]+)·n: never more rows than ρ = ([\d.]+),",
        lambda: (option_default("rank_cap"),) * 2,
    ),
    Fact("solvers.md", r"e = `rank_energy` \(default ([\d.]+)\)", lambda: option_default("rank_energy")),
    Fact(
        "solvers.md",
        r"\(r/(\d+) refetches in practice\), and one outside them fetches the next (\d+)",
        lambda: (module("hylo.solvers.reduce").LOOKAHEAD,) * 2,
    ),
    Fact(
        "solvers.md",
        r"the O\(d²\) probe ‖Q 1‖² = d \(within (10⁻\S+)\)",
        _c("hylo.numerics", "ORTHOGONALITY_TOLERANCE"),
    ),
    Fact("solvers.md", r"‖∇W‖/λ·\(1 \+ max\((10⁻\S+), 8ε\)\)", _c("hylo.numerics", "LENGTH_SLACK")),
    Fact("solvers.md", r"clamped into \[(10\S+), (10\S+)\]", _c("hylo.numerics", "NORM_CLAMP")),
    Fact("solvers.md", r"by 1/\((10⁻²⁴) \+ ‖∇W‖·m\)", _c("hylo.numerics", "UNBOUNDED_FLOOR")),
    Fact(
        "solvers.md",
        r"exact in float32 up to V = (2\S+), float64 above",
        _c("hylo.layers.rows", "EXACT_FLOAT32_INTEGERS"),
    ),
    # training-scripts.md
    Fact(
        "training-scripts.md",
        r"except the scripts' `damping` ([\d.]+) and `kl_clip` (\S+) \(`hylo_options.py`\)",
        lambda: tuple(
            module("hylo_scripts.training.hylo_options").SCRIPT_DEFAULTS[k].value for k in ("damping", "kl_clip")
        ),
    ),
    Fact(
        "training-scripts.md",
        r"defaults are hylo's except `--damping` ([\d.]+) and `--kl-clip` (\S+) \((\d+): off\)",
        lambda: (
            module("hylo_scripts.training.hylo_options").SCRIPT_DEFAULTS["damping"].value,
            module("hylo_scripts.training.hylo_options").SCRIPT_DEFAULTS["kl_clip"].value,
            module("hylo_scripts.training.hylo_options").SCRIPT_DEFAULTS["kl_clip"].off,
        ),
    ),
    Fact(
        "training-scripts.md",
        r"at `--lr` \(default ([\d.]+) in `train.py`",
        _c("hylo_scripts.training.hylo_options", "ADAPTIVE_LR"),
    ),
    Fact(
        "training-scripts.md",
        r"`--solver \{([\w,]+)\}`",
        lambda: ",".join(("none", *module("hylo_scripts.training.hylo_options").solver_choices())),
    ),
    Fact(
        "training-scripts.md",
        r"\| `(\w+)` \(default\) \| none: the 5,000",
        lambda: module("hylo_scripts.training.train").DEFAULTS["dataset"],
    ),
    Fact(
        "training-scripts.md",
        r"\| `(\w+)` \(default\), `mlp` \|",
        lambda: module("hylo_scripts.training.train").DEFAULTS["model"],
    ),
    Fact(
        "training-scripts.md",
        r"\| `(\w+)` \(language model; `train_lm.py`'s default\)",
        lambda: module("hylo_scripts.training.train_lm").DEFAULTS["dataset"],
    ),
    Fact(
        "training-scripts.md",
        r"option-A shortcuts: ([\d.]+) M, ([\d.]+) M, ([\d.]+) M parameters",
        lambda: tuple(parameter_count(f"resnet{n}") / 1e6 for n in (20, 32, 56)),
        approx=True,
    ),
    Fact(
        "training-scripts.md",
        r"compression 0.5, ([\d.]+) M parameters",
        lambda: parameter_count("densenet") / 1e6,
        approx=True,
    ),
    Fact(
        "training-scripts.md",
        r"up-sampling, ([\d.]+) M parameters; hylo preconditions its (\d+) convolutions and its (\d+) `ConvTranspose2d`",
        lambda: (parameter_count("unet") / 1e6, registered("unet", nn.Conv2d), registered("unet", nn.ConvTranspose2d)),
        approx=True,
    ),
    Fact(
        "training-scripts.md",
        r"\((\d+) blocks × width (\d+), (\d+) heads, context (\d+) by default: ([\d.]+) M parameters\)",
        lambda: (
            *(
                module("hylo_scripts.models.registry").MODELS["transformer"].options[k]
                for k in ("layers", "width", "heads")
            ),
            module("hylo_scripts.models.registry").MODELS["transformer"].input_shape[0],
            parameter_count("transformer") / 1e6,
        ),
        approx=True,
    ),
    Fact(
        "training-scripts.md",
        r"`--seq-len` bytes \(default (\d+), also the model's context",
        lambda: module("hylo_scripts.models.registry").MODELS["transformer"].input_shape[0],
    ),
    Fact(
        "training-scripts.md",
        r"AdamW \(lr (\S+) with every solver, weight decay ([\d.]+)\), a linear warm-up over ([\d.]+) epochs",
        lambda: (
            module("hylo_scripts.training.hylo_options").TRAINER_LRS["lm"].natural,
            module("hylo_scripts.training.train_lm").DEFAULTS["weight_decay"],
            module("hylo_scripts.training.train_lm").DEFAULTS["warmup_epochs"],
        ),
    ),
    Fact(
        "training-scripts.md",
        r"batch (\d+) windows \(global\), (\d+) epochs of (\d+) KB",
        lambda: (
            module("hylo_scripts.training.train_lm").DEFAULTS["batch_size"],
            module("hylo_scripts.training.train_lm").DEFAULTS["epochs"],
            module("hylo_scripts.training.train_lm").DEFAULTS["max_bytes"] / 1000,
        ),
    ),
    # training-stacks.md
    Fact(
        "training-stacks.md",
        r"It reads a (\d+)-value sample of every parameter",
        _c("hylo.integrations.transformers", "MARK_SAMPLES"),
    ),
    Fact("training-stacks.md", r"as `checkpoint-<step>/([\w.]+)`", _c("hylo.integrations.transformers", "STATE_FILE")),
    Fact(
        "training-stacks.md",
        r"The optimizer form sets it under SGD-type optimizers \(`kl_clip=([^`]+)`",
        lambda: form_defaults(torch.optim.SGD)["kl_clip"],
    ),
    # usage.md
    Fact("usage.md", r"\(last ([\d,]+); \[Decisions and reasons\]", _c("hylo.preconditioner", "DECISION_LOG_SIZE")),
    Fact(
        "usage.md",
        r"`load_state_dict` restores the saved ((?:`\w+`,? (?:and )?)+)\(and the generator",
        _c("hylo.pipeline.checkpoint", "RESTORABLE"),
    ),
    Fact("usage.md", r"\| `options` \| the saved ((?:`\w+`, )+`\w+`) \|", _c("hylo.pipeline.checkpoint", "RESTORABLE")),
    Fact(
        "usage.md",
        r"a checkpoint made with another ((?:`\w+`,? (?:or )?)+)is refused",
        _c("hylo.pipeline.checkpoint", "MATCHING"),
    ),
    Fact("usage.md", r"an int outside int64's \[−(2⁶³), (2⁶³)\)", lambda: (module("hylo.rules").INT_LIMIT,) * 2),
    # figures.md
    Fact(
        "figures.md",
        r"\((\d+) epochs of (\d+) steps at batch (\d+)\)",
        lambda: tuple(
            getattr(module("hylo_scripts.demos.make_figures").StudySize(), k)
            for k in ("epochs", "max_steps", "batch_size")
        ),
    ),
    Fact(
        "figures.md", r"over seeds (\d+) and (\d+)", lambda: module("hylo_scripts.demos.make_figures").StudySize().seeds
    ),
    Fact(
        "figures.md",
        r"use `--trend-window (\d+)`",
        lambda: module("hylo_scripts.demos.make_figures").StudySize().trend_window,
    ),
    Fact("figures.md", r"the default window of (\d+) steps", lambda: option_default("trend_window")),
    Fact("figures.md", r"the tests execute all (\w+) on a real study", notebooks),
    # extending.md
    Fact("extending.md", r"trains a small MLP on random data for (\d+) steps", example_steps),
)


@pytest.mark.parametrize("fact", FACTS, ids=str)
def test_every_stated_fact_is_the_codes(fact: Fact) -> None:
    problems = fact_problems(fact, page_text(page(fact.page)))
    assert not problems, "\n".join(problems)


def test_the_facts_check_catches_a_wrong_figure_and_a_missing_phrase() -> None:
    families = Fact("design.md", r"There are (\w+) families\.", bundled_families)
    assert fact_problems(families, "There are three families.") == []
    assert fact_problems(families, "There are four families.") == [
        f"{families}: states 'four', the code gives {bundled_families()}"
    ]
    assert fact_problems(families, "Three families there are.") == [
        f"{families}: the page no longer says this (reworded? then update FACTS)"
    ]
    cap = Fact("hybrid-policy.md", r"C ≈ (\S+),", lambda: 6.703903964971299e153, approx=True)
    assert fact_problems(cap, "C ≈ 6.7·10¹⁵³,") == [] and fact_problems(cap, "C ≈ 6.8·10¹⁵³,") != []
    names = Fact("usage.md", r"saved ((?:`\w+`, )+`\w+`)\.", lambda: ("update_freq", "damping"))
    assert fact_problems(names, "saved `update_freq`, `damping`.") == []
    assert fact_problems(names, "saved `damping`, `update_freq`.") != []


# --- 5. Tables -----------------------------------------------------------------------------------------------


def table_with(path: Path, first_header: str) -> list[list[str]]:
    """The one table of a page whose header's first cell is ``first_header``."""
    found = [rows for rows in tables(page_text(path)) if rows[0][0] == first_header]
    assert len(found) == 1, f"{shown(path)}: {len(found)} tables headed {first_header!r}"
    return found[0]


def tolerance_problems(rows: list[list[str]]) -> list[str]:
    """The device tier's table against ``tests/kit/devices.py``'s ``TOLERANCES``: one row per device, one column
    per field in the dataclass's order; a tolerance of 0 is written "—" or "bit for bit"."""
    kit = module("tests.kit.devices")
    fields = [f.name for f in dataclasses.fields(kit.Tolerances)]
    problems = [] if len(rows[0]) == len(fields) + 1 else [f"{len(rows[0]) - 1} columns for the fields {fields}"]
    if {row[0] for row in rows[1:]} != set(kit.TOLERANCES):
        problems.append(f"devices {[row[0] for row in rows[1:]]}, the kit's {sorted(kit.TOLERANCES)}")
    for row in rows[1:]:
        if row[0] not in kit.TOLERANCES:
            continue
        for field, cell in zip(fields, row[1:], strict=False):
            value = getattr(kit.TOLERANCES[row[0]], field)
            if not (cell in ("—", "bit for bit") if value == 0 else number(cell) == value):
                problems.append(f"{row[0]}, {field}: the page says {cell!r}, the kit {value!r}")
    return problems


def test_the_device_tiers_tolerances_are_the_kits() -> None:
    rows = table_with(page("contributing.md"), "device")
    assert not tolerance_problems(rows), tolerance_problems(rows)
    wrong = [row[:] for row in rows]
    wrong[1][2] = "1e-13"
    assert len(tolerance_problems(wrong)) == 1


def listed_columns(cell: str) -> tuple[str, ...]:
    """The columns a cell lists: the names of its code spans (``a, b`` spans split), with "… phase columns"
    standing for the phases' ``*_ms`` columns; nothing after an ellipsis or a ``<placeholder>``."""
    found: list[str] = []
    for piece in re.split(r"(`[^`]+`)", cell):
        if piece.startswith("`"):
            names = [name.strip() for name in piece.strip("`").split(",")]
            if any("<" in name for name in names):
                break
            found += names
        elif "…" in piece:
            break
        elif "phase columns" in piece:
            found += [f"{phase}_ms" for phase in module("hylo.telemetry.profiling").PHASES]
    return tuple(found)


def profile_columns() -> dict[str, tuple[str, ...]]:
    """Each of hylo's CSV files and its columns (``rank-analysis.csv`` up to its first eigenvalue)."""
    recorder = module("hylo.telemetry.recorder")
    return {
        "timing-r{rank}.csv": recorder.TIMING_COLUMNS,
        "steps-r{rank}.csv": recorder.STEPS_COLUMNS,
        "decisions.csv": recorder.DECISION_COLUMNS,
        "grad-norm.csv": recorder.GRAD_NORM_COLUMNS,
        "rank-analysis.csv": recorder.rank_columns(1),
        "grad-error.csv": recorder.GRAD_ERROR_COLUMNS,
    }


def profile_problems(rows: list[list[str]]) -> list[str]:
    """docs/profiling.md's files and their columns against ``FILE_PATTERNS`` and the recorder's columns."""
    files = {row[0].replace("`", ""): row for row in rows[1:]}
    problems = []
    if set(files) != set(module("hylo.telemetry.recording").FILE_PATTERNS):
        problems.append(f"files {sorted(files)}, the recorder's {module('hylo.telemetry.recording').FILE_PATTERNS}")
    for name, expected in profile_columns().items():
        if name in files and listed_columns(files[name][3]) != expected:
            problems.append(f"{name}: the page lists {listed_columns(files[name][3])}, the recorder {expected}")
    return problems


def test_the_profile_files_and_their_columns_are_the_recorders() -> None:
    rows = table_with(page("profiling.md"), "file")
    assert not profile_problems(rows), profile_problems(rows)
    wrong = [[cell.replace("rows_kept, d_a", "d_a") for cell in row] for row in rows]
    assert len(profile_problems(wrong)) == 1 and len(profile_problems(rows[:-1])) == 1
    assert listed_columns("`step, layer`, the phase columns, `bytes_sent`") == (
        "step",
        "layer",
        *(f"{p}_ms" for p in module("hylo.telemetry.profiling").PHASES),
        "bytes_sent",
    )
    assert listed_columns("`step, sv_1` … `sv_k`") == ("step", "sv_1")


def assignments(cell: str) -> dict[str, Any]:
    """The ``name=value`` code spans of a cell, as a dict of literals."""
    return {m.group(1): literal(m.group(2)) for m in re.finditer(r"`(\w+)=([^`]+)`", cell)}


def same_options(stated: dict[str, Any], expected: dict[str, Any]) -> bool:
    return stated.keys() == expected.keys() and all(same(stated[k], expected[k]) for k in expected)


def form_problems(rows: list[list[str]]) -> list[str]:
    """docs/usage.md's options of the optimizer form per optimizer kind against ``hylo.optimizer.default_options``
    on those optimizers: the Adam-type classes, the options under AdamW (and those it takes from AdamW's own
    ``defaults``: the ones that follow its ``betas`` and ``eps``), under AdamW with ``solver="kfac"``, under SGD."""
    adaptive, natural, plain = rows[1], rows[2], rows[3]
    problems = []
    kinds = {b.__name__ for b in module("hylo.optimizer").ADAPTIVE_BASES}
    if set(stated_names(adaptive[0].split(", or any")[0])) != kinds:
        problems.append(f"Adam-type: the page names {adaptive[0]}, the code {sorted(kinds)}")
    under_adamw = form_defaults(torch.optim.AdamW)
    other = nn.Parameter(torch.zeros(1))
    moved = module("hylo.optimizer").default_options(torch.optim.AdamW([other], betas=(0.5, 0.6), eps=1e-3), {})
    inherited = {k for k in under_adamw if not same(under_adamw[k], moved[k])}
    if not same_options(assignments(adaptive[1]), {k: v for k, v in under_adamw.items() if k not in inherited}):
        problems.append(f"under AdamW: the page says {adaptive[1]}, the code {under_adamw}")
    if set(stated_names(adaptive[1].split(";")[-1].split(" its own")[0])) != inherited:
        problems.append(f"under AdamW: the page takes {adaptive[1]} from the optimizer, the code {inherited}")
    chosen = form_defaults(torch.optim.AdamW, solver="kfac")
    if not same_options(assignments(natural[1]), {k: v for k, v in chosen.items() if k != "solver"}):
        problems.append(f"under AdamW with solver='kfac': the page says {natural[1]}, the code {chosen}")
    if not same_options(assignments(plain[1]), form_defaults(torch.optim.SGD)):
        problems.append(f"under SGD: the page says {plain[1]}, the code {form_defaults(torch.optim.SGD)}")
    return problems


def test_the_optimizer_forms_defaults_are_default_options() -> None:
    rows = table_with(page("usage.md"), "wrapped optimizer")
    assert not form_problems(rows), form_problems(rows)
    wrong = [
        [
            cell.replace("`update_freq=3`", "`update_freq=5`")
            .replace("`kl_clip=1e-3`", "`kl_clip=1e-2`")
            .replace("`SparseAdam`, ", "")
            for cell in row
        ]
        for row in rows
    ]
    assert len(form_problems(wrong)) == 3


def names_problems(stated: Sequence[str], code: Sequence[str], what: str) -> list[str]:
    return (
        [] if sorted(stated) == sorted(code) else [f"the page lists {what} {sorted(stated)}, the code {sorted(code)}"]
    )


def test_the_figures_and_reasons_tables_list_every_figure_and_reason() -> None:
    figures = [stated_names(row[0])[0] for row in table_with(page("figures.md"), "figure")[1:]]
    code_figures = list(module("hylo_analysis").FIGURES)
    reasons = [n for row in table_with(page("hybrid-policy.md"), "reason")[1:] for n in stated_names(row[0])]
    code_reasons = list(module("hylo.records").REASONS)
    assert not names_problems(figures, code_figures, "figures") + names_problems(reasons, code_reasons, "reasons")
    assert names_problems(figures[1:], code_figures, "figures") and names_problems([*reasons, "x"], code_reasons, "")


def lr_problems(rows: list[list[str]]) -> list[str]:
    """docs/training-scripts.md's default learning rates: the solvers of each column (``hylo_options.ADAPTIVE``
    and the rest), and each trainer's rates (``TRAINER_LRS`` of the task of the trainer's default model)."""
    options_module, models = module("hylo_scripts.training.hylo_options"), module("hylo_scripts.models.registry")
    solvers = hylo.solvers.solver_names()
    natural = ["none", hylo.solvers.HYBRID, *(s for s in solvers if not hylo.solvers.whole_step(s))]
    problems = names_problems(stated_names(rows[0][1]), natural, "natural solvers")
    problems += names_problems(stated_names(rows[0][2]), options_module.ADAPTIVE, "adaptive solvers")
    for row in rows[1:]:
        for script in re.findall(r"`(\w+)\.py`", row[0]):
            task = models.MODELS[module(f"hylo_scripts.training.{script}").DEFAULTS["model"]].task
            lrs = options_module.TRAINER_LRS[task]
            if (number(row[1]), number(row[2])) != (lrs.natural, lrs.adaptive):
                problems.append(f"{script}.py: the page says {row[1]}, {row[2]}; the code {lrs}")
    return problems


def test_the_trainers_learning_rates_are_trainer_lrs() -> None:
    rows = table_with(page("training-scripts.md"), "trainer")
    assert not lr_problems(rows), lr_problems(rows)
    wrong = [row[:2] + [row[2].replace("0.01", "0.02")] for row in rows]
    assert len(lr_problems(wrong)) == 2  # train.py and train_segmentation.py


#: A launcher row's settings (docs/training-scripts.md, "Launchers"), each a phrase → the flags it sets.
SETTINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(\S+)/GPU", ("BATCH_PER_GPU",)),
    (r"(\S+) epochs", ("--epochs",)),
    (r"warm-up (\S+)", ("--warmup-epochs",)),
    (r"lr (\S+) × (\S+) at ([\d ]+)", ("--lr", "--lr-decay", "--milestone")),
    (r"lr (\S+)", ("--lr",)),
    (r"λ (\S+) → (\S+) over (\S+) epochs", ("--damping", "--target-damping", "--damping-decay-epochs")),
    (r"λ (\S+)", ("--damping",)),
    (r"wd (\S+)", ("--weight-decay",)),
    (r"freq (\S+)", ("--freq",)),
    (r"ρ = (\S+)", ("--compression-ratio",)),
    (r"label smoothing (\S+)", ("--label-smoothing",)),
    (r"adaptive ([\d ]+)", ("--adaptive",)),
)


def launcher_defaults(script: str) -> dict[str, str]:
    """A launcher's defaults: each flag's ``${VAR-default}`` (and ``BATCH_PER_GPU``'s ``${…:-default}``)."""
    text = (ROOT / script).read_text(encoding="utf-8")
    found = {m.group(1): m.group(2) for m in re.finditer(r"hylo_(?:list_)?arg (--[\w-]+) \"\$\{\w+-([^}]*)\}\"", text)}
    batch = re.search(r"BATCH_PER_GPU=\"\$\{BATCH_PER_GPU:-(\d+)\}\"", text)
    return found | ({"BATCH_PER_GPU": batch.group(1)} if batch else {})


def launcher_problems(script: str, cell: str) -> list[str]:
    """What a launcher row states that the launcher's defaults do not give (a constant λ: the target equal to it;
    no decay stated: no milestones, or a decay of 1)."""
    defaults_of = launcher_defaults(script)
    stated: dict[str, str] = {}
    problems = []
    for item in (part.strip() for part in cell.split(", ")):
        match = next((m for p, flags in SETTINGS if (m := re.fullmatch(p, item))), None)
        flags = next((flags for p, flags in SETTINGS if re.fullmatch(p, item)), ())
        if match is None:
            problems.append(f"{script}: cannot read {item!r}")
            continue
        stated |= dict(zip(flags, match.groups(), strict=True))
    if "--target-damping" not in stated and "--damping" in stated:
        stated["--target-damping"] = stated["--damping"]
    epochs = number(defaults_of.get("--epochs", "0")) or 0
    if "--lr-decay" not in stated and any(
        (number(m) or 0) < epochs for m in defaults_of.get("--milestone", "").split()
    ):
        stated["--lr-decay"] = "1"  # no decay stated: none within the run's epochs
    for flag, value in stated.items():
        code = defaults_of.get(flag)
        if code is None or [number(v) for v in value.split()] != [number(v) for v in code.split()]:
            problems.append(f"{script}: {flag} stated {value!r}, the launcher's default {code!r}")
    return problems


def test_the_launchers_settings_are_their_defaults() -> None:
    rows = table_with(page("training-scripts.md"), "launcher")
    scripts = [stated_names(row[0])[0] for row in rows[1:]]
    assert sorted(scripts) == sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "scripts").glob("train-*.sh"))
    problems = [p for row in rows[1:] for p in launcher_problems(stated_names(row[0])[0], row[2])]
    assert not problems, "\n".join(problems)
    right = [row for row in rows[1:] if "resnet32" in row[0]][0][2]
    assert launcher_problems("scripts/train-resnet32-cifar10.sh", right.replace("freq 13", "freq 12")) != []
    assert launcher_problems("scripts/train-resnet32-cifar10.sh", right + ", momentum 0.8") != []


# --- 6. Counts the code determines ---------------------------------------------------------------------------

FLAGS = re.compile(r"(\d+) \+ (\d+)L (?:int32 )?flags")
CAPTURE_FLAGS = re.compile(r"(\d*)L more under `hybrid`, (\d*)L with a fixed solver")


def flag_problems(text: str) -> list[str]:
    """The agreement's flag count a page states ("a + bL flags", "at capture steps cL more") against
    :func:`hylo.pipeline.guard.agreement_flags` (with the statistics the families capture)."""
    guard = module("hylo.pipeline.guard")
    problems = []
    for match in FLAGS.finditer(flat(text)):
        head, per_layer = int(match.group(1)), int(match.group(2))
        if any(head + per_layer * n != guard.agreement_flags(n) for n in range(1, 9)):
            problems.append(f"{match.group(0)}: the guard sends {guard.agreement_flags(1) - 2} + 2L")
    for match in CAPTURE_FLAGS.finditer(flat(text)):
        fixed = {len(hylo.HyLoConfig(solver=solver).statistics()) for solver in hylo.solvers.solver_names()}
        captured = (len(hylo.HyLoConfig(solver=hylo.solvers.HYBRID).statistics()), *fixed)
        for stated, statistics in zip(match.groups(), (captured[0], captured[1:]), strict=True):
            for count in statistics if isinstance(statistics, tuple) else (statistics,):
                more = guard.agreement_flags(1, count) - guard.agreement_flags(1)
                if more != int(stated or 1):
                    problems.append(f"{match.group(0)}: the guard sends {more}L more with {count} statistics")
    return problems


def test_the_agreements_flag_count_is_the_guards() -> None:
    stated = [path for path in DOC_FILES if FLAGS.search(flat(page_text(path)))]
    assert {shown(p) for p in stated} >= {"docs/design.md", "docs/reliability.md"}, stated
    problems = [f"{shown(p)}: {problem}" for p in stated for problem in flag_problems(page_text(p))]
    assert not problems, "\n".join(problems)
    assert flag_problems("one all-reduce of 2 + 2L flags") and flag_problems(
        "3L more under `hybrid`, L with a fixed solver"
    )


@pytest.mark.parametrize("solver", ["hybrid", "kfac"])
def test_the_guard_sends_agreement_flags(solver: str) -> None:
    """What the agreement's all-reduce (int32, MIN) carries on a capture step and between updates, logged by a
    cluster of 2 ranks as threads: :func:`agreement_flags` of the layers and, at the capture step, of the
    statistics the solvers capture."""
    guard, cluster = module("hylo.pipeline.guard"), module("tests.kit.cluster").ThreadCluster(2)

    def rank_steps(rank: int, comm: Any) -> tuple[int, int, list[list[int]]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
        pre = hylo.HyLoPreconditioner(model, solver=solver, update_freq=2, communicator=comm)
        sent = []
        try:
            for _ in range(2):  # an update, then a step between updates
                model.zero_grad()
                model(torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
                start = len(cluster.log[rank])
                pre.step()
                calls = cluster.log[rank][start:]
                sent.append(
                    [c.numel for c in calls if c.op == "all_reduce" and c.dtype == torch.int32 and c.detail == "min"]
                )
            return len(pre.layer_info()), len(pre.config.statistics()), sent
        finally:
            pre.remove()

    for layers, statistics, sent in cluster.run(rank_steps):
        assert sent == [[guard.agreement_flags(layers, statistics)], [guard.agreement_flags(layers)]], sent


def pin_problems(design: str, benchmarks: str) -> list[str]:
    """The pins docs/design.md and docs/benchmarks.md quote against ``tests/library/test_step_cost.py``'s: ``MARGIN``
    more operations for ``MANY`` equal layers than for ``FEW``, and the benchmarks' targets (``TARGETS``: at most so
    many operations between updates on the LM bench decoder and ResNet-32, ``kfac_adam`` apart)."""
    cost = module("tests.library.test_step_cost")
    problems = []
    pin = re.search(r"\((\d+) equal layers, one group, issue at most (\d+) operations more than (\d+)\)", flat(design))
    if not pin or tuple(map(int, pin.groups())) != (cost.MANY, cost.MARGIN, cost.FEW):
        problems.append(f"design.md: {pin and pin.group(0)}; the pin: {cost.MANY}, {cost.MARGIN}, {cost.FEW}")
    shape = re.search(r"`tests/library/test_step_cost.py` pins it: at most (\d+) operations more", flat(benchmarks))
    if not shape or int(shape.group(1)) != cost.MARGIN:
        problems.append(f"benchmarks.md: {shape and shape.group(0)}; the pin: {cost.MARGIN}")
    most: dict[tuple[str, bool], set[int]] = {}
    for model, _, solver, _, bound in cost.TARGETS:
        most.setdefault((model, solver == "kfac_adam"), set()).add(bound)
    targets = re.search(
        r"between updates ≤ (\d+) operations on the LM bench decoder for every solver but `kfac_adam` \(≤ (\d+)\), "
        r"≤ (\d+) on ResNet-32 \(≤ (\d+) for `kfac_adam`\)",
        flat(benchmarks),
    )
    expected = [most[(model, adam)] for model in ("transformer", "resnet32") for adam in (False, True)]
    if not targets or [{int(v)} for v in targets.groups()] != expected:
        problems.append(f"benchmarks.md: {targets and targets.group(0)}; TARGETS: {expected}")
    return problems


def test_the_operation_pins_are_test_step_costs() -> None:
    design, benchmarks = page_text(page("design.md")), page_text(page("benchmarks.md"))
    assert not pin_problems(design, benchmarks), pin_problems(design, benchmarks)
    assert len(pin_problems(design.replace("at most 16 operations more", "at most 8 operations more"), benchmarks)) == 1
    assert len(pin_problems(design, benchmarks.replace("≤ 150 on ResNet-32", "≤ 140 on ResNet-32"))) == 1


def budget_problems(text: str) -> list[str]:
    """The widths and megabytes docs/hybrid-policy.md gives for ``kfac_max_state_mb``'s default, from
    ``kfac_state_bytes`` in float32: the widest layer it keeps (width d with a bias: d_a = d + 1), an MLP's state,
    and a vocabulary's state over the budget."""
    kfac_state_bytes = module("hylo.solvers.kfac").kfac_state_bytes
    cap = option_default("kfac_max_state_mb")
    stated = re.search(
        r"([\d,]+) MB keeps K-FAC for layers up to ([\d,]+) wide \(a (\d+) × (\d+) MLP: ([\d,]+) MB\) and refuses a "
        r"([\d,]+)-token embedding or head at any width \(([\d,]+) MB at width (\d+)\)",
        flat(text),
    )
    if not stated:
        return ["docs/hybrid-policy.md no longer states the budget's examples"]
    mb, wide, d_in, d_out, mlp_mb, vocab, vocab_mb, width = (int(number(v) or 0) for v in stated.groups())
    widest = max(d for d in range(1, 2**15) if kfac_state_bytes(d + 1, d, 4) <= cap * 2**20)
    computed = (
        cap,
        widest,
        round(kfac_state_bytes(d_in, d_out, 4) / 2**20),
        round(kfac_state_bytes(vocab, width, 4) / 2**20),
    )
    problems = [] if (mb, wide, mlp_mb, vocab_mb) == computed else [f"{stated.group(0)}: the code gives {computed}"]
    return problems + ([] if vocab_mb > cap else [f"{vocab_mb} MB is within the budget of {cap} MB"])


def test_kfacs_memory_budget_examples_are_computed_from_the_budget() -> None:
    text = page_text(page("hybrid-policy.md"))
    assert not budget_problems(text), budget_problems(text)
    assert len(budget_problems(text.replace("up to 11,584 wide", "up to 11,585 wide"))) == 1
    assert len(budget_problems(text.replace("MLP: 1,053 MB", "MLP: 1,052 MB"))) == 1


@cache
def stack_counts(solver: str, layers: int, batch: int, option: tuple[tuple[str, str], ...]) -> tuple[Any, Any, Any]:
    """``hylo_scripts.benchmarks.bench_ops.step_counts`` of a stack of ``layers`` equal layers, counted once."""
    ops = module("hylo_scripts.benchmarks.bench_ops")
    return ops.step_counts("stack", solver, batch, 10, None, model_options={"layers": layers}, options=dict(option))


def stack_problems(text: str) -> list[str]:
    """docs/benchmarks.md's operations of a stack of equal layers (``scripts/bench_ops.py --model stack``, its
    command read from the page): each solver's step between updates at both depths ("**a → b**" after) and the
    forward and backward, counted again by ``hylo_scripts.benchmarks.bench_ops.step_counts``; the layers' shape from its
    ``stack``."""
    ops = module("hylo_scripts.benchmarks.bench_ops")
    command = re.search(
        r"bench_ops.py --model stack --layers \d+ --batch-size (\d+) --solvers ([\w ]+?) \\\s*--set (\w+)=(\w+)", text
    )
    rows = [row for rows in tables(text) if rows[0][0].startswith("model (") for row in rows[1:]]
    at = next((i for i, row in enumerate(rows) if "equal Linear" in row[0]), None)
    if command is None or at is None:
        return ["docs/benchmarks.md no longer gives the stack's command and rows"]
    batch, option = int(command.group(1)), {command.group(3): command.group(4)}
    shape = re.search(r"(\d+) → (\d+) equal Linear\((\d+), (\d+)\)", rows[at][0])
    assert shape, rows[at][0]
    few, many, d_in, d_out = map(int, shape.groups())
    linear = next(m for m in ops.stack(few, 1)[0].modules() if isinstance(m, nn.Linear))
    problems = [] if (linear.in_features, linear.out_features) == (d_in, d_out) else [f"the stack is {linear}"]
    stacked = rows[at : at + 1] + list(itertools.takewhile(lambda row: not row[0], rows[at + 1 :]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for row in stacked:
            solver, after = stated_names(row[1])[0], re.search(r"\*\*(\d+) → (\d+)\*\*", row[2])
            counts = [stack_counts(solver, n, batch, tuple(option.items())) for n in (few, many)]
            if not after or tuple(map(int, after.groups())) != tuple(c[2].total for c in counts):
                problems.append(f"{solver}: the page says {row[2]}, the count {[c[2].total for c in counts]}")
            if row[4] and [number(v) for v in row[4].split("→")] != [c[0].total for c in counts]:
                problems.append(f"forward + backward: the page says {row[4]}, the count {[c[0].total for c in counts]}")
    return problems


def test_the_stacks_operation_counts_are_counted_again() -> None:
    text = page_text(page("benchmarks.md"))
    assert not stack_problems(text), stack_problems(text)
    assert len(stack_problems(text.replace("**59 → 59**", "**59 → 60**"))) == 1
