"""The distributions: the root's wheel holds exactly hylo, scripts/'s hylo_scripts and analysis/'s hylo_analysis,
each with the licence and the metadata; `pip install .` installs hylo alone; the three versions agree."""

from __future__ import annotations

import email.message
import email.parser
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What a build must not copy from the checkout (the repository's own state, earlier builds).
NOT_SOURCES = (".git", "build", "dist", "*.egg-info", ".venv", "venv", "__pycache__", ".*_cache", ".hypothesis")
#: Each distribution: the folder it builds from and the one top-level package its wheel holds.
DISTRIBUTIONS = {
    "hylo": (".", "hylo"),
    "hylo-scripts": ("scripts", "hylo_scripts"),
    "hylo-analysis": ("analysis", "hylo_analysis"),
}
#: What pip builds offline: no index, the environment's setuptools (the `test` extra's), no dependencies.
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
OFFLINE = ["--no-deps", "--no-build-isolation", "--no-index"]


def hylo_version() -> str:
    spec = importlib.util.spec_from_file_location("_hylo_version", ROOT / "hylo" / "version.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.__version__)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout (a copy: setuptools' build/ of an earlier layout would leak in); links kept as links."""
    source = tmp_path_factory.mktemp("checkout") / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    return source


@pytest.fixture(scope="module")
def wheels(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three wheels, each built from its own folder (``pip wheel .``, ``./scripts``, ``./analysis``)."""
    dist = tmp_path_factory.mktemp("dist")
    folders = [str(source / folder) for folder, _ in DISTRIBUTIONS.values()]
    done = subprocess.run(
        [*PIP, "wheel", *OFFLINE, "-w", str(dist), *folders], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    built = {}
    for name in DISTRIBUTIONS:
        (built[name],) = dist.glob(f"{name.replace('-', '_')}-*.whl")
    return built


def tops(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name.split("/")[0] for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (info,) = {name.split("/")[0] for name in archive.namelist() if name.split("/")[0].endswith(".dist-info")}
        return email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())


def test_each_wheel_holds_exactly_its_package(wheels: dict[str, Path]) -> None:
    for name, (_, package) in DISTRIBUTIONS.items():
        assert tops(wheels[name]) == {package}, name  # no scripts, analysis, tests, examples, nor each other
    with zipfile.ZipFile(wheels["hylo"]) as archive:
        assert "hylo/py.typed" in archive.namelist()
    with zipfile.ZipFile(wheels["hylo-scripts"]) as archive:
        modules = {
            path.relative_to(ROOT / "scripts").as_posix() for path in (ROOT / "scripts/hylo_scripts").rglob("*.py")
        }
        assert "hylo_scripts/training/engine.py" in modules  # every module of every subpackage
        assert modules <= set(archive.namelist())
    with zipfile.ZipFile(wheels["hylo-analysis"]) as archive:
        assert "hylo_analysis/__main__.py" in archive.namelist()
    for wheel in wheels.values():
        with zipfile.ZipFile(wheel) as archive:
            assert not [name for name in archive.namelist() if name.endswith((".ipynb", ".sh"))], wheel.name


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_each_wheel_carries_the_licence(wheels: dict[str, Path], name: str) -> None:
    with zipfile.ZipFile(wheels[name]) as archive:
        names = archive.namelist()
        licences = [name for name in names if ".dist-info/" in name and name.endswith("LICENSE")]
        assert licences, f"no LICENSE in {wheels[name].name}"
        assert "Copyright (c) 2026 hylo contributors" in archive.read(licences[0]).decode()
    found = metadata(wheels[name])
    assert found["License"] == "MIT" or found["License-Expression"] == "MIT"
    assert found["Author"] == "hylo contributors"
    assert found.get_all("Project-URL") == ["HyLo research code, https://github.com/hylo-dso/hylo"]
    assert found["Requires-Python"] == ">=3.10"


def test_the_library_wheel_carries_the_metadata(wheels: dict[str, Path]) -> None:
    found = metadata(wheels["hylo"])
    classifiers = found.get_all("Classifier")
    for classifier in (
        "Typing :: Typed",
        "Programming Language :: Python :: 3.12",
        "Operating System :: OS Independent",
    ):
        assert classifier in classifiers
    assert found["Description-Content-Type"] == "text/markdown"
    assert found.get_all("Provides-Extra") == ["test"]  # the scripts' extras live in scripts/pyproject.toml
    assert not [need for need in found.get_all("Requires-Dist") if need.startswith("hylo")]


def test_the_versions_agree_and_the_scripts_pin_this_hylo(wheels: dict[str, Path]) -> None:
    """hylo-scripts and hylo-analysis state hylo/version.py's version; hylo-scripts needs exactly that hylo."""
    version = hylo_version()
    assert {name: metadata(wheel)["Version"] for name, wheel in wheels.items()} == dict.fromkeys(DISTRIBUTIONS, version)
    scripts = metadata(wheels["hylo-scripts"])
    needs = scripts.get_all("Requires-Dist")
    assert f"hylo=={version}" in needs
    assert {"numpy", "mlxtend", "pillow", "scikit-learn", "tqdm", "torchinfo"} <= set(needs)
    assert sorted(scripts.get_all("Provides-Extra")) == ["peers", "vision"]
    analysis = metadata(wheels["hylo-analysis"]).get_all("Requires-Dist")
    assert {"matplotlib", "pandas"} <= set(analysis)
    assert not [need for need in analysis if need.startswith("hylo")]  # it imports neither hylo nor hylo_scripts


def test_pip_install_dot_installs_hylo_alone(source: Path, tmp_path: Path) -> None:
    """`pip install .` into an empty folder (offline): hylo and its dist-info, nothing else, and RECORD agrees."""
    target = tmp_path / "site"
    done = subprocess.run(
        [*PIP, "install", *OFFLINE, "--target", str(target), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    version = hylo_version()
    assert {path.name for path in target.iterdir()} == {"hylo", f"hylo-{version}.dist-info"}
    record = (target / f"hylo-{version}.dist-info" / "RECORD").read_text().splitlines()
    assert {line.split("/")[0] for line in record} == {"hylo", f"hylo-{version}.dist-info"}
    spec = importlib.machinery.PathFinder.find_spec
    assert spec("hylo", [str(target)]) is not None
    assert spec("hylo_scripts", [str(target)]) is None and spec("hylo_analysis", [str(target)]) is None


def test_the_installed_names_are_namespaced(wheels: dict[str, Path], tmp_path: Path) -> None:
    """From the unpacked wheels, hylo_scripts and hylo_analysis import, and nothing answers to scripts or analysis."""
    for wheel in wheels.values():
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tmp_path / "site")
    code = (
        "import importlib.util, hylo_scripts, hylo_analysis\n"
        "print(hylo_scripts.__file__, hylo_analysis.__file__)\n"
        "print(importlib.util.find_spec('scripts'), importlib.util.find_spec('analysis'))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    files, specs = done.stdout.splitlines()
    assert all(path.startswith(str(tmp_path / "site")) for path in files.split())
    assert specs == "None None"
