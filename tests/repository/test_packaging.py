"""The distribution: the wheel holds exactly hylo, hylo_scripts and hylo_analysis, the licence and the metadata."""

from __future__ import annotations

import email.parser
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a copy of this checkout (a copy: setuptools' build/ of an earlier layout would leak in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run([*command, "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = (tmp / "dist").glob("hylo-*.whl")
    return built


def test_the_wheel_installs_the_three_namespaced_packages_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"hylo", "hylo_scripts", "hylo_analysis"}  # no scripts, analysis, tests, examples
    assert "hylo/py.typed" in names and "hylo_analysis/__main__.py" in names
    assert "hylo_scripts/engine.py" in names and "hylo_scripts/train.py" in names
    assert not [name for name in names if name.endswith(".ipynb") or name.endswith(".sh")]


def test_the_wheel_carries_the_licence_and_the_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (info,) = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
        licences = [name for name in names if name.startswith(f"{info}/") and name.endswith("LICENSE")]
        assert licences, f"no LICENSE in {info}"
        assert "Copyright (c) 2026 hylo contributors" in archive.read(licences[0]).decode()
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
    assert metadata["License"] == "MIT" or metadata["License-Expression"] == "MIT"
    assert metadata["Author"] == "hylo contributors"
    assert metadata.get_all("Project-URL") == ["HyLo research code, https://github.com/hylo-dso/hylo"]
    classifiers = metadata.get_all("Classifier")
    for classifier in (
        "Typing :: Typed",
        "Programming Language :: Python :: 3.12",
        "Operating System :: OS Independent",
    ):
        assert classifier in classifiers
    assert metadata["Requires-Python"] == ">=3.10" and metadata["Description-Content-Type"] == "text/markdown"


def test_the_installed_names_are_namespaced(wheel: Path, tmp_path: Path) -> None:
    """From the unpacked wheel, hylo_scripts and hylo_analysis import, and nothing answers to scripts or analysis."""
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
