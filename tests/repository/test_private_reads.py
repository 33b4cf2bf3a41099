"""The tests read the library through its public API (docs/contributing.md, "Tests").

A private read is, in any file of ``tests/`` (every folder and the kit), read with ``ast``:

- an attribute access ``obj._name`` (load, store or delete) where ``obj`` is not ``self`` or ``cls`` and ``_name``
  is not a dunder;
- an import of a private name, ``from x import _name``;
- a private name given as a string to ``getattr``/``setattr``/``hasattr``/``delattr`` or to a ``setattr``/
  ``delattr`` method (``monkeypatch.setattr(obj, "_name", …)``): the same read or write by another spelling.

Every one is on :data:`ALLOWED` with its count and reason, and nothing else is: a new private read fails the test,
and one removed must leave the list too. The list holds at most :data:`LIMIT` reads: what the public view
(``layer_info()``, ``progress()``, ``state_dict()``, ``summary()``) does not show and should not — fault
injection, a cache's identity, another library's internals.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 20
BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}
#: (file, private name) → (reads, why the test reads it).
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("tests/kit/internals.py", "_forward_pre_hooks"): (1, "torch lists a module's hooks nowhere public"),
    ("tests/kit/internals.py", "_forward_hooks"): (1, "torch lists a module's hooks nowhere public"),
    ("tests/kit/internals.py", "_backward_pre_hooks"): (1, "torch lists a module's hooks nowhere public"),
    ("tests/kit/internals.py", "_backward_hooks"): (1, "torch lists a module's hooks nowhere public"),
    ("tests/kit/internals.py", "_actions"): (1, "argparse lists a parser's actions nowhere public"),
    ("tests/kit/internals.py", "_placement"): (1, "white-box: the apply plan's identity and groups, an internal cache"),
    ("tests/kit/internals.py", "_layers"): (1, "white-box: held states replaced on purpose, their layout checked"),
    ("tests/kit/internals.py", "_LAYER_TYPES"): (2, "the layer-type registry restored after a test (read, then set)"),
    ("tests/kit/devices.py", "_device_constructors"): (1, "torch's list of factory functions, for the device mode"),
    ("tests/library/test_attention.py", "_get_current_function_mode_stack"): (1, "torch's active function modes"),
    ("tests/library/test_compile.py", "_stance"): (
        1,
        "torch.compile's current stance, which hylo holds and gives back",
    ),
    ("tests/library/test_compile.py", "_EagerStance"): (1, "white-box: the stance holder's reentrancy, on its own"),
    ("tests/library/test_reduce.py", "_local_scalar_dense"): (1, "the aten operator every host read of a value runs"),
    ("tests/library/test_accelerate.py", "_reset_state"): (1, "Accelerate's singletons reset between tests"),
    ("tests/application/test_bench_peers.py", "_zeropower_via_newtonschulz"): (
        2,
        "torch Muon's iteration, which Float32Muon swaps for a step and gives back",
    ),
    ("tests/application/test_bench_peers.py", "_adjust_lr"): (1, "torch Muon's lr adjustment in the expected step"),
    ("tests/repository/test_harness.py", "_exit"): (1, "os._exit: a rank dying without cleanup"),
}


def private_reads(source: str) -> Counter[str]:
    """Private name → how often ``source`` reads it (see the module docstring)."""
    found: Counter[str] = Counter()

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found[node.attr] += 1
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names if private(alias.name))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            by_name = isinstance(func, ast.Name) and func.id in BY_NAME
            by_method = isinstance(func, ast.Attribute) and func.attr in ("setattr", "delattr")
            name = node.args[1]
            if (by_name or by_method) and isinstance(name, ast.Constant) and isinstance(name.value, str):
                if private(name.value):
                    found[name.value] += 1
    return found


def reads_in_tests() -> dict[tuple[str, str], int]:
    """(file, private name) → reads, over every Python file of ``tests/``."""
    reads: dict[tuple[str, str], int] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        file = path.relative_to(ROOT).as_posix()
        for name, count in private_reads(path.read_text()).items():
            reads[(file, name)] = count
    return reads


def test_the_counter_sees_every_kind_of_private_read() -> None:
    source = """
from hylo.state import RegisteredLayer, _hidden
import hylo

class Held:
    def __init__(self) -> None:
        self._mine = 1          # its own attribute: not counted
        cls = type(self)
        cls._shared = 2         # nor through cls

def read(pre, monkeypatch):
    layers = pre._layers                      # 1
    pre._planner.step = 3                     # 2 (a write counts too)
    name = pre.__class__.__name__             # a dunder: not counted
    state = getattr(pre, "_policy")           # 3 (by name)
    monkeypatch.setattr(hylo, "_REGISTRY", {})  # 4 (by name)
    monkeypatch.setattr(hylo, "public", {})   # public: not counted
    return [layer.state for layer in pre._layers]  # 5
"""
    assert private_reads(source) == Counter({"_hidden": 1, "_layers": 2, "_planner": 1, "_policy": 1, "_REGISTRY": 1})
    assert private_reads("x = self._a + obj.b + obj.__dict__\n") == Counter()


def test_private_reads_are_the_allow_listed_ones() -> None:
    found = reads_in_tests()
    allowed = {key: count for key, (count, _) in ALLOWED.items()}
    new = {key: count for key, count in found.items() if allowed.get(key) != count}
    gone = {key: count for key, count in allowed.items() if found.get(key) != count}
    assert not new and not gone, (
        f"private reads not on the allow-list (or more than it says): {new}; "
        f"allow-listed reads no test makes (or fewer): {gone}: read the public view instead "
        "(layer_info(), progress(), state_dict(), summary()), or update tests/repository/test_private_reads.py"
    )


def test_the_allow_list_is_short_and_explained() -> None:
    assert sum(count for count, _ in ALLOWED.values()) <= LIMIT
    assert all(count > 0 and reason.strip() for count, reason in ALLOWED.values())
