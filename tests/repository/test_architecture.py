"""The package's structure (docs/design.md, "Layout"), read from its source with ``ast``.

- Every import counts (at module level, in a function or a class; relative imports resolved; in hylo only
  ``if TYPE_CHECKING:`` blocks are left out, in the scripts and the analysis not even those): hylo/, the scripts
  (hylo_scripts and the entry points scripts/*.py) and hylo_analysis each import without a cycle; hylo imports
  neither hylo_scripts nor hylo_analysis, and hylo_analysis neither hylo nor hylo_scripts; hylo's packages import
  each other without a cycle; a module of hylo imports only from its level of :data:`LEVELS` or a lower one, and
  nothing under hylo/solvers/ imports hylo/distributed/; every module of hylo_scripts (but its ``__init__``) is in
  a subpackage, each subpackage in one level of :data:`SCRIPT_LEVELS`, and imports only from its level or a lower
  one.
- No module of ``hylo/`` is over 500 lines, and ``HyLoPreconditioner`` is under 400: the class runs
  a step; the planner, guard, checkpoint, memory accounting and telemetry have their own modules.
- Only ``hylo/solvers/``, ``hylo/config.py`` and ``hylo/policy.py`` compare anything with a solver's
  or a family's name: everything else goes through the family interface and the registry.
- Only the placements (``hylo/pipeline/placement/``) ask which distribution is in force (the ``strategy``, FSDP2
  sharding, a placement's class): everything else asks the placement chosen at construction.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hylo"
NAMES = {"kfac", "sngd", "kid", "kis", "lowrank", "hybrid"}
MAY_NAME_SOLVERS = ("solvers/", "config.py", "policy.py")


def modules_of(package: Path) -> dict[str, Path]:
    """Module name → file of every module of the package in the folder ``package``."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules_of(ROOT)


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
    "test_fsdp.py": "hylo_scripts.models.registry: the decoder LM whose sharded embedding and attention are held "
    "to one process",
    "test_graft.py": "hylo_scripts.benchmarks.bench_ops: the op counter grafting's constant cost is counted with",
    "test_moe.py": "hylo_scripts.models.moe: the Mixtral and Qwen2-MoE builders and their nn.Linear-per-expert twin",
    "test_moe_families.py": "hylo_scripts.models.moe: the other MoE families' builders and the nn.Linear-per-expert "
    "twin",
    "test_optimizer_form.py": "hylo_scripts.benchmarks.bench_ops: the op counter the step-cost pins read",
    "test_step_cost.py": "hylo_scripts.benchmarks.bench_ops: the op counts the benchmark reports, pinned",
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


# --- Every import: hylo's levels, the scripts and the analysis -------------------------------------------------
# An import inside a function or a class is as much a dependency as one at the top: it cannot hold a cycle
# open. In hylo only ``if TYPE_CHECKING:`` blocks are left out (annotations, never run); in the scripts and the
# analysis they count too: a type two modules share lives in the lower one.

REPO = ROOT.parent
SCRIPTS = REPO / "scripts"
ANALYSIS = REPO / "analysis" / "hylo_analysis"

#: hylo's levels, lowest first (docs/design.md, "Layout"): a module of hylo imports only from modules of its own
#: level or of a lower one. A module is in the level whose entry names it or its subpackage (every module is in
#: exactly one: :func:`level_of`).
LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundations",
        (
            "hylo.version",
            "hylo.rules",
            "hylo.records",
            "hylo.integrity",
            "hylo.adapted",
            "hylo.graft",
            "hylo.numerics",
            "hylo.payload",
        ),
    ),
    ("per-layer math", ("hylo.layers",)),
    ("solver families", ("hylo.solvers",)),
    (
        "configuration and per-layer state",
        ("hylo.config", "hylo.sections", "hylo.trend", "hylo.policy", "hylo.state", "hylo.memory", "hylo.views"),
    ),
    ("distribution", ("hylo.distributed",)),
    ("step pipeline", ("hylo.pipeline",)),
    ("telemetry", ("hylo.telemetry",)),
    (
        "the public classes",
        ("hylo.fingerprint", "hylo.preconditioner", "hylo.optimizer", "hylo.optimizer_state", "hylo"),
    ),
    ("integrations", ("hylo.integrations",)),
)


