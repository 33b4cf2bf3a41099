"""The package's structure (docs/design.md, "Layout"), read from its source with ``ast``.

- Module imports form no cycle: each ``from hylo.x import …`` (at module level, outside
  ``TYPE_CHECKING``) is an edge to the module it names, and the graph is acyclic.
- No module of ``hylo/`` is over 500 lines, and ``HyLoPreconditioner`` is under 400: the class runs
  a step; the planner, guard, checkpoint, memory accounting and telemetry have their own modules.
- Only ``hylo/solvers/``, ``hylo/config.py`` and ``hylo/policy.py`` compare anything with a solver's
  or a family's name: everything else goes through the family interface and the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hylo"
NAMES = {"kfac", "sngd", "kid", "kis", "lowrank", "hybrid"}
MAY_NAME_SOLVERS = ("solvers/", "config.py", "policy.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _runtime_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Module-level imports, leaving out ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.ImportFrom | ast.Import] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
    return found


def import_graph() -> dict[str, set[str]]:
    """hylo module → the hylo modules it imports at load time."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            targets = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom):  # ``from hylo import checkpoint``: submodules by name
                targets += [f"{node.module}.{alias.name}" for alias in node.names]
            graph[name].update(t for t in targets if t in MODULES and t != name and t != "hylo")
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_hylo_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert graph["hylo.preconditioner"] >= {
        "hylo.pipeline.planner",
        "hylo.pipeline.guard",
        "hylo.pipeline.checkpoint",
        "hylo.memory",
    }
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph) or [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_500_lines(name: str) -> None:
    assert len(MODULES[name].read_text().splitlines()) <= 500


def test_the_preconditioner_class_is_under_400_lines() -> None:
    tree = ast.parse(MODULES["hylo.preconditioner"].read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "HyLoPreconditioner"]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 < 400


def solver_name_comparisons(source: str) -> list[str]:
    """Comparisons (==, !=, in, not in, match cases) of anything with a solver's or family's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            constants = {
                c.value
                for operand in operands
                for c in ast.walk(operand)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            if constants & NAMES:
                found.append(ast.unparse(node))
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in NAMES:
            found.append(ast.unparse(node))
    return found


def test_the_name_check_sees_comparisons() -> None:
    assert solver_name_comparisons('x = family == "kfac"\ny = s in ("kid", "kis")') == [
        "family == 'kfac'",
        "s in ('kid', 'kis')",
    ]
    assert solver_name_comparisons('costs = {"kfac": 1.0}') == []


def test_only_solvers_config_and_policy_compare_solver_names() -> None:
    offenders = {
        name: found
        for name, path in MODULES.items()
        if not str(path.relative_to(ROOT)).startswith(MAY_NAME_SOLVERS)
        and (found := solver_name_comparisons(path.read_text()))
    }
    assert offenders == {}


TESTS = ROOT.parent / "tests"
#: The library's tests that use a piece of the application, with the piece and why (docs/contributing.md, "Tests").
APPLICATION_IN_LIBRARY = {
    "test_fsdp.py": "hylo_scripts.models: the decoder LM whose sharded embedding and attention are held to one process",
    "test_moe.py": "hylo_scripts.moe: the Mixtral and Qwen2-MoE builders and their nn.Linear-per-expert twin",
    "test_optimizer_form.py": "hylo_scripts.bench_ops: the op counter the step-cost pins read",
    "test_step_cost.py": "hylo_scripts.bench_ops: the op counts the benchmark reports, pinned",
}


def application_imports(source: str) -> set[str]:
    """The modules of ``hylo_scripts`` and ``hylo_analysis`` a test file imports, at any level."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        found |= {name for name in names if name.split(".")[0] in ("hylo_scripts", "hylo_analysis")}
    return found


def test_the_library_tests_use_the_application_only_where_listed() -> None:
    using = {
        path.name: imports
        for path in sorted((TESTS / "library").glob("*.py"))
        if (imports := application_imports(path.read_text()))
    }
    assert sorted(using) == sorted(APPLICATION_IN_LIBRARY), using
    assert all(not imported.startswith("hylo_analysis") for found in using.values() for imported in found)


def test_the_tests_are_in_their_three_folders() -> None:
    assert sorted(path.name for path in TESTS.glob("test_*.py")) == []
    assert {path.name for path in TESTS.iterdir() if path.is_dir() and not path.name.startswith("_")} >= {
        "library",
        "application",
        "repository",
        "kit",
    }