#: The levels of the scripts' package, lowest first, as :data:`LEVELS` for hylo: a module imports only from its
#: level or a lower one (the entry points scripts/*.py stand above them all). Every module of ``hylo_scripts`` but its
#: ``__init__`` is in one of its subpackages, and each subpackage is named here (:func:`script_subpackages`).
SCRIPT_LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data and models", ("hylo_scripts", "hylo_scripts.data", "hylo_scripts.models")),
    ("the engine, the trainers' flags and the trainers", ("hylo_scripts.training",)),
    ("the benchmarks and the demos", ("hylo_scripts.benchmarks", "hylo_scripts.demos")),
)
#: The folder of the scripts' package.
SCRIPT_PACKAGE = SCRIPTS / "hylo_scripts"


def _and_above(name: str) -> tuple[str, ...]:
    """``a.b.c``, ``a.b``, ``a``."""
    parts = name.split(".")
    return tuple(".".join(parts[:n]) for n in range(len(parts), 0, -1))


def named_imports(
    source: str, module: str = "", is_package: bool = False, typing: bool = False
) -> list[tuple[str, ...]]:
    """What each import of ``source`` names, wherever it stands, except under ``if TYPE_CHECKING:`` (its ``else``
    counts) unless ``typing``: per imported name, the modules it may be, most specific first (``from m import n``:
    ``m.n``, then ``m`` and the packages above it; ``import a.b``: ``a.b``, ``a``). Relative imports are resolved
    against ``module`` (``is_package``: its file is an ``__init__.py``)."""
    tree = ast.parse(source)
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    found: list[tuple[str, ...]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [_and_above(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            found += [(f"{base}.{alias.name}", *_and_above(base)) for alias in node.names]
    return found


def every_import_graph(modules: dict[str, Path], typing: bool = False) -> dict[str, set[str]]:
    """Module → the modules of ``modules`` it imports anywhere (:func:`named_imports`; ``typing``: those under
    ``if TYPE_CHECKING:`` too): each import is an edge to the most specific module it may be
    (``from hylo.pipeline import checkpoint``: ``hylo.pipeline.checkpoint``; ``from hylo.solvers import family_of``:
    ``hylo.solvers``)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named = named_imports(path.read_text(), name, path.name == "__init__.py", typing)
        targets = {next((c for c in candidates if c in modules), None) for candidates in named}
        graph[name] = {target for target in targets if target is not None and target != name}
    return graph


def foreign_imports(modules: dict[str, Path], packages: set[str]) -> dict[str, set[str]]:
    """Module → what it imports, anywhere, of the top-level ``packages`` (only modules that do)."""
    found = {
        name: {candidates[0] for candidates in named_imports(path.read_text()) if candidates[-1] in packages}
        for name, path in modules.items()
    }
    return {name: imports for name, imports in found.items() if imports}


def level_of(module: str, levels: tuple[tuple[str, tuple[str, ...]], ...] = LEVELS) -> int:
    """The index in ``levels`` of the level whose entry names ``module`` or the subpackage it is in (a name with a
    dot: ``hylo.layers`` holds ``hylo.layers.math``, ``hylo`` holds only itself; a name ending in ``*`` every
    module it begins); ``ValueError`` unless exactly one does."""
    (found,) = [
        index
        for index, (_, names) in enumerate(levels)
        for name in names
        if module == name
        or ("." in name and module.startswith(f"{name}."))
        or (name.endswith("*") and module.startswith(name[:-1]))
    ]
    return found


def upward_imports(
    graph: dict[str, set[str]], levels: tuple[tuple[str, tuple[str, ...]], ...] = LEVELS
) -> list[tuple[str, str]]:
    """The imports of ``graph`` that point to a higher level of ``levels``."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if level_of(target, levels) > level_of(module, levels)
    )


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` by hylo's packages: a module of a subpackage is its ``hylo.<package>``, every other module
    (``hylo``, ``hylo.config``, …) stays itself."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(package(module), set()).update(package(target) for target in targets)
    return {name: targets - {name} for name, targets in packages.items()}


def hylo_graph() -> dict[str, set[str]]:
    return every_import_graph(MODULES)


def scripts_graph() -> dict[str, set[str]]:
    """hylo_scripts' modules and the entry points (named ``scripts/<file>``), every import, those under
    ``if TYPE_CHECKING:`` too; imports of hylo left out."""
    modules = modules_of(SCRIPT_PACKAGE) | {f"scripts/{p.name}": p for p in sorted(SCRIPTS.glob("*.py"))}
    return every_import_graph(modules, typing=True)


def analysis_graph() -> dict[str, set[str]]:
    """hylo_analysis' modules, every import, those under ``if TYPE_CHECKING:`` too."""
    return every_import_graph(modules_of(ANALYSIS), typing=True)


def test_named_imports_count_every_import_but_type_checking_ones_unless_asked() -> None:
    source = """
import a.b as ab
from . import sibling
from .. import uncle
from .inner import thing
if TYPE_CHECKING:
    from hidden import Hidden
else:
    import shown

def f():
    from late import x

class C:
    import in_class
"""
    assert named_imports(source, "pkg.sub.mod") == [
        ("a.b", "a"),
        ("pkg.sub.sibling", "pkg.sub", "pkg"),
        ("pkg.uncle", "pkg"),
        ("pkg.sub.inner.thing", "pkg.sub.inner", "pkg.sub", "pkg"),
        ("shown",),
        ("late.x", "late"),
        ("in_class",),
    ]
    assert ("hidden.Hidden", "hidden") in named_imports(source, "pkg.sub.mod", typing=True)
    assert named_imports("from .inner import thing", "pkg.sub", is_package=True) == [
        ("pkg.sub.inner.thing", "pkg.sub.inner", "pkg.sub", "pkg")
    ]


def test_the_full_graph_sees_a_cycle_held_open_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text("def later():\n    from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    graph = every_import_graph(modules_of(tmp_path / "pkg"))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": set()}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_typing_graph_sees_a_cycle_held_open_by_type_checking(tmp_path: Path) -> None:
    """The scripts' and the analysis' graphs count ``if TYPE_CHECKING:`` imports: a cycle they hold is a cycle."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    assert find_cycle(every_import_graph(modules_of(tmp_path / "pkg"))) is None
    graph = every_import_graph(modules_of(tmp_path / "pkg"), typing=True)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_level_check_finds_an_upward_import() -> None:
    levels = (("low", ("p.low",)), ("high", ("p.high", "p")))
    graph = {"p.low.x": {"p.high"}, "p.high": {"p.low.x"}, "p": {"p.high"}, "p.low": {"p.low.x"}}
    assert upward_imports(graph, levels) == [("p.low.x", "p.high")]
    assert level_of("p.low.x.deep", levels) == 0 and level_of("p", levels) == 1
    with pytest.raises(ValueError):
        level_of("p.elsewhere", levels)  # "p" holds only itself


def test_the_package_graph_finds_a_cycle_of_packages() -> None:
    graph = {"h.a.x": {"h.b.y"}, "h.b.y": set(), "h.b.z": {"h.a.w"}, "h.a.w": set(), "h.top": {"h.a.x"}}
    packages = package_graph(graph)
    assert packages == {"h.a": {"h.b"}, "h.b": {"h.a"}, "h.top": {"h.a"}}
    assert find_cycle(graph) is None and find_cycle(packages) == ["h.a", "h.b", "h.a"]


def test_every_import_of_hylo_without_a_cycle() -> None:
    graph = hylo_graph()
    assert graph["hylo.pipeline.checkpoint"] >= {"hylo.config", "hylo.solvers"}  # the graph is read
    assert graph["hylo.preconditioner"] >= {"hylo.pipeline.planner", "hylo.pipeline.guard", "hylo.memory"}
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph) or [])


def test_every_import_of_the_scripts_and_the_analysis_without_a_cycle() -> None:
    scripts = scripts_graph()
    assert "hylo_scripts.models.registry" in scripts["hylo_scripts.training.tasks"]  # the graph is read
    assert "hylo_scripts.training.train" in scripts["scripts/train.py"]
    assert find_cycle(scripts) is None, " → ".join(find_cycle(scripts) or [])
    analysis = analysis_graph()
    assert "hylo_analysis.runs" in analysis["hylo_analysis.cli"]
    assert find_cycle(analysis) is None, " → ".join(find_cycle(analysis) or [])


def test_the_library_imports_neither_the_scripts_nor_the_analysis() -> None:
    assert foreign_imports(MODULES, {"hylo_scripts", "hylo_analysis"}) == {}
    assert foreign_imports(modules_of(ANALYSIS), {"hylo", "hylo_scripts"}) == {}
    assert foreign_imports({"probe": SCRIPT_PACKAGE / "training" / "loop.py"}, {"hylo"}) != {}  # the check sees


def test_hylo_packages_import_each_other_without_a_cycle() -> None:
    packages = package_graph(hylo_graph())
    assert find_cycle(packages) is None, " → ".join(find_cycle(packages) or [])


def unplaced(graph: dict[str, set[str]], levels: tuple[tuple[str, tuple[str, ...]], ...]) -> list[str]:
    """The modules of ``graph`` no entry of ``levels`` places (or more than one does)."""
    missing = []
    for name in graph:
        try:
            level_of(name, levels)
        except ValueError:
            missing.append(name)
    return missing


def upward_lines(graph: dict[str, set[str]], levels: tuple[tuple[str, tuple[str, ...]], ...]) -> list[str]:
    """:func:`upward_imports`, each as ``module (its level) → target (its level)``."""
    names = [name for name, _ in levels]
    return [
        f"{module} ({names[level_of(module, levels)]}) → {target} ({names[level_of(target, levels)]})"
        for module, target in upward_imports(graph, levels)
    ]


def test_every_hylo_module_is_in_one_level() -> None:
    assert unplaced(hylo_graph(), LEVELS) == [], "add each to one entry of LEVELS"


def test_no_hylo_module_imports_from_a_higher_level() -> None:
    assert upward_lines(hylo_graph(), LEVELS) == []


def test_the_solver_families_import_nothing_of_the_distributed_package() -> None:
    graph = hylo_graph()
    offenders = {
        module: sorted(t for t in targets if t.startswith("hylo.distributed"))
        for module, targets in graph.items()
        if module.startswith("hylo.solvers")
    }
    assert {module: found for module, found in offenders.items() if found} == {}, (
        "the math knows nothing of the distribution layer: what a family needs of it (hylo.payload) lies below both"
    )


#: What asks which distribution is in force (docs/design.md, "Placements"): the ``strategy`` option, whether a
#: parameter is sharded by FSDP2 (``is_sharded``), and which placement a step holds (its classes named).
DISTRIBUTION_ATTRIBUTES = {"strategy"}
DISTRIBUTION_NAMES = {"is_sharded", "fsdp2_sharded", "Owners", "Sharded"}
#: Who may ask: the placements, which decide once at construction; the option's own definition; the per-layer math
#: and transport, which read a parameter's layout (a DTensor's local rows) and move tensors, never a step's mode.
MAY_ASK_DISTRIBUTION = ("hylo.pipeline.placement", "hylo.config", "hylo.sections", "hylo.layers", "hylo.distributed")


def distribution_questions(source: str) -> list[str]:
    """Each place ``source`` asks which distribution is in force: a ``.strategy`` read, a name of
    :data:`DISTRIBUTION_NAMES` used or imported."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in DISTRIBUTION_ATTRIBUTES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in DISTRIBUTION_NAMES:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in DISTRIBUTION_NAMES:
            found.append(f"import {node.name}")
    return found


def test_the_distribution_check_sees_every_kind_of_question() -> None:
    source = "from hylo.layers.sharded import is_sharded\nif config.distributed.strategy == 'gradient': pass\n"
    source += "x = isinstance(p, Sharded)\n"
    assert distribution_questions(source) == ["import is_sharded", "line 2: .strategy", "line 3: Sharded"]


def test_no_module_outside_the_placements_asks_about_distribution() -> None:
    """A placement is chosen once at construction and owns every decision that depends on the distribution: the
    norms, the sharing after a solve, the rejection vote, which remote states are applied, the checkpoint's scope
    (docs/design.md, "Placements"). How many ranks there are is the communicator's (one rank skips a collective)."""
    offenders = {
        module: found
        for module, path in MODULES.items()
        if not module.startswith(MAY_ASK_DISTRIBUTION)
        and (found := distribution_questions(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}


#: The families of hylo/solvers/bundled/: each module's family, registered through the public register_family.
BUNDLED = ROOT / "solvers" / "bundled"
#: What names the bundled kfac_adam family (its solver, its classes, its modules).
KFAC_ADAM_NAMES = re.compile(r"kfac_adam|KFACAdam|adam_rule")


def test_a_bundled_family_is_named_nowhere_else_in_hylo() -> None:
    """docs/extending.md, "Solver families": kfac_adam registers itself through the public call, with its options
    section and statistic, and no line of hylo outside its own modules names it (the package loads its modules
    without naming them)."""
    from hylo.solvers import FAMILIES

    (family,) = [family for family in FAMILIES if family.name == "kfac_adam"]
    assert type(family).__module__ == "hylo.solvers.bundled.kfac_adam"
    assert family.section is not None and family.section.section_name == "kfac_adam"
    bundled_modules = {path for path in BUNDLED.glob("*.py") if path.name != "__init__.py"}
    assert {path.name for path in bundled_modules} == {"kfac_adam.py", "adam_rule.py", "staleness.py"}
    naming = [
        f"{path.relative_to(ROOT.parent)}:{number}"
        for path in sorted(ROOT.rglob("*.py"))
        if path not in bundled_modules
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if KFAC_ADAM_NAMES.search(line)
    ]
    assert naming == []


def test_no_scripts_module_imports_from_a_higher_level() -> None:
    graph = {name: targets for name, targets in scripts_graph().items() if name.startswith("hylo_scripts")}
    assert unplaced(graph, SCRIPT_LEVELS) == [], "add each to one entry of SCRIPT_LEVELS"
    assert upward_lines(graph, SCRIPT_LEVELS) == []
    assert upward_imports({"hylo_scripts.models.registry": {"hylo_scripts.training.loop"}}, SCRIPT_LEVELS)  # it sees


def script_subpackages() -> set[str]:
    """The subpackages of hylo_scripts (its folders with an ``__init__.py``)."""
    return {f"hylo_scripts.{path.parent.name}" for path in SCRIPT_PACKAGE.glob("*/__init__.py")}


def test_every_scripts_module_is_in_a_subpackage_of_a_level() -> None:
    """hylo_scripts holds no module of its own but its ``__init__``: each is in a subpackage, one job each, and
    every subpackage (no deeper one) is an entry of :data:`SCRIPT_LEVELS`."""
    modules = modules_of(SCRIPT_PACKAGE)
    assert [name for name in modules if name.count(".") != (1 if name in script_subpackages() else 2)] == [
        "hylo_scripts"
    ], "put each module in a subpackage of hylo_scripts"
    named = {name for _, names in SCRIPT_LEVELS for name in names}
    assert named == {"hylo_scripts", *script_subpackages()}, "name each subpackage in one level of SCRIPT_LEVELS"
    assert {"hylo_scripts.data", "hylo_scripts.training", "hylo_scripts.benchmarks"} <= script_subpackages()
